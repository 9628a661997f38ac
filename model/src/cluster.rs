//! Model 3: the cluster. Nodes that are each an edge and an owner, a
//! linearizable KV with leases (TTL) and compare-and-set, and a network that
//! loses, delays and reorders messages; nodes crash, restart, and get cut off
//! from the KV. Every owner runs the real [`Core`] (with the cluster inputs:
//! `enter_epoch`, `restore_owned`, `hold_offline_until`, `handle_edge_lost`,
//! `poll_published`) and the watcher's edge runs the real [`Fanout`] and the
//! client's [`View`].
//!
//! It is written as a plain stateright `Model` whose actions are the steps of
//! actors (one node handles one message; the KV applies one operation; the
//! network drops one message; time advances), because the protocol rests on
//! one timing assumption an actor model cannot state: clocks run at the same
//! rate, so an owner that failed to renew stops acting before the KV expires
//! its claim. Time is global and advances in ticks; a `Tick` runs everything
//! time-driven, deterministically: lease renewals (compare-and-set), lapses,
//! KV expiries, edge-lost handling, claims of free shards, core timers,
//! beacons and retries.
//!
//! The world: one shard; alice (user 1) has one device, connected at an edge;
//! bob (user 2) watches alice in realtime from node 0, which never fails.
//! Faults (bounded counts): crash, restart, cut-off of any other node; a lost
//! message. Alice's client reconnects to a live node within grace after its
//! edge died, or gives up; it may turn invisible once.
//!
//! Delay: a message sent at tick t is delivered (or lost) before the clock
//! passes t + 1, in any order: delays shorter than two ticks. Faults and
//! alice's reconnects happen at tick starts; a node's calls to itself are
//! in process. docs/cluster.md ("The model") describes the protocol as
//! checked, the bounds and the holes found.

use greendot_core::cluster::{epoch_of, owner_of, DeviceRecord, OwnedRecord};
use greendot_core::{
    Config, Connect, Core, DeviceId, DeviceKind, Epoch, Fanout, KindConfig, Millis, NodeId, Output,
    Presence, RealtimeOverflow, SessionId, ShardId, Tier, UserId, View, Watch,
};
use stateright::{Model, Property};
use std::collections::{BTreeMap, BTreeSet};

use crate::protocol::Shown;

pub const ALICE: UserId = UserId(1);
pub const BOB: UserId = UserId(2);
/// Bob's session at node 0's edge (edge-local id).
const BOB_SESSION: SessionId = SessionId(1);
/// The node of bob's watcher: never faulted.
pub const WATCHER_NODE: u8 = 0;
const SHARD: ShardId = ShardId(0);

/// Timing, in ticks (the cores' milliseconds are ticks).
pub const TTL: u64 = 3;
/// An owner that could not renew stops this long before its claim can
/// expire; an edge closes its clients then too.
pub const MARGIN: u64 = 1;
pub const GRACE: u64 = 2;
pub const DEBOUNCE: u64 = 1;
/// A new owner's resync window.
pub const RESYNC: u64 = 3;

/// The bound of C3: a device whose edge died and that does not come back
/// is shown offline by its owner within this many ticks of the death.
pub const GHOST_BOUND: u64 = TTL + if GRACE > RESYNC { GRACE } else { RESYNC } + DEBOUNCE;

/// Deliberately broken variants of the protocol, one per property.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClusterMutant {
    /// An owner that failed to renew its claim keeps acting (C1).
    KeepOwningAfterLapse,
    /// A new owner publishes offline before its resync window closes (C2).
    NoResyncHold,
    /// Owners ignore the expiry of an edge's lease: its devices stay Online
    /// until the heartbeat timeout (C3).
    IgnoreEdgeLost,
    /// `SetInvisible` is acknowledged without writing the KV (C4).
    InvisibleInMemory,
    /// A new owner's versions restart from zero (C5).
    NoEpochInVersions,
    /// An owner acknowledges `SetInvisible` for a device it has no live
    /// session of (a new owner before the device's resync) without storing
    /// anything (C4; a hole the model found, see docs/cluster.md).
    AckWithoutSession,
    /// An edge takes an owner's `Ended` by connection id alone, which
    /// restarts with the process (C3; a hole the model found).
    EndedWithoutIncarnation,
    /// A restarted node renews its lease under the same key, value and
    /// owners keep its old incarnation's devices (C3; the hole the model
    /// found, see docs/cluster.md).
    NoIncarnation,
    /// Edges ignore the owner's beacons: a lost last view leaves the
    /// watcher stale until the next change (C5).
    NoBeacon,
}

impl ClusterMutant {
    pub const ALL: [ClusterMutant; 9] = [
        ClusterMutant::KeepOwningAfterLapse,
        ClusterMutant::NoResyncHold,
        ClusterMutant::IgnoreEdgeLost,
        ClusterMutant::InvisibleInMemory,
        ClusterMutant::NoEpochInVersions,
        ClusterMutant::NoIncarnation,
        ClusterMutant::AckWithoutSession,
        ClusterMutant::EndedWithoutIncarnation,
        ClusterMutant::NoBeacon,
    ];

    /// The CI bound it is checked at: the smallest that shows it.
    pub fn bound(self) -> (&'static str, ClusterBounds) {
        let name = match self {
            ClusterMutant::KeepOwningAfterLapse => "cut",
            ClusterMutant::NoIncarnation
            | ClusterMutant::IgnoreEdgeLost
            | ClusterMutant::EndedWithoutIncarnation => "edge",
            ClusterMutant::NoResyncHold | ClusterMutant::AckWithoutSession => "three",
            ClusterMutant::InvisibleInMemory | ClusterMutant::NoEpochInVersions => "crash",
            ClusterMutant::NoBeacon => "lossy",
        };
        *ClusterBounds::CI
            .iter()
            .find(|(n, _)| *n == name)
            .expect("a CI bound")
    }

