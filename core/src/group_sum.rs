//! A group's count across a cluster, at its aggregator (issue 28).
//!
//! Each shard's owner counts the slice of the group in its shard (the
//! `group_changes` module) and sends its **partial**: the slice's members
//! published online, as an absolute set, tagged with the owner's epoch and
//! a sequence number of its own. The aggregator keeps, per shard, the
//! partial with the highest (epoch, sequence) and replaces it with a newer
//! one; it never adds. So a partial lost, repeated or delivered out of
//! order cannot count anyone twice, and a new owner's partial (a higher
//! epoch) replaces whatever the previous owner sent, even a late one.
//!
//! The count is the members online by the latest partials, restricted to
//! the members the aggregator knows, so 0 ≤ count ≤ members always (G2).
//! Each member who goes online or offline by a partial is one
//! [`SumOutput::Member`], at once (admins get it in realtime); each
//! membership write is one [`SumOutput::Count`]. Versions start at the
//! aggregator's epoch floor and rise by [`FED_VERSION_STEP`] per output,
//! so a later aggregator's are above an earlier one's (G3 across a
//! failover), and the fed cores of the edges have the versions between for
//! their own writes (the `group_fed` module).
//!
//! A new aggregator (a failover) knows no partial: it holds its outputs
//! until every shard holding members has sent one, or until a deadline
//! (an owner may be gone too), then sends one `Count`. Until then a count
//! would be too low.
//!
//! Sans-IO and generic over how members are named (names on the wire).

use crate::group_fed::FED_VERSION_STEP;
use crate::types::Millis;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Bound;

/// What the aggregator sends the edges, in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SumOutput<M> {
    /// The count, after a membership write (or once a new aggregator is
    /// ready).
    Count { version: u64, count: u32 },
    /// A member went online or offline by a partial; `count` is after it.
    Member {
        version: u64,
        member: M,
        online: bool,
        count: u32,
    },
}

/// The latest partial of one shard.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Part<M> {
    epoch: u64,
    seq: u64,
    online: BTreeSet<M>,
}

/// Deliberately broken sums, for the tests to catch (feature `mutants`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SumMutant {
    /// A partial is added to what the shard sent before instead of
    /// replacing it: a member offline by the newer partial stays counted.
    PartialsAdd,
    /// The partial that arrives last wins, whatever its (epoch, sequence).
    StalePartialWins,
}

/// One group's sum at its aggregator (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupSum<M: Ord + Clone> {
    members: BTreeSet<M>,
    parts: BTreeMap<u32, Part<M>>,
    /// Members online by the parts (a subset of `members`).
    online: BTreeSet<M>,
    version: u64,
    /// Shards holding members that have not sent a partial, while held.
    waiting: Option<(BTreeSet<u32>, Millis)>,
    outputs: VecDeque<SumOutput<M>>,
    #[cfg(feature = "mutants")]
    mutant: Option<SumMutant>,
}

impl<M: Ord + Copy> GroupSum<M> {
    /// The keys of a member page by the latest partials: up to `limit` of
    /// the members online after `from`, then of the others, in key order,
    /// each with whether it is online, and the next page's cursor (`None`
    /// on the last). The same order as one node's pages (the
    /// `group_pages` module), over the aggregator's keys.
    pub fn page(&self, from: Option<(bool, M)>, limit: usize) -> crate::group_pages::PageKeys<M> {
        let after = |a: Option<M>| {
            let start = a.map_or(Bound::Unbounded, Bound::Excluded);
            self.members.range((start, Bound::Unbounded)).copied()
        };
        crate::group_pages::pick_page(&self.online, after, from, limit)
    }
}

impl<M: Ord + Clone> GroupSum<M> {
    /// A sum with no partial yet, whose versions start above `floor` (the
    /// aggregator's epoch base); `members` and the shards holding them
    /// (`shards`); outputs are held until each of those shards has sent a
    /// partial, or until `deadline`.
    pub fn new(members: BTreeSet<M>, shards: BTreeSet<u32>, floor: u64, deadline: Millis) -> Self {
        // An epoch's base is one; the edges' cores use the versions between.
        debug_assert!(floor.is_multiple_of(FED_VERSION_STEP), "floor {floor}");
        GroupSum {
            members,
            parts: BTreeMap::new(),
            online: BTreeSet::new(),
            version: floor,
            waiting: Some((shards, deadline)),
            outputs: VecDeque::new(),
            #[cfg(feature = "mutants")]
            mutant: None,
        }
    }

