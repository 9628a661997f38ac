//! What this node's owners send its own edge, in process: the views and
//! truths they publish, answers to the edge's requests, and group counts.
//! Each is queued by the owner and delivered once the owner's step
//! returns, in order: the owner never calls into the edge, as a remote
//! owner cannot.

use super::wire::{FromOwner, GroupCounts, ShardView};
use super::ClusterLink;
use greendot_core::Millis;
use std::time::Instant;

#[derive(Debug)]
pub(super) enum ToEdge {
    /// A view or truth published at `at` (the copy NATS brings back is
    /// dropped by version).
    View { at: Millis, view: ShardView },
    /// The answer to the edge's request `id` (see `Shared::loopback`).
    Answer {
        id: u64,
        answer: FromOwner,
        now: Instant,
        at: Millis,
    },
    /// Counts of groups homed at one of this node's shards.
    Counts(GroupCounts),
    /// The owner of `shard` read a user from its KV: what it answered
    /// `Loading` may be asked again.
    Loaded {
        shard: u32,
        now: Instant,
        at: Millis,
    },
}

impl ClusterLink {
    /// Hands the edge what this node's owners sent it. An answer may pump
    /// the device's next input to its owner, which queues more: the loop
    /// takes those too.
    pub(super) fn deliver_local(&mut self) {
        while let Some(msg) = self.shared.to_edge.pop_front() {
            match msg {
                ToEdge::View { at, view } => {
                    self.edge
                        .apply_view(at, &view.user, view.own, view.presence.to_core());
                }
                ToEdge::Answer {
                    id,
                    answer,
                    now,
                    at,
                } => self.take_answer(now, at, id, Some(answer)),
                ToEdge::Counts(counts) => self.take_group_counts(counts),
                ToEdge::Loaded { shard, now, at } => self.loaded_here(shard, now, at),
            }
        }
    }

    /// Every step delivers what it queued before it returns: a message
    /// left here would reach the edge late, or never.
    #[cfg(any(test, feature = "check"))]
    pub(super) fn check_delivered(&self) {
        assert!(
            self.shared.to_edge.is_empty(),
            "owners' messages left undelivered: {:?}",
            self.shared.to_edge
        );
    }
}
