//! The Rust client library.
//!
//! [`Client::connect`] opens a QUIC connection, says hello with the token and
//! returns the client and its [`Updates`], an async stream of [`Event`]s.
//! Snapshots and pushes are applied to a `greendot_core::View`, so stale or
//! duplicate versions never reach the application. When the connection is lost
//! (not closed by the application or refused by the server) the client
//! reconnects with backoff and resumes its session; if the session could not be
//! resumed it subscribes again to what it had. [`Client::rebind`] moves the
//! client to a new UDP socket (a new network) without reconnecting. Where
//! UDP is blocked it runs over WebSocket instead (below).
//!
//! In the client's `Presence`, `last_seen` is in Unix milliseconds (the
//! server's clock), not on the server's monotonic clock.
//!
//! # While the app does not read
//!
//! [`Updates`] is bounded, so an app that stops reading (a phone in the
//! background) does not make the client grow:
//! - presence is conflated: at most one pending [`Event::Presence`] per
//!   target, the newest (with the newest one's `source`), in the place of
//!   the first one that was pending, so the app learns the latest state
//!   no later than it would have learnt the first; at most
//!   [`ClientConfig::max_pending_targets`] targets (default 4,096), past
//!   it a new target's presence is dropped ([`Client::presence`] still has
//!   it);
//! - other events are kept in order, at most
//!   [`ClientConfig::max_pending_events`] (default 64), dropping the oldest;
//! - [`Event::Closed`] is never dropped and always comes last.
//!
//! [`Updates::stats`] counts what was conflated and dropped.
//!
//! # When UDP is blocked
//!
//! Every connection attempt (the first and every reconnect) starts QUIC; if
//! no QUIC handshake completed within [`ClientConfig::fallback_delay`]
//! (300 ms), or QUIC failed sooner, it also starts WebSocket over TLS to
//! [`ClientConfig::websocket`] (default: the server's address over TCP), and
//! the first transport up wins. The race ends before the hello, which only
//! the winner sends (two hellos of one device would supersede each other).
//! So a client that fell back is back on QUIC at its next reconnect once UDP
//! works. Both carriers run the same session code; [`Client::stats`] says
//! which one is in use.
//!
//! # When the network changes
//!
//! Call [`Client::network_changed`] (or [`Client::network_changed_with`] a
//! new UDP socket) when the device changes networks: over QUIC the client
//! sends at once on the new path, so the server learns the new address
//! within one round trip instead of at the next keep-alive; over WebSocket
//! it probes the TCP connection and reconnects (and resumes) if no answer
//! comes within [`ClientConfig::probe_timeout`].
//!
//! # The app's lifecycle
//!
//! [`Client::app_backgrounded`] and [`Client::app_foregrounded`], with
//! `network_changed`, are the calls a phone's callbacks make. In the
//! background the user is shown offline (last seen when the app went) and
//! `route` no longer names the device, so a backend pushes instead; the
//! session and its subscriptions go on, every hello carries the state, and
//! the client redials nothing until the app is back in the foreground (or
//! the network changes). Back in the foreground it tells the server, checks
//! the connection within `probe_timeout`, and a reconnect in progress tries
//! at once with its backoff reset.
//!
//! # Reconnecting
//!
//! Every wait before an attempt is drawn with full jitter: uniformly in
//! `[0, min(max_backoff, initial_backoff * 2^n)]` before the `n`-th attempt
//! (from 0), so that clients that lost the same server at the same moment do
//! not come back at the same moment. A close reason from the server may carry
//! `retry_ms=<decimal>` (a draining server spreads its clients over the time
//! it needs to admit them all): the next wait is then drawn uniformly in
//! `[0, retry_ms]` instead, and so is every wait after a failed attempt
//! until one succeeds (unless the doubling has grown past it): a device that
//! fails inside a restart herd keeps to the spread the server asked for
//! instead of coming back within seconds. Every connection of one [`Client`] uses the same
//! TLS configuration, and so the same session cache: a reconnect resumes the
//! TLS session (no certificate signature, no certificate check) when the
//! server still knows it.
//!
//! # A request without an answer in time
//!
//! [`ClientError::Timeout`] means the client does not know the outcome:
//! - a request still waiting to be sent (the client was reconnecting) is
//!   dropped when its caller gives up, and never takes effect;
//! - a request already sent may or may not have taken effect; it may still
//!   take effect after the timeout (the transport retransmits it until the
//!   connection is declared lost).
//!
//! Requests of one client reach the server in the order they were made, so a
//! later call always wins over an earlier one that timed out.
//! [`Client::set_status`] and [`Client::set_invisible`] are idempotent:
//! setting the value the user already has changes nothing anybody sees (no
//! push, no new version), so after a timeout simply call again until it is
//! answered. The client does not retry by itself.
//!
//! # Errors
//!
//! [`ClientError`] says what kind of failure it was, and its variants carry
//! typed reasons to match on: [`ConfigError`], [`ConnectError`] (which
//! handshake failed, or both), [`LostReason`] and [`ProtocolError`]. Where
//! a reason has a foreign cause (an I/O, QUIC, TLS or WebSocket error) it
//! carries it, and [`std::error::Error::source`] returns it. The `Display`
//! text is a whole sentence, cause included.
//!
//! # Tokens
//!
//! A token expires (its `exp`); the server closes a connection whose token
//! has run out (`exp` plus its leeway) with `TokenExpired`. Give the client
//! a [`TokenRefresh`] ([`ClientConfig::refresh`]) and it fetches a new
//! token ahead of expiry and sends it on the live connection (nothing
//! else changes), and fetches one before reconnecting when the old one has
//! run out. [`Client::refresh`] sends a token the application got by
//! itself. A refreshed token's `watch` replaces the old one: subscriptions
//! it no longer allows end ([`Event::TokenRefreshed`]).

