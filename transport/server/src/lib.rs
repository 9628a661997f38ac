//! The greendot server: QUIC in front of one presence core.
//!
//! Design:
//! - **A sans-IO state machine in one task.** [`ServerState`] (in `state`)
//!   is the whole server without IO: quinn-proto's endpoint with every
//!   connection, the [`Hub`] (the core plus name interning), the timers,
//!   shedding, push queues and leases; datagrams, time and control inputs go
//!   in, transmits, store writes and events come out, and a seed drives all
//!   its randomness, so a simulator runs it on virtual time. A single task
//!   (`driver`) owns the UDP socket, the timer and the control channel around
//!   it, and hands store writes to the store's thread; see `driver` for why
//!   one task. It sleeps until a datagram, a control message or the state's
//!   next deadline, then reads the socket, lets the state work, and sends.
//!   Nothing is shared with another task but counters and the event channel.
//! - **Sessions do not know QUIC.** A connection's session layer (`session`:
//!   its `Phase`, frames, answers, push queues, closing) talks to its
//!   transport through a small binding trait; QUIC (`quic`) is the one
//!   binding today.
//! - **A connection** is the client's control stream, cut into frames with a
//!   hard size cap, run through [`ConnState::on_frame`] (decode, version,
//!   token, rate limit) and [`Hub::apply`], answered on the same stream in
//!   order. [`handle_frame`] is those two halves chained, without a network.
//! - **Pushes.** At the welcome the server opens two unidirectional streams,
//!   realtime (higher priority) and batched, and writes each push into its
//!   stream as the core emits it, each update encoded once and its bytes
//!   shared by every subscriber. Pushes a stream cannot take yet (QUIC flow
//!   control) wait in a queue of at most [`ServerConfig::push_queue_bytes`]
//!   bytes per connection (each queued push also counts its bookkeeping); a full
//!   queue means the client does not read: its connection is closed
//!   (`Overloaded`), never the core blocked. Past
//!   [`ServerConfig::push_budget_bytes`] queued in the whole server, the
//!   connections with the largest queues are closed the same way.
//! - **QUIC is the heartbeat.** Keep-alive and idle timeout are server settings.
//!   While a connection lives its session's lease is renewed in the core (on
//!   any frame, and for every connection at a third of the shortest heartbeat
//!   timeout). When the connection ends the session is told: an application
//!   close with the logout code is a logout, anything else (idle timeout,
//!   transport error, a plain close) a disconnect, and the device lingers for
//!   its grace.
//! - **Migration** is on by default; a new remote address is noticed after
//!   the datagram that shows it, counted and reported as a
//!   [`ServerEvent::Migrated`].
//! - **Bad input** (garbage, oversized frames, unknown versions, bad tokens) gets
//!   an error frame and a close with a specific code on that connection only.
//! - **Time** is Unix milliseconds: the core's `now` is the wall clock at start
//!   plus the monotonic time since (so it never goes backwards while the
//!   process lives), and instants saved by a previous process (last seen)
//!   restore as they are.
//! - **Durability** (optional, [`ServerConfig::store`]): status and
//!   invisibility are committed to the [`store`] before the request is
//!   answered (the connection's later frames wait behind it; the rest of the
//!   server does not); what else changed (last seen, who is shown online) is
//!   written behind every [`ServerConfig::flush_interval`]. At start every
//!   saved user is restored into the core before the first connection is
//!   accepted (the file is opened and read off the runtime's worker).
//!   A commit that fails, or does not finish within
//!   [`ServerConfig::store_timeout`], is **not rolled back**: the change is
//!   in effect (watchers see it) and the request is answered `Internal`,
//!   "the change is in effect but could not be saved"; the change stays
//!   pending and is written with the next flush that succeeds (a failed
//!   batch keeps its users). The writer's queue is bounded
//!   ([`store::DURABLE_QUEUE`] durable requests; write-behind batches merge
//!   into one per user).
//! - **Overload.** Each pass of the loop reads the socket first and is
//!   bounded ([`PassBudget`]); new handshakes are shed early and cheaply
//!   when the server is past what it can take ([`Shed`]: a QUIC Retry for
//!   unvalidated clients past [`ServerConfig::retry_threshold`], a limit per
//!   address, an admission rate that follows the loop's load
//!   ([`ServerInput::Load`]), the connection cap), so established
//!   sessions keep being served; keep-alives are jittered per connection.
//! - **Draining** ([`Server::drain`]): stop accepting, close every connection
//!   with [`CloseCode::Draining`] (clients reconnect and resume), write the
//!   store, including the devices that were live; the next process brings them
//!   back as lingering so nobody who reconnects within grace is shown offline.
//!   The close's reason carries `retry_ms=N`, the time to readmit everyone
//!   at the admission rate: clients spread their reconnect over [0, N] ms,
//!   and restored devices linger for their grace plus that time.

