//! Views from owners at the edge: applied to the local sessions, their
//! numbers tracked per shard (and the truths' per edge), so a view missed
//! (a gap, or a beacon ahead) is asked for again.

use crate::cluster::edge::devices::InFlight;
use crate::cluster::edge::Edge;
use crate::cluster::wire::{decode, Beacon, ShardView, ToOwner};
use crate::cluster::DetMap;
use crate::cluster::{
    ClusterLink, ClusterOutput, RequestKind, BEACON_EVERY, MAX_BEACON_SHARDS, MAX_BEACON_TRUTHS,
    MAX_SNAPSHOT_TARGETS, RETRY_AFTER,
};
use greendot_core::{Millis, Presence, UserId};
use greendot_proto as proto;
use std::time::Instant;

/// What an edge knows of the views of a shard some local session watches.
#[derive(Debug, Default)]
pub(in crate::cluster) struct ShardTrack {
    /// (epoch, seq) of the newest view of the shard taken from its subject,
    /// or announced by a beacon, or of the owner's answer that came first.
    seen: Option<(u64, u64)>,
    /// A view was missed: the views of every target watched here are asked
    /// for again.
    gap: bool,
    /// Repair requests out.
    pub(in crate::cluster) asking: u32,
    /// Not before this (after a failed repair).
    pub(in crate::cluster) not_before: Option<Instant>,
    /// Repairs failed in a row: each waits twice as long as the one before,
    /// up to a beacon interval (a dead owner's shards are silent until its
    /// lease lapses, and nobody answers for them until then).
    failed: u32,
    /// When the shard's owner was last heard of: a view on the shard's
    /// subject, a beacon naming the shard at or past `seen`, an answer.
    heard: Option<Millis>,
}

/// A watched shard whose owner is not heard of for this long (beacons go
/// every second) counts as missed: its owner may have been cut off right
/// after a view this edge lost, with no later view or beacon to show the
/// gap, so what this edge holds of the shard's users is no answer until
/// an owner answers again.
pub(in crate::cluster) const STALE_AFTER: Millis = Millis(3_000);

impl ClusterLink {
    pub(in crate::cluster) fn watch_shard(&mut self, shard: u32) {
        let n = self.edge.shard_watchers.entry(shard).or_insert(0);
        *n += 1;
        if *n == 1 {
            self.edge.tracks.insert(shard, ShardTrack::default());
            self.shared
                .outputs
                .push_back(ClusterOutput::Watch { shard });
        }
    }

    pub(in crate::cluster) fn unwatch_shard(&mut self, shard: u32) {
        if let Some(n) = self.edge.shard_watchers.get_mut(&shard) {
            *n -= 1;
            if *n == 0 {
                self.edge.shard_watchers.remove(&shard);
                self.edge.tracks.remove(&shard);
                self.shared
                    .outputs
                    .push_back(ClusterOutput::Unwatch { shard });
            }
        }
    }

    /// A view from NATS: on `shard`'s subject (views, and the truths older
    /// owners sent there), or on this edge's subject (`None`: truths only).
    pub(in crate::cluster) fn view_message(
        &mut self,
        at: Millis,
        payload: &[u8],
        shard: Option<u32>,
    ) {
        match decode::<ShardView>(payload) {
            Some(v)
                if v.user.len() <= self.shared.max_name_len
                    && v.presence
                        .message
                        .as_ref()
                        .is_none_or(|m| m.len() <= self.shared.owner_config.max_message_len)
                    && shard.map_or(v.own, |s| self.shared.shard(&v.user) == s) =>
            {
                match (shard, v.own) {
                    (Some(shard), false) => self.track_view(shard, v.epoch, v.seq, at),
                    (None, true) if v.seq > 0 => {
                        let shard = self.shared.shard(&v.user);
                        self.track_truth(shard, v.epoch, v.seq, false);
                    }
                    _ => {}
                }
                let presence = v.presence.to_core();
                if self.edge.apply_view(at, &v.user, v.own, presence.clone()) {
                    self.shared.counters.views_applied += 1;
                    if self.edge.latencies.len() < 1024 {
                        self.edge
                            .latencies
                            .push_back(at.0.saturating_sub(v.published_ms));
                    }
                }
                self.edge.keep_early(&v.user, v.own, presence);
            }
            _ => self.shared.counters.malformed += 1,
        }
    }

    /// Status messages of an owner's answer within the limit.
    pub(in crate::cluster) fn messages_fit(&self, presences: &[proto::Presence]) -> bool {
        presences.iter().all(|p| {
            p.message
                .as_ref()
                .is_none_or(|m| m.len() <= self.shared.owner_config.max_message_len)
        })
    }

