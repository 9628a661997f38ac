//! The cluster data path (docs/cluster.md "The protocol as checked"), sans
//! IO: what `ServerState` does as an **edge** (forwards its sessions' device
//! inputs to the owner of their user's shard, fans published views out to
//! its sessions through a `Fanout`) and as an **owner** (one `Core` per shard
//! it acts for, publishing each view once on the shard's subject).
//!
//! Everything that leaves a node is named by strings (user, device, edge
//! node), never by the hub's interned ids, which are this process's own.
//! Messages are postcard-encoded; a message from NATS is checked against
//! [`MAX_MESSAGE`] and the name limits before anything of it is stored, and
//! one that does not decode or does not fit is counted and dropped.
//!
//! The NATS I/O is a thin task outside (see `greendot serve`): it turns
//! [`ClusterOutput`]s into publishes, requests, replies, KV writes and
//! subscriptions, and what NATS delivers into [`ClusterInput`]s.

use crate::hub::Interner;
use bytes::Bytes;
use greendot_core::{
    Config, Connect, Core, DeviceId, DeviceKind, EndReason, Epoch, Fanout, Millis, Output,
    Presence, SessionId, Tier, UserId, Watch,
};
use greendot_proto::{self as proto, ErrorCode, Refused, Snapshot, WireError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The largest message accepted from another node: a device input or a
/// view is a few names and a status message; a snapshot answer carries at
/// most [`MAX_SNAPSHOT_TARGETS`] presences.
pub const MAX_MESSAGE: usize = 256 * 1024;
/// Targets one snapshot request may name (a subscribe is split per shard).
pub const MAX_SNAPSHOT_TARGETS: usize = 1_000;
/// Device inputs an edge holds for one session at most: a session's
/// requests wait for their answers, so more means a stuck owner.
const MAX_QUEUED_OPS: usize = 16;
/// Requests an owner has taken and not yet answered (waiting for a KV write).
const MAX_PENDING_PREFS: usize = 65_536;
/// Connections an owner remembers the last request id of (past it, it
/// forgets them all at once: see `remember_rid`).
const MAX_HOLDERS_REMEMBERED: usize = 262_144;
/// Edges whose newest incarnation is remembered (the cluster's nodes; a
/// node id past it is not tracked, and its late requests are not filtered).
const MAX_EDGES_REMEMBERED: usize = 4_096;
/// How long an edge waits before asking again after a refusal or a failure.
const RETRY_AFTER: Duration = Duration::from_millis(100);
/// How long after a change of its devices an owner writes a shard's device
/// record behind (what a crash of the owner may lose).
const WRITE_BEHIND: Millis = Millis(500);
/// Devices one shard's record holds at most (the rest are not recorded: a
/// crash of their owner together with their edge leaves them to the
/// watchers' last view).
const MAX_RECORDED_DEVICES: usize = 2_048;
/// How long an owner keeps a user after their last device went (or after
/// a snapshot of a user with none) before it frees the user's record and
/// name: the KV holds their preferences and last view, read again at their
/// next input. Long enough for the view written behind to have landed.
const RELEASE_AFTER: Millis = Millis(60_000);
/// Users one owner core waits to free at most (past it, the rest stay until
/// the shard's owner changes).
const MAX_IDLE_USERS: usize = 1 << 20;
/// How often retries, deadlines and lapsed claims are looked at while there
/// is any (a claim's deadline is `margin` before NATS can expire it, so
/// acting up to this late still ends before the claim can).
const TICK: Duration = Duration::from_millis(50);
/// How often an owner announces the latest view number of each shard it
/// acts for ([`Beacon`]): a view lost on the way is noticed within this.
const BEACON_EVERY: Duration = Duration::from_secs(1);
/// Beacons name the last truth sent to an edge for this long after it went
/// (an edge that missed it, and every beacon since, is then stale until the
/// user's next change).
pub const TRUTH_BEACON_FOR: Duration = Duration::from_secs(10);
/// Shards one beacon names at most (more go in several).
pub const MAX_BEACON_SHARDS: usize = 8_192;
/// Truths one beacon names at most: each carries an edge's name (up to 64
/// bytes), and 8,192 shards (25 bytes each at worst) with 512 truths (90)
/// stay under [`MAX_MESSAGE`].
pub const MAX_BEACON_TRUTHS: usize = 512;
/// How often a new owner asks the edges again to resend its shard's
/// devices while its resync window is open (the request may be lost).
const RESYNC_EVERY: Duration = Duration::from_millis(500);

/// The last epoch whose versions fit: versions carry the epoch above
/// `EPOCH_SHIFT` bits, so a larger one would wrap them.
pub const MAX_EPOCH: u64 = (1 << (64 - greendot_core::cluster::EPOCH_SHIFT)) - 1;

/// How a node takes part in a cluster.
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    /// This node's id (`[A-Za-z0-9_-]`, as in its lease).
    pub node: String,
    /// Grows at every start of the process (greendot: the start time in Unix
    /// milliseconds, the same value as in the node's lease): names this
    /// edge's connections to owners, so a late request of a previous
    /// process is never taken for one of this process, and owners that see
    /// a newer incarnation in the lease treat the devices of older ones as
    /// lost ([`ClusterInput::EdgeRestarted`]).
    pub incarnation: u64,
    pub shard_count: u32,
    /// The user → shard map every node shares (greendot-cluster's).
    pub shard_of: fn(&str, u32) -> u32,
    /// A forwarded request unanswered this long is answered with an error to
    /// the client (the edge still delivers device inputs that have no client
    /// waiting, retrying until the owner takes them).
    pub request_timeout: Duration,
}

/// Which of the owner's subjects a request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestKind {
    Input,
    Snapshot,
}

/// What the NATS I/O hands the state.
#[derive(Debug)]
pub enum ClusterInput {
    /// The shards this node may act for now: epoch, and the instant it must
    /// stop at the latest (from the node's duty task).
    Status {
        shards: BTreeMap<u32, (u64, Instant)>,
    },
    /// A message on the subject of a watched shard.
    ShardMessage { shard: u32, payload: Bytes },
    /// A message on this node's edge subject: the truth of a user with a
    /// device here, from the user's owner.
    EdgeMessage { payload: Bytes },
    /// A request to a shard this node serves; answer with
    /// [`ClusterOutput::Reply`] naming `reply`.
    Request {
        shard: u32,
        kind: RequestKind,
        payload: Bytes,
        reply: u64,
    },
    /// The owner's answer to [`ClusterOutput::Request`] `id`, or `None`: no
    /// owner, timed out, or NATS failed (the edge retries).
    Answered { id: u64, payload: Option<Bytes> },
    /// The KV write of [`ClusterOutput::PutPrefs`] `id` is done (`ok`) or
    /// failed.
    PrefsStored { id: u64, ok: bool },
    /// What the KV holds of the user of [`ClusterOutput::LoadUser`] `id`
    /// (`None`: nothing, or the read failed: the user starts fresh).
    UserLoaded {
        id: u64,
        prefs: Option<Bytes>,
        view: Option<Bytes>,
    },
    /// The put of [`ClusterOutput::PutSession`] `id` landed (`ok`) or
    /// failed.
    SessionStored { id: u64, ok: bool },
    /// What the KV holds of the device of [`ClusterOutput::LoadSession`]
    /// `id` (`None`: nothing, or the read failed: the session starts fresh).
    SessionLoaded { id: u64, record: Option<Bytes> },
    /// A message on the cluster's resync subject (a new owner asks every
    /// edge to resend its devices of a shard).
    Resync { payload: Bytes },
    /// A message on the cluster's beacon subject ([`Beacon`]).
    Beacon { payload: Bytes },
    /// What the KV holds of the devices of the shard of
    /// [`ClusterOutput::LoadShard`] `id` (`None`: nothing, or the read failed).
    ShardLoaded { id: u64, record: Option<Bytes> },
    /// The lease of node `node` is gone (expired: the node died or was cut
    /// off; or released: it left). `last_heard`: Unix milliseconds of its
    /// last renewal, as near as known.
    EdgeLost { node: String, last_heard: u64 },
    /// Node `node`'s lease names incarnation `incarnation` (it restarted
    /// within its TTL and took its lease over, or joined): the devices it
    /// held under older incarnations are lost, as by a disconnect at
    /// `last_heard` (Unix milliseconds); those of `incarnation` and newer
    /// are not touched (the new process may have forwarded some already).
    EdgeRestarted {
        node: String,
        incarnation: u64,
        last_heard: u64,
    },
}

/// What the state asks the NATS I/O to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterOutput {
    /// Publish once on the shard's subject.
    Publish { shard: u32, payload: Bytes },
    /// Send on node `node`'s edge subject (a truth, to an edge holding a
    /// device of the user).
    PublishToEdge { node: String, payload: Bytes },
    /// Ask the shard's owner; answer with [`ClusterInput::Answered`].
    Request {
        id: u64,
        shard: u32,
        kind: RequestKind,
        payload: Bytes,
    },
    /// Answer a [`ClusterInput::Request`].
    Reply { reply: u64, payload: Bytes },
    /// Write a user's preferences to the KV, fenced by the owner's `epoch`
    /// (refused once a newer owner wrote them); answer with
    /// [`ClusterInput::PrefsStored`].
    PutPrefs {
        id: u64,
        user: String,
        epoch: u64,
        value: Bytes,
    },
    /// Read a user's preferences and last published view from the KV;
    /// answer with [`ClusterInput::UserLoaded`].
    LoadUser { id: u64, user: String },
    /// Write the last published view of a user (behind: nobody waits).
    PutView { user: String, value: Bytes },
    /// Write a shard's device record (behind).
    PutShardDevices { shard: u32, value: Bytes },
    /// Read a shard's device record; answer with [`ClusterInput::ShardLoaded`].
    LoadShard { id: u64, shard: u32 },
    /// Write a device's [`SessionRecord`]; answer with
    /// [`ClusterInput::SessionStored`].
    PutSession {
        id: u64,
        user: String,
        device: String,
        value: Bytes,
    },
    /// Read a device's [`SessionRecord`]; answer with
    /// [`ClusterInput::SessionLoaded`].
    LoadSession {
        id: u64,
        user: String,
        device: String,
    },
    /// Delete a device's [`SessionRecord`] (its owner saw the device end:
    /// a resume naming it must start fresh): behind.
    DeleteSession { user: String, device: String },
    /// Publish on the cluster's resync subject (every node listens).
    Resync { payload: Bytes },
    /// Publish on the cluster's beacon subject (every node listens).
    Beacon { payload: Bytes },
    /// Subscribe to a shard's subject (one more local watcher of it).
    Watch { shard: u32 },
    /// The last local watcher of the shard left.
    Unwatch { shard: u32 },
}

// ---- the wire between nodes ---------------------------------------------

/// A device input, as the edge forwards it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireOp {
    /// `session`: the edge's wire id of the session (what `Route` lists).
    /// `since`: the order in which this edge run welcomed the session: of
    /// two sessions of one device at one edge run, the later welcomed is
    /// the one its client kept (it gives up on an attempt before making
    /// another), whatever order their connects reach the owner in.
    Connect {
        kind: proto::Kind,
        session: u64,
        since: u64,
    },
    /// `last_heard`: Unix milliseconds (the nodes' clocks agree on Unix time,
    /// not on their cores' milliseconds).
    Disconnect {
        last_heard: u64,
    },
    Logout,
    SetStatus {
        status: proto::Status,
        message: Option<String>,
    },
    SetInvisible(bool),
    /// The app went to the foreground (`true`) or the background (I12).
    SetForeground(bool),
}

/// Keeps, of a device's queued ops, every `Connect` and the last status,
/// the last invisibility change and the last foreground change (in their
/// order): what the owner must still take before an ending op. Returns the
/// waits of the ops dropped.
fn compact_queue(queue: &mut VecDeque<QueuedOp>) -> Vec<u64> {
    let last_status = queue
        .iter()
        .rposition(|q| matches!(q.op, WireOp::SetStatus { .. }));
    let last_invisible = queue
        .iter()
        .rposition(|q| matches!(q.op, WireOp::SetInvisible(_)));
    let last_foreground = queue
        .iter()
        .rposition(|q| matches!(q.op, WireOp::SetForeground(_)));
    let mut dropped = Vec::new();
    let kept = std::mem::take(queue)
        .into_iter()
        .enumerate()
        .filter_map(|(i, q)| {
            let keep = matches!(q.op, WireOp::Connect { .. })
                || Some(i) == last_status
                || Some(i) == last_invisible
                || Some(i) == last_foreground;
            if !keep {
                dropped.extend(q.wait);
            }
            keep.then_some(q)
        })
        .collect();
    *queue = kept;
    dropped
}

/// Edge → owner, on `<prefix>.req.<shard>.<kind>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToOwner {
    Device {
        edge: String,
        incarnation: u64,
        /// Unique per (edge, incarnation), increasing: the owner's duplicate
        /// filter.
        rid: u64,
        /// The edge's connection of the device (one per connect).
        conn: u64,
        user: String,
        device: String,
        op: WireOp,
    },
    /// The views of `targets` for a subscribe by `viewer` (a target equal to
    /// the viewer gets the truth).
    Snapshot {
        viewer: String,
        targets: Vec<String>,
    },
    /// The views of `targets` (what others see, for every target; `own`:
    /// each target's truth), for an edge that missed a view (a truth) of
    /// their shard.
    Views { targets: Vec<String>, own: bool },
    /// The user's Online devices, for a service's `Route`.
    Route { user: String },
}

/// Owner → edge (a reply).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromOwner {
    Done {
        epoch: u64,
    },
    /// This node does not act for the shard: look again and retry.
    NotOwner,
    /// No live session of the device here: connect it again, then retry.
    Unknown,
    /// The owner refused the input (a limit): tell the client.
    Refused(WireError),
    /// `epoch` and `seq`: the shard's last published view when answered
    /// (the presences include every view up to it).
    Snapshot {
        presences: Vec<proto::Presence>,
        epoch: u64,
        seq: u64,
    },
    /// The user's Online devices, wherever they are connected.
    Route(Vec<proto::RouteEntry>),
    /// Some targets' KV records are being read (users the owner freed, or
    /// has not met since it took the shard): ask again shortly.
    Loading,
}

/// On `<prefix>.shard.<n>`: a view the owner published (on an edge's
/// subject: a truth).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardView {
    pub epoch: u64,
    /// On the shard's subject: the view's number in the epoch, from 1 with
    /// no gaps, so an edge notices a lost one. On an edge's subject: the
    /// truth's number among those the shard's owner sent that edge in the
    /// epoch, the same way.
    pub seq: u64,
    /// When the owner published it (Unix milliseconds of its clock).
    pub published_ms: u64,
    pub user: String,
    /// The truth, for the user's own sessions.
    pub own: bool,
    pub presence: proto::Presence,
}

/// One device of a shard's record, as its owner last wrote it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedDevice {
    pub user: String,
    pub device: String,
    pub kind: proto::Kind,
    pub edge: String,
    pub incarnation: u64,
    pub conn: u64,
    /// Unix milliseconds of the write.
    pub heard: u64,
}

/// In the sessions bucket, under the device's key: what its current
/// session subscribed to, so that a resume on another node (or in the next
/// process) carries it over. Written before a subscribe is answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// The session's wire id (what the client names to resume it).
    pub wire: u64,
    pub subscriptions: Vec<(String, proto::Tier)>,
}

/// On the resync subject: the new owner of `shard` asks every edge to
/// resend its live devices of the shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncRequest {
    pub shard: u32,
    pub epoch: u64,
    pub owner: String,
}

/// On `<prefix>.beacon`, every [`BEACON_EVERY`]: the latest view number of
/// each shard `owner` acts for and has published in (at most
/// [`MAX_BEACON_SHARDS`]). An edge watching one of them that has seen an
/// older number missed a view and asks the owner again (C5 under loss).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beacon {
    pub owner: String,
    /// (shard, epoch, seq)
    pub shards: Vec<(u32, u64, u64)>,
    /// (edge, shard, epoch, seq) of the last truth sent to another edge,
    /// for those sent in the last [`TRUTH_BEACON_FOR`].
    pub truths: Vec<(String, u32, u64, u64)>,
}

fn encode<T: Serialize>(value: &T) -> Bytes {
    // Our own small types always encode.
    Bytes::from(postcard::to_stdvec(value).unwrap_or_default())
}

fn decode<'a, T: Deserialize<'a>>(payload: &'a [u8]) -> Option<T> {
    if payload.len() > MAX_MESSAGE {
        return None;
    }
    postcard::from_bytes(payload).ok()
}

/// Counters the metrics read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterCounters {
    /// Device inputs sent to a remote owner (retries included).
    pub forwarded: u64,
    /// Device inputs handled by this node's own owner, in process.
    pub forwarded_local: u64,
    /// Device inputs this node handled as owner for other edges.
    pub owner_inputs: u64,
    /// Views published on shard subjects.
    pub published: u64,
    /// Truths sent to the edges holding the user's devices (other nodes
    /// only: this node's own edge takes them in process).
    pub truths_sent: u64,
    /// Views from other nodes applied to local sessions.
    pub views_applied: u64,
    /// Messages from NATS dropped: undecodable, too large, or naming too
    /// long a name or the wrong shard.
    pub malformed: u64,
    /// Requests refused with `NotOwner`, `Unknown`, or unanswered, and retried.
    pub retries: u64,
    /// Resync requests of new owners this edge answered (resending its
    /// devices of the shard).
    pub resyncs: u64,
    /// Devices this node's owners lost with their edge's lease.
    pub edge_lost_devices: u64,
    /// Users this node's owners freed (offline for a while: their KV record
    /// is read again at their next input).
    pub users_released: u64,
    /// Device inputs of an edge's previous run, arrived after its newer run
    /// was known: dropped unanswered (their sender is gone).
    pub stale_incarnation: u64,
    /// Connects of a session the device's client gave up on, arrived at the
    /// owner after a session the same edge welcomed later: not taken.
    pub stale_connects: u64,
    /// Views of a watched shard this edge missed (a gap in the numbers, or
    /// a beacon ahead of the last one seen): each asks the owner for the
    /// views of the shard's watched users again.
    pub view_gaps: u64,
    /// Truths this edge missed (a gap in the numbers an owner gives the
    /// truths it sends here, or a beacon ahead): each asks for the truths
    /// of the shard's users with a session here again.
    pub truth_gaps: u64,
    /// Sessions resumed here from another node's (or a previous process's)
    /// record, their subscriptions carried over.
    pub resumed_elsewhere: u64,
    /// Session record puts that failed (tried again at the next tick).
    pub session_writes_failed: u64,
}

// ---- the owner ------------------------------------------------------------

/// Who holds a device's connection: the edge, its incarnation, its
/// connection.
type Holder = (String, u64, u64);

struct Owner {
    epoch: u64,
    core: Core,
    users: Interner,
    devices: Interner,
    /// Each session's holder, device name id (the owner's `devices` hold
    /// one reference per session: a name no session uses is freed), the
    /// edge's wire id of it (0: restored, not connected again yet) and its
    /// user.
    /// Each session's holder, device, wire id, user, and `since` (its
    /// edge's welcome order; 0 when restored from the device record).
    sessions: HashMap<SessionId, (Holder, u64, u64, UserId, u64)>,
    by_holder: HashMap<Holder, SessionId>,
    /// The last request id taken per connection: a request that arrives
    /// late (after the edge gave up on it and sent the next) is not applied
    /// over a newer one.
    last_rid: HashMap<Holder, u64>,
    /// Users whose KV record was read (or is being read): the first device
    /// input of any other waits for it, so a new owner keeps the user's
    /// preferences and last published view.
    loaded: std::collections::HashSet<String>,
    /// Inputs waiting for their user's KV record.
    loading: HashMap<String, Vec<(ToOwner, ReplyTo)>>,
    /// Devices of the shard's record (the previous owner's), by user, to be
    /// restored as lingering with the user.
    recorded: HashMap<String, Vec<RecordedDevice>>,
    /// The device set changed since this instant and is not written yet.
    dirty_since: Option<Millis>,
    /// Users that got a session at another node's edge in this step: that
    /// edge is sent the user's truth even if it did not change (it may
    /// have changed while the connect was on its way).
    greet: Vec<(UserId, String)>,
    /// Users that went offline (or were only looked at), by when to free
    /// them if they still hold nothing.
    idle: VecDeque<(Millis, UserId)>,
    /// Views published on the shard's subject in this epoch: the last
    /// one's number.
    seq: u64,
    /// Truths sent to each other edge in this epoch: the last one's number,
    /// and when it went (beacons name the recent ones).
    truth_seq: HashMap<String, (u64, Instant)>,
    /// The resync request is sent again until then (it may be lost), every
    /// `RESYNC_EVERY`.
    resync_until: Instant,
    next_resync: Instant,
}

/// Where an owner's answer goes.
#[derive(Debug, Clone, Copy)]
enum ReplyTo {
    Remote(u64),
    /// This node's own edge, in process: the op `rid` of a session.
    Local(SessionId, u64),
}

struct PendingPrefs {
    reply: ReplyTo,
    since: Instant,
    shard: u32,
    epoch: u64,
    holder: Holder,
    rid: u64,
}

// ---- the edge -------------------------------------------------------------

#[derive(Debug)]
struct QueuedOp {
    op: WireOp,
    /// The client request waiting for it, if any.
    wait: Option<u64>,
    /// The client is answered with an error after this.
    deadline: Instant,
}

#[derive(Debug)]
struct EdgeDevice {
    user: String,
    device: String,
    kind: proto::Kind,
    /// The session's wire id.
    wire: u64,
    conn: u64,
    /// When this edge run welcomed the session (its first `conn`).
    since: u64,
    queue: VecDeque<QueuedOp>,
    /// The request id of the op at the queue's head, once sent.
    sent: Option<u64>,
    /// Not before this instant (a retry's pause).
    not_before: Option<Instant>,
    /// The session is over here: forget the device once its queue is empty.
    closed: bool,
    /// The app is in the background (I12): a connect sent again (to a new
    /// owner) is followed by a `SetForeground(false)`.
    background: bool,
}

impl EdgeDevice {
    /// Puts a connect at the head of the queue, then the app's state if it
    /// is in the background.
    fn connect_first(&mut self, now: Instant) {
        if self.background {
            self.queue.push_front(QueuedOp {
                op: WireOp::SetForeground(false),
                wait: None,
                deadline: now,
            });
        }
        self.queue.push_front(self.connect(now));
    }

