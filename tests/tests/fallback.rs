//! The Rust client where UDP is blocked: it tries QUIC, falls back to
//! WebSocket over TLS when no QUIC handshake completes within its
//! `fallback_delay`, serves everything over it (requests, both push
//! streams, reconnect with resume, logout), goes back to QUIC on its next
//! reconnect once UDP works, and after `network_changed()` over a dead TCP
//! connection reconnects at once instead of after its idle timeout.

use greendot_client::{Carrier, ClientConfig, Event, Source};
use greendot_core::{Status, Tier};
use greendot_proto::{CloseCode, Kind};
use greendot_server::token::WatchClaim;
use greendot_tests::{eventually, Relay, TcpProxy, TestServer, SLACK};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;

fn server() -> TestServer {
    TestServer::start(|c| c.websocket = Some(([127, 0, 0, 1], 0).into()))
}

/// A UDP port nobody listens on (bound, then released).
fn closed_udp_port() -> SocketAddr {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap()
}

fn config(ts: &TestServer, user: &str, quic: SocketAddr, websocket: SocketAddr) -> ClientConfig {
    let mut config = ts.client_config(ts.token(user, "phone", Kind::Mobile, WatchClaim::all()));
    config.servers = vec![quic.into()];
    config.websocket = greendot_client::WebSocket::At(websocket);
    config.fallback_delay = Duration::from_millis(300);
    config
}

