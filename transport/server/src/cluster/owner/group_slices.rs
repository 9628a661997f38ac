//! A shard owner's share of group counts across a cluster (issue 28,
//! docs/groups.md "Across a cluster").
//!
//! Each owner core holds the **slice** of every group in its shard: the
//! group's members whose user is in the shard, written with
//! `handle_set_group` from the directory every node keeps. The core counts
//! the slice from its published views as one node counts a whole group,
//! and notes each group whose online members change. The owner sends the
//! group's **partial** to the owner of the group's home shard: the
//! ordinals (the definition's) of the slice's members shown online, an
//! absolute set tagged with the owner's epoch and a sequence number, at
//! once after a quiet second and at most once a second while it changes.
//! It sends nothing while the previous owner's record is being read (its
//! users are not restored yet, so the partial would be too low), and sends
//! every partial again when the home shard gets a new owner (its resync
//! request), which holds none.
//!
//! Slice members' names hold a reference in the owner's names, so a member
//! freed while idle keeps her id, and the slice counts her when she comes
//! back.

use crate::cluster::edge::devices::InFlight;
use crate::cluster::owner::shard::{forget_user_if_unknown, Owner};
use crate::cluster::owner::OwnedShards;
use crate::cluster::shared::Shared;
use crate::cluster::wire::{encode, FromOwner, GroupPartial, ToOwner, GROUPS_SINCE};
use crate::cluster::{ClusterLink, DetMap, GroupDef, RequestKind, MAX_MESSAGE, RETRY_AFTER};
use greendot_core::{GroupId, Millis, UserId};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// A group's partial goes at most this often while it changes.
pub(in crate::cluster) const PARTIAL_EVERY: Duration = Duration::from_secs(1);

/// The bytes of partials one request carries at most (a partial of a
/// 10,000-member slice is at most 50 KB of ordinals).
const PARTIALS_BYTES: usize = MAX_MESSAGE / 2;

/// The name whose shard is group `group`'s home shard (its sum's owner).
pub fn home_key(group: u64) -> String {
    format!("group/{group}")
}

/// A slice: each member's name id in the owner's names, with her ordinal.
pub(in crate::cluster) type Slice = BTreeMap<u64, u32>;

/// When a group's partial goes next.
#[derive(Debug, Default)]
pub(in crate::cluster) struct PartialState {
    last_sent: Option<Instant>,
    due: Option<Instant>,
}

impl PartialState {
    /// Due at once after a quiet [`PARTIAL_EVERY`], else a second after the
    /// last went; an earlier due time stays.
    fn mark(&mut self, now: Instant) {
        let at = self
            .last_sent
            .map_or(now, |last| (last + PARTIAL_EVERY).max(now));
        earliest(&mut self.due, at);
    }
}

/// `slot` becomes `at` if that is earlier (or it held none).
fn earliest(slot: &mut Option<Instant>, at: Instant) {
    *slot = Some(slot.map_or(at, |t| t.min(at)));
}

/// The name of `uid` no longer held by a slice: freed if nothing else
/// holds it.
fn release_slice_name(o: &mut Owner, uid: u64) {
    if o.users.drop_ref(uid) == 0 {
        forget_user_if_unknown(o, uid);
    }
}

impl ClusterLink {
    /// Whether the cluster's protocol carries groups.
    pub fn serves_groups(&self) -> bool {
        self.shared.serves_groups()
    }
}

/// `items` cut into runs of at most `limit` bytes by `size`'s estimate (an
/// item larger than the limit goes alone).
pub(in crate::cluster) fn batches<T>(
    items: Vec<T>,
    limit: usize,
    size: impl Fn(&T) -> usize,
) -> Vec<Vec<T>> {
    let mut out: Vec<Vec<T>> = Vec::new();
    let mut bytes = usize::MAX;
    for item in items {
        let n = size(&item);
        if bytes.saturating_add(n) > limit {
            out.push(Vec::new());
            bytes = 0;
        }
        bytes += n;
        if let Some(last) = out.last_mut() {
            last.push(item);
        }
    }
    out
}

/// Partial states by group, kept by each owner.
pub(in crate::cluster) type Partials = DetMap<u64, PartialState>;

