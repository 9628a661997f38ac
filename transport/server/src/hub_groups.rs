//! Group requests and pushes of the hub (issue 28, docs/groups.md): member
//! names to ids, the references a group's names hold, and the core's group
//! outputs as push frames.
//!
//! Each member name of a group holds a reference on its interned id while
//! it is in the group, so the id is never freed and given to another name
//! (which would silently make a stranger a member).

use super::{Hub, HubOutput, RestoreError};
use bytes::Bytes;
use greendot_core::{
    GroupChange, GroupId, GroupOutput, Millis, PageCursor, SessionId, Tier, UserId,
};
use greendot_proto::{
    self as proto, Answer, ErrorCode, GroupCursor, GroupEntry, GroupPage, GroupSnapshot, Request,
    WireError,
};

/// A group as a store keeps it: names, not this process's ids, and the
/// membership version a backend's `expect_version` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredGroup {
    pub group: u64,
    pub membership: u64,
    /// Admins included, in the order of this process's ids.
    pub members: Vec<String>,
    /// In the order of this process's ids.
    pub admins: Vec<String>,
}

/// A group write for a driver that stores groups, in the order made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupWrite {
    Set(StoredGroup),
    /// The group is gone; groups created from now on start above
    /// `membership_floor` (the core's, after the removal).
    Removed {
        group: u64,
        membership_floor: u64,
    },
}

impl GroupWrite {
    pub fn group(&self) -> u64 {
        match self {
            GroupWrite::Set(g) => g.group,
            GroupWrite::Removed { group, .. } => *group,
        }
    }
}

impl Hub {
    /// One group request of `session` (`svc`: it holds a service token).
    pub(super) fn group_request(
        &mut self,
        now: Millis,
        session: SessionId,
        svc: bool,
        request: Request,
    ) -> Result<Answer, WireError> {
        if matches!(
            request,
            Request::SetGroup { .. } | Request::ChangeGroup { .. } | Request::RemoveGroup { .. }
        ) {
            self.check_group_write(svc, &request)?;
        }
        match request {
            Request::SetGroup {
                group,
                members,
                admins,
            } => self.set_group(now, GroupId(group), &members, &admins),
            Request::ChangeGroup {
                group,
                add,
                remove,
                add_admins,
                remove_admins,
                expect_version,
            } => {
                let lists = [&add[..], &remove, &add_admins, &remove_admins];
                self.change_group(now, GroupId(group), lists, expect_version)
            }
            Request::RemoveGroup { group } => {
                let old = self.group_member_ids(GroupId(group));
                self.core.handle_remove_group(now, GroupId(group))?;
                self.drop_member_refs(&old);
                if self.store_groups {
                    self.group_writes.push(GroupWrite::Removed {
                        group,
                        membership_floor: self.core.group_membership_floor(),
                    });
                }
                Ok(Answer::Done)
            }
            Request::GroupSubscribe { group } => {
                let s = self
                    .core
                    .handle_group_subscribe(now, session, GroupId(group))?;
                Ok(Answer::GroupSubscribed(GroupSnapshot {
                    group: s.group.0,
                    role: s.role.into(),
                    version: s.version,
                    count: s.count,
                    members: s.members,
                }))
            }
            Request::GroupUnsubscribe { group } => {
                self.core
                    .handle_group_unsubscribe(now, session, GroupId(group))?;
                Ok(Answer::Done)
            }
            Request::GroupPage {
                group,
                after,
                limit,
            } => self.group_page(now, session, group, after, limit, false),
            Request::GroupWatchPage {
                group,
                after,
                limit,
            } => self.group_page(now, session, group, after, limit, true),
            Request::GroupRenewWatch { group, after } => {
                self.core
                    .handle_group_renew_watch(now, session, GroupId(group), cursor(after))?;
                Ok(Answer::Done)
            }
            Request::GroupUnwatchPage { group, after } => {
                self.core
                    .handle_group_unwatch(now, session, GroupId(group), cursor(after))?;
                Ok(Answer::Done)
            }
            _ => Err(WireError::new(ErrorCode::Internal, "not a group request")),
        }
    }

