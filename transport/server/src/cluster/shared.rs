//! What the edge and the owned shards share: the settings, the request ids,
//! the requests out, the outputs to the NATS I/O, the counters, the group
//! directory, and what the owners send this node's edge.

use super::edge::devices::InFlight;
use super::group_dir::GroupDirectory;
use super::to_edge::ToEdge;
use super::{
    ClusterCounters, ClusterOutput, ClusterSettings, DetMap, RequestKind, MAX_MESSAGE,
    MAX_SNAPSHOT_TARGETS,
};
use bytes::Bytes;
use greendot_core::{Config, Millis};
use std::collections::VecDeque;
use std::time::Instant;

pub(super) struct Shared {
    pub(super) settings: ClusterSettings,
    /// The core's configuration as owners use it (heartbeats off).
    pub(super) owner_config: Config,
    /// The Unix time of the core's `Millis(0)`.
    pub(super) unix_base_ms: u64,
    pub(super) max_name_len: usize,
    pub(super) next_id: u64,
    /// Requests out, with when they count as unanswered (an output the NATS
    /// I/O dropped is never answered).
    pub(super) in_flight: DetMap<u64, (InFlight, Instant)>,
    pub(super) outputs: VecDeque<ClusterOutput>,
    pub(super) counters: ClusterCounters,
    /// The cluster's groups and this node's writes of them.
    pub(super) groups: GroupDirectory,
    /// What this node's owners send its own edge, delivered in process
    /// once the owner's step returns (see `ClusterLink::deliver_local`).
    pub(super) to_edge: VecDeque<ToEdge>,
}

impl Shared {
    pub(super) fn shard(&self, user: &str) -> u32 {
        (self.settings.shard_of)(user, self.settings.shard_count)
    }

    pub(super) fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// A request to `shard`'s owner, waited for until the request timeout.
    pub(super) fn request(
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

    /// A request to this node's own owner, waited for as one over NATS is:
    /// its id, for the owner's `ReplyTo::Loopback`.
    pub(super) fn loopback(&mut self, now: Instant, waiting: InFlight) -> u64 {
        let id = self.id();
        let deadline = now + self.settings.request_timeout;
        self.in_flight.insert(id, (waiting, deadline));
        id
    }

    pub(super) fn to_unix(&self, at: Millis) -> u64 {
        self.unix_base_ms.saturating_add(at.0)
    }

    /// Keys one answer holds at most, every name at its longest.
    pub(super) fn page_keys_that_fit(&self) -> usize {
        let key = self.max_name_len + 12;
        (MAX_MESSAGE / 2 / key).clamp(1, MAX_SNAPSHOT_TARGETS)
    }
}
