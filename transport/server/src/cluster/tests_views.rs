//! Tests of views at the edge: lost views and truths noticed (gaps,
//! beacons) and asked for again.

use super::edge::views::STALE_AFTER;
use super::test_support::*;
use super::wire::{decode, encode, Beacon, ShardView};
use super::{
    ClusterInput, ClusterLink, ClusterOutput, Finished, BEACON_EVERY, MAX_BEACON_SHARDS,
    MAX_BEACON_TRUTHS, MAX_MESSAGE, TICK,
};
use greendot_core::{Millis, SessionId, Tier};
use greendot_proto as proto;
use std::time::{Duration, Instant};

fn is_view(out: &ClusterOutput) -> bool {
    matches!(out, ClusterOutput::Publish { .. })
}

/// bob (on `a`) watches alice and carol, both of shard 1, whose owner
/// `b` has published them online; alice then goes busy and that view
/// is lost on the way to `a`.
fn bob_misses_alices_busy() -> (ClusterLink, ClusterLink, Instant) {
    let (mut a, mut b, now) = two_nodes();
    a.connected(
        now,
        Millis(0),
        SessionId(3),
        1003,
        "carol",
        "phone",
        proto::Kind::Mobile,
        None,
    );
    exchange(&mut a, &mut b, now, Millis(0));
    let targets = vec!["alice".into(), "carol".into()];
    let kind = Tier::Realtime;
    let answer = a.subscribe(
        now,
        Millis(1),
        9,
        SessionId(2),
        "bob",
        targets,
        vec![],
        kind,
        false,
    );
    assert!(answer.is_none());
    exchange(&mut a, &mut b, now, Millis(1));
    assert!(matches!(a.poll_finished(), Some((9, Finished::Answer(_)))));
    b.handle_timeout(now, Millis(300));
    exchange(&mut a, &mut b, now, Millis(300));
    assert_eq!(pushes(&mut a).len(), 2, "alice and carol online");
    set_status(
        &mut a,
        &mut b,
        SessionId(1),
        proto::Status::Busy,
        now,
        400,
        is_view,
    );
    assert!(!busy_pushed_to_bob(&mut a), "the view was lost");
    (a, b, now)
}

fn busy_pushed_to_bob(a: &mut ClusterLink) -> bool {
    pushes(a)
        .iter()
        .any(|(to, p)| *to == SessionId(2) && p.status == greendot_core::Status::Busy)
}

#[test]
fn a_lost_view_is_noticed_at_the_next_one_and_asked_for_again() {
    let (mut a, mut b, now) = bob_misses_alices_busy();
    // carol's next view comes with a number two past the last one seen.
    let away = proto::Status::Away;
    set_status(&mut a, &mut b, SessionId(3), away, now, 800, |_| false);
    assert_eq!(a.counters().view_gaps, 1);
    assert!(!busy_pushed_to_bob(&mut a));
    // a acts for no shard and has nothing else to do: the gap is work.
    assert!(a.poll_deadline(now).is_some());
    // The edge's next tick asks the owner for the shard's views again.
    let later = now + TICK;
    a.handle_timeout(later, Millis(1_150));
    exchange(&mut a, &mut b, later, Millis(1_150));
    assert!(busy_pushed_to_bob(&mut a), "bob still sees alice available");
    assert_eq!(a.counters().view_gaps, 1);
}

