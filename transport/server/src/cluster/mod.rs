//! The cluster data path (docs/cluster.md "The protocol as checked"), sans
//! IO: what `ServerState` does as an **edge** (forwards its sessions' device
//! inputs to the owner of their user's shard, fans published views out to
//! its sessions through a `Fanout`) and as an **owner** (one `Core` per shard
//! it acts for, publishing each view once on the shard's subject).
//!
//! [`ClusterLink`] holds the two apart: the edge's state is an `Edge`
//! (the `edge` folder), the owners' an `OwnedShards` (the `owner` folder),
//! and what both use (settings, request ids, the outputs, counters, the
//! group directory) is `Shared`. Owners never call into the edge: what they send
//! this node's own edge is queued (`to_edge.rs`) and delivered when their
//! step returns, as a remote owner's message arrives after its step.
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

mod edge;
mod group_dir;
pub mod local;
mod owner;
mod shared;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests_edge;
#[cfg(test)]
mod tests_group_counts;
#[cfg(test)]
mod tests_groups;
#[cfg(test)]
mod tests_owner;
#[cfg(test)]
mod tests_records;
#[cfg(test)]
mod tests_views;
mod to_edge;
mod wire;

use bytes::Bytes;
pub use edge::group_pages::PAGE_WATCHER;
use edge::Edge;
use greendot_core::{Config, Millis, Output, SessionId, Tier, UserId};
use greendot_proto::{self as proto, WireError};
use group_dir::GroupDirectory;
pub use group_dir::{GroupDef, GroupLimits, GroupWrite, GroupWriteOutcome, MAX_WRITE_TRIES};
pub use owner::group_slices::home_key;
use owner::OwnedShards;
use shared::Shared;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};
pub use wire::{
    decode_device_record, Beacon, FromOwner, GroupCount, GroupCounts, GroupPartial, RecordedDevice,
    ResyncRequest, SessionRecord, ShardView, ToOwner, WireOp, WirePrefs, GROUPS_SINCE,
};

/// Maps whose iteration order is the same in every run (std's default
/// hasher is seeded per process): the multi-node simulator replays a run
/// from its seed.
type DetHasher = std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher>;
pub(crate) type DetMap<K, V> = std::collections::HashMap<K, V, DetHasher>;
pub(crate) type DetSet<K> = std::collections::HashSet<K, DetHasher>;

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

/// Ops one pump hands this node's own owners in a row at most; past it the
/// devices left wait for the next tick (no loop between an edge and its
/// own owner holds the state's loop).
const MAX_LOCAL_HOPS: usize = 4_096;

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
    /// How long a new owner of a shard holds its users' offlines: the edges
    /// resend their live devices of the shard meanwhile (C2). A cluster of
    /// one has no other edge, and its own resends before anything can go
    /// offline: none.
    pub resync_window: Duration,
    /// The inter-node protocol version this node sends (greendot-cluster's
    /// `Envelope::send_version`); the KV records it writes follow it, so a
    /// node of the previous release reads them during a rolling upgrade.
    pub protocol: u8,
    /// A deliberately broken link, for the simulator's checks to catch
    /// (`None` in production).
    pub mutant: Option<LinkMutant>,
}

/// Deliberately broken cluster links: each is a bug the multi-node
/// simulator (`greendot-sim`'s `cluster`) must catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkMutant {
    /// A preference write that lands is answered `Done` even after the
    /// shard's claim lapsed or moved (the C4 race: the client is told
    /// "invisible" while the new owner shows her online).
    AckAfterShardLost,
    /// An edge drops a device's `Disconnect` instead of forwarding it: the
    /// device stays online at its owner (a ghost past C3's bound).
    DropEndingOp,
    /// An owner keeps acting past its claim's deadline: a node paused past
    /// its lease publishes for shards that moved when it wakes (C1).
    ActPastDeadline,
    /// Owners never send their partial counts again to a new owner of a
    /// group's home shard: its sum lacks the shards whose members did not
    /// change since (G1).
    PartialsNotResent,
    /// An edge feeds its hub's core every group count it hears, whatever
    /// its version (with the core's `FedOlderCountTaken`, a repeated count
    /// reaches admins again: G3).
    CountsAnyVersion,
}

