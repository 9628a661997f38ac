//! Watched member pages and the page budget (issue 28).
//!
//! **A watched page** is the set of members a page listed when it was
//! answered ([`Core::handle_group_watch_page`]), named by its group and the
//! cursor it was asked from (`None`: the first page). While the watch
//! lives, each published change of one of those members (online, status,
//! message, kinds, last seen: any new published view) is queued for the
//! session, coalesced per member, and flushed every `Config::batch_interval`
//! as one [`GroupOutput::Page`] per group (per [`PAGE_DELTA_ENTRIES`]
//! entries) holding the latest published view of each changed member (on
//! the batched stream); a listed member who left the group since is left
//! out. The set is not re-sorted: a member who went online stays in the
//! watched set of its offline page; asking the same page again re-reads it
//! and renews.
//!
//! A watch lives `Config::group_watch_ttl` (60 s) after it was last asked
//! for or renewed ([`Core::handle_group_renew_watch`]), then ends on its own
//! (a core timer), so a backgrounded phone that stops renewing stops
//! costing. It also ends on [`Core::handle_group_unwatch`], with its
//! session (logout, expiry, supersede), when the session's user leaves the
//! group, and when the group is removed. A resume carries it over, and the
//! first flush after it lists every member it watches. A lingering
//! session's watches get no deltas (nothing is sent while it lingers).
//!
//! Limits, checked before anything is stored: at most
//! `Config::max_watched_pages` watches (3) and `Config::max_watched_entries`
//! entries (600) per session. The entry check counts the new page at its
//! largest (its limit, capped by the page size and the group's members),
//! so that it comes before the page is read.
//!
//! **The page budget**: every member page (watched or not) spends one
//! token of the session's bucket for that group: `Config::group_page_burst`
//! tokens (10), one back every `Config::group_page_refill` (1 s). It is
//! checked before any work; over it, [`Error::PageRateLimited`] says when
//! the next page is granted. It is kept as one deadline per (session,
//! group) (GCRA: the moment the bucket is full again), only for groups the
//! session's user was a member of when it asked, and dropped with the
//! session.
//!
//! Cost: a member's change costs one look-up per group of theirs plus one
//! step per watch of a page holding them; never O(members).
//!
//! **G5** (in `check_invariants` and the property tests, with
//! `GroupMutant::WatchOutlivesExpiry` caught): page deltas go only to
//! Online sessions holding a live, unexpired watch of a page of that group
//! listing that member; a held watch is unexpired, of a live session of a
//! member, within the limits.

use crate::engine::Core;
use crate::error::{Error, Limit};
use crate::group_fed_watch::FedViews;
use crate::group_pages::{GroupPage, PageCursor};
use crate::groups::{group_mutant, is_online, GroupId, GroupOutput};
use crate::timers::Timer;
use crate::types::{Millis, Presence, SessionId, UserId};
use std::collections::{BTreeMap, BTreeSet};

/// Entries of one [`GroupOutput::Page`] at most: 100 entries of the
/// longest names and messages (about 400 bytes each) fit one 64 KiB frame.
pub const PAGE_DELTA_ENTRIES: usize = 100;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PageWatch {
    pub(crate) session: SessionId,
    pub(crate) group: GroupId,
    pub(crate) from: Option<PageCursor>,
    /// The members the page listed, sorted.
    pub(crate) members: Vec<UserId>,
    pub(crate) expires: Millis,
}

/// A resumed session's watches (ids) and page budgets (group, when full).
#[derive(Default)]
pub(crate) struct CarriedWatches {
    watches: Vec<u64>,
    budgets: Vec<(GroupId, Millis)>,
}

/// Deltas waiting for a session's flush.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct PendingDeltas {
    pub(crate) due: Option<Millis>,
    pub(crate) members: BTreeSet<(GroupId, UserId)>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Watches {
    pub(crate) next_id: u64,
    pub(crate) all: BTreeMap<u64, PageWatch>,
    /// At most `max_watched_pages` each.
    pub(crate) by_session: BTreeMap<SessionId, Vec<u64>>,
    pub(crate) by_group: BTreeSet<(GroupId, u64)>,
    /// (group, member) → the watches of pages listing that member.
    pub(crate) by_member: BTreeMap<(GroupId, UserId), Vec<u64>>,
    pub(crate) pending: BTreeMap<SessionId, PendingDeltas>,
    /// (session, group) → when its page bucket is full again.
    pub(crate) budgets: BTreeMap<(SessionId, GroupId), Millis>,
    /// With fed counts: the views fed of the members watches list (the
    /// `group_fed_watch` module).
    pub(crate) fed: FedViews,
}

