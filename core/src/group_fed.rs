//! Group counts fed from outside (issue 28, a cluster's edge).
//!
//! On one node the core counts a group's members from its own published
//! views (the `groups` module). A node of a cluster holds only its own
//! sessions; the count of a group is summed elsewhere (from every shard's
//! owner) and reaches the node as a stream of counts and member changes,
//! each under a version of the count source's. A core switched to fed
//! counts ([`Core::set_group_counts_fed`]) keeps everything else of groups
//! as on one node, on the same code: the members and admins it is written,
//! the subscriptions in their roles, `Ended` for leavers, the resume
//! carry-over, members' counts at most once per interval and only when
//! changed, and admins' changes at once. What changes:
//! - the count is the latest one fed ([`Core::handle_group_count`],
//!   [`Core::handle_group_member`]), taken only under a higher version than
//!   the group's (the stream may be duplicated, reordered or late), and at
//!   most the members the core holds (its list may lag the source's);
//! - a membership write keeps the last count fed, cut to the members if it
//!   was more, and tells it as on one node (admins at once, members at the
//!   flush if it changed) under the next version after the group's; the
//!   source then sends the count after the write. So the source's versions
//!   rise by at least [`FED_VERSION_STEP`] per message, leaving the ones
//!   between to the core's writes (past the last version before the next
//!   multiple of the step, 255 writes after a message of `GroupSum`, whose
//!   versions are multiples of it, a write is told with the source's next
//!   count);
//! - its published views count for nothing, and watched pages get no deltas
//!   from them.
//!
//! G2 holds structurally (0 ≤ count ≤ members), G3 because a fed version is
//! taken only above the group's, G4 as on one node; G1 holds once the
//! source's stream has arrived (`tests/group_fed.rs`, with
//! `GroupMutant::FedOlderCountTaken` caught).

use crate::engine::Core;
use crate::error::Error;
use crate::groups::{arm_flush, group_mutant, is_online, GroupId, GroupOutput};
use crate::types::{Millis, UserId};

/// The least step between two versions of a count source: the versions
/// between are the fed core's own (a count cut by a membership write).
pub const FED_VERSION_STEP: u64 = 256;

impl Core {
    /// Switches this core's group counts to fed ones, before any group is
    /// written (`false`, and nothing changes, if one was).
    pub fn set_group_counts_fed(&mut self) -> bool {
        if !self.groups.groups.is_empty() {
            return false;
        }
        self.groups.fed = true;
        true
    }

    /// Whether this core's group counts are fed from outside.
    pub fn group_counts_fed(&self) -> bool {
        self.groups.fed
    }

    /// The count of `group` from the count source, under its `version`:
    /// taken (`Ok(true)`) only above the group's version; admins get it at
    /// once, members at the next flush if it changed. `Ok(false)`: an older
    /// or repeated one, or one within [`FED_VERSION_STEP`] of `u64::MAX`,
    /// dropped. `Error::UnknownGroup` for a group this core
    /// does not hold, `Error::NotAllowed` when counts are not fed.
    pub fn handle_group_count(
        &mut self,
        now: Millis,
        group: GroupId,
        version: u64,
        count: u32,
    ) -> Result<bool, Error> {
        self.take_fed(now, group, version, count, None)
    }

    /// A member's change from the count source (`online`, and the count
    /// after it), under its `version`: as [`Core::handle_group_count`], and
    /// admins get the change itself, if this core lists `member` in the
    /// group.
    pub fn handle_group_member(
        &mut self,
        now: Millis,
        group: GroupId,
        version: u64,
        member: UserId,
        online: bool,
        count: u32,
    ) -> Result<bool, Error> {
        self.take_fed(now, group, version, count, Some((member, online)))
    }

    fn take_fed(
        &mut self,
        now: Millis,
        group: GroupId,
        version: u64,
        count: u32,
        change: Option<(UserId, bool)>,
    ) -> Result<bool, Error> {
        self.advance(now);
        if !self.groups.fed {
            return Err(Error::NotAllowed);
        }
        let mut groups = std::mem::take(&mut self.groups);
        let any_version = group_mutant!(groups, FedOlderCountTaken);
        let members_too = group_mutant!(groups, DeltasToMembers);
        let Some(g) = groups.groups.get_mut(&group) else {
            self.groups = groups;
            return Err(Error::UnknownGroup);
        };
        // A version with no room above it for this core's writes is not a
        // count source's (they start from an epoch's base).
        let no_room = version > u64::MAX - FED_VERSION_STEP;
        if (version <= g.version && !any_version) || no_room {
            self.groups = groups;
            return Ok(false);
        }
        let old = g.count;
        g.version = version;
        g.count = count.min(g.members.len() as u32);
        let listed = change.filter(|(m, _)| g.members.binary_search(m).is_ok());
        let counted = g.counted.keys().filter(|_| members_too);
        for &to in g.admin_subs.iter().chain(counted) {
            if !is_online(&self.slots, to) {
                continue;
            }
            groups.outputs.push_back(match listed {
                Some((member, online)) => GroupOutput::Member {
                    to,
                    group,
                    version,
                    member,
                    online,
                    count: g.count,
                },
                None => GroupOutput::Count {
                    to,
                    group,
                    version,
                    count: g.count,
                },
            });
        }
        // Also when unchanged: a member may know a count from before a cut
        // that could not be told.
        if g.count != old || g.counted.values().any(|&told| told != g.count) {
            arm_flush(group, g, self);
        }
        self.groups = groups;
        Ok(true)
    }
}

impl Core {
    /// A group's definition as the cluster holds it, at its membership
    /// version `membership` (a cluster's edge, from the directory every node
    /// keeps): written as `handle_set_group` writes it (leavers' sessions
    /// ended, roles moved, the count kept and cut to the members), whether
    /// the core holds the group or not, then given the directory's
    /// membership version instead of one of its own.
    pub fn handle_define_group(
        &mut self,
        now: Millis,
        group: GroupId,
        members: &[UserId],
        admins: &[UserId],
        membership: u64,
    ) -> Result<(), Error> {
        self.handle_set_group(now, group, members, admins)?;
        if let Some(g) = self.groups.groups.get_mut(&group) {
            g.membership = membership;
        }
        Ok(())
    }
}
