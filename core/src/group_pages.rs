//! A group's member list, on demand, in pages (issue 28): online members
//! first, then the others, each section by user id; at most
//! `Config::group_page_size` entries per page (default 200).
//!
//! The cursor is the last entry returned (its section and user id), so a
//! page is found by a range look-up, never by counting from the start, and
//! a cursor stays valid whatever changes between two requests. A member
//! whose view changes between two pages may then be listed twice or not at
//! all (it moved across the cursor), as with any keyset pagination; each
//! page, and the group version it carries, is one instant's truth. Entries
//! carry published views, as watchers see them (invisible members offline).
//!
//! Cost: O(log members + page) for the online section, plus one look-up per
//! online member skipped in the offline section.

use crate::engine::Core;
use crate::error::Error;
use crate::groups::GroupId;
use crate::types::{Millis, Presence, SessionId, UserId};
use std::collections::BTreeSet;
use std::ops::Bound;

/// Where a page starts: after this entry of the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageCursor {
    /// The entry was in the online section.
    pub online: bool,
    pub after: UserId,
}

/// One page of a group's member list.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupPage {
    pub group: GroupId,
    /// The group's version when the page was taken.
    pub version: u64,
    /// Members published online, in all.
    pub count: u32,
    pub entries: Vec<(UserId, Presence)>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<PageCursor>,
}

impl Core {
    /// A page of `group`'s members for an Online session of a member: up to
    /// `limit` entries (at most `Config::group_page_size`) after `from`
    /// (`None`: from the start). `Error::NotMember` for anyone else;
    /// `Error::PageRateLimited` past the session's page budget for that
    /// group (the `group_watch` module), checked before the page is read.
    pub fn handle_group_page(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
        limit: usize,
    ) -> Result<GroupPage, Error> {
        self.page_request(now, id, group, from, limit, false)
    }

    /// A page, watched or not: membership, then the budget, then the watch
    /// limits, all before the page is read; nothing is stored on an error.
    /// A core whose counts are fed holds no one's view but its own users',
    /// so it reads no page (`Error::NotAllowed`).
    pub(crate) fn page_request(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
        limit: usize,
        watch: bool,
    ) -> Result<GroupPage, Error> {
        if self.groups.fed {
            return Err(Error::NotAllowed);
        }
        let (id, limit, renewed) = self.admit_page(now, id, group, limit, watch.then_some(from))?;
        let page = self.read_page(group, from, limit);
        if watch {
            self.store_watch(id, &page, from, renewed);
        }
        Ok(page)
    }

    /// Admits a page: the session (Online, of a member of `group`), the
    /// page budget, and for a page to be watched from `watch`'s cursor the
    /// watch limits; then spends the budget's token. Returns the session,
    /// the limit capped by the page size, and the watch the page renews.
    pub(crate) fn admit_page(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        limit: usize,
        watch: Option<Option<PageCursor>>,
    ) -> Result<(SessionId, usize, Option<u64>), Error> {
        let (id, limit, members) = self.page_checks(now, id, group, limit)?;
        let budget = self.page_budget(id, group)?;
        let renewed = match watch {
            Some(from) => self.watch_room(id, group, from, limit.min(members))?,
            None => None,
        };
        self.groups.watches.budgets.insert((id, group), budget);
        Ok((id, limit, renewed))
    }

    /// The session (Online, of a member of `group`), the limit capped by
    /// the page size, and the group's members.
    pub(crate) fn page_checks(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        limit: usize,
    ) -> Result<(SessionId, usize, usize), Error> {
        self.advance(now);
        let id = self.online(id)?;
        let user = self.session_user(id).ok_or(Error::Stale)?;
        let members = self
            .groups
            .groups
            .get(&group)
            .filter(|g| g.members.binary_search(&user).is_ok())
            .ok_or(Error::NotMember)?
            .members
            .len();
        Ok((id, limit.clamp(1, self.config.group_page_size), members))
    }

    fn read_page(&self, group: GroupId, from: Option<PageCursor>, limit: usize) -> GroupPage {
        let g = &self.groups.groups[&group];
        let (picked, next) = pick_page(
            &g.online,
            |after| {
                let start = after.map_or(0, |a| g.members.partition_point(|&m| m <= a));
                g.members[start..].iter().copied()
            },
            from.map(|c| (c.online, c.after)),
            limit,
        );
        let next = next.map(|(online, after)| PageCursor { online, after });
        let (version, count) = (g.version, g.count);
        let entries = picked
            .into_iter()
            .map(|(u, _)| (u, self.presence(u)))
            .collect();
        GroupPage {
            group,
            version,
            count,
            entries,
            next,
        }
    }
}

/// The keys of a page, each with whether it is online, and the cursor of
/// the next page (section, key), `None` on the last.
pub type PageKeys<M> = (Vec<(M, bool)>, Option<(bool, M)>);

/// The keys of one page: up to `limit` (at least 1) of the members online
/// after `from` (by key), then of the others, each with whether it was
/// taken from the online section; and the cursor of the next page, `None`
/// on the last. `members_after(a)` lists every member above `a` (`None`:
/// all) in order; `online` is a subset of the members. Shared by one
/// node's pages and a cluster's aggregator, whose keys are ordinals.
pub(crate) fn pick_page<M, I>(
    online: &BTreeSet<M>,
    members_after: impl FnOnce(Option<M>) -> I,
    from: Option<(bool, M)>,
    limit: usize,
) -> PageKeys<M>
where
    M: Ord + Copy,
    I: Iterator<Item = M>,
{
    let limit = limit.max(1);
    // One more than asked, to know whether a next page exists.
    let mut picked: Vec<(M, bool)> = Vec::with_capacity(limit + 1);
    let offline_after = match from {
        Some((false, after)) => Some(after),
        _ => {
            let start = match from {
                Some((_, after)) => Bound::Excluded(after),
                None => Bound::Unbounded,
            };
            picked.extend(
                online
                    .range((start, Bound::Unbounded))
                    .take(limit + 1)
                    .map(|&m| (m, true)),
            );
            None
        }
    };
    if picked.len() <= limit {
        let room = limit + 1 - picked.len();
        picked.extend(
            members_after(offline_after)
                .filter(|m| !online.contains(m))
                .take(room)
                .map(|m| (m, false)),
        );
    }
    let more = picked.len() > limit;
    picked.truncate(limit);
    let next = more
        .then(|| picked.last().map(|&(m, online)| (online, m)))
        .flatten();
    (picked, next)
}
