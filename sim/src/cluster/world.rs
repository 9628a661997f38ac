//! The multi-node world: nodes, the bus, the duty, the devices and the
//! WebSocket links between them, stepped on virtual time.

use super::bus::{Bus, Nodes, Reach};
use super::device::{user_name, Asked, Device, Heard};
use super::duty::{Duty, Membership, DUTY_EVERY, TTL};
use super::groups::{group_def, GroupTruth};
use super::{Failure, Faults, Options, Report};
use crate::rng::Rng;
use greendot_proto::{Request, Status};
use greendot_server::cluster::{ClusterInput, ClusterSettings};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use greendot_server::{ServerConfig, ServerInput, ServerOutput, ServerState, WsMessage};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"greendot simulation secret, not for production use";
const TOKEN_EXP: u64 = 4_000_000_000;
const WALL_START_MS: u64 = 1_767_225_600_000;
pub(super) const SHARDS: u32 = 8;
/// `handle_timeout` calls one node may ask for at one instant, at most.
const MAX_PASSES: usize = 10_000;
/// A device that hears nothing (not even a ping) this long gives up its
/// connection and connects elsewhere.
const CLIENT_IDLE: Duration = Duration::from_secs(25);
/// How long a `SetInvisible` unanswered with its connection may still
/// land: its deadline at the edge (the request timeout, 15 s), a request in
/// flight (2 s), and margin.
const TAINTED_FOR: Duration = Duration::from_secs(30);
/// Device ops a node may forward or retry at one instant: a few per device
/// (a connect, a change, a disconnect) after a resync, far below a loop's.
const MAX_OPS_AT_ONCE: u64 = 1_000;
/// Lease changes a cut-off node may have waiting at most: past it the run
/// fails (an unbounded queue).
const MAX_UNHEARD: usize = 1_024;

/// One node: its process (if running) and what the world knows of it.
pub(super) struct Node {
    pub state: Option<ServerState>,
    pub incarnation: u64,
    pub skew_ms: i64,
    pub paused_until: Option<Duration>,
    pub down_until: Option<Duration>,
    /// Cut off from the bus (alone) until then.
    pub cut_until: Duration,
    /// Inputs that arrived while it was paused, in order.
    backlog: VecDeque<ServerInput>,
    /// Changes of the leases while it was cut off, in order: its lease
    /// watch (a JetStream consumer) delivers them once it reaches NATS
    /// again.
    unheard: VecDeque<ClusterInput>,
    /// The status last handed to it (until in virtual time).
    pub status: BTreeMap<u32, (u64, Duration)>,
    next_duty: Duration,
    /// The latest moment it was down, paused or cut off alone.
    pub troubled_at: Duration,
    /// Its link's device ops (forwarded and retried) so far.
    ops_seen: u64,
}

impl Node {
    pub fn running(&self) -> bool {
        self.state.is_some() && self.paused_until.is_none()
    }
}

/// Something on a WebSocket link, in flight.
#[derive(Debug)]
enum WsEvent {
    ToServer {
        node: usize,
        incarnation: u64,
        input: ServerInput,
    },
    ToDevice {
        device: usize,
        conn: u64,
        bytes: Vec<u8>,
    },
    Ping {
        device: usize,
        conn: u64,
    },
    Closed {
        device: usize,
        conn: u64,
    },
}

/// The world's record of a user's invisibility.
#[derive(Debug, Default)]
pub(super) struct UserTruth {
    /// Uses invisibility at all (the no-false-offline check skips it).
    pub may_hide: bool,
    pub in_flight: u32,
    pub ambiguous: bool,
    pub invisible_acked: Option<Duration>,
    /// A `SetInvisible` went unanswered with its connection: it may still
    /// land until then (its deadline at the edge, and one request in
    /// flight), so an acknowledgement before then proves nothing.
    pub tainted_until: Duration,
    /// The last moment the user had a connected device.
    pub last_device: Duration,
    /// Versions of the offline views of the user shown to any device, and
    /// when first.
    pub offline_shown: BTreeMap<u64, Duration>,
}

pub(super) struct World {
    pub opts: Options,
    pub rng: Rng,
    base: Instant,
    pub now: Duration,
    config: ServerConfig,
    pub nodes: Vec<Node>,
    pub names: Vec<String>,
    pub bus: Bus,
    pub duty: Duty,
    /// The whole bus is down until then.
    pub bus_down_until: Duration,
    pub devices: Vec<Device>,
    pub users: Vec<UserTruth>,
    ws: BTreeMap<(Duration, u64), WsEvent>,
    ws_seq: u64,
    /// Per connection, the latest delivery time each way (TCP keeps order).
    ws_last: BTreeMap<(u64, bool), Duration>,
    /// Connection id → (device, node).
    pub conns: BTreeMap<u64, (usize, usize)>,
    next_ws: u64,
    next_action: Duration,
    next_fault: Duration,
    /// The end of the latest fault of any kind (for C3).
    pub calm_since: Duration,
    /// Message loss and duplication end then.
    lossy_until: Duration,
    /// Connections the server asked to close.
    pub closing: BTreeSet<u64>,
    pub faults: Faults,
    trace: u64,
    log: VecDeque<String>,
    pub welcomes: u64,
    pub views: u64,
    pub stale_dropped: u64,
    pub claims: u64,
    verbose: bool,
    /// What the nodes published of the group's members (G1's truth).
    pub group_truth: GroupTruth,
}

