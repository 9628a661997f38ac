//! WebTransport over HTTP/3 against a real server: a quinn client speaks
//! the HTTP/3 handshake (SETTINGS, extended CONNECT) with
//! `web-transport-proto`, then greendot frames on a WebTransport
//! bidirectional stream and two push streams, beside a raw QUIC client.

use greendot_client::{Client, ClientConfig, Event};
use greendot_proto::{
    encode_frame, Answer, Hello, Push, Request, RequestFrame, ServerFrame, Tier, VERSION,
};
use greendot_server::token::{Claims, WatchClaim};
use greendot_server::{Server, ServerConfig};
use std::sync::Arc;
use std::time::Duration;
use web_transport_proto::{
    Capsule, ConnectError, ConnectRequest, ConnectResponse, Settings, StreamUni, VarInt,
};

const WAIT: Duration = Duration::from_secs(10);

fn server() -> Server {
    let mut config = ServerConfig::new(b"secret".to_vec());
    config.listen = "127.0.0.1:0".parse().unwrap();
    Server::bind(config).unwrap()
}

fn token(server: &Server, user: &str, device: &str) -> String {
    server
        .mint(&Claims {
            sub: user.into(),
            dev: device.into(),
            kind: Default::default(),
            watch: WatchClaim::Star("*".into()),
            svc: false,
            exp: u64::MAX / 2,
            iat: None,
        })
        .unwrap()
}

async fn h3_connection(server: &Server) -> quinn::Connection {
    h3_connection_on(server).await.0
}

/// An HTTP/3 connection and the client endpoint it runs on (to move it).
async fn h3_connection_on(server: &Server) -> (quinn::Connection, quinn::Endpoint) {
    let crypto =
        greendot_client::tls::client_crypto(std::slice::from_ref(server.certificate()), b"h3")
            .unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = endpoint
        .connect(server.local_addr(), "localhost")
        .unwrap()
        .await
        .unwrap();
    // HTTP/3: the client's control stream with its SETTINGS.
    let mut control = conn.open_uni().await.unwrap();
    let mut settings = Settings::default();
    settings.enable_webtransport(1);
    let mut bytes = Vec::new();
    settings.encode(&mut bytes);
    control.write_all(&bytes).await.unwrap();
    // Kept open for the connection's life, as HTTP/3 requires.
    std::mem::forget(control);
    (conn, endpoint)
}

/// Sends raw CONNECT bytes; the response status, or why there is none.
async fn connect_raw(
    conn: &quinn::Connection,
    request: &[u8],
) -> (quinn::SendStream, quinn::RecvStream, Result<u16, String>) {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(request).await.unwrap();
    let mut buf = Vec::new();
    let status = loop {
        match ConnectResponse::decode(&mut &buf[..]) {
            Ok(response) => break Ok(response.status.as_u16()),
            Err(ConnectError::WrongStatus(Some(status))) => break Ok(status.as_u16()),
            Err(ConnectError::UnexpectedEnd) => {}
            Err(e) => break Err(e.to_string()),
        }
        let mut chunk = [0u8; 256];
        match tokio::time::timeout(WAIT, recv.read(&mut chunk)).await {
            Ok(Ok(Some(n))) => buf.extend_from_slice(&chunk[..n]),
            other => break Err(format!("no response: {other:?}")),
        }
    };
    (send, recv, status)
}

fn connect_request(path: &str) -> Vec<u8> {
    let url = url::Url::parse(&format!("https://localhost{path}")).unwrap();
    let mut bytes = Vec::new();
    ConnectRequest::new(url).encode(&mut bytes).unwrap();
    bytes
}

fn varint(v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    VarInt::from_u64(v).unwrap().encode(&mut out);
    out
}

async fn read_varint(recv: &mut quinn::RecvStream) -> u64 {
    let mut first = [0u8; 1];
    recv.read_exact(&mut first).await.unwrap();
    let len = 1usize << (first[0] >> 6);
    let mut bytes = vec![first[0]];
    bytes.resize(len, 0);
    recv.read_exact(&mut bytes[1..]).await.unwrap();
    VarInt::decode(&mut &bytes[..]).unwrap().into_inner()
}

async fn read_frame<T: serde::de::DeserializeOwned>(recv: &mut quinn::RecvStream) -> T {
    let mut len = [0u8; 4];
    tokio::time::timeout(WAIT, recv.read_exact(&mut len))
        .await
        .expect("no frame in time")
        .unwrap();
    let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
    recv.read_exact(&mut payload).await.unwrap();
    greendot_proto::decode(&payload).unwrap()
}

