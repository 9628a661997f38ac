//! Member pages across a cluster (issue 28, docs/groups.md "Across a
//! cluster").
//!
//! The hub's core at the edge checks the session, its membership and its
//! page budget, as one node does. The owner of the group's home shard, the
//! group's aggregator, knows who is online by the latest partials: it
//! answers the page's **keys**, the members' names in page order (online
//! first, then the others, each section by ordinal) with the next page's
//! cursor. The edge then reads those members' published views from their
//! owners, as a query does (what others are shown: an invisible member is
//! offline), and answers the page. Ordinals are never reused, so a cursor
//! (section, ordinal) stays valid across membership writes.
//!
//! A page costs one request to the aggregator and one per shard holding
//! the page's members, at most the page size, within the page budget.
//!
//! **A watched page** is read the same way, with the members' shards
//! watched from before the read (no view published after it is missed).
//! Its members are then followed in the fanout by one subscriber of this
//! node's own, [`PAGE_WATCHER`], in realtime; its pushes go to the hub's
//! core ([`ClusterLink::poll_fanout`] is read by the server), which keeps
//! the watches as one node does and batches their deltas per session. The
//! core says when no watch lists a member any more, and she is no longer
//! followed ([`ClusterLink::unfollow_page_member`]). The aggregator's side,
//! the keys of a page, is `OwnedShards::page_keys` (`owner::group_sums`).

use crate::cluster::edge::devices::{due_waits, InFlight};
use crate::cluster::edge::subscribe::PageRead;
use crate::cluster::wire::{FromOwner, ToOwner, PAGES_SINCE};
use crate::cluster::{ClusterLink, Finished, RequestKind, RETRY_AFTER};
use greendot_core::Presence;
use greendot_core::{Millis, SessionId, Tier, UserId};
use greendot_proto::{self as proto, ErrorCode, WireError};
use std::time::Instant;

/// The fanout's subscriber that follows the members of this node's
/// watched pages (no session has this id; its user is no user's).
pub const PAGE_WATCHER: SessionId = SessionId(u64::MAX);
const PAGE_WATCHER_USER: UserId = UserId(u64::MAX);

/// A page whose keys are asked of the group's aggregator.
pub(in crate::cluster) struct PendingPage {
    session: SessionId,
    group: u64,
    after: Option<proto::GroupCursor>,
    limit: u32,
    watch: bool,
    deadline: Instant,
    /// Ask again then (after a refusal or a failure).
    retry_at: Option<Instant>,
}

impl ClusterLink {
    /// Whether this node serves member pages: only while it sends a
    /// protocol whose nodes all answer a page's keys.
    pub fn serves_pages(&self) -> bool {
        self.shared.settings.protocol >= PAGES_SINCE
    }

    /// A page of `group`'s members for `session`, whose membership and page
    /// budget the hub's core checked, with at most `limit` entries.
    /// Answered through [`ClusterLink::poll_finished`] under `wait` (before
    /// this returns when everything is at hand here); a page to be watched
    /// (`watch`) through [`Finished::WatchedPage`].
    #[allow(clippy::too_many_arguments)]
    pub fn group_page(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        group: u64,
        (after, limit): (Option<proto::GroupCursor>, u32),
        watch: bool,
    ) {
        let p = PendingPage {
            session,
            group,
            after,
            limit: limit.max(1),
            watch,
            deadline: now + self.shared.settings.request_timeout,
            retry_at: None,
        };
        self.edge.pages.insert(wait, p);
        self.ask_page_keys(wait, now, at)
    }

    fn ask_page_keys(&mut self, wait: u64, now: Instant, at: Millis) {
        let Some(p) = self.edge.pages.get_mut(&wait) else {
            return;
        };
        p.retry_at = None;
        // An ordinal is a u32: a larger cursor is past every member.
        let after = p
            .after
            .map(|c| (c.online, u32::try_from(c.after).unwrap_or(u32::MAX)));
        let (group, limit) = (p.group, p.limit);
        let home = self.shared.home_shard(group);
        let msg = ToOwner::GroupPage {
            group,
            after,
            limit,
        };
        let waiting = InFlight::PageKeys { wait };
        self.ask_owner((now, at), waiting, home, RequestKind::Snapshot, msg);
    }

