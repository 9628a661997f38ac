//! The whole server as a sans-IO state machine: [`ServerState`] owns the
//! [`Hub`] (the core), quinn-proto's endpoint and connections, every timer,
//! the admission pacer and shedding, the push queues and the leases. It has
//! no socket, no runtime, no clock and no thread: time comes in with every
//! call (`now`, a `std::time::Instant`, and the wall clock given at
//! [`ServerState::new`] or by [`ServerInput::SetWallClock`]), and all its
//! randomness (QUIC connection ids, keep-alive jitter, the session key)
//! comes from the `seed` given to `new` (the stateless reset key from the
//! token secret, so that it outlives the process). The same inputs give
//! the same outputs, so a simulator can run it on virtual time and replay a
//! seed. (TLS keys are drawn by rustls itself: they change the bytes of a
//! handshake, not what the server does.)
//!
//! The shape is quinn-proto's (and str0m's):
//! - in: [`ServerState::handle_datagram`] (a UDP datagram),
//!   [`ServerState::handle_timeout`] (the due timers and the connections
//!   touched since: this is where work is done), [`ServerState::handle_input`]
//!   (the store's answers, a stop, a jump of the wall clock);
//! - out, drained after every call: [`ServerState::poll_transmit`]
//!   (datagrams to send; give their buffers back with
//!   [`ServerState::recycle`]), [`ServerState::poll_output`] (store writes,
//!   events, the end of a stop), and [`ServerState::poll_timeout`] (when to
//!   call `handle_timeout` next: `now` itself while work is carried).
//! - read: [`ServerState::counters`], [`ServerState::census`],
//!   [`ServerState::stats`].
//!
//! **Fairness** ([`PassBudget`]): `handle_timeout` handles at most
//! `timers` connection timers and drives at most `connections` connections;
//! the rest is carried ([`ServerState::has_carried_work`]) to the next call.
//! A driver reads the socket (up to `datagrams`) before each call, so under
//! overload receiving is never starved.
//!
//! **The store** is outside: the state asks for writes
//! ([`ServerOutput::Store`]); a durable write carries a ticket, and the
//! request behind it is answered when [`ServerInput::StoreDone`] brings the
//! ticket back (or, if it does not within `store_timeout`, answered "not
//! saved"). The connection's later frames wait behind it.
//!
//! **Sessions** (`session`) do not know QUIC: they talk to their
//! transport through a small binding trait; QUIC is the one binding today
//! (`quic`).
//!
//! This file keeps [`ServerState`], its constructor and the entry points
//! (`handle_*`, `poll_*`, the timers' dispatch); the rest is by concern,
//! each an `impl ServerState` block: `admission` (shedding and accepting
//! new QUIC connections, the handshakes in flight), `connections` (driving
//! a connection, WebSocket connections, its end and close) over `link`
//! (the binding), `requests` (frames in, answers out), `pushes` (the hub's
//! outputs to sessions, the push byte budget), `cluster_requests` (what
//! the state does with the cluster link), `tickets` (requests waiting for
//! the store or the cluster), `persistence` (write-behind and restore),
//! `drain` (a stop), `tokens`, `check`; `clock` and `rng` are the state's
//! time and randomness.

mod admission;
mod check;
mod clock;
mod cluster_requests;
mod connections;
mod drain;
mod link;
mod persistence;
mod pushes;
mod requests;
mod rng;
mod tickets;
mod timer_heap;
mod tokens;

