//! The Rust client's errors are typed: a caller can match on what happened
//! (which handshake failed and why, how the server broke the protocol, how
//! the connection was lost) and reach the underlying error through
//! `source()`. Against the real server where it can produce the failure,
//! against a fake QUIC server where only a broken server can.

use greendot_client::quinn;
use greendot_client::{
    Carrier, Client, ClientConfig, ClientError, ConfigError, ConnectError, LostReason,
    ProtocolError,
};
use greendot_core::Status;
use greendot_proto::{
    self as proto, encode_frame, Answer, CloseCode, ErrorCode, Hello, Kind, RequestFrame,
    ServerFrame, Welcome,
};
use greendot_server::tls::{self, Identity};
use greendot_server::token::WatchClaim;
use greendot_tests::TestServer;
use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A TCP port nobody listens on (bound, then released).
fn closed_tcp_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind(loopback()).unwrap();
    listener.local_addr().unwrap()
}

/// A config for the real server, QUIC only unless the test says otherwise.
fn real(ts: &TestServer) -> ClientConfig {
    let mut config = ts.client_config(ts.token("ann", "phone", Kind::Mobile, WatchClaim::all()));
    config.websocket = greendot_client::WebSocket::Off;
    config.reconnect = None;
    config
}

/// What the fake server does once the client said hello.
#[derive(Clone, Copy)]
enum Script {
    /// A reply before any welcome.
    ReplyFirst,
    /// Bytes that are no server frame.
    Garbage,
    /// Welcome, then answer every request with `Route([])`.
    WrongAnswer,
    /// Welcome, then answer every request with `Presences([])`.
    EmptyPresences,
    /// Welcome, then a second welcome in place of the first answer.
    SecondWelcome,
    /// Welcome, then close normally at the first request.
    CloseAtRequest,
}

fn welcome() -> ServerFrame {
    ServerFrame::Welcome(Welcome {
        version: proto::VERSION,
        session: 1,
        resumed: false,
        user: "u".into(),
        device: "d".into(),
        snapshots: Vec::new(),
        max_frame: proto::DEFAULT_MAX_FRAME as u32,
    })
}