    /// The keys came (or the aggregator refused, or did not answer): the
    /// members' views are read next, or the keys asked again shortly.
    pub(in crate::cluster) fn page_keys_answer(
        &mut self,
        wait: u64,
        answer: Option<FromOwner>,
        now: Instant,
        at: Millis,
    ) -> Option<proto::Answer> {
        let p = self.edge.pages.get_mut(&wait)?;
        let ok = |s: &str| !s.is_empty() && s.len() <= self.shared.max_name_len;
        match answer {
            Some(FromOwner::GroupPageKeys {
                version,
                count,
                keys,
                next,
            }) if keys.len() <= p.limit as usize
                && keys.iter().all(|(n, _)| ok(n))
                && distinct(&keys) =>
            {
                let p = self.edge.pages.remove(&wait)?;
                let read = PageRead {
                    group: p.group,
                    after: p.after,
                    watch: p.watch,
                    deadline: p.deadline,
                    version,
                    count,
                    next: next.map(|(online, after)| proto::GroupCursor {
                        online,
                        after: u64::from(after),
                    }),
                };
                let names = keys.into_iter().map(|(n, _)| n).collect();
                self.read_page(now, at, wait, p.session, names, read)
            }
            _ => {
                self.shared.counters.retries += 1;
                p.retry_at = Some(now + RETRY_AFTER);
                None
            }
        }
    }

    /// Follows the members of a watched page just read (their shards are
    /// watched already, one reference each), from the views read, each
    /// made the newest the fanout knows. Returns the members followed, each
    /// held until the read is settled ([`ClusterLink::settle_page_read`]),
    /// and the error of any that could not be.
    pub(in crate::cluster) fn follow_page_members(
        &mut self,
        at: Millis,
        read: &mut [(String, Presence)],
    ) -> (Vec<String>, Option<WireError>) {
        self.edge.fanout.open(PAGE_WATCHER, PAGE_WATCHER_USER);
        let held: Vec<UserId> = self
            .edge
            .fanout
            .subscriptions(PAGE_WATCHER)
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        let mut followed = Vec::with_capacity(read.len());
        let mut refused = None;
        for (name, presence) in read.iter_mut() {
            let snap = (Tier::Realtime, presence.clone());
            match self.fanout_subscribe(at, PAGE_WATCHER, name, snap, &held) {
                Ok(newest) => {
                    *presence = newest;
                    *self.edge.page_reads.entry(name.clone()).or_default() += 1;
                    followed.push(name.clone());
                }
                Err(e) => refused = Some(e),
            }
        }
        (followed, refused)
    }

    /// A watched page's read was handed to the hub's core: of the members
    /// it followed, those no watch lists (`listed` says) and no other read
    /// holds are no longer followed.
    pub fn settle_page_read(
        &mut self,
        at: Millis,
        followed: &[String],
        listed: impl Fn(&str) -> bool,
    ) {
        for name in followed {
            let Some(reads) = self.edge.page_reads.get_mut(name) else {
                continue;
            };
            *reads -= 1;
            if *reads == 0 {
                self.edge.page_reads.remove(name);
                if !listed(name) {
                    self.unfollow_page_member(at, name);
                }
            }
        }
    }

    /// No watched page here lists `member` any more: she is no longer
    /// followed, unless a read not yet handed to the hub's core holds her
    /// (its settling decides).
    pub fn unfollow_page_member(&mut self, at: Millis, member: &str) {
        if self.edge.page_reads.contains_key(member) {
            return;
        }
        let Some(id) = self.edge.names.get(member) else {
            return;
        };
        if self
            .edge
            .fanout
            .unsubscribe(at, PAGE_WATCHER, UserId(id))
            .is_ok()
        {
            self.forget_target(UserId(id));
        }
    }

    /// Pages past their deadline fail; keys due are asked again.
    pub(in crate::cluster) fn retry_pages(&mut self, now: Instant, at: Millis) {
        let pending = self
            .edge
            .pages
            .iter()
            .map(|(w, p)| (*w, p.deadline, p.retry_at));
        let (late, again) = due_waits(pending, now);
        for wait in late {
            self.edge.pages.remove(&wait);
            let error = WireError::new(
                ErrorCode::Internal,
                "the group's aggregator did not answer in time",
            );
            self.finished.push_back((wait, Finished::Failed(error)));
        }
        for wait in again {
            self.ask_page_keys(wait, now, at);
        }
    }
}

/// Whether no member is listed twice (each is followed once per read).
fn distinct(keys: &[(String, bool)]) -> bool {
    let mut seen = std::collections::BTreeSet::new();
    keys.iter().all(|(n, _)| seen.insert(n.as_str()))
}
