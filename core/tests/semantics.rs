//! One test per input, transition and race of DESIGN.md's semantics.

mod semantics_support;

use greendot_core::*;
use semantics_support::*;

#[test]
fn connect_is_published_once_the_debounce_window_held() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    h.connect(ALICE, PHONE, DeviceKind::Mobile);
    assert!(h.core.is_online(ALICE));
    assert!(
        !h.core.presence(ALICE).online,
        "not published before the window ends"
    );
    assert!(pushes_to(&h.run_until(299), bob).is_empty());
    let pushes = pushes_to(&h.run_until(300), bob);
    assert_eq!(pushes.len(), 1);
    let (target, tier, p) = &pushes[0];
    assert_eq!((*target, *tier), (ALICE, Tier::Realtime));
    assert!(p.online && p.kinds.contains(DeviceKind::Mobile) && p.last_seen.is_none());
    assert_eq!(h.core.presence(ALICE), *p);
}

#[test]
fn activity_renews_the_lease_and_silence_reaps_a_ghost() {
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Mobile).heartbeat_timeout = Millis(1000);
    let mut h = Harness::with(config);
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(900);
    h.core.handle_activity(Millis(900), alice).unwrap();
    let out = h.run_until(1899);
    assert!(ended(&out).is_empty(), "renewed at 900, due at 1900");
    let out = h.run_until(1900);
    assert_eq!(ended(&out), vec![(alice, EndReason::HeartbeatTimeout)]);
    assert_eq!(h.core.counters().ghosts_reaped, 1);
    assert!(!h.core.is_online(ALICE));
    assert_eq!(
        h.core.handle_activity(Millis(1900), alice),
        Err(Error::Stale),
        "a reaped session cannot be revived"
    );
    let pushes = pushes_to(&h.run_until(2200), bob);
    let last = pushes.last().expect("offline published").2.clone();
    assert!(!last.online);
    assert_eq!(
        last.last_seen,
        Some(Millis(900)),
        "a reaped ghost was last heard at its last activity, not at the timeout"
    );
}

#[test]
fn heartbeat_timeouts_are_per_device_kind() {
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Mobile).heartbeat_timeout = Millis(5000);
    config.kind_mut(DeviceKind::Web).heartbeat_timeout = Millis(1000);
    let mut h = Harness::with(config);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let web = h.connect(ALICE, LAPTOP, DeviceKind::Web);
    let out = h.run_until(1000);
    assert_eq!(ended(&out), vec![(web, EndReason::HeartbeatTimeout)]);
    assert_eq!(h.core.route(ALICE), vec![phone]);
    let out = h.run_until(5000);
    assert_eq!(ended(&out), vec![(phone, EndReason::HeartbeatTimeout)]);
}

#[test]
fn disconnect_lingers_unseen_and_is_offline_after_grace() {
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Mobile).grace = Millis(2000);
    let mut h = Harness::with(config);
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    h.core
        .handle_disconnect(Millis(1000), alice, Millis(1000))
        .unwrap();
    h.check();
    assert!(h.core.is_online(ALICE), "I1: lingering counts as online");
    assert!(
        h.core.route(ALICE).is_empty(),
        "I9: lingering is not routable"
    );
    assert!(!h.core.session_info(alice).unwrap().online);
    assert!(
        pushes_to(&h.run_until(2999), bob).is_empty(),
        "nothing visible"
    );
    let out = h.run_until(3000);
    assert_eq!(ended(&out), vec![(alice, EndReason::GraceExpired)]);
    let pushes = pushes_to(&h.run_until(3300), bob);
    assert_eq!(pushes.len(), 1);
    assert!(!pushes[0].2.online);
    assert_eq!(
        pushes[0].2.last_seen,
        Some(Millis(1000)),
        "last heard when the connection was lost, not when grace ran out"
    );
}

