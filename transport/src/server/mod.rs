//! The greendot server: QUIC in front of one presence core.
//!
//! Design:
//! - **One owner of the core.** A single *core task* owns the [`Hub`] (the core
//!   plus name interning) and is fed by one mpsc channel. It sleeps until the
//!   next message or `poll_timeout()`, applies the input, then drains every
//!   output. No lock is held across an await anywhere; the core is never shared.
//! - **One task per connection.** It reads the control stream, cuts frames with a
//!   hard size cap and runs [`ConnState::on_frame`] (decode, version, token,
//!   rate limit) itself; steps that need the core travel to the core task with a
//!   oneshot for the answer ([`Hub::apply`]). [`handle_frame`] is those two
//!   halves chained, without a network.
//! - **Pushes.** For each session the core task holds a link: the QUIC
//!   connection and two bounded channels, realtime and batched, each drained by
//!   a writer task into its own server-opened unidirectional stream (realtime
//!   at a higher priority). A full channel means the client does not read: its
//!   connection is closed (`Overloaded`), never the core blocked.
//! - **QUIC is the heartbeat.** Keep-alive and idle timeout are server settings.
//!   While a connection lives its task renews the session's lease in the core
//!   (any frame, and a timer at a third of the shortest heartbeat timeout), so a
//!   hung connection task is reaped by the core's own timeout. When the
//!   connection ends the task reports `Closed`: an application close with the
//!   logout code is a logout, anything else (idle timeout, transport error, a
//!   plain close) a disconnect, and the device lingers for its grace.
//! - **Migration** is on by default; the connection task notices a new remote
//!   address on every frame and timer tick, counts it and reports it as a
//!   [`ServerEvent::Migrated`].
//! - **Bad input** (garbage, oversized frames, unknown versions, bad tokens) gets
//!   an error frame and a close with a specific code on that connection only.
//! - **Time** is Unix milliseconds: the core's `now` is the wall clock at start
//!   plus the monotonic time since (so it never goes backwards while the
//!   process lives), and instants saved by a previous process (last seen)
//!   restore as they are.
//! - **Durability** (optional, [`ServerConfig::store`]): status and
//!   invisibility are committed to the [`store`] before the request is
//!   answered; what else changed (last seen, who is shown online) is written
//!   behind every [`ServerConfig::flush_interval`]. At start every saved user
//!   is restored into the core before the first connection is accepted.
//! - **Draining** ([`Server::drain`]): stop accepting, close every connection
//!   with [`CloseCode::Draining`] (clients reconnect and resume), write the
//!   store, including the devices that were live; the next process brings them
//!   back as lingering so nobody who reconnects within grace is shown offline.

pub mod conn;
pub mod hub;
pub mod metrics;
pub mod store;

pub use conn::{handle_frame, ConnState, Handled, RateLimit, Step};
pub use hub::{Hub, HubLimits, HubOutput, Interner, LiveDevice};
pub use metrics::MetricsSnapshot;

use crate::proto::{
    self, codec::read_frame, codec::ReadError, encode_frame, CloseCode, FrameReader, ServerFrame,
};
use crate::tls::{self, Identity, TlsError};
use crate::token::TokenKeys;
use greendot_core::{Counters, EndReason, Millis, SessionId, Tier, UserId};
use metrics::Histogram;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use store::{Batch, Record, Store, StoreWriter};
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Server settings. `ServerConfig::new(secret)` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The presence core's settings (debounce, grace, caps...).
    pub core: greendot_core::Config,
    /// The HMAC secret tokens are signed with.
    pub token_secret: Vec<u8>,
    /// Clock skew tolerated on a token's `exp`. Default 30 s.
    pub token_leeway: Duration,
    /// The TLS certificate; `None` generates a self-signed one for `localhost`.
    pub identity: Option<Identity>,
    /// QUIC keep-alive. Default 15 s: under the 30 s after which many mobile
    /// NATs forget a UDP mapping.
    pub keep_alive: Duration,
    /// QUIC idle timeout: silence this long means the connection is lost
    /// (Disconnect). Default 45 s: three keep-alives may be lost, and a phone
    /// that dozes for a minute still lingers for its grace before anyone sees it.
    pub idle_timeout: Duration,
    /// Connection migration. Default on.
    pub migration: bool,
    /// Default 100 000.
    pub max_connections: usize,
    /// Cap on a frame's length. Default 64 KiB.
    pub max_frame: usize,
    /// Requests per session. Default 50/s, bursts of 100.
    pub rate: RateLimit,
    /// Time allowed to open the control stream and send the hello. Default 10 s.
    pub hello_timeout: Duration,
    /// How often a live connection renews its lease in the core; `None`: a
    /// third of the shortest heartbeat timeout of the core's config.
    pub lease_renewal: Option<Duration>,
    /// Pushes queued per session and tier before the client counts as stalled.
    /// Default 1024.
    pub push_queue: usize,
    pub limits: HubLimits,
    /// The durable store's file (a redb database); `None`: nothing survives
    /// a restart.
    pub store: Option<PathBuf>,
    /// How often what changed is written behind to the store (last seen, who
    /// is shown online). Default 1 s.
    pub flush_interval: Duration,
}