impl Core {
    /// Like [`Core::handle_group_page`], and the page is watched: its
    /// members' published changes come as [`GroupOutput::Page`] (batched)
    /// until the watch runs out, `Config::group_watch_ttl` from now. Asking
    /// the same page (same group and cursor) again re-reads it and renews
    /// its watch. `Error::LimitExceeded(WatchedPages | WatchedEntries)` past
    /// the session's watch limits; then nothing is stored and the page is
    /// not read.
    pub fn handle_group_watch_page(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
        limit: usize,
    ) -> Result<GroupPage, Error> {
        self.page_request(now, id, group, from, limit, true)
    }

    /// Renews the watch of a page (group and cursor as asked) for another
    /// `Config::group_watch_ttl`, without reading it again.
    /// `Error::NotSubscribed` when there is no such watch (it ran out).
    pub fn handle_group_renew_watch(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
    ) -> Result<(), Error> {
        let wid = self.held_watch(now, id, group, from)?;
        self.set_watch_expiry(wid);
        Ok(())
    }

    /// Ends the watch of a page. `Error::NotSubscribed` when there is none.
    pub fn handle_group_unwatch(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
    ) -> Result<(), Error> {
        let wid = self.held_watch(now, id, group, from)?;
        self.remove_watch(wid);
        Ok(())
    }

    /// The pages `session` watches: group, cursor, members, expiry.
    pub fn group_watches(
        &self,
        session: SessionId,
    ) -> Vec<(GroupId, Option<PageCursor>, Vec<UserId>, Millis)> {
        let w = &self.groups.watches;
        w.by_session
            .get(&session)
            .into_iter()
            .flatten()
            .map(|wid| {
                let x = &w.all[wid];
                (x.group, x.from, x.members.clone(), x.expires)
            })
            .collect()
    }

    /// The watch an Online session holds of a page, after time has moved to
    /// `now`; `Error::NotSubscribed` when it has none (it ran out).
    fn held_watch(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
    ) -> Result<u64, Error> {
        self.advance(now);
        let id = self.online(id)?;
        self.find_watch(id, group, from).ok_or(Error::NotSubscribed)
    }

    fn find_watch(&self, id: SessionId, group: GroupId, from: Option<PageCursor>) -> Option<u64> {
        let w = &self.groups.watches;
        w.by_session.get(&id)?.iter().copied().find(|wid| {
            let x = &w.all[wid];
            x.group == group && x.from == from
        })
    }

    /// The page budget of (`id`, `group`): its new deadline if a page is
    /// granted now, or why not. Changes nothing but the counter of limits.
    pub(crate) fn page_budget(&mut self, id: SessionId, group: GroupId) -> Result<Millis, Error> {
        let every = self.config.group_page_refill;
        let tolerance = every
            .0
            .saturating_mul(u64::from(self.config.group_page_burst.saturating_sub(1)));
        let now = self.clock;
        let full_at = self
            .groups
            .watches
            .budgets
            .get(&(id, group))
            .copied()
            .unwrap_or(now)
            .max(now);
        let granted_from = Millis(full_at.0.saturating_sub(tolerance));
        if granted_from > now {
            self.counters.limits_hit += 1;
            return Err(Error::PageRateLimited {
                retry_after: Millis(granted_from.0 - now.0),
            });
        }
        Ok(full_at.plus(every))
    }

    /// Room for a watch of the page (`group`, `from`) of at most `bound`
    /// entries: the watch it renews, if any, or why not. Changes nothing
    /// but the counter of limits.
    pub(crate) fn watch_room(
        &mut self,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
        bound: usize,
    ) -> Result<Option<u64>, Error> {
        let existing = self.find_watch(id, group, from);
        let w = &self.groups.watches;
        let mine = w.by_session.get(&id).map_or(&[][..], Vec::as_slice);
        if existing.is_none() && mine.len() >= self.config.max_watched_pages {
            return Err(self.group_limit(Limit::WatchedPages));
        }
        let held: usize = mine
            .iter()
            .filter(|&&wid| Some(wid) != existing)
            .map(|wid| w.all[wid].members.len())
            .sum();
        if held.saturating_add(bound) > self.config.max_watched_entries {
            return Err(self.group_limit(Limit::WatchedEntries));
        }
        Ok(existing)
    }