#[test]
fn reconnect_inside_grace_resumes_unseen_with_its_subscriptions() {
    let mut h = Harness::new();
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.connect(CAROL, PHONE, DeviceKind::Web);
    h.subscribe(alice, CAROL, Tier::Realtime);
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    h.run_until(1000);
    h.core
        .handle_disconnect(Millis(1000), alice, Millis(1000))
        .unwrap();
    h.at(5000);
    let back = h.connect_with(ALICE, PHONE, DeviceKind::Mobile, Watch::All, Some(alice));
    assert!(back.resumed);
    assert_eq!(
        back.superseded, None,
        "the old session was lingering, not online"
    );
    assert_eq!(back.snapshots.len(), 1);
    assert_eq!(back.snapshots[0].target, CAROL);
    assert!(back.snapshots[0].presence.online);
    assert_eq!(
        h.core.subscriptions(back.session),
        vec![(CAROL, Tier::Realtime)]
    );
    assert_eq!(h.core.counters().resumed, 1);
    assert!(
        pushes_to(&h.run_until(10_000), bob).is_empty(),
        "watchers saw nothing"
    );
    // Carol's changes reach the resumed session.
    let carol = h.core.route(CAROL)[0];
    h.core
        .handle_set_status(Millis(10_000), carol, Status::Busy, None)
        .unwrap();
    let pushes = pushes_to(&h.run_until(10_300), back.session);
    assert_eq!(pushes.len(), 1);
    assert_eq!(pushes[0].2.status, Status::Busy);
}

#[test]
fn reconnect_without_resume_starts_clean() {
    let mut h = Harness::new();
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.subscribe(alice, CAROL, Tier::Realtime);
    h.core
        .handle_disconnect(Millis(0), alice, Millis(0))
        .unwrap();
    let fresh = h.connect_with(ALICE, PHONE, DeviceKind::Mobile, Watch::All, None);
    assert!(!fresh.resumed && fresh.snapshots.is_empty());
    assert!(h.core.subscriptions(fresh.session).is_empty());
    assert_eq!(ended(&h.drain()), vec![(alice, EndReason::Superseded)]);
}

#[test]
fn resume_keeps_only_what_the_new_credentials_allow() {
    let mut h = Harness::new();
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.subscribe(alice, BOB, Tier::Realtime);
    h.subscribe(alice, CAROL, Tier::Batched);
    h.core
        .handle_disconnect(Millis(0), alice, Millis(0))
        .unwrap();
    let back = h.connect_with(
        ALICE,
        PHONE,
        DeviceKind::Mobile,
        Watch::only([CAROL]),
        Some(alice),
    );
    assert!(back.resumed);
    assert_eq!(
        h.core.subscriptions(back.session),
        vec![(CAROL, Tier::Batched)]
    );
}

#[test]
fn connecting_an_online_device_again_supersedes_the_old_session() {
    let mut h = Harness::new();
    let old = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.subscribe(old, BOB, Tier::Realtime);
    h.drain();
    let new = h.connect_with(ALICE, PHONE, DeviceKind::Mobile, Watch::All, Some(old));
    assert_eq!(new.superseded, Some(old));
    assert!(
        new.resumed,
        "the client named its old session: subscriptions carry over"
    );
    assert_eq!(ended(&h.drain()), vec![(old, EndReason::Superseded)]);
    assert_eq!(h.core.route(ALICE), vec![new.session]);
    assert_eq!(h.core.counters().superseded, 1);
}

#[test]
fn a_late_disconnect_of_a_superseded_session_is_stale() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let old = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let new = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    let before = h.core.clone();
    assert_eq!(
        h.core.handle_disconnect(Millis(1000), old, Millis(1000)),
        Err(Error::Stale)
    );
    assert_eq!(h.core.handle_logout(Millis(1000), old), Err(Error::Stale));
    assert_eq!(
        h.core.handle_set_invisible(Millis(1000), old, true),
        Err(Error::Stale)
    );
    assert_eq!(h.core, before, "I3: stale inputs change nothing");
    assert_eq!(h.core.counters().stale_inputs, 3);
    assert_eq!(h.core.route(ALICE), vec![new]);
    let pushes = pushes_to(&h.run_until(5000), bob);
    assert!(pushes.iter().all(|p| p.2.online));
}

