//! Why a client call failed: [`ClientError`] and the typed reasons it
//! carries, so that a caller can match on what happened.
//!
//! Display strings are whole sentences (the CLI prints just `{error}`), so
//! each includes the text of its cause. [`std::error::Error::source`] gives
//! that cause itself (an I/O, QUIC, TLS or WebSocket error) for
//! downcasting; it skips the typed reason in between, which is matched on
//! directly. Foreign errors are shared with [`Arc`] (one connection's end
//! is reported to every waiting request); `ClientError::source` gives the
//! error inside, not the `Arc`. Errors of the libraries under the client
//! (quinn, rustls, tungstenite) come as an opaque [`Cause`], so that their
//! new versions do not change this API.

use crate::{ws, Carrier};
use greendot_proto::{Answer, CloseCode, ErrorCode, WireError};
use std::error::Error;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// An error of a library under the client (QUIC, TLS, WebSocket), opaque:
/// its `Display` is the library's text, and [`Cause::downcast_ref`] (or
/// [`Error::source`] of the [`ClientError`] that carries it) gives the
/// library's own error to a caller who depends on that library.
#[derive(Clone)]
pub struct Cause(Arc<dyn Error + Send + Sync + 'static>);

impl Cause {
    pub(crate) fn new(error: impl Error + Send + Sync + 'static) -> Cause {
        Cause(Arc::new(error))
    }

    /// The library's error, if it is a `T`.
    pub fn downcast_ref<T: Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }

    /// The library's error.
    pub fn get(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

/// Why the client's TLS configuration could not be built (a bad root
/// certificate, no platform trust store); the cause is rustls'.
#[derive(Debug, Clone, thiserror::Error)]
#[error("tls: {0}")]
#[non_exhaustive]
pub struct TlsError(pub Cause);

/// Why a client call failed.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ClientError {
    /// A client setting cannot be used (or a request is too large to send).
    Config(ConfigError),
    /// The TLS configuration could not be built (a bad root certificate).
    Tls(TlsError),
    /// No connection could be opened.
    Connect(ConnectError),
    /// The server refused the connection: an error frame and/or a close code.
    Rejected {
        code: Option<CloseCode>,
        error: WireError,
    },
    /// The connection was lost, or closed by the server without a refusal.
    Lost(LostReason),
    /// The server answered the request with an error.
    Server(WireError),
    /// The server broke the protocol.
    Protocol(ProtocolError),
    /// A frame could not be encoded (the client's own bug, or a request
    /// beyond what the frame format can carry).
    Encode(postcard::Error),
    /// The request was sent, and no answer came within
    /// [`crate::ClientConfig::request_timeout`] (`lost: None`), or the
    /// connection ended before the answer and the request is not sent
    /// again (`lost`: how it ended): it may or may not have taken effect,
    /// and may still take effect later. Not a failure: see the crate docs,
    /// "A request without an answer in time".
    OutcomeUnknown { lost: Option<Box<ClientError>> },
    /// The request was never sent (the client was reconnecting until
    /// [`crate::ClientConfig::request_timeout`] passed): it has not taken
    /// effect and never will.
    NotSent,
    /// The client is closed.
    Closed,
}

impl ClientError {
    /// The server's error code, if the server said one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Rejected { error, .. } | ClientError::Server(error) => Some(error.code),
            _ => None,
        }
    }

    /// How long the server asked the client to wait at most before
    /// reconnecting (`retry_ms` in its close reason), or before asking a
    /// member page of that group again (`ErrorCode::PageRateLimited`), if
    /// it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Rejected { error, .. } => crate::retry_hint(&error.message),
            ClientError::Server(error) if error.code == ErrorCode::PageRateLimited => {
                crate::retry_hint(&error.message)
            }
            _ => None,
        }
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Config(e) => write!(f, "invalid client setting: {e}"),
            ClientError::Tls(e) => e.fmt(f),
            ClientError::Connect(e) => write!(f, "cannot connect: {e}"),
            ClientError::Rejected { code, error } => {
                write!(f, "refused by the server ({code:?}): {error}")
            }
            ClientError::Lost(e) => write!(f, "connection lost: {e}"),
            ClientError::Server(e) => write!(f, "server error: {e}"),
            ClientError::Protocol(e) => write!(f, "protocol violation by the server: {e}"),
            ClientError::Encode(e) => write!(f, "cannot encode a frame: {e}"),
            ClientError::OutcomeUnknown { lost: None } => {
                f.write_str("sent, but no answer in time: the outcome is unknown")
            }
            ClientError::OutcomeUnknown { lost: Some(e) } => write!(
                f,
                "sent, but the connection ended before the answer ({e}): the outcome is unknown"
            ),
            ClientError::NotSent => f.write_str("not sent in time (never takes effect)"),
            ClientError::Closed => f.write_str("the client is closed"),
        }
    }
}

