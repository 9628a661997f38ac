//! Tests of the edge side: device inputs forwarded, subscribes, routes,
//! retries, session records and resumes.

use super::test_support::*;
use super::wire::{decode, encode, SessionRecord, WireOp};
use super::{
    ClusterInput, ClusterLink, ClusterOutput, Finished, MAX_QUEUED_OPS, RETRY_AFTER, TICK,
};
use greendot_core::{Millis, SessionId, Tier, UserId};
use greendot_proto::{self as proto, ErrorCode};
use std::time::{Duration, Instant};

#[test]
fn a_device_on_one_node_is_seen_by_a_watcher_through_its_owner() {
    let (mut a, mut b, now) = two_nodes();
    let bob = SessionId(2);
    let answer = bob_subscribes_to_alice(&mut a, now, Millis(1), 100);
    assert!(answer.is_none(), "the snapshot is the owner's");
    let out = a.poll_output();
    assert_eq!(
        out,
        Some(ClusterOutput::Watch { shard: 1 }),
        "watched before asking"
    );
    exchange(&mut a, &mut b, now, Millis(1));
    let Some((100, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
        a.poll_finished()
    else {
        panic!("no subscribe answer");
    };
    assert!(!snapshots[0].presence.online, "within the debounce");
    // The owner publishes after the debounce; the edge pushes to bob.
    b.handle_timeout(now, Millis(300));
    assert!(exchange(&mut a, &mut b, now, Millis(300)) >= 1);
    let seen = pushes(&mut a);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0, bob);
    assert!(seen[0].1.online);
    assert!(seen[0].1.version >= epoch_base_of(1));

    // A status change is answered once the owner stored it.
    let alice = SessionId(1);
    let op = WireOp::SetStatus {
        status: proto::Status::Busy,
        message: Some("out".into()),
    };
    assert!(a.input(now, Millis(400), alice, op, Some(200)));
    let prefs = {
        let mut found = false;
        exchange_until_prefs(&mut a, &mut b, now, Millis(400), &mut found);
        found
    };
    assert!(prefs, "preferences written before the ack");
    assert!(matches!(a.poll_finished(), Some((200, Finished::Done))));
    b.handle_timeout(now, Millis(700));
    exchange(&mut a, &mut b, now, Millis(700));
    let seen = pushes(&mut a);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].1.status, greendot_core::Status::Busy);
}

/// A logout behind a full queue (an owner that takes nothing) is still
/// queued: it takes the place of changes a later one overwrites, whose
/// requests are answered that they failed; the last status and the last
/// invisibility change stay before it.
#[test]
fn an_ending_op_is_never_refused_behind_a_full_queue() {
    let (mut a, _owner, now) = two_nodes();
    let alice = SessionId(1);
    let status = || WireOp::SetStatus {
        status: proto::Status::Busy,
        message: None,
    };
    for i in 0..40u64 {
        let op = match i % 3 {
            0 => status(),
            1 => WireOp::SetInvisible(true),
            _ => WireOp::SetInvisible(false),
        };
        assert!(a.input(now, Millis(400), alice, op, Some(100 + i)));
    }
    let queued = &a.edge.devices[&alice].queue;
    assert_eq!(queued.len(), MAX_QUEUED_OPS, "full");
    let last_invisible = queued
        .iter()
        .rev()
        .find_map(|q| match q.op {
            WireOp::SetInvisible(v) => Some((v, q.wait)),
            _ => None,
        })
        .unwrap();
    while a.poll_finished().is_some() {}

    assert!(a.input(now, Millis(401), alice, WireOp::Logout, Some(600)));
    let d = &a.edge.devices[&alice];
    assert!(d.closed, "the device ends at its owner");
    let ops: Vec<&WireOp> = d.queue.iter().map(|q| &q.op).collect();
    assert_eq!(ops.last(), Some(&&WireOp::Logout), "{ops:?}");
    assert_eq!(ops.len(), 3, "{ops:?}");
    assert!(matches!(
        ops[..2],
        [WireOp::SetStatus { .. }, WireOp::SetInvisible(_)]
            | [WireOp::SetInvisible(_), WireOp::SetStatus { .. }]
    ));
    let kept = d
        .queue
        .iter()
        .find_map(|q| match q.op {
            WireOp::SetInvisible(v) => Some((v, q.wait)),
            _ => None,
        })
        .unwrap();
    assert_eq!(kept, last_invisible, "the latest invisibility stays");
    let mut failed = Vec::new();
    while let Some((wait, finished)) = a.poll_finished() {
        assert!(matches!(finished, Finished::Failed(_)), "{finished:?}");
        failed.push(wait);
    }
    assert!(!failed.contains(&600), "the logout is not refused");
    assert_eq!(failed.len(), MAX_QUEUED_OPS - 2);
}

