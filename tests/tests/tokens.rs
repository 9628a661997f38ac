//! Tokens on live sessions (docs/protocol.md, "Tokens on live sessions"),
//! over QUIC and over WebSocket: a session whose token runs out is closed
//! with `TokenExpired`; a client with a refresh callback keeps its session
//! past any one token's `exp`; a refresh's narrower `watch` ends the
//! subscriptions it no longer allows; a revocation closes the live sessions
//! holding a revoked token, refuses the token at the hello, and survives a
//! restart.

use greendot_client::{Carrier, Client, ClientConfig, ClientError, Event, TokenRefresh};
use greendot_core::{Status, Tier};
use greendot_proto::{CloseCode, ErrorCode, Kind};
use greendot_server::token::{unix_now, Claims, WatchClaim};
use greendot_tests::{eventually, TestServer, SLACK};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn server(tweak: impl FnOnce(&mut greendot_server::ServerConfig)) -> TestServer {
    TestServer::start(|c| {
        c.websocket = Some(([127, 0, 0, 1], 0).into());
        tweak(c);
    })
}

fn mint(ts: &TestServer, user: &str, device: &str, watch: WatchClaim, ttl: Duration) -> String {
    ts.server
        .mint(&Claims::new(user, device, Kind::Mobile, watch, ttl))
        .unwrap()
}

/// A client over `carrier`: WebSocket by pointing QUIC at a port nobody
/// listens on, so the client falls back.
fn config(ts: &TestServer, token: String, carrier: Carrier) -> ClientConfig {
    let mut config = ts.client_config(token);
    if carrier == Carrier::WebSocket {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let closed: SocketAddr = socket.local_addr().unwrap();
        drop(socket);
        config.servers = vec![closed.into()];
        config.fallback_delay = Duration::from_millis(100);
    }
    config
}

async fn connect(config: ClientConfig, carrier: Carrier) -> (Client, greendot_tests::Recorder) {
    let (client, updates) = Client::connect(config).await.expect("client connects");
    assert_eq!(client.carrier(), carrier);
    (client, greendot_tests::Recorder::new(updates))
}