impl Error for ClientError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            // The foreign error itself, not the Arc that shares it, so that
            // `downcast_ref::<std::io::Error>()` finds it.
            ClientError::Config(
                ConfigError::ServerName { cause, .. } | ConfigError::WebSocketUrl { cause, .. },
            ) => Some(cause.get()),
            ClientError::Connect(
                ConnectError::Bind { source, .. }
                | ConnectError::WebSocketTcp { source, .. }
                | ConnectError::WebSocketTls { source, .. },
            ) => Some(&**source),
            ClientError::Connect(
                ConnectError::WebSocketUpgrade { cause, .. }
                | ConnectError::Quic(cause)
                | ConnectError::QuicHandshake(cause),
            ) => Some(cause.get()),
            ClientError::Connect(ConnectError::Resolve { source, .. }) => Some(&**source),
            ClientError::Lost(
                LostReason::Quic(e)
                | LostReason::WebSocket(e)
                | LostReason::WebSocketSend(e)
                | LostReason::WebSocketPing(e),
            ) => Some(e.get()),
            ClientError::Tls(TlsError(e)) => Some(e.get()),
            ClientError::OutcomeUnknown { lost: Some(e) } => Some(&**e),
            ClientError::Config(e) => e.source(),
            ClientError::Connect(e) => e.source(),
            ClientError::Lost(e) => e.source(),
            ClientError::Protocol(e) => e.source(),
            ClientError::Encode(e) => Some(e),
            ClientError::Rejected { .. }
            | ClientError::Server(_)
            | ClientError::OutcomeUnknown { lost: None }
            | ClientError::NotSent
            | ClientError::Closed => None,
        }
    }
}

impl From<ConfigError> for ClientError {
    fn from(e: ConfigError) -> ClientError {
        ClientError::Config(e)
    }
}

impl From<TlsError> for ClientError {
    fn from(e: TlsError) -> ClientError {
        ClientError::Tls(e)
    }
}

impl From<ConnectError> for ClientError {
    fn from(e: ConnectError) -> ClientError {
        ClientError::Connect(e)
    }
}

impl From<LostReason> for ClientError {
    fn from(e: LostReason) -> ClientError {
        ClientError::Lost(e)
    }
}

impl From<ProtocolError> for ClientError {
    fn from(e: ProtocolError) -> ClientError {
        ClientError::Protocol(e)
    }
}

impl From<postcard::Error> for ClientError {
    fn from(e: postcard::Error) -> ClientError {
        ClientError::Encode(e)
    }
}

/// A client setting that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `idle_timeout` is beyond what QUIC can say.
    #[error("idle_timeout too large")]
    IdleTimeoutTooLarge,
    /// `server_name` is neither a DNS name nor an IP address.
    #[error("server name {name:?}: {cause}")]
    ServerName { name: String, cause: Cause },
    /// No server address in `servers`.
    #[error("no server address")]
    NoServer,
    /// A server address that is neither `IP:PORT` nor `HOST:PORT`.
    #[error("server address {0:?}: expected HOST:PORT or IP:PORT")]
    ServerAddress(String),
    /// Certificates that could not be read (a file, or PEM that does not
    /// decode).
    #[error("cannot read certificates: {0}")]
    Certificates(Cause),
    /// PEM without a certificate.
    #[error("no certificate in the PEM")]
    NoCertificate,
    /// `server_name`, the port and `websocket_path` make no valid URL.
    #[error("WebSocket URL {url}: {cause}")]
    WebSocketUrl { url: String, cause: Cause },
    /// A request's frame (`len` bytes) is over the server's cap (`max`,
    /// from its welcome); it was not sent.
    #[error("request of {len} bytes exceeds the server's frame cap of {max}")]
    RequestTooLarge { len: usize, max: usize },
}