#[test]
fn a_session_that_was_never_issued_is_unknown() {
    let mut h = Harness::new();
    let s = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    assert_eq!(
        h.core.handle_activity(Millis(0), SessionId(s.0 + 7)),
        Err(Error::UnknownSession)
    );
    assert_eq!(
        h.core.handle_activity(Millis(0), SessionId(u64::MAX)),
        Err(Error::UnknownSession)
    );
    assert_eq!(
        h.core.handle_activity(Millis(0), SessionId(0)),
        Err(Error::UnknownSession)
    );
}

#[test]
fn logging_out_of_one_device_keeps_the_user_online() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let laptop = h.connect(ALICE, LAPTOP, DeviceKind::Desktop);
    let pushes = pushes_to(&h.run_until(1000), bob);
    assert_eq!(pushes.len(), 1);
    assert!(pushes[0].2.kinds.contains(DeviceKind::Desktop));
    h.core.handle_logout(Millis(1000), laptop).unwrap();
    assert_eq!(ended(&h.drain()), vec![(laptop, EndReason::LoggedOut)]);
    let pushes = pushes_to(&h.run_until(2000), bob);
    assert_eq!(pushes.len(), 1, "only the device kinds changed");
    assert!(pushes[0].2.online);
    assert_eq!(
        pushes[0].2.kinds.iter().collect::<Vec<_>>(),
        vec![DeviceKind::Mobile]
    );
    assert_eq!(h.core.route(ALICE), vec![phone]);

    h.core.handle_logout(Millis(2000), phone).unwrap();
    assert!(
        h.core.route(ALICE).is_empty(),
        "I4: out of every route at once"
    );
    let pushes = pushes_to(&h.run_until(3000), bob);
    assert_eq!(pushes.len(), 1, "offline published once");
    assert!(!pushes[0].2.online);
    assert_eq!(pushes[0].2.last_seen, Some(Millis(2000)));
}

#[test]
fn logout_ends_the_sessions_subscriptions() {
    let mut h = Harness::new();
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.subscribe(alice, BOB, Tier::Realtime);
    h.subscribe(alice, CAROL, Tier::Batched);
    let bob = h.connect(BOB, PHONE, DeviceKind::Mobile);
    h.core.handle_logout(Millis(0), alice).unwrap();
    assert!(h.core.subscriptions(alice).is_empty());
    h.core
        .handle_set_status(Millis(0), bob, Status::Away, None)
        .unwrap();
    let out = h.run_until(10_000);
    assert!(
        pushes_to(&out, alice).is_empty(),
        "I10: nothing to an ended session"
    );
    assert_eq!(
        h.core
            .handle_subscribe(Millis(10_000), alice, BOB, Tier::Realtime),
        Err(Error::Stale)
    );
}

#[test]
fn a_flap_inside_the_debounce_window_publishes_nothing() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    let published = h.core.presence(ALICE);
    h.core.handle_logout(Millis(1000), alice).unwrap();
    h.at(1100);
    h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let pushes = pushes_to(&h.run_until(5000), bob);
    assert!(pushes.is_empty(), "I6: {pushes:?}");
    assert_eq!(h.core.presence(ALICE), published);
    assert_eq!(h.core.counters().flaps_suppressed, 1);
}

#[test]
fn each_change_restarts_the_window_so_a_published_state_always_held() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    h.core
        .handle_set_status(Millis(1000), alice, Status::Busy, None)
        .unwrap();
    h.at(1200);
    h.core
        .handle_set_status(Millis(1200), alice, Status::Away, None)
        .unwrap();
    assert!(pushes_to(&h.run_until(1499), bob).is_empty());
    let pushes = pushes_to(&h.run_until(1500), bob);
    assert_eq!(pushes.len(), 1);
    assert_eq!(pushes[0].2.status, Status::Away, "busy never held 300 ms");
}

