//! The shards this node acts for: their claims, what serves only them,
//! and an index of when each is next due for `handle_timeout`, so the
//! server's loop finds the earliest owner timer without asking every owner
//! core on every pass.
//!
//! A shard handed out mutably may have changed its timers: it is marked
//! touched and left out of the index until [`Owners::reindex`] (at the end of
//! each of the link's steps) computes its deadline again. Until then it is
//! asked directly, so the answer is right whenever it is asked.

pub(in crate::cluster) mod device_record;
pub(in crate::cluster) mod group_slices;
pub(in crate::cluster) mod group_sums;
pub(in crate::cluster) mod prefs_writes;
pub(in crate::cluster) mod requests;
pub(in crate::cluster) mod shard;

use crate::cluster::shared::Shared;
use crate::cluster::{ClusterOutput, DetMap, LinkMutant, WRITE_BEHIND};
use greendot_core::Millis;
use prefs_writes::PrefsWrites;
use requests::PendingPrefs;
use shard::{release_idle, Owner};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Index;
use std::time::Instant;

/// The shards this node acts for, with what serves only them: their
/// claims, preference writes, KV and shard record reads, and the edges'
/// incarnations their requests carry.
#[derive(Default)]
pub(in crate::cluster) struct OwnedShards {
    /// Per shard acted for: the epoch, and until when the claim holds.
    pub(in crate::cluster) acting: BTreeMap<u32, (u64, Instant)>,
    /// The earliest deadline in `acting`.
    pub(in crate::cluster) next_lapse: Option<Instant>,
    pub(in crate::cluster) owners: Owners,
    pub(in crate::cluster) pending_prefs: DetMap<u64, PendingPrefs>,
    pub(in crate::cluster) prefs_writes: PrefsWrites,
    /// KV reads in flight: shard, epoch, user, since.
    pub(in crate::cluster) pending_loads: DetMap<u64, (u32, u64, String, Instant)>,
    /// Shard record reads in flight: shard, epoch, since.
    pub(in crate::cluster) pending_shards: DetMap<u64, (u32, u64, Instant)>,
    /// The newest incarnation seen of each edge (from its requests and its
    /// lease): requests of older ones are dropped. At most
    /// `MAX_EDGES_REMEMBERED`: edges are the cluster's nodes.
    pub(in crate::cluster) incarnations: DetMap<String, u64>,
    pub(in crate::cluster) next_beacon: Option<Instant>,
    /// When the owners' next partial is due, if one is.
    pub(in crate::cluster) partials_next: Option<Instant>,
}

impl OwnedShards {
    /// What of the owners waited too long for the NATS I/O: requests
    /// waiting on preference writes fail, a preference write never answered
    /// is given up, and KV reads are asked again.
    pub(in crate::cluster) fn expire_pending(&mut self, sh: &mut Shared, now: Instant, at: Millis) {
        let timeout = sh.settings.request_timeout;
        let late: Vec<u64> = self
            .pending_prefs
            .iter()
            .filter(|(_, p)| p.since + timeout <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.answer_prefs(sh, now, at, id, false);
        }
        // The I/O ends a write within 3 tries of a read and a
        // compare-and-set, each within an operation timeout (at most a
        // third of the act window; `greendot serve` sets the request
        // timeout to the claim TTL): under twice the request timeout. A
        // write not answered by then was dropped before it began.
        if let Some(cutoff) = now.checked_sub(timeout * 2) {
            for id in self.prefs_writes.lost(cutoff) {
                self.prefs_stored(sh, now, at, id, false);
            }
        }
        let late: Vec<u64> = self
            .pending_loads
            .iter()
            .filter(|(_, (_, _, _, since))| *since + timeout <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            if let Some((shard, epoch, user, _)) = self.pending_loads.remove(&id) {
                sh.next_id += 1;
                let id = sh.next_id;
                self.pending_loads
                    .insert(id, (shard, epoch, user.clone(), now));
                sh.outputs.push_back(ClusterOutput::LoadUser { id, user });
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
                sh.next_id += 1;
                let id = sh.next_id;
                self.pending_shards.insert(id, (shard, epoch, now));
                sh.outputs.push_back(ClusterOutput::LoadShard { id, shard });
            }
        }
    }

    /// Whether this node's owner of `shard` takes requests now: the edge
    /// asks it in process, not over NATS.
    pub(in crate::cluster) fn serves(&self, sh: &Shared, shard: u32, now: Instant) -> bool {
        self.owners.contains_key(&shard) && self.acting_epoch(sh, shard, now).is_some()
    }

    /// Something of the owners is looked at by the tick: claims (their
    /// owners' resyncs and beacons), or preference writes and KV reads that
    /// may have to be asked again.
    pub(in crate::cluster) fn waits_on_tick(&self) -> bool {
        !self.acting.is_empty()
            || !self.pending_prefs.is_empty()
            || !self.prefs_writes.is_empty()
            || !self.pending_loads.is_empty()
            || !self.pending_shards.is_empty()
    }

    /// Runs the owners with something due at `at` (or changed since last
    /// asked): their cores' timers, the views they publish, their device
    /// records written behind, and their idle users released.
    pub(in crate::cluster) fn handle_timeout(&mut self, sh: &mut Shared, now: Instant, at: Millis) {
        for shard in self.owners.due(at) {
            if let Some(o) = self.owners.get_mut(&shard) {
                o.core.handle_timeout(at);
            }
            self.drain_owner(sh, shard, now, at);
            self.write_devices(sh, shard, at);
            if let Some(o) = self.owners.get_mut(&shard) {
                sh.counters.users_released += release_idle(o, at) as u64;
            }
        }
    }