    fn connect(&self, now: Instant) -> QueuedOp {
        QueuedOp {
            op: WireOp::Connect {
                kind: self.kind,
                session: self.wire,
                since: self.since,
            },
            wait: None,
            deadline: now,
        }
    }
}

struct PendingRoute {
    user: String,
    deadline: Instant,
    /// Ask again then (after a refusal or a failure).
    retry_at: Option<Instant>,
}

/// What a subscribe (or a resume's carry-over) asks for.
struct Wanted {
    targets: Vec<String>,
    refused: Vec<Refused>,
    tier: Tier,
    /// Targets with a tier of their own (carried over by a resume).
    tiers: HashMap<String, Tier>,
    query: bool,
}

struct PendingSubscribe {
    session: SessionId,
    viewer: String,
    tier: Tier,
    /// Targets with a tier of their own (carried over by a resume).
    tiers: HashMap<String, Tier>,
    /// Targets in request order: their snapshot once known.
    targets: Vec<(String, Option<Presence>)>,
    refused: Vec<Refused>,
    deadline: Instant,
    /// Shards still to answer, and when to ask each again.
    asking: BTreeMap<u32, Option<Instant>>,
    /// Views of the targets that arrived before their snapshot (the shard is
    /// watched first, and a view may overtake the owner's answer, a hole
    /// the model found): the newest is what the subscribe starts from.
    early: HashMap<String, Presence>,
    /// A query: answered with the presences, nothing subscribed or watched.
    query: bool,
}

/// The KV copy of a local session's subscriptions ([`SessionRecord`]): one
/// put in flight at a time (so they land in order), subscribe answers held
/// until a put that covers them landed.
struct SessionSync {
    user: String,
    device: String,
    wire: u64,
    /// Changes made to the subscriptions, and how many the KV has.
    changed: u64,
    stored: u64,
    /// The put in flight: its id and the changes it covers.
    putting: Option<(u64, u64)>,
    /// A failed put is tried again at the tick.
    retry: bool,
    /// Answers waiting for change `n` to be stored, with their deadline.
    waiting: Vec<(u64, u64, proto::Answer, Instant)>,
}

/// A hello naming a session this node does not hold: its device's record is
/// being read.
struct PendingResume {
    wait: u64,
    session: SessionId,
    wire: u64,
}

enum InFlight {
    Device {
        session: SessionId,
        rid: u64,
    },
    Snapshot {
        wait: u64,
        shard: u32,
    },
    /// The views (`own`: truths) of `targets` again, after one of `shard`
    /// was missed.
    Repair {
        shard: u32,
        targets: Vec<String>,
        own: bool,
    },
    Route {
        wait: u64,
    },
}

/// What an edge knows of the views of a shard some local session watches.
#[derive(Debug, Default)]
struct ShardTrack {
    /// (epoch, seq) of the newest view of the shard taken from its subject,
    /// or announced by a beacon, or of the owner's answer that came first.
    seen: Option<(u64, u64)>,
    /// A view was missed: the views of every target watched here are asked
    /// for again.
    gap: bool,
    /// Repair requests out.
    asking: u32,
    /// Not before this (after a failed repair).
    not_before: Option<Instant>,
}

/// A client request's answer, once the cluster is done with it.
#[derive(Debug)]
pub enum Finished {
    /// Answer with what the hub answered (the owner took the input).
    Done,
    /// The device's record names the session the hello resumes: these
    /// subscriptions carry over once the caller checked them against the
    /// new credentials ([`ClusterLink::carry_over`], under the same wait).
    Carry {
        session: SessionId,
        subscriptions: Vec<(String, Tier)>,
    },
    /// Answer with this instead.
    Answer(proto::Answer),
    /// Answer with this error.
    Failed(WireError),
}

/// The cluster side of one node (see the module docs).
pub struct ClusterLink {
    settings: ClusterSettings,
    owner_config: Config,
    /// The Unix time of the core's `Millis(0)`.
    unix_base_ms: u64,
    acting: BTreeMap<u32, (u64, Instant)>,
    owners: BTreeMap<u32, Owner>,
    pending_prefs: HashMap<u64, PendingPrefs>,
    /// KV reads in flight: shard, epoch, user, since.
    pending_loads: HashMap<u64, (u32, u64, String, Instant)>,
    /// Shard record reads in flight: shard, epoch, since.
    pending_shards: HashMap<u64, (u32, u64, Instant)>,
    fanout: Fanout,
    names: Interner,
    /// The edge's devices by session, while their inputs are forwarded.
    devices: HashMap<SessionId, EdgeDevice>,
    /// Sessions open in the fanout, with their user (whose name they hold a
    /// reference on).
    open: HashMap<SessionId, String>,
    /// Shards some local subscription watches, with how many.
    shard_watchers: HashMap<u32, u32>,
    /// The view numbers seen of each watched shard (the same keys).
    tracks: HashMap<u32, ShardTrack>,
    /// The numbers of the truths this edge was sent, per shard (at most
    /// one entry per shard).
    truth_tracks: HashMap<u32, ShardTrack>,
    /// Per shard, the newest epoch whose resync request this edge answered
    /// (a new owner sends it again while its window is open).
    resynced: HashMap<u32, u64>,
    next_beacon: Option<Instant>,
    /// Some track has a gap to repair (what the tick looks at).
    gaps: bool,
    subscribes: HashMap<u64, PendingSubscribe>,
    routes: HashMap<u64, PendingRoute>,
    /// Local sessions' KV records, and the puts in flight by id.
    records: HashMap<SessionId, SessionSync>,
    record_puts: HashMap<u64, SessionId>,
    /// Sessions whose put failed: tried again at the tick.
    record_retries: std::collections::HashSet<SessionId>,
    /// Record reads for resumes, by id.
    resumes: HashMap<u64, PendingResume>,
    /// Requests out, with when they count as unanswered (an output the NATS
    /// I/O dropped is never answered).
    in_flight: HashMap<u64, (InFlight, Instant)>,
    /// Devices with inputs queued or a retry pending: what the tick looks at.
    busy: std::collections::HashSet<SessionId>,
    next_tick: Option<Instant>,
    next_id: u64,
    next_conn: u64,
    outputs: VecDeque<ClusterOutput>,
    finished: VecDeque<(u64, Finished)>,
    counters: ClusterCounters,
    /// The newest incarnation seen of each edge (from its requests and its
    /// lease): requests of older ones are dropped. At most
    /// `MAX_EDGES_REMEMBERED`: edges are the cluster's nodes.
    incarnations: HashMap<String, u64>,
    /// Publish-to-fanout delays of remote views taken, in milliseconds.
    latencies: VecDeque<u64>,
    max_name_len: usize,
    max_subscriptions: usize,
}

impl ClusterLink {
    /// `config`: the core's configuration; owners use it with heartbeats
    /// off (the edge holding a connection says when it is lost).
    pub fn new(
        settings: ClusterSettings,
        config: &Config,
        unix_base_ms: u64,
        max_name_len: usize,
    ) -> ClusterLink {
        let mut owner_config = config.clone();
        for kind in &mut owner_config.kinds {
            kind.heartbeat_timeout = Millis(u64::MAX / 4);
        }
        ClusterLink {
            settings,
            max_subscriptions: config.max_subscriptions_per_session,
            fanout: Fanout::new(config.batch_interval),
            owner_config,
            unix_base_ms,
            acting: BTreeMap::new(),
            owners: BTreeMap::new(),
            pending_prefs: HashMap::new(),
            pending_loads: HashMap::new(),
            pending_shards: HashMap::new(),
            names: Interner::new(config.max_users.saturating_mul(2)),
            devices: HashMap::new(),
            open: HashMap::new(),
            shard_watchers: HashMap::new(),
            tracks: HashMap::new(),
            truth_tracks: HashMap::new(),
            resynced: HashMap::new(),
            next_beacon: None,
            gaps: false,
            subscribes: HashMap::new(),
            routes: HashMap::new(),
            records: HashMap::new(),
            record_puts: HashMap::new(),
            record_retries: Default::default(),
            resumes: HashMap::new(),
            in_flight: HashMap::new(),
            busy: Default::default(),
            next_tick: None,
            next_id: 0,
            next_conn: 0,
            outputs: VecDeque::new(),
            finished: VecDeque::new(),
            counters: ClusterCounters::default(),
            incarnations: HashMap::new(),
            latencies: VecDeque::new(),
            max_name_len,
        }
    }

    pub fn counters(&self) -> ClusterCounters {
        self.counters
    }

    pub fn poll_output(&mut self) -> Option<ClusterOutput> {
        self.outputs.pop_front()
    }

    /// A client request the cluster is done with: its wait id and answer.
    pub fn poll_finished(&mut self) -> Option<(u64, Finished)> {
        self.finished.pop_front()
    }

    /// The delay of a remote view this edge took (milliseconds).
    pub fn poll_latency(&mut self) -> Option<u64> {
        self.latencies.pop_front()
    }

    /// A push for a local session: the fanout's outputs.
    pub fn poll_fanout(&mut self) -> Option<Output> {
        self.fanout.poll_output()
    }

    /// The name behind a fanout user id.
    pub fn user_name(&self, user: UserId) -> Option<&str> {
        self.names.name(user.0).map(|n| &**n)
    }

    fn shard(&self, user: &str) -> u32 {
        (self.settings.shard_of)(user, self.settings.shard_count)
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// A request to `shard`'s owner, waited for until the request timeout.
    fn request(
        &mut self,
        now: Instant,
        waiting: InFlight,
        shard: u32,
        kind: RequestKind,
        payload: Bytes,
    ) {
        let id = self.id();
        let deadline = now + self.settings.request_timeout;
        self.in_flight.insert(id, (waiting, deadline));
        self.outputs.push_back(ClusterOutput::Request {
            id,
            shard,
            kind,
            payload,
        });
    }

    fn acting_epoch(&self, shard: u32, now: Instant) -> Option<u64> {
        self.acting
            .get(&shard)
            .filter(|(_, until)| now < *until)
            .map(|(epoch, _)| *epoch)
    }

    fn to_unix(&self, at: Millis) -> u64 {
        self.unix_base_ms.saturating_add(at.0)
    }

    /// The earliest instant something here is due, besides the cores';
    /// `now` (the caller's) when the first tick is still to come.
    pub fn poll_deadline(&self, now: Instant) -> Option<Instant> {
        let work = !self.acting.is_empty()
            || !self.busy.is_empty()
            || !self.subscribes.is_empty()
            || !self.routes.is_empty()
            || !self.record_retries.is_empty()
            || !self.resumes.is_empty()
            || self.gaps
            || !self.in_flight.is_empty()
            || !self.pending_prefs.is_empty()
            || !self.pending_loads.is_empty()
            || !self.pending_shards.is_empty();
        // A tick, not the exact instants: finding the earliest of them
        // would walk every device at every pass of the server's loop.
        // Not `Instant::now()`: that is always after the caller's `now`,
        // so a node whose cores had no timer due would never tick (its
        // retries and deadlines never looked at) while its loop spun.
        work.then(|| self.next_tick.unwrap_or(now))
    }

    /// The earliest core timer (owners' and the fanout's).
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.owners
            .values()
            .flat_map(|o| {
                o.core
                    .poll_timeout()
                    .into_iter()
                    .chain(o.dirty_since.map(|d| d.plus(WRITE_BEHIND)))
                    .chain(o.idle.front().map(|(due, _)| *due))
            })
            .chain(self.fanout.poll_timeout())
            .min()
    }

    /// Runs what is due: core timers at `at`, deadlines and retries at `now`.
    pub fn handle_timeout(&mut self, now: Instant, at: Millis) {
        // Stop acting at a claim's deadline, whatever the status says.
        let lapsed: Vec<u32> = self
            .acting
            .iter()
            .filter(|(_, (_, until))| now >= *until)
            .map(|(s, _)| *s)
            .collect();
        for shard in lapsed {
            self.acting.remove(&shard);
            self.drop_owner(shard, now, at);
        }
        let shards: Vec<u32> = self.owners.keys().copied().collect();
        for shard in shards {
            if let Some(o) = self.owners.get_mut(&shard) {
                o.core.handle_timeout(at);
            }
            self.drain_owner(shard, now, at);
            self.write_devices(shard, at);
            if let Some(o) = self.owners.get_mut(&shard) {
                self.counters.users_released += release_idle(o, at) as u64;
            }
        }
        self.fanout.handle_timeout(at);
        if self.next_tick.is_some_and(|t| now < t) {
            return;
        }
        self.next_tick = Some(now + TICK);
        self.expire_pending(now, at);
        self.announce(now);
        self.repair_gaps(now, at);
        self.tick_devices(now, at);
        self.retry_routes(now);
        self.retry_records(now);
        self.tick_subscribes(now, at);
    }

    // ---- status ----

    pub fn set_status(&mut self, now: Instant, at: Millis, shards: BTreeMap<u32, (u64, Instant)>) {
        // Shards lost, or won under a new epoch: their old cores go.
        let gone: Vec<u32> = self
            .owners
            .iter()
            .filter(|(s, o)| shards.get(s).is_none_or(|(e, _)| *e != o.epoch))
            .map(|(s, _)| *s)
            .collect();
        for shard in gone {
            self.drop_owner(shard, now, at);
        }
        self.acting = shards;
        let won: Vec<(u32, u64)> = self
            .acting
            .iter()
            .filter(|(s, (_, until))| now < *until && !self.owners.contains_key(s))
            .filter(|(s, (e, _))| {
                // An epoch past the last whose versions fit would wrap them:
                // not acted for (the claim side refuses it first).
                let fits = *e <= MAX_EPOCH;
                if !fits {
                    tracing::error!(
                        shard = s,
                        epoch = e,
                        "not acting for the shard: its epoch would wrap versions"
                    );
                }
                fits
            })
            .map(|(s, (e, _))| (*s, *e))
            .collect();
        for (shard, epoch) in won {
            let Ok(mut core) = Core::new(self.owner_config.clone()) else {
                continue; // the same config the hub's core took
            };
            core.set_publish_views(true);
            core.enter_epoch(Epoch(u32::try_from(epoch).unwrap_or(u32::MAX)));
            // Until the edges resent their devices, nobody restored from the
            // KV goes offline (C2).
            core.hold_offline_until(at.plus(Millis(
                u64::try_from(self.settings.request_timeout.as_millis()).unwrap_or(u64::MAX),
            )));
            let cap = self.owner_config.max_users;
            self.owners.insert(
                shard,
                Owner {
                    epoch,
                    core,
                    users: Interner::new(cap),
                    devices: Interner::new(self.owner_config.max_sessions),
                    sessions: HashMap::new(),
                    by_holder: HashMap::new(),
                    last_rid: HashMap::new(),
                    loaded: Default::default(),
                    loading: HashMap::new(),
                    recorded: HashMap::new(),
                    dirty_since: None,
                    greet: Vec::new(),
                    idle: VecDeque::new(),
                    seq: 0,
                    truth_seq: HashMap::new(),
                    resync_until: now + self.settings.request_timeout,
                    next_resync: now + RESYNC_EVERY,
                },
            );
            // The previous owner's devices: restored as lingering, so that
            // those nobody resends go offline (no ghost when the edge died
            // with the owner, C3).
            self.next_id += 1;
            let id = self.next_id;
            self.pending_shards.insert(id, (shard, epoch, now));
            self.outputs
                .push_back(ClusterOutput::LoadShard { id, shard });
            self.ask_resync(shard, epoch);
            // This node's own edge resends its devices of the shard at once.
            let mine: Vec<SessionId> = self
                .devices
                .iter()
                .filter(|(_, d)| !d.closed && self.shard(&d.user) == shard)
                .map(|(s, _)| *s)
                .collect();
            for session in mine {
                self.resend(session, now, at);
            }
        }
    }

    fn ask_resync(&mut self, shard: u32, epoch: u64) {
        self.outputs.push_back(ClusterOutput::Resync {
            payload: encode(&ResyncRequest {
                shard,
                epoch,
                owner: self.settings.node.clone(),
            }),
        });
    }

    /// Owners' periodic messages: the resync request again while its window
    /// is open, and the beacon.
    fn announce(&mut self, now: Instant) {
        let again: Vec<(u32, u64)> = self
            .owners
            .iter_mut()
            .filter(|(_, o)| now < o.resync_until && now >= o.next_resync)
            .map(|(s, o)| {
                o.next_resync = now + RESYNC_EVERY;
                (*s, o.epoch)
            })
            .collect();
        for (shard, epoch) in again {
            self.ask_resync(shard, epoch);
        }
        if self.next_beacon.is_some_and(|t| now < t) {
            return;
        }
        self.next_beacon = Some(now + BEACON_EVERY);
        let acting: Vec<(&u32, &Owner)> = self
            .owners
            .iter()
            .filter(|(s, o)| self.acting_epoch(**s, now) == Some(o.epoch))
            .collect();
        let shards: Vec<(u32, u64, u64)> = acting
            .iter()
            .filter(|(_, o)| o.seq > 0)
            .map(|(s, o)| (**s, o.epoch, o.seq))
            .collect();
        let recent = |sent: Instant| now.saturating_duration_since(sent) <= TRUTH_BEACON_FOR;
        let truths: Vec<(String, u32, u64, u64)> = acting
            .iter()
            .flat_map(|(s, o)| {
                o.truth_seq
                    .iter()
                    .filter(move |(_, (_, sent))| recent(*sent))
                    .map(move |(edge, (seq, _))| (edge.clone(), **s, o.epoch, *seq))
            })
            .collect();
        let chunks = shards
            .len()
            .div_ceil(MAX_BEACON_SHARDS)
            .max(truths.len().div_ceil(MAX_BEACON_TRUTHS));
        for i in 0..chunks {
            let part = |len: usize, max: usize| (i * max).min(len)..((i + 1) * max).min(len);
            self.outputs.push_back(ClusterOutput::Beacon {
                payload: encode(&Beacon {
                    owner: self.settings.node.clone(),
                    shards: shards[part(shards.len(), MAX_BEACON_SHARDS)].to_vec(),
                    truths: truths[part(truths.len(), MAX_BEACON_TRUTHS)].to_vec(),
                }),
            });
        }
    }

    /// Connects the session's device again to its (new) owner, ahead of
    /// whatever waits.
    fn resend(&mut self, session: SessionId, now: Instant, at: Millis) {
        let conn = self.next_conn();
        let Some(d) = self.devices.get_mut(&session) else {
            return;
        };
        if matches!(d.queue.front().map(|q| &q.op), Some(WireOp::Connect { .. })) {
            return;
        }
        d.conn = conn;
        d.sent = None;
        d.not_before = None;
        d.connect_first(now);
        self.pump(session, now, at);
    }

    fn next_conn(&mut self) -> u64 {
        self.next_conn += 1;
        self.next_conn
    }

    /// Client requests past their deadline, and retries due.
    fn tick_devices(&mut self, now: Instant, at: Millis) {
        let sessions: Vec<SessionId> = self.busy.iter().copied().collect();
        for session in sessions {
            if let Some(d) = self.devices.get_mut(&session) {
                for q in &mut d.queue {
                    if q.deadline <= now {
                        if let Some(wait) = q.wait.take() {
                            // An ending op is never dropped: it lands at this
                            // owner or the next, or, if this node dies first,
                            // the owner ends the session by its grace. The
                            // client is told it will land, not that it failed.
                            let answer = match q.op {
                                WireOp::Logout => Finished::Done,
                                _ => Finished::Failed(owner_late()),
                            };
                            self.finished.push_back((wait, answer));
                        }
                    }
                }
            }
            let due = self
                .devices
                .get(&session)
                .is_some_and(|d| d.not_before.is_some_and(|t| t <= now));
            if due {
                if let Some(d) = self.devices.get_mut(&session) {
                    d.not_before = None;
                    d.sent = None;
                }
                self.pump(session, now, at);
            }
        }
    }

    /// Subscribes past their deadline fail; snapshots due are asked again.
    fn tick_subscribes(&mut self, now: Instant, at: Millis) {
        let waits: Vec<u64> = self.subscribes.keys().copied().collect();
        for wait in waits {
            let Some(p) = self.subscribes.get_mut(&wait) else {
                continue;
            };
            if p.deadline <= now {
                if let Some(p) = self.subscribes.remove(&wait) {
                    self.fail_subscribe(wait, p);
                }
                continue;
            }
            let again: Vec<u32> = p
                .asking
                .iter()
                .filter(|(_, t)| t.is_some_and(|t| t <= now))
                .map(|(s, _)| *s)
                .collect();
            for shard in again {
                self.ask_snapshot(wait, shard, now, at);
            }
        }
    }

    // ---- the edge: sessions and device inputs ----

    /// A session was welcomed here: its device is forwarded to its owner.
    /// `wire`: the session's id on the wire (what `Route` lists).
    #[allow(clippy::too_many_arguments)]
    pub fn connected(
        &mut self,
        now: Instant,
        at: Millis,
        session: SessionId,
        wire: u64,
        user: &str,
        device: &str,
        kind: proto::Kind,
        carried_from: Option<SessionId>,
    ) {
        if !self.open.contains_key(&session) {
            let Some(uid) = self.names.intern(user) else {
                return; // at the cap: this session gets no cluster pushes
            };
            self.names.acquire(uid);
            self.fanout.open(session, UserId(uid));
            self.open.insert(session, user.to_owned());
        }
        // A resume here: the subscriptions (in the fanout, not the hub's
        // core) and the record carry over to the new session, whose wire
        // id the record now names.
        let old = carried_from.filter(|&old| old != session);
        if let Some(old) = old {
            self.fanout.carry(old, session);
        }
        match old.and_then(|old| self.records.remove(&old).map(|r| (old, r))) {
            Some((old, mut r)) => {
                for id in self.record_puts.values_mut() {
                    if *id == old {
                        *id = session;
                    }
                }
                if self.record_retries.remove(&old) {
                    self.record_retries.insert(session);
                }
                r.wire = wire;
                self.records.insert(session, r);
                self.record_changed(session);
            }
            None => {
                self.records.entry(session).or_insert_with(|| SessionSync {
                    user: user.to_owned(),
                    device: device.to_owned(),
                    wire,
                    changed: 0,
                    stored: 0,
                    putting: None,
                    retry: false,
                    waiting: Vec::new(),
                });
            }
        }
        let conn = self.next_conn();
        if let Some(d) = self.devices.get_mut(&session) {
            // Resumed here after a disconnect: connected again at the owner.
            if d.closed {
                d.closed = false;
                d.background = false; // the new hello's state follows
                d.conn = conn;
                d.queue.push_back(d.connect(now));
                self.pump(session, now, at);
            }
            return;
        }
        let mut d = EdgeDevice {
            user: user.to_owned(),
            device: device.to_owned(),
            kind,
            wire,
            conn,
            since: conn,
            queue: VecDeque::new(),
            sent: None,
            not_before: None,
            closed: false,
            background: false,
        };
        d.queue.push_back(d.connect(now));
        self.devices.insert(session, d);
        self.pump(session, now, at);
    }