impl ServerConfig {
    pub fn new(token_secret: impl Into<Vec<u8>>) -> ServerConfig {
        ServerConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 4433)),
            core: greendot_core::Config::default(),
            token_secret: token_secret.into(),
            token_leeway: Duration::from_secs(30),
            identity: None,
            keep_alive: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(45),
            migration: true,
            max_connections: 100_000,
            max_frame: proto::DEFAULT_MAX_FRAME,
            rate: RateLimit::default(),
            hello_timeout: Duration::from_secs(10),
            lease_renewal: None,
            push_queue: 1024,
            limits: HubLimits::default(),
            store: None,
            flush_interval: Duration::from_secs(1),
        }
    }

    fn renewal(&self) -> Duration {
        self.lease_renewal.unwrap_or_else(|| {
            let shortest = self
                .core
                .kinds
                .iter()
                .map(|k| k.heartbeat_timeout.0)
                .min()
                .unwrap_or(3000);
            Duration::from_millis((shortest / 3).max(1))
        })
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Config(#[from] greendot_core::ConfigError),
    #[error("invalid setting: {0}")]
    Setting(String),
    #[error("cannot bind: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] store::StoreError),
}

/// Something that happened on the server, for logs and tests. Sessions are
/// named as their clients know them (the welcome's `session`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerEvent {
    Connected {
        session: SessionId,
        user: String,
        device: String,
        resumed: bool,
        remote: SocketAddr,
    },
    /// The remote address of a live connection changed.
    Migrated {
        session: Option<SessionId>,
        from: SocketAddr,
        to: SocketAddr,
    },
    /// A connection ended; `logout` if by the logout close code.
    Closed {
        session: Option<SessionId>,
        logout: bool,
        reason: String,
    },
    /// A connection was refused or closed for bad input.
    Rejected { remote: SocketAddr, reason: String },
}

/// Transport counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub connections_open: u64,
    pub connections_total: u64,
    pub migrations: u64,
    pub rejected: u64,
    pub overloaded: u64,
}

#[derive(Default)]
struct StatsInner {
    open: AtomicUsize,
    total: AtomicU64,
    migrations: AtomicU64,
    rejected: AtomicU64,
    overloaded: AtomicU64,
    store_errors: AtomicU64,
    rejected_by: Mutex<BTreeMap<String, u64>>,
    latency: Histogram,
}

impl StatsInner {
    fn reject(&self, reason: &str) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let mut by = self.rejected_by.lock().unwrap_or_else(|p| p.into_inner());
        *by.entry(reason.to_owned()).or_default() += 1;
    }
}

/// The metrics label of a rejection.
fn reason_label(error: &proto::WireError) -> String {
    match error.code {
        proto::ErrorCode::Other(n) => format!("code_{n}"),
        code => format!("{code:?}"),
    }
}

/// The driver's clock: Unix milliseconds, read as the wall clock at start plus
/// the monotonic time since, so it never goes backwards while the process
/// lives and saved wall-clock instants (last seen) mean the same after a
/// restart.
#[derive(Clone, Copy, Debug)]
struct Clock {
    start: Instant,
    unix_start_ms: u64,
}

impl Clock {
    fn start() -> Clock {
        let unix_start_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(0))
            .unwrap_or(0);
        Clock {
            start: Instant::now(),
            unix_start_ms,
        }
    }

    fn now(&self) -> Millis {
        let elapsed = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        Millis(self.unix_start_ms.saturating_add(elapsed))
    }

    fn instant(&self, at: Millis) -> Option<Instant> {
        self.start.checked_add(Duration::from_millis(
            at.0.saturating_sub(self.unix_start_ms),
        ))
    }
}

