//! The HTTP port (`greendot_server::http`) in front of a real server: its
//! endpoints and refusals, `/readyz` through a drain, and clients that are
//! slow (slowloris), too many or malformed, none of which holds up the
//! presence server or the port itself for longer than its timeouts.

use greendot_core::{Status, Tier};
use greendot_proto::Kind;
use greendot_server::http::{HttpConfig, HttpService, HttpThread};
use greendot_server::testing::StoreFaults;
use greendot_tests::{TestServer, SLACK};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

fn http(ts: &TestServer, config: HttpConfig) -> HttpThread {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a TCP port");
    HttpService::new(ts.server.monitor())
        .config(config)
        .spawn(listener)
        .expect("the HTTP port starts")
}

/// An HTTP response, as read to the end of the connection.
#[derive(Debug)]
struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Sends `request` as is and reads until the server closes the connection.
async fn exchange(at: SocketAddr, request: &[u8]) -> std::io::Result<Reply> {
    let mut stream = TcpStream::connect(at).await?;
    stream.write_all(request).await?;
    let mut bytes = Vec::new();
    tokio::time::timeout(SLACK, stream.read_to_end(&mut bytes))
        .await
        .map_err(|_| std::io::Error::other("no end of the response in time"))??;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no response head: {text:?}")))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status: {head:?}")))?;
    Ok(Reply {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    })
}