pub mod cluster;
mod config;
mod conn;
mod driver;
pub mod http;
mod hub;
mod interner;
pub mod metrics;
mod quic;
mod session;
mod state;
mod store;
pub mod tls;
pub mod token;
mod tokens;
mod udp;
mod webtransport;
mod ws;
mod ws_gate;
mod ws_io;

pub use config::{PassBudget, ServerConfig};
use conn::{Handled, Step};
pub use conn::{RateLimit, RATE_LIMIT_PATIENCE};
use hub::Hub;
pub use hub::HubLimits;
pub use hub::{GroupFeed, GroupWrite, LiveDevice, RestoreError, StoredGroup};
pub use metrics::MetricsSnapshot;
pub use state::{
    Census, Datagram, ServerInput, ServerMutant, ServerOutput, ServerState, StoreRequest, Transmit,
    LOAD_REPORT_EVERY,
};
pub use store::{Batch, Loaded, Record, StoreError};
pub use tls::{Identity, TlsError};
pub use tokens::Revocation;
pub use ws::{WsId, WsMessage};
pub use ws_gate::WsShed;

/// Internals for this workspace's tests, benches and fuzz targets (a session
/// without a network, the store with injected faults); not a stable API.
#[doc(hidden)]
pub mod testing {
    pub use crate::conn::{handle_frame, ConnState, Handled, Step};
    pub use crate::hub::{Hub, HubOutput, Interner, LiveDevice};
    pub use crate::store::{Record, Store, StoreFaults};

    /// Asks for `bytes` of socket buffers each way (as the server does for
    /// its own socket), warning when the kernel caps them.
    pub fn socket_buffers(socket: &std::net::UdpSocket, bytes: usize) {
        crate::socket_buffers(socket, bytes)
    }
}

use crate::token::TokenKeys;
use driver::Control;
use greendot_core::{Counters, SessionId, UserId};
use greendot_proto::{self as proto, CloseCode, ServerFrame};
use metrics::Histogram;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use store::{Store, StoreWriter};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Config(#[from] greendot_core::ConfigError),
    #[error("invalid setting: {0}")]
    Setting(#[from] SettingError),
    /// What the store held of a user could not be restored.
    #[error("cannot restore the saved state of {user:?}")]
    Restore {
        user: String,
        #[source]
        source: RestoreError,
    },
    #[error("cannot bind: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] store::StoreError),
}

/// A setting the server cannot run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SettingError {
    #[error("token_secret must not be empty")]
    EmptyTokenSecret,
    #[error("max_frame must be 64 to 2^32 - 1 bytes")]
    MaxFrame,
    #[error("max_hello must be at least 256 bytes and max_websocket_pending at least 1")]
    HelloLimits,
    #[error("push_queue_bytes and push_budget_bytes must be at least 1")]
    PushBytes,
    #[error("max_handshakes_per_sec and max_handshakes_per_address must be at least 1")]
    HandshakeLimits,
    #[error("every part of the pass budget must be at least 1")]
    PassBudget,
    #[error("flush_interval must be more than 0")]
    FlushInterval,
    #[error("idle_timeout too large")]
    IdleTimeout,
    #[error("the identity has no certificate")]
    NoCertificate,
    #[error("max_udp_payload must be 1200 to 65527")]
    MaxUdpPayload,
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
    /// Open connections, every binding.
    pub connections_open: u64,
    /// Of them, WebSocket connections.
    pub connections_open_websocket: u64,
    /// Of them, WebTransport sessions (QUIC connections with ALPN h3).
    pub connections_open_webtransport: u64,
    pub connections_total: u64,
    pub migrations: u64,
    pub rejected: u64,
    pub overloaded: u64,
}