#[test]
fn invisible_shows_offline_to_others_at_once_and_the_truth_to_oneself() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let laptop = h.connect(ALICE, LAPTOP, DeviceKind::Desktop);
    h.subscribe(laptop, ALICE, Tier::Realtime);
    h.run_until(1000);
    h.core
        .handle_set_invisible(Millis(1000), phone, true)
        .unwrap();
    let out = h.drain();
    let to_bob = pushes_to(&out, bob);
    assert_eq!(to_bob.len(), 1, "published at once, not debounced");
    assert!(!to_bob[0].2.online);
    assert_eq!(to_bob[0].2.last_seen, Some(Millis(1000)));
    let to_self = pushes_to(&out, laptop);
    assert_eq!(to_self.len(), 1);
    assert!(to_self[0].2.online && to_self[0].2.invisible);
    assert_eq!(h.core.route(ALICE).len(), 2, "I9: still routable");

    // A new watcher's snapshot does not leak either (I5).
    let carol = h.connect(CAROL, PHONE, DeviceKind::Web);
    let snap = h.subscribe(carol, ALICE, Tier::Batched);
    assert!(!snap.presence.online);
    assert_eq!(
        h.core
            .handle_query(Millis(1000), carol, ALICE)
            .unwrap()
            .last_seen,
        Some(Millis(1000))
    );

    // Changes while invisible reach nobody else, and last seen stays frozen.
    h.at(2000);
    h.core
        .handle_set_status(Millis(2000), phone, Status::Busy, None)
        .unwrap();
    h.core.handle_logout(Millis(2000), laptop).unwrap();
    let out = h.run_until(10_000);
    assert!(pushes_to(&out, bob).is_empty() && pushes_to(&out, carol).is_empty());
    h.core.handle_logout(Millis(10_000), phone).unwrap();
    h.run_until(20_000);
    assert_eq!(h.core.presence(ALICE).last_seen, Some(Millis(1000)));

    // Visible again: published after the window, like any change.
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.core
        .handle_set_invisible(Millis(20_000), phone, false)
        .unwrap();
    assert!(!h.core.presence(ALICE).online);
    let pushes = pushes_to(&h.run_until(20_300), bob);
    assert_eq!(pushes.len(), 1);
    assert!(pushes[0].2.online);
    assert_eq!(pushes[0].2.status, Status::Busy);
}

#[test]
fn subscribing_while_a_publish_is_pending_gets_the_old_snapshot_then_the_delta() {
    let mut h = Harness::new();
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    h.core
        .handle_set_status(Millis(1000), alice, Status::Busy, None)
        .unwrap();
    h.at(1100);
    let bob = h.connect(BOB, PHONE, DeviceKind::Desktop);
    let snap = h.subscribe(bob, ALICE, Tier::Realtime);
    assert_eq!(
        snap.presence.status,
        Status::Available,
        "snapshot is what was published"
    );
    let pushes = pushes_to(&h.run_until(1300), bob);
    assert_eq!(pushes.len(), 1);
    assert_eq!(pushes[0].2.status, Status::Busy);
    assert!(pushes[0].2.version > snap.presence.version, "I7");
}

#[test]
fn batched_subscribers_get_only_the_latest_state_once_per_interval() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Batched);
    let realtime = h.connect(CAROL, PHONE, DeviceKind::Desktop);
    h.subscribe(realtime, ALICE, Tier::Realtime);
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let mut out = h.run_until(1000);
    h.core
        .handle_set_status(Millis(1000), alice, Status::Busy, None)
        .unwrap();
    out.extend(h.run_until(1500));
    h.core
        .handle_set_status(Millis(1500), alice, Status::Away, Some("lunch"))
        .unwrap();
    out.extend(h.run_until(2299));
    assert_eq!(
        pushes_to(&out, realtime).len(),
        3,
        "realtime: every publish, at once"
    );
    assert!(
        pushes_to(&out, bob).is_empty(),
        "batched: not yet (first change at 300)"
    );
    let out = h.run_until(2300);
    let pushes = pushes_to(&out, bob);
    assert_eq!(pushes.len(), 1, "three publishes coalesced into one");
    assert_eq!(pushes[0].1, Tier::Batched);
    assert_eq!(pushes[0].2.status, Status::Away);
    assert_eq!(pushes[0].2.message.as_deref(), Some("lunch"));
    assert_eq!(pushes[0].2, h.core.presence(ALICE));
}

