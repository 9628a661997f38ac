//! Limits give typed errors to the peer that exceeds them and nobody else:
//! subscriptions per session, request rate, connections, service-only calls.

use greendot_client::{Client, ClientError, Event};
use greendot_core::{Kinds, Presence, Tier};
use greendot_proto::{CloseCode, ErrorCode, Kind};
use greendot_server::RateLimit;
use greendot_tests::{TestServer, SLACK};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_cap_and_service_only_calls() {
    let ts = TestServer::start(|c| c.core.max_subscriptions_per_session = 3);
    let (client, _) = ts.connect("lena", "phone", Kind::Mobile).await;
    let answer = client
        .subscribe(&["a", "b", "c", "d"], Tier::Batched)
        .await
        .unwrap();
    assert_eq!(answer.snapshots.len(), 3);
    assert_eq!(answer.refused.len(), 1);
    assert_eq!(
        answer.refused[0].error.code,
        ErrorCode::TooManySubscriptions
    );

    let error = client.query_many(&["a", "b"]).await.unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::ServiceOnly));
    let (svc, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;
    // lena is shown online once her arrival is published (one debounce);
    // a user never seen is offline at version 0, with nothing else known.
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let (lena, nobody) = loop {
        let results = svc.query_many(&["lena", "nobody"]).await.unwrap();
        assert_eq!(results[0].0, "lena");
        assert_eq!(results[1].0, "nobody");
        let lena = results[0].1.clone().expect("lena may be queried");
        if lena.online || tokio::time::Instant::now() >= deadline {
            break (lena, results[1].1.clone());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(lena.online, "lena is never shown online: {lena:?}");
    assert!(lena.version >= 1, "{lena:?}");
    assert_eq!(lena.kinds, Kinds::from_bits(1), "{lena:?}"); // mobile
    assert_eq!(lena.last_seen, None, "{lena:?}");
    assert_eq!(nobody, Ok(Presence::default()));
    assert_eq!(
        nobody.as_ref().map(|p| (p.version, p.online, p.last_seen)),
        Ok((0, false, None))
    );
    client.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_rate_is_limited_per_session() {
    let ts = TestServer::start(|c| c.rate = RateLimit::new(2, 5));
    let (flood, mut flood_events) = ts.connect("fred", "phone", Kind::Mobile).await;
    let (calm, _) = ts.connect("carl", "phone", Kind::Mobile).await;
    let mut limited = 0;
    for _ in 0..20 {
        match flood.ping().await {
            Ok(()) => {}
            Err(e) if e.code() == Some(ErrorCode::RateLimited) => limited += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(limited >= 10, "only {limited} of 20 refused");
    // Another session is unaffected, and the flooder's connection lives on.
    for _ in 0..5 {
        calm.ping().await.unwrap();
    }
    flood_events.drain();
    assert!(flood_events.connection_events().is_empty());
    // The bucket refills.
    let deadline = tokio::time::Instant::now() + SLACK;
    loop {
        match flood.ping().await {
            Ok(()) => break,
            Err(e) if e.code() == Some(ErrorCode::RateLimited) => {
                assert!(tokio::time::Instant::now() < deadline, "never refilled");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_refused_and_superseded_sessions_end() {
    let ts = TestServer::start(|c| c.max_connections = 2);
    let (first, mut first_events) = ts.connect("sam", "phone", Kind::Mobile).await;
    let (second, _) = ts.connect("tom", "phone", Kind::Mobile).await;
    let token = ts.token("ute", "phone", Kind::Mobile, Default::default());
    match Client::connect(ts.client_config(token)).await {
        Err(ClientError::Rejected { code, .. }) => {
            assert_eq!(code, Some(CloseCode::TooManyConnections))
        }
        other => panic!("over the cap: {other:?}"),
    }
    first.ping().await.unwrap();

    // The same device connecting again supersedes the first connection
    // (once there is room), which ends for good.
    second.close().await;
    let server = &ts.server;
    assert!(
        greendot_tests::eventually(SLACK, || server.stats().connections_open < 2).await,
        "the closed connection is still counted"
    );
    let (sam_again, _) = ts.connect("sam", "phone", Kind::Mobile).await;
    let (_, event) = first_events
        .wait_for(SLACK, |e| matches!(e, Event::Closed { .. }))
        .await
        .expect("the superseded client is told");
    assert!(
        matches!(
            event,
            Event::Closed {
                code: Some(CloseCode::Superseded),
                ..
            }
        ),
        "{event:?}"
    );
    assert!(first.is_closed());
    sam_again.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_every_connection_with_the_shutdown_code() {
    let ts = TestServer::start(|_| {});
    let mut config = ts.client_config(ts.token("sid", "phone", Kind::Mobile, Default::default()));
    config.reconnect = None;
    let (client, mut events) = ts.connect_with(config).await;
    client.ping().await.unwrap();
    ts.server.shutdown().await;
    let (_, event) = events
        .wait_for(SLACK, |e| matches!(e, Event::Closed { .. }))
        .await
        .expect("the client is told");
    assert!(
        matches!(
            event,
            Event::Closed {
                code: Some(CloseCode::Shutdown),
                ..
            }
        ),
        "{event:?}"
    );
    assert!(matches!(client.ping().await, Err(ClientError::Closed)));
}

/// `max_frame` counts a frame's payload, not its 4-byte length: a payload of
/// exactly `max_frame` bytes is read and answered, one byte more is refused
/// from the length alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_frame_counts_the_payload_without_the_length() {
    use greendot_proto::{self as proto, encode_frame, Hello, Request, RequestFrame, ServerFrame};
    use greendot_server::token::WatchClaim;
    use greendot_tests::{raw_connect, raw_exchange};

    // Room for the hello (its token), which is held to the same cap.
    let max_frame = 512;
    let ts = TestServer::start(|c| c.max_frame = max_frame);
    let query = |name_len: usize| {
        encode_frame(&RequestFrame {
            id: 7,
            request: Request::Query {
                targets: vec!["x".repeat(name_len)],
            },
        })
        .unwrap()
    };
    // The name that makes the payload exactly max_frame bytes.
    let fit = (1..max_frame)
        .find(|&len| query(len).len() == max_frame + 4)
        .unwrap();
    let hello = || {
        let token = ts.token("max", "raw", Kind::Other, WatchClaim::all());
        encode_frame(&Hello {
            version: proto::VERSION,
            token,
            resume: None,
            foreground: true,
        })
        .unwrap()
    };

    // Exactly max_frame: read and answered (the connection stays open, so
    // read frames until the answer).
    let (_e1, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let mut bytes = hello();
    bytes.extend_from_slice(&query(fit));
    send.write_all(&bytes).await.unwrap();
    let answered = tokio::time::timeout(SLACK, async {
        let mut reader = proto::FrameReader::new(1 << 20);
        loop {
            match proto::codec::read_frame(&mut recv, &mut reader).await {
                Ok(Some(payload)) => match proto::decode::<ServerFrame>(&payload) {
                    Ok(ServerFrame::Reply { id: 7, .. }) => return Ok(()),
                    Ok(ServerFrame::Error(e)) => return Err(format!("{e}")),
                    _ => {}
                },
                other => return Err(format!("{other:?}")),
            }
        }
    })
    .await;
    assert!(
        matches!(answered, Ok(Ok(()))),
        "a payload of exactly max_frame was not answered: {answered:?}"
    );

    // One byte more: refused.
    let (_e2, conn) = raw_connect(&ts, proto::ALPN).await.unwrap();
    let mut bytes = hello();
    bytes.extend_from_slice(&query(fit + 1));
    assert_eq!(query(fit + 1).len(), max_frame + 5);
    let over = raw_exchange(&conn, &bytes, SLACK).await;
    assert!(
        over.frames
            .iter()
            .any(|f| matches!(f, ServerFrame::Error(e) if e.code == ErrorCode::FrameTooLarge)),
        "{:?}",
        over.frames
    );
    assert_eq!(
        over.close,
        Some(CloseCode::FrameTooLarge),
        "{}",
        over.reason
    );
}