#[derive(Default)]
struct StatsInner {
    open: AtomicUsize,
    /// Of `open`, WebSocket connections.
    open_websocket: AtomicUsize,
    /// Of `open`, WebTransport sessions.
    open_webtransport: AtomicUsize,
    total: AtomicU64,
    migrations: AtomicU64,
    rejected: AtomicU64,
    overloaded: AtomicU64,
    store_errors: AtomicU64,
    /// New connections shed, by [`Shed`] reason.
    shed: [AtomicU64; Shed::ALL.len()],
    /// Handshakes the client gave up (or lost) before they completed.
    handshakes_aborted: AtomicU64,
    /// Handshakes in flight now.
    handshaking: AtomicUsize,
    /// The admission rate now (handshakes per second), and how often the
    /// loop's load cut it.
    admission_rate: AtomicU64,
    admission_cuts: AtomicU64,
    /// The loop's busy share in the last load report, in thousandths.
    loop_busy_permille: AtomicU64,
    rejected_by: Mutex<BTreeMap<String, u64>>,
    latency: Histogram,
    /// Durations of the loop's passes, and how many left work to the next.
    loop_pass: Histogram,
    loop_carried: AtomicU64,
    /// Set when a drain or shutdown begins (see [`Monitor::accepting`]).
    stopping: AtomicBool,
    /// Outputs for the cluster's NATS I/O dropped at a full queue.
    cluster_dropped: AtomicU64,
    /// From an owner's publish of a view to this edge's fanout taking it.
    cluster_latency: Histogram,
    /// The WebSocket door before the hello.
    websocket: ws_gate::WsGateStats,
}

impl StatsInner {
    fn snapshot(&self) -> Stats {
        Stats {
            connections_open: self.open.load(Ordering::Relaxed) as u64,
            connections_open_websocket: self.open_websocket.load(Ordering::Relaxed) as u64,
            connections_open_webtransport: self.open_webtransport.load(Ordering::Relaxed) as u64,
            connections_total: self.total.load(Ordering::Relaxed),
            migrations: self.migrations.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            overloaded: self.overloaded.load(Ordering::Relaxed),
        }
    }

    fn reject(&self, reason: &str) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let mut by = self.rejected_by.lock().unwrap_or_else(|p| p.into_inner());
        *by.entry(reason.to_owned()).or_default() += 1;
    }
}

/// Whether a failed handshake was merely cut short (the client's network
/// went away, it gave up, the server was stopping) rather than refused for
/// bad input (a TLS alert, a wrong ALPN, a QUIC protocol violation): the
/// first is counted in `greendot_handshakes_aborted_total`, the second in
/// `greendot_rejected_total{reason="handshake"}`.
pub(crate) fn handshake_aborted(error: &quinn_proto::ConnectionError) -> bool {
    use quinn_proto::{ConnectionError as E, TransportErrorCode};
    match error {
        E::TimedOut | E::Reset | E::LocallyClosed | E::CidsExhausted | E::ApplicationClosed(_) => {
            true
        }
        // The peer's stack gave up without an error of its own, or its
        // application did (an application close before the handshake is
        // done travels as APPLICATION_ERROR: quinn sends it when a connect
        // times out and its `Connecting` is dropped).
        E::ConnectionClosed(close) => {
            close.error_code == TransportErrorCode::NO_ERROR
                || close.error_code == TransportErrorCode::APPLICATION_ERROR
        }
        E::TransportError(_) | E::VersionMismatch => false,
    }
}

/// Why a new connection was shed rather than served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shed {
    /// Sent a QUIC Retry: too many unvalidated handshakes in flight.
    Retry,
    /// Refused: too many handshakes in flight from its address.
    PerAddress,
    /// Refused: the connection cap (with its handshake headroom) is reached.
    Capacity,
    /// Refused: over the admission rate.
    Rate,
    /// Closed: no hello within `hello_timeout` of its first packet.
    HandshakeTimeout,
    /// Refused: the server is draining.
    Draining,
    /// Dropped without an answer: past `2 × max_handshakes_per_sec` answers
    /// of shedding per second (a Retry or a refusal costs a packet and
    /// crypto, and a Retry brings the Initial straight back; silence lets
    /// the client's own retransmission timer back off).
    Ignored,
}