mod backoff;
mod driver;
mod error;
mod events;
mod lifecycle;
mod refresh;
pub mod tls;
mod ws;

pub use backoff::{retry_hint, Backoff, Reconnect, MAX_RETRY_HINT};
pub use error::{ClientError, ConfigError, ConnectError, LostReason, ProtocolError};
pub use events::{Carrier, Event, EventStats, Source, Updates};
pub use refresh::{token_expiry, TokenRefresh};

// Re-exported so users need no second copy of them (TLS settings, roots).
pub use quinn;
pub use rustls;
// The WebSocket errors in ConnectError and LostReason are tungstenite's.
pub use tokio_tungstenite::tungstenite;

use greendot_core::{Applied, Presence, SessionId, Status, Tier, UserId, View};
use greendot_proto::{
    self as proto, codec::read_frame, encode_frame, Answer, CloseCode, ErrorCode, FrameReader,
    Hello, Push, QueryResult, Refused, Request, RequestFrame, RouteEntry, ServerFrame, Welcome,
    WireError,
};
use quinn::crypto::rustls::QuicClientConfig;
use rustls::pki_types::CertificateDer;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tracing::debug;

/// Client settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClientConfig {
    pub server: SocketAddr,
    /// The name in the server's certificate. Default `localhost`.
    pub server_name: String,
    /// Certificates trusted as roots (for a self-signed server: its certificate).
    pub roots: Vec<CertificateDer<'static>>,
    pub token: String,
    /// Local UDP address. Default: any address, any port, of the server's family.
    pub bind: SocketAddr,
    /// QUIC keep-alive. Default 10 s.
    pub keep_alive: Duration,
    /// QUIC idle timeout (the lower of the client's and the server's applies).
    /// Default 30 s.
    pub idle_timeout: Duration,
    /// `None`: a lost connection ends the client.
    pub reconnect: Option<Reconnect>,
    /// How long a request may wait for its answer. Default 10 s.
    pub request_timeout: Duration,
    /// How long one attempt to connect and say hello may take (QUIC does not
    /// notice a server that is down until its handshake times out). Default 5 s.
    pub connect_timeout: Duration,
    /// The ALPN offered (change it only to test the server).
    pub alpn: Vec<u8>,
    /// The protocol version in the hello (change it only to test the server).
    pub version: u32,
    /// A TLS configuration to use instead of the one built from `roots` (a
    /// custom certificate check, a session cache shared by several clients).
    /// It must allow TLS 1.3; if it offers no ALPN, `alpn` is offered. The
    /// WebSocket carrier uses a copy with ALPN `http/1.1` and a session
    /// cache of its own. Default `None`.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The WebSocket fallback's TCP address (`wss://server_name:PORT/…`),
    /// tried when no QUIC handshake completes within `fallback_delay`
    /// (see the module docs, "When UDP is blocked"); `None`: QUIC only.
    /// Default: the server's address over TCP (`greendot serve` listens for
    /// WebSocket on the QUIC port number).
    pub websocket: Option<SocketAddr>,
    /// The path of the WebSocket upgrade. Default `/greendot`.
    pub websocket_path: String,
    /// How long QUIC has alone before the WebSocket attempt starts beside
    /// it. Default 300 ms.
    pub fallback_delay: Duration,
    /// After [`Client::network_changed`] over WebSocket: how long the probe
    /// may go unanswered before the connection counts as dead and the
    /// client reconnects (and resumes). Default 3 s.
    pub probe_timeout: Duration,
    /// A session to resume at the first connect: [`Client::session`] of an
    /// earlier client of this device (an app restarted within its grace,
    /// or a client moving to another node of a cluster). If it resumes, its
    /// subscriptions carry over (the welcome's snapshots, in the view at
    /// once); if not, the session is fresh. Default `None`.
    pub resume: Option<SessionId>,
    /// Fetches a new token before this one expires (see the module docs,
    /// "Tokens"). Default `None`: the connection ends with `TokenExpired`
    /// once the token runs out.
    pub refresh: Option<TokenRefresh>,
    /// How long before the token's `exp` it is refreshed (at most 1/5 of
    /// the token's remaining life earlier). Default 60 s.
    pub refresh_ahead: Duration,
    /// The app is in the foreground at the first connect (`false`: started
    /// in the background, e.g. by a push). Later changes go through
    /// [`Client::app_backgrounded`] and [`Client::app_foregrounded`].
    /// Default `true`.
    pub foreground: bool,
    /// How many events other than presence and `Closed` (disconnects,
    /// reconnects, refreshes) [`Updates`] keeps while the app does not
    /// read; past it the oldest is dropped and counted
    /// ([`Updates::stats`]). Default 64: they come at most once per
    /// connection attempt, and the newest say how things stand.
    pub max_pending_events: usize,
    /// How many targets [`Updates`] keeps a pending presence for while
    /// the app does not read (one each, the newest: see the module docs,
    /// "While the app does not read"); the presence of one more target is
    /// dropped and counted ([`Updates::stats`]), and [`Client::presence`]
    /// still has it. Default 4,096: four times the server's default
    /// subscription limit per session (1,000), so nothing is dropped
    /// unless the server allows more.
    pub max_pending_targets: usize,
}

