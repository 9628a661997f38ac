//! The server's one task: the UDP socket, the timer, the control channel
//! and the store thread around the sans-IO [`ServerState`] (the way quinn's
//! endpoint driver sits over quinn-proto). It only translates: datagrams
//! in, transmits out, control messages to inputs and answers, store
//! requests to the store thread and its results back.
//!
//! Why one task and not quinn's per-connection tasks: a presence server holds
//! many mostly idle connections, and what each costs at rest is the limit.
//! quinn's async wrapper gives every connection a driver, an event channel,
//! wakers and the application its own tasks and push queues (about 48 KiB per
//! session, measured); here a connection is one `quinn_proto::Connection` and
//! a few small fields in a slot, and the core is called directly, with no
//! channel or oneshot between a frame and its answer.
//!
//! One pass of the loop ([`Driver::pass`]), bounded by [`PassBudget`]: read
//! the socket until it is empty (or the budget is spent) and hand each
//! datagram to the state; then [`ServerState::handle_timeout`] (the due
//! timers and the touched connections, each up to its budget); then send.
//! What a budget leaves is carried to the next pass, which starts without
//! sleeping, again by reading the socket: under overload receiving is never
//! starved, and nothing one pass does grows with the backlog.
//!
//! [`PassBudget`]: super::PassBudget

use super::state::{
    Census, Datagram, ServerInput, ServerOutput, ServerState, StoreRequest, LOAD_REPORT_EVERY,
};
use super::store::{StoreError, StoreWriter};
use super::udp::Io;
use super::ws_io::{WsEvent, WsIo};
use super::{ServerEvent, Shared};
use greendot_core::Counters;
use greendot_proto::CloseCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

/// Control messages handled per pass besides the one that woke it.
const CONTROL_BATCH: usize = 64;
/// Datagrams kept while the socket's send buffer is full; beyond this they
/// are dropped (QUIC retransmits). Not while stopping: every connection's
/// close packet is kept until sent, so clients learn of it at once.
const OUTBOX_CAP: usize = 16384;

/// Messages from the [`super::Server`] handle and from store waiters.
pub(super) enum Control {
    Counters(oneshot::Sender<Counters>),
    /// The core's counters with the hub's census.
    Census(oneshot::Sender<Census>),
    /// A durable write finished.
    StoreDone {
        ticket: u64,
        result: Result<(), StoreError>,
    },
    /// From the cluster's NATS I/O.
    Cluster(crate::cluster::ClusterInput),
    /// See [`ServerInput::Stop`]; `done` once stopped.
    Stop {
        code: CloseCode,
        text: &'static [u8],
        save: bool,
        done: oneshot::Sender<()>,
    },
}

/// WebSocket events handled per pass besides the one that woke it.
const WS_BATCH: usize = 1024;

/// The next WebSocket event (never, without a listener).
async fn ws_event(ws: &mut Option<WsIo>) -> Option<WsEvent> {
    match ws {
        Some(ws) => ws.events.recv().await,
        None => std::future::pending().await,
    }
}

pub(super) struct Driver {
    pub(super) state: ServerState,
    shared: Arc<Shared>,
    pub(super) io: Io,
    store: Option<StoreWriter>,
    recv_batch: Vec<Datagram>,
    /// Answered once the state has stopped.
    done: Option<oneshot::Sender<()>>,
    stopped: bool,
    /// The WebSocket listener and connections, if enabled.
    pub(super) ws: Option<WsIo>,
    /// When the wall clock is read next (the state slews towards it).
    next_wall_read: Instant,
    /// To the cluster's NATS I/O (with a cluster only).
    pub(super) cluster: Option<mpsc::Sender<crate::cluster::ClusterOutput>>,
    /// A cluster of one's bus and KV, in place of the NATS I/O.
    pub(super) local_bus: Option<crate::cluster::local::LocalBus>,
    load: LoadWindow,
}

/// The loop's load since the last report to the state
/// ([`ServerInput::Load`]).
struct LoadWindow {
    since: Instant,
    busy: Duration,
    /// The socket's drop counter at the last report.
    drops: Option<u64>,
    /// Passes that read their whole datagram budget.
    backlogged: u32,
}

/// How often the wall clock is read, so last seen follows NTP corrections.
const WALL_READ_EVERY: Duration = Duration::from_secs(1);

impl Driver {
    pub(super) fn new(
        shared: Arc<Shared>,
        io: Io,
        mut state: ServerState,
        store: Option<StoreWriter>,
    ) -> Driver {
        state.set_max_datagrams(io.max_segments());
        Driver {
            state,
            shared,
            io,
            store,
            recv_batch: Vec::new(),
            done: None,
            stopped: false,
            ws: None,
            next_wall_read: Instant::now() + WALL_READ_EVERY,
            cluster: None,
            local_bus: None,
            load: LoadWindow {
                since: Instant::now(),
                busy: Duration::ZERO,
                drops: None,
                backlogged: 0,
            },
        }
    }

