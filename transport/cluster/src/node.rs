//! A node's duty in the cluster, as one task ([`Node::start`]): hold the
//! node lease, follow the live nodes and the claims, claim, renew and
//! release shards by rendezvous placement, stop acting before a claim or the
//! lease can expire, and say so through a watch channel ([`NodeStatus`]).
//!
//! When the node is cut off from NATS, its renewals fail: each shard stops
//! at its claim's deadline, and at the lease's deadline (`lease_ttl - margin`
//! after the last renewal was sent) the status turns [`NodePhase::CutOff`]:
//! the node owns nothing, `margin` before NATS can expire the lease. The
//! task does not end there: it takes a lease again with backoff (its own
//! lease back by compare-and-set if NATS still has it, else a new one under
//! the same incarnation) and turns `Active` once it has one. What the server
//! does with its clients meanwhile is the server's choice (greendot holds
//! them through an outage of the whole cluster and moves them when only
//! this node is cut off). [`Node::leave`] (SIGTERM) releases every claim
//! and the lease at once, so other nodes take the shards without waiting
//! for a TTL.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::client::{ClaimWatch, Cluster, MemberWatch, NodeLease};
use crate::error::{ClusterError, Result};
use crate::ids::{NodeId, ShardId};
use crate::membership::MemberEvent;
use crate::ownership::{ClaimAction, ClaimState, HeldShard, Ownership};
use crate::tenure::side_work_until;

/// Longest advertised address a lease value carries.
pub const MAX_ADVERTISE_LEN: usize = 256;

/// What a node's lease value tells the others (and `greendot cluster
/// status`). Written as `key=value` lines; renewals rewrite `renewed_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Where clients and operators reach the node (e.g. `host:4433`).
    pub advertise: String,
    /// Unix milliseconds when the node started.
    pub started_ms: u64,
    /// This run of the node (see [`Node::start`]): owners treat the devices
    /// of an older incarnation of a node as lost once they see a newer one.
    pub incarnation: u64,
    /// Unix milliseconds of the write (the writer's clock).
    pub renewed_ms: u64,
    pub shard_count: u32,
    pub lease_ttl_ms: u64,
    /// Where the node's HTTP port answers (`host:port`), if it has one: a
    /// node cut off from NATS asks its peers there whether they still hold
    /// their leases (`GET /cluster/lease`).
    pub http: Option<String>,
}

impl NodeInfo {
    pub fn encode(&self) -> Bytes {
        let mut text = format!(
            "advertise={}\nstarted_ms={}\nincarnation={}\nrenewed_ms={}\nshards={}\nlease_ttl_ms={}\n",
            self.advertise,
            self.started_ms,
            self.incarnation,
            self.renewed_ms,
            self.shard_count,
            self.lease_ttl_ms
        );
        if let Some(http) = &self.http {
            text.push_str(&format!("http={http}\n"));
        }
        Bytes::from(text)
    }

    /// `None` when the value is not one a node wrote.
    pub fn decode(value: &[u8]) -> Option<NodeInfo> {
        let text = std::str::from_utf8(value).ok()?;
        let mut fields = HashMap::new();
        for line in text.lines() {
            let (k, v) = line.split_once('=')?;
            fields.insert(k, v);
        }
        let started_ms = fields.get("started_ms")?.parse().ok()?;
        Some(NodeInfo {
            advertise: fields.get("advertise")?.to_string(),
            started_ms,
            // A lease written before incarnations: its start time.
            incarnation: match fields.get("incarnation") {
                Some(v) => v.parse().ok()?,
                None => started_ms,
            },
            renewed_ms: fields.get("renewed_ms")?.parse().ok()?,
            shard_count: fields.get("shards")?.parse().ok()?,
            lease_ttl_ms: fields.get("lease_ttl_ms")?.parse().ok()?,
            http: fields.get("http").map(|v| v.to_string()),
        })
    }
}

/// Unix time in milliseconds by this machine's clock.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePhase {
    /// Holds its lease and acts for the shards it holds.
    Active,
    /// Its lease ran out without a renewal (cut off from NATS, or the lease
    /// was lost): owns nothing, and tries to take a lease again.
    CutOff,
    /// Left on purpose ([`Node::leave`]): claims and lease released.
    Left,
}

/// A shard this node acts for, and until when at the latest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnedShard {
    pub epoch: u64,
    pub may_act_until: Instant,
}

