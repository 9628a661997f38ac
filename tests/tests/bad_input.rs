//! Bad input of every kind gets a clear, typed error on that connection only,
//! while a healthy client connected at the same time notices nothing.

use greendot_client::quinn;
use greendot_client::tls;
use greendot_client::{Client, ClientError};
use greendot_core::{Status, Tier};
use greendot_proto::{
    self as proto, encode_frame, CloseCode, ErrorCode, Hello, Kind, Request, RequestFrame,
    ServerFrame,
};
use greendot_server::token::{unix_now, Claims, TokenKeys, WatchClaim};
use greendot_server::RateLimit;
use greendot_tests::{raw_connect, raw_exchange, TestServer, SLACK};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn hello(token: String, version: u32) -> Vec<u8> {
    encode_frame(&Hello {
        version,
        token,
        resume: None,
        foreground: true,
    })
    .unwrap()
}

fn error_code(frames: &[ServerFrame]) -> Option<ErrorCode> {
    frames.iter().find_map(|f| match f {
        ServerFrame::Error(e) => Some(e.code),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_typed_errors_and_disturbs_nobody() {
    let ts = TestServer::start(|_| {});
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;

    // The healthy pair: hank and a watcher, watching each other.
    let (hank, mut hank_events) = ts.connect("hank", "phone", Kind::Mobile).await;
    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    hank.subscribe(&["walt"], Tier::Realtime).await.unwrap();
    watcher.subscribe(&["hank"], Tier::Realtime).await.unwrap();
    seen.wait_presence("hank", wait, |p| p.online)
        .await
        .expect("hank online");
    hank_events
        .wait_presence("walt", wait, |p| p.online)
        .await
        .expect("walt online");
    seen.reset();
    hank_events.reset();
    let hank_session = hank.session();
    let good = |user: &str| ts.token(user, "raw", Kind::Other, WatchClaim::all());

    // 1. Garbage bytes instead of a hello.
    let (_e1, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let out = raw_exchange(&conn, &[0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff, 0xff], SLACK).await;
    assert_eq!(error_code(&out.frames), Some(ErrorCode::BadFrame));
    assert_eq!(out.close, Some(CloseCode::ProtocolError), "{}", out.reason);

    // 2. Garbage bytes on the control stream after a good hello.
    let (_e2, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let mut bytes = hello(good("rogue1"), proto::VERSION);
    bytes.extend_from_slice(&[0, 0, 0, 7, 42, 0xde, 0xad, 0xbe, 0xef, 0xff, 0x01]);
    let out = raw_exchange(&conn, &bytes, SLACK).await;
    assert!(matches!(out.frames.first(), Some(ServerFrame::Welcome(_))));
    assert_eq!(error_code(&out.frames), Some(ErrorCode::BadFrame));
    assert_eq!(out.close, Some(CloseCode::ProtocolError), "{}", out.reason);

    // 3. An oversized frame after a good hello: refused from its length alone.
    let (_e3, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let mut bytes = hello(good("rogue2"), proto::VERSION);
    bytes.extend_from_slice(&(1u32 << 20).to_be_bytes());
    bytes.extend_from_slice(&[0u8; 1024]);
    let out = raw_exchange(&conn, &bytes, SLACK).await;
    assert_eq!(error_code(&out.frames), Some(ErrorCode::FrameTooLarge));
    assert_eq!(out.close, Some(CloseCode::FrameTooLarge), "{}", out.reason);

    // 4. An unknown protocol version.
    let (_e4, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let out = raw_exchange(&conn, &hello(good("rogue3"), 99), SLACK).await;
    assert_eq!(error_code(&out.frames), Some(ErrorCode::UnsupportedVersion));
    assert_eq!(
        out.close,
        Some(CloseCode::UnsupportedVersion),
        "{}",
        out.reason
    );
    assert!(out.reason.contains("99"), "{}", out.reason);

    // 5. A request before the hello is read as a hello: its id is taken for
    //    the version. Id 1 reads as version 1 and then does not decode as a
    //    hello (BadFrame); id 2 reads as version 2 (UnsupportedVersion).
    //    `UnexpectedFrame` is never what it gets.
    let (_e5, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let early = encode_frame(&RequestFrame {
        id: 1,
        request: Request::Ping,
    })
    .unwrap();
    let out = raw_exchange(&conn, &early, SLACK).await;
    assert_eq!(error_code(&out.frames), Some(ErrorCode::BadFrame));
    assert_eq!(out.close, Some(CloseCode::ProtocolError), "{}", out.reason);
    let (_e5b, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let early = encode_frame(&RequestFrame {
        id: 2,
        request: Request::Ping,
    })
    .unwrap();
    let out = raw_exchange(&conn, &early, SLACK).await;
    assert_eq!(error_code(&out.frames), Some(ErrorCode::UnsupportedVersion));
    assert_eq!(
        out.close,
        Some(CloseCode::UnsupportedVersion),
        "{}",
        out.reason
    );

    // 6. A wrong ALPN: the TLS handshake fails.
    let wrong = raw_connect(&ts, b"greendot/0").await;
    let error = wrong.expect_err("a wrong ALPN must be refused");
    // TLS alert 120, no_application_protocol (QUIC CRYPTO_ERROR 0x178).
    assert!(error.contains("120"), "{error}");

    // 7. An expired token.
    let keys = TokenKeys::new(greendot_tests::SECRET, Duration::ZERO);
    let mut claims = Claims::new(
        "eve",
        "phone",
        Kind::Mobile,
        WatchClaim::all(),
        Duration::ZERO,
    );
    claims.exp = unix_now() - 3600;
    let expired = keys.mint(&claims).unwrap();
    match Client::connect(ts.client_config(expired)).await {
        Err(ClientError::Rejected { code, error }) => {
            assert_eq!(code, Some(CloseCode::TokenExpired));
            assert_eq!(error.code, ErrorCode::TokenExpired);
        }
        other => panic!("expired token: {other:?}"),
    }

    // 8. A forged token (another secret), a malformed one, a missing one.
    let forger = TokenKeys::new(b"not the server's secret", Duration::ZERO);
    let claims = Claims::new("eve", "phone", Kind::Mobile, WatchClaim::all(), SLACK);
    for token in [
        forger.mint(&claims).unwrap(),
        "not.a.jwt".into(),
        String::new(),
    ] {
        match Client::connect(ts.client_config(token.clone())).await {
            Err(ClientError::Rejected { code, error }) => {
                assert_eq!(code, Some(CloseCode::Unauthorized), "{token:?}");
                assert_eq!(error.code, ErrorCode::BadToken, "{token:?}");
            }
            other => panic!("token {token:?}: {other:?}"),
        }
    }

    // 9. A subscription outside the token's watch list: refused, typed, and
    //    the connection carries on.
    let token = ts.token("nina", "phone", Kind::Mobile, WatchClaim::only(["hank"]));
    let (nina, _) = ts.connect_with(ts.client_config(token)).await;
    let answer = nina
        .subscribe(&["walt", "hank"], Tier::Realtime)
        .await
        .unwrap();
    assert_eq!(answer.refused.len(), 1, "{answer:?}");
    assert_eq!(answer.refused[0].target, "walt");
    assert_eq!(answer.refused[0].error.code, ErrorCode::NotAllowed);
    assert_eq!(answer.snapshots.len(), 1);
    assert_eq!(
        nina.query("walt").await.unwrap_err().code(),
        Some(ErrorCode::NotAllowed)
    );
    nina.ping().await.unwrap();

    // The healthy pair noticed nothing: same session, no reconnects, never
    // offline, and pushes still flow both ways.
    hank.ping().await.unwrap();
    watcher
        .set_status(Status::Busy, Some("still here"))
        .await
        .unwrap();
    hank_events
        .wait_presence("walt", wait, |p| p.message.as_deref() == Some("still here"))
        .await
        .expect("hank still gets pushes");
    hank.set_status(Status::Away, Some("me too")).await.unwrap();
    seen.wait_presence("hank", wait, |p| p.message.as_deref() == Some("me too"))
        .await
        .expect("the watcher still gets pushes");
    assert_eq!(hank.session(), hank_session);
    assert!(hank_events.connection_events().is_empty());
    assert!(seen.connection_events().is_empty());
    assert_eq!(seen.offline_count("hank"), 0);
    // Each refusal above was counted under its own code (the wrong ALPN
    // fails in the handshake, before any code).
    let rejected = ts.server.monitor().metrics().await.unwrap().rejected;
    let count = |code: &str| rejected.get(code).copied().unwrap_or(0);
    assert_eq!(
        [
            count("BadFrame"),
            count("FrameTooLarge"),
            count("UnsupportedVersion"),
            count("TokenExpired"),
            count("BadToken"),
        ],
        [3, 1, 2, 1, 3],
        "{rejected:?}"
    );
}

/// A client that sends requests and never reads the answers is held back by
/// flow control: the server stops reading its requests while its answers
/// wait, so what it buffers for that connection is bounded by the windows, not
/// by what the client sends; everyone else is answered as usual meanwhile.
///
/// The server exposes no per-connection byte count, so this is measured from
/// the client: the request bytes the client's QUIC stack accepted, which is
/// what the server read plus the server's receive window (quinn takes a write
/// only within the flow-control credit the server granted). Every request the
/// server reads produces an answer it must buffer or send; the client reads
/// none, so answers fill the client's stream window, then the server's send
/// buffer, then the server stops reading. So the accepted bytes must
///   1. stop growing (a server that is merely slow keeps reading),
///   2. stop below a bound computed from the windows (a server that buffers
///      answers without bound reads all 24 MB),
///   3. grow again once the client reads its answers (the hold was flow
///      control, not a dead connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_answers_is_held_back() {
    // No rate limit in the way: every request is a real query with a real
    // answer (and a flood past the rate limit may be closed, which is not
    // what this test is about).
    let ts = TestServer::start(|c| c.rate = RateLimit::new(10_000_000, 10_000_000));
    let (healthy, _events) = ts.connect("hank", "phone", Kind::Mobile).await;

    // A raw client whose receive window for the control stream is known.
    const CLIENT_STREAM_WINDOW: u32 = 64 * 1024;
    let crypto = tls::client_crypto(&[ts.server.certificate().clone()], proto::ALPN).unwrap();
    let mut transport = quinn::TransportConfig::default();
    transport.stream_receive_window(CLIENT_STREAM_WINDOW.into());
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport));
    let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    endpoint.set_default_client_config(client);
    let conn = endpoint
        .connect(ts.addr(), "localhost")
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let token = ts.token("flood", "raw", Kind::Other, WatchClaim::all());
    send.write_all(&hello(token, proto::VERSION)).await.unwrap();

    // 2,000,000 queries, about 24 MB.
    let request = |id: u64| {
        encode_frame(&RequestFrame {
            id,
            request: Request::Query {
                targets: vec!["hank".into()],
            },
        })
        .unwrap()
    };
    let n = 2_000_000u64;
    let mut bytes = Vec::new();
    for id in 0..n {
        bytes.extend_from_slice(&request(id));
    }
    let total = bytes.len();
    let accepted = Arc::new(AtomicUsize::new(0));
    let writer = {
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let mut at = 0;
            while at < bytes.len() {
                let end = (at + 4096).min(bytes.len());
                match send.write(&bytes[at..end]).await {
                    Ok(k) => {
                        at += k;
                        accepted.store(at, Ordering::SeqCst);
                    }
                    Err(_) => return,
                }
            }
        })
    };

    // 1. The accepted bytes stop growing: unchanged over a whole second.
    let deadline = tokio::time::Instant::now() + SLACK * 2;
    let mut last = usize::MAX;
    let plateau = loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = accepted.load(Ordering::SeqCst);
        if now == last {
            break now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server keeps reading requests whose answers are never read: {now} of {total} bytes taken"
        );
        last = now;
    };

    // 2. Below what the windows allow. The server read at most: its receive
    //    window, plus one read round (a frame's worth), plus the requests
    //    whose answers fit in the client's stream window, the server's send
    //    buffer (4 frames' worth) and the answers of one read round.
    let max_frame = ts.config().max_frame;
    let request_len = request(n - 1).len();
    let answer_len = encode_frame(&ServerFrame::Reply {
        id: 0,
        result: Ok(proto::Answer::Presences(vec![proto::QueryResult {
            target: "hank".into(),
            result: Ok(proto::Presence::default()),
        }])),
    })
    .unwrap()
    .len();
    let server_window = 4 * max_frame;
    let read_round = max_frame + 4;
    let answers_held = CLIENT_STREAM_WINDOW as usize + 4 * max_frame;
    let bound = server_window
        + read_round
        + answers_held / answer_len * request_len
        + read_round / request_len * request_len;
    assert!(
        plateau <= bound && plateau < total / 4,
        "the server took {plateau} bytes of requests (bound {bound}) without its answers being read"
    );

    // The healthy client is answered at once meanwhile.
    let started = std::time::Instant::now();
    healthy.set_status(Status::Busy, None).await.unwrap();
    assert!(started.elapsed() < SLACK, "{:?}", started.elapsed());

    // 3. Reading the answers lets the requests flow again.
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok(Some(_)) = recv.read(&mut buf).await {}
    });
    assert!(
        greendot_tests::eventually(SLACK, || accepted.load(Ordering::SeqCst) > plateau).await,
        "reading the answers did not let the server read on"
    );
    writer.abort();
    reader.abort();
}

/// Datagrams that are not QUIC, or are QUIC cut short, reach the server's one
/// task before any connection exists: they are dropped, and the server keeps
/// serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_datagrams_are_dropped_and_disturb_nobody() {
    let ts = TestServer::start(|_| {});
    let (healthy, _events) = ts.connect("hank", "phone", Kind::Mobile).await;
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..3000usize {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let base = [1usize, 20, 1200, 1500][i % 4];
        let len = base - (x as usize) % base.min(8);
        let mut bytes: Vec<u8> = (0..len).map(|k| (x >> (k % 56)) as u8).collect();
        // Every fourth looks like a long-header Initial with a bad body.
        if i % 4 == 2 {
            bytes[0] = 0xc3;
            bytes[1..5].copy_from_slice(&1u32.to_be_bytes());
        }
        let _ = socket.send_to(&bytes, ts.addr()).await;
    }
    let started = std::time::Instant::now();
    healthy.set_status(Status::Busy, None).await.unwrap();
    assert!(started.elapsed() < SLACK, "{:?}", started.elapsed());
    // And a new client still gets in.
    let (_late, _) = ts.connect("late", "phone", Kind::Mobile).await;
}