impl Shed {
    pub const ALL: [Shed; 7] = [
        Shed::Retry,
        Shed::PerAddress,
        Shed::Capacity,
        Shed::Rate,
        Shed::HandshakeTimeout,
        Shed::Draining,
        Shed::Ignored,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Shed::Retry => "retry",
            Shed::PerAddress => "per_address",
            Shed::Capacity => "capacity",
            Shed::Rate => "rate",
            Shed::HandshakeTimeout => "handshake_timeout",
            Shed::Draining => "draining",
            Shed::Ignored => "ignored",
        }
    }
}

impl StatsInner {
    fn shed(&self, reason: Shed) {
        self.shed[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// New connections shed so far, for every reason.
    fn shed_total(&self) -> u64 {
        self.shed.iter().map(|n| n.load(Ordering::Relaxed)).sum()
    }
}

/// The metrics label of a rejection.
fn reason_label(error: &proto::WireError) -> String {
    match error.code {
        proto::ErrorCode::Other(n) => format!("code_{n}"),
        code => format!("{code:?}"),
    }
}

/// QUIC transport settings of a connection, with this keep-alive interval.
fn transport_config(
    config: &ServerConfig,
    keep_alive: Duration,
) -> Result<quinn::TransportConfig, ServerError> {
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(Some(keep_alive));
    transport.max_idle_timeout(Some(
        config
            .idle_timeout
            .try_into()
            .map_err(|_| SettingError::IdleTimeout)?,
    ));
    // One control stream per connection; pushes come on server-opened
    // streams. WebTransport (ALPN h3) needs one more bidirectional stream
    // (its CONNECT) and the client's three HTTP/3 unidirectional streams;
    // browsers expect that room from the start, so it is granted to all and
    // withdrawn from raw QUIC connections at the handshake (quic.rs).
    transport.max_concurrent_bidi_streams(2u32.into());
    transport.max_concurrent_uni_streams(3u32.into());
    // What a peer may make the server buffer, either way: a few frames,
    // not quinn's megabytes (a presence connection never needs more, and
    // 100,000 connections each at quinn's default would not fit).
    let window = u32::try_from(config.max_frame.saturating_mul(4)).unwrap_or(u32::MAX);
    transport.stream_receive_window(window.into());
    transport.receive_window(window.into());
    transport.send_window(u64::from(window));
    // WebTransport requires HTTP datagrams, hence QUIC datagrams, to be
    // on; none is used: each is dropped as it arrives (quic.rs).
    transport.datagram_receive_buffer_size(Some(DATAGRAM_BUFFER));
    Ok(transport)
}

/// The most datagram bytes quinn holds for a connection before the link
/// drops them: about one datagram.
const DATAGRAM_BUFFER: usize = 1500;

/// Keep-alive intervals a connection may get, evenly spaced over
/// [0.75, 1] × [`ServerConfig::keep_alive`] (15 s: steps of 121 ms).
const KEEP_ALIVE_STEPS: usize = 32;

/// The wall clock, in Unix milliseconds.
fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(0))
        .unwrap_or(0)
}

struct Shared {
    config: ServerConfig,
    keys: Arc<TokenKeys>,
    control: mpsc::Sender<Control>,
    /// The state's counters, shared with the monitor.
    stats: Arc<StatsInner>,
    events: broadcast::Sender<ServerEvent>,
    /// The UDP socket's inode, to find it in `/proc/net/udp`.
    socket_inode: Option<u64>,
}

/// Outputs for the cluster's NATS I/O queued at most; past it they are
/// dropped and counted (edges retry what they wait for).
const CLUSTER_QUEUE: usize = 65_536;

/// Hands the server what the cluster's NATS I/O received.
#[derive(Clone)]
pub struct ClusterInputs {
    control: mpsc::Sender<Control>,
}

impl ClusterInputs {
    /// `false` once the server has stopped.
    pub async fn send(&self, input: cluster::ClusterInput) -> bool {
        self.control.send(Control::Cluster(input)).await.is_ok()
    }
}

/// A running server. Dropping it without [`Server::shutdown`] leaves its task
/// (and the store's writer thread) running until the runtime stops.
pub struct Server {
    local_addr: SocketAddr,
    websocket_addr: Option<SocketAddr>,
    /// What the state asks of the cluster's NATS I/O, until taken.
    cluster: Mutex<Option<mpsc::Receiver<cluster::ClusterOutput>>>,
    shared: Arc<Shared>,
    certificate: rustls::pki_types::CertificateDer<'static>,
    task: JoinHandle<()>,
}

