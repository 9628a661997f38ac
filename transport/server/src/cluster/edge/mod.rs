//! The edge: what serves this node's sessions. Their devices' inputs go to
//! the owners of their users' shards (`devices`), the views of the users
//! they watch come back and are fanned out to them (`views`, `subscribe`),
//! their records let them resume on another node (`records`), and groups'
//! counts and member pages reach them (`group_feed`, `group_pages`).

pub(in crate::cluster) mod devices;
pub(in crate::cluster) mod group_feed;
pub(in crate::cluster) mod group_pages;
pub(in crate::cluster) mod records;
pub(in crate::cluster) mod subscribe;
pub(in crate::cluster) mod views;

use crate::cluster::{DetMap, DetSet};
use crate::hub::{GroupFeed, Interner};
use devices::{EdgeDevice, PendingRoute};
use greendot_core::{Config, Fanout, SessionId};
use group_pages::PendingPage;
use records::{PendingResume, SessionSync};
use std::collections::VecDeque;
use subscribe::PendingSubscribe;
use views::ShardTrack;

/// What serves this node's sessions: their devices and the fanout of views
/// to them, the shards they watch, their records for resume, and the
/// requests they wait on.
pub(in crate::cluster) struct Edge {
    pub(in crate::cluster) fanout: Fanout,
    pub(in crate::cluster) names: Interner,
    /// The edge's devices by session, while their inputs are forwarded.
    pub(in crate::cluster) devices: DetMap<SessionId, EdgeDevice>,
    /// Sessions open in the fanout, with their user (whose name they hold a
    /// reference on).
    pub(in crate::cluster) open: DetMap<SessionId, String>,
    /// Shards some local subscription watches, with how many.
    pub(in crate::cluster) shard_watchers: DetMap<u32, u32>,
    /// The view numbers seen of each watched shard (the same keys).
    pub(in crate::cluster) tracks: DetMap<u32, ShardTrack>,
    /// The numbers of the truths this edge was sent, per shard (at most
    /// one entry per shard).
    pub(in crate::cluster) truth_tracks: DetMap<u32, ShardTrack>,
    /// Per shard, the newest epoch whose resync request this edge answered
    /// (a new owner sends it again while its window is open).
    pub(in crate::cluster) resynced: DetMap<u32, u64>,
    /// Some track has a gap to repair (what the tick looks at).
    pub(in crate::cluster) gaps: bool,
    pub(in crate::cluster) subscribes: DetMap<u64, PendingSubscribe>,
    /// Subscribes this node's own owner of a shard answered `Loading`, by
    /// shard: asked again as soon as that owner has read a user, not after
    /// `RETRY_AFTER`.
    pub(in crate::cluster) awaiting_load: DetMap<u32, Vec<u64>>,
    pub(in crate::cluster) routes: DetMap<u64, PendingRoute>,
    /// Member pages whose keys are asked of their group's aggregator.
    pub(in crate::cluster) pages: DetMap<u64, PendingPage>,
    /// Members followed for watched pages read but not yet handed to the
    /// hub's core, with how many such reads hold each.
    pub(in crate::cluster) page_reads: DetMap<String, u32>,
    /// Local sessions' KV records, and the puts in flight by id.
    pub(in crate::cluster) records: DetMap<SessionId, SessionSync>,
    pub(in crate::cluster) record_puts: DetMap<u64, SessionId>,
    /// Sessions whose put failed: tried again at the tick.
    pub(in crate::cluster) record_retries: DetSet<SessionId>,
    /// Record reads for resumes, by id.
    pub(in crate::cluster) resumes: DetMap<u64, PendingResume>,
    /// Devices with inputs queued or a retry pending: what the tick looks at.
    pub(in crate::cluster) busy: DetSet<SessionId>,
    pub(in crate::cluster) next_conn: u64,
    /// A pump runs: pumps it causes (an op handled by this node's own
    /// owner, answered at once) wait here and run after it, in a loop,
    /// not nested: nested, a device whose ops keep being answered in
    /// process would grow the stack without a bound.
    pub(in crate::cluster) pumping: bool,
    pub(in crate::cluster) pump_later: VecDeque<SessionId>,
    /// Publish-to-fanout delays of remote views taken, in milliseconds.
    pub(in crate::cluster) latencies: VecDeque<u64>,
    pub(in crate::cluster) max_subscriptions: usize,
    /// What the hub's core learns of groups (`group_edge`).
    pub(in crate::cluster) group_feed: VecDeque<GroupFeed>,
    /// The newest count of each group: version and count.
    pub(in crate::cluster) fed_counts: DetMap<u64, (u64, u32)>,
}

impl Edge {
    /// Something of the edge is looked at by the tick: devices with
    /// inputs queued, requests waiting, records to put again, gaps to
    /// repair, or watched shards (an owner gone silent is noticed at a
    /// tick).
    pub(in crate::cluster) fn waits_on_tick(&self) -> bool {
        !self.busy.is_empty()
            || !self.subscribes.is_empty()
            || !self.routes.is_empty()
            || !self.pages.is_empty()
            || !self.record_retries.is_empty()
            || !self.resumes.is_empty()
            || self.gaps
            || !self.tracks.is_empty()
    }

    pub(in crate::cluster) fn new(config: &Config) -> Edge {
        Edge {
            fanout: Fanout::new(config.batch_interval),
            names: Interner::new(config.max_users.saturating_mul(2)),
            devices: DetMap::default(),
            open: DetMap::default(),
            shard_watchers: DetMap::default(),
            tracks: DetMap::default(),
            truth_tracks: DetMap::default(),
            resynced: DetMap::default(),
            gaps: false,
            subscribes: DetMap::default(),
            awaiting_load: DetMap::default(),
            routes: DetMap::default(),
            pages: DetMap::default(),
            page_reads: DetMap::default(),
            records: DetMap::default(),
            record_puts: DetMap::default(),
            record_retries: DetSet::default(),
            resumes: DetMap::default(),
            busy: DetSet::default(),
            next_conn: 0,
            pumping: false,
            pump_later: VecDeque::new(),
            latencies: VecDeque::new(),
            max_subscriptions: config.max_subscriptions_per_session,
            group_feed: VecDeque::new(),
            fed_counts: DetMap::default(),
        }
    }

    pub(in crate::cluster) fn drop_name(&mut self, user: &str) {
        if let Some(id) = self.names.get(user) {
            if self.names.drop_ref(id) == 0 {
                self.names.remove(id);
            }
        }
    }

    pub(in crate::cluster) fn next_conn(&mut self) -> u64 {
        self.next_conn += 1;
        self.next_conn
    }
}
