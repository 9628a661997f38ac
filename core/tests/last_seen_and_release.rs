//! Last seen as when a device was last heard from, releasing users the
//! core no longer needs, and its counters (DESIGN.md's semantics, as in
//! semantics.rs).

mod semantics_support;

use greendot_core::*;
use semantics_support::*;

// ----- last seen is when a device was last heard from ------------------------

/// What Bob was last pushed about Alice by `ms`.
fn last_push(h: &mut Harness, bob: SessionId, ms: u64) -> Presence {
    let pushes = pushes_to(&h.run_until(ms), bob);
    pushes.last().expect("a push").2.clone()
}

#[test]
fn a_dead_phone_reads_its_last_packet_not_the_end_of_grace() {
    let mut h = Harness::new(); // mobile: 30 s grace
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(10_000);
    h.core.handle_activity(Millis(10_000), phone).unwrap();
    // The phone dies at 10 s; the transport notices at 25 s (idle timeout).
    h.at(25_000);
    h.core
        .handle_disconnect(Millis(25_000), phone, Millis(10_000))
        .unwrap();
    h.check();
    let out = h.run_until(55_000);
    assert_eq!(ended(&out), vec![(phone, EndReason::GraceExpired)]);
    let shown = last_push(&mut h, bob, 56_000);
    assert!(!shown.online);
    assert_eq!(shown.last_seen, Some(Millis(10_000)), "not 25 s, not 55 s");
    assert_eq!(h.core.saved(ALICE).last_seen, Some(Millis(10_000)));
}

#[test]
fn a_last_heard_is_clamped_between_the_last_activity_and_now() {
    for (heard, want) in [(0, 2000), (3000, 3000), (9000, 5000)] {
        let mut h = Harness::new();
        let bob = bob_watches_alice(&mut h, Tier::Realtime);
        let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
        h.run_until(2000);
        h.core.handle_activity(Millis(2000), phone).unwrap();
        h.at(5000);
        h.core
            .handle_disconnect(Millis(5000), phone, Millis(heard))
            .unwrap();
        h.check();
        let shown = last_push(&mut h, bob, 40_000);
        assert_eq!(shown.last_seen, Some(Millis(want)), "last heard {heard}");
    }
}

#[test]
fn every_device_counts_the_latest_heard_wins() {
    // Laptop logs out at 1 s; the phone is heard until 4 s, lost, and its
    // grace expires: last seen is the phone's 4 s.
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let laptop = h.connect(ALICE, LAPTOP, DeviceKind::Desktop);
    h.run_until(1000);
    h.core.handle_logout(Millis(1000), laptop).unwrap();
    h.run_until(4000);
    h.core.handle_activity(Millis(4000), phone).unwrap();
    h.at(6000);
    h.core
        .handle_disconnect(Millis(6000), phone, Millis(4000))
        .unwrap();
    let shown = last_push(&mut h, bob, 40_000);
    assert!(!shown.online);
    assert_eq!(shown.last_seen, Some(Millis(4000)));

    // The other way round: the phone is lost (last heard 2 s) and lingers
    // while the laptop logs out at 3 s; the laptop's logout is the latest.
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let laptop = h.connect(ALICE, LAPTOP, DeviceKind::Desktop);
    h.run_until(2000);
    h.core.handle_activity(Millis(2000), phone).unwrap();
    h.core
        .handle_disconnect(Millis(2000), phone, Millis(2000))
        .unwrap();
    h.run_until(3000);
    h.core.handle_logout(Millis(3000), laptop).unwrap();
    assert_eq!(ended(&h.drain()), vec![(laptop, EndReason::LoggedOut)]);
    let out = h.run_until(40_000);
    assert_eq!(ended(&out), vec![(phone, EndReason::GraceExpired)]);
    let pushes = pushes_to(&out, bob);
    let last = &pushes.last().expect("offline published").2;
    assert!(!last.online, "offline once the phone's grace ran out");
    assert_eq!(last.last_seen, Some(Millis(3000)));
}