    /// A member page, watched or not.
    fn group_page(
        &mut self,
        now: Millis,
        session: SessionId,
        group: u64,
        after: Option<GroupCursor>,
        limit: u32,
        watch: bool,
    ) -> Result<Answer, WireError> {
        let from = cursor(after);
        let limit = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .min(self.page_entries_that_fit());
        let group = GroupId(group);
        let page = if watch {
            self.core
                .handle_group_watch_page(now, session, group, from, limit)?
        } else {
            self.core
                .handle_group_page(now, session, group, from, limit)?
        };
        Ok(Answer::GroupPage(GroupPage {
            group: page.group.0,
            version: page.version,
            count: page.count,
            entries: self.group_entries(&page.entries),
            next: page.next.map(|c| GroupCursor {
                online: c.online,
                after: c.after.0,
            }),
        }))
    }

    /// A member page read by the cluster (counts fed): checks the session,
    /// its membership and its page budget as for a page of its own (and the
    /// watch limits, for a page to be watched), spends the token, and
    /// returns how many entries to ask for.
    pub fn fed_group_page(
        &mut self,
        now: Millis,
        session: SessionId,
        group: u64,
        (after, limit): (Option<GroupCursor>, u32),
        watch: bool,
    ) -> Result<u32, WireError> {
        let limit = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .min(self.page_entries_that_fit());
        let watch = watch.then(|| cursor(after));
        let limit = self
            .core
            .handle_fed_group_page(now, session, GroupId(group), limit, watch)?;
        Ok(u32::try_from(limit).unwrap_or(u32::MAX))
    }

    /// A page the cluster read, to be watched: its members' views come
    /// through [`Hub::fed_view`] while a watch lists them. Fed views keep
    /// the edge's Unix milliseconds; their deltas are framed as they are.
    pub fn fed_watched_page(
        &mut self,
        now: Millis,
        session: SessionId,
        group: u64,
        after: Option<GroupCursor>,
        entries: &[GroupEntry],
    ) -> Result<(), WireError> {
        let entries = entries
            .iter()
            .filter_map(|e| Some((self.user_id(&e.user)?, e.presence.to_core())))
            .collect();
        self.core
            .handle_fed_watched_page(now, session, GroupId(group), cursor(after), entries)?;
        Ok(())
    }

    /// A published view of `user`, from the cluster (Unix milliseconds),
    /// for the watched pages that list her.
    pub fn fed_view(&mut self, now: Millis, user: &str, presence: greendot_core::Presence) {
        if let Some(id) = self.user_id(user) {
            self.core.handle_fed_view(now, id, presence);
        }
    }

    /// A member no watched page lists any more (the cluster stops following
    /// her views).
    pub fn poll_fed_unlisted(&mut self) -> Option<String> {
        self.name_unlisted();
        self.fed_unlisted.pop_front()
    }

    fn name_unlisted(&mut self) {
        while let Some(id) = self.core.poll_fed_unlisted() {
            if let Some(name) = self.user_name(id) {
                self.fed_unlisted.push_back(name.to_owned());
            }
        }
    }

    /// Whether a watched page lists `user`.
    pub fn is_fed_listed(&self, user: &str) -> bool {
        self.user_id(user)
            .is_some_and(|id| self.core.is_fed_listed(id))
    }

    /// How many entries a member page may hold so that its answer always
    /// fits the server frames clients accept (`proto::MAX_SERVER_FRAME`),
    /// every entry at its largest: the longest name, the longest status
    /// message, every number at its widest. Past it (a large configured
    /// page size or message cap) the page answers fewer entries, its
    /// cursor after the last one sent. At the defaults (200 entries of at
    /// most about 420 bytes) it is about 40,000: no cut.
    fn page_entries_that_fit(&self) -> usize {
        fn string(len: usize) -> usize {
            len + VARINT_MAX
        }
        let message = 1 + string(self.core.config().max_message_len);
        // version, online, status, message, kinds, last_seen, invisible.
        let presence = VARINT_MAX + 1 + 1 + message + 1 + 1 + VARINT_MAX + 1;
        let entry = string(self.limits.max_name_len) + presence;
        (proto::MAX_SERVER_FRAME.saturating_sub(PAGE_OVERHEAD) / entry).max(1)
    }

