//! One node run as a cluster of one (`ServerConfig::cluster_of_one`): its
//! sessions' presence goes through the cluster's edge and owner path over
//! the in-process bus, and watchers see what one node shows them.

use greendot_core::{DeviceKind, Tier};
use greendot_proto::{ErrorCode, Kind};
use greendot_server::token::WatchClaim;
use greendot_tests::{Doomed, TestServer, SLACK};
use std::time::Duration;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_goes_through_the_owner_path_and_watchers_see_it() {
    let ts = TestServer::start(|c| c.cluster_of_one = true);
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

    // Invisible: shown offline at once; visible again: online.
    laptop.set_invisible(true).await.unwrap();
    seen.wait_presence("ulla", wait, |p| !p.online)
        .await
        .expect("invisible ulla is shown offline");
    laptop.set_invisible(false).await.unwrap();
    seen.wait_presence("ulla", wait, |p| p.online)
        .await
        .expect("visible ulla is shown online again");
    seen.reset();

    // One device logs out: still online, only on desktop.
    phone.logout().await.unwrap();
    let (_, p) = seen
        .wait_presence("ulla", wait, |p| !p.kinds.contains(DeviceKind::Mobile))
        .await
        .expect("the phone's logout is published");
    assert!(p.online, "ulla must stay online on her laptop: {p:?}");

    // The other logs out too: offline once, after the debounce.
    let t0 = Instant::now();
    laptop.logout().await.unwrap();
    let (at, p) = seen
        .wait_presence("ulla", wait, |p| !p.online)
        .await
        .expect("offline is published");
    assert!(at - t0 >= debounce, "offline after {:?}", at - t0);
    assert!(p.last_seen.is_some(), "offline carries last seen: {p:?}");
    assert_eq!(seen.offline_count("ulla"), 1);

    // All of it went through the node's own owner, in process, and
    // nothing was dropped on the way.
    let metrics = ts.server.monitor().metrics().await.unwrap();
    let cluster = metrics
        .cluster
        .expect("a cluster of one has a cluster link");
    assert!(
        cluster.counters.forwarded_local >= 6,
        "{:?}",
        cluster.counters
    );
    assert_eq!(cluster.counters.forwarded, 0, "{:?}", cluster.counters);
    assert!(cluster.counters.published >= 4, "{:?}", cluster.counters);
    assert_eq!(cluster.dropped, 0);
}

/// The node's owner takes its shard at start with no resync window to hold
/// offlines in (its only edge is in process): a device that dies right
/// after the start is offline within the one-node bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_silent_is_shown_offline_after_its_grace() {
    let ts = TestServer::start(|c| c.cluster_of_one = true);
    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let token = ts.token("kim", "phone", Kind::Mobile, WatchClaim::all());
    let doomed = Doomed::spawn(ts.client_config(token)).await.unwrap();
    watcher.subscribe(&["kim"], Tier::Realtime).await.unwrap();
    let bound = ts.death_to_offline() + SLACK;
    seen.wait_presence("kim", bound, |p| p.online)
        .await
        .expect("kim shown online");
    let t0 = Instant::now();
    doomed.kill();
    seen.wait_presence("kim", bound, |p| !p.online)
        .await
        .unwrap_or_else(|| panic!("kim still shown online {:?} after dying", t0.elapsed()));
}

/// A name no user can have is refused as a bad request by the cluster's
/// unsubscribe too, as by one node's, not answered "not subscribed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsubscribing_from_a_bad_name_is_a_bad_request() {
    let ts = TestServer::start(|c| c.cluster_of_one = true);
    let (client, _) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let too_long = "x".repeat(ts.config().limits.max_name_len + 1);
    for name in ["", "bell\u{7}", too_long.as_str()] {
        let error = client.unsubscribe(name).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::BadRequest), "{name:?}");
    }
    let error = client.unsubscribe("nobody").await.unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::NotSubscribed));
}

/// Users shown online through the node and logged out are forgotten by
/// its edge (their owner keeps what is saved of them): the census returns
/// to where it started. The edge's core used to keep each such user for
/// good, as its copy of her last seen was not the default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_shown_online_then_logged_out_are_forgotten_by_the_edge() {
    let ts = TestServer::start(|c| c.cluster_of_one = true);
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let monitor = ts.server.monitor();
    let start = monitor.metrics().await.unwrap();
    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    for i in 0..4 {
        let name = format!("user-{i}");
        let (client, _) = ts.connect(&name, "phone", Kind::Mobile).await;
        watcher.subscribe(&[&name], Tier::Realtime).await.unwrap();
        seen.wait_presence(&name, wait, |p| p.online)
            .await
            .expect("shown online");
        client.logout().await.unwrap();
        let (_, p) = seen
            .wait_presence(&name, wait, |p| !p.online)
            .await
            .expect("shown offline");
        assert!(p.last_seen.is_some(), "{p:?}");
        watcher.unsubscribe(&name).await.unwrap();
    }
    watcher.logout().await.unwrap();
    // Freed by the server's sweep, which runs at each lease renewal (a
    // third of the heartbeat timeout: several within this wait).
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut end = monitor.metrics().await.unwrap();
    while (end.names, end.users_known) != (start.names, start.users_known)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        end = monitor.metrics().await.unwrap();
    }
    assert_eq!(
        (end.names, end.users_known),
        (start.names, start.users_known)
    );
}
