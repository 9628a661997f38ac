//! The Rust client library.
//!
//! [`Client::connect`] opens a QUIC connection, says hello with the token and
//! returns the client and its [`Updates`], an async stream of [`Event`]s.
//! Snapshots and pushes are applied to a `greendot_core::View`, so stale or
//! duplicate versions never reach the application. When the connection is lost
//! (not closed by the application or refused by the server) the client
//! reconnects with backoff and resumes its session; if the session could not be
//! resumed it subscribes again to what it had. [`Client::rebind`] moves the
//! client to a new UDP socket (a new network) without reconnecting.
//!
//! In the client's `Presence`, `last_seen` is in Unix milliseconds (the
//! server's clock), not on the server's monotonic clock.
//!
//! # Reconnecting
//!
//! Every wait before an attempt is drawn with full jitter: uniformly in
//! `[0, min(max_backoff, initial_backoff * 2^n)]` before the `n`-th attempt
//! (from 0), so that clients that lost the same server at the same moment do
//! not come back at the same moment. A close reason from the server may carry
//! `retry_ms=<decimal>` (a draining server spreads its clients over the time
//! it needs to admit them all): the next wait is then drawn uniformly in
//! `[0, retry_ms]` instead. Every connection of one [`Client`] uses the same
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

pub mod tls;

// Re-exported so users need no second copy of them (TLS settings, roots).
pub use quinn;
pub use rustls;

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

/// Reconnection policy (see the module docs: waits are drawn with full jitter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reconnect {
    /// The ceiling of the first wait after a loss; it doubles with every
    /// failed attempt up to `max_backoff`.
    pub initial_backoff: Duration,
    /// The largest ceiling of a wait (a `retry_ms` from the server may exceed
    /// it).
    pub max_backoff: Duration,
    /// Stop trying after this long without a connection (`None`: never).
    pub give_up_after: Option<Duration>,
}

/// The longest wait taken from a server's `retry_ms` (a larger one is cut
/// to this).
pub const MAX_RETRY_HINT: Duration = Duration::from_secs(300);

/// The `retry_ms=<decimal>` a server may put in a close reason (a word of its
/// own: `xretry_ms=5` is not one), as a duration of at most
/// [`MAX_RETRY_HINT`]. The first one counts.
pub fn retry_hint(reason: &str) -> Option<Duration> {
    const KEY: &str = "retry_ms=";
    let mut rest = reason;
    let mut offset = 0;
    while let Some(at) = rest.find(KEY) {
        let start = offset + at;
        let word_start = match reason[..start].chars().next_back() {
            None => true,
            Some(c) => !(c.is_alphanumeric() || c == '_'),
        };
        let digits: &str = {
            let after = &reason[start + KEY.len()..];
            let end = after
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(after.len());
            &after[..end]
        };
        if word_start && !digits.is_empty() {
            // Too many digits for a u64 is simply "a very long time".
            let ms = digits.parse::<u64>().unwrap_or(u64::MAX);
            return Some(Duration::from_millis(ms).min(MAX_RETRY_HINT));
        }
        offset = start + KEY.len();
        rest = &reason[offset..];
    }
    None
}

/// Full-jitter exponential backoff: the `n`-th wait (from 0) is uniform in
/// `[0, min(max_backoff, initial_backoff * 2^n)]`, or uniform in
/// `[0, retry_ms]` when the server suggested one.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: Reconnect,
    attempt: u32,
    rng: u64,
}

impl Backoff {
    /// Seeded from the system's randomness (`ring`), so that two clients
    /// started together draw different waits.
    pub fn new(policy: Reconnect) -> Backoff {
        use ring::rand::SecureRandom;
        let mut seed = [0u8; 8];
        let seed = match ring::rand::SystemRandom::new().fill(&mut seed) {
            Ok(()) => u64::from_le_bytes(seed),
            // No system randomness: the clock's nanoseconds still differ
            // between clients.
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
        };
        Backoff::with_seed(policy, seed)
    }

