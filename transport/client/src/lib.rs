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
//! [`ClientConfig::websocket`] (default: the QUIC address being tried, over TCP), and
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
//! makes a request, or the network changes). After
//! [`ClientConfig::close_in_background`] in the background it closes the
//! connection (the server keeps the session for its grace), so nothing
//! wakes the phone for it. Back in the foreground it tells the server,
//! checks the connection within `probe_timeout` or reconnects at once
//! (resuming), and a reconnect in progress tries at once with its backoff
//! reset.
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
//! # Servers and trust
//!
//! [`ClientConfig::servers`] lists one or more servers: IP addresses or
//! `HOST:PORT` names ([`ServerAddr`]). Every connection attempt (the first
//! and every reconnect) resolves the names again (DNS, through the
//! system's resolver) and tries the addresses in order, staggered: each
//! next address starts [`ClientConfig::address_delay`] (250 ms) after the
//! one before unless a transport is up, each within
//! [`ClientConfig::connect_timeout`]; the first transport up says hello,
//! and the others are dropped. So a dead address costs 250 ms, not the
//! connect timeout. After a lost connection the address it was on is tried
//! last, so a client of a node that died or drains moves to another. A refusal that ends the
//! client (a bad token) ends the attempt at once; a refusal that allows
//! a reconnect (a draining or full server) moves on to the next address.
//! [`ClientStats::server`] says where the client is.
//!
//! The server's certificate is checked against [`ClientConfig::trust`]:
//! [`Trust::Roots`] (a private CA, or a self-signed server's own
//! certificate), [`Trust::Platform`] (the operating system's trust store,
//! through `rustls-platform-verifier`; on Android the app must initialise
//! that crate's Android component first) or [`Trust::CertificateHashes`]
//! (SHA-256 pins). The name checked (and sent as SNI) is the host name
//! the address came from, unless [`ClientConfig::server_name`] says
//! otherwise (for an IP address without it: `localhost`).
//!
//! # A request without an answer in time
//!
//! Every request has a deadline, [`ClientConfig::request_timeout`]
//! (default 10 s). Until it passes the request waits for the path: a
//! silent path (QUIC retransmits), a reconnect (the request waits, or if it
//! was sent on the connection that was lost and is idempotent, it is sent
//! again on the next one). When the deadline passes without an answer the
//! call says which of two things happened:
//! - [`ClientError::NotSent`]: the request was never sent (the client was
//!   reconnecting); it is dropped and never takes effect;
//! - [`ClientError::OutcomeUnknown`]: it was sent; it may or may not have
//!   taken effect, and may still take effect later (the transport
//!   retransmits it until the connection is declared lost). It is not a
//!   failure.
//!
//! A connection lost with a logout, refresh or revoke unanswered gives
//! `OutcomeUnknown` at once (they are not sent twice). A client that ends
//! (gave up, refused) answers requests sent once with `OutcomeUnknown` and
//! the others with its error.
//!
//! Requests of one client reach the server in the order they were made, so a
//! later call always wins over an earlier one whose outcome is unknown.
//! [`Client::set_status`], [`Client::set_invisible`] and the foreground
//! state ([`Client::app_foregrounded`], [`Client::app_backgrounded`]) are
//! idempotent: setting the value the user already has changes nothing
//! anybody sees (no push, no new version), so after `OutcomeUnknown`
//! (or `NotSent`) simply call again until it is answered. The client does
//! not retry on its own past the deadline.
//!
//! # Errors
//!
//! [`ClientError`] says what kind of failure it was, and its variants carry
//! typed reasons to match on: [`ConfigError`], [`ConnectError`] (which
//! handshake failed, or both), [`LostReason`] and [`ProtocolError`]. Where
//! a reason has a foreign cause (an I/O, QUIC, TLS or WebSocket error) it
//! carries it (QUIC, TLS and WebSocket errors as an opaque [`Cause`]), and
//! [`std::error::Error::source`] returns it. The `Display` text is a whole
//! sentence, cause included.
//!
//! # A stable API
//!
//! The API names no type of quinn, rustls or tungstenite, so their new
//! versions do not break it; public enums and structs whose variants or
//! fields may grow are `#[non_exhaustive]` (build a [`ClientConfig`] with
//! [`ClientConfig::new`], then set fields). The `unstable-internals`
//! feature re-exports those crates, the `tls` module (the client's QUIC
//! and TLS configurations, for raw connections) and `ClientConfig::tls` (a
//! rustls configuration of one's own); it is outside semver.
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
mod connect;
mod driver;
mod error;
mod events;
mod groups;
mod lifecycle;
mod refresh;
mod request;
#[cfg(feature = "unstable-internals")]
pub mod tls;
mod trust;
mod ws;

