//! The cluster's groups (issue 28, docs/groups.md): the directory of group
//! definitions every node keeps from the groups bucket's watch, and the
//! writes a node makes there for its sessions (`SetGroup`, `ChangeGroup`,
//! `RemoveGroup`), each a compare-and-set on the revision of the definition
//! it changed.
//!
//! A write is computed from this node's copy, as one node's core computes
//! it (the same list arithmetic, limits and errors), and stored by the NATS
//! I/O ([`ClusterOutput::WriteGroup`]). If another node wrote the group
//! since ([`GroupWriteOutcome::Conflict`]), it is computed again from the
//! newer copy the watch brings, after [`RETRY_AFTER`], at most
//! [`MAX_WRITE_TRIES`] times. A refusal found on the copy (an expected
//! version that does not match, no group to remove) is confirmed by a read
//! from the store first, since the copy may lag: then it is refused as on
//! one node. The answer waits for the store.
//!
//! Removing a group stores a tombstone that keeps its membership version,
//! so a group written again goes on from it (one node starts again at 1).

use super::{ClusterLink, ClusterOutput, DetMap, Finished, RETRY_AFTER};
use greendot_core::{changed_lists, Error, Limit, Millis, SessionId};
use greendot_proto::{self as proto, ErrorCode, WireError};
use std::time::Instant;

/// Tries of one write whose compare-and-set lost to another writer.
pub const MAX_WRITE_TRIES: u8 = 3;

/// A group as the cluster stores it (greendot-cluster's `GroupDef`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupDef {
    pub group: u64,
    /// Bumped by each write, a removal included.
    pub membership: u64,
    /// The ordinal the next new member gets: ordinals are never reused.
    pub next_ordinal: u32,
    /// Names (admins included) with their ordinals, by ordinal.
    pub members: Vec<(String, u32)>,
    /// Sorted.
    pub admins: Vec<String>,
    /// A tombstone: the group was removed.
    pub removed: bool,
}

/// What the store did with a [`ClusterOutput::WriteGroup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupWriteOutcome {
    /// Stored at this revision.
    Written { revision: u64 },
    /// Another write came first: the definition is at another revision.
    Conflict,
    /// Not stored (NATS failed or timed out), with why.
    Failed(String),
}

/// A session's group write, with its lists checked (sizes, names) already.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupWrite {
    Set {
        members: Vec<String>,
        admins: Vec<String>,
    },
    Change {
        add: Vec<String>,
        remove: Vec<String>,
        add_admins: Vec<String>,
        remove_admins: Vec<String>,
        expect: Option<u64>,
    },
    Remove,
}

/// The limits a write is checked against (the core's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLimits {
    pub max_members: usize,
    pub max_admins: usize,
    /// Groups (not removed) in the directory: a soft cap across the
    /// cluster, since two nodes may each create one at the same time.
    pub max_groups: usize,
}

struct PendingWrite {
    /// The client request waiting for it.
    wait: u64,
    group: u64,
    write: GroupWrite,
    /// The definition stored, once asked.
    def: GroupDef,
    tries: u8,
    /// Set while it waits to be computed again after a conflict.
    retry_at: Option<Instant>,
    /// Given up unanswered past this (the I/O dropped the output).
    deadline: Instant,
    /// The copy was read from the store since a refusal found on it: a
    /// refusal now is the store's, not a lagging copy's.
    confirmed: bool,
}

/// The directory and the writes in flight (see the module docs).
#[derive(Default)]
pub(super) struct GroupDirectory {
    /// By group: the revision and the definition (tombstones included).
    groups: DetMap<u64, (u64, GroupDef)>,
    /// The watch has delivered what the bucket held when it started.
    synced: bool,
    /// Writes in flight, by their output id.
    writes: DetMap<u64, PendingWrite>,
    /// Reads of groups from the store that refused subscribes wait for, by
    /// the read's id (one read in flight per group).
    confirms: DetMap<u64, Confirm>,
}

/// A read of a group from the store, and the refused subscribes waiting for
/// it: each request's wait and session.
struct Confirm {
    group: u64,
    /// The read counts as lost then (the I/O dropped it).
    lost: Instant,
    waiting: Vec<(u64, SessionId)>,
}

impl GroupDirectory {
    /// The definition of `group` and its revision (0: never written).
    pub(super) fn get(&self, group: u64) -> (u64, Option<&GroupDef>) {
        match self.groups.get(&group) {
            Some((revision, def)) => (*revision, Some(def)),
            None => (0, None),
        }
    }