impl OwnedShards {
    /// Writes the slice of `group` into the core of `shard`'s owner.
    pub(in crate::cluster) fn set_slice(
        &mut self,
        shard: u32,
        group: u64,
        slice: Vec<(String, u32)>,
        at: Millis,
    ) {
        let Some(o) = self.owners.get_mut(&shard) else {
            return;
        };
        if slice.is_empty() && !o.slices.contains_key(&group) {
            return;
        }
        let mut new = Slice::new();
        for (name, ordinal) in slice {
            let Some(uid) = o.users.intern(&name) else {
                // The owner's names are full: the member is not counted
                // until a write of the group finds room.
                tracing::warn!(
                    group,
                    shard,
                    "no room for a group member's name at its owner"
                );
                continue;
            };
            if new.insert(uid, ordinal).is_none() {
                o.users.acquire(uid);
            }
        }
        let ids: Vec<UserId> = new.keys().map(|&u| UserId(u)).collect();
        let id = GroupId(group);
        let written = if ids.is_empty() {
            match o.core.handle_remove_group(at, id) {
                Err(greendot_core::Error::UnknownGroup) => Ok(()),
                other => other,
            }
        } else {
            o.core.handle_set_group(at, id, &ids, &[]).map(|_| ())
        };
        if let Err(e) = written {
            // Over the owner core's limits (a node of lower limits than
            // the writer's): the previous slice stays.
            tracing::warn!(group, shard, error = %e, "a group's slice was not taken");
            for uid in new.into_keys() {
                release_slice_name(o, uid);
            }
            return;
        }
        let old = if new.is_empty() {
            o.slices.remove(&group)
        } else {
            o.slices.insert(group, new)
        };
        for uid in old.into_iter().flat_map(Slice::into_keys) {
            release_slice_name(o, uid);
        }
    }

    /// Some partial is due at `at` or before: the tick sends it.
    pub(in crate::cluster) fn partial_due_by(&mut self, at: Instant) {
        earliest(&mut self.partials_next, at);
    }

    /// Gives the owners of `shards` the slice of every group (a claim won,
    /// or the directory's first pass done), in one pass over the directory.
    pub(in crate::cluster) fn load_slices(
        &mut self,
        sh: &mut Shared,
        shards: &[u32],
        now: Instant,
        at: Millis,
    ) {
        if !sh.serves_groups() || !sh.groups.is_synced() || shards.is_empty() {
            return;
        }
        let taken: BTreeSet<u32> = shards.iter().copied().collect();
        let mut slices = Vec::new();
        for def in sh.groups.live_defs() {
            for (shard, slice) in self.slices_of(sh, def, |s| taken.contains(&s)) {
                slices.push((shard, def.group, slice));
            }
        }
        for (shard, group, slice) in slices {
            self.set_slice(shard, group, slice, at);
        }
        for &shard in shards {
            self.note_changed_groups(shard, now);
        }
    }

    /// A definition changed: the slices this node's owners hold of it
    /// follow (an empty slice, or a removed group, is no slice).
    pub(in crate::cluster) fn slices_follow(
        &mut self,
        sh: &mut Shared,
        group: u64,
        now: Instant,
        at: Millis,
    ) {
        if !sh.serves_groups() || !sh.groups.is_synced() {
            return;
        }
        let mut slices: BTreeMap<u32, Vec<(String, u32)>> =
            self.owners.keys().map(|s| (*s, Vec::new())).collect();
        if let (_, Some(def)) = sh.groups.get(group) {
            if !def.removed {
                slices.extend(self.slices_of(sh, def, |s| self.owners.contains_key(&s)));
            }
        }
        for (shard, slice) in slices {
            self.set_slice(shard, group, slice, at);
            self.note_changed_groups(shard, now);
        }
    }

    /// The members of `def` in each shard `wanted` picks (those with any),
    /// with their ordinals.
    pub(in crate::cluster) fn slices_of(
        &self,
        sh: &Shared,
        def: &GroupDef,
        wanted: impl Fn(u32) -> bool,
    ) -> BTreeMap<u32, Vec<(String, u32)>> {
        let (shard_of, count) = (sh.settings.shard_of, sh.settings.shard_count);
        let mut slices: BTreeMap<u32, Vec<(String, u32)>> = BTreeMap::new();
        for (name, ordinal) in &def.members {
            let shard = shard_of(name, count);
            if wanted(shard) {
                slices
                    .entry(shard)
                    .or_default()
                    .push((name.clone(), *ordinal));
            }
        }
        slices
    }

    /// The groups whose slice changed at `shard`'s core since last asked
    /// get their partial due.
    pub(in crate::cluster) fn note_changed_groups(&mut self, shard: u32, now: Instant) {
        let Some(o) = self.owners.get_mut(&shard) else {
            return;
        };
        let changed = o.core.take_changed_groups();
        for group in &changed {
            o.partials.entry(group.0).or_default().mark(now);
        }
        if !changed.is_empty() {
            self.partial_due_by(now);
        }
    }

    /// The home shard `home` has a new owner, which holds no partial: every
    /// slice homed there is due again.
    pub(in crate::cluster) fn home_changed(&mut self, sh: &mut Shared, home: u32, now: Instant) {
        let mutant = sh.settings.mutant == Some(crate::cluster::LinkMutant::PartialsNotResent);
        if !sh.serves_groups() || mutant {
            return;
        }
        let shards: Vec<u32> = self.owners.keys().copied().collect();
        for shard in shards {
            let homed: Vec<u64> = self.owners[&shard]
                .slices
                .keys()
                .copied()
                .filter(|g| sh.home_shard(*g) == home)
                .collect();
            // Only an owner with such a slice is touched (and indexed again).
            if let Some(o) = self.owners.get_mut(&shard).filter(|_| !homed.is_empty()) {
                for group in homed {
                    o.partials.entry(group).or_default().mark(now);
                }
            }
        }
        self.partial_due_by(now);
    }