pub use backoff::{retry_hint, Backoff, Reconnect, MAX_RETRY_HINT};
pub use error::{
    Cause, ClientError, ConfigError, ConnectError, LostReason, ProtocolError, TlsError,
};
pub use events::{Carrier, Event, EventStats, Source, Updates};
pub use groups::{GroupChange, GroupCursor, GroupPage, GroupRole, GroupSnapshot, GroupWritten};
pub use refresh::{token_expiry, TokenRefresh};
pub use trust::{Certificate, Trust};

// Outside the stable API (see the `unstable-internals` feature): the
// libraries under the client, for a TLS configuration of one's own or raw
// connections beside a client.
#[cfg(feature = "unstable-internals")]
pub use {quinn, rustls, tokio_tungstenite::tungstenite};

use connect::{establish, Dialer};
use greendot_core::{Applied, Presence, SessionId, Status, Tier, UserId, View};
use greendot_proto::{
    self as proto, codec::read_frame, encode_frame, Answer, CloseCode, ErrorCode, FrameReader,
    Hello, Push, QueryResult, Refused, Request, RequestFrame, RouteEntry, ServerFrame, Welcome,
    WireError,
};
use request::Ticket;
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
    /// Where the server is: one or more addresses or `HOST:PORT` names,
    /// tried in this order (staggered by `address_delay`) at every
    /// connection attempt (see the module docs, "Servers"). Never empty.
    pub servers: Vec<ServerAddr>,
    /// The name the server's certificate must have (and the TLS SNI).
    /// Default `None`: the host name for an address resolved from one,
    /// `localhost` for an IP address.
    pub server_name: Option<String>,
    /// Which servers to trust: roots (a private CA or a self-signed
    /// server's certificate), the platform's trust store, or certificate
    /// hashes.
    pub trust: Trust,
    pub token: String,
    /// Local UDP address. Default `None`: any address, any port; IPv4
    /// when every server is an IPv4 address, else dual-stack IPv6 (IPv4 if
    /// the host has no IPv6).
    pub bind: Option<SocketAddr>,
    /// QUIC keep-alive. Default 10 s.
    pub keep_alive: Duration,
    /// QUIC idle timeout (the lower of the client's and the server's applies).
    /// Default 30 s.
    pub idle_timeout: Duration,
    /// `None`: a lost connection ends the client.
    pub reconnect: Option<Reconnect>,
    /// The deadline of a request: how long a call waits for its answer,
    /// including while the path is silent or the client reconnects (a
    /// request sent on a connection that was lost is sent again on the
    /// next if it is idempotent). Past it the call returns
    /// [`ClientError::OutcomeUnknown`] if the request was sent, or
    /// [`ClientError::NotSent`] if not (see the module docs, "A request
    /// without an answer in time"). Default 10 s.
    pub request_timeout: Duration,
    /// How long one attempt to connect and say hello may take (QUIC does not
    /// notice a server that is down until its handshake times out). Default 5 s.
    pub connect_timeout: Duration,
    /// The ALPN offered (change it only to test the server).
    pub alpn: Vec<u8>,
    /// The protocol version in the hello (change it only to test the server).
    pub version: u32,
    /// A TLS configuration to use instead of the one built from `trust` (a
    /// custom certificate check, a session cache shared by several clients).
    /// It must allow TLS 1.3; if it offers no ALPN, `alpn` is offered. The
    /// WebSocket carrier uses a copy with ALPN `http/1.1` and a session
    /// cache of its own. Default `None`. Only with the
    /// `unstable-internals` feature (it is rustls' type).
    #[cfg(feature = "unstable-internals")]
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The WebSocket fallback (`wss://server_name:PORT/…`), tried when no
    /// QUIC handshake completes within `fallback_delay` (see the module
    /// docs, "When UDP is blocked"). Default [`WebSocket::SamePort`]: each
    /// server address over TCP (`greendot serve` listens for WebSocket on
    /// the QUIC port number).
    pub websocket: WebSocket,
    /// The path of the WebSocket upgrade. Default `/greendot`.
    pub websocket_path: String,
    /// How long QUIC has alone before the WebSocket attempt starts beside
    /// it. Default 300 ms.
    pub fallback_delay: Duration,
    /// With several addresses: how long an address's attempt has alone
    /// before the next address's starts beside it (the first transport up
    /// says hello), so a dead address costs this, not `connect_timeout`.
    /// Default 250 ms (RFC 8305's connection attempt delay).
    pub address_delay: Duration,
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
    /// How long after [`Client::app_backgrounded`] the client closes its
    /// connection, if the app is still in the background and has nothing
    /// waiting for an answer: from then on nothing wakes the device for
    /// this client (no keep-alives, no redials). The server keeps the
    /// session for the device's grace; [`Client::app_foregrounded`] or a
    /// request reconnects at once, resuming it (or, after the grace, with a
    /// new session that subscribes again). A return within this time keeps
    /// the connection, so quick toggles cost nothing. `None`: the
    /// connection stays up in the background (pushes go on). Default 10 s.
    pub close_in_background: Option<Duration>,
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
    /// The settings to connect to `server` (an address, or a
    /// [`ServerAddr::parse`]d `HOST:PORT`) trusting `trust` (a
    /// `Vec<Certificate>` of roots, or a [`Trust`]), with every other
    /// setting at its default; change the fields after.
    pub fn new(
        server: impl Into<ServerAddr>,
        trust: impl Into<Trust>,
        token: impl Into<String>,
    ) -> ClientConfig {
        ClientConfig {
            servers: vec![server.into()],
            server_name: None,
            trust: trust.into(),
            token: token.into(),
            bind: None,
            keep_alive: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            reconnect: Some(Reconnect::default()),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            alpn: proto::ALPN.to_vec(),
            version: proto::VERSION,
            #[cfg(feature = "unstable-internals")]
            tls: None,
            websocket: WebSocket::SamePort,
            websocket_path: ws::PATH.into(),
            fallback_delay: Duration::from_millis(300),
            address_delay: Duration::from_millis(250),
            probe_timeout: Duration::from_secs(3),
            resume: None,
            refresh: None,
            refresh_ahead: Duration::from_secs(60),
            foreground: true,
            close_in_background: Some(Duration::from_secs(10)),
            max_pending_events: 64,
            max_pending_targets: 4_096,
        }
    }
}