    /// A replayable sequence of waits (tests, benchmarks).
    pub fn with_seed(policy: Reconnect, seed: u64) -> Backoff {
        Backoff {
            policy,
            attempt: 0,
            // xorshift needs a state other than 0.
            rng: seed | 1,
        }
    }

    /// The ceiling of the next wait: `min(max_backoff, initial_backoff * 2^n)`.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt).unwrap_or(u32::MAX);
        self.policy
            .initial_backoff
            .checked_mul(factor)
            .unwrap_or(Duration::MAX)
            .min(self.policy.max_backoff)
    }

    /// The next wait: uniform in `[0, hint]` if the server suggested one,
    /// otherwise uniform in `[0, ceiling()]`; the ceiling then doubles.
    pub fn next_delay(&mut self, hint: Option<Duration>) -> Duration {
        let ceiling = hint.unwrap_or_else(|| self.ceiling());
        self.attempt = self.attempt.saturating_add(1);
        self.uniform(ceiling)
    }

    /// Starts again from `initial_backoff` (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Uniform in `[0, max]`, to the nanosecond.
    fn uniform(&mut self, max: Duration) -> Duration {
        // xorshift64*: plenty for spreading reconnects.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let span = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        let nanos = ((u128::from(r) * (u128::from(span) + 1)) >> 64) as u64;
        Duration::from_nanos(nanos)
    }
}

impl Default for Reconnect {
    fn default() -> Reconnect {
        Reconnect {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            give_up_after: Some(Duration::from_secs(300)),
        }
    }
}

impl Reconnect {
    /// A policy with these waits (see the fields); a setting added later
    /// gets its default.
    pub fn new(
        initial_backoff: Duration,
        max_backoff: Duration,
        give_up_after: Option<Duration>,
    ) -> Reconnect {
        Reconnect {
            initial_backoff,
            max_backoff,
            give_up_after,
        }
    }
}

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
    /// It must allow TLS 1.3; if it offers no ALPN, `alpn` is offered.
    /// Default `None`.
    pub tls: Option<Arc<rustls::ClientConfig>>,
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
        }
    }
}

/// Why a client call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    #[error("invalid client setting: {0}")]
    Config(String),
    /// The TLS configuration could not be built (a bad root certificate).
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The server refused the connection: an error frame and/or a close code.
    #[error("refused by the server ({code:?}): {error}")]
    Rejected {
        code: Option<CloseCode>,
        error: WireError,
    },
    /// The connection was lost, or closed by the server.
    #[error("connection lost: {0}")]
    Lost(String),
    /// The server answered the request with an error.
    #[error("server error: {0}")]
    Server(WireError),
    #[error("protocol violation by the server: {0}")]
    Protocol(String),
    #[error("no answer in time")]
    Timeout,
    #[error("the client is closed")]
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
    /// reconnecting (`retry_ms` in its close reason), if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Rejected { error, .. } => retry_hint(&error.message),
            _ => None,
        }
    }
}

/// Where an update came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A snapshot: in a subscribe answer or a resumed welcome.
    Snapshot,
    Realtime,
    Batched,
}

/// What the client tells the application.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// What the client knows of `target` changed (newer version only).
    Presence {
        target: String,
        presence: Presence,
        source: Source,
    },
    /// The connection was lost; the client is reconnecting.
    Disconnected { reason: String },
    /// Connected again; `resumed` if the old session carried over unseen.
    Reconnected { session: SessionId, resumed: bool },
    /// The client is finished (closed, logged out, refused, superseded, or
    /// gave up reconnecting).
    Closed {
        code: Option<CloseCode>,
        reason: String,
    },
}

/// The stream of events of one client.
#[derive(Debug)]
pub struct Updates {
    rx: mpsc::UnboundedReceiver<Event>,
}

impl Updates {
    /// The next event; `None` once the client is gone and all were read.
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// An event already received, without waiting.
    pub fn try_next(&mut self) -> Option<Event> {
        self.rx.try_recv().ok()
    }
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
    user: String,
    device: String,
    view: View,
    ids: HashMap<String, UserId>,
    /// What the application subscribed to, to subscribe again after a reconnect
    /// that could not resume.
    wanted: BTreeMap<String, Tier>,
    closed: bool,
}