/// A push and when the core task took the change behind it.
type Queued = (Instant, proto::Push);

/// Where the core task sends a session's pushes.
struct Link {
    conn: quinn::Connection,
    realtime: mpsc::Sender<Queued>,
    batched: mpsc::Sender<Queued>,
}

enum CoreMsg {
    /// A step that needs the hub; a hello step carries the connection's link.
    Apply {
        step: Step,
        link: Option<Link>,
        reply: oneshot::Sender<Handled>,
    },
    Activity(SessionId),
    Closed {
        session: SessionId,
        logout: bool,
    },
    Counters(oneshot::Sender<Counters>),
    /// Write everything to the store, with the live devices; answer when on disk.
    Drain(oneshot::Sender<()>),
}

struct Shared {
    config: ServerConfig,
    keys: Arc<TokenKeys>,
    core_tx: mpsc::Sender<CoreMsg>,
    clock: Clock,
    stats: StatsInner,
    events: broadcast::Sender<ServerEvent>,
    /// See [`Hub::with_session_key`]: events name sessions as clients do.
    session_key: u64,
}

impl Shared {
    /// A session as its client knows it.
    fn wire(&self, session: SessionId) -> SessionId {
        SessionId(session.0 ^ self.session_key)
    }

    fn event(&self, event: ServerEvent) {
        let _ = self.events.send(event);
    }
}

/// A running server. Dropping it without [`Server::shutdown`] leaves the tasks
/// running until the runtime stops.
pub struct Server {
    local_addr: SocketAddr,
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    certificate: rustls::pki_types::CertificateDer<'static>,
    stop: Arc<Notify>,
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    /// Binds the UDP socket and starts the core and accept tasks. Must be called
    /// inside a tokio runtime.
    pub fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        if config.token_secret.is_empty() {
            return Err(ServerError::Setting(
                "token_secret must not be empty".into(),
            ));
        }
        if config.max_frame < 64 || config.max_frame > u32::MAX as usize {
            return Err(ServerError::Setting("max_frame must be at least 64".into()));
        }
        if config.push_queue == 0 {
            return Err(ServerError::Setting("push_queue must be at least 1".into()));
        }
        let identity = match &config.identity {
            Some(identity) => identity.clone(),
            None => Identity::self_signed(&["localhost"])?,
        };
        let certificate = identity
            .certs
            .first()
            .cloned()
            .ok_or_else(|| ServerError::Setting("the identity has no certificate".into()))?;

        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(Some(config.keep_alive));
        transport.max_idle_timeout(Some(
            config
                .idle_timeout
                .try_into()
                .map_err(|_| ServerError::Setting("idle_timeout too large".into()))?,
        ));
        // One control stream per connection; pushes come on server-opened streams.
        transport.max_concurrent_bidi_streams(1u32.into());
        transport.max_concurrent_uni_streams(0u32.into());
        let mut server_config =
            quinn::ServerConfig::with_crypto(Arc::new(tls::server_crypto(&identity)?));
        server_config.transport_config(Arc::new(transport));
        server_config.migration(config.migration);