/// Why no connection could be opened.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The UDP socket could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: Arc<std::io::Error>,
    },
    /// QUIC refused to start the connection (before any I/O).
    #[error("{0}")]
    Quic(Cause),
    /// The QUIC handshake failed.
    #[error("{0}")]
    QuicHandshake(Cause),
    /// A host name did not resolve (or resolved to no address).
    #[error("cannot resolve {host}: {source}")]
    Resolve {
        host: String,
        source: Arc<std::io::Error>,
    },
    /// No TCP connection to the WebSocket address.
    #[error("WebSocket {addr}: {source}")]
    WebSocketTcp {
        addr: SocketAddr,
        source: Arc<std::io::Error>,
    },
    /// The TLS handshake over TCP failed.
    #[error("WebSocket {addr}: TLS: {source}")]
    WebSocketTls {
        addr: SocketAddr,
        source: Arc<std::io::Error>,
    },
    /// The HTTP upgrade to WebSocket failed.
    #[error("WebSocket {addr}: upgrade: {cause}")]
    WebSocketUpgrade { addr: SocketAddr, cause: Cause },
    /// The server upgraded without selecting the greendot subprotocol.
    #[error("WebSocket {addr}: the server did not select {}", ws::SUBPROTOCOL)]
    NoSubprotocol { addr: SocketAddr },
    /// Both carriers failed (each error says how).
    #[error("QUIC: {quic}; WebSocket: {websocket}")]
    Both {
        quic: Box<ClientError>,
        websocket: Box<ClientError>,
    },
    /// No welcome within `connect_timeout`, whatever the carrier.
    #[error("no answer from {server} within {after:?}")]
    TimedOut { server: SocketAddr, after: Duration },
}

/// Why a connection ended, when the server did not refuse it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LostReason {
    /// The QUIC connection ended (timed out, reset, or closed normally by
    /// the server).
    #[error("{0}")]
    Quic(Cause),
    /// The connection's tasks ended without saying why.
    #[error("the connection ended without a reason")]
    Ended,
    /// [`crate::Reconnect::give_up_after`] passed without a connection.
    #[error("gave up reconnecting")]
    GaveUp,
    /// Over WebSocket, the probe after a network change went unanswered.
    #[error("no answer within {after:?} after a network change")]
    NoProbeAnswer { after: Duration },
    /// Nothing (not even a pong) came over WebSocket for `idle_timeout`.
    #[error("nothing heard from the server for {after:?}")]
    IdleTimeout { after: Duration },
    /// Reading from the WebSocket failed.
    #[error("WebSocket: {0}")]
    WebSocket(Cause),
    /// Sending a message failed.
    #[error("WebSocket send: {0}")]
    WebSocketSend(Cause),
    /// Sending a keep-alive ping failed.
    #[error("WebSocket ping: {0}")]
    WebSocketPing(Cause),
    /// The TCP connection ended without a WebSocket close.
    #[error("WebSocket connection ended")]
    WebSocketEnded,
    /// A WebSocket close without a status code.
    #[error("WebSocket closed without a code")]
    WebSocketClosedWithoutCode,
    /// A WebSocket close with a code outside 4000..=4999 (not greendot's).
    #[error("WebSocket closed: {code} {reason}")]
    WebSocketClosed { code: u16, reason: String },
    /// A WebSocket close with greendot's `Normal` code (over QUIC the same
    /// close is a [`LostReason::Quic`] `ApplicationClosed`).
    #[error("closed by the server: {reason}")]
    ClosedByServer { reason: String },
    /// The client closed the connection itself, the app having been in the
    /// background for [`crate::ClientConfig::close_in_background`] with
    /// nothing to send. It reconnects (resuming) when the app comes to the
    /// foreground or makes a request.
    #[error("closed after {after:?} in the background")]
    QuietInBackground { after: Duration },
}