/// The node's ownership as the server and the metrics read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    pub node: NodeId,
    pub phase: NodePhase,
    /// The node may serve clients strictly before this instant.
    pub lease_until: Instant,
    pub shards: BTreeMap<ShardId, OwnedShard>,
    /// Live nodes as this node's watch sees them (itself included).
    pub live_nodes: usize,
    /// Shards won by a claim (each with a new epoch).
    pub epoch_changes: u64,
    pub lease_renewals: u64,
    /// Times the node was cut off (its lease ran out or was lost).
    pub cut_offs: u64,
    /// Times it took a lease again after a cut-off.
    pub rejoins: u64,
    /// The other live nodes as last seen, with their HTTP addresses (from
    /// their lease values; `None` when a node advertises none).
    pub peers: Vec<(NodeId, Option<String>)>,
    /// How long a renewal lets the node act (`lease_ttl - margin`).
    pub act_window: Duration,
    /// When the node took the lease it holds (at its start, or its last
    /// rejoin).
    pub held_since: Instant,
}

impl NodeStatus {
    /// Whether the node has held its lease steadily: since at least
    /// `held_for` ago (never less than one act window), and renewed within
    /// the last half of the window. This tells a cut-off node whether only
    /// it lost NATS, when it passes how long it has been cut off: a node
    /// whose NATS works renews every third of the window and has held its
    /// lease since before the asker's cut-off; a peer that shares the
    /// outage renewed at the latest when the outage began, two thirds of a
    /// window or more before the asker's cut-off; and a peer that rejoined
    /// after the outage took its lease after the asker was cut off, however
    /// long the asker then takes to rejoin as well.
    pub fn steadily_holding(&self, now: Instant, held_for: Duration) -> bool {
        self.acting(now)
            && self.lease_until.saturating_duration_since(now) > self.act_window / 2
            && now.saturating_duration_since(self.held_since) >= held_for.max(self.act_window)
    }

    /// Whether the node may serve at `now`.
    pub fn acting(&self, now: Instant) -> bool {
        self.phase == NodePhase::Active && now < self.lease_until
    }

    /// The epoch under which the node may act for `shard` at `now`, if any:
    /// a reader checks the deadlines itself, so a status it read a moment
    /// ago never lets it act late.
    pub fn acting_epoch(&self, shard: ShardId, now: Instant) -> Option<u64> {
        let owned = self.shards.get(&shard)?;
        (self.acting(now) && now < owned.may_act_until).then_some(owned.epoch)
    }

    /// Shards the node may act for at `now`.
    pub fn shards_acting(&self, now: Instant) -> usize {
        if !self.acting(now) {
            return 0;
        }
        self.shards
            .values()
            .filter(|s| now < s.may_act_until)
            .count()
    }

    /// The node's cluster metrics in the Prometheus text format.
    pub fn render_metrics(&self, now: Instant) -> String {
        let node = &self.node;
        let mut out = String::new();
        for (name, kind, help, value) in [
            (
                "greendot_cluster_shards_owned",
                "gauge",
                "Shards this node holds a live claim for and acts for.",
                self.shards_acting(now) as u64,
            ),
            (
                "greendot_cluster_epoch_changes_total",
                "counter",
                "Shards this node won by a claim (each a new epoch).",
                self.epoch_changes,
            ),
            (
                "greendot_cluster_lease_renewals_total",
                "counter",
                "Successful renewals of this node's lease.",
                self.lease_renewals,
            ),
            (
                "greendot_cluster_acting",
                "gauge",
                "1 while this node holds its lease and may serve, else 0.",
                u64::from(self.acting(now)),
            ),
            (
                "greendot_cluster_live_nodes",
                "gauge",
                "Live nodes as this node sees them.",
                self.live_nodes as u64,
            ),
            (
                "greendot_cluster_cut_offs_total",
                "counter",
                "Times this node's lease ran out or was lost (it owned nothing until it rejoined).",
                self.cut_offs,
            ),
            (
                "greendot_cluster_rejoins_total",
                "counter",
                "Times this node took a lease again after a cut-off.",
                self.rejoins,
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{node=\"{node}\"}} {value}\n"
            ));
        }
        out
    }
}

/// How the duty task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeExit {
    /// Claims and lease released ([`Node::leave`]).
    Left,
}

/// A running node's duty task.
pub struct Node {
    status: watch::Receiver<NodeStatus>,
    leave: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<NodeExit>>,
}

/// Claims and renewals in flight at once.
const IN_FLIGHT: usize = 32;