    fn group_entries(&self, entries: &[(UserId, greendot_core::Presence)]) -> Vec<GroupEntry> {
        // Fed views carry the cluster's Unix milliseconds already.
        let base = match self.core.group_counts_fed() {
            true => 0,
            false => self.unix_base_ms,
        };
        entries
            .iter()
            .map(|(user, presence)| GroupEntry {
                user: self.user_name(*user).unwrap_or_default().to_owned(),
                presence: proto::Presence::from_core(presence, base),
            })
            .collect()
    }

    /// Writes a group, its lists checked already (`check_group_write`): a
    /// write the core refuses leaves no name behind.
    fn set_group(
        &mut self,
        now: Millis,
        group: GroupId,
        members: &[String],
        admins: &[String],
    ) -> Result<Answer, WireError> {
        let interned = self.intern_all(members.iter().chain(admins))?;
        let (member_ids, admin_ids) = interned.split_at(members.len());
        self.write_group(group, &interned, true, |core| {
            core.handle_set_group(now, group, member_ids, admin_ids)
        })
    }

    /// Changes a group by difference (`lists`: add, remove, add_admins,
    /// remove_admins), checked already as `set_group`'s. Names to remove that
    /// were never interned are no members: they are skipped, not interned.
    fn change_group(
        &mut self,
        now: Millis,
        group: GroupId,
        lists: [&[String]; 4],
        expect: Option<u64>,
    ) -> Result<Answer, WireError> {
        let [add, remove, add_admins, remove_admins] = lists;
        let known = |hub: &Hub, names: &[String]| -> Vec<UserId> {
            names.iter().filter_map(|n| hub.user_id(n)).collect()
        };
        let remove_ids = known(self, remove);
        let remove_admin_ids = known(self, remove_admins);
        let interned = self.intern_all(add.iter().chain(add_admins))?;
        let (add_ids, add_admin_ids) = interned.split_at(add.len());
        let change = GroupChange {
            add: add_ids,
            remove: &remove_ids,
            add_admins: add_admin_ids,
            remove_admins: &remove_admin_ids,
            expect,
        };
        self.write_group(group, &interned, true, |core| {
            core.handle_change_group(now, group, &change)
        })
    }

    /// What a membership write (`SetGroup`, `ChangeGroup`, `RemoveGroup`)
    /// must pass before it goes anywhere: a service token, and its lists
    /// (as `check_lists`). A node of a cluster checks this before it writes
    /// the group to the cluster's store.
    pub(crate) fn check_group_write(&self, svc: bool, request: &Request) -> Result<(), WireError> {
        match request {
            Request::SetGroup {
                members, admins, ..
            } => {
                service_only(svc, "setting a group")?;
                self.check_lists(&[members], &[admins])
            }
            Request::ChangeGroup {
                add,
                remove,
                add_admins,
                remove_admins,
                ..
            } => {
                service_only(svc, "changing a group")?;
                self.check_lists(&[add, remove], &[add_admins, remove_admins])
            }
            Request::RemoveGroup { .. } => service_only(svc, "removing a group"),
            _ => Err(WireError::new(ErrorCode::Internal, "not a group write")),
        }
    }

    /// The limits of a membership write's lists, checked before any name
    /// is interned: each list of members (or admins) within the group's
    /// limit, and every name valid.
    fn check_lists(&self, members: &[&[String]], admins: &[&[String]]) -> Result<(), WireError> {
        let config = self.core.config();
        if admins.iter().any(|l| l.len() > config.max_group_admins) {
            return Err(WireError::new(
                ErrorCode::TooManyGroupAdmins,
                format!("at most {} admins per group", config.max_group_admins),
            ));
        }
        if members.iter().any(|l| l.len() > config.max_group_members) {
            return Err(WireError::new(
                ErrorCode::TooManyGroupMembers,
                format!(
                    "at most {} members per group, admins included",
                    config.max_group_members
                ),
            ));
        }
        for name in members.iter().chain(admins).copied().flatten() {
            self.name_ok(name, "member")?;
        }
        Ok(())
    }

