//! Hostile clients: what a client with a valid token but bad intentions can
//! make the server hold, and how it is stopped.

use greendot_core::Tier;
use greendot_tests::TestServer;
use greendot_transport::proto::{ErrorCode, Kind};
use greendot_transport::server::RateLimit;
use greendot_transport::token::WatchClaim;

/// A deterministic stream of names nobody uses.
fn random_names(seed: u64, n: usize) -> Vec<String> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            format!("stranger-{x:016x}")
        })
        .collect()
}

/// A token limited to a watch list cannot make the server remember anybody
/// else: every refused target is refused before its name is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_targets_create_no_names_and_no_users() {
    let ts = TestServer::start(|c| {
        c.rate = RateLimit {
            per_second: 10_000,
            burst: 10_000,
        }
    });
    let token = ts.token(
        "mallory",
        "laptop",
        Kind::Desktop,
        WatchClaim::only(["alice", "bob"]),
    );
    let (client, _events) = ts.connect_with(ts.client_config(token)).await;
    let granted = client.subscribe(&["bob"], Tier::Realtime).await.unwrap();
    assert!(granted.refused.is_empty());
    let before = ts.server.monitor().metrics().await.unwrap();
    assert!(before.users_known >= 2 && before.names >= 3);

    let names = random_names(0x5eed, 100_000);
    for chunk in names.chunks(1_000) {
        let answer = client.subscribe(chunk, Tier::Realtime).await.unwrap();
        assert!(answer.snapshots.is_empty());
        assert_eq!(answer.refused.len(), chunk.len());
        assert!(answer
            .refused
            .iter()
            .all(|r| r.error.code == ErrorCode::NotAllowed));
    }
    // Queries and unsubscribes of strangers keep nothing either.
    for name in names.iter().take(100) {
        let error = client.query(name).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::NotAllowed));
        let error = client.unsubscribe(name).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::NotSubscribed));
    }
    let after = ts.server.monitor().metrics().await.unwrap();
    assert_eq!(after.users_known, before.users_known);
    assert_eq!(after.names, before.names);
    client.ping().await.unwrap();
}