    /// Groups not removed.
    pub(super) fn live(&self) -> usize {
        self.groups.values().filter(|(_, d)| !d.removed).count()
    }

    /// Whether writes are in flight (what the tick looks at).
    pub(super) fn busy(&self) -> bool {
        !self.writes.is_empty() || !self.confirms.is_empty()
    }

    /// Whether the watch has delivered what the bucket held at its start.
    pub(super) fn is_synced(&self) -> bool {
        self.synced
    }

    /// The definitions of the groups not removed.
    pub(super) fn live_defs(&self) -> impl Iterator<Item = &GroupDef> {
        self.groups.values().map(|(_, d)| d).filter(|d| !d.removed)
    }

    /// A definition from the watch: kept if newer than the copy held;
    /// whether it was.
    fn changed(&mut self, group: u64, revision: u64, def: Option<GroupDef>) -> bool {
        if self.groups.get(&group).is_some_and(|(r, _)| *r >= revision) {
            return false;
        }
        match def {
            // Not this group's: the bucket's reader refuses these already.
            Some(def) if def.group != group => return false,
            Some(def) => {
                self.groups.insert(group, (revision, def));
            }
            // A header deleted or purged by an operator: no group.
            None => {
                self.groups.remove(&group);
            }
        }
        true
    }
}

/// The definition `write` makes of `current` (`None`: never written), or
/// the error one node's core would answer.
pub(super) fn next_def(
    current: Option<&GroupDef>,
    group: u64,
    write: &GroupWrite,
    limits: &GroupLimits,
    live: usize,
) -> Result<GroupDef, WireError> {
    let live_def = current.filter(|d| !d.removed);
    let membership = current.map_or(0, |d| d.membership);
    let next_ordinal = current.map_or(0, |d| d.next_ordinal);
    let (old_members, old_admins): (Vec<String>, Vec<String>) = match live_def {
        Some(d) => {
            let mut names: Vec<String> = d.members.iter().map(|(n, _)| n.clone()).collect();
            names.sort_unstable();
            (names, d.admins.clone())
        }
        None => (Vec::new(), Vec::new()),
    };
    let (members, admins) = match write {
        GroupWrite::Remove => {
            if live_def.is_none() {
                return Err(Error::UnknownGroup.into());
            }
            return Ok(GroupDef {
                group,
                membership: membership + 1,
                next_ordinal,
                members: Vec::new(),
                admins: Vec::new(),
                removed: true,
            });
        }
        GroupWrite::Set { members, admins } => {
            changed_lists((&[], &[]), [members, &[], admins, &[]])
        }
        GroupWrite::Change {
            add,
            remove,
            add_admins,
            remove_admins,
            expect,
        } => {
            let current = live_def.map_or(0, |d| d.membership);
            if expect.is_some_and(|e| e != current) {
                return Err(Error::VersionMismatch { current }.into());
            }
            changed_lists(
                (&old_members, &old_admins),
                [add, remove, add_admins, remove_admins],
            )
        }
    };
    if admins.len() > limits.max_admins {
        return Err(Error::LimitExceeded(Limit::GroupAdmins).into());
    }
    if members.len() > limits.max_members {
        return Err(Error::LimitExceeded(Limit::GroupMembers).into());
    }
    if live_def.is_none() && live >= limits.max_groups {
        return Err(Error::LimitExceeded(Limit::Groups).into());
    }
    // Members who stay keep their ordinals; new ones get the next ones.
    let mut next_ordinal = next_ordinal;
    let kept: DetMap<&str, u32> = live_def
        .map(|d| d.members.iter().map(|(n, o)| (n.as_str(), *o)).collect())
        .unwrap_or_default();
    let mut with_ordinals: Vec<(String, u32)> = Vec::with_capacity(members.len());
    for name in members {
        let ordinal = match kept.get(name.as_str()) {
            Some(&o) => o,
            None => {
                let o = next_ordinal;
                next_ordinal = next_ordinal.saturating_add(1);
                o
            }
        };
        with_ordinals.push((name, ordinal));
    }
    with_ordinals.sort_unstable_by_key(|(_, o)| *o);
    Ok(GroupDef {
        group,
        membership: membership + 1,
        next_ordinal,
        members: with_ordinals,
        admins,
        removed: false,
    })
}

fn not_stored(group: u64, why: &str) -> WireError {
    WireError::new(
        ErrorCode::Internal,
        format!("group {group} could not be stored: {why}"),
    )
}

