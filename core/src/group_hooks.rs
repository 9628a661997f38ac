//! The group hooks the engine calls (see the `groups` module): a member's
//! published view changed, a count flush is due, a session ended or was
//! resumed.

use crate::engine::Core;
use crate::group_watch::CarriedWatches;
use crate::groups::{arm_flush, group_mutant, is_online, GroupId, GroupOutput, GroupRole};
use crate::types::{Millis, SessionId, UserId};

/// What a resumed session takes over from the one it resumes.
pub(crate) struct CarriedGroups {
    groups: Vec<GroupId>,
    watches: CarriedWatches,
}

impl Core {
    /// `user`'s published view changed (from `was_online` to `online`):
    /// watched pages listing them queue it; if it went online or offline,
    /// the count of each of their groups moves by one and the admins are
    /// told.
    pub(crate) fn group_published(&mut self, user: UserId, was_online: bool, online: bool) {
        // Fed counts come from outside, and so do the views pages list.
        if self.groups.fed {
            return;
        }
        // Watched pages list any change of a published view.
        self.watch_published(user);
        if was_online == online || !self.groups.member_of.contains_key(&user) {
            return;
        }
        let mut groups = std::mem::take(&mut self.groups);
        let missed = !online && group_mutant!(groups, CountMissesOffline);
        let frozen = group_mutant!(groups, VersionNotBumped);
        for &group in groups.member_of.get(&user).into_iter().flatten() {
            let Some(g) = groups.groups.get_mut(&group) else {
                continue;
            };
            if online {
                g.online.insert(user);
            } else {
                g.online.remove(&user);
            }
            if let Some(changed) = &mut groups.changed {
                changed.insert(group);
            }
            if online {
                g.count += 1;
            } else if !missed {
                g.count = g.count.saturating_sub(1);
            }
            if !frozen {
                g.version += 1;
            }
            for &to in &g.admin_subs {
                if is_online(&self.slots, to) {
                    groups.outputs.push_back(GroupOutput::Member {
                        to,
                        group,
                        version: g.version,
                        member: user,
                        online,
                        count: g.count,
                    });
                }
            }
            arm_flush(group, g, self);
        }
        self.groups = groups;
    }

    /// The count flush of `group`: each Online member session told another
    /// count than the current one is told this one.
    pub(crate) fn on_group_flush(&mut self, group: GroupId) {
        let Core { groups, slots, .. } = self;
        let Some(g) = groups.groups.get_mut(&group) else {
            return;
        };
        g.flush_due = None;
        for (&to, last) in g.counted.iter_mut() {
            if *last != g.count && is_online(slots, to) {
                *last = g.count;
                groups.outputs.push_back(GroupOutput::Count {
                    to,
                    group,
                    version: g.version,
                    count: g.count,
                });
            }
        }
    }

    /// A session ended: its group subscriptions end with it.
    pub(crate) fn group_session_ended(&mut self, id: SessionId) {
        self.watches_session_ended(id);
        if group_mutant!(self.groups, SubsKeptAfterEnd) {
            return;
        }
        for group in self.groups.by_session.remove(&id).unwrap_or_default() {
            if let Some(g) = self.groups.groups.get_mut(&group) {
                g.unsubscribe(id);
            }
        }
    }

    /// A resume: takes `old`'s group subscriptions and watched pages, for
    /// `group_carry`.
    pub(crate) fn group_take(&mut self, old: SessionId) -> CarriedGroups {
        let taken = self.groups.by_session.remove(&old).unwrap_or_default();
        for group in &taken {
            if let Some(g) = self.groups.groups.get_mut(group) {
                g.unsubscribe(old);
            }
        }
        CarriedGroups {
            groups: taken,
            watches: self.watches_take(old),
        }
    }

    /// A resume on another node of a cluster: the new session `id` holds
    /// the group subscriptions its previous session's record lists, in the
    /// roles its user has now, and is told each count at once, as a resume
    /// on one node is. A listed group it does not hold (removed, or its user
    /// left it while it was away) is told `Ended`; those are returned.
    pub fn handle_group_carry(
        &mut self,
        now: Millis,
        id: SessionId,
        groups: &[GroupId],
    ) -> Vec<GroupId> {
        self.advance(now);
        let user = self.session_user(id);
        // A record read from outside may name a group twice.
        let mut groups = groups.to_vec();
        groups.sort_unstable();
        groups.dedup();
        let (held, gone): (Vec<GroupId>, Vec<GroupId>) = groups.iter().partition(|group| {
            let g = self.groups.groups.get(group);
            user.is_some_and(|u| g.is_some_and(|g| g.role_of(u).is_some()))
        });
        let taken = CarriedGroups {
            groups: held,
            watches: CarriedWatches::default(),
        };
        self.group_carry(id, taken);
        for &group in gone.iter().filter(|_| user.is_some()) {
            self.groups
                .outputs
                .push_back(GroupOutput::Ended { to: id, group });
        }
        gone
    }

    /// A resume: the new session `id` holds the taken subscriptions, in the
    /// roles its user has now, and is told each count at once; it holds the
    /// taken watches too.
    pub(crate) fn group_carry(&mut self, id: SessionId, taken: CarriedGroups) {
        let Some(user) = self.session_user(id) else {
            return;
        };
        self.watches_carry(id, taken.watches);
        for group in taken.groups {
            let Some(g) = self.groups.groups.get_mut(&group) else {
                continue;
            };
            match g.role_of(user) {
                Some(GroupRole::Member) => {
                    g.counted.insert(id, g.count);
                }
                Some(GroupRole::Admin) => {
                    if let Err(at) = g.admin_subs.binary_search(&id) {
                        g.admin_subs.insert(at, id);
                    }
                }
                None => continue,
            }
            self.groups.outputs.push_back(GroupOutput::Count {
                to: id,
                group,
                version: g.version,
                count: g.count,
            });
            let list = self.groups.by_session.entry(id).or_default();
            if let Err(at) = list.binary_search(&group) {
                list.insert(at, group);
            }
        }
    }
}
