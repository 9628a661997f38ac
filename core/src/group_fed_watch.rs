//! Watched member pages in a core whose counts are fed (issue 28, a
//! cluster's edge).
//!
//! On one node a watched page's deltas come from the core's own published
//! views (the `group_watch` module). A cluster's edge holds only its own
//! sessions, so a page is read elsewhere: the edge checks it here first
//! ([`Core::handle_fed_group_page`]), reads the members' views from their
//! owners, and hands the page back ([`Core::handle_fed_watched_page`]) to
//! be watched. While a watch lists a member, the edge feeds her published
//! views as they come ([`Core::handle_fed_view`]). Everything else is the
//! one node's code: the limits, the page budget, the TTL, renew and
//! unwatch, the end with the session or the membership, the resume, the
//! flush every batch interval with each queued member's latest view.
//!
//! The core keeps the fed view only of members a watch lists, and tells
//! when a member stops being listed by any watch
//! ([`Core::poll_fed_unlisted`]), so the edge stops following her.

use crate::engine::Core;
use crate::error::Error;
use crate::group_pages::{GroupPage, PageCursor};
use crate::groups::GroupId;
use crate::types::{Millis, Presence, SessionId, UserId};
use std::collections::{BTreeMap, BTreeSet};

/// The views fed for watched pages.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FedViews {
    /// Member → the (group, member) keys of watches listing her, and her
    /// latest view fed (`None` until one comes).
    pub(crate) listed: BTreeMap<UserId, (u32, Option<Presence>)>,
    /// Members no watch lists any more, for the edge (a member listed
    /// again before the edge asked is taken out: a page renewed lists
    /// again at once what it listed).
    pub(crate) unlisted: BTreeSet<UserId>,
}

impl Core {
    /// A page read elsewhere, for a core whose counts are fed (a cluster's
    /// edge): checks the session, its membership and the page budget as for
    /// a page of its own, and for a watched page (`watch`: asked from
    /// `from`) the watch limits too; spends the token and returns the limit
    /// to ask for. `Error::NotAllowed` when counts are not fed.
    pub fn handle_fed_group_page(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        limit: usize,
        watch: Option<Option<PageCursor>>,
    ) -> Result<usize, Error> {
        if !self.groups.fed {
            return Err(Error::NotAllowed);
        }
        let (_, limit, _) = self.admit_page(now, id, group, limit, watch)?;
        Ok(limit)
    }

    /// A watched page read elsewhere (after [`Core::handle_fed_group_page`]):
    /// its entries, with the views read, are watched as on one node (or
    /// renew the watch of the same page), checked again against the
    /// session, its membership and the watch limits, since the read took a
    /// while. Entries of users who are not members are left out.
    pub fn handle_fed_watched_page(
        &mut self,
        now: Millis,
        id: SessionId,
        group: GroupId,
        from: Option<PageCursor>,
        entries: Vec<(UserId, Presence)>,
    ) -> Result<(), Error> {
        if !self.groups.fed {
            return Err(Error::NotAllowed);
        }
        let (id, _, _) = self.page_checks(now, id, group, 1)?;
        let g = &self.groups.groups[&group];
        let (version, count) = (g.version, g.count);
        let entries: Vec<(UserId, Presence)> = entries
            .into_iter()
            .filter(|(u, _)| g.members.binary_search(u).is_ok())
            .collect();
        let renewed = self.watch_room(id, group, from, entries.len())?;
        let page = GroupPage {
            group,
            version,
            count,
            entries,
            next: None,
        };
        self.store_watch(id, &page, from, renewed);
        for (user, presence) in page.entries {
            self.take_fed_view(user, presence);
        }
        Ok(())
    }

    /// `user`'s published view, fed by the edge: kept if a watch lists her
    /// and it is newer than the one kept, and then queued for the sessions
    /// whose watches list her, as a published change is on one node.
    pub fn handle_fed_view(&mut self, now: Millis, user: UserId, presence: Presence) {
        self.advance(now);
        if self.take_fed_view(user, presence) {
            self.watch_published(user);
        }
    }

    /// A member no watch lists any more: the edge stops following her.
    pub fn poll_fed_unlisted(&mut self) -> Option<UserId> {
        self.groups.watches.fed.unlisted.pop_first()
    }

    /// Whether a watch lists `user` (the edge follows her views).
    pub fn is_fed_listed(&self, user: UserId) -> bool {
        self.groups.watches.fed.listed.contains_key(&user)
    }

    fn take_fed_view(&mut self, user: UserId, presence: Presence) -> bool {
        let Some((_, kept)) = self.groups.watches.fed.listed.get_mut(&user) else {
            return false;
        };
        if kept.as_ref().is_some_and(|k| k.version >= presence.version) {
            return false;
        }
        *kept = Some(presence);
        true
    }

    /// What a watched page's delta says of `user`: with fed counts, the view
    /// fed; else the published one.
    pub(crate) fn page_view(&self, user: UserId) -> Presence {
        if !self.groups.fed {
            return self.presence(user);
        }
        let fed = &self.groups.watches.fed.listed;
        fed.get(&user)
            .and_then(|(_, p)| p.clone())
            .unwrap_or_default()
    }
}

impl FedViews {
    /// A (group, member) key of the watch index was made.
    pub(crate) fn listed(&mut self, user: UserId) {
        self.unlisted.remove(&user);
        self.listed.entry(user).or_default().0 += 1;
    }

    /// A (group, member) key of the watch index went.
    pub(crate) fn unlisted(&mut self, user: UserId) {
        if let Some((keys, _)) = self.listed.get_mut(&user) {
            *keys -= 1;
            if *keys == 0 {
                self.listed.remove(&user);
                self.unlisted.insert(user);
            }
        }
    }

    /// The keys counted per member match the watch index (`check`).
    #[cfg(feature = "check")]
    pub(crate) fn check(
        &self,
        fed: bool,
        by_member: &BTreeMap<(GroupId, UserId), Vec<u64>>,
    ) -> Result<(), String> {
        let mut keys: BTreeMap<UserId, u32> = BTreeMap::new();
        if fed {
            for &(_, user) in by_member.keys() {
                *keys.entry(user).or_default() += 1;
            }
        }
        let counted: BTreeMap<UserId, u32> =
            self.listed.iter().map(|(u, (n, _))| (*u, *n)).collect();
        if counted != keys {
            return Err(format!(
                "fed views follow {counted:?}, the watches list {keys:?}"
            ));
        }
        Ok(())
    }
}