impl LinkMutant {
    pub const ALL: [LinkMutant; 5] = [
        LinkMutant::AckAfterShardLost,
        LinkMutant::DropEndingOp,
        LinkMutant::ActPastDeadline,
        LinkMutant::PartialsNotResent,
        LinkMutant::CountsAnyVersion,
    ];
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
    /// (`None`: nothing: the user starts fresh).
    UserLoaded {
        id: u64,
        prefs: Option<Bytes>,
        view: Option<Bytes>,
    },
    /// The read of [`ClusterOutput::LoadUser`] `id` failed: it is asked
    /// again, and the user's inputs wait (started fresh, a user who chose
    /// to be invisible would be shown online: C4).
    UserLoadFailed { id: u64 },
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
    /// [`ClusterOutput::LoadShard`] `id` (`None`: nothing).
    ShardLoaded { id: u64, record: Option<Bytes> },
    /// The read of [`ClusterOutput::LoadShard`] `id` failed: it is asked
    /// again, and the shard's record is not written until it is read (taken
    /// as empty, the previous owner's devices would be lost, and users of
    /// theirs shown online would stay so: C3).
    ShardLoadFailed { id: u64 },
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
    /// This node took its lease again after it lapsed (NATS was away past
    /// its renewals): owners may have dropped its devices when the lease
    /// expired, and nothing else tells them the node is back under the
    /// same incarnation, so the edge sends each live device's connect
    /// again.
    Rejoined,
    /// A group's definition from the groups bucket's watch, at `revision`
    /// (`None`: its header was deleted).
    GroupChanged {
        group: u64,
        revision: u64,
        def: Option<GroupDef>,
    },
    /// The watch has delivered everything the bucket held when it started.
    GroupsSynced,
    /// A message on the cluster's groups subject ([`GroupCounts`]).
    GroupCounts { payload: Bytes },
    /// What the store did with [`ClusterOutput::WriteGroup`] `id`.
    GroupWritten { id: u64, outcome: GroupWriteOutcome },
    /// What the store holds of the group of [`ClusterOutput::ReadGroup`]
    /// `id`: its revision (0: never written) and definition, or why the
    /// read failed.
    GroupRead {
        id: u64,
        read: Result<(u64, Option<GroupDef>), String>,
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
    /// Write a shard's device record (behind), fenced from protocol 3
    /// ([`wire::FENCED_RECORD_SINCE`]): not over a record written under a
    /// higher `fence`, which is the owner's epoch in the high 32 bits and
    /// its count of record writes in that epoch below (a newer owner's, or
    /// this owner's later write).
    PutShardDevices {
        shard: u32,
        fence: Option<u64>,
        value: Bytes,
    },
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
    /// Store a group's definition if its stored revision is still
    /// `expected` (0: never written); answer with
    /// [`ClusterInput::GroupWritten`].
    WriteGroup {
        id: u64,
        def: GroupDef,
        expected: u64,
    },
    /// Read a group's definition from the store (the stream's leader);
    /// answer with [`ClusterInput::GroupRead`].
    ReadGroup { id: u64, group: u64 },
    /// Publish on the cluster's groups subject (every node listens).
    GroupCounts { payload: Bytes },
    /// Subscribe to a shard's subject (one more local watcher of it).
    Watch { shard: u32 },
    /// The last local watcher of the shard left.
    Unwatch { shard: u32 },
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
    /// Watched shards whose owner this edge did not hear of for 3 s (no
    /// view, beacon or answer): each asks the owner for the views of the
    /// shard's watched users again, and answers none from what it holds
    /// until then.
    pub silent_shards: u64,
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
        /// Its group subscriptions (from protocol 4).
        groups: Vec<u64>,
    },
    /// Answer with this instead.
    Answer(proto::Answer),
    /// Answer with this error.
    Failed(WireError),
    /// Run the group subscribe of `session` through the hub again and
    /// answer what it answers: the hub's core holds the group as the store
    /// does now ([`ClusterLink::confirm_group`]).
    GroupSubscribeAgain { session: SessionId, group: u64 },
    /// A page read to be watched: watched in the hub's core (unless
    /// `refused`: answer that), then answered (or the core's refusal); then
    /// settled ([`ClusterLink::settle_page_read`] with `followed`).
    WatchedPage {
        session: SessionId,
        after: Option<proto::GroupCursor>,
        page: proto::GroupPage,
        followed: Vec<String>,
        refused: Option<WireError>,
    },
}