use crate::cluster::{ClusterInput, ClusterLink, ClusterOutput};
use crate::config::validate;
use crate::hub::Hub;
use crate::session::Session;
use crate::store::{Batch, Loaded, StoreError};
use crate::tls::{self, Identity};
use crate::token::TokenKeys;
use crate::ws::{WsId, WsMessage};
use crate::{
    transport_config, PassBudget, ServerConfig, ServerError, ServerEvent, SettingError, Stats,
    StatsInner, KEEP_ALIVE_STEPS,
};
pub(crate) use admission::Pacer;
use admission::{Accept, Admission, HOLD_TICK};
use bytes::BytesMut;
use clock::Clock;
use drain::Stopping;
use greendot_core::{Counters, Millis, SessionId, UserId};
use greendot_proto::CloseCode;
use link::{quic_slot, Link};
use persistence::{restore, SWEEP_BUDGET};
use quinn_proto::{DatagramEvent, EcnCodepoint, Endpoint};
use rng::{derive, SeededCids, SmallRng};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tickets::Ticket;
use timer_heap::TimerHeap;

/// Maps whose iteration order is the same in every run (std's default
/// hasher is seeded per process).
type DetHasher = BuildHasherDefault<std::collections::hash_map::DefaultHasher>;
type DetMap<K, V> = HashMap<K, V, DetHasher>;
type DetSet<K> = HashSet<K, DetHasher>;

/// At most one stateless reset per this interval (quinn's default is 20 ms,
/// 50 a second): after a restart under 100,000 sessions, thousands of
/// clients that missed the Draining close (or a crashed process's clients)
/// each need one to come back before their idle timeout. A reset is
/// smaller than the packet that caused it, so this bounds work, not
/// amplification.
const MIN_RESET_INTERVAL: Duration = Duration::from_micros(100);
/// Transmit buffers kept for reuse: about what one call with the default
/// budget hands out; a larger buffer (a big GSO batch) is not kept.
const POOL_CAP: usize = 1024;
const POOL_BUFFER_CAP: usize = 16 * 1024;

/// One received UDP datagram.
#[derive(Debug)]
pub struct Datagram {
    pub remote: SocketAddr,
    /// The address the datagram was sent to (ours), where known: the answer
    /// leaves from it.
    pub local_ip: Option<IpAddr>,
    pub ecn: Option<EcnCodepoint>,
    pub data: BytesMut,
}

/// A UDP datagram (or a GSO batch of `segment_size` segments) to send.
#[derive(Debug)]
pub struct Transmit {
    pub destination: SocketAddr,
    pub src_ip: Option<IpAddr>,
    pub ecn: Option<EcnCodepoint>,
    /// The bytes; give the buffer back with [`ServerState::recycle`].
    pub contents: Vec<u8>,
    pub segment_size: Option<usize>,
}

/// Inputs other than datagrams and time.
#[derive(Debug)]
pub enum ServerInput {
    /// The store finished the durable write of `ticket`.
    StoreDone {
        ticket: u64,
        result: Result<(), StoreError>,
    },
    /// Close every connection with `code`, wait up to two seconds for them
    /// to go, then (if `save`) write the store with the live devices, and
    /// end with [`ServerOutput::Stopped`].
    Stop {
        code: CloseCode,
        text: Vec<u8>,
        save: bool,
    },
    /// The wall clock now reads `unix_ms` (read it every second or so: an
    /// NTP step, a resumed VM). The core's time is slewed towards it by at
    /// most 1%, never stepped (see `Clock`).
    SetWallClock { unix_ms: u64 },
    /// A WebSocket connection (TLS and upgrade done) from `remote`; `id`
    /// is the driver's and never reused.
    WsOpened { id: WsId, remote: SocketAddr },
    /// A message from WebSocket `id`.
    WsReceived { id: WsId, message: WsMessage },
    /// The driver wrote a message of `len` bytes (a `WsSend`) to `id`'s
    /// socket: room in its send window.
    WsWritten { id: WsId, len: usize },
    /// WebSocket `id` is gone: closed by the client with `code`, or lost
    /// (`None`), or closed after the server asked.
    WsClosed { id: WsId, code: Option<u16> },
    /// From the cluster's NATS I/O (only with [`ServerConfig::cluster`]).
    Cluster(ClusterInput),
    /// How loaded the loop was since the last report (send one every
    /// [`LOAD_REPORT_EVERY`]): `busy_permille`, the share of wall time it
    /// spent in passes rather than waiting; `socket_drops`, datagrams the
    /// kernel dropped on a full receive buffer meanwhile;
    /// `backlogged_passes`, passes that read their whole datagram budget
    /// ([`PassBudget::datagrams`]), so more may be waiting. The admission
    /// rate follows it (see `Admission`); without reports it stays at
    /// [`ServerConfig::max_handshakes_per_sec`].
    Load {
        busy_permille: u32,
        socket_drops: u64,
        backlogged_passes: u32,
    },
}