    /// Switches on one deliberate bug (feature `mutants`).
    #[cfg(feature = "mutants")]
    pub fn set_mutant(&mut self, mutant: Option<SumMutant>) {
        self.mutant = mutant;
    }

    #[cfg(feature = "mutants")]
    fn is(&self, m: SumMutant) -> bool {
        self.mutant == Some(m)
    }

    #[cfg(not(feature = "mutants"))]
    fn is(&self, _: SumMutant) -> bool {
        false
    }

    /// The members online by the latest partials.
    pub fn count(&self) -> u32 {
        self.online.len() as u32
    }

    /// The version of the latest output.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether outputs are held (a new aggregator waiting for partials).
    pub fn is_waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// A shard's partial: `online`, its members published online, under the
    /// owner's `epoch` and `seq`. Taken only above the shard's last (epoch,
    /// sequence); returns whether it was.
    pub fn handle_partial(
        &mut self,
        now: Millis,
        shard: u32,
        epoch: u64,
        seq: u64,
        online: BTreeSet<M>,
    ) -> bool {
        let newer = self
            .parts
            .get(&shard)
            .is_none_or(|p| (epoch, seq) > (p.epoch, p.seq));
        if !newer && !self.is(SumMutant::StalePartialWins) {
            return false;
        }
        let mut online = online;
        if self.is(SumMutant::PartialsAdd) {
            if let Some(old) = self.parts.get(&shard) {
                online.extend(old.online.iter().cloned());
            }
        }
        let old = self.parts.insert(shard, Part { epoch, seq, online });
        let part = &self.parts[&shard].online;
        let gone: Vec<M> = old
            .iter()
            .flat_map(|p| p.online.difference(part))
            .cloned()
            .collect();
        let came: Vec<M> = match &old {
            Some(p) => part.difference(&p.online).cloned().collect(),
            None => part.iter().cloned().collect(),
        };
        for member in gone {
            self.member_changed(member, false);
        }
        for member in came {
            self.member_changed(member, true);
        }
        if let Some((shards, _)) = &mut self.waiting {
            shards.remove(&shard);
        }
        self.handle_timeout(now);
        true
    }

    fn member_changed(&mut self, member: M, online: bool) {
        if !self.members.contains(&member) {
            return;
        }
        let changed = if online {
            self.online.insert(member.clone())
        } else {
            self.online.remove(&member)
        };
        if changed && self.waiting.is_none() {
            self.version = self.version.saturating_add(FED_VERSION_STEP);
            self.outputs.push_back(SumOutput::Member {
                version: self.version,
                member,
                online,
                count: self.count(),
            });
        }
    }

    /// A membership write the aggregator learned: the count is of the new
    /// members, and one `Count` tells it (also when unchanged: the edges'
    /// cores wait for one after each write).
    pub fn handle_members(&mut self, now: Millis, members: BTreeSet<M>, shards: BTreeSet<u32>) {
        self.members = members;
        self.online = self
            .parts
            .values()
            .flat_map(|p| p.online.iter())
            .filter(|m| self.members.contains(m))
            .cloned()
            .collect();
        if let Some((waiting, _)) = &mut self.waiting {
            *waiting = shards
                .into_iter()
                .filter(|s| !self.parts.contains_key(s))
                .collect();
        }
        if self.waiting.is_none() {
            self.tell_count();
        }
        self.handle_timeout(now);
    }

    fn tell_count(&mut self) {
        self.version = self.version.saturating_add(FED_VERSION_STEP);
        self.outputs.push_back(SumOutput::Count {
            version: self.version,
            count: self.count(),
        });
    }

    /// Ends the wait of a new aggregator once every shard has reported or
    /// its deadline passed, telling the count.
    pub fn handle_timeout(&mut self, now: Millis) {
        let ready = self
            .waiting
            .as_ref()
            .is_some_and(|(shards, deadline)| shards.is_empty() || now >= *deadline);
        if ready {
            self.waiting = None;
            self.tell_count();
        }
    }

    /// When [`GroupSum::handle_timeout`] is due: the wait's deadline.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.waiting.as_ref().map(|(_, deadline)| *deadline)
    }

    /// The next output for the edges. Drain after every input.
    pub fn poll_output(&mut self) -> Option<SumOutput<M>> {
        self.outputs.pop_front()
    }
}