    /// Stores the watch of `page` (asked from `from`), renewing `existing`.
    pub(crate) fn store_watch(
        &mut self,
        id: SessionId,
        page: &GroupPage,
        from: Option<PageCursor>,
        existing: Option<u64>,
    ) {
        let group = page.group;
        let mut members: Vec<UserId> = page.entries.iter().map(|(u, _)| *u).collect();
        members.sort_unstable();
        let mut old = None;
        let wid = match existing {
            Some(wid) => {
                let listed =
                    std::mem::take(&mut self.groups.watches.all.get_mut(&wid).unwrap().members);
                self.unindex_members(wid, group, &listed);
                old = Some(listed);
                wid
            }
            None => {
                let w = &mut self.groups.watches;
                let wid = w.next_id;
                w.next_id += 1;
                w.all.insert(
                    wid,
                    PageWatch {
                        session: id,
                        group,
                        from,
                        members: Vec::new(),
                        expires: Millis(u64::MAX),
                    },
                );
                w.by_session.entry(id).or_default().push(wid);
                w.by_group.insert((group, wid));
                wid
            }
        };
        let fed = self.groups.fed;
        let w = &mut self.groups.watches;
        for &m in &members {
            let ids = w.by_member.entry((group, m)).or_default();
            if ids.is_empty() && fed {
                w.fed.listed(m);
            }
            ids.push(wid);
        }
        w.all.get_mut(&wid).unwrap().members = members;
        if let Some(old) = old {
            self.prune_pending(id, group, &old);
        }
        self.set_watch_expiry(wid);
    }

    fn set_watch_expiry(&mut self, wid: u64) {
        let expires = self.clock.plus(self.config.group_watch_ttl);
        let x = self.groups.watches.all.get_mut(&wid).unwrap();
        let old = std::mem::replace(&mut x.expires, expires);
        self.timers.remove(&(old, Timer::WatchExpiry(wid)));
        self.timers.insert((expires, Timer::WatchExpiry(wid)));
    }

    fn unindex_members(&mut self, wid: u64, group: GroupId, members: &[UserId]) {
        let w = &mut self.groups.watches;
        for &m in members {
            if let Some(list) = w.by_member.get_mut(&(group, m)) {
                list.retain(|&x| x != wid);
                if list.is_empty() {
                    w.by_member.remove(&(group, m));
                    w.fed.unlisted(m);
                }
            }
        }
    }

    /// Ends a watch; its session's queued deltas of members no other watch
    /// of the session lists go with it.
    pub(crate) fn remove_watch(&mut self, wid: u64) {
        let Some(x) = self.groups.watches.all.remove(&wid) else {
            return;
        };
        self.timers.remove(&(x.expires, Timer::WatchExpiry(wid)));
        self.unindex_members(wid, x.group, &x.members);
        let w = &mut self.groups.watches;
        w.by_group.remove(&(x.group, wid));
        if let Some(list) = w.by_session.get_mut(&x.session) {
            list.retain(|&y| y != wid);
            if list.is_empty() {
                w.by_session.remove(&x.session);
            }
        }
        self.prune_pending(x.session, x.group, &x.members);
    }

    /// Drops `session`'s queued deltas of those of `members` of `group` that
    /// no watch of the session lists any more.
    fn prune_pending(&mut self, session: SessionId, group: GroupId, members: &[UserId]) {
        let w = &mut self.groups.watches;
        let Some(p) = w.pending.get_mut(&session) else {
            return;
        };
        for &m in members {
            let listed = w
                .by_member
                .get(&(group, m))
                .is_some_and(|ids| ids.iter().any(|other| w.all[other].session == session));
            if !listed {
                p.members.remove(&(group, m));
            }
        }
        if p.members.is_empty() {
            if let Some(due) = p.due {
                self.timers.remove(&(due, Timer::PageFlush(session)));
            }
            w.pending.remove(&session);
        }
    }

    /// `user`'s published view changed: queued for each session watching a
    /// page that lists them.
    pub(crate) fn watch_published(&mut self, user: UserId) {
        let Core {
            groups,
            timers,
            clock,
            config,
            ..
        } = self;
        let w = &mut groups.watches;
        if w.all.is_empty() {
            return;
        }
        for &group in groups.member_of.get(&user).into_iter().flatten() {
            for wid in w.by_member.get(&(group, user)).into_iter().flatten() {
                let session = w.all[wid].session;
                let p = w.pending.entry(session).or_default();
                p.members.insert((group, user));
                if p.due.is_none() {
                    let due = clock.plus(config.batch_interval);
                    p.due = Some(due);
                    timers.insert((due, Timer::PageFlush(session)));
                }
            }
        }
    }

