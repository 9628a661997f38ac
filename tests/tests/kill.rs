//! A client dies without closing (its runtime stops mid-flight): offline is
//! published within idle timeout + grace + debounce plus slack, and not before
//! grace (the device lingered, unseen).

use greendot_core::Tier;
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_tests::{Doomed, TestServer, SLACK};
use std::time::Duration;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_client_is_published_offline_within_the_configured_bound() {
    let ts = TestServer::start(|_| {});
    let config = ts.config().clone();
    let grace = Duration::from_millis(config.core.kinds[0].grace.0);
    let wait = Duration::from_millis(config.core.debounce.0) + SLACK;

    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let token = ts.token("kim", "phone", Kind::Mobile, WatchClaim::all());
    let doomed = Doomed::spawn(ts.client_config(token)).await.unwrap();
    watcher.subscribe(&["kim"], Tier::Realtime).await.unwrap();
    seen.wait_presence("kim", wait, |p| p.online)
        .await
        .expect("kim online");
    seen.reset();

    let bound = ts.death_to_offline() + SLACK;
    let t0 = Instant::now();
    doomed.kill();
    let (at, p) = seen
        .wait_presence("kim", bound, |p| !p.online)
        .await
        .unwrap_or_else(|| panic!("kim still shown online {bound:?} after dying"));
    let took = at - t0;
    assert!(
        took >= grace,
        "offline after {took:?}, before grace {grace:?}"
    );
    assert!(p.last_seen.is_some());
    assert_eq!(seen.offline_count("kim"), 1);

    let counters = ts.server.counters().await.unwrap();
    assert_eq!(counters.disconnects, 1, "{counters:?}");
    assert_eq!(counters.grace_expired, 1, "{counters:?}");
    assert_eq!(counters.logouts, 0);
    println!("killed client published offline after {took:?} (bound {bound:?})");
}
