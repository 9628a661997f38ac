//! Model 2: the protocol. A server actor runs the real [`Core`]; client actors
//! connect, subscribe, change what they show, lose their connection and
//! resume, and apply snapshots and pushes with the core's [`View`] (the same
//! code the client library uses). The network loses, reorders and duplicates
//! every message.
//!
//! The server actor plays the transport's part: one connection per client
//! attempt, a request is mapped to the session of the connection it came on,
//! a handshake of an attempt older than the latest is ignored (its connection
//! is gone), and every message to a client carries the attempt and a sequence
//! number, so a property can tell whether a client received everything its
//! connection was sent.

use greendot_core::{
    Config, Connect, Core, DeviceId, DeviceKind, Input, KindConfig, Millis, Output, Presence,
    RealtimeOverflow, Reply, SessionId, Status, Tier, UserId, View, Watch,
};
use stateright::actor::{
    model_timeout, Actor, ActorModel, ActorModelState, Id, LossyNetwork, Network, Out,
};
use stateright::Expectation;
use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// A presence inside a message (stateright wants messages `Ord`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shown(pub Presence);

impl Shown {
    fn key(&self) -> impl Ord + '_ {
        let p = &self.0;
        (
            p.version,
            p.online,
            p.status,
            &p.message,
            p.kinds,
            p.last_seen,
            p.invisible,
        )
    }
}

impl Ord for Shown {
    fn cmp(&self, other: &Shown) -> Ordering {
        self.key().cmp(&other.key())
    }
}

impl PartialOrd for Shown {
    fn partial_cmp(&self, other: &Shown) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A request a client sends on a connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Req {
    Subscribe(UserId, Tier),
    SetInvisible(bool),
    SetStatus(Status),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    // client → server, tagged with the client's connection attempt
    Connect {
        attempt: u8,
        resume: Option<SessionId>,
    },
    /// Request `id` (per connection) of this connection.
    Req { attempt: u8, id: u8, req: Req },
    /// The transport noticed that this connection died (idle timeout).
    Lost { attempt: u8 },
    // server → client, tagged with the attempt and a per-connection sequence number
    Connected {
        attempt: u8,
        seq: u8,
        session: SessionId,
        resumed: bool,
        snapshots: Vec<(UserId, Shown)>,
    },
    /// A snapshot (subscribe answer) or a push.
    Update {
        attempt: u8,
        seq: u8,
        target: UserId,
        presence: Shown,
    },
    /// The server ended the session of this connection.
    Ended { attempt: u8, seq: u8 },
}

/// What one client does, besides connecting and subscribing.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClientSpec {
    pub user: UserId,
    pub kind: DeviceKind,
    /// Subscribed at every fresh (not resumed) connect.
    pub watch: Vec<(UserId, Tier)>,
    /// Invisibility toggles it may make.
    pub flips: u8,
    /// Status changes it may make (Available ↔ Away).
    pub statuses: u8,
    /// Connection losses it may suffer (each followed by a reconnect with resume).
    pub drops: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Node {
    Server(Box<ServerSpec>),
    Client(ClientSpec),
}

/// The server actor: the core it starts from, and the world's bounds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServerSpec {
    pub core: Core,
    pub max_time: u64,
    pub users: Vec<UserId>,
    /// The device kind of each client, by user.
    pub kinds: Vec<DeviceKind>,
}