#[test]
fn going_invisible_freezes_last_seen_at_that_moment() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    // Last activity at 0, invisible at 1 s: heard at 1 s.
    h.core
        .handle_set_invisible(Millis(1000), phone, true)
        .unwrap();
    let shown = pushes_to(&h.drain(), bob)[0].2.clone();
    assert_eq!(shown.last_seen, Some(Millis(1000)));
    // Heard from later while invisible, then lost: nothing moves.
    h.run_until(5000);
    h.core.handle_activity(Millis(5000), phone).unwrap();
    h.core
        .handle_disconnect(Millis(6000), phone, Millis(5000))
        .unwrap();
    assert!(pushes_to(&h.run_until(60_000), bob).is_empty());
    assert_eq!(h.core.presence(ALICE).last_seen, Some(Millis(1000)));
    assert_eq!(h.core.saved(ALICE).last_seen, Some(Millis(1000)));
}

#[test]
fn a_visit_that_becomes_visible_reads_from_that_moment_on() {
    // Connected invisible at 0 (last activity 0), visible at 2 s, reaped:
    // last seen is 2 s, when others started seeing the user, never earlier.
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Mobile).heartbeat_timeout = Millis(10_000);
    let mut h = Harness::with(config);
    h.core
        .restore(
            ALICE,
            Saved {
                invisible: true,
                ..Saved::default()
            },
        )
        .unwrap();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(2000);
    h.core
        .handle_set_invisible(Millis(2000), phone, false)
        .unwrap();
    let out = h.run_until(20_000);
    assert_eq!(ended(&out), vec![(phone, EndReason::HeartbeatTimeout)]);
    let pushes = pushes_to(&out, bob);
    assert!(pushes[0].2.online);
    assert_eq!(pushes.last().unwrap().2.last_seen, Some(Millis(2000)));
}

// ----- releasing users ---------------------------------------------------------

#[test]
fn churned_users_are_released_and_their_slots_reused() {
    let mut h = Harness::new();
    let bob = h.connect(BOB, PHONE, DeviceKind::Desktop);
    let start = h.core.user_count();
    let debounce = h.core.config().debounce.0;
    const ROUND: u64 = 1_000;
    for round in 0..100u64 {
        let users: Vec<UserId> = (0..ROUND)
            .map(|i| UserId(1_000 + round * ROUND + i))
            .collect();
        for &user in &users {
            let s = h
                .core
                .handle_connect(
                    h.now(),
                    Connect {
                        user,
                        device: PHONE,
                        kind: DeviceKind::Web,
                        watch: Watch::All,
                        resume: None,
                        foreground: true,
                    },
                )
                .unwrap()
                .session;
            h.core.handle_logout(h.now(), s).unwrap();
        }
        // The flap's debounce window has to run out before a record is free.
        assert!(!h.core.is_releasable(users[0]));
        let next = h.now + debounce;
        h.run_until(next);
        for &user in &users {
            assert!(h.core.release(user), "{user:?}");
        }
        assert_eq!(h.core.user_count(), start);
        h.check();
    }
    assert!(
        h.core.user_slots() <= start + ROUND as usize,
        "{} slots for a peak of {} users",
        h.core.user_slots(),
        start + ROUND as usize
    );
    assert_eq!(h.core.counters().users_released, 100 * ROUND);
    assert!(h.core.route(BOB) == vec![bob]);
}

#[test]
fn a_user_with_anything_to_keep_is_not_released() {
    let mut h = Harness::new();
    assert!(!h.core.release(ALICE), "unknown");
    // A watcher holds a subscription to Alice.
    let bob = h.connect(BOB, PHONE, DeviceKind::Desktop);
    h.subscribe(bob, ALICE, Tier::Realtime);
    assert!(!h.core.release(ALICE), "watched");
    // Parked: Bob's connection is lost, the subscription waits for a resume.
    h.core.handle_disconnect(Millis(0), bob, Millis(0)).unwrap();
    assert!(
        !h.core.release(ALICE),
        "a lingering session's parked subscription still refers to Alice"
    );
    h.core.handle_logout(Millis(0), bob).unwrap();
    h.check();
    assert!(h.core.release(ALICE), "nothing left");
    h.check();

    // Online, or last seen (saved state) that a restart must keep.
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    assert!(!h.core.release(ALICE), "online");
    h.run_until(1000);
    h.core.handle_logout(Millis(1000), phone).unwrap();
    assert!(!h.core.release(ALICE), "debounce pending");
    h.run_until(2000);
    assert_eq!(h.core.saved(ALICE).last_seen, Some(Millis(1000)));
    assert!(!h.core.release(ALICE), "last seen is kept");
    // A chosen status is saved state too.
    h.core
        .restore(
            CAROL,
            Saved {
                status: Status::Busy,
                ..Saved::default()
            },
        )
        .unwrap();
    assert!(!h.core.release(CAROL));
    h.core.restore(CAROL, Saved::default()).unwrap();
    assert!(h.core.release(CAROL));
    h.check();
}