struct Shared {
    endpoint: quinn::Endpoint,
    state: Mutex<State>,
    events: mpsc::UnboundedSender<Event>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn emit(&self, event: Event) {
        let _ = self.events.send(event);
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

struct Established {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    reader: FrameReader,
    welcome: Welcome,
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
    ClientError::Lost(error.to_string())
}

/// After an error frame: the server's close code, and the error with the
/// close reason's `retry_ms` added to its message if only the reason has it.
async fn rejected_after(conn: &quinn::Connection, mut error: WireError) -> ClientError {
    let code = match conn.closed().await {
        quinn::ConnectionError::ApplicationClosed(c) => {
            let reason = String::from_utf8_lossy(&c.reason);
            if let (None, Some(hint)) = (retry_hint(&error.message), retry_hint(&reason)) {
                error.message = format!("{} retry_ms={}", error.message, hint.as_millis());
            }
            CloseCode::from_code(c.error_code.into_inner())
        }
        _ => None,
    };
    ClientError::Rejected { code, error }
}

fn error_code_for(code: Option<CloseCode>) -> ErrorCode {
    match code {
        Some(CloseCode::Unauthorized) => ErrorCode::BadToken,
        Some(CloseCode::TokenExpired) => ErrorCode::TokenExpired,
        Some(CloseCode::UnsupportedVersion) => ErrorCode::UnsupportedVersion,
        Some(CloseCode::FrameTooLarge) => ErrorCode::FrameTooLarge,
        Some(CloseCode::ProtocolError) => ErrorCode::BadFrame,
        Some(CloseCode::TooManyConnections) => ErrorCode::TooManyConnections,
        Some(CloseCode::Shutdown) | Some(CloseCode::Draining) => ErrorCode::ShuttingDown,
        Some(CloseCode::Superseded) | Some(CloseCode::SessionExpired) => ErrorCode::Stale,
        _ => ErrorCode::Other(0),
    }
}

/// Opens a connection and says hello, within the connect timeout.
async fn establish(
    endpoint: &quinn::Endpoint,
    config: &ClientConfig,
    resume: Option<SessionId>,
) -> Result<Established, ClientError> {
    match tokio::time::timeout(
        config.connect_timeout,
        establish_now(endpoint, config, resume),
    )
    .await
    {
        Ok(result) => result,
        Err(_) => Err(ClientError::Connect(format!(
            "no answer from {} within {:?}",
            config.server, config.connect_timeout
        ))),
    }
}

async fn establish_now(
    endpoint: &quinn::Endpoint,
    config: &ClientConfig,
    resume: Option<SessionId>,
) -> Result<Established, ClientError> {
    let connecting = endpoint
        .connect(config.server, &config.server_name)
        .map_err(|e| ClientError::Connect(e.to_string()))?;
    let conn = connecting.await.map_err(|e| match &e {
        quinn::ConnectionError::ApplicationClosed(_) => lost(&e),
        _ => ClientError::Connect(e.to_string()),
    })?;
    let result = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
        let hello = Hello {
            version: config.version,
            token: config.token.clone(),
            resume: resume.map(|s| s.0),
        };
        let bytes = encode_frame(&hello).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if send.write_all(&bytes).await.is_err() {
            return Err(lost(&conn.closed().await));
        }
        let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
        let frame = match read_frame(&mut recv, &mut reader).await {
            Ok(Some(payload)) => proto::decode::<ServerFrame>(&payload)
                .map_err(|e| ClientError::Protocol(e.to_string()))?,
            Ok(None) | Err(_) => {
                let error = conn.closed().await;
                return Err(lost(&error));
            }
        };
        match frame {
            ServerFrame::Welcome(welcome) => Ok(Established {
                conn: conn.clone(),
                send,
                recv,
                reader,
                welcome,
            }),
            ServerFrame::Error(error) => Err(rejected_after(&conn, error).await),
            ServerFrame::Reply { .. } => {
                Err(ClientError::Protocol("a reply before the welcome".into()))
            }
        }
    }
    .await;
    if result.is_err() {
        conn.close(CloseCode::Normal.varint(), b"hello failed");
    }
    result
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
                .map_err(|_| ClientError::Config("idle_timeout too large".into()))?,
        ));
        let mut client_config = quinn::ClientConfig::new(Arc::new(crypto));
        client_config.transport_config(Arc::new(transport));
        let mut endpoint = quinn::Endpoint::client(config.bind)
            .map_err(|e| ClientError::Connect(format!("cannot bind {}: {e}", config.bind)))?;
        endpoint.set_default_client_config(client_config);

        let established = establish(&endpoint, &config, None).await?;
        let (events, rx) = mpsc::unbounded_channel();
        let welcome = &established.welcome;
        let shared = Arc::new(Shared {
            endpoint,
            state: Mutex::new(State {
                session: SessionId(welcome.session),
                user: welcome.user.clone(),
                device: welcome.device.clone(),
                view: View::new(),
                ids: HashMap::new(),
                wanted: BTreeMap::new(),
                closed: false,
            }),
            events,
        });
        let (cmd_tx, cmd_rx) = mpsc::channel(256);
        let request_timeout = config.request_timeout;
        tokio::spawn(drive(shared.clone(), config, established, cmd_rx));
        Ok((
            Client {
                shared,
                cmd: cmd_tx,
                request_timeout,
            },
            Updates { rx },
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

    /// The local address of the client's socket.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.shared.endpoint.local_addr()
    }

    /// Moves the client to a new UDP socket (a new network); the connection,
    /// its session and subscriptions carry over if the server allows
    /// migration. Call inside the tokio runtime.
    pub fn rebind(&self, socket: UdpSocket) -> std::io::Result<()> {
        self.shared.endpoint.rebind(socket)
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
        ClientError::Protocol(format!("unexpected answer {answer:?}"))
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
            None => Err(ClientError::Protocol("empty query answer".into())),
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
        let _ = tokio::time::timeout(Duration::from_millis(500), self.shared.endpoint.wait_idle())
            .await;
    }
}

