//! Typed errors: every refused input says why, and none of them panics.

use crate::types::Millis;
use std::fmt;

/// Why an input was refused. Nothing changed in the core when one is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The session was issued but is no longer current (superseded, logged
    /// out, expired), or is lingering and cannot take this input.
    Stale,
    /// No such session was ever issued.
    UnknownSession,
    /// A configured cap was reached.
    LimitExceeded(Limit),
    /// The session's credentials do not allow watching that user.
    NotAllowed,
    /// Unsubscribe from a target the session is not subscribed to.
    NotSubscribed,
    /// Restoring saved preferences of a user who is already online.
    AlreadyOnline,
    /// The session's user is not a member of that group (or there is no
    /// such group: a non-member cannot tell the two apart).
    NotMember,
    /// Removing a group that does not exist.
    UnknownGroup,
    /// Too many member pages of one group asked too quickly
    /// (`Config::group_page_burst`): nothing was done; the next page is
    /// granted `retry_after` from now.
    PageRateLimited { retry_after: Millis },
    /// A group change expected another membership version: the group is
    /// at `current` (0: it does not exist), and nothing was changed.
    VersionMismatch { current: u64 },
}

/// Which cap an input hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Limit {
    SubscriptionsPerSession,
    RealtimePerTarget,
    MessageLength,
    DevicesPerUser,
    Sessions,
    Users,
    GroupMembers,
    GroupAdmins,
    GroupSubscriptionsPerSession,
    Groups,
    WatchedPages,
    WatchedEntries,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Stale => f.write_str("session is no longer current"),
            Error::UnknownSession => f.write_str("no such session"),
            Error::LimitExceeded(limit) => write!(f, "limit exceeded: {limit}"),
            Error::NotAllowed => f.write_str("not allowed to watch that user"),
            Error::NotSubscribed => f.write_str("not subscribed to that user"),
            Error::AlreadyOnline => f.write_str("user is already online"),
            Error::NotMember => f.write_str("not a member of that group"),
            Error::UnknownGroup => f.write_str("no such group"),
            Error::PageRateLimited { retry_after } => write!(
                f,
                "too many member pages of this group: retry after {} ms",
                retry_after.0
            ),
            Error::VersionMismatch { current } => {
                write!(f, "the group is at membership version {current}")
            }
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::SubscriptionsPerSession => "subscriptions per session",
            Limit::RealtimePerTarget => "realtime subscribers per target",
            Limit::MessageLength => "status message length",
            Limit::DevicesPerUser => "devices per user",
            Limit::Sessions => "sessions",
            Limit::Users => "users",
            Limit::GroupMembers => "members per group",
            Limit::GroupAdmins => "admins per group",
            Limit::GroupSubscriptionsPerSession => "group subscriptions per session",
            Limit::Groups => "groups",
            Limit::WatchedPages => "watched pages per session",
            Limit::WatchedEntries => "entries of watched pages per session",
        })
    }
}

impl std::error::Error for Error {}
