//! Arbitrary frames from several peers fed to the server's per-connection
//! request handler (`handle_frame`) without a network: each frame gets a typed
//! answer or a close, never a panic; every request is answered under its own
//! id; and the core's invariants (the groups' among them) hold after every
//! step. Group requests come with small caps, so that the caps are reached.
#![no_main]

use arbitrary::Arbitrary;
use greendot_core::Millis;
use greendot_proto::codec::encode_frame;
use greendot_proto::{
    self as proto, Hello, Kind, Request, RequestFrame, ServerFrame, Status, Tier,
};
use greendot_server::testing::{handle_frame, ConnState, Hub};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use greendot_server::{HubLimits, RateLimit};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use std::time::Duration;

const NAMES: [&str; 4] = ["ann", "bob", "cy", "dee"];

#[derive(Arbitrary, Debug)]
struct Case {
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
struct Step {
    conn: u8,
    dt: u8,
    what: What,
}

#[derive(Arbitrary, Debug)]
enum What {
    /// A hello with a valid token (or a bad one).
    Hello {
        user: u8,
        device: u8,
        kind: u8,
        watch_all: bool,
        service: bool,
        forged: bool,
        version: u8,
        resume: Option<u64>,
        foreground: bool,
    },
    Request {
        id: u64,
        request: Req,
    },
    Raw(Vec<u8>),
    /// The connection is gone: logout or disconnect.
    Closed {
        logout: bool,
    },
    Tick,
}

#[derive(Arbitrary, Debug)]
enum Req {
    Ping,
    Subscribe {
        targets: Vec<u8>,
        realtime: bool,
        junk: Option<String>,
    },
    Unsubscribe(u8),
    Query(Vec<u8>),
    SetStatus(u8, Option<String>),
    SetInvisible(bool),
    SetForeground(bool),
    Route(u8),
    Logout,
    SetGroup {
        group: u8,
        members: Vec<u8>,
        admins: Vec<u8>,
        junk: Option<String>,
    },
    RemoveGroup(u8),
    GroupSubscribe(u8),
    GroupUnsubscribe(u8),
    GroupPage {
        group: u8,
        after: Option<(bool, u64)>,
        limit: u32,
    },
    GroupWatchPage {
        group: u8,
        after: Option<(bool, u64)>,
        limit: u32,
    },
    GroupRenewWatch {
        group: u8,
        after: Option<(bool, u64)>,
    },
    GroupUnwatchPage {
        group: u8,
        after: Option<(bool, u64)>,
    },
    ChangeGroup {
        group: u8,
        add: Vec<u8>,
        remove: Vec<u8>,
        add_admins: Vec<u8>,
        remove_admins: Vec<u8>,
        junk: Option<String>,
        expect_version: Option<u8>,
    },
}

fn cursor(after: Option<(bool, u64)>) -> Option<proto::GroupCursor> {
    after.map(|(online, after)| proto::GroupCursor { online, after })
}

fn name(i: u8) -> String {
    NAMES[usize::from(i) % NAMES.len()].to_string()
}

fn payload<T: serde::Serialize>(value: &T) -> Vec<u8> {
    let frame = encode_frame(value).expect("a request encodes");
    frame[4..].to_vec()
}

fn request(r: Req) -> Request {
    match r {
        Req::Ping => Request::Ping,
        Req::Subscribe {
            targets,
            realtime,
            junk,
        } => Request::Subscribe {
            targets: targets.into_iter().map(name).chain(junk).collect(),
            tier: if realtime {
                Tier::Realtime
            } else {
                Tier::Batched
            },
        },
        Req::Unsubscribe(t) => Request::Unsubscribe { target: name(t) },
        Req::Query(ts) => Request::Query {
            targets: ts.into_iter().map(name).collect(),
        },
        Req::SetStatus(s, message) => Request::SetStatus {
            status: [
                Status::Available,
                Status::Away,
                Status::Busy,
                Status::DoNotDisturb,
            ][usize::from(s % 4)],
            message,
        },
        Req::SetInvisible(b) => Request::SetInvisible { invisible: b },
        Req::SetForeground(b) => Request::SetForeground { foreground: b },
        Req::Route(u) => Request::Route { user: name(u) },
        Req::Logout => Request::Logout,
        // Group ids 0..4 against a cap of 3 groups: the cap is reached.
        Req::SetGroup {
            group,
            members,
            admins,
            junk,
        } => Request::SetGroup {
            group: u64::from(group % 4),
            members: members.into_iter().map(name).chain(junk).collect(),
            admins: admins.into_iter().map(name).collect(),
        },
        Req::RemoveGroup(g) => Request::RemoveGroup {
            group: u64::from(g % 4),
        },
        Req::GroupSubscribe(g) => Request::GroupSubscribe {
            group: u64::from(g % 4),
        },
        Req::GroupUnsubscribe(g) => Request::GroupUnsubscribe {
            group: u64::from(g % 4),
        },
        Req::GroupPage {
            group,
            after,
            limit,
        } => Request::GroupPage {
            group: u64::from(group % 4),
            after: cursor(after),
            limit,
        },
        Req::GroupWatchPage {
            group,
            after,
            limit,
        } => Request::GroupWatchPage {
            group: u64::from(group % 4),
            after: cursor(after),
            limit,
        },
        Req::GroupRenewWatch { group, after } => Request::GroupRenewWatch {
            group: u64::from(group % 4),
            after: cursor(after),
        },
        Req::GroupUnwatchPage { group, after } => Request::GroupUnwatchPage {
            group: u64::from(group % 4),
            after: cursor(after),
        },
        // Small expected versions, so that some match.
        Req::ChangeGroup {
            group,
            add,
            remove,
            add_admins,
            remove_admins,
            junk,
            expect_version,
        } => Request::ChangeGroup {
            group: u64::from(group % 4),
            add: add.into_iter().map(name).chain(junk).collect(),
            remove: remove.into_iter().map(name).collect(),
            add_admins: add_admins.into_iter().map(name).collect(),
            remove_admins: remove_admins.into_iter().map(name).collect(),
            expect_version: expect_version.map(|v| u64::from(v % 8)),
        },
    }
}

fuzz_target!(|case: Case| {
    let keys = Arc::new(TokenKeys::new(b"fuzz secret", Duration::ZERO));
    let forger = TokenKeys::new(b"another secret", Duration::ZERO);
    // Small group caps, so that the fuzzer reaches them.
    let config = greendot_core::Config {
        debounce: Millis(50),
        batch_interval: Millis(200),
        group_interval: Millis(300),
        max_group_members: 3,
        max_group_admins: 1,
        max_group_subscriptions_per_session: 2,
        max_groups: 3,
        group_page_size: 2,
        max_watched_pages: 2,
        max_watched_entries: 3,
        group_page_burst: 3,
        ..Default::default()
    };
    let mut limits = HubLimits::default();
    limits.max_names = 16;
    limits.max_targets = 4;
    limits.max_watch = 8;
    let mut hub = Hub::new(config, limits, 0).expect("valid config");
    let rate = RateLimit::new(100, 20);
    let mut conns: Vec<ConnState> = (0..4).map(|_| ConnState::new(keys.clone(), rate)).collect();
    // A connection that has seen no frame yet: its first frame must be a hello.
    let mut fresh = [true; 4];
    let mut now = 0u64;
    for step in case.steps {
        now += u64::from(step.dt);
        let at = Millis(now);
        let c = usize::from(step.conn) % conns.len();
        match step.what {
            What::Hello {
                user,
                device,
                kind,
                watch_all,
                service,
                forged,
                version,
                resume,
                foreground,
            } => {
                let kind =
                    [Kind::Mobile, Kind::Desktop, Kind::Web, Kind::Other][usize::from(kind % 4)];
                let watch = if watch_all {
                    WatchClaim::all()
                } else {
                    WatchClaim::only([name(user.wrapping_add(1))])
                };
                let mut claims = Claims::new(
                    name(user),
                    name(device),
                    kind,
                    watch,
                    Duration::from_secs(600),
                );
                if service {
                    claims = claims.service();
                }
                let signer = if forged { &forger } else { &*keys };
                let token = signer.mint(&claims).expect("claims encode");
                let version = if version < 250 {
                    proto::VERSION
                } else {
                    u32::from(version)
                };
                let hello = Hello {
                    version,
                    token,
                    resume,
                    foreground,
                };
                let handled = handle_frame(&mut hub, &mut conns[c], at, &payload(&hello));
                if std::mem::take(&mut fresh[c]) && (forged || version != proto::VERSION) {
                    assert!(
                        handled.close.is_some(),
                        "a bad hello must close: {handled:?}"
                    );
                }
            }
            What::Request { id, request: r } => {
                let frame = RequestFrame {
                    id,
                    request: request(r),
                };
                let handled = handle_frame(&mut hub, &mut conns[c], at, &payload(&frame));
                fresh[c] = false;
                if let Some(ServerFrame::Reply { id: answered, .. }) = &handled.reply {
                    assert_eq!(*answered, id, "a reply carries its request's id");
                }
            }
            What::Raw(bytes) => {
                let _ = handle_frame(&mut hub, &mut conns[c], at, &bytes);
                fresh[c] = false;
            }
            What::Closed { logout } => {
                if let Some(session) = conns[c].session() {
                    hub.closed(at, session, logout, at);
                }
                conns[c] = ConnState::new(keys.clone(), rate);
                fresh[c] = true;
            }
            What::Tick => hub.handle_timeout(at),
        }
        while hub.poll_output().is_some() {}
        if let Err(why) = hub.core().check_invariants() {
            panic!("{why}");
        }
    }
});