    /// A device input of a session; `wait` is answered through
    /// [`ClusterLink::poll_finished`] once the owner took it (or with an
    /// error). `false`: the session is unknown here or already ended
    /// (nothing is forwarded).
    pub fn input(
        &mut self,
        now: Instant,
        at: Millis,
        session: SessionId,
        op: WireOp,
        wait: Option<u64>,
    ) -> bool {
        let deadline = now + self.settings.request_timeout;
        let Some(d) = self.devices.get_mut(&session).filter(|d| !d.closed) else {
            return false;
        };
        let ends = matches!(op, WireOp::Logout | WireOp::Disconnect { .. });
        if let WireOp::SetForeground(foreground) = op {
            d.background = !foreground;
        }
        if d.queue.len() >= MAX_QUEUED_OPS && ends {
            // An ending op is never refused: dropped, the device would stay
            // online at its owner until the shard moved (a ghost past C3's
            // bound). It takes the place of the changes queued before it
            // that a later one of the same kind overwrites anyway.
            for wait in compact_queue(&mut d.queue) {
                self.finished.push_back((
                    wait,
                    Finished::Failed(WireError::new(
                        ErrorCode::Internal,
                        "a later change took its place before the owner took it",
                    )),
                ));
            }
        }
        if d.queue.len() >= MAX_QUEUED_OPS {
            // The owner has not taken the inputs before it: refuse this one
            // (a client request is answered with the error).
            if let Some(wait) = wait {
                self.finished.push_back((
                    wait,
                    Finished::Failed(WireError::new(
                        ErrorCode::Internal,
                        "the owner of this user is not taking inputs",
                    )),
                ));
            }
            return true;
        }
        d.queue.push_back(QueuedOp { op, wait, deadline });
        if ends {
            d.closed = true;
        }
        self.pump(session, now, at);
        true
    }

    /// The session is over here (ended by the local core, or its connection
    /// is gone and its device already told): its subscriptions end.
    pub fn session_ended(&mut self, session: SessionId) {
        let subs = self.fanout.subscriptions(session);
        // The fanout's own `SessionEnded` is skipped by the driver.
        self.fanout.close(session, EndReason::LoggedOut);
        for (target, _) in subs {
            self.forget_target(target);
        }
        if let Some(user) = self.open.remove(&session) {
            self.drop_name(&user);
        }
        // Its record stays for a resume elsewhere until the owner sees the
        // device end (and deletes it).
        self.record_retries.remove(&session);
        if let Some(r) = self.records.remove(&session) {
            for (_, wait, answer, _) in r.waiting {
                self.finished.push_back((wait, Finished::Answer(answer)));
            }
        }
        if let Some(d) = self.devices.get_mut(&session) {
            d.closed = true;
            if d.queue.is_empty() && d.sent.is_none() {
                self.devices.remove(&session);
                self.busy.remove(&session);
            }
        }
    }

    fn drop_name(&mut self, user: &str) {
        if let Some(id) = self.names.get(user) {
            if self.names.drop_ref(id) == 0 {
                self.names.remove(id);
            }
        }
    }

    /// Fanout user id `target` lost a subscription.
    fn forget_target(&mut self, target: UserId) {
        let Some(name) = self.names.name(target.0).cloned() else {
            return;
        };
        let shard = self.shard(&name);
        self.unwatch_shard(shard);
        if self.names.drop_ref(target.0) == 0 {
            self.names.remove(target.0);
        }
    }

    fn watch_shard(&mut self, shard: u32) {
        let n = self.shard_watchers.entry(shard).or_insert(0);
        *n += 1;
        if *n == 1 {
            self.tracks.insert(shard, ShardTrack::default());
            self.outputs.push_back(ClusterOutput::Watch { shard });
        }
    }

    fn unwatch_shard(&mut self, shard: u32) {
        if let Some(n) = self.shard_watchers.get_mut(&shard) {
            *n -= 1;
            if *n == 0 {
                self.shard_watchers.remove(&shard);
                self.tracks.remove(&shard);
                self.outputs.push_back(ClusterOutput::Unwatch { shard });
            }
        }
    }

    // ---- the edge: views missed ----

    /// View `seq` of `epoch` came on `shard`'s subject. Views of an epoch
    /// come in order from its one owner; a new owner numbers from 1.
    fn track_view(&mut self, shard: u32, epoch: u64, seq: u64) {
        let Some(t) = self.tracks.get_mut(&shard) else {
            return;
        };
        match t.seen {
            None => t.seen = Some((epoch, seq)),
            Some(seen) if (epoch, seq) <= seen => {}
            Some((e, s)) => {
                t.seen = Some((epoch, seq));
                let next = (epoch == e && seq == s + 1) || (epoch > e && seq == 1);
                if !next {
                    self.missed(shard);
                }
            }
        }
    }

    /// A view of `shard` may have been missed: repaired at the next tick.
    fn missed(&mut self, shard: u32) {
        if let Some(t) = self.tracks.get_mut(&shard).filter(|t| !t.gap) {
            t.gap = true;
            self.gaps = true;
            self.counters.view_gaps += 1;
        }
    }

    /// A truth of a user of `shard` numbered `(epoch, seq)` came (or a
    /// beacon names it, `announced`): one skipped, or one announced that
    /// never came, means this edge missed a truth, and the truths of its
    /// users of the shard are asked for again.
    fn track_truth(&mut self, shard: u32, epoch: u64, seq: u64, announced: bool) {
        let t = self.truth_tracks.entry(shard).or_default();
        let missed = match t.seen {
            // The first heard of: only a beacon says one was missed.
            None => announced,
            Some(seen) if (epoch, seq) <= seen => false,
            Some((e, s)) => announced || !((epoch == e && seq == s + 1) || (epoch > e && seq == 1)),
        };
        t.seen = t.seen.max(Some((epoch, seq)));
        if missed && !t.gap {
            t.gap = true;
            self.gaps = true;
            self.counters.truth_gaps += 1;
        }
    }

    /// The owner of `shard` answered with the views up to `(epoch, seq)`.
    /// An answer older than a view seen since may miss what that view
    /// carried, when it was about a target being subscribed and the view
    /// was lost: the shard is asked again.
    fn track_answer(&mut self, shard: u32, epoch: u64, seq: u64) {
        let Some(t) = self.tracks.get_mut(&shard) else {
            return;
        };
        match t.seen {
            None => t.seen = Some((epoch, seq)),
            Some(seen) if seen > (epoch, seq) => self.missed(shard),
            _ => {}
        }
    }

    fn beacon(&mut self, b: Beacon) {
        for (edge, shard, epoch, seq) in b.truths {
            if edge == self.settings.node && shard < self.settings.shard_count {
                self.track_truth(shard, epoch, seq, true);
            }
        }
        for (shard, epoch, seq) in b.shards {
            let Some(t) = self.tracks.get_mut(&shard) else {
                continue;
            };
            // Not seen anything yet: the pending subscribe's answer will
            // carry the owner's number.
            let Some(seen) = t.seen else { continue };
            if (epoch, seq) > seen {
                t.seen = Some((epoch, seq));
                self.missed(shard);
            }
        }
    }

    /// Asks the owners of shards with a view missed for the views of every
    /// target watched here (and of those being subscribed).
    fn repair_gaps(&mut self, now: Instant, at: Millis) {
        if !self.gaps {
            return;
        }
        for own in [false, true] {
            let due: HashMap<u32, Vec<String>> = self
                .shard_tracks(own)
                .iter()
                .filter(|(_, t)| t.gap && t.asking == 0 && t.not_before.is_none_or(|n| n <= now))
                .map(|(s, _)| (*s, Vec::new()))
                .collect();
            if !due.is_empty() {
                self.ask_repairs(due, own, now, at);
            }
        }
        // Those waiting (a repair out, or a pause after a failure) keep it.
        self.gaps = self
            .tracks
            .values()
            .chain(self.truth_tracks.values())
            .any(|t| t.gap);
    }

    /// What this edge knows of the views (`own`: of the truths) of shards.
    fn shard_tracks(&mut self, own: bool) -> &mut HashMap<u32, ShardTrack> {
        if own {
            &mut self.truth_tracks
        } else {
            &mut self.tracks
        }
    }

    /// Asks for the views of every target of the `due` shards (`own`: the
    /// truths of every user of them with a session here).
    fn ask_repairs(
        &mut self,
        mut due: HashMap<u32, Vec<String>>,
        own: bool,
        now: Instant,
        at: Millis,
    ) {
        let names: Vec<String> = if own {
            self.open.values().cloned().collect()
        } else {
            let watched = self
                .fanout
                .watched()
                .filter_map(|u| self.names.name(u.0).map(|n| n.to_string()));
            let subscribing = self
                .subscribes
                .values()
                .filter(|p| !p.query)
                .flat_map(|p| p.targets.iter().map(|(t, _)| t.clone()));
            watched.chain(subscribing).collect()
        };
        let (shard_of, count) = (self.settings.shard_of, self.settings.shard_count);
        for name in names {
            if let Some(targets) = due.get_mut(&shard_of(&name, count)) {
                targets.push(name);
            }
        }
        for (shard, mut targets) in due {
            targets.sort_unstable();
            targets.dedup();
            if let Some(t) = self.shard_tracks(own).get_mut(&shard) {
                t.gap = false;
                t.not_before = None;
            }
            if self.acting_epoch(shard, now).is_some() && self.owners.contains_key(&shard) {
                self.repair_locally(shard, targets, own, now, at);
                continue;
            }
            for chunk in targets.chunks(MAX_SNAPSHOT_TARGETS) {
                if let Some(t) = self.shard_tracks(own).get_mut(&shard) {
                    t.asking += 1;
                }
                let targets = chunk.to_vec();
                let payload = encode(&ToOwner::Views {
                    targets: targets.clone(),
                    own,
                });
                self.request(
                    now,
                    InFlight::Repair {
                        shard,
                        targets,
                        own,
                    },
                    shard,
                    RequestKind::Snapshot,
                    payload,
                );
            }
        }
    }

    /// A repair of a shard this node acts for (its NATS copy of a view was
    /// lost; the in-process one was not, but what came from the previous
    /// owner may have been).
    fn repair_locally(
        &mut self,
        shard: u32,
        targets: Vec<String>,
        own: bool,
        now: Instant,
        at: Millis,
    ) {
        let mut presences = Vec::with_capacity(targets.len());
        for t in &targets {
            let viewer = own.then_some(t.as_str());
            match self.local_snapshot(shard, viewer, t, at) {
                Some(p) => presences.push(p),
                None => return self.repair_failed(shard, own, now),
            }
        }
        let (epoch, seq) = self.published_up_to(shard);
        self.repaired(shard, &targets, presences, (epoch, seq), own, at);
    }

    /// This node's owner of `shard`: its epoch and last view's number.
    fn published_up_to(&self, shard: u32) -> (u64, u64) {
        self.owners.get(&shard).map_or((0, 0), |o| (o.epoch, o.seq))
    }

    fn repair_failed(&mut self, shard: u32, own: bool, now: Instant) {
        self.counters.retries += 1;
        if let Some(t) = self.shard_tracks(own).get_mut(&shard) {
            t.gap = true;
            t.not_before = Some(now + RETRY_AFTER);
            self.gaps = true;
        }
    }

    /// `published`: the shard's last view when the owner answered.
    fn repaired(
        &mut self,
        shard: u32,
        targets: &[String],
        presences: Vec<Presence>,
        published: (u64, u64),
        own: bool,
        at: Millis,
    ) {
        for (target, presence) in targets.iter().zip(presences) {
            self.apply_view(at, target, own, presence.clone());
            self.keep_early(target, own, presence);
        }
        if let Some(t) = self.tracks.get_mut(&shard).filter(|_| !own) {
            // Views up to the answer's are in it.
            t.seen = t.seen.max(Some(published));
        }
    }

    /// Sends the op at the head of the session's queue, unless one is out.
    fn pump(&mut self, session: SessionId, now: Instant, at: Millis) {
        let rid = self.next_id + 1;
        let Some(d) = self.devices.get(&session) else {
            self.busy.remove(&session);
            return;
        };
        if d.sent.is_some() || d.not_before.is_some() {
            self.busy.insert(session);
            return;
        }
        let Some(head) = d.queue.front() else {
            self.busy.remove(&session);
            if d.closed {
                self.devices.remove(&session);
            }
            return;
        };
        self.busy.insert(session);
        let msg = ToOwner::Device {
            edge: self.settings.node.clone(),
            incarnation: self.settings.incarnation,
            rid,
            conn: d.conn,
            user: d.user.clone(),
            device: d.device.clone(),
            op: head.op.clone(),
        };
        let shard = self.shard(&d.user);
        self.next_id = rid;
        if let Some(d) = self.devices.get_mut(&session) {
            d.sent = Some(rid);
        }
        if self.owners.contains_key(&shard) && self.acting_epoch(shard, now).is_some() {
            self.counters.forwarded_local += 1;
            self.owner_input(shard, msg, ReplyTo::Local(session, rid), now, at);
        } else {
            self.counters.forwarded += 1;
            let payload = encode(&msg);
            self.request(
                now,
                InFlight::Device { session, rid },
                shard,
                RequestKind::Input,
                payload,
            );
        }
    }

    /// The owner's answer to the session's op `rid`.
    fn device_answer(
        &mut self,
        session: SessionId,
        rid: u64,
        answer: Option<FromOwner>,
        now: Instant,
        at: Millis,
    ) {
        let Some(d) = self.devices.get_mut(&session) else {
            return;
        };
        if d.sent != Some(rid) {
            return; // a stale answer (resent since)
        }
        d.sent = None;
        match answer {
            Some(FromOwner::Done { .. }) => {
                if let Some(q) = d.queue.pop_front() {
                    if let Some(wait) = q.wait {
                        self.finished.push_back((wait, Finished::Done));
                    }
                }
            }
            Some(FromOwner::Refused(error)) => {
                if let Some(q) = d.queue.pop_front() {
                    if let Some(wait) = q.wait {
                        self.finished.push_back((wait, Finished::Failed(error)));
                    }
                }
            }
            Some(FromOwner::Unknown) => {
                // The owner has no live session of the device (a new owner):
                // connect it again first.
                self.counters.retries += 1;
                d.connect_first(now);
                self.next_conn += 1;
                if let Some(d) = self.devices.get_mut(&session) {
                    d.conn = self.next_conn;
                }
            }
            Some(FromOwner::NotOwner)
            | Some(FromOwner::Snapshot { .. })
            | Some(FromOwner::Route(_))
            | Some(FromOwner::Loading)
            | None => {
                self.counters.retries += 1;
                d.not_before = Some(now + RETRY_AFTER);
                self.busy.insert(session);
                return;
            }
        }
        self.pump(session, now, at);
    }

    // ---- the edge: subscriptions ----

    /// A subscribe of a session in the cluster: `targets` already checked
    /// against the session's credentials (refusals in `refused`). Answered
    /// now (`Some`) when every snapshot is at hand, else through
    /// [`ClusterLink::poll_finished`] under `wait`.
    #[allow(clippy::too_many_arguments)]
    pub fn subscribe(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        viewer: &str,
        targets: Vec<String>,
        refused: Vec<Refused>,
        tier: Tier,
        query: bool,
    ) -> Option<proto::Answer> {
        let wanted = Wanted {
            targets,
            refused,
            tier,
            tiers: HashMap::new(),
            query,
        };
        self.start_subscribe(now, at, wait, session, viewer, wanted)
    }

    /// What a resume carries over (checked against the new credentials),
    /// subscribed again here with snapshots from the targets' owners, each
    /// in its tier; answered like a subscribe under `wait`.
    pub fn carry_over(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        viewer: &str,
        subscriptions: Vec<(String, Tier)>,
    ) -> Option<proto::Answer> {
        let wanted = Wanted {
            targets: subscriptions.iter().map(|(t, _)| t.clone()).collect(),
            refused: Vec::new(),
            tier: Tier::Realtime,
            tiers: subscriptions.into_iter().collect(),
            query: false,
        };
        self.start_subscribe(now, at, wait, session, viewer, wanted)
    }

    fn start_subscribe(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        viewer: &str,
        wanted: Wanted,
    ) -> Option<proto::Answer> {
        let Wanted {
            targets,
            mut refused,
            tier,
            tiers,
            query,
        } = wanted;
        let held = self.fanout.subscriptions(session);
        let mut room = self.max_subscriptions.saturating_sub(held.len());
        let mut wanted = Vec::new();
        for target in targets {
            if query {
                wanted.push((target, None));
                continue;
            }
            let already = self
                .names
                .get(&target)
                .is_some_and(|id| held.iter().any(|(t, _)| t.0 == id));
            if !already {
                if room == 0 {
                    refused.push(Refused {
                        target,
                        error: WireError::new(
                            ErrorCode::TooManySubscriptions,
                            "too many subscriptions",
                        ),
                    });
                    continue;
                }
                room -= 1;
            }
            wanted.push((target, None));
        }
        let mut p = PendingSubscribe {
            session,
            viewer: viewer.to_owned(),
            tier,
            targets: wanted,
            tiers,
            refused,
            deadline: now + self.settings.request_timeout,
            asking: BTreeMap::new(),
            early: HashMap::new(),
            query,
        };
        // What this edge knows already (another session watches the target),
        // or its own owner knows, is answered at once.
        let viewer_id = self.names.get(viewer).map(UserId);
        for (target, snap) in &mut p.targets {
            if let (Some(v), Some(t)) = (viewer_id, self.names.get(target)) {
                if let Some(known) = self.fanout.known(v, UserId(t)) {
                    *snap = Some(known.clone());
                    continue;
                }
            }
            let shard = (self.settings.shard_of)(target, self.settings.shard_count);
            if self.acting_epoch(shard, now).is_some() && self.owners.contains_key(&shard) {
                if let Some(presence) = self.local_snapshot(shard, Some(viewer), target, at) {
                    *snap = Some(presence);
                    continue;
                }
            }
            p.asking.insert(shard, Some(now));
        }
        // Watch the shards before asking (so no view published after the
        // snapshot is missed).
        for (target, _) in p.targets.iter().filter(|_| !query) {
            let shard = self.shard(target);
            self.watch_shard(shard);
        }
        self.subscribes.insert(wait, p);
        let shards: Vec<u32> = self.subscribes[&wait].asking.keys().copied().collect();
        for shard in shards {
            self.ask_snapshot(wait, shard, now, at);
        }
        self.try_finish_subscribe(wait, at)
    }

    /// What the owner core of `shard` here shows `viewer` (`None`: others)
    /// of `target`.
    fn local_snapshot(
        &mut self,
        shard: u32,
        viewer: Option<&str>,
        target: &str,
        at: Millis,
    ) -> Option<Presence> {
        let base = self.unix_base_ms;
        if !self.load_users(shard, std::iter::once(target), Instant::now()) {
            return None; // asked again after the read
        }
        let o = self.owners.get_mut(&shard)?;
        let uid = o.users.intern(target)?;
        let p = o
            .core
            .handle_snapshot(at, UserId(uid), viewer == Some(target))
            .ok()?;
        if !o.core.is_online(UserId(uid)) {
            note_idle(o, UserId(uid), at);
        }
        // Presences at the edge carry last seen in Unix milliseconds.
        let p = proto::Presence::from_core(&p, base).to_core();
        self.drain_owner(shard, Instant::now(), at);
        let (epoch, seq) = self.published_up_to(shard);
        self.track_answer(shard, epoch, seq);
        Some(p)
    }

    fn ask_snapshot(&mut self, wait: u64, shard: u32, now: Instant, at: Millis) {
        let Some(p) = self.subscribes.get_mut(&wait) else {
            return;
        };
        let targets: Vec<String> = p
            .targets
            .iter()
            .filter(|(t, snap)| {
                snap.is_none() && (self.settings.shard_of)(t, self.settings.shard_count) == shard
            })
            .map(|(t, _)| t.clone())
            .collect();
        if targets.is_empty() {
            p.asking.remove(&shard);
            return;
        }
        p.asking.insert(shard, None);
        let viewer = p.viewer.clone();
        if self.acting_epoch(shard, now).is_some() && self.owners.contains_key(&shard) {
            let mut presences = Vec::new();
            for t in &targets {
                match self.local_snapshot(shard, Some(&viewer), t, at) {
                    Some(presence) => presences.push(presence),
                    None => return self.retry_snapshot(wait, shard, now),
                }
            }
            self.snapshot_answer(wait, shard, &targets, presences, at);
            return;
        }
        let payload = encode(&ToOwner::Snapshot { viewer, targets });
        self.request(
            now,
            InFlight::Snapshot { wait, shard },
            shard,
            RequestKind::Snapshot,
            payload,
        );
    }

