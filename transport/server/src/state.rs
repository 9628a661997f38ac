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

use super::cluster::{ClusterInput, ClusterLink, ClusterOutput, Finished, WireOp};
use super::conn::{ConnState, Handled, Step};
use super::hub::{Hub, HubOutput};
use super::quic::QuicLink;
use super::session::{
    tier_index, Binding, Flushed, Happened, Next, Overdue, Phase, Pushed, ReadEnd, Session, Write,
};
use super::store::{Batch, Loaded, StoreError};
use super::ws::{ws_code, WsId, WsLink, WsMessage, WsOut};
use super::{
    durable_user, not_saved, readmit_ms, reason_label, reason_text, record, transport_config,
    validate, with_retry_hint, PassBudget, ServerConfig, ServerError, ServerEvent, SettingError,
    Shed, Stats, StatsInner, KEEP_ALIVE_STEPS,
};
use crate::tls::{self, Identity};
use crate::token::TokenKeys;
use bytes::{Bytes, BytesMut};
use greendot_core::{Counters, EndReason, Millis, SessionId, Tier, UserId};
use greendot_proto::{self as proto, encode_frame, CloseCode, ServerFrame};
use quinn_proto::{ConnectionHandle, DatagramEvent, EcnCodepoint, Endpoint};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// Maps whose iteration order is the same in every run (std's default
/// hasher is seeded per process).
type DetHasher = BuildHasherDefault<std::collections::hash_map::DefaultHasher>;
type DetMap<K, V> = HashMap<K, V, DetHasher>;
type DetSet<K> = HashSet<K, DetHasher>;

/// Connections allowed past `max_connections` while they handshake.
const HANDSHAKE_HEADROOM: usize = 1024;
/// User names checked per lease-renewal tick by [`Hub::sweep`].
const SWEEP_BUDGET: usize = 4096;
/// How long a closing answer may take to reach the peer.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// How long a stop waits for the connections to go.
const STOP_LINGER: Duration = Duration::from_secs(2);
/// At most one stateless reset per this interval (quinn's default is 20 ms,
/// 50 a second): after a restart under 100,000 sessions, thousands of
/// clients that missed the Draining close (or a crashed process's clients)
/// each need one to come back before their idle timeout. A reset is
/// smaller than the packet that caused it, so this bounds work, not
/// amplification.
const MIN_RESET_INTERVAL: Duration = Duration::from_micros(100);
/// How often the server looks whether it still sheds while restored devices
/// wait ([`ServerState::hold_restored`]), and the step their deadlines move by.
const HOLD_TICK: Duration = Duration::from_secs(1);
const HOLD_STEP: Duration = Duration::from_secs(5);
/// How long a device disconnected by a saving drain lingers in the old
/// process: beyond any drain (the process ends first).
const DRAIN_HOLD: Millis = Millis(3_600_000);
/// How long a stop waits for the final store write.
const STOP_SAVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Transmit buffers kept for reuse: about what one call with the default
/// budget hands out; a larger buffer (a big GSO batch) is not kept.
const POOL_CAP: usize = 1024;
const POOL_BUFFER_CAP: usize = 16 * 1024;

/// Bytes read from a control stream per round: one maximal frame and its
/// prefix, so what is buffered per connection stays bounded.
fn read_budget(max_frame: usize) -> usize {
    max_frame + 4
}

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
    pub cluster: Option<super::cluster::ClusterCounters>,
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

/// How a new connection is accepted: its server config, one of the
/// keep-alive variants, picked by the state's own randomness.
pub(super) struct Accept {
    /// (keep-alive interval, server config with it).
    variants: Vec<(Duration, Arc<quinn_proto::ServerConfig>)>,
    rng: SmallRng,
}

impl Accept {
    pub(super) fn new(
        variants: Vec<(Duration, Arc<quinn_proto::ServerConfig>)>,
        seed: u64,
    ) -> Accept {
        Accept {
            variants,
            rng: SmallRng(seed | 1),
        }
    }

    /// A new connection's server config (`None`: the endpoint's own).
    pub(super) fn pick(&mut self) -> Option<&(Duration, Arc<quinn_proto::ServerConfig>)> {
        let n = self.variants.len() as u64;
        if n == 0 {
            return None;
        }
        let i = self.rng.below(n);
        self.variants.get(usize::try_from(i).ok()?)
    }
}

/// The admission rate: a token bucket of handshakes, refilled at `rate`,
/// holding at most one second's worth.
pub(super) struct Pacer {
    rate: f64,
    tokens: f64,
    at: Instant,
}

/// How the admission rate follows the loop's load (see
/// [`ServerInput::Load`]): cut by [`Admission::CUT`] in every report of an
/// overloaded loop (the socket dropped datagrams, or a pass left datagrams
/// unread past its budget: a backlog), raised by [`Admission::STEP`] of the
/// configured rate in every report of a loop with room (neither, and busy
/// less than [`Admission::ROOM`] of the time), never below
/// [`Admission::FLOOR`] of it. A loop that is busy but keeps up is at
/// capacity, not overloaded: the rate is kept.
/// A static rate is either above what a loaded machine can complete (then
/// handshakes pile up, time out and are retried, and the retries take the
/// CPU established sessions need) or wastes an idle one.
pub(super) struct Admission {
    pacer: Pacer,
    max: f64,
}

impl Admission {
    /// Busy share of the loop's wall time below which the rate goes back
    /// up (a CPU-starved loop counts as busy: its passes take longer).
    pub(super) const ROOM: f64 = 0.75;
    pub(super) const CUT: f64 = 0.7;
    pub(super) const STEP: f64 = 0.05;
    pub(super) const FLOOR: f64 = 0.05;

    fn new(per_sec: u32, now: Instant) -> Admission {
        let pacer = Pacer::new(per_sec, now);
        Admission {
            max: pacer.rate,
            pacer,
        }
    }

    /// Whether a handshake may be admitted now (takes nothing: the other
    /// sheds come between this and [`Admission::take`]).
    fn has_room(&mut self, now: Instant) -> bool {
        self.pacer.refill(now);
        self.pacer.tokens >= 1.0
    }

    /// Takes the token [`Admission::has_room`] found.
    fn take(&mut self) {
        debug_assert!(self.pacer.tokens >= 1.0, "take without room");
        self.pacer.tokens -= 1.0;
    }

    /// The current rate, handshakes per second.
    pub(super) fn rate(&self) -> f64 {
        self.pacer.rate
    }

    /// One load report; `true` if the rate was cut.
    fn on_load(&mut self, busy: f64, socket_drops: u64, backlogged_passes: u32) -> bool {
        let floor = (self.max * Self::FLOOR).max(1.0);
        let rate = self.pacer.rate;
        let (next, cut) = if socket_drops > 0 || backlogged_passes > 0 {
            ((rate * Self::CUT).max(floor), true)
        } else if busy < Self::ROOM {
            ((rate + self.max * Self::STEP).min(self.max), false)
        } else {
            (rate, false)
        };
        self.pacer.rate = next;
        self.pacer.tokens = self.pacer.tokens.min(next);
        cut
    }
}