        if config.flush_interval.is_zero() {
            return Err(ServerError::Setting(
                "flush_interval must be more than 0".into(),
            ));
        }
        // The core runs on Unix milliseconds: `last_seen` needs no offset.
        let clock = Clock::start();
        let session_key = random_u64();
        let mut hub = Hub::new(config.core.clone(), config.limits, 0)?
            .with_max_frame(u32::try_from(config.max_frame).unwrap_or(u32::MAX))
            .with_session_key(session_key);
        // Bound first (a taken port fails before the store is touched);
        // connections wait in quinn's queue until the accept task starts.
        let endpoint = quinn::Endpoint::server(server_config, config.listen)?;
        let local_addr = endpoint.local_addr()?;
        // Everything saved is back in the core before the first connection.
        let writer = match &config.store {
            Some(path) => {
                let store = Store::open(path)?;
                restore(&mut hub, &store, clock.now(), &config)?;
                Some(StoreWriter::spawn(store)?)
            }
            None => None,
        };
        let (core_tx, core_rx) = mpsc::channel(4096);
        let (events, _) = broadcast::channel(4096);
        let shared = Arc::new(Shared {
            keys: Arc::new(TokenKeys::new(&config.token_secret, config.token_leeway)),
            config,
            core_tx,
            clock,
            stats: StatsInner::default(),
            events,
            session_key,
        });
        let stop = Arc::new(Notify::new());
        let core_task = tokio::spawn(run_core(hub, core_rx, clock, shared.clone(), writer));
        let accept_task = tokio::spawn(accept_loop(endpoint.clone(), shared.clone(), stop.clone()));
        info!(%local_addr, "greendot server listening");
        Ok(Server {
            local_addr,
            endpoint,
            shared,
            certificate,
            stop,
            tasks: vec![core_task, accept_task],
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The server's certificate (the generated one when none was configured):
    /// clients trust it as a root.
    pub fn certificate(&self) -> &rustls::pki_types::CertificateDer<'static> {
        &self.certificate
    }

    pub fn config(&self) -> &ServerConfig {
        &self.shared.config
    }

    pub fn stats(&self) -> Stats {
        self.monitor().stats()
    }

    /// A cheap handle for reading metrics while the server runs.
    pub fn monitor(&self) -> Monitor {
        Monitor {
            shared: self.shared.clone(),
        }
    }

    /// Events from now on (a lagging receiver loses the oldest).
    pub fn events(&self) -> broadcast::Receiver<ServerEvent> {
        self.shared.events.subscribe()
    }

    /// The core's counters, or `None` once the core task has stopped.
    pub async fn counters(&self) -> Option<Counters> {
        let (tx, rx) = oneshot::channel();
        self.shared.core_tx.send(CoreMsg::Counters(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Mints a token with the server's secret (for tools and tests).
    pub fn mint(&self, claims: &crate::token::Claims) -> Result<String, proto::WireError> {
        self.shared.keys.mint(claims)
    }

    /// A graceful stop, for restarts and deploys: stops accepting, closes
    /// every connection with `CloseCode::Draining` (clients reconnect and try
    /// to resume), then writes the store, including the devices that were
    /// live, which the next process restores as lingering. Waits at most
    /// about `2 s` for connections and `10 s` for the store.
    pub async fn drain(self) {
        self.stop.notify_one();
        self.endpoint.set_server_config(None);
        self.endpoint.close(
            CloseCode::Draining.varint(),
            b"server draining: reconnect and resume",
        );
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        let (tx, rx) = oneshot::channel();
        if self.shared.core_tx.send(CoreMsg::Drain(tx)).await.is_ok()
            && tokio::time::timeout(Duration::from_secs(10), rx)
                .await
                .is_err()
        {
            warn!("the store did not finish writing in time");
        }
        for task in self.tasks {
            task.abort();
        }
        info!("drained");
    }

    /// Closes every connection (`CloseCode::Shutdown`) and stops the tasks,
    /// at once: what was not yet written behind to the store (at most one
    /// flush interval) is lost. [`Server::drain`] is the graceful stop.
    pub async fn shutdown(self) {
        self.stop.notify_one();
        self.endpoint
            .close(CloseCode::Shutdown.varint(), b"server shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        for task in self.tasks {
            task.abort();
        }
    }
}

/// Reads the server's metrics while it runs (see [`Server::monitor`]).
#[derive(Clone)]
pub struct Monitor {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Monitor(..)")
    }
}

impl Monitor {
    pub fn stats(&self) -> Stats {
        let s = &self.shared.stats;
        Stats {
            connections_open: s.open.load(Ordering::Relaxed) as u64,
            connections_total: s.total.load(Ordering::Relaxed),
            migrations: s.migrations.load(Ordering::Relaxed),
            rejected: s.rejected.load(Ordering::Relaxed),
            overloaded: s.overloaded.load(Ordering::Relaxed),
        }
    }

    /// Everything for the metrics page; `None` once the core task stopped.
    pub async fn metrics(&self) -> Option<MetricsSnapshot> {
        let (tx, rx) = oneshot::channel();
        self.shared.core_tx.send(CoreMsg::Counters(tx)).await.ok()?;
        let counters = rx.await.ok()?;
        let s = &self.shared.stats;
        let stats = self.stats();
        let rejected = s
            .rejected_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Some(MetricsSnapshot {
            counters,
            connections_open: stats.connections_open,
            connections_total: stats.connections_total,
            migrations: stats.migrations,
            overloaded: stats.overloaded,
            rejected,
            latency: s.latency.snapshot(),
            store_errors: s.store_errors.load(Ordering::Relaxed),
        })
    }
}

/// 64 random bits (for the session key); falls back to the clock.
fn random_u64() -> u64 {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 8];
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_ok() {
        return u64::from_le_bytes(bytes);
    }
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x9e37_79b9_7f4a_7c15)
}

/// Restores everything saved into a fresh hub, and marks the store in use.
/// A store that cannot be read stops the start: starting without it could
/// show an invisible user online.
fn restore(
    hub: &mut Hub,
    store: &Store,
    now: Millis,
    config: &ServerConfig,
) -> Result<(), ServerError> {
    let loaded = store.load_and_begin(now.0)?;
    let mut restored = 0usize;
    for (name, record) in &loaded.users {
        let saved = record.to_saved(loaded.alive_at);
        match hub.restore(name, saved.clone()) {
            Ok(_) => restored += 1,
            Err(e) => {
                // A message over a lowered cap: keep the rest.
                let without = greendot_core::Saved {
                    message: None,
                    ..saved
                };
                hub.restore(name, without).map_err(|e2| {
                    ServerError::Setting(format!(
                        "cannot restore the saved state of {name:?}: {e}; {e2}"
                    ))
                })?;
                restored += 1;
            }
        }
    }
    // Devices live at a drained shutdown come back as lost connections, as of
    // just over one debounce ago, so that those shown online are published
    // online again before anyone subscribes.
    let back = Millis(
        now.0
            .saturating_sub(config.core.debounce.0.saturating_add(1)),
    );
    let mut lingering = 0usize;
    for d in &loaded.drained {
        match hub.restore_device(back, &d.user, &d.device, d.kind) {
            Ok(()) => lingering += 1,
            Err(e) => {
                warn!(user = %d.user, device = %d.device, error = %e, "cannot restore a device")
            }
        }
    }
    hub.handle_timeout(now);
    while hub.poll_output().is_some() {}
    hub.take_touched();
    info!(
        users = restored,
        lingering,
        clean = loaded.clean,
        "restored the saved state"
    );
    Ok(())
}

/// The record to write for `user`, by name.
fn record(hub: &Hub, user: UserId) -> Option<(String, Record)> {
    let name = hub.user_name(user)?.to_owned();
    let (saved, shown_online) = hub.saved(user);
    Some((name, Record::new(&saved, shown_online)))
}

async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<Shared>, stop: Arc<Notify>) {
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            _ = stop.notified() => break,
        };
        let Some(incoming) = incoming else { break };
        tokio::spawn(serve_connection(incoming, shared.clone()));
    }
}

