//! The NATS I/O: one connection per node, its five buckets, and thin async
//! calls around the pure decisions of `tenure`, `membership`, `ownership`.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv, stream::StorageType};
use bytes::Bytes;
use futures_util::StreamExt;

use crate::config::ClusterConfig;
use crate::envelope::{DropCounts, Envelope};
use crate::error::{ClusterError, Result};
use crate::ids::{device_key, user_key, NodeId, ShardId};

/// A session record nobody rewrote for this long is dropped by the bucket:
/// a resume after it starts a fresh session (the client subscribes again),
/// and records of devices that never came back do not pile up.
pub const SESSION_RECORD_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
use crate::kv::{put, read, write_if, KvEntry, KvOp, Write};
use crate::membership::{MemberEvent, Membership};
use crate::messaging::{check_shard, OwnerInbox, RequestKind, SubjectFeed, ViewFeed};
use crate::ownership::{
    decode_claim, encode_claim, epoch_key, shard_key, ClaimState, ClaimTable, HeldShard,
};
use crate::tenure::Tenure;

/// This node's lease: while it may act, the node may serve clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLease {
    pub revision: u64,
    pub tenure: Tenure,
}

impl NodeLease {
    /// The node closes its client connections at this instant unless a
    /// renewal succeeds first (its clients then move to live nodes before
    /// the owners see the lease expire).
    pub fn may_act_until(&self) -> Instant {
        self.tenure.may_act_until()
    }
}

/// One node's handle on the cluster. Cheap to clone.
#[derive(Clone)]
pub struct Cluster {
    config: ClusterConfig,
    client: async_nats::Client,
    /// Seals every message this node publishes and opens every one it
    /// receives (views, truths, requests, replies, resyncs, beacons).
    envelope: Envelope,
    js: jetstream::Context,
    leases: kv::Store,
    claims: kv::Store,
    prefs: kv::Store,
    views: kv::Store,
    sessions: kv::Store,
    /// `<prefix>_groups`, opened on first use: nothing uses group
    /// definitions yet, so a node that never touches them makes no bucket.
    groups: std::sync::Arc<tokio::sync::OnceCell<kv::Store>>,
    /// Whether NATS last said the client connected (`true`) or
    /// disconnected, from its connection events: what a send waiting for
    /// the connection wakes on.
    linked: tokio::sync::watch::Receiver<bool>,
}