    /// Sends the partials that are due, batched per home shard (in process
    /// when this node owns it).
    pub(in crate::cluster) fn send_partials(&mut self, sh: &mut Shared, now: Instant, at: Millis) {
        if !sh.serves_groups() || self.partials_next.is_none_or(|t| now < t) {
            return;
        }
        self.partials_next = None;
        let mut by_home: BTreeMap<u32, Vec<GroupPartial>> = BTreeMap::new();
        let shards: Vec<u32> = self.owners.keys().copied().collect();
        for shard in shards {
            let acting = self.acting_epoch(sh, shard, now);
            let o = &self.owners[&shard];
            if o.reading_record || acting != Some(o.epoch) {
                continue;
            }
            let due: Vec<u64> = o
                .partials
                .iter()
                .filter(|(_, p)| p.due.is_some_and(|d| d <= now))
                .map(|(g, _)| *g)
                .collect();
            for group in due {
                let home = sh.home_shard(group);
                let Some(o) = self.owners.get_mut(&shard) else {
                    continue;
                };
                // A slice gone from the shard sends an empty partial once,
                // which replaces its last at the sum.
                let mut online: Vec<u32> = match o.slices.get(&group) {
                    Some(slice) => {
                        let p = o.partials.entry(group).or_default();
                        p.due = None;
                        p.last_sent = Some(now);
                        o.core
                            .group_online(GroupId(group))
                            .into_iter()
                            .flatten()
                            .filter_map(|u| slice.get(&u.0).copied())
                            .collect()
                    }
                    None => {
                        o.partials.remove(&group);
                        Vec::new()
                    }
                };
                online.sort_unstable();
                // One sequence for all of the owner's partials in its
                // epoch: a slice that empties and comes back goes on above.
                o.partial_seq += 1;
                by_home.entry(home).or_default().push(GroupPartial {
                    group,
                    shard,
                    epoch: o.epoch,
                    seq: o.partial_seq,
                    online,
                });
            }
        }
        // Those of owners that can send stay due; an owner reading its
        // predecessor's record asks again once it is read.
        let next = self
            .owners
            .values()
            .filter(|o| !o.reading_record)
            .flat_map(|o| o.partials.values().filter_map(|p| p.due))
            .min();
        if let Some(next) = next {
            self.partial_due_by(next.max(now + crate::cluster::TICK));
        }
        for (home, parts) in by_home {
            // An ordinal is at most 5 bytes, the rest of a partial at most 40.
            let cut = batches(parts, PARTIALS_BYTES, |p| 40 + 5 * p.online.len());
            for batch in cut {
                let sent: Vec<(u32, u64)> = batch.iter().map(|p| (p.shard, p.group)).collect();
                if self.owners.contains_key(&home) {
                    let answer = self.take_partials(sh, home, batch, now, at);
                    if !matches!(answer, FromOwner::Done { .. }) {
                        self.partials_failed(&sent, now);
                    }
                    continue;
                }
                let payload = encode(&ToOwner::GroupPartials { parts: batch });
                sh.request(
                    now,
                    InFlight::Partials { sent },
                    home,
                    RequestKind::Snapshot,
                    payload,
                );
            }
        }
    }

    /// The home owner did not take these partials (no owner yet, not
    /// synced, or no answer): sent again, with the latest sets.
    pub(in crate::cluster) fn partials_failed(&mut self, sent: &[(u32, u64)], now: Instant) {
        for &(shard, group) in sent {
            // Also a slice gone since: its empty partial goes again.
            if let Some(o) = self.owners.get_mut(&shard) {
                earliest(
                    &mut o.partials.entry(group).or_default().due,
                    now + RETRY_AFTER,
                );
            }
        }
        self.partial_due_by(now + RETRY_AFTER);
    }
}

impl Shared {
    /// Whether this node takes part in group counts (it sends protocol
    /// [`GROUPS_SINCE`] or later, so every node reads what it sends).
    pub(in crate::cluster) fn serves_groups(&self) -> bool {
        self.settings.protocol >= GROUPS_SINCE
    }

    /// The home shard of `group`: its owner sums the group's partials.
    /// Placement only, so a key that a user could also be named collides
    /// harmlessly.
    pub(in crate::cluster) fn home_shard(&self, group: u64) -> u32 {
        (self.settings.shard_of)(&home_key(group), self.settings.shard_count)
    }
}