enum Wake {
    Msg(CoreMsg),
    Timer,
    Flush,
}

/// Whether a step changes what must be on disk before it is answered.
fn durable_user(hub: &Hub, step: &Step) -> Option<UserId> {
    match step {
        Step::Request {
            session,
            request: proto::Request::SetStatus { .. } | proto::Request::SetInvisible { .. },
            ..
        } => hub.session_user(*session),
        _ => None,
    }
}

/// The core task: the only owner of the hub.
async fn run_core(
    mut hub: Hub,
    mut rx: mpsc::Receiver<CoreMsg>,
    clock: Clock,
    shared: Arc<Shared>,
    store: Option<StoreWriter>,
) {
    let mut links: HashMap<SessionId, Link> = HashMap::new();
    let mut dirty: HashSet<UserId> = HashSet::new();
    let mut flush = tokio::time::interval(shared.config.flush_interval);
    flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let deadline = hub.poll_timeout().and_then(|at| clock.instant(at));
        let wake = tokio::select! {
            msg = rx.recv() => match msg {
                Some(msg) => Wake::Msg(msg),
                None => break,
            },
            _ = sleep_until(deadline), if deadline.is_some() => Wake::Timer,
            _ = flush.tick(), if store.is_some() => Wake::Flush,
        };
        let taken = Instant::now();
        let now = clock.now();
        match wake {
            Wake::Timer => hub.handle_timeout(now),
            Wake::Flush => {
                if let Some(store) = &store {
                    let users = dirty.drain().filter_map(|u| record(&hub, u)).collect();
                    store.write_behind(Batch {
                        users,
                        alive_at: Some(now.0),
                        drained: None,
                    });
                }
            }
            Wake::Msg(CoreMsg::Drain(reply)) => {
                dirty.extend(hub.take_touched());
                match &store {
                    Some(store) => {
                        let users = dirty.drain().filter_map(|u| record(&hub, u)).collect();
                        let done = store.write_durable(Batch {
                            users,
                            alive_at: Some(now.0),
                            drained: Some(hub.live_devices()),
                        });
                        let shared = shared.clone();
                        tokio::spawn(async move {
                            if !matches!(done.await, Ok(Ok(()))) {
                                shared.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                            }
                            let _ = reply.send(());
                        });
                    }
                    None => {
                        let _ = reply.send(());
                    }
                }
            }
            Wake::Msg(CoreMsg::Apply { step, link, reply }) => {
                let durable = durable_user(&hub, &step);
                let handled = hub.apply(now, step);
                if let (Some(session), Some(link)) = (handled.welcomed, link) {
                    links.insert(session, link);
                }
                let answered_ok = matches!(
                    &handled.reply,
                    Some(ServerFrame::Reply { result: Ok(_), .. })
                );
                let pending = durable
                    .filter(|_| answered_ok)
                    .and_then(|user| Some((store.as_ref()?, record(&hub, user)?)));
                match pending {
                    // On disk before it is acknowledged.
                    Some((store, user)) => {
                        let done = store.write_durable(Batch {
                            users: vec![user],
                            alive_at: None,
                            drained: None,
                        });
                        let shared = shared.clone();
                        tokio::spawn(async move {
                            let handled = match done.await {
                                Ok(Ok(())) => handled,
                                _ => {
                                    shared.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                                    not_saved(handled)
                                }
                            };
                            let _ = reply.send(handled);
                        });
                    }
                    None => {
                        let _ = reply.send(handled);
                    }
                }
            }
            Wake::Msg(CoreMsg::Activity(session)) => hub.activity(now, session),
            Wake::Msg(CoreMsg::Closed { session, logout }) => {
                links.remove(&session);
                hub.closed(now, session, logout);
            }
            Wake::Msg(CoreMsg::Counters(reply)) => {
                let _ = reply.send(hub.core().counters().clone());
            }
        }
        while let Some(output) = hub.poll_output() {
            match output {
                HubOutput::Push {
                    session,
                    tier,
                    push,
                } => {
                    let Some(link) = links.get(&session) else {
                        continue;
                    };
                    let queue = match tier {
                        Tier::Realtime => &link.realtime,
                        Tier::Batched => &link.batched,
                    };
                    if queue.try_send((taken, push)).is_err() {
                        warn!(%session, "push queue full: closing the stalled connection");
                        shared.stats.overloaded.fetch_add(1, Ordering::Relaxed);
                        link.conn
                            .close(CloseCode::Overloaded.varint(), b"pushes not read in time");
                        links.remove(&session);
                    }
                }
                HubOutput::End { session, reason } => {
                    let Some(link) = links.remove(&session) else {
                        continue;
                    };
                    let (code, text): (CloseCode, &[u8]) = match reason {
                        EndReason::Superseded => {
                            (CloseCode::Superseded, b"the device connected again")
                        }
                        EndReason::HeartbeatTimeout => {
                            (CloseCode::SessionExpired, b"no sign of life in time")
                        }
                        EndReason::GraceExpired => {
                            (CloseCode::SessionExpired, b"not back within grace")
                        }
                        // The connection's own task answers the logout, then closes.
                        EndReason::LoggedOut => continue,
                    };
                    link.conn.close(code.varint(), text);
                }
            }
        }
        if store.is_some() {
            dirty.extend(hub.take_touched());
        } else {
            hub.take_touched();
        }
    }
}