    /// Whether the owner of `shard` has the KV records of all `users`;
    /// if not, reads those not asked for yet (a snapshot taken before
    /// would miss a freed user's last seen, or a new owner's predecessor's
    /// view).
    fn load_users<'a>(
        &mut self,
        shard: u32,
        users: impl Iterator<Item = &'a str>,
        now: Instant,
    ) -> bool {
        let Some(o) = self.owners.get_mut(&shard) else {
            return false;
        };
        let epoch = o.epoch;
        let mut all = true;
        for user in users {
            if o.loaded.contains(user) {
                continue;
            }
            all = false;
            if o.loading.contains_key(user) || self.pending_loads.len() >= MAX_PENDING_PREFS {
                continue;
            }
            o.loading.insert(user.to_owned(), Vec::new());
            self.next_id += 1;
            let id = self.next_id;
            self.pending_loads
                .insert(id, (shard, epoch, user.to_owned(), now));
            self.outputs.push_back(ClusterOutput::LoadUser {
                id,
                user: user.to_owned(),
            });
        }
        all
    }

    fn retry_snapshot(&mut self, wait: u64, shard: u32, now: Instant) {
        self.counters.retries += 1;
        if let Some(p) = self.subscribes.get_mut(&wait) {
            p.asking.insert(shard, Some(now + RETRY_AFTER));
        }
    }

    fn snapshot_answer(
        &mut self,
        wait: u64,
        shard: u32,
        targets: &[String],
        presences: Vec<Presence>,
        at: Millis,
    ) {
        let Some(p) = self.subscribes.get_mut(&wait) else {
            return;
        };
        if presences.len() != targets.len() {
            return;
        }
        for (name, presence) in targets.iter().zip(presences) {
            for (t, snap) in &mut p.targets {
                if t == name && snap.is_none() {
                    *snap = Some(presence.clone());
                }
            }
        }
        p.asking.remove(&shard);
        if let Some(answer) = self.try_finish_subscribe(wait, at) {
            self.finished.push_back((wait, Finished::Answer(answer)));
        }
    }

    /// Subscribes in the fanout once every snapshot is in.
    fn try_finish_subscribe(&mut self, wait: u64, at: Millis) -> Option<proto::Answer> {
        let p = self.subscribes.get(&wait)?;
        if p.targets.iter().any(|(_, s)| s.is_none()) {
            return None;
        }
        let p = self.subscribes.remove(&wait)?;
        if p.query {
            let mut results: Vec<proto::QueryResult> = p
                .targets
                .into_iter()
                .map(|(target, snap)| {
                    let presence = match (snap, p.early.get(&target)) {
                        (Some(s), Some(e)) if e.version > s.version => e.clone(),
                        (snap, _) => snap.unwrap_or_default(),
                    };
                    proto::QueryResult {
                        target,
                        result: Ok(proto::Presence::from_core(&presence, 0)),
                    }
                })
                .collect();
            results.extend(p.refused.into_iter().map(|r| proto::QueryResult {
                target: r.target,
                result: Err(r.error),
            }));
            return Some(proto::Answer::Presences(results));
        }
        let mut snapshots = Vec::new();
        let mut refused = p.refused;
        let held: Vec<UserId> = self
            .fanout
            .subscriptions(p.session)
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        for (target, snap) in p.targets {
            let shard = self.shard(&target);
            let snap = match (snap, p.early.get(&target)) {
                (Some(s), Some(e)) if e.version > s.version => Some(e.clone()),
                (snap, _) => snap,
            };
            let Some(id) = self.names.intern(&target) else {
                self.unwatch_shard(shard);
                refused.push(Refused {
                    target,
                    error: WireError::new(ErrorCode::TooManyUsers, "too many user names"),
                });
                continue;
            };
            let again = held.contains(&UserId(id));
            let tier = p.tiers.get(&target).copied().unwrap_or(p.tier);
            match self
                .fanout
                .subscribe(at, p.session, UserId(id), tier, snap.unwrap_or_default())
            {
                Ok(presence) => {
                    if again {
                        self.unwatch_shard(shard); // counted once per subscription
                    } else {
                        self.names.acquire(id);
                    }
                    snapshots.push(Snapshot {
                        target,
                        tier: tier.into(),
                        presence: proto::Presence::from_core(&presence, 0),
                    });
                }
                Err(e) => {
                    self.unwatch_shard(shard);
                    if self.names.refs(id) == 0 {
                        self.names.remove(id);
                    }
                    refused.push(Refused {
                        target,
                        error: e.into(),
                    });
                }
            }
        }
        let answer = proto::Answer::Subscribed { snapshots, refused };
        self.when_recorded(p.session, wait, answer, p.deadline)
    }

    fn fail_subscribe(&mut self, wait: u64, p: PendingSubscribe) {
        for (target, _) in p.targets.iter().filter(|_| !p.query) {
            let shard = self.shard(target);
            self.unwatch_shard(shard);
        }
        self.finished.push_back((
            wait,
            Finished::Failed(WireError::new(
                ErrorCode::Internal,
                "the owner of a target did not answer in time",
            )),
        ));
    }

    /// A service's `Route` of `user`: their owner lists their Online
    /// devices on every node. Answered now (`Some`) when this node acts for
    /// the user's shard, else through [`ClusterLink::poll_finished`] under
    /// `wait`.
    pub fn route(&mut self, now: Instant, wait: u64, user: &str) -> Option<proto::Answer> {
        let shard = self.shard(user);
        if self.acting_epoch(shard, now).is_some() {
            if let Some(o) = self.owners.get(&shard) {
                return Some(proto::Answer::Route(route_of(o, user)));
            }
        }
        let p = PendingRoute {
            user: user.to_owned(),
            deadline: now + self.settings.request_timeout,
            retry_at: None,
        };
        self.routes.insert(wait, p);
        self.ask_route(wait, now);
        None
    }

    fn ask_route(&mut self, wait: u64, now: Instant) {
        let Some(p) = self.routes.get_mut(&wait) else {
            return;
        };
        p.retry_at = None;
        let shard = (self.settings.shard_of)(&p.user, self.settings.shard_count);
        let payload = encode(&ToOwner::Route {
            user: p.user.clone(),
        });
        let waiting = InFlight::Route { wait };
        self.request(now, waiting, shard, RequestKind::Snapshot, payload);
    }

    fn retry_routes(&mut self, now: Instant) {
        let mut again = Vec::new();
        let mut late = Vec::new();
        for (wait, p) in &self.routes {
            if p.deadline <= now {
                late.push(*wait);
            } else if p.retry_at.is_some_and(|t| t <= now) {
                again.push(*wait);
            }
        }
        for wait in late {
            self.routes.remove(&wait);
            self.finished
                .push_back((wait, Finished::Failed(owner_late())));
        }
        for wait in again {
            self.ask_route(wait, now);
        }
    }

    /// Stops watching `target`. `false`: not subscribed.
    pub fn unsubscribe(&mut self, at: Millis, session: SessionId, target: &str) -> bool {
        let Some(id) = self.names.get(target) else {
            return false;
        };
        if self.fanout.unsubscribe(at, session, UserId(id)).is_err() {
            return false;
        }
        self.forget_target(UserId(id));
        // Behind: a record that still lists it carries one target too many,
        // never one too few.
        self.record_changed(session);
        true
    }

    // ---- session records (resume on any node) ----

    /// The session's subscriptions changed: its record is written again.
    fn record_changed(&mut self, session: SessionId) {
        if let Some(r) = self.records.get_mut(&session) {
            r.changed += 1;
            self.store_record(session);
        }
    }

    /// `answer` (to a subscribe of `session`) once the record that has it
    /// landed, so that a resume anywhere after the answer carries it over.
    fn when_recorded(
        &mut self,
        session: SessionId,
        wait: u64,
        answer: proto::Answer,
        deadline: Instant,
    ) -> Option<proto::Answer> {
        let Some(r) = self.records.get_mut(&session) else {
            return Some(answer);
        };
        r.changed += 1;
        r.waiting.push((r.changed, wait, answer, deadline));
        self.store_record(session);
        None
    }

    fn store_record(&mut self, session: SessionId) {
        let Some(r) = self.records.get(&session) else {
            return;
        };
        if r.putting.is_some() || r.retry || r.changed == r.stored {
            return;
        }
        let subscriptions = self
            .fanout
            .subscriptions(session)
            .into_iter()
            .filter_map(|(t, tier)| Some((self.names.name(t.0)?.to_string(), tier.into())))
            .collect();
        let value = encode(&SessionRecord {
            wire: r.wire,
            subscriptions,
        });
        let (user, device, changed) = (r.user.clone(), r.device.clone(), r.changed);
        let id = self.id();
        if let Some(r) = self.records.get_mut(&session) {
            r.putting = Some((id, changed));
        }
        self.record_puts.insert(id, session);
        self.outputs.push_back(ClusterOutput::PutSession {
            id,
            user,
            device,
            value,
        });
    }

    fn session_stored(&mut self, now: Instant, id: u64, ok: bool) {
        let Some(session) = self.record_puts.remove(&id) else {
            return;
        };
        let Some(r) = self.records.get_mut(&session) else {
            return;
        };
        let Some((_, covers)) = r.putting.take() else {
            return;
        };
        if ok {
            r.stored = r.stored.max(covers);
        } else {
            self.counters.session_writes_failed += 1;
            r.retry = true;
            self.record_retries.insert(session);
        }
        self.release_answers(session, now);
        self.store_record(session);
    }

    fn retry_records(&mut self, now: Instant) {
        let due: Vec<SessionId> = self.record_retries.drain().collect();
        for session in due {
            if let Some(r) = self.records.get_mut(&session) {
                r.retry = false;
                self.release_answers(session, now);
                self.store_record(session);
            }
        }
    }

    /// Subscribe answers go once their record is stored; past their
    /// deadline, anyway (the subscription holds here; a resume elsewhere
    /// would miss it).
    fn release_answers(&mut self, session: SessionId, now: Instant) {
        let Some(r) = self.records.get_mut(&session) else {
            return;
        };
        let stored = r.stored;
        let (done, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut r.waiting)
            .into_iter()
            .partition(|&(n, _, _, deadline)| n <= stored || deadline <= now);
        r.waiting = kept;
        for (_, wait, answer, _) in done {
            self.finished.push_back((wait, Finished::Answer(answer)));
        }
    }

    /// A hello named `wire`, which is no session of this node (another
    /// node's, or a previous process's): the device's record is read, and
    /// if it names `wire` its subscriptions come back as
    /// [`Finished::Carry`] under `wait`; if not, [`Finished::Done`] (the
    /// session is fresh).
    pub fn resume_elsewhere(
        &mut self,
        wait: u64,
        session: SessionId,
        user: &str,
        device: &str,
        wire: u64,
    ) {
        let id = self.id();
        self.resumes.insert(
            id,
            PendingResume {
                wait,
                session,
                wire,
            },
        );
        self.outputs.push_back(ClusterOutput::LoadSession {
            id,
            user: user.to_owned(),
            device: device.to_owned(),
        });
    }

    fn session_loaded(&mut self, id: u64, record: Option<Bytes>) {
        let Some(p) = self.resumes.remove(&id) else {
            return;
        };
        let record = record
            .as_deref()
            .and_then(decode::<SessionRecord>)
            .filter(|r| r.wire == p.wire)
            .filter(|r| r.subscriptions.len() <= self.max_subscriptions)
            .filter(|_| self.open.contains_key(&p.session));
        let finished = match record {
            Some(r) => {
                self.counters.resumed_elsewhere += 1;
                let subscriptions = r
                    .subscriptions
                    .into_iter()
                    .map(|(t, tier)| (t, tier.into()))
                    .collect();
                Finished::Carry {
                    session: p.session,
                    subscriptions,
                }
            }
            None => Finished::Done,
        };
        self.finished.push_back((p.wait, finished));
    }

    /// The session's subscriptions with what this edge knows of each (for a
    /// resumed session's welcome).
    pub fn snapshots(&self, session: SessionId, viewer: &str) -> Vec<Snapshot> {
        let viewer = self.names.get(viewer).map(UserId);
        self.fanout
            .subscriptions(session)
            .into_iter()
            .filter_map(|(t, tier)| {
                let presence = viewer
                    .and_then(|v| self.fanout.known(v, t))
                    .cloned()
                    .unwrap_or_default();
                Some(Snapshot {
                    target: self.user_name(t)?.to_owned(),
                    tier: tier.into(),
                    presence: proto::Presence::from_core(&presence, 0),
                })
            })
            .collect()
    }

    // ---- messages from NATS ----

    pub fn handle_input(&mut self, now: Instant, at: Millis, input: ClusterInput) {
        match input {
            ClusterInput::Status { shards } => self.set_status(now, at, shards),
            ClusterInput::ShardMessage { shard, payload } => {
                self.view_message(at, &payload, Some(shard))
            }
            ClusterInput::EdgeMessage { payload } => self.view_message(at, &payload, None),
            ClusterInput::Request {
                shard,
                kind,
                payload,
                reply,
            } => self.request_message(now, at, shard, kind, &payload, reply),
            ClusterInput::SessionStored { id, ok } => self.session_stored(now, id, ok),
            ClusterInput::SessionLoaded { id, record } => self.session_loaded(id, record),
            ClusterInput::Answered { id, payload } => self.answered(now, at, id, payload),
            ClusterInput::Beacon { payload } => self.beacon_message(&payload),
            ClusterInput::UserLoaded { id, prefs, view } => {
                self.user_loaded(now, at, id, prefs, view)
            }
            ClusterInput::ShardLoaded { id, record } => self.shard_loaded(now, id, record),
            ClusterInput::EdgeLost { node, last_heard } => {
                self.edge_lost(now, at, &node, None, last_heard)
            }
            ClusterInput::EdgeRestarted {
                node,
                incarnation,
                last_heard,
            } => {
                self.saw_incarnation(&node, incarnation);
                self.edge_lost(now, at, &node, Some(incarnation), last_heard)
            }
            ClusterInput::Resync { payload } => self.resync_message(now, at, &payload),
            ClusterInput::PrefsStored { id, ok } => self.prefs_stored(now, at, id, ok),
        }
    }

    /// A request on a shard's subject: checked, then taken as its owner.
    fn request_message(
        &mut self,
        now: Instant,
        at: Millis,
        shard: u32,
        kind: RequestKind,
        payload: &[u8],
        reply: u64,
    ) {
        match decode::<ToOwner>(payload) {
            Some(msg) if self.well_formed(&msg) => {
                let matches_kind = matches!(
                    (&msg, kind),
                    (ToOwner::Device { .. }, RequestKind::Input)
                        | (ToOwner::Snapshot { .. }, RequestKind::Snapshot)
                        | (ToOwner::Views { .. }, RequestKind::Snapshot)
                        | (ToOwner::Route { .. }, RequestKind::Snapshot)
                );
                if !matches_kind {
                    self.counters.malformed += 1;
                    return;
                }
                self.owner_request(shard, msg, reply, now, at);
            }
            _ => self.counters.malformed += 1,
        }
    }

    /// The owner's answer to request `id` (`None`: unanswered).
    fn answered(&mut self, now: Instant, at: Millis, id: u64, payload: Option<Bytes>) {
        let Some((what, _)) = self.in_flight.remove(&id) else {
            return;
        };
        let answer = payload.and_then(|p| {
            let a = decode::<FromOwner>(&p);
            if a.is_none() {
                self.counters.malformed += 1;
            }
            a
        });
        match what {
            InFlight::Device { session, rid } => self.device_answer(session, rid, answer, now, at),
            InFlight::Snapshot { wait, shard } => match answer {
                Some(FromOwner::Snapshot {
                    presences,
                    epoch,
                    seq,
                }) if self.messages_fit(&presences) => {
                    self.track_answer(shard, epoch, seq);
                    let targets: Vec<String> = self
                        .subscribes
                        .get(&wait)
                        .map(|p| {
                            p.targets
                                .iter()
                                .filter(|(t, s)| s.is_none() && self.shard(t) == shard)
                                .map(|(t, _)| t.clone())
                                .collect()
                        })
                        .unwrap_or_default();
                    let presences = presences.iter().map(|p| p.to_core()).collect();
                    self.snapshot_answer(wait, shard, &targets, presences, at);
                }
                _ => self.retry_snapshot(wait, shard, now),
            },
            InFlight::Route { wait } => match answer {
                Some(FromOwner::Route(entries))
                    if entries
                        .iter()
                        .all(|e| !e.device.is_empty() && e.device.len() <= self.max_name_len) =>
                {
                    if self.routes.remove(&wait).is_some() {
                        let answer = proto::Answer::Route(entries);
                        self.finished.push_back((wait, Finished::Answer(answer)));
                    }
                }
                _ => {
                    self.counters.retries += 1;
                    if let Some(p) = self.routes.get_mut(&wait) {
                        p.retry_at = Some(now + RETRY_AFTER);
                    }
                }
            },
            InFlight::Repair {
                shard,
                targets,
                own,
            } => {
                if let Some(t) = self.shard_tracks(own).get_mut(&shard) {
                    t.asking = t.asking.saturating_sub(1);
                }
                match answer {
                    Some(FromOwner::Snapshot {
                        presences,
                        epoch,
                        seq,
                    }) if presences.len() == targets.len() && self.messages_fit(&presences) => {
                        let presences = presences.iter().map(|p| p.to_core()).collect();
                        self.repaired(shard, &targets, presences, (epoch, seq), own, at);
                    }
                    _ => self.repair_failed(shard, own, now),
                }
            }
        }
    }

    /// A message on the beacon subject, checked against the limits.
    fn beacon_message(&mut self, payload: &[u8]) {
        match decode::<Beacon>(payload) {
            Some(b)
                if b.owner.len() <= self.max_name_len
                    && b.shards.len() <= MAX_BEACON_SHARDS
                    && b.truths.len() <= MAX_BEACON_TRUTHS
                    && b.truths.iter().all(|t| t.0.len() <= self.max_name_len) =>
            {
                self.beacon(b)
            }
            _ => self.counters.malformed += 1,
        }
    }

    /// A new owner's resync request: this edge resends its devices of the
    /// shard.
    fn resync_message(&mut self, now: Instant, at: Millis, payload: &[u8]) {
        match decode::<ResyncRequest>(payload) {
            Some(r)
                if r.owner.len() <= self.max_name_len && r.shard < self.settings.shard_count =>
            {
                if r.owner == self.settings.node {
                    return; // resent in process when the claim was won
                }
                // Sent again while the owner's window is open: once is
                // enough (the resent connects are retried until taken).
                let answered = self.resynced.entry(r.shard).or_insert(0);
                if *answered >= r.epoch {
                    return;
                }
                *answered = r.epoch;
                let mine: Vec<SessionId> = self
                    .devices
                    .iter()
                    .filter(|(_, d)| !d.closed && self.shard(&d.user) == r.shard)
                    .map(|(s, _)| *s)
                    .collect();
                self.counters.resyncs += 1;
                for session in mine {
                    self.resend(session, now, at);
                }
            }
            _ => self.counters.malformed += 1,
        }
    }

    /// The KV write of preferences `id` is done (`ok`) or failed: the
    /// input that waited for it is answered.
    fn prefs_stored(&mut self, now: Instant, at: Millis, id: u64, ok: bool) {
        let Some(p) = self.pending_prefs.remove(&id) else {
            return;
        };
        // Done only while this node still acts for the epoch it
        // wrote under (C4): after the shard moved, the new owner may
        // show otherwise, so the edge asks it again.
        let acting = self
            .acting
            .get(&p.shard)
            .is_some_and(|(epoch, until)| *epoch == p.epoch && now < *until);
        let owner = self
            .owners
            .get_mut(&p.shard)
            .filter(|o| acting && o.epoch == p.epoch);
        let answer = match owner {
            Some(o) if ok => {
                remember_rid(&mut o.last_rid, p.holder, p.rid);
                FromOwner::Done { epoch: p.epoch }
            }
            // Not stored (or fenced by a newer owner's write), or
            // the shard moved: the edge asks again.
            _ => FromOwner::NotOwner,
        };
        self.reply(p.reply, answer, now, at);
    }

    /// A user's KV record arrived: restore it, then take the inputs that
    /// waited for it.
    fn user_loaded(
        &mut self,
        now: Instant,
        at: Millis,
        id: u64,
        prefs: Option<Bytes>,
        view: Option<Bytes>,
    ) {
        let Some((shard, epoch, user, _)) = self.pending_loads.remove(&id) else {
            return;
        };
        let max_message = self.owner_config.max_message_len;
        let prefs = prefs
            .and_then(|b| decode::<WirePrefs>(&b))
            .filter(|p| p.message.as_ref().is_none_or(|m| m.len() <= max_message));
        let view = view
            .and_then(|b| decode::<proto::Presence>(&b))
            .filter(|p| p.message.as_ref().is_none_or(|m| m.len() <= max_message));
        let Some(o) = self.owners.get_mut(&shard).filter(|o| o.epoch == epoch) else {
            return; // the owner is gone; its waiting inputs were refused then
        };
        o.loaded.insert(user.clone());
        let recorded = o.recorded.remove(&user).unwrap_or_default();
        if prefs.is_some() || view.is_some() || !recorded.is_empty() {
            // Recorded devices linger at least to the end of the resync
            // window, heard from at the record's time.
            let window = u64::try_from(self.settings.request_timeout.as_millis()).unwrap_or(0);
            let mut devices = Vec::new();
            let mut holders = Vec::new();
            for d in &recorded {
                let Some(did) = o.devices.intern(&d.device) else {
                    continue;
                };
                devices.push(greendot_core::cluster::DeviceRecord {
                    device: DeviceId(did),
                    kind: d.kind.into(),
                    edge: greendot_core::NodeId(0),
                    last_heard: Millis(d.heard).min(at),
                });
                holders.push(((d.edge.clone(), d.incarnation, d.conn), did));
            }
            if let Some(uid) = o.users.intern(&user) {
                let record = greendot_core::cluster::OwnedRecord {
                    status: prefs
                        .as_ref()
                        .map_or(Default::default(), |p| p.status.into()),
                    message: prefs.as_ref().and_then(|p| p.message.clone()),
                    invisible: prefs.as_ref().is_some_and(|p| p.invisible),
                    // The preferences carry last seen as of their last write,
                    // the view as of the last publish (later, when the user
                    // went offline since).
                    last_seen: prefs
                        .as_ref()
                        .and_then(|p| p.last_seen)
                        .max(view.as_ref().and_then(|v| v.last_seen))
                        .map(Millis),
                    published: view.map(|v| v.to_core()).unwrap_or_default(),
                    devices,
                };
                // Refused only for a user already online here (cannot be:
                // their inputs waited for this), or past a limit.
                if let Ok(sessions) =
                    o.core
                        .restore_owned(at, UserId(uid), &record, at.plus(Millis(window)))
                {
                    for (session, (holder, did)) in sessions.into_iter().zip(holders) {
                        o.by_holder.insert(holder.clone(), session);
                        o.devices.acquire(did);
                        o.sessions.insert(session, (holder, did, 0, UserId(uid), 0));
                    }
                }
            }
        }
        let waiting = o.loading.remove(&user).unwrap_or_default();
        for (msg, reply) in waiting {
            self.owner_input(shard, msg, reply, now, at);
        }
        self.drain_owner(shard, now, at);
    }

    /// Remembers `incarnation` as the edge's newest if it is; `false` if a
    /// newer one of the edge is known (`incarnation` is a dead run's).
    fn saw_incarnation(&mut self, edge: &str, incarnation: u64) -> bool {
        match self.incarnations.get_mut(edge) {
            Some(newest) if *newest > incarnation => false,
            Some(newest) => {
                *newest = incarnation;
                true
            }
            None => {
                if self.incarnations.len() < MAX_EDGES_REMEMBERED {
                    self.incarnations.insert(edge.to_owned(), incarnation);
                }
                true
            }
        }
    }

    /// An edge's lease is gone: the devices it held, at every shard this
    /// node owns, are lost as by a disconnect at its last renewal, so a
    /// device that reconnects to another edge within grace resumes unseen,
    /// and one that does not is shown offline after grace and debounce (C3).
    /// With `older_than`, only the devices of the edge's incarnations below
    /// it are lost (the edge restarted under that incarnation).
    fn edge_lost(
        &mut self,
        now: Instant,
        at: Millis,
        node: &str,
        older_than: Option<u64>,
        last_heard: u64,
    ) {
        if node == self.settings.node {
            return; // its own lease: the node is being cut off, not lost
        }
        // Unix ms (from the lease) on the core's clock.
        let last_heard = Millis(last_heard.saturating_sub(self.unix_base_ms)).min(at);
        let shards: Vec<u32> = self.owners.keys().copied().collect();
        for shard in shards {
            let Some(o) = self.owners.get_mut(&shard) else {
                continue;
            };
            let lost: Vec<SessionId> = o
                .sessions
                .iter()
                .filter(|(_, (holder, ..))| {
                    holder.0 == node && older_than.is_none_or(|i| holder.1 < i)
                })
                .map(|(s, _)| *s)
                .collect();
            if lost.is_empty() {
                continue;
            }
            let n = o.core.handle_edge_lost(at, &lost, last_heard);
            self.counters.edge_lost_devices += n as u64;
            self.drain_owner(shard, now, at);
        }
    }

    /// Writes the shard's device record behind once `WRITE_BEHIND` passed
    /// since the first change not written.
    fn write_devices(&mut self, shard: u32, at: Millis) {
        let base = self.unix_base_ms;
        let Some(o) = self.owners.get_mut(&shard) else {
            return;
        };
        if o.dirty_since.is_none_or(|d| at < d.plus(WRITE_BEHIND)) {
            return;
        }
        o.dirty_since = None;
        let mut devices: Vec<RecordedDevice> = o
            .sessions
            .iter()
            .filter_map(|(s, ((edge, incarnation, conn), ..))| {
                let info = o.core.session_info(*s)?;
                Some(RecordedDevice {
                    user: o.users.name(info.user.0)?.to_string(),
                    device: o.devices.name(info.device.0)?.to_string(),
                    kind: info.kind.into(),
                    edge: edge.clone(),
                    incarnation: *incarnation,
                    conn: *conn,
                    heard: base.saturating_add(at.0),
                })
            })
            .collect();
        devices.sort_by(|a, b| (&a.user, &a.device).cmp(&(&b.user, &b.device)));
        devices.truncate(MAX_RECORDED_DEVICES);
        self.outputs.push_back(ClusterOutput::PutShardDevices {
            shard,
            value: encode(&devices),
        });
    }

    /// The previous owner's device record of a shard arrived: each user in
    /// it is restored (preferences, view, devices as lingering) at once.
    fn shard_loaded(&mut self, now: Instant, id: u64, record: Option<Bytes>) {
        let Some((shard, epoch, _)) = self.pending_shards.remove(&id) else {
            return;
        };
        let max_name = self.max_name_len;
        let devices: Vec<RecordedDevice> = record
            .and_then(|b| decode::<Vec<RecordedDevice>>(&b))
            .unwrap_or_default()
            .into_iter()
            .filter(|d| {
                [&d.user, &d.device, &d.edge]
                    .iter()
                    .all(|n| !n.is_empty() && n.len() <= max_name)
            })
            .take(MAX_RECORDED_DEVICES)
            .collect();
        let shard_of = self.settings.shard_of;
        let count = self.settings.shard_count;
        let Some(o) = self.owners.get_mut(&shard).filter(|o| o.epoch == epoch) else {
            return;
        };
        let mut users = Vec::new();
        for d in devices {
            if shard_of(&d.user, count) != shard || o.loaded.contains(&d.user) {
                continue;
            }
            let list = o.recorded.entry(d.user.clone()).or_default();
            if list.is_empty() {
                users.push(d.user.clone());
            }
            list.push(d);
        }
        for user in users {
            let Some(o) = self.owners.get_mut(&shard) else {
                return;
            };
            if o.loading.contains_key(&user) {
                continue; // its read is on the way; the devices go with it
            }
            o.loading.insert(user.clone(), Vec::new());
            self.next_id += 1;
            let id = self.next_id;
            self.pending_loads
                .insert(id, (shard, epoch, user.clone(), now));
            self.outputs.push_back(ClusterOutput::LoadUser { id, user });
        }
    }

    /// What waited too long for the NATS I/O (its output dropped at a full
    /// queue, or NATS silent): requests count as unanswered (retried),
    /// preference writes as failed, KV reads are asked again.
    fn expire_pending(&mut self, now: Instant, at: Millis) {
        let late: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.handle_input(now, at, ClusterInput::Answered { id, payload: None });
        }
        let timeout = self.settings.request_timeout;
        let late: Vec<u64> = self
            .pending_prefs
            .iter()
            .filter(|(_, p)| p.since + timeout <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.handle_input(now, at, ClusterInput::PrefsStored { id, ok: false });
        }
        let late: Vec<u64> = self
            .pending_loads
            .iter()
            .filter(|(_, (_, _, _, since))| *since + timeout <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            if let Some((shard, epoch, user, _)) = self.pending_loads.remove(&id) {
                self.next_id += 1;
                let id = self.next_id;
                self.pending_loads
                    .insert(id, (shard, epoch, user.clone(), now));
                self.outputs.push_back(ClusterOutput::LoadUser { id, user });
            }
        }
        let late: Vec<u64> = self
            .pending_shards
            .iter()
            .filter(|(_, (_, _, since))| *since + timeout <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            if let Some((shard, epoch, _)) = self.pending_shards.remove(&id) {
                self.next_id += 1;
                let id = self.next_id;
                self.pending_shards.insert(id, (shard, epoch, now));
                self.outputs
                    .push_back(ClusterOutput::LoadShard { id, shard });
            }
        }
    }

    /// The node stops acting for `shard`: its core goes, and this node's
    /// own inputs that waited in it are refused (the edge looks again).
    fn drop_owner(&mut self, shard: u32, now: Instant, at: Millis) {
        let Some(o) = self.owners.remove(&shard) else {
            return;
        };
        for (_, waiting) in o.loading {
            for (_, reply) in waiting {
                if let ReplyTo::Local(..) = reply {
                    self.reply(reply, FromOwner::NotOwner, now, at);
                }
            }
        }
    }

    /// A view from NATS: on `shard`'s subject (views, and the truths older
    /// owners sent there), or on this edge's subject (`None`: truths only).
    fn view_message(&mut self, at: Millis, payload: &[u8], shard: Option<u32>) {
        match decode::<ShardView>(payload) {
            Some(v)
                if v.user.len() <= self.max_name_len
                    && v.presence
                        .message
                        .as_ref()
                        .is_none_or(|m| m.len() <= self.owner_config.max_message_len)
                    && shard.map_or(v.own, |s| self.shard(&v.user) == s) =>
            {
                match (shard, v.own) {
                    (Some(shard), false) => self.track_view(shard, v.epoch, v.seq),
                    (None, true) if v.seq > 0 => {
                        let shard = self.shard(&v.user);
                        self.track_truth(shard, v.epoch, v.seq, false);
                    }
                    _ => {}
                }
                let presence = v.presence.to_core();
                if self.apply_view(at, &v.user, v.own, presence.clone()) {
                    self.counters.views_applied += 1;
                    if self.latencies.len() < 1024 {
                        self.latencies
                            .push_back(at.0.saturating_sub(v.published_ms));
                    }
                }
                self.keep_early(&v.user, v.own, presence);
            }
            _ => self.counters.malformed += 1,
        }
    }

    /// A view of a target some subscribe here still waits the snapshot of.
    fn keep_early(&mut self, user: &str, own: bool, presence: Presence) {
        for p in self.subscribes.values_mut() {
            let wanted = (p.viewer == user) == own && p.targets.iter().any(|(t, _)| t == user);
            if !wanted {
                continue;
            }
            let newer = p
                .early
                .get(user)
                .is_none_or(|e| e.version < presence.version);
            if newer {
                p.early.insert(user.to_owned(), presence.clone());
            }
        }
    }

    /// Names within the limits (checked before anything is interned).
    fn well_formed(&self, msg: &ToOwner) -> bool {
        let ok = |s: &str| !s.is_empty() && s.len() <= self.max_name_len;
        match msg {
            ToOwner::Device {
                edge,
                user,
                device,
                op,
                ..
            } => {
                ok(edge)
                    && ok(user)
                    && ok(device)
                    && match op {
                        WireOp::SetStatus {
                            message: Some(m), ..
                        } => m.len() <= self.owner_config.max_message_len,
                        _ => true,
                    }
            }
            ToOwner::Snapshot { viewer, targets } => {
                ok(viewer) && targets.len() <= MAX_SNAPSHOT_TARGETS && targets.iter().all(|t| ok(t))
            }
            ToOwner::Views { targets, .. } => {
                targets.len() <= MAX_SNAPSHOT_TARGETS && targets.iter().all(|t| ok(t))
            }
            ToOwner::Route { user } => ok(user),
        }
    }

    /// Status messages of an owner's answer within the limit.
    fn messages_fit(&self, presences: &[proto::Presence]) -> bool {
        presences.iter().all(|p| {
            p.message
                .as_ref()
                .is_none_or(|m| m.len() <= self.owner_config.max_message_len)
        })
    }

    /// A view from an owner (remote, or this node's own in process) for the
    /// local sessions that watch `user`.
    fn apply_view(&mut self, at: Millis, user: &str, own: bool, presence: Presence) -> bool {
        let Some(id) = self.names.get(user) else {
            return false; // nobody here watches
        };
        self.fanout.apply(at, UserId(id), own, presence)
    }

    // ---- the owner ----

    fn owner_request(&mut self, shard: u32, msg: ToOwner, reply: u64, now: Instant, at: Millis) {
        if self.acting_epoch(shard, now).is_none() || !self.owners.contains_key(&shard) {
            self.outputs.push_back(ClusterOutput::Reply {
                reply,
                payload: encode(&FromOwner::NotOwner),
            });
            return;
        }
        // Whether each target gets its truth: the viewer's own, or all.
        let (viewer, all_own, targets) = match msg {
            ToOwner::Snapshot { viewer, targets } => (Some(viewer), false, targets),
            ToOwner::Views { targets, own } => (None, own, targets),
            ToOwner::Route { user } => {
                if self.shard(&user) != shard {
                    self.counters.malformed += 1;
                    return;
                }
                let entries = self.owners.get(&shard).map(|o| route_of(o, &user));
                self.outputs.push_back(ClusterOutput::Reply {
                    reply,
                    payload: encode(&FromOwner::Route(entries.unwrap_or_default())),
                });
                return;
            }
            device => {
                self.counters.owner_inputs += 1;
                return self.owner_input(shard, device, ReplyTo::Remote(reply), now, at);
            }
        };
        if targets.iter().any(|t| self.shard(t) != shard) {
            self.counters.malformed += 1;
            return;
        }
        if !self.load_users(shard, targets.iter().map(String::as_str), now) {
            self.outputs.push_back(ClusterOutput::Reply {
                reply,
                payload: encode(&FromOwner::Loading),
            });
            return;
        }
        let mut presences = Vec::with_capacity(targets.len());
        let base = self.unix_base_ms;
        for t in &targets {
            let Some(o) = self.owners.get_mut(&shard) else {
                return;
            };
            let Some(uid) = o.users.intern(t) else {
                // At the cap: no answer, the edge times out.
                return;
            };
            match o
                .core
                .handle_snapshot(at, UserId(uid), all_own || viewer.as_ref() == Some(t))
            {
                Ok(p) => presences.push(proto::Presence::from_core(&p, base)),
                Err(_) => return,
            }
            if !o.core.is_online(UserId(uid)) {
                note_idle(o, UserId(uid), at);
            }
        }
        self.drain_owner(shard, now, at);
        let (epoch, seq) = self.published_up_to(shard);
        self.outputs.push_back(ClusterOutput::Reply {
            reply,
            payload: encode(&FromOwner::Snapshot {
                presences,
                epoch,
                seq,
            }),
        });
    }

    fn reply(&mut self, to: ReplyTo, answer: FromOwner, now: Instant, at: Millis) {
        match to {
            ReplyTo::Remote(reply) => self.outputs.push_back(ClusterOutput::Reply {
                reply,
                payload: encode(&answer),
            }),
            ReplyTo::Local(session, rid) => self.device_answer(session, rid, Some(answer), now, at),
        }
    }

    /// A device input at the owner of `shard`.
    fn owner_input(&mut self, shard: u32, msg: ToOwner, reply: ReplyTo, now: Instant, at: Millis) {
        let ToOwner::Device {
            edge,
            incarnation,
            rid,
            conn,
            user,
            device,
            op,
        } = msg
        else {
            return;
        };
        if self.shard(&user) != shard {
            self.counters.malformed += 1;
            return;
        }
        if !self.saw_incarnation(&edge, incarnation) {
            // Sent by a run of the edge that is gone (a `kill -9` just
            // after it sent): applied, it would connect a device nobody
            // holds, a ghost until the next owner change.
            self.counters.stale_incarnation += 1;
            return;
        }
        let from_unix = |unix: u64| Millis(unix.saturating_sub(self.unix_base_ms)).min(at);
        let loads = self.pending_loads.len();
        // `max_users` is the node's, over all the shards it owns: a user
        // new to every owner core here is refused at it.
        let node_users: usize = self.owners.values().map(|o| o.users.len()).sum();
        let Some(o) = self.owners.get_mut(&shard) else {
            return self.reply(reply, FromOwner::NotOwner, now, at);
        };
        let connects = matches!(op, WireOp::Connect { .. });
        if connects && node_users >= self.owner_config.max_users && o.users.get(&user).is_none() {
            let full = WireError::new(ErrorCode::TooManyUsers, "this node holds too many users");
            return self.reply(reply, FromOwner::Refused(full), now, at);
        }
        let epoch = o.epoch;
        if !o.loaded.contains(&user) {
            // The user's KV record first: a new owner keeps their choices,
            // and a user last published online whose device it never hears
            // of goes offline once the resync window closed (no ghost).
            let msg = ToOwner::Device {
                edge,
                incarnation,
                rid,
                conn,
                user: user.clone(),
                device,
                op,
            };
            if let Some(queue) = o.loading.get_mut(&user) {
                if queue.len() < MAX_QUEUED_OPS * 4 {
                    queue.push((msg, reply));
                }
                return;
            }
            if loads >= MAX_PENDING_PREFS {
                return self.reply(reply, FromOwner::NotOwner, now, at);
            }
            o.loading.insert(user.clone(), vec![(msg, reply)]);
            self.next_id += 1;
            let id = self.next_id;
            self.pending_loads
                .insert(id, (shard, epoch, user.clone(), now));
            self.outputs.push_back(ClusterOutput::LoadUser { id, user });
            return;
        }
        let holder = (edge, incarnation, conn);
        if o.last_rid.get(&holder).is_some_and(|&r| rid <= r) {
            return self.reply(reply, FromOwner::Done { epoch }, now, at);
        }
        let session = o.by_holder.get(&holder).copied();
        let live = |o: &Owner, s: SessionId| o.core.session_info(s).is_some_and(|i| i.online);
        let mut prefs = false;
        let answer = match op {
            WireOp::Connect {
                kind,
                session: wire,
                since,
            } => {
                if session.is_some_and(|s| live(o, s)) {
                    FromOwner::Done { epoch }
                } else if welcomed_later(o, &user, &device, &holder, since) {
                    // A session this edge run welcomed after this one holds
                    // the device: this one was given up by its client and
                    // must not take the device over (its end would show
                    // the device offline while it is connected).
                    self.counters.stale_connects += 1;
                    FromOwner::Done { epoch }
                } else {
                    let named = (holder.clone(), wire, since);
                    match owner_connect(o, at, &user, &device, kind.into(), named) {
                        Ok(uid) => {
                            o.dirty_since.get_or_insert(at);
                            if holder.0 != self.settings.node {
                                o.greet.push((uid, holder.0.clone()));
                            }
                            FromOwner::Done { epoch }
                        }
                        Err(e) => FromOwner::Refused(e),
                    }
                }
            }
            WireOp::Disconnect { last_heard } => {
                if let Some(s) = session {
                    let _ = o.core.handle_disconnect(at, s, from_unix(last_heard));
                }
                FromOwner::Done { epoch }
            }
            WireOp::Logout => {
                if let Some(s) = session {
                    let _ = o.core.handle_logout(at, s);
                }
                FromOwner::Done { epoch }
            }
            WireOp::SetStatus { status, message } => match session.filter(|&s| live(o, s)) {
                None => FromOwner::Unknown,
                Some(s) => match o
                    .core
                    .handle_set_status(at, s, status.into(), message.as_deref())
                {
                    Ok(()) => {
                        prefs = true;
                        FromOwner::Done { epoch }
                    }
                    Err(e) => FromOwner::Refused(e.into()),
                },
            },
            WireOp::SetInvisible(invisible) => match session.filter(|&s| live(o, s)) {
                None => FromOwner::Unknown,
                Some(s) => match o.core.handle_set_invisible(at, s, invisible) {
                    Ok(()) => {
                        prefs = true;
                        FromOwner::Done { epoch }
                    }
                    Err(e) => FromOwner::Refused(e.into()),
                },
            },
            WireOp::SetForeground(foreground) => match session.filter(|&s| live(o, s)) {
                None => FromOwner::Unknown,
                Some(s) => match o.core.handle_set_foreground(at, s, foreground) {
                    Ok(()) => {
                        // Last seen may move: written behind, like a connect.
                        o.dirty_since.get_or_insert(at);
                        FromOwner::Done { epoch }
                    }
                    Err(e) => FromOwner::Refused(e.into()),
                },
            },
        };
        let key_rid = holder.clone();
        if prefs {
            // Preferences are in the KV before the ack (C4).
            let uid = o.users.get(&user).map(UserId);
            let saved = uid.map(|u| o.core.saved(u)).unwrap_or_default();
            let value = encode(&WirePrefs {
                status: saved.status.into(),
                message: saved.message.as_deref().map(str::to_owned),
                invisible: saved.invisible,
                last_seen: saved.last_seen.map(|m| self.to_unix(m)),
            });
            if self.pending_prefs.len() < MAX_PENDING_PREFS {
                let id = self.id();
                self.pending_prefs.insert(
                    id,
                    PendingPrefs {
                        reply,
                        since: now,
                        shard,
                        epoch,
                        holder: key_rid,
                        rid,
                    },
                );
                self.outputs.push_back(ClusterOutput::PutPrefs {
                    id,
                    user,
                    epoch,
                    value,
                });
            }
            self.drain_owner(shard, now, at);
            return;
        }
        if matches!(answer, FromOwner::Done { .. }) {
            if let Some(o) = self.owners.get_mut(&shard) {
                remember_rid(&mut o.last_rid, key_rid, rid);
            }
        }
        self.drain_owner(shard, now, at);
        self.reply(reply, answer, now, at);
    }

    /// Publishes what the owner's core published, and forgets ended sessions.
    fn drain_owner(&mut self, shard: u32, now: Instant, at: Millis) {
        let base = self.unix_base_ms;
        let Some(o) = self.owners.get_mut(&shard) else {
            return;
        };
        let mut ended = Vec::new();
        while let Some(out) = o.core.poll_output() {
            if let Output::SessionEnded { session, reason } = out {
                ended.push((session, reason));
            }
        }
        if !ended.is_empty() {
            o.dirty_since.get_or_insert(at);
        }
        for (session, reason) in ended {
            if let Some((holder, did, _, uid, _)) = o.sessions.remove(&session) {
                // The device is gone (not connected again): a resume naming
                // its session anywhere starts fresh.
                let names = (o.users.name(uid.0), o.devices.name(did));
                if let (false, (Some(user), Some(device))) =
                    (reason == EndReason::Superseded, names)
                {
                    self.outputs.push_back(ClusterOutput::DeleteSession {
                        user: user.to_string(),
                        device: device.to_string(),
                    });
                }
                o.by_holder.remove(&holder);
                forget_device(&mut o.devices, did);
            }
        }
        // (user, own, presence, only to the greeted edges)
        let mut views = Vec::new();
        while let Some(p) = o.core.poll_published() {
            if p.own && !p.presence.online {
                note_idle(o, p.user, at);
            }
            views.push((p.user, p.own, p.presence, false));
        }
        // A greeted edge not sent a truth below gets the current one.
        let mut greet = std::mem::take(&mut o.greet);
        for &(user, _) in &greet {
            let already = views.iter().any(|(u, own, ..)| *u == user && *own);
            if !already {
                views.push((user, true, o.core.truth(user), true));
            }
        }
        let me = self.settings.node.as_str();
        let mut out = Vec::new();
        let mut local = Vec::new();
        for (user, own, presence, greet_only) in views {
            let Some(name) = o.users.name(user.0) else {
                continue;
            };
            if !own {
                o.seq += 1;
            }
            let v = ShardView {
                epoch: o.epoch,
                seq: if own { 0 } else { o.seq },
                published_ms: base.saturating_add(at.0),
                user: name.to_string(),
                own,
                presence: proto::Presence::from_core(&presence, base),
            };
            let payload = encode(&v);
            if own {
                // Only the user's own sessions see the truth: it goes to
                // the edges holding the user's devices, not to every
                // watcher of the shard, numbered per edge so that an edge
                // notices one it missed.
                let holding = if greet_only {
                    Vec::new()
                } else {
                    o.core.sessions_of(user)
                };
                let mut edges: Vec<&str> = holding
                    .iter()
                    .filter_map(|s| o.sessions.get(s))
                    .map(|(h, ..)| h.0.as_str())
                    .chain(greet.iter().filter(|g| g.0 == user).map(|g| g.1.as_str()))
                    .filter(|e| *e != me)
                    .collect();
                edges.sort_unstable();
                edges.dedup();
                for node in edges {
                    let n = o.truth_seq.entry(node.to_owned()).or_insert((0, now));
                    *n = (n.0 + 1, now);
                    let numbered = ShardView {
                        seq: n.0,
                        ..v.clone()
                    };
                    out.push(ClusterOutput::PublishToEdge {
                        node: node.to_owned(),
                        payload: encode(&numbered),
                    });
                }
            } else {
                // Written behind, for the next owner to restore.
                out.push(ClusterOutput::PutView {
                    user: v.user.clone(),
                    value: encode(&v.presence),
                });
                out.push(ClusterOutput::Publish { shard, payload });
            }
            local.push(v);
        }
        greet.clear();
        o.greet = greet;
        for output in out {
            match output {
                ClusterOutput::Publish { .. } => self.counters.published += 1,
                ClusterOutput::PublishToEdge { .. } => self.counters.truths_sent += 1,
                _ => {}
            }
            self.outputs.push_back(output);
        }
        // This node's own sessions, in process (the copy NATS brings back
        // on the shard's subject is dropped by version).
        for v in local {
            self.apply_view(at, &v.user, v.own, v.presence.to_core());
        }
    }
}

