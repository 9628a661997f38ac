//! Group presence (issue 28): online counts for members, realtime deltas for
//! admins, without pushing one member's change to every other member.
//!
//! A group is a set of members and a set of admins, written whole by a
//! backend ([`Core::handle_set_group`]; an admin is always a member). Each
//! write bumps the group's membership version. What is counted is the
//! members whose *published* view is online ([`Core::presence`]): the view
//! watchers get, after debounce and grace, so an invisible member counts as
//! offline, and nothing a count says tells "went invisible" from "went
//! offline" (I5 holds for counts).
//!
//! A session of a member subscribes with [`Core::handle_group_subscribe`]
//! and gets a [`GroupSnapshot`]. Then, drained with
//! [`Core::poll_group_output`]:
//! - a member gets [`GroupOutput::Count`] at most once per
//!   `Config::group_interval`, only when the count differs from the last one
//!   that session was told, and never an identity;
//! - an admin gets [`GroupOutput::Member`] at once for each member whose
//!   published view goes online or offline, with the count after it, and a
//!   [`GroupOutput::Count`] at once after each membership write;
//! - a session whose user leaves the group, or whose group is removed, gets
//!   [`GroupOutput::Ended`].
//!
//! Group subscriptions belong to the session like its user subscriptions:
//! nothing is sent while it lingers, a resume carries them over (the new
//! session gets a `Count` of each at once), and they end with the session.
//!
//! Any member may also read the member list in pages
//! ([`Core::handle_group_page`], the `group_pages` module), within a page
//! budget per group, and watch up to 3 pages for batched deltas
//! ([`Core::handle_group_watch_page`], the `group_watch` module, G5).
//!
//! Cost: the index user → groups makes one member's change cost, per group
//! of that member, O(1) for the count, O(log members) for the online set the
//! pages read, and one push per admin session; never O(members). A flush
//! costs one step per member subscription of the group, once per interval at
//! most. A membership write costs O(members + subscriptions).
//!
//! Invariants (checked by `check_invariants`, the property tests in
//! `tests/groups.rs`, each with a [`GroupMutant`](crate::mutants::GroupMutant)
//! that is caught):
//! - **G1** exact at quiescence: once inputs stop for debounce + the group
//!   interval, every subscribed session's last count equals the number of
//!   members whose published view is online (in the property tests);
//! - **G2** 0 ≤ count ≤ members, and the count is the number of members
//!   published online (structural);
//! - **G3** the versions a session gets per group rise: pushes strictly, and
//!   a snapshot is never older than a push before it (property tests);
//! - **G4** member deltas go only to live sessions of admins: admin
//!   subscriptions are held by live sessions of admins only (structural),
//!   and only Online ones are sent to (property tests; extends I11: only
//!   members may subscribe).

use crate::engine::{Core, Link, Slot};
use crate::error::{Error, Limit};
use crate::timers::Timer;
use crate::types::{Millis, SessionId, UserId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// A group, as the backend names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GroupId(pub u64);

/// A change of a group's lists by difference ([`Core::handle_change_group`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupChange<'a> {
    /// New members.
    pub add: &'a [UserId],
    /// Members who leave (admins among them leave too).
    pub remove: &'a [UserId],
    /// New admins (members too, whether listed in `add` or not).
    pub add_admins: &'a [UserId],
    /// Admins who stay members only.
    pub remove_admins: &'a [UserId],
    /// Change only a group at this membership version (0: a group that
    /// does not exist).
    pub expect: Option<u64>,
}

/// A group's lists after a change by difference, as
/// [`Core::handle_change_group`] makes it: from `old` (members, admins
/// included, and admins, both sorted), `change` = [add, remove, add_admins,
/// remove_admins] removes `remove` (members and admins alike) and
/// `remove_admins` (from the admins only), then adds `add` as members and
/// `add_admins` as admins and members; a name both removed and added ends
/// added. Returns the new (members, admins), sorted and deduplicated.
/// Generic so that a node of a cluster changes a group's names the same way.
pub fn changed_lists<T: Ord + Clone>(old: (&[T], &[T]), change: [&[T]; 4]) -> (Vec<T>, Vec<T>) {
    let (old_members, old_admins) = old;
    let [add, remove, add_admins, remove_admins] = change;
    let sorted = |list: &[T]| {
        let mut list = list.to_vec();
        list.sort_unstable();
        list.dedup();
        list
    };
    let (remove, remove_admins) = (sorted(remove), sorted(remove_admins));
    let add_admins = sorted(add_admins);
    let kept = |list: &[T], also: &[T]| -> Vec<T> {
        list.iter()
            .filter(|u| remove.binary_search(u).is_err() && also.binary_search(u).is_err())
            .cloned()
            .collect()
    };
    let mut admins = kept(old_admins, &remove_admins);
    admins.extend(add_admins.iter().cloned());
    admins.sort_unstable();
    admins.dedup();
    let mut members = kept(old_members, &[]);
    members.extend(add.iter().chain(&add_admins).cloned());
    members.sort_unstable();
    members.dedup();
    (members, admins)
}