/// The answer to a request whose change could not be saved.
fn not_saved(handled: Handled) -> Handled {
    match handled.reply {
        Some(ServerFrame::Reply { id, .. }) => Handled {
            reply: Some(ServerFrame::Reply {
                id,
                result: Err(proto::WireError::new(
                    proto::ErrorCode::Internal,
                    "the change is in effect but could not be saved",
                )),
            }),
            ..handled
        },
        _ => handled,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Decrements the open-connection count when a connection task ends.
struct Admission<'a>(&'a StatsInner);

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

fn reason_text(error: &proto::WireError) -> Vec<u8> {
    let mut text = format!("{:?}: {}", error.code, error.message).into_bytes();
    text.truncate(400);
    text
}

/// Writes `frame` and, if asked, closes after giving the peer a moment to
/// receive it.
async fn answer(
    conn: &quinn::Connection,
    send: &mut quinn::SendStream,
    handled: &Handled,
) -> Result<(), ()> {
    if let Some(frame) = &handled.reply {
        let bytes = encode_frame(frame).map_err(|_| ())?;
        send.write_all(&bytes).await.map_err(|_| ())?;
    }
    if let Some(code) = handled.close {
        let text = match &handled.reply {
            Some(ServerFrame::Error(e)) => reason_text(e),
            _ => format!("{code:?}").into_bytes(),
        };
        let _ = send.finish();
        // Let the frame reach the peer (or the peer close first), then close.
        let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
        conn.close(code.varint(), &text);
        return Err(());
    }
    Ok(())
}

async fn serve_connection(incoming: quinn::Incoming, shared: Arc<Shared>) {
    let remote = incoming.remote_address();
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(e) => {
            debug!(%remote, error = %e, "handshake failed");
            shared.stats.reject("handshake");
            shared.event(ServerEvent::Rejected {
                remote,
                reason: format!("handshake failed: {e}"),
            });
            return;
        }
    };
    let open = shared.stats.open.fetch_add(1, Ordering::Relaxed);
    let _admission = Admission(&shared.stats);
    shared.stats.total.fetch_add(1, Ordering::Relaxed);
    if open >= shared.config.max_connections {
        shared.stats.reject("TooManyConnections");
        conn.close(
            CloseCode::TooManyConnections.varint(),
            b"TooManyConnections: the server is at its connection cap",
        );
        return;
    }
    let session = run_connection(&conn, &shared).await;
    // Whatever ended the loop, wait for the connection itself to end.
    let error = conn.closed().await;
    let logout = matches!(
        &error,
        quinn::ConnectionError::ApplicationClosed(close)
            if close.error_code == CloseCode::Logout.varint()
    );
    if let Some(session) = session {
        let _ = shared
            .core_tx
            .send(CoreMsg::Closed { session, logout })
            .await;
    }
    shared.event(ServerEvent::Closed {
        session: session.map(|s| shared.wire(s)),
        logout,
        reason: error.to_string(),
    });
}