    /// View `seq` of `epoch` came on `shard`'s subject. Views of an epoch
    /// come in order from its one owner; a new owner numbers from 1.
    fn track_view(&mut self, shard: u32, epoch: u64, seq: u64, at: Millis) {
        let Some(t) = self.edge.tracks.get_mut(&shard) else {
            return;
        };
        t.heard = Some(at);
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

    /// This node was cut off from the bus: views and truths published
    /// meanwhile never reached it, and a later view under a newer epoch
    /// does not show the gap (its numbers start again), so every shard
    /// watched here is repaired.
    pub(in crate::cluster) fn missed_all(&mut self) {
        let shards: Vec<u32> = self.edge.tracks.keys().copied().collect();
        for shard in shards {
            self.missed(shard);
        }
        for t in self.edge.truth_tracks.values_mut().filter(|t| !t.gap) {
            t.gap = true;
            self.edge.gaps = true;
            self.shared.counters.truth_gaps += 1;
        }
    }

    /// A view of `shard` may have been missed: repaired at the next tick.
    fn missed(&mut self, shard: u32) {
        if let Some(t) = self.edge.tracks.get_mut(&shard).filter(|t| !t.gap) {
            t.gap = true;
            self.edge.gaps = true;
            self.shared.counters.view_gaps += 1;
        }
    }

    /// A truth of a user of `shard` numbered `(epoch, seq)` came (or a
    /// beacon names it, `announced`): one skipped, or one announced that
    /// never came, means this edge missed a truth, and the truths of its
    /// users of the shard are asked for again.
    fn track_truth(&mut self, shard: u32, epoch: u64, seq: u64, announced: bool) {
        let t = self.edge.truth_tracks.entry(shard).or_default();
        let missed = match t.seen {
            // The first heard of: only a beacon says one was missed.
            None => announced,
            Some(seen) if (epoch, seq) <= seen => false,
            Some((e, s)) => announced || !((epoch == e && seq == s + 1) || (epoch > e && seq == 1)),
        };
        t.seen = t.seen.max(Some((epoch, seq)));
        if missed && !t.gap {
            t.gap = true;
            self.edge.gaps = true;
            self.shared.counters.truth_gaps += 1;
        }
    }

    /// The owner of `shard` answered with the views up to `(epoch, seq)`.
    /// An answer older than a view seen since may miss what that view
    /// carried, when it was about a target being subscribed and the view
    /// was lost: the shard is asked again.
    pub(in crate::cluster) fn track_answer(
        &mut self,
        shard: u32,
        epoch: u64,
        seq: u64,
        at: Millis,
    ) {
        let Some(t) = self.edge.tracks.get_mut(&shard) else {
            return;
        };
        t.heard = Some(at);
        match t.seen {
            None => t.seen = Some((epoch, seq)),
            Some(seen) if seen > (epoch, seq) => self.missed(shard),
            _ => {}
        }
    }

    /// A message on the beacon subject, checked against the limits.
    pub(in crate::cluster) fn beacon_message(&mut self, payload: &[u8], at: Millis) {
        match decode::<Beacon>(payload) {
            Some(b)
                if b.owner.len() <= self.shared.max_name_len
                    && b.shards.len() <= MAX_BEACON_SHARDS
                    && b.truths.len() <= MAX_BEACON_TRUTHS
                    && b.truths
                        .iter()
                        .all(|t| t.0.len() <= self.shared.max_name_len) =>
            {
                self.beacon(b, at)
            }
            _ => self.shared.counters.malformed += 1,
        }
    }

    fn beacon(&mut self, b: Beacon, at: Millis) {
        for (edge, shard, epoch, seq) in b.truths {
            if edge == self.shared.settings.node && shard < self.shared.settings.shard_count {
                self.track_truth(shard, epoch, seq, true);
            }
        }
        for (shard, epoch, seq) in b.shards {
            let Some(t) = self.edge.tracks.get_mut(&shard) else {
                continue;
            };
            // Not seen anything yet: the pending subscribe's answer will
            // carry the owner's number. The owner is heard of all the same.
            let Some(seen) = t.seen else {
                t.heard = Some(at);
                continue;
            };
            if (epoch, seq) >= seen {
                t.heard = Some(at);
            }
            if (epoch, seq) > seen {
                t.seen = Some((epoch, seq));
                self.missed(shard);
            }
        }
    }

    /// Asks the owners of shards with a view missed for the views of every
    /// target watched here (and of those being subscribed).
    pub(in crate::cluster) fn repair_gaps(&mut self, now: Instant, at: Millis) {
        self.mark_stale(at);
        if !self.edge.gaps {
            return;
        }
        for own in [false, true] {
            let due: DetMap<u32, Vec<String>> = self
                .edge
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
        self.edge.gaps = self
            .edge
            .tracks
            .values()
            .chain(self.edge.truth_tracks.values())
            .any(|t| t.gap);
    }

    /// Watched shards whose owner was not heard of for [`STALE_AFTER`]
    /// count as missed (see there).
    fn mark_stale(&mut self, at: Millis) {
        let mut marked = 0;
        for t in self.edge.tracks.values_mut() {
            if !t.gap && t.asking == 0 && t.heard.is_some_and(|h| at >= h.plus(STALE_AFTER)) {
                t.gap = true;
                marked += 1;
            }
        }
        if marked > 0 {
            self.edge.gaps = true;
            self.shared.counters.silent_shards += marked;
        }
    }

    /// Asks for the views of every target of the `due` shards (`own`: the
    /// truths of every user of them with a session here).
    fn ask_repairs(
        &mut self,
        mut due: DetMap<u32, Vec<String>>,
        own: bool,
        now: Instant,
        at: Millis,
    ) {
        let names: Vec<String> = if own {
            self.edge.open.values().cloned().collect()
        } else {
            let watched = self
                .edge
                .fanout
                .watched()
                .filter_map(|u| self.edge.names.name(u.0).map(|n| n.to_string()));
            let subscribing = self
                .edge
                .subscribes
                .values()
                .filter(|p| !p.query)
                .flat_map(|p| p.targets.iter().map(|(t, _)| t.clone()));
            watched.chain(subscribing).collect()
        };
        let (shard_of, count) = (
            self.shared.settings.shard_of,
            self.shared.settings.shard_count,
        );
        for name in names {
            if let Some(targets) = due.get_mut(&shard_of(&name, count)) {
                targets.push(name);
            }
        }
        for (shard, mut targets) in due {
            targets.sort_unstable();
            targets.dedup();
            if let Some(t) = self.edge.shard_tracks(own).get_mut(&shard) {
                t.gap = false;
                t.not_before = None;
            }
            for chunk in targets.chunks(MAX_SNAPSHOT_TARGETS) {
                if let Some(t) = self.edge.shard_tracks(own).get_mut(&shard) {
                    t.asking += 1;
                }
                let targets = chunk.to_vec();
                let msg = ToOwner::Views {
                    targets: targets.clone(),
                    own,
                };
                let waiting = InFlight::Repair {
                    shard,
                    targets,
                    own,
                };
                self.ask_owner((now, at), waiting, shard, RequestKind::Snapshot, msg);
            }
        }
    }

    pub(in crate::cluster) fn repair_failed(&mut self, shard: u32, own: bool, now: Instant) {
        self.shared.counters.retries += 1;
        if let Some(t) = self.edge.shard_tracks(own).get_mut(&shard) {
            let wait = RETRY_AFTER.saturating_mul(1 << t.failed.min(4));
            t.failed = t.failed.saturating_add(1);
            t.gap = true;
            t.not_before = Some(now + wait.min(BEACON_EVERY));
            self.edge.gaps = true;
        }
    }

    /// `published`: the shard's last view when the owner answered.
    pub(in crate::cluster) fn repaired(
        &mut self,
        shard: u32,
        targets: &[String],
        presences: Vec<Presence>,
        published: (u64, u64),
        own: bool,
        at: Millis,
    ) {
        for (target, presence) in targets.iter().zip(presences) {
            self.edge.apply_view(at, target, own, presence.clone());
            self.edge.keep_early(target, own, presence);
        }
        if let Some(t) = self.edge.shard_tracks(own).get_mut(&shard) {
            t.failed = 0;
            if !own {
                // Views up to the answer's are in it.
                t.seen = t.seen.max(Some(published));
                t.heard = Some(at);
            }
        }
    }
}

impl Edge {
    /// A view of a target some subscribe here still waits the snapshot of.
    pub(in crate::cluster) fn keep_early(&mut self, user: &str, own: bool, presence: Presence) {
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

    /// A view from an owner (remote, or this node's own in process) for the
    /// local sessions that watch `user`.
    pub(in crate::cluster) fn apply_view(
        &mut self,
        at: Millis,
        user: &str,
        own: bool,
        presence: Presence,
    ) -> bool {
        let Some(id) = self.names.get(user) else {
            return false; // nobody here watches
        };
        self.fanout.apply(at, UserId(id), own, presence)
    }

    /// Whether this edge knows it may lack a view of `shard` (a gap, or an
    /// owner silent for [`STALE_AFTER`], not repaired yet): what it holds
    /// of the shard's users is no answer.
    pub(in crate::cluster) fn behind_on(&self, shard: u32) -> bool {
        self.tracks
            .get(&shard)
            .is_some_and(|t| t.gap || t.asking > 0)
    }

    /// What this edge knows of the views (`own`: of the truths) of shards.
    pub(in crate::cluster) fn shard_tracks(&mut self, own: bool) -> &mut DetMap<u32, ShardTrack> {
        if own {
            &mut self.truth_tracks
        } else {
            &mut self.tracks
        }
    }
}