impl Pacer {
    pub(super) fn new(per_sec: u32, now: Instant) -> Pacer {
        let rate = f64::from(per_sec.max(1));
        Pacer {
            rate,
            tokens: rate,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = self.at.max(now);
        self.tokens = (self.tokens + elapsed * self.rate).min(self.rate);
    }

    /// Takes a token if there is one.
    pub(super) fn admit(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// xorshift64*: jitter and connection ids need no cryptographic
/// randomness, only a seed and speed.
#[derive(Clone, Debug)]
pub(super) struct SmallRng(u64);

impl SmallRng {
    pub(super) fn new(seed: u64) -> SmallRng {
        SmallRng(seed | 1)
    }

    pub(super) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform enough in `0..n` (`n` > 0).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// Connection ids from the seed (quinn's own generator draws from the
/// thread's randomness). 8 bytes, as quinn's default.
struct SeededCids {
    rng: SmallRng,
}

impl quinn_proto::ConnectionIdGenerator for SeededCids {
    fn generate_cid(&mut self) -> quinn_proto::ConnectionId {
        quinn_proto::ConnectionId::new(&self.rng.next().to_le_bytes())
    }

    fn cid_len(&self) -> usize {
        8
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// The state's clock: Unix milliseconds, read as the wall clock at a base
/// instant plus the monotonic time since, so it never goes backwards and
/// saved wall-clock instants (last seen) mean the same after a restart.
///
/// A step of the wall clock (NTP, a resumed VM) is never taken at once: a
/// step forward taken whole would expire every heartbeat, grace and lease
/// together (every healthy session reaped, everyone shown offline), a step
/// back would run time backwards. It is slewed in instead: the clock runs
/// up to [`SLEW_PER_MS`] faster or slower until it has caught up, so every
/// window the core measures lasts at least 99% of its length in real time,
/// and last seen drifts back to the wall clock (a one-minute step in 100
/// minutes).
#[derive(Clone, Copy, Debug)]
struct Clock {
    start: Instant,
    start_ms: u64,
    /// What is still to be slewed in (wall clock minus this clock), in ms.
    pending: i64,
}

/// The slew rate: 1 ms per 100 ms.
const SLEW_PER_MS: u64 = 100;

impl Clock {
    fn new(start: Instant, unix_ms: u64) -> Clock {
        Clock {
            start,
            start_ms: unix_ms,
            pending: 0,
        }
    }

    /// `instant` on this clock.
    fn at(&self, instant: Instant) -> Millis {
        let elapsed = instant.saturating_duration_since(self.start);
        let elapsed = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        let slewed = (elapsed / SLEW_PER_MS).min(self.pending.unsigned_abs());
        let run = if self.pending >= 0 {
            elapsed.saturating_add(slewed)
        } else {
            elapsed - slewed
        };
        Millis(self.start_ms.saturating_add(run))
    }

    /// When a core deadline is due. `at()` truncates to the millisecond, so
    /// an input stamped `m` happened up to 1 ms after `m`: waking at `at + 1`
    /// ms keeps every window the core measures (debounce, grace) at least as
    /// long in real time, never a fraction of a millisecond short (less the
    /// slew).
    fn instant(&self, at: Millis) -> Option<Instant> {
        let run = at.0.saturating_sub(self.start_ms);
        let p = self.pending.unsigned_abs();
        // Invert `at()`: while slewing, `run = elapsed * (1 ± 1/SLEW_PER_MS)`;
        // once `p` is slewed in (after `p * SLEW_PER_MS` ms), `run = elapsed ± p`.
        let elapsed = if self.pending >= 0 {
            let slewing = p.saturating_mul(SLEW_PER_MS + 1);
            if run <= slewing {
                run.saturating_mul(SLEW_PER_MS) / (SLEW_PER_MS + 1)
            } else {
                run - p
            }
        } else {
            let slewing = p.saturating_mul(SLEW_PER_MS - 1);
            if run <= slewing {
                run.saturating_mul(SLEW_PER_MS).div_ceil(SLEW_PER_MS - 1)
            } else {
                run.saturating_add(p)
            }
        };
        self.start
            .checked_add(Duration::from_millis(elapsed.saturating_add(1)))
    }

    /// The wall clock reads `unix_ms` at `now`: the difference is slewed in
    /// from here on (replacing what was still pending).
    fn set(&mut self, now: Instant, unix_ms: u64) {
        let current = self.at(now).0;
        self.start = now;
        self.start_ms = current;
        self.pending = i64::try_from(i128::from(unix_ms) - i128::from(current)).unwrap_or(0);
    }
}

/// A connection's binding. The QUIC link stays inline (the `Conn` is
/// boxed already; boxing it too would cost every QUIC connection an
/// allocation); a WebSocket slot pays its size for now.
#[allow(clippy::large_enum_variant)]
enum Link {
    Quic(QuicLink),
    Ws(WsLink),
}

impl Link {
    fn quic(&mut self) -> Option<&mut quinn_proto::Connection> {
        match self {
            Link::Quic(l) => Some(&mut l.quic),
            Link::Ws(_) => None,
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        match self {
            Link::Quic(l) => l.handle_timeout(now),
            Link::Ws(l) => l.handle_timeout(now),
        }
    }

    fn poll_timeout(&mut self) -> Option<Instant> {
        match self {
            Link::Quic(l) => l.poll_timeout(),
            Link::Ws(l) => l.poll_timeout(),
        }
    }

    fn is_ws(&self) -> bool {
        matches!(self, Link::Ws(_))
    }

    /// A QUIC connection that negotiated HTTP/3 (known once connected).
    fn is_webtransport(&self) -> bool {
        matches!(self, Link::Quic(l) if l.is_webtransport())
    }
}

impl Binding for Link {
    fn remote(&self) -> SocketAddr {
        match self {
            Link::Quic(l) => l.remote(),
            Link::Ws(l) => l.remote(),
        }
    }
    fn has_control(&self) -> bool {
        match self {
            Link::Quic(l) => l.has_control(),
            Link::Ws(l) => l.has_control(),
        }
    }
    fn read_control(
        &mut self,
        budget: usize,
        reader: &mut proto::FrameReader,
    ) -> Option<(usize, ReadEnd)> {
        match self {
            Link::Quic(l) => l.read_control(budget, reader),
            Link::Ws(l) => l.read_control(budget, reader),
        }
    }
    fn write_control(&mut self, bytes: &[u8]) -> Write {
        match self {
            Link::Quic(l) => l.write_control(bytes),
            Link::Ws(l) => l.write_control(bytes),
        }
    }
    fn finish_control(&mut self) -> bool {
        match self {
            Link::Quic(l) => l.finish_control(),
            Link::Ws(l) => l.finish_control(),
        }
    }
    fn open_pushes(&mut self) -> bool {
        match self {
            Link::Quic(l) => l.open_pushes(),
            Link::Ws(l) => l.open_pushes(),
        }
    }
    fn write_push(&mut self, tier: usize, bytes: &[u8]) -> Write {
        match self {
            Link::Quic(l) => l.write_push(tier, bytes),
            Link::Ws(l) => l.write_push(tier, bytes),
        }
    }
    fn close(&mut self, now: Instant, code: CloseCode, text: &[u8]) {
        match self {
            Link::Quic(l) => l.close(now, code, text),
            Link::Ws(l) => l.close(now, code, text),
        }
    }
}

/// Slots of QUIC connections are even (twice quinn's handle), those of
/// WebSocket connections odd: both live in one table.
fn quic_slot(ch: ConnectionHandle) -> usize {
    ch.0 * 2
}

/// One connection: its session layer over its binding (QUIC or WebSocket).
struct Conn {
    link: Link,
    session: Session,
    /// Tells a reused slot from the connection a store ticket answers.
    serial: u64,
    /// The instant under which this connection sits in the timer set.
    timer: Option<Instant>,
    /// In the state's `touched` list.
    touched: bool,
    /// Counted among the open connections (and its binding's): set once
    /// when the handshake ends and the connection is admitted, cleared once
    /// when its end is reported, so the counts never go below zero.
    counted: bool,
}

/// What a durable write in flight is for.
enum Ticket {
    /// A request's answer waits for it.
    Answer {
        ch: usize,
        serial: u64,
        handled: Handled,
        deadline: Instant,
    },
    /// The final write of a stop.
    Stop { deadline: Instant },
    /// A request's answer waits for the owner of its user (in a cluster);
    /// the cluster link answers before `deadline`, which is a backstop.
    Cluster {
        ch: usize,
        serial: u64,
        handled: Handled,
        deadline: Instant,
    },
}

impl Ticket {
    fn deadline(&self) -> Instant {
        match self {
            Ticket::Answer { deadline, .. }
            | Ticket::Stop { deadline }
            | Ticket::Cluster { deadline, .. } => *deadline,
        }
    }
}

enum Stopping {
    /// Connections are closing, until `until`.
    Closing { save: bool, until: Instant },
    /// The final store write is in flight (its ticket answers it).
    Saving,
    /// [`ServerOutput::Stopped`] was emitted.
    Done,
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
    pub(super) timers: BTreeSet<(Instant, usize)>,
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
    /// devices it disconnects linger for [`DRAIN_HOLD`], not their grace.
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

/// Takes `n` bits of a seed apart for each use, so uses do not correlate.
fn derive(seed: u64, purpose: u64) -> u64 {
    let mut rng = SmallRng::new(seed ^ purpose.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    rng.next();
    rng.next()
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
        let cluster = config.cluster.clone().map(|settings| {
            Box::new(ClusterLink::new(
                settings,
                &config.core,
                0,
                config.limits.max_name_len,
            ))
        });
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
            timers: BTreeSet::new(),
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
            at = at.min(*t);
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
        !self.touched.is_empty() || self.timers.first().is_some_and(|&(at, _)| at <= now)
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

    /// Checks the state's own bookkeeping against itself (for simulators
    /// and tests; it walks every connection): the byte counts of the push
    /// queues, the session and handshake tables, the open-connection count,
    /// the timer and touched sets, the store tickets.
    pub fn check(&self) -> Result<(), String> {
        let mut queued = 0;
        let (mut open, mut open_ws, mut open_wt, mut handshaking) =
            (0usize, 0usize, 0usize, 0usize);
        let mut per_address: BTreeMap<IpAddr, usize> = BTreeMap::new();
        let touched: BTreeSet<usize> = self.touched.iter().copied().collect();
        for (ch, conn) in self.conns.iter().enumerate() {
            let Some(conn) = conn.as_deref() else {
                continue;
            };
            conn.session
                .check()
                .map_err(|e| format!("connection {ch}: {e}"))?;
            queued += conn.session.queued;
            match &conn.session.phase {
                Phase::Handshaking { ip, .. } => {
                    handshaking += 1;
                    *per_address.entry(*ip).or_default() += 1;
                }
                Phase::WaitingStore { ticket } => {
                    let waits_here = matches!(
                        self.tickets.get(ticket),
                        Some(Ticket::Answer { ch: c, serial, .. } | Ticket::Cluster { ch: c, serial, .. })
                            if *c == ch && *serial == conn.serial
                    );
                    if !waits_here {
                        return Err(format!(
                            "connection {ch} waits for ticket {ticket}, which is not its"
                        ));
                    }
                }
                _ => {}
            }
            if conn.session.phase.is_open() != conn.counted {
                return Err(format!(
                    "connection {ch}: phase {:?} but counted open: {}",
                    conn.session.phase, conn.counted
                ));
            }
            if conn.counted {
                open += 1;
                open_ws += usize::from(conn.link.is_ws());
                open_wt += usize::from(conn.link.is_webtransport());
            }
            if let Some(at) = conn.timer {
                if !self.timers.contains(&(at, ch)) {
                    return Err(format!(
                        "connection {ch}: its timer is not in the timer set"
                    ));
                }
            }
            if conn.touched != touched.contains(&ch) {
                return Err(format!("connection {ch}: touched mark and list disagree"));
            }
        }
        if queued != self.queued {
            return Err(format!(
                "{} push bytes counted, {queued} queued",
                self.queued
            ));
        }
        if self.queued > self.config.push_budget_bytes {
            return Err(format!(
                "{} push bytes queued, over the budget",
                self.queued
            ));
        }
        if handshaking != self.handshaking {
            return Err(format!(
                "{} handshakes counted, {handshaking} in flight",
                self.handshaking
            ));
        }
        let counted: BTreeMap<IpAddr, usize> =
            self.per_address.iter().map(|(k, v)| (*k, *v)).collect();
        if counted != per_address {
            return Err("handshakes by address disagree with the connections".into());
        }
        let counts = [
            ("", &self.stats.open, open),
            (" WebSocket", &self.stats.open_websocket, open_ws),
            (" WebTransport", &self.stats.open_webtransport, open_wt),
        ];
        for (binding, count, are) in counts {
            let counted = count.load(Ordering::Relaxed);
            if counted != are {
                return Err(format!(
                    "{counted}{binding} connections counted open, {are} are"
                ));
            }
        }
        for &(at, ch) in &self.timers {
            let owned = self
                .conns
                .get(ch)
                .and_then(|c| c.as_deref())
                .is_some_and(|c| c.timer == Some(at));
            if !owned {
                return Err(format!(
                    "a timer for connection {ch} that has no such timer"
                ));
            }
        }
        for (&session, &ch) in &self.sessions {
            let conn = self.conns.get(ch).and_then(|c| c.as_deref());
            if !conn.is_some_and(|c| c.session.id == Some(session) && !c.session.is_ended()) {
                return Err(format!(
                    "session {session:?} routed to connection {ch}, not its"
                ));
            }
        }
        if self.tickets.len() != self.ticket_deadlines.len()
            || self
                .ticket_deadlines
                .iter()
                .any(|(at, t)| self.tickets.get(t).map(Ticket::deadline) != Some(*at))
        {
            return Err("store tickets and their deadlines disagree".into());
        }
        Ok(())
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

    /// A new client's first packet: shed it early and cheaply when the
    /// server is past what it can take, otherwise accept it.
    fn on_incoming(&mut self, now: Instant, incoming: quinn_proto::Incoming, mut buf: Vec<u8>) {
        let config = &self.config;
        let ip = incoming.remote_address().ip();
        let from_ip = self.per_address.get(&ip).copied().unwrap_or(0);
        let crowded = self.handshaking >= config.retry_threshold
            || from_ip >= config.max_handshakes_per_address;
        // Connections still in their handshake count too: past the cap plus
        // some headroom (where clients still get the typed
        // `TooManyConnections` close) a new one is refused outright.
        let cap = config.max_connections.saturating_add(HANDSHAKE_HEADROOM);
        let shed = if self.stopping.is_some() {
            Some(Shed::Draining)
        } else if !self.admission.has_room(now) {
            // Refused now rather than after a Retry's round trip: a Retry
            // brings the Initial straight back, to be refused then.
            Some(Shed::Rate)
        } else if crowded && !incoming.remote_address_validated() && incoming.may_retry() {
            Some(Shed::Retry)
        } else if from_ip >= config.max_handshakes_per_address {
            Some(Shed::PerAddress)
        } else if self.endpoint.open_connections() >= cap {
            Some(Shed::Capacity)
        } else {
            None
        };
        if let Some(reason) = shed {
            if !self.shed_answers.admit(now) {
                // A herd or a flood: answering each Initial would take the
                // loop the admitted handshakes need.
                self.stats.shed(Shed::Ignored);
                self.endpoint.ignore(incoming);
                self.recycle(buf);
                return;
            }
            self.stats.shed(reason);
            let t = match reason {
                Shed::Retry => match self.endpoint.retry(incoming, &mut buf) {
                    Ok(t) => t,
                    Err(e) => self.endpoint.refuse(e.into_incoming(), &mut buf),
                },
                _ => self.endpoint.refuse(incoming, &mut buf),
            };
            self.queue_transmit(t, buf);
            return;
        }
        self.admission.take();
        let remote = incoming.remote_address();
        let server_config = self.accept.pick().map(|(_, c)| c.clone());
        match self.endpoint.accept(incoming, now, &mut buf, server_config) {
            Ok((ch, quic)) => {
                self.recycle(buf);
                self.insert(ch, quic, ip, now);
            }
            Err(e) => {
                match e.response {
                    Some(t) => self.queue_transmit(t, buf),
                    None => self.recycle(buf),
                }
                debug!(%remote, error = %e.cause, "handshake refused");
                self.stats.reject("handshake");
                self.event(ServerEvent::Rejected {
                    remote,
                    reason: format!("handshake failed: {}", e.cause),
                });
            }
        }
    }

    /// Devices restored at start come back at the rate the server admits
    /// handshakes, which under a herd can be well below the configured one
    /// the first estimate used (`restore`). While the server still sheds,
    /// each still waiting lingers until at least its grace past the shed
    /// client's retry spread; once the shedding stops, their grace runs
    /// out as usual. Deadlines go up in steps of [`HOLD_STEP`] so that a
    /// device's timer moves once per step, not once per tick.
    fn hold_restored(&mut self, now: Instant) {
        self.next_hold = Some(now + HOLD_TICK);
        let shed = self.stats.shed_total();
        if shed == self.shed_seen {
            return;
        }
        self.shed_seen = shed;
        let at = self.clock.at(now);
        let step = HOLD_STEP.as_millis() as u64;
        let from = Millis(at.0.saturating_add(self.retry_ms()).div_ceil(step) * step);
        // Within one step every deadline is already there.
        if from <= self.held_from {
            return;
        }
        self.held_from = from;
        if self.hub.hold_restored(at, from) == 0 {
            self.next_hold = None;
        }
    }

    /// The reconnect spread suggested in a close for shedding or draining:
    /// the time to readmit every open connection at the admission rate.
    fn retry_ms(&self) -> u64 {
        let open = self.stats.open.load(Ordering::Relaxed);
        readmit_ms(open, self.config.max_handshakes_per_sec)
    }

    /// A new connection, counted among the handshakes in flight, with
    /// `hello_timeout` from now to complete and send its hello.
    fn insert(
        &mut self,
        ch: ConnectionHandle,
        quic: quinn_proto::Connection,
        ip: IpAddr,
        now: Instant,
    ) {
        self.next_serial += 1;
        let phase = Phase::Handshaking {
            ip,
            hello_by: now + self.config.hello_timeout,
        };
        let session = Session::new(
            ConnState::new(self.keys.clone(), self.config.rate),
            self.config.max_hello.min(self.config.max_frame),
            quic.remote_address(),
            self.clock.at(now),
            phase,
        );
        let ch = quic_slot(ch);
        let conn = Conn {
            link: Link::Quic(QuicLink::new(quic)),
            session,
            serial: self.next_serial,
            timer: None,
            touched: false,
            counted: false,
        };
        if self.conns.len() <= ch {
            self.conns.resize_with(ch + 1, || None);
        }
        self.conns[ch] = Some(Box::new(conn));
        self.handshaking += 1;
        *self.per_address.entry(ip).or_default() += 1;
        self.stats
            .handshaking
            .store(self.handshaking, Ordering::Relaxed);
        self.touch(ch);
    }

    /// A handshake no longer in flight (it completed, or the connection
    /// ended during it).
    fn handshake_over(&mut self, ip: IpAddr) {
        self.handshaking = self.handshaking.saturating_sub(1);
        if let Some(n) = self.per_address.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_address.remove(&ip);
            }
        }
        self.stats
            .handshaking
            .store(self.handshaking, Ordering::Relaxed);
    }

    /// A handshake the client abandoned or lost (its network came back
    /// mid-attempt, or it gave up): counted apart from bad input.
    fn handshake_failed(&mut self, remote: SocketAddr, error: &str, aborted: bool) {
        debug!(%remote, %error, "handshake failed");
        if aborted {
            // Not bad input: a client whose network went away mid-handshake.
            self.stats
                .handshakes_aborted
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.stats.reject("handshake");
        self.event(ServerEvent::Rejected {
            remote,
            reason: format!("handshake failed: {error}"),
        });
    }

    /// A report of the loop's load: the admission rate follows it.
    fn on_load(&mut self, busy_permille: u32, socket_drops: u64, backlogged_passes: u32) {
        self.stats
            .loop_busy_permille
            .store(u64::from(busy_permille), Ordering::Relaxed);
        let busy = f64::from(busy_permille) / 1000.0;
        if self
            .admission
            .on_load(busy, socket_drops, backlogged_passes)
        {
            self.stats.admission_cuts.fetch_add(1, Ordering::Relaxed);
        }
        self.stats
            .admission_rate
            .store(self.admission.rate() as u64, Ordering::Relaxed);
    }

    // ---- inputs: the store and a stop ----

    fn store_done(&mut self, now: Instant, ticket: u64, result: Result<(), StoreError>) {
        let Some(waiting) = self.tickets.remove(&ticket) else {
            // Timed out already (answered then), or unknown.
            return;
        };
        self.ticket_deadlines.remove(&(waiting.deadline(), ticket));
        match waiting {
            Ticket::Answer {
                ch,
                serial,
                handled,
                ..
            } => self.saved(now, ch, serial, ticket, handled, result.err()),
            Ticket::Cluster { .. } => {}
            Ticket::Stop { .. } => {
                if let Err(e) = result {
                    warn!(error = %e, "the store was not written at the stop");
                    self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                }
                self.stopped();
            }
        }
    }

    /// A durable write finished (or failed, or timed out): answer the
    /// request that waited for it, then the frames behind it.
    fn saved(
        &mut self,
        now: Instant,
        ch: usize,
        serial: u64,
        ticket: u64,
        handled: Handled,
        error: Option<StoreError>,
    ) {
        let handled = match error {
            None => handled,
            Some(error) => {
                self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                not_saved(handled, &error.to_string())
            }
        };
        let Some(conn) = self.conn(ch) else { return };
        if conn.serial != serial {
            return;
        }
        match conn.session.phase {
            Phase::WaitingStore { ticket: t } if t == ticket => conn.session.phase = Phase::Live,
            _ => return,
        }
        self.answer(ch, now, handled);
        // Frames that waited behind it.
        self.read_control(ch, now);
        self.touch(ch);
    }

    fn stop(&mut self, now: Instant, code: CloseCode, text: Vec<u8>, save: bool) {
        if self.stopping.is_some() {
            return;
        }
        self.endpoint.set_server_config(None);
        // Clients reconnecting to the next process are spread over the time
        // it needs to readmit them all.
        let text = match code {
            CloseCode::Draining => with_retry_hint(&text, self.retry_ms()),
            _ => text,
        };
        // A device whose grace ran out during the drain would be saved as
        // gone and shown offline, though its client comes back to the next
        // process: the saved ones get their grace there. (With a cluster
        // the owners hold the devices, each with its grace.)
        self.drain_holds = save && self.stored && self.cluster.is_none();
        for ch in 0..self.conns.len() {
            if self.conns[ch].is_some() {
                self.close(ch, now, code, &text);
            }
        }
        self.stopping = Some(Stopping::Closing {
            save,
            until: now + STOP_LINGER,
        });
    }

    /// Once every connection is gone (or the linger is over): the final
    /// store write, then the end.
    fn check_stop(&mut self, now: Instant) {
        let Some(Stopping::Closing { save, until }) = self.stopping else {
            return;
        };
        if self.conns.iter().any(Option::is_some) && now < until {
            return;
        }
        if save && self.stored {
            let batch = Batch {
                drained: Some(self.hub.live_devices()),
                ..self.changed_records()
            };
            let ticket = self.ticket(Ticket::Stop {
                deadline: now + STOP_SAVE_TIMEOUT,
            });
            self.outputs
                .push_back(ServerOutput::Store(StoreRequest::Durable {
                    ticket,
                    batch,
                    timeout: STOP_SAVE_TIMEOUT,
                }));
            self.stopping = Some(Stopping::Saving);
        } else {
            self.stopped();
        }
    }

    fn stopped(&mut self) {
        self.stopping = Some(Stopping::Done);
        self.outputs.push_back(ServerOutput::Stopped);
    }

    fn ticket(&mut self, ticket: Ticket) -> u64 {
        self.next_ticket += 1;
        self.ticket_deadlines
            .insert((ticket.deadline(), self.next_ticket));
        self.tickets.insert(self.next_ticket, ticket);
        self.next_ticket
    }

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

    /// The due connection timers, at most the budget of them (earliest
    /// first; the rest stay due for the next call).
    fn connection_timers(&mut self, now: Instant) {
        for _ in 0..self.budget.timers {
            let Some(&(at, ch)) = self.timers.first() else {
                break;
            };
            if at > now {
                break;
            }
            self.timers.pop_first();
            let Some(conn) = self.conn(ch) else {
                continue;
            };
            conn.timer = None;
            conn.link.handle_timeout(now);
            match conn.session.overdue(now) {
                Some(Overdue::Close(code, text)) => self.close(ch, now, code, &text),
                Some(Overdue::NoHello { handshaking }) => {
                    if handshaking {
                        self.stats.shed(Shed::HandshakeTimeout);
                    }
                    self.close(ch, now, CloseCode::HelloTimeout, b"no hello in time");
                }
                None => {}
            }
            self.touch(ch);
        }
    }

    /// Durable writes that took too long: answered "not saved".
    fn expire_tickets(&mut self, now: Instant) {
        while let Some(&(deadline, ticket)) = self.ticket_deadlines.first() {
            if deadline > now {
                break;
            }
            self.ticket_deadlines.pop_first();
            let Some(waiting) = self.tickets.remove(&ticket) else {
                continue;
            };
            let error = StoreError::Timeout(self.config.store_timeout);
            match waiting {
                Ticket::Answer {
                    ch,
                    serial,
                    handled,
                    ..
                } => self.saved(now, ch, serial, ticket, handled, Some(error)),
                Ticket::Cluster {
                    ch,
                    serial,
                    handled,
                    ..
                } => {
                    let handled = not_saved(handled, "the owner of this user did not answer");
                    self.saved(now, ch, serial, ticket, handled, None);
                }
                Ticket::Stop { .. } => {
                    warn!("the store was not written at the stop: no commit in time");
                    self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                    self.stopped();
                }
            }
        }
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

    /// The cluster link's timers (its cores' and its requests' deadlines).
    fn cluster_timers(&mut self, now: Instant) {
        if let Some(c) = self.cluster.as_deref_mut() {
            let at = self.clock.at(now);
            let core_due = c
                .poll_timeout()
                .and_then(|m| self.clock.instant(m))
                .is_some_and(|t| t <= now);
            if core_due || c.poll_deadline(now).is_some_and(|t| t <= now) {
                c.handle_timeout(now, at);
            }
        }
    }

    /// The records of every user changed since the last write.
    fn changed_records(&mut self) -> Batch {
        self.dirty_users.extend(self.hub.take_touched());
        let mut users: Vec<UserId> = self.dirty_users.drain().collect();
        users.sort_unstable();
        let users = users
            .into_iter()
            .filter_map(|u| record(&self.hub, u))
            .collect();
        Batch {
            users,
            alive_at: Some(self.clock.at(self.last_now).0),
            ..Batch::default()
        }
    }

    fn flush_store(&mut self) {
        let batch = self.changed_records();
        // Users are freed only once their records are taken: a freed user's
        // record can no longer be read.
        self.hub.release_idle();
        self.hub.sweep(SWEEP_BUDGET);
        self.outputs
            .push_back(ServerOutput::Store(StoreRequest::Behind(batch)));
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

    /// Hands a connection's endpoint events to the endpoint; `true` once the
    /// connection is drained (the endpoint has forgotten it: nothing more may
    /// be handed over for it).
    fn endpoint_events(&mut self, ch: usize) -> bool {
        let Some(quic) = slot(&mut self.conns, ch).and_then(|c| c.link.quic()) else {
            return false;
        };
        while let Some(event) = quic.poll_endpoint_events() {
            let drained = event.is_drained();
            if let Some(back) = self.endpoint.handle_event(ConnectionHandle(ch / 2), event) {
                quic.handle_event(back);
            }
            if drained {
                return true;
            }
        }
        false
    }

    /// Everything a connection has to say and do, then its transmits and its
    /// timer.
    fn drive(&mut self, ch: usize, now: Instant) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        conn.touched = false;
        let mut drained = false;
        loop {
            if !drained {
                drained = self.endpoint_events(ch);
            }
            let Some(conn) = slot(&mut self.conns, ch) else {
                return;
            };
            let refuse = conn.session.control_done();
            let (happened, aborted) = match &mut conn.link {
                Link::Quic(link) => {
                    let Some(event) = link.quic.poll() else {
                        break;
                    };
                    let aborted = match &event {
                        quinn_proto::Event::ConnectionLost { reason } => {
                            super::handshake_aborted(reason)
                        }
                        _ => false,
                    };
                    (link.translate(event, refuse, now), aborted)
                }
                Link::Ws(link) => {
                    let Some(happened) = link.poll() else {
                        break;
                    };
                    (Some(happened), false)
                }
            };
            if let Some(happened) = happened {
                self.on_happened(ch, now, happened, aborted);
            }
        }
        self.check_address(ch, now);
        self.route(now);
        if drained {
            self.remove(ch);
            return;
        }
        if let Some(Link::Ws(link)) = slot(&mut self.conns, ch).map(|c| &mut c.link) {
            let id = link.id;
            let gone = link.gone;
            while let Some(out) = link.poll_out() {
                self.outputs.push_back(match out {
                    WsOut::Send(bytes) => ServerOutput::WsSend { id, bytes },
                    WsOut::Ping => ServerOutput::WsPing { id },
                    WsOut::Close(code, reason) => ServerOutput::WsClose { id, code, reason },
                    WsOut::Credit(bytes) => ServerOutput::WsCredit { id, bytes },
                });
            }
            if gone {
                self.remove(ch);
                return;
            }
        }
        let segments = self.max_datagrams;
        loop {
            let mut buf = self.buffer();
            let Some(quic) = slot(&mut self.conns, ch).and_then(|c| c.link.quic()) else {
                self.recycle(buf);
                break;
            };
            // quinn-proto writes each transmit from the start of `buf`.
            match quic.poll_transmit(now, segments, &mut buf) {
                Some(t) => self.queue_transmit(t, buf),
                None => {
                    self.recycle(buf);
                    break;
                }
            }
        }
        // Transmitting can emit endpoint events (new connection ids).
        if self.endpoint_events(ch) {
            self.remove(ch);
            return;
        }
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        let next = match (conn.link.poll_timeout(), conn.session.phase.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if next != conn.timer {
            if let Some(old) = conn.timer.take() {
                self.timers.remove(&(old, ch));
            }
            if let Some(at) = next {
                conn.timer = Some(at);
                self.timers.insert((at, ch));
            }
        }
    }

    fn remove(&mut self, ch: usize) {
        self.end(ch, false, "drained".into());
        debug!(slot = ch, "connection forgotten");
        if let Some(conn) = self.conns.get_mut(ch).and_then(Option::take) {
            if let Some(at) = conn.timer {
                self.timers.remove(&(at, ch));
            }
            if let Link::Ws(link) = &conn.link {
                self.ws.remove(&link.id);
                self.ws_free.push(ch);
            }
        }
    }

    // ---- WebSocket connections ----

    /// A WebSocket connection is open (its TLS and upgrade are the
    /// driver's): it counts as connected at once, with `hello_timeout` for
    /// its hello, under the same connection cap as QUIC.
    fn ws_opened(&mut self, now: Instant, id: WsId, remote: SocketAddr) {
        if self.ws.contains_key(&id) {
            return;
        }
        if self.stopping.is_some() {
            self.outputs.push_back(ServerOutput::WsClose {
                id,
                code: Some(ws_code(CloseCode::Draining)),
                reason: "server draining".into(),
            });
            return;
        }
        let ch = self.ws_free.pop().unwrap_or_else(|| {
            // The next odd slot past the table.
            let n = self.conns.len();
            n | 1
        });
        if self.conns.len() <= ch {
            self.conns.resize_with(ch + 1, || None);
        }
        self.next_serial += 1;
        let hello_by = now + self.config.hello_timeout;
        let session = Session::new(
            ConnState::new(self.keys.clone(), self.config.rate),
            self.config.max_hello.min(self.config.max_frame),
            remote,
            self.clock.at(now),
            Phase::AwaitingHello { hello_by },
        );
        let link = WsLink::new(
            id,
            remote,
            now,
            self.config.max_frame,
            self.config.keep_alive,
            self.config.idle_timeout,
            self.ws_rng.next() & 1 == 0,
        );
        self.conns[ch] = Some(Box::new(Conn {
            link: Link::Ws(link),
            session,
            serial: self.next_serial,
            timer: None,
            touched: false,
            counted: false,
        }));
        self.ws.insert(id, ch);
        self.on_connected(ch, now);
        self.touch(ch);
    }

    /// A message from WebSocket `id`: a sign of life, and work for its session.
    fn ws_received(&mut self, now: Instant, id: WsId, message: WsMessage) {
        let heard = self.clock.at(now);
        let renew = !self.mutant(ServerMutant::LeaseNotRenewedOnTraffic);
        let Some(ch) = self.ws.get(&id).copied() else {
            return;
        };
        let Some(conn) = self.conn(ch) else { return };
        if let Link::Ws(link) = &mut conn.link {
            if renew {
                conn.session.last_heard = heard;
            }
            link.received(now, message);
        }
        self.touch(ch);
    }

    fn with_ws(&mut self, id: WsId, f: impl FnOnce(&mut WsLink)) {
        let Some(ch) = self.ws.get(&id).copied() else {
            return;
        };
        if let Some(Link::Ws(link)) = self.conn(ch).map(|c| &mut c.link) {
            f(link);
        }
        self.touch(ch);
    }

    fn check_address(&mut self, ch: usize, now: Instant) {
        let Some(conn) = self.conn(ch) else { return };
        let to = conn.link.remote();
        if to == conn.session.address || conn.session.is_ended() {
            return;
        }
        let from = std::mem::replace(&mut conn.session.address, to);
        let session = conn.session.id;
        self.stats.migrations.fetch_add(1, Ordering::Relaxed);
        debug!(?session, %from, %to, "migrated");
        self.event(ServerEvent::Migrated {
            session: session.map(|s| self.wire(s)),
            from,
            to,
        });
        if self.mutant(ServerMutant::MigrationAsDisconnect) {
            self.close(ch, now, CloseCode::Normal, b"address changed");
        }
    }

    /// What the binding reported, in session terms.
    fn on_happened(&mut self, ch: usize, now: Instant, happened: Happened, aborted: bool) {
        match happened {
            Happened::Connected => self.on_connected(ch, now),
            Happened::Lost { logout, reason } => {
                let Some(conn) = self.conn(ch) else { return };
                if matches!(conn.session.phase, Phase::Handshaking { .. }) {
                    let remote = conn.session.address;
                    self.handshake_failed(remote, &reason, aborted);
                }
                self.end(ch, logout, reason);
            }
            Happened::ControlReadable => self.read_control(ch, now),
            Happened::ControlWritable => {
                self.write_answers(ch, now);
                // Requests held back behind unread answers.
                self.read_control(ch, now);
            }
            Happened::PushWritable(tier) => self.write_pushes(ch, now, tier),
            Happened::PushStopped => {
                // A client that stops a push stream would stay online while
                // missing every update of that tier: a protocol error.
                let Some(conn) = self.conn(ch) else { return };
                let remote = conn.session.address;
                self.stats.reject("StreamStopped");
                self.event(ServerEvent::Rejected {
                    remote,
                    reason: "the client stopped a push stream".into(),
                });
                self.close(
                    ch,
                    now,
                    CloseCode::StreamStopped,
                    b"the client stopped a push stream",
                );
            }
            Happened::ControlStopped => {
                // The client reads no more answers: what waits for it is
                // dropped (the write fails), which may unblock the reading
                // or the close.
                self.write_answers(ch, now);
                self.after_answers(ch, now);
            }
            Happened::AnswersDelivered => self.after_answers(ch, now),
        }
    }

    /// The answers are all out (or dropped): close if a close was waiting
    /// for them, otherwise read the requests held back.
    fn after_answers(&mut self, ch: usize, now: Instant) {
        let Some(conn) = self.conn(ch) else { return };
        if !conn.link.has_control() || !conn.session.answers_out() {
            return;
        }
        match conn.session.answers_delivered() {
            Some((code, text)) => self.close(ch, now, code, &text),
            None => self.read_control(ch, now),
        }
    }

    fn on_connected(&mut self, ch: usize, now: Instant) {
        let hello = now + self.config.hello_timeout;
        let Some(conn) = self.conn(ch) else { return };
        // Counted once, and never after its end was reported (a late
        // report must not count a connection nothing will uncount).
        if conn.counted || conn.session.is_ended() {
            return;
        }
        // The hello is due `hello_timeout` after the first packet (set when
        // accepted), not after a slow handshake.
        let hello_by = conn.session.phase.deadline().unwrap_or(hello);
        let ip = conn.session.connected(hello_by);
        if let Some(ip) = ip {
            self.handshake_over(ip);
        }
        let stats = self.stats.clone();
        let open = stats.open.load(Ordering::Relaxed);
        stats.total.fetch_add(1, Ordering::Relaxed);
        if open >= self.config.max_connections {
            stats.reject("TooManyConnections");
            let text = with_retry_hint(
                b"TooManyConnections: the server is at its connection cap",
                self.retry_ms(),
            );
            // Connected but never counted: closed and reported at once.
            let Some(conn) = self.conn(ch) else { return };
            conn.link.close(now, CloseCode::TooManyConnections, &text);
            conn.session.end();
            self.touch(ch);
            self.event(ServerEvent::Closed {
                session: None,
                logout: false,
                reason: "closed by the server: TooManyConnections".into(),
            });
            return;
        }
        let Some(conn) = self.conn(ch) else { return };
        conn.counted = true;
        let (ws, wt) = (conn.link.is_ws(), conn.link.is_webtransport());
        stats.open.fetch_add(1, Ordering::Relaxed);
        if ws {
            stats.open_websocket.fetch_add(1, Ordering::Relaxed);
        }
        if wt {
            stats.open_webtransport.fetch_add(1, Ordering::Relaxed);
        }
        // Frames that came with the end of the handshake.
        self.read_control(ch, now);
    }

    /// The connection is over for the application: report it once.
    fn end(&mut self, ch: usize, logout: bool, reason: String) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        if conn.session.is_ended() {
            return;
        }
        let was = conn.session.end();
        let connected = std::mem::take(&mut conn.counted);
        let session = conn.session.id;
        let last_heard = conn.session.last_heard;
        let ws = conn.link.is_ws();
        let wt = conn.link.is_webtransport();
        self.queued -= std::mem::take(&mut conn.session.queued);
        if let Phase::Handshaking { ip, .. } = was {
            self.handshake_over(ip);
        }
        if connected {
            uncount(&self.stats.open);
            if ws {
                uncount(&self.stats.open_websocket);
            }
            if wt {
                uncount(&self.stats.open_webtransport);
            }
        }
        if let Some(session) = session {
            if self.sessions.get(&session) == Some(&ch) {
                self.sessions.remove(&session);
            }
            let now = self.clock.at(self.last_now);
            if self.drain_holds && !logout {
                self.hub
                    .closed_until(now, session, last_heard.min(now), now.plus(DRAIN_HOLD));
            } else {
                self.hub.closed(now, session, logout, last_heard.min(now));
            }
            if let Some(c) = self.cluster.as_deref_mut() {
                let op = if logout {
                    WireOp::Logout
                } else {
                    WireOp::Disconnect {
                        last_heard: last_heard.min(now).0,
                    }
                };
                c.input(self.last_now, now, session, op, None);
            }
        }
        if connected {
            let session = session.map(|s| self.wire(s));
            self.event(ServerEvent::Closed {
                session,
                logout,
                reason,
            });
        }
    }

    /// Closes the connection now (the peer gets `code` and `text`).
    fn close(&mut self, ch: usize, now: Instant, code: CloseCode, text: &[u8]) {
        let Some(conn) = self.conn(ch) else { return };
        conn.link.close(now, code, text);
        self.touch(ch);
        self.end(ch, false, format!("closed by the server: {code:?}"));
    }

    // ---- the session layer ----

    /// Reads and handles frames until the control channel has no more, or
    /// the connection waits (for the store, for its answers to be read) or
    /// is condemned.
    fn read_control(&mut self, ch: usize, now: Instant) {
        let budget = read_budget(self.config.max_frame);
        let at = self.clock.at(now);
        loop {
            let Some(conn) = slot(&mut self.conns, ch) else {
                return;
            };
            match conn.session.next_frame(&mut conn.link, at, budget) {
                Next::Step(step) => self.on_step(ch, now, step),
                Next::Idle => break,
            }
        }
        self.touch(ch);
    }

    fn on_step(&mut self, ch: usize, now: Instant, step: Step) {
        let at = self.clock.at(now);
        let Some(conn) = self.conn(ch) else { return };
        let session = conn.session.id;
        let remote = conn.session.address;
        // Any frame of an established session is a sign of life.
        if let Some(s) = session {
            if !self.mutant(ServerMutant::LeaseNotRenewedOnTraffic) {
                self.hub.activity(at, s);
            }
        }
        if let Step::Close(e) = &step {
            self.stats.reject(&reason_label(e));
            self.event(ServerEvent::Rejected {
                remote,
                reason: e.to_string(),
            });
        }
        if !step.needs_hub() {
            let handled = Handled::default().merge_local(step);
            self.answer(ch, now, handled);
            return;
        }
        if self.mutant(ServerMutant::PushAfterLogout) {
            if let Step::Request {
                id,
                request: proto::Request::Logout,
                ..
            } = &step
            {
                let handled = Handled {
                    reply: Some(ServerFrame::Reply {
                        id: *id,
                        result: Ok(proto::Answer::Done),
                    }),
                    ..Handled::default()
                };
                self.answer(ch, now, handled);
                return;
            }
        }
        if self.cluster.is_some() {
            if let Step::Request {
                request:
                    proto::Request::Subscribe { .. }
                    | proto::Request::Unsubscribe { .. }
                    | proto::Request::Query { .. }
                    | proto::Request::Route { .. },
                ..
            } = &step
            {
                return self.cluster_subscription(ch, now, step);
            }
        }
        let forward = self.cluster.as_ref().and_then(|_| forwarded_op(&step));
        let durable = durable_user(&self.hub, &step);
        let resume = match &step {
            Step::Hello { resume, .. } => *resume,
            _ => None,
        };
        let refreshed = match &step {
            Step::Refresh { session, .. } => Some(*session),
            _ => None,
        };
        let mut handled = self.hub.apply(at, step);
        if let Some(s) = refreshed {
            self.after_refresh(at, s, &mut handled);
        }
        let revocations = self.hub.take_revocations();
        if let Some(s) = handled.welcomed {
            let elsewhere = match self.cluster {
                Some(_) => self.cluster_welcome(now, s, resume, &mut handled),
                None => None,
            };
            self.welcome(ch, now, s, &handled);
            // The welcome may have closed the connection (no push streams):
            // nothing more is done for it.
            if self.conn(ch).is_none_or(|c| c.session.is_ended()) {
                return;
            }
            if let Some(wire) = elsewhere {
                return self.resume_elsewhere(ch, now, s, wire, handled);
            }
        } else if let Some(ServerFrame::Error(e)) = &handled.reply {
            self.stats.reject(&reason_label(e));
            self.event(ServerEvent::Rejected {
                remote,
                reason: e.to_string(),
            });
        }
        let answered_ok = matches!(
            &handled.reply,
            Some(ServerFrame::Reply { result: Ok(_), .. })
        );
        if let Some((session, op)) = forward.filter(|_| answered_ok) {
            // In a cluster the owner of the user takes it before the answer.
            return self.cluster_wait(ch, now, session, op, handled);
        }
        let pending = durable
            .filter(|_| answered_ok && self.stored)
            .and_then(|user| record(&self.hub, user));
        let revocations = match answered_ok && self.stored {
            true => revocations,
            false => Vec::new(),
        };
        match (pending, revocations.is_empty()) {
            (None, true) => self.answer(ch, now, handled),
            // On disk before it is acknowledged; later frames wait.
            (user, _) => {
                let timeout = self.config.store_timeout;
                let Some(conn) = self.conn(ch) else { return };
                let serial = conn.serial;
                let ticket = self.ticket(Ticket::Answer {
                    ch,
                    serial,
                    handled,
                    deadline: now + timeout,
                });
                if let Some(conn) = self.conn(ch) {
                    conn.session.wait_for(ticket);
                }
                let batch = Batch {
                    users: user.into_iter().collect(),
                    revocations,
                    ..Batch::default()
                };
                self.outputs
                    .push_back(ServerOutput::Store(StoreRequest::Durable {
                        ticket,
                        batch,
                        timeout,
                    }));
            }
        }
        // What the step made the core emit is routed by `drive` or `pump`.
    }

    fn welcome(&mut self, ch: usize, now: Instant, session: SessionId, handled: &Handled) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        let opened = conn
            .session
            .welcome(session, &mut conn.link, self.config.max_frame);
        let remote = conn.session.address;
        if opened {
            // Each push stream starts with its tier.
            for (i, tier) in [(0, proto::Tier::Realtime), (1, proto::Tier::Batched)] {
                if let Ok(header) = encode_frame(&proto::Push::Stream { tier }) {
                    let pushed =
                        conn.session
                            .push(&mut conn.link, i, now, header.into(), usize::MAX);
                    if let Pushed::Queued(n) = pushed {
                        self.queued += n;
                    }
                }
            }
        }
        self.sessions.insert(session, ch);
        if let Some(ServerFrame::Welcome(w)) = &handled.reply {
            self.event(ServerEvent::Connected {
                session: self.wire(session),
                user: w.user.clone(),
                device: w.device.clone(),
                resumed: w.resumed,
                remote,
            });
        }
        if !opened {
            self.close(
                ch,
                now,
                CloseCode::ProtocolError,
                b"the client allows no push streams",
            );
        }
    }

    /// Sends the answer, and arranges the close it asks for.
    fn answer(&mut self, ch: usize, now: Instant, handled: Handled) {
        let Some(conn) = self.conn(ch) else { return };
        if conn.session.is_ended() {
            return;
        }
        let frame = match &handled.reply {
            Some(frame) => encode_frame(frame).unwrap_or_default(),
            None => Vec::new(),
        };
        let close = handled.close.map(|code| {
            let text = match &handled.reply {
                Some(ServerFrame::Error(e)) => reason_text(e),
                _ => format!("{code:?}").into_bytes(),
            };
            (code, text)
        });
        let Some(conn) = self.conn(ch) else { return };
        // Let the answer reach the peer (or the peer stop the stream), then close.
        conn.session.answer(&frame, close, now + CLOSE_LINGER);
        self.touch(ch);
        let Some(conn) = self.conn(ch) else { return };
        if conn.link.has_control() {
            self.write_answers(ch, now);
        } else if let Some((code, text)) = conn.session.take_close() {
            self.close(ch, now, code, &text);
        }
    }

    fn write_answers(&mut self, ch: usize, now: Instant) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        if let Flushed::Close(code, text) = conn.session.write_answers(&mut conn.link) {
            self.close(ch, now, code, &text);
        }
    }

    fn write_pushes(&mut self, ch: usize, now: Instant, tier: usize) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        let latency = &self.stats.latency;
        let freed = conn.session.write_pushes(&mut conn.link, tier, |at| {
            latency.observe(now.saturating_duration_since(at))
        });
        self.queued -= freed;
    }

    /// Sends every output of the hub (and, in a cluster, of the edge's
    /// fanout and the cluster link) where it goes.
    fn route(&mut self, now: Instant) {
        while let Some(output) = self.hub.poll_output() {
            match output {
                HubOutput::Push {
                    session,
                    tier,
                    frame,
                } => self.deliver(now, session, tier, frame),
                HubOutput::End { session, reason } => self.session_ended(now, session, reason),
            }
        }
        self.close_for_tokens(now);
        if self.cluster.is_some() {
            self.route_cluster(now);
        }
        self.within_budget(now);
    }

    /// The core ended a session: its connection is closed with the reason.
    fn session_ended(&mut self, now: Instant, session: SessionId, reason: EndReason) {
        if let Some(c) = self.cluster.as_deref_mut() {
            c.session_ended(session);
        }
        let Some(&ch) = self.sessions.get(&session) else {
            return;
        };
        let (code, text): (CloseCode, &[u8]) = match reason {
            EndReason::Superseded => (CloseCode::Superseded, b"the device connected again"),
            EndReason::HeartbeatTimeout => (CloseCode::SessionExpired, b"no sign of life in time"),
            EndReason::GraceExpired => (CloseCode::SessionExpired, b"not back within grace"),
            // The logout's answer goes out first, then the close.
            EndReason::LoggedOut => return,
        };
        self.close(ch, now, code, text);
    }

    /// One push to a session's stream of `tier`.
    fn deliver(&mut self, now: Instant, session: SessionId, tier: Tier, frame: Bytes) {
        let Some(&ch) = self.sessions.get(&session) else {
            return;
        };
        let limit = self.config.push_queue_bytes;
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        match conn
            .session
            .push(&mut conn.link, tier_index(tier), now, frame, limit)
        {
            Pushed::Sent => {
                self.stats.latency.observe(Duration::ZERO);
                self.touch(ch);
            }
            Pushed::Queued(n) => {
                self.queued += n;
                self.touch(ch);
            }
            Pushed::Dropped => self.touch(ch),
            Pushed::Stalled => {
                warn!(%session, "push queue full: closing the stalled connection");
                self.overloaded(ch, now);
            }
        }
    }

    // ---- the cluster (only with `ServerConfig::cluster`) ----

    /// What the cluster's NATS I/O delivered.
    fn cluster_input(&mut self, now: Instant, input: ClusterInput) {
        let at = self.clock.at(now);
        if let Some(c) = self.cluster.as_deref_mut() {
            c.handle_input(now, at, input);
        }
        self.route(now);
    }

    /// The fanout's pushes, the answers the cluster finished, and what it
    /// asks of the NATS I/O.
    fn route_cluster(&mut self, now: Instant) {
        loop {
            let Some(c) = self.cluster.as_deref_mut() else {
                return;
            };
            if let Some(out) = c.poll_fanout() {
                if let greendot_core::Output::Push {
                    to,
                    target,
                    tier,
                    presence,
                } = out
                {
                    let push = proto::Push::Update {
                        target: c.user_name(target).unwrap_or_default().to_owned(),
                        // Presences at the edge carry Unix milliseconds.
                        presence: proto::Presence::from_core(&presence, 0),
                    };
                    let frame = Bytes::from(encode_frame(&push).unwrap_or_default());
                    self.deliver(now, to, tier, frame);
                }
                continue;
            }
            if let Some(ms) = c.poll_latency() {
                self.stats
                    .cluster_latency
                    .observe(Duration::from_millis(ms));
                continue;
            }
            if let Some((wait, finished)) = c.poll_finished() {
                self.cluster_finished(now, wait, finished);
                continue;
            }
            match c.poll_output() {
                Some(out) => self.outputs.push_back(ServerOutput::Cluster(out)),
                None => return,
            }
        }
    }

    /// The cluster is done with the request behind `wait`.
    fn cluster_finished(&mut self, now: Instant, wait: u64, finished: Finished) {
        if let Finished::Carry {
            session,
            subscriptions,
        } = finished
        {
            if self.tickets.contains_key(&wait) {
                self.carry_over(now, wait, session, subscriptions);
            }
            return;
        }
        let Some(ticket) = self.tickets.remove(&wait) else {
            return; // answered at the backstop already
        };
        self.ticket_deadlines.remove(&(ticket.deadline(), wait));
        let Ticket::Cluster {
            ch,
            serial,
            mut handled,
            ..
        } = ticket
        else {
            return;
        };
        let result = match finished {
            Finished::Done | Finished::Carry { .. } => None,
            Finished::Answer(answer) => Some(Ok(answer)),
            Finished::Failed(error) => Some(Err(error)),
        };
        match (result, handled.reply.as_mut()) {
            (Some(result), Some(ServerFrame::Reply { result: r, .. })) => *r = result,
            // A resume from another node's record: what carried over.
            (
                Some(Ok(proto::Answer::Subscribed { snapshots, .. })),
                Some(ServerFrame::Welcome(w)),
            ) => {
                w.resumed = true;
                w.snapshots = snapshots;
            }
            _ => {}
        }
        self.saved(now, ch, serial, wait, handled, None);
    }

    /// Holds `handled` (the hub's answer) until the owner took `op`.
    fn cluster_wait(
        &mut self,
        ch: usize,
        now: Instant,
        session: SessionId,
        op: WireOp,
        handled: Handled,
    ) {
        let Some((wait, backstop)) = self.cluster_ticket(ch, now, handled) else {
            return;
        };
        let at = self.clock.at(now);
        let taken = self
            .cluster
            .as_deref_mut()
            .is_some_and(|c| c.input(now, at, session, op, Some(wait)));
        if taken {
            return self.hold_for(ch, wait);
        }
        // Not a session the cluster knows (it never got through): answered
        // as it is.
        if let Some(Ticket::Cluster { handled, .. }) = self.tickets.remove(&wait) {
            self.ticket_deadlines.remove(&(backstop, wait));
            self.answer(ch, now, handled);
        }
    }

    fn cluster_backstop(&self, now: Instant) -> Instant {
        let timeout = self
            .config
            .cluster
            .as_ref()
            .map_or(Duration::ZERO, |c| c.request_timeout);
        now + timeout + Duration::from_secs(1)
    }

    /// A welcome in a cluster: the device goes to its owner. A session
    /// resumed here keeps its subscriptions (they live in the fanout, not
    /// the hub's core) except what the new credentials no longer allow.
    /// Returns the wire id the hello named if it is no session here (so
    /// perhaps another node's: its record is read before the welcome).
    fn cluster_welcome(
        &mut self,
        now: Instant,
        session: SessionId,
        resume: Option<u64>,
        handled: &mut Handled,
    ) -> Option<u64> {
        let at = self.clock.at(now);
        let kind = self.hub.session_kind(session);
        let foreground = self.hub.session_foreground(session).unwrap_or(true);
        let carried_from = resume.map(|wire| self.wire(SessionId(wire)));
        let (Some(c), Some(ServerFrame::Welcome(w)), Some(kind)) =
            (self.cluster.as_deref_mut(), handled.reply.as_mut(), kind)
        else {
            return None;
        };
        let carried_from = carried_from.filter(|_| w.resumed);
        c.connected(
            now,
            at,
            session,
            w.session,
            &w.user,
            &w.device,
            kind.into(),
            carried_from,
        );
        if !foreground {
            // A hello in the background: the owner hears it right after
            // the connect (I12).
            c.input(now, at, session, WireOp::SetForeground(false), None);
        }
        if !w.resumed {
            return resume;
        }
        let (kept, refused): (Vec<_>, Vec<_>) = c
            .snapshots(session, &w.user)
            .into_iter()
            .partition(|s| self.hub.may_watch(session, &s.target).is_ok());
        for s in refused {
            c.unsubscribe(at, session, &s.target);
        }
        w.snapshots = kept;
        None
    }

    /// The hello named `wire`, no session of this node: the welcome waits
    /// while the device's record is read; if it names `wire`, its
    /// subscriptions carry over and the welcome says resumed.
    fn resume_elsewhere(
        &mut self,
        ch: usize,
        now: Instant,
        session: SessionId,
        wire: u64,
        handled: Handled,
    ) {
        let (user, device) = match &handled.reply {
            Some(ServerFrame::Welcome(w)) => (w.user.clone(), w.device.clone()),
            _ => return self.answer(ch, now, handled),
        };
        let Some((wait, _)) = self.cluster_ticket(ch, now, handled) else {
            return;
        };
        if let Some(c) = self.cluster.as_deref_mut() {
            c.resume_elsewhere(wait, session, &user, &device, wire);
        }
        self.hold_for(ch, wait);
    }

    /// A resume's record named the session: what the new credentials still
    /// allow is subscribed again, under the same wait.
    fn carry_over(
        &mut self,
        now: Instant,
        wait: u64,
        session: SessionId,
        subscriptions: Vec<(String, Tier)>,
    ) {
        let at = self.clock.at(now);
        let allowed: Vec<(String, Tier)> = subscriptions
            .into_iter()
            .filter(|(t, _)| self.hub.may_watch(session, t).is_ok())
            .collect();
        let viewer = self
            .hub
            .session_user(session)
            .and_then(|u| self.hub.user_name(u))
            .map(str::to_owned);
        let (Some(c), Some(viewer)) = (self.cluster.as_deref_mut(), viewer) else {
            return self.cluster_finished(now, wait, Finished::Done);
        };
        if let Some(answer) = c.carry_over(now, at, wait, session, &viewer, allowed) {
            self.cluster_finished(now, wait, Finished::Answer(answer));
        }
    }

    /// Subscribe and unsubscribe in a cluster: through the fanout, with
    /// snapshots from the targets' owners.
    fn cluster_subscription(&mut self, ch: usize, now: Instant, step: Step) {
        let Step::Request {
            session,
            id,
            request,
        } = step
        else {
            return;
        };
        let at = self.clock.at(now);
        let reply = |result| Handled {
            reply: Some(ServerFrame::Reply { id, result }),
            ..Handled::default()
        };
        let viewer = self
            .hub
            .session_user(session)
            .and_then(|u| self.hub.user_name(u))
            .map(str::to_owned);
        let Some(viewer) = viewer else {
            let stale =
                proto::WireError::new(proto::ErrorCode::Stale, "session is no longer current");
            return self.answer(ch, now, reply(Err(stale)));
        };
        match request {
            request @ (proto::Request::Subscribe { .. } | proto::Request::Query { .. }) => {
                let (targets, tier, query) = match request {
                    proto::Request::Subscribe { targets, tier } => (targets, tier.into(), false),
                    proto::Request::Query { targets } => (targets, Tier::Realtime, true),
                    _ => return,
                };
                if query && targets.len() > 1 && !self.hub.is_service(session) {
                    let error = proto::WireError::new(
                        proto::ErrorCode::ServiceOnly,
                        "querying several users at once needs a service token",
                    );
                    return self.answer(ch, now, reply(Err(error)));
                }
                if targets.len() > self.config.limits.max_targets {
                    let error = proto::WireError::new(
                        proto::ErrorCode::TooManyTargets,
                        format!(
                            "at most {} targets per request",
                            self.config.limits.max_targets
                        ),
                    );
                    return self.answer(ch, now, reply(Err(error)));
                }
                let mut allowed = Vec::with_capacity(targets.len());
                let mut refused = Vec::new();
                for target in targets {
                    match self.hub.may_watch(session, &target) {
                        Ok(()) => allowed.push(target),
                        Err(error) => refused.push(proto::Refused { target, error }),
                    }
                }
                self.cluster_ask(ch, now, id, |c, wait| {
                    c.subscribe(
                        now, at, wait, session, &viewer, allowed, refused, tier, query,
                    )
                });
            }
            proto::Request::Route { user } => {
                let svc = self.hub.is_service(session);
                if let Err(error) = self.hub.may_route(svc, &user) {
                    return self.answer(ch, now, reply(Err(error)));
                }
                self.cluster_ask(ch, now, id, |c, wait| c.route(now, wait, &user));
            }
            proto::Request::Unsubscribe { target } => {
                let done = self
                    .cluster
                    .as_deref_mut()
                    .is_some_and(|c| c.unsubscribe(at, session, &target));
                let result = if done {
                    Ok(proto::Answer::Done)
                } else {
                    Err(proto::WireError::new(
                        proto::ErrorCode::NotSubscribed,
                        "not subscribed to that user",
                    ))
                };
                self.answer(ch, now, reply(result));
            }
            _ => {}
        }
    }

    /// Runs a cluster request of connection `ch` (its request `id`): the
    /// answer now, or the connection waits for it under a ticket.
    fn cluster_ask(
        &mut self,
        ch: usize,
        now: Instant,
        id: u64,
        ask: impl FnOnce(&mut ClusterLink, u64) -> Option<proto::Answer>,
    ) {
        let reply = |result| Handled {
            reply: Some(ServerFrame::Reply { id, result }),
            ..Handled::default()
        };
        let held = reply(Ok(proto::Answer::Done));
        let Some((wait, backstop)) = self.cluster_ticket(ch, now, held) else {
            return;
        };
        let Some(c) = self.cluster.as_deref_mut() else {
            return;
        };
        match ask(c, wait) {
            Some(answer) => {
                self.tickets.remove(&wait);
                self.ticket_deadlines.remove(&(backstop, wait));
                self.answer(ch, now, reply(Ok(answer)));
            }
            None => self.hold_for(ch, wait),
        }
    }

    /// A ticket for a request of connection `ch` the cluster answers
    /// (`handled`: the answer when it has nothing else to say), with its
    /// backstop deadline.
    fn cluster_ticket(
        &mut self,
        ch: usize,
        now: Instant,
        handled: Handled,
    ) -> Option<(u64, Instant)> {
        let serial = self.conn(ch).map(|c| c.serial)?;
        let deadline = self.cluster_backstop(now);
        let wait = self.ticket(Ticket::Cluster {
            ch,
            serial,
            handled,
            deadline,
        });
        Some((wait, deadline))
    }

    /// Connection `ch` waits for ticket `wait`: its later frames wait too,
    /// so that answers keep their order.
    fn hold_for(&mut self, ch: usize, wait: u64) {
        if let Some(conn) = self.conn(ch) {
            conn.session.wait_for(wait);
        }
    }

    fn overloaded(&mut self, ch: usize, now: Instant) {
        self.stats.overloaded.fetch_add(1, Ordering::Relaxed);
        self.close(ch, now, CloseCode::Overloaded, b"pushes not read in time");
    }

    /// Past the server's push byte budget, the slowest readers (the largest
    /// queues) are closed until the rest fits: a few clients that do not
    /// read cannot make the server run out of memory for everybody.
    fn within_budget(&mut self, now: Instant) {
        let budget = self.config.push_budget_bytes;
        if self.queued <= budget {
            return;
        }
        let mut queues: Vec<(usize, usize)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(ch, c)| Some((c.as_deref()?.session.queued, ch)))
            .filter(|&(queued, _)| queued > 0)
            .collect();
        queues.sort_unstable_by(|a, b| b.cmp(a));
        for (_, ch) in queues {
            if self.queued <= budget {
                break;
            }
            warn!(ch, "push byte budget exceeded: closing the slowest reader");
            self.overloaded(ch, now);
        }
    }
}

/// The device input a request is in a cluster, forwarded to the owner of
/// its user once the hub answered it.
fn forwarded_op(step: &Step) -> Option<(SessionId, WireOp)> {
    let Step::Request {
        session, request, ..
    } = step
    else {
        return None;
    };
    let op = match request {
        proto::Request::SetStatus { status, message } => WireOp::SetStatus {
            status: *status,
            message: message.clone(),
        },
        proto::Request::SetInvisible { invisible } => WireOp::SetInvisible(*invisible),
        proto::Request::SetForeground { foreground } => WireOp::SetForeground(*foreground),
        proto::Request::Logout => WireOp::Logout,
        _ => return None,
    };
    Some((*session, op))
}

/// One connection less on `count`. A count taken below zero is a bug in
/// the bookkeeping (a debug build stops there); a release build keeps it at
/// zero rather than wrap to a count that refuses everyone.
fn uncount(count: &AtomicUsize) {
    let was = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    debug_assert!(was.is_ok(), "an open-connection count went below zero");
}

fn slot(conns: &mut [Option<Box<Conn>>], ch: usize) -> Option<&mut Conn> {
    conns.get_mut(ch).and_then(|c| c.as_deref_mut())
}

/// Restores everything saved into a fresh hub. A record that cannot be
/// restored stops the start: starting without it could show an invisible
/// user online.
fn restore(
    hub: &mut Hub,
    loaded: Loaded,
    now: Millis,
    config: &ServerConfig,
) -> Result<(), ServerError> {
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
                hub.restore(name, without)
                    .map_err(|source| ServerError::Restore {
                        user: name.clone(),
                        source,
                    })
                    .inspect(|_| warn!(user = %name, error = %e, "restored without its message"))?;
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
    // They come back at most at the admission rate: each lingers for its
    // grace plus the time to readmit them all, so that nobody waiting for
    // their turn is shown offline.
    let readmit = readmit_ms(loaded.drained.len(), config.max_handshakes_per_sec);
    let mut lingering = 0usize;
    for d in &loaded.drained {
        let grace = config.core.kind(d.kind.into()).grace;
        let until = Millis(now.0.saturating_add(grace.0).saturating_add(readmit));
        match hub.restore_device(back, &d.user, &d.device, d.kind, until) {
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

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;

#[path = "state_tokens.rs"]
mod tokens;