impl ClusterLink {
    fn group_limits(&self) -> GroupLimits {
        GroupLimits {
            max_members: self.shared.owner_config.max_group_members,
            max_admins: self.shared.owner_config.max_group_admins,
            max_groups: self.shared.owner_config.max_groups,
        }
    }

    /// A session's group write (lists already checked): answered under
    /// `wait` ([`ClusterLink::poll_finished`]) once stored, or refused.
    /// Until this node has read the cluster's groups it waits (a node just
    /// started), up to its deadline.
    pub fn group_write(&mut self, now: Instant, wait: u64, group: u64, write: GroupWrite) {
        let id = self.shared.id();
        let pending = PendingWrite {
            wait,
            group,
            write,
            def: GroupDef {
                group,
                membership: 0,
                next_ordinal: 0,
                members: Vec::new(),
                admins: Vec::new(),
                removed: false,
            },
            tries: 0,
            retry_at: None,
            deadline: now + self.shared.settings.request_timeout,
            confirmed: false,
        };
        self.shared.groups.writes.insert(id, pending);
        if self.shared.groups.synced {
            self.send_group_write(id);
        }
    }

    /// Computes the write `id` from the copy held and asks the store.
    fn send_group_write(&mut self, id: u64) {
        let limits = self.group_limits();
        let live = self.shared.groups.live();
        let Some(w) = self.shared.groups.writes.get(&id) else {
            return;
        };
        let (revision, current) = self.shared.groups.get(w.group);
        match next_def(current, w.group, &w.write, &limits, live) {
            Ok(def) => {
                let w = self.shared.groups.writes.get_mut(&id).expect("held");
                w.tries += 1;
                w.retry_at = None;
                w.def = def.clone();
                self.shared.outputs.push_back(ClusterOutput::WriteGroup {
                    id,
                    def,
                    expected: revision,
                });
            }
            // The copy may lag the store (the watch is behind): a group
            // at another version, or none, is read from the store first.
            Err(error)
                if !w.confirmed
                    && matches!(
                        error.code,
                        ErrorCode::VersionMismatch | ErrorCode::UnknownGroup
                    ) =>
            {
                let group = w.group;
                let w = self.shared.groups.writes.get_mut(&id).expect("held");
                w.confirmed = true;
                w.retry_at = None;
                self.shared
                    .outputs
                    .push_back(ClusterOutput::ReadGroup { id, group });
            }
            Err(error) => {
                let w = self.shared.groups.writes.remove(&id).expect("held");
                self.finished.push_back((w.wait, Finished::Failed(error)));
            }
        }
    }

    /// The store's definition of the group of write `id` (read to confirm a
    /// refusal found on this node's copy): held, and the write computed
    /// again from it.
    pub(super) fn group_read(
        &mut self,
        now: Instant,
        at: Millis,
        id: u64,
        read: Result<(u64, Option<GroupDef>), String>,
    ) {
        if let Some(c) = self.shared.groups.confirms.remove(&id) {
            if let Ok((revision @ 1.., def)) = read {
                self.group_changed(now, at, c.group, revision, def);
            }
            // Whatever the read found, the hub's core now holds at least
            // what the store held when the subscribes were refused.
            self.subscribe_again(c);
            return;
        }
        let Some(w) = self.shared.groups.writes.get(&id) else {
            return;
        };
        match read {
            Ok((revision, def)) => {
                let group = w.group;
                if revision > 0 {
                    self.group_changed(now, at, group, revision, def);
                }
                self.send_group_write(id);
            }
            Err(why) => {
                let w = self.shared.groups.writes.remove(&id).expect("held");
                let error = not_stored(w.group, &why);
                self.finished.push_back((w.wait, Finished::Failed(error)));
            }
        }
    }

    /// What the store did with write `id`.
    pub(super) fn group_written(
        &mut self,
        now: Instant,
        at: Millis,
        id: u64,
        outcome: GroupWriteOutcome,
    ) {
        let Some(w) = self.shared.groups.writes.get_mut(&id) else {
            return;
        };
        match outcome {
            GroupWriteOutcome::Written { revision } => {
                let w = self.shared.groups.writes.remove(&id).expect("held");
                let answer = match w.write {
                    GroupWrite::Remove => proto::Answer::Done,
                    _ => proto::Answer::GroupSet {
                        version: w.def.membership,
                    },
                };
                // The watch brings it too; this node's next write must
                // start from it already (and its edge and owners follow).
                self.group_changed(now, at, w.group, revision, Some(w.def));
                self.finished.push_back((w.wait, Finished::Answer(answer)));
            }
            GroupWriteOutcome::Conflict if w.tries < MAX_WRITE_TRIES => {
                w.retry_at = Some(now + RETRY_AFTER);
            }
            GroupWriteOutcome::Conflict => {
                let w = self.shared.groups.writes.remove(&id).expect("held");
                let error = not_stored(w.group, "other nodes kept writing it; try again");
                self.finished.push_back((w.wait, Finished::Failed(error)));
            }
            GroupWriteOutcome::Failed(why) => {
                let w = self.shared.groups.writes.remove(&id).expect("held");
                let error = not_stored(w.group, &why);
                self.finished.push_back((w.wait, Finished::Failed(error)));
            }
        }
    }