/// Where a server is: an address, or a host name resolved at every
/// connection attempt (every address it resolves to is tried).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ServerAddr {
    Ip(SocketAddr),
    /// A DNS name and a port. The name is also the one the server's
    /// certificate must have, unless `server_name` says otherwise.
    Host {
        name: String,
        port: u16,
    },
}

impl ServerAddr {
    /// `IP:PORT`, `[IPv6]:PORT` or `HOST:PORT`.
    pub fn parse(text: &str) -> Result<ServerAddr, ConfigError> {
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(ServerAddr::Ip(addr));
        }
        let bad = || ConfigError::ServerAddress(text.to_owned());
        let (name, port) = text.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse::<u16>().map_err(|_| bad())?;
        let valid = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
        if !valid {
            return Err(bad());
        }
        Ok(ServerAddr::Host {
            name: name.to_owned(),
            port,
        })
    }
}

impl From<SocketAddr> for ServerAddr {
    fn from(addr: SocketAddr) -> ServerAddr {
        ServerAddr::Ip(addr)
    }
}

impl std::str::FromStr for ServerAddr {
    type Err = ConfigError;
    fn from_str(text: &str) -> Result<ServerAddr, ConfigError> {
        ServerAddr::parse(text)
    }
}

impl std::fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerAddr::Ip(addr) => addr.fmt(f),
            ServerAddr::Host { name, port } => write!(f, "{name}:{port}"),
        }
    }
}

