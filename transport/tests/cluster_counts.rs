//! The open-connection count of a cluster node stays true when a
//! connection ends while its welcome waits for another node's record.
//!
//! The sequence that wrapped it: a client reconnects to a node with the
//! session id of an earlier node (a resume), the node opens the push streams
//! at the welcome, cannot (here: the client allows none; in the field: the
//! client had already given up and closed), closes with `ProtocolError`, and
//! then went on to wait for the record read. That wait made the ended
//! connection open again, its end was counted twice, and the count read
//! 18446744073709551615: every later client was refused
//! `TooManyConnections … retry_ms=6148914691236517`.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use support::{metric, Proc};

use greendot_client::rustls::pki_types::pem::PemObject;
use greendot_client::rustls::pki_types::CertificateDer;
use greendot_client::{Client, ClientConfig};
use greendot_cluster::testing::NatsCluster;
use greendot_proto::{self as proto, CloseCode, Hello, Kind};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};

const BIN: &str = env!("CARGO_BIN_EXE_greendot");
const SECRET: &str = "0123456789abcdef0123456789abcdef";
/// A loaded 2-core machine, NATS round trips, process start.
const SLACK: Duration = Duration::from_secs(30);

fn token(user: &str, device: &str) -> String {
    let claims = Claims::new(
        user,
        device,
        Kind::Desktop,
        WatchClaim::default(),
        Duration::from_secs(3600),
    );
    TokenKeys::new(SECRET.as_bytes(), Duration::ZERO)
        .mint(&claims)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_at_its_welcome_is_uncounted_once() {
    let nats = NatsCluster::start(1).await;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cluster-counts");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    let mut command = Command::new(BIN);
    command
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(dir.join("a"))
        .arg("--secret-file")
        .arg(dir.join("secret"))
        .args(["--cluster", &nats.urls(), "--node-id", "a"])
        .args(["--cluster-shards", "8", "--cluster-lease-ttl", "2s"])
        .args(["--cluster-replicas", "1"])
        .args(["--websocket", "off"])
        .env(
            "RUST_LOG",
            "warn,greendot::connections=debug,greendot_server::state=debug",
        );
    let mut node = Proc::spawn("a", command);
    let addr = node.listening_addr(SLACK);
    let metrics = node.metrics_addr(SLACK);
    let cert = CertificateDer::from_pem_file(dir.join("a").join("cert.pem")).unwrap();
    let quic = "greendot_connections{binding=\"quic\"}";

    // A client that allows no push streams, resuming a session no node has.
    let crypto =
        greendot_client::tls::client_crypto(std::slice::from_ref(&cert), proto::ALPN).unwrap();
    let mut transport = quinn::TransportConfig::default();
    transport.max_concurrent_uni_streams(0u32.into());
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport));
    let mut endpoint = quinn::Endpoint::client(([127, 0, 0, 1], 0).into()).unwrap();
    endpoint.set_default_client_config(client);
    let conn = endpoint.connect(addr, "localhost").unwrap().await.unwrap();
    let hello = Hello {
        version: proto::VERSION,
        token: token("ann", "laptop"),
        resume: Some(0x00ab_cdef_0000_0042),
        foreground: true,
    };
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&proto::encode_frame(&hello).unwrap())
        .await
        .unwrap();
    let closed = tokio::time::timeout(SLACK, conn.closed())
        .await
        .expect("the server closes a client that allows no push streams");
    match closed {
        quinn::ConnectionError::ApplicationClosed(c) => assert_eq!(
            CloseCode::from_code(c.error_code.into_inner()),
            Some(CloseCode::ProtocolError),
            "{c:?}"
        ),
        other => panic!("closed otherwise: {other}"),
    }
    drop(conn);
    endpoint.wait_idle().await;

    // The server forgets the connection once its close has drained (a few
    // round trips on loopback); that end must not be counted again (it was,
    // and the count wrapped).
    node.wait_for(SLACK, "that forgets the connection", |l| {
        l.contains("connection forgotten")
    });
    assert_eq!(metric(&metrics, quic), Some(0));

    // An ordinary client is served, and counted once (at its handshake,
    // before its welcome).
    let mut config = ClientConfig::new(addr, vec![cert], token("bob", "phone"));
    config.reconnect = None;
    config.websocket = greendot_client::WebSocket::Off;
    let (bob, _updates) = Client::connect(config)
        .await
        .expect("an ordinary client is served after it");
    assert_eq!(metric(&metrics, quic), Some(1));
    bob.close().await;
    // Uncounted before its end is reported.
    node.wait_for(SLACK, "with the client's end", |l| {
        l.contains("greendot::connections") && l.contains(" closed ")
    });
    assert_eq!(metric(&metrics, quic), Some(0));
    node.drain();
    assert!(
        !node.seen.iter().any(|l| l.contains("TooManyConnections")),
        "{}",
        node.seen.join("\n")
    );
}