#[test]
fn the_first_tick_is_due_at_the_callers_now() {
    // An edge with a request out and no core timer: its first tick
    // must be due at once, by the clock its caller compares with.
    let (mut a, _b, now) = two_nodes();
    assert!(a.input(now, Millis(5), SessionId(1), WireOp::Logout, Some(3)));
    let later = now + Duration::from_millis(10);
    assert_eq!(a.poll_deadline(later), Some(later));
    a.handle_timeout(later, Millis(15));
    assert_eq!(a.poll_deadline(later), Some(later + TICK));
}

/// dave, on `b` (the owner of zed's shard), subscribes to zed, never seen
/// (wait 7): not answered before zed's record is read. Returns the read's
/// id.
fn dave_subscribes_to_zed(b: &mut ClusterLink, now: Instant) -> u64 {
    b.connected(
        now,
        Millis(10),
        SessionId(50),
        1050,
        "dave",
        "phone",
        proto::Kind::Mobile,
        None,
    );
    while b.poll_output().is_some() {}
    let answer = b.subscribe(
        now,
        Millis(20),
        7,
        SessionId(50),
        "dave",
        vec!["zed".into()],
        vec![],
        Tier::Realtime,
        false,
    );
    assert!(answer.is_none(), "answered before zed's record was read");
    let mut loads = Vec::new();
    while let Some(out) = b.poll_output() {
        if let ClusterOutput::LoadUser { id, user } = out {
            loads.push((id, user));
        }
    }
    assert_eq!(loads.len(), 1, "{loads:?}");
    let (id, user) = loads.pop().unwrap();
    assert_eq!(user, "zed");
    id
}