/// Where the WebSocket fallback connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WebSocket {
    /// QUIC only.
    Off,
    /// The QUIC address being tried, over TCP.
    SamePort,
    /// This TCP address, whichever server address is tried.
    At(SocketAddr),
}

impl From<Option<SocketAddr>> for WebSocket {
    /// `None`: [`WebSocket::Off`]; an address: [`WebSocket::At`].
    fn from(addr: Option<SocketAddr>) -> WebSocket {
        addr.map_or(WebSocket::Off, WebSocket::At)
    }
}

/// The TLS configuration the application gave, if any.
#[cfg(feature = "unstable-internals")]
pub(crate) fn custom_tls(config: &ClientConfig) -> Option<&Arc<rustls::ClientConfig>> {
    config.tls.as_ref()
}

#[cfg(not(feature = "unstable-internals"))]
pub(crate) fn custom_tls(_: &ClientConfig) -> Option<&Arc<rustls::ClientConfig>> {
    None
}

/// The local address when `bind` is `None` (see [`ClientConfig::bind`]).
fn default_binds(servers: &[ServerAddr]) -> Vec<SocketAddr> {
    let v4 = SocketAddr::from(([0, 0, 0, 0], 0));
    let v6 = SocketAddr::from(([0u16; 8], 0));
    if servers
        .iter()
        .all(|s| matches!(s, ServerAddr::Ip(a) if a.is_ipv4()))
    {
        vec![v4]
    } else {
        vec![v6, v4]
    }
}

/// How a client has been connected so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientStats {
    /// What the current (or last) connection runs on.
    pub carrier: Carrier,
    /// The server address of the current (or last) connection.
    pub server: SocketAddr,
    /// Connections that said hello over QUIC, the first one included.
    pub quic_connections: u64,
    /// Connections that said hello over WebSocket (fallbacks).
    pub websocket_connections: u64,
}

/// The answer to a subscribe.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The highest version told of each subscribed group.
    group_versions: HashMap<u64, u64>,
    /// The server's cap on a request's payload (the latest welcome's
    /// `max_frame`, at least 1,024 as the driver enforces it).
    max_frame: usize,
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
        ticket: Ticket,
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
    /// A group push, as its event.
    Group(Event),
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
    /// The address connected to.
    server: SocketAddr,
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
    ClientError::Lost(LostReason::Quic(error::Cause::new(error.clone())))
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

