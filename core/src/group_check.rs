//! The structural group invariants, part of `Core::check_invariants()`
//! (feature `check`): G2 and the structural half of G4, plus the indexes.

use crate::engine::Core;
use crate::groups::GroupRole;
use crate::timers::Timer;
use crate::types::{Millis, SessionId};
use std::collections::{BTreeMap, BTreeSet};

impl Core {
    pub(crate) fn check_groups(
        &self,
        expected_timers: &mut BTreeSet<(Millis, Timer)>,
    ) -> Result<(), String> {
        let mut index = 0;
        let mut held: BTreeMap<SessionId, BTreeSet<_>> = BTreeMap::new();
        for (&id, g) in &self.groups.groups {
            ensure(g.members.windows(2).all(|w| w[0] < w[1]), || {
                format!("{id:?}: members unsorted")
            })?;
            ensure(g.admins.windows(2).all(|w| w[0] < w[1]), || {
                format!("{id:?}: admins unsorted")
            })?;
            ensure(
                g.admins.iter().all(|a| g.members.binary_search(a).is_ok()),
                || format!("{id:?}: an admin is not a member"),
            )?;
            ensure(
                g.members.len() <= self.config.max_group_members
                    && g.admins.len() <= self.config.max_group_admins,
                || format!("{id:?} over its member or admin cap"),
            )?;
            // G2: the count is the number of members published online.
            let online = g
                .members
                .iter()
                .filter(|&&m| self.published_online(m))
                .count();
            ensure(g.count as usize <= g.members.len(), || {
                format!(
                    "G2: {id:?} counts {} of {} members",
                    g.count,
                    g.members.len()
                )
            })?;
            if self.groups.fed {
                // Fed counts: the count source's, and no online set.
                ensure(g.online.is_empty(), || {
                    format!("{id:?}: fed counts, but an online set is kept")
                })?;
            } else {
                ensure(
                    g.online.len() == online
                        && g.online.iter().all(|&m| {
                            g.members.binary_search(&m).is_ok() && self.published_online(m)
                        }),
                    || {
                        format!(
                            "G2: {id:?} keeps another online set than its members published online"
                        )
                    },
                )?;
                ensure(g.count as usize == online, || {
                    format!(
                        "G2: {id:?} counts {} but {online} are published online",
                        g.count
                    )
                })?;
            }
            for m in &g.members {
                index += 1;
                ensure(
                    self.groups
                        .member_of
                        .get(m)
                        .is_some_and(|l| l.binary_search(&id).is_ok()),
                    || format!("{m:?} of {id:?} missing from the user index"),
                )?;
            }
            ensure(g.admin_subs.windows(2).all(|w| w[0] < w[1]), || {
                format!("{id:?}: admin subscriptions unsorted")
            })?;
            let subs = g
                .counted
                .keys()
                .map(|s| (s, GroupRole::Member))
                .chain(g.admin_subs.iter().map(|s| (s, GroupRole::Admin)));
            for (&s, role) in subs {
                ensure(held.entry(s).or_default().insert(id), || {
                    format!("{s} holds {id:?} twice")
                })?;
                // G4 (and I11 for groups): held by a live session of a
                // user in that role.
                let user = self
                    .session_user(s)
                    .ok_or_else(|| format!("G4: dead session {s} subscribes to {id:?}"))?;
                let admin = g.admins.binary_search(&user).is_ok();
                let member = g.members.binary_search(&user).is_ok();
                ensure(member, || {
                    format!("G4/I11: {s} of non-member {user:?} subscribes to {id:?}")
                })?;
                ensure(admin == (role == GroupRole::Admin), || {
                    format!("G4: {s} of {user:?} (admin: {admin}) subscribes to {id:?} as {role:?}")
                })?;
            }
            if let Some(due) = g.flush_due {
                expected_timers.insert((due, Timer::Group(id)));
            }
        }
        let indexed: usize = self.groups.member_of.values().map(Vec::len).sum();
        ensure(indexed == index, || {
            "the user → groups index holds strangers".to_string()
        })?;
        ensure(
            self.groups.member_of.values().all(|l| !l.is_empty()),
            || "the user → groups index keeps an empty list".to_string(),
        )?;
        let by_session: BTreeMap<SessionId, BTreeSet<_>> = self
            .groups
            .by_session
            .iter()
            .map(|(s, l)| (*s, l.iter().copied().collect()))
            .collect();
        ensure(by_session == held, || {
            format!("session → groups index {by_session:?} differs from the groups' {held:?}")
        })?;
        self.check_watches(expected_timers)?;
        for (s, list) in &self.groups.by_session {
            ensure(
                list.len() <= self.config.max_group_subscriptions_per_session,
                || format!("{s} over the group subscription cap"),
            )?;
        }
        Ok(())
    }
}

fn ensure(ok: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(why())
    }
}