    /// Interns `names` in order; on a refusal the ones interned so far are
    /// noted idle (nothing holds them) and nothing is kept.
    fn intern_all<'a>(
        &mut self,
        names: impl Iterator<Item = &'a String>,
    ) -> Result<Vec<UserId>, WireError> {
        let mut interned = Vec::with_capacity(names.size_hint().0);
        for name in names {
            match self.intern_user(name) {
                Ok(id) => interned.push(id),
                Err(e) => {
                    self.idle.extend(&interned);
                    return Err(e);
                }
            }
        }
        Ok(interned)
    }

    /// Runs a membership write of the core and moves the names' references
    /// from the old members to the new. `interned`: the names the request
    /// interned, noted idle when the core refuses it (nothing holds them).
    /// `record`: a write for the store (a restore is not one).
    fn write_group(
        &mut self,
        group: GroupId,
        interned: &[UserId],
        record: bool,
        write: impl FnOnce(&mut greendot_core::Core) -> Result<u64, greendot_core::Error>,
    ) -> Result<Answer, WireError> {
        let old = self.group_member_ids(group);
        match write(&mut self.core) {
            Ok(version) => {
                // The new references first: a member who stays never drops to 0.
                for id in self.group_member_ids(group) {
                    self.users.acquire(id.0);
                }
                self.drop_member_refs(&old);
                let record = record && self.store_groups;
                if let Some(stored) = self.stored_group(group).filter(|_| record) {
                    self.group_writes.push(GroupWrite::Set(stored));
                }
                Ok(Answer::GroupSet { version })
            }
            Err(e) => {
                self.idle.extend(interned);
                Err(e.into())
            }
        }
    }

    /// `group` as a store keeps it, `None` for no such group.
    fn stored_group(&self, group: GroupId) -> Option<StoredGroup> {
        let (members, admins) = self.core.group_members(group)?;
        let names = |ids: &[UserId]| -> Vec<String> {
            ids.iter()
                .filter_map(|&id| self.user_name(id).map(str::to_owned))
                .collect()
        };
        Some(StoredGroup {
            group: group.0,
            membership: self.core.group_membership(group)?,
            members: names(members),
            admins: names(admins),
        })
    }

    /// Records the group writes for a driver that stores them
    /// ([`Hub::take_group_writes`]); without, none are kept.
    pub fn with_stored_groups(mut self) -> Hub {
        self.store_groups = true;
        self
    }

    /// Group writes made since the last call, in order, for a driver that
    /// stores them (before it answers the request that made them); only
    /// after [`Hub::with_stored_groups`].
    pub fn take_group_writes(&mut self) -> Vec<GroupWrite> {
        std::mem::take(&mut self.group_writes)
    }

    /// Groups created from now on start above `floor` (a restart: the
    /// stored floor, and the versions of stored groups not restored).
    pub fn raise_group_membership_floor(&mut self, floor: u64) {
        self.core.raise_group_membership_floor(floor);
    }

    /// A group a previous process stored: before connections. Checked as a
    /// `SetGroup` is, so a group over a lowered limit is refused (the
    /// caller says so and goes on: the stored record stays until written).
    pub fn restore_group(&mut self, now: Millis, stored: &StoredGroup) -> Result<(), RestoreError> {
        let group = GroupId(stored.group);
        self.check_lists(&[&stored.members], &[&stored.admins])
            .map_err(RestoreError::Group)?;
        let interned = self
            .intern_all(stored.members.iter().chain(&stored.admins))
            .map_err(RestoreError::Group)?;
        let (members, admins) = interned.split_at(stored.members.len());
        let membership = stored.membership;
        self.write_group(group, &interned, false, |core| {
            core.handle_restore_group(now, group, members, admins, membership)
                .map(|()| membership)
        })
        .map(|_| ())
        .map_err(RestoreError::Group)
    }

    /// The members of `group` (admins included), none for no such group.
    fn group_member_ids(&self, group: GroupId) -> Vec<UserId> {
        self.core
            .group_members(group)
            .map(|(members, _)| members.to_vec())
            .unwrap_or_default()
    }

    fn drop_member_refs(&mut self, old: &[UserId]) {
        self.name_unlisted();
        for &id in old {
            if self.users.drop_ref(id.0) == 0 {
                self.idle.push(id);
            }
        }
    }

    /// A group push of the core as a frame for its session. An admin's
    /// subscription gets everything on the realtime stream (its counts and
    /// deltas stay in version order); a member's gets its counts on the
    /// batched stream; an end goes on the realtime stream; page deltas go on
    /// the batched stream.
    pub(super) fn group_push(&mut self, out: GroupOutput) -> HubOutput {
        let (session, tier, push) = match out {
            GroupOutput::Count {
                to,
                group,
                version,
                count,
            } => {
                let admin = self.session_user(to).is_some_and(|user| {
                    self.core
                        .group_members(group)
                        .is_some_and(|(_, admins)| admins.binary_search(&user).is_ok())
                });
                let tier = if admin { Tier::Realtime } else { Tier::Batched };
                let push = proto::Push::GroupCount {
                    group: group.0,
                    version,
                    count,
                };
                (to, tier, push)
            }
            GroupOutput::Member {
                to,
                group,
                version,
                member,
                online,
                count,
            } => {
                let push = proto::Push::GroupMember {
                    group: group.0,
                    version,
                    member: self.user_name(member).unwrap_or_default().to_owned(),
                    online,
                    count,
                };
                (to, Tier::Realtime, push)
            }
            GroupOutput::Ended { to, group } => (
                to,
                Tier::Realtime,
                proto::Push::GroupEnded { group: group.0 },
            ),
            GroupOutput::Page { to, group, entries } => (
                to,
                Tier::Batched,
                proto::Push::GroupPageDelta {
                    group: group.0,
                    entries: self.group_entries(&entries),
                },
            ),
        };
        // A flush tells many sessions the same count: encoded once.
        let frame = match &self.group_frame {
            Some((last, frame)) if *last == push => frame.clone(),
            _ => {
                // A push is a few small fields: it always encodes.
                let frame = Bytes::from(proto::encode_frame(&push).unwrap_or_default());
                self.group_frame = Some((push, frame.clone()));
                frame
            }
        };
        HubOutput::Push {
            session,
            tier,
            frame,
        }
    }
}