    /// Runs until stopped by [`Control::Stop`].
    pub(super) async fn run(mut self, mut control: mpsc::Receiver<Control>) {
        loop {
            if self.state.has_carried_work(Instant::now()) {
                // Work left by the last pass: let the runtime's other tasks
                // (store waiters, metrics) run, then go on without sleeping.
                tokio::task::yield_now().await;
            } else {
                let far = Instant::now() + Duration::from_secs(3600);
                let deadline = self.state.poll_timeout().unwrap_or(far).min(far);
                tokio::select! {
                    biased;
                    msg = control.recv() => match msg {
                        Some(msg) => self.on_control(Instant::now(), msg),
                        None => return,
                    },
                    event = ws_event(&mut self.ws) => match event {
                        Some(event) => self.on_ws(Instant::now(), event),
                        None => self.ws = None,
                    },
                    _ = self.io.socket.readable() => {}
                    _ = self.io.socket.writable(), if !self.io.is_empty() => {}
                    _ = tokio::time::sleep_until(deadline.into()) => {}
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
            // WebSocket events that came meanwhile (a bounded batch).
            for _ in 0..WS_BATCH {
                let Some(ws) = &mut self.ws else { break };
                match ws.events.try_recv() {
                    Ok(event) => self.on_ws(Instant::now(), event),
                    Err(_) => break,
                }
            }
            let now = Instant::now();
            if now >= self.next_wall_read {
                self.next_wall_read = now + WALL_READ_EVERY;
                let unix_ms = super::unix_now_ms();
                self.state
                    .handle_input(now, ServerInput::SetWallClock { unix_ms });
            }
            let read = self.pass(now);
            let took = now.elapsed();
            self.load.busy += took;
            if read >= self.state.config().pass.datagrams {
                self.load.backlogged += 1;
            }
            if now >= self.load.since + LOAD_REPORT_EVERY {
                self.report_load(now);
            }
            let stats = &self.shared.stats;
            stats.loop_pass.observe(took);
            if self.state.has_carried_work(Instant::now()) {
                stats.loop_carried.fetch_add(1, Ordering::Relaxed);
            }
            if self.stopped {
                self.finish().await;
                return;
            }
        }
    }

    /// Tells the state how busy the loop was and what the socket dropped
    /// since the last report (the admission rate follows).
    fn report_load(&mut self, now: Instant) {
        let window = now.saturating_duration_since(self.load.since);
        let busy_permille = (self.load.busy.as_secs_f64() / window.as_secs_f64().max(1e-9) * 1000.0)
            .min(1000.0) as u32;
        let drops = self
            .shared
            .socket_inode
            .and_then(super::metrics::UdpSocketStats::read)
            .map(|u| u.drops);
        let socket_drops = match (self.load.drops, drops) {
            (Some(before), Some(now)) => now.saturating_sub(before),
            _ => 0,
        };
        let backlogged_passes = self.load.backlogged;
        self.load = LoadWindow {
            since: now,
            busy: Duration::ZERO,
            drops: drops.or(self.load.drops),
            backlogged: 0,
        };
        self.state.handle_input(
            now,
            ServerInput::Load {
                busy_permille,
                socket_drops,
                backlogged_passes,
            },
        );
    }

    /// One pass, bounded by [`super::PassBudget`]: read the socket (until
    /// it is empty or the budget is spent) before anything else, so that
    /// timers and busy connections never starve receiving; then the state's
    /// due timers and touched connections, each up to its budget; then send.
    /// Returns how many datagrams it read.
    pub(super) fn pass(&mut self, now: Instant) -> usize {
        let read = self.receive(now);
        self.state.handle_timeout(now);
        self.drain();
        // Sending must not wait for a quiet moment in receiving.
        self.flush();
        read
    }

    /// Sends what the socket takes of the outbox; the buffers sent go
    /// back to the state.
    fn flush(&mut self) {
        self.io.flush();
        for buf in self.io.spent() {
            self.state.recycle(buf);
        }
    }

    /// Reads datagrams until the socket has none or the budget is spent
    /// (the last batch may pass it by a few); returns how many were read.
    fn receive(&mut self, now: Instant) -> usize {
        let mut batch = std::mem::take(&mut self.recv_batch);
        let budget = self.state.config().pass.datagrams;
        let mut read = 0;
        while read < budget {
            batch.clear();
            match self.io.recv(&mut batch) {
                Ok(0) => break,
                Ok(n) => read += n,
                // ICMP errors (a client gone) surface here; nothing to do,
                // but they count, so an error loop cannot spin forever.
                Err(_) => read += 1,
            }
            for d in batch.drain(..) {
                self.state.handle_datagram(now, d);
            }
            // Answers the endpoint gave at once (Retry, refusals).
            self.send_transmits();
        }
        self.recv_batch = batch;
        read
    }

    fn send_transmits(&mut self) {
        let cap = if self.state.is_stopping() {
            usize::MAX
        } else {
            OUTBOX_CAP
        };
        while let Some(t) = self.state.poll_transmit() {
            if let Some(buf) = self.io.send(cap, t) {
                self.state.recycle(buf);
            }
        }
        self.flush();
    }

    /// Everything the state has for the world: transmits, store requests,
    /// events; in a cluster of one, what its bus hands back goes in at once,
    /// until the bus has nothing more (an owner's view reaches the node's
    /// own watchers in the same pass).
    fn drain(&mut self) {
        loop {
            self.drain_outputs();
            let Some(bus) = &mut self.local_bus else {
                return;
            };
            let mut fed = false;
            while let Some(input) = bus.poll_input() {
                let now = Instant::now();
                self.state.handle_input(now, ServerInput::Cluster(input));
                fed = true;
            }
            if !fed {
                return;
            }
        }
    }

    fn drain_outputs(&mut self) {
        self.send_transmits();
        while let Some(output) = self.state.poll_output() {
            match output {
                ServerOutput::Event(event) => self.event(event),
                ServerOutput::Store(StoreRequest::Behind(batch)) => {
                    if let Some(store) = &self.store {
                        store.write_behind(batch);
                    }
                }
                ServerOutput::Store(StoreRequest::Durable {
                    ticket,
                    batch,
                    timeout,
                }) => {
                    let Some(store) = self.store.clone() else {
                        continue;
                    };
                    let tx = self.shared.control.clone();
                    // Handed over here, in the order made; the wait (for
                    // room in the writer's queue, then for the commit) is
                    // this task's, never the loop's.
                    let written = store.write_durable(batch, timeout);
                    tokio::spawn(async move {
                        let result = written.await;
                        let _ = tx.send(Control::StoreDone { ticket, result }).await;
                    });
                }
                ServerOutput::Stopped => self.stopped = true,
                ServerOutput::WsSend { id, bytes } => {
                    if let Some(ws) = &self.ws {
                        ws.send(id, bytes);
                    }
                }
                ServerOutput::WsPing { id } => {
                    if let Some(ws) = &self.ws {
                        ws.ping(id);
                    }
                }
                ServerOutput::WsClose { id, code, reason } => {
                    if let Some(ws) = &self.ws {
                        ws.close(id, code, reason);
                    }
                }
                ServerOutput::WsCredit { id, bytes } => {
                    if let Some(ws) = &self.ws {
                        ws.credit(id, bytes);
                    }
                }
                ServerOutput::Cluster(out) if self.local_bus.is_some() => {
                    if let Some(bus) = &mut self.local_bus {
                        bus.handle_output(out);
                    }
                }
                ServerOutput::Cluster(out) => {
                    let sent = self.cluster.as_ref().map(|tx| tx.try_send(out));
                    if let Some(Err(_)) = sent {
                        self.shared
                            .stats
                            .cluster_dropped
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// A WebSocket connection's event, as the state's input.
    fn on_ws(&mut self, now: Instant, event: WsEvent) {
        let input = match event {
            WsEvent::Opened { id, remote, handle } => {
                if let Some(ws) = &mut self.ws {
                    ws.opened(id, handle);
                }
                ServerInput::WsOpened { id, remote }
            }
            WsEvent::Message { id, message } => ServerInput::WsReceived { id, message },
            WsEvent::Written { id, len } => ServerInput::WsWritten { id, len },
            WsEvent::Closed { id, code } => {
                if let Some(ws) = &mut self.ws {
                    ws.closed(id);
                }
                ServerInput::WsClosed { id, code }
            }
        };
        self.state.handle_input(now, input);
        self.drain();
    }

    fn event(&self, event: ServerEvent) {
        let _ = self.shared.events.send(event);
    }

    fn on_control(&mut self, now: Instant, msg: Control) {
        match msg {
            Control::Counters(reply) => {
                let _ = reply.send(self.state.counters());
            }
            Control::Census(reply) => {
                let _ = reply.send(self.state.census());
            }
            Control::StoreDone { ticket, result } => {
                self.state
                    .handle_input(now, ServerInput::StoreDone { ticket, result });
            }
            Control::Cluster(input) => {
                self.state.handle_input(now, ServerInput::Cluster(input));
            }
            Control::Stop {
                code,
                text,
                save,
                done,
            } => {
                self.done = Some(done);
                self.state.handle_input(
                    now,
                    ServerInput::Stop {
                        code,
                        text: text.to_vec(),
                        save,
                    },
                );
            }
        }
        self.drain();
    }

    /// The end of a stop: the last close packets out, then `done`.
    async fn finish(&mut self) {
        let flush = async {
            while !self.io.is_empty() {
                if self.io.socket.writable().await.is_err() {
                    break;
                }
                self.flush();
            }
        };
        if tokio::time::timeout(Duration::from_secs(1), flush)
            .await
            .is_err()
        {
            warn!("close packets still unsent at the stop");
        }
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
    }
}

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
