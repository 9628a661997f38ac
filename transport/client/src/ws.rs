//! The WebSocket carrier (docs/protocol.md, "WebSocket over TLS"): TCP, TLS
//! 1.3, the upgrade to `wss://HOST:PORT/greendot` with subprotocol
//! `greendot.v1`, then one task per connection that owns the socket. The
//! session logic is the same as over QUIC (`run` in the crate root): this
//! task only turns messages into [`Inbound`] items and [`Out`] commands into
//! messages, and keeps the connection alive (pings, idle timeout).

use crate::error::Cause;
use crate::{
    error_code_for, trust, Carrier, ClientConfig, ClientError, ConfigError, ConnectError, Inbound,
    LostReason, ProtocolError, Source,
};
use futures_util::{SinkExt, StreamExt};
use greendot_proto::{self as proto, CloseCode, Push, ServerFrame, WireError};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use tracing::debug;

/// The subprotocol offered (and required in the answer).
pub const SUBPROTOCOL: &str = "greendot.v1";
/// The path of the upgrade request unless configured otherwise.
pub const PATH: &str = "/greendot";
/// How long a close may take to go out (and its answer to come back).
const CLOSE_LINGER: Duration = Duration::from_millis(500);

pub(crate) type Stream = WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>;

/// What the session loop asks of the connection's task.
pub(crate) enum Out {
    /// One frame's payload (without the length prefix), as one message.
    Frame(Vec<u8>),
    /// Close with this greendot close code, then end.
    Close {
        code: CloseCode,
        reason: &'static str,
        done: oneshot::Sender<()>,
    },
}

/// The TLS configuration of the WebSocket carrier: TLS 1.3, ALPN
/// `http/1.1` (what the server's TCP listener offers), and a session cache
/// of its own (QUIC tickets carry QUIC transport parameters; keep the two
/// apart).
pub(crate) fn tls_config(config: &ClientConfig) -> Result<Arc<rustls::ClientConfig>, ClientError> {
    let mut tls = match crate::custom_tls(config) {
        Some(given) => {
            let mut tls = (**given).clone();
            tls.resumption = rustls::client::Resumption::default();
            tls
        }
        None => trust::client_tls(&config.trust)?,
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(tls))
}

/// TCP, TLS and the upgrade; no greendot frame is sent yet.
pub(crate) async fn handshake(
    config: &ClientConfig,
    addr: std::net::SocketAddr,
    server_name: &str,
    tls: Arc<rustls::ClientConfig>,
) -> Result<Stream, ClientError> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| ConnectError::WebSocketTcp {
            addr,
            source: Arc::new(e),
        })?;
    // Requests are small and latency matters more than packet count.
    let _ = tcp.set_nodelay(true);
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned()).map_err(|e| {
        ConfigError::ServerName {
            name: server_name.to_owned(),
            cause: Cause::new(e),
        }
    })?;
    let tls = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| ConnectError::WebSocketTls {
            addr,
            source: Arc::new(e),
        })?;
    let host = if server_name.contains(':') {
        format!("[{server_name}]")
    } else {
        server_name.to_owned()
    };
    let url = format!("wss://{host}:{}{}", addr.port(), config.websocket_path);
    let mut request =
        url.as_str()
            .into_client_request()
            .map_err(|e| ConfigError::WebSocketUrl {
                url: url.clone(),
                cause: Cause::new(e),
            })?;
    request.headers_mut().insert(
        "sec-websocket-protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    // A server message is at most a server frame plus its stream byte.
    let ws_config = WebSocketConfig::default()
        .max_message_size(Some(proto::MAX_SERVER_FRAME + 1))
        .max_frame_size(Some(proto::MAX_SERVER_FRAME + 1));
    let (ws, response) = tokio_tungstenite::client_async_with_config(request, tls, Some(ws_config))
        .await
        .map_err(|e| ConnectError::WebSocketUpgrade {
            addr,
            cause: Cause::new(e),
        })?;
    if response
        .headers()
        .get("sec-websocket-protocol")
        .and_then(|v| v.to_str().ok())
        != Some(SUBPROTOCOL)
    {
        return Err(ConnectError::NoSubprotocol { addr }.into());
    }
    Ok(ws)
}

/// What a close from the server means to the client (docs/protocol.md:
/// 4000 + greendot code; anything else is a lost connection).
fn closed_by_server(frame: Option<CloseFrame>) -> ClientError {
    let Some(frame) = frame else {
        return LostReason::WebSocketClosedWithoutCode.into();
    };
    let raw = u16::from(frame.code);
    if !(4000..=4999).contains(&raw) {
        return LostReason::WebSocketClosed {
            code: raw,
            reason: frame.reason.to_string(),
        }
        .into();
    }
    let code = CloseCode::from_code(u64::from(raw - 4000));
    if code == Some(CloseCode::Normal) {
        return LostReason::ClosedByServer {
            reason: frame.reason.to_string(),
        }
        .into();
    }
    ClientError::Rejected {
        code,
        error: WireError::new(error_code_for(code), frame.reason.to_string()),
    }
}