/// What a group subscription gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GroupRole {
    /// The count, batched.
    Member,
    /// Each member's change, at once.
    Admin,
}

/// The answer to a group subscribe.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupSnapshot {
    pub group: GroupId,
    pub role: GroupRole,
    /// Per group, only grows: later pushes carry higher versions.
    pub version: u64,
    /// Members published online.
    pub count: u32,
    /// Members, admins included.
    pub members: u32,
}

/// A group push for the driver to deliver, drained with
/// [`Core::poll_group_output`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GroupOutput {
    /// The group's online count.
    Count {
        to: SessionId,
        group: GroupId,
        version: u64,
        count: u32,
    },
    /// To an admin: `member`'s published view went online or offline.
    Member {
        to: SessionId,
        group: GroupId,
        version: u64,
        member: UserId,
        online: bool,
        count: u32,
    },
    /// The subscription ended: the user left the group, or it was removed.
    Ended { to: SessionId, group: GroupId },
    /// Batched, to a session watching pages of `group` (the `group_watch`
    /// module): the latest published view of each listed member whose view
    /// changed since the last flush, by user id.
    Page {
        to: SessionId,
        group: GroupId,
        entries: Vec<(UserId, crate::types::Presence)>,
    },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Group {
    /// Sorted, admins included.
    pub(crate) members: Vec<UserId>,
    /// Sorted.
    pub(crate) admins: Vec<UserId>,
    /// Bumped by each write of the membership.
    pub(crate) membership: u64,
    /// Members published online: what the count counts, and the first
    /// section of member pages.
    pub(crate) online: BTreeSet<UserId>,
    /// Members published online.
    pub(crate) count: u32,
    /// Bumped by each change of the count and each membership write.
    pub(crate) version: u64,
    /// Member subscriptions (Online or Lingering sessions), each with the
    /// count that session was last told.
    pub(crate) counted: BTreeMap<SessionId, u32>,
    /// Admin subscriptions (Online or Lingering sessions), sorted.
    pub(crate) admin_subs: Vec<SessionId>,
    pub(crate) flush_due: Option<Millis>,
}

impl Group {
    pub(crate) fn role_of(&self, user: UserId) -> Option<GroupRole> {
        if self.admins.binary_search(&user).is_ok() {
            Some(GroupRole::Admin)
        } else if self.members.binary_search(&user).is_ok() {
            Some(GroupRole::Member)
        } else {
            None
        }
    }

    pub(crate) fn unsubscribe(&mut self, id: SessionId) {
        self.counted.remove(&id);
        if let Ok(at) = self.admin_subs.binary_search(&id) {
            self.admin_subs.remove(at);
        }
    }
}

/// Everything the core keeps for groups.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Groups {
    pub(crate) groups: BTreeMap<GroupId, Group>,
    /// User → the groups they are a member of, sorted.
    pub(crate) member_of: BTreeMap<UserId, Vec<GroupId>>,
    /// Session → the groups it subscribes to, sorted.
    pub(crate) by_session: BTreeMap<SessionId, Vec<GroupId>>,
    /// The highest version a removed group reached: a group created again
    /// starts above it.
    pub(crate) version_floor: u64,
    /// The highest membership version a removed group reached: a group
    /// created afterwards starts above it, so no membership version of a
    /// group id repeats (a backend's expected version never matches a
    /// group that was removed and written again).
    pub(crate) membership_floor: u64,
    pub(crate) outputs: VecDeque<GroupOutput>,
    /// Watched pages and page budgets (the `group_watch` module).
    pub(crate) watches: crate::group_watch::Watches,
    /// Counts come from outside (the `group_fed` module), not from this
    /// core's published views.
    pub(crate) fed: bool,
    /// Groups whose online members changed, while tracked (the
    /// `group_changes` module: a shard owner's partial counts).
    pub(crate) changed: Option<BTreeSet<GroupId>>,
    #[cfg(feature = "mutants")]
    pub(crate) mutant: Option<crate::mutants::GroupMutant>,
}

