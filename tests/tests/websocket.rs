//! The WebSocket binding end to end (docs/protocol.md, "WebSocket over
//! TLS"): a raw WebSocket client over TLS against a real server, beside
//! QUIC clients: the same sessions, the same semantics.

use futures_util::{SinkExt, StreamExt};
use greendot_proto::{
    decode, encode_frame, Hello, Kind, Push, Request, RequestFrame, ServerFrame, Status, Tier,
    VERSION,
};
use greendot_server::token::WatchClaim;
use greendot_tests::{eventually, TestServer, SLACK};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpSocket;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// A server with its WebSocket listener on 127.0.0.1, port 0.
fn server(tweak: impl FnOnce(&mut greendot_server::ServerConfig)) -> TestServer {
    TestServer::start(|c| {
        c.websocket = Some(([127, 0, 0, 1], 0).into());
        tweak(c);
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the server sent: a frame on a stream, or the close.
#[derive(Debug)]
enum Got {
    Control(ServerFrame),
    Push(u8, Push),
    Closed(Option<u16>),
}

struct WsClient {
    ws: WebSocketStream<Tls>,
}

/// TLS to the server (trusting its certificate), then the upgrade on
/// `path` offering `protocol`.
async fn open(
    ts: &TestServer,
    path: &str,
    protocol: Option<&str>,
    recv_buffer: Option<u32>,
) -> Result<WebSocketStream<Tls>, WsError> {
    let addr = ts.server.websocket_addr().expect("a WebSocket listener");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ts.server.certificate().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let socket = TcpSocket::new_v4().unwrap();
    if let Some(size) = recv_buffer {
        socket.set_recv_buffer_size(size).unwrap();
    }
    let tcp = socket.connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect(name, tcp)
        .await
        .unwrap();
    let mut request = format!("wss://localhost:{}{path}", addr.port())
        .into_client_request()
        .unwrap();
    if let Some(p) = protocol {
        request
            .headers_mut()
            .insert("sec-websocket-protocol", HeaderValue::from_str(p).unwrap());
    }
    let (ws, response) = tokio_tungstenite::client_async(request, tls).await?;
    assert_eq!(
        response.headers().get("sec-websocket-protocol").unwrap(),
        "greendot.v1"
    );
    Ok(ws)
}

impl WsClient {
    async fn connect(ts: &TestServer, user: &str, device: &str) -> WsClient {
        WsClient::connect_buffered(ts, user, device, None).await
    }

    /// Connects and is welcomed (the welcome, then both push streams'
    /// first frames, are read).
    async fn connect_buffered(
        ts: &TestServer,
        user: &str,
        device: &str,
        recv_buffer: Option<u32>,
    ) -> WsClient {
        let ws = open(ts, "/greendot", Some("greendot.v1"), recv_buffer)
            .await
            .expect("upgrade");
        let mut client = WsClient { ws };
        let token = ts.token(user, device, Kind::Web, WatchClaim::all());
        client
            .send(&Hello {
                version: VERSION,
                token,
                resume: None,
                foreground: true,
            })
            .await;
        match client.next().await {
            Got::Control(ServerFrame::Welcome(w)) => assert_eq!(w.user, user),
            other => panic!("no welcome: {other:?}"),
        }
        client
    }

    /// One frame as one binary message, without its length prefix.
    async fn send<T: serde::Serialize>(&mut self, frame: &T) {
        let bytes = encode_frame(frame).unwrap();
        self.ws
            .send(Message::Binary(bytes[4..].to_vec().into()))
            .await
            .unwrap();
    }

    async fn request(&mut self, id: u64, request: Request) -> ServerFrame {
        self.send(&RequestFrame { id, request }).await;
        loop {
            match self.next().await {
                Got::Control(frame) => return frame,
                Got::Push(..) => continue,
                other => panic!("no answer: {other:?}"),
            }
        }
    }

    /// The next message (pings are answered by tungstenite).
    async fn next(&mut self) -> Got {
        loop {
            let message = tokio::time::timeout(SLACK, self.ws.next())
                .await
                .expect("a message in time");
            match message {
                Some(Ok(Message::Binary(bytes))) => {
                    let (stream, payload) = bytes.split_first().expect("a stream byte");
                    return match stream {
                        0 => Got::Control(decode(payload).expect("a server frame")),
                        1 | 2 => Got::Push(*stream, decode(payload).expect("a push")),
                        other => panic!("stream byte {other}"),
                    };
                }
                Some(Ok(Message::Close(frame))) => {
                    return Got::Closed(frame.as_ref().map(|f| u16::from(f.code)))
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                Some(Ok(other)) => panic!("unexpected message {other:?}"),
                Some(Err(_)) | None => return Got::Closed(None),
            }
        }
    }

    /// Reads until the close; the frames before it.
    async fn until_closed(&mut self) -> (Vec<Got>, Option<u16>) {
        let mut got = Vec::new();
        loop {
            match self.next().await {
                Got::Closed(code) => return (got, code),
                other => got.push(other),
            }
        }
    }

    async fn close(mut self, code: u16) {
        let frame = CloseFrame {
            code: WsCloseCode::from(code),
            reason: "".into(),
        };
        let _ = self.ws.close(Some(frame)).await;
        // Until the server's answer, so the close is surely delivered.
        while let Ok(Some(Ok(_))) = tokio::time::timeout(SLACK, self.ws.next()).await {}
    }
}

/// The welcome, both push streams (stream bytes 1 and 2, one each tier,
/// told apart by their first frame), a subscription and its pushes; a
/// QUIC client and a WebSocket client see each other; connections by
/// binding in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_session_is_a_session() {
    let ts = server(|_| {});
    let mut alice = WsClient::connect(&ts, "alice", "web").await;
    let mut tiers = Vec::new();
    for _ in 0..2 {
        match alice.next().await {
            Got::Push(stream, Push::Stream { tier }) => tiers.push((stream, tier)),
            other => panic!("no push stream header: {other:?}"),
        }
    }
    tiers.sort_by_key(|(s, _)| *s);
    assert_eq!(tiers.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
    assert_ne!(tiers[0].1, tiers[1].1);
    let realtime = tiers.iter().find(|t| t.1 == Tier::Realtime).unwrap().0;

    let (bob, mut bob_events) = ts.connect("bob", "pc", Kind::Desktop).await;
    bob.subscribe(&["alice"], greendot_core::Tier::Realtime)
        .await
        .unwrap();
    assert!(bob_events
        .wait_presence("alice", SLACK, |p| p.online && p.kinds.bits() == 4)
        .await
        .is_some());
    let reply = alice
        .request(
            1,
            Request::Subscribe {
                targets: vec!["bob".into()],
                tier: Tier::Realtime,
            },
        )
        .await;
    assert!(
        matches!(
            reply,
            ServerFrame::Reply {
                id: 1,
                result: Ok(_)
            }
        ),
        "{reply:?}"
    );
    bob.set_status(greendot_core::Status::Busy, Some("in a call"))
        .await
        .unwrap();
    loop {
        match alice.next().await {
            Got::Push(stream, Push::Update { target, presence })
                if target == "bob" && presence.status == Status::Busy =>
            {
                assert_eq!(stream, realtime);
                break;
            }
            Got::Push(..) => continue,
            other => panic!("no update: {other:?}"),
        }
    }
    let stats = ts.server.stats();
    assert_eq!(stats.connections_open, 2);
    assert_eq!(stats.connections_open_websocket, 1);
    let metrics = ts.server.monitor().metrics().await.unwrap().render();
    assert!(
        metrics.contains("greendot_connections{binding=\"websocket\"} 1")
            && metrics.contains("greendot_connections{binding=\"quic\"} 1"),
        "{metrics}"
    );

    // Close code 4001 is a logout: offline at once, not after the grace.
    bob_events.reset();
    let closed = tokio::time::Instant::now();
    alice.close(4001).await;
    let (at, _) = bob_events
        .wait_presence("alice", SLACK, |p| !p.online)
        .await
        .expect("alice offline");
    let grace = Duration::from_millis(ts.config().core.kinds[0].grace.0);
    assert!(at - closed < grace, "offline after {:?}", at - closed);
    assert!(eventually(SLACK, || ts.server.stats().connections_open_websocket == 0).await);
}

/// A TCP connection that is simply gone is a disconnect: the device
/// lingers for its grace, then is offline with last seen = last heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_websocket_lingers_then_goes_offline_as_of_last_heard() {
    let ts = server(|c| {
        // No idle timeout before the grace is over: the TCP reset decides.
        c.idle_timeout = Duration::from_secs(30);
    });
    let (bob, mut bob_events) = ts.connect("bob", "pc", Kind::Desktop).await;
    bob.subscribe(&["alice"], greendot_core::Tier::Realtime)
        .await
        .unwrap();
    let mut alice = WsClient::connect(&ts, "alice", "web").await;
    assert!(bob_events
        .wait_presence("alice", SLACK, |p| p.online)
        .await
        .is_some());
    let reply = alice.request(1, Request::Ping).await;
    assert!(matches!(reply, ServerFrame::Reply { .. }));
    let last_heard = now_ms();
    // Gone without a close frame (the TCP connection is dropped).
    drop(alice);
    let dropped = tokio::time::Instant::now();
    let (at, presence) = bob_events
        .wait_presence("alice", SLACK + SLACK, |p| !p.online)
        .await
        .expect("alice offline");
    let grace = Duration::from_millis(ts.config().core.kinds[0].grace.0);
    assert!(at - dropped >= grace, "offline after {:?}", at - dropped);
    let seen = presence.last_seen.expect("a last seen").0;
    assert!(
        seen <= last_heard + 50 && seen + 1000 >= last_heard,
        "last seen {seen}, last heard {last_heard}"
    );
}

/// Keep-alive: a client whose WebSocket answers pings stays past the idle
/// timeout; one that answers nothing is dropped after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pings_keep_a_websocket_and_silence_ends_it() {
    let ts = server(|_| {});
    let idle = ts.config().idle_timeout;
    let mut lively = WsClient::connect(&ts, "lively", "web").await;
    let silent = WsClient::connect(&ts, "silent", "web").await;
    let opened = tokio::time::Instant::now();
    // `lively` reads (tungstenite answers the pings); `silent` reads
    // nothing, so it answers no ping either.
    let reading = async {
        loop {
            if let Got::Closed(..) = lively.next().await {
                panic!("lively was closed");
            }
        }
    };
    let _ = tokio::time::timeout(idle * 2, reading).await;
    assert_eq!(ts.server.stats().connections_open_websocket, 1);
    assert!(opened.elapsed() >= idle);
    drop(silent);
}

/// Text messages and messages over `max_frame` are protocol errors: an
/// `Error` frame on stream 0, then close 4004 or 4005.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_and_oversize_messages_are_refused_with_their_close_codes() {
    let ts = server(|c| c.max_frame = 1024);
    let mut text = WsClient::connect(&ts, "t", "web").await;
    text.ws.send(Message::Text("hello".into())).await.unwrap();
    let (got, code) = text.until_closed().await;
    assert_eq!(code, Some(4004));
    assert!(got.iter().any(|g| matches!(
        g,
        Got::Control(ServerFrame::Error(e)) if e.code == greendot_proto::ErrorCode::BadFrame
    )));

    let mut big = WsClient::connect(&ts, "b", "web").await;
    big.ws
        .send(Message::Binary(vec![0u8; 1025].into()))
        .await
        .unwrap();
    let (got, code) = big.until_closed().await;
    assert_eq!(code, Some(4005));
    assert!(got.iter().any(|g| matches!(
        g,
        Got::Control(ServerFrame::Error(e)) if e.code == greendot_proto::ErrorCode::FrameTooLarge
    )));

    // At the cap exactly is a frame (a bad one here, but read).
    let mut exact = WsClient::connect(&ts, "e", "web").await;
    exact
        .ws
        .send(Message::Binary(vec![0xffu8; 1024].into()))
        .await
        .unwrap();
    let (_, code) = exact.until_closed().await;
    assert_eq!(code, Some(4004));
}

/// The upgrade needs the path and the subprotocol: 404 and 400 otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_needs_the_path_and_the_subprotocol() {
    let ts = server(|_| {});
    let status = |r: Result<WebSocketStream<Tls>, WsError>| match r {
        Err(WsError::Http(response)) => Some(response.status().as_u16()),
        _ => None,
    };
    assert_eq!(
        status(open(&ts, "/other", Some("greendot.v1"), None).await),
        Some(404)
    );
    assert_eq!(status(open(&ts, "/greendot", None, None).await), Some(400));
    assert_eq!(
        status(open(&ts, "/greendot", Some("greendot/1"), None).await),
        Some(400)
    );
    assert_eq!(ts.server.stats().connections_total, 0);
}