impl Node {
    /// Takes the node lease, then starts the duty task. `incarnation` names
    /// this run (greendot uses its start time in Unix milliseconds): it must
    /// be above every earlier run's of this node id.
    ///
    /// A live lease of this id that advertises the same address with an
    /// older incarnation is a previous run of this node that died within its
    /// TTL (a live one would still hold the address's port, which the caller
    /// has bound): it is taken over at once (compare-and-set), and the
    /// owners, seeing the new incarnation on the lease watch, treat the old
    /// run's devices as lost. Any other live lease of this id (another
    /// address: a second node misconfigured with this id; or an incarnation
    /// not older, a clock set back) is waited out, up to two lease TTLs.
    pub async fn start(cluster: Cluster, advertise: String, incarnation: u64) -> Result<Node> {
        Node::start_with_http(cluster, advertise, None, incarnation).await
    }

    /// [`Node::start`], advertising the node's HTTP port as well, where
    /// peers cut off from NATS ask whether it holds its lease.
    pub async fn start_with_http(
        cluster: Cluster,
        advertise: String,
        http: Option<String>,
        incarnation: u64,
    ) -> Result<Node> {
        for address in std::iter::once(&advertise).chain(http.as_ref()) {
            if address.len() > MAX_ADVERTISE_LEN || address.contains(['\n', '\r']) {
                return Err(ClusterError::Corrupt {
                    bucket: cluster.config().bucket("leases"),
                    key: format!(
                        "advertised address {address:?} (one line, at most {MAX_ADVERTISE_LEN} bytes)"
                    ),
                });
            }
        }
        let config = cluster.config().clone();
        let mut info = NodeInfo {
            advertise,
            started_ms: unix_ms(),
            incarnation,
            renewed_ms: unix_ms(),
            shard_count: config.shard_count,
            lease_ttl_ms: config.lease_ttl.as_millis() as u64,
            http,
        };
        // Watches first: our lease write then comes after their initial
        // snapshot, so seeing ourselves join means the snapshot is complete.
        let mut members = cluster.watch_members().await?;
        let claims = cluster.watch_claims().await?;
        let give_up = Instant::now() + config.lease_ttl * 2 + config.op_timeout;
        let lease = loop {
            info.renewed_ms = unix_ms();
            match cluster.acquire_lease(info.encode()).await {
                Ok(lease) => break lease,
                Err(ClusterError::LeaseHeld { .. }) => {
                    if let Some(lease) = take_over_previous_run(&cluster, &info).await? {
                        break lease;
                    }
                    if Instant::now() >= give_up {
                        return Err(ClusterError::LeaseHeld {
                            node: cluster.node().clone(),
                        });
                    }
                    debug!("node lease held by another process of this id; waiting for its TTL");
                    tokio::time::sleep(config.lease_timing().renew_every()).await;
                }
                Err(e) => return Err(e),
            }
        };
        let me = cluster.node().clone();
        // Our own lease, of this incarnation: a previous run's lease in the
        // watch's initial snapshot says nothing of where the snapshot ends.
        let caught_up = async {
            while let Some(event) = members.next().await {
                let ours = matches!(&event,
                    Ok(MemberEvent::Joined { node, .. } | MemberEvent::Restarted { node, .. })
                        if *node == me);
                let member = members.membership().member(&me);
                if ours && member.is_some_and(|m| m.incarnation == Some(incarnation)) {
                    break;
                }
            }
        };
        if tokio::time::timeout_at(lease.may_act_until().into(), caught_up)
            .await
            .is_err()
        {
            warn!("own lease not seen on the watch in time; planning with what is known");
        }
        let (tx, status) = watch::channel(NodeStatus {
            node: me,
            phase: NodePhase::Active,
            lease_until: lease.may_act_until(),
            shards: BTreeMap::new(),
            live_nodes: members.membership().len(),
            epoch_changes: 0,
            lease_renewals: 0,
            cut_offs: 0,
            rejoins: 0,
            peers: Vec::new(),
            act_window: config.lease_ttl.saturating_sub(config.margin),
            held_since: Instant::now(),
        });
        let (leave, leave_rx) = oneshot::channel();
        let duty = Duty {
            ownership: Ownership::new(cluster.node().clone(), config.shard_count),
            cluster,
            info,
            members: Some(members),
            claims: Some(claims),
            lease,
            tx,
            backoff: HashMap::new(),
            lease_retry_at: None,
            watch_retry_at: Instant::now(),
            epoch_changes: 0,
            lease_renewals: 0,
            cut_offs: 0,
            rejoins: 0,
            peers: Vec::new(),
            held_since: Instant::now(),
        };
        let task = tokio::spawn(duty.run(leave_rx));
        Ok(Node {
            status,
            leave: Some(leave),
            task,
        })
    }