/// Runs one seed.
pub fn run(options: Options) -> Result<Report, Box<Failure>> {
    let opts = options.clone();
    crate::world::guarded(options, move || {
        let mut world = World::new(opts.clone()).map_err(|what| Failure::at_start(opts, what))?;
        for step in 0..world.opts.steps {
            if let Err(what) = world.step_once() {
                return Err(Box::new(Failure {
                    options: world.opts.clone(),
                    step,
                    at: world.now,
                    what,
                    log: world.log.iter().cloned().collect(),
                }));
            }
        }
        Ok(world.report())
    })
}

impl World {
    fn new(opts: Options) -> Result<World, String> {
        if !(1..=5).contains(&opts.nodes) {
            return Err(format!("{} nodes: 1 to 5 are simulated", opts.nodes));
        }
        let mut rng = match &opts.script {
            Some(script) => Rng::scripted(opts.seed, script.clone()),
            None => Rng::new(opts.seed),
        };
        let identity = crate::world::identity(&mut rng)?;
        let mut config = ServerConfig::new(SECRET.to_vec());
        config.identity = Some(identity);
        let keys = TokenKeys::new(SECRET, Duration::from_secs(30));
        let names: Vec<String> = (0..opts.nodes).map(|i| format!("n{i}")).collect();
        let users = opts.users.max(2);
        let mut devices = Vec::new();
        let mut truths = Vec::new();
        for user in 0..users {
            truths.push(UserTruth {
                may_hide: rng.chance(0.4),
                ..UserTruth::default()
            });
            let per_user = rng.range(1, 2) as usize;
            for d in 0..per_user {
                let targets: Vec<usize> = (0..users)
                    .filter(|&t| t != user && rng.chance(0.6))
                    .collect();
                let kind = [
                    greendot_proto::Kind::Mobile,
                    greendot_proto::Kind::Desktop,
                    greendot_proto::Kind::Web,
                ][rng.index(3)];
                let claims = Claims {
                    sub: user_name(user),
                    dev: format!("d{d}"),
                    kind,
                    watch: WatchClaim::all(),
                    svc: false,
                    exp: TOKEN_EXP,
                    iat: None,
                };
                let token = keys.mint(&claims).map_err(|e| e.to_string())?;
                let mut device = Device::new(user, token, targets);
                device.reconnect_at = Some(Duration::from_millis(rng.range(0, 5_000)));
                devices.push(device);
            }
        }
        let nodes = names
            .iter()
            .map(|_| Node {
                state: None,
                incarnation: 0,
                skew_ms: rng.range(0, 3_000) as i64 - 1_500,
                paused_until: None,
                down_until: Some(Duration::ZERO),
                cut_until: Duration::ZERO,
                backlog: VecDeque::new(),
                unheard: VecDeque::new(),
                status: BTreeMap::new(),
                next_duty: Duration::ZERO,
                troubled_at: Duration::ZERO,
                ops_seen: 0,
            })
            .collect();
        let mut bus = Bus::new(opts.nodes);
        bus.buffered = opts.buffered;
        if opts.groups {
            bus.kv.insert_group(group_def(users));
        }
        Ok(World {
            duty: Duty::new(&names, SHARDS),
            bus,
            opts,
            rng,
            base: Instant::now(),
            now: Duration::ZERO,
            config,
            nodes,
            names,
            bus_down_until: Duration::ZERO,
            devices,
            users: truths,
            ws: BTreeMap::new(),
            ws_seq: 0,
            ws_last: BTreeMap::new(),
            conns: BTreeMap::new(),
            next_ws: 0,
            next_action: Duration::from_millis(500),
            next_fault: Duration::from_secs(20),
            calm_since: Duration::ZERO,
            lossy_until: Duration::ZERO,
            closing: BTreeSet::new(),
            faults: Faults::default(),
            trace: 0xcbf2_9ce4_8422_2325,
            log: VecDeque::new(),
            welcomes: 0,
            views: 0,
            stale_dropped: 0,
            claims: 0,
            verbose: std::env::var("GREENDOT_SIM_VERBOSE").is_ok_and(|v| v == "1"),
            group_truth: GroupTruth::new(),
        })
    }

