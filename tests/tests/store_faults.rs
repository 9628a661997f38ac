//! A failing or hung disk: a status change is answered "in effect but could
//! not be saved" (failed commit, or none within `store_timeout`), the
//! connection goes on, and what could not be written is written later.

use greendot_core::{Status, Tier};
use greendot_proto::{ErrorCode, Kind, Status as WireStatus};
use greendot_server::testing::{Record, Store, StoreFaults};
use greendot_tests::{TestServer, SLACK};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

fn store_path(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("greendot-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("store.redb")
}

fn faulty(path: &Path, faults: &Arc<StoreFaults>) -> TestServer {
    let (path, faults) = (path.to_path_buf(), faults.clone());
    TestServer::start(move |c| {
        c.store = Some(path);
        c.store_faults = Some(faults);
        c.flush_interval = Duration::from_millis(100);
        c.store_timeout = Duration::from_millis(400);
    })
}

/// A failed commit: the change is in effect (watchers see it), the answer
/// says it was not saved, and the next flush after the disk recovers
/// writes it (a failed batch keeps its users).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_in_effect_and_written_once_the_disk_recovers() {
    let path = store_path("failed-commit");
    let faults = Arc::new(StoreFaults::default());
    let ts = faulty(&path, &faults);
    let (ann, _ann_events) = ts.connect("ann", "phone", Kind::Mobile).await;
    let (wes, mut wes_events) = ts.connect("wes", "phone", Kind::Mobile).await;
    wes.subscribe(&["ann"], Tier::Realtime).await.unwrap();

    faults.fail.store(true, Ordering::Relaxed);
    let error = ann
        .set_status(Status::Busy, Some("in a meeting"))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::Internal), "{error}");
    assert!(error
        .to_string()
        .contains("in effect but could not be saved"));
    wes_events
        .wait_presence("ann", SLACK, |p| p.status == Status::Busy)
        .await
        .expect("the change is in effect");
    // Flushes fail meanwhile, too: the next commit (a flush, carrying the
    // record the failed one kept) is refused as well.
    let refused = faults.refused.load(Ordering::Relaxed);
    assert!(refused >= 1, "the failed commit was not counted");
    let flush_failed =
        greendot_tests::eventually(SLACK, || faults.refused.load(Ordering::Relaxed) > refused)
            .await;
    assert!(flush_failed, "no flush was tried while the disk failed");
    faults.committed.lock().unwrap().clear();
    faults.fail.store(false, Ordering::Relaxed);
    // Nothing touches ann again: only a retry writes her record.
    let busy = |(name, record): &(String, Record)| {
        name == "ann"
            && matches!(
                record,
                Record::V1 {
                    status: WireStatus::Busy,
                    ..
                }
            )
    };
    let written =
        greendot_tests::eventually(SLACK, || faults.committed.lock().unwrap().iter().any(busy))
            .await;
    assert!(
        written,
        "the failed change was not written after the disk recovered"
    );
    ann.ping().await.unwrap();
    let metrics = ts.server.monitor().metrics().await.unwrap();
    assert!(metrics.store_errors >= 1);
    ts.server.shutdown().await;

    // The writer thread lets go of the file once the server is gone.
    let deadline = Instant::now() + SLACK;
    let store = loop {
        match Store::open(&path) {
            Ok(store) => break store,
            Err(e) if Instant::now() >= deadline => panic!("{e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let loaded = store.load_and_begin(0).unwrap();
    let ann = loaded.users.iter().find(|(name, _)| name == "ann");
    match ann {
        Some((
            _,
            Record::V1 {
                status, message, ..
            },
        )) => {
            assert_eq!(*status, WireStatus::Busy);
            assert_eq!(message.as_deref(), Some("in a meeting"));
        }
        None => panic!("the change was never written"),
    }
}

/// A hung disk: the answer comes after `store_timeout`, not never, and the
/// connection's later requests are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_commit_is_answered_after_the_store_timeout() {
    let path = store_path("hung-commit");
    let faults = Arc::new(StoreFaults::default());
    let ts = faulty(&path, &faults);
    let (ann, _ann_events) = ts.connect("ann", "phone", Kind::Mobile).await;
    faults.stall.store(true, Ordering::Relaxed);
    let started = Instant::now();
    let error = ann.set_invisible(true).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(error.code(), Some(ErrorCode::Internal), "{error}");
    assert!(error
        .to_string()
        .contains("in effect but could not be saved"));
    let timeout = ts.config().store_timeout;
    assert!(took >= timeout && took < timeout + SLACK, "{took:?}");
    ann.ping().await.unwrap();
    faults.stall.store(false, Ordering::Relaxed);
    ann.set_invisible(false).await.unwrap();
    ts.server.shutdown().await;
}