/// `greendot_connections` by binding, as the metrics page shows it.
async fn connections_metric(ts: &TestServer) -> (u64, u64) {
    let text = ts.server.monitor().metrics().await.unwrap().render();
    let value = |binding: &str| {
        let key = format!("greendot_connections{{binding=\"{binding}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .unwrap_or_else(|| panic!("no {key} in the metrics"))
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    (value("quic"), value("websocket"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_udp_is_blocked_is_served_over_websocket() {
    let ts = server();
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let proxy = TcpProxy::start(ts.server.websocket_addr().unwrap()).await;
    let (walt, mut walt_seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let (bob, _bob_seen) = ts.connect("bob", "laptop", Kind::Desktop).await;
    assert_eq!(walt.carrier(), Carrier::Quic);

    let started = Instant::now();
    let (mia, mut mia_seen) = ts
        .connect_with(config(&ts, "mia", closed_udp_port(), proxy.addr))
        .await;
    let took = started.elapsed();
    assert_eq!(mia.carrier(), Carrier::WebSocket);
    let stats = mia.stats();
    assert_eq!(
        (stats.quic_connections, stats.websocket_connections),
        (0, 1)
    );
    // Not after QUIC's 3 s connect timeout: after the fallback delay.
    assert!(took < Duration::from_secs(2), "fallback took {took:?}");
    // The server sees it: one QUIC connection each for walt and bob, one
    // WebSocket for mia.
    assert!(eventually(SLACK, || ts.server.stats().connections_open_websocket == 1).await);
    assert_eq!(connections_metric(&ts).await, (2, 1));

    // Requests and both push streams.
    let sub = mia.subscribe(&["walt"], Tier::Realtime).await.unwrap();
    assert_eq!(sub.snapshots.len(), 1);
    mia.subscribe(&["bob"], Tier::Batched).await.unwrap();
    walt.subscribe(&["mia"], Tier::Realtime).await.unwrap();
    walt_seen
        .wait_presence("mia", wait, |p| p.online)
        .await
        .expect("walt sees mia online");
    mia.set_status(Status::Busy, Some("on a train"))
        .await
        .unwrap();
    walt_seen
        .wait_presence("mia", wait, |p| p.status == Status::Busy)
        .await
        .expect("walt sees mia busy");
    walt.set_status(Status::Away, Some("lunch")).await.unwrap();
    mia_seen
        .wait_for(wait, |e| {
            matches!(e, Event::Presence { target, presence, source: Source::Realtime }
                if target == "walt" && presence.status == Status::Away)
        })
        .await
        .expect("a realtime push over WebSocket");
    bob.set_status(Status::DoNotDisturb, None).await.unwrap();
    let batch = Duration::from_millis(ts.config().core.batch_interval.0);
    mia_seen
        .wait_for(wait + batch, |e| {
            matches!(e, Event::Presence { target, presence, source: Source::Batched }
                if target == "bob" && presence.status == Status::DoNotDisturb)
        })
        .await
        .expect("a batched push over WebSocket");
    assert_eq!(mia.query("walt").await.unwrap().status, Status::Away);

    // The TCP connection dies: the client reconnects (QUIC is still
    // blocked, so over WebSocket again) and resumes; walt sees nothing.
    walt_seen.reset();
    proxy.cut();
    let (_, event) = mia_seen
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("mia reconnects");
    assert!(
        matches!(
            event,
            Event::Reconnected {
                resumed: true,
                carrier: Carrier::WebSocket,
                ..
            }
        ),
        "{event:?}"
    );
    assert_eq!(mia.stats().websocket_connections, 2);
    walt.set_status(Status::Available, Some("back"))
        .await
        .unwrap();
    mia_seen
        .wait_presence("walt", wait, |p| p.message.as_deref() == Some("back"))
        .await
        .expect("pushes after the resume");

    // Logout with the logout close code: mia is offline at once (not
    // after her grace) and her client is finished.
    let grace = Duration::from_millis(ts.config().core.kinds[0].grace.0);
    let logout = Instant::now();
    mia.logout().await.unwrap();
    let (at, _) = walt_seen
        .wait_presence("mia", wait, |p| !p.online)
        .await
        .expect("walt sees mia offline");
    assert!(at - logout < grace, "offline after {:?}", at - logout);
    assert_eq!(walt_seen.offline_count("mia"), 1, "one offline, at logout");
    let (_, closed) = mia_seen
        .wait_for(SLACK, |e| matches!(e, Event::Closed { .. }))
        .await
        .expect("mia's client finishes");
    assert!(
        matches!(
            closed,
            Event::Closed {
                code: Some(CloseCode::Logout),
                ..
            }
        ),
        "{closed:?}"
    );
    assert!(eventually(SLACK, || ts.server.stats().connections_open_websocket == 0).await);
    let counters = ts.server.counters().await.unwrap();
    assert_eq!(counters.logouts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_fell_back_uses_quic_again_on_its_next_reconnect() {
    let ts = server();
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let relay = Relay::start(ts.addr()).await;
    relay.cut(true);
    let proxy = TcpProxy::start(ts.server.websocket_addr().unwrap()).await;
    let (walt, mut walt_seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let mut cfg = config(&ts, "mia", relay.addr, proxy.addr);
    // QUIC gets a whole second of head start on the reconnect, so that it
    // wins even on a loaded machine.
    cfg.fallback_delay = Duration::from_secs(1);
    let (mia, mut mia_seen) = ts.connect_with(cfg).await;
    assert_eq!(mia.carrier(), Carrier::WebSocket);
    mia.subscribe(&["walt"], Tier::Realtime).await.unwrap();
    walt.subscribe(&["mia"], Tier::Realtime).await.unwrap();
    walt_seen
        .wait_presence("mia", wait, |p| p.online)
        .await
        .expect("mia online");
    walt_seen.reset();

    // UDP works again; the WebSocket connection is lost.
    relay.cut(false);
    proxy.cut();
    let (_, event) = mia_seen
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("mia reconnects");
    assert!(
        matches!(
            event,
            Event::Reconnected {
                resumed: true,
                carrier: Carrier::Quic,
                ..
            }
        ),
        "{event:?}"
    );
    let stats = mia.stats();
    assert_eq!(stats.carrier, Carrier::Quic);
    assert_eq!(
        (stats.quic_connections, stats.websocket_connections),
        (1, 1)
    );
    assert_eq!(proxy.connections(), 0, "no WebSocket was needed");
    assert!(eventually(SLACK, || ts.server.stats().connections_open_websocket == 0).await);
    assert_eq!(connections_metric(&ts).await, (2, 0));

    // The session carried on over QUIC.
    walt.set_status(Status::Busy, Some("over QUIC"))
        .await
        .unwrap();
    mia_seen
        .wait_presence("walt", wait, |p| p.message.as_deref() == Some("over QUIC"))
        .await
        .expect("pushes over QUIC");
    mia.set_status(Status::Away, None).await.unwrap();
    walt_seen
        .wait_presence("mia", wait, |p| p.status == Status::Away)
        .await
        .expect("requests over QUIC");
    assert_eq!(walt_seen.offline_count("mia"), 0);
}

/// A WebSocket link that went dark (no FIN, no RST): without a call the
/// client would notice only after its idle timeout; `network_changed()`
/// probes, and reconnects within `probe_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_changed_over_a_dead_websocket_reconnects_at_once() {
    let ts = server();
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let proxy = TcpProxy::start(ts.server.websocket_addr().unwrap()).await;
    let (walt, _walt_seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let mut cfg = config(&ts, "mia", closed_udp_port(), proxy.addr);
    // The client alone would take 30 s to notice.
    cfg.keep_alive = Duration::from_secs(10);
    cfg.idle_timeout = Duration::from_secs(30);
    cfg.probe_timeout = Duration::from_millis(500);
    let (mia, mut mia_seen) = ts.connect_with(cfg).await;
    assert_eq!(mia.carrier(), Carrier::WebSocket);
    mia.subscribe(&["walt"], Tier::Realtime).await.unwrap();

    proxy.freeze();
    let changed = Instant::now();
    mia.network_changed();
    let (at, _) = mia_seen
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("mia reconnects after network_changed");
    // The probe's 500 ms, the fallback delay, a handshake: well under the
    // 30 s idle timeout.
    assert!(at - changed < Duration::from_secs(3), "{:?}", at - changed);
    walt.set_status(Status::Busy, Some("after the change"))
        .await
        .unwrap();
    mia_seen
        .wait_presence("walt", wait, |p| {
            p.message.as_deref() == Some("after the change")
        })
        .await
        .expect("pushes on the new connection");
}