/// A user's preferences as the owner writes them to the KV.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePrefs {
    pub status: proto::Status,
    pub message: Option<String>,
    pub invisible: bool,
    /// Unix milliseconds.
    pub last_seen: Option<u64>,
}

fn remember_rid(last: &mut HashMap<Holder, u64>, key: Holder, rid: u64) {
    if last.len() >= MAX_HOLDERS_REMEMBERED && !last.contains_key(&key) {
        // Bounded memory over a perfect filter: after this, a request that
        // was in flight for a long-gone connection could be applied late.
        last.clear();
    }
    let r = last.entry(key).or_insert(0);
    *r = (*r).max(rid);
}

fn owner_connect(
    o: &mut Owner,
    at: Millis,
    user: &str,
    device: &str,
    kind: DeviceKind,
    (holder, wire, since): (Holder, u64, u64),
) -> Result<UserId, WireError> {
    let too_many = || WireError::new(ErrorCode::TooManyUsers, "the owner holds too many users");
    let uid = o.users.intern(user).ok_or_else(too_many)?;
    let Some(did) = o.devices.intern(device) else {
        forget_user_if_unknown(o, uid);
        return Err(too_many());
    };
    // A device connecting again (here or at another edge) supersedes its
    // older session; a Lingering one is taken over unseen.
    let connect = Connect {
        user: UserId(uid),
        device: DeviceId(did),
        kind,
        watch: Watch::All,
        resume: None,
        foreground: true,
    };
    let connected = match o.core.handle_connect(at, connect) {
        Ok(c) => c,
        Err(e) => {
            // Nothing refers to names interned for a refused connect.
            if o.devices.refs(did) == 0 {
                o.devices.remove(did);
            }
            forget_user_if_unknown(o, uid);
            return Err(e.into());
        }
    };
    if let Some(old) = o.by_holder.insert(holder.clone(), connected.session) {
        if let Some((_, did, ..)) = o.sessions.remove(&old) {
            forget_device(&mut o.devices, did);
        }
    }
    o.devices.acquire(did);
    o.sessions
        .insert(connected.session, (holder, did, wire, UserId(uid), since));
    Ok(UserId(uid))
}