#[test]
fn unsubscribe_stops_pushes_and_resubscribe_changes_tier() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Batched);
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(400);
    let snap = h.subscribe(bob, ALICE, Tier::Realtime);
    assert_eq!(snap.tier, Tier::Realtime);
    assert!(snap.presence.online);
    assert_eq!(h.core.subscriptions(bob), vec![(ALICE, Tier::Realtime)]);
    assert!(
        pushes_to(&h.run_until(3000), bob).is_empty(),
        "the queued change was in the snapshot"
    );
    h.core.handle_unsubscribe(Millis(3000), bob, ALICE).unwrap();
    assert_eq!(
        h.core.handle_unsubscribe(Millis(3000), bob, ALICE),
        Err(Error::NotSubscribed)
    );
    h.core.handle_logout(Millis(3000), alice).unwrap();
    assert!(pushes_to(&h.run_until(10_000), bob).is_empty());
}

#[test]
fn watch_lists_are_enforced_but_oneself_is_always_allowed() {
    let mut h = Harness::new();
    let bob = h
        .connect_with(BOB, PHONE, DeviceKind::Mobile, Watch::only([CAROL]), None)
        .session;
    assert_eq!(
        h.core
            .handle_subscribe(Millis(0), bob, ALICE, Tier::Realtime),
        Err(Error::NotAllowed)
    );
    assert_eq!(
        h.core.handle_query(Millis(0), bob, ALICE),
        Err(Error::NotAllowed)
    );
    h.subscribe(bob, CAROL, Tier::Realtime);
    let own = h.subscribe(bob, BOB, Tier::Realtime);
    assert!(
        own.presence.online,
        "own view is the truth, not yet debounced"
    );
}

#[test]
fn the_subscription_cap_is_a_clear_error() {
    let config = Config {
        max_subscriptions_per_session: 2,
        ..Config::default()
    };
    let mut h = Harness::with(config);
    let bob = h.connect(BOB, PHONE, DeviceKind::Mobile);
    h.subscribe(bob, UserId(10), Tier::Batched);
    h.subscribe(bob, UserId(11), Tier::Batched);
    assert_eq!(
        h.core
            .handle_subscribe(Millis(0), bob, UserId(12), Tier::Batched),
        Err(Error::LimitExceeded(Limit::SubscriptionsPerSession))
    );
    h.subscribe(bob, UserId(11), Tier::Realtime); // changing tier is not a new one
    assert_eq!(h.core.subscriptions(bob).len(), 2);
}

#[test]
fn the_realtime_fan_out_cap_downgrades_or_rejects() {
    let mut config = Config {
        max_realtime_per_target: 1,
        ..Config::default()
    };
    let mut h = Harness::with(config.clone());
    let first = h.connect(BOB, PHONE, DeviceKind::Mobile);
    let second = h.connect(CAROL, PHONE, DeviceKind::Mobile);
    assert_eq!(
        h.subscribe(first, ALICE, Tier::Realtime).tier,
        Tier::Realtime
    );
    assert_eq!(
        h.subscribe(second, ALICE, Tier::Realtime).tier,
        Tier::Batched
    );
    assert_eq!(h.core.counters().downgraded, 1);

    config.realtime_overflow = RealtimeOverflow::Reject;
    let mut h = Harness::with(config);
    let first = h.connect(BOB, PHONE, DeviceKind::Mobile);
    let second = h.connect(CAROL, PHONE, DeviceKind::Mobile);
    h.subscribe(first, ALICE, Tier::Realtime);
    h.subscribe(second, ALICE, Tier::Batched);
    assert_eq!(
        h.core
            .handle_subscribe(Millis(0), second, ALICE, Tier::Realtime),
        Err(Error::LimitExceeded(Limit::RealtimePerTarget))
    );
    assert_eq!(
        h.core.subscriptions(second),
        vec![(ALICE, Tier::Batched)],
        "unchanged"
    );
}