impl Groups {
    #[cfg(feature = "mutants")]
    pub(crate) fn is(&self, m: crate::mutants::GroupMutant) -> bool {
        self.mutant == Some(m)
    }

    pub(crate) fn note_changed(&mut self, group: GroupId) {
        if let Some(changed) = &mut self.changed {
            changed.insert(group);
        }
    }

    pub(crate) fn unlink_session(&mut self, id: SessionId, group: GroupId) {
        if let Some(list) = self.by_session.get_mut(&id) {
            if let Ok(at) = list.binary_search(&group) {
                list.remove(at);
            }
            if list.is_empty() {
                self.by_session.remove(&id);
            }
        }
    }
}

#[cfg(feature = "mutants")]
macro_rules! group_mutant {
    ($groups:expr, $m:ident) => {
        $groups.is($crate::mutants::GroupMutant::$m)
    };
}
#[cfg(not(feature = "mutants"))]
macro_rules! group_mutant {
    ($groups:expr, $m:ident) => {
        false
    };
}
pub(crate) use group_mutant;

pub(crate) fn is_online(slots: &[Slot], id: SessionId) -> bool {
    slots
        .get(id.index())
        .filter(|slot| slot.generation == id.generation())
        .and_then(|slot| slot.session.as_ref())
        .is_some_and(|s| matches!(s.link(), Link::Online { .. }))
}

pub(crate) fn arm_flush(group_id: GroupId, group: &mut Group, core: &mut Core) {
    if group.flush_due.is_none() && !group.counted.is_empty() {
        let due = core.clock.plus(core.config.group_interval);
        group.flush_due = Some(due);
        core.timers.insert((due, Timer::Group(group_id)));
    }
}

impl Core {
    /// Switches on one deliberate bug of group presence (feature `mutants`).
    #[cfg(feature = "mutants")]
    pub fn set_group_mutant(&mut self, mutant: Option<crate::mutants::GroupMutant>) {
        self.groups.mutant = mutant;
    }

    /// The next group push for the driver. Drain after every input, like
    /// [`Core::poll_output`].
    pub fn poll_group_output(&mut self) -> Option<GroupOutput> {
        self.groups.outputs.pop_front()
    }

    /// Writes a group's members and admins (a backend's input; an admin is
    /// a member whether listed as one or not). Creates the group if new.
    /// Sessions of users who left get `GroupOutput::Ended`; a user who
    /// became or stopped being an admin keeps the subscription in the new
    /// role. Admins get the count at once, members at the next flush if it
    /// changed. Returns the membership version. Limits are checked before
    /// anything is stored, on the lists as given (duplicates count).
    pub fn handle_set_group(
        &mut self,
        now: Millis,
        group: GroupId,
        members: &[UserId],
        admins: &[UserId],
    ) -> Result<u64, Error> {
        self.advance(now);
        if admins.len() > self.config.max_group_admins {
            return Err(self.group_limit(Limit::GroupAdmins));
        }
        if members.len() > self.config.max_group_members {
            return Err(self.group_limit(Limit::GroupMembers));
        }
        let exists = self.groups.groups.contains_key(&group);
        if !exists && self.groups.groups.len() >= self.config.max_groups {
            return Err(self.group_limit(Limit::Groups));
        }
        let mut admins = admins.to_vec();
        admins.sort_unstable();
        admins.dedup();
        let mut members: Vec<UserId> = members.iter().chain(&admins).copied().collect();
        members.sort_unstable();
        members.dedup();
        if members.len() > self.config.max_group_members {
            return Err(self.group_limit(Limit::GroupMembers));
        }
        Ok(self.write_group(group, members, admins))
    }