/// docs/protocol.md, "Streams": a raw QUIC client that opens streams of its
/// own beyond the control stream (the transport parameters grant 2
/// bidirectional and 3 unidirectional, WebTransport's room) gets each one
/// stopped with STOP_SENDING code 0, and its connection goes on: a request
/// on the control stream is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_beyond_the_control_stream_are_stopped_and_the_connection_goes_on() {
    let ts = TestServer::start(|_| {});
    let (_endpoint, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let token = ts.token("stan", "raw", Kind::Other, WatchClaim::all());
    send.write_all(&hello(token, proto::VERSION)).await.unwrap();
    let mut reader = proto::FrameReader::new(1 << 20);
    let mut next_frame = async || {
        let payload = tokio::time::timeout(SLACK, proto::codec::read_frame(&mut recv, &mut reader))
            .await
            .expect("a frame in time")
            .expect("a frame")
            .expect("the stream goes on");
        proto::decode::<ServerFrame>(&payload).expect("a server frame")
    };
    assert!(
        matches!(next_frame().await, ServerFrame::Welcome(_)),
        "welcomed"
    );

    let mut extra = Vec::new();
    for _ in 0..3 {
        extra.push(
            tokio::time::timeout(SLACK, conn.open_uni())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let (second_bi, _) = tokio::time::timeout(SLACK, conn.open_bi())
        .await
        .unwrap()
        .unwrap();
    extra.push(second_bi);
    for (i, stream) in extra.iter_mut().enumerate() {
        // Something to send: a stream is opened on the wire by its first frame.
        stream.write_all(b"\0\0\0\x01\0").await.ok();
        let stopped = tokio::time::timeout(SLACK, stream.stopped())
            .await
            .unwrap_or_else(|_| panic!("stream {i} not stopped within {SLACK:?}"));
        assert_eq!(stopped.ok().flatten(), Some(0u32.into()), "stream {i}");
    }

    let ping = encode_frame(&RequestFrame {
        id: 7,
        request: Request::Ping,
    })
    .unwrap();
    send.write_all(&ping).await.unwrap();
    match next_frame().await {
        ServerFrame::Reply { id, result } => {
            assert_eq!(id, 7);
            assert!(result.is_ok(), "{result:?}");
        }
        other => panic!("not a reply: {other:?}"),
    }
    assert!(conn.close_reason().is_none(), "{:?}", conn.close_reason());
}