/// The hello is held to `max_hello` (later frames to `max_frame`): a larger
/// first message gets `FrameTooLarge` and close 4005, counted at the door;
/// after the welcome, a frame larger than the hello cap is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hello_is_held_to_max_hello_and_later_frames_to_max_frame() {
    let ts = server(|c| c.max_hello = 1024);
    let mut big = WsClient {
        ws: open(&ts, "/greendot", Some("greendot.v1"), None)
            .await
            .expect("upgrade"),
    };
    big.ws
        .send(Message::Binary(vec![0u8; 2000].into()))
        .await
        .unwrap();
    let (got, code) = big.until_closed().await;
    assert_eq!(code, Some(4005));
    assert!(got.iter().any(|g| matches!(
        g,
        Got::Control(ServerFrame::Error(e)) if e.code == greendot_proto::ErrorCode::FrameTooLarge
    )));
    let metrics = ts.server.monitor().metrics().await.unwrap();
    assert_eq!(
        metrics
            .websocket_shed
            .iter()
            .find(|(reason, _)| *reason == "hello_too_large")
            .map(|(_, n)| *n),
        Some(1)
    );

    // Welcomed: a status message longer than the hello cap is a frame.
    let mut alice = WsClient::connect(&ts, "alice", "web").await;
    let long = "x".repeat(1000);
    let answer = alice
        .request(
            1,
            Request::SetStatus {
                status: Status::Busy,
                message: Some(long.repeat(2)),
            },
        )
        .await;
    assert!(
        !matches!(answer, ServerFrame::Error(ref e) if e.code == greendot_proto::ErrorCode::FrameTooLarge),
        "{answer:?}"
    );
    assert!(
        matches!(answer, ServerFrame::Reply { id: 1, .. }),
        "{answer:?}"
    );
}