/// How often the driver reports the loop's load ([`ServerInput::Load`]).
pub const LOAD_REPORT_EVERY: Duration = Duration::from_millis(250);

/// A write the store is asked for.
#[derive(Debug)]
pub enum StoreRequest {
    /// Write behind: merge with what is pending; nobody waits for it.
    Behind(Batch),
    /// On disk before `ticket` is answered with [`ServerInput::StoreDone`]
    /// (the state gives up after `timeout`).
    Durable {
        ticket: u64,
        batch: Batch,
        timeout: Duration,
    },
}

/// What the state asks of its driver, besides transmits.
#[derive(Debug)]
pub enum ServerOutput {
    Store(StoreRequest),
    Event(ServerEvent),
    /// A [`ServerInput::Stop`] is complete: nothing more will happen.
    Stopped,
    /// Send one binary message on WebSocket `id`; report it written with
    /// [`ServerInput::WsWritten`].
    WsSend {
        id: WsId,
        bytes: Vec<u8>,
    },
    /// Send a WebSocket ping on `id`.
    WsPing {
        id: WsId,
    },
    /// Close WebSocket `id` with this close code and reason (`None`: drop
    /// the TCP connection without a close frame), then report
    /// [`ServerInput::WsClosed`].
    WsClose {
        id: WsId,
        code: Option<u16>,
        reason: String,
    },
    /// The session read `bytes` of `id`'s messages: the driver may read
    /// that many more.
    WsCredit {
        id: WsId,
        bytes: usize,
    },
    /// For the cluster's NATS I/O (only with [`ServerConfig::cluster`]).
    Cluster(ClusterOutput),
}

/// What the metrics read of the hub.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Census {
    pub counters: Counters,
    /// User names held (as many core records at most).
    pub users_known: usize,
    /// User and device names held.
    pub names: usize,
    /// The cluster link's counters (with a cluster only).
    pub cluster: Option<crate::cluster::ClusterCounters>,
}

/// Deliberately broken variants of the server (for the simulator: it must
/// catch each). Off unless set in [`ServerConfig::mutant`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServerMutant {
    /// A logout request is answered, but the core is only told when the
    /// connection goes, and the connection is not closed: the session keeps
    /// its subscriptions and pushes are still routed to it after its logout.
    PushAfterLogout,
    /// Traffic does not count as a sign of life: a connection's datagrams
    /// do not refresh its last heard (so the periodic renewal renews
    /// nothing) and its frames do not count as activity (only an explicit
    /// `Ping`, which the core handles itself, still renews the lease).
    LeaseNotRenewedOnTraffic,
    /// A connection whose address changes is closed and its session ended
    /// as a disconnect (the device lingers), instead of migrating.
    MigrationAsDisconnect,
}

impl ServerMutant {
    pub const ALL: [ServerMutant; 3] = [
        ServerMutant::PushAfterLogout,
        ServerMutant::LeaseNotRenewedOnTraffic,
        ServerMutant::MigrationAsDisconnect,
    ];
}

/// One connection: its session layer over its binding (QUIC or WebSocket).
struct Conn {
    link: Link,
    session: Session,
    /// Tells a reused slot from the connection a store ticket answers.
    serial: u64,
    /// In the state's `touched` list.
    touched: bool,
    /// Counted among the open connections (and its binding's): set once
    /// when the handshake ends and the connection is admitted, cleared once
    /// when its end is reported, so the counts never go below zero.
    counted: bool,
}