    /// The property that must catch it.
    pub fn property(self) -> &'static str {
        match self {
            ClusterMutant::KeepOwningAfterLapse => "C1 one writer",
            ClusterMutant::NoResyncHold => "C2 no false offline on failover",
            ClusterMutant::IgnoreEdgeLost
            | ClusterMutant::NoIncarnation
            | ClusterMutant::EndedWithoutIncarnation => "C3 bounded ghosts",
            ClusterMutant::InvisibleInMemory | ClusterMutant::AckWithoutSession => {
                "C4 invisible survives failover"
            }
            ClusterMutant::NoEpochInVersions | ClusterMutant::NoBeacon => "C5 convergence",
        }
    }
}

/// The size of the checked world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClusterBounds {
    /// 2 or 3.
    pub nodes: u8,
    /// Where alice's device first connects.
    pub alice_edge: u8,
    /// Who holds the shard's claim at time 0 (epoch 1).
    pub first_owner: u8,
    pub crashes: u8,
    pub restarts: u8,
    /// Cut-offs from the KV (the node can still send and receive messages:
    /// the worst case for a zombie owner).
    pub cuts: u8,
    /// Messages the network may lose.
    pub drops: u8,
    /// Invisibility toggles of alice (to invisible only), only at tick
    /// `invisible_at`.
    pub flips: u8,
    pub invisible_at: u64,
    /// Faults (crash, restart, cut, loss) happen at ticks up to this one.
    pub faults_until: u64,
    pub max_time: u64,
    /// Which of the "sometimes" properties this bound must reach.
    pub reaches: &'static [&'static str],
}