enum Pending {
    /// An application's request.
    User(oneshot::Sender<Result<Answer, ClientError>>),
    /// A subscribe sent by the client itself after a reconnect.
    Resubscribe,
}

enum Exit {
    /// The application closed the client (or dropped every handle).
    Closed(CloseCode),
    /// The connection ended; the error says how.
    Lost(ClientError),
}

/// The client's task: runs connections one after another.
async fn drive(
    shared: Arc<Shared>,
    config: ClientConfig,
    mut est: Established,
    mut cmd_rx: mpsc::Receiver<Cmd>,
) {
    let mut deferred: VecDeque<Cmd> = VecDeque::new();
    let mut next_id: u64 = 0;
    loop {
        let welcome = est.welcome.clone();
        for s in &welcome.snapshots {
            shared.apply(&s.target, &s.presence, Source::Snapshot);
        }
        let exit = run(&shared, est, &mut cmd_rx, &mut deferred, &mut next_id).await;
        let error = match exit {
            Exit::Closed(code) => {
                finish(&shared, Some(code), "closed by the application".into());
                return;
            }
            Exit::Lost(error) => error,
        };
        let final_code = match &error {
            ClientError::Rejected { code, .. } => !code.is_some_and(|c| c.may_reconnect()),
            _ => false,
        };
        let Some(policy) = config.reconnect.filter(|_| !final_code) else {
            let code = match &error {
                ClientError::Rejected { code, .. } => *code,
                _ => None,
            };
            finish(&shared, code, error.to_string());
            return;
        };
        shared.emit(Event::Disconnected {
            reason: error.to_string(),
        });
        let hint = error.retry_after();
        match reconnect(&shared, &config, policy, hint, &mut cmd_rx, &mut deferred).await {
            Ok(new) => {
                let resumed = new.welcome.resumed;
                let session = SessionId(new.welcome.session);
                {
                    let mut state = shared.state();
                    state.session = session;
                    if !resumed {
                        // A new session, perhaps on a restarted server whose
                        // versions began again: forget what the old one said,
                        // so the fresh snapshots are not dropped as stale.
                        state.view = View::new();
                    }
                }
                shared.emit(Event::Reconnected { session, resumed });
                est = new;
            }
            Err(exit) => {
                let (code, reason) = match exit {
                    Exit::Closed(code) => (Some(code), "closed by the application".to_owned()),
                    Exit::Lost(ClientError::Rejected { code, error }) => (code, error.to_string()),
                    Exit::Lost(e) => (None, e.to_string()),
                };
                finish(&shared, code, reason);
                return;
            }
        }
    }
}