/// A server built but not running: [`Server::bind`] spawns its driver; tests
/// run the driver's passes by hand.
struct Built {
    local_addr: SocketAddr,
    websocket_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    certificate: rustls::pki_types::CertificateDer<'static>,
    driver: driver::Driver,
    control: mpsc::Receiver<Control>,
    cluster: Option<mpsc::Receiver<cluster::ClusterOutput>>,
}

impl Server {
    /// Binds the UDP socket, restores the store if any, and starts the
    /// server's one task (see `driver`). Must be called inside a tokio
    /// runtime.
    pub fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let built = Server::build(config)?;
        let task = tokio::spawn(built.driver.run(built.control));
        info!(local_addr = %built.local_addr, "greendot server listening");
        Ok(Server {
            local_addr: built.local_addr,
            websocket_addr: built.websocket_addr,
            cluster: Mutex::new(built.cluster),
            shared: built.shared,
            certificate: built.certificate,
            task,
        })
    }

    /// Everything [`Server::bind`] makes, the driver not yet running (tests
    /// run its passes by hand). Must be called inside a tokio runtime.
    fn build(mut config: ServerConfig) -> Result<Built, ServerError> {
        if config.cluster_of_one && config.cluster.is_none() {
            config.cluster = Some(cluster::local::settings(unix_now_ms()));
        } else {
            config.cluster_of_one = false;
        }
        config::validate(&config)?;
        // Bound first (a taken port fails before the store is touched).
        let socket = std::net::UdpSocket::bind(config.listen)?;
        socket.set_nonblocking(true)?;
        socket_buffers(&socket, config.socket_buffer);
        let socket_inode = socket_inode(&socket);
        let io = udp::Io::new(socket)?;
        let local_addr = io.socket.local_addr()?;
        let tcp = match config.websocket {
            Some(addr) => {
                let tcp = std::net::TcpListener::bind(addr)?;
                tcp.set_nonblocking(true)?;
                Some(tcp)
            }
            None => None,
        };
        let now = std::time::Instant::now();
        let unix_ms = unix_now_ms();
        let seed = random_u64();
        // Everything saved is back in the core before the first connection.
        // Disk work (and restoring many users): off the runtime's worker
        // (the runtime moves its other tasks elsewhere meanwhile).
        let start = || -> Result<(ServerState, Option<StoreWriter>), ServerError> {
            let (loaded, store) = match &config.store {
                Some(path) => {
                    let store = Store::open(path)?;
                    (Some(store.load_and_begin(unix_ms)?), Some(store))
                }
                None => (None, None),
            };
            let state = ServerState::new(config.clone(), now, unix_ms, seed, loaded)?;
            let writer = match store {
                Some(store) => Some(StoreWriter::spawn_with_faults(
                    store,
                    config.store_faults.clone(),
                )?),
                None => None,
            };
            Ok((state, writer))
        };
        // On a multi-thread runtime its other tasks move to other workers
        // meanwhile; on a current-thread one (greendot serve) the disk work
        // runs on a plain thread, never on the runtime's, and `bind` waits.
        let (state, writer) = match tokio::runtime::Handle::try_current()
            .map(|h| h.runtime_flavor())
        {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(start)?,
            _ => std::thread::scope(|s| {
                s.spawn(start)
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })?,
        };
        let certificate = state.certificate().clone();
        let (control, control_rx) = mpsc::channel(1024);
        let (events, _) = broadcast::channel(4096);
        let shared = Arc::new(Shared {
            keys: state.keys().clone(),
            config,
            control,
            stats: state.shared_stats(),
            events,
            socket_inode,
        });
        let mut websocket_addr = None;
        let ws = match tcp {
            Some(tcp) => {
                websocket_addr = Some(tcp.local_addr()?);
                let config = &shared.config;
                let limits = ws_gate::WsLimits {
                    max_pending: config.max_websocket_pending,
                    per_address: config.max_handshakes_per_address,
                };
                let settings = ws_io::WsSettings {
                    tls: state.websocket_tls(),
                    max_frame: config.max_frame,
                    max_hello: config.max_hello.min(config.max_frame),
                    hello_timeout: config.hello_timeout,
                    max_connections: config.max_connections,
                    max_pending: config.max_websocket_pending,
                    gate: Arc::new(ws_gate::WsGate::new(limits, shared.stats.clone())),
                };
                Some(ws_io::WsIo::start(tcp, settings)?)
            }
            None => None,
        };
        let mut driver = driver::Driver::new(shared.clone(), io, state, writer);
        driver.ws = ws;
        let cluster = match &shared.config.cluster {
            Some(settings) if shared.config.cluster_of_one => {
                driver.local_bus = Some(cluster::local::LocalBus::new(settings, now));
                None
            }
            Some(_) => {
                let (tx, rx) = mpsc::channel(CLUSTER_QUEUE);
                driver.cluster = Some(tx);
                Some(rx)
            }
            None => None,
        };
        Ok(Built {
            local_addr,
            websocket_addr,
            shared,
            certificate,
            driver,
            control: control_rx,
            cluster,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The WebSocket listener's address, if there is one.
    pub fn websocket_addr(&self) -> Option<SocketAddr> {
        self.websocket_addr
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

    /// What the state asks of the cluster's NATS I/O ([`ServerConfig::cluster`]);
    /// `None` without a cluster, or once taken.
    pub fn take_cluster_outputs(&self) -> Option<mpsc::Receiver<cluster::ClusterOutput>> {
        self.cluster.lock().ok()?.take()
    }

    /// A handle to give the state what NATS delivered.
    pub fn cluster_inputs(&self) -> ClusterInputs {
        ClusterInputs {
            control: self.shared.control.clone(),
        }
    }

    /// Events from now on (a lagging receiver loses the oldest).
    pub fn events(&self) -> broadcast::Receiver<ServerEvent> {
        self.shared.events.subscribe()
    }

    /// The core's counters, or `None` once the server's task has stopped.
    pub async fn counters(&self) -> Option<Counters> {
        let (tx, rx) = oneshot::channel();
        self.shared.control.send(Control::Counters(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Mints a token with the server's secret (for tools and tests).
    pub fn mint(&self, claims: &crate::token::Claims) -> Result<String, token::MintError> {
        self.shared.keys.mint(claims)
    }

    /// A graceful stop, for restarts and deploys: stops accepting, closes
    /// every connection with `CloseCode::Draining` (clients reconnect and try
    /// to resume), then writes the store, including the devices that were
    /// live, which the next process restores as lingering. Waits at most
    /// about `2 s` for connections and `10 s` for the store.
    pub async fn drain(self) {
        self.stop(
            CloseCode::Draining,
            b"server draining: reconnect and resume",
            true,
        )
        .await;
        info!("drained");
    }

    /// Closes every connection (`CloseCode::Shutdown`) and stops the task,
    /// at once: what was not yet written behind to the store (at most one
    /// flush interval) is lost. [`Server::drain`] is the graceful stop.
    pub async fn shutdown(self) {
        self.stop(CloseCode::Shutdown, b"server shutting down", false)
            .await;
    }

    async fn stop(self, code: CloseCode, text: &'static [u8], save: bool) {
        self.shared.stats.stopping.store(true, Ordering::Relaxed);
        let (done, finished) = oneshot::channel();
        let stop = Control::Stop {
            code,
            text,
            save,
            done,
        };
        if self.shared.control.send(stop).await.is_ok()
            && tokio::time::timeout(Duration::from_secs(15), finished)
                .await
                .is_err()
        {
            warn!("the server did not stop in time");
        }
        self.task.abort();
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
    /// Whether the server accepts new connections: bound, its loop running,
    /// no drain or shutdown begun (`/readyz`).
    pub fn accepting(&self) -> bool {
        !self.shared.stats.stopping.load(Ordering::Relaxed) && !self.shared.control.is_closed()
    }

    pub fn stats(&self) -> Stats {
        self.shared.stats.snapshot()
    }

    /// Everything for the metrics page; `None` once the server's task stopped.
    pub async fn metrics(&self) -> Option<MetricsSnapshot> {
        let (tx, rx) = oneshot::channel();
        self.shared.control.send(Control::Census(tx)).await.ok()?;
        let census = rx.await.ok()?;
        let s = &self.shared.stats;
        let stats = self.stats();
        let rejected = s
            .rejected_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Some(MetricsSnapshot {
            counters: census.counters,
            users_known: census.users_known as u64,
            names: census.names as u64,
            connections_open: stats.connections_open,
            connections_open_websocket: stats.connections_open_websocket,
            connections_open_webtransport: stats.connections_open_webtransport,
            connections_total: stats.connections_total,
            migrations: stats.migrations,
            overloaded: stats.overloaded,
            rejected,
            latency: s.latency.snapshot(),
            store_errors: s.store_errors.load(Ordering::Relaxed),
            shed: Shed::ALL
                .iter()
                .map(|&r| (r.label(), s.shed[r as usize].load(Ordering::Relaxed)))
                .collect(),
            websocket_shed: s.websocket.shed_counts(),
            websocket_pending: s.websocket.pending() as u64,
            handshakes_aborted: s.handshakes_aborted.load(Ordering::Relaxed),
            handshakes_in_flight: s.handshaking.load(Ordering::Relaxed) as u64,
            admission_rate: s.admission_rate.load(Ordering::Relaxed),
            admission_cuts: s.admission_cuts.load(Ordering::Relaxed),
            loop_busy: s.loop_busy_permille.load(Ordering::Relaxed) as f64 / 1000.0,
            loop_pass: s.loop_pass.snapshot(),
            loop_carried: s.loop_carried.load(Ordering::Relaxed),
            cluster: census.cluster.map(|counters| metrics::ClusterMetrics {
                counters,
                dropped: s.cluster_dropped.load(Ordering::Relaxed),
                latency: s.cluster_latency.snapshot(),
            }),
            udp: self
                .shared
                .socket_inode
                .and_then(metrics::UdpSocketStats::read),
        })
    }
}

/// Asks for `bytes` of receive and send buffer, and logs when the kernel
/// grants less (Linux caps an unprivileged request at `net.core.rmem_max` /
/// `wmem_max`; a privileged process may exceed the cap, so that is tried next).
fn socket_buffers(socket: &std::net::UdpSocket, bytes: usize) {
    let sock = socket2::SockRef::from(socket);
    // Linux reports twice what it grants (bookkeeping included).
    let granted = |got: std::io::Result<usize>| got.map(|n| n / 2).unwrap_or(0);
    let _ = sock.set_recv_buffer_size(bytes);
    let mut recv = granted(sock.recv_buffer_size());
    if recv < bytes {
        force_buffer(socket, FORCE_RCVBUF, bytes);
        recv = granted(sock.recv_buffer_size());
    }
    let _ = sock.set_send_buffer_size(bytes);
    let mut send = granted(sock.send_buffer_size());
    if send < bytes {
        force_buffer(socket, FORCE_SNDBUF, bytes);
        send = granted(sock.send_buffer_size());
    }
    if recv < bytes || send < bytes {
        let cap = |name: &str| {
            std::fs::read_to_string(format!("/proc/sys/net/core/{name}"))
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "?".into())
        };
        warn!(
            requested = bytes,
            receive = recv,
            send,
            rmem_max = %cap("rmem_max"),
            wmem_max = %cap("wmem_max"),
            "the kernel capped the UDP socket buffers: raise net.core.rmem_max and wmem_max"
        );
    } else {
        info!(receive = recv, send, "UDP socket buffers");
    }
}

#[cfg(target_os = "linux")]
const FORCE_RCVBUF: libc::c_int = libc::SO_RCVBUFFORCE;
#[cfg(target_os = "linux")]
const FORCE_SNDBUF: libc::c_int = libc::SO_SNDBUFFORCE;
#[cfg(not(target_os = "linux"))]
const FORCE_RCVBUF: i32 = 0;
#[cfg(not(target_os = "linux"))]
const FORCE_SNDBUF: i32 = 0;

/// `SO_RCVBUFFORCE` / `SO_SNDBUFFORCE`: past the sysctl cap, for a process
/// with CAP_NET_ADMIN; fails harmlessly otherwise.
#[cfg(target_os = "linux")]
fn force_buffer(socket: &std::net::UdpSocket, option: libc::c_int, bytes: usize) {
    use std::os::fd::AsRawFd;
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: a valid socket descriptor, a c_int option value of the right size.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn force_buffer(_: &std::net::UdpSocket, _: i32, _: usize) {}

/// The socket's inode (Linux: `/proc/self/fd/N` is the socket itself).
#[cfg(target_os = "linux")]
fn socket_inode(socket: &std::net::UdpSocket) -> Option<u64> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/self/fd/{}", socket.as_raw_fd()))
        .ok()
        .map(|m| m.ino())
}

#[cfg(not(target_os = "linux"))]
fn socket_inode(_: &std::net::UdpSocket) -> Option<u64> {
    None
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

/// The time to readmit `connections` at `per_sec`, in ms (at least 1 s): the
/// spread of reconnects the server suggests when it drains (`retry_ms=` in
/// the close reason), and the extra grace of devices restored after it.
pub(crate) fn readmit_ms(connections: usize, per_sec: u32) -> u64 {
    let connections = u64::try_from(connections).unwrap_or(u64::MAX);
    (connections.saturating_mul(1000) / u64::from(per_sec.max(1))).clamp(1000, MAX_RETRY_MS)
}

/// The largest reconnect spread the server suggests: clients cut a larger
/// hint to the same 300 s, and a spread longer than that only leaves
/// devices away for no gain.
pub const MAX_RETRY_MS: u64 = 300_000;

/// A close reason carrying the reconnect hint (at most [`MAX_RETRY_MS`]):
/// clients spread their reconnect uniformly over [0, retry_ms].
pub(crate) fn with_retry_hint(text: &[u8], retry_ms: u64) -> Vec<u8> {
    let retry_ms = retry_ms.min(MAX_RETRY_MS);
    let mut text = text.to_vec();
    text.extend_from_slice(format!(" retry_ms={retry_ms}").as_bytes());
    text
}

/// The record to write for `user`, by name.
fn record(hub: &Hub, user: UserId) -> Option<(String, Record)> {
    let name = hub.user_name(user)?.to_owned();
    let (saved, shown_online) = hub.saved(user);
    Some((name, Record::new(&saved, shown_online)))
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

/// The answer to a request whose change could not be saved (the commit
/// failed or did not finish within `store_timeout`): the change stays in
/// effect (see "Durability" in the module docs).
fn not_saved(handled: Handled, why: &str) -> Handled {
    match handled.reply {
        Some(ServerFrame::Reply { id, .. }) => Handled {
            reply: Some(ServerFrame::Reply {
                id,
                result: Err(proto::WireError::new(
                    proto::ErrorCode::Internal,
                    format!("the change is in effect but could not be saved: {why}"),
                )),
            }),
            ..handled
        },
        _ => handled,
    }
}

fn reason_text(error: &proto::WireError) -> Vec<u8> {
    let mut text = format!("{:?}: {}", error.code, error.message).into_bytes();
    text.truncate(400);
    text
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

#[cfg(test)]
mod tests {
    use super::handshake_aborted;
    use quinn_proto::{ConnectionError, TransportError, TransportErrorCode};

    #[test]
    fn a_lost_handshake_is_not_bad_input() {
        assert!(handshake_aborted(&ConnectionError::TimedOut));
        assert!(handshake_aborted(&ConnectionError::Reset));
        assert!(handshake_aborted(&ConnectionError::LocallyClosed));
        let close = |code| {
            ConnectionError::ConnectionClosed(quinn_proto::ConnectionClose {
                error_code: code,
                frame_type: None,
                reason: bytes::Bytes::new(),
            })
        };
        assert!(handshake_aborted(&close(TransportErrorCode::NO_ERROR)));
        // A client whose connect timed out (seen 150 a second in a restart
        // herd, all counted as bad input before).
        assert!(handshake_aborted(&close(
            TransportErrorCode::APPLICATION_ERROR
        )));
        // A TLS alert (here: no application protocol) is bad input.
        assert!(!handshake_aborted(&close(TransportErrorCode::crypto(0x78))));
        assert!(!handshake_aborted(&close(
            TransportErrorCode::PROTOCOL_VIOLATION
        )));
        let violation = TransportError {
            code: TransportErrorCode::crypto(0x2a),
            frame: None,
            reason: "bad certificate".into(),
        };
        assert!(!handshake_aborted(&ConnectionError::TransportError(
            violation
        )));
        assert!(!handshake_aborted(&ConnectionError::VersionMismatch));
    }
}