async fn expiry_closes_the_session(carrier: Carrier) {
    let ts = server(|_| {});
    let token = mint(
        &ts,
        "ann",
        "phone",
        WatchClaim::all(),
        Duration::from_secs(2),
    );
    let exp = greendot_client::token_expiry(&token).unwrap();
    let (ann, mut events) = connect(config(&ts, token, carrier), carrier).await;
    ann.ping().await.unwrap();
    let (_, closed) = events
        .wait_for(Duration::from_secs(2) + SLACK, |e| {
            matches!(e, Event::Closed { .. })
        })
        .await
        .expect("closed once the token ran out");
    // Not before `exp` (leeway 0 in the quick config; 50 ms for clocks read apart).
    assert!(now_ms() + 50 >= exp * 1000, "closed before exp");
    match closed {
        Event::Closed { code, .. } => assert_eq!(code, Some(CloseCode::TokenExpired)),
        other => panic!("{other:?}"),
    }
    assert!(
        !events
            .connection_events()
            .iter()
            .any(|e| matches!(e, Event::Reconnected { .. })),
        "without a refresh callback an expired token is final"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_closes_its_quic_session() {
    expiry_closes_the_session(Carrier::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_closes_its_websocket_session() {
    expiry_closes_the_session(Carrier::WebSocket).await;
}

async fn refresh_keeps_the_session(carrier: Carrier) {
    let ts = Arc::new(server(|_| {}));
    let fetched = Arc::new(AtomicUsize::new(0));
    let first = mint(
        &ts,
        "bo",
        "phone",
        WatchClaim::all(),
        Duration::from_secs(2),
    );
    let first_exp = greendot_client::token_expiry(&first).unwrap();
    let mut config = config(&ts, first, carrier);
    let (server, count) = (ts.clone(), fetched.clone());
    config.refresh = Some(TokenRefresh::new(move || {
        count.fetch_add(1, Ordering::SeqCst);
        let token = mint(
            &server,
            "bo",
            "phone",
            WatchClaim::all(),
            Duration::from_secs(2),
        );
        async move { Ok(token) }
    }));
    config.refresh_ahead = Duration::from_secs(1);
    let (bo, mut events) = connect(config, carrier).await;
    let session = bo.session();
    // Two refreshes on the live connection carry it past the first token's
    // exp (and past the second's).
    for _ in 0..2 {
        events
            .wait_for(Duration::from_secs(2) + SLACK, |e| {
                matches!(e, Event::TokenRefreshed { .. })
            })
            .await
            .expect("refreshed before expiry");
    }
    assert!(now_ms() > first_exp * 1000, "past the first token's exp");
    bo.ping().await.expect("still connected");
    assert_eq!(bo.session(), session);
    assert!(
        events
            .connection_events()
            .iter()
            .all(|e| matches!(e, Event::TokenRefreshed { .. })),
        "never disconnected: {:?}",
        events.connection_events()
    );
    assert!(fetched.load(Ordering::SeqCst) >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refreshed_quic_session_outlives_its_first_token() {
    refresh_keeps_the_session(Carrier::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refreshed_websocket_session_outlives_its_first_token() {
    refresh_keeps_the_session(Carrier::WebSocket).await;
}

async fn narrower_watch_ends_subscriptions(carrier: Carrier) {
    let ts = server(|_| {});
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let (bob, _) = ts.connect("bob", "pc", Kind::Desktop).await;
    let (carol, _) = ts.connect("carol", "pc", Kind::Desktop).await;
    let ttl = Duration::from_secs(600);
    let token = mint(&ts, "ann", "phone", WatchClaim::only(["bob", "carol"]), ttl);
    let (ann, mut seen) = connect(config(&ts, token, carrier), carrier).await;
    let subscribed = ann
        .subscribe(&["bob", "carol"], Tier::Realtime)
        .await
        .unwrap();
    assert_eq!(subscribed.snapshots.len(), 2);

    // A token for another device is refused; the connection goes on.
    let other = mint(&ts, "ann", "laptop", WatchClaim::all(), ttl);
    match ann.refresh(&other).await {
        Err(ClientError::Server(e)) => assert_eq!(e.code, ErrorCode::BadToken),
        other => panic!("{other:?}"),
    }
    // A forged one too.
    match ann.refresh("a.b.c").await {
        Err(ClientError::Server(e)) => assert_eq!(e.code, ErrorCode::BadToken),
        other => panic!("{other:?}"),
    }

    let narrower = mint(&ts, "ann", "phone", WatchClaim::only(["bob"]), ttl);
    let ended = ann.refresh(&narrower).await.unwrap();
    assert_eq!(ended, vec!["carol".to_string()]);
    // carol's changes no longer reach ann; bob's still do.
    carol
        .set_status(Status::Busy, Some("carol after"))
        .await
        .unwrap();
    bob.set_status(Status::Busy, Some("bob after"))
        .await
        .unwrap();
    seen.wait_presence("bob", wait, |p| p.message.as_deref() == Some("bob after"))
        .await
        .expect("bob still watched");
    assert!(
        seen.presences_of("carol")
            .all(|p| p.message.as_deref() != Some("carol after")),
        "a push for an ended subscription"
    );
    let again = ann.subscribe(&["carol"], Tier::Realtime).await.unwrap();
    assert_eq!(again.refused.len(), 1);
    assert_eq!(again.refused[0].error.code, ErrorCode::NotAllowed);
    // A wider token allows it again.
    let wider = mint(&ts, "ann", "phone", WatchClaim::all(), ttl);
    assert!(ann.refresh(&wider).await.unwrap().is_empty());
    let back = ann.subscribe(&["carol"], Tier::Realtime).await.unwrap();
    assert_eq!(back.snapshots.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_narrower_refresh_ends_quic_subscriptions() {
    narrower_watch_ends_subscriptions(Carrier::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_narrower_refresh_ends_websocket_subscriptions() {
    narrower_watch_ends_subscriptions(Carrier::WebSocket).await;
}

/// A revocation of one device closes its session (QUIC) and, of the whole
/// user, the other (WebSocket); old tokens are refused at the hello, also
/// after a restart on the same store; a newer token is welcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_closes_live_sessions_and_survives_a_restart() {
    let dir = std::env::temp_dir().join(format!("greendot-tokens-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("store.redb");
    let store = path.clone();
    let ts = server(move |c| c.store = Some(store));
    let ttl = Duration::from_secs(600);
    let phone_token = mint(&ts, "ann", "phone", WatchClaim::all(), ttl);
    let laptop_token = mint(&ts, "ann", "laptop", WatchClaim::all(), ttl);
    let (phone, mut phone_events) = connect(
        config(&ts, phone_token.clone(), Carrier::Quic),
        Carrier::Quic,
    )
    .await;
    let (laptop, mut laptop_events) = connect(
        config(&ts, laptop_token.clone(), Carrier::WebSocket),
        Carrier::WebSocket,
    )
    .await;
    let (watcher, mut seen) = ts.connect("walt", "pc", Kind::Desktop).await;
    watcher.subscribe(&["ann"], Tier::Realtime).await.unwrap();
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    seen.wait_presence("ann", wait, |p| p.online && p.kinds.bits() == 1)
        .await
        .expect("ann online");

    // A user token may not revoke.
    let before = unix_now() + 1;
    let (svc, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;
    match laptop.revoke("ann", None, before).await {
        Err(ClientError::Server(e)) => assert_eq!(e.code, ErrorCode::ServiceOnly),
        other => panic!("{other:?}"),
    }

    assert_eq!(svc.revoke("ann", Some("phone"), before).await.unwrap(), 1);
    let (_, closed) = phone_events
        .wait_for(SLACK, |e| matches!(e, Event::Closed { .. }))
        .await
        .expect("the phone is closed");
    assert!(
        matches!(
            closed,
            Event::Closed {
                code: Some(CloseCode::Revoked),
                ..
            }
        ),
        "{closed:?}"
    );
    laptop.ping().await.expect("the laptop is not revoked");
    match Client::connect(config(&ts, phone_token.clone(), Carrier::Quic)).await {
        Err(ClientError::Rejected { code, error }) => {
            assert_eq!(code, Some(CloseCode::Revoked));
            assert_eq!(error.code, ErrorCode::TokenRevoked);
        }
        other => panic!("a revoked token was welcome: {:?}", other.map(|_| ())),
    }
    drop(phone);

    assert_eq!(svc.revoke("ann", None, before).await.unwrap(), 1);
    let (_, closed) = laptop_events
        .wait_for(SLACK, |e| matches!(e, Event::Closed { .. }))
        .await
        .expect("the laptop is closed");
    assert!(
        matches!(
            closed,
            Event::Closed {
                code: Some(CloseCode::Revoked),
                ..
            }
        ),
        "{closed:?}"
    );
    // Revoked is final: ann is offline at once (a logout), not after grace.
    seen.wait_presence("ann", wait, |p| !p.online)
        .await
        .expect("ann offline");
    drop((laptop, svc, watcher));

    // After a restart on the same store the old tokens are still refused.
    ts.server.shutdown().await;
    // The old server's store writer lets the file go once its task is gone.
    let mut restarted = None;
    let reopened = eventually(SLACK, || {
        if restarted.is_none() {
            let mut c = greendot_tests::quick_config();
            c.websocket = Some(([127, 0, 0, 1], 0).into());
            c.store = Some(path.clone());
            restarted = greendot_server::Server::bind(c).ok();
        }
        restarted.is_some()
    })
    .await;
    assert!(reopened, "the store did not reopen");
    let ts = TestServer {
        server: restarted.unwrap(),
    };
    for (token, carrier) in [
        (&phone_token, Carrier::Quic),
        (&laptop_token, Carrier::WebSocket),
    ] {
        match Client::connect(config(&ts, token.clone(), carrier)).await {
            Err(ClientError::Rejected { code, .. }) => assert_eq!(code, Some(CloseCode::Revoked)),
            other => panic!("a revoked token was welcome: {:?}", other.map(|_| ())),
        }
    }
    // A token issued at `before` (not before it) is welcome.
    let mut claims = Claims::new("ann", "phone", Kind::Mobile, WatchClaim::all(), ttl);
    claims.iat = Some(before);
    let fresh = ts.server.mint(&claims).unwrap();
    let (ann, _) = connect(config(&ts, fresh, Carrier::Quic), Carrier::Quic).await;
    ann.ping().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