/// The sans-IO server (see the module docs).
pub struct ServerState {
    config: ServerConfig,
    keys: Arc<TokenKeys>,
    stats: Arc<StatsInner>,
    clock: Clock,
    certificate: rustls::pki_types::CertificateDer<'static>,
    endpoint: Endpoint,
    pub(super) accept: Accept,
    /// Handshakes in flight, in all and by address.
    handshaking: usize,
    per_address: DetMap<IpAddr, usize>,
    admission: Admission,
    /// Answers to shed Initials (Retries, refusals) per second.
    shed_answers: Pacer,
    hub: Hub,
    session_key: u64,
    conns: Vec<Option<Box<Conn>>>,
    sessions: DetMap<SessionId, usize>,
    /// The connections' timers, by slot.
    pub(super) timers: TimerHeap,
    /// Connections to drive, oldest first; what a call's budget leaves is
    /// driven by the next.
    pub(super) touched: VecDeque<usize>,
    budget: PassBudget,
    next_serial: u64,
    max_datagrams: usize,
    transmits: VecDeque<Transmit>,
    pool: Vec<Vec<u8>>,
    outputs: VecDeque<ServerOutput>,
    /// A store is in use (its writes are asked for).
    stored: bool,
    dirty_users: DetSet<UserId>,
    /// Push bytes waiting in every connection's queues.
    queued: usize,
    next_flush: Instant,
    next_renewal: Instant,
    /// While devices restored at start may still be waiting for their turn:
    /// when to look at the shedding again ([`HOLD_TICK`]), and the shed
    /// count seen then.
    next_hold: Option<Instant>,
    shed_seen: u64,
    /// The `from` of the last hold.
    held_from: Millis,
    /// A drain that will save the live devices for the next process: the
    /// devices it disconnects linger for [`DRAIN_HOLD`](drain::DRAIN_HOLD), not their grace.
    drain_holds: bool,
    tickets: BTreeMap<u64, Ticket>,
    /// The tickets by deadline.
    ticket_deadlines: BTreeSet<(Instant, u64)>,
    next_ticket: u64,
    stopping: Option<Stopping>,
    /// The latest `now` seen: what `poll_timeout` answers while work is carried.
    last_now: Instant,
    /// WebSocket connections by the driver's id: their slots.
    ws: DetMap<WsId, usize>,
    /// Odd slots free for WebSocket connections.
    ws_free: Vec<usize>,
    /// Which push stream byte is realtime, drawn per WebSocket connection.
    ws_rng: SmallRng,
    /// The WebSocket listener's TLS (the same identity as QUIC).
    ws_tls: Arc<rustls::ServerConfig>,
    /// The cluster data path (`None` on one node: nothing of it runs).
    cluster: Option<Box<ClusterLink>>,
}

impl std::fmt::Debug for ServerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerState")
            .field("connections", &self.endpoint.open_connections())
            .field("sessions", &self.sessions.len())
            .finish_non_exhaustive()
    }
}