async fn request(at: SocketAddr, method: &str, path: &str) -> Reply {
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: greendot\r\nConnection: close\r\n\r\n");
    exchange(at, request.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// The QUIC side goes on: a client connects, changes its status, and a
/// watcher sees it.
async fn presence_goes_on(ts: &TestServer, user: &str) {
    let (watcher, mut seen) = ts
        .connect(&format!("{user}-watcher"), "desk", Kind::Desktop)
        .await;
    watcher.subscribe(&[user], Tier::Realtime).await.unwrap();
    let (client, _events) = ts.connect(user, "phone", Kind::Mobile).await;
    client.set_status(Status::Busy, Some("here")).await.unwrap();
    seen.wait_presence(user, SLACK, |p| p.status == Status::Busy)
        .await
        .expect("the watcher sees the change");
    client.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_port_serves_metrics_health_and_readiness_and_refuses_the_rest() {
    let ts = TestServer::start(|_| {});
    let port = http(&ts, HttpConfig::default().max_head_bytes(2048));
    let at = port.local_addr();

    let metrics = request(at, "GET", "/metrics").await;
    assert_eq!(metrics.status, 200, "{metrics:?}");
    assert_eq!(
        metrics.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    assert!(
        metrics.body.contains("greendot_users_online "),
        "{metrics:?}"
    );
    let head = request(at, "HEAD", "/metrics").await;
    assert_eq!(head.status, 200, "{head:?}");
    assert!(head.body.is_empty(), "HEAD has no body: {head:?}");

    let health = request(at, "GET", "/healthz").await;
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"));
    let ready = request(at, "GET", "/readyz").await;
    assert_eq!((ready.status, ready.body.as_str()), (200, "ready\n"));

    let missing = request(at, "GET", "/nope").await;
    assert_eq!(missing.status, 404, "{missing:?}");
    assert!(
        missing.body.contains("/metrics"),
        "a helpful 404: {missing:?}"
    );
    let wrong = request(at, "DELETE", "/metrics").await;
    assert_eq!(wrong.status, 405, "{wrong:?}");
    assert!(
        wrong.header("allow").is_some_and(|a| a.contains("GET")),
        "{wrong:?}"
    );

    // A body is refused before any route sees it.
    let body = exchange(
        at,
        b"GET /metrics HTTP/1.1\r\nHost: g\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello",
    )
    .await
    .unwrap();
    assert_eq!(body.status, 413, "{body:?}");
    // A head past the cap (2 KiB): 431; one within it is served.
    let head_of = |filler: usize| {
        format!(
            "GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\nX-Big: {}\r\n\r\n",
            "a".repeat(filler)
        )
    };
    let big = exchange(at, head_of(3000).as_bytes()).await.unwrap();
    assert_eq!(big.status, 431, "{big:?}");
    let fits = exchange(at, head_of(1500).as_bytes()).await.unwrap();
    assert_eq!(fits.status, 200, "{fits:?}");

    // A malformed request line: a 400, and nothing else breaks.
    let bad = exchange(at, b"NOT HTTP AT ALL\r\n\r\n").await.unwrap();
    assert_eq!(bad.status, 400, "{bad:?}");
    let bad = exchange(at, b"\x16\x03\x01\x00\xff\x01\x00\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(bad.status, 400, "{bad:?}");
    presence_goes_on(&ts, "ann").await;
    let metrics = request(at, "GET", "/metrics").await;
    assert_eq!(metrics.status, 200, "{metrics:?}");
    assert!(
        metrics.body.contains("greendot_users_online 2"),
        "{}",
        metrics.body
    );
}

/// `/readyz` turns 503 as a drain begins (while the drain still runs: the
/// store's writer is held) and stays so; `/healthz` is 503 once the loop
/// has stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_from_the_start_of_a_drain() {
    let dir = std::env::temp_dir().join(format!("greendot-http-drain-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let faults = Arc::new(StoreFaults::default());
    let (path, held) = (dir.join("store.redb"), faults.clone());
    let ts = TestServer::start(move |c| {
        c.store = Some(path);
        c.store_faults = Some(held);
    });
    let config = HttpConfig::default().loop_timeout(Duration::from_millis(500));
    let port = http(&ts, config);
    let at = port.local_addr();
    assert_eq!(request(at, "GET", "/readyz").await.status, 200);
    let (_client, _events) = ts.connect("bea", "phone", Kind::Mobile).await;

    faults.stall.store(true, Ordering::Relaxed);
    let TestServer { server } = ts;
    let drain = tokio::spawn(server.drain());
    let deadline = Instant::now() + SLACK;
    loop {
        let ready = request(at, "GET", "/readyz").await;
        if ready.status == 503 {
            assert!(ready.body.contains("draining"), "{ready:?}");
            break;
        }
        assert_eq!(ready.status, 200, "{ready:?}");
        assert!(
            Instant::now() < deadline,
            "/readyz still 200 while draining"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!drain.is_finished(), "the drain waits for the held store");

    faults.stall.store(false, Ordering::Relaxed);
    tokio::time::timeout(SLACK * 4, drain)
        .await
        .expect("the drain ends")
        .unwrap();
    assert_eq!(request(at, "GET", "/readyz").await.status, 503);
    let health = request(at, "GET", "/healthz").await;
    assert_eq!(health.status, 503, "{health:?}");
    let metrics = request(at, "GET", "/metrics").await;
    assert_eq!(metrics.status, 503, "{metrics:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Opens a connection that sends `prefix` and then nothing.
async fn stall(at: SocketAddr, prefix: &'static [u8]) -> TcpStream {
    let mut stream = TcpStream::connect(at).await.expect("connects");
    stream.write_all(prefix).await.expect("writes");
    stream
}

/// Whether the server has closed `stream` (EOF or reset), waiting at most
/// `within`; what it sent before closing is skipped.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// 300 connections that stall (half of them halfway through a request
/// head, half before sending a byte) fill the port's 256 slots (the
/// per-address cap raised to let one address do it); the QUIC
/// side goes on meanwhile, and the header read timeout frees the slots:
/// `/metrics` answers within that timeout (plus slack), and every stalled
/// connection is closed by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_holds_up_neither_the_server_nor_the_port_past_the_timeout() {
    const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
    let ts = TestServer::start(|_| {});
    let port = http(
        &ts,
        HttpConfig::default()
            .header_read_timeout(HEAD_TIMEOUT)
            .max_connections(256)
            .max_connections_per_address(256),
    );
    let at = port.local_addr();
    let started = Instant::now();
    let mut stalled = Vec::new();
    for i in 0..300 {
        let prefix: &'static [u8] = if i % 2 == 0 {
            b"GET /metrics HTTP/1.1\r\nHost: slow\r\nX-Wait: "
        } else {
            b""
        };
        stalled.push(stall(at, prefix).await);
    }

    presence_goes_on(&ts, "cyd").await;

    // The port answers again once the timeout has freed the slots.
    let answered = loop {
        match exchange(
            at,
            b"GET /metrics HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n",
        )
        .await
        {
            Ok(reply) if reply.status == 200 => break started.elapsed(),
            // Refused while the slots are full.
            Ok(reply) => assert_eq!(reply.status, 503, "{reply:?}"),
            Err(_) => {}
        }
        assert!(
            started.elapsed() < HEAD_TIMEOUT + SLACK,
            "/metrics did not answer within {:?} of the stall",
            HEAD_TIMEOUT + SLACK
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("/metrics answered {answered:?} after the stall began");
    let left = (started + HEAD_TIMEOUT + SLACK).saturating_duration_since(Instant::now());
    for (i, stream) in stalled.iter_mut().enumerate() {
        assert!(
            closed_within(stream, left).await,
            "stalled connection {i} still open after {:?}",
            started.elapsed()
        );
    }
    presence_goes_on(&ts, "dov").await;
}

/// A connection from `ip` (a loopback address of the test's choosing) to
/// `at`.
async fn connect_from(ip: &str, at: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::new(ip.parse().unwrap(), 0))
        .unwrap_or_else(|e| panic!("bind {ip}: {e}"));
    socket.connect(at).await.expect("connects")
}

/// Sends `request` from `ip` and reads the answer to the end.
async fn exchange_from(ip: &str, at: SocketAddr, request: &[u8]) -> Reply {
    let mut stream = connect_from(ip, at).await;
    stream.write_all(request).await.expect("writes");
    let mut bytes = Vec::new();
    tokio::time::timeout(SLACK, stream.read_to_end(&mut bytes))
        .await
        .expect("an answer in time")
        .expect("reads");
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head");
    Reply {
        status: head.split_whitespace().nth(1).unwrap().parse().unwrap(),
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

/// Many stalled connections from one address (a slowloris at 127.0.0.1,
/// opened far faster than "a few dozen a second", held far longer than the
/// head timeout would allow: it is a minute here) take that address's share
/// only: past it they are refused at once, and a probe from another address
/// (127.0.0.2) is answered on its first try, while they are all still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_starve_a_probe_from_another() {
    const PER_ADDRESS: usize = 16;
    let ts = TestServer::start(|_| {});
    let port = http(
        &ts,
        HttpConfig::default()
            .header_read_timeout(Duration::from_secs(60))
            .max_connections(256)
            .max_connections_per_address(PER_ADDRESS),
    );
    let at = port.local_addr();
    let mut held = Vec::new();
    for i in 0..300 {
        let mut stream = connect_from("127.0.0.1", at).await;
        if i % 2 == 0 {
            // Refused ones may be reset already: the write is best effort.
            let _ = stream
                .write_all(b"GET /readyz HTTP/1.1\r\nHost: slow\r\nX-Wait: ")
                .await;
        }
        held.push(stream);
    }
    let readyz = b"GET /readyz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n";
    // The address's share is held: one more from it is turned away at
    // once, with a 503 that says why. (It sends nothing: closing a socket
    // with unread input resets it, and the reset could overtake the 503.)
    let same = exchange_from("127.0.0.1", at, b"").await;
    assert_eq!(same.status, 503, "{same:?}");
    assert!(same.body.contains("from your address"), "{same:?}");
    // A probe from elsewhere gets its answer on its first try.
    let probe = exchange_from("127.0.0.2", at, readyz).await;
    assert_eq!(
        (probe.status, probe.body.as_str()),
        (200, "ready\n"),
        "{probe:?}"
    );
    // And the slow ones were held all along.
    let same = exchange_from("127.0.0.1", at, b"").await;
    assert!(same.body.contains("from your address"), "{same:?}");
    drop(held);
}

/// A slowloris that trickles its request head a byte at a time (every read
/// brings something) is still closed once the head timeout has passed since
/// it began: the deadline is for the whole head, not for each read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_head_is_closed_at_the_head_timeout() {
    const HEAD_TIMEOUT: Duration = Duration::from_secs(1);
    let ts = TestServer::start(|_| {});
    let port = http(&ts, HttpConfig::default().header_read_timeout(HEAD_TIMEOUT));
    let at = port.local_addr();
    let mut stream = TcpStream::connect(at).await.expect("connects");
    let started = Instant::now();
    let head = b"GET /readyz HTTP/1.1\r\nHost: slow\r\nX-Wait: ";
    let mut sent = 0usize;
    let mut buf = [0u8; 256];
    let closed_after = loop {
        let byte = head.get(sent).copied().unwrap_or(b'a');
        if stream.write_all(&[byte]).await.is_err() {
            break started.elapsed();
        }
        sent += 1;
        // One byte every 50 ms, watching for the close meanwhile.
        match tokio::time::timeout(Duration::from_millis(50), stream.read(&mut buf)).await {
            Err(_) => {}
            Ok(Ok(0)) | Ok(Err(_)) => break started.elapsed(),
            Ok(Ok(n)) => panic!(
                "an answer to a head never finished: {:?}",
                String::from_utf8_lossy(&buf[..n])
            ),
        }
        assert!(
            started.elapsed() < HEAD_TIMEOUT + SLACK,
            "a trickling head still open after {:?} ({sent} bytes)",
            started.elapsed()
        );
    };
    assert!(
        closed_after >= HEAD_TIMEOUT,
        "closed early: {closed_after:?}"
    );
    println!("closed {closed_after:?} after it began, {sent} bytes sent");
}

/// One connection past the cap is closed at once (with a 503 when it can
/// be sent), long before the stalled ones time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_cap_is_closed_at_once() {
    let ts = TestServer::start(|_| {});
    let port = http(
        &ts,
        HttpConfig::default()
            .header_read_timeout(Duration::from_secs(60))
            .max_connections(4),
    );
    let at = port.local_addr();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(stall(at, b"GET /metrics HTTP/1.1\r\n").await);
    }
    // It sends nothing: closing a socket with unread input resets it, and
    // the reset could overtake the 503.
    let extra = exchange(at, b"").await.expect("an answer at once");
    assert_eq!(extra.status, 503, "{extra:?}");
    assert!(extra.body.contains("too many connections"), "{extra:?}");
    // The slots free as their holders leave.
    drop(held);
    let deadline = Instant::now() + SLACK;
    loop {
        if let Ok(reply) = exchange(
            at,
            b"GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n",
        )
        .await
        {
            if reply.status == 200 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the slots were not freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client that sends requests but never reads the answers holds its
/// connection only until a response has waited `send_timeout` for room:
/// then the connection closes and its slot (the only one here) is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
    const SEND_TIMEOUT: Duration = Duration::from_secs(1);
    let ts = TestServer::start(|_| {});
    let port = http(
        &ts,
        HttpConfig::default()
            .header_read_timeout(Duration::from_secs(60))
            .send_timeout(SEND_TIMEOUT)
            .max_connections(1),
    );
    let at = port.local_addr();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut deaf = socket.connect(at).await.expect("connects");
    let started = Instant::now();
    // Pipelined requests for small 404s, until the server stops taking
    // them (its answers fill both buffers) or closes the connection.
    let batch = b"GET /nope HTTP/1.1\r\nHost: g\r\n\r\n".repeat(1000);
    let writer = tokio::spawn(async move { while deaf.write_all(&batch).await.is_ok() {} });
    let deadline = started + SEND_TIMEOUT + SLACK;
    let freed = loop {
        if let Ok(reply) = exchange(
            at,
            b"GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n",
        )
        .await
        {
            if reply.status == 200 {
                break started.elapsed();
            }
            assert_eq!(reply.status, 503, "{reply:?}");
        }
        assert!(
            Instant::now() < deadline,
            "the deaf client still holds its slot after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("the slot was free {freed:?} after the deaf client began");
    tokio::time::timeout(SLACK, writer)
        .await
        .expect("the deaf client's connection was closed")
        .unwrap();
}