/// The cluster side of one node (see the module docs).
pub struct ClusterLink {
    /// Settings, request ids and the outputs to the NATS I/O.
    shared: Shared,
    /// What serves this node's sessions.
    edge: Edge,
    /// The shards this node acts for, and what serves only them.
    shards: OwnedShards,
    next_tick: Option<Instant>,
    finished: VecDeque<(u64, Finished)>,
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
            shared: Shared {
                settings,
                owner_config,
                unix_base_ms,
                max_name_len,
                next_id: 0,
                in_flight: DetMap::default(),
                outputs: VecDeque::new(),
                counters: ClusterCounters::default(),
                groups: GroupDirectory::default(),
                to_edge: VecDeque::new(),
            },
            edge: Edge::new(config),
            shards: OwnedShards::default(),
            next_tick: None,
            finished: VecDeque::new(),
        }
    }

    pub fn counters(&self) -> ClusterCounters {
        self.shared.counters
    }

    pub fn poll_output(&mut self) -> Option<ClusterOutput> {
        #[cfg(any(test, feature = "check"))]
        self.check_delivered();
        self.shared.outputs.pop_front()
    }

    /// A client request the cluster is done with: its wait id and answer.
    pub fn poll_finished(&mut self) -> Option<(u64, Finished)> {
        self.finished.pop_front()
    }

    /// The delay of a remote view this edge took (milliseconds).
    pub fn poll_latency(&mut self) -> Option<u64> {
        self.edge.latencies.pop_front()
    }

    /// A push for a local session: the fanout's outputs.
    pub fn poll_fanout(&mut self) -> Option<Output> {
        self.edge.fanout.poll_output()
    }

    /// The name behind a fanout user id.
    pub fn user_name(&self, user: UserId) -> Option<&str> {
        self.edge.names.name(user.0).map(|n| &**n)
    }

    /// The earliest instant something here is due, besides the cores';
    /// `now` (the caller's) when the first tick is still to come.
    pub fn poll_deadline(&self, now: Instant) -> Option<Instant> {
        let work = self.shards.waits_on_tick()
            || self.edge.waits_on_tick()
            || !self.shared.in_flight.is_empty()
            || self.shared.groups.busy();
        // A tick, not the exact instants: finding the earliest of them
        // would walk every device at every pass of the server's loop.
        // Not `Instant::now()`: that is always after the caller's `now`,
        // so a node whose cores had no timer due would never tick (its
        // retries and deadlines never looked at) while its loop spun.
        work.then(|| self.next_tick.unwrap_or(now))
    }

    /// The earliest core timer (owners' and the fanout's).
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.shards
            .owners
            .poll_timeout()
            .into_iter()
            .chain(self.edge.fanout.poll_timeout())
            .min()
    }

    /// Runs what is due: core timers at `at`, deadlines and retries at `now`.
    pub fn handle_timeout(&mut self, now: Instant, at: Millis) {
        self.on_timeout(now, at);
        self.shards.owners.reindex();
        #[cfg(test)]
        self.shards.owners.check();
        #[cfg(any(test, feature = "check"))]
        self.check_delivered();
    }

    fn on_timeout(&mut self, now: Instant, at: Millis) {
        self.shards.stop_lapsed(&mut self.shared, now, at);
        self.deliver_local();
        self.shards.handle_timeout(&mut self.shared, now, at);
        self.deliver_local();
        self.edge.fanout.handle_timeout(at);
        if self.next_tick.is_some_and(|t| now < t) {
            return;
        }
        self.next_tick = Some(now + TICK);
        self.expire_pending(now, at);
        self.shards.announce(&mut self.shared, now);
        self.repair_gaps(now, at);
        self.tick_devices(now, at);
        self.retry_routes(now, at);
        self.retry_pages(now, at);
        self.retry_records(now);
        self.tick_subscribes(now, at);
        self.retry_group_writes(now, at);
        self.shards.send_partials(&mut self.shared, now, at);
        self.deliver_local();
        self.shards.tick_sums(&mut self.shared, now, at);
        self.deliver_local();
    }

    pub fn handle_input(&mut self, now: Instant, at: Millis, input: ClusterInput) {
        self.on_input(now, at, input);
        self.shards.owners.reindex();
        #[cfg(test)]
        self.shards.owners.check();
        #[cfg(any(test, feature = "check"))]
        self.check_delivered();
    }

    fn on_input(&mut self, now: Instant, at: Millis, input: ClusterInput) {
        self.shards.stop_lapsed(&mut self.shared, now, at);
        self.deliver_local();
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
            } => {
                self.shards
                    .request_message(&mut self.shared, now, at, shard, kind, &payload, reply)
            }
            ClusterInput::SessionStored { id, ok } => self.session_stored(now, id, ok),
            ClusterInput::SessionLoaded { id, record } => self.session_loaded(id, record),
            ClusterInput::Answered { id, payload } => self.answered(now, at, id, payload),
            ClusterInput::Beacon { payload } => self.beacon_message(&payload, at),
            ClusterInput::UserLoadFailed { id } => {
                self.shards.user_load_failed(&mut self.shared, now, id)
            }
            ClusterInput::ShardLoadFailed { id } => {
                self.shards.shard_load_failed(&mut self.shared, now, id)
            }
            ClusterInput::UserLoaded { id, prefs, view } => {
                self.shards
                    .user_loaded(&mut self.shared, now, at, id, prefs, view)
            }
            ClusterInput::ShardLoaded { id, record } => {
                self.shards.shard_loaded(&mut self.shared, now, id, record)
            }
            ClusterInput::EdgeLost { node, last_heard } => {
                self.shards
                    .edge_lost(&mut self.shared, now, at, &node, None, last_heard)
            }
            ClusterInput::EdgeRestarted {
                node,
                incarnation,
                last_heard,
            } => {
                self.shards.saw_incarnation(&node, incarnation);
                self.shards.edge_lost(
                    &mut self.shared,
                    now,
                    at,
                    &node,
                    Some(incarnation),
                    last_heard,
                )
            }
            ClusterInput::Resync { payload } => self.resync_message(now, at, &payload),
            ClusterInput::Rejoined => self.rejoined(now, at),
            ClusterInput::PrefsStored { id, ok } => {
                self.shards.prefs_stored(&mut self.shared, now, at, id, ok)
            }
            ClusterInput::GroupChanged {
                group,
                revision,
                def,
            } => self.group_changed(now, at, group, revision, def),
            ClusterInput::GroupsSynced => self.groups_synced(now, at),
            ClusterInput::GroupCounts { payload } => self.group_counts_message(&payload),
            ClusterInput::GroupWritten { id, outcome } => self.group_written(now, at, id, outcome),
            ClusterInput::GroupRead { id, read } => self.group_read(now, at, id, read),
        }
        self.deliver_local();
    }

    /// What waited too long for the NATS I/O (its output dropped at a full
    /// queue, or NATS silent): requests count as unanswered (retried),
    /// requests waiting on preference writes as failed, KV reads are asked
    /// again, and a preference write never answered is given up.
    fn expire_pending(&mut self, now: Instant, at: Millis) {
        let late: Vec<u64> = self
            .shared
            .in_flight
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.handle_input(now, at, ClusterInput::Answered { id, payload: None });
        }
        self.shards.expire_pending(&mut self.shared, now, at);
        self.deliver_local();
    }
}