    /// Changes a group's lists by difference (a backend's input): removes
    /// `change.remove` (members and admins alike) and `change.remove_admins`
    /// (from the admins only: they stay members), then adds `change.add` as
    /// members and `change.add_admins` as admins (and members), so a name
    /// both removed and added ends added. A group that does not exist is at
    /// membership version 0 with no members, and a change creates it.
    /// With `change.expect` set, the change is made only if the group's
    /// membership version is that one (`Error::VersionMismatch` otherwise):
    /// a backend writing in several steps sees a concurrent writer.
    /// Every effect is the one `handle_set_group` has for the same
    /// resulting lists. Limits are checked before anything is stored: each
    /// list as given (`max_group_members` names to add or remove,
    /// `max_group_admins` admins to add or remove), then the group's lists
    /// after the change and `max_groups` for a new group. Returns the new
    /// membership version.
    pub fn handle_change_group(
        &mut self,
        now: Millis,
        group: GroupId,
        change: &GroupChange<'_>,
    ) -> Result<u64, Error> {
        self.advance(now);
        if change.add_admins.len() > self.config.max_group_admins
            || change.remove_admins.len() > self.config.max_group_admins
        {
            return Err(self.group_limit(Limit::GroupAdmins));
        }
        if change.add.len() > self.config.max_group_members
            || change.remove.len() > self.config.max_group_members
        {
            return Err(self.group_limit(Limit::GroupMembers));
        }
        let (old_members, old_admins, current) = match self.groups.groups.get(&group) {
            Some(g) => (&g.members[..], &g.admins[..], g.membership),
            None => (&[][..], &[][..], 0),
        };
        if let Some(expected) = change.expect {
            if expected != current {
                return Err(Error::VersionMismatch { current });
            }
        }
        let (members, admins) = changed_lists(
            (old_members, old_admins),
            [
                change.add,
                change.remove,
                change.add_admins,
                change.remove_admins,
            ],
        );
        let exists = self.groups.groups.contains_key(&group);
        if admins.len() > self.config.max_group_admins {
            return Err(self.group_limit(Limit::GroupAdmins));
        }
        if members.len() > self.config.max_group_members {
            return Err(self.group_limit(Limit::GroupMembers));
        }
        if !exists && self.groups.groups.len() >= self.config.max_groups {
            return Err(self.group_limit(Limit::Groups));
        }
        Ok(self.write_group(group, members, admins))
    }

    /// Stores a group's new lists (sorted, deduplicated, admins among the
    /// members, within the limits): the online set and count, the index,
    /// the subscriptions in their new roles, the admins' counts, the flush
    /// and the watches. Returns the membership version.
    fn write_group(&mut self, group: GroupId, members: Vec<UserId>, admins: Vec<UserId>) -> u64 {
        let mut groups = std::mem::take(&mut self.groups);
        let floor = groups.version_floor;
        let mut g = groups.groups.remove(&group).unwrap_or(Group {
            version: floor,
            membership: groups.membership_floor,
            ..Group::default()
        });
        let old = std::mem::replace(&mut g.members, members);
        g.admins = admins;
        update_index(&mut groups.member_of, group, &old, &g.members);
        let old_count = g.count;
        // Fed counts: the source sends the count after this write under a
        // version of its own. Until then the count is the last one fed, cut
        // to the members, told under a version between the source's.
        let mut told = true;
        if groups.fed {
            g.count = g.count.min(g.members.len() as u32);
            if !(g.version + 1).is_multiple_of(crate::group_fed::FED_VERSION_STEP) {
                g.version += 1;
            } else {
                // No version left to tell it under: everyone hears it with
                // the source's next count.
                told = false;
                if let Some(due) = g.flush_due.take() {
                    self.timers.remove(&(due, Timer::Group(group)));
                }
            }
        } else {
            g.online = g
                .members
                .iter()
                .copied()
                .filter(|&m| self.published_online(m))
                .collect();
            g.count = g.online.len() as u32;
            g.version += 1;
        }
        g.membership += 1;

        // Subscriptions in their new roles; leavers end.
        let mut ended = Vec::new();
        let counted: Vec<SessionId> = g.counted.keys().copied().collect();
        for id in counted {
            match self.session_user(id).and_then(|u| g.role_of(u)) {
                Some(GroupRole::Member) => {}
                Some(GroupRole::Admin) => {
                    g.counted.remove(&id);
                    if let Err(at) = g.admin_subs.binary_search(&id) {
                        g.admin_subs.insert(at, id);
                    }
                }
                None => ended.push(id),
            }
        }
        let keep_admins = group_mutant!(groups, AdminKeptAfterDemotion);
        for id in g.admin_subs.clone() {
            match self.session_user(id).and_then(|u| g.role_of(u)) {
                Some(GroupRole::Admin) => {}
                Some(GroupRole::Member) if keep_admins => {}
                Some(GroupRole::Member) => {
                    // Admins were told every count: this one knew `old_count`
                    // (if this write could not be told, it knows none).
                    g.unsubscribe(id);
                    g.counted
                        .insert(id, if told { old_count } else { u32::MAX });
                }
                None => ended.push(id),
            }
        }
        for id in ended {
            g.unsubscribe(id);
            groups.unlink_session(id, group);
            if is_online(&self.slots, id) {
                groups
                    .outputs
                    .push_back(GroupOutput::Ended { to: id, group });
            }
        }
        for &to in g.admin_subs.iter().filter(|_| told) {
            if is_online(&self.slots, to) {
                groups.outputs.push_back(GroupOutput::Count {
                    to,
                    group,
                    version: g.version,
                    count: g.count,
                });
            }
        }
        if told && g.count != old_count && !group_mutant!(groups, MembershipNotFlushed) {
            arm_flush(group, &mut g, self);
        }
        let membership = g.membership;
        groups.note_changed(group);
        groups.groups.insert(group, g);
        self.groups = groups;
        self.watches_group_changed(group);
        membership
    }

