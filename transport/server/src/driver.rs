//! The server's one task: a UDP socket, quinn-proto's sans-IO endpoint and
//! connections, and the [`Hub`], driven together.
//!
//! Why one task and not quinn's per-connection tasks: a presence server holds
//! many mostly idle connections, and what each costs at rest is the limit.
//! quinn's async wrapper gives every connection a driver, an event channel,
//! wakers and the application its own tasks and push queues (about 48 KiB per
//! session, measured); here a connection is one `quinn_proto::Connection` and
//! a few small fields in a slot, and the core is called directly, with no
//! channel or oneshot between a frame and its answer. Everything below is
//! synchronous except the socket and the timer the loop sleeps on.
//!
//! One pass of the loop ([`Driver::pass`]), bounded by [`PassBudget`]: read
//! the socket until it is empty (or the budget is spent) and feed each
//! datagram to the endpoint and its connection; handle the due timers; then
//! `pump`: handle every application event of the touched connections (frames
//! go through [`ConnState::on_frame`] and [`Hub::apply`], outputs are routed
//! to push streams at once) and let each transmit and re-arm its timer. What
//! a budget leaves (timers still due, connections still touched) is carried
//! to the next pass, which starts without sleeping, again by reading the
//! socket: under overload receiving is never starved, and nothing one pass
//! does grows with the backlog.

use super::conn::{ConnState, Handled, Step};
use super::hub::{Hub, HubOutput};
use super::store::{Batch, StoreWriter};
use super::udp::{Datagram, Io};
use super::{
    durable_user, not_saved, readmit_ms, reason_label, reason_text, record, with_retry_hint,
    PassBudget, ServerEvent, Shared, Shed,
};
use bytes::{Buf, Bytes};
use greendot_core::{Counters, EndReason, Millis, SessionId, Tier, UserId};
use greendot_proto::{
    self as proto, encode_frame, CloseCode, FrameError, FrameReader, ServerFrame,
};
use quinn_proto::{
    ConnectionError, ConnectionHandle, DatagramEvent, Dir, Endpoint, Event, StreamEvent, StreamId,
};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{debug, warn};

/// Control messages handled per pass besides the one that woke it.
const CONTROL_BATCH: usize = 64;
/// Datagrams kept while the socket's send buffer is full; beyond this they
/// are dropped (QUIC retransmits). Not while stopping: every connection's
/// close packet is kept until sent, so clients learn of it at once.
const OUTBOX_CAP: usize = 16384;
/// Connections allowed past `max_connections` while they handshake.
const HANDSHAKE_HEADROOM: usize = 1024;
/// Bytes read from a control stream per round: one maximal frame and its
/// prefix, so what is buffered per connection stays bounded.
fn read_budget(max_frame: usize) -> usize {
    max_frame + 4
}

/// User names checked per lease-renewal tick by [`Hub::sweep`].
const SWEEP_BUDGET: usize = 4096;

/// Messages from the [`super::Server`] handle and from store waiters.
pub(super) enum Control {
    Counters(oneshot::Sender<Counters>),
    /// The core's counters with the hub's census.
    Census(oneshot::Sender<Census>),
    /// A durable write finished; answer the request that waited for it.
    Saved {
        ch: usize,
        serial: u64,
        handled: Handled,
        /// Why it could not be saved (a failed commit, or none in time).
        error: Option<String>,
    },
    /// Close every connection with `code`, wait up to two seconds for them to
    /// go, then (if `save`) write the store with the live devices, and stop.
    Stop {
        code: CloseCode,
        text: &'static [u8],
        save: bool,
        done: oneshot::Sender<()>,
    },
}

/// What the metrics read of the hub.
pub(super) struct Census {
    pub counters: Counters,
    /// User names held (as many core records at most).
    pub users_known: usize,
    /// User and device names held.
    pub names: usize,
}

/// A server-opened push stream of one tier.
struct PushStream {
    id: StreamId,
    /// Encoded pushes the stream did not accept yet (flow control), with the
    /// instant of the change behind each.
    pending: VecDeque<(Instant, Bytes)>,
}

/// One connection.
struct Conn {
    quic: quinn_proto::Connection,
    /// Tells a reused slot from the connection a store waiter answers.
    serial: u64,
    state: ConnState,
    reader: FrameReader,
    /// The client's bidirectional control stream, once opened.
    control: Option<StreamId>,
    /// Answer bytes the control stream did not accept yet.
    unsent: Vec<u8>,
    /// Realtime and batched, opened at the welcome.
    pushes: Option<Box<[PushStream; 2]>>,
    /// Bytes waiting in `pushes` (counted in `Driver::queued` too).
    queued: usize,
    session: Option<SessionId>,
    address: SocketAddr,
    /// The handshake is done.
    connected: bool,
    /// Counted in `Stats::connections_open` (handshake done, under the cap).
    counted: bool,
    /// The client finished (or reset) its side of the control stream.
    control_done: bool,
    /// The end was reported (hub, stats, event); nothing more is read.
    ended: bool,
    /// A durable request waits for the store: frames after it wait too, so
    /// answers keep their order.
    waiting_store: bool,
    /// After the answer in flight: close with this code.
    closing: Option<(CloseCode, Vec<u8>)>,
    /// The hello deadline, or how long a closing answer may take to arrive.
    deadline: Option<Instant>,
    /// When a datagram of this connection last arrived (Unix ms): the
    /// user's last seen if the connection is lost.
    last_heard: Millis,
    /// The instant under which this connection sits in the timer set.
    timer: Option<Instant>,
    /// In the driver's `touched` list.
    touched: bool,
    /// Counted in the driver's handshakes in flight, from this address.
    handshake_ip: Option<IpAddr>,
}

