//! Realtime and batched tiers: a realtime change arrives before the batched
//! flush, and the batched tier coalesces several changes of one target into one.

use greendot_client::{Event, Source};
use greendot_core::{Millis, Status, Tier};
use greendot_proto::Kind;
use greendot_tests::{TestServer, SLACK};
use std::collections::BTreeSet;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_arrives_first_and_batched_coalesces() {
    let ts = TestServer::start(|c| c.core.batch_interval = Millis(3000));
    let config = ts.config().clone();
    let wait = Duration::from_millis(config.core.debounce.0) + SLACK;
    let batch = Duration::from_millis(config.core.batch_interval.0);

    let (tess, _) = ts.connect("tess", "phone", Kind::Mobile).await;
    let (rita, mut realtime) = ts.connect("rita", "laptop", Kind::Desktop).await;
    let (bert, mut batched) = ts.connect("bert", "laptop", Kind::Desktop).await;
    rita.subscribe(&["tess"], Tier::Realtime).await.unwrap();
    realtime
        .wait_presence("tess", wait, |p| p.online)
        .await
        .expect("tess online");
    let snapshot = bert.subscribe(&["tess"], Tier::Batched).await.unwrap();
    assert_eq!(snapshot.snapshots.len(), 1);
    assert_eq!(snapshot.snapshots[0].1, Tier::Batched);
    assert!(snapshot.snapshots[0].2.online, "the snapshot is current");
    realtime.reset();
    batched.reset();

    let changes = [
        (Status::Away, "one"),
        (Status::Busy, "two"),
        (Status::DoNotDisturb, "three"),
    ];
    let mut first_realtime = None;
    for (status, message) in changes {
        tess.set_status(status, Some(message)).await.unwrap();
        let (at, _) = realtime
            .wait_presence("tess", wait, |p| p.message.as_deref() == Some(message))
            .await
            .unwrap_or_else(|| panic!("realtime missed {message}"));
        first_realtime.get_or_insert(at);
    }
    let (first_batched, p) = batched
        .wait_presence("tess", batch + SLACK, |_| true)
        .await
        .expect("the batch is flushed");
    assert_eq!(
        (p.status, p.message.as_deref()),
        (Status::DoNotDisturb, Some("three")),
        "the batch carries only the latest state"
    );
    let first_realtime = first_realtime.unwrap();
    assert!(
        first_realtime < first_batched,
        "realtime must arrive before the batched flush"
    );
    assert!(
        batched.seen.iter().all(|(_, e)| matches!(
            e,
            Event::Presence {
                source: Source::Batched,
                ..
            }
        )),
        "{:?}",
        batched.seen
    );
    assert_eq!(
        batched.presences_of("tess").count(),
        1,
        "three changes, one batched update"
    );
    assert_eq!(realtime.presences_of("tess").count(), 3);
}

/// A batch larger than what the connection may have in flight (its send
/// window, 4 × max_frame) is written in parts as acknowledgements free the
/// window, and arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_the_send_window_arrives_whole() {
    // max_frame 256: a 1 KiB send window; 40 updates of about 50 bytes each.
    let ts = TestServer::start(|c| c.max_frame = 256);
    let within = Duration::from_millis(ts.config().core.batch_interval.0) * 2 + SLACK;
    let names: Vec<String> = (0..40)
        .map(|i| format!("friend-with-a-long-name-{i:02}"))
        .collect();
    let (watcher, mut seen) = ts.connect("watcher", "laptop", Kind::Desktop).await;
    for chunk in names.chunks(4) {
        watcher.subscribe(chunk, Tier::Batched).await.unwrap();
    }
    let mut friends = Vec::new();
    for name in &names {
        friends.push(ts.connect(name, "phone", Kind::Mobile).await);
    }
    // The updates of a batch arrive in any order (docs/protocol.md): in a
    // cluster, in the order their owners' views came.
    let mut missing: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    while !missing.is_empty() {
        let shown = seen
            .wait_for(within, |e| {
                matches!(e, Event::Presence { target, presence, .. }
                    if presence.online && missing.contains(target.as_str()))
            })
            .await;
        match shown {
            Some((_, Event::Presence { target, .. })) => missing.remove(target.as_str()),
            _ => panic!("never shown online: {missing:?}"),
        };
    }
}