/// A browser-like WebTransport session, welcomed.
struct Wt {
    conn: quinn::Connection,
    session_recv: quinn::RecvStream,
    session_send: Option<quinn::SendStream>,
    control_send: quinn::SendStream,
    control_recv: quinn::RecvStream,
    /// By tier: realtime, batched.
    pushes: [quinn::RecvStream; 2],
    session: u64,
    /// The server's HTTP/3 control stream (it stays open).
    _settings: Option<quinn::RecvStream>,
    endpoint: quinn::Endpoint,
}

impl Wt {
    async fn open(server: &Server, token: String) -> Wt {
        let (conn, endpoint) = h3_connection_on(server).await;
        let (session_send, session_recv, status) =
            connect_raw(&conn, &connect_request("/greendot")).await;
        assert_eq!(status, Ok(200));
        let session = quinn::VarInt::from(session_send.id()).into_inner();
        let (mut control_send, mut control_recv) = conn.open_bi().await.unwrap();
        let mut bytes = varint(0x41);
        bytes.extend(varint(session));
        let hello = Hello {
            version: VERSION,
            token,
            resume: None,
            foreground: true,
        };
        bytes.extend(encode_frame(&hello).unwrap());
        control_send.write_all(&bytes).await.unwrap();
        let welcome: ServerFrame = read_frame(&mut control_recv).await;
        assert!(
            matches!(welcome, ServerFrame::Welcome(_)),
            "not welcomed: {welcome:?}"
        );
        let mut by_tier: [Option<quinn::RecvStream>; 2] = [None, None];
        let mut settings = None;
        while by_tier.iter().any(Option::is_none) {
            let mut push = tokio::time::timeout(WAIT, conn.accept_uni())
                .await
                .expect("no push stream")
                .unwrap();
            let kind = read_varint(&mut push).await;
            if kind == 0 && settings.is_none() {
                // The server's HTTP/3 control stream: its SETTINGS frame.
                assert_eq!(read_varint(&mut push).await, 0x04, "not SETTINGS");
                let len = read_varint(&mut push).await;
                let mut payload = vec![0u8; len as usize];
                push.read_exact(&mut payload).await.unwrap();
                let mut stream = varint(0);
                stream.extend(varint(0x04));
                stream.extend(varint(len));
                stream.extend(payload);
                let decoded = Settings::decode(&mut &stream[..]).unwrap();
                assert!(decoded.supports_webtransport() > 0, "{decoded:?}");
                settings = Some(push);
                continue;
            }
            assert_eq!(kind, 0x54, "WebTransport stream type");
            assert_eq!(read_varint(&mut push).await, session, "session id");
            let tier = match read_frame::<Push>(&mut push).await {
                Push::Stream {
                    tier: Tier::Realtime,
                } => 0,
                Push::Stream {
                    tier: Tier::Batched,
                } => 1,
                other => panic!("a push stream began with {other:?}"),
            };
            by_tier[tier] = Some(push);
        }
        let [Some(realtime), Some(batched)] = by_tier else {
            panic!("two push streams of the same tier");
        };
        Wt {
            conn,
            session_recv,
            session_send: Some(session_send),
            control_send,
            control_recv,
            pushes: [realtime, batched],
            session,
            _settings: settings,
            endpoint,
        }
    }

    async fn request(&mut self, id: u64, request: Request) -> Answer {
        let frame = RequestFrame { id, request };
        self.control_send
            .write_all(&encode_frame(&frame).unwrap())
            .await
            .unwrap();
        match read_frame::<ServerFrame>(&mut self.control_recv).await {
            ServerFrame::Reply { id: got, result } if got == id => result.unwrap(),
            other => panic!("not the reply to {id}: {other:?}"),
        }
    }

    /// The close capsule the server sends on the session stream.
    async fn server_close(&mut self) -> (u32, String) {
        let bytes = tokio::time::timeout(WAIT, self.session_recv.read_to_end(4096))
            .await
            .expect("the session stream did not end")
            .unwrap();
        match Capsule::decode(&mut &bytes[..]).unwrap() {
            Capsule::CloseWebTransportSession { code, reason } => (code, reason),
            other => panic!("not a close capsule: {other:?}"),
        }
    }