    /// The node's ownership, updated on every change.
    pub fn status(&self) -> watch::Receiver<NodeStatus> {
        self.status.clone()
    }

    /// Waits until the task ends (after [`Node::leave`]).
    pub async fn finished(&mut self) -> Result<NodeExit> {
        match (&mut self.task).await {
            Ok(exit) => exit,
            Err(e) => panic!("node duty task failed: {e}"),
        }
    }

    /// Leaves the cluster: stops acting for every shard, deletes the claims
    /// and then the lease, so other nodes take over at once.
    pub async fn leave(mut self) -> Result<NodeExit> {
        if let Some(leave) = self.leave.take() {
            let _ = leave.send(());
        }
        self.finished().await
    }

    /// Stops the task as a crash would (`kill -9`): nothing is released;
    /// claims and lease expire on their TTLs. For tests.
    #[doc(hidden)]
    pub fn crash(self) {
        self.task.abort();
    }
}

/// Takes over the live lease of this node id if it is a previous run's
/// (same address, older incarnation; see [`Node::start`]); `None` if it is
/// not, or another taker won.
async fn take_over_previous_run(cluster: &Cluster, info: &NodeInfo) -> Result<Option<NodeLease>> {
    let Some(entry) = cluster.lease(cluster.node()).await? else {
        return Ok(None);
    };
    let previous_run = entry.op == crate::kv::KvOp::Put
        && NodeInfo::decode(&entry.value)
            .is_some_and(|i| i.advertise == info.advertise && i.incarnation < info.incarnation);
    if !previous_run {
        return Ok(None);
    }
    match cluster.take_over_lease(info.encode(), entry.revision).await {
        Ok(lease) => {
            info!(
                incarnation = info.incarnation,
                "took over the node lease of a previous run of this node"
            );
            Ok(Some(lease))
        }
        Err(ClusterError::LeaseHeld { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

struct Duty {
    cluster: Cluster,
    info: NodeInfo,
    members: Option<MemberWatch>,
    claims: Option<ClaimWatch>,
    lease: NodeLease,
    ownership: Ownership,
    tx: watch::Sender<NodeStatus>,
    /// Shards not to claim again before this instant (a claim failed: the
    /// claims watch has not caught up, or NATS is unreachable).
    backoff: HashMap<ShardId, Instant>,
    lease_retry_at: Option<Instant>,
    /// No new watch attempt before this instant.
    watch_retry_at: Instant,
    epoch_changes: u64,
    lease_renewals: u64,
    cut_offs: u64,
    rejoins: u64,
    /// The other live nodes as last seen (kept while a watch is made again).
    peers: Vec<(NodeId, Option<String>)>,
    /// When the lease held now was taken.
    held_since: Instant,
}

/// The outcome of one claim action.
enum Done {
    Claimed(ShardId, Result<HeldShard>),
    Renewed(HeldShard, Result<()>),
    Released(ShardId, Result<()>),
}

impl Duty {
    fn publish(&mut self, phase: NodePhase) {
        if let Some(members) = &self.members {
            let me = self.cluster.node();
            self.peers = members
                .membership()
                .members()
                .filter(|(node, _)| *node != me)
                .map(|(node, m)| {
                    let http = NodeInfo::decode(&m.value).and_then(|i| i.http);
                    (node.clone(), http)
                })
                .collect();
        }
        let shards = self
            .ownership
            .held()
            .map(|h| {
                let owned = OwnedShard {
                    epoch: h.epoch,
                    may_act_until: h.may_act_until().min(self.lease.may_act_until()),
                };
                (h.shard, owned)
            })
            .collect();
        let status = NodeStatus {
            node: self.cluster.node().clone(),
            phase,
            lease_until: self.lease.may_act_until(),
            shards,
            live_nodes: self.members.as_ref().map_or(0, |m| m.membership().len()),
            epoch_changes: self.epoch_changes,
            lease_renewals: self.lease_renewals,
            cut_offs: self.cut_offs,
            rejoins: self.rejoins,
            peers: self.peers.clone(),
            act_window: {
                let c = self.cluster.config();
                c.lease_ttl.saturating_sub(c.margin)
            },
            held_since: self.held_since,
        };
        self.tx.send_if_modified(|old| {
            let changed = *old != status;
            *old = status;
            changed
        });
    }

    fn retry_delay(&self) -> Duration {
        self.cluster.config().claim_timing().renew_every()
    }

    async fn run(mut self, mut leave: oneshot::Receiver<()>) -> Result<NodeExit> {
        loop {
            let now = Instant::now();
            let lease_until = self.lease.may_act_until();
            for stopped in self.ownership.stop_expired(now, lease_until) {
                warn!(shard = %stopped.shard, epoch = stopped.epoch, "claim not renewed in time: stopped acting for the shard");
            }
            if now >= lease_until {
                warn!("node lease not renewed in time: owning nothing until the node rejoins");
                if let Some(exit) = self.rejoin(&mut leave).await {
                    return Ok(exit);
                }
                continue;
            }
            self.publish(NodePhase::Active);
            self.backoff.retain(|_, until| *until > now);

            if now >= self.lease.tenure.renew_at() && self.lease_retry_at.is_none_or(|t| now >= t) {
                self.info.renewed_ms = unix_ms();
                let value = self.info.encode();
                let renew = self.cluster.renew_lease(&mut self.lease, value);
                let result = tokio::select! {
                    r = tokio::time::timeout_at(lease_until.into(), renew) => Some(r),
                    _ = &mut leave => None,
                };
                let Some(result) = result else {
                    return self.leave().await;
                };
                match result {
                    Ok(Ok(())) => {
                        self.lease_renewals += 1;
                        self.lease_retry_at = None;
                    }
                    Ok(Err(ClusterError::Conflict { .. })) => {
                        if !self.adopt_landed_renewal().await {
                            warn!("node lease expired or taken: owning nothing until the node rejoins");
                            if let Some(exit) = self.rejoin(&mut leave).await {
                                return Ok(exit);
                            }
                        }
                    }
                    Ok(Err(e)) => {
                        debug!(error = %e, "lease renewal failed; retrying");
                        self.lease_retry_at = Some(Instant::now() + self.retry_delay() / 4);
                    }
                    Err(_) => {}
                }
                continue;
            }

            // Only with this node in the live set: over a set that lacks
            // it (a watch made again, still replaying), placement would
            // give its shards away. With it, a partial set only makes it
            // try claims that fail.
            let plan = match &self.members {
                Some(members) if members.membership().is_live(self.cluster.node()) => {
                    let table = self.claims.as_ref().map(|c| c.table());
                    match table {
                        Some(table) => self.ownership.plan(members.membership(), table, now),
                        None => Vec::new(),
                    }
                }
                _ => Vec::new(),
            };
            let actions: Vec<ClaimAction> = plan
                .into_iter()
                .filter(|a| match a {
                    ClaimAction::Claim { shard, .. } | ClaimAction::Renew { shard } => {
                        !self.backoff.contains_key(shard)
                    }
                    ClaimAction::Release { .. } => true,
                })
                .collect();
            if !actions.is_empty() {
                if let Some(exit) = self.act(actions, &mut leave).await? {
                    return Ok(exit);
                }
                continue;
            }
            if let Some(exit) = self.wait(&mut leave).await? {
                return Ok(exit);
            }
        }
    }

    /// Cut off: owns nothing (every claim dropped, none acted for), says
    /// `CutOff`, and takes a lease again with backoff until it has one
    /// (`None`: back to `Active`) or is told to leave.
    async fn rejoin(&mut self, leave: &mut oneshot::Receiver<()>) -> Option<NodeExit> {
        let held: Vec<ShardId> = self.ownership.held().map(|h| h.shard).collect();
        for shard in held {
            self.ownership.remove(shard);
        }
        self.backoff.clear();
        self.lease_retry_at = None;
        self.cut_offs += 1;
        self.publish(NodePhase::CutOff);
        let since = Instant::now();
        let bound = self.cluster.config().op_timeout * 2;
        // Tries start at most a renewal period apart, and one that timed
        // out is followed at once: each try is one KV read and write, and
        // the node's clients wait for it to rejoin.
        let longest = self.retry_delay();
        let mut delay = self.retry_delay() / 4;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let started = Instant::now();
            let attempt = tokio::select! {
                biased;
                _ = &mut *leave => None,
                r = tokio::time::timeout(bound, self.retake_lease()) => Some(r),
            };
            let Some(result) = attempt else {
                self.publish(NodePhase::Left);
                return Some(NodeExit::Left);
            };
            let why = match result {
                Ok(Ok(lease)) => {
                    self.lease = lease;
                    self.held_since = Instant::now();
                    // Fresh watches: the old ones may have stalled with the
                    // NATS node that went. One that cannot be made now is
                    // made again by `wait`; planning waits for both.
                    self.members = None;
                    self.claims = None;
                    if let Ok(Ok(w)) =
                        tokio::time::timeout(bound, self.cluster.watch_members()).await
                    {
                        self.members = Some(w);
                    }
                    if let Ok(Ok(w)) =
                        tokio::time::timeout(bound, self.cluster.watch_claims()).await
                    {
                        self.claims = Some(w);
                    }
                    self.watch_retry_at = Instant::now();
                    self.rejoins += 1;
                    info!(after = ?since.elapsed(), attempts, "rejoined the cluster: node lease taken again");
                    self.publish(NodePhase::Active);
                    return None;
                }
                Ok(Err(e)) => crate::error::chain(&e),
                Err(_) => format!("no answer from NATS within {bound:?}"),
            };
            // Loud at first, then once in ten: an outage is long to read.
            if attempts == 1 || attempts.is_multiple_of(10) {
                warn!(attempts, after = ?since.elapsed(), error = %why, "cannot take a node lease yet; retrying");
            } else {
                debug!(attempts, error = %why, "cannot take a node lease yet; retrying");
            }
            tokio::select! {
                biased;
                _ = &mut *leave => {
                    self.publish(NodePhase::Left);
                    return Some(NodeExit::Left);
                }
                _ = tokio::time::sleep(delay.saturating_sub(started.elapsed())) => {}
            }
            delay = (delay * 2).min(longest);
        }
    }

    /// A new lease, or this run's own lease back by compare-and-set when
    /// NATS still has it (the outage was shorter than its TTL).
    async fn retake_lease(&mut self) -> Result<NodeLease> {
        self.info.renewed_ms = unix_ms();
        let value = self.info.encode();
        match self.cluster.acquire_lease(value.clone()).await {
            Err(ClusterError::LeaseHeld { node }) => {
                let entry = self.cluster.lease(self.cluster.node()).await?;
                let ours = entry.as_ref().is_some_and(|e| {
                    e.op == crate::kv::KvOp::Put
                        && NodeInfo::decode(&e.value).is_some_and(|i| {
                            i.incarnation == self.info.incarnation
                                && i.advertise == self.info.advertise
                        })
                });
                match entry {
                    Some(e) if ours => self.cluster.take_over_lease(value, e.revision).await,
                    _ => Err(ClusterError::LeaseHeld { node }),
                }
            }
            other => other,
        }
    }

    /// After a renewal conflict: an earlier renewal that timed out may have
    /// landed later. The lease is still ours if it carries this run's start
    /// time; adopt its revision (the deadline stays where it was).
    async fn adopt_landed_renewal(&mut self) -> bool {
        match self.cluster.lease(self.cluster.node()).await {
            Ok(Some(entry)) if entry.op == crate::kv::KvOp::Put => {
                let ours = NodeInfo::decode(&entry.value).is_some_and(|i| {
                    i.started_ms == self.info.started_ms
                        && i.incarnation == self.info.incarnation
                        && i.advertise == self.info.advertise
                });
                if ours {
                    self.lease.revision = entry.revision;
                }
                ours
            }
            _ => false,
        }
    }

    /// Runs a batch of claim actions, applying each outcome as it arrives;
    /// gives up on the rest when a deadline comes (a hanging write never
    /// delays a stop) or the node is told to leave.
    async fn act(
        &mut self,
        actions: Vec<ClaimAction>,
        leave: &mut oneshot::Receiver<()>,
    ) -> Result<Option<NodeExit>> {
        let mut work = Vec::new();
        for action in actions {
            let cluster = self.cluster.clone();
            match action {
                ClaimAction::Claim {
                    shard,
                    expected_revision,
                } => work.push(futures_util::future::Either::Left(async move {
                    Done::Claimed(shard, cluster.claim_shard(shard, expected_revision).await)
                })),
                ClaimAction::Renew { shard } => {
                    let Some(mut held) = self.ownership.get(shard).cloned() else {
                        continue;
                    };
                    work.push(futures_util::future::Either::Right(
                        futures_util::future::Either::Left(async move {
                            let r = cluster.renew_claim(&mut held).await;
                            Done::Renewed(held, r)
                        }),
                    ));
                }
                ClaimAction::Release { shard } => {
                    // Stop acting first, then hand the shard back.
                    let Some(held) = self.ownership.remove(shard) else {
                        continue;
                    };
                    info!(%shard, epoch = held.epoch, "another node should own this shard: releasing");
                    work.push(futures_util::future::Either::Right(
                        futures_util::future::Either::Right(async move {
                            Done::Released(shard, cluster.release_claim(held).await)
                        }),
                    ));
                }
            }
        }
        self.publish(NodePhase::Active);
        let mut batch = futures_util::stream::iter(work).buffer_unordered(IN_FLIGHT);
        loop {
            let lease_until = self.lease.may_act_until();
            let stop_at = self
                .ownership
                .next_deadline(lease_until)
                .unwrap_or(lease_until)
                .min(self.lease.tenure.renew_at().max(Instant::now()));
            let done = tokio::select! {
                biased;
                _ = &mut *leave => None,
                _ = tokio::time::sleep_until(stop_at.into()) => return Ok(None),
                done = batch.next() => Some(done),
            };
            let Some(done) = done else {
                drop(batch);
                return self.leave().await.map(Some);
            };
            let Some(done) = done else { return Ok(None) };
            let now = Instant::now();
            match done {
                Done::Claimed(shard, Ok(held)) => {
                    info!(%shard, epoch = held.epoch, "claimed shard");
                    self.epoch_changes += 1;
                    self.ownership.insert(held);
                }
                Done::Claimed(shard, Err(e)) => {
                    debug!(%shard, error = %e, "claim failed");
                    self.backoff.insert(shard, now + self.retry_delay());
                }
                Done::Renewed(held, Ok(())) => {
                    // Only if still held under this epoch (not released meanwhile).
                    if self
                        .ownership
                        .get(held.shard)
                        .is_some_and(|h| h.epoch == held.epoch)
                    {
                        self.ownership.insert(held);
                    }
                }
                Done::Renewed(held, Err(ClusterError::Conflict { .. })) => {
                    warn!(shard = %held.shard, epoch = held.epoch, "claim lost: stopped acting for the shard");
                    self.ownership.remove(held.shard);
                }
                Done::Renewed(held, Err(e)) => {
                    debug!(shard = %held.shard, error = %e, "claim renewal failed; retrying");
                    self.backoff
                        .insert(held.shard, now + self.retry_delay() / 4);
                }
                Done::Released(shard, r) => {
                    if let Err(e) = r {
                        debug!(%shard, error = %e, "release failed; the claim expires on its TTL");
                    }
                }
            }
            self.publish(NodePhase::Active);
        }
    }

    /// Sleeps until something is due, a member joins or leaves, or a claim
    /// becomes free.
    async fn wait(&mut self, leave: &mut oneshot::Receiver<()>) -> Result<Option<NodeExit>> {
        let lease_until = self.lease.may_act_until();
        let mut wake = self
            .lease_retry_at
            .unwrap_or(self.lease.tenure.renew_at())
            .min(lease_until);
        for h in self.ownership.held() {
            wake = wake.min(h.may_act_until()).min(h.tenure.renew_at());
        }
        if let Some(b) = self.backoff.values().min() {
            wake = wake.min(*b);
        }
        // A watch silent for three lease renewal periods has stalled (this
        // node's own renewals alone would have shown): its consumer lived on
        // a NATS node that died. Made again rather than waiting for
        // `async-nats` to notice; so is a watch that ended.
        let stall_after = self.cluster.config().lease_timing().renew_every() * 3;
        let now = Instant::now();
        if self
            .members
            .as_ref()
            .is_some_and(|m| now >= m.seen_at() + stall_after)
        {
            warn!("member watch silent for {stall_after:?}: watching again");
            self.members = None;
        }
        // Silent claims are a stall only while someone renews a claim: ours,
        // or another node's in the table. A node that owns nothing still
        // needs the watch to see claims expire.
        if self.claims.as_ref().is_some_and(|c| {
            now >= c.seen_at() + stall_after
                && (self.ownership.held().next().is_some() || c.table().any_held())
        }) {
            warn!("claim watch silent for {stall_after:?}: watching again");
            self.claims = None;
        }
        // Making a watch needs the JetStream meta leader, which may be in an
        // election: bounded, not more often than retry_delay, and only
        // while the lease and every claim outlast it (`side_work_until`).
        let budget = self.cluster.config().op_timeout;
        let missing = self.members.is_none() || self.claims.is_none();
        let must_renew_by = self
            .ownership
            .held()
            .map(|h| h.may_act_until())
            .fold(lease_until, Instant::min);
        let spare = side_work_until(now, budget, must_renew_by);
        if let (true, true, Some(until)) = (missing, self.watch_retry_at <= now, spare) {
            let until = until.into();
            if self.members.is_none() {
                match tokio::time::timeout_at(until, self.cluster.watch_members()).await {
                    Ok(Ok(w)) => self.members = Some(w),
                    Ok(Err(e)) => debug!(error = %e, "cannot watch the members yet"),
                    Err(_) => debug!("watching the members timed out"),
                }
            }
            if self.claims.is_none() {
                match tokio::time::timeout_at(until, self.cluster.watch_claims()).await {
                    Ok(Ok(w)) => self.claims = Some(w),
                    Ok(Err(e)) => debug!(error = %e, "cannot watch the claims yet"),
                    Err(_) => debug!("watching the claims timed out"),
                }
            }
            if self.members.is_none() || self.claims.is_none() {
                self.watch_retry_at = Instant::now() + self.retry_delay();
            }
        }
        if self.members.is_none() || self.claims.is_none() {
            wake = wake.min(self.watch_retry_at.max(Instant::now() + budget));
        }
        if let Some(m) = &self.members {
            wake = wake.min(m.seen_at() + stall_after);
        }
        if let Some(c) = &self.claims {
            if self.ownership.held().next().is_some() || c.table().any_held() {
                wake = wake.min(c.seen_at() + stall_after);
            }
        }
        let me = self.cluster.node().clone();
        loop {
            enum Woke {
                Leave,
                Due,
                Member(Option<Result<MemberEvent>>),
                Claim(Option<Result<(ShardId, ClaimState)>>),
            }
            let woke = {
                let members = async {
                    match self.members.as_mut() {
                        Some(m) => m.next().await,
                        None => std::future::pending().await,
                    }
                };
                let claims = async {
                    match self.claims.as_mut() {
                        Some(c) => c.next().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = &mut *leave => Woke::Leave,
                    _ = tokio::time::sleep_until(wake.into()) => Woke::Due,
                    event = members => Woke::Member(event),
                    change = claims => Woke::Claim(change),
                }
            };
            match woke {
                Woke::Leave => return self.leave().await.map(Some),
                Woke::Due => return Ok(None),
                Woke::Member(None) => {
                    self.members = None;
                    return Ok(None);
                }
                Woke::Member(Some(Err(e))) => debug!(error = %e, "member watch"),
                Woke::Member(Some(Ok(event))) => {
                    info!(?event, "membership changed");
                    return Ok(None);
                }
                Woke::Claim(None) => {
                    self.claims = None;
                    return Ok(None);
                }
                Woke::Claim(Some(Err(e))) => debug!(error = %e, "claim watch"),
                // Renewals by others change nothing here; a free shard may
                // be ours to claim; a claim by us that we did not record (a
                // write given up on) simply expires.
                Woke::Claim(Some(Ok((_, ClaimState::Free { .. })))) => return Ok(None),
                Woke::Claim(Some(Ok((shard, ClaimState::Held(r))))) => {
                    if r.owner != me && self.ownership.get(shard).is_some() {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Stops acting for every shard, deletes the claims, then the lease.
    async fn leave(&mut self) -> Result<NodeExit> {
        let held: Vec<HeldShard> = self
            .ownership
            .held()
            .map(|h| h.shard)
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|s| self.ownership.remove(s))
            .collect();
        self.publish(NodePhase::Active);
        let count = held.len();
        let cluster = self.cluster.clone();
        let releases = futures_util::stream::iter(held.into_iter().map(|h| {
            let cluster = cluster.clone();
            async move { cluster.release_claim(h).await }
        }))
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<_>>();
        let bound = self.cluster.config().op_timeout * 2;
        match tokio::time::timeout(bound, releases).await {
            Ok(results) => {
                let failed = results.iter().filter(|r| r.is_err()).count();
                info!(released = count - failed, failed, "released shards");
            }
            Err(_) => warn!("releasing shards timed out; the rest expire on their TTL"),
        }
        let lease = self.lease.clone();
        if let Err(e) = self.cluster.release_lease(lease).await {
            warn!(error = %e, "releasing the node lease failed; it expires on its TTL");
        }
        self.publish(NodePhase::Left);
        Ok(NodeExit::Left)
    }
}