#[test]
fn a_released_user_comes_back_new_with_versions_above_every_old_one() {
    let mut h = Harness::new();
    let bob = h.connect(BOB, PHONE, DeviceKind::Desktop);
    let seen = h.subscribe(bob, ALICE, Tier::Realtime).presence;
    assert_eq!(seen.version, 0);
    // Alice flaps (connect, logout, inside one window): her own view moves
    // her version, nothing is published.
    for _ in 0..3 {
        let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
        h.core.handle_logout(h.now(), phone).unwrap();
    }
    h.run_until(1000);
    let old = h.core.truth(ALICE).version;
    assert!(old >= 6);
    h.core.handle_unsubscribe(Millis(1000), bob, ALICE).unwrap();
    assert!(h.core.release(ALICE));
    assert_eq!(h.core.presence(ALICE), Presence::default(), "unknown again");
    assert_eq!(h.core.user_count(), 1);

    // Back: a new record, offline and default, its versions above the old.
    let snap = h.subscribe(bob, ALICE, Tier::Realtime).presence;
    assert!(snap.version >= old);
    assert!(snap.same_view(&Presence::default()));
    h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let pushes = pushes_to(&h.run_until(2000), bob);
    assert_eq!(pushes.len(), 1);
    assert!(pushes[0].2.online && pushes[0].2.version > old);
}

// ----- counters --------------------------------------------------------------

#[test]
fn counters_compare_by_value_but_stay_out_of_the_cores_equality() {
    let one = Counters {
        logouts: 1,
        ..Counters::default()
    };
    assert_ne!(one, Counters::default());
    assert_eq!(one.clone(), one);

    // A refused stale input moves a counter and nothing else: the cores
    // are the same state, their counters are not equal.
    let mut h = Harness::new();
    let old = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.drain();
    let before = h.core.clone();
    assert_eq!(h.core.handle_activity(Millis(0), old), Err(Error::Stale));
    assert_eq!(h.core, before);
    assert_ne!(h.core.counters(), before.counters());
}

/// A driver's renewal sweep passes when it last heard from a connection: the
/// lease counts from then and `last_seen` stays at that moment, not the sweep.
#[test]
fn a_renewal_as_of_the_last_packet_keeps_the_real_last_heard() {
    let mut core = Core::new(Config::default()).unwrap();
    let connect = |user| Connect {
        user: UserId(user),
        device: DeviceId(1),
        kind: DeviceKind::Desktop,
        watch: Watch::All,
        resume: None,
        foreground: true,
    };
    let phone = core.handle_connect(Millis(0), connect(1)).unwrap().session;
    let watcher = core.handle_connect(Millis(0), connect(2)).unwrap().session;
    core.handle_subscribe(Millis(0), watcher, UserId(1), Tier::Realtime)
        .unwrap();
    core.handle_activity(Millis(5_000), phone).unwrap();
    // Sweeps at 20 s and 40 s: the connection was last heard at 10 s.
    core.handle_heard(Millis(20_000), phone, Millis(10_000))
        .unwrap();
    core.handle_heard(Millis(40_000), phone, Millis(10_000))
        .unwrap();
    // An older report never moves it back.
    core.handle_heard(Millis(41_000), phone, Millis(1_000))
        .unwrap();
    core.handle_disconnect(Millis(55_000), phone, Millis(10_000))
        .unwrap();
    core.handle_timeout(Millis(200_000));
    assert_eq!(core.presence(UserId(1)).last_seen, Some(Millis(10_000)));
}
