//! Hostile clients: what a client with a valid token but bad intentions can
//! make the server hold, and how it is stopped.

use greendot_core::Tier;
use greendot_tests::TestServer;
use greendot_transport::client::{Client, ClientError};
use greendot_transport::proto::{CloseCode, ErrorCode, Kind};
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

/// Names with control characters are refused wherever a name is taken, with
/// `BadRequest`, and never echoed back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_with_control_characters_are_refused() {
    let ts = TestServer::start(|_| {});
    let bad = [
        "nul\0user",
        "new\nline",
        "esc\x1b[31m",
        "del\x7f",
        "c1\u{85}",
    ];
    for name in bad {
        for (user, device) in [(name, "phone"), ("fine", name)] {
            let token = ts.token(user, device, Kind::Mobile, WatchClaim::all());
            let error = Client::connect(ts.client_config(token)).await.err();
            let error = error.unwrap_or_else(|| panic!("{user:?}/{device:?} connected"));
            assert_eq!(error.code(), Some(ErrorCode::BadRequest), "{error}");
            assert!(
                matches!(
                    &error,
                    ClientError::Rejected {
                        code: Some(CloseCode::Refused),
                        ..
                    }
                ),
                "{error:?}"
            );
        }
        let token = ts.token("fine", "phone", Kind::Mobile, WatchClaim::only([name]));
        let error = Client::connect(ts.client_config(token)).await.err();
        assert_eq!(error.and_then(|e| e.code()), Some(ErrorCode::BadRequest));
    }
    let before = ts.server.monitor().metrics().await.unwrap();
    let (client, _events) = ts.connect("fine", "phone", Kind::Mobile).await;
    let (service, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;
    for name in bad {
        let answer = client.subscribe(&[name], Tier::Batched).await.unwrap();
        assert_eq!(answer.refused[0].error.code, ErrorCode::BadRequest);
        let error = client.query(name).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::BadRequest));
        let error = client.unsubscribe(name).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::BadRequest));
        let error = service.route(name).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::BadRequest));
    }
    // Nothing was kept of the bad names (the two good users and their
    // devices are all that was added).
    let after = ts.server.monitor().metrics().await.unwrap();
    assert_eq!(after.users_known, before.users_known + 2);
    client.ping().await.unwrap();
}
