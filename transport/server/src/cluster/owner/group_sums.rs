//! A group's aggregator across a cluster (issue 28, docs/groups.md "Across
//! a cluster"): the owner of the group's home shard.
//!
//! It keeps one `GroupSum` per group homed at its shard, built from the
//! directory (the members' ordinals, and the shards holding them), with
//! versions from its epoch's base, so a later owner's are above an earlier
//! one's. Owners' partials replace each shard's last one by (epoch,
//! sequence); each member who goes online or offline by a partial is one
//! count with the change (admins get it at once), and each membership
//! write one count. They go on `<prefix>.groups` while the node acts for
//! the home shard (C1), and to this node's own edge in process. Every group
//! interval the owner publishes every count it holds again, so an edge that
//! missed one, or started since, has it within an interval; edges take a
//! count only above the version they hold.
//!
//! A new owner of the home shard holds no partial: each sum waits for
//! every shard holding members, or for the request timeout, before it
//! tells a count (the owners send theirs on its resync request).

use crate::cluster::owner::group_slices::batches;
use crate::cluster::owner::OwnedShards;
use crate::cluster::shared::Shared;
use crate::cluster::to_edge::ToEdge;
use crate::cluster::wire::{encode, FromOwner, GroupCount, GroupCounts, GroupPartial};
use crate::cluster::{ClusterOutput, MAX_MESSAGE};
use greendot_core::cluster::epoch_base;
use greendot_core::{Epoch, GroupSum, Millis, SumOutput};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The bytes of counts one message carries at most (a count is under 40
/// bytes with the member's name's length).
const COUNTS_BYTES: usize = MAX_MESSAGE / 2;

/// The sums an owner holds for the groups homed at its shard.
#[derive(Default)]
pub(in crate::cluster) struct Sums {
    by_group: BTreeMap<u64, GroupSum<u32>>,
    /// Groups whose sum holds its outputs (a new owner's wait).
    waiting: BTreeSet<u64>,
    next_refresh: Option<Instant>,
    /// The highest version a removed group's sum reached in this epoch: a
    /// group written again under its id goes on above it (edges drop
    /// counts below what they hold).
    removed_floor: u64,
}

impl Sums {
    /// The sum of `group`, if it is homed here.
    pub(in crate::cluster) fn get(&self, group: u64) -> Option<&GroupSum<u32>> {
        self.by_group.get(&group)
    }

    /// Whether a wait still held has ended by `at`.
    fn wait_ended(&self, at: Millis) -> bool {
        self.waiting
            .iter()
            .filter_map(|g| self.by_group.get(g)?.poll_timeout())
            .any(|end| end <= at)
    }
}

/// The name of the member of ordinal `ordinal` (members are by ordinal).
fn name_of(members: &[(String, u32)], ordinal: u32) -> Option<String> {
    members
        .binary_search_by_key(&ordinal, |(_, o)| *o)
        .ok()
        .map(|i| members[i].0.clone())
}

impl OwnedShards {
    /// Sums for every group homed at `shards` (claims won, or the
    /// directory's first pass done).
    pub(in crate::cluster) fn load_sums(
        &mut self,
        sh: &mut Shared,
        shards: &[u32],
        now: Instant,
        at: Millis,
    ) {
        if !sh.serves_groups() || !sh.groups.is_synced() || shards.is_empty() {
            return;
        }
        let groups: Vec<u64> = sh
            .groups
            .live_defs()
            .map(|d| d.group)
            .filter(|g| shards.contains(&sh.home_shard(*g)))
            .collect();
        for group in groups {
            self.sum_follows(sh, group, now, at);
        }
    }

    /// A definition changed: its sum, if this node owns its home shard,
    /// follows (a removed group's goes).
    pub(in crate::cluster) fn sum_follows(
        &mut self,
        sh: &mut Shared,
        group: u64,
        now: Instant,
        at: Millis,
    ) {
        if !sh.serves_groups() || !sh.groups.is_synced() {
            return;
        }
        let home = sh.home_shard(group);
        if !self.owners.contains_key(&home) {
            return;
        }
        let (shard_of, count) = (sh.settings.shard_of, sh.settings.shard_count);
        let def = sh.groups.get(group).1.filter(|d| !d.removed);
        let Some(def) = def else {
            if let Some(o) = self.owners.get_mut(&home) {
                if let Some(sum) = o.sums.by_group.remove(&group) {
                    o.sums.removed_floor = o.sums.removed_floor.max(sum.version());
                }
                o.sums.waiting.remove(&group);
            }
            return;
        };
        let members: BTreeSet<u32> = def.members.iter().map(|(_, o)| *o).collect();
        let shards: BTreeSet<u32> = def
            .members
            .iter()
            .map(|(n, _)| shard_of(n, count))
            .collect();
        let wait =
            Millis(u64::try_from(sh.settings.request_timeout.as_millis()).unwrap_or(u64::MAX / 4));
        let Some(o) = self.owners.get_mut(&home) else {
            return;
        };
        match o.sums.by_group.get_mut(&group) {
            Some(sum) => sum.handle_members(at, members, shards),
            None => {
                let epoch = Epoch(u32::try_from(o.epoch).unwrap_or(u32::MAX));
                let floor = epoch_base(epoch).max(o.sums.removed_floor);
                let sum = GroupSum::new(members, shards, floor, at.plus(wait));
                o.sums.by_group.insert(group, sum);
            }
        }
        self.drain_sums(sh, home, &[group], now);
    }

    /// Owners' partials for groups homed at `home`: each replaces its
    /// shard's last one at the group's sum.
    pub(in crate::cluster) fn take_partials(
        &mut self,
        sh: &mut Shared,
        home: u32,
        parts: Vec<GroupPartial>,
        now: Instant,
        at: Millis,
    ) -> FromOwner {
        let Some(epoch) = self.acting_epoch(sh, home, now) else {
            return FromOwner::NotOwner;
        };
        if self.owners.get(&home).is_none_or(|o| o.epoch != epoch) {
            return FromOwner::NotOwner;
        }
        if !sh.groups.is_synced() {
            return FromOwner::Loading;
        }
        let mut touched = Vec::new();
        let mut unknown = false;
        for part in parts {
            if sh.home_shard(part.group) != home {
                sh.counters.malformed += 1;
                continue;
            }
            // A group this node's directory has not seen yet: the sender
            // asks again (a removed one is summed no more).
            if sh.groups.get(part.group).1.is_none() {
                unknown = true;
                continue;
            }
            let Some(o) = self.owners.get_mut(&home) else {
                break;
            };
            let Some(sum) = o.sums.by_group.get_mut(&part.group) else {
                continue;
            };
            let online: BTreeSet<u32> = part.online.into_iter().collect();
            if sum.handle_partial(at, part.shard, part.epoch, part.seq, online) {
                touched.push(part.group);
            }
        }
        self.drain_sums(sh, home, &touched, now);
        match unknown {
            true => FromOwner::Loading,
            false => FromOwner::Done { epoch },
        }
    }

    /// The outputs of the sums of `groups` at `home`'s owner: published
    /// while this node acts for `home`, and taken by this node's edge.
    pub(in crate::cluster) fn drain_sums(
        &mut self,
        sh: &mut Shared,
        home: u32,
        groups: &[u64],
        now: Instant,
    ) {
        let acting = self.acting_epoch(sh, home, now);
        let Some(o) = self.owners.get_mut(&home) else {
            return;
        };
        let mut counts = Vec::new();
        for group in groups {
            let Some(sum) = o.sums.by_group.get_mut(group) else {
                continue;
            };
            match sum.is_waiting() {
                true => o.sums.waiting.insert(*group),
                false => o.sums.waiting.remove(group),
            };
            let def = sh.groups.get(*group).1;
            while let Some(out) = sum.poll_output() {
                counts.push(match out {
                    SumOutput::Count { version, count } => GroupCount {
                        group: *group,
                        version,
                        count,
                        change: None,
                    },
                    SumOutput::Member {
                        version,
                        member,
                        online,
                        count,
                    } => GroupCount {
                        group: *group,
                        version,
                        count,
                        change: def
                            .and_then(|d| name_of(&d.members, member))
                            .map(|n| (n, online)),
                    },
                });
            }
        }
        let epoch = o.epoch;
        if acting == Some(epoch) {
            self.publish_counts(sh, home, epoch, counts);
        }
    }

    pub(in crate::cluster) fn publish_counts(
        &mut self,
        sh: &mut Shared,
        home: u32,
        epoch: u64,
        counts: Vec<GroupCount>,
    ) {
        let size = |c: &GroupCount| 40 + c.change.as_ref().map_or(0, |(name, _)| name.len());
        let chunks = batches(counts, COUNTS_BYTES, size);
        for counts in chunks {
            let msg = GroupCounts {
                home,
                epoch,
                counts,
            };
            sh.outputs.push_back(ClusterOutput::GroupCounts {
                payload: encode(&msg),
            });
            // This node's own edge, in process (the copy NATS brings back
            // is dropped by version).
            sh.to_edge.push_back(ToEdge::Counts(msg));
        }
    }

    /// The sums' waits that ended, and every count again once a group
    /// interval passed since the last time.
    pub(in crate::cluster) fn tick_sums(&mut self, sh: &mut Shared, now: Instant, at: Millis) {
        if !sh.serves_groups() {
            return;
        }
        let every = Duration::from_millis(sh.owner_config.group_interval.0);
        // Only the owners with a wait ended, or a refresh due while acting
        // (one that is not publishes nothing): one handed out mutably is
        // indexed again (its core's timers), every tick.
        let shards: Vec<u32> = self
            .owners
            .iter()
            .filter(|(shard, o)| {
                let s = &o.sums;
                !s.by_group.is_empty()
                    && (s.wait_ended(at)
                        || (s.next_refresh.is_none_or(|t| now >= t)
                            && self.acting_epoch(sh, **shard, now) == Some(o.epoch)))
            })
            .map(|(s, _)| *s)
            .collect();
        for shard in shards {
            let Some(o) = self.owners.get_mut(&shard) else {
                continue;
            };
            if o.sums.wait_ended(at) {
                let waiting: Vec<u64> = o.sums.waiting.iter().copied().collect();
                for group in &waiting {
                    if let Some(sum) = o.sums.by_group.get_mut(group) {
                        sum.handle_timeout(at);
                    }
                }
                self.drain_sums(sh, shard, &waiting, now);
            }
            let acting = self.acting_epoch(sh, shard, now);
            let Some(o) = self.owners.get_mut(&shard) else {
                continue;
            };
            let due = o.sums.next_refresh.is_none_or(|t| now >= t);
            if o.sums.by_group.is_empty() || !due || acting != Some(o.epoch) {
                continue;
            }
            o.sums.next_refresh = Some(now + every);
            let counts: Vec<GroupCount> = o
                .sums
                .by_group
                .iter()
                .filter(|(_, s)| !s.is_waiting())
                .map(|(group, s)| GroupCount {
                    group: *group,
                    version: s.version(),
                    count: s.count(),
                    change: None,
                })
                .collect();
            let epoch = o.epoch;
            self.publish_counts(sh, shard, epoch, counts);
        }
    }

    /// The aggregator's answer to a page's keys (see the module docs):
    /// `Loading` while it cannot tell who is online (its directory has not
    /// seen the group, or its sum waits for partials after a failover).
    pub(in crate::cluster) fn page_keys(
        &mut self,
        sh: &mut Shared,
        home: u32,
        group: u64,
        after: Option<(bool, u32)>,
        limit: u32,
        now: Instant,
    ) -> FromOwner {
        let Some(epoch) = self.acting_epoch(sh, home, now) else {
            return FromOwner::NotOwner;
        };
        if sh.home_shard(group) != home || self.owners.get(&home).is_none_or(|o| o.epoch != epoch) {
            return FromOwner::NotOwner;
        }
        if !sh.groups.is_synced() {
            return FromOwner::Loading;
        }
        let def = sh.groups.get(group).1.filter(|d| !d.removed);
        let sum = self.owners.get(&home).and_then(|o| o.sums.get(group));
        let (Some(def), Some(sum)) = (def, sum) else {
            return FromOwner::Loading;
        };
        if sum.is_waiting() {
            return FromOwner::Loading;
        }
        let limit = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .min(sh.page_keys_that_fit());
        let (keys, next) = sum.page(after, limit);
        let keys = keys
            .into_iter()
            .filter_map(|(ordinal, online)| {
                let i = def
                    .members
                    .binary_search_by_key(&ordinal, |(_, o)| *o)
                    .ok()?;
                Some((def.members[i].0.clone(), online))
            })
            .collect();
        FromOwner::GroupPageKeys {
            version: sum.version(),
            count: sum.count(),
            keys,
            next,
        }
    }
}