    fn report(&self) -> Report {
        Report {
            seed: self.opts.seed,
            steps: self.opts.steps,
            simulated: self.now,
            faults: self.faults,
            trace: self.trace,
            bus_messages: self.bus.counters.messages,
            sent_late: self.bus.counters.sent_late,
            welcomes: self.welcomes,
            views: self.views,
            stale_dropped: self.stale_dropped,
            claims: self.claims,
            group_judged: self.group_truth.judged,
            groups_refused: self.group_truth.refused,
        }
    }

    pub(super) fn note(&mut self, line: String) {
        for b in line.bytes() {
            self.trace ^= u64::from(b);
            self.trace = self.trace.wrapping_mul(0x0000_0100_0000_01b3);
        }
        if self.verbose {
            eprintln!("[{:>10.6}s] {line}", self.now.as_secs_f64());
        }
        if self.log.len() >= 60 {
            self.log.pop_front();
        }
        self.log
            .push_back(format!("[{:>10.3}s] {line}", self.now.as_secs_f64()));
    }

    fn instant(&self) -> Instant {
        self.base + self.now
    }

    fn wall(&self, node: usize) -> u64 {
        let wall = WALL_START_MS as i64 + self.now.as_millis() as i64 + self.nodes[node].skew_ms;
        wall.max(0) as u64
    }

    pub(super) fn reach(&self) -> Vec<Reach> {
        let bus_up = self.now >= self.bus_down_until;
        self.nodes
            .iter()
            .map(|n| Reach {
                incarnation: n.state.as_ref().map(|_| n.incarnation),
                linked: bus_up && self.now >= n.cut_until,
            })
            .collect()
    }

    fn serving(&self) -> Vec<BTreeSet<u32>> {
        self.nodes
            .iter()
            .map(|n| {
                n.status
                    .iter()
                    .filter(|(_, (_, until))| self.now < *until)
                    .map(|(s, _)| *s)
                    .collect()
            })
            .collect()
    }

    // ---- one step ----

    fn next_time(&self) -> Duration {
        let mut next = self.next_action.min(self.next_fault);
        let mut consider = |t: Option<Duration>| {
            if let Some(t) = t {
                next = next.min(t);
            }
        };
        consider(self.bus.next_at());
        consider(self.ws.keys().next().map(|(t, _)| *t));
        for node in &self.nodes {
            consider(node.down_until);
            consider(node.paused_until);
            if node.running() {
                consider(Some(node.next_duty));
                if let Some(state) = &node.state {
                    consider(
                        state
                            .poll_timeout()
                            .map(|t| t.saturating_duration_since(self.base)),
                    );
                }
            }
        }
        for d in &self.devices {
            consider(d.reconnect_at);
            if let Some(c) = &d.conn {
                consider(Some(c.heard + CLIENT_IDLE));
            }
        }
        next
    }

