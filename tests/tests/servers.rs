//! A client given several servers, or a host name: it skips an address
//! that does not answer, moves to a live server when its own drains, and
//! checks the server's certificate against what `trust` says.

use greendot_client::{
    Certificate, Client, ClientConfig, ClientError, ConnectError, Event, ServerAddr, Trust,
    WebSocket,
};
use greendot_core::Status;
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_tests::{Relay, TestServer, SLACK};
use std::net::SocketAddr;
use std::time::Duration;

/// A loopback UDP port with nothing behind it (bound, then closed).
fn dead_udp_port() -> SocketAddr {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap()
}

fn config_for(ts: &TestServer, user: &str, servers: Vec<ServerAddr>) -> ClientConfig {
    let mut config = ts.client_config(ts.token(user, "phone", Kind::Mobile, WatchClaim::all()));
    config.servers = servers;
    config.websocket = WebSocket::Off;
    // A dead address costs `address_delay` (250 ms) while another is
    // tried, and one connect timeout once every other attempt failed.
    config.connect_timeout = Duration::from_secs(1);
    config
}

/// The first address is dead: the client connects to the next. Then its
/// server drains: it moves to the other live one, subscribes again there,
/// and hears the watched user's status set on that server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_skips_a_dead_address_and_leaves_a_draining_server_for_a_live_one() {
    let a = TestServer::start(|_| {});
    // Same secret (quick_config): a token of one is good on the other.
    let b = TestServer::start(|_| {});
    let dead = dead_udp_port();
    let servers = vec![dead.into(), a.addr().into(), b.addr().into()];
    let (client, mut events) = a.connect_with(config_for(&a, "ivy", servers)).await;
    assert_eq!(
        client.stats().server,
        a.addr(),
        "connected past the dead address"
    );
    client
        .subscribe(&["walt"], greendot_core::Tier::Realtime)
        .await
        .unwrap();

    let TestServer { server } = a;
    server.drain().await;
    let (_, reconnected) = events
        .wait_for(SLACK + SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("the client reconnects to a live server");
    assert!(
        matches!(reconnected, Event::Reconnected { resumed: false, .. }),
        "{reconnected:?}"
    );
    assert_eq!(client.stats().server, b.addr());

    // Its subscription carried over to b: walt's status there reaches it.
    let (walt, _walt_events) = b.connect("walt", "laptop", Kind::Desktop).await;
    walt.set_status(Status::Busy, Some("on b")).await.unwrap();
    events
        .wait_presence("walt", SLACK, |p| p.status == Status::Busy)
        .await
        .expect("the subscription works on the new server");
    client.ping().await.unwrap();
}

/// Addresses are raced, staggered: with a connect timeout of a minute, a
/// dead first address delays the connect by `address_delay`, not by the
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_address_costs_the_address_delay_not_the_connect_timeout() {
    let a = TestServer::start(|_| {});
    // Bound and kept: datagrams to it vanish, with no ICMP error to end the
    // attempt early.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let servers = vec![silent.local_addr().unwrap().into(), a.addr().into()];
    let mut config = config_for(&a, "ivy", servers);
    config.connect_timeout = Duration::from_secs(60);
    // QUIC gives up a handshake after the idle timeout: long here too.
    config.idle_timeout = Duration::from_secs(60);
    let connected = tokio::time::timeout(SLACK, Client::connect(config))
        .await
        .expect("the live address was not tried before the dead one timed out")
        .expect("connects");
    assert_eq!(connected.0.stats().server, a.addr());
}

/// After a lost connection the client tries the other server first: here
/// the path to its first one is back by the time it reconnects, yet it
/// goes to the second (a node that just failed its clients is the least
/// likely to serve them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_loss_the_other_server_is_tried_first() {
    let a = TestServer::start(|_| {});
    let b = TestServer::start(|_| {});
    let relay = Relay::start(a.addr()).await;
    let servers = vec![relay.addr.into(), b.addr().into()];
    let (client, mut events) = a.connect_with(config_for(&a, "rosa", servers)).await;
    assert_eq!(client.stats().server, relay.addr);

    relay.cut(true);
    let idle = a.config().idle_timeout;
    events
        .wait_for(idle + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("the client notices the dead path");
    relay.cut(false);
    events
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("the client reconnects");
    assert_eq!(
        client.stats().server,
        b.addr(),
        "went back to the server it lost"
    );
    client.ping().await.unwrap();
}

/// `localhost:PORT` is resolved (every address it names is tried: `::1`,
/// where the server does not listen, costs one connect timeout) and its
/// name is the one checked in the certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_is_resolved_and_checked() {
    let ts = TestServer::start(|_| {});
    let host = ServerAddr::parse(&format!("localhost:{}", ts.addr().port())).unwrap();
    let mut config = config_for(&ts, "hana", vec![host]);
    config.bind = None;
    let (client, _events) = ts.connect_with(config).await;
    client.ping().await.unwrap();
    assert_eq!(client.stats().server.port(), ts.addr().port());
    assert!(client.stats().server.ip().is_loopback());

    // A name the certificate does not have is refused.
    let other = ServerAddr::parse(&format!("localhost:{}", ts.addr().port())).unwrap();
    let mut config = config_for(&ts, "hana", vec![other]);
    config.bind = None;
    config.server_name = Some("elsewhere.example".into());
    config.reconnect = None;
    let refused = Client::connect(config).await;
    assert!(
        matches!(refused, Err(ClientError::Connect(_))),
        "{:?}",
        refused.err()
    );
}

/// Pins: the certificate's SHA-256 is enough (and another hash refuses);
/// the platform's trust store does not know a self-signed test server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trust_by_certificate_hash_or_the_platform_store() {
    let ts = TestServer::start(|_| {});
    let cert = Certificate::from_der(ts.server.certificate().to_vec());
    let mut config = config_for(&ts, "pia", vec![ts.addr().into()]);
    config.reconnect = None;
    config.trust = Trust::CertificateHashes(vec![cert.sha256()]);
    let (client, _events) = ts.connect_with(config.clone()).await;
    client.ping().await.unwrap();

    for trust in [Trust::CertificateHashes(vec![[0; 32]]), Trust::Platform] {
        config.trust = trust.clone();
        match Client::connect(config.clone()).await {
            Err(ClientError::Connect(ConnectError::QuicHandshake(_))) => {}
            other => panic!("{trust:?}: {:?}", other.err()),
        }
    }
}
