//! Group presence (issue 28, docs/groups.md): a backend's service token
//! writes groups; a member's session subscribes and gets the online count
//! ([`Event::GroupCount`]), an admin's each member's change
//! ([`Event::GroupMember`]); any member reads the member list in pages
//! (at most 10 pages of a group in a burst, then one a second by default:
//! [`crate::ClientError::retry_after`] says when on
//! `ErrorCode::PageRateLimited`), and may watch up to 3 of them for
//! batched deltas ([`Event::GroupPageDelta`]).
//!
//! Per group the client keeps the highest version it was told and drops
//! anything older (a count on the batched stream may arrive after the
//! subscribe answer that already said more).

use crate::events::{Event, Source};
use crate::{Client, ClientError, Inbound, Shared};
use greendot_core::Presence;
use greendot_proto::{self as proto, Answer, Push, Request};

pub use greendot_proto::{GroupCursor, GroupRole, GroupSnapshot};

/// Groups whose version the client tracks at most (the server allows 100
/// group subscriptions per session by default).
const MAX_TRACKED: usize = 1024;

/// One page of a group's member list: online members first.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupPage {
    pub group: u64,
    /// The group's version when the page was taken.
    pub version: u64,
    /// Members shown online, in all.
    pub count: u32,
    /// Each member and what everybody is shown of them.
    pub entries: Vec<(String, Presence)>,
    /// Pass to [`Client::group_page`] for the next page; `None` on the last.
    pub next: Option<GroupCursor>,
}

fn entry(e: proto::GroupEntry) -> (String, Presence) {
    (e.user, e.presence.to_core())
}

/// A group push as an event, if its stream's tier is known.
pub(crate) fn inbound(push: Push, source: Option<Source>) -> Option<Inbound> {
    let source = source?;
    let event = match push {
        Push::GroupCount {
            group,
            version,
            count,
        } => Event::GroupCount {
            group,
            version,
            count,
            source,
        },
        Push::GroupMember {
            group,
            version,
            member,
            online,
            count,
        } => Event::GroupMember {
            group,
            version,
            member,
            online,
            count,
        },
        Push::GroupEnded { group } => Event::GroupEnded { group },
        Push::GroupPageDelta { group, entries } => Event::GroupPageDelta {
            group,
            entries: entries.into_iter().map(entry).collect(),
        },
        Push::Stream { .. } | Push::Update { .. } => return None,
    };
    Some(Inbound::Group(event))
}

impl Shared {
    /// Emits a group event unless it is older than what the app was told.
    pub(crate) fn apply_group(&self, event: Event) {
        let fresh = {
            let mut state = self.state();
            match &event {
                Event::GroupCount { group, version, .. }
                | Event::GroupMember { group, version, .. } => {
                    match state.group_versions.get_mut(group) {
                        Some(seen) if *seen >= *version => false,
                        Some(seen) => {
                            *seen = *version;
                            true
                        }
                        // A push may overtake the subscribe's answer (another
                        // stream); the server pushes only what is subscribed.
                        None => {
                            if state.group_versions.len() < MAX_TRACKED {
                                state.group_versions.insert(*group, *version);
                            }
                            true
                        }
                    }
                }
                Event::GroupEnded { group } => state.group_versions.remove(group).is_some(),
                _ => true,
            }
        };
        if fresh {
            self.emit(event);
        }
    }
}

