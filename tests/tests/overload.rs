//! Overload: what the server does to stay cheap and fair when more comes in
//! than it can take (see issue 15 and the server's `PassBudget`).

use greendot_client::{quinn, tls};
use greendot_proto::ALPN;
use greendot_tests::{TestServer, SLACK};
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

/// A plain client's connection statistics once its handshake is confirmed
/// (HANDSHAKE_DONE received), against a server advertising
/// `max_udp_payload`. quinn starts path-MTU discovery as soon as the
/// handshake completes on its side (the first time it has nothing else to
/// send), a round trip before the confirmation arrives: a client that
/// probes at all has probed by then.
async fn stats_once_confirmed(max_udp_payload: u16) -> quinn::ConnectionStats {
    let ts = TestServer::start(|c| c.max_udp_payload = max_udp_payload);
    let endpoint = client_endpoint(&ts);
    let conn = tokio::time::timeout(SLACK, endpoint.connect(ts.addr(), "localhost").unwrap())
        .await
        .expect("handshake in time")
        .expect("handshake");
    let confirmed =
        greendot_tests::eventually(SLACK, || conn.stats().frame_rx.handshake_done > 0).await;
    assert!(confirmed, "no HANDSHAKE_DONE within {SLACK:?}");
    let stats = conn.stats();
    conn.close(0u32.into(), b"");
    stats
}

/// The server advertises the smallest maximum UDP payload, so a client sends
/// no path-MTU probes (padded datagrams the server would parse byte by byte).
/// The same wait against a server that advertises more sees probes: the
/// wait is long enough for a probe to show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_send_the_server_no_mtu_probes() {
    let probed = stats_once_confirmed(1452).await;
    assert!(
        probed.path.sent_plpmtud_probes > 0,
        "a server advertising 1452 bytes was not probed: {:?}",
        probed.path
    );
    let stats = stats_once_confirmed(1200).await;
    assert_eq!(stats.path.sent_plpmtud_probes, 0, "{:?}", stats.path);
    assert_eq!(stats.path.current_mtu, 1200);
}

/// Initials of clients that will never answer, each a new connection, as
/// a spoofing flood sends them.
fn initials(ts: &TestServer, n: usize) -> Vec<Vec<u8>> {
    let crypto = tls::client_crypto(std::slice::from_ref(ts.server.certificate()), ALPN).unwrap();
    let config = quinn_proto::ClientConfig::new(Arc::new(crypto));
    let mut endpoint = quinn_proto::Endpoint::new(
        Arc::new(quinn_proto::EndpointConfig::default()),
        None,
        false,
        None,
    );
    let now = std::time::Instant::now();
    (0..n)
        .map(|_| {
            let (_, mut conn) = endpoint
                .connect(now, config.clone(), ts.addr(), "localhost")
                .unwrap();
            let mut buf = Vec::new();
            let t = conn.poll_transmit(now, 1, &mut buf).unwrap();
            buf.truncate(t.size);
            buf
        })
        .collect()
}

/// A flood of Initials from many source ports (as from spoofed addresses:
/// nobody completes them) costs the server a stateless Retry each once a
/// few handshakes are in flight, so it never holds more than a few
/// half-open handshakes, and a real client still connects and is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_initials_gets_retries_and_a_real_client_is_served() {
    const THRESHOLD: usize = 16;
    const FLOOD: usize = 1500;
    let ts = TestServer::start(|c| {
        c.retry_threshold = THRESHOLD;
    });
    let flood = initials(&ts, FLOOD);
    let to = ts.addr();
    let sockets: Vec<std::net::UdpSocket> = (0..100)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let send = |part: &[Vec<u8>]| {
        for (i, initial) in part.iter().enumerate() {
            let _ = sockets[i % sockets.len()].send_to(initial, to);
        }
    };
    let (first, rest) = flood.split_at(FLOOD / 2);
    send(first);

    // A real client connects while the rest of the flood arrives.
    let connecting = tokio::time::timeout(
        SLACK,
        ts.connect("ann", "phone", greendot_proto::Kind::Mobile),
    );
    let (connected, ()) = tokio::join!(connecting, async { send(rest) });
    let (ann, _events) = connected.expect("the real client connects during the flood");
    ann.subscribe(&["bob"], greendot_core::Tier::Realtime)
        .await
        .expect("and is served");

    let metrics = ts.server.monitor().metrics().await.unwrap();
    assert!(
        metrics.handshakes_in_flight <= THRESHOLD as u64 + 1,
        "the server holds {} half-open handshakes",
        metrics.handshakes_in_flight
    );
    assert!(
        metrics.shed("retry") >= (FLOOD - THRESHOLD - 1) as u64,
        "{:?}",
        metrics.shed
    );
    // Overload is visible: the loop's passes and the socket as the kernel
    // sees it.
    assert!(metrics.loop_pass.0.last().is_some_and(|&n| n > 0));
    #[cfg(target_os = "linux")]
    assert!(
        metrics.udp.is_some(),
        "the socket is not found in /proc/net/udp"
    );
    let text = metrics.render();
    assert!(text.contains("greendot_shed_total{reason=\"retry\"}"));
}

/// A drain's close tells clients over how long to spread their reconnect:
/// `retry_ms=` the time to readmit every connection at the admission rate
/// (at least 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_draining_close_carries_a_retry_hint() {
    let ts = TestServer::start(|c| c.max_handshakes_per_sec = 2);
    let endpoint = client_endpoint(&ts);
    let mut conns = Vec::new();
    for _ in 0..2 {
        let conn = tokio::time::timeout(SLACK, endpoint.connect(ts.addr(), "localhost").unwrap())
            .await
            .expect("handshake in time")
            .expect("handshake");
        conns.push(conn);
    }
    // Established on the server's side too (an application close during
    // the handshake reaches the client without its reason).
    let deadline = tokio::time::Instant::now() + SLACK;
    while ts.server.stats().connections_open < 2 {
        assert!(tokio::time::Instant::now() < deadline, "not established");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drained = tokio::spawn(ts.server.drain());
    for conn in conns {
        let reason = match tokio::time::timeout(SLACK, conn.closed()).await {
            Ok(quinn::ConnectionError::ApplicationClosed(close)) => close.reason,
            other => panic!("not an application close: {other:?}"),
        };
        let text = String::from_utf8_lossy(&reason).into_owned();
        let retry_ms: u64 = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("retry_ms="))
            .unwrap_or_else(|| panic!("no retry_ms in {text:?}"))
            .parse()
            .expect("retry_ms is a decimal");
        // Two connections at two a second: one second, the floor.
        assert_eq!(retry_ms, 1000, "{text:?}");
    }
    drained.await.unwrap();
}