/// The connection's task: messages in, commands out, pings, idle timeout.
/// It ends after telling the session loop why (an [`Inbound::Ended`]),
/// or after a close asked for by the session loop.
pub(crate) async fn drive(
    mut ws: Stream,
    mut out: mpsc::Receiver<Out>,
    inbound: mpsc::UnboundedSender<Inbound>,
    keep_alive: Duration,
    idle_timeout: Duration,
) {
    let mut ping = tokio::time::interval(keep_alive.max(Duration::from_millis(10)));
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.tick().await;
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    // Which tier each push stream carries, from its first frame.
    let mut sources: [Option<Source>; 2] = [None, None];
    let ended = loop {
        tokio::select! {
            message = ws.next() => {
                idle.as_mut().reset(tokio::time::Instant::now() + idle_timeout);
                let bytes = match message {
                    Some(Ok(Message::Binary(bytes))) => bytes,
                    Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
                    Some(Ok(Message::Text(_))) => break protocol_error(&mut ws, ProtocolError::WebSocketText).await,
                    Some(Ok(Message::Close(frame))) => {
                        // Answer the close (tungstenite queued the reply).
                        let _ = tokio::time::timeout(CLOSE_LINGER, ws.close(None)).await;
                        break closed_by_server(frame);
                    }
                    Some(Err(e)) => break LostReason::WebSocket(Cause::new(e)).into(),
                    None => break LostReason::WebSocketEnded.into(),
                };
                let item = match bytes.split_first() {
                    Some((0, payload)) if !payload.is_empty() => {
                        match proto::decode::<ServerFrame>(payload) {
                            Ok(frame) => Some(Inbound::Frame(frame)),
                            Err(error) => break protocol_error(&mut ws, bad_frame(error)).await,
                        }
                    }
                    Some((s @ (1 | 2), payload)) if !payload.is_empty() => {
                        let slot = &mut sources[usize::from(*s - 1)];
                        match proto::decode::<Push>(payload) {
                            Ok(Push::Stream { tier }) => {
                                *slot = Some(match tier {
                                    proto::Tier::Realtime => Source::Realtime,
                                    proto::Tier::Batched => Source::Batched,
                                });
                                None
                            }
                            Ok(push @ (Push::GroupCount { .. } | Push::GroupMember { .. } | Push::GroupEnded { .. } | Push::GroupPageDelta { .. })) => {
                                crate::groups::inbound(push, *slot)
                            }
                            Ok(Push::Update { target, presence }) => slot.map(|source| {
                                Inbound::Push { target, presence, source }
                            }),
                            Err(error) => break protocol_error(&mut ws, bad_frame(error)).await,
                        }
                    }
                    _ => break protocol_error(&mut ws, ProtocolError::WebSocketNoFrame).await,
                };
                if let Some(item) = item {
                    if inbound.send(item).is_err() {
                        return;
                    }
                }
            }
            cmd = out.recv() => match cmd {
                Some(Out::Frame(payload)) => {
                    if let Err(e) = ws.send(Message::Binary(payload.into())).await {
                        break LostReason::WebSocketSend(Cause::new(e)).into();
                    }
                }
                Some(Out::Close { code, reason, done }) => {
                    close(&mut ws, code.code() as u16 + 4000, reason).await;
                    let _ = done.send(());
                    return;
                }
                // The session loop is gone (aborted): drop the socket.
                None => return,
            },
            _ = ping.tick() => {
                if let Err(e) = ws.send(Message::Ping(Vec::new().into())).await {
                    break LostReason::WebSocketPing(Cause::new(e)).into();
                }
            }
            _ = &mut idle => {
                break LostReason::IdleTimeout { after: idle_timeout }.into();
            }
        }
    };
    debug!(error = %ended, "WebSocket connection ended");
    let _ = inbound.send(Inbound::Ended(ended));
}

fn bad_frame(error: WireError) -> ProtocolError {
    ProtocolError::BadFrame {
        carrier: Carrier::WebSocket,
        error,
    }
}

/// The server broke the binding's rules: close with 4004 (ProtocolError).
async fn protocol_error(ws: &mut Stream, what: ProtocolError) -> ClientError {
    close(
        ws,
        4000 + CloseCode::ProtocolError.code() as u16,
        "protocol error",
    )
    .await;
    ClientError::Protocol(what)
}

/// Sends a close and waits (briefly) for the server's answer, so the close
/// reaches the server before the socket is dropped.
async fn close(ws: &mut Stream, code: u16, reason: &'static str) {
    let frame = CloseFrame {
        code: WsCloseCode::from(code),
        reason: reason.into(),
    };
    let _ = tokio::time::timeout(CLOSE_LINGER, async {
        if ws.close(Some(frame)).await.is_ok() {
            while let Some(Ok(_)) = ws.next().await {}
        }
    })
    .await;
}
