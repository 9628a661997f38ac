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

/// A change of a group by difference ([`Client::change_group`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupChange {
    /// New members.
    pub add: Vec<String>,
    /// Members who leave (admins among them too).
    pub remove: Vec<String>,
    /// New admins (members too).
    pub add_admins: Vec<String>,
    /// Admins who stay members only.
    pub remove_admins: Vec<String>,
    /// Change only a group at this membership version (0: none exists).
    pub expect_version: Option<u64>,
}

/// What [`Client::set_group_in_parts`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupWritten {
    /// The membership version after the last request.
    pub version: u64,
    /// How many requests the write took (1: a single `SetGroup`).
    pub requests: usize,
}

/// Bytes of a group request besides its names, at most: the request id
/// and group (10 bytes each as varints), the variant, four list lengths
/// (5 each) and the expected version (11).
const REQUEST_OVERHEAD: usize = 64;

/// Bytes a name takes in a request: its length as a varint, then its bytes.
fn name_cost(name: &str) -> usize {
    let len = name.len();
    let mut varint = 1;
    while len >> (7 * varint) != 0 {
        varint += 1;
    }
    len + varint
}

/// `names` in consecutive parts of at most `budget` bytes each (a name
/// larger than the budget goes alone: the server refuses it as too large).
fn split<T>(names: &[T], budget: usize, cost: impl Fn(&str) -> usize) -> Vec<&[T]>
where
    T: AsRef<str>,
{
    let mut parts = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (i, name) in names.iter().enumerate() {
        let c = cost(name.as_ref());
        if i > start && used + c > budget {
            parts.push(&names[start..i]);
            (start, used) = (i, 0);
        }
        used += c;
    }
    if start < names.len() || parts.is_empty() {
        parts.push(&names[start..]);
    }
    parts
}

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

    /// Changes a group by difference (service tokens only): `remove`
    /// leave (admins too), `remove_admins` stay members only, then `add`
    /// join as members and `add_admins` as admins. Creates the group if new
    /// (a group that does not exist is at membership version 0). With
    /// `expect_version`, changes only a group at that membership version,
    /// else `ErrorCode::VersionMismatch` and nothing changed. Returns the
    /// new membership version.
    pub async fn change_group(&self, group: u64, change: GroupChange) -> Result<u64, ClientError> {
        let request = Request::ChangeGroup {
            group,
            add: change.add,
            remove: change.remove,
            add_admins: change.add_admins,
            remove_admins: change.remove_admins,
            expect_version: change.expect_version,
        };
        match self.call(request).await? {
            Answer::GroupSet { version } => Ok(version),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Writes a group whole as [`Client::set_group`] does, in as many
    /// requests as the server's frame cap ([`Client::max_frame`]) needs:
    /// one `SetGroup` when it fits, else a `SetGroup` of the admins and
    /// the first members that fit, then `ChangeGroup`s adding the rest,
    /// each expecting the version the previous one answered. A concurrent
    /// writer stops it with `ErrorCode::VersionMismatch`, the group then
    /// holding part of the list: write it again. In parts, a group that
    /// exists loses, until the request that adds them back, the members
    /// listed only in a later part: their subscriptions end
    /// ([`Event::GroupEnded`]); change an existing large group with
    /// [`Client::change_group`] instead. Returns the membership version
    /// and how many requests it took.
    pub async fn set_group_in_parts<M: AsRef<str>, A: AsRef<str>>(
        &self,
        group: u64,
        members: &[M],
        admins: &[A],
    ) -> Result<GroupWritten, ClientError> {
        let admin_cost = admins.iter().map(|a| name_cost(a.as_ref())).sum::<usize>();
        let budget = self.max_frame().saturating_sub(REQUEST_OVERHEAD);
        let mut parts = split(members, budget.saturating_sub(admin_cost), name_cost);
        if parts.len() <= 1 {
            let version = self.set_group(group, members, admins).await?;
            return Ok(GroupWritten {
                version,
                requests: 1,
            });
        }
        let rest = parts.split_off(1);
        let mut version = self.set_group(group, parts[0], admins).await?;
        for part in &rest {
            let change = GroupChange {
                add: part.iter().map(|m| m.as_ref().to_owned()).collect(),
                expect_version: Some(version),
                ..GroupChange::default()
            };
            version = self.change_group(group, change).await?;
        }
        Ok(GroupWritten {
            version,
            requests: 1 + rest.len(),
        })
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

#[cfg(test)]
mod tests {
    use super::{name_cost, split};

    #[test]
    fn names_are_split_into_parts_within_the_budget() {
        assert_eq!((name_cost("ann"), name_cost(&"x".repeat(128))), (4, 130));
        let names: Vec<String> = (0..10).map(|i| format!("member{i:05}")).collect();
        // 12 bytes each: three fit in 36.
        let parts = split(&names, 36, name_cost);
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [3, 3, 3, 1]
        );
        assert_eq!(parts.concat(), names, "every name once, in order");
        assert_eq!(split(&names, 1000, name_cost).len(), 1);
        assert_eq!(split::<String>(&[], 10, name_cost), [&[] as &[String]]);
    }
}