impl Client {
    /// Writes a group whole (service tokens only): its members and admins
    /// (an admin is a member whether listed in `members` or not). Returns
    /// the membership version.
    pub async fn set_group<M: AsRef<str>, A: AsRef<str>>(
        &self,
        group: u64,
        members: &[M],
        admins: &[A],
    ) -> Result<u64, ClientError> {
        let request = Request::SetGroup {
            group,
            members: members.iter().map(|m| m.as_ref().to_owned()).collect(),
            admins: admins.iter().map(|a| a.as_ref().to_owned()).collect(),
        };
        match self.call(request).await? {
            Answer::GroupSet { version } => Ok(version),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Removes a group (service tokens only).
    pub async fn remove_group(&self, group: u64) -> Result<(), ClientError> {
        match self.call(Request::RemoveGroup { group }).await? {
            Answer::Done => Ok(()),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Subscribes to a group this session's user is a member of: the
    /// snapshot now, then [`Event::GroupCount`] (and, for an admin,
    /// [`Event::GroupMember`]) on [`crate::Updates`]. The subscription
    /// lasts across reconnects: a resumed session keeps it, and after one
    /// that did not resume the client subscribes again itself and tells
    /// the count then ([`Event::GroupCount`] from
    /// [`Source::Snapshot`](crate::Source::Snapshot)), or
    /// [`Event::GroupEnded`] if refused.
    pub async fn group_subscribe(&self, group: u64) -> Result<GroupSnapshot, ClientError> {
        match self.call(Request::GroupSubscribe { group }).await? {
            // The driver noted its version.
            Answer::GroupSubscribed(snapshot) => Ok(snapshot),
            other => Err(Self::unexpected(other)),
        }
    }

    pub async fn group_unsubscribe(&self, group: u64) -> Result<(), ClientError> {
        match self.call(Request::GroupUnsubscribe { group }).await? {
            Answer::Done => {
                self.shared.state().group_versions.remove(&group);
                Ok(())
            }
            other => Err(Self::unexpected(other)),
        }
    }

    /// A page of a group's member list (members only): `after` is the
    /// previous page's `next` (`None`: the first page); at most `limit`
    /// entries (the server caps it).
    pub async fn group_page(
        &self,
        group: u64,
        after: Option<GroupCursor>,
        limit: u32,
    ) -> Result<GroupPage, ClientError> {
        let request = Request::GroupPage {
            group,
            after,
            limit,
        };
        self.page(request).await
    }

    /// [`Client::group_page`], and the page is watched: its members'
    /// changes come as [`Event::GroupPageDelta`] (batched) until the watch
    /// runs out (60 s by default). Asking the same page (`group`, `after`)
    /// again re-reads it and renews the watch; so does
    /// [`Client::group_renew_watch`] without reading it. At most 3 pages
    /// and 600 entries per session (`ErrorCode::TooManyWatchedPages`).
    /// Watches end with the session: after a reconnect
    /// ([`Event::Reconnected`]) watch the pages again.
    pub async fn group_watch_page(
        &self,
        group: u64,
        after: Option<GroupCursor>,
        limit: u32,
    ) -> Result<GroupPage, ClientError> {
        let request = Request::GroupWatchPage {
            group,
            after,
            limit,
        };
        self.page(request).await
    }

    /// Renews the watch of a page (`group` and `after` as asked) without
    /// reading it. `ErrorCode::NotSubscribed` when it already ran out.
    pub async fn group_renew_watch(
        &self,
        group: u64,
        after: Option<GroupCursor>,
    ) -> Result<(), ClientError> {
        match self.call(Request::GroupRenewWatch { group, after }).await? {
            Answer::Done => Ok(()),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Ends the watch of a page.
    pub async fn group_unwatch_page(
        &self,
        group: u64,
        after: Option<GroupCursor>,
    ) -> Result<(), ClientError> {
        match self
            .call(Request::GroupUnwatchPage { group, after })
            .await?
        {
            Answer::Done => Ok(()),
            other => Err(Self::unexpected(other)),
        }
    }

    async fn page(&self, request: Request) -> Result<GroupPage, ClientError> {
        match self.call(request).await? {
            Answer::GroupPage(page) => Ok(GroupPage {
                group: page.group,
                version: page.version,
                count: page.count,
                entries: page.entries.into_iter().map(entry).collect(),
                next: page.next,
            }),
            other => Err(Self::unexpected(other)),
        }
    }
}