/// Whether `device` of `user` is online under a session that the same edge
/// run as `holder` welcomed after `since`.
fn welcomed_later(o: &Owner, user: &str, device: &str, holder: &Holder, since: u64) -> bool {
    let (Some(uid), Some(did)) = (o.users.get(user), o.devices.get(device)) else {
        return false;
    };
    o.core.sessions_of(UserId(uid)).into_iter().any(|s| {
        let online = o
            .core
            .session_info(s)
            .is_some_and(|i| i.online && i.device == DeviceId(did));
        online
            && o.sessions.get(&s).is_some_and(|(h, _, _, _, later)| {
                h.0 == holder.0 && h.1 == holder.1 && *later > since
            })
    })
}

fn owner_late() -> WireError {
    WireError::new(
        ErrorCode::Internal,
        "the owner of this user did not answer in time",
    )
}

/// The user's Online devices at this owner, with the edges' session ids.
fn route_of(o: &Owner, user: &str) -> Vec<proto::RouteEntry> {
    let Some(uid) = o.users.get(user) else {
        return Vec::new();
    };
    o.core
        .route(UserId(uid))
        .into_iter()
        .filter_map(|s| {
            let info = o.core.session_info(s)?;
            let (_, did, wire, ..) = o.sessions.get(&s)?;
            Some(proto::RouteEntry {
                device: o.devices.name(*did)?.to_string(),
                kind: info.kind.into(),
                session: *wire,
            })
        })
        .collect()
}

fn note_idle(o: &mut Owner, user: UserId, at: Millis) {
    if o.idle.len() < MAX_IDLE_USERS {
        o.idle.push_back((at.plus(RELEASE_AFTER), user));
    }
}

/// Frees the users whose wait is over and who still hold nothing but what
/// the KV keeps; how many.
fn release_idle(o: &mut Owner, at: Millis) -> usize {
    let mut freed = 0;
    while let Some(&(due, user)) = o.idle.front() {
        if due > at {
            break;
        }
        o.idle.pop_front();
        let Some(name) = o.users.name(user.0).cloned() else {
            continue; // freed already (an id is never reused)
        };
        if o.loading.contains_key(&*name) || o.recorded.contains_key(&*name) {
            continue;
        }
        if o.core.is_known(user) && !o.core.release_saved(user) {
            continue; // back online, or a publish pending
        }
        o.loaded.remove(&*name);
        o.users.remove(user.0);
        freed += 1;
    }
    freed
}

/// A name interned for a user the core has no record of goes again.
fn forget_user_if_unknown(o: &mut Owner, uid: u64) {
    if !o.core.is_known(UserId(uid)) {
        o.users.remove(uid);
    }
}