    pub(in crate::cluster) fn acting_epoch(
        &self,
        sh: &Shared,
        shard: u32,
        now: Instant,
    ) -> Option<u64> {
        let lapse_ignored = sh.settings.mutant == Some(LinkMutant::ActPastDeadline);
        self.acting
            .get(&shard)
            .filter(|(_, until)| lapse_ignored || now < *until)
            .map(|(epoch, _)| *epoch)
    }

    /// Stops acting for the shards whose claim's deadline passed, whatever
    /// the status says: first thing at every input and timeout, so that no
    /// owner acts past its deadline on anything (a node paused past its
    /// lease wakes to the inputs that queued while it slept, before any
    /// timer).
    pub(in crate::cluster) fn stop_lapsed(&mut self, sh: &mut Shared, now: Instant, at: Millis) {
        if sh.settings.mutant == Some(LinkMutant::ActPastDeadline)
            || self.next_lapse.is_none_or(|t| now < t)
        {
            return;
        }
        let lapsed: Vec<u32> = self
            .acting
            .iter()
            .filter(|(_, (_, until))| now >= *until)
            .map(|(s, _)| *s)
            .collect();
        for shard in lapsed {
            self.acting.remove(&shard);
            self.drop_owner(sh, shard, now, at);
        }
        self.next_lapse = self.acting.values().map(|(_, until)| *until).min();
    }
}

#[derive(Default)]
pub(in crate::cluster) struct Owners {
    map: BTreeMap<u32, Owner>,
    /// (deadline, shard) of the shards not touched since they were indexed
    /// and that have a deadline.
    index: BTreeSet<(Millis, u32)>,
    /// Each indexed shard's entry in `index`.
    indexed: DetMap<u32, Millis>,
    /// Shards handed out mutably since the last `reindex`.
    touched: BTreeSet<u32>,
}

/// When `o` next needs `handle_timeout`: its core's timer, the write-behind
/// of its device record (once the previous owner's is read), or the release
/// of its earliest idle user.
fn deadline(o: &Owner) -> Option<Millis> {
    [
        o.core.poll_timeout(),
        o.dirty_since
            .filter(|_| !o.reading_record)
            .map(|d| d.plus(WRITE_BEHIND)),
        o.idle.front().map(|(due, _)| *due),
    ]
    .into_iter()
    .flatten()
    .min()
}

impl Owners {
    pub(in crate::cluster) fn get(&self, shard: &u32) -> Option<&Owner> {
        self.map.get(shard)
    }

    pub(in crate::cluster) fn get_mut(&mut self, shard: &u32) -> Option<&mut Owner> {
        if self.map.contains_key(shard) {
            self.touch(*shard);
        }
        self.map.get_mut(shard)
    }

    pub(in crate::cluster) fn contains_key(&self, shard: &u32) -> bool {
        self.map.contains_key(shard)
    }

    pub(in crate::cluster) fn insert(&mut self, shard: u32, owner: Owner) -> Option<Owner> {
        self.touch(shard);
        self.map.insert(shard, owner)
    }

    pub(in crate::cluster) fn remove(&mut self, shard: &u32) -> Option<Owner> {
        self.unindex(*shard);
        self.touched.remove(shard);
        self.map.remove(shard)
    }

    pub(in crate::cluster) fn keys(&self) -> impl Iterator<Item = &u32> {
        self.map.keys()
    }

    pub(in crate::cluster) fn values(&self) -> impl Iterator<Item = &Owner> {
        self.map.values()
    }

    #[cfg(test)]
    pub(in crate::cluster) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub(in crate::cluster) fn iter(&self) -> impl Iterator<Item = (&u32, &Owner)> {
        self.map.iter()
    }

    fn touch(&mut self, shard: u32) {
        self.unindex(shard);
        self.touched.insert(shard);
    }

    fn unindex(&mut self, shard: u32) {
        if let Some(due) = self.indexed.remove(&shard) {
            self.index.remove(&(due, shard));
        }
    }

    /// Puts the touched shards back in the index at their new deadlines.
    pub(in crate::cluster) fn reindex(&mut self) {
        for shard in std::mem::take(&mut self.touched) {
            if let Some(due) = self.map.get(&shard).and_then(deadline) {
                self.index.insert((due, shard));
                self.indexed.insert(shard, due);
            }
        }
    }

    /// The earliest deadline of any shard.
    pub(in crate::cluster) fn poll_timeout(&self) -> Option<Millis> {
        let touched = self
            .touched
            .iter()
            .filter_map(|s| self.map.get(s).and_then(deadline));
        self.index
            .first()
            .map(|(due, _)| *due)
            .into_iter()
            .chain(touched)
            .min()
    }

    /// The shards due at `at`, and the touched ones (whose deadline is not
    /// known without asking).
    pub(in crate::cluster) fn due(&self, at: Millis) -> Vec<u32> {
        let mut due: Vec<u32> = self
            .index
            .range(..=(at, u32::MAX))
            .map(|(_, shard)| *shard)
            .collect();
        due.extend(self.touched.iter().copied());
        due
    }

    /// Asserts that the index agrees with every owner's deadline, and that
    /// the earliest is what walking every owner finds (run after every step
    /// of the link in the unit tests).
    #[cfg(test)]
    pub(in crate::cluster) fn check(&self) {
        for (shard, o) in &self.map {
            if !self.touched.contains(shard) {
                assert_eq!(
                    self.indexed.get(shard).copied(),
                    deadline(o),
                    "shard {shard}"
                );
            }
        }
        assert_eq!(self.index.len(), self.indexed.len());
        let scan = self.map.values().filter_map(deadline).min();
        assert_eq!(self.poll_timeout(), scan);
    }
}

impl Index<&u32> for Owners {
    type Output = Owner;

    fn index(&self, shard: &u32) -> &Owner {
        &self.map[shard]
    }
}