#[test]
fn a_subscribe_at_the_owners_own_edge_waits_for_the_targets_record() {
    let (_a, mut b, now) = two_nodes();
    let id = dave_subscribes_to_zed(&mut b, now);
    let seen = proto::Presence {
        version: 5,
        last_seen: Some(4_000),
        ..Default::default()
    };
    b.handle_input(
        now,
        Millis(30),
        ClusterInput::UserLoaded {
            id,
            prefs: None,
            view: Some(encode(&seen)),
        },
    );
    let later = now + RETRY_AFTER + TICK;
    b.handle_timeout(later, Millis(200));
    assert!(
        b.poll_finished().is_none(),
        "answered before its record landed"
    );
    store_records(&mut b, later, Millis(200));
    let Some((7, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
        b.poll_finished()
    else {
        panic!("no subscribe answer");
    };
    assert_eq!(snapshots[0].presence.last_seen, Some(4_000));
}

/// The read a subscribe waits on at this node's own owner lands: the
/// subscribe is answered in the same step, not at a retry after
/// `RETRY_AFTER` (what a cluster of one, whose reads land in process,
/// would otherwise pay on every subscribe to a user not read yet).
#[test]
fn a_subscribe_at_the_owners_own_edge_is_answered_when_the_read_lands() {
    let (_a, mut b, now) = two_nodes();
    let id = dave_subscribes_to_zed(&mut b, now);
    let loaded = ClusterInput::UserLoaded {
        id,
        prefs: None,
        view: None,
    };
    b.handle_input(now, Millis(20), loaded);
    store_records(&mut b, now, Millis(20));
    assert!(
        matches!(
            b.poll_finished(),
            Some((7, Finished::Answer(proto::Answer::Subscribed { .. })))
        ),
        "the subscribe waits for a retry"
    );
    assert!(b.edge.awaiting_load.is_empty());
}

/// Like `exchange`, noting whether a `PutPrefs` went out.
fn exchange_until_prefs(
    a: &mut ClusterLink,
    b: &mut ClusterLink,
    now: Instant,
    at: Millis,
    found: &mut bool,
) {
    while let Some(out) = a.poll_output() {
        if let ClusterOutput::Request {
            id,
            shard,
            kind,
            payload,
        } = out
        {
            b.handle_input(
                now,
                at,
                ClusterInput::Request {
                    shard,
                    kind,
                    payload,
                    reply: id,
                },
            );
        }
    }
    let mut replies = Vec::new();
    while let Some(out) = b.poll_output() {
        match out {
            ClusterOutput::PutPrefs { id, user, .. } => {
                assert_eq!(user, "alice");
                assert!(
                    replies.is_empty(),
                    "no answer before the preferences are stored"
                );
                *found = true;
                b.handle_input(now, at, ClusterInput::PrefsStored { id, ok: true });
            }
            ClusterOutput::LoadUser { id, .. } => b.handle_input(
                now,
                at,
                ClusterInput::UserLoaded {
                    id,
                    prefs: None,
                    view: None,
                },
            ),
            other => replies.push(other),
        }
    }
    for out in replies {
        if let ClusterOutput::Reply { reply, payload } = out {
            a.handle_input(
                now,
                at,
                ClusterInput::Answered {
                    id: reply,
                    payload: Some(payload),
                },
            );
        }
    }
    exchange(a, b, now, at);
}

#[test]
fn a_route_lists_the_devices_on_every_node() {
    let (mut a, mut b, now) = two_nodes();
    // b, the owner, is also an edge: alice's laptop connects there.
    b.connected(
        now,
        Millis(5),
        SessionId(7),
        1007,
        "alice",
        "laptop",
        proto::Kind::Desktop,
        None,
    );
    exchange(&mut a, &mut b, now, Millis(5));
    let entry = |device: &str, kind, session| proto::RouteEntry {
        device: device.into(),
        kind,
        session,
    };
    let both = vec![
        entry("laptop", proto::Kind::Desktop, 1007),
        entry("phone", proto::Kind::Mobile, 1001),
    ];
    let sorted = |mut r: Vec<proto::RouteEntry>| {
        r.sort_by(|x, y| x.device.cmp(&y.device));
        r
    };
    // At the owner's node: answered in process, before `route` returns.
    b.route(now, Millis(5), 1, "alice");
    let Some((1, Finished::Answer(proto::Answer::Route(route)))) = b.poll_finished() else {
        panic!("the owner answers at once");
    };
    assert_eq!(sorted(route), both);
    // Elsewhere: asked of the owner.
    a.route(now, Millis(5), 2, "alice");
    assert!(a.poll_finished().is_none());
    exchange(&mut a, &mut b, now, Millis(6));
    let Some((2, Finished::Answer(proto::Answer::Route(route)))) = a.poll_finished() else {
        panic!("no route answer");
    };
    assert_eq!(sorted(route), both);
    // An owner that does not answer: an error once the request times out.
    a.route(now, Millis(6), 3, "alice");
    assert!(a.poll_finished().is_none());
    while a.poll_output().is_some() {}
    let late = now + Duration::from_secs(6);
    a.handle_timeout(late, Millis(6_000));
    let Some((3, Finished::Failed(e))) = a.poll_finished() else {
        panic!("no failure");
    };
    assert_eq!(e.code, ErrorCode::Internal);
}

#[test]
fn a_request_the_io_never_answered_is_sent_again() {
    let (mut a, mut b, now) = two_nodes();
    assert!(a.input(now, Millis(5), SessionId(1), WireOp::Logout, Some(3)));
    let lost = a.poll_output();
    assert!(
        matches!(lost, Some(ClusterOutput::Request { .. })),
        "{lost:?}"
    );
    // Dropped on the way (a full queue): nothing comes back.
    let later = now + Duration::from_secs(5);
    a.handle_timeout(later, Millis(5_005));
    let later = later + RETRY_AFTER;
    a.handle_timeout(later, Millis(5_105));
    assert!(a.counters().retries >= 1);
    exchange(&mut a, &mut b, later, Millis(5_105));
    let answers: Vec<_> = std::iter::from_fn(|| a.poll_finished()).collect();
    // A logout is told, in time, that it will land (it stays queued).
    assert!(
        answers
            .iter()
            .any(|(w, f)| *w == 3 && matches!(f, Finished::Done)),
        "the client was told in time: {answers:?}"
    );
    let o = &b.shards.owners[&1];
    let alice = UserId(o.users.get("alice").unwrap());
    assert!(
        !o.core.truth(alice).online,
        "the logout got through at last"
    );
    assert!(a.shared.in_flight.is_empty() && a.edge.busy.is_empty());
}

/// [`exchange`], holding `a`'s session record puts instead of landing
/// them (returned: id, record).
fn exchange_holding_records(
    a: &mut ClusterLink,
    b: &mut ClusterLink,
    now: Instant,
    at: Millis,
) -> Vec<(u64, SessionRecord)> {
    HELD.with(|h| *h.borrow_mut() = Some(Vec::new()));
    exchange(a, b, now, at);
    HELD.with(|h| h.borrow_mut().take()).unwrap_or_default()
}

#[test]
fn a_subscribe_is_answered_once_its_session_record_landed() {
    let (mut a, mut b, now) = two_nodes();
    assert!(bob_subscribes_to_alice(&mut a, now, Millis(10), 9).is_none());
    let mut puts = exchange_holding_records(&mut a, &mut b, now, Millis(10));
    assert!(
        a.poll_finished().is_none(),
        "answered before its record landed"
    );
    let (id, record) = puts.pop().unwrap();
    assert_eq!(record.wire, 1002, "bob's session's wire id");
    assert_eq!(
        record.subscriptions,
        vec![("alice".to_string(), proto::Tier::Realtime)]
    );
    // A failed put is tried again at the tick; the answer still waits.
    let failed = ClusterInput::SessionStored { id, ok: false };
    a.handle_input(now, Millis(20), failed);
    assert!(a.poll_finished().is_none());
    assert_eq!(a.counters().session_writes_failed, 1);
    let later = now + TICK;
    a.handle_timeout(later, Millis(70));
    let (records, _) = store_records(&mut a, later, Millis(70));
    assert_eq!(records.len(), 1, "put again");
    let Some((9, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
        a.poll_finished()
    else {
        panic!("no subscribe answer after the record landed");
    };
    assert_eq!(snapshots[0].target, "alice");
    // The record lands in the KV; the connection is lost: it stays (a
    // resume elsewhere may come within grace).
    let kv = |a: &mut ClusterLink, b: &mut ClusterLink, at| {
        exchange(a, b, now, Millis(at));
    };
    kv(&mut a, &mut b, 80);
    assert!(bob_subscribes_to_alice(&mut a, now, Millis(90), 10).is_none());
    kv(&mut a, &mut b, 90);
    assert!(landed("bob", "laptop").is_some());
    let lost = WireOp::Disconnect { last_heard: 0 };
    assert!(a.input(now, Millis(100), SessionId(2), lost, None));
    a.session_ended(SessionId(2));
    kv(&mut a, &mut b, 100);
    assert!(
        landed("bob", "laptop").is_some(),
        "gone while bob may resume"
    );
    // The owner sees the device end (grace): the record goes.
    b.handle_timeout(now, Millis(100 + 60_000));
    kv(&mut a, &mut b, 100 + 60_000);
    assert!(
        landed("bob", "laptop").is_none(),
        "kept after bob's device ended"
    );
}

#[test]
fn a_session_resumed_on_another_node_carries_its_subscriptions() {
    let (mut a, mut b, now) = two_nodes();
    b.handle_timeout(now, Millis(300)); // alice shown online
    exchange(&mut a, &mut b, now, Millis(300));
    let at = Millis(310);
    assert!(bob_subscribes_to_alice(&mut a, now, at, 9).is_none());
    exchange(&mut a, &mut b, now, at);
    assert!(matches!(a.poll_finished(), Some((9, Finished::Answer(_)))));
    let record = landed("bob", "laptop").expect("bob's record");
    // Node a dies; bob's laptop comes back on c, naming its session.
    let mut c = link("c");
    let laptop = SessionId(1);
    let kind = proto::Kind::Desktop;
    c.connected(now, at, laptop, 5001, "bob", "laptop", kind, None);
    exchange(&mut c, &mut b, now, at);
    let load = |c: &mut ClusterLink, wait, wire| {
        c.resume_elsewhere(wait, laptop, "bob", "laptop", wire);
        let ids: Vec<u64> = std::iter::from_fn(|| c.poll_output())
            .filter_map(|o| match o {
                ClusterOutput::LoadSession { id, .. } => Some(id),
                _ => None,
            })
            .collect();
        assert_eq!(ids.len(), 1);
        ids[0]
    };
    // A record of another session of the device: a fresh session.
    let id = load(&mut c, 3, 777);
    let loaded = ClusterInput::SessionLoaded {
        id,
        record: Some(record.clone()),
    };
    c.handle_input(now, at, loaded);
    assert!(matches!(c.poll_finished(), Some((3, Finished::Done))));
    // The session the record names: its subscriptions come back.
    let id = load(&mut c, 4, 1002);
    let loaded = ClusterInput::SessionLoaded {
        id,
        record: Some(record),
    };
    c.handle_input(now, at, loaded);
    let Some((
        4,
        Finished::Carry {
            session,
            subscriptions,
            groups,
        },
    )) = c.poll_finished()
    else {
        panic!("nothing carried over");
    };
    assert_eq!(session, laptop);
    assert_eq!(subscriptions, vec![("alice".to_string(), Tier::Realtime)]);
    assert!(groups.is_empty());
    assert!(c
        .carry_over(now, at, 4, laptop, "bob", subscriptions)
        .is_none());
    exchange(&mut c, &mut b, now, at);
    let Some((4, Finished::Answer(proto::Answer::Subscribed { snapshots, refused }))) =
        c.poll_finished()
    else {
        panic!("no snapshots for what carried over");
    };
    assert!(refused.is_empty());
    assert_eq!(snapshots.len(), 1);
    assert!(snapshots[0].presence.online, "alice is online");
    assert_eq!(c.counters().resumed_elsewhere, 1);
    let record: SessionRecord = decode(&landed("bob", "laptop").unwrap()).unwrap();
    assert_eq!(record.wire, 5001, "the record names the session on c now");
}

#[test]
fn a_session_resumed_on_the_same_node_keeps_its_subscriptions() {
    let (mut a, mut b, now) = two_nodes();
    let at = Millis(10);
    assert!(bob_subscribes_to_alice(&mut a, now, at, 9).is_none());
    exchange(&mut a, &mut b, now, at);
    assert!(matches!(a.poll_finished(), Some((9, Finished::Answer(_)))));
    // bob's laptop resumes on a: new session 20 (wire 1020) from 2.
    let (old, new) = (SessionId(2), SessionId(20));
    let kind = proto::Kind::Desktop;
    a.connected(now, at, new, 1020, "bob", "laptop", kind, Some(old));
    a.session_ended(old); // what the hub's core says of the old one
    exchange(&mut a, &mut b, now, at);
    let kept: Vec<String> = a
        .snapshots(new, "bob")
        .into_iter()
        .map(|s| s.target)
        .collect();
    assert_eq!(kept, vec!["alice".to_string()]);
    let record: SessionRecord = decode(&landed("bob", "laptop").unwrap()).unwrap();
    assert_eq!(record.wire, 1020);
    // alice's next change reaches the new session.
    set_status(
        &mut a,
        &mut b,
        SessionId(1),
        proto::Status::Busy,
        now,
        400,
        |_| false,
    );
    let to: Vec<SessionId> = pushes(&mut a).into_iter().map(|(to, _)| to).collect();
    assert!(to.contains(&new), "{to:?}");
    assert!(!to.contains(&old), "{to:?}");
}

/// A session superseded here (its device resumed at this node) before its
/// owner took its connect: the connect is moot. The newer session connects
/// and later ends; when the owner is reached again, the old connect is not
/// sent, so it cannot take the device after the newer session's end and
/// leave a ghost (found by the simulator, seed 1628 with other changes).
#[test]
fn a_connect_of_a_session_superseded_here_is_not_sent_again() {
    let (mut a, mut b, now) = edge_and_owner();
    alice_phone_connects(&mut a, now, Millis(0));
    // Lost on the way: the owner never hears it.
    let lost = requests_of(&mut a);
    assert_eq!(lost.len(), 1);
    // Her phone resumes here as session 2; the hub ends session 1.
    let kind = proto::Kind::Mobile;
    let old = Some(SessionId(1));
    a.connected(
        now,
        Millis(100),
        SessionId(2),
        1002,
        "alice",
        "phone",
        kind,
        old,
    );
    a.session_superseded(SessionId(1));
    exchange(&mut a, &mut b, now, Millis(100));
    assert!(alice_connected_at(&b), "the newer session's connect landed");
    // The newer session ends too (its device closed).
    let op = WireOp::Disconnect { last_heard: 150 };
    assert!(a.input(now, Millis(150), SessionId(2), op, None));
    a.session_ended(SessionId(2));
    exchange(&mut a, &mut b, now, Millis(150));
    // The lost request counts as unanswered, and retries come due.
    for step in 1..=20u64 {
        let later = now + Duration::from_millis(500 * step);
        a.handle_timeout(later, Millis(150 + 500 * step));
        exchange(&mut a, &mut b, later, Millis(150 + 500 * step));
    }
    assert!(
        !alice_connected_at(&b),
        "the superseded session's connect took the device"
    );
    assert!(a.edge.devices.is_empty() && a.edge.busy.is_empty());
}