/// A session of device name `did` is gone: the name goes with its last.
fn forget_device(devices: &mut Interner, did: u64) {
    if devices.drop_ref(did) == 0 {
        devices.remove(did);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHARDS: u32 = 4;

    /// Shard by name length: "alice" is shard 1, "bob" shard 3.
    fn by_len(user: &str, shards: u32) -> u32 {
        user.len() as u32 % shards
    }

    fn link(node: &str) -> ClusterLink {
        link_as(node, 7)
    }

    fn link_as(node: &str, incarnation: u64) -> ClusterLink {
        let settings = ClusterSettings {
            node: node.into(),
            incarnation,
            shard_count: SHARDS,
            shard_of: by_len,
            request_timeout: Duration::from_secs(5),
        };
        ClusterLink::new(settings, &Config::default(), 0, 128)
    }

    fn all_shards(epoch: u64, until: Instant) -> BTreeMap<u32, (u64, Instant)> {
        (0..SHARDS).map(|s| (s, (epoch, until))).collect()
    }

    /// Carries every output of the edge `a` to the owner `b` and back, as
    /// NATS would, until both are quiet. Returns the views published.
    fn exchange(a: &mut ClusterLink, b: &mut ClusterLink, now: Instant, at: Millis) -> usize {
        exchange_seen(a, b, now, at)
            .iter()
            .filter(|o| matches!(o, ClusterOutput::Publish { .. }))
            .count()
    }

    /// [`exchange`], returning what `b` published and sent to edges.
    fn exchange_seen(
        a: &mut ClusterLink,
        b: &mut ClusterLink,
        now: Instant,
        at: Millis,
    ) -> Vec<ClusterOutput> {
        exchange_kv(a, b, now, at, None)
    }

    /// [`exchange_seen`], with `views` as the KV's views bucket (without,
    /// every user reads as never seen).
    fn exchange_kv(
        a: &mut ClusterLink,
        b: &mut ClusterLink,
        now: Instant,
        at: Millis,
        views: Option<&mut HashMap<String, Bytes>>,
    ) -> Vec<ClusterOutput> {
        exchange_lossy(a, b, now, at, views, |_| false)
    }

    /// [`exchange_kv`], losing what `b` sends that `lose` picks.
    fn exchange_lossy(
        a: &mut ClusterLink,
        b: &mut ClusterLink,
        now: Instant,
        at: Millis,
        mut views: Option<&mut HashMap<String, Bytes>>,
        lose: fn(&ClusterOutput) -> bool,
    ) -> Vec<ClusterOutput> {
        let mut published = Vec::new();
        loop {
            let mut moved = false;
            while let Some(out) = a.poll_output() {
                moved = true;
                match out {
                    ClusterOutput::Request {
                        id,
                        shard,
                        kind,
                        payload,
                    } => {
                        let request = ClusterInput::Request {
                            shard,
                            kind,
                            payload,
                            reply: id,
                        };
                        b.handle_input(now, at, request);
                    }
                    ClusterOutput::PutSession { id, value, .. } if holding() => {
                        let record = decode(&value).unwrap();
                        HELD.with(|h| h.borrow_mut().as_mut().map(|h| h.push((id, record))));
                    }
                    ClusterOutput::PutSession {
                        id,
                        user,
                        device,
                        value,
                    } => {
                        LANDED.with(|l| l.borrow_mut().insert((user, device), value));
                        let stored = ClusterInput::SessionStored { id, ok: true };
                        a.handle_input(now, at, stored);
                    }
                    _ => {}
                }
            }
            while let Some(out) = b.poll_output() {
                moved = true;
                if lose(&out) {
                    continue;
                }
                match out {
                    ClusterOutput::Beacon { payload } => {
                        a.handle_input(now, at, ClusterInput::Beacon { payload })
                    }
                    ClusterOutput::Reply { reply, payload } => a.handle_input(
                        now,
                        at,
                        ClusterInput::Answered {
                            id: reply,
                            payload: Some(payload),
                        },
                    ),
                    ClusterOutput::PutPrefs { id, .. } => {
                        b.handle_input(now, at, ClusterInput::PrefsStored { id, ok: true })
                    }
                    ClusterOutput::LoadUser { id, user } => {
                        let view = views.as_deref().and_then(|v| v.get(&user).cloned());
                        let loaded = ClusterInput::UserLoaded {
                            id,
                            prefs: None,
                            view,
                        };
                        b.handle_input(now, at, loaded)
                    }
                    ClusterOutput::PutView { user, value } => {
                        if let Some(v) = views.as_deref_mut() {
                            v.insert(user, value);
                        }
                    }
                    ClusterOutput::DeleteSession { user, device } => {
                        LANDED.with(|l| l.borrow_mut().remove(&(user, device)));
                    }
                    ClusterOutput::Publish { shard, ref payload } => {
                        let payload = payload.clone();
                        published.push(out);
                        a.handle_input(now, at, ClusterInput::ShardMessage { shard, payload });
                    }
                    ClusterOutput::PublishToEdge {
                        ref node,
                        ref payload,
                    } => {
                        let to_a = *node == a.settings.node;
                        let payload = payload.clone();
                        published.push(out);
                        if to_a {
                            a.handle_input(now, at, ClusterInput::EdgeMessage { payload });
                        }
                    }
                    _ => {}
                }
            }
            if !moved {
                return published;
            }
        }
    }

    thread_local! {
        /// The session records the exchanges landed, by (user, device).
        static LANDED: std::cell::RefCell<HashMap<(String, String), Bytes>> =
            std::cell::RefCell::default();
    }

    thread_local! {
        /// While set, the exchanges hold `a`'s record puts here unanswered.
        static HELD: std::cell::RefCell<Option<Vec<(u64, SessionRecord)>>> =
            const { std::cell::RefCell::new(None) };
    }

    fn holding() -> bool {
        HELD.with(|h| h.borrow().is_some())
    }

    fn landed(user: &str, device: &str) -> Option<Bytes> {
        LANDED.with(|l| l.borrow().get(&(user.into(), device.into())).cloned())
    }

    /// Lands every session record `l` puts (as the KV would); returns them
    /// by (user, device), and the other outputs.
    fn store_records(
        l: &mut ClusterLink,
        now: Instant,
        at: Millis,
    ) -> (Vec<(String, String, SessionRecord)>, Vec<ClusterOutput>) {
        let (mut records, mut others) = (Vec::new(), Vec::new());
        while let Some(out) = l.poll_output() {
            match out {
                ClusterOutput::PutSession {
                    id,
                    user,
                    device,
                    value,
                } => {
                    records.push((user, device, decode(&value).unwrap()));
                    let stored = ClusterInput::SessionStored { id, ok: true };
                    l.handle_input(now, at, stored);
                }
                out => others.push(out),
            }
        }
        (records, others)
    }

    fn pushes(a: &mut ClusterLink) -> Vec<(SessionId, Presence)> {
        let mut out = Vec::new();
        while let Some(o) = a.poll_fanout() {
            if let Output::Push { to, presence, .. } = o {
                out.push((to, presence));
            }
        }
        out
    }

    /// Edge `a` and `b`, the owner of every shard, with no devices yet.
    fn edge_and_owner() -> (ClusterLink, ClusterLink, Instant) {
        let now = Instant::now();
        let (a, mut b) = (link("a"), link("b"));
        b.set_status(
            now,
            Millis(0),
            all_shards(1, now + Duration::from_secs(3600)),
        );
        (a, b, now)
    }

    /// The requests the edge `a` sends, as the owner takes them.
    fn requests_of(a: &mut ClusterLink) -> Vec<ClusterInput> {
        std::iter::from_fn(|| a.poll_output())
            .filter_map(|out| match out {
                ClusterOutput::Request {
                    id,
                    shard,
                    kind,
                    payload,
                } => Some(ClusterInput::Request {
                    shard,
                    kind,
                    payload,
                    reply: id,
                }),
                _ => None,
            })
            .collect()
    }

    /// Edge `a` holds alice's phone and bob's session; `b` owns every shard.
    fn two_nodes() -> (ClusterLink, ClusterLink, Instant) {
        let (mut a, mut b, now) = edge_and_owner();
        let (alice, bob) = (SessionId(1), SessionId(2));
        a.connected(
            now,
            Millis(0),
            alice,
            1001,
            "alice",
            "phone",
            proto::Kind::Mobile,
            None,
        );
        a.connected(
            now,
            Millis(0),
            bob,
            1002,
            "bob",
            "laptop",
            proto::Kind::Desktop,
            None,
        );
        exchange(&mut a, &mut b, now, Millis(0));
        (a, b, now)
    }

    #[test]
    fn an_epoch_that_would_wrap_versions_is_not_acted_for() {
        let now = Instant::now();
        let until = now + Duration::from_secs(3600);
        let won = |epoch: u64| {
            let mut b = link("b");
            b.set_status(now, Millis(0), [(1, (epoch, until))].into());
            std::iter::from_fn(|| b.poll_output())
                .filter(|o| {
                    matches!(
                        o,
                        ClusterOutput::Resync { .. } | ClusterOutput::LoadShard { .. }
                    )
                })
                .count()
        };
        // The last epoch that fits: a new owner loads and asks for a resync.
        assert_eq!(won(MAX_EPOCH), 2);
        assert_eq!(epoch_base_of(MAX_EPOCH as u32) >> 40, MAX_EPOCH);
        // One more would wrap every version to below the first owner's.
        assert_eq!(epoch_base_of((MAX_EPOCH + 1) as u32), 0);
        assert_eq!(won(MAX_EPOCH + 1), 0);
        assert_eq!(won(u64::from(u32::MAX) + 1), 0);
    }

    #[test]
    fn a_device_on_one_node_is_seen_by_a_watcher_through_its_owner() {
        let (mut a, mut b, now) = two_nodes();
        let bob = SessionId(2);
        let answer = bob_subscribes_to_alice(&mut a, now, Millis(1), 100);
        assert!(answer.is_none(), "the snapshot is the owner's");
        let out = a.poll_output();
        assert_eq!(
            out,
            Some(ClusterOutput::Watch { shard: 1 }),
            "watched before asking"
        );
        exchange(&mut a, &mut b, now, Millis(1));
        let Some((100, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
            a.poll_finished()
        else {
            panic!("no subscribe answer");
        };
        assert!(!snapshots[0].presence.online, "within the debounce");
        // The owner publishes after the debounce; the edge pushes to bob.
        b.handle_timeout(now, Millis(300));
        assert!(exchange(&mut a, &mut b, now, Millis(300)) >= 1);
        let seen = pushes(&mut a);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].0, bob);
        assert!(seen[0].1.online);
        assert!(seen[0].1.version >= epoch_base_of(1));

        // A status change is answered once the owner stored it.
        let alice = SessionId(1);
        let op = WireOp::SetStatus {
            status: proto::Status::Busy,
            message: Some("out".into()),
        };
        assert!(a.input(now, Millis(400), alice, op, Some(200)));
        let prefs = {
            let mut found = false;
            exchange_until_prefs(&mut a, &mut b, now, Millis(400), &mut found);
            found
        };
        assert!(prefs, "preferences written before the ack");
        assert!(matches!(a.poll_finished(), Some((200, Finished::Done))));
        b.handle_timeout(now, Millis(700));
        exchange(&mut a, &mut b, now, Millis(700));
        let seen = pushes(&mut a);
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].1.status, greendot_core::Status::Busy);
    }

    /// alice's phone has two sessions at edge `a`: one its client gave up
    /// on (a connect timeout) and the one it kept, welcomed later. Their
    /// connects reach the owner in the wrong order (the first was held up).
    /// The given-up session must not take the device over: when it ends,
    /// alice stays online, since her kept session is connected.
    #[test]
    fn a_connect_given_up_on_arriving_late_does_not_take_the_device_over() {
        let (mut a, mut b, now) = edge_and_owner();
        let (given_up, kept) = (SessionId(1), SessionId(2));
        for (session, wire) in [(given_up, 1001), (kept, 1002)] {
            let kind = proto::Kind::Mobile;
            a.connected(now, Millis(0), session, wire, "alice", "phone", kind, None);
        }
        let mut requests = requests_of(&mut a);
        assert_eq!(requests.len(), 2, "one connect per session");
        requests.reverse();
        for request in requests {
            b.handle_input(now, Millis(1), request);
            exchange(&mut a, &mut b, now, Millis(1));
        }
        let ended = WireOp::Disconnect { last_heard: 0 };
        assert!(a.input(now, Millis(2), given_up, ended, None));
        exchange(&mut a, &mut b, now, Millis(2));
        // Far past grace and debounce.
        b.handle_timeout(now, Millis(600_000));
        exchange(&mut a, &mut b, now, Millis(600_000));
        let o = &b.owners[&1];
        let uid = UserId(o.users.get("alice").unwrap());
        let online = o
            .core
            .sessions_of(uid)
            .into_iter()
            .any(|s| o.core.session_info(s).is_some_and(|i| i.online));
        assert!(
            online,
            "alice shown offline while her kept session is connected"
        );
    }

    /// alice logs out while the owner of her shard is dead: nobody answers.
    /// The next owner restores her phone from the shard's device record and
    /// the edge's logout reaches it: she is offline within the new owner's
    /// resync window and the debounce, not after her grace.
    #[test]
    fn a_logout_during_an_owner_failover_reaches_the_next_owner() {
        let (mut a, mut b, now) = two_nodes();
        b.handle_timeout(now, Millis(600));
        exchange(&mut a, &mut b, now, Millis(600));
        let alice = SessionId(1);
        let record = vec![RecordedDevice {
            user: "alice".into(),
            device: "phone".into(),
            kind: proto::Kind::Mobile,
            edge: "a".into(),
            incarnation: 7,
            conn: a.devices[&alice].conn,
            heard: 600,
        }];
        drop(b); // the owner dies

        assert!(a.input(now, Millis(1_000), alice, WireOp::Logout, Some(100)));
        a.session_ended(alice);
        let unanswered: Vec<u64> = std::iter::from_fn(|| a.poll_output())
            .filter_map(|out| match out {
                ClusterOutput::Request { id, .. } => Some(id),
                _ => None,
            })
            .collect();
        assert_eq!(unanswered.len(), 1);
        for id in unanswered {
            a.handle_input(
                now,
                Millis(1_000),
                ClusterInput::Answered { id, payload: None },
            );
        }

        // The next owner claims the shard, restores the record, asks for a resync.
        let mut c = link("c");
        let t = |ms: u64| (now + Duration::from_millis(ms), Millis(ms));
        // After the logout's request timeout (5 s): it is still queued.
        let (claimed_at, at) = t(8_000);
        c.set_status(
            claimed_at,
            at,
            all_shards(2, now + Duration::from_secs(3600)),
        );
        while let Some(out) = c.poll_output() {
            match out {
                ClusterOutput::LoadShard { id, .. } => {
                    let loaded = ClusterInput::ShardLoaded {
                        id,
                        record: Some(encode(&record)),
                    };
                    c.handle_input(claimed_at, at, loaded);
                }
                ClusterOutput::Resync { payload } => {
                    a.handle_input(claimed_at, at, ClusterInput::Resync { payload })
                }
                _ => {}
            }
        }
        let mut offline_at = None;
        for ms in (8_000..60_000).step_by(100) {
            let (now, at) = t(ms);
            a.handle_timeout(now, at);
            c.handle_timeout(now, at);
            exchange(&mut a, &mut c, now, at);
            let o = &c.owners[&1];
            let uid = o.users.get("alice").map(UserId);
            let gone = uid.is_some_and(|u| o.core.is_known(u) && !o.core.is_online(u));
            if gone {
                offline_at = Some(ms);
                break;
            }
        }
        let offline_at = offline_at.expect("alice's session ended at the new owner");
        // Resync window (the request timeout, 5 s) and the debounce, far
        // below the mobile grace.
        assert!(
            offline_at <= 8_000 + 5_000 + 1_000,
            "ended at {offline_at} ms"
        );
        let answers: Vec<(u64, Finished)> = std::iter::from_fn(|| a.poll_finished()).collect();
        assert!(
            answers
                .iter()
                .any(|(w, f)| *w == 100 && matches!(f, Finished::Done)),
            "the client is told its logout lands: {answers:?} (ended at {offline_at} ms)"
        );
    }

    /// `max_users` bounds the users of all the shards a node owns, not of
    /// each shard's core.
    #[test]
    fn max_users_is_the_nodes_over_all_its_shards() {
        let now = Instant::now();
        let settings = |node: &str| ClusterSettings {
            node: node.into(),
            incarnation: 7,
            shard_count: SHARDS,
            shard_of: by_len,
            request_timeout: Duration::from_secs(5),
        };
        let config = Config {
            max_users: 2,
            ..Config::default()
        };
        let mut a = ClusterLink::new(settings("a"), &Config::default(), 0, 128);
        let mut b = ClusterLink::new(settings("b"), &config, 0, 128);
        b.set_status(
            now,
            Millis(0),
            all_shards(1, now + Duration::from_secs(3600)),
        );
        // One user per shard (shards by name length).
        for (i, user) in ["al", "bob", "carl"].into_iter().enumerate() {
            let session = SessionId(i as u64 + 1);
            a.connected(
                now,
                Millis(0),
                session,
                1000 + i as u64,
                user,
                "phone",
                proto::Kind::Mobile,
                None,
            );
            exchange(&mut a, &mut b, now, Millis(0));
        }
        let owned: usize = b.owners.values().map(|o| o.users.len()).sum();
        assert_eq!(owned, 2, "the third user is refused");
        let carl = b.owners.values().any(|o| o.users.get("carl").is_some());
        assert!(!carl);
    }

    /// C4: the owner's preference write is acknowledged by the KV after the
    /// shard moved to another owner. The edge must not be told `Done`: the
    /// new owner may show otherwise, so the edge asks again.
    #[test]
    fn a_preference_write_that_lands_after_the_shard_moved_is_not_acknowledged() {
        let (mut a, mut b, now) = two_nodes();
        let op = WireOp::SetStatus {
            status: proto::Status::Busy,
            message: None,
        };
        assert!(a.input(now, Millis(400), SessionId(1), op, Some(200)));
        for request in requests_of(&mut a) {
            b.handle_input(now, Millis(400), request);
        }
        let mut write = None;
        while let Some(out) = b.poll_output() {
            match out {
                ClusterOutput::LoadUser { id, .. } => {
                    let loaded = ClusterInput::UserLoaded {
                        id,
                        prefs: None,
                        view: None,
                    };
                    b.handle_input(now, Millis(400), loaded);
                }
                ClusterOutput::PutPrefs { id, epoch, .. } => write = Some((id, epoch)),
                ClusterOutput::Reply { payload, .. } => {
                    panic!(
                        "answered before the write: {:?}",
                        decode::<FromOwner>(&payload)
                    )
                }
                _ => {}
            }
        }
        let (id, epoch) = write.expect("the owner writes the preferences");
        // The shard moves to another owner (a new epoch) ...
        let moved = BTreeMap::from([(1, (epoch + 1, now + Duration::from_secs(10)))]);
        b.handle_input(now, Millis(401), ClusterInput::Status { shards: moved });
        // ... then the old write's acknowledgement arrives.
        b.handle_input(now, Millis(402), ClusterInput::PrefsStored { id, ok: true });
        let answers: Vec<FromOwner> = std::iter::from_fn(|| b.poll_output())
            .filter_map(|out| match out {
                ClusterOutput::Reply { payload, .. } => decode(&payload),
                _ => None,
            })
            .collect();
        assert_eq!(answers, vec![FromOwner::NotOwner]);
    }

    /// A logout behind a full queue (an owner that takes nothing) is still
    /// queued: it takes the place of changes a later one overwrites, whose
    /// requests are answered that they failed; the last status and the last
    /// invisibility change stay before it.
    #[test]
    fn an_ending_op_is_never_refused_behind_a_full_queue() {
        let (mut a, _owner, now) = two_nodes();
        let alice = SessionId(1);
        let status = || WireOp::SetStatus {
            status: proto::Status::Busy,
            message: None,
        };
        for i in 0..40u64 {
            let op = match i % 3 {
                0 => status(),
                1 => WireOp::SetInvisible(true),
                _ => WireOp::SetInvisible(false),
            };
            assert!(a.input(now, Millis(400), alice, op, Some(100 + i)));
        }
        let queued = &a.devices[&alice].queue;
        assert_eq!(queued.len(), MAX_QUEUED_OPS, "full");
        let last_invisible = queued
            .iter()
            .rev()
            .find_map(|q| match q.op {
                WireOp::SetInvisible(v) => Some((v, q.wait)),
                _ => None,
            })
            .unwrap();
        while a.poll_finished().is_some() {}

        assert!(a.input(now, Millis(401), alice, WireOp::Logout, Some(600)));
        let d = &a.devices[&alice];
        assert!(d.closed, "the device ends at its owner");
        let ops: Vec<&WireOp> = d.queue.iter().map(|q| &q.op).collect();
        assert_eq!(ops.last(), Some(&&WireOp::Logout), "{ops:?}");
        assert_eq!(ops.len(), 3, "{ops:?}");
        assert!(matches!(
            ops[..2],
            [WireOp::SetStatus { .. }, WireOp::SetInvisible(_)]
                | [WireOp::SetInvisible(_), WireOp::SetStatus { .. }]
        ));
        let kept = d
            .queue
            .iter()
            .find_map(|q| match q.op {
                WireOp::SetInvisible(v) => Some((v, q.wait)),
                _ => None,
            })
            .unwrap();
        assert_eq!(kept, last_invisible, "the latest invisibility stays");
        let mut failed = Vec::new();
        while let Some((wait, finished)) = a.poll_finished() {
            assert!(matches!(finished, Finished::Failed(_)), "{finished:?}");
            failed.push(wait);
        }
        assert!(!failed.contains(&600), "the logout is not refused");
        assert_eq!(failed.len(), MAX_QUEUED_OPS - 2);
    }

    /// What `outs` carry: (on a shard subject?, to which edge, own, user).
    fn carried(outs: &[ClusterOutput]) -> Vec<(Option<u32>, Option<String>, bool, String)> {
        outs.iter()
            .map(|o| match o {
                ClusterOutput::Publish { shard, payload } => {
                    let v: ShardView = decode(payload).unwrap();
                    (Some(*shard), None, v.own, v.user)
                }
                ClusterOutput::PublishToEdge { node, payload } => {
                    let v: ShardView = decode(payload).unwrap();
                    (None, Some(node.clone()), v.own, v.user)
                }
                other => panic!("not a view: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_truth_goes_only_to_the_edges_holding_the_users_devices() {
        // a holds alice's phone; b owns every shard; c and d watch.
        let (mut a, mut b, now) = two_nodes();
        b.handle_timeout(now, Millis(300));
        exchange(&mut a, &mut b, now, Millis(300));
        // alice's tablet connects at c: her truth does not change (a
        // second mobile), yet c is sent it: it may have changed while
        // the connect was on its way.
        let mut c = link("c");
        c.connected(
            now,
            Millis(400),
            SessionId(9),
            1009,
            "alice",
            "tablet",
            proto::Kind::Mobile,
            None,
        );
        let seen = carried(&exchange_seen(&mut c, &mut b, now, Millis(400)));
        assert_eq!(seen, vec![(None, Some("c".into()), true, "alice".into())]);
        // Her phone turns busy: the truth goes to a and c, nowhere else;
        // the view, after the debounce, once on her shard's subject.
        let op = WireOp::SetStatus {
            status: proto::Status::Busy,
            message: None,
        };
        let sent = b.counters().truths_sent;
        assert!(a.input(now, Millis(500), SessionId(1), op, Some(1)));
        let mut seen = carried(&exchange_seen(&mut a, &mut b, now, Millis(500)));
        seen.sort();
        assert_eq!(
            seen,
            vec![
                (None, Some("a".into()), true, "alice".into()),
                (None, Some("c".into()), true, "alice".into()),
            ]
        );
        b.handle_timeout(now, Millis(800));
        let seen = carried(&exchange_seen(&mut a, &mut b, now, Millis(800)));
        assert_eq!(seen, vec![(Some(1), None, false, "alice".into())]);
        assert_eq!(b.counters().truths_sent, sent + 2);
        // An edge takes a truth only from its own subject, never a view.
        let view = ShardView {
            epoch: 1,
            seq: 1,
            published_ms: 1,
            user: "alice".into(),
            own: false,
            presence: proto::Presence::default(),
        };
        let malformed = c.counters().malformed;
        c.handle_input(
            now,
            Millis(900),
            ClusterInput::EdgeMessage {
                payload: encode(&view),
            },
        );
        assert_eq!(c.counters().malformed, malformed + 1);
    }

    #[test]
    fn an_owner_frees_a_user_gone_a_while_and_reads_them_back_for_a_snapshot() {
        let (mut a, mut b, now) = two_nodes();
        let mut views = HashMap::new();
        b.handle_timeout(now, Millis(300));
        exchange_kv(&mut a, &mut b, now, Millis(300), Some(&mut views));
        // alice logs out (after the new owner's resync window); after the
        // debounce, watchers are shown her last seen.
        assert!(a.input(now, Millis(6_000), SessionId(1), WireOp::Logout, Some(1)));
        exchange_kv(&mut a, &mut b, now, Millis(6_000), Some(&mut views));
        assert!(matches!(a.poll_finished(), Some((1, Finished::Done))));
        b.handle_timeout(now, Millis(6_400));
        exchange_kv(&mut a, &mut b, now, Millis(6_400), Some(&mut views));
        let uid = UserId(b.owners[&1].users.get("alice").unwrap());
        let shown = b.owners[&1].core.presence(uid);
        assert!(
            !shown.online && shown.last_seen == Some(Millis(6_000)),
            "{shown:?}"
        );
        // Kept for RELEASE_AFTER, then freed: record and name.
        b.handle_timeout(now, Millis(6_000 + RELEASE_AFTER.0 - 1));
        assert_eq!(b.counters().users_released, 0);
        b.handle_timeout(now, Millis(6_000 + RELEASE_AFTER.0));
        assert_eq!(b.counters().users_released, 1);
        assert!(!b.owners[&1].core.is_known(uid));
        assert_eq!(b.owners[&1].users.get("alice"), None);
        assert_eq!(
            b.owners[&1].devices.get("phone"),
            None,
            "her device name too"
        );
        // bob subscribes to her: the owner reads her back before answering,
        // so he sees her last seen, not a user never seen.
        let at = Millis(70_000);
        let answer = bob_subscribes_to_alice(&mut a, now, at, 100);
        assert!(answer.is_none());
        exchange_kv(&mut a, &mut b, now, at, Some(&mut views));
        assert!(
            a.poll_finished().is_none(),
            "answered before her record was read"
        );
        let later = now + RETRY_AFTER + TICK;
        a.handle_timeout(later, at);
        exchange_kv(&mut a, &mut b, later, at, Some(&mut views));
        let Some((100, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
            a.poll_finished()
        else {
            panic!("no subscribe answer");
        };
        let seen = &snapshots[0].presence;
        assert!(!seen.online);
        assert_eq!(seen.last_seen, Some(6_000), "{seen:?}");
        assert!(
            seen.version >= shown.version,
            "versions went back: {seen:?}"
        );
    }

    #[test]
    fn the_first_tick_is_due_at_the_callers_now() {
        // An edge with a request out and no core timer: its first tick
        // must be due at once, by the clock its caller compares with.
        let (mut a, _b, now) = two_nodes();
        assert!(a.input(now, Millis(5), SessionId(1), WireOp::Logout, Some(3)));
        let later = now + Duration::from_millis(10);
        assert_eq!(a.poll_deadline(later), Some(later));
        a.handle_timeout(later, Millis(15));
        assert_eq!(a.poll_deadline(later), Some(later + TICK));
    }

    #[test]
    fn a_subscribe_at_the_owners_own_edge_waits_for_the_targets_record() {
        let (_a, mut b, now) = two_nodes();
        // dave on b, the owner of zed's shard, subscribes to zed (never seen).
        b.connected(
            now,
            Millis(10),
            SessionId(50),
            1050,
            "dave",
            "phone",
            proto::Kind::Mobile,
            None,
        );
        while b.poll_output().is_some() {}
        let answer = b.subscribe(
            now,
            Millis(20),
            7,
            SessionId(50),
            "dave",
            vec!["zed".into()],
            vec![],
            Tier::Realtime,
            false,
        );
        assert!(answer.is_none(), "answered before zed's record was read");
        let mut loads = Vec::new();
        while let Some(out) = b.poll_output() {
            if let ClusterOutput::LoadUser { id, user } = out {
                loads.push((id, user));
            }
        }
        assert_eq!(loads.len(), 1, "{loads:?}");
        let (id, user) = loads.pop().unwrap();
        assert_eq!(user, "zed");
        let seen = proto::Presence {
            version: 5,
            last_seen: Some(4_000),
            ..Default::default()
        };
        b.handle_input(
            now,
            Millis(30),
            ClusterInput::UserLoaded {
                id,
                prefs: None,
                view: Some(encode(&seen)),
            },
        );
        let later = now + RETRY_AFTER + TICK;
        b.handle_timeout(later, Millis(200));
        assert!(
            b.poll_finished().is_none(),
            "answered before its record landed"
        );
        store_records(&mut b, later, Millis(200));
        let Some((7, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
            b.poll_finished()
        else {
            panic!("no subscribe answer");
        };
        assert_eq!(snapshots[0].presence.last_seen, Some(4_000));
    }

    /// bob's laptop (session 2, on `a`) subscribes to alice in realtime.
    fn bob_subscribes_to_alice(
        a: &mut ClusterLink,
        now: Instant,
        at: Millis,
        wait: u64,
    ) -> Option<proto::Answer> {
        let targets = vec!["alice".into()];
        a.subscribe(
            now,
            at,
            wait,
            SessionId(2),
            "bob",
            targets,
            vec![],
            Tier::Realtime,
            false,
        )
    }

    fn epoch_base_of(epoch: u32) -> u64 {
        greendot_core::cluster::epoch_base(Epoch(epoch))
    }

    /// Like `exchange`, noting whether a `PutPrefs` went out.
    fn exchange_until_prefs(
        a: &mut ClusterLink,
        b: &mut ClusterLink,
        now: Instant,
        at: Millis,
        found: &mut bool,
    ) {
        while let Some(out) = a.poll_output() {
            if let ClusterOutput::Request {
                id,
                shard,
                kind,
                payload,
            } = out
            {
                b.handle_input(
                    now,
                    at,
                    ClusterInput::Request {
                        shard,
                        kind,
                        payload,
                        reply: id,
                    },
                );
            }
        }
        let mut replies = Vec::new();
        while let Some(out) = b.poll_output() {
            match out {
                ClusterOutput::PutPrefs { id, user, .. } => {
                    assert_eq!(user, "alice");
                    assert!(
                        replies.is_empty(),
                        "no answer before the preferences are stored"
                    );
                    *found = true;
                    b.handle_input(now, at, ClusterInput::PrefsStored { id, ok: true });
                }
                ClusterOutput::LoadUser { id, .. } => b.handle_input(
                    now,
                    at,
                    ClusterInput::UserLoaded {
                        id,
                        prefs: None,
                        view: None,
                    },
                ),
                other => replies.push(other),
            }
        }
        for out in replies {
            if let ClusterOutput::Reply { reply, payload } = out {
                a.handle_input(
                    now,
                    at,
                    ClusterInput::Answered {
                        id: reply,
                        payload: Some(payload),
                    },
                );
            }
        }
        exchange(a, b, now, at);
    }

    fn is_view(out: &ClusterOutput) -> bool {
        matches!(out, ClusterOutput::Publish { .. })
    }

    /// bob (on `a`) watches alice and carol, both of shard 1, whose owner
    /// `b` has published them online; alice then goes busy and that view
    /// is lost on the way to `a`.
    fn bob_misses_alices_busy() -> (ClusterLink, ClusterLink, Instant) {
        let (mut a, mut b, now) = two_nodes();
        a.connected(
            now,
            Millis(0),
            SessionId(3),
            1003,
            "carol",
            "phone",
            proto::Kind::Mobile,
            None,
        );
        exchange(&mut a, &mut b, now, Millis(0));
        let targets = vec!["alice".into(), "carol".into()];
        let kind = Tier::Realtime;
        let answer = a.subscribe(
            now,
            Millis(1),
            9,
            SessionId(2),
            "bob",
            targets,
            vec![],
            kind,
            false,
        );
        assert!(answer.is_none());
        exchange(&mut a, &mut b, now, Millis(1));
        assert!(matches!(a.poll_finished(), Some((9, Finished::Answer(_)))));
        b.handle_timeout(now, Millis(300));
        exchange(&mut a, &mut b, now, Millis(300));
        assert_eq!(pushes(&mut a).len(), 2, "alice and carol online");
        set_status(
            &mut a,
            &mut b,
            SessionId(1),
            proto::Status::Busy,
            now,
            400,
            is_view,
        );
        assert!(!busy_pushed_to_bob(&mut a), "the view was lost");
        (a, b, now)
    }

    /// The session's device sets `status` at `at` ms; the owner publishes
    /// what others see after its debounce (`lose` applies to all of it).
    fn set_status(
        a: &mut ClusterLink,
        b: &mut ClusterLink,
        session: SessionId,
        status: proto::Status,
        now: Instant,
        at: u64,
        lose: fn(&ClusterOutput) -> bool,
    ) {
        let op = WireOp::SetStatus {
            status,
            message: None,
        };
        assert!(a.input(now, Millis(at), session, op, None));
        exchange_lossy(a, b, now, Millis(at), None, lose);
        b.handle_timeout(now, Millis(at + 300));
        exchange_lossy(a, b, now, Millis(at + 300), None, lose);
    }

    fn busy_pushed_to_bob(a: &mut ClusterLink) -> bool {
        pushes(a)
            .iter()
            .any(|(to, p)| *to == SessionId(2) && p.status == greendot_core::Status::Busy)
    }

    #[test]
    fn a_lost_view_is_noticed_at_the_next_one_and_asked_for_again() {
        let (mut a, mut b, now) = bob_misses_alices_busy();
        // carol's next view comes with a number two past the last one seen.
        let away = proto::Status::Away;
        set_status(&mut a, &mut b, SessionId(3), away, now, 800, |_| false);
        assert_eq!(a.counters().view_gaps, 1);
        assert!(!busy_pushed_to_bob(&mut a));
        // a acts for no shard and has nothing else to do: the gap is work.
        assert!(a.poll_deadline(now).is_some());
        // The edge's next tick asks the owner for the shard's views again.
        let later = now + TICK;
        a.handle_timeout(later, Millis(1_150));
        exchange(&mut a, &mut b, later, Millis(1_150));
        assert!(busy_pushed_to_bob(&mut a), "bob still sees alice available");
        assert_eq!(a.counters().view_gaps, 1);
    }

    #[test]
    fn a_lost_last_view_is_noticed_by_the_owners_beacon() {
        let (mut a, mut b, now) = bob_misses_alices_busy();
        // Nothing else happens in the shard; the owner's next beacon
        // names a view the edge has not seen.
        let later = now + BEACON_EVERY;
        b.handle_timeout(later, Millis(1_300));
        exchange(&mut a, &mut b, later, Millis(1_300));
        assert_eq!(a.counters().view_gaps, 1);
        a.handle_timeout(later, Millis(1_300));
        exchange(&mut a, &mut b, later, Millis(1_300));
        assert!(busy_pushed_to_bob(&mut a), "bob still sees alice available");
        // Beacons that name nothing new change nothing.
        let again = later + BEACON_EVERY;
        b.handle_timeout(again, Millis(2_300));
        exchange(&mut a, &mut b, again, Millis(2_300));
        a.handle_timeout(again, Millis(2_300));
        assert_eq!(exchange(&mut a, &mut b, again, Millis(2_300)), 0);
        assert_eq!(a.counters().view_gaps, 1);
    }

    #[test]
    fn a_view_missed_while_a_repair_is_out_is_asked_for_after_it() {
        let (mut a, mut b, now) = bob_misses_alices_busy();
        let later = now + BEACON_EVERY;
        b.handle_timeout(later, Millis(1_300));
        exchange(&mut a, &mut b, later, Millis(1_300));
        a.handle_timeout(later, Millis(1_300));
        let requests = |a: &mut ClusterLink| {
            let mut out = Vec::new();
            while let Some(o) = a.poll_output() {
                if let ClusterOutput::Request {
                    id,
                    shard,
                    kind,
                    payload,
                } = o
                {
                    out.push(ClusterInput::Request {
                        shard,
                        kind,
                        payload,
                        reply: id,
                    });
                }
            }
            out
        };
        let repair = requests(&mut a);
        assert_eq!(repair.len(), 1, "the repair is out");
        // Meanwhile a beacon shows another view missed.
        let ahead = Beacon {
            owner: "b".into(),
            shards: vec![(1, 1, 99)],
            truths: Vec::new(),
        };
        let payload = encode(&ahead);
        a.handle_input(later, Millis(1_310), ClusterInput::Beacon { payload });
        a.handle_timeout(later + TICK, Millis(1_350));
        assert!(requests(&mut a).is_empty(), "one repair at a time");
        // The first repair is answered; the next tick asks again.
        for r in repair {
            b.handle_input(later, Millis(1_360), r);
        }
        exchange(&mut a, &mut b, later, Millis(1_360));
        a.handle_timeout(later + TICK * 2, Millis(1_400));
        assert_eq!(requests(&mut a).len(), 1, "the second gap is repaired");
    }

    #[test]
    fn a_new_owner_asks_again_for_a_lost_resync_and_an_edge_answers_once() {
        let (mut a, mut b, now) = two_nodes();
        let until = now + Duration::from_secs(3600);
        b.set_status(now, Millis(10), all_shards(2, until));
        let resyncs = |b: &mut ClusterLink| {
            let mut out = Vec::new();
            while let Some(o) = b.poll_output() {
                if let ClusterOutput::Resync { payload } = o {
                    let r: ResyncRequest = decode(&payload).unwrap();
                    if r.shard == 1 {
                        out.push(payload);
                    }
                }
            }
            out
        };
        assert_eq!(resyncs(&mut b).len(), 1, "lost on the way");
        b.handle_timeout(now + TICK, Millis(60));
        assert!(resyncs(&mut b).is_empty(), "not yet");
        let later = now + RESYNC_EVERY;
        b.handle_timeout(later, Millis(510));
        let again = resyncs(&mut b);
        assert_eq!(again.len(), 1, "asked again");
        let forwarded = a.counters().forwarded;
        for _ in 0..2 {
            let payload = again[0].clone();
            a.handle_input(later, Millis(510), ClusterInput::Resync { payload });
        }
        assert_eq!(a.counters().forwarded, forwarded + 1, "alice's phone, once");
        assert_eq!(a.counters().resyncs, 1);
        // Not past the window.
        let closed = now + Duration::from_secs(5);
        b.handle_timeout(closed, Millis(5_010));
        assert!(resyncs(&mut b).is_empty());
    }

    #[test]
    fn a_route_lists_the_devices_on_every_node() {
        let (mut a, mut b, now) = two_nodes();
        // b, the owner, is also an edge: alice's laptop connects there.
        b.connected(
            now,
            Millis(5),
            SessionId(7),
            1007,
            "alice",
            "laptop",
            proto::Kind::Desktop,
            None,
        );
        exchange(&mut a, &mut b, now, Millis(5));
        let entry = |device: &str, kind, session| proto::RouteEntry {
            device: device.into(),
            kind,
            session,
        };
        let both = vec![
            entry("laptop", proto::Kind::Desktop, 1007),
            entry("phone", proto::Kind::Mobile, 1001),
        ];
        let sorted = |mut r: Vec<proto::RouteEntry>| {
            r.sort_by(|x, y| x.device.cmp(&y.device));
            r
        };
        // At the owner's node: answered at once.
        let Some(proto::Answer::Route(route)) = b.route(now, 1, "alice") else {
            panic!("the owner answers at once");
        };
        assert_eq!(sorted(route), both);
        // Elsewhere: asked of the owner.
        assert!(a.route(now, 2, "alice").is_none());
        exchange(&mut a, &mut b, now, Millis(6));
        let Some((2, Finished::Answer(proto::Answer::Route(route)))) = a.poll_finished() else {
            panic!("no route answer");
        };
        assert_eq!(sorted(route), both);
        // An owner that does not answer: an error once the request times out.
        assert!(a.route(now, 3, "alice").is_none());
        while a.poll_output().is_some() {}
        let late = now + Duration::from_secs(6);
        a.handle_timeout(late, Millis(6_000));
        let Some((3, Finished::Failed(e))) = a.poll_finished() else {
            panic!("no failure");
        };
        assert_eq!(e.code, ErrorCode::Internal);
    }

    #[test]
    fn a_view_that_overtakes_the_snapshot_is_not_lost() {
        let (mut a, mut b, now) = two_nodes();
        let answer = bob_subscribes_to_alice(&mut a, now, Millis(1), 5);
        assert!(answer.is_none());
        // A newer view arrives on the shard's subject before the answer.
        let newer = proto::Presence {
            version: epoch_base_of(1) + 1_000,
            online: true,
            kinds: 1,
            ..Default::default()
        };
        let view = ShardView {
            epoch: 1,
            seq: 2,
            published_ms: 1,
            user: "alice".into(),
            own: false,
            presence: newer.clone(),
        };
        a.handle_input(
            now,
            Millis(1),
            ClusterInput::ShardMessage {
                shard: 1,
                payload: encode(&view),
            },
        );
        exchange(&mut a, &mut b, now, Millis(1));
        let Some((5, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
            a.poll_finished()
        else {
            panic!("no subscribe answer");
        };
        assert_eq!(snapshots[0].presence, newer, "the older snapshot won");
    }

    #[test]
    fn a_new_owner_that_never_heard_of_the_device_gets_it_connected_again() {
        let (mut a, mut b, now) = two_nodes();
        // b wins every shard again under a new epoch: a fresh core.
        b.set_status(
            now,
            Millis(10),
            all_shards(2, now + Duration::from_secs(3600)),
        );
        assert!(a.input(
            now,
            Millis(10),
            SessionId(1),
            WireOp::SetInvisible(true),
            Some(9)
        ));
        exchange(&mut a, &mut b, now, Millis(10));
        assert!(matches!(a.poll_finished(), Some((9, Finished::Done))));
        assert!(a.counters().retries >= 1, "answered Unknown first");
        let o = &b.owners[&1];
        let alice = UserId(o.users.get("alice").unwrap());
        assert!(o.core.saved(alice).invisible);
        assert!(o.core.truth(alice).online, "her device was connected again");
    }

    #[test]
    fn a_late_request_is_not_applied_over_a_newer_one() {
        let (mut a, mut b, now) = two_nodes();
        let alice = SessionId(1);
        a.input(now, Millis(5), alice, WireOp::SetInvisible(true), Some(1));
        let Some(ClusterOutput::Request {
            shard,
            kind,
            payload,
            id,
        }) = a.poll_output()
        else {
            panic!("no request");
        };
        // Lost: the edge retries (a new request id), then turns visible.
        a.handle_input(now, Millis(5), ClusterInput::Answered { id, payload: None });
        a.handle_timeout(now + RETRY_AFTER, Millis(105));
        exchange(&mut a, &mut b, now, Millis(105));
        a.input(
            now,
            Millis(110),
            alice,
            WireOp::SetInvisible(false),
            Some(2),
        );
        exchange(&mut a, &mut b, now, Millis(110));
        // The first copy arrives at last.
        b.handle_input(
            now,
            Millis(120),
            ClusterInput::Request {
                shard,
                kind,
                payload,
                reply: 77,
            },
        );
        let o = &b.owners[&1];
        let uid = UserId(o.users.get("alice").unwrap());
        assert!(!o.core.saved(uid).invisible, "the late copy was applied");
        let reply = b.poll_output();
        assert!(
            matches!(&reply, Some(ClusterOutput::Reply { reply: 77, payload }) if decode::<FromOwner>(payload) == Some(FromOwner::Done { epoch: 1 })),
            "{reply:?}"
        );
    }

    /// Whether each of the owner's sessions held by `edge` is online, by
    /// the holder's incarnation.
    fn held_by(b: &ClusterLink, shard: u32, edge: &str) -> Vec<(u64, bool)> {
        let o = &b.owners[&shard];
        let mut held: Vec<(u64, bool)> = o
            .sessions
            .iter()
            .filter(|(_, (h, ..))| h.0 == edge)
            .map(|(s, (h, ..))| (h.1, o.core.session_info(*s).unwrap().online))
            .collect();
        held.sort();
        held
    }

    #[test]
    fn a_restarted_edge_loses_only_the_devices_of_its_older_incarnations() {
        // Edge a, incarnation 7, holds alice's phone (shard 1) and bob's
        // laptop (shard 3); b owns every shard.
        let (mut old_a, mut b, now) = two_nodes();
        // Just before its `kill -9`, the old process sent dave's connect;
        // it arrives after b learned of the restart (below).
        old_a.connected(
            now,
            Millis(90),
            SessionId(5),
            1005,
            "dave",
            "phone",
            proto::Kind::Mobile,
            None,
        );
        // a is killed and restarts as incarnation 9; before b learns of it
        // from the lease watch, the new process already forwards carol's
        // phone (shard 1 too).
        let mut a = link_as("a", 9);
        a.connected(
            now,
            Millis(100),
            SessionId(1),
            1001,
            "carol",
            "phone",
            proto::Kind::Mobile,
            None,
        );
        exchange(&mut a, &mut b, now, Millis(100));
        assert_eq!(held_by(&b, 1, "a"), vec![(7, true), (9, true)]);
        // The old incarnation's own lease (a watch made again, say) loses nothing.
        let restarted = |incarnation| ClusterInput::EdgeRestarted {
            node: "a".into(),
            incarnation,
            last_heard: 200,
        };
        b.handle_input(now, Millis(200), restarted(7));
        assert_eq!(b.counters().edge_lost_devices, 0);
        // The new lease: incarnation 7's devices are lost, carol's stays.
        b.handle_input(now, Millis(200), restarted(9));
        assert_eq!(
            b.counters().edge_lost_devices,
            2,
            "alice's phone, bob's laptop"
        );
        assert_eq!(held_by(&b, 1, "a"), vec![(7, false), (9, true)]);
        assert_eq!(held_by(&b, 3, "a"), vec![(7, false)]);
        // The dead run's late connect is dropped: no ghost of dave.
        exchange(&mut old_a, &mut b, now, Millis(210));
        assert_eq!(held_by(&b, 0, "a"), vec![], "dave connected by a dead run");
        assert_eq!(b.counters().stale_incarnation, 1);
        // Seen again (a renewal replayed): nothing more to lose.
        b.handle_input(now, Millis(250), restarted(9));
        assert_eq!(b.counters().edge_lost_devices, 2);
        // After grace and debounce alice is offline, carol still online.
        let grace = Config::default().kinds[proto::Kind::Mobile as usize].grace;
        let later = Millis(200 + grace.0 + Config::default().debounce.0 + 100);
        let later_instant = now + Duration::from_millis(later.0);
        b.handle_timeout(later_instant, later);
        let o = &b.owners[&1];
        assert!(!o.core.truth(UserId(o.users.get("alice").unwrap())).online);
        assert!(o.core.truth(UserId(o.users.get("carol").unwrap())).online);
    }

    #[test]
    fn a_request_the_io_never_answered_is_sent_again() {
        let (mut a, mut b, now) = two_nodes();
        assert!(a.input(now, Millis(5), SessionId(1), WireOp::Logout, Some(3)));
        let lost = a.poll_output();
        assert!(
            matches!(lost, Some(ClusterOutput::Request { .. })),
            "{lost:?}"
        );
        // Dropped on the way (a full queue): nothing comes back.
        let later = now + Duration::from_secs(5);
        a.handle_timeout(later, Millis(5_005));
        let later = later + RETRY_AFTER;
        a.handle_timeout(later, Millis(5_105));
        assert!(a.counters().retries >= 1);
        exchange(&mut a, &mut b, later, Millis(5_105));
        let answers: Vec<_> = std::iter::from_fn(|| a.poll_finished()).collect();
        // A logout is told, in time, that it will land (it stays queued).
        assert!(
            answers
                .iter()
                .any(|(w, f)| *w == 3 && matches!(f, Finished::Done)),
            "the client was told in time: {answers:?}"
        );
        let o = &b.owners[&1];
        let alice = UserId(o.users.get("alice").unwrap());
        assert!(
            !o.core.truth(alice).online,
            "the logout got through at last"
        );
        assert!(a.in_flight.is_empty() && a.busy.is_empty());
    }

    #[test]
    fn malformed_messages_are_counted_and_dropped() {
        let (mut a, mut b, now) = two_nodes();
        let users_before = b.owners[&1].users.len();
        let garbage = [
            Bytes::from_static(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff"),
            Bytes::from(vec![0u8; MAX_MESSAGE + 1]),
            Bytes::new(),
        ];
        for payload in garbage.iter().cloned() {
            a.handle_input(
                now,
                Millis(1),
                ClusterInput::ShardMessage {
                    shard: 1,
                    payload: payload.clone(),
                },
            );
            b.handle_input(
                now,
                Millis(1),
                ClusterInput::Request {
                    shard: 1,
                    kind: RequestKind::Input,
                    payload,
                    reply: 1,
                },
            );
        }
        // A view named for another shard, a name past the limit, a snapshot
        // naming too many targets, a device input on the snapshot subject.
        let view = |user: &str, shard| ClusterInput::ShardMessage {
            shard,
            payload: encode(&ShardView {
                epoch: 1,
                seq: 1,
                published_ms: 0,
                user: user.into(),
                own: false,
                presence: proto::Presence::default(),
            }),
        };
        a.handle_input(now, Millis(1), view("alice", 2));
        a.handle_input(now, Millis(1), view(&"x".repeat(129), 1));
        let many = ToOwner::Snapshot {
            viewer: "bob".into(),
            targets: vec!["alice".into(); MAX_SNAPSHOT_TARGETS + 1],
        };
        let wrong_kind = ToOwner::Device {
            edge: "a".into(),
            incarnation: 1,
            rid: 1_000,
            conn: 1,
            user: "alice".into(),
            device: "tablet".into(),
            op: WireOp::Connect {
                kind: proto::Kind::Web,
                session: 1,
                since: 1,
            },
        };
        for (msg, kind) in [
            (many, RequestKind::Snapshot),
            (wrong_kind, RequestKind::Snapshot),
        ] {
            b.handle_input(
                now,
                Millis(1),
                ClusterInput::Request {
                    shard: 1,
                    kind,
                    payload: encode(&msg),
                    reply: 2,
                },
            );
        }
        assert_eq!(a.counters().malformed, 5);
        assert_eq!(b.counters().malformed, 5);
        assert_eq!(b.poll_output(), None, "nothing answered");
        assert_eq!(b.owners[&1].users.len(), users_before, "nothing stored");
        assert_eq!(b.owners[&1].core.session_count(), 1, "alice's phone only");
    }

    #[test]
    fn an_owner_past_its_claim_deadline_stops_answering() {
        let (mut a, mut b, now) = two_nodes();
        let until = now + Duration::from_millis(50);
        b.set_status(now, Millis(1), all_shards(1, until));
        b.handle_timeout(until, Millis(50));
        assert!(b.owners.is_empty(), "the cores are gone at the deadline");
        a.input(until, Millis(50), SessionId(1), WireOp::Logout, None);
        let Some(ClusterOutput::Request {
            id,
            shard,
            kind,
            payload,
        }) = a.poll_output()
        else {
            panic!("no request");
        };
        b.handle_input(
            until,
            Millis(50),
            ClusterInput::Request {
                shard,
                kind,
                payload,
                reply: id,
            },
        );
        let Some(ClusterOutput::Reply { payload, .. }) = b.poll_output() else {
            panic!("no answer");
        };
        assert_eq!(decode::<FromOwner>(&payload), Some(FromOwner::NotOwner));
    }

    /// [`exchange`], holding `a`'s session record puts instead of landing
    /// them (returned: id, record).
    fn exchange_holding_records(
        a: &mut ClusterLink,
        b: &mut ClusterLink,
        now: Instant,
        at: Millis,
    ) -> Vec<(u64, SessionRecord)> {
        HELD.with(|h| *h.borrow_mut() = Some(Vec::new()));
        exchange(a, b, now, at);
        HELD.with(|h| h.borrow_mut().take()).unwrap_or_default()
    }

    #[test]
    fn a_subscribe_is_answered_once_its_session_record_landed() {
        let (mut a, mut b, now) = two_nodes();
        assert!(bob_subscribes_to_alice(&mut a, now, Millis(10), 9).is_none());
        let mut puts = exchange_holding_records(&mut a, &mut b, now, Millis(10));
        assert!(
            a.poll_finished().is_none(),
            "answered before its record landed"
        );
        let (id, record) = puts.pop().unwrap();
        assert_eq!(record.wire, 1002, "bob's session's wire id");
        assert_eq!(
            record.subscriptions,
            vec![("alice".to_string(), proto::Tier::Realtime)]
        );
        // A failed put is tried again at the tick; the answer still waits.
        let failed = ClusterInput::SessionStored { id, ok: false };
        a.handle_input(now, Millis(20), failed);
        assert!(a.poll_finished().is_none());
        assert_eq!(a.counters().session_writes_failed, 1);
        let later = now + TICK;
        a.handle_timeout(later, Millis(70));
        let (records, _) = store_records(&mut a, later, Millis(70));
        assert_eq!(records.len(), 1, "put again");
        let Some((9, Finished::Answer(proto::Answer::Subscribed { snapshots, .. }))) =
            a.poll_finished()
        else {
            panic!("no subscribe answer after the record landed");
        };
        assert_eq!(snapshots[0].target, "alice");
        // The record lands in the KV; the connection is lost: it stays (a
        // resume elsewhere may come within grace).
        let kv = |a: &mut ClusterLink, b: &mut ClusterLink, at| {
            exchange(a, b, now, Millis(at));
        };
        kv(&mut a, &mut b, 80);
        assert!(bob_subscribes_to_alice(&mut a, now, Millis(90), 10).is_none());
        kv(&mut a, &mut b, 90);
        assert!(landed("bob", "laptop").is_some());
        let lost = WireOp::Disconnect { last_heard: 0 };
        assert!(a.input(now, Millis(100), SessionId(2), lost, None));
        a.session_ended(SessionId(2));
        kv(&mut a, &mut b, 100);
        assert!(
            landed("bob", "laptop").is_some(),
            "gone while bob may resume"
        );
        // The owner sees the device end (grace): the record goes.
        b.handle_timeout(now, Millis(100 + 60_000));
        kv(&mut a, &mut b, 100 + 60_000);
        assert!(
            landed("bob", "laptop").is_none(),
            "kept after bob's device ended"
        );
    }

    #[test]
    fn a_session_resumed_on_another_node_carries_its_subscriptions() {
        let (mut a, mut b, now) = two_nodes();
        b.handle_timeout(now, Millis(300)); // alice shown online
        exchange(&mut a, &mut b, now, Millis(300));
        let at = Millis(310);
        assert!(bob_subscribes_to_alice(&mut a, now, at, 9).is_none());
        exchange(&mut a, &mut b, now, at);
        assert!(matches!(a.poll_finished(), Some((9, Finished::Answer(_)))));
        let record = landed("bob", "laptop").expect("bob's record");
        // Node a dies; bob's laptop comes back on c, naming its session.
        let mut c = link("c");
        let laptop = SessionId(1);
        let kind = proto::Kind::Desktop;
        c.connected(now, at, laptop, 5001, "bob", "laptop", kind, None);
        exchange(&mut c, &mut b, now, at);
        let load = |c: &mut ClusterLink, wait, wire| {
            c.resume_elsewhere(wait, laptop, "bob", "laptop", wire);
            let ids: Vec<u64> = std::iter::from_fn(|| c.poll_output())
                .filter_map(|o| match o {
                    ClusterOutput::LoadSession { id, .. } => Some(id),
                    _ => None,
                })
                .collect();
            assert_eq!(ids.len(), 1);
            ids[0]
        };
        // A record of another session of the device: a fresh session.
        let id = load(&mut c, 3, 777);
        let loaded = ClusterInput::SessionLoaded {
            id,
            record: Some(record.clone()),
        };
        c.handle_input(now, at, loaded);
        assert!(matches!(c.poll_finished(), Some((3, Finished::Done))));
        // The session the record names: its subscriptions come back.
        let id = load(&mut c, 4, 1002);
        let loaded = ClusterInput::SessionLoaded {
            id,
            record: Some(record),
        };
        c.handle_input(now, at, loaded);
        let Some((
            4,
            Finished::Carry {
                session,
                subscriptions,
            },
        )) = c.poll_finished()
        else {
            panic!("nothing carried over");
        };
        assert_eq!(session, laptop);
        assert_eq!(subscriptions, vec![("alice".to_string(), Tier::Realtime)]);
        assert!(c
            .carry_over(now, at, 4, laptop, "bob", subscriptions)
            .is_none());
        exchange(&mut c, &mut b, now, at);
        let Some((4, Finished::Answer(proto::Answer::Subscribed { snapshots, refused }))) =
            c.poll_finished()
        else {
            panic!("no snapshots for what carried over");
        };
        assert!(refused.is_empty());
        assert_eq!(snapshots.len(), 1);
        assert!(snapshots[0].presence.online, "alice is online");
        assert_eq!(c.counters().resumed_elsewhere, 1);
        let record: SessionRecord = decode(&landed("bob", "laptop").unwrap()).unwrap();
        assert_eq!(record.wire, 5001, "the record names the session on c now");
    }

    #[test]
    fn a_session_resumed_on_the_same_node_keeps_its_subscriptions() {
        let (mut a, mut b, now) = two_nodes();
        let at = Millis(10);
        assert!(bob_subscribes_to_alice(&mut a, now, at, 9).is_none());
        exchange(&mut a, &mut b, now, at);
        assert!(matches!(a.poll_finished(), Some((9, Finished::Answer(_)))));
        // bob's laptop resumes on a: new session 20 (wire 1020) from 2.
        let (old, new) = (SessionId(2), SessionId(20));
        let kind = proto::Kind::Desktop;
        a.connected(now, at, new, 1020, "bob", "laptop", kind, Some(old));
        a.session_ended(old); // what the hub's core says of the old one
        exchange(&mut a, &mut b, now, at);
        let kept: Vec<String> = a
            .snapshots(new, "bob")
            .into_iter()
            .map(|s| s.target)
            .collect();
        assert_eq!(kept, vec!["alice".to_string()]);
        let record: SessionRecord = decode(&landed("bob", "laptop").unwrap()).unwrap();
        assert_eq!(record.wire, 1020);
        // alice's next change reaches the new session.
        set_status(
            &mut a,
            &mut b,
            SessionId(1),
            proto::Status::Busy,
            now,
            400,
            |_| false,
        );
        let to: Vec<SessionId> = pushes(&mut a).into_iter().map(|(to, _)| to).collect();
        assert!(to.contains(&new), "{to:?}");
        assert!(!to.contains(&old), "{to:?}");
    }

    #[test]
    fn a_lost_truth_is_noticed_by_the_owners_beacon_and_asked_for_again() {
        let (mut a, mut b, now) = two_nodes();
        b.handle_timeout(now, Millis(300));
        exchange(&mut a, &mut b, now, Millis(300));
        // alice's phone (on a) watches herself: it is sent her truth.
        let me = vec!["alice".to_string()];
        let kind = Tier::Realtime;
        let alice = SessionId(1);
        let asked = a.subscribe(now, Millis(310), 5, alice, "alice", me, vec![], kind, false);
        assert!(asked.is_none());
        exchange(&mut a, &mut b, now, Millis(310));
        assert!(matches!(a.poll_finished(), Some((5, Finished::Answer(_)))));
        pushes(&mut a);
        let lose_truths = |o: &ClusterOutput| matches!(o, ClusterOutput::PublishToEdge { .. });
        set_status(
            &mut a,
            &mut b,
            alice,
            proto::Status::Busy,
            now,
            400,
            lose_truths,
        );
        let busy = |a: &mut ClusterLink| {
            pushes(a)
                .iter()
                .any(|(to, p)| *to == alice && p.status == greendot_core::Status::Busy)
        };
        assert!(!busy(&mut a), "the truth was lost");
        // The owner's next beacon names the truth it sent a: a asks again.
        let later = now + BEACON_EVERY + TICK;
        b.handle_timeout(later, Millis(1_500));
        exchange(&mut a, &mut b, later, Millis(1_500));
        assert_eq!(a.counters().truth_gaps, 1);
        let later = later + TICK;
        a.handle_timeout(later, Millis(1_600));
        exchange(&mut a, &mut b, later, Millis(1_600));
        assert!(busy(&mut a), "alice's phone never saw herself busy");
    }

    #[test]
    fn the_largest_beacon_fits_in_a_message() {
        let beacon = Beacon {
            owner: "n".repeat(64),
            shards: vec![(u32::MAX, u64::MAX, u64::MAX); MAX_BEACON_SHARDS],
            truths: vec![("e".repeat(64), u32::MAX, u64::MAX, u64::MAX); MAX_BEACON_TRUTHS],
        };
        let len = encode(&beacon).len();
        assert!(len <= MAX_MESSAGE, "{len} bytes");
        assert!(decode::<Beacon>(&encode(&beacon)).is_some());
    }
}