/// How the server broke the protocol.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A reply before the welcome.
    #[error("a reply before the welcome")]
    ReplyBeforeWelcome,
    /// A welcome on a connection already welcomed.
    #[error("a second welcome")]
    SecondWelcome,
    /// An answer of the wrong kind for the request.
    #[error("unexpected answer {answer:?}")]
    UnexpectedAnswer { answer: Box<Answer> },
    /// A query answer without a result.
    #[error("empty query answer")]
    EmptyQueryAnswer,
    /// A frame that does not decode.
    #[error("{}{error}", carrier_prefix(*.carrier))]
    BadFrame {
        carrier: Carrier,
        #[source]
        error: WireError,
    },
    /// A text message (the binding is binary only).
    #[error("WebSocket: a text message")]
    WebSocketText,
    /// A message without a stream byte and a frame after it.
    #[error("WebSocket: a message without a stream byte and frame")]
    WebSocketNoFrame,
}

fn carrier_prefix(carrier: Carrier) -> &'static str {
    match carrier {
        Carrier::Quic => "",
        Carrier::WebSocket => "WebSocket: ",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_tungstenite::tungstenite;

    #[test]
    fn display_is_the_sentence_the_cli_prints() {
        let server = SocketAddr::from(([127, 0, 0, 1], 9));
        let cases: Vec<(ClientError, &str)> = vec![
            (
                ConnectError::TimedOut {
                    server,
                    after: Duration::from_secs(5),
                }
                .into(),
                "cannot connect: no answer from 127.0.0.1:9 within 5s",
            ),
            (
                LostReason::Quic(Cause::new(quinn::ConnectionError::TimedOut)).into(),
                "connection lost: timed out",
            ),
            (
                LostReason::GaveUp.into(),
                "connection lost: gave up reconnecting",
            ),
            (
                LostReason::IdleTimeout {
                    after: Duration::from_millis(1500),
                }
                .into(),
                "connection lost: nothing heard from the server for 1.5s",
            ),
            (
                ProtocolError::SecondWelcome.into(),
                "protocol violation by the server: a second welcome",
            ),
            (
                ProtocolError::BadFrame {
                    carrier: Carrier::WebSocket,
                    error: WireError::new(ErrorCode::BadFrame, "trailing bytes"),
                }
                .into(),
                "protocol violation by the server: WebSocket: BadFrame (1): trailing bytes",
            ),
            (
                ConfigError::NoServer.into(),
                "invalid client setting: no server address",
            ),
            (
                ConnectError::Both {
                    quic: Box::new(
                        ConnectError::Quic(Cause::new(quinn::ConnectError::EndpointStopping))
                            .into(),
                    ),
                    websocket: Box::new(ConnectError::NoSubprotocol { addr: server }.into()),
                }
                .into(),
                "cannot connect: QUIC: cannot connect: endpoint stopping; WebSocket: cannot \
                 connect: WebSocket 127.0.0.1:9: the server did not select greendot.v1",
            ),
        ];
        for (error, text) in cases {
            assert_eq!(error.to_string(), text, "{error:?}");
        }
    }

    #[test]
    fn the_source_is_the_foreign_cause_shared_by_clones() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = ClientError::from(ConnectError::WebSocketTcp {
            addr: SocketAddr::from(([127, 0, 0, 1], 9)),
            source: Arc::new(io),
        });
        let copy = error.clone();
        for e in [&error, &copy] {
            let source = e.source().expect("a source");
            let io = source
                .downcast_ref::<std::io::Error>()
                .expect("an io::Error");
            assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        }
        let (
            ClientError::Connect(ConnectError::WebSocketTcp { source: a, .. }),
            ClientError::Connect(ConnectError::WebSocketTcp { source: b, .. }),
        ) = (&error, &copy)
        else {
            unreachable!()
        };
        assert!(Arc::ptr_eq(a, b));

        let ws = ClientError::from(LostReason::WebSocketSend(Cause::new(
            tungstenite::Error::ConnectionClosed,
        )));
        assert!(ws
            .source()
            .unwrap()
            .downcast_ref::<tungstenite::Error>()
            .is_some());
        // Typed reasons without a foreign cause have no source.
        assert!(ClientError::from(LostReason::GaveUp).source().is_none());
        assert!(ClientError::OutcomeUnknown { lost: None }
            .source()
            .is_none());
    }
}