/// A QUIC server that follows `script` on every connection; a client
/// config for it (QUIC only, no reconnect).
fn fake(script: Script) -> ClientConfig {
    let identity = Identity::self_signed(&["localhost"]).unwrap();
    let crypto = tls::server_crypto(&identity, b"test ticket secret").unwrap();
    let server = quinn::Endpoint::server(
        quinn::ServerConfig::with_crypto(Arc::new(crypto)),
        loopback(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(incoming) = server.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                    return;
                };
                let mut reader = proto::FrameReader::new(1 << 16);
                let Ok(Some(payload)) = proto::codec::read_frame(&mut recv, &mut reader).await
                else {
                    return;
                };
                let _: Hello = proto::decode(&payload).unwrap();
                let first = match script {
                    Script::ReplyFirst => encode_frame(&ServerFrame::Reply {
                        id: 1,
                        result: Ok(Answer::Done),
                    })
                    .unwrap(),
                    // A length prefix, then a variant no ServerFrame has.
                    Script::Garbage => vec![0, 0, 0, 2, 0xff, 0xff],
                    _ => encode_frame(&welcome()).unwrap(),
                };
                if send.write_all(&first).await.is_err() {
                    return;
                }
                while let Ok(Some(payload)) = proto::codec::read_frame(&mut recv, &mut reader).await
                {
                    let request: RequestFrame = proto::decode(&payload).unwrap();
                    let answer = |answer| ServerFrame::Reply {
                        id: request.id,
                        result: Ok(answer),
                    };
                    let frame = match script {
                        Script::WrongAnswer => answer(Answer::Route(Vec::new())),
                        Script::EmptyPresences => answer(Answer::Presences(Vec::new())),
                        Script::SecondWelcome => welcome(),
                        _ => {
                            conn.close(CloseCode::Normal.varint(), b"bye");
                            break;
                        }
                    };
                    if send
                        .write_all(&encode_frame(&frame).unwrap())
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
                // Hold the connection until the client is done with it.
                conn.closed().await;
            });
        }
    });
    let mut config = ClientConfig::new(addr, identity.certs.clone(), "token");
    config.bind = Some(loopback());
    config.websocket = greendot_client::WebSocket::Off;
    config.reconnect = None;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_quic_handshake_carries_quinns_error() {
    let ts = TestServer::start(|_| {});
    let mut config = real(&ts);
    config.alpn = b"greendot/0".to_vec();
    let error = Client::connect(config).await.expect_err("wrong ALPN");
    let ClientError::Connect(ConnectError::QuicHandshake(cause)) = &error else {
        panic!("{error:?}");
    };
    let Some(quinn::ConnectionError::ConnectionClosed(close)) = cause.downcast_ref() else {
        panic!("{error:?}");
    };
    // TLS alert 120, no_application_protocol (QUIC CRYPTO_ERROR 0x178).
    assert_eq!(u64::from(close.error_code), 0x178, "{close:?}");
    let source = error.source().expect("a source");
    assert!(source.downcast_ref::<quinn::ConnectionError>().is_some());
    assert!(error.to_string().starts_with("cannot connect: "), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_carriers_failing_says_how_each_failed() {
    let ts = TestServer::start(|_| {});
    let mut config = real(&ts);
    config.alpn = b"greendot/0".to_vec();
    let tcp = closed_tcp_port();
    config.websocket = greendot_client::WebSocket::At(tcp);
    let error = Client::connect(config)
        .await
        .expect_err("nothing to connect to");
    let ClientError::Connect(ConnectError::Both { quic, websocket }) = &error else {
        panic!("{error:?}");
    };
    assert!(
        matches!(**quic, ClientError::Connect(ConnectError::QuicHandshake(_))),
        "{quic:?}"
    );
    let ClientError::Connect(ConnectError::WebSocketTcp { addr, source }) = &**websocket else {
        panic!("{websocket:?}");
    };
    assert_eq!(*addr, tcp);
    assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
    let text = error.to_string();
    assert!(
        text.starts_with("cannot connect: QUIC: cannot connect: ")
            && text.contains(&format!("; WebSocket: cannot connect: WebSocket {tcp}: ")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_config_errors() {
    let ts = TestServer::start(|c| c.websocket = Some(loopback()));
    // QUIC refuses the name before any I/O.
    let mut config = real(&ts);
    config.server_name = Some("not a name!".into());
    match Client::connect(config.clone()).await {
        Err(ClientError::Connect(ConnectError::Quic(cause))) => match cause.downcast_ref() {
            Some(quinn::ConnectError::InvalidServerName(name)) => assert_eq!(name, "not a name!"),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    // With the WebSocket fallback (TCP connects), its own check says the same.
    config.websocket = ts.server.websocket_addr().into();
    assert!(config.websocket != greendot_client::WebSocket::Off);
    let error = Client::connect(config.clone()).await.expect_err("bad name");
    let ClientError::Connect(ConnectError::Both { websocket, .. }) = &error else {
        panic!("{error:?}");
    };
    match &**websocket {
        ClientError::Config(ConfigError::ServerName { name, .. }) => {
            assert_eq!(name, "not a name!")
        }
        other => panic!("{other:?}"),
    }
    // An idle timeout beyond what QUIC can carry.
    let mut config = real(&ts);
    config.idle_timeout = Duration::from_secs(u64::MAX / 1000);
    match Client::connect(config).await {
        Err(e @ ClientError::Config(ConfigError::IdleTimeoutTooLarge)) => {
            assert_eq!(
                e.to_string(),
                "invalid client setting: idle_timeout too large"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_answer_in_time_is_a_typed_timeout() {
    // A UDP port nobody listens on: QUIC hears nothing back.
    let socket = std::net::UdpSocket::bind(loopback()).unwrap();
    let addr = socket.local_addr().unwrap();
    drop(socket);
    let identity = Identity::self_signed(&["localhost"]).unwrap();
    let mut config = ClientConfig::new(addr, identity.certs, "token");
    config.bind = Some(loopback());
    config.websocket = greendot_client::WebSocket::Off;
    config.connect_timeout = Duration::from_millis(400);
    match Client::connect(config).await {
        Err(ClientError::Connect(ConnectError::TimedOut { server, after })) => {
            assert_eq!((server, after), (addr, Duration::from_millis(400)));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_servers_frame_cap_is_not_sent() {
    let ts = TestServer::start(|_| {});
    let (client, _updates) = Client::connect(real(&ts)).await.unwrap();
    let message = "x".repeat(proto::DEFAULT_MAX_FRAME * 2);
    match client.set_status(Status::Busy, Some(&message)).await {
        Err(ClientError::Config(ConfigError::RequestTooLarge { len, max })) => {
            assert!(len > message.len() && max < message.len(), "{len} {max}");
        }
        other => panic!("{other:?}"),
    }
    // Nothing was sent: the connection carries on.
    client.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_violations_before_the_welcome_are_typed() {
    match Client::connect(fake(Script::ReplyFirst)).await {
        Err(ClientError::Protocol(ProtocolError::ReplyBeforeWelcome)) => {}
        other => panic!("{other:?}"),
    }
    match Client::connect(fake(Script::Garbage)).await {
        Err(e @ ClientError::Protocol(ProtocolError::BadFrame { .. })) => {
            let ClientError::Protocol(ProtocolError::BadFrame { carrier, error }) = &e else {
                unreachable!()
            };
            assert_eq!(*carrier, Carrier::Quic);
            assert_eq!(error.code, ErrorCode::BadFrame);
            let source = e.source().expect("a source");
            assert!(source.downcast_ref::<proto::WireError>().is_some());
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_answers_are_typed() {
    let (client, _updates) = Client::connect(fake(Script::WrongAnswer)).await.unwrap();
    match client.ping().await {
        Err(ClientError::Protocol(ProtocolError::UnexpectedAnswer { answer })) => {
            assert_eq!(*answer, Answer::Route(Vec::new()));
        }
        other => panic!("{other:?}"),
    }
    let (client, _updates) = Client::connect(fake(Script::EmptyPresences)).await.unwrap();
    match client.query("bob").await {
        Err(ClientError::Protocol(ProtocolError::EmptyQueryAnswer)) => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_ending_under_a_request_says_how() {
    // A second welcome ends the connection; the waiting request (sent:
    // its outcome is unknown) hears why.
    let (client, _updates) = Client::connect(fake(Script::SecondWelcome)).await.unwrap();
    match client.ping().await {
        Err(ClientError::OutcomeUnknown { lost: Some(e) }) => {
            assert!(
                matches!(*e, ClientError::Protocol(ProtocolError::SecondWelcome)),
                "{e:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    // A normal close by the server: lost, with quinn's error as the source.
    let (client, _updates) = Client::connect(fake(Script::CloseAtRequest)).await.unwrap();
    match client.ping().await {
        Err(ClientError::OutcomeUnknown { lost: Some(e) }) => {
            let ClientError::Lost(LostReason::Quic(cause)) = &*e else {
                panic!("{e:?}");
            };
            assert!(matches!(
                cause.downcast_ref(),
                Some(quinn::ConnectionError::ApplicationClosed(_))
            ));
            assert!(e
                .source()
                .unwrap()
                .downcast_ref::<quinn::ConnectionError>()
                .is_some());
            assert!(e.to_string().starts_with("connection lost: "), "{e}");
        }
        other => panic!("{other:?}"),
    }
}
