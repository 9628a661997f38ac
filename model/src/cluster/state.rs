//! The state of the checked world: nodes, the KV, the network, alice.

use super::*;

/// What alice's edge asks her owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Connect,
    SetInvisible(bool),
    /// The device logs out (ends its session, no grace).
    Logout,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Body {
    /// Edge → owner (request/reply): a device input of alice's device
    /// `dev` (`MOBILE` or `DESKTOP`).
    Req {
        edge: u8,
        inc: u8,
        rid: u8,
        dev: u8,
        op: Op,
    },
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
    /// Edge → owner: its live devices of the shard and whether it watches.
    Resynced {
        edge: u8,
        inc: u8,
        epoch: Epoch,
        /// The connection of each device it holds, by device.
        devices: [Option<u8>; 2],
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
    /// Owner-side session → (edge, incarnation, connection, device) holding
    /// the device; the connection is the id of the edge's `Connect` request.
    pub sessions: BTreeMap<SessionId, (u8, u8, u8, u8)>,
    /// Last request id handled per (edge, incarnation, device): per device,
    /// since two devices at one edge may have their requests (and retries)
    /// interleaved, and one device's newer request must not make another's
    /// pending one look done.
    pub last_rid: BTreeMap<(u8, u8, u8), u8>,
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
    /// The request (edge, incarnation, device, request id) whose preference write
    /// is on its way to the KV: answered when the write lands.
    pub writing: Option<(u8, u8, u8, u8)>,
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

/// Bob's session at an edge: its fanout and its watch of alice's shard.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Watcher {
    pub fanout: Fanout,
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
    /// Alice's devices held here, by device (`MOBILE`, `DESKTOP`).
    pub devices: [Option<EdgeDevice>; 2],
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
    /// The epoch of the owner that wrote them last: a write of an older
    /// epoch is refused (the fence of C4).
    pub prefs_epoch: Epoch,
    /// Alice's last published view.
    pub view: Option<Presence>,
    /// Bob's session record (bucket `gd_sessions`): the session and its
    /// subscriptions (alice, realtime), written before his subscribe was
    /// answered; read by an edge he resumes on.
    pub bob_record: Option<SessionId>,
    /// Alice's devices: (edge, incarnation, connection, device, last heard).
    pub devices: Vec<(u8, u8, u8, u8, u64)>,
}

/// Bob's client: its view outlives the edge it is connected to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Bob {
    /// Bob's client's view (the edge → client stream is reliable).
    pub view: View,
    /// The node whose edge holds his session (`None` after it crashed,
    /// until he resumes elsewhere).
    pub at: Option<u8>,
    /// He resumed on another node and was told `resumed`.
    pub resumed: bool,
}

/// Alice's mobile (her desktop, when modelled, stays at node 0).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Alice {
    pub at: Option<u8>,
    pub away_since: Option<u64>,
    /// Away for grace without reconnecting: she is gone for good.
    pub gone: bool,
    pub flips: u8,
    pub invisible_asked: bool,
    pub invisible_acked: bool,
    /// The mobile asked to log out: it does not come back.
    pub logout_asked: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClusterState {
    pub t: u64,
    pub nodes: Vec<NodeState>,
    pub kv: Kv,
    pub net: BTreeSet<Msg>,
    pub alice: Alice,
    pub bob: Bob,
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
    /// Preference writes on their way to the KV: each lands (and is
    /// answered) in a step of its own, apart from the owner's request.
    pub writes: BTreeSet<Write>,
    /// Writes that may still be held past the next tick.
    pub slow: u8,
}

/// An owner's write of alice's preferences, in flight to the KV.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Write {
    /// The tick it was sent at.
    pub sent: u64,
    /// The writing node and its incarnation (the answer goes to it).
    pub node: u8,
    pub inc: u8,
    /// The epoch it acts for.
    pub epoch: Epoch,
    /// The request it answers: (edge, edge incarnation, device, request id).
    pub request: (u8, u8, u8, u8),
    pub invisible: bool,
    /// Slow: it may land after any number of ticks.
    pub held: bool,
}

impl Watcher {
    /// Subscribed to alice, or subscribing.
    pub fn watches(&self) -> bool {
        self.subscribed || self.snap_pending
    }
}

impl ClusterState {
    /// Sends `body` from node `from` to node `to`: over the network, or in
    /// process when `to` is `from`.
    pub(super) fn send(&mut self, from: u8, to: u8, body: Body) {
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
    /// Alice's mobile logs out.
    Logout,
    /// Bob's client resumes his session on this node (his edge died).
    BobResumes(u8),
    /// The KV applies a preference write and answers its owner.
    Store(Write),
    /// A write is slow: it lands only after a later tick (a bounded fault).
    Hold(Write),
}
