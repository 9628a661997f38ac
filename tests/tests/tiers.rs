//! Realtime and batched tiers: a realtime change arrives before the batched
//! flush, and the batched tier coalesces several changes of one target into one.

use greendot_core::{Millis, Status, Tier};
use greendot_tests::{TestServer, SLACK};
use greendot_transport::client::{Event, Source};
use greendot_transport::proto::Kind;
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
