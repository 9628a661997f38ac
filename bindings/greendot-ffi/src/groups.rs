//! Group presence (docs/groups.md) across the FFI: a backend writes groups
//! with a service token; a member subscribes to a group's online count
//! (`ClientEvent::GroupCount`), an admin also gets each member's change
//! (`ClientEvent::GroupMember`); members read the member list in pages and
//! may watch up to 3 of them for a while (`ClientEvent::GroupPageDelta`).

use crate::{on_runtime, GreendotClient, GreendotError, Presence};

/// How a group subscription is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum GroupRole {
    /// The online count, batched (at most every group interval, 10 s by
    /// default, only when it changed).
    Member,
    /// Each member's change in realtime, and the count with it.
    Admin,
}

impl From<greendot_client::GroupRole> for GroupRole {
    fn from(r: greendot_client::GroupRole) -> GroupRole {
        match r {
            greendot_client::GroupRole::Member => GroupRole::Member,
            greendot_client::GroupRole::Admin => GroupRole::Admin,
        }
    }
}

/// The answer to `set_group_in_parts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Record)]
pub struct GroupWritten {
    /// The membership version after the last request.
    pub version: u64,
    /// How many requests the write took (1 when it fit one frame).
    pub requests: u32,
}

/// The answer to `group_subscribe`. The member list is not in it: read it
/// with `group_page`.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct GroupSubscription {
    pub group: u64,
    pub role: GroupRole,
    /// Per group, only grows.
    pub version: u64,
    /// Members shown online (an invisible member counts as offline).
    pub count: u32,
    /// Members, admins included.
    pub members: u32,
}

/// Where a member page starts: the previous page's `next`. Opaque: pass
/// back what a page gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Record)]
pub struct GroupCursor {
    pub online: bool,
    pub after: u64,
}

impl From<greendot_client::GroupCursor> for GroupCursor {
    fn from(c: greendot_client::GroupCursor) -> GroupCursor {
        GroupCursor {
            online: c.online,
            after: c.after,
        }
    }
}

impl From<GroupCursor> for greendot_client::GroupCursor {
    fn from(c: GroupCursor) -> greendot_client::GroupCursor {
        greendot_client::GroupCursor {
            online: c.online,
            after: c.after,
        }
    }
}

/// A member and what everybody is shown of them.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct GroupMemberEntry {
    pub user: String,
    pub presence: Presence,
}

/// One page of a group's member list: online members first.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct GroupMemberPage {
    pub group: u64,
    /// The group's version when the page was taken.
    pub version: u64,
    /// Members shown online, in all.
    pub count: u32,
    pub entries: Vec<GroupMemberEntry>,
    /// Pass to `group_page` for the next page; `None` on the last.
    pub next: Option<GroupCursor>,
}