/// Sends a step to the core task and waits for its answer.
async fn to_core(shared: &Shared, step: Step, link: Option<Link>) -> Handled {
    let (tx, rx) = oneshot::channel();
    let msg = CoreMsg::Apply {
        step,
        link,
        reply: tx,
    };
    if shared.core_tx.send(msg).await.is_err() {
        return Handled::close(proto::WireError::new(
            proto::ErrorCode::ShuttingDown,
            "server shutting down",
        ));
    }
    rx.await.unwrap_or_else(|_| {
        Handled::close(proto::WireError::new(
            proto::ErrorCode::ShuttingDown,
            "server shutting down",
        ))
    })
}

/// The life of one connection until it closes or is condemned; returns the
/// session it had.
async fn run_connection(conn: &quinn::Connection, shared: &Arc<Shared>) -> Option<SessionId> {
    let config = &shared.config;
    let remote = conn.remote_address();
    let hello_deadline = Instant::now() + config.hello_timeout;
    let (mut send, mut recv) = match tokio::time::timeout_at(hello_deadline, conn.accept_bi()).await
    {
        Ok(Ok(streams)) => streams,
        Ok(Err(_)) => return None,
        Err(_) => {
            conn.close(CloseCode::HelloTimeout.varint(), b"no hello in time");
            return None;
        }
    };
    let mut reader = FrameReader::new(config.max_frame);
    let mut state = ConnState::new(shared.keys.clone(), config.rate);

    // The hello.
    let step =
        match tokio::time::timeout_at(hello_deadline, read_frame(&mut recv, &mut reader)).await {
            Err(_) => {
                conn.close(CloseCode::HelloTimeout.varint(), b"no hello in time");
                return None;
            }
            Ok(Ok(Some(payload))) => state.on_frame(shared.clock.now(), &payload),
            Ok(Ok(None)) | Ok(Err(ReadError::Stream(_))) => return None,
            Ok(Err(ReadError::Frame(e))) => state.on_frame_error(e),
        };
    let (realtime_tx, realtime_rx) = mpsc::channel(config.push_queue);
    let (batched_tx, batched_rx) = mpsc::channel(config.push_queue);
    let handled = if step.needs_hub() {
        let link = Link {
            conn: conn.clone(),
            realtime: realtime_tx,
            batched: batched_tx,
        };
        to_core(shared, step, Some(link)).await
    } else {
        Handled::default().merge_local(step)
    };
    if let Some(ServerFrame::Error(e)) = &handled.reply {
        shared.stats.reject(&reason_label(e));
        shared.event(ServerEvent::Rejected {
            remote,
            reason: e.to_string(),
        });
    }
    let session = handled.welcomed;
    if let Some(s) = session {
        state.on_welcome(s);
        if let Some(ServerFrame::Welcome(w)) = &handled.reply {
            shared.event(ServerEvent::Connected {
                session: shared.wire(s),
                user: w.user.clone(),
                device: w.device.clone(),
                resumed: w.resumed,
                remote,
            });
        }
    }
    if answer(conn, &mut send, &handled).await.is_err() {
        return session;
    }
    let session = session?;

    // The push streams.
    for (tier, rx, priority) in [
        (proto::Tier::Realtime, realtime_rx, 1),
        (proto::Tier::Batched, batched_rx, 0),
    ] {
        match conn.open_uni().await {
            Ok(stream) => {
                let _ = stream.set_priority(priority);
                tokio::spawn(write_pushes(stream, tier, rx, shared.clone()));
            }
            Err(_) => return Some(session),
        }
    }

    let mut renew = tokio::time::interval(config.renewal());
    renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Migrations show on every frame; this catches moves between frames.
    let mut poll_address = tokio::time::interval(config.renewal().min(Duration::from_secs(1)));
    poll_address.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut address = remote;
    let check_address = |address: &mut SocketAddr| {
        let now = conn.remote_address();
        if now != *address {
            shared.stats.migrations.fetch_add(1, Ordering::Relaxed);
            debug!(%session, from = %address, to = %now, "migrated");
            shared.event(ServerEvent::Migrated {
                session: Some(shared.wire(session)),
                from: *address,
                to: now,
            });
            *address = now;
        }
    };
    loop {
        let step = tokio::select! {
            frame = read_frame(&mut recv, &mut reader) => match frame {
                Ok(Some(payload)) => state.on_frame(shared.clock.now(), &payload),
                // The client finished its control stream: nothing more to read.
                Ok(None) => {
                    let _ = conn.closed().await;
                    return Some(session);
                }
                Err(ReadError::Stream(_)) => return Some(session),
                Err(ReadError::Frame(e)) => state.on_frame_error(e),
            },
            _ = renew.tick() => {
                check_address(&mut address);
                let _ = shared.core_tx.send(CoreMsg::Activity(session)).await;
                continue;
            }
            _ = poll_address.tick() => {
                check_address(&mut address);
                continue;
            }
            _ = conn.closed() => return Some(session),
        };
        check_address(&mut address);
        let handled = if step.needs_hub() {
            to_core(shared, step, None).await
        } else {
            if let Step::Close(e) = &step {
                shared.stats.reject(&reason_label(e));
                shared.event(ServerEvent::Rejected {
                    remote: address,
                    reason: e.to_string(),
                });
            } else {
                // Answered locally (rate limited): still a sign of life.
                let _ = shared.core_tx.send(CoreMsg::Activity(session)).await;
            }
            Handled::default().merge_local(step)
        };
        if answer(conn, &mut send, &handled).await.is_err() {
            return Some(session);
        }
    }
}