    fn step_once(&mut self) -> Result<(), String> {
        let next = self.next_time();
        self.now = self.now.max(next);
        let now = self.now;
        for node in 0..self.nodes.len() {
            if self.nodes[node].down_until.is_some_and(|t| t <= now) {
                self.start_node(node)?;
            }
            if self.nodes[node].paused_until.is_some_and(|t| t <= now) {
                self.nodes[node].paused_until = None;
                self.nodes[node].troubled_at = now;
                self.note(format!("{} wakes", self.names[node]));
                let backlog: Vec<ServerInput> = self.nodes[node].backlog.drain(..).collect();
                for input in backlog {
                    self.give(node, input);
                }
            }
        }
        if now >= self.lossy_until {
            self.bus.loss = 0.0;
            self.bus.duplication = 0.0;
        }
        // What woken nodes did is checked against the status they had.
        self.drive()?;
        self.duties()?;
        self.drive()?;
        let reach = self.reach();
        while let Some((to, _, input)) = self.bus.pop_due(&mut self.rng, now, &reach)? {
            self.give(to, ServerInput::Cluster(input));
        }
        while let Some(entry) = self.ws.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let event = entry.remove();
            self.ws_event(event)?;
        }
        for i in 0..self.devices.len() {
            if self.devices[i].reconnect_at.is_some_and(|t| t <= now) {
                self.devices[i].reconnect_at = None;
                self.connect(i);
            }
            let idle = self.devices[i]
                .conn
                .as_ref()
                .is_some_and(|c| c.heard + CLIENT_IDLE <= now);
            if idle {
                self.note(format!("device {i} hears nothing: gives up its connection"));
                self.drop_conn(i, true);
            }
        }
        let quiet = self.group_quiet();
        if self.next_action <= now {
            if !quiet {
                self.act();
            }
            let gap = self.rng.range(100, 3_000);
            self.next_action = now + Duration::from_millis(gap);
        }
        if self.next_fault <= now {
            if self.opts.faults && !quiet {
                self.fault();
            }
            // Faults come in stormy phases with calm ones between, so that
            // the bounds that need calm (C3) are checked too.
            let gap = if self.rng.chance(0.1) {
                self.rng.range(70_000, 150_000)
            } else {
                self.rng.range(3_000, 30_000)
            };
            self.next_fault = now + Duration::from_millis(gap);
        }
        self.drive()?;
        self.check_state()?;
        self.check_groups()
    }

    /// Hands a node an input now, or keeps it until the node wakes.
    pub(super) fn give(&mut self, node: usize, input: ServerInput) {
        let instant = self.instant();
        let n = &mut self.nodes[node];
        if n.state.is_none() {
            return;
        }
        if n.paused_until.is_some() {
            n.backlog.push_back(input);
            return;
        }
        if let Some(state) = n.state.as_mut() {
            state.handle_input(instant, input);
        }
    }

    fn start_node(&mut self, node: usize) -> Result<(), String> {
        let mut config = self.config.clone();
        let incarnation = self.wall(node).max(self.nodes[node].incarnation + 1);
        config.cluster = Some(ClusterSettings {
            node: self.names[node].clone(),
            incarnation,
            shard_count: SHARDS,
            shard_of: |user, shards| greendot_cluster::shard_of(user, shards).0,
            request_timeout: TTL,
            resync_window: TTL,
            protocol: self.opts.protocol,
            mutant: self.opts.mutant,
        });
        let seed = self.rng.next_u64();
        let mut state = ServerState::new(config, self.instant(), self.wall(node), seed, None)
            .map_err(|e| format!("node start: {e}"))?;
        state.set_group_mutant(self.opts.group_mutant);
        let n = &mut self.nodes[node];
        n.state = Some(state);
        n.incarnation = incarnation;
        n.down_until = None;
        n.status.clear();
        n.backlog.clear();
        n.unheard.clear();
        n.next_duty = self.now;
        n.troubled_at = self.now;
        n.ops_seen = 0;
        self.note(format!("{} up as {incarnation}", self.names[node]));
        self.give_groups(node);
        Ok(())
    }

    /// The duty passes due, the leases that ran out, and the statuses.
    fn duties(&mut self) -> Result<(), String> {
        let now = self.now;
        let reach = self.reach();
        // Expired leases are heard of before anyone's claims of this
        // instant (the KV's order: the expiry, then the claims it frees).
        for (node, r) in reach.iter().enumerate() {
            if r.linked {
                while let Some(input) = self.nodes[node].unheard.pop_front() {
                    self.give(node, ServerInput::Cluster(input));
                }
            }
        }
        if self.opts.buffered {
            let serving = self.serving();
            let nodes = Nodes {
                reach: &reach,
                serving: &serving,
                names: &self.names,
            };
            for node in 0..reach.len() {
                self.bus.send_held(&mut self.rng, now, nodes, node)?;
            }
        }
        let lost = self.duty.expire(now);
        self.tell_members(lost, &reach)?;
        let mut told = Vec::new();
        for (node, linked) in reach.iter().map(|r| r.linked).enumerate() {
            if !self.nodes[node].running() || self.nodes[node].next_duty > now {
                continue;
            }
            self.nodes[node].next_duty = now + DUTY_EVERY;
            if linked {
                let before = self.duty.held[node].clone();
                let incarnation = self.nodes[node].incarnation;
                told.extend(self.duty.pass(node, incarnation, now));
                let taken: Vec<(u32, u64)> = self.duty.held[node]
                    .iter()
                    .filter(|(s, (epoch, _))| before.get(s).is_none_or(|(e, _)| e != epoch))
                    .map(|(s, (epoch, _))| (*s, *epoch))
                    .collect();
                for (s, epoch) in taken {
                    self.claims += 1;
                    self.note(format!(
                        "{} claims shard {s} at epoch {epoch}",
                        self.names[node]
                    ));
                }
            }
            let status = self.duty.status(node, now);
            let changed = status.len() != self.nodes[node].status.len()
                || status
                    .iter()
                    .any(|(s, v)| self.nodes[node].status.get(s) != Some(v));
            if changed {
                self.nodes[node].status = status.clone();
                let shards = status
                    .into_iter()
                    .map(|(s, (e, until))| (s, (e, self.base + until)))
                    .collect();
                self.give(node, ServerInput::Cluster(ClusterInput::Status { shards }));
            }
        }
        self.tell_members(told, &reach)
    }

    /// Hands every other running node a change of the leases, as its
    /// lease watch would: at once if it reaches the bus, else once it does.
    fn tell_members(&mut self, events: Vec<Membership>, reach: &[Reach]) -> Result<(), String> {
        let now = self.now;
        for event in events {
            self.note(format!("membership: {event:?}"));
            for (to, r) in reach.iter().enumerate() {
                let input = match &event {
                    Membership::Lost { node, renewed } => {
                        if *node == to {
                            continue;
                        }
                        let heard = self
                            .wall(to)
                            .saturating_sub((now - *renewed).as_millis() as u64);
                        ClusterInput::EdgeLost {
                            node: self.names[*node].clone(),
                            last_heard: heard,
                        }
                    }
                    Membership::Rejoined { node } => {
                        if *node != to {
                            continue;
                        }
                        ClusterInput::Rejoined
                    }
                    Membership::Restarted { node, incarnation } => {
                        if *node == to {
                            continue;
                        }
                        ClusterInput::EdgeRestarted {
                            node: self.names[*node].clone(),
                            incarnation: *incarnation,
                            last_heard: self.wall(to),
                        }
                    }
                };
                if r.incarnation.is_none() {
                    continue;
                }
                if r.linked {
                    self.give(to, ServerInput::Cluster(input));
                } else if self.nodes[to].unheard.len() < MAX_UNHEARD {
                    self.nodes[to].unheard.push_back(input);
                } else {
                    return Err(format!(
                        "{MAX_UNHEARD} lease changes wait for a cut-off node: unbounded"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Runs every running node until it is quiet at `now`.
    fn drive(&mut self) -> Result<(), String> {
        let instant = self.instant();
        for node in 0..self.nodes.len() {
            let mut passes = 0;
            loop {
                if !self.nodes[node].running() {
                    break;
                }
                let mut outputs = Vec::new();
                if let Some(state) = self.nodes[node].state.as_mut() {
                    while state.poll_timeout().is_some_and(|t| t <= instant) {
                        state.handle_timeout(instant);
                        passes += 1;
                        if passes > MAX_PASSES {
                            return Err("a node keeps asking for work at one instant".into());
                        }
                    }
                    if let Some(t) = state.poll_transmit() {
                        return Err(format!("a QUIC transmit with no QUIC client: {t:?}"));
                    }
                    while let Some(o) = state.poll_output() {
                        outputs.push(o);
                    }
                }
                if outputs.is_empty() {
                    break;
                }
                for out in outputs {
                    self.node_output(node, out)?;
                }
                passes += 1;
                if passes > MAX_PASSES {
                    return Err("no quiescence at one instant".into());
                }
            }
            if let Some(state) = &self.nodes[node].state {
                state
                    .check()
                    .map_err(|e| format!("{}: {e}", self.names[node]))?;
                // Device ops forwarded and retried: a burst at one instant
                // is a loop between an edge and an owner, not work.
                let c = state.census().cluster.unwrap_or_default();
                let ops = c.forwarded + c.forwarded_local + c.retries;
                let before = std::mem::replace(&mut self.nodes[node].ops_seen, ops);
                if ops.saturating_sub(before) > MAX_OPS_AT_ONCE {
                    return Err(format!(
                        "{}: {} device ops at one instant (a livelock)",
                        self.names[node],
                        ops - before
                    ));
                }
            }
        }
        Ok(())
    }

    fn node_output(&mut self, node: usize, out: ServerOutput) -> Result<(), String> {
        let now = self.now;
        match out {
            ServerOutput::Cluster(out) => {
                if self.verbose {
                    eprintln!(
                        "[{:>10.6}s] {} → bus: {out:?}",
                        now.as_secs_f64(),
                        self.names[node]
                    );
                }
                self.check_output(node, &out)?;
                self.note_published(&out);
                let reach = self.reach();
                let serving = self.serving();
                let nodes = Nodes {
                    reach: &reach,
                    serving: &serving,
                    names: &self.names,
                };
                self.bus.output(&mut self.rng, now, nodes, node, out)?;
            }
            ServerOutput::WsSend { id, bytes } => {
                let len = bytes.len();
                self.give(node, ServerInput::WsWritten { id, len });
                if let Some(&(device, _)) = self.conns.get(&id) {
                    self.send_to_device(
                        WsEvent::ToDevice {
                            device,
                            conn: id,
                            bytes,
                        },
                        id,
                    );
                }
            }
            ServerOutput::WsPing { id } => {
                if let Some(&(device, _)) = self.conns.get(&id) {
                    self.send_to_device(WsEvent::Ping { device, conn: id }, id);
                }
            }
            ServerOutput::WsClose { id, code, .. } => {
                self.closing.insert(id);
                self.give(node, ServerInput::WsClosed { id, code });
                if let Some(&(device, _)) = self.conns.get(&id) {
                    self.send_to_device(WsEvent::Closed { device, conn: id }, id);
                }
            }
            ServerOutput::WsCredit { .. } => {}
            ServerOutput::Event(event) => self.note(format!("{}: {event:?}", self.names[node])),
            ServerOutput::Stopped => return Err(format!("{} stopped unasked", self.names[node])),
            other => return Err(format!("{}: unexpected output {other:?}", self.names[node])),
        }
        Ok(())
    }

    /// Queues a message to a device, after what the link already carries.
    fn send_to_device(&mut self, event: WsEvent, conn: u64) {
        let delay = Duration::from_micros(self.rng.range(500, 30_000));
        let at = self.ws_at(conn, false, delay);
        self.ws_seq += 1;
        self.ws.insert((at, self.ws_seq), event);
    }

    fn ws_at(&mut self, conn: u64, to_server: bool, delay: Duration) -> Duration {
        let last = self.ws_last.entry((conn, to_server)).or_default();
        let at = (self.now + delay).max(*last);
        *last = at;
        at
    }

    fn send_to_server(&mut self, conn: u64, node: usize, input: ServerInput) {
        if self.nodes[node].state.is_none() {
            return;
        }
        let incarnation = self.nodes[node].incarnation;
        let delay = Duration::from_micros(self.rng.range(500, 30_000));
        let at = self.ws_at(conn, true, delay);
        self.ws_seq += 1;
        self.ws.insert(
            (at, self.ws_seq),
            WsEvent::ToServer {
                node,
                incarnation,
                input,
            },
        );
    }

    fn ws_event(&mut self, event: WsEvent) -> Result<(), String> {
        match event {
            WsEvent::ToServer {
                node,
                incarnation,
                input,
            } => {
                if self.nodes[node].state.is_some() && self.nodes[node].incarnation == incarnation {
                    self.give(node, input);
                }
            }
            WsEvent::ToDevice {
                device,
                conn,
                bytes,
            } => {
                if self.devices[device]
                    .conn
                    .as_ref()
                    .is_some_and(|c| c.id == conn)
                {
                    let heard = self.devices[device].receive(&bytes, self.now);
                    for h in heard {
                        self.heard(device, h)?;
                    }
                }
            }
            WsEvent::Ping { device, conn } => {
                let open = self.devices[device]
                    .conn
                    .as_ref()
                    .is_some_and(|c| c.id == conn);
                if open {
                    if let Some(c) = self.devices[device].conn.as_mut() {
                        c.heard = self.now;
                    }
                    let node = self.conns[&conn].1;
                    let pong = ServerInput::WsReceived {
                        id: conn,
                        message: WsMessage::Pong,
                    };
                    self.send_to_server(conn, node, pong);
                }
            }
            WsEvent::Closed { device, conn } => {
                if self.devices[device]
                    .conn
                    .as_ref()
                    .is_some_and(|c| c.id == conn)
                {
                    self.note(format!(
                        "device {device}: the server closed connection {conn}"
                    ));
                    self.drop_conn(device, false);
                }
            }
        }
        Ok(())
    }

    /// What a device heard, checked and acted on.
    fn heard(&mut self, device: usize, heard: Heard) -> Result<(), String> {
        match heard {
            Heard::Welcome {
                resumed,
                session,
                covered,
            } => {
                self.welcomes += 1;
                self.note(format!(
                    "device {device} welcomed (session {session}, resumed {resumed})"
                ));
                self.group_welcomed(device);
                // What did not carry over is asked for (as clients do).
                if !covered && !self.devices[device].targets.is_empty() {
                    if let Some(frame) = self.devices[device].subscribe() {
                        self.send_frame(device, frame);
                    }
                }
            }
            Heard::View {
                target,
                presence,
                stream,
            } => {
                self.views += 1;
                self.note(format!(
                    "device {device} shown u{target} at {:#x}: online {}",
                    presence.version, presence.online
                ));
                if let Some(c) = self.devices[device].conn.as_mut().filter(|_| stream != 0) {
                    let highest = c.versions.entry((stream, target)).or_default();
                    if presence.version <= *highest {
                        return Err(format!(
                            "versions: device {device} pushed u{target} at {:#x} after {:#x} on one push stream",
                            presence.version, *highest
                        ));
                    }
                    *highest = presence.version;
                }
                let older = self.devices[device]
                    .seen
                    .get(&target)
                    .is_some_and(|s| presence.version < s.version);
                if older {
                    // Older than one it was shown (a snapshot and a push
                    // cross on their streams, or a node's cache is behind
                    // on a resume): dropped, as clients do.
                    self.stale_dropped += 1;
                    return Ok(());
                }
                self.check_view(device, target, &presence)?;
                if !presence.online {
                    let now = self.now;
                    let shown = &mut self.users[target].offline_shown;
                    shown.entry(presence.version).or_insert(now);
                }
                let seen = super::device::Seen {
                    version: presence.version,
                    online: presence.online,
                    at: self.now,
                };
                self.devices[device].seen.insert(target, seen);
            }
            Heard::Answer { asked, ok } => {
                let user = self.devices[device].user;
                if let Asked::SetInvisible(invisible) = asked {
                    let u = &mut self.users[user];
                    u.in_flight = u.in_flight.saturating_sub(1);
                    let acked = invisible
                        && ok
                        && !u.ambiguous
                        && u.in_flight == 0
                        && self.now >= u.tainted_until;
                    if acked {
                        u.invisible_acked = Some(self.now);
                    }
                    if !ok {
                        // Failed (its owner late): it may still land.
                        u.ambiguous = true;
                        u.invisible_acked = None;
                        u.tainted_until = u.tainted_until.max(self.now + TAINTED_FOR);
                    } else if u.in_flight == 0 && !invisible {
                        u.ambiguous = false;
                    }
                    if acked {
                        self.note(format!("u{user}: invisible, acknowledged"));
                    }
                }
                if asked == Asked::Subscribe && !ok {
                    // Asked again (the owner may be changing hands).
                    if let Some(frame) = self.devices[device].subscribe() {
                        self.send_frame(device, frame);
                    }
                }
                if asked == Asked::Logout && ok {
                    self.note(format!("device {device}: logout answered"));
                }
            }
            Heard::Error(e) => return Err(format!("device {device}: {e}")),
            Heard::Nothing => {}
            group @ (Heard::GroupAnswer(_) | Heard::GroupPush { .. } | Heard::GroupEnded) => {
                self.group_heard(device, group)?
            }
        }
        Ok(())
    }

    pub(super) fn send_frame(&mut self, device: usize, frame: Vec<u8>) {
        self.group_truth.input_at = self.now;
        let Some(conn) = &self.devices[device].conn else {
            return;
        };
        let (id, node) = (conn.id, conn.node);
        let input = ServerInput::WsReceived {
            id,
            message: WsMessage::Binary(frame),
        };
        self.send_to_server(id, node, input);
    }

    /// Connects a device to a running node (resuming its last session).
    fn connect(&mut self, device: usize) {
        self.group_truth.input_at = self.now;
        let up: Vec<usize> = (0..self.nodes.len())
            .filter(|&n| self.nodes[n].state.is_some())
            .collect();
        if up.is_empty() {
            self.devices[device].reconnect_at = Some(self.now + Duration::from_secs(1));
            return;
        }
        let node = up[self.rng.index(up.len())];
        self.next_ws += 1;
        let id = self.next_ws;
        self.conns.insert(id, (device, node));
        self.devices[device].conn = Some(super::device::Conn {
            id,
            node,
            welcomed: None,
            subscribed: None,
            pending: Default::default(),
            heard: self.now,
            logging_out: false,
            versions: BTreeMap::new(),
            group: None,
        });
        let remote =
            SocketAddr::from((Ipv4Addr::new(10, 1, 0, device as u8 + 1), 1000 + id as u16));
        self.send_to_server(id, node, ServerInput::WsOpened { id, remote });
        let hello = self.devices[device].hello();
        self.send_to_server(
            id,
            node,
            ServerInput::WsReceived {
                id,
                message: WsMessage::Binary(hello),
            },
        );
        self.note(format!(
            "device {device} connects to {} ({id})",
            self.names[node]
        ));
    }

    /// The device's connection ends; `tell`: the device closes it (the
    /// node hears of it). It comes back later, resuming.
    fn drop_conn(&mut self, device: usize, tell: bool) {
        self.group_truth.input_at = self.now;
        let Some(conn) = self.devices[device].conn.take() else {
            return;
        };
        let user = self.devices[device].user;
        self.users[user].last_device = self.now;
        if tell {
            let input = ServerInput::WsClosed {
                id: conn.id,
                code: Some(1000),
            };
            self.send_to_server(conn.id, conn.node, input);
        }
        for asked in conn.pending.values() {
            if let Asked::SetInvisible(_) = asked {
                // Unanswered: it may still be applied.
                let u = &mut self.users[user];
                u.in_flight = u.in_flight.saturating_sub(1);
                u.ambiguous = true;
                u.invisible_acked = None;
                u.tainted_until = u.tainted_until.max(self.now + TAINTED_FOR);
            }
        }
        if conn.logging_out {
            self.devices[device].resume = None;
            self.devices[device].reconnect_at =
                Some(self.now + Duration::from_millis(self.rng.range(5_000, 90_000)));
        } else {
            // Mostly back at once (resuming); now and then away for minutes
            // (its user goes offline: what C3 bounds).
            let away = if self.rng.chance(0.25) {
                self.rng.range(60_000, 400_000)
            } else {
                self.rng.range(100, 8_000)
            };
            self.devices[device].reconnect_at = Some(self.now + Duration::from_millis(away));
        }
    }

    /// One device does something.
    fn act(&mut self) {
        let device = self.rng.index(self.devices.len());
        let welcomed = self.devices[device]
            .conn
            .as_ref()
            .is_some_and(|c| c.welcomed.is_some() && !c.logging_out);
        if !welcomed {
            return;
        }
        let user = self.devices[device].user;
        match self.rng.below(100) {
            0..=39 => {
                let status = [Status::Available, Status::Away, Status::Busy][self.rng.index(3)];
                if let Some(f) = self.devices[device].set_status(status) {
                    self.send_frame(device, f);
                }
            }
            40..=54 if self.users[user].may_hide => {
                let invisible = self.rng.chance(0.5);
                let u = &mut self.users[user];
                if u.in_flight > 0 {
                    u.ambiguous = true;
                }
                if !invisible {
                    u.invisible_acked = None;
                }
                u.in_flight += 1;
                self.note(format!(
                    "device {device} asks u{user} invisible {invisible}"
                ));
                let req = Request::SetInvisible { invisible };
                if let Some(f) = self.devices[device].request(req, Asked::SetInvisible(invisible)) {
                    self.send_frame(device, f);
                }
            }
            55..=69 => {
                self.note(format!("device {device} closes its connection"));
                self.drop_conn(device, true);
            }
            70..=76 => {
                self.note(format!("device {device} logs out"));
                if let Some(f) = self.devices[device].request(Request::Logout, Asked::Logout) {
                    self.send_frame(device, f);
                    if let Some(c) = self.devices[device].conn.as_mut() {
                        c.logging_out = true;
                    }
                }
            }
            77..=84 => {
                // Moves: closes here and connects (to any node) at once.
                self.faults.moves += 1;
                self.note(format!("device {device} moves"));
                self.drop_conn(device, true);
                self.devices[device].reconnect_at = Some(self.now);
            }
            _ => {}
        }
    }

    fn fault(&mut self) {
        let now = self.now;
        let node = self.rng.index(self.nodes.len());
        let up = self.nodes.iter().filter(|n| n.state.is_some()).count();
        let choice = self.rng.below(100);
        let end = match choice {
            0..=19 if up > 1 && self.nodes[node].running() => {
                self.faults.kills += 1;
                self.note(format!("kill -9 {}", self.names[node]));
                self.kill(node);
                let back = Duration::from_millis(self.rng.range(500, 20_000));
                self.nodes[node].down_until = Some(now + back);
                now + back
            }
            20..=39 if self.nodes[node].running() => {
                self.faults.pauses += 1;
                let long = self.rng.chance(0.5);
                let len = if long {
                    self.faults.long_pauses += 1;
                    TTL + Duration::from_millis(self.rng.range(1_000, 12_000))
                } else {
                    Duration::from_millis(self.rng.range(500, 6_000))
                };
                if self.rng.chance(0.5) {
                    // Its host stalls its writes in flight too: they land
                    // late, maybe after its claims lapsed.
                    self.bus.kv_slow_until = self.bus.kv_slow_until.max(now + len);
                }
                self.note(format!("pause {} for {len:?}", self.names[node]));
                self.nodes[node].paused_until = Some(now + len);
                now + len
            }
            40..=59 => {
                self.faults.cut_offs += 1;
                let len = Duration::from_millis(self.rng.range(1_000, 30_000));
                self.note(format!("cut {} off the bus for {len:?}", self.names[node]));
                let n = &mut self.nodes[node];
                n.cut_until = n.cut_until.max(now + len);
                now + len
            }
            60..=69 => {
                self.faults.outages += 1;
                let len = Duration::from_millis(self.rng.range(2_000, 20_000));
                self.note(format!("the whole bus stops for {len:?}"));
                self.bus_down_until = self.bus_down_until.max(now + len);
                now + len
            }
            70..=84 => {
                self.faults.lossy += 1;
                self.bus.loss = self.rng.range(1, 10) as f64 / 100.0;
                self.bus.duplication = self.rng.range(0, 5) as f64 / 100.0;
                self.note(format!(
                    "lossy bus: {:.2} lost, {:.2} duplicated",
                    self.bus.loss, self.bus.duplication
                ));
                let len = Duration::from_millis(self.rng.range(2_000, 20_000));
                self.lossy_until = now + len;
                now + len
            }
            _ => {
                self.faults.slow_kv += 1;
                let len = Duration::from_millis(self.rng.range(2_000, 15_000));
                self.note(format!("slow KV for {len:?}"));
                self.bus.kv_slow_until = now + len;
                now + len
            }
        };
        self.calm_since = self.calm_since.max(end);
    }

    pub(super) fn kill(&mut self, node: usize) {
        self.nodes[node].state = None;
        self.nodes[node].paused_until = None;
        self.nodes[node].backlog.clear();
        self.nodes[node].status.clear();
        self.nodes[node].troubled_at = self.now;
        self.bus.node_gone(node);
        self.duty.forget(node);
        let on_it: Vec<(u64, usize)> = self
            .conns
            .iter()
            .filter(|(_, (_, n))| *n == node)
            .map(|(id, (d, _))| (*id, *d))
            .collect();
        for (id, device) in on_it {
            self.send_to_device(WsEvent::Closed { device, conn: id }, id);
        }
    }
}