/// The server: the core plus the transport's connection table.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServerState {
    pub core: Core,
    /// Latest attempt seen per actor index.
    pub latest: BTreeMap<usize, u8>,
    /// The session of each (client, attempt) connection.
    pub conns: BTreeMap<(usize, u8), SessionId>,
    /// Requests handled per connection, as a bit set (bit 15: `Lost`): the
    /// transport handles each request once, whatever the network repeats.
    pub done: BTreeMap<(usize, u8), u16>,
    /// Messages sent on each connection (the next sequence number).
    pub sent: BTreeMap<(usize, u8), u8>,
    /// Per user: when what others are shown last changed; `None` once it is
    /// at least `debounce + batch_interval` ago.
    pub since: BTreeMap<UserId, Millis>,
    /// Violations seen by the server (prefixed with the invariant id).
    pub bad: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClientState {
    pub attempt: u8,
    pub session: Option<SessionId>,
    pub view: View,
    /// The highest version ever received per target.
    pub high: BTreeMap<UserId, u64>,
    /// Sequence numbers received on the current attempt, as a bit set.
    pub got: u64,
    /// Requests sent on the current attempt.
    pub reqs: u8,
    pub invisible: bool,
    pub status: Status,
    pub flips: u8,
    pub statuses: u8,
    pub drops: u8,
    /// A connect of this client resumed its session.
    pub resumed: bool,
    /// An update arrived older than the view and was dropped.
    pub reordered: bool,
    pub bad: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NodeState {
    Server(Box<ServerState>),
    Client(Box<ClientState>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Timer {
    /// One millisecond passes on the server.
    Tick,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Act {
    ToggleInvisible,
    ToggleStatus,
    /// The connection dies; the client reconnects, resuming.
    Drop,
}

/// Shared by the actors.
#[derive(Clone, Debug)]
pub struct ProtocolCfg {
    pub config: Config,
    pub max_time: u64,
    pub clients: Vec<ClientSpec>,
}

/// The bounds of Model 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProtocolBounds {
    /// Client actors (each its own user); at least 2.
    pub clients: usize,
    /// Server time never passes this.
    pub max_time: u64,
    /// Connection losses per client.
    pub drops: u8,
    /// Invisibility toggles of the first client.
    pub flips: u8,
    /// The network may also drop any message (besides reordering and
    /// duplicating; an undelivered message already stands for one delayed
    /// forever, so this adds states, not client behaviours).
    pub lossy: bool,
}

impl ProtocolBounds {
    /// CI, with reconnects: every message may be reordered and repeated,
    /// and each client may lose its connection once and resume.
    pub const CI: ProtocolBounds = ProtocolBounds {
        clients: 2,
        max_time: 2,
        drops: 1,
        flips: 1,
        lossy: false,
    };
    /// CI, lossy: every message may also be lost (no reconnects).
    pub const CI_LOSSY: ProtocolBounds = ProtocolBounds {
        clients: 2,
        max_time: 2,
        drops: 0,
        flips: 1,
        lossy: true,
    };
}

/// Model 2 as a stateright actor model.
pub type ProtocolModel = ActorModel<Node, ProtocolCfg, ()>;
pub type ProtocolState = ActorModelState<Node, ()>;

pub fn protocol_config() -> Config {
    let kind = KindConfig {
        // The transport's keep-alive is the heartbeat: not what this model is about.
        heartbeat_timeout: Millis(1_000),
        grace: Millis(2),
    };
    Config {
        debounce: Millis(1),
        batch_interval: Millis(1),
        kinds: [kind; 4],
        max_subscriptions_per_session: 4,
        max_realtime_per_target: 4,
        realtime_overflow: RealtimeOverflow::Downgrade,
        max_message_len: 16,
        max_devices_per_user: 1,
        max_sessions: 64,
        max_users: 16,
        backgrounded: greendot_core::Backgrounded::Offline,
        // Groups are not modelled here: their defaults.
        ..Config::default()
    }
}

/// The clients of Model 2: the first (user 1) toggles its invisibility; the
/// second (user 2) watches user 1 in realtime, any further one watches user 1
/// batched. The first two may lose their connection `drops` times and resume.
pub fn clients(b: &ProtocolBounds) -> Vec<ClientSpec> {
    (0..b.clients.max(2))
        .map(|i| {
            let user = UserId(i as u64 + 1);
            let (watch, flips, statuses) = match i {
                0 => (vec![], b.flips, 0),
                1 => (vec![(UserId(1), Tier::Realtime)], 0, 0),
                _ => (vec![(UserId(1), Tier::Batched)], 0, 0),
            };
            ClientSpec {
                user,
                kind: if i == 0 {
                    DeviceKind::Mobile
                } else {
                    DeviceKind::Desktop
                },
                watch,
                flips,
                statuses,
                drops: if i < 2 { b.drops } else { 0 },
            }
        })
        .collect()
}

pub fn protocol_model(b: ProtocolBounds) -> ProtocolModel {
    protocol_model_with(b, Core::new(protocol_config()).expect("valid config"))
}

/// Model 2 with the server starting from `core` (e.g. with a mutant on).
pub fn protocol_model_with(b: ProtocolBounds, core: Core) -> ProtocolModel {
    let clients = clients(&b);
    let users = users_of(&clients);
    let kinds = clients.iter().map(|c| c.kind).collect();
    let cfg = ProtocolCfg {
        config: core.config().clone(),
        max_time: b.max_time,
        clients: clients.clone(),
    };
    ActorModel::new(cfg, ())
        .actor(Node::Server(Box::new(ServerSpec {
            core,
            max_time: b.max_time,
            users,
            kinds,
        })))
        .actors(clients.into_iter().map(Node::Client))
        .init_network(Network::new_unordered_duplicating([]))
        .lossy_network(if b.lossy {
            LossyNetwork::Yes
        } else {
            LossyNetwork::No
        })
        .property(Expectation::Always, "I5 invisible", |_, s| i5(s))
        .property(Expectation::Always, "I7 versions", |_, s| no_bad(s, "I7"))
        .property(Expectation::Always, "I8 convergence", i8)
        .property(Expectation::Always, "I10 no stray output", |_, s| {
            no_bad(s, "I10")
        })
        .property(Expectation::Always, "core structure", |_, s| no_bad(s, "S"))
        .property(Expectation::Sometimes, "resume within grace", |_, s| {
            clients_of(s).any(|(_, c)| c.resumed)
        })
        .property(
            Expectation::Sometimes,
            "reordered update dropped by View",
            |_, s| clients_of(s).any(|(_, c)| c.reordered),
        )
        .property(
            Expectation::Sometimes,
            "converged after a resume",
            |m, s| converged(m, s, true),
        )
}

const SERVER: usize = 0;

fn server_of(s: &ProtocolState) -> &ServerState {
    match &*s.actor_states[SERVER] {
        NodeState::Server(server) => server,
        NodeState::Client(_) => unreachable!("actor 0 is the server"),
    }
}

fn clients_of(s: &ProtocolState) -> impl Iterator<Item = (usize, &ClientState)> {
    s.actor_states
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match &**a {
            NodeState::Client(c) => Some((i, &**c)),
            NodeState::Server(_) => None,
        })
}

fn no_bad(s: &ProtocolState, id: &str) -> bool {
    let bad = |list: &[String]| {
        list.iter()
            .any(|b| b.split_once(':').is_some_and(|(p, _)| p == id))
    };
    !bad(&server_of(s).bad) && !clients_of(s).any(|(_, c)| bad(&c.bad))
}

/// No client of another user holds an up-to-date view showing an invisible
/// user online, and the server never sent one (checked as it sends).
fn i5(s: &ProtocolState) -> bool {
    if !no_bad(s, "I5") {
        return false;
    }
    let server = server_of(s);
    clients_of(s).all(|(_, c)| {
        c.view.iter().all(|(target, p)| {
            let truth = server.core.truth(target);
            !(p.online
                && truth.invisible
                && p.version >= server.core.presence(target).version
                && server
                    .core
                    .session_info(c.session.unwrap_or(SessionId(0)))
                    .map(|i| i.user)
                    != Some(target))
        })
    })
}

/// The sessions a client's up-to-date connection is subscribed to, in
/// states where it got everything its connection was sent.
fn settled<'a>(
    s: &'a ProtocolState,
    i: usize,
    c: &'a ClientState,
) -> Option<(SessionId, Vec<(UserId, Tier)>)> {
    let server = server_of(s);
    let session = c.session?;
    if server.conns.get(&(i, c.attempt)) != Some(&session) {
        return None;
    }
    if !server
        .core
        .session_info(session)
        .is_some_and(|info| info.online)
    {
        return None;
    }
    let sent = server.sent.get(&(i, c.attempt)).copied().unwrap_or(0);
    let all = if sent >= 64 {
        u64::MAX
    } else {
        (1u64 << sent) - 1
    };
    if c.got != all {
        return None;
    }
    Some((session, server.core.subscriptions(session)))
}

/// I8: a client that received everything its connection was sent sees each
/// settled target as it is shown (published, with its version).
fn i8(_: &ProtocolModel, s: &ProtocolState) -> bool {
    let server = server_of(s);
    clients_of(s).all(|(i, c)| {
        let Some((_, subs)) = settled(s, i, c) else {
            return true;
        };
        subs.iter().all(|&(target, _)| {
            if server.since.contains_key(&target) {
                return true; // not settled yet
            }
            let published = server.core.presence(target);
            c.view.get(target) == Some(&published)
                && published.same_view(&server.core.shown(target))
        })
    })
}

fn converged(_: &ProtocolModel, s: &ProtocolState, after_resume: bool) -> bool {
    let server = server_of(s);
    clients_of(s).any(|(i, c)| {
        (!after_resume || c.resumed)
            && settled(s, i, c).is_some_and(|(_, subs)| {
                subs.iter().any(|&(t, _)| {
                    !server.since.contains_key(&t)
                        && server.core.presence(t).version > 0
                        && c.view.get(t) == Some(&server.core.presence(t))
                })
            })
    })
}

impl ServerState {
    /// What each user is shown as and whether they are invisible, taken
    /// before an input so that I5 can judge what the input sent.
    fn shown_and_invisible(&self, users: &[UserId]) -> Vec<(Presence, bool)> {
        users
            .iter()
            .map(|&u| (self.core.shown(u), self.core.truth(u).invisible))
            .collect()
    }

    /// Runs one input through the core and sends what it produced.
    fn input(
        &mut self,
        users: &[UserId],
        now: Millis,
        input: Input,
        o: &mut Out<Node>,
    ) -> Result<Reply, greendot_core::Error> {
        let before: Vec<(Presence, bool)> = users
            .iter()
            .map(|&u| (self.core.shown(u), self.core.truth(u).invisible))
            .collect();
        let reply = self.core.handle_input(now, input);
        let now = self.core.now();
        while let Some(out) = self.core.poll_output() {
            match out {
                Output::Push {
                    to,
                    target,
                    presence,
                    ..
                } => {
                    let Some(conn) = self.conn_of(to) else {
                        self.bad
                            .push(format!("I10: push to {to}, which has no connection"));
                        continue;
                    };
                    let viewer = self.core.session_info(to).map(|i| i.user);
                    self.check_i5(users, &before, viewer, target, &presence);
                    let seq = self.next_seq(conn);
                    o.send(
                        Id::from(conn.0),
                        Msg::Update {
                            attempt: conn.1,
                            seq,
                            target,
                            presence: Shown(presence),
                        },
                    );
                }
                Output::SessionEnded { session, .. } => {
                    if let Some(conn) = self.conn_of(session) {
                        let seq = self.next_seq(conn);
                        o.send(
                            Id::from(conn.0),
                            Msg::Ended {
                                attempt: conn.1,
                                seq,
                            },
                        );
                    }
                }
            }
        }
        for (k, &u) in users.iter().enumerate() {
            if !self.core.shown(u).same_view(&before[k].0) {
                self.since.insert(u, now);
            }
        }
        let settle = self.core.config().debounce.0 + self.core.config().batch_interval.0;
        self.since.retain(|_, t| now.0 < t.0 + settle);
        if let Err(e) = self.core.check_invariants() {
            let tagged = e.split_once(':').is_some_and(|(id, _)| id.starts_with('I'));
            self.bad.push(if tagged { e } else { format!("S: {e}") });
        }
        reply
    }

    /// The newest connection that carries `session`.
    fn conn_of(&self, session: SessionId) -> Option<(usize, u8)> {
        self.conns
            .iter()
            .filter(|(_, &s)| s == session)
            .map(|(&k, _)| k)
            .max_by_key(|k| k.1)
    }

    fn next_seq(&mut self, conn: (usize, u8)) -> u8 {
        let seq = self.sent.entry(conn).or_insert(0);
        let out = *seq;
        *seq += 1;
        out
    }

    /// I5 as the server sends: never an invisible user shown online to
    /// another user (invisible before and after the input that produced it).
    fn check_i5(
        &mut self,
        users: &[UserId],
        before: &[(Presence, bool)],
        viewer: Option<UserId>,
        target: UserId,
        presence: &Presence,
    ) {
        if viewer == Some(target) {
            return;
        }
        let Some(k) = users.iter().position(|&u| u == target) else {
            return;
        };
        if presence.invisible {
            self.bad
                .push(format!("I5: {viewer:?} told that {target:?} is invisible"));
        }
        if presence.online && before[k].1 && self.core.truth(target).invisible {
            self.bad.push(format!(
                "I5: {viewer:?} shown invisible {target:?} online: {presence:?}"
            ));
        }
    }
}

impl ClientState {
    fn apply(&mut self, target: UserId, presence: &Presence) {
        let high = self.high.entry(target).or_insert(0);
        let older = self
            .view
            .get(target)
            .is_some_and(|p| presence.version < p.version);
        *high = (*high).max(presence.version);
        let high = *high;
        self.view.apply(target, presence.clone());
        if older {
            self.reordered = true;
        }
        if self.view.get(target).map(|p| p.version) != Some(high) {
            self.bad.push(format!(
                "I7: view of {target:?} at version {:?} after version {high} was received",
                self.view.get(target).map(|p| p.version)
            ));
        }
    }

    fn next_req(&mut self) -> u8 {
        self.reqs += 1;
        self.reqs - 1
    }

    /// Accepts a message of the current attempt once.
    fn accept(&mut self, attempt: u8, seq: u8) -> bool {
        if attempt != self.attempt || seq >= 64 || self.got & (1 << seq) != 0 {
            return false;
        }
        self.got |= 1 << seq;
        true
    }

    fn choices(&self) -> Vec<Act> {
        let mut acts = Vec::new();
        if self.flips > 0 {
            acts.push(Act::ToggleInvisible);
        }
        if self.statuses > 0 {
            acts.push(Act::ToggleStatus);
        }
        if self.drops > 0 {
            acts.push(Act::Drop);
        }
        acts
    }
}

fn offer(o: &mut Out<Node>, c: &ClientState) {
    let acts = c.choices();
    if acts.is_empty() {
        o.remove_random("act");
    } else {
        o.choose_random("act", acts);
    }
}

fn users_of(cfg: &[ClientSpec]) -> Vec<UserId> {
    cfg.iter().map(|c| c.user).collect()
}

impl Actor for Node {
    type Msg = Msg;
    type Timer = Timer;
    type State = NodeState;
    type Storage = ();
    type Random = Act;

    fn on_start(&self, _id: Id, _storage: &Option<()>, o: &mut Out<Self>) -> NodeState {
        match self {
            Node::Server(spec) => {
                o.set_timer(Timer::Tick, model_timeout());
                NodeState::Server(Box::new(ServerState {
                    core: spec.core.clone(),
                    latest: BTreeMap::new(),
                    conns: BTreeMap::new(),
                    done: BTreeMap::new(),
                    sent: BTreeMap::new(),
                    since: BTreeMap::new(),
                    bad: Vec::new(),
                }))
            }
            Node::Client(spec) => {
                let state = ClientState {
                    attempt: 1,
                    session: None,
                    view: View::new(),
                    high: BTreeMap::new(),
                    got: 0,
                    reqs: 0,
                    invisible: false,
                    status: Status::Available,
                    flips: spec.flips,
                    statuses: spec.statuses,
                    drops: spec.drops,
                    resumed: false,
                    reordered: false,
                    bad: Vec::new(),
                };
                o.send(
                    Id::from(SERVER),
                    Msg::Connect {
                        attempt: 1,
                        resume: None,
                    },
                );
                offer(o, &state);
                NodeState::Client(Box::new(state))
            }
        }
    }

    fn on_msg(&self, _id: Id, state: &mut Cow<NodeState>, src: Id, msg: Msg, o: &mut Out<Self>) {
        match self {
            Node::Server(spec) => server_msg(spec, state, src, msg, o),
            Node::Client(spec) => client_msg(spec, state, msg, o),
        }
    }

    fn on_timeout(&self, _id: Id, state: &mut Cow<NodeState>, _timer: &Timer, o: &mut Out<Self>) {
        let Node::Server(spec) = self else {
            return;
        };
        let NodeState::Server(server) = state.to_mut() else {
            return;
        };
        let now = server.core.now().0;
        if now >= spec.max_time {
            return;
        }
        let _ = server.input(&spec.users, Millis(now + 1), Input::Tick, o);
        if now + 1 < spec.max_time {
            o.set_timer(Timer::Tick, model_timeout());
        }
    }

    fn on_random(&self, _id: Id, state: &mut Cow<NodeState>, act: &Act, o: &mut Out<Self>) {
        let NodeState::Client(c) = state.to_mut() else {
            return;
        };
        let server = Id::from(SERVER);
        match act {
            Act::ToggleInvisible => {
                c.flips -= 1;
                c.invisible = !c.invisible;
                let req = Req::SetInvisible(c.invisible);
                o.send(
                    server,
                    Msg::Req {
                        attempt: c.attempt,
                        id: c.next_req(),
                        req,
                    },
                );
            }
            Act::ToggleStatus => {
                c.statuses -= 1;
                c.status = if c.status == Status::Available {
                    Status::Away
                } else {
                    Status::Available
                };
                let req = Req::SetStatus(c.status);
                o.send(
                    server,
                    Msg::Req {
                        attempt: c.attempt,
                        id: c.next_req(),
                        req,
                    },
                );
            }
            Act::Drop => {
                c.drops -= 1;
                o.send(server, Msg::Lost { attempt: c.attempt });
                c.attempt += 1;
                c.got = 0;
                c.reqs = 0;
                let resume = c.session.take();
                o.send(
                    server,
                    Msg::Connect {
                        attempt: c.attempt,
                        resume,
                    },
                );
            }
        }
        offer(o, c);
    }
}

fn server_msg(spec: &ServerSpec, state: &mut Cow<NodeState>, src: Id, msg: Msg, o: &mut Out<Node>) {
    let client = usize::from(src);
    let Some(i) = client.checked_sub(1).filter(|&i| i < spec.users.len()) else {
        return;
    };
    let (cspec, kind) = (spec.users[i], spec.kinds[i]);
    let NodeState::Server(server) = &**state else {
        return;
    };
    let now = server.core.now();
    // Decide on the borrowed state first, so that no-ops stay no-ops.
    match &msg {
        Msg::Connect { attempt, .. } => {
            if server.latest.get(&client).is_some_and(|&l| *attempt <= l) {
                return; // a handshake of a connection already replaced
            }
        }
        Msg::Req { attempt, .. } | Msg::Lost { attempt } => {
            if !server.conns.contains_key(&(client, *attempt)) {
                return; // no such connection (yet)
            }
            let bit = match &msg {
                Msg::Req { id, .. } => 1u16 << (*id).min(14),
                _ => 1 << 15,
            };
            if server
                .done
                .get(&(client, *attempt))
                .is_some_and(|d| d & bit != 0)
            {
                return; // handled already: a duplicate
            }
            let server = match state.to_mut() {
                NodeState::Server(server) => server,
                NodeState::Client(_) => unreachable!(),
            };
            *server.done.entry((client, *attempt)).or_insert(0) |= bit;
        }
        _ => return,
    }
    let NodeState::Server(server) = state.to_mut() else {
        unreachable!()
    };
    let users = &spec.users;
    match msg {
        Msg::Connect { attempt, resume } => {
            server.latest.insert(client, attempt);
            let input = Input::Connect(Connect {
                user: cspec,
                device: DeviceId(1),
                kind,
                watch: Watch::All,
                resume,
                foreground: true,
            });
            let users_before = server.shown_and_invisible(users);
            // The connection exists before the core's outputs are sent.
            let reply = server.input(users, now, input, o);
            if let Ok(Reply::Connected(c)) = reply {
                server.conns.insert((client, attempt), c.session);
                for snap in &c.snapshots {
                    server.check_i5(
                        users,
                        &users_before,
                        Some(cspec),
                        snap.target,
                        &snap.presence,
                    );
                }
                let seq = server.next_seq((client, attempt));
                o.send(
                    src,
                    Msg::Connected {
                        attempt,
                        seq,
                        session: c.session,
                        resumed: c.resumed,
                        snapshots: c
                            .snapshots
                            .into_iter()
                            .map(|s| (s.target, Shown(s.presence)))
                            .collect(),
                    },
                );
            }
        }
        Msg::Req { attempt, req, .. } => {
            let session = server.conns[&(client, attempt)];
            let input = match req {
                Req::Subscribe(target, tier) => Input::Subscribe {
                    session,
                    target,
                    tier,
                },
                Req::SetInvisible(invisible) => Input::SetInvisible { session, invisible },
                Req::SetStatus(status) => Input::SetStatus {
                    session,
                    status,
                    message: None,
                },
            };
            let users_before = server.shown_and_invisible(users);
            if let Ok(Reply::Subscribed(snap)) = server.input(users, now, input, o) {
                server.check_i5(
                    users,
                    &users_before,
                    Some(cspec),
                    snap.target,
                    &snap.presence,
                );
                let seq = server.next_seq((client, attempt));
                o.send(
                    src,
                    Msg::Update {
                        attempt,
                        seq,
                        target: snap.target,
                        presence: Shown(snap.presence),
                    },
                );
            }
        }
        Msg::Lost { attempt } => {
            let session = server.conns[&(client, attempt)];
            // Last seen is Model 1's concern; here the loss is reported as
            // heard until it was noticed.
            let input = Input::Disconnect {
                session,
                last_heard: now,
            };
            let _ = server.input(users, now, input, o);
        }
        _ => {}
    }
}

fn client_msg(spec: &ClientSpec, state: &mut Cow<NodeState>, msg: Msg, o: &mut Out<Node>) {
    let NodeState::Client(c) = &**state else {
        return;
    };
    let (attempt, seq) = match &msg {
        Msg::Connected { attempt, seq, .. }
        | Msg::Update { attempt, seq, .. }
        | Msg::Ended { attempt, seq } => (*attempt, *seq),
        _ => return,
    };
    if attempt != c.attempt || seq >= 64 || c.got & (1 << seq) != 0 {
        return; // another connection's, or a duplicate
    }
    let NodeState::Client(c) = state.to_mut() else {
        unreachable!()
    };
    c.accept(attempt, seq);
    match msg {
        Msg::Connected {
            session,
            resumed,
            snapshots,
            ..
        } => {
            c.session = Some(session);
            if resumed {
                c.resumed = true;
            }
            for (target, Shown(p)) in snapshots {
                c.apply(target, &p);
            }
            if !resumed {
                for &(target, tier) in &spec.watch {
                    let req = Req::Subscribe(target, tier);
                    let id = c.next_req();
                    o.send(Id::from(SERVER), Msg::Req { attempt, id, req });
                }
            }
        }
        Msg::Update {
            target, presence, ..
        } => c.apply(target, &presence.0),
        Msg::Ended { .. } => c.session = None,
        _ => {}
    }
}