    /// Opens a WebTransport stream of the client's, which the server
    /// refuses (STOP_SENDING): an answer that needs the connection up.
    async fn a_client_stream_is_refused(&self) {
        let mut uni = self.conn.open_uni().await.unwrap();
        uni.write_all(&varint(StreamUni::WEBTRANSPORT.0.into_inner()))
            .await
            .unwrap();
        let stopped = tokio::time::timeout(WAIT, uni.stopped())
            .await
            .expect("a client WebTransport stream was never answered");
        assert!(matches!(stopped, Ok(Some(_))), "{stopped:?}");
    }

    async fn client_close(&mut self, code: u32) {
        let mut send = self.session_send.take().unwrap();
        let mut bytes = Vec::new();
        Capsule::CloseWebTransportSession {
            code,
            reason: "bye".into(),
        }
        .encode(&mut bytes);
        send.write_all(&bytes).await.unwrap();
        send.finish().unwrap();
    }
}

/// A raw QUIC client (the native library) for `user`.
async fn native(server: &Server, user: &str, device: &str) -> (Client, greendot_client::Updates) {
    let mut config = ClientConfig::new(
        server.local_addr(),
        vec![server.certificate().clone()],
        token(server, user, device),
    );
    config.reconnect = None;
    Client::connect(config).await.unwrap()
}

/// The next presence of `target` seen by a native client.
async fn next_presence(updates: &mut greendot_client::Updates, target: &str) -> bool {
    loop {
        match tokio::time::timeout(WAIT, updates.next()).await {
            Ok(Some(Event::Presence {
                target: t,
                presence,
                ..
            })) if t == target => return presence.online,
            Ok(Some(_)) => {}
            other => panic!("no presence of {target}: {other:?}"),
        }
    }
}

/// carol (native, QUIC) watches alice in realtime; alice comes online over
/// WebTransport and carol sees it.
async fn alice_watched_by_carol(server: &Server) -> (Client, greendot_client::Updates, Wt) {
    let (carol, mut carol_updates) = native(server, "carol", "laptop").await;
    carol
        .subscribe(&["alice"], greendot_core::Tier::Realtime)
        .await
        .unwrap();
    assert!(!next_presence(&mut carol_updates, "alice").await);
    let alice = Wt::open(server, token(server, "alice", "browser")).await;
    assert!(next_presence(&mut carol_updates, "alice").await);
    (carol, carol_updates, alice)
}

/// The next update pushed to a WebTransport client on `tier`.
async fn next_push(wt: &mut Wt, tier: usize) -> (String, bool) {
    match read_frame::<Push>(&mut wt.pushes[tier]).await {
        Push::Update { target, presence } => (target, presence.online),
        other => panic!("not an update: {other:?}"),
    }
}

#[tokio::test]
async fn a_webtransport_session_is_a_session_like_any_other() {
    let server = server();
    // alice comes online over WebTransport: the QUIC watcher sees her.
    let (_carol, mut carol_updates, mut alice) = alice_watched_by_carol(&server).await;

    // alice subscribes to bob (realtime) and dave (batched): the pushes come
    // on both WebTransport push streams.
    let answer = alice
        .request(
            1,
            Request::Subscribe {
                targets: vec!["bob".into()],
                tier: Tier::Realtime,
            },
        )
        .await;
    assert!(matches!(answer, Answer::Subscribed { .. }), "{answer:?}");
    let answer = alice
        .request(
            2,
            Request::Subscribe {
                targets: vec!["dave".into()],
                tier: Tier::Batched,
            },
        )
        .await;
    assert!(matches!(answer, Answer::Subscribed { .. }), "{answer:?}");
    let (_bob, _bob_updates) = native(&server, "bob", "phone").await;
    assert_eq!(next_push(&mut alice, 0).await, ("bob".into(), true));
    let (_dave, _dave_updates) = native(&server, "dave", "phone").await;
    assert_eq!(next_push(&mut alice, 1).await, ("dave".into(), true));
    assert_eq!(alice.request(3, Request::Ping).await, Answer::Done);

    // Closing the session with code 1 is a logout: offline at once (a
    // disconnect would linger for the grace).
    alice.client_close(1).await;
    assert!(!next_presence(&mut carol_updates, "alice").await);
    let closed = tokio::time::timeout(WAIT, alice.conn.closed())
        .await
        .expect("the server did not close the connection after the session");
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(_)),
        "{closed:?}"
    );
}