impl ClientConfig {
    pub fn new(
        server: SocketAddr,
        roots: Vec<CertificateDer<'static>>,
        token: impl Into<String>,
    ) -> ClientConfig {
        let bind = if server.is_ipv6() {
            SocketAddr::from(([0u16; 8], 0))
        } else {
            SocketAddr::from(([0, 0, 0, 0], 0))
        };
        ClientConfig {
            server,
            server_name: "localhost".into(),
            roots,
            token: token.into(),
            bind,
            keep_alive: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            reconnect: Some(Reconnect::default()),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            alpn: proto::ALPN.to_vec(),
            version: proto::VERSION,
            tls: None,
            websocket: Some(server),
            websocket_path: ws::PATH.into(),
            fallback_delay: Duration::from_millis(300),
            probe_timeout: Duration::from_secs(3),
            resume: None,
            refresh: None,
            refresh_ahead: Duration::from_secs(60),
            foreground: true,
            max_pending_events: 64,
            max_pending_targets: 4_096,
        }
    }
}

/// How a client has been connected so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientStats {
    /// What the current (or last) connection runs on.
    pub carrier: Carrier,
    /// Connections that said hello over QUIC, the first one included.
    pub quic_connections: u64,
    /// Connections that said hello over WebSocket (fallbacks).
    pub websocket_connections: u64,
}

/// The answer to a subscribe.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Subscribed {
    /// Granted targets: the tier granted and the snapshot.
    pub snapshots: Vec<(String, Tier, Presence)>,
    pub refused: Vec<Refused>,
}

struct State {
    session: SessionId,
    /// The token of the next hello (the latest refreshed one).
    token: String,
    user: String,
    device: String,
    view: View,
    ids: HashMap<String, UserId>,
    /// What the application subscribed to, to subscribe again after a reconnect
    /// that could not resume.
    wanted: BTreeMap<String, Tier>,
    closed: bool,
    stats: ClientStats,
}

struct Shared {
    dialer: Dialer,
    state: Mutex<State>,
    events: events::EventSender,
    /// The app is in the foreground (see `lifecycle`).
    foreground: tokio::sync::watch::Sender<bool>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn emit(&self, event: Event) {
        self.events.send(event);
    }

    /// Applies a snapshot or push to the view; emits an event if it is news.
    fn apply(&self, target: &str, presence: &proto::Presence, source: Source) {
        let presence = presence.to_core();
        let applied = {
            let mut state = self.state();
            let next = UserId(state.ids.len() as u64);
            let id = *state.ids.entry(target.to_owned()).or_insert(next);
            state.view.apply(id, presence.clone())
        };
        if applied != Applied::Dropped {
            self.emit(Event::Presence {
                target: target.to_owned(),
                presence,
                source,
            });
        }
    }
}