impl ServerState {
    /// A server at `now`, when the wall clock reads `unix_ms`. `seed`
    /// drives all its randomness. `restored`: what the store loaded
    /// (`Some` also means a store is in use: writes will be asked for);
    /// everything in it is back in the core before the first datagram.
    pub fn new(
        config: ServerConfig,
        now: Instant,
        unix_ms: u64,
        seed: u64,
        restored: Option<Loaded>,
    ) -> Result<ServerState, ServerError> {
        validate(&config)?;
        let identity = match &config.identity {
            Some(identity) => identity.clone(),
            None => Identity::self_signed(&["localhost"])?,
        };
        let certificate = identity
            .certs
            .first()
            .cloned()
            .ok_or(SettingError::NoCertificate)?;
        let ws_tls = tls::websocket_crypto(&identity, &config.token_secret)?;
        let mut server_config = quinn_proto::ServerConfig::with_crypto(Arc::new(
            tls::server_crypto(&identity, &config.token_secret)?,
        ));
        server_config.migration(config.migration);
        // One variant per keep-alive step in [0.75, 1] × keep_alive; each
        // accepted connection gets one at random, so connections opened
        // together (a ramp, a mass reconnect) do not send their keep-alives
        // together for the rest of their lives.
        let variants: Vec<(Duration, Arc<quinn_proto::ServerConfig>)> = (0..KEEP_ALIVE_STEPS)
            .map(|i| {
                let scale = 0.75 + 0.25 * i as f64 / (KEEP_ALIVE_STEPS - 1) as f64;
                let interval = config.keep_alive.mul_f64(scale);
                let transport = transport_config(&config, interval)?;
                let mut variant = server_config.clone();
                variant.transport_config(Arc::new(transport));
                Ok((interval, Arc::new(variant)))
            })
            .collect::<Result<_, ServerError>>()?;
        server_config.transport_config(Arc::new(transport_config(&config, config.keep_alive)?));

        let mut endpoint_config = quinn_proto::EndpointConfig::new(Arc::new(
            tls::stateless_reset_key(&config.token_secret)?,
        ));
        endpoint_config
            .max_udp_payload_size(config.max_udp_payload)
            .map_err(|_| SettingError::MaxUdpPayload)?
            .min_reset_interval(MIN_RESET_INTERVAL);
        let cids = Arc::new(AtomicU64::new(derive(seed, 2)));
        endpoint_config.cid_generator(move || {
            let n = cids.fetch_add(1, Ordering::Relaxed);
            Box::new(SeededCids {
                rng: SmallRng::new(derive(n, 3)),
            })
        });
        let mut rng_seed = [0u8; 32];
        for (i, chunk) in rng_seed.chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&derive(seed, 10 + i as u64).to_le_bytes());
        }
        let endpoint = Endpoint::new(
            Arc::new(endpoint_config),
            Some(Arc::new(server_config)),
            false,
            Some(rng_seed),
        );

        let clock = Clock::new(now, unix_ms);
        let session_key = derive(seed, 1);
        // The core runs on Unix milliseconds: `last_seen` needs no offset.
        let mut hub = Hub::new(config.core.clone(), config.limits, 0)?
            .with_max_frame(u32::try_from(config.max_frame).unwrap_or(u32::MAX))
            .with_session_key(session_key)
            .with_token_leeway(config.token_leeway);
        let stored = restored.is_some();
        if stored {
            hub = hub.with_stored_groups();
        }
        let cluster = config.cluster.clone().map(|settings| {
            Box::new(ClusterLink::new(
                settings,
                &config.core,
                0,
                config.limits.max_name_len,
            ))
        });
        if cluster.is_some() {
            hub.set_cluster_edge();
        }
        // A cluster's edge serves groups with counts summed across nodes.
        if cluster.as_ref().is_some_and(|c| c.serves_groups()) {
            hub.set_group_counts_fed();
        }
        if let Some(mut loaded) = restored {
            hub.restore_revocations(std::mem::take(&mut loaded.revocations));
            restore(&mut hub, loaded, clock.at(now), &config)?;
        }
        let next_hold = hub.holds_restored().then(|| now + HOLD_TICK);
        let stats = StatsInner::default();
        stats
            .admission_rate
            .store(u64::from(config.max_handshakes_per_sec), Ordering::Relaxed);
        Ok(ServerState {
            keys: Arc::new(TokenKeys::new(&config.token_secret, config.token_leeway)),
            stats: Arc::new(stats),
            clock,
            certificate,
            endpoint,
            accept: Accept::new(variants, derive(seed, 4)),
            handshaking: 0,
            per_address: DetMap::default(),
            admission: Admission::new(config.max_handshakes_per_sec, now),
            shed_answers: Pacer::new(config.max_handshakes_per_sec.saturating_mul(2), now),
            hub,
            session_key,
            conns: Vec::new(),
            sessions: DetMap::default(),
            timers: TimerHeap::default(),
            touched: VecDeque::new(),
            budget: config.pass,
            next_serial: 0,
            max_datagrams: 1,
            transmits: VecDeque::new(),
            pool: Vec::new(),
            outputs: VecDeque::new(),
            stored,
            dirty_users: DetSet::default(),
            queued: 0,
            next_flush: now + config.flush_interval,
            next_renewal: now + config.renewal(),
            next_hold,
            shed_seen: 0,
            held_from: Millis(0),
            drain_holds: false,
            tickets: BTreeMap::new(),
            ticket_deadlines: BTreeSet::new(),
            next_ticket: 0,
            stopping: None,
            last_now: now,
            ws: DetMap::default(),
            ws_free: Vec::new(),
            ws_tls,
            ws_rng: SmallRng::new(derive(seed, 5)),
            cluster,
            config,
        })
    }

    // ---- the public API ----

    /// The server's certificate (the generated one when none was configured).
    pub fn certificate(&self) -> &rustls::pki_types::CertificateDer<'static> {
        &self.certificate
    }

    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// The TLS config for a WebSocket listener: the same certificate as QUIC.
    pub fn websocket_tls(&self) -> Arc<rustls::ServerConfig> {
        self.ws_tls.clone()
    }

    /// Mints a token with the server's secret (for tools and tests).
    pub fn keys(&self) -> &Arc<TokenKeys> {
        &self.keys
    }

    /// Datagrams a transmit may carry (GSO segments); default 1.
    pub fn set_max_datagrams(&mut self, n: usize) {
        self.max_datagrams = n.max(1);
    }

    /// A datagram arrived. Work it causes is done by the next
    /// [`ServerState::handle_timeout`] (which [`ServerState::poll_timeout`]
    /// then asks for at once); only answers the endpoint gives without a
    /// connection (version negotiation, Retry, refusals) are queued here.
    pub fn handle_datagram(&mut self, now: Instant, datagram: Datagram) {
        self.last_now = self.last_now.max(now);
        let mut buf = self.buffer();
        let remote = datagram.remote;
        let event = self.endpoint.handle(
            now,
            remote,
            datagram.local_ip,
            datagram.ecn,
            datagram.data,
            &mut buf,
        );
        match event {
            Some(DatagramEvent::NewConnection(incoming)) => {
                self.on_incoming(now, incoming, buf);
            }
            Some(DatagramEvent::ConnectionEvent(ch, event)) => {
                let heard = self.clock.at(now);
                let renew = !self.mutant(ServerMutant::LeaseNotRenewedOnTraffic);
                let ch = quic_slot(ch);
                if let Some(conn) = self.conn(ch) {
                    if renew {
                        conn.session.last_heard = heard;
                    }
                    if let Some(quic) = conn.link.quic() {
                        quic.handle_event(event);
                    }
                    self.touch(ch);
                }
                self.recycle(buf);
            }
            Some(DatagramEvent::Response(t)) => self.queue_transmit(t, buf),
            None => self.recycle(buf),
        }
    }

    /// Handles the due timers (connections', the core's, the lease
    /// renewal, the store's) and drives the connections touched since the
    /// last call, each up to its [`PassBudget`]; what is left is carried.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = self.last_now.max(now);
        self.on_timers(now);
        self.pump(now);
        self.check_stop(now);
    }

    /// When [`ServerState::handle_timeout`] is due: the latest `now` given
    /// while work is carried (call it again at once).
    pub fn poll_timeout(&self) -> Option<Instant> {
        if matches!(self.stopping, Some(Stopping::Done)) {
            return None;
        }
        if !self.touched.is_empty() {
            return Some(self.last_now);
        }
        let mut at = self.next_renewal;
        if self.stored {
            at = at.min(self.next_flush);
        }
        if let Some((t, _)) = self.timers.first() {
            at = at.min(t);
        }
        if let Some(t) = self.hub.poll_timeout().and_then(|m| self.clock.instant(m)) {
            at = at.min(t);
        }
        if let Some(t) = self.hub.token_timeout().and_then(|m| self.clock.instant(m)) {
            at = at.min(t);
        }
        if let Some(&(t, _)) = self.ticket_deadlines.first() {
            at = at.min(t);
        }
        if let Some(c) = self.cluster.as_deref() {
            let core = c.poll_timeout().and_then(|m| self.clock.instant(m));
            if let Some(t) = core.into_iter().chain(c.poll_deadline(self.last_now)).min() {
                at = at.min(t);
            }
        }
        if let Some(Stopping::Closing { until, .. }) = &self.stopping {
            at = at.min(*until);
        }
        if let Some(t) = self.next_hold {
            at = at.min(t);
        }
        Some(at)
    }

    /// Whether the last call left work (due timers, touched connections)
    /// that the next must do without waiting.
    pub fn has_carried_work(&self, now: Instant) -> bool {
        !self.touched.is_empty() || self.timers.first().is_some_and(|(at, _)| at <= now)
    }

    /// The next datagram to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// Gives a transmit's buffer back for reuse.
    pub fn recycle(&mut self, mut contents: Vec<u8>) {
        if self.pool.len() < POOL_CAP && contents.capacity() <= POOL_BUFFER_CAP {
            contents.clear();
            self.pool.push(contents);
        }
    }

    /// The next output (store write, event, end of a stop).
    pub fn poll_output(&mut self) -> Option<ServerOutput> {
        self.outputs.pop_front()
    }

    pub fn handle_input(&mut self, now: Instant, input: ServerInput) {
        self.last_now = self.last_now.max(now);
        match input {
            ServerInput::StoreDone { ticket, result } => self.store_done(now, ticket, result),
            ServerInput::Stop { code, text, save } => self.stop(now, code, text, save),
            ServerInput::SetWallClock { unix_ms } => self.clock.set(now, unix_ms),
            ServerInput::WsOpened { id, remote } => self.ws_opened(now, id, remote),
            ServerInput::WsReceived { id, message } => self.ws_received(now, id, message),
            ServerInput::WsWritten { id, len } => {
                self.with_ws(id, |link| link.written(len));
            }
            ServerInput::WsClosed { id, code } => {
                self.with_ws(id, |link| link.lost(code));
            }
            ServerInput::Load {
                busy_permille,
                socket_drops,
                backlogged_passes,
            } => self.on_load(busy_permille, socket_drops, backlogged_passes),
            ServerInput::Cluster(input) => self.cluster_input(now, input),
        }
    }

    /// The core's counters.
    pub fn counters(&self) -> Counters {
        self.hub.core().counters().clone()
    }

    /// The core's counters with the hub's census.
    pub fn census(&self) -> Census {
        Census {
            counters: self.counters(),
            users_known: self.hub.user_names(),
            names: self.hub.names(),
            cluster: self.cluster.as_deref().map(ClusterLink::counters),
        }
    }

    /// The transport counters.
    pub fn stats(&self) -> Stats {
        self.stats.snapshot()
    }

    /// The core behind the hub (for checks of what it says; the simulator's).
    #[doc(hidden)]
    pub fn hub(&self) -> &Hub {
        &self.hub
    }

    /// A session as its client knows it (the welcome's `session`).
    pub fn wire(&self, session: SessionId) -> SessionId {
        SessionId(session.0 ^ self.session_key)
    }

    /// Whether a stop is under way (every close packet is then kept until
    /// sent).
    pub fn is_stopping(&self) -> bool {
        self.stopping.is_some()
    }

    /// Connections held (in any phase).
    pub fn connections(&self) -> usize {
        self.conns.iter().filter(|c| c.is_some()).count()
    }

    /// Push bytes queued in the whole server.
    pub fn queued_push_bytes(&self) -> usize {
        self.queued
    }

    pub(super) fn shared_stats(&self) -> Arc<StatsInner> {
        self.stats.clone()
    }

    // ---- internals ----

    fn mutant(&self, m: ServerMutant) -> bool {
        self.config.mutant == Some(m)
    }

    fn buffer(&mut self) -> Vec<u8> {
        let mut buf = self.pool.pop().unwrap_or_default();
        buf.clear();
        buf
    }

    fn queue_transmit(&mut self, t: quinn_proto::Transmit, mut buf: Vec<u8>) {
        buf.truncate(t.size);
        self.transmits.push_back(Transmit {
            destination: t.destination,
            src_ip: t.src_ip,
            ecn: t.ecn,
            contents: buf,
            segment_size: t.segment_size,
        });
    }

    fn event(&mut self, event: ServerEvent) {
        self.outputs.push_back(ServerOutput::Event(event));
    }

    fn conn(&mut self, ch: usize) -> Option<&mut Conn> {
        slot(&mut self.conns, ch)
    }

    fn touch(&mut self, ch: usize) {
        if let Some(conn) = self.conn(ch) {
            if !conn.touched {
                conn.touched = true;
                self.touched.push_back(ch);
            }
        }
    }

    // ---- inputs: the store and a stop ----

    // ---- timers ----

    /// The due timers: the connections' (at most the budget of them), then
    /// the hub's, the tokens', the store's tickets, the lease renewal, the
    /// restored devices' hold, the store's flush and the cluster's.
    fn on_timers(&mut self, now: Instant) {
        self.connection_timers(now);
        if self
            .hub
            .poll_timeout()
            .and_then(|m| self.clock.instant(m))
            .is_some_and(|at| at <= now)
        {
            self.hub.handle_timeout(self.clock.at(now));
        }
        self.expire_tokens(now);
        self.expire_tickets(now);
        if now >= self.next_renewal {
            self.renew_leases(now);
        }
        if self.next_hold.is_some_and(|at| now >= at) {
            self.hold_restored(now);
        }
        if self.stored && now >= self.next_flush {
            self.next_flush = now + self.config.flush_interval;
            self.flush_store();
        }
        self.cluster_timers(now);
    }

    /// The periodic lease renewal: an open connection is a live device
    /// (QUIC's keep-alive and idle timeout stand for the heartbeat).
    fn renew_leases(&mut self, now: Instant) {
        // Renewed as of each connection's last datagram, not now: a client
        // that fell silent must keep its real last heard.
        let at = self.clock.at(now);
        for (&session, &ch) in &self.sessions {
            if let Some(conn) = self.conns.get(ch).and_then(|c| c.as_deref()) {
                self.hub.heard(at, session, conn.session.last_heard);
            }
        }
        self.next_renewal = now + self.config.renewal();
        if !self.stored {
            self.hub.sweep(SWEEP_BUDGET);
        }
    }

    // ---- the pump ----

    fn pump(&mut self, now: Instant) {
        self.route(now);
        for _ in 0..self.budget.connections {
            let Some(ch) = self.touched.pop_front() else {
                break;
            };
            self.drive(ch, now);
        }
        if self.stored {
            self.dirty_users.extend(self.hub.take_touched());
        } else {
            self.hub.take_touched();
            self.hub.release_idle();
        }
    }

    // ---- WebSocket connections ----

    // ---- the session layer ----

    // ---- the cluster (only with `ServerConfig::cluster`) ----
}

fn slot(conns: &mut [Option<Box<Conn>>], ch: usize) -> Option<&mut Conn> {
    conns.get_mut(ch).and_then(|c| c.as_deref_mut())
}

#[cfg(test)]
mod tests;