    /// Removes a group: its subscriptions end (`GroupOutput::Ended`).
    pub fn handle_remove_group(&mut self, now: Millis, group: GroupId) -> Result<(), Error> {
        self.advance(now);
        let Some(g) = self.groups.groups.remove(&group) else {
            return Err(Error::UnknownGroup);
        };
        update_index(&mut self.groups.member_of, group, &g.members, &[]);
        if let Some(due) = g.flush_due {
            self.timers.remove(&(due, Timer::Group(group)));
        }
        let subs = g.counted.keys().chain(&g.admin_subs).copied();
        for id in subs {
            self.groups.unlink_session(id, group);
            if is_online(&self.slots, id) {
                self.groups
                    .outputs
                    .push_back(GroupOutput::Ended { to: id, group });
            }
        }
        self.groups.version_floor = self.groups.version_floor.max(g.version);
        self.groups.membership_floor = self.groups.membership_floor.max(g.membership);
        self.groups.note_changed(group);
        self.watches_group_changed(group);
        Ok(())
    }

    /// Subscribes an Online session of a member to `group`: a member's
    /// session gets the count (batched), an admin's each change (at once).
    /// Subscribing again answers with a fresh snapshot. Refused with
    /// `Error::NotMember` for anyone else.
    pub fn handle_group_subscribe(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
    ) -> Result<GroupSnapshot, Error> {
        self.advance(now);
        let id = self.online(id)?;
        let user = self.session_user(id).ok_or(Error::Stale)?;
        let role = self
            .groups
            .groups
            .get(&group)
            .and_then(|g| g.role_of(user))
            .ok_or(Error::NotMember)?;
        let held = self.groups.by_session.get(&id);
        let subscribed = held.is_some_and(|list| list.binary_search(&group).is_ok());
        if !subscribed
            && held.map_or(0, Vec::len) >= self.config.max_group_subscriptions_per_session
        {
            return Err(self.group_limit(Limit::GroupSubscriptionsPerSession));
        }
        let list = self.groups.by_session.entry(id).or_default();
        if let Err(at) = list.binary_search(&group) {
            list.insert(at, group);
        }
        let Some(g) = self.groups.groups.get_mut(&group) else {
            return Err(Error::NotMember);
        };
        match role {
            GroupRole::Member => {
                g.counted.insert(id, g.count);
            }
            GroupRole::Admin => {
                if let Err(at) = g.admin_subs.binary_search(&id) {
                    g.admin_subs.insert(at, id);
                }
            }
        }
        Ok(GroupSnapshot {
            group,
            role,
            version: g.version,
            count: g.count,
            members: g.members.len() as u32,
        })
    }

    /// Ends a group subscription.
    pub fn handle_group_unsubscribe(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
    ) -> Result<(), Error> {
        self.advance(now);
        let id = self.online(id)?;
        let subscribed = self
            .groups
            .by_session
            .get(&id)
            .is_some_and(|list| list.binary_search(&group).is_ok());
        if !subscribed {
            return Err(Error::NotSubscribed);
        }
        self.groups.unlink_session(id, group);
        if let Some(g) = self.groups.groups.get_mut(&group) {
            g.unsubscribe(id);
        }
        Ok(())
    }