    /// At the tick: writes that lost a compare-and-set are computed again
    /// from the newer copy once their wait is over; writes the I/O never
    /// answered are given up.
    pub(super) fn retry_group_writes(&mut self, now: Instant, at: Millis) {
        let lost: Vec<u64> = self
            .shared
            .groups
            .writes
            .iter()
            .filter(|(_, w)| w.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            let why = match self.shared.groups.synced {
                true => "no answer in time",
                false => "this node could not read the cluster's groups in time",
            };
            self.group_written(now, at, id, GroupWriteOutcome::Failed(why.into()));
        }
        let due: Vec<u64> = self
            .shared
            .groups
            .writes
            .iter()
            .filter(|(_, w)| w.retry_at.is_some_and(|t| t <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.send_group_write(id);
        }
        let lost: Vec<u64> = self
            .shared
            .groups
            .confirms
            .iter()
            .filter(|(_, c)| c.lost <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            if let Some(c) = self.shared.groups.confirms.remove(&id) {
                self.subscribe_again(c);
            }
        }
    }

    fn subscribe_again(&mut self, c: Confirm) {
        for (wait, session) in c.waiting {
            let again = Finished::GroupSubscribeAgain {
                session,
                group: c.group,
            };
            self.finished.push_back((wait, again));
        }
    }

    /// A definition from the groups bucket's watch: this node's edge, its
    /// owners' slices and its sums follow it.
    pub(super) fn group_changed(
        &mut self,
        now: Instant,
        at: Millis,
        group: u64,
        revision: u64,
        def: Option<GroupDef>,
    ) {
        if !self.shared.groups.changed(group, revision, def) {
            return;
        }
        self.feed_definition(group);
        self.shards.slices_follow(&mut self.shared, group, now, at);
        self.shards.sum_follows(&mut self.shared, group, now, at);
        self.deliver_local();
    }

    /// The watch has delivered everything the bucket held when it started:
    /// the writes that waited for it go out, and the owners take their
    /// slices and sums.
    pub(super) fn groups_synced(&mut self, now: Instant, at: Millis) {
        if self.shared.groups.synced {
            return;
        }
        self.shared.groups.synced = true;
        let owned: Vec<u32> = self.shards.owners.keys().copied().collect();
        self.shards.load_slices(&mut self.shared, &owned, now, at);
        self.shards.load_sums(&mut self.shared, &owned, now, at);
        self.deliver_local();
        let mut waiting: Vec<u64> = self.shared.groups.writes.keys().copied().collect();
        waiting.sort_unstable();
        for id in waiting {
            self.send_group_write(id);
        }
    }

    /// A group subscribe the hub's core refused (no such group, not a
    /// member): this node's copy of the directory may lag a write made at
    /// another node, so the group is read from the store, and the request
    /// `wait` is finished with [`Finished::GroupSubscribeAgain`] once this
    /// node holds what the store does (or the read failed).
    /// Subscribes refused for one group at once share one read.
    pub fn confirm_group(&mut self, now: Instant, wait: u64, session: SessionId, group: u64) {
        if let Some(c) = self
            .shared
            .groups
            .confirms
            .values_mut()
            .find(|c| c.group == group)
        {
            c.waiting.push((wait, session));
            return;
        }
        let id = self.shared.id();
        let confirm = Confirm {
            group,
            lost: now + self.shared.settings.request_timeout,
            waiting: vec![(wait, session)],
        };
        self.shared.groups.confirms.insert(id, confirm);
        self.shared
            .outputs
            .push_back(ClusterOutput::ReadGroup { id, group });
    }

    /// The definition of `group` this node holds, and its revision.
    pub fn group_def(&self, group: u64) -> (u64, Option<&GroupDef>) {
        self.shared.groups.get(group)
    }
}