impl Client {
    /// Connects, says hello and starts the client's tasks.
    pub async fn connect(config: ClientConfig) -> Result<(Client, Updates), ClientError> {
        // One TLS configuration for every connection of this client: its
        // session cache is what lets a reconnect resume TLS.
        if config.servers.is_empty() {
            return Err(ConfigError::NoServer.into());
        }
        let mut tls = match custom_tls(&config) {
            Some(given) => (**given).clone(),
            None => trust::client_tls(&config.trust)?,
        };
        if tls.alpn_protocols.is_empty() {
            tls.alpn_protocols = vec![config.alpn.clone()];
        }
        let crypto = trust::quic_crypto(tls)?;
        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(Some(config.keep_alive));
        transport.max_idle_timeout(Some(
            config
                .idle_timeout
                .try_into()
                .map_err(|_| ConfigError::IdleTimeoutTooLarge)?,
        ));
        let mut client_config = quinn::ClientConfig::new(Arc::new(crypto));
        client_config.transport_config(Arc::new(transport));
        let binds = match config.bind {
            Some(addr) => vec![addr],
            None => default_binds(&config.servers),
        };
        let mut bound = Err(ConnectError::Bind {
            addr: binds[0],
            source: Arc::new(std::io::Error::other("no address to bind")),
        });
        for addr in binds {
            bound = quinn::Endpoint::client(addr).map_err(|e| ConnectError::Bind {
                addr,
                source: Arc::new(e),
            });
            if bound.is_ok() {
                break;
            }
        }
        let mut endpoint = bound?;
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
            None,
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
                group_versions: HashMap::new(),
                max_frame: welcome.max_frame.max(1024) as usize,
                closed: false,
                stats: ClientStats {
                    carrier,
                    server: established.server,
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

    /// The server's cap on a request's payload, from its latest welcome: a
    /// larger request fails with `ConfigError::RequestTooLarge`.
    pub fn max_frame(&self) -> usize {
        self.shared.state().max_frame
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
    /// - While reconnecting it tries at once, with the backoff reset (the
    ///   new path may work where the old one failed); in the background
    ///   too, unless the client closed the connection itself
    ///   ([`ClientConfig::close_in_background`]).
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

    /// Sends `request` and waits for its answer until the deadline
    /// (`request_timeout`); past it, whether the request was sent decides
    /// between `OutcomeUnknown` and `NotSent`.
    async fn call(&self, request: Request) -> Result<Answer, ClientError> {
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        let (tx, rx) = oneshot::channel();
        let ticket = Ticket::default();
        let cmd = Cmd::Request {
            request,
            reply: tx,
            ticket: ticket.clone(),
        };
        match tokio::time::timeout_at(deadline, self.cmd.send(cmd)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(ClientError::Closed),
            Err(_) => return Err(ClientError::NotSent),
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ClientError::Closed),
            Err(_) if ticket.abandon() => Err(ClientError::NotSent),
            Err(_) => Err(ClientError::OutcomeUnknown { lost: None }),
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

    /// The user's chosen status and message. Idempotent: after
    /// [`ClientError::OutcomeUnknown`] or [`ClientError::NotSent`] (see the
    /// module docs, "A request without an answer in time") call it again
    /// with the same values; a value the user already has changes nothing
    /// anybody sees.
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
    /// [`Client::set_status`]: retry it after `OutcomeUnknown`.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_addresses_are_ips_or_host_names_with_a_port() {
        assert_eq!(
            ServerAddr::parse("127.0.0.1:4433").unwrap(),
            ServerAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 4433)))
        );
        assert!(matches!(
            ServerAddr::parse("[::1]:4433").unwrap(),
            ServerAddr::Ip(a) if a.is_ipv6()
        ));
        let host = ServerAddr::parse("presence.example.com:4433").unwrap();
        assert_eq!(
            host,
            ServerAddr::Host {
                name: "presence.example.com".into(),
                port: 4433
            }
        );
        assert_eq!(host.to_string(), "presence.example.com:4433");
        for bad in [
            "",
            "example.com",
            ":4433",
            "a b:1",
            "host:99999",
            "::1:4433x",
        ] {
            assert!(ServerAddr::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_default_bind_is_ipv4_only_for_ipv4_servers() {
        let v4: ServerAddr = SocketAddr::from(([127, 0, 0, 1], 1)).into();
        assert_eq!(default_binds(std::slice::from_ref(&v4)).len(), 1);
        let host = ServerAddr::parse("localhost:1").unwrap();
        assert!(default_binds(&[v4, host])[0].is_ipv6());
    }
}