#[uniffi::export]
impl GreendotClient {
    /// Service tokens only (a backend): writes a group whole, its members
    /// and admins (an admin is a member whether listed in `members` or
    /// not). Returns the membership version. Sessions of users who left get
    /// `GroupEnded`.
    pub async fn set_group(
        &self,
        group: u64,
        members: Vec<String>,
        admins: Vec<String>,
    ) -> Result<u64, GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.set_group(group, &members, &admins).await?) }).await
    }

    /// `set_group` for a list of any size: one request when it fits the
    /// server's frame cap, else a `set_group` of the admins and the first
    /// members that fit, then `change_group`s adding the rest, each
    /// expecting the version before it (`Server` with code
    /// `VersionMismatch` if another writer changed the group meanwhile:
    /// it then holds part of the list; write it again). A group that
    /// exists loses the later parts' members until they are added back
    /// (their subscriptions end): change an existing large group with
    /// `change_group` instead.
    pub async fn set_group_in_parts(
        &self,
        group: u64,
        members: Vec<String>,
        admins: Vec<String>,
    ) -> Result<GroupWritten, GreendotError> {
        let client = self.client();
        on_runtime(async move {
            let written = client.set_group_in_parts(group, &members, &admins).await?;
            Ok(GroupWritten {
                version: written.version,
                requests: u32::try_from(written.requests).unwrap_or(u32::MAX),
            })
        })
        .await
    }

    /// Service tokens only (a backend): changes a group by difference.
    /// `remove` leave (admins too), `remove_admins` stay members only; then
    /// `add` join as members and `add_admins` as admins (and members).
    /// Creates the group if new (a group that does not exist is at version
    /// 0). With `expect_version`, changes only a group at that membership
    /// version, else `Server` with code `VersionMismatch` and nothing
    /// changed. Returns the new membership version.
    pub async fn change_group(
        &self,
        group: u64,
        add: Vec<String>,
        remove: Vec<String>,
        add_admins: Vec<String>,
        remove_admins: Vec<String>,
        expect_version: Option<u64>,
    ) -> Result<u64, GreendotError> {
        let client = self.client();
        let change = greendot_client::GroupChange {
            add,
            remove,
            add_admins,
            remove_admins,
            expect_version,
        };
        on_runtime(async move { Ok(client.change_group(group, change).await?) }).await
    }

    /// Service tokens only: removes a group; its subscribers get `GroupEnded`.
    pub async fn remove_group(&self, group: u64) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.remove_group(group).await?) }).await
    }

    /// Subscribes to a group of which this user is a member: the count
    /// now, then `GroupCount` (and for an admin `GroupMember`) events. Kept
    /// across reconnects. A non-member gets `Server` with code `NotMember`.
    pub async fn group_subscribe(&self, group: u64) -> Result<GroupSubscription, GreendotError> {
        let client = self.client();
        on_runtime(async move {
            let s = client.group_subscribe(group).await?;
            Ok(GroupSubscription {
                group: s.group,
                role: s.role.into(),
                version: s.version,
                count: s.count,
                members: s.members,
            })
        })
        .await
    }

    pub async fn group_unsubscribe(&self, group: u64) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.group_unsubscribe(group).await?) }).await
    }

    /// A page of the member list (members only): `after` is the previous
    /// page's `next` (`None`: the first page); at most `limit` entries
    /// (the server caps it, at 200 by default).
    pub async fn group_page(
        &self,
        group: u64,
        after: Option<GroupCursor>,
        limit: u32,
    ) -> Result<GroupMemberPage, GreendotError> {
        let client = self.client();
        on_runtime(async move {
            let page = client
                .group_page(group, after.map(Into::into), limit)
                .await?;
            Ok(member_page(page))
        })
        .await
    }

    /// `group_page`, and the page is watched: when a member it lists
    /// changes, `GroupPageDelta` events bring the new view (batched, every
    /// batch interval, 2 s by default) until the watch runs out, 60 s
    /// after it was asked unless renewed (`group_renew_watch`, say every
    /// 30 s while the page is on screen). Asking the same page (`group`,
    /// `after`) again re-reads it and renews the watch. At most 3 pages and
    /// 600 entries per session: `Server` with code `TooManyWatchedPages`.
    /// A resumed session keeps its watches; after `Reconnected` with
    /// `resumed: false`, watch again (watching a watched page again only
    /// renews it).
    pub async fn group_watch_page(
        &self,
        group: u64,
        after: Option<GroupCursor>,
        limit: u32,
    ) -> Result<GroupMemberPage, GreendotError> {
        let client = self.client();
        on_runtime(async move {
            let page = client
                .group_watch_page(group, after.map(Into::into), limit)
                .await?;
            Ok(member_page(page))
        })
        .await
    }

    /// Renews the watch of the page asked with this `group` and `after`,
    /// without reading it. `Server` with code `NotSubscribed` when it has
    /// run out already: watch the page again.
    pub async fn group_renew_watch(
        &self,
        group: u64,
        after: Option<GroupCursor>,
    ) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move {
            Ok(client
                .group_renew_watch(group, after.map(Into::into))
                .await?)
        })
        .await
    }

    /// Ends the watch of the page asked with this `group` and `after` (the
    /// page left the screen).
    pub async fn group_unwatch_page(
        &self,
        group: u64,
        after: Option<GroupCursor>,
    ) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move {
            Ok(client
                .group_unwatch_page(group, after.map(Into::into))
                .await?)
        })
        .await
    }
}

pub(crate) fn member_entry(
    (user, presence): (String, greendot_core::Presence),
) -> GroupMemberEntry {
    GroupMemberEntry {
        user,
        presence: presence.into(),
    }
}

fn member_page(page: greendot_client::GroupPage) -> GroupMemberPage {
    GroupMemberPage {
        group: page.group,
        version: page.version,
        count: page.count,
        entries: page.entries.into_iter().map(member_entry).collect(),
        next: page.next.map(Into::into),
    }
}