    /// The flush of `session`'s page deltas: the latest published view of
    /// each queued member, one output per group; nothing while it lingers.
    pub(crate) fn on_page_flush(&mut self, session: SessionId) {
        let Some(p) = self.groups.watches.pending.remove(&session) else {
            return;
        };
        if !is_online(&self.slots, session) {
            return;
        }
        let mut by_group: BTreeMap<GroupId, Vec<(UserId, Presence)>> = BTreeMap::new();
        for (group, user) in p.members {
            // A member who left since is no longer shown to the group.
            let member = self
                .groups
                .groups
                .get(&group)
                .is_some_and(|g| g.members.binary_search(&user).is_ok());
            if !member {
                continue;
            }
            by_group
                .entry(group)
                .or_default()
                .push((user, self.page_view(user)));
        }
        for (group, entries) in by_group {
            for chunk in entries.chunks(PAGE_DELTA_ENTRIES) {
                self.groups.outputs.push_back(GroupOutput::Page {
                    to: session,
                    group,
                    entries: chunk.to_vec(),
                });
            }
        }
    }

    /// A watch ran out.
    pub(crate) fn on_watch_expiry(&mut self, wid: u64) {
        if group_mutant!(self.groups, WatchOutlivesExpiry) {
            return;
        }
        self.remove_watch(wid);
    }

    /// A resume: detaches `old`'s watches and page budgets, so that the end
    /// of `old` leaves them, for [`Core::watches_carry`]. Its queued deltas
    /// go: the carried watches queue every member they list again.
    pub(crate) fn watches_take(&mut self, old: SessionId) -> CarriedWatches {
        let w = &mut self.groups.watches;
        let watches = w.by_session.remove(&old).unwrap_or_default();
        let budgets: Vec<_> = w
            .budgets
            .range((old, GroupId(0))..=(old, GroupId(u64::MAX)))
            .map(|(&(_, group), &full)| (group, full))
            .collect();
        for (group, _) in &budgets {
            w.budgets.remove(&(old, *group));
        }
        if let Some(p) = w.pending.remove(&old) {
            if let Some(due) = p.due {
                self.timers.remove(&(due, Timer::PageFlush(old)));
            }
        }
        CarriedWatches { watches, budgets }
    }

    /// A resume: the new session `id` (of the same user) holds the taken
    /// watches, with their expiry, and page budgets. Every member a watch
    /// lists is queued, so the first flush brings each one's current view:
    /// nothing was sent while the old session was away.
    pub(crate) fn watches_carry(&mut self, id: SessionId, taken: CarriedWatches) {
        let w = &mut self.groups.watches;
        for (group, full) in taken.budgets {
            w.budgets.insert((id, group), full);
        }
        if taken.watches.is_empty() {
            return;
        }
        let mut queued = BTreeSet::new();
        for &wid in &taken.watches {
            if let Some(x) = w.all.get_mut(&wid) {
                x.session = id;
                queued.extend(x.members.iter().map(|&m| (x.group, m)));
            }
        }
        w.by_session.insert(id, taken.watches);
        if queued.is_empty() {
            return;
        }
        let due = self.clock.plus(self.config.batch_interval);
        w.pending.insert(
            id,
            PendingDeltas {
                due: Some(due),
                members: queued,
            },
        );
        self.timers.insert((due, Timer::PageFlush(id)));
    }

    /// A session ended: its watches, queued deltas and page budgets go.
    pub(crate) fn watches_session_ended(&mut self, id: SessionId) {
        let budgets = &mut self.groups.watches.budgets;
        let spent: Vec<_> = budgets
            .range((id, GroupId(0))..=(id, GroupId(u64::MAX)))
            .map(|(k, _)| *k)
            .collect();
        for key in spent {
            budgets.remove(&key);
        }
        for wid in self
            .groups
            .watches
            .by_session
            .get(&id)
            .cloned()
            .unwrap_or_default()
        {
            self.remove_watch(wid);
        }
        if let Some(p) = self.groups.watches.pending.remove(&id) {
            if let Some(due) = p.due {
                self.timers.remove(&(due, Timer::PageFlush(id)));
            }
        }
    }