    /// Brings back a group a previous process stored, at the membership
    /// version it had, so a backend's `expect_version` still matches after a
    /// restart. Checked and written as `handle_set_group` is; a group already
    /// held is refused (`Error::VersionMismatch`, as a change expecting no
    /// group would be): restoring is for a fresh core.
    pub fn handle_restore_group(
        &mut self,
        now: Millis,
        group: GroupId,
        members: &[UserId],
        admins: &[UserId],
        membership: u64,
    ) -> Result<(), Error> {
        if let Some(g) = self.groups.groups.get(&group) {
            return Err(Error::VersionMismatch {
                current: g.membership,
            });
        }
        self.handle_define_group(now, group, members, admins, membership)
    }

    /// The membership version every group created from now on starts
    /// above (the highest a removed group reached).
    pub fn group_membership_floor(&self) -> u64 {
        self.groups.membership_floor
    }

    /// Raises [`Core::group_membership_floor`] to `floor` (a restart: the
    /// stored floor, and the versions of stored groups not restored).
    pub fn raise_group_membership_floor(&mut self, floor: u64) {
        self.groups.membership_floor = self.groups.membership_floor.max(floor);
    }

    /// The group's membership version, or `None` for no such group.
    pub fn group_membership(&self, group: GroupId) -> Option<u64> {
        self.groups.groups.get(&group).map(|g| g.membership)
    }

    /// Members published online, or `None` for no such group.
    pub fn group_count(&self, group: GroupId) -> Option<u32> {
        self.groups.groups.get(&group).map(|g| g.count)
    }

    /// The group's members (admins included) and admins, sorted.
    pub fn group_members(&self, group: GroupId) -> Option<(&[UserId], &[UserId])> {
        self.groups
            .groups
            .get(&group)
            .map(|g| (&g.members[..], &g.admins[..]))
    }

    /// The groups `session` subscribes to, with its role in each.
    pub fn group_subscriptions(&self, session: SessionId) -> Vec<(GroupId, GroupRole)> {
        let Some(list) = self.groups.by_session.get(&session) else {
            return Vec::new();
        };
        list.iter()
            .filter_map(|group| {
                let g = self.groups.groups.get(group)?;
                let role = if g.admin_subs.binary_search(&session).is_ok() {
                    GroupRole::Admin
                } else {
                    GroupRole::Member
                };
                Some((*group, role))
            })
            .collect()
    }

    pub(crate) fn published_online(&self, user: UserId) -> bool {
        self.index
            .get(user)
            .is_some_and(|u| self.users[u as usize].published.online)
    }

    pub(crate) fn session_user(&self, id: SessionId) -> Option<UserId> {
        self.session(id).map(|s| self.users[s.user as usize].id)
    }

    pub(crate) fn group_limit(&mut self, limit: Limit) -> Error {
        self.counters.limits_hit += 1;
        Error::LimitExceeded(limit)
    }
}

/// Moves `group` in the user → groups index from the members `old` to the
/// members `new` (both sorted), touching only those who joined or left.
fn update_index(
    member_of: &mut BTreeMap<UserId, Vec<GroupId>>,
    group: GroupId,
    old: &[UserId],
    new: &[UserId],
) {
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        let (left, joined) = match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) if a == b => {
                i += 1;
                j += 1;
                continue;
            }
            (Some(a), Some(b)) if a < b => {
                i += 1;
                (Some(*a), None)
            }
            (Some(a), None) => {
                i += 1;
                (Some(*a), None)
            }
            (_, Some(b)) => {
                j += 1;
                (None, Some(*b))
            }
            (None, None) => break,
        };
        if let Some(user) = left {
            if let Some(list) = member_of.get_mut(&user) {
                if let Ok(at) = list.binary_search(&group) {
                    list.remove(at);
                }
                if list.is_empty() {
                    member_of.remove(&user);
                }
            }
        }
        if let Some(user) = joined {
            let list = member_of.entry(user).or_default();
            if let Err(at) = list.binary_search(&group) {
                list.insert(at, group);
            }
        }
    }
}