impl ClusterBounds {
    /// Two nodes: bob on 0; alice's edge and her shard's owner on 1, which
    /// crashes once and may restart (at ticks up to 3); alice may go
    /// invisible at tick 1; failover to node 0, where she reconnects (or to
    /// the restarted 1).
    pub const CRASH: ClusterBounds = ClusterBounds {
        nodes: 2,
        alice_edge: 1,
        first_owner: 1,
        crashes: 1,
        restarts: 1,
        cuts: 0,
        drops: 0,
        flips: 1,
        invisible_at: 1,
        faults_until: 3,
        max_time: 8,
        reaches: &[FAILOVER, ONLINE, ONLINE_LATER, QUIET],
    };
    /// Two nodes: node 1 (alice's edge and owner) is cut off from the KV
    /// but still sends and receives: the zombie owner.
    pub const CUT: ClusterBounds = ClusterBounds {
        cuts: 1,
        crashes: 0,
        restarts: 0,
        reaches: &[FAILOVER, ONLINE, QUIET],
        ..ClusterBounds::CRASH
    };
    /// Two nodes: alice's edge (1) crashes under a live owner (0), and may
    /// restart (a new incarnation renews the same lease key) before its
    /// lease expires; long enough for C3's bound to pass.
    pub const EDGE: ClusterBounds = ClusterBounds {
        first_owner: 0,
        flips: 0,
        faults_until: 2,
        max_time: 2 + GHOST_BOUND,
        reaches: &[ONLINE, QUIET],
        ..ClusterBounds::CRASH
    };
    /// Three nodes: alice's edge and bob on 0, the owner on 2; 2 (or the
    /// bystander 1) crashes, and 1 takes the shard over from a distance:
    /// it hears of alice's device only through the resync. Alice may go
    /// invisible at tick 1.
    pub const THREE: ClusterBounds = ClusterBounds {
        nodes: 3,
        alice_edge: 0,
        first_owner: 2,
        restarts: 0,
        faults_until: 2,
        max_time: 5,
        ..ClusterBounds::CRASH
    };
    /// Two nodes, no crash: two messages may be lost, at ticks up to 2.
    pub const LOSSY: ClusterBounds = ClusterBounds {
        crashes: 0,
        restarts: 0,
        drops: 2,
        flips: 0,
        faults_until: 2,
        max_time: 5,
        reaches: &[ONLINE, QUIET],
        ..ClusterBounds::CRASH
    };
    pub const CI: [(&'static str, ClusterBounds); 5] = [
        ("crash", ClusterBounds::CRASH),
        ("cut", ClusterBounds::CUT),
        ("edge", ClusterBounds::EDGE),
        ("three", ClusterBounds::THREE),
        ("lossy", ClusterBounds::LOSSY),
    ];
}

/// The "sometimes" properties: situations a bound must reach, so a check
/// that passes is not vacuous.
pub const FAILOVER: &str = "failover happened";
pub const ONLINE: &str = "bob saw alice online";
pub const ONLINE_LATER: &str = "bob saw alice online at a later epoch";
pub const QUIET: &str = "converged and quiet";

/// What alice's edge asks her owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Connect,
    SetInvisible(bool),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Body {
    /// Edge → owner (request/reply): a device input.
    Req { edge: u8, inc: u8, rid: u8, op: Op },
    /// Owner → edge: done (after the KV write for preferences).
    Ack { epoch: Epoch, rid: u8 },
    /// Owner → edge: no live session of the device here (a new owner that
    /// has not heard of it yet): connect it again, then retry.
    Unknown { rid: u8 },
    /// Owner → edge: this session of the device was superseded by a newer
    /// connection elsewhere (or a late request of a dead edge): the edge
    /// closes the connection, and the client reconnects, as on one node.
    /// Names the connection with the edge's incarnation: connection ids
    /// restart with a process (a hole the model found: a restarted edge
    /// closed its new connection on the old one's end, and the owner kept
    /// the new session online with nobody behind it).
    Ended { inc: u8, conn: u8 },
    /// Edge → owner: a snapshot for a subscribe (or to repair a gap).
    SnapReq { edge: u8 },
    /// Owner → edge: the snapshot, as of the shard's sequence `seq`.
    Snap {
        epoch: Epoch,
        seq: u32,
        presence: Shown,
    },
    /// On the shard's subject: a published view, numbered per epoch.
    View {
        epoch: Epoch,
        seq: u32,
        presence: Shown,
    },
    /// On the shard's subject, each tick: the latest sequence number, so a
    /// lost view is noticed.
    Beacon { epoch: Epoch, seq: u32 },
    /// A new owner asks an edge to resend.
    Resync { epoch: Epoch },
    /// Edge → owner: its live device of the shard and whether it watches.
    Resynced {
        edge: u8,
        inc: u8,
        epoch: Epoch,
        /// The connection of its device, if it holds one.
        device: Option<u8>,
        watches: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Msg {
    /// The tick it was sent at.
    pub sent: u64,
    pub to: u8,
    pub body: Body,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OwnerState {
    pub epoch: Epoch,
    pub core: Core,
    /// Owner-side session → (edge, incarnation, connection) holding the
    /// device; the connection is the id of the edge's `Connect` request.
    pub sessions: BTreeMap<SessionId, (u8, u8, u8)>,
    /// Last request id handled per (edge, incarnation).
    pub last_rid: BTreeMap<(u8, u8), u8>,
    /// Published views of this epoch.
    pub seq: u32,
    pub resync_until: u64,
    /// Nodes that answered the resync (bit set).
    pub resynced: u8,
    /// Device changes not yet written to the KV (written behind).
    /// The tick of the oldest such change.
    pub dirty: Option<u64>,
    /// The last tick the claim was renewed.
    pub renewed: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EdgeDevice {
    pub rid: u8,
    /// The id of its `Connect` request: names the connection to the owner.
    pub conn: u8,
    /// The op waiting for its ack (resent each tick).
    pub pending: Option<Op>,
    /// The op to send once `pending` is acked (after an `Unknown`).
    pub then: Option<Op>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Watcher {
    pub fanout: Fanout,
    /// Bob's client's view (the edge → client stream is reliable).
    pub view: View,
    pub subscribed: bool,
    pub snap_pending: bool,
    /// The highest (epoch, seq) seen on the shard's subject.
    pub seen: (Epoch, u32),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeState {
    pub up: bool,
    pub cut: bool,
    pub inc: u8,
    /// Request ids this incarnation issued: unique per edge, so the owner's
    /// duplicate filter never mistakes a new connection's request for an
    /// old one's (a hole the model found).
    pub rids: u8,
    /// Last successful renewal of its node lease.
    pub renewed: u64,
    pub owner: Option<Box<OwnerState>>,
    pub device: Option<EdgeDevice>,
    pub watcher: Option<Box<Watcher>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Kv {
    /// Node leases: (incarnation, expires).
    pub leases: Vec<Option<(u8, u64)>>,
    /// The shard's claim: (node, epoch, expires).
    pub claim: Option<(u8, Epoch, u64)>,
    /// The shard's epoch counter (no TTL).
    pub epoch: Epoch,
    /// Alice's preferences.
    pub invisible: bool,
    /// Alice's last published view.
    pub view: Option<Presence>,
    /// Alice's devices: (edge, incarnation, connection, last heard).
    pub devices: Vec<(u8, u8, u8, u64)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Alice {
    pub at: Option<u8>,
    pub away_since: Option<u64>,
    /// Away for grace without reconnecting: she is gone for good.
    pub gone: bool,
    pub flips: u8,
    pub invisible_asked: bool,
    pub invisible_acked: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClusterState {
    pub t: u64,
    pub nodes: Vec<NodeState>,
    pub kv: Kv,
    pub net: BTreeSet<Msg>,
    pub alice: Alice,
    pub crashes: u8,
    pub restarts: u8,
    pub cuts: u8,
    pub drops: u8,
    /// The tick of the last fault or input.
    pub quiet_since: u64,
    /// No message was handled since the last tick: faults and alice's
    /// reconnects happen only then. Since a message may arrive before or
    /// after the next tick, this still puts a fault before or after each
    /// handling, with far fewer interleavings.
    pub fresh: bool,
    /// Violations seen as they happened, prefixed with the property id.
    pub bad: Vec<String>,
    /// Messages a node sends itself (its edge calling its own owner, its
    /// owner answering or publishing to its own edge): handled in process,
    /// in order, within the step that sent them. Always empty between steps.
    pub local: std::collections::VecDeque<Msg>,
}

impl ClusterState {
    /// Sends `body` from node `from` to node `to`: over the network, or in
    /// process when `to` is `from`.
    fn send(&mut self, from: u8, to: u8, body: Body) {
        let m = Msg {
            sent: self.t,
            to,
            body,
        };
        if from == to {
            self.local.push_back(m);
        } else {
            self.net.insert(m);
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Tick,
    Deliver(Msg),
    Drop(Msg),
    Crash(u8),
    Restart(u8),
    Cut(u8),
    /// Alice's client reconnects to this node.
    Reconnect(u8),
    GoInvisible,
}

pub struct ClusterModel {
    pub bounds: ClusterBounds,
    pub mutant: Option<ClusterMutant>,
    pub config: Config,
}

pub fn cluster_config() -> Config {
    let kind = KindConfig {
        // Edges forward liveness through their leases; not what this is about.
        heartbeat_timeout: Millis(1_000),
        grace: Millis(GRACE),
    };
    Config {
        debounce: Millis(DEBOUNCE),
        batch_interval: Millis(1),
        kinds: [kind; 4],
        max_subscriptions_per_session: 4,
        max_realtime_per_target: 4,
        realtime_overflow: RealtimeOverflow::Downgrade,
        max_message_len: 16,
        max_devices_per_user: 2,
        max_sessions: 64,
        max_users: 16,
        backgrounded: greendot_core::Backgrounded::Offline,
    }
}

impl ClusterModel {
    pub fn new(bounds: ClusterBounds, mutant: Option<ClusterMutant>) -> ClusterModel {
        ClusterModel {
            bounds,
            mutant,
            config: cluster_config(),
        }
    }

    fn is(&self, m: ClusterMutant) -> bool {
        self.mutant == Some(m)
    }

    fn claim_shard(&self, s: &mut ClusterState, n: u8) {
        let t = s.t;
        let epoch = Epoch(s.kv.epoch.0 + 1);
        s.kv.epoch = epoch;
        s.kv.claim = Some((n, epoch, t + TTL));
        let mut core = Core::new(self.config.clone()).expect("valid config");
        core.set_publish_views(true);
        if !self.is(ClusterMutant::NoEpochInVersions) {
            core.enter_epoch(epoch);
        }
        if !self.is(ClusterMutant::NoResyncHold) {
            core.hold_offline_until(Millis(t + RESYNC));
        }
        let mut published = s.kv.view.clone().unwrap_or_default();
        if self.is(ClusterMutant::NoEpochInVersions) {
            published.version = 0;
        }
        let record = OwnedRecord {
            invisible: s.kv.invisible,
            published,
            devices: s
                .kv
                .devices
                .iter()
                .map(|&(edge, _, _, heard)| DeviceRecord {
                    device: DeviceId(1),
                    kind: DeviceKind::Mobile,
                    edge: NodeId(edge.into()),
                    last_heard: Millis(heard),
                })
                .collect(),
            ..OwnedRecord::default()
        };
        let mut sessions = BTreeMap::new();
        if let Ok(restored) = core.restore_owned(Millis(t), ALICE, &record, Millis(t + RESYNC)) {
            for (session, &(edge, inc, conn, _)) in restored.into_iter().zip(&s.kv.devices) {
                sessions.insert(session, (edge, inc, conn));
            }
        }
        let mut owner = OwnerState {
            epoch,
            core,
            sessions,
            last_rid: BTreeMap::new(),
            seq: 0,
            resync_until: t + RESYNC,
            resynced: 0,
            dirty: None,
            renewed: t,
        };
        // This node's own edge resends at once, without a message.
        if let Some(conn) = s.nodes[n as usize].device.as_ref().map(|d| d.conn) {
            let inc = s.nodes[n as usize].inc;
            self.connect(s, &mut owner, n, inc, conn);
        }
        if let Some(w) = s.nodes[n as usize].watcher.as_deref_mut() {
            w.snap_pending = true;
            w.seen = w.seen.max((epoch, 0));
        }
        self.drain(s, n, &mut owner);
        s.nodes[n as usize].owner = Some(Box::new(owner));
        // Ask every other edge to resend (retried each tick of the window
        // where messages get lost); the first owner has nothing to recover.
        for m in (0..self.bounds.nodes).filter(|&m| m != n && epoch.0 > 1) {
            s.send(n, m, Body::Resync { epoch });
        }
    }

    /// Sends what the owner's core produced: published views on the shard's
    /// subject (and into the KV), and forgets ended sessions.
    fn drain(&self, s: &mut ClusterState, n: u8, o: &mut OwnerState) {
        while let Some(out) = o.core.poll_output() {
            if let Output::SessionEnded { session, reason } = out {
                if let Some((edge, inc, conn)) = o.sessions.remove(&session) {
                    o.dirty = o.dirty.or(Some(s.t));
                    if reason == greendot_core::EndReason::Superseded {
                        s.send(n, edge, Body::Ended { inc, conn });
                    }
                }
            }
        }
        while let Some(p) = o.core.poll_published() {
            if p.own || p.user != ALICE {
                continue; // alice's own sessions are not modelled
            }
            if s.kv
                .claim
                .is_none_or(|(holder, e, _)| holder != n || e != o.epoch)
            {
                s.bad.push(format!(
                    "C1: node {n} published at epoch {:?} without holding the claim {:?}",
                    o.epoch, s.kv.claim
                ));
            }
            if p.presence.online && s.alice.invisible_acked {
                s.bad.push(format!(
                    "C4: node {n} published invisible alice online: {:?}",
                    p.presence
                ));
            }
            o.seq += 1;
            s.kv.view = Some(p.presence.clone());
            s.send(
                n,
                WATCHER_NODE,
                Body::View {
                    epoch: o.epoch,
                    seq: o.seq,
                    presence: Shown(p.presence),
                },
            );
        }
    }

    fn owner_msg(&self, s: &mut ClusterState, n: u8, body: Body) {
        let Some(mut o) = s.nodes[n as usize].owner.take() else {
            return; // not an owner (any more): the edge retries elsewhere
        };
        let t = s.t;
        match body {
            Body::Req { edge, inc, rid, op } => {
                let done = o.last_rid.get(&(edge, inc)).is_some_and(|&r| rid <= r);
                let mut reply = Body::Ack {
                    epoch: o.epoch,
                    rid,
                };
                if !done {
                    match op {
                        Op::Connect => {
                            o.last_rid.insert((edge, inc), rid);
                            self.connect(s, &mut o, edge, inc, rid);
                        }
                        Op::SetInvisible(b) => {
                            let session = o
                                .sessions
                                .iter()
                                .find(|&(&k, &(e, i, _))| (e, i) == (edge, inc) && live(&o.core, k))
                                .map(|(&k, _)| k);
                            // Hole found by the model: a new owner that has
                            // not heard of the device yet (its resync or its
                            // KV record still to come) acked without storing
                            // anything. It answers Unknown instead, unrecorded,
                            // and the edge connects the device again first.
                            match session {
                                Some(session) => {
                                    o.last_rid.insert((edge, inc), rid);
                                    if o.core.handle_set_invisible(Millis(t), session, b).is_ok()
                                        && !self.is(ClusterMutant::InvisibleInMemory)
                                    {
                                        s.kv.invisible = b; // before the ack
                                    }
                                }
                                None if self.is(ClusterMutant::AckWithoutSession) => {
                                    o.last_rid.insert((edge, inc), rid);
                                }
                                None => reply = Body::Unknown { rid },
                            }
                        }
                    }
                }
                s.send(n, edge, reply);
            }
            Body::SnapReq { edge } => {
                if let Ok(p) = o.core.handle_snapshot(Millis(t), ALICE, false) {
                    s.send(
                        n,
                        edge,
                        Body::Snap {
                            epoch: o.epoch,
                            seq: o.seq,
                            presence: Shown(p),
                        },
                    );
                }
            }
            Body::Resynced {
                edge,
                inc,
                epoch,
                device,
                watches,
            } if epoch == o.epoch => {
                o.resynced |= 1 << edge;
                if let Some(conn) = device {
                    self.connect(s, &mut o, edge, inc, conn);
                }
                if watches {
                    if let Ok(p) = o.core.handle_snapshot(Millis(t), ALICE, false) {
                        s.send(
                            n,
                            edge,
                            Body::Snap {
                                epoch: o.epoch,
                                seq: o.seq,
                                presence: Shown(p),
                            },
                        );
                    }
                }
            }
            _ => {}
        }
        self.drain(s, n, &mut o);
        s.nodes[n as usize].owner = Some(o);
    }

    fn connect(&self, s: &mut ClusterState, o: &mut OwnerState, edge: u8, inc: u8, conn: u8) {
        let known: Vec<SessionId> = o
            .sessions
            .iter()
            .filter(|&(_, &e)| e == (edge, inc, conn))
            .map(|(&session, _)| session)
            .collect();
        if known.iter().any(|&k| live(&o.core, k)) {
            return; // this connection is live here already (a retry, a resync)
        }
        // Restored from the KV as Lingering: the new session supersedes it,
        // and the edge must not be told to close the connection.
        for k in known {
            o.sessions.remove(&k);
        }
        let c = Connect {
            user: ALICE,
            device: DeviceId(1),
            kind: DeviceKind::Mobile,
            watch: Watch::All,
            resume: None,
            foreground: true,
        };
        if let Ok(c) = o.core.handle_connect(Millis(s.t), c) {
            o.sessions.insert(c.session, (edge, inc, conn));
            o.dirty = o.dirty.or(Some(s.t));
        }
    }

    /// An edge handles a message; a snapshot found stale or missing is
    /// asked for at once (and again at each tick until answered).
    fn edge_msg(&self, s: &mut ClusterState, n: u8, body: Body) {
        let pending = |s: &ClusterState| {
            s.nodes[n as usize]
                .watcher
                .as_ref()
                .is_some_and(|w| w.snap_pending)
        };
        // A stale snapshot answers the pending request: ask again.
        let before = pending(s) && !matches!(body, Body::Snap { .. });
        self.edge_msg_inner(s, n, body);
        if !before && pending(s) {
            if let Some((holder, _, _)) = s.kv.claim {
                s.send(n, holder, Body::SnapReq { edge: n });
            }
        }
    }

    fn edge_msg_inner(&self, s: &mut ClusterState, n: u8, body: Body) {
        let t = s.t;
        let node = &mut s.nodes[n as usize];
        match body {
            Body::Ended { inc, conn } => {
                let this_process =
                    node.inc == inc || self.is(ClusterMutant::EndedWithoutIncarnation);
                if this_process && node.device.as_ref().is_some_and(|d| d.conn == conn) {
                    node.device = None;
                    s.alice.at = None;
                    s.alice.away_since = Some(t);
                }
            }
            Body::Ack { rid, .. } => {
                if let Some(d) = node.device.as_mut().filter(|d| d.rid == rid) {
                    if let Some(Op::SetInvisible(true)) = d.pending {
                        s.alice.invisible_acked = true;
                    }
                    d.pending = d.then.take();
                    if let Some(op) = d.pending {
                        node.rids += 1;
                        d.rid = node.rids;
                        let req = Body::Req {
                            edge: n,
                            inc: node.inc,
                            rid: d.rid,
                            op,
                        };
                        if let Some((holder, _, _)) = s.kv.claim {
                            s.send(n, holder, req);
                        }
                    }
                }
            }
            Body::Unknown { rid } => {
                if let Some(d) = node.device.as_mut().filter(|d| d.rid == rid) {
                    d.then = d.pending.take();
                    node.rids += 1;
                    d.rid = node.rids;
                    d.conn = d.rid; // a new connection to the owner
                    d.pending = Some(Op::Connect);
                    let req = Body::Req {
                        edge: n,
                        inc: node.inc,
                        rid: d.rid,
                        op: Op::Connect,
                    };
                    if let Some((holder, _, _)) = s.kv.claim {
                        s.send(n, holder, req);
                    }
                }
            }
            Body::Resync { epoch } => {
                let watches = node.watcher.is_some();
                if let Some(w) = node.watcher.as_deref_mut() {
                    w.snap_pending = true; // the snapshot comes with the answer
                    w.seen = w.seen.max((epoch, 0));
                }
                let body = Body::Resynced {
                    edge: n,
                    inc: node.inc,
                    epoch,
                    device: node.device.as_ref().map(|d| d.conn),
                    watches,
                };
                if let Some((holder, _, _)) = s.kv.claim.filter(|c| c.1 == epoch) {
                    s.send(n, holder, body);
                }
            }
            Body::Snap {
                epoch,
                seq,
                presence,
            } => {
                let Some(w) = node.watcher.as_deref_mut() else {
                    return;
                };
                // Hole found by the model: a view may overtake the snapshot
                // of an edge still subscribing; a snapshot older than a view
                // already seen is applied but asked for again.
                w.snap_pending = (epoch, seq) < w.seen;
                w.seen = w.seen.max((epoch, seq));
                let updates = if !w.subscribed {
                    w.subscribed = true;
                    let snap = w
                        .fanout
                        .subscribe(Millis(t), BOB_SESSION, ALICE, Tier::Realtime, presence.0)
                        .unwrap_or_default();
                    vec![snap]
                } else {
                    w.fanout.apply(Millis(t), ALICE, false, presence.0);
                    pushes(&mut w.fanout)
                };
                for p in updates {
                    bob_sees(s, n, p);
                }
            }
            Body::View {
                epoch,
                seq,
                presence,
            } => {
                let Some(w) = node.watcher.as_deref_mut() else {
                    return;
                };
                if (epoch, seq) > w.seen && !w.subscribed {
                    w.seen = (epoch, seq); // the snapshot must be at least this new
                    return;
                }
                if (epoch, seq) > w.seen {
                    if epoch == w.seen.0 && seq > w.seen.1 + 1 {
                        w.snap_pending = true; // a view was lost
                    }
                    w.seen = (epoch, seq);
                }
                w.fanout.apply(Millis(t), ALICE, false, presence.0);
                for p in pushes(&mut w.fanout) {
                    bob_sees(s, n, p);
                }
            }
            Body::Beacon { epoch, seq } => {
                if self.is(ClusterMutant::NoBeacon) {
                    return;
                }
                let Some(w) = node.watcher.as_deref_mut() else {
                    return;
                };
                if (epoch, seq) > w.seen {
                    w.snap_pending = true;
                    w.seen = (epoch, seq);
                }
            }
            _ => {}
        }
    }

    fn tick(&self, s: &mut ClusterState) {
        s.t += 1;
        let t = s.t;
        let nodes = self.bounds.nodes;
        // Renewals (compare-and-set on the claim) and lapses.
        for n in 0..nodes {
            let node = &mut s.nodes[n as usize];
            if !node.up {
                continue;
            }
            if !node.cut {
                node.renewed = t;
                s.kv.leases[n as usize] = Some((node.inc, t + TTL));
                if let Some(o) = node.owner.as_deref_mut() {
                    match s.kv.claim {
                        Some((holder, e, _)) if holder == n && e == o.epoch => {
                            s.kv.claim = Some((n, e, t + TTL));
                            o.renewed = t;
                        }
                        _ => node.owner = None, // lost it: stop at once
                    }
                }
            } else {
                let lapse = |renewed: u64| t + MARGIN >= renewed + TTL;
                if node.owner.as_deref().is_some_and(|o| lapse(o.renewed))
                    && !self.is(ClusterMutant::KeepOwningAfterLapse)
                {
                    node.owner = None;
                }
                if lapse(node.renewed) && node.device.is_some() {
                    // Cut off: close the clients before the lease runs out.
                    node.device = None;
                    s.alice.at = None;
                    s.alice.away_since = Some(t);
                }
            }
        }
        // Device changes are written behind, two ticks after they happen
        // (so a crash at the tick in between loses them).
        for n in 0..nodes {
            let node = &mut s.nodes[n as usize];
            let due = |o: &&mut OwnerState| o.dirty.is_some_and(|d| t >= d + 2);
            if let Some(o) = node.owner.as_deref_mut().filter(due).filter(|_| !node.cut) {
                o.dirty = None;
                s.kv.devices = o.sessions.values().map(|&(e, i, c)| (e, i, c, t)).collect();
            }
        }
        // KV expiries.
        let mut lost = Vec::new();
        for n in 0..nodes as usize {
            if let Some((inc, expires)) = s.kv.leases[n] {
                if expires <= t {
                    s.kv.leases[n] = None;
                    lost.push((n as u8, inc, expires - TTL));
                }
            }
        }
        if s.kv.claim.is_some_and(|(_, _, expires)| expires <= t) {
            s.kv.claim = None;
        }
        // Owners handle lost edges (a watch on the lease bucket), and under
        // the fix, a lease whose incarnation changed (a restarted edge).
        for n in 0..nodes {
            let Some(mut o) = s.nodes[n as usize].owner.take() else {
                continue;
            };
            if !self.is(ClusterMutant::IgnoreEdgeLost) {
                let gone: Vec<(SessionId, u64)> = o
                    .sessions
                    .iter()
                    .filter_map(|(&session, &(edge, inc, _))| {
                        let expired = lost
                            .iter()
                            .find(|&&(e, i, _)| e == edge && i == inc)
                            .map(|&(_, _, renewed)| renewed);
                        let replaced = !self.is(ClusterMutant::NoIncarnation)
                            && s.kv.leases[edge as usize].is_some_and(|(i, _)| i != inc);
                        expired
                            .or(replaced.then_some(t))
                            .map(|renewed| (session, renewed))
                    })
                    .collect();
                for (session, renewed) in gone {
                    o.core
                        .handle_edge_lost(Millis(t), &[session], Millis(renewed));
                }
            }
            s.nodes[n as usize].owner = Some(o);
        }
        // A free shard is claimed by its preferred node among the live ones.
        if s.kv.claim.is_none() {
            let live: Vec<NodeId> = (0..nodes)
                .filter(|&n| {
                    let node = &s.nodes[n as usize];
                    node.up && !node.cut && s.kv.leases[n as usize].is_some()
                })
                .map(|n| NodeId(n.into()))
                .collect();
            if let Some(NodeId(n)) = owner_of(SHARD, &live) {
                self.claim_shard(s, n as u8);
            }
        }
        // Owners: timers, beacons, resync retries.
        for n in 0..nodes {
            let Some(mut o) = s.nodes[n as usize].owner.take() else {
                continue;
            };
            o.core.handle_timeout(Millis(t));
            self.drain(s, n, &mut o);
            // Beacons and resync retries only matter where messages get
            // lost; without losses they would only add interleavings.
            if self.bounds.drops > 0 {
                s.send(
                    n,
                    WATCHER_NODE,
                    Body::Beacon {
                        epoch: o.epoch,
                        seq: o.seq,
                    },
                );
            }
            if t < o.resync_until && self.bounds.drops > 0 {
                for m in (0..nodes).filter(|&m| m != n) {
                    if o.resynced & (1 << m) == 0 && s.kv.leases[m as usize].is_some() {
                        s.send(n, m, Body::Resync { epoch: o.epoch });
                    }
                }
            }
            s.nodes[n as usize].owner = Some(o);
        }
        // Edges: retries to the current claim holder.
        if let Some((holder, _, _)) = s.kv.claim {
            for n in 0..nodes {
                let node = &s.nodes[n as usize];
                if !node.up {
                    continue;
                }
                let req = node.device.as_ref().and_then(|d| {
                    d.pending.map(|op| Body::Req {
                        edge: n,
                        inc: node.inc,
                        rid: d.rid,
                        op,
                    })
                });
                let snap = node.watcher.as_ref().is_some_and(|w| w.snap_pending);
                if let Some(req) = req {
                    s.send(n, holder, req);
                }
                if snap {
                    s.send(n, holder, Body::SnapReq { edge: n });
                }
            }
        }
        if let Some(since) = s.alice.away_since {
            if s.alice.at.is_none() && t >= since + GRACE {
                s.alice.gone = true;
            }
        }
    }

    fn deliver(&self, s: &mut ClusterState, m: Msg) {
        if !s.nodes[m.to as usize].up {
            return;
        }
        match m.body {
            Body::Req { .. } | Body::SnapReq { .. } | Body::Resynced { .. } => {
                self.owner_msg(s, m.to, m.body)
            }
            body => self.edge_msg(s, m.to, body),
        }
    }

    fn crash(&self, s: &mut ClusterState, n: u8) {
        // What was on its way to the process is lost with it (replies go to
        // its connection's inboxes; a restarted process subscribes anew).
        s.net.retain(|m| m.to != n);
        s.local.retain(|m| m.to != n);
        let node = &mut s.nodes[n as usize];
        node.up = false;
        node.owner = None;
        node.watcher = None;
        if node.device.take().is_some() {
            s.alice.at = None;
            s.alice.away_since = Some(s.t);
        }
    }
}

/// Whether `session` is Online in `core` (not Lingering, not gone).
fn live(core: &Core, session: SessionId) -> bool {
    core.session_info(session).is_some_and(|i| i.online)
}

/// The pushes a `Fanout` produced for bob.
fn pushes(fanout: &mut Fanout) -> Vec<Presence> {
    std::iter::from_fn(|| fanout.poll_output())
        .filter_map(|out| match out {
            Output::Push { presence, .. } => Some(presence),
            Output::SessionEnded { .. } => None,
        })
        .collect()
}

/// Bob's client applies an update; C1 and C2 are judged as it does.
fn bob_sees(s: &mut ClusterState, n: u8, p: Presence) {
    let Some(w) = s.nodes[n as usize].watcher.as_deref_mut() else {
        return;
    };
    let before = w.view.get(ALICE).cloned();
    let newest_epoch = before.as_ref().map(|b| epoch_of(b.version));
    if w.view.apply(ALICE, p.clone()) == greendot_core::Applied::Dropped {
        return;
    }
    if newest_epoch.is_some_and(|e| epoch_of(p.version) < e) {
        s.bad
            .push(format!("C1: bob took a view of an older epoch: {p:?}"));
    }
    let excused = s.alice.gone || s.alice.invisible_asked;
    if before.is_some_and(|b| b.online) && !p.online && !excused {
        s.bad.push(format!(
            "C2: bob shown alice offline while she is connected or back within grace: {p:?}"
        ));
    }
}

impl Model for ClusterModel {
    type State = ClusterState;
    type Action = Action;

    fn init_states(&self) -> Vec<ClusterState> {
        let b = &self.bounds;
        let nodes: Vec<NodeState> = (0..b.nodes)
            .map(|n| NodeState {
                up: true,
                cut: false,
                inc: 0,
                rids: u8::from(n == b.alice_edge),
                renewed: 0,
                owner: None,
                device: (n == b.alice_edge).then_some(EdgeDevice {
                    rid: 1,
                    conn: 1,
                    pending: Some(Op::Connect),
                    then: None,
                }),
                watcher: (n == WATCHER_NODE).then(|| {
                    let mut fanout = Fanout::new(self.config.batch_interval);
                    fanout.open(BOB_SESSION, BOB);
                    Box::new(Watcher {
                        fanout,
                        view: View::new(),
                        subscribed: false,
                        snap_pending: true,
                        seen: (Epoch(0), 0),
                    })
                }),
            })
            .collect();
        let mut s = ClusterState {
            t: 0,
            nodes,
            kv: Kv {
                leases: (0..b.nodes).map(|_| Some((0, TTL))).collect(),
                claim: None,
                epoch: Epoch(0),
                invisible: false,
                view: None,
                devices: Vec::new(),
            },
            net: BTreeSet::new(),
            alice: Alice {
                at: Some(b.alice_edge),
                away_since: None,
                gone: false,
                flips: b.flips,
                invisible_asked: false,
                invisible_acked: false,
            },
            crashes: b.crashes,
            restarts: b.restarts,
            cuts: b.cuts,
            drops: b.drops,
            quiet_since: 0,
            fresh: true,
            bad: Vec::new(),
            local: Default::default(),
        };
        self.claim_shard(&mut s, b.first_owner);
        // The first requests go out at once.
        s.send(
            b.alice_edge,
            b.first_owner,
            Body::Req {
                edge: b.alice_edge,
                inc: 0,
                rid: 1,
                op: Op::Connect,
            },
        );
        s.send(
            WATCHER_NODE,
            b.first_owner,
            Body::SnapReq { edge: WATCHER_NODE },
        );
        while let Some(m) = s.local.pop_front() {
            self.deliver(&mut s, m);
        }
        vec![s]
    }

    fn actions(&self, s: &ClusterState, actions: &mut Vec<Action>) {
        let b = &self.bounds;
        if s.t < b.max_time && s.net.iter().all(|m| m.sent == s.t) {
            actions.push(Action::Tick);
        }
        let faults = s.t <= b.faults_until && s.fresh;
        for m in &s.net {
            actions.push(Action::Deliver(m.clone()));
            if s.drops > 0 && faults {
                actions.push(Action::Drop(m.clone()));
            }
        }
        for n in 0..b.nodes {
            let node = &s.nodes[n as usize];
            if n == WATCHER_NODE || !faults {
                continue;
            }
            if node.up && s.crashes > 0 {
                actions.push(Action::Crash(n));
            }
            if !node.up && s.restarts > 0 {
                actions.push(Action::Restart(n));
            }
            if node.up && !node.cut && s.cuts > 0 {
                actions.push(Action::Cut(n));
            }
        }
        if s.alice.at.is_none() && !s.alice.gone && s.fresh {
            for n in 0..b.nodes {
                let node = &s.nodes[n as usize];
                if node.up && !node.cut {
                    actions.push(Action::Reconnect(n));
                }
            }
        }
        if s.alice.flips > 0
            && s.t == b.invisible_at
            && s.alice
                .at
                .and_then(|n| s.nodes[n as usize].device.as_ref())
                .is_some_and(|d| d.pending.is_none())
        {
            actions.push(Action::GoInvisible);
        }
    }

    fn next_state(&self, last: &ClusterState, action: Action) -> Option<ClusterState> {
        let mut s = last.clone();
        let t = s.t;
        match action {
            Action::Tick => {
                s.fresh = true;
                self.tick(&mut s)
            }
            Action::Deliver(m) => {
                s.fresh = false;
                s.net.remove(&m);
                self.deliver(&mut s, m);
            }
            Action::Drop(m) => {
                s.fresh = false;
                s.net.remove(&m);
                s.drops -= 1;
                s.quiet_since = t;
            }
            Action::Crash(n) => {
                s.crashes -= 1;
                s.quiet_since = t;
                self.crash(&mut s, n);
            }
            Action::Restart(n) => {
                s.restarts -= 1;
                s.quiet_since = t;
                let node = &mut s.nodes[n as usize];
                node.up = true;
                node.cut = false;
                node.inc += 1;
                node.rids = 0;
                node.renewed = t;
                // A fresh process puts its lease (same key, new incarnation).
                s.kv.leases[n as usize] = Some((node.inc, t + TTL));
            }
            Action::Cut(n) => {
                s.cuts -= 1;
                s.quiet_since = t;
                s.nodes[n as usize].cut = true;
            }
            Action::Reconnect(n) => {
                s.quiet_since = t;
                s.alice.at = Some(n);
                s.alice.away_since = None;
                let node = &mut s.nodes[n as usize];
                node.rids += 1;
                let rid = node.rids;
                node.device = Some(EdgeDevice {
                    rid,
                    conn: rid,
                    pending: Some(Op::Connect),
                    then: None,
                });
                let req = Body::Req {
                    edge: n,
                    inc: node.inc,
                    rid,
                    op: Op::Connect,
                };
                if let Some((holder, _, _)) = s.kv.claim {
                    s.send(n, holder, req);
                }
            }
            Action::GoInvisible => {
                s.quiet_since = t;
                s.alice.flips -= 1;
                s.alice.invisible_asked = true;
                let n = s.alice.at?;
                let node = &mut s.nodes[n as usize];
                let d = node.device.as_mut()?;
                node.rids += 1;
                d.rid = node.rids;
                d.pending = Some(Op::SetInvisible(true));
                let body = Body::Req {
                    edge: n,
                    inc: node.inc,
                    rid: d.rid,
                    op: Op::SetInvisible(true),
                };
                if let Some((holder, _, _)) = s.kv.claim {
                    s.send(n, holder, body);
                }
            }
        }
        while let Some(m) = s.local.pop_front() {
            self.deliver(&mut s, m);
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("C1 one writer", |_, s: &ClusterState| {
                s.nodes.iter().filter(|n| n.owner.is_some()).count() <= 1 && !has(s, "C1")
            }),
            Property::always("C2 no false offline on failover", |_, s: &ClusterState| {
                !has(s, "C2")
            }),
            Property::always("C3 bounded ghosts", |_, s: &ClusterState| c3(s)),
            Property::always("C4 invisible survives failover", |_, s: &ClusterState| {
                let shown_online = s
                    .nodes
                    .iter()
                    .filter_map(|n| n.owner.as_deref())
                    .any(|o| o.core.presence(ALICE).online);
                let acked = s.alice.invisible_acked;
                !has(s, "C4") && (!acked || !shown_online)
            }),
            Property::always("C5 convergence", |_, s: &ClusterState| c5(s)),
            Property::sometimes(FAILOVER, |_, s: &ClusterState| {
                s.kv.epoch.0 >= 2 && s.nodes.iter().any(|n| n.owner.is_some())
            }),
            Property::sometimes(ONLINE, |_, s: &ClusterState| {
                s.nodes[WATCHER_NODE as usize]
                    .watcher
                    .as_ref()
                    .and_then(|w| w.view.get(ALICE))
                    .is_some_and(|p| p.online)
            }),
            Property::sometimes(ONLINE_LATER, |_, s: &ClusterState| {
                s.nodes[WATCHER_NODE as usize]
                    .watcher
                    .as_ref()
                    .and_then(|w| w.view.get(ALICE))
                    .is_some_and(|p| p.online && epoch_of(p.version).0 >= 2)
            }),
            Property::sometimes(QUIET, |_, s: &ClusterState| {
                quiet(s).is_some_and(|o| o.core.presence(ALICE).version > 0)
            }),
        ]
    }
}

fn has(s: &ClusterState, id: &str) -> bool {
    s.bad
        .iter()
        .any(|b| b.split_once(':').is_some_and(|(p, _)| p == id))
}

/// C3: alice gone for good (not invisible) is shown offline by every owner
/// within `GHOST_BOUND` ticks of losing her connection.
fn c3(s: &ClusterState) -> bool {
    let Some(since) = s.alice.away_since else {
        return true;
    };
    if !s.alice.gone || s.alice.invisible_asked || s.t <= since + GHOST_BOUND {
        return true;
    }
    s.nodes
        .iter()
        .filter_map(|n| n.owner.as_deref())
        .all(|o| !o.core.presence(ALICE).online)
}

/// The acting owner, when the world is quiet: nothing in flight, at least
/// one tick since the last fault or input (so a beacon went out after it),
/// the claim holder acting, and bob's edge subscribed.
fn quiet(s: &ClusterState) -> Option<&OwnerState> {
    if !s.net.is_empty() || s.t <= s.quiet_since {
        return None;
    }
    let (holder, epoch, _) = s.kv.claim?;
    let o = s.nodes[holder as usize].owner.as_deref()?;
    (o.epoch == epoch && !s.nodes[holder as usize].cut).then_some(o)
}

/// C5: when quiet, bob's view of alice is the owner's published view.
fn c5(s: &ClusterState) -> bool {
    let Some(o) = quiet(s) else {
        return true;
    };
    let Some(w) = s.nodes[WATCHER_NODE as usize].watcher.as_deref() else {
        return true;
    };
    w.view.get(ALICE) == Some(&o.core.presence(ALICE))
}

/// A short account of a state, for counterexamples.
pub fn describe(s: &ClusterState) -> String {
    let owners: Vec<String> = s
        .nodes
        .iter()
        .enumerate()
        .filter_map(|(n, node)| {
            node.owner.as_deref().map(|o| {
                format!(
                    "owner {n} {:?} shows {:?}",
                    o.epoch,
                    Shown(o.core.presence(ALICE)).0
                )
            })
        })
        .collect();
    let bob = s.nodes[WATCHER_NODE as usize]
        .watcher
        .as_ref()
        .and_then(|w| w.view.get(ALICE).cloned());
    format!(
        "t={} claim={:?} alice={:?} owners={owners:?} bob={bob:?} bad={:?}",
        s.t, s.kv.claim, s.alice, s.bad
    )
}