    /// After a membership write or a removal of `group`: watches of
    /// sessions whose user is no longer a member end. With fed counts,
    /// members who left are taken out of the watches that stay, so the edge
    /// stops following them (their names may be freed).
    pub(crate) fn watches_group_changed(&mut self, group: GroupId) {
        let ids: Vec<u64> = self
            .groups
            .watches
            .by_group
            .range((group, 0)..=(group, u64::MAX))
            .map(|&(_, wid)| wid)
            .collect();
        for wid in ids {
            let session = self.groups.watches.all[&wid].session;
            let member = self.session_user(session).is_some_and(|u| {
                self.groups
                    .groups
                    .get(&group)
                    .is_some_and(|g| g.members.binary_search(&u).is_ok())
            });
            if !member {
                self.remove_watch(wid);
            } else if self.groups.fed {
                self.drop_leavers(wid, group);
            }
        }
    }

    /// Takes the members who left `group` out of watch `wid`.
    fn drop_leavers(&mut self, wid: u64, group: GroupId) {
        let Some(g) = self.groups.groups.get(&group) else {
            return;
        };
        let x = &self.groups.watches.all[&wid];
        let (kept, left): (Vec<UserId>, Vec<UserId>) = x
            .members
            .iter()
            .partition(|m| g.members.binary_search(m).is_ok());
        if left.is_empty() {
            return;
        }
        let session = x.session;
        self.groups.watches.all.get_mut(&wid).unwrap().members = kept;
        self.unindex_members(wid, group, &left);
        self.prune_pending(session, group, &left);
    }
}

#[cfg(feature = "check")]
impl Core {
    /// G5, structurally: every held watch is unexpired, of a live session
    /// of a member, within the session's limits, and indexed; queued deltas
    /// are of members a watch of that session lists.
    pub(crate) fn check_watches(
        &self,
        expected_timers: &mut BTreeSet<(Millis, Timer)>,
    ) -> Result<(), String> {
        let w = &self.groups.watches;
        let mut by_session: BTreeMap<SessionId, Vec<u64>> = BTreeMap::new();
        let mut by_member: BTreeMap<(GroupId, UserId), Vec<u64>> = BTreeMap::new();
        for (&wid, x) in &w.all {
            if x.expires <= self.clock {
                return Err(format!(
                    "G5: watch {wid} of {} ran out at {} but is held at {}",
                    x.session, x.expires, self.clock
                ));
            }
            let user = self
                .session_user(x.session)
                .ok_or_else(|| format!("G5: dead session {} watches a page", x.session))?;
            let member = self
                .groups
                .groups
                .get(&x.group)
                .is_some_and(|g| g.members.binary_search(&user).is_ok());
            if !member {
                return Err(format!(
                    "G5: {} of non-member {user:?} watches a page of {:?}",
                    x.session, x.group
                ));
            }
            if !x.members.windows(2).all(|p| p[0] < p[1]) {
                return Err(format!("watch {wid}: members unsorted"));
            }
            if !w.by_group.contains(&(x.group, wid)) {
                return Err(format!("watch {wid} missing from the group index"));
            }
            by_session.entry(x.session).or_default().push(wid);
            for &m in &x.members {
                by_member.entry((x.group, m)).or_default().push(wid);
            }
            expected_timers.insert((x.expires, Timer::WatchExpiry(wid)));
        }
        if w.by_group.len() != w.all.len() {
            return Err("the group → watches index holds strangers".into());
        }
        let mut held = w.by_session.clone();
        held.values_mut().for_each(|l| l.sort_unstable());
        if held != by_session {
            return Err(format!(
                "session → watches index {held:?} is not {by_session:?}"
            ));
        }
        let mut indexed = w.by_member.clone();
        indexed.values_mut().for_each(|l| l.sort_unstable());
        if indexed != by_member {
            return Err("the member → watches index is not the watches' members".into());
        }
        w.fed.check(self.groups.fed, &w.by_member)?;
        for (s, list) in &by_session {
            let entries: usize = list.iter().map(|wid| w.all[wid].members.len()).sum();
            if list.len() > self.config.max_watched_pages
                || entries > self.config.max_watched_entries
            {
                return Err(format!(
                    "{s} watches {} pages of {entries} entries, over its limits",
                    list.len()
                ));
            }
        }
        for (s, p) in &w.pending {
            let due = p
                .due
                .ok_or_else(|| format!("{s}: queued deltas and no flush"))?;
            expected_timers.insert((due, Timer::PageFlush(*s)));
            for key in &p.members {
                let listed = w
                    .by_member
                    .get(key)
                    .is_some_and(|ids| ids.iter().any(|wid| w.all[wid].session == *s));
                if !listed {
                    return Err(format!(
                        "G5: {s} has a delta of {key:?} queued, watching no page of it"
                    ));
                }
            }
            if p.members.is_empty() {
                return Err(format!("{s}: an empty queue of deltas is kept"));
            }
        }
        Ok(())
    }
}