enum Cmd {
    Request {
        request: Request,
        reply: oneshot::Sender<Result<Answer, ClientError>>,
    },
    Close {
        code: CloseCode,
        done: oneshot::Sender<()>,
    },
    /// The network changed: send at once (and over WebSocket, probe).
    NetworkChanged,
}

/// A connected client. Cheap to clone; the connection closes (without logout:
/// the device lingers for its grace) when the last clone is dropped.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
    cmd: mpsc::Sender<Cmd>,
    request_timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("session", &self.session())
            .finish()
    }
}

/// What a connection's readers tell the session loop, in arrival order.
enum Inbound {
    /// A frame of the control stream.
    Frame(ServerFrame),
    /// An update on a push stream whose tier is known.
    Push {
        target: String,
        presence: proto::Presence,
        source: Source,
    },
    /// The connection ended, and how (the last item).
    Ended(ClientError),
}

/// The sending half of a connection: the one place the carriers differ for
/// the session loop (`run`).
enum Link {
    Quic {
        conn: quinn::Connection,
        send: quinn::SendStream,
    },
    WebSocket(mpsc::Sender<ws::Out>),
}

impl Link {
    fn carrier(&self) -> Carrier {
        match self {
            Link::Quic { .. } => Carrier::Quic,
            Link::WebSocket(_) => Carrier::WebSocket,
        }
    }

    /// Sends one frame (`bytes` is length-prefixed, as on a QUIC stream);
    /// `false` if the connection is gone (its reader then says why).
    async fn send(&mut self, bytes: Vec<u8>) -> bool {
        match self {
            Link::Quic { send, .. } => send.write_all(&bytes).await.is_ok(),
            Link::WebSocket(tx) => {
                let payload = bytes.get(4..).unwrap_or_default().to_vec();
                tx.send(ws::Out::Frame(payload)).await.is_ok()
            }
        }
    }

    /// Closes with `code`; returns once the close is on its way.
    async fn close(&mut self, code: CloseCode, reason: &'static str) {
        match self {
            Link::Quic { conn, .. } => conn.close(code.varint(), reason.as_bytes()),
            Link::WebSocket(tx) => {
                let (done, wait) = oneshot::channel();
                if tx.send(ws::Out::Close { code, reason, done }).await.is_ok() {
                    let _ = wait.await;
                }
            }
        }
    }
}

/// Tasks of one connection, stopped when it is dropped: nothing from an old
/// connection is read after a reconnect.
struct Tasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

struct Established {
    link: Link,
    inbound: mpsc::UnboundedReceiver<Inbound>,
    /// Pushes that came before the welcome, applied first.
    early: Vec<Inbound>,
    tasks: Tasks,
    welcome: Welcome,
    /// The app's state the hello carried.
    foreground: bool,
}

fn lost(error: &quinn::ConnectionError) -> ClientError {
    if let quinn::ConnectionError::ApplicationClosed(close) = error {
        let code = CloseCode::from_code(close.error_code.into_inner());
        let text = String::from_utf8_lossy(&close.reason).into_owned();
        if code != Some(CloseCode::Normal) {
            return ClientError::Rejected {
                code,
                error: WireError::new(error_code_for(code), text),
            };
        }
    }
    ClientError::Lost(LostReason::Quic(error.clone()))
}

/// After an error frame: waits for the close that follows, and gives the
/// server's close code with the error, adding the close reason's
/// `retry_ms` to its message if only the reason has it.
async fn rejected_after(
    inbound: &mut mpsc::UnboundedReceiver<Inbound>,
    mut error: WireError,
) -> ClientError {
    let code = match ended(inbound).await {
        ClientError::Rejected { code, error: close } => {
            if let (None, Some(hint)) = (retry_hint(&error.message), retry_hint(&close.message)) {
                error.message = format!("{} retry_ms={}", error.message, hint.as_millis());
            }
            code
        }
        _ => None,
    };
    ClientError::Rejected { code, error }
}

/// Why the connection ended (skipping what it still delivered).
async fn ended(inbound: &mut mpsc::UnboundedReceiver<Inbound>) -> ClientError {
    while let Some(item) = inbound.recv().await {
        if let Inbound::Ended(e) = item {
            return e;
        }
    }
    ClientError::Lost(LostReason::Ended)
}

