//! Two devices of one user: logging out one keeps the user online; logging
//! out both publishes offline once, after the debounce window.

use greendot_core::{DeviceKind, Tier};
use greendot_proto::Kind;
use greendot_tests::{TestServer, SLACK};
use std::time::Duration;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logging_out_one_device_keeps_the_user_online_and_both_publishes_offline_once() {
    let ts = TestServer::start(|_| {});
    let debounce = Duration::from_millis(ts.config().core.debounce.0);
    let wait = debounce + SLACK;

    let (phone, _) = ts.connect("ulla", "phone", Kind::Mobile).await;
    let (laptop, _) = ts.connect("ulla", "laptop", Kind::Desktop).await;
    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    watcher.subscribe(&["ulla"], Tier::Realtime).await.unwrap();
    seen.wait_presence("ulla", wait, |p| {
        p.online && p.kinds.contains(DeviceKind::Mobile) && p.kinds.contains(DeviceKind::Desktop)
    })
    .await
    .expect("ulla shown online on mobile and desktop");
    seen.reset();

    // One device logs out: still online, now only on desktop.
    phone.logout().await.unwrap();
    let (_, p) = seen
        .wait_presence("ulla", wait, |p| !p.kinds.contains(DeviceKind::Mobile))
        .await
        .expect("the phone's logout is published");
    assert!(p.online, "ulla must stay online on her laptop: {p:?}");
    assert!(p.kinds.contains(DeviceKind::Desktop));
    assert_eq!(seen.offline_count("ulla"), 0);

    // Route lists exactly the laptop.
    let (svc, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;
    let route = svc.route("ulla").await.unwrap();
    assert_eq!(route.len(), 1, "{route:?}");
    assert_eq!(route[0].device, "laptop");

    // The other logs out too: offline, once, not before the debounce window.
    let t0 = Instant::now();
    laptop.logout().await.unwrap();
    let (at, p) = seen
        .wait_presence("ulla", wait, |p| !p.online)
        .await
        .expect("offline is published");
    assert!(
        at - t0 >= debounce,
        "published after {:?}, before the debounce window of {debounce:?}",
        at - t0
    );
    assert!(p.last_seen.is_some(), "offline carries last seen: {p:?}");

    // Nothing else follows (bounded wait for an absence).
    let extra = seen.wait_presence("ulla", debounce * 4, |_| true).await;
    assert!(
        extra.is_none(),
        "unexpected update after offline: {extra:?}"
    );
    assert_eq!(seen.offline_count("ulla"), 1);
    assert!(svc.route("ulla").await.unwrap().is_empty());

    let counters = ts.server.counters().await.unwrap();
    assert_eq!(counters.logouts, 2);
    assert_eq!(counters.disconnects, 0);
}
