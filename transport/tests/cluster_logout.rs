//! A logout during an owner failover (issue 30 §3, "Ending ops are never
//! dropped"): alice's phone, on node a, logs out right after `kill -9` of her
//! owner b. Her client is answered, and bob, on c (her next owner), sees her
//! offline once c owns her shard: within the failover (claim TTL, the new
//! owner's resync window, the debounce), long before her 30 s grace.

mod support;
#[path = "support/three.rs"]
mod three;

use std::time::{Duration, Instant};
use three::*;

use greendot_cluster::testing::NatsCluster;
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;

/// Far longer than a failover, so an offline that waited for the grace
/// shows.
const LONG_GRACE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logout_during_an_owner_failover_is_shown_long_before_the_grace() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let dir = temp_dir("logout-failover");
    let node = |id| {
        let cluster = Some((urls.as_str(), LEASE_TTL));
        serve_graced(&dir, cluster, id, "127.0.0.1:0", "127.0.0.1:0", LONG_GRACE)
    };
    let (a, mut b, c) = (node("a"), node("b"), node("c"));
    wait_placed(&urls);
    let nodes = [&a, &b, &c];
    let alice = user_moving(&urls, "b", "c");

    let (_bob, mut bob_updates) = bob_watching(&nodes, &c, &[alice.as_str()]).await;
    let (phone, _p) = connect(&nodes, &a, &alice, "phone", Kind::Mobile, WatchClaim::all()).await;
    wait_presence(
        &mut bob_updates,
        &alice,
        DEBOUNCE + SLACK,
        "alice online",
        |p| p.online,
    )
    .await;

    let t0 = Instant::now();
    b.proc.kill9();
    let answered = phone.logout().await;
    let answered_after = t0.elapsed();
    assert!(
        answered.is_ok(),
        "the logout is answered \"it will land\", not failed: {answered:?}"
    );
    wait_presence(
        &mut bob_updates,
        &alice,
        LONG_GRACE,
        "alice offline after her logout",
        |p| !p.online,
    )
    .await;
    let took = t0.elapsed();
    println!("logout answered after {answered_after:?}; bob saw alice offline {took:?} after the kill (grace {LONG_GRACE:?})");
    // The claim expires (TTL, plus NATS's expiry lag), c claims it, asks the
    // edges to resend (a resends the phone with its logout), and publishes
    // after the debounce.
    let bound = LEASE_TTL * 2 + DEBOUNCE + SLACK;
    assert!(
        took <= bound,
        "offline {took:?} after the kill: past the failover bound {bound:?}, as if the logout waited for the grace"
    );
    assert_eq!(owner_of(&urls, &alice), "c", "the shard moved to c");
}