fn finish(shared: &Shared, code: Option<CloseCode>, reason: String) {
    shared.state().closed = true;
    shared.emit(Event::Closed { code, reason });
}

/// Waits `delay` while taking commands: requests wait for the connection, a
/// close ends the client.
async fn wait_taking_commands(
    delay: Duration,
    cmd_rx: &mut mpsc::Receiver<Cmd>,
    deferred: &mut VecDeque<Cmd>,
) -> Result<(), Exit> {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            _ = &mut sleep => return Ok(()),
            cmd = cmd_rx.recv() => take_command(cmd, deferred)?,
        }
    }
}

/// A command that came while reconnecting: a close ends the attempt, any
/// other waits for the connection.
fn take_command(cmd: Option<Cmd>, deferred: &mut VecDeque<Cmd>) -> Result<(), Exit> {
    match cmd {
        Some(Cmd::Close { code, done }) => {
            let _ = done.send(());
            Err(Exit::Closed(code))
        }
        Some(cmd) => {
            deferred.push_back(cmd);
            Ok(())
        }
        None => Err(Exit::Closed(CloseCode::Normal)),
    }
}

/// Tries to connect again, resuming the session: before each attempt a wait
/// drawn with full jitter, or within the `retry_ms` the server last asked for.
async fn reconnect(
    shared: &Arc<Shared>,
    config: &ClientConfig,
    policy: Reconnect,
    mut hint: Option<Duration>,
    cmd_rx: &mut mpsc::Receiver<Cmd>,
    deferred: &mut VecDeque<Cmd>,
) -> Result<Established, Exit> {
    let started = tokio::time::Instant::now();
    let mut backoff = Backoff::new(policy);
    loop {
        wait_taking_commands(backoff.next_delay(hint.take()), cmd_rx, deferred).await?;
        let resume = Some(shared.state().session);
        let attempt = establish(&shared.endpoint, config, resume);
        tokio::pin!(attempt);
        // Keep taking commands while connecting: requests wait, a close ends.
        let result = loop {
            tokio::select! {
                result = &mut attempt => break result,
                cmd = cmd_rx.recv() => take_command(cmd, deferred)?,
            }
        };
        match result {
            Ok(est) => return Ok(est),
            Err(ClientError::Rejected { code, error })
                if !code.is_some_and(|c| c.may_reconnect()) =>
            {
                return Err(Exit::Lost(ClientError::Rejected { code, error }));
            }
            Err(e) => {
                debug!(error = %e, "reconnect attempt failed");
                hint = e.retry_after();
            }
        }
        if policy
            .give_up_after
            .is_some_and(|limit| started.elapsed() >= limit)
        {
            return Err(Exit::Lost(ClientError::Lost("gave up reconnecting".into())));
        }
    }
}

/// Reads control frames into a channel (so the driver's select stays simple).
async fn read_control(
    mut recv: quinn::RecvStream,
    mut reader: FrameReader,
    tx: mpsc::UnboundedSender<Result<ServerFrame, ClientError>>,
) {
    loop {
        let item = match read_frame(&mut recv, &mut reader).await {
            Ok(Some(payload)) => proto::decode::<ServerFrame>(&payload)
                .map_err(|e| ClientError::Protocol(e.to_string())),
            Ok(None) => return,
            Err(e) => Err(ClientError::Lost(e.to_string())),
        };
        let stop = item.is_err();
        if tx.send(item).is_err() || stop {
            return;
        }
    }
}

