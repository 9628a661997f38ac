//! Hostile clients: what a client with a valid token but bad intentions can
//! make the server hold, and how it is stopped.

use greendot_client::quinn;
use greendot_client::{Client, ClientError};
use greendot_core::{Status, Tier};
use greendot_proto::codec::read_frame;
use greendot_proto::{
    self as proto, decode, encode_frame, CloseCode, ErrorCode, FrameReader, Hello, Kind, Request,
    RequestFrame, ServerFrame, ALPN,
};
use greendot_server::token::WatchClaim;
use greendot_server::{RateLimit, RATE_LIMIT_PATIENCE};
use greendot_tests::{raw_connect, TestServer, SLACK};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

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
    let ts = TestServer::start(|c| c.rate = RateLimit::new(10_000, 10_000));
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

/// A client that keeps pipelining requests past its rate is closed with
/// `RateLimited` once its refusals lasted `RATE_LIMIT_PATIENCE`, instead of
/// being answered one refusal at a time forever; a calm client is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_slows_down_is_closed() {
    let ts = TestServer::start(|c| c.rate = RateLimit::new(20, 20));
    let (calm, _calm_events) = ts.connect("calm", "phone", Kind::Mobile).await;
    let (_endpoint, conn) = raw_connect(&ts, ALPN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = Hello {
        version: proto::VERSION,
        token: ts.token("flood", "phone", Kind::Mobile, WatchClaim::all()),
        resume: None,
        foreground: true,
    };
    send.write_all(&encode_frame(&hello).unwrap())
        .await
        .unwrap();
    // Answers are read (and counted) so that flow control never slows the
    // flood down: only the rate limit stands in its way.
    let reader = tokio::spawn(async move {
        let mut reader = FrameReader::new(1 << 20);
        let mut refused = 0usize;
        while let Ok(Some(payload)) = read_frame(&mut recv, &mut reader).await {
            if let Ok(ServerFrame::Reply { result: Err(e), .. }) = decode::<ServerFrame>(&payload) {
                assert_eq!(e.code, ErrorCode::RateLimited);
                refused += 1;
            }
        }
        refused
    });
    let ping = encode_frame(&RequestFrame {
        id: 1,
        request: Request::Ping,
    })
    .unwrap();
    let started = Instant::now();
    let flood = async {
        loop {
            if send.write_all(&ping.repeat(10)).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let patience = Duration::from_millis(RATE_LIMIT_PATIENCE.0);
    let _ = tokio::time::timeout(patience + SLACK, flood).await;
    let close = tokio::time::timeout(SLACK, conn.closed()).await;
    let elapsed = started.elapsed();
    match close {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => {
            assert_eq!(
                CloseCode::from_code(c.error_code.into_inner()),
                Some(CloseCode::RateLimited)
            )
        }
        other => panic!("not closed for its rate: {other:?}"),
    }
    assert!(elapsed >= patience, "closed after {elapsed:?}");
    let refused = reader.await.unwrap();
    assert!(refused > 100, "{refused} refusals before the close");
    calm.ping().await.unwrap();
}

/// A client that stops (STOP_SENDING) one of its push streams is closed with
/// `StreamStopped` rather than kept online while every push to it is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_push_stream_closes_the_connection() {
    let ts = TestServer::start(|_| {});
    let (watcher, _watcher_events) = ts.connect("wendy", "phone", Kind::Mobile).await;
    let (_endpoint, conn) = raw_connect(&ts, ALPN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = Hello {
        version: proto::VERSION,
        token: ts.token("stopper", "phone", Kind::Mobile, WatchClaim::all()),
        resume: None,
        foreground: true,
    };
    send.write_all(&encode_frame(&hello).unwrap())
        .await
        .unwrap();
    let mut reader = FrameReader::new(1 << 20);
    let welcome = read_frame(&mut recv, &mut reader).await.unwrap().unwrap();
    assert!(matches!(
        decode::<ServerFrame>(&welcome),
        Ok(ServerFrame::Welcome(_))
    ));
    let mut push = tokio::time::timeout(SLACK, conn.accept_uni())
        .await
        .expect("a push stream in time")
        .unwrap();
    push.stop(0u32.into()).unwrap();
    match tokio::time::timeout(SLACK, conn.closed()).await {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => assert_eq!(
            CloseCode::from_code(c.error_code.into_inner()),
            Some(CloseCode::StreamStopped)
        ),
        other => panic!("not closed for the stopped stream: {other:?}"),
    }
    watcher.ping().await.unwrap();
}

/// A raw connection whose receive windows are small, so that pushes it does
/// not read soon wait in the server's queues.
async fn stingy_connect(ts: &TestServer) -> (quinn::Endpoint, quinn::Connection) {
    let crypto =
        greendot_client::tls::client_crypto(&[ts.server.certificate().clone()], ALPN).unwrap();
    let mut transport = quinn::TransportConfig::default();
    transport.stream_receive_window(4096u32.into());
    transport.receive_window(8192u32.into());
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(transport));
    let mut endpoint =
        quinn::Endpoint::client(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    endpoint.set_default_client_config(config);
    let conn = endpoint
        .connect(ts.addr(), "localhost")
        .unwrap()
        .await
        .unwrap();
    (endpoint, conn)
}

/// `sink` watches itself and never reads its pushes while its other device
/// changes its status 200 times with 1 KB messages; how the server closed
/// the sink (`None`: still open).
async fn stall_with_big_pushes(ts: &TestServer) -> Option<CloseCode> {
    let (_endpoint, conn) = stingy_connect(ts).await;
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = Hello {
        version: proto::VERSION,
        token: ts.token("sink", "tablet", Kind::Mobile, WatchClaim::all()),
        resume: None,
        foreground: true,
    };
    let subscribe = RequestFrame {
        id: 1,
        request: Request::Subscribe {
            targets: vec!["sink".into()],
            tier: proto::Tier::Realtime,
        },
    };
    send.write_all(&encode_frame(&hello).unwrap())
        .await
        .unwrap();
    send.write_all(&encode_frame(&subscribe).unwrap())
        .await
        .unwrap();
    let mut reader = FrameReader::new(1 << 20);
    for _ in 0..2 {
        read_frame(&mut recv, &mut reader).await.unwrap().unwrap();
    }
    let (writer, _events) = ts.connect("sink", "pc", Kind::Desktop).await;
    for i in 0..200 {
        let message = format!("{i:04}").repeat(250);
        if writer
            .set_status(Status::Busy, Some(&message))
            .await
            .is_err()
        {
            break;
        }
    }
    match tokio::time::timeout(SLACK, conn.closed()).await {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => {
            CloseCode::from_code(c.error_code.into_inner())
        }
        _ => None,
    }
}

/// Push queues are bounded in bytes per connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_is_closed_by_bytes_queued() {
    let ts = TestServer::start(|c| {
        c.core.max_message_len = 1_000;
        c.rate = RateLimit::new(10_000, 10_000);
        c.push_queue_bytes = 16 * 1024;
    });
    assert_eq!(
        stall_with_big_pushes(&ts).await,
        Some(CloseCode::Overloaded)
    );
    assert!(ts.server.stats().overloaded >= 1);
}

/// Past the server's byte budget the largest queue is closed; a client that
/// reads is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_byte_budget_the_slowest_reader_is_closed() {
    let ts = TestServer::start(|c| {
        c.core.max_message_len = 1_000;
        c.rate = RateLimit::new(10_000, 10_000);
        c.push_queue_bytes = 1 << 30;
        c.push_budget_bytes = 32 * 1024;
    });
    let (reader, mut reader_events) = ts.connect("reader", "phone", Kind::Mobile).await;
    reader.subscribe(&["sink"], Tier::Realtime).await.unwrap();
    assert_eq!(
        stall_with_big_pushes(&ts).await,
        Some(CloseCode::Overloaded)
    );
    reader_events
        .wait_presence("sink", SLACK, |p| p.status == Status::Busy)
        .await
        .expect("the reader got its pushes");
    reader.ping().await.unwrap();
}

