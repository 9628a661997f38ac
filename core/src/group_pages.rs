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
    pub(crate) fn page_request(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
        limit: usize,
        watch: bool,
    ) -> Result<GroupPage, Error> {
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
        let limit = limit.clamp(1, self.config.group_page_size);
        let budget = self.page_budget(id, group)?;
        let renewed = if watch {
            self.watch_room(id, group, from, limit.min(members))?
        } else {
            None
        };
        let page = self.read_page(group, from, limit);
        self.groups.watches.budgets.insert((id, group), budget);
        if watch {
            self.store_watch(id, &page, from, renewed);
        }
        Ok(page)
    }

    fn read_page(&self, group: GroupId, from: Option<PageCursor>, limit: usize) -> GroupPage {
        let g = &self.groups.groups[&group];
        // One more than asked, to know whether a next page exists.
        let mut picked: Vec<(bool, UserId)> = Vec::with_capacity(limit + 1);
        let offline_from = match from {
            Some(PageCursor {
                online: false,
                after,
            }) => Bound::Excluded(after),
            _ => {
                let start = match from {
                    Some(c) => Bound::Excluded(c.after),
                    None => Bound::Unbounded,
                };
                picked.extend(
                    g.online
                        .range((start, Bound::Unbounded))
                        .take(limit + 1)
                        .map(|&u| (true, u)),
                );
                Bound::Unbounded
            }
        };
        if picked.len() <= limit {
            let start = match offline_from {
                Bound::Excluded(after) => g.members.partition_point(|&m| m <= after),
                _ => 0,
            };
            let room = limit + 1 - picked.len();
            picked.extend(
                g.members[start..]
                    .iter()
                    .filter(|m| !g.online.contains(m))
                    .take(room)
                    .map(|&u| (false, u)),
            );
        }
        let more = picked.len() > limit;
        picked.truncate(limit);
        let next = more.then(|| {
            let &(online, after) = picked.last().expect("limit is at least 1");
            PageCursor { online, after }
        });
        let (version, count) = (g.version, g.count);
        let entries = picked
            .into_iter()
            .map(|(_, u)| (u, self.presence(u)))
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