#[test]
fn other_caps_are_clear_errors() {
    let config = Config {
        max_message_len: 4,
        max_devices_per_user: 1,
        max_sessions: 2,
        max_users: 3,
        ..Config::default()
    };
    let mut h = Harness::with(config);
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    assert_eq!(
        h.core
            .handle_set_status(Millis(0), alice, Status::Busy, Some("hello")),
        Err(Error::LimitExceeded(Limit::MessageLength))
    );
    h.core
        .handle_set_status(Millis(0), alice, Status::Busy, Some("hi"))
        .unwrap();
    let laptop = Connect {
        user: ALICE,
        device: LAPTOP,
        kind: DeviceKind::Desktop,
        watch: Watch::All,
        resume: None,
        foreground: true,
    };
    assert_eq!(
        h.core.handle_connect(Millis(0), laptop),
        Err(Error::LimitExceeded(Limit::DevicesPerUser))
    );
    h.connect(ALICE, PHONE, DeviceKind::Mobile); // replacing a device is fine
    let bob = h.connect(BOB, PHONE, DeviceKind::Mobile);
    let carol = Connect {
        user: CAROL,
        device: PHONE,
        kind: DeviceKind::Mobile,
        watch: Watch::All,
        resume: None,
        foreground: true,
    };
    assert_eq!(
        h.core.handle_connect(Millis(0), carol),
        Err(Error::LimitExceeded(Limit::Sessions))
    );
    h.subscribe(bob, CAROL, Tier::Batched); // third user
    assert_eq!(
        h.core
            .handle_subscribe(Millis(0), bob, UserId(99), Tier::Batched),
        Err(Error::LimitExceeded(Limit::Users))
    );
    h.check();
}

#[test]
fn route_lists_online_sessions_whatever_status_or_invisibility() {
    let mut h = Harness::new();
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let laptop = h.connect(ALICE, LAPTOP, DeviceKind::Desktop);
    h.core
        .handle_set_status(Millis(0), phone, Status::DoNotDisturb, None)
        .unwrap();
    h.core.handle_set_invisible(Millis(0), phone, true).unwrap();
    assert_eq!(h.core.route(ALICE), vec![phone, laptop]);
    h.core
        .handle_disconnect(Millis(0), laptop, Millis(0))
        .unwrap();
    assert_eq!(h.core.route(ALICE), vec![phone]);
    assert!(h.core.route(BOB).is_empty());
}

#[test]
fn query_answers_without_subscribing() {
    let mut h = Harness::new();
    let alice = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    let bob = h.connect(BOB, PHONE, DeviceKind::Mobile);
    h.run_until(500);
    let p = h.core.handle_query(Millis(500), bob, ALICE).unwrap();
    assert!(p.online && p.version > 0);
    assert!(h.core.subscriptions(bob).is_empty());
    let unknown = h.core.handle_query(Millis(500), bob, UserId(77)).unwrap();
    assert_eq!(
        unknown,
        Presence::default(),
        "never seen: offline, version 0"
    );
    assert_eq!(h.core.user_count(), 2, "a query creates no record");
    let _ = alice;
}

#[test]
fn time_never_runs_backwards_and_an_idle_timeout_call_is_a_no_op() {
    let mut h = Harness::new();
    h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    let before = h.core.clone();
    h.core.handle_timeout(Millis(1000));
    assert_eq!(h.core, before);
    assert!(h.core.poll_output().is_none());
    h.core.handle_timeout(Millis(10)); // older than seen: treated as 1000
    assert_eq!(h.core.now(), Millis(1000));
    assert_eq!(h.core, before);
}