/// The widest varint (a `u64`).
const VARINT_MAX: usize = 10;

/// Bytes of a page's answer besides its entries, at most: the reply's tags
/// and id, the group, version, count, the entries' length and the cursor.
const PAGE_OVERHEAD: usize = 64;

fn cursor(after: Option<GroupCursor>) -> Option<PageCursor> {
    after.map(|c| PageCursor {
        online: c.online,
        after: UserId(c.after),
    })
}

fn service_only(svc: bool, what: &str) -> Result<(), WireError> {
    if svc {
        Ok(())
    } else {
        Err(WireError::new(
            ErrorCode::ServiceOnly,
            format!("{what} needs a service token"),
        ))
    }
}

/// What a cluster's edge learns of groups, for the hub's core (fed counts,
/// `Hub::set_group_counts_fed`): definitions from the directory every node
/// keeps, and counts from the owner of each group's home shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupFeed {
    Define {
        group: u64,
        membership: u64,
        /// Admins included.
        members: Vec<String>,
        admins: Vec<String>,
    },
    Remove {
        group: u64,
    },
    /// A count under the home owner's version, with the member whose
    /// change made it, if one did.
    Count {
        group: u64,
        version: u64,
        count: u32,
        change: Option<(String, bool)>,
    },
}

impl Hub {
    /// A session resumed from another node's record holds the group
    /// subscriptions it lists (each told its count at once); returns those
    /// it does not hold, which are told `Ended`.
    pub fn carry_groups(&mut self, now: Millis, session: SessionId, groups: &[u64]) -> Vec<u64> {
        let ids: Vec<GroupId> = groups.iter().map(|&g| GroupId(g)).collect();
        self.core
            .handle_group_carry(now, session, &ids)
            .into_iter()
            .map(|g| g.0)
            .collect()
    }

    /// Switches on one deliberate bug of group presence in the core
    /// (feature `mutants`).
    #[cfg(feature = "mutants")]
    pub fn set_group_mutant(&mut self, mutant: Option<greendot_core::mutants::GroupMutant>) {
        self.core.set_group_mutant(mutant);
    }

    /// Switches the core to group counts fed from a cluster (before any
    /// group is written; `false` if one was).
    pub fn set_group_counts_fed(&mut self) -> bool {
        self.core.set_group_counts_fed()
    }