/// A subscribe at an edge that knows it missed a view of the target's
/// shard, before its repair came back, asks the owner instead of
/// answering what the edge holds (seed 7760: an invisible user's cached
/// online view answered to a resume).
#[test]
fn a_subscribe_to_a_shard_with_a_missed_view_asks_the_owner() {
    let (mut a, mut b, now) = bob_misses_alices_busy();
    let away = proto::Status::Away;
    set_status(&mut a, &mut b, SessionId(3), away, now, 800, |_| false);
    assert_eq!(a.counters().view_gaps, 1);
    let answer = bob_subscribes_to_alice(&mut a, now, Millis(900), 10);
    assert!(answer.is_none(), "answered from the edge: {answer:?}");
    exchange(&mut a, &mut b, now, Millis(900));
    let answer = std::iter::from_fn(|| a.poll_finished()).find(|(wait, _)| *wait == 10);
    let Some((_, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) = answer else {
        panic!("no answer: {answer:?}");
    };
    assert_eq!(snapshots[0].presence.status, proto::Status::Busy);
}

#[test]
fn a_lost_last_view_is_noticed_by_the_owners_beacon() {
    let (mut a, mut b, now) = bob_misses_alices_busy();
    // Nothing else happens in the shard; the owner's next beacon
    // names a view the edge has not seen.
    let later = now + BEACON_EVERY;
    b.handle_timeout(later, Millis(1_300));
    exchange(&mut a, &mut b, later, Millis(1_300));
    assert_eq!(a.counters().view_gaps, 1);
    a.handle_timeout(later, Millis(1_300));
    exchange(&mut a, &mut b, later, Millis(1_300));
    assert!(busy_pushed_to_bob(&mut a), "bob still sees alice available");
    // Beacons that name nothing new change nothing.
    let again = later + BEACON_EVERY;
    b.handle_timeout(again, Millis(2_300));
    exchange(&mut a, &mut b, again, Millis(2_300));
    a.handle_timeout(again, Millis(2_300));
    assert_eq!(exchange(&mut a, &mut b, again, Millis(2_300)), 0);
    assert_eq!(a.counters().view_gaps, 1);
}

/// An owner cut off right after a view this edge lost sends no later view
/// or beacon to show the gap (seed 20294: an invisible user's cached
/// online view kept there until her next change). A watched shard whose
/// owner is not heard of for `STALE_AFTER` counts as missed: its views are
/// asked for again, and what the edge holds of it answers no subscribe
/// until the owner answers.
#[test]
fn a_watched_shard_whose_owner_went_silent_is_asked_again() {
    let (mut a, mut b, now) = bob_misses_alices_busy();
    assert!(!a.edge.behind_on(1), "nothing shows the gap yet");
    // a acts for no shard: it ticks for the shards it watches.
    assert!(a.poll_deadline(now).is_some());
    a.handle_timeout(now + TICK, Millis(1_000));
    assert_eq!(a.counters().silent_shards, 0, "heard of lately");
    // The owner's beacons are lost from here on.
    let later = now + Duration::from_millis(STALE_AFTER.0);
    let at = Millis(400 + STALE_AFTER.0);
    a.handle_timeout(later, at);
    assert_eq!(a.counters().silent_shards, 1);
    assert!(a.edge.behind_on(1));
    a.handle_timeout(later + TICK, at.plus(Millis(50)));
    exchange(&mut a, &mut b, later + TICK, at.plus(Millis(50)));
    assert!(busy_pushed_to_bob(&mut a), "bob still sees alice available");
    assert!(!a.edge.behind_on(1), "the owner answered");
}

/// An owner heard of only through its beacons, naming the last view the
/// edge saw, is not silent: nothing is asked for again.
#[test]
fn an_owner_heard_of_by_its_beacons_is_not_silent() {
    let (mut a, mut b, now) = two_nodes();
    b.handle_timeout(now, Millis(300));
    exchange(&mut a, &mut b, now, Millis(300));
    assert!(bob_subscribes_to_alice(&mut a, now, Millis(400), 9).is_none());
    exchange(&mut a, &mut b, now, Millis(400));
    for second in 1..=8u64 {
        let later = now + BEACON_EVERY * second as u32;
        let at = Millis(400 + 1_000 * second);
        b.handle_timeout(later, at);
        exchange(&mut a, &mut b, later, at);
        a.handle_timeout(later, at);
        let asked = std::iter::from_fn(|| a.poll_output())
            .filter(|o| matches!(o, ClusterOutput::Request { .. }))
            .count();
        assert_eq!(asked, 0, "asked again at {at:?}");
    }
    assert_eq!(a.counters().silent_shards, 0);
}

/// Nothing in the numbers tells a node that was cut off what it missed:
/// views published meanwhile may all be gone, and the next owner numbers
/// its views from one again (seed 9792: a user's invisibility missed, and
/// shown online on the node's own sessions for good). At its rejoin it
/// asks again for every shard it watches.
#[test]
fn a_view_missed_while_cut_off_is_asked_for_at_the_rejoin() {
    let (mut a, mut b, now) = bob_misses_alices_busy();
    a.handle_input(now, Millis(900), ClusterInput::Rejoined);
    exchange(&mut a, &mut b, now, Millis(900));
    let later = now + TICK;
    a.handle_timeout(later, Millis(1_000));
    exchange(&mut a, &mut b, later, Millis(1_000));
    assert!(busy_pushed_to_bob(&mut a), "bob still sees alice available");
    assert_eq!(a.counters().view_gaps, 1);
}

#[test]
fn a_view_missed_while_a_repair_is_out_is_asked_for_after_it() {
    let (mut a, mut b, now) = bob_misses_alices_busy();
    let later = now + BEACON_EVERY;
    b.handle_timeout(later, Millis(1_300));
    exchange(&mut a, &mut b, later, Millis(1_300));
    a.handle_timeout(later, Millis(1_300));
    let requests = |a: &mut ClusterLink| {
        let mut out = Vec::new();
        while let Some(o) = a.poll_output() {
            if let ClusterOutput::Request {
                id,
                shard,
                kind,
                payload,
            } = o
            {
                out.push(ClusterInput::Request {
                    shard,
                    kind,
                    payload,
                    reply: id,
                });
            }
        }
        out
    };
    let repair = requests(&mut a);
    assert_eq!(repair.len(), 1, "the repair is out");
    // Meanwhile a beacon shows another view missed.
    let ahead = Beacon {
        owner: "b".into(),
        shards: vec![(1, 1, 99)],
        truths: Vec::new(),
    };
    let payload = encode(&ahead);
    a.handle_input(later, Millis(1_310), ClusterInput::Beacon { payload });
    a.handle_timeout(later + TICK, Millis(1_350));
    assert!(requests(&mut a).is_empty(), "one repair at a time");
    // The first repair is answered; the next tick asks again.
    for r in repair {
        b.handle_input(later, Millis(1_360), r);
    }
    exchange(&mut a, &mut b, later, Millis(1_360));
    a.handle_timeout(later + TICK * 2, Millis(1_400));
    assert_eq!(requests(&mut a).len(), 1, "the second gap is repaired");
}

#[test]
fn a_view_that_overtakes_the_snapshot_is_not_lost() {
    let (mut a, mut b, now) = two_nodes();
    let answer = bob_subscribes_to_alice(&mut a, now, Millis(1), 5);
    assert!(answer.is_none());
    // A newer view arrives on the shard's subject before the answer.
    let newer = proto::Presence {
        version: epoch_base_of(1) + 1_000,
        online: true,
        kinds: 1,
        ..Default::default()
    };
    let view = ShardView {
        epoch: 1,
        seq: 2,
        published_ms: 1,
        user: "alice".into(),
        own: false,
        presence: newer.clone(),
    };
    a.handle_input(
        now,
        Millis(1),
        ClusterInput::ShardMessage {
            shard: 1,
            payload: encode(&view),
        },
    );
    exchange(&mut a, &mut b, now, Millis(1));
    let Some((5, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
        a.poll_finished()
    else {
        panic!("no subscribe answer");
    };
    assert_eq!(snapshots[0].presence, newer, "the older snapshot won");
}

#[test]
fn a_lost_truth_is_noticed_by_the_owners_beacon_and_asked_for_again() {
    let (mut a, mut b, now) = two_nodes();
    b.handle_timeout(now, Millis(300));
    exchange(&mut a, &mut b, now, Millis(300));
    // alice's phone (on a) watches herself: it is sent her truth.
    let me = vec!["alice".to_string()];
    let kind = Tier::Realtime;
    let alice = SessionId(1);
    let asked = a.subscribe(now, Millis(310), 5, alice, "alice", me, vec![], kind, false);
    assert!(asked.is_none());
    exchange(&mut a, &mut b, now, Millis(310));
    assert!(matches!(a.poll_finished(), Some((5, Finished::Answer(_)))));
    pushes(&mut a);
    let lose_truths = |o: &ClusterOutput| matches!(o, ClusterOutput::PublishToEdge { .. });
    set_status(
        &mut a,
        &mut b,
        alice,
        proto::Status::Busy,
        now,
        400,
        lose_truths,
    );
    let busy = |a: &mut ClusterLink| {
        pushes(a)
            .iter()
            .any(|(to, p)| *to == alice && p.status == greendot_core::Status::Busy)
    };
    assert!(!busy(&mut a), "the truth was lost");
    // The owner's next beacon names the truth it sent a: a asks again.
    let later = now + BEACON_EVERY + TICK;
    b.handle_timeout(later, Millis(1_500));
    exchange(&mut a, &mut b, later, Millis(1_500));
    assert_eq!(a.counters().truth_gaps, 1);
    let later = later + TICK;
    a.handle_timeout(later, Millis(1_600));
    exchange(&mut a, &mut b, later, Millis(1_600));
    assert!(busy(&mut a), "alice's phone never saw herself busy");
}

#[test]
fn the_largest_beacon_fits_in_a_message() {
    let beacon = Beacon {
        owner: "n".repeat(64),
        shards: vec![(u32::MAX, u64::MAX, u64::MAX); MAX_BEACON_SHARDS],
        truths: vec![("e".repeat(64), u32::MAX, u64::MAX, u64::MAX); MAX_BEACON_TRUTHS],
    };
    let len = encode(&beacon).len();
    assert!(len <= MAX_MESSAGE, "{len} bytes");
    assert!(decode::<Beacon>(&encode(&beacon)).is_some());
}

/// A welcome that waited (for its record or the owners) carries snapshots
/// taken when it began waiting; views that came meanwhile replace the
/// older ones before it goes, and a snapshot newer than what the edge
/// holds stays as it is.
#[test]
fn a_waited_welcomes_snapshots_are_brought_up_to_what_the_edge_holds() {
    let (mut a, mut b, now) = two_nodes();
    b.handle_timeout(now, Millis(300));
    exchange(&mut a, &mut b, now, Millis(300));
    assert!(bob_subscribes_to_alice(&mut a, now, Millis(400), 9).is_none());
    exchange(&mut a, &mut b, now, Millis(400));
    let answer = std::iter::from_fn(|| a.poll_finished()).find(|(wait, _)| *wait == 9);
    let Some((_, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) = answer else {
        panic!("no answer: {answer:?}");
    };
    let taken = snapshots[0].clone();
    assert_eq!(taken.presence.status, proto::Status::Available);
    let busy = proto::Status::Busy;
    set_status(&mut a, &mut b, SessionId(1), busy, now, 500, |_| false);
    let mut welcome = vec![taken.clone()];
    a.refresh_snapshots("bob", &mut welcome);
    assert_eq!(welcome[0].presence.status, busy);
    assert!(welcome[0].presence.version > taken.presence.version);
    let mut ahead = taken.clone();
    ahead.presence.version = u64::MAX;
    let mut welcome = vec![ahead.clone()];
    a.refresh_snapshots("bob", &mut welcome);
    assert_eq!(welcome[0], ahead);
}