#[test]
fn zero_grace_ends_a_lost_session_at_once() {
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Web).grace = Millis::ZERO;
    let mut h = Harness::with(config);
    let web = h.connect(ALICE, PHONE, DeviceKind::Web);
    h.core.handle_disconnect(Millis(0), web, Millis(0)).unwrap();
    h.check();
    assert_eq!(ended(&h.drain()), vec![(web, EndReason::GraceExpired)]);
    assert!(!h.core.is_online(ALICE));
}

#[test]
fn session_ids_are_never_reused() {
    let mut h = Harness::new();
    let mut seen = std::collections::BTreeSet::new();
    for round in 0..50 {
        let s = h.connect(ALICE, DeviceId(round % 3), DeviceKind::Mobile);
        assert!(seen.insert(s), "{s} issued twice");
        if round % 2 == 0 {
            h.core.handle_logout(Millis(0), s).unwrap();
        }
    }
}

#[test]
fn invalid_configs_are_refused() {
    let config = Config {
        debounce: Millis::ZERO,
        ..Config::default()
    };
    assert!(Core::new(config).is_err());
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Other).heartbeat_timeout = Millis::ZERO;
    assert!(Core::new(config).is_err());
}

#[test]
fn saved_preferences_survive_a_restart() {
    let mut h = Harness::new();
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.core
        .handle_set_status(Millis(0), phone, Status::Busy, Some("focus"))
        .unwrap();
    h.run_until(1000);
    h.core
        .handle_set_invisible(Millis(1000), phone, true)
        .unwrap();
    h.core.handle_logout(Millis(5000), phone).unwrap();
    let saved = h.core.saved(ALICE);
    assert_eq!(saved.last_seen, Some(Millis(1000)), "frozen when invisible");

    let mut restarted = Harness::new();
    restarted.core.restore(ALICE, saved.clone()).unwrap();
    restarted.check();
    assert_eq!(restarted.core.saved(ALICE), saved);
    assert_eq!(restarted.core.presence(ALICE).last_seen, Some(Millis(1000)));
    let bob = restarted.connect(BOB, PHONE, DeviceKind::Desktop);
    restarted.subscribe(bob, ALICE, Tier::Realtime);
    restarted.connect(ALICE, PHONE, DeviceKind::Mobile);
    let out = restarted.run_until(10_000);
    assert!(
        pushes_to(&out, bob).is_empty(),
        "I5 across restarts: still invisible"
    );
    assert!(restarted.core.truth(ALICE).invisible);
    assert_eq!(restarted.core.truth(ALICE).status, Status::Busy);
    assert_eq!(
        restarted.core.restore(ALICE, Saved::default()),
        Err(Error::AlreadyOnline)
    );
}

#[test]
fn connecting_invisible_within_the_window_reveals_nothing_not_even_last_seen() {
    let mut h = Harness::new();
    let bob = bob_watches_alice(&mut h, Tier::Realtime);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.run_until(1000);
    h.core.handle_logout(Millis(1000), phone).unwrap();
    h.run_until(2000);
    let published = h.core.presence(ALICE);
    assert_eq!(published.last_seen, Some(Millis(1000)));
    // Back, and invisible 5 ms later: nobody was ever shown this connection.
    h.at(5000);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.at(5005);
    h.core
        .handle_set_invisible(Millis(5005), phone, true)
        .unwrap();
    assert!(
        pushes_to(&h.run_until(10_000), bob).is_empty(),
        "I5: {published:?}"
    );
    assert_eq!(h.core.presence(ALICE), published);
    // Nor does a short visit that ends inside the window.
    h.core.handle_logout(Millis(10_000), phone).unwrap();
    h.at(20_000);
    let phone = h.connect(ALICE, PHONE, DeviceKind::Mobile);
    h.core.handle_logout(Millis(20_100), phone).unwrap();
    assert!(pushes_to(&h.run_until(30_000), bob).is_empty());
    assert_eq!(h.core.presence(ALICE).last_seen, Some(Millis(1000)));
}