impl Cluster {
    /// Connects to NATS (`urls`: comma-separated `nats://host:port` of the
    /// NATS cluster's nodes) with the credentials and TLS of
    /// `config.nats`, and creates or opens the buckets. `envelope`: the
    /// cluster's message key and protocol version (every node's messages
    /// are sealed with it).
    pub async fn connect(urls: &str, config: ClusterConfig, envelope: Envelope) -> Result<Cluster> {
        config.validate()?;
        let most = config.op_timeout;
        let options = async_nats::ConnectOptions::new()
            .name(format!("greendot-{}", config.node))
            .request_timeout(Some(config.op_timeout))
            .connection_timeout(config.op_timeout)
            .reconnect_delay_callback(move |attempts| reconnect_delay(attempts, most))
            .subscription_capacity(config.channel_capacity);
        let options = config
            .nats
            .apply(options)
            .await
            .map_err(|source| ClusterError::Credentials { source })?;
        let (linked_tx, linked) = tokio::sync::watch::channel(true);
        let linked_tx = std::sync::Arc::new(linked_tx);
        let options = options.event_callback(move |event| {
            let linked_tx = linked_tx.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        linked_tx.send_replace(true);
                    }
                    async_nats::Event::Disconnected => {
                        linked_tx.send_replace(false);
                    }
                    _ => {}
                }
            }
        });
        let servers: Vec<&str> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        let client = async_nats::connect_with_options(servers, options)
            .await
            .map_err(|source| ClusterError::Connect {
                urls: urls.to_owned(),
                source,
            })?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(config.op_timeout);
        let marked = Some(config.marker_ttl);
        let forever = Duration::ZERO;
        let leases = bucket(&js, &config, "leases", marked, forever).await?;
        let claims = bucket(&js, &config, "claims", marked, forever).await?;
        let prefs = bucket(&js, &config, "prefs", None, forever).await?;
        let views = bucket(&js, &config, "views", None, forever).await?;
        let sessions = bucket(&js, &config, "sessions", None, SESSION_RECORD_MAX_AGE).await?;
        Ok(Cluster {
            config,
            client,
            envelope,
            js,
            leases,
            claims,
            prefs,
            views,
            sessions,
            groups: Default::default(),
            linked,
        })
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    pub fn node(&self) -> &NodeId {
        &self.config.node
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Messages from NATS dropped by the envelope (forged, of a version not
    /// read, malformed), for the metrics.
    pub fn dropped(&self) -> std::sync::Arc<DropCounts> {
        self.envelope.drops().clone()
    }

    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.config.op_timeout
    }

    /// Whether the client is connected to NATS now (not making its
    /// connection again).
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// NATS's connection events as they come: `true` once it said the
    /// client connected, `false` once it said it disconnected.
    pub fn connection(&self) -> tokio::sync::watch::Receiver<bool> {
        self.linked.clone()
    }

    /// Waits up to half an operation's timeout for the client to be
    /// connected; `Reconnecting` if it is not by then. async-nats queues
    /// what it is handed while it reconnects and sends it once it is back:
    /// a request whose asker gave up long ago, a view, a record write. A
    /// device's connect sent so from an edge cut off from NATS took the
    /// device from the edge that held it by then, and its end showed the
    /// device offline while it was connected (the simulator's `--buffered`
    /// runs, seed 1631). Such a send fails instead, once half its timeout
    /// passed with no connection: failing later keeps the link's pace (it
    /// retries a failed record write at its next tick, and logs each). A
    /// send whose connection comes back in time goes out with half its
    /// timeout left.
    pub(crate) async fn connected(&self, op: &'static str) -> Result<()> {
        let deadline = tokio::time::Instant::now() + self.timeout() / 2;
        let mut events = self.linked.clone();
        while self.connected_now(op).is_err() {
            // The state is the client's; its next connection event is the
            // moment to look again. async-nats sends the event just before
            // it sets the state: a wake that finds it unset waits for the
            // deadline, and the link retries.
            match tokio::time::timeout_at(deadline, events.changed()).await {
                Ok(Ok(())) => {}
                _ => return Err(ClusterError::Reconnecting { op }),
            }
        }
        Ok(())
    }

    /// [`Cluster::connected`] without the wait, for the publishes the I/O
    /// loop makes inline (a lost publish is repaired by the beacons).
    fn connected_now(&self, op: &'static str) -> Result<()> {
        if self.is_connected() {
            Ok(())
        } else {
            Err(ClusterError::Reconnecting { op })
        }
    }

    pub(crate) fn js(&self) -> &jetstream::Context {
        &self.js
    }

    /// The groups bucket, created or opened on the first call.
    pub(crate) async fn groups_store(&self) -> Result<&kv::Store> {
        self.groups
            .get_or_try_init(|| bucket(&self.js, &self.config, "groups", None, Duration::ZERO))
            .await
    }

    /// The revision a compare-and-set creating `key` must expect: 0 if the key
    /// never existed, the marker's if deleted or expired. `Err(entry)` if live.
    async fn free_revision(&self, store: &kv::Store, key: &str) -> Result<Result<u64, KvEntry>> {
        Ok(match read(store, key, self.timeout()).await? {
            None => Ok(0),
            Some(e) if e.op != KvOp::Put => Ok(e.revision),
            Some(e) => Err(e),
        })
    }

    // ---- node leases -------------------------------------------------------

    /// Takes this node's lease (`value`: what others should know of it, e.g.
    /// its advertised address). Fails with `LeaseHeld` while a lease of this
    /// id is live.
    pub async fn acquire_lease(&self, value: Bytes) -> Result<NodeLease> {
        let key = self.config.node.as_str();
        let expected = match self.free_revision(&self.leases, key).await? {
            Ok(rev) => rev,
            Err(_) => {
                return Err(ClusterError::LeaseHeld {
                    node: self.config.node.clone(),
                })
            }
        };
        self.put_lease(value, expected).await
    }

    /// Writes this node's lease with its TTL if its revision is still
    /// `expected`; `LeaseHeld` if it changed meanwhile.
    async fn put_lease(&self, value: Bytes, expected: u64) -> Result<NodeLease> {
        let sent_at = Instant::now();
        let ttl = Some(self.config.lease_ttl);
        let key = self.config.node.as_str();
        let write = Write::Put { value, ttl };
        let revision = write_if(&self.js, &self.leases, key, expected, write, self.timeout())
            .await
            .map_err(|e| match e {
                ClusterError::Conflict { .. } => ClusterError::LeaseHeld {
                    node: self.config.node.clone(),
                },
                e => e,
            })?;
        Ok(NodeLease {
            revision,
            tenure: Tenure::granted(self.config.lease_timing(), sent_at),
        })
    }

    /// Takes over this node id's live lease at `revision` by compare-and-set
    /// (a previous run of this node that died within its TTL: see
    /// `Node::start`). That run's next renewal then fails. `LeaseHeld` if
    /// the lease changed meanwhile.
    pub async fn take_over_lease(&self, value: Bytes, revision: u64) -> Result<NodeLease> {
        self.put_lease(value, revision).await
    }

    /// Renews the lease with its TTL. `Conflict` means the lease expired (or
    /// was taken): the node must stop serving and acquire a new one.
    pub async fn renew_lease(&self, lease: &mut NodeLease, value: Bytes) -> Result<()> {
        let sent_at = Instant::now();
        let ttl = Some(self.config.lease_ttl);
        let key = self.config.node.as_str();
        lease.revision = write_if(
            &self.js,
            &self.leases,
            key,
            lease.revision,
            Write::Put { value, ttl },
            self.timeout(),
        )
        .await?;
        lease.tenure.renewed(sent_at);
        Ok(())
    }

    /// Leaves: deletes the lease so that others see the node gone now.
    pub async fn release_lease(&self, lease: NodeLease) -> Result<()> {
        let key = self.config.node.as_str();
        write_if(
            &self.js,
            &self.leases,
            key,
            lease.revision,
            Write::Delete,
            self.timeout(),
        )
        .await?;
        Ok(())
    }

    /// The latest entry of `node`'s lease (a `Put` while it is live).
    pub async fn lease(&self, node: &NodeId) -> Result<Option<KvEntry>> {
        read(&self.leases, node.as_str(), self.timeout()).await
    }

    /// Watches the node leases: first the current ones, then every change.
    pub async fn watch_members(&self) -> Result<MemberWatch> {
        let inner = self
            .leases
            .watch_all()
            .await
            .map_err(|source| ClusterError::Watch {
                bucket: self.leases.name.clone(),
                source,
            })?;
        Ok(MemberWatch {
            bucket: self.leases.name.clone(),
            inner,
            seen_at: Instant::now(),
            membership: Membership::default(),
        })
    }

    // ---- shard claims ------------------------------------------------------

    pub async fn read_claim(&self, shard: ShardId) -> Result<ClaimState> {
        check_shard(&self.config, shard)?;
        Ok(
            match read(&self.claims, &shard_key(shard), self.timeout()).await? {
                None => ClaimState::Free { revision: 0 },
                // A value that is no claim counts as held by nobody we trust:
                // treat it as free at its revision (a CAS still guards the write).
                Some(e) => decode_claim(&e).unwrap_or(ClaimState::Free {
                    revision: e.revision,
                }),
            },
        )
    }

    /// Claims `shard` by compare-and-set on `expected_revision` (from the
    /// claim table or `read_claim`). Exactly one of racing claimers wins;
    /// the others get `ShardHeld` (or `Conflict`). First bumps the shard's
    /// epoch counter, so the winner's epoch is above every earlier owner's.
    ///
    /// If the claim is still free but at another revision than expected
    /// (its expiry marker was removed after `marker_ttl`, or the caller's
    /// table lagged), it retries once on the revision it read.
    pub async fn claim_shard(&self, shard: ShardId, expected_revision: u64) -> Result<HeldShard> {
        check_shard(&self.config, shard)?;
        let epoch = self.bump_epoch(shard).await?;
        let key = shard_key(shard);
        let claim = |expected: u64| {
            let value = encode_claim(&self.config.node, epoch);
            let write = Write::Put {
                value,
                ttl: Some(self.config.claim_ttl),
            };
            let key = &key;
            async move {
                let sent_at = Instant::now();
                let revision =
                    write_if(&self.js, &self.claims, key, expected, write, self.timeout()).await?;
                Ok::<_, ClusterError>(HeldShard {
                    shard,
                    epoch,
                    revision,
                    tenure: Tenure::granted(self.config.claim_timing(), sent_at),
                })
            }
        };
        match claim(expected_revision).await {
            Err(ClusterError::Conflict { .. }) => match self.read_claim(shard).await? {
                ClaimState::Free { revision } if revision != expected_revision => {
                    claim(revision).await
                }
                ClaimState::Free { .. } => Err(ClusterError::Conflict {
                    bucket: self.claims.name.clone(),
                    key: key.clone(),
                    expected: expected_revision,
                }),
                ClaimState::Held(r) => Err(ClusterError::ShardHeld {
                    shard,
                    owner: r.owner,
                    epoch: r.epoch,
                }),
            },
            other => other,
        }
    }

    /// Raises `shard`'s epoch counter by one (compare-and-set, retried while
    /// racing claimers bump it too) and returns the new epoch.
    async fn bump_epoch(&self, shard: ShardId) -> Result<u64> {
        let key = epoch_key(shard);
        let mut attempts = 0;
        loop {
            let (current, revision) = match read(&self.claims, &key, self.timeout()).await? {
                Some(e) if e.op == KvOp::Put => {
                    let text = std::str::from_utf8(&e.value).unwrap_or("");
                    let n: u64 = text.parse().map_err(|_| ClusterError::Corrupt {
                        bucket: self.claims.name.clone(),
                        key: key.clone(),
                    })?;
                    (n, e.revision)
                }
                Some(e) => (0, e.revision),
                None => (0, 0),
            };
            let Some(next) = crate::ownership::next_epoch(current) else {
                // Refused before anything is written: claiming would wrap
                // every version of the shard (see `MAX_EPOCH`).
                tracing::error!(
                    %shard,
                    epoch = current,
                    "not claiming the shard: its epoch counter is at the last epoch whose \
                     versions fit; a claim would wrap every version of its users \
                     (docs/cluster.md \"Epochs\")"
                );
                return Err(ClusterError::EpochExhausted {
                    shard,
                    epoch: current,
                });
            };
            let value = Bytes::from(next.to_string());
            let write = Write::Put { value, ttl: None };
            match write_if(
                &self.js,
                &self.claims,
                &key,
                revision,
                write,
                self.timeout(),
            )
            .await
            {
                Ok(_) => return Ok(next),
                Err(ClusterError::Conflict { .. }) if attempts < 8 => attempts += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Renews a held claim (same epoch, new revision, fresh TTL). On any
    /// error the holder keeps its old deadline, and on `Conflict` it has lost
    /// the shard: it stops acting at once.
    pub async fn renew_claim(&self, held: &mut HeldShard) -> Result<()> {
        let sent_at = Instant::now();
        let value = encode_claim(&self.config.node, held.epoch);
        let ttl = Some(self.config.claim_ttl);
        let key = shard_key(held.shard);
        let put = || Write::Put {
            value: value.clone(),
            ttl,
        };
        match write_if(
            &self.js,
            &self.claims,
            &key,
            held.revision,
            put(),
            self.timeout(),
        )
        .await
        {
            Ok(revision) => held.revision = revision,
            Err(ClusterError::Conflict { .. }) => {
                // An earlier renewal that timed out may have landed later:
                // the claim is still ours if it keeps our epoch (a new claim
                // would have a new one). Adopt its revision without moving
                // the deadline, and try once more.
                match self.read_claim(held.shard).await? {
                    ClaimState::Held(r) if r.owner == self.config.node && r.epoch == held.epoch => {
                        held.revision = write_if(
                            &self.js,
                            &self.claims,
                            &key,
                            r.revision,
                            put(),
                            self.timeout(),
                        )
                        .await?;
                    }
                    _ => {
                        let bucket = self.claims.name.clone();
                        return Err(ClusterError::Conflict {
                            bucket,
                            key,
                            expected: held.revision,
                        });
                    }
                }
            }
            Err(e) => return Err(e),
        }
        held.tenure.renewed(sent_at);
        Ok(())
    }

    /// Hands a shard back (the caller stopped acting for it first).
    pub async fn release_claim(&self, held: HeldShard) -> Result<()> {
        let key = shard_key(held.shard);
        write_if(
            &self.js,
            &self.claims,
            &key,
            held.revision,
            Write::Delete,
            self.timeout(),
        )
        .await?;
        Ok(())
    }

    /// Watches all claims: first the current ones, then every change.
    pub async fn watch_claims(&self) -> Result<ClaimWatch> {
        let inner = self
            .claims
            .watch_all()
            .await
            .map_err(|source| ClusterError::Watch {
                bucket: self.claims.name.clone(),
                source,
            })?;
        Ok(ClaimWatch {
            bucket: self.claims.name.clone(),
            shard_count: self.config.shard_count,
            inner,
            seen_at: Instant::now(),
            table: ClaimTable::default(),
        })
    }

    // ---- preferences and last published views ------------------------------

    /// Stores a user's preferences as written by the owner of their shard
    /// under `epoch`, fenced (C4, [`Cluster::put_fenced`]); returns once the
    /// replicas have them, so the caller may then acknowledge the request.
    pub async fn put_preferences(&self, user: &str, epoch: u64, value: Bytes) -> Result<u64> {
        let key = user_key(user)?;
        self.put_fenced(&self.prefs, key, epoch, value).await
    }

    /// Writes `value` under `key` as the owner of its shard under `epoch`:
    /// by compare-and-set on the record's revision, and only if the record
    /// was not written under a newer epoch (`Fenced`: a new owner wrote
    /// since, and this write, late, must not undo its). Records keep the
    /// epoch in front of the value ([`FENCED_MAGIC`], 8 bytes big-endian);
    /// a record without it (written before fencing) counts as epoch 0.
    async fn put_fenced(
        &self,
        store: &kv::Store,
        key: String,
        epoch: u64,
        value: Bytes,
    ) -> Result<u64> {
        self.connected("a fenced KV write").await?;
        let mut framed = Vec::with_capacity(FENCED_MAGIC.len() + 8 + value.len());
        framed.extend_from_slice(FENCED_MAGIC);
        framed.extend_from_slice(&epoch.to_be_bytes());
        framed.extend_from_slice(&value);
        let framed = Bytes::from(framed);
        // A racing writer of the same epoch (the same owner, two changes in
        // flight) makes the compare-and-set fail: read and try again.
        for _ in 0..3 {
            let latest = read(store, &key, self.timeout()).await?;
            let expected = match &latest {
                Some(e) => {
                    let written = fenced_epoch(&e.value).0;
                    if e.op == KvOp::Put && written > epoch {
                        return Err(ClusterError::Fenced {
                            bucket: store.name.clone(),
                            key,
                            epoch,
                            newer: written,
                        });
                    }
                    e.revision
                }
                None => 0,
            };
            let write = Write::Put {
                value: framed.clone(),
                ttl: None,
            };
            match write_if(&self.js, store, &key, expected, write, self.timeout()).await {
                Err(ClusterError::Conflict { .. }) => continue,
                other => return other,
            }
        }
        Err(ClusterError::Conflict {
            bucket: store.name.clone(),
            key,
            expected: 0,
        })
    }

    /// A user's preferences (without the epoch they were written under).
    pub async fn preferences(&self, user: &str) -> Result<Option<Bytes>> {
        let value = latest_value(&self.prefs, &user_key(user)?, self.timeout()).await?;
        Ok(value.as_ref().map(unfenced))
    }

    /// Stores the last view the owner published for a user.
    pub async fn put_view(&self, user: &str, value: Bytes) -> Result<u64> {
        self.connected("a view's KV write").await?;
        put(
            &self.js,
            &self.views,
            &user_key(user)?,
            value,
            self.timeout(),
        )
        .await
    }

    /// Stores the record of a shard's devices its owner writes behind (in
    /// the views bucket, under `shard.<n>`, which no escaped user id is):
    /// fenced when given a `fence` ([`Cluster::put_fenced`]; the owner's
    /// epoch above its count of writes: a late write of an older owner, or
    /// an earlier one of the same owner, would drop what a later one
    /// recorded), else as is (what nodes sending protocol 2 write).
    pub async fn put_shard_devices(
        &self,
        shard: ShardId,
        fence: Option<u64>,
        value: Bytes,
    ) -> Result<u64> {
        check_shard(&self.config, shard)?;
        let key = format!("shard.{}", shard.0);
        match fence {
            Some(fence) => self.put_fenced(&self.views, key, fence, value).await,
            None => put(&self.js, &self.views, &key, value, self.timeout()).await,
        }
    }

    /// A shard's device record (without the epoch it was written under).
    pub async fn shard_devices(&self, shard: ShardId) -> Result<Option<Bytes>> {
        check_shard(&self.config, shard)?;
        let key = format!("shard.{}", shard.0);
        let value = latest_value(&self.views, &key, self.timeout()).await?;
        Ok(value.as_ref().map(unfenced))
    }

    pub async fn view(&self, user: &str) -> Result<Option<Bytes>> {
        latest_value(&self.views, &user_key(user)?, self.timeout()).await
    }

    // ---- session records (resume on any node) ------------------------------

    /// Stores the record of a device's current session; returns its
    /// revision once the replicas have it.
    pub async fn put_session(&self, user: &str, device: &str, value: Bytes) -> Result<u64> {
        self.connected("a session record's KV write").await?;
        let key = device_key(user, device)?;
        put(&self.js, &self.sessions, &key, value, self.timeout()).await
    }

    pub async fn session(&self, user: &str, device: &str) -> Result<Option<Bytes>> {
        latest_value(&self.sessions, &device_key(user, device)?, self.timeout()).await
    }

    /// Deletes the record (the device ended: a resume naming it starts
    /// fresh).
    pub async fn delete_session(&self, user: &str, device: &str) -> Result<()> {
        self.connected("a session record's KV delete").await?;
        let key = device_key(user, device)?;
        let after = self.timeout();
        match tokio::time::timeout(after, self.sessions.delete(&key)).await {
            Err(_) => Err(ClusterError::TimedOut {
                op: "KV delete",
                after,
            }),
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(ClusterError::Delete {
                bucket: self.sessions.name.clone(),
                key,
                source,
            }),
        }
    }

    // ---- messaging ---------------------------------------------------------

    /// Publishes a view once, on its shard's subject; NATS delivers one copy
    /// to each node subscribed to the shard.
    pub async fn publish_view(&self, shard: ShardId, payload: Bytes) -> Result<()> {
        check_shard(&self.config, shard)?;
        self.publish_on(self.config.view_subject(shard), payload)
            .await
    }

    /// Publishes on `<prefix>.resync`, which every node listens to
    /// ([`Cluster::resync_feed`]): a new owner asks the edges to resend.
    pub async fn publish_resync(&self, payload: Bytes) -> Result<()> {
        self.publish_on(self.config.resync_subject(), payload).await
    }

    /// The messages on `<prefix>.resync` (one subscription per node).
    pub async fn resync_feed(&self) -> Result<SubjectFeed> {
        self.subject_feed(self.config.resync_subject()).await
    }

    /// Publishes on `<prefix>.beacon`, which every node listens to
    /// ([`Cluster::beacon_feed`]): an owner's latest view number of each
    /// shard it acts for, so an edge notices a view it missed.
    pub async fn publish_beacon(&self, payload: Bytes) -> Result<()> {
        self.publish_on(self.config.beacon_subject(), payload).await
    }

    /// The messages on `<prefix>.beacon` (one subscription per node).
    pub async fn beacon_feed(&self) -> Result<SubjectFeed> {
        self.subject_feed(self.config.beacon_subject()).await
    }

    /// Publishes on `<prefix>.groups`, which every node listens to
    /// ([`Cluster::group_counts_feed`]): the counts of the groups whose
    /// home shard the publisher owns.
    pub async fn publish_group_counts(&self, payload: Bytes) -> Result<()> {
        self.publish_on(self.config.group_counts_subject(), payload)
            .await
    }

    /// The messages on `<prefix>.groups` (one subscription per node).
    pub async fn group_counts_feed(&self) -> Result<SubjectFeed> {
        self.subject_feed(self.config.group_counts_subject()).await
    }

    /// Sends a user's truth to the edge of `node`, which holds devices of
    /// that user ([`Cluster::edge_feed`]).
    pub async fn publish_to_edge(&self, node: &NodeId, payload: Bytes) -> Result<()> {
        self.publish_on(self.config.edge_subject(node), payload)
            .await
    }

    async fn publish_on(&self, subject: String, payload: Bytes) -> Result<()> {
        self.connected_now("a publish")?;
        let sealed = self.envelope.seal(&subject, &payload);
        self.client
            .publish(subject.clone(), sealed)
            .await
            .map_err(|source| ClusterError::Publish { subject, source })
    }

    /// What owners send to this node's edge (one subscription per node).
    pub async fn edge_feed(&self) -> Result<SubjectFeed> {
        self.subject_feed(self.config.edge_subject(&self.config.node))
            .await
    }

    async fn subject_feed(&self, subject: String) -> Result<SubjectFeed> {
        let sub = self
            .client
            .subscribe(subject.clone())
            .await
            .map_err(|source| ClusterError::Subscribe { subject, source })?;
        Ok(SubjectFeed {
            sub,
            envelope: self.envelope.clone(),
        })
    }

    /// A feed of the published views of the shards this node watches.
    pub fn view_feed(&self) -> ViewFeed {
        ViewFeed::new(
            self.client.clone(),
            self.config.clone(),
            self.envelope.clone(),
        )
    }

    /// The requests to the shards this node owns.
    pub fn owner_inbox(&self) -> OwnerInbox {
        OwnerInbox::new(
            self.client.clone(),
            self.config.clone(),
            self.envelope.clone(),
        )
    }

    /// Sends a request to the owner of `shard` and waits for its answer.
    /// `NoOwner` when nobody serves the shard now; `Dropped` when the answer
    /// is not a sealed message of this cluster (counted).
    pub async fn request(
        &self,
        shard: ShardId,
        kind: RequestKind,
        payload: Bytes,
    ) -> Result<Bytes> {
        check_shard(&self.config, shard)?;
        self.connected("a request to a shard owner").await?;
        use async_nats::RequestErrorKind;
        let subject = self.config.request_subject(shard, kind);
        let sealed = self.envelope.seal(&subject, &payload);
        match self.client.request(subject.clone(), sealed).await {
            // The owner sealed its answer for this request's own inbox.
            Ok(msg) => match self.envelope.check(msg.subject.as_str(), &msg.payload) {
                Ok((_, payload)) => Ok(payload),
                Err(reason) => {
                    // Counted like every other drop.
                    let _ = self.envelope.open(msg.subject.as_str(), &msg.payload);
                    Err(ClusterError::Dropped {
                        subject,
                        reason: reason.label(),
                    })
                }
            },
            Err(e) if e.kind() == RequestErrorKind::NoResponders => {
                Err(ClusterError::NoOwner { shard })
            }
            Err(e) if e.kind() == RequestErrorKind::TimedOut => Err(ClusterError::TimedOut {
                op: "request to a shard owner",
                after: self.timeout(),
            }),
            Err(source) => Err(ClusterError::Request { subject, source }),
        }
    }

    /// Waits until the NATS server has processed everything sent so far
    /// (e.g. new subscriptions).
    pub async fn flush(&self) -> Result<()> {
        tokio::time::timeout(self.timeout(), self.client.flush())
            .await
            .map_err(|_| ClusterError::TimedOut {
                op: "flush",
                after: self.timeout(),
            })?
            .map_err(|source| ClusterError::Flush { source })
    }
}

/// What starts a fenced record: the epoch follows.
pub const FENCED_MAGIC: &[u8] = b"gdE1";

/// A fenced record's value, without its fence (the whole record if it has
/// none): what a reader of the KV bucket itself needs.
pub fn unfenced(record: &Bytes) -> Bytes {
    record.slice(fenced_epoch(record).1..)
}

/// The epoch a record was written under and where its value starts (epoch
/// 0 and the whole record when it is not fenced).
fn fenced_epoch(record: &[u8]) -> (u64, usize) {
    let head = FENCED_MAGIC.len();
    match record.get(head..head + 8) {
        Some(epoch) if record.starts_with(FENCED_MAGIC) => {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(epoch);
            (u64::from_be_bytes(bytes), head + 8)
        }
        _ => (0, 0),
    }
}

/// How long the NATS client waits before its `attempts`-th try to
/// reconnect (each server tried counts one): at once, then doubling from
/// 2 ms, at most `most` (the op timeout). async-nats's own backoff reaches
/// 4 s; through an outage of a few seconds it gets there, and a node then
/// noticed NATS's return up to 4 s late, when its peers may have rejoined
/// and its clients wait on it.
fn reconnect_delay(attempts: usize, most: Duration) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let exponent = u32::try_from(attempts - 1).unwrap_or(u32::MAX).min(20);
    Duration::from_millis(1u64 << exponent).min(most)
}

async fn latest_value(store: &kv::Store, key: &str, timeout: Duration) -> Result<Option<Bytes>> {
    Ok(read(store, key, timeout)
        .await?
        .filter(|e| e.op == KvOp::Put)
        .map(|e| e.value))
}

async fn bucket(
    js: &jetstream::Context,
    config: &ClusterConfig,
    kind: &str,
    limit_markers: Option<Duration>,
    max_age: Duration,
) -> Result<kv::Store> {
    let name = config.bucket(kind);
    js.create_or_update_key_value(kv::Config {
        bucket: name.clone(),
        history: 1,
        num_replicas: config.replicas,
        storage: StorageType::File,
        limit_markers,
        max_age,
        ..Default::default()
    })
    .await
    .map_err(|source| ClusterError::Bucket {
        bucket: name,
        source,
    })
}

/// The live-node set, kept current from the lease bucket's watch.
pub struct MemberWatch {
    bucket: String,
    inner: kv::Watch,
    seen_at: Instant,
    membership: Membership,
}

impl MemberWatch {
    /// The next join or leave. `None` when the watch ended (connection
    /// closed for good).
    pub async fn next(&mut self) -> Option<Result<MemberEvent>> {
        loop {
            match self.inner.next().await? {
                Err(source) => {
                    return Some(Err(ClusterError::Watcher {
                        bucket: self.bucket.clone(),
                        source,
                    }))
                }
                Ok(entry) => {
                    self.seen_at = Instant::now();
                    if let Some(event) = self.membership.apply(&entry.into()) {
                        return Some(Ok(event));
                    }
                }
            }
        }
    }

    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// When the watch last delivered an entry (renewals included). Every
    /// live node renews its lease, so a long silence means the watch's
    /// consumer stalled (it lived on a NATS node that died).
    pub fn seen_at(&self) -> Instant {
        self.seen_at
    }
}

/// Every shard's claim, kept current from the claims bucket's watch.
pub struct ClaimWatch {
    bucket: String,
    shard_count: u32,
    inner: kv::Watch,
    seen_at: Instant,
    table: ClaimTable,
}

impl ClaimWatch {
    /// The next change of a shard's claim.
    pub async fn next(&mut self) -> Option<Result<(ShardId, ClaimState)>> {
        loop {
            match self.inner.next().await? {
                Err(source) => {
                    return Some(Err(ClusterError::Watcher {
                        bucket: self.bucket.clone(),
                        source,
                    }))
                }
                Ok(entry) => {
                    self.seen_at = Instant::now();
                    if let Some(change) = self.table.apply(&entry.into(), self.shard_count) {
                        return Some(Ok(change));
                    }
                }
            }
        }
    }

    pub fn table(&self) -> &ClaimTable {
        &self.table
    }

    /// When the watch last delivered an entry (see [`MemberWatch::seen_at`]).
    pub fn seen_at(&self) -> Instant {
        self.seen_at
    }
}

#[cfg(test)]
mod tests {
    use super::reconnect_delay;
    use std::time::Duration;

    /// Reconnects come at once, then doubling, and never further apart than
    /// the op timeout, however long NATS was away.
    #[test]
    fn reconnects_come_at_most_an_op_timeout_apart() {
        let most = Duration::from_millis(500);
        assert_eq!(reconnect_delay(0, most), Duration::ZERO);
        assert_eq!(reconnect_delay(1, most), Duration::ZERO);
        assert_eq!(reconnect_delay(2, most), Duration::from_millis(2));
        assert_eq!(reconnect_delay(9, most), Duration::from_millis(256));
        assert_eq!(reconnect_delay(10, most), most);
        assert_eq!(reconnect_delay(usize::MAX, most), most);
    }
}