/// Accepts the server's push streams and applies what they carry. Aborting
/// this task stops its readers too, so nothing from an old connection is
/// applied after a reconnect.
async fn accept_pushes(conn: quinn::Connection, shared: Arc<Shared>) {
    let mut readers = tokio::task::JoinSet::new();
    while let Ok(recv) = conn.accept_uni().await {
        readers.spawn(read_pushes(recv, shared.clone()));
    }
    while readers.join_next().await.is_some() {}
}

async fn read_pushes(mut recv: quinn::RecvStream, shared: Arc<Shared>) {
    let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
    let mut source = None;
    while let Ok(Some(payload)) = read_frame(&mut recv, &mut reader).await {
        match proto::decode::<Push>(&payload) {
            Ok(Push::Stream { tier }) => {
                source = Some(match tier {
                    proto::Tier::Realtime => Source::Realtime,
                    proto::Tier::Batched => Source::Batched,
                })
            }
            Ok(Push::Update { target, presence }) => {
                if let Some(source) = source {
                    shared.apply(&target, &presence, source);
                }
            }
            Err(e) => {
                debug!(error = %e, "bad push frame");
                return;
            }
        }
    }
}

/// One connection's life: requests out, answers in, until it ends.
async fn run(
    shared: &Arc<Shared>,
    est: Established,
    cmd_rx: &mut mpsc::Receiver<Cmd>,
    deferred: &mut VecDeque<Cmd>,
    next_id: &mut u64,
) -> Exit {
    let Established {
        conn,
        mut send,
        recv,
        reader,
        welcome,
    } = est;
    // The cap on what the client sends; what it reads is capped by MAX_SERVER_FRAME.
    let max_frame = welcome.max_frame.max(1024) as usize;
    let (ctl_tx, mut ctl_rx) = mpsc::unbounded_channel();
    let control = tokio::spawn(read_control(recv, reader, ctl_tx));
    let pushes = tokio::spawn(accept_pushes(conn.clone(), shared.clone()));
    let mut pending: HashMap<u64, Pending> = HashMap::new();

    // After a reconnect that did not resume, subscribe again.
    let mut startup: VecDeque<(Request, Pending)> = VecDeque::new();
    if !welcome.resumed {
        let wanted = shared.state().wanted.clone();
        for tier in [Tier::Realtime, Tier::Batched] {
            let targets: Vec<String> = wanted
                .iter()
                .filter(|(_, t)| **t == tier)
                .map(|(name, _)| name.clone())
                .collect();
            if !targets.is_empty() {
                startup.push_back((
                    Request::Subscribe {
                        targets,
                        tier: tier.into(),
                    },
                    Pending::Resubscribe,
                ));
            }
        }
    }
    while let Some(cmd) = deferred.pop_front() {
        match cmd {
            Cmd::Request { request, reply } => startup.push_back((request, Pending::User(reply))),
            Cmd::Close { code, done } => {
                conn.close(code.varint(), b"closed by the application");
                let _ = done.send(());
                control.abort();
                pushes.abort();
                return Exit::Closed(code);
            }
        }
    }

    let exit = 'conn: loop {
        while let Some((request, waiter)) = startup.pop_front() {
            // The caller gave up waiting (a timeout): a request never sent
            // must never take effect later, so it is not sent at all.
            if matches!(&waiter, Pending::User(reply) if reply.is_closed()) {
                continue;
            }
            *next_id = next_id.wrapping_add(1);
            let id = *next_id;
            let bytes = match encode_frame(&RequestFrame { id, request }) {
                Ok(b) => b,
                Err(e) => {
                    if let Pending::User(reply) = waiter {
                        let _ = reply.send(Err(ClientError::Protocol(e.to_string())));
                    }
                    continue;
                }
            };
            if bytes.len() > max_frame + 4 {
                if let Pending::User(reply) = waiter {
                    let _ = reply.send(Err(ClientError::Config(format!(
                        "request of {} bytes exceeds the server's frame cap",
                        bytes.len()
                    ))));
                }
                continue;
            }
            pending.insert(id, waiter);
            if let Err(e) = send.write_all(&bytes).await {
                debug!(error = %e, "control stream write failed");
                break 'conn Exit::Lost(lost(&conn.closed().await));
            }
        }
        tokio::select! {
            cmd = cmd_rx.recv() => match cmd {
                Some(Cmd::Request { request, reply }) => {
                    startup.push_back((request, Pending::User(reply)));
                }
                Some(Cmd::Close { code, done }) => {
                    conn.close(code.varint(), b"closed by the application");
                    let _ = done.send(());
                    break Exit::Closed(code);
                }
                None => {
                    conn.close(CloseCode::Normal.varint(), b"client dropped");
                    break Exit::Closed(CloseCode::Normal);
                }
            },
            frame = ctl_rx.recv() => match frame {
                Some(Ok(ServerFrame::Reply { id, result })) => {
                    if let Ok(Answer::Subscribed { snapshots, .. }) = &result {
                        let mut state = shared.state();
                        for s in snapshots {
                            state.wanted.insert(s.target.clone(), s.tier.into());
                        }
                    }
                    if let Ok(Answer::Subscribed { snapshots, .. }) = &result {
                        for s in snapshots {
                            shared.apply(&s.target, &s.presence, Source::Snapshot);
                        }
                    }
                    match pending.remove(&id) {
                        Some(Pending::User(reply)) => {
                            let _ = reply.send(result.map_err(ClientError::Server));
                        }
                        Some(Pending::Resubscribe) => {}
                        None => debug!(id, "reply to no request"),
                    }
                }
                Some(Ok(ServerFrame::Error(error))) => {
                    // The server closes next; report its error with the close code.
                    break Exit::Lost(rejected_after(&conn, error).await);
                }
                Some(Ok(ServerFrame::Welcome(_))) => {
                    conn.close(CloseCode::ProtocolError.varint(), b"a second welcome");
                    break Exit::Lost(ClientError::Protocol("a second welcome".into()));
                }
                Some(Err(_)) | None => {
                    break Exit::Lost(lost(&conn.closed().await));
                }
            },
            error = conn.closed() => break Exit::Lost(lost(&error)),
        }
    };
    control.abort();
    pushes.abort();
    let failure = match &exit {
        Exit::Lost(e) => e.clone(),
        Exit::Closed(_) => ClientError::Closed,
    };
    for (_, waiter) in pending.drain() {
        if let Pending::User(reply) = waiter {
            let _ = reply.send(Err(failure.clone()));
        }
    }
    for (_, waiter) in startup.drain(..) {
        if let Pending::User(reply) = waiter {
            let _ = reply.send(Err(failure.clone()));
        }
    }
    exit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(initial_ms: u64, max_ms: u64) -> Reconnect {
        Reconnect {
            initial_backoff: Duration::from_millis(initial_ms),
            max_backoff: Duration::from_millis(max_ms),
            give_up_after: None,
        }
    }

    #[test]
    fn backoff_ceilings_double_up_to_the_maximum() {
        let mut b = Backoff::with_seed(policy(100, 5000), 7);
        let mut ceilings = Vec::new();
        for _ in 0..10 {
            ceilings.push(b.ceiling().as_millis());
            b.next_delay(None);
        }
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]
        );
        // No overflow however many attempts.
        for _ in 0..100 {
            b.next_delay(None);
        }
        assert_eq!(b.ceiling(), Duration::from_millis(5000));
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
    }

    #[test]
    fn backoff_waits_are_spread_over_the_whole_range() {
        // Full jitter: every wait in [0, ceiling], and over many draws both
        // ends of the range are reached (not a fixed or a half-range wait).
        let mut all = Vec::new();
        for seed in 0..2000u64 {
            let mut b = Backoff::with_seed(policy(100, 400), seed.wrapping_mul(0x9e37_79b9));
            for n in 0..4 {
                let ceiling = b.ceiling();
                let d = b.next_delay(None);
                assert!(d <= ceiling, "wait {d:?} over ceiling {ceiling:?}");
                if n == 3 {
                    all.push(d.as_secs_f64() / ceiling.as_secs_f64());
                }
            }
        }
        let below = all.iter().filter(|&&x| x < 0.1).count();
        let above = all.iter().filter(|&&x| x > 0.9).count();
        let mean = all.iter().sum::<f64>() / all.len() as f64;
        assert!(below > 100 && above > 100, "{below} low, {above} high");
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
        // Two clients seeded from the system draw different waits.
        let a: Vec<_> = {
            let mut b = Backoff::new(policy(1000, 1000));
            (0..4).map(|_| b.next_delay(None)).collect()
        };
        let b: Vec<_> = {
            let mut b = Backoff::new(policy(1000, 1000));
            (0..4).map(|_| b.next_delay(None)).collect()
        };
        assert_ne!(a, b);
    }

    #[test]
    fn a_server_hint_bounds_the_next_wait_only() {
        let hint = Duration::from_millis(12_000);
        let mut longest = Duration::ZERO;
        for seed in 1..500u64 {
            let mut b = Backoff::with_seed(policy(100, 5000), seed);
            let d = b.next_delay(Some(hint));
            assert!(d <= hint);
            longest = longest.max(d);
            // The hint replaced the first ceiling; the doubling goes on.
            assert_eq!(b.ceiling(), Duration::from_millis(200));
            assert!(b.next_delay(None) <= Duration::from_millis(200));
        }
        // A hint above max_backoff is honoured.
        assert!(longest > Duration::from_millis(5000), "{longest:?}");
        // A zero hint: at once.
        let mut b = Backoff::with_seed(policy(100, 5000), 3);
        assert_eq!(b.next_delay(Some(Duration::ZERO)), Duration::ZERO);
    }

    #[test]
    fn retry_ms_is_read_from_a_close_reason() {
        let ms = |s: &str| retry_hint(s).map(|d| d.as_millis());
        assert_eq!(
            ms("server draining: reconnect and resume retry_ms=12000"),
            Some(12_000)
        );
        assert_eq!(ms("retry_ms=0"), Some(0));
        assert_eq!(ms("TooManyConnections: full (retry_ms=250)"), Some(250));
        assert_eq!(ms("retry_ms=250, then retry_ms=9"), Some(250));
        assert_eq!(ms("busy retry_ms=1500; more text"), Some(1500));
        // Not a word of its own, no digits, a negative or a decimal point.
        assert_eq!(ms("xretry_ms=5"), None);
        assert_eq!(ms("retry_ms="), None);
        assert_eq!(ms("retry_ms=-5"), None);
        assert_eq!(ms("retry_ms = 5"), None);
        assert_eq!(ms("retry_ms=1.5"), Some(1));
        assert_eq!(ms("server draining"), None);
        assert_eq!(ms(""), None);
        // A bad one first does not hide a good one after it.
        assert_eq!(ms("xretry_ms=5 retry_ms=7"), Some(7));
        // Absurd values are cut to MAX_RETRY_HINT.
        assert_eq!(
            retry_hint("retry_ms=99999999999999999999999"),
            Some(MAX_RETRY_HINT)
        );
        assert_eq!(retry_hint("retry_ms=86400000"), Some(MAX_RETRY_HINT));
        // Carried by a rejection, not by other errors.
        let rejected = ClientError::Rejected {
            code: Some(CloseCode::Draining),
            error: WireError::new(ErrorCode::ShuttingDown, "draining retry_ms=40"),
        };
        assert_eq!(rejected.retry_after(), Some(Duration::from_millis(40)));
        assert_eq!(ClientError::Timeout.retry_after(), None);
    }
}