impl Handled {
    /// The outcome of a step that does not need the hub.
    fn merge_local(self, step: Step) -> Handled {
        match step {
            Step::Reply(frame) => Handled {
                reply: Some(frame),
                ..self
            },
            Step::Close(error) => Handled::close(error),
            _ => self,
        }
    }
}

/// Drains one tier's pushes into its stream.
async fn write_pushes(
    mut stream: quinn::SendStream,
    tier: proto::Tier,
    mut rx: mpsc::Receiver<Queued>,
    shared: Arc<Shared>,
) {
    let Ok(header) = encode_frame(&proto::Push::Stream { tier }) else {
        return;
    };
    if stream.write_all(&header).await.is_err() {
        return;
    }
    let mut taken = Vec::new();
    while let Some((at, push)) = rx.recv().await {
        let mut bytes = match encode_frame(&push) {
            Ok(b) => b,
            Err(_) => continue,
        };
        taken.clear();
        taken.push(at);
        // Write whatever else is already queued in the same call.
        while bytes.len() <= 32 * 1024 {
            let Ok((at, more)) = rx.try_recv() else { break };
            if let Ok(b) = encode_frame(&more) {
                bytes.extend_from_slice(&b);
                taken.push(at);
            }
        }
        if stream.write_all(&bytes).await.is_err() {
            return;
        }
        for at in &taken {
            shared.stats.latency.observe(at.elapsed());
        }
    }
    let _ = stream.finish();
}