#[tokio::test]
async fn the_server_closes_a_session_with_the_greendot_close_code() {
    let server = server();
    let mut first = Wt::open(&server, token(&server, "erin", "browser")).await;
    // The same device again: the first session is superseded (code 2).
    let _second = Wt::open(&server, token(&server, "erin", "browser")).await;
    let (code, reason) = first.server_close().await;
    assert_eq!(
        code,
        greendot_proto::CloseCode::Superseded.code(),
        "{reason}"
    );
    // The connection carries on until the client has ended its side of the
    // session stream (a browser's page has the close code only once it has
    // taken in the capsule): a stream it opens now is still answered (here
    // refused), not lost with the connection.
    first.a_client_stream_is_refused().await;
    // The client ends its side: then the QUIC connection closes.
    first.session_send.take().unwrap().finish().unwrap();
    tokio::time::timeout(WAIT, first.conn.closed())
        .await
        .expect("the connection stayed open after the client ended the session");
    let _ = first.session;
}

#[tokio::test]
async fn a_client_that_never_answers_a_close_capsule_is_closed_after_a_linger() {
    let server = server();
    let mut first = Wt::open(&server, token(&server, "gil", "browser")).await;
    let _second = Wt::open(&server, token(&server, "gil", "browser")).await;
    first.server_close().await;
    // The client keeps its side of the session stream open.
    let closed = tokio::time::timeout(WAIT, first.conn.closed())
        .await
        .expect("the connection stayed open past the linger");
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(_)),
        "{closed:?}"
    );
}

#[tokio::test]
async fn a_connect_to_another_path_is_refused_with_404() {
    let server = server();
    let conn = h3_connection(&server).await;
    let (_send, _recv, status) = connect_raw(&conn, &connect_request("/other")).await;
    assert_eq!(status, Ok(404));
}

#[tokio::test]
async fn a_connect_header_block_past_the_bound_is_refused_before_it_is_stored() {
    let server = server();
    let conn = h3_connection(&server).await;
    // A HEADERS frame announcing 6000 bytes (under HTTP/3's own 16 KiB
    // limit), sent in full: refused once the server holds its bound.
    let mut request = varint(0x01);
    request.extend(varint(6000));
    request.extend(std::iter::repeat_n(0u8, 6000));
    let (_send, _recv, status) = connect_raw(&conn, &request).await;
    assert_eq!(status, Ok(431));
}

#[tokio::test]
async fn client_unidirectional_streams_are_refused() {
    let server = server();
    // (A second control stream cannot even be opened: the stream limit of a
    // WebTransport connection is its CONNECT and control streams.)
    let mut wt = Wt::open(&server, token(&server, "fay", "browser")).await;
    wt.a_client_stream_is_refused().await;
    // The session carries on.
    assert_eq!(wt.request(1, Request::Ping).await, Answer::Done);
}

/// Migration keeps working inside WebTransport: the browser's side moves to
/// a new UDP socket (a new port, as after a network change), and its
/// session, its push streams and what watchers see all carry on.
#[tokio::test]
async fn a_webtransport_session_survives_a_change_of_address() {
    let server = server();
    let (_carol, mut carol_updates, mut alice) = alice_watched_by_carol(&server).await;
    let answer = alice
        .request(
            1,
            Request::Subscribe {
                targets: vec!["bob".into()],
                tier: Tier::Realtime,
            },
        )
        .await;
    assert!(matches!(answer, Answer::Subscribed { .. }), "{answer:?}");
    let before = server.stats().migrations;

    let old = alice.endpoint.local_addr().unwrap();
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    alice.endpoint.rebind(socket).unwrap();
    assert_ne!(alice.endpoint.local_addr().unwrap(), old);
    // Traffic on the new path: the server validates it and moves.
    assert_eq!(alice.request(2, Request::Ping).await, Answer::Done);
    let (_bob, _bob_updates) = native(&server, "bob", "phone").await;
    assert_eq!(next_push(&mut alice, 0).await, ("bob".into(), true));
    let deadline = tokio::time::Instant::now() + WAIT;
    while server.stats().migrations == before && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        server.stats().migrations,
        before + 1,
        "no migration counted"
    );
    // Nobody saw alice go offline (a debounce and more after the move).
    let quiet = tokio::time::Instant::now() + std::time::Duration::from_millis(600);
    while let Ok(Some(event)) = tokio::time::timeout_at(quiet, carol_updates.next()).await {
        if let Event::Presence {
            target, presence, ..
        } = event
        {
            assert!(
                target != "alice" || presence.online,
                "carol saw alice offline after the move"
            );
        }
    }
    assert_eq!(alice.request(3, Request::Ping).await, Answer::Done);
}