/// Users who came, watched somebody and logged out are forgotten: the
/// server's census returns to where it started (release.rs measures the
/// heap of the same without a network, for 100,000 users).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_who_logged_out_are_forgotten_by_the_server() {
    let ts = Arc::new(TestServer::start(|_| {}));
    let start = ts.server.monitor().metrics().await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..8 {
        let ts = ts.clone();
        let next = next.clone();
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= 400 {
                    return;
                }
                let token = ts.token(
                    &format!("user-{i}"),
                    &format!("device-{i}"),
                    Kind::Web,
                    WatchClaim::only(["friend"]),
                );
                let (client, _events) = ts.connect_with(ts.client_config(token)).await;
                client
                    .subscribe(&["friend"], greendot_core::Tier::Batched)
                    .await
                    .unwrap();
                client.logout().await.unwrap();
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let monitor = ts.server.monitor();
    let mut end = monitor.metrics().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while (end.names, end.users_known) != (start.names, start.users_known)
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        end = monitor.metrics().await.unwrap();
    }
    assert_eq!(
        (end.names, end.users_known),
        (start.names, start.users_known)
    );
}

/// Over QUIC too, a hello larger than `max_hello` is refused before it is
/// held (`FrameTooLarge`), while the same bytes after a welcome are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_over_max_hello_is_refused_on_quic_too() {
    let ts = TestServer::start(|c| c.max_hello = 1024);
    let (_endpoint, conn) = raw_connect(&ts, ALPN).await.unwrap();
    let hello = encode_frame(&Hello {
        version: proto::VERSION,
        token: "t".repeat(2000),
        resume: None,
        foreground: true,
    })
    .unwrap();
    let outcome = greendot_tests::raw_exchange(&conn, &hello, SLACK).await;
    assert_eq!(
        outcome.close,
        Some(CloseCode::FrameTooLarge),
        "{}",
        outcome.reason
    );
    assert!(outcome.frames.iter().any(|f| matches!(
        f,
        ServerFrame::Error(e) if e.code == ErrorCode::FrameTooLarge
    )));

    let (client, _events) = ts.connect("alice", "phone", Kind::Mobile).await;
    let names = random_names(7, 150);
    let granted = client
        .subscribe(&names, Tier::Batched)
        .await
        .expect("a frame over the hello cap after the welcome");
    assert_eq!(granted.snapshots.len(), names.len());
}
