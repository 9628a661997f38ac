//! Overload: what the server does to stay cheap and fair when more comes in
//! than it can take (see issue 15 and the server's `PassBudget`).

use greendot_tests::{TestServer, SLACK};
use greendot_transport::proto::ALPN;
use greendot_transport::{quinn, tls};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A plain quinn client endpoint trusting the test server.
fn client_endpoint(ts: &TestServer) -> quinn::Endpoint {
    let crypto = tls::client_crypto(std::slice::from_ref(ts.server.certificate()), ALPN).unwrap();
    let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    endpoint
}

/// The server advertises the smallest maximum UDP payload, so a client sends
/// no path-MTU probes (padded datagrams the server would parse byte by byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_send_the_server_no_mtu_probes() {
    let ts = TestServer::start(|_| {});
    let endpoint = client_endpoint(&ts);
    let conn = tokio::time::timeout(SLACK, endpoint.connect(ts.addr(), "localhost").unwrap())
        .await
        .expect("handshake in time")
        .expect("handshake");
    // A client probes as soon as the handshake is confirmed: a few round
    // trips on loopback.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stats = conn.stats();
    assert_eq!(stats.path.sent_plpmtud_probes, 0, "{:?}", stats.path);
    assert_eq!(stats.path.current_mtu, 1200);
    conn.close(0u32.into(), b"");
}