pub(crate) fn error_code_for(code: Option<CloseCode>) -> ErrorCode {
    match code {
        Some(CloseCode::Unauthorized) => ErrorCode::BadToken,
        Some(CloseCode::TokenExpired) => ErrorCode::TokenExpired,
        Some(CloseCode::Revoked) => ErrorCode::TokenRevoked,
        Some(CloseCode::UnsupportedVersion) => ErrorCode::UnsupportedVersion,
        Some(CloseCode::FrameTooLarge) => ErrorCode::FrameTooLarge,
        Some(CloseCode::ProtocolError) => ErrorCode::BadFrame,
        Some(CloseCode::TooManyConnections) => ErrorCode::TooManyConnections,
        Some(CloseCode::Shutdown) | Some(CloseCode::Draining) => ErrorCode::ShuttingDown,
        Some(CloseCode::Superseded) | Some(CloseCode::SessionExpired) => ErrorCode::Stale,
        _ => ErrorCode::Other(0),
    }
}

/// What one [`Client`] connects with, whatever the carrier.
struct Dialer {
    endpoint: quinn::Endpoint,
    /// The WebSocket carrier's TLS (one session cache for all its connections).
    ws_tls: Arc<rustls::ClientConfig>,
}

/// A transport that is up (QUIC handshake done, or TLS and WebSocket
/// upgrade done) but has carried no greendot frame yet.
enum Transport {
    Quic(quinn::Connection),
    WebSocket(Box<ws::Stream>),
}

/// Opens a connection and says hello, within the connect timeout.
async fn establish(
    dialer: &Dialer,
    config: &ClientConfig,
    token: &str,
    resume: Option<SessionId>,
    foreground: bool,
) -> Result<Established, ClientError> {
    let attempt = async {
        let transport = race(dialer, config).await?;
        hello(transport, config, token, resume, foreground).await
    };
    match tokio::time::timeout(config.connect_timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(ClientError::Connect(ConnectError::TimedOut {
            server: config.server,
            after: config.connect_timeout,
        })),
    }
}

async fn quic_handshake(
    endpoint: &quinn::Endpoint,
    config: &ClientConfig,
) -> Result<quinn::Connection, ClientError> {
    let connecting = endpoint
        .connect(config.server, &config.server_name)
        .map_err(|e| ClientError::Connect(ConnectError::Quic(e)))?;
    connecting.await.map_err(|e| match &e {
        quinn::ConnectionError::ApplicationClosed(_) => lost(&e),
        _ => ClientError::Connect(ConnectError::QuicHandshake(e)),
    })
}

/// Happy eyeballs: QUIC first; if no QUIC handshake completed within
/// `fallback_delay` (or QUIC failed sooner) WebSocket too, and the first
/// transport up wins. The race ends before the hello: two hellos of one
/// device would supersede each other, so only the winner says hello.
async fn race(dialer: &Dialer, config: &ClientConfig) -> Result<Transport, ClientError> {
    let quic = quic_handshake(&dialer.endpoint, config);
    if config.websocket.is_none() {
        return quic.await.map(Transport::Quic);
    }
    let both = |q: ClientError, w: ClientError| {
        ClientError::Connect(ConnectError::Both {
            quic: Box::new(q),
            websocket: Box::new(w),
        })
    };
    tokio::pin!(quic);
    let websocket = async {
        ws::handshake(config, dialer.ws_tls.clone())
            .await
            .map(|s| Transport::WebSocket(Box::new(s)))
    };
    let quic_failed = tokio::select! {
        result = &mut quic => match result {
            Ok(conn) => return Ok(Transport::Quic(conn)),
            // The server answered over QUIC: its word is final.
            Err(e @ ClientError::Rejected { .. }) => return Err(e),
            Err(e) => Some(e),
        },
        _ = tokio::time::sleep(config.fallback_delay) => None,
    };
    if let Some(q) = quic_failed {
        return websocket.await.map_err(|w| both(q, w));
    }
    debug!(delay = ?config.fallback_delay, "no QUIC handshake yet: trying WebSocket too");
    tokio::pin!(websocket);
    tokio::select! {
        result = &mut quic => match result {
            Ok(conn) => Ok(Transport::Quic(conn)),
            Err(e @ ClientError::Rejected { .. }) => Err(e),
            Err(q) => websocket.await.map_err(|w| both(q, w)),
        },
        result = &mut websocket => match result {
            Ok(transport) => Ok(transport),
            Err(w) => quic.await.map(Transport::Quic).map_err(|q| both(q, w)),
        },
    }
}