/// How a new connection is accepted: its server config, one of the
/// keep-alive variants, picked by the driver's own randomness.
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
    fn pick(&mut self) -> Option<&(Duration, Arc<quinn_proto::ServerConfig>)> {
        let n = self.variants.len() as u64;
        if n == 0 {
            return None;
        }
        let i = self.rng.below(n);
        self.variants.get(usize::try_from(i).ok()?)
    }
}

/// The admission rate: a token bucket of handshakes, refilled at the
/// configured rate, holding at most one second's worth.
struct Pacer {
    rate: f64,
    tokens: f64,
    at: Instant,
}

impl Pacer {
    fn new(per_sec: u32, now: Instant) -> Pacer {
        let rate = f64::from(per_sec.max(1));
        Pacer {
            rate,
            tokens: rate,
            at: now,
        }
    }

    /// Takes a token if there is one.
    fn admit(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = self.at.max(now);
        self.tokens = (self.tokens + elapsed * self.rate).min(self.rate);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// xorshift64*: jitter needs no cryptographic randomness, only a seed
/// (from the system's) and speed.
pub(super) struct SmallRng(u64);

impl SmallRng {
    fn next(&mut self) -> u64 {
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

pub(super) struct Driver {
    shared: Arc<Shared>,
    io: Io,
    endpoint: Endpoint,
    accept: Accept,
    /// Handshakes in flight, in all and by address.
    handshaking: usize,
    per_address: HashMap<IpAddr, usize>,
    pacer: Pacer,
    hub: Hub,
    conns: Vec<Option<Box<Conn>>>,
    sessions: HashMap<SessionId, usize>,
    timers: BTreeSet<(Instant, usize)>,
    /// Connections to drive, oldest first; what a pass's budget leaves is
    /// driven by the next.
    touched: VecDeque<usize>,
    budget: PassBudget,
    recv_batch: Vec<Datagram>,
    next_serial: u64,
    send_buf: Vec<u8>,
    store: Option<StoreWriter>,
    dirty_users: HashSet<UserId>,
    /// Push bytes waiting in every connection's queues.
    queued: usize,
    next_flush: Instant,
    next_renewal: Instant,
    stopping: Option<Stopping>,
}

struct Stopping {
    save: bool,
    done: oneshot::Sender<()>,
    until: Instant,
}

impl Driver {
    pub(super) fn new(
        shared: Arc<Shared>,
        io: Io,
        endpoint: Endpoint,
        accept: Accept,
        hub: Hub,
        store: Option<StoreWriter>,
    ) -> Driver {
        let now = Instant::now();
        Driver {
            budget: shared.config.pass,
            pacer: Pacer::new(shared.config.max_handshakes_per_sec, now),
            next_flush: now + shared.config.flush_interval,
            next_renewal: now + shared.config.renewal(),
            shared,
            io,
            endpoint,
            accept,
            handshaking: 0,
            per_address: HashMap::new(),
            hub,
            conns: Vec::new(),
            sessions: HashMap::new(),
            timers: BTreeSet::new(),
            touched: VecDeque::new(),
            recv_batch: Vec::new(),
            next_serial: 0,
            send_buf: Vec::new(),
            store,
            dirty_users: HashSet::new(),
            queued: 0,
            stopping: None,
        }
    }

    /// Runs until stopped by [`Control::Stop`].
    pub(super) async fn run(mut self, mut control: mpsc::Receiver<Control>) {
        loop {
            if self.carried(Instant::now()) {
                // Work left by the last pass: let the runtime's other tasks
                // (store waiters, metrics) run, then go on without sleeping.
                tokio::task::yield_now().await;
            } else {
                let deadline = self.next_deadline();
                tokio::select! {
                    biased;
                    msg = control.recv() => match msg {
                        Some(msg) => self.on_control(Instant::now(), msg),
                        None => return,
                    },
                    _ = self.io.socket.readable() => {}
                    _ = self.io.socket.writable(), if !self.io.is_empty() => {}
                    _ = tokio::time::sleep_until(deadline) => {}
                }
            }
            // Control messages that came meanwhile (a few per pass).
            for _ in 0..CONTROL_BATCH {
                match control.try_recv() {
                    Ok(msg) => self.on_control(Instant::now(), msg),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            let now = Instant::now();
            self.pass(now);
            let stats = &self.shared.stats;
            stats.loop_pass.observe(now.elapsed());
            if self.carried(Instant::now()) {
                stats.loop_carried.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(stop) = &self.stopping {
                if self.conns.iter().all(Option::is_none) || now >= stop.until {
                    self.finish().await;
                    return;
                }
            }
        }
    }

    /// One pass, bounded by [`PassBudget`]: read the socket (until it is
    /// empty or the budget is spent) before anything else, so that timers
    /// and busy connections never starve receiving; then the due timers and
    /// the touched connections, each up to its budget (the rest waits for
    /// the next pass, in order); then send.
    /// Returns how many datagrams it read.
    fn pass(&mut self, now: Instant) -> usize {
        let read = self.receive(now);
        self.on_timers(now);
        self.pump(now);
        // Sending must not wait for a quiet moment in receiving.
        self.io.flush();
        read
    }

    /// Whether the last pass left work (due timers, touched connections)
    /// that the next one must do without waiting for a wake-up.
    fn carried(&self, now: Instant) -> bool {
        !self.touched.is_empty() || self.timers.first().is_some_and(|&(at, _)| at <= now)
    }

    /// Reads datagrams until the socket has none or the budget is spent
    /// (the last batch may pass it by a few); returns how many were read.
    fn receive(&mut self, now: Instant) -> usize {
        let mut batch = std::mem::take(&mut self.recv_batch);
        let mut read = 0;
        while read < self.budget.datagrams {
            batch.clear();
            match self.io.recv(&mut batch) {
                Ok(0) => break,
                Ok(n) => read += n,
                // ICMP errors (a client gone) surface here; nothing to do,
                // but they count, so an error loop cannot spin forever.
                Err(_) => read += 1,
            }
            for d in batch.drain(..) {
                self.on_datagram(now, d);
            }
        }
        self.recv_batch = batch;
        read
    }

    fn next_deadline(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        let mut at = self.next_renewal.min(far);
        if self.store.is_some() {
            at = at.min(self.next_flush);
        }
        if let Some((t, _)) = self.timers.first() {
            at = at.min(*t);
        }
        if let Some(t) = self
            .hub
            .poll_timeout()
            .and_then(|m| self.shared.clock.instant(m))
        {
            at = at.min(t);
        }
        if let Some(stop) = &self.stopping {
            at = at.min(stop.until);
        }
        at
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

    // ---- the socket ----

    fn send(&mut self, t: &quinn_proto::Transmit, bytes: &[u8]) {
        let cap = self.outbox_cap();
        self.io.send(cap, t, bytes);
    }

    fn outbox_cap(&self) -> usize {
        if self.stopping.is_some() {
            usize::MAX
        } else {
            OUTBOX_CAP
        }
    }

    fn on_datagram(&mut self, now: Instant, datagram: Datagram) {
        let mut buf = std::mem::take(&mut self.send_buf);
        buf.clear();
        let from = datagram.from;
        let event = self.endpoint.handle(
            now.into_std(),
            from,
            datagram.local_ip,
            datagram.ecn,
            datagram.data,
            &mut buf,
        );
        match event {
            Some(DatagramEvent::NewConnection(incoming)) => {
                self.on_incoming(now, incoming, &mut buf);
            }
            Some(DatagramEvent::ConnectionEvent(ch, event)) => {
                let heard = self.shared.clock.at(now);
                if let Some(conn) = self.conn(ch.0) {
                    conn.last_heard = heard;
                    conn.quic.handle_event(event);
                    self.touch(ch.0);
                }
            }
            Some(DatagramEvent::Response(t)) => self.send(&t, &buf[..t.size]),
            None => {}
        }
        self.send_buf = buf;
    }

    /// A new client's first packet: shed it early and cheaply when the
    /// server is past what it can take, otherwise accept it.
    fn on_incoming(&mut self, now: Instant, incoming: quinn_proto::Incoming, buf: &mut Vec<u8>) {
        let config = &self.shared.config;
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
        } else if crowded && !incoming.remote_address_validated() && incoming.may_retry() {
            Some(Shed::Retry)
        } else if from_ip >= config.max_handshakes_per_address {
            Some(Shed::PerAddress)
        } else if self.endpoint.open_connections() >= cap {
            Some(Shed::Capacity)
        } else if !self.pacer.admit(now) {
            Some(Shed::Rate)
        } else {
            None
        };
        if let Some(reason) = shed {
            self.shared.stats.shed(reason);
            let t = match reason {
                Shed::Retry => match self.endpoint.retry(incoming, buf) {
                    Ok(t) => t,
                    Err(e) => self.endpoint.refuse(e.into_incoming(), buf),
                },
                _ => self.endpoint.refuse(incoming, buf),
            };
            self.send(&t, &buf[..t.size]);
            return;
        }
        let remote = incoming.remote_address();
        let config = self.accept.pick().map(|(_, c)| c.clone());
        match self.endpoint.accept(incoming, now.into_std(), buf, config) {
            Ok((ch, quic)) => {
                self.insert(ch, quic);
                self.handshake_begins(ch.0, ip, now);
            }
            Err(e) => {
                if let Some(t) = e.response {
                    self.send(&t, &buf[..t.size]);
                }
                debug!(%remote, error = %e.cause, "handshake refused");
                self.shared.stats.reject("handshake");
                self.shared.event(ServerEvent::Rejected {
                    remote,
                    reason: format!("handshake failed: {}", e.cause),
                });
            }
        }
    }

    /// The reconnect spread suggested in a close for shedding or draining:
    /// the time to readmit every open connection at the admission rate.
    fn retry_ms(&self) -> u64 {
        let open = self.shared.stats.open.load(Ordering::Relaxed);
        readmit_ms(open, self.shared.config.max_handshakes_per_sec)
    }

    /// Counts a handshake in flight, and gives it `hello_timeout` from now
    /// to complete and send its hello.
    fn handshake_begins(&mut self, ch: usize, ip: IpAddr, now: Instant) {
        let deadline = now + self.shared.config.hello_timeout;
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        conn.handshake_ip = Some(ip);
        conn.deadline = Some(deadline);
        self.handshaking += 1;
        *self.per_address.entry(ip).or_default() += 1;
        self.shared
            .stats
            .handshaking
            .store(self.handshaking, Ordering::Relaxed);
    }

    /// The handshake completed or the connection ended: no longer in flight.
    fn handshake_over(&mut self, ch: usize) {
        let Some(ip) = slot(&mut self.conns, ch).and_then(|c| c.handshake_ip.take()) else {
            return;
        };
        self.handshaking = self.handshaking.saturating_sub(1);
        if let Some(n) = self.per_address.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_address.remove(&ip);
            }
        }
        self.shared
            .stats
            .handshaking
            .store(self.handshaking, Ordering::Relaxed);
    }

    fn insert(&mut self, ch: ConnectionHandle, quic: quinn_proto::Connection) {
        let config = &self.shared.config;
        self.next_serial += 1;
        let conn = Conn {
            address: quic.remote_address(),
            quic,
            serial: self.next_serial,
            state: ConnState::new(self.shared.keys.clone(), config.rate),
            reader: FrameReader::new(config.max_frame),
            control: None,
            unsent: Vec::new(),
            pushes: None,
            queued: 0,
            session: None,
            connected: false,
            counted: false,
            control_done: false,
            ended: false,
            waiting_store: false,
            closing: None,
            deadline: None,
            last_heard: self.shared.clock.now(),
            timer: None,
            touched: false,
            handshake_ip: None,
        };
        if self.conns.len() <= ch.0 {
            self.conns.resize_with(ch.0 + 1, || None);
        }
        self.conns[ch.0] = Some(Box::new(conn));
        self.touch(ch.0);
    }

    /// A handshake the client abandoned or lost (its network came back
    /// mid-attempt, or it gave up): counted apart from bad input.
    fn handshake_failed(&self, remote: SocketAddr, error: &ConnectionError) {
        debug!(%remote, %error, "handshake failed");
        if super::handshake_aborted(error) {
            // Not bad input: a client whose network went away mid-handshake.
            self.shared
                .stats
                .handshakes_aborted
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.shared.stats.reject("handshake");
        self.shared.event(ServerEvent::Rejected {
            remote,
            reason: format!("handshake failed: {error}"),
        });
    }

    // ---- control messages and timers ----

    fn on_control(&mut self, now: Instant, msg: Control) {
        match msg {
            Control::Counters(reply) => {
                let _ = reply.send(self.hub.core().counters().clone());
            }
            Control::Census(reply) => {
                let _ = reply.send(Census {
                    counters: self.hub.core().counters().clone(),
                    users_known: self.hub.user_names(),
                    names: self.hub.names(),
                });
            }
            Control::Saved {
                ch,
                serial,
                handled,
                error,
            } => {
                let handled = match error {
                    None => handled,
                    Some(error) => {
                        self.shared
                            .stats
                            .store_errors
                            .fetch_add(1, Ordering::Relaxed);
                        not_saved(handled, &error)
                    }
                };
                let Some(conn) = self.conn(ch) else { return };
                if conn.serial != serial || conn.ended {
                    return;
                }
                conn.waiting_store = false;
                self.answer(ch, now, handled);
                // Frames that waited behind it.
                self.read_control(ch, now);
                self.touch(ch);
            }
            Control::Stop {
                code,
                text,
                save,
                done,
            } => {
                self.endpoint.set_server_config(None);
                // Clients reconnecting to the next process are spread over
                // the time it needs to readmit them all.
                let text = match code {
                    CloseCode::Draining => with_retry_hint(text, self.retry_ms()),
                    _ => text.to_vec(),
                };
                for ch in 0..self.conns.len() {
                    if self.conns[ch].is_some() {
                        self.close(ch, now, code, &text);
                    }
                }
                self.stopping = Some(Stopping {
                    save,
                    done,
                    until: now + Duration::from_secs(2),
                });
            }
        }
    }

    /// The due connection timers, at most the pass budget of them (earliest
    /// first; the rest stay due for the next pass), then the hub's, the lease
    /// renewal and the store's.
    fn on_timers(&mut self, now: Instant) {
        for _ in 0..self.budget.timers {
            let Some(&(at, ch)) = self.timers.first() else {
                break;
            };
            if at > now {
                break;
            }
            self.timers.pop_first();
            let Some(conn) = slot(&mut self.conns, ch) else {
                continue;
            };
            conn.timer = None;
            conn.quic.handle_timeout(now.into_std());
            if conn.deadline.is_some_and(|d| d <= now) {
                conn.deadline = None;
                let hello_due = conn.session.is_none() && !conn.ended;
                let handshaking = !conn.connected;
                match conn.closing.take() {
                    Some((code, text)) => self.close(ch, now, code, &text),
                    None if hello_due => {
                        if handshaking {
                            self.shared.stats.shed(Shed::HandshakeTimeout);
                        }
                        self.close(ch, now, CloseCode::HelloTimeout, b"no hello in time")
                    }
                    None => {}
                }
            }
            self.touch(ch);
        }
        if self
            .hub
            .poll_timeout()
            .and_then(|m| self.shared.clock.instant(m))
            .is_some_and(|at| at <= now)
        {
            self.hub.handle_timeout(self.shared.clock.now());
        }
        if now >= self.next_renewal {
            // An open connection is a live device: QUIC's keep-alive and idle
            // timeout stand for the heartbeat.
            // Renewed as of each connection's last datagram, not now: a
            // client that fell silent must keep its real last heard.
            let at = self.shared.clock.now();
            for (&session, &ch) in &self.sessions {
                if let Some(conn) = self.conns.get(ch).and_then(|c| c.as_deref()) {
                    self.hub.heard(at, session, conn.last_heard);
                }
            }
            self.next_renewal = now + self.shared.config.renewal();
            if self.store.is_none() {
                self.hub.sweep(SWEEP_BUDGET);
            }
        }
        if self.store.is_some() && now >= self.next_flush {
            self.next_flush = now + self.shared.config.flush_interval;
            self.flush_store();
        }
    }

    /// The records of every user changed since the last write.
    fn changed_records(&mut self) -> Batch {
        self.dirty_users.extend(self.hub.take_touched());
        let users = self
            .dirty_users
            .drain()
            .filter_map(|u| record(&self.hub, u))
            .collect();
        Batch {
            users,
            alive_at: Some(self.shared.clock.now().0),
            drained: None,
        }
    }

    fn flush_store(&mut self) {
        if self.store.is_none() {
            return;
        }
        let batch = self.changed_records();
        // Users are freed only once their records are taken: a freed user's
        // record can no longer be read.
        self.hub.release_idle();
        self.hub.sweep(SWEEP_BUDGET);
        if let Some(store) = &self.store {
            store.write_behind(batch);
        }
    }

    /// The end of a [`Control::Stop`]: the store with the live devices.
    async fn finish(&mut self) {
        let Some(stop) = self.stopping.take() else {
            return;
        };
        // The close packets first: clients that get them reconnect at once.
        let flush = async {
            while !self.io.is_empty() {
                if self.io.socket.writable().await.is_err() {
                    break;
                }
                self.io.flush();
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), flush).await;
        if stop.save && self.store.is_some() {
            let batch = Batch {
                drained: Some(self.hub.live_devices()),
                ..self.changed_records()
            };
            if let Some(store) = &self.store {
                if let Err(e) = store.write_durable(batch, Duration::from_secs(10)).await {
                    warn!(error = %e, "the store was not written at the stop");
                    self.shared
                        .stats
                        .store_errors
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let _ = stop.done.send(());
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
        if self.store.is_some() {
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
        let Some(conn) = slot(&mut self.conns, ch) else {
            return false;
        };
        while let Some(event) = conn.quic.poll_endpoint_events() {
            let drained = event.is_drained();
            if let Some(back) = self.endpoint.handle_event(ConnectionHandle(ch), event) {
                conn.quic.handle_event(back);
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
            let Some(event) = conn.quic.poll() else { break };
            self.on_event(ch, now, event);
        }
        self.check_address(ch);
        self.route(now);
        if drained {
            self.remove(ch);
            return;
        }
        let cap = self.outbox_cap();
        let segments = self.io.max_segments();
        if let Some(conn) = slot(&mut self.conns, ch) {
            let buf = &mut self.send_buf;
            loop {
                // quinn-proto writes each transmit from the start of `buf`.
                buf.clear();
                let Some(t) = conn.quic.poll_transmit(now.into_std(), segments, buf) else {
                    break;
                };
                self.io.send(cap, &t, &buf[..t.size]);
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
        let next = match (
            conn.quic.poll_timeout().map(Instant::from_std),
            conn.deadline,
        ) {
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
        if let Some(conn) = self.conns.get_mut(ch).and_then(Option::take) {
            if let Some(at) = conn.timer {
                self.timers.remove(&(at, ch));
            }
        }
    }

    fn check_address(&mut self, ch: usize) {
        let Some(conn) = self.conn(ch) else { return };
        let now = conn.quic.remote_address();
        if now == conn.address || conn.ended {
            return;
        }
        let from = std::mem::replace(&mut conn.address, now);
        let session = conn.session;
        self.shared.stats.migrations.fetch_add(1, Ordering::Relaxed);
        debug!(?session, %from, to = %now, "migrated");
        self.shared.event(ServerEvent::Migrated {
            session: session.map(|s| self.shared.wire(s)),
            from,
            to: now,
        });
    }

    fn on_event(&mut self, ch: usize, now: Instant, event: Event) {
        match event {
            Event::Connected => self.on_connected(ch, now),
            Event::ConnectionLost { reason } => {
                let logout = matches!(
                    &reason,
                    ConnectionError::ApplicationClosed(close)
                        if close.error_code == CloseCode::Logout.varint()
                );
                let Some(conn) = slot(&mut self.conns, ch) else {
                    return;
                };
                if !conn.connected && !conn.ended {
                    let remote = conn.address;
                    self.handshake_failed(remote, &reason);
                }
                self.end(ch, logout, reason.to_string());
            }
            Event::Stream(StreamEvent::Opened { dir: Dir::Bi }) => {
                let Some(conn) = slot(&mut self.conns, ch) else {
                    return;
                };
                while let Some(id) = conn.quic.streams().accept(Dir::Bi) {
                    if conn.control.is_none() && !conn.control_done {
                        conn.control = Some(id);
                    } else {
                        // One control stream per connection.
                        let _ = conn.quic.recv_stream(id).stop(0u32.into());
                    }
                }
                self.read_control(ch, now);
            }
            Event::Stream(StreamEvent::Readable { id })
                if self.conn(ch).is_some_and(|c| c.control == Some(id)) =>
            {
                self.read_control(ch, now);
            }
            Event::Stream(StreamEvent::Writable { id }) => {
                self.write_pending(ch, now, id);
                // Requests held back behind unread answers.
                if self.conn(ch).is_some_and(|c| c.control == Some(id)) {
                    self.read_control(ch, now);
                }
            }
            Event::Stream(StreamEvent::Stopped { id, .. })
                if self.conn(ch).is_some_and(|c| {
                    c.pushes
                        .as_deref()
                        .is_some_and(|p| p.iter().any(|s| s.id == id))
                }) =>
            {
                // A client that stops a push stream would stay online while
                // missing every update of that tier: a protocol error.
                let remote = self.conn(ch).map(|c| c.address);
                self.shared.stats.reject("StreamStopped");
                if let Some(remote) = remote {
                    self.shared.event(ServerEvent::Rejected {
                        remote,
                        reason: "the client stopped a push stream".into(),
                    });
                }
                self.close(
                    ch,
                    now,
                    CloseCode::StreamStopped,
                    b"the client stopped a push stream",
                );
            }
            Event::Stream(StreamEvent::Stopped { id, .. }) => {
                // The client reads no more of this stream: what waits for it
                // is dropped (the write fails), which may unblock the control
                // stream's reading or its close.
                self.write_pending(ch, now, id);
                self.after_answers(ch, now, id);
            }
            Event::Stream(StreamEvent::Finished { id }) => self.after_answers(ch, now, id),
            _ => {}
        }
    }

    /// The control stream's answers are all out (or dropped): close if a
    /// close was waiting for them, otherwise read the requests held back.
    fn after_answers(&mut self, ch: usize, now: Instant, id: StreamId) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        if conn.control != Some(id) || !conn.unsent.is_empty() {
            return;
        }
        match conn.closing.take() {
            Some((code, text)) => self.close(ch, now, code, &text),
            None => self.read_control(ch, now),
        }
    }

    fn on_connected(&mut self, ch: usize, now: Instant) {
        self.handshake_over(ch);
        let stats = &self.shared.stats;
        let open = stats.open.load(Ordering::Relaxed);
        stats.total.fetch_add(1, Ordering::Relaxed);
        if let Some(conn) = slot(&mut self.conns, ch) {
            conn.connected = true;
        }
        if open >= self.shared.config.max_connections {
            stats.reject("TooManyConnections");
            let text = with_retry_hint(
                b"TooManyConnections: the server is at its connection cap",
                self.retry_ms(),
            );
            self.close(ch, now, CloseCode::TooManyConnections, &text);
            return;
        }
        stats.open.fetch_add(1, Ordering::Relaxed);
        let hello = now + self.shared.config.hello_timeout;
        let Some(conn) = self.conn(ch) else { return };
        conn.counted = true;
        conn.connected = true;
        // The hello is due `hello_timeout` after the first packet (set when
        // accepted), not after a slow handshake.
        conn.deadline = conn.deadline.or(Some(hello));
    }

    /// The connection is over for the application: report it once.
    fn end(&mut self, ch: usize, logout: bool, reason: String) {
        self.handshake_over(ch);
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        if conn.ended {
            return;
        }
        conn.ended = true;
        conn.closing = None;
        conn.deadline = None;
        let counted = std::mem::take(&mut conn.counted);
        let connected = conn.connected;
        let session = conn.session;
        let last_heard = conn.last_heard;
        conn.pushes = None;
        self.queued -= std::mem::take(&mut conn.queued);
        conn.unsent = Vec::new();
        conn.reader = FrameReader::new(0);
        if counted {
            self.shared.stats.open.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(session) = session {
            if self.sessions.get(&session) == Some(&ch) {
                self.sessions.remove(&session);
            }
            let now = self.shared.clock.now();
            self.hub.closed(now, session, logout, last_heard.min(now));
        }
        if connected {
            self.shared.event(ServerEvent::Closed {
                session: session.map(|s| self.shared.wire(s)),
                logout,
                reason,
            });
        }
    }

    /// Closes the connection now (the peer gets `code` and `text`).
    fn close(&mut self, ch: usize, now: Instant, code: CloseCode, text: &[u8]) {
        let Some(conn) = self.conn(ch) else { return };
        conn.quic
            .close(now.into_std(), code.varint(), Bytes::copy_from_slice(text));
        self.touch(ch);
        self.end(ch, false, format!("closed by the server: {code:?}"));
    }

    // ---- the control stream ----

    /// Reads and handles frames until the stream has no more, or the
    /// connection waits (for the store) or is condemned.
    fn read_control(&mut self, ch: usize, now: Instant) {
        let budget = read_budget(self.shared.config.max_frame);
        loop {
            // Frames already buffered first.
            loop {
                let Some(conn) = slot(&mut self.conns, ch) else {
                    return;
                };
                // Answers the client does not read stop its requests being
                // read (QUIC flow control then stops the client).
                if conn.ended
                    || conn.waiting_store
                    || conn.closing.is_some()
                    || !conn.unsent.is_empty()
                {
                    return;
                }
                let step = match conn.reader.next_frame() {
                    Ok(Some(payload)) => conn.state.on_frame(self.shared.clock.now(), &payload),
                    Ok(None) => {
                        conn.reader.compact();
                        break;
                    }
                    Err(e) => conn.state.on_frame_error(e),
                };
                self.on_step(ch, now, step);
            }
            let Some(conn) = slot(&mut self.conns, ch) else {
                return;
            };
            if conn.control_done {
                // The client finished its control stream: a partial frame
                // left over is an error; otherwise nothing more comes.
                if conn.reader.finish().is_err() {
                    conn.reader = FrameReader::new(0);
                    let step = conn.state.on_frame_error(FrameError::Truncated);
                    self.on_step(ch, now, step);
                }
                return;
            }
            let Some(id) = conn.control else { return };
            let mut recv = conn.quic.recv_stream(id);
            let Ok(mut chunks) = recv.read(true) else {
                return;
            };
            let mut got = 0usize;
            let mut fin = false;
            while got < budget {
                match chunks.next(budget - got) {
                    Ok(Some(chunk)) => {
                        got += chunk.bytes.len();
                        conn.reader.push(&chunk.bytes);
                    }
                    Ok(None) => {
                        fin = true;
                        break;
                    }
                    Err(quinn_proto::ReadError::Blocked) => break,
                    Err(quinn_proto::ReadError::Reset(_)) => {
                        // Abandoned mid-stream: nothing buffered is trusted.
                        fin = true;
                        conn.reader = FrameReader::new(0);
                        break;
                    }
                }
            }
            // Credit the peer gets back goes out with the next transmit.
            let _ = chunks.finalize();
            conn.control_done = fin;
            self.touch(ch);
            if got == 0 && !fin {
                return;
            }
        }
    }

    fn on_step(&mut self, ch: usize, now: Instant, step: Step) {
        let at = self.shared.clock.now();
        let Some(conn) = self.conn(ch) else { return };
        let session = conn.session;
        let remote = conn.address;
        // Any frame of an established session is a sign of life.
        if let Some(s) = session {
            self.hub.activity(at, s);
        }
        if let Step::Close(e) = &step {
            self.shared.stats.reject(&reason_label(e));
            self.shared.event(ServerEvent::Rejected {
                remote,
                reason: e.to_string(),
            });
        }
        if !step.needs_hub() {
            let handled = Handled::default().merge_local(step);
            self.answer(ch, now, handled);
            return;
        }
        let durable = durable_user(&self.hub, &step);
        let handled = self.hub.apply(at, step);
        if let Some(s) = handled.welcomed {
            self.welcome(ch, now, s, &handled);
        } else if let Some(ServerFrame::Error(e)) = &handled.reply {
            self.shared.stats.reject(&reason_label(e));
            self.shared.event(ServerEvent::Rejected {
                remote,
                reason: e.to_string(),
            });
        }
        let answered_ok = matches!(
            &handled.reply,
            Some(ServerFrame::Reply { result: Ok(_), .. })
        );
        let pending = durable
            .filter(|_| answered_ok)
            .and_then(|user| Some((self.store.as_ref()?, record(&self.hub, user)?)));
        match pending {
            // On disk before it is acknowledged; later frames wait.
            Some((store, user)) => {
                let store = store.clone();
                let batch = Batch {
                    users: vec![user],
                    alive_at: None,
                    drained: None,
                };
                let timeout = self.shared.config.store_timeout;
                let Some(conn) = self.conn(ch) else { return };
                conn.waiting_store = true;
                let serial = conn.serial;
                let tx = self.shared.control.clone();
                // The wait (for room in the writer's queue, then for the
                // commit) is this task's, never the driver's.
                tokio::spawn(async move {
                    let error = store
                        .write_durable(batch, timeout)
                        .await
                        .err()
                        .map(|e| e.to_string());
                    let _ = tx
                        .send(Control::Saved {
                            ch,
                            serial,
                            handled,
                            error,
                        })
                        .await;
                });
            }
            None => self.answer(ch, now, handled),
        }
        // What the step made the core emit is routed by `drive` or `pump`.
    }

    fn welcome(&mut self, ch: usize, now: Instant, session: SessionId, handled: &Handled) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        conn.state.on_welcome(session);
        conn.session = Some(session);
        conn.deadline = None;
        let remote = conn.address;
        // The push streams, realtime at the higher priority.
        let mut streams = Vec::with_capacity(2);
        for (tier, priority) in [(proto::Tier::Realtime, 1), (proto::Tier::Batched, 0)] {
            let Some(id) = conn.quic.streams().open(Dir::Uni) else {
                break;
            };
            let _ = conn.quic.send_stream(id).set_priority(priority);
            streams.push(PushStream {
                id,
                pending: VecDeque::new(),
            });
            if let (Ok(header), Some(stream)) = (
                encode_frame(&proto::Push::Stream { tier }),
                streams.last_mut(),
            ) {
                let (_, queued) = write_or_queue(&mut conn.quic, stream, now, header.into());
                conn.queued += queued;
                self.queued += queued;
            }
        }
        if let Ok(pair) = <[PushStream; 2]>::try_from(streams) {
            conn.pushes = Some(Box::new(pair));
        }
        self.sessions.insert(session, ch);
        if let Some(ServerFrame::Welcome(w)) = &handled.reply {
            self.shared.event(ServerEvent::Connected {
                session: self.shared.wire(session),
                user: w.user.clone(),
                device: w.device.clone(),
                resumed: w.resumed,
                remote,
            });
        }
        if self.conn(ch).is_some_and(|c| c.pushes.is_none()) {
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
        if conn.ended {
            return;
        }
        if let Some(frame) = &handled.reply {
            if let Ok(bytes) = encode_frame(frame) {
                conn.unsent.extend_from_slice(&bytes);
            }
        }
        if let Some(code) = handled.close {
            let text = match &handled.reply {
                Some(ServerFrame::Error(e)) => reason_text(e),
                _ => format!("{code:?}").into_bytes(),
            };
            conn.closing = Some((code, text));
            // Let the answer reach the peer (or the peer stop the stream), then close.
            conn.deadline = Some(now + Duration::from_secs(1));
        }
        self.touch(ch);
        if let Some(id) = self.conn(ch).and_then(|c| c.control) {
            self.write_pending(ch, now, id);
        } else if let Some((code, text)) = self.conn(ch).and_then(|c| c.closing.take()) {
            self.close(ch, now, code, &text);
        }
    }

    /// Writes what waits for stream `id` (answers or pushes).
    fn write_pending(&mut self, ch: usize, now: Instant, id: StreamId) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        if conn.control == Some(id) {
            // Until all is taken or quinn says `Blocked`: only a write that
            // is refused outright promises a `Writable` event later.
            while !conn.unsent.is_empty() {
                match conn.quic.send_stream(id).write(&conn.unsent) {
                    Ok(n) => {
                        conn.unsent.drain(..n);
                    }
                    Err(quinn_proto::WriteError::Blocked) => return,
                    // Stopped by the client: it reads no answers.
                    Err(_) => conn.unsent.clear(),
                }
            }
            if conn.unsent.is_empty() {
                conn.unsent = Vec::new();
                // The answer before a close is all out: finish, and close
                // once it is acknowledged (or at the deadline).
                if conn.closing.is_some() && conn.quic.send_stream(id).finish().is_err() {
                    if let Some((code, text)) = conn.closing.take() {
                        self.close(ch, now, code, &text);
                    }
                }
            }
            return;
        }
        let latency = &self.shared.stats.latency;
        let Some(pushes) = conn.pushes.as_deref_mut() else {
            return;
        };
        let mut written = 0;
        for stream in pushes.iter_mut().filter(|s| s.id == id) {
            while let Some((at, bytes)) = stream.pending.front_mut() {
                match conn.quic.send_stream(id).write(bytes) {
                    Ok(n) if n == bytes.len() => {
                        latency.observe(at.elapsed());
                        written += n + PUSH_ENTRY_OVERHEAD;
                        stream.pending.pop_front();
                    }
                    // Part taken: try the rest (see above).
                    Ok(n) => {
                        written += n;
                        bytes.advance(n);
                    }
                    Err(quinn_proto::WriteError::Blocked) => break,
                    Err(_) => {
                        written += stream
                            .pending
                            .iter()
                            .map(|(_, b)| queued_cost(b))
                            .sum::<usize>();
                        stream.pending.clear();
                        break;
                    }
                }
            }
            if stream.pending.is_empty() {
                stream.pending = VecDeque::new();
            }
        }
        conn.queued -= written;
        self.queued -= written;
    }

    /// Sends every output of the hub where it goes.
    fn route(&mut self, now: Instant) {
        while let Some(output) = self.hub.poll_output() {
            let (session, stalled) = match output {
                HubOutput::Push {
                    session,
                    tier,
                    frame,
                } => {
                    let Some(&ch) = self.sessions.get(&session) else {
                        continue;
                    };
                    let config = &self.shared.config;
                    let limit_bytes = config.push_queue_bytes;
                    let Some(conn) = slot(&mut self.conns, ch) else {
                        continue;
                    };
                    let Some(pushes) = conn.pushes.as_deref_mut() else {
                        continue;
                    };
                    let stream = match tier {
                        Tier::Realtime => &mut pushes[0],
                        Tier::Batched => &mut pushes[1],
                    };
                    if conn.queued.saturating_add(queued_cost(&frame)) > limit_bytes {
                        (session, ch)
                    } else {
                        let (straight, queued) = write_or_queue(&mut conn.quic, stream, now, frame);
                        conn.queued += queued;
                        self.queued += queued;
                        if straight {
                            self.shared.stats.latency.observe(now.elapsed());
                        }
                        self.touch(ch);
                        continue;
                    }
                }
                HubOutput::End { session, reason } => {
                    let Some(&ch) = self.sessions.get(&session) else {
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
                        // The logout's answer goes out first, then the close.
                        EndReason::LoggedOut => continue,
                    };
                    self.close(ch, now, code, text);
                    continue;
                }
            };
            warn!(%session, "push queue full: closing the stalled connection");
            self.overloaded(stalled, now);
        }
        self.within_budget(now);
    }

    fn overloaded(&mut self, ch: usize, now: Instant) {
        self.shared.stats.overloaded.fetch_add(1, Ordering::Relaxed);
        self.close(ch, now, CloseCode::Overloaded, b"pushes not read in time");
    }

    /// Past the server's push byte budget, the slowest readers (the largest
    /// queues) are closed until the rest fits: a few clients that do not
    /// read cannot make the server run out of memory for everybody.
    fn within_budget(&mut self, now: Instant) {
        let budget = self.shared.config.push_budget_bytes;
        if self.queued <= budget {
            return;
        }
        let mut queues: Vec<(usize, usize)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(ch, c)| Some((c.as_deref()?.queued, ch)))
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

/// Writes `bytes` to a push stream, or queues it behind what waits: whether
/// it went straight into the stream, and how many bytes were queued.
fn write_or_queue(
    quic: &mut quinn_proto::Connection,
    stream: &mut PushStream,
    at: Instant,
    mut bytes: Bytes,
) -> (bool, usize) {
    if !stream.pending.is_empty() {
        let n = queued_cost(&bytes);
        stream.pending.push_back((at, bytes));
        return (false, n);
    }
    // Until all is taken or quinn says `Blocked`: only a write that is
    // refused outright promises a `Writable` event later.
    while !bytes.is_empty() {
        match quic.send_stream(stream.id).write(&bytes) {
            Ok(n) => bytes.advance(n),
            Err(quinn_proto::WriteError::Blocked) => {
                let n = queued_cost(&bytes);
                stream.pending.push_back((at, bytes));
                return (false, n);
            }
            // Stopped by the client (the connection is being closed for it).
            Err(_) => return (false, 0),
        }
    }
    (true, 0)
}

/// What one queued push entry costs beside its bytes: with it, the byte
/// limits also bound how many tiny pushes a queue can hold.
const PUSH_ENTRY_OVERHEAD: usize = std::mem::size_of::<(Instant, Bytes)>();

/// The bytes a queued push counts for in the per-connection limit and the
/// server's budget.
fn queued_cost(bytes: &Bytes) -> usize {
    bytes.len() + PUSH_ENTRY_OVERHEAD
}

fn slot(conns: &mut [Option<Box<Conn>>], ch: usize) -> Option<&mut Conn> {
    conns.get_mut(ch).and_then(|c| c.as_deref_mut())
}

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
