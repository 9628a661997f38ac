//! Users who hold nothing are forgotten: after 100,000 distinct users came
//! and went, the server holds what it held before, names, records and heap.

use greendot_proto::{self as proto, encode_frame, Hello, Kind, Request, RequestFrame};
use greendot_server::testing::{handle_frame, ConnState, Hub};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use greendot_server::{HubLimits, RateLimit};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Counts the bytes allocated and not yet freed, in this test binary.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A frame's payload, without its length prefix.
fn payload(frame: Vec<u8>) -> Vec<u8> {
    frame[4..].to_vec()
}

/// One user connects (a device of their own name), watches a friend, and
/// logs out at once: nothing was ever published of them.
fn come_and_go(hub: &mut Hub, keys: &Arc<TokenKeys>, i: usize, now: greendot_core::Millis) {
    let claims = Claims::new(
        format!("user-{i}"),
        format!("device-{i}"),
        Kind::Mobile,
        WatchClaim::only(["friend"]),
        Duration::from_secs(600),
    );
    let hello = Hello {
        version: proto::VERSION,
        token: keys.mint(&claims).unwrap(),
        resume: None,
        foreground: true,
    };
    let mut conn = ConnState::new(keys.clone(), RateLimit::default());
    let welcome = handle_frame(hub, &mut conn, now, &payload(encode_frame(&hello).unwrap()));
    assert!(welcome.welcomed.is_some(), "{welcome:?}");
    let subscribe = RequestFrame {
        id: 1,
        request: Request::Subscribe {
            targets: vec!["friend".into()],
            tier: proto::Tier::Realtime,
        },
    };
    handle_frame(
        hub,
        &mut conn,
        now,
        &payload(encode_frame(&subscribe).unwrap()),
    );
    let logout = RequestFrame {
        id: 2,
        request: Request::Logout,
    };
    let bye = handle_frame(
        hub,
        &mut conn,
        now,
        &payload(encode_frame(&logout).unwrap()),
    );
    assert_eq!(bye.close, Some(proto::CloseCode::Logout));
    while hub.poll_output().is_some() {}
    hub.take_touched();
    hub.release_idle();
}

/// The hub as the driver runs it, without a network (100,000 QUIC
/// handshakes would take a minute here): names, core records and heap all
/// come back to where they were.
#[test]
fn hundred_thousand_users_come_and_go_and_leave_nothing() {
    let keys = Arc::new(TokenKeys::new(b"release test secret", Duration::ZERO));
    let mut hub = Hub::new(greendot_core::Config::default(), HubLimits::default(), 0).unwrap();
    // A server is not empty: 5,000 users stay online throughout (the start
    // the heap is compared with includes them, as a real server's would).
    for i in 0..5_000 {
        let claims = Claims::new(
            format!("resident-{i}"),
            "desk",
            Kind::Desktop,
            WatchClaim::all(),
            Duration::from_secs(600),
        );
        hub.hello(greendot_core::Millis(1), &claims, None, true)
            .unwrap();
    }
    // A driver sweeps now and then; debounce windows end meanwhile.
    let mut clock = 0u64;
    let mut run = |hub: &mut Hub, users: std::ops::Range<usize>| {
        for i in users {
            clock += 10;
            come_and_go(hub, &keys, i, greendot_core::Millis(clock));
            // As the driver does at each lease renewal (budget: its
            // SWEEP_BUDGET).
            if i % 1_000 == 0 {
                hub.sweep(4096);
            }
        }
        // Past every debounce window, then one full sweep.
        clock += 60_000;
        hub.handle_timeout(greendot_core::Millis(clock));
        hub.sweep(usize::MAX);
    };
    // Warm-up: rounds of 10,000 users until the heap after a round is what
    // it was after the previous one (tables and buffers at working size;
    // hash tables grow in steps, so a few thousand users are not enough).
    let mut next = 0;
    let mut before = -1;
    for _ in 0..10 {
        run(&mut hub, next..next + 10_000);
        next += 10_000;
        let now = LIVE.load(Ordering::Relaxed);
        if now == before {
            break;
        }
        before = now;
    }
    let names = hub.names();
    let users = hub.core().user_count();
    let heap = LIVE.load(Ordering::Relaxed);
    run(&mut hub, next..next + 100_000);
    assert_eq!(hub.names(), names);
    assert_eq!(hub.core().user_count(), users);
    assert_eq!(hub.user_names(), 5_000, "only the residents are held");
    let grown = LIVE.load(Ordering::Relaxed) - heap;
    eprintln!("live heap {heap} bytes after the warm-up, {grown:+} after 100,000 more users");
    assert!(
        grown * 10 <= heap,
        "live heap grew by {grown} bytes from {heap}"
    );
}