/// Says hello on a transport that is up and waits for the welcome.
async fn hello(
    transport: Transport,
    config: &ClientConfig,
    token: &str,
    resume: Option<SessionId>,
    foreground: bool,
) -> Result<Established, ClientError> {
    let hello = Hello {
        version: config.version,
        token: token.to_owned(),
        resume: resume.map(|s| s.0),
        foreground,
    };
    let bytes = encode_frame(&hello)?;
    let (tx, mut inbound) = mpsc::unbounded_channel();
    let (mut link, tasks) = match transport {
        Transport::Quic(conn) => {
            let (mut send, recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
            if send.write_all(&bytes).await.is_err() {
                return Err(lost(&conn.closed().await));
            }
            let tasks = Tasks(vec![
                tokio::spawn(driver::read_control(conn.clone(), recv, tx.clone())),
                tokio::spawn(driver::accept_pushes(conn.clone(), tx)),
            ]);
            (Link::Quic { conn, send }, tasks)
        }
        Transport::WebSocket(mut stream) => {
            use futures_util::SinkExt;
            let payload = bytes[4..].to_vec();
            stream
                .send(tokio_tungstenite::tungstenite::Message::Binary(
                    payload.into(),
                ))
                .await
                .map_err(|e| ClientError::Lost(LostReason::WebSocketSend(Arc::new(e))))?;
            let (out_tx, out_rx) = mpsc::channel(64);
            let task = tokio::spawn(ws::drive(
                *stream,
                out_rx,
                tx,
                config.keep_alive,
                config.idle_timeout,
            ));
            (Link::WebSocket(out_tx), Tasks(vec![task]))
        }
    };
    let mut early = Vec::new();
    let result = loop {
        match inbound.recv().await {
            Some(Inbound::Frame(ServerFrame::Welcome(welcome))) => break Ok(welcome),
            Some(Inbound::Frame(ServerFrame::Error(error))) => {
                break Err(rejected_after(&mut inbound, error).await)
            }
            Some(Inbound::Frame(ServerFrame::Reply { .. })) => {
                break Err(ProtocolError::ReplyBeforeWelcome.into())
            }
            Some(push @ Inbound::Push { .. }) => early.push(push),
            Some(Inbound::Ended(e)) => break Err(e),
            None => break Err(LostReason::Ended.into()),
        }
    };
    match result {
        Ok(welcome) => Ok(Established {
            link,
            inbound,
            early,
            tasks,
            welcome,
            foreground,
        }),
        Err(e) => {
            link.close(CloseCode::Normal, "hello failed").await;
            Err(e)
        }
    }
}

impl Client {
    /// Connects, says hello and starts the client's tasks.
    pub async fn connect(config: ClientConfig) -> Result<(Client, Updates), ClientError> {
        // One TLS configuration for every connection of this client: its
        // session cache is what lets a reconnect resume TLS.
        let crypto = match &config.tls {
            Some(given) => {
                let mut tls = (**given).clone();
                if tls.alpn_protocols.is_empty() {
                    tls.alpn_protocols = vec![config.alpn.clone()];
                }
                QuicClientConfig::try_from(tls).map_err(tls::TlsError::from)?
            }
            None => tls::client_crypto(&config.roots, &config.alpn)?,
        };
        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(Some(config.keep_alive));
        transport.max_idle_timeout(Some(
            config
                .idle_timeout
                .try_into()
                .map_err(ConfigError::IdleTimeoutTooLarge)?,
        ));
        let mut client_config = quinn::ClientConfig::new(Arc::new(crypto));
        client_config.transport_config(Arc::new(transport));
        let mut endpoint =
            quinn::Endpoint::client(config.bind).map_err(|e| ConnectError::Bind {
                addr: config.bind,
                source: Arc::new(e),
            })?;
        endpoint.set_default_client_config(client_config);
        let dialer = Dialer {
            endpoint,
            ws_tls: ws::tls_config(&config)?,
        };

        let established = establish(
            &dialer,
            &config,
            &config.token,
            config.resume,
            config.foreground,
        )
        .await?;
        let (events, updates) =
            events::channel(config.max_pending_events, config.max_pending_targets);
        let welcome = &established.welcome;
        let carrier = established.link.carrier();
        let shared = Arc::new(Shared {
            dialer,
            state: Mutex::new(State {
                session: SessionId(welcome.session),
                token: config.token.clone(),
                user: welcome.user.clone(),
                device: welcome.device.clone(),
                view: View::new(),
                ids: HashMap::new(),
                wanted: BTreeMap::new(),
                closed: false,
                stats: ClientStats {
                    carrier,
                    quic_connections: u64::from(carrier == Carrier::Quic),
                    websocket_connections: u64::from(carrier == Carrier::WebSocket),
                },
            }),
            events,
            foreground: tokio::sync::watch::Sender::new(config.foreground),
        });
        let (cmd_tx, cmd_rx) = mpsc::channel(256);
        let request_timeout = config.request_timeout;
        tokio::spawn(driver::drive(shared.clone(), config, established, cmd_rx));
        Ok((
            Client {
                shared,
                cmd: cmd_tx,
                request_timeout,
            },
            updates,
        ))
    }

    /// The current session (it changes when a reconnect could not resume).
    pub fn session(&self) -> SessionId {
        self.shared.state().session
    }

    pub fn user(&self) -> String {
        self.shared.state().user.clone()
    }

    pub fn device(&self) -> String {
        self.shared.state().device.clone()
    }

    /// What the client knows of `target`.
    pub fn presence(&self, target: &str) -> Option<Presence> {
        let state = self.shared.state();
        let id = *state.ids.get(target)?;
        state.view.get(id).cloned()
    }

    /// Whether the client is finished (see [`Event::Closed`]).
    pub fn is_closed(&self) -> bool {
        self.shared.state().closed
    }

    /// What the client runs on now, and how often it connected over each.
    pub fn stats(&self) -> ClientStats {
        self.shared.state().stats
    }

    /// What the current (or last) connection runs on.
    pub fn carrier(&self) -> Carrier {
        self.stats().carrier
    }

    /// The local address of the client's UDP socket (QUIC's; also while
    /// the connection runs over WebSocket).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.shared.dialer.endpoint.local_addr()
    }

    /// Moves the client to a new UDP socket (a new network); the connection,
    /// its session and subscriptions carry over if the server allows
    /// migration. Call inside the tokio runtime. (quinn sends a PING on
    /// the new socket at once; an address change without a new socket needs
    /// [`Client::network_changed`].)
    pub fn rebind(&self, socket: UdpSocket) -> std::io::Result<()> {
        self.shared.dialer.endpoint.rebind(socket)
    }

    /// The device's network changed (a new Wi-Fi, 4G, a VPN, a NAT that
    /// rebound): call it from the platform's network-change callback.
    /// Without it a client with nothing to send stays unreachable until its
    /// next keep-alive, since the server learns a QUIC client's new address
    /// only from a packet.
    ///
    /// - Over QUIC it sends a `Ping` request at once, on the new path: the
    ///   server migrates the connection within one round trip and pushes
    ///   follow it.
    /// - Over WebSocket (a TCP connection does not survive a new address)
    ///   it sends the same `Ping`; if no answer comes within
    ///   `probe_timeout` the connection counts as lost and the client
    ///   reconnects at once (QUIC first) and resumes its session.
    /// - While reconnecting it cuts the current backoff wait short.
    ///
    /// Returns at once; nothing to await.
    pub fn network_changed(&self) {
        // A full queue has requests waiting that will go out anyway.
        let _ = self.cmd.try_send(Cmd::NetworkChanged);
    }

    /// [`Client::rebind`] to `socket`, then [`Client::network_changed`].
    pub fn network_changed_with(&self, socket: UdpSocket) -> std::io::Result<()> {
        self.rebind(socket)?;
        self.network_changed();
        Ok(())
    }

    async fn call(&self, request: Request) -> Result<Answer, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Request { request, reply: tx })
            .await
            .map_err(|_| ClientError::Closed)?;
        match tokio::time::timeout(self.request_timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ClientError::Closed),
            Err(_) => Err(ClientError::Timeout),
        }
    }

    fn unexpected(answer: Answer) -> ClientError {
        ClientError::Protocol(ProtocolError::UnexpectedAnswer {
            answer: Box::new(answer),
        })
    }

    /// Renews the lease and measures nothing: a round trip.
    pub async fn ping(&self) -> Result<(), ClientError> {
        match self.call(Request::Ping).await? {
            Answer::Done => Ok(()),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Watches `targets` in `tier`: snapshots now, updates on [`Updates`].
    pub async fn subscribe<S: AsRef<str>>(
        &self,
        targets: &[S],
        tier: Tier,
    ) -> Result<Subscribed, ClientError> {
        let targets: Vec<String> = targets.iter().map(|t| t.as_ref().to_owned()).collect();
        let answer = self
            .call(Request::Subscribe {
                targets,
                tier: tier.into(),
            })
            .await?;
        match answer {
            // The driver already applied the snapshots to the view.
            Answer::Subscribed { snapshots, refused } => Ok(Subscribed {
                snapshots: snapshots
                    .into_iter()
                    .map(|s| (s.target, s.tier.into(), s.presence.to_core()))
                    .collect(),
                refused,
            }),
            other => Err(Self::unexpected(other)),
        }
    }

    pub async fn unsubscribe(&self, target: &str) -> Result<(), ClientError> {
        self.shared.state().wanted.remove(target);
        match self
            .call(Request::Unsubscribe {
                target: target.to_owned(),
            })
            .await?
        {
            Answer::Done => {
                let mut state = self.shared.state();
                if let Some(id) = state.ids.get(target).copied() {
                    state.view.forget(id);
                }
                Ok(())
            }
            other => Err(Self::unexpected(other)),
        }
    }

    /// What this session may see of one user now.
    pub async fn query(&self, target: &str) -> Result<Presence, ClientError> {
        let mut results = self.query_many(&[target]).await?;
        match results.pop() {
            Some((_, result)) => result.map_err(ClientError::Server),
            None => Err(ProtocolError::EmptyQueryAnswer.into()),
        }
    }

    /// Several users at once (service tokens only).
    pub async fn query_many<S: AsRef<str>>(
        &self,
        targets: &[S],
    ) -> Result<Vec<(String, Result<Presence, WireError>)>, ClientError> {
        let targets = targets.iter().map(|t| t.as_ref().to_owned()).collect();
        match self.call(Request::Query { targets }).await? {
            Answer::Presences(results) => Ok(results
                .into_iter()
                .map(|QueryResult { target, result }| (target, result.map(|p| p.to_core())))
                .collect()),
            other => Err(Self::unexpected(other)),
        }
    }

    /// The user's chosen status and message. Idempotent: after a
    /// [`ClientError::Timeout`] (outcome unknown, see the module docs) call
    /// it again with the same values; a value the user already has changes
    /// nothing anybody sees.
    pub async fn set_status(
        &self,
        status: Status,
        message: Option<&str>,
    ) -> Result<(), ClientError> {
        match self
            .call(Request::SetStatus {
                status: status.into(),
                message: message.map(str::to_owned),
            })
            .await?
        {
            Answer::Done => Ok(()),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Appear offline to everybody else (or stop). Idempotent like
    /// [`Client::set_status`]: retry it after a timeout.
    pub async fn set_invisible(&self, invisible: bool) -> Result<(), ClientError> {
        match self.call(Request::SetInvisible { invisible }).await? {
            Answer::Done => Ok(()),
            other => Err(Self::unexpected(other)),
        }
    }

    /// The Online devices of `user` (service tokens only).
    pub async fn route(&self, user: &str) -> Result<Vec<RouteEntry>, ClientError> {
        match self
            .call(Request::Route {
                user: user.to_owned(),
            })
            .await?
        {
            Answer::Route(entries) => Ok(entries),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Sends a new token for this user and device on the live connection
    /// (and uses it for later hellos); returns the subscriptions its
    /// `watch` no longer allows, which ended. Refused, the connection goes
    /// on under the current token.
    pub async fn refresh(&self, token: &str) -> Result<Vec<String>, ClientError> {
        let request = Request::Refresh {
            token: token.to_owned(),
        };
        match self.call(request).await? {
            Answer::Refreshed { ended, .. } => Ok(ended),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Service tokens only: revokes every token of `user` (only of
    /// `device`, if given) issued before `before` (Unix seconds). Returns
    /// how many live sessions of the server it closed.
    pub async fn revoke(
        &self,
        user: &str,
        device: Option<&str>,
        before: u64,
    ) -> Result<u32, ClientError> {
        let request = Request::Revoke {
            user: user.to_owned(),
            device: device.map(str::to_owned),
            before,
        };
        match self.call(request).await? {
            Answer::Revoked { closed } => Ok(closed),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Graceful logout: the device goes offline at once (no grace), and the
    /// client is finished.
    pub async fn logout(&self) -> Result<(), ClientError> {
        let result = match self.call(Request::Logout).await {
            Ok(Answer::Done) => Ok(()),
            // The server may close with the logout code before the answer lands.
            Err(ClientError::Rejected {
                code: Some(CloseCode::Logout),
                ..
            }) => Ok(()),
            Ok(other) => Err(Self::unexpected(other)),
            Err(e) => Err(e),
        };
        self.close_with(CloseCode::Logout).await;
        result
    }

    /// Closes without logging out: the server treats it as a lost connection
    /// and the device lingers for its grace.
    pub async fn close(&self) {
        self.close_with(CloseCode::Normal).await;
    }

    async fn close_with(&self, code: CloseCode) {
        let (tx, rx) = oneshot::channel();
        if self.cmd.send(Cmd::Close { code, done: tx }).await.is_ok() {
            let _ = rx.await;
        }
        // Give the close frame a moment to leave.
        let _ = tokio::time::timeout(
            Duration::from_millis(500),
            self.shared.dialer.endpoint.wait_idle(),
        )
        .await;
    }
}
