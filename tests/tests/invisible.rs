//! An invisible user: watchers see offline, the user's own other device sees
//! the truth, and route still lists the devices.

use greendot_core::{Status, Tier};
use greendot_proto::{ErrorCode, Kind};
use greendot_tests::{TestServer, SLACK};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invisible_is_offline_to_others_true_to_self_and_still_routable() {
    let ts = TestServer::start(|_| {});
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;

    let (phone, _) = ts.connect("ivy", "phone", Kind::Mobile).await;
    let (laptop, mut own) = ts.connect("ivy", "laptop", Kind::Desktop).await;
    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let (svc, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;
    laptop.subscribe(&["ivy"], Tier::Realtime).await.unwrap();
    watcher.subscribe(&["ivy"], Tier::Realtime).await.unwrap();
    seen.wait_presence("ivy", wait, |p| p.online)
        .await
        .expect("ivy online");
    own.wait_presence("ivy", wait, |p| p.online)
        .await
        .expect("ivy sees herself online");
    seen.reset();
    own.reset();

    phone.set_invisible(true).await.unwrap();
    let (_, p) = seen
        .wait_presence("ivy", wait, |p| !p.online)
        .await
        .expect("watchers see ivy offline");
    assert!(
        !p.invisible,
        "others must not learn about invisibility: {p:?}"
    );
    assert!(p.last_seen.is_some());
    let (_, mine) = own
        .wait_presence("ivy", wait, |p| p.invisible)
        .await
        .expect("ivy's own device sees the truth");
    assert!(mine.online, "{mine:?}");

    // Changes while invisible: her own device sees them, watchers do not.
    phone
        .set_status(Status::Busy, Some("hiding"))
        .await
        .unwrap();
    own.wait_presence("ivy", wait, |p| p.message.as_deref() == Some("hiding"))
        .await
        .expect("own device sees the new status");
    let queried = watcher.query("ivy").await.unwrap();
    assert!(!queried.online && queried.message.is_none(), "{queried:?}");
    seen.drain();
    assert!(seen
        .presences_of("ivy")
        .all(|p| !p.online && p.message.is_none()));

    // Route ignores invisibility; it is for service tokens only.
    let mut devices: Vec<String> = svc
        .route("ivy")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.device)
        .collect();
    devices.sort();
    assert_eq!(devices, ["laptop", "phone"]);
    let refused = watcher.route("ivy").await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::ServiceOnly));

    // Visible again: the watcher sees her online again.
    phone.set_invisible(false).await.unwrap();
    seen.wait_presence("ivy", wait, |p| p.online && p.status == Status::Busy)
        .await
        .expect("ivy visible again");
}