    /// Takes what the cluster says of a group: its pushes follow as the
    /// hub's outputs. A definition over this node's limits is refused, and
    /// the group is left as it was (the caller logs it).
    pub fn group_feed(&mut self, now: Millis, feed: GroupFeed) -> Result<(), WireError> {
        match feed {
            GroupFeed::Define {
                group,
                membership,
                members,
                admins,
            } => {
                self.check_lists(&[&members], &[&admins])?;
                let interned = self.intern_all(members.iter().chain(&admins))?;
                let (members, admins) = interned.split_at(members.len());
                let group = GroupId(group);
                self.write_group(group, &interned, false, |core| {
                    core.handle_define_group(now, group, members, admins, membership)
                        .map(|()| membership)
                })
                .map(|_| ())
            }
            GroupFeed::Remove { group } => {
                let old = self.group_member_ids(GroupId(group));
                match self.core.handle_remove_group(now, GroupId(group)) {
                    Ok(()) => self.drop_member_refs(&old),
                    Err(greendot_core::Error::UnknownGroup) => {}
                    Err(e) => return Err(e.into()),
                }
                Ok(())
            }
            GroupFeed::Count {
                group,
                version,
                count,
                change,
            } => {
                let group = GroupId(group);
                let member = change.and_then(|(name, online)| Some((self.user_id(&name)?, online)));
                let taken = match member {
                    Some((member, online)) => self
                        .core
                        .handle_group_member(now, group, version, member, online, count),
                    None => self.core.handle_group_count(now, group, version, count),
                };
                match taken {
                    Ok(_) | Err(greendot_core::Error::UnknownGroup) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Hub, HubLimits};
    use crate::token::{Claims, WatchClaim};
    use greendot_core::{Millis, SessionId};
    use greendot_proto::{Answer, ErrorCode, Kind, Request};
    use std::time::Duration;

    /// A token of `user` on device `d`, watching anyone, for a minute.
    fn claims(user: &str) -> Claims {
        Claims::new(
            user,
            "d",
            Kind::Other,
            WatchClaim::all(),
            Duration::from_secs(60),
        )
    }

    /// A member name is never freed (its id given to another name) while
    /// it is in a group, and is freed once no group holds it.
    #[test]
    fn member_names_are_held_while_in_a_group() {
        let mut hub = Hub::new(Default::default(), HubLimits::default(), 0).unwrap();
        let claims = Claims::new(
            "backend",
            "b",
            Kind::Other,
            WatchClaim::all(),
            Duration::from_secs(60),
        )
        .service();
        let welcome = hub.hello(Millis(1), &claims, None, true).unwrap();
        let svc = SessionId(welcome.session);
        let set = |members: &[&str]| Request::SetGroup {
            group: 7,
            members: members.iter().map(|m| m.to_string()).collect(),
            admins: Vec::new(),
        };
        let answer = hub.request(Millis(2), svc, set(&["ann", "bob"])).unwrap();
        assert_eq!(answer, Answer::GroupSet { version: 1 });
        let sweep = |hub: &mut Hub| {
            hub.release_idle();
            hub.sweep(1_000);
        };
        sweep(&mut hub);
        assert!(hub.user_id("ann").is_some() && hub.user_id("bob").is_some());
        hub.request(Millis(3), svc, set(&["bob"])).unwrap();
        sweep(&mut hub);
        assert_eq!(hub.user_id("ann"), None, "ann left: her name goes");
        assert!(hub.user_id("bob").is_some(), "bob stayed: held");
        let remove = Request::RemoveGroup { group: 7 };
        assert_eq!(hub.request(Millis(4), svc, remove).unwrap(), Answer::Done);
        sweep(&mut hub);
        assert_eq!(hub.user_id("bob"), None);
    }

    /// A member page whose entries at their largest would pass the server
    /// frame clients accept (a page size of 1,000 and 64 KiB messages)
    /// answers fewer entries, within the cap, and its cursor goes on
    /// after the last one sent: the next page lists the rest.
    #[test]
    fn a_page_that_would_pass_the_frame_cap_answers_fewer_entries() {
        use greendot_proto::{GroupEntry, ServerFrame, Status, MAX_SERVER_FRAME};
        let config = greendot_core::Config {
            max_message_len: 65_536,
            group_page_size: 1_000,
            ..Default::default()
        };
        let mut hub = Hub::new(config, HubLimits::default(), 0).unwrap();
        let svc = hub
            .hello(Millis(1), &claims("backend").service(), None, true)
            .unwrap();
        let names: Vec<String> = (0..300)
            .map(|i| format!("{i:03}{}", "x".repeat(125)))
            .collect();
        let set = Request::SetGroup {
            group: 3,
            members: names.clone(),
            admins: Vec::new(),
        };
        hub.request(Millis(2), SessionId(svc.session), set).unwrap();
        let mut sessions = Vec::new();
        for name in &names {
            let welcome = hub.hello(Millis(3), &claims(name), None, true).unwrap();
            let session = SessionId(welcome.session);
            let status = Request::SetStatus {
                status: Status::Busy,
                message: Some("m".repeat(65_536)),
            };
            hub.request(Millis(3), session, status).unwrap();
            sessions.push(session);
        }
        // Published after the debounce.
        hub.handle_timeout(Millis(10_000));
        let mut listed: Vec<GroupEntry> = Vec::new();
        let mut after = None;
        let mut pages = 0;
        loop {
            let ask = Request::GroupPage {
                group: 3,
                after,
                limit: 1_000,
            };
            let Answer::GroupPage(page) = hub.request(Millis(10_000), sessions[0], ask).unwrap()
            else {
                panic!("not a page");
            };
            pages += 1;
            let entries = page.entries.len();
            let frame = greendot_proto::encode_frame(&ServerFrame::Reply {
                id: u64::MAX,
                result: Ok(Answer::GroupPage(page.clone())),
            })
            .unwrap();
            assert!(
                frame.len() - 4 <= MAX_SERVER_FRAME,
                "a page of {entries} entries is {} bytes",
                frame.len()
            );
            listed.extend(page.entries);
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert!(pages >= 2, "one page held all 300");
        assert!(listed
            .iter()
            .all(|e| e.presence.online
                && e.presence.message.as_deref().map(str::len) == Some(65_536)));
        let mut users: Vec<String> = listed.into_iter().map(|e| e.user).collect();
        users.sort();
        assert_eq!(users, names, "every member once");
    }

    /// A change by difference moves the names' references as a whole
    /// write does, a refused one leaves no name behind, and only a service
    /// token may change a group.
    #[test]
    fn a_change_holds_the_names_it_adds_and_frees_the_ones_it_removes() {
        let mut hub = Hub::new(Default::default(), HubLimits::default(), 0).unwrap();
        let svc = hub
            .hello(Millis(1), &claims("backend").service(), None, true)
            .unwrap();
        let svc = SessionId(svc.session);
        let names = |list: &[&str]| list.iter().map(|m| m.to_string()).collect::<Vec<_>>();
        let change = |add: &[&str], remove: &[&str], expect| Request::ChangeGroup {
            group: 7,
            add: names(add),
            remove: names(remove),
            add_admins: Vec::new(),
            remove_admins: names(&["never-seen"]),
            expect_version: expect,
        };
        let sweep = |hub: &mut Hub| {
            hub.release_idle();
            hub.sweep(1_000);
        };
        let answer = hub.request(Millis(2), svc, change(&["ann", "bob"], &[], Some(0)));
        assert_eq!(answer.unwrap(), Answer::GroupSet { version: 1 });
        assert_eq!(hub.user_id("never-seen"), None, "a removal interns nothing");
        let stale = hub.request(Millis(3), svc, change(&["cy"], &["ann"], Some(0)));
        assert_eq!(stale.unwrap_err().code, ErrorCode::VersionMismatch);
        // Told at once, not found later by the sweep.
        hub.release_idle();
        assert_eq!(hub.user_id("cy"), None, "a refused change leaves no name");
        assert!(hub.user_id("ann").is_some(), "ann is still a member: held");
        let answer = hub.request(Millis(4), svc, change(&[], &["ann"], Some(1)));
        assert_eq!(answer.unwrap(), Answer::GroupSet { version: 2 });
        sweep(&mut hub);
        assert_eq!(hub.user_id("ann"), None, "ann left: her name goes");
        assert!(hub.user_id("bob").is_some());
        let user = hub.hello(Millis(5), &claims("bob"), None, true).unwrap();
        let refused = hub.request(
            Millis(5),
            SessionId(user.session),
            change(&["x"], &[], None),
        );
        assert_eq!(refused.unwrap_err().code, ErrorCode::ServiceOnly);
    }
}
