//! The frames of version 1. Field order is the encoding order (postcard):
//! never reorder fields or enum variants; add new variants at the end.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The first frame on the control stream, from the client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Must stay the first field: the server reads it before anything else.
    pub version: u32,
    /// A JWT (HS256) with the claims of `token::Claims`.
    pub token: String,
    /// The session this device had, to resume it (from a previous `Welcome`).
    pub resume: Option<u64>,
    /// The app is in the foreground (`false`: in the background, so the
    /// device is not present and not routable; see `Request::SetForeground`).
    /// Optional on the wire: a hello that ends after `resume` (a client
    /// older than this field) is in the foreground. Decode with
    /// [`crate::decode_hello`].
    pub foreground: bool,
}

/// Every later frame on the control stream, from the client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestFrame {
    /// Chosen by the client; echoed in the reply. Ids may be reused once answered.
    pub id: u64,
    pub request: Request,
}

/// What a client may ask.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Does nothing but renew the session's lease; answered `Done`.
    Ping,
    /// Watch these users in this tier; answered `Subscribed`.
    Subscribe { targets: Vec<String>, tier: Tier },
    /// Stop watching one user; answered `Done` or `NotSubscribed`.
    Unsubscribe { target: String },
    /// What this session may see of these users now; answered `Presences`.
    /// More than one target needs a service token.
    Query { targets: Vec<String> },
    /// The user's chosen status and message; answered `Done`.
    SetStatus {
        status: Status,
        message: Option<String>,
    },
    /// Appear offline to everybody else; answered `Done`.
    SetInvisible { invisible: bool },
    /// The Online devices of a user (service tokens only); answered `Route`.
    Route { user: String },
    /// Graceful logout: answered `Done`, then the server closes the connection
    /// with `CloseCode::Logout`.
    Logout,
    /// A new token for this connection, for the same user and device (before
    /// the current one expires); answered `Refreshed`. Its `watch` replaces
    /// the old one: subscriptions it no longer allows end, and the answer
    /// names them. Refused (`BadToken`, `TokenExpired`, `TokenRevoked`) the
    /// connection goes on under its current token.
    Refresh { token: String },
    /// Service tokens only: every token of `user` (only of `device`, if
    /// given) issued before `before` (Unix seconds, the token's `iat`) is
    /// refused from now on, and live sessions holding one are closed with
    /// `CloseCode::Revoked`. Answered `Revoked` once stored durably.
    Revoke {
        user: String,
        device: Option<String>,
        before: u64,
    },
    /// The app went to the foreground (`true`) or the background; answered
    /// `Done`. A backgrounded device is not present: once no device of the
    /// user is in the foreground, others see the user offline after the
    /// debounce, last seen at the moment the last one went to the
    /// background; `Route` no longer lists it. Its session, subscriptions
    /// and pushes go on. Idempotent; a reconnect's `Hello::foreground`
    /// carries the state.
    SetForeground { foreground: bool },
    /// Service tokens only: writes group `group` whole, its members and its
    /// admins (an admin is a member whether listed in `members` or not);
    /// creates it if new. Answered `GroupSet` with the membership version.
    /// Sessions of users who left get `Push::GroupEnded`.
    SetGroup {
        group: u64,
        members: Vec<String>,
        admins: Vec<String>,
    },
    /// Service tokens only: removes a group; its subscribers get
    /// `Push::GroupEnded`. Answered `Done`, or `UnknownGroup`.
    RemoveGroup { group: u64 },
    /// A member's session subscribes to a group; answered `GroupSubscribed`.
    /// Members then get `Push::GroupCount` on the batched stream, admins
    /// `Push::GroupMember` (and counts) on the realtime stream. Again: a
    /// fresh snapshot. `NotMember` for anyone else, and for no such group.
    GroupSubscribe { group: u64 },
    /// Answered `Done`, or `NotSubscribed`.
    GroupUnsubscribe { group: u64 },
    /// A page of a group's member list (members only): online members
    /// first; `after` is the previous page's `next` (`None`: the first
    /// page); at most `limit` entries (the server caps it, 200 by default).
    /// Answered `GroupPage`.
    GroupPage {
        group: u64,
        after: Option<GroupCursor>,
        limit: u32,
    },
    /// `GroupPage`, and the page is watched: the members it lists (that
    /// set, as answered) get `Push::GroupPageDelta` on the batched stream
    /// when their published view changes, for 60 s (the server's
    /// `group_watch_ttl`). Asking the same page (same `group` and `after`)
    /// again re-reads it and renews its watch. At most 3 watched pages and
    /// 600 entries per session: `TooManyWatchedPages` past them, and then
    /// nothing is stored. Answered `GroupPage`.
    GroupWatchPage {
        group: u64,
        after: Option<GroupCursor>,
        limit: u32,
    },
    /// Renews the watch of the page asked with this `group` and `after`
    /// for another TTL without reading it. Answered `Done`, or
    /// `NotSubscribed` when the watch is gone (it ran out: ask the page
    /// again).
    GroupRenewWatch {
        group: u64,
        after: Option<GroupCursor>,
    },
    /// Ends the watch of that page. Answered `Done`, or `NotSubscribed`.
    GroupUnwatchPage {
        group: u64,
        after: Option<GroupCursor>,
    },
    /// Service tokens only: changes group `group` by difference. `remove`
    /// leave (admins too), `remove_admins` stay members only; then `add`
    /// join as members and `add_admins` as admins (and members): a name
    /// both removed and added ends added. Creates the group if new (a
    /// group that does not exist is at membership version 0). With
    /// `expect_version`, changes only a group at that membership version,
    /// else `VersionMismatch` and nothing changes. Answered `GroupSet` with
    /// the new membership version; the same limits and pushes as `SetGroup`.
    ChangeGroup {
        group: u64,
        add: Vec<String>,
        remove: Vec<String>,
        add_admins: Vec<String>,
        remove_admins: Vec<String>,
        expect_version: Option<u64>,
    },
}

/// Frames on the control stream, from the server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerFrame {
    /// The answer to a good `Hello`.
    Welcome(Welcome),
    /// The answer to the request with this id.
    Reply {
        id: u64,
        result: Result<Answer, WireError>,
    },
    /// A connection-level error; the server closes the connection next.
    Error(WireError),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub version: u32,
    /// This connection's session; pass it as `Hello::resume` when reconnecting.
    pub session: u64,
    /// The previous session was resumed: its subscriptions carried over and
    /// `snapshots` holds a fresh snapshot of each.
    pub resumed: bool,
    pub user: String,
    pub device: String,
    pub snapshots: Vec<Snapshot>,
    /// The server's frame length cap.
    pub max_frame: u32,
}

/// Answers to requests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Done,
    /// One snapshot per granted target (the tier may be downgraded to batched),
    /// one refusal per refused target.
    Subscribed {
        snapshots: Vec<Snapshot>,
        refused: Vec<Refused>,
    },
    Presences(Vec<QueryResult>),
    Route(Vec<RouteEntry>),
    /// The answer to `Refresh`: the new token's `exp` (Unix seconds) and
    /// the targets whose subscriptions ended because its `watch` no longer
    /// allows them.
    Refreshed {
        expires: u64,
        ended: Vec<String>,
    },
    /// The answer to `Revoke`: how many live sessions of this server it closed.
    Revoked {
        closed: u32,
    },
    /// The answer to `SetGroup` and `ChangeGroup`: the group's membership
    /// version (1, 2, … per write).
    GroupSet {
        version: u64,
    },
    /// The answer to `GroupSubscribe`.
    GroupSubscribed(GroupSnapshot),
    /// The answer to `GroupPage`.
    GroupPage(GroupPage),
}

/// What a group subscription gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupRole {
    /// The online count, batched.
    Member,
    /// Each member's change, in realtime.
    Admin,
}

/// The answer to a group subscribe. The member list is not in it: read it
/// in pages (`Request::GroupPage`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSnapshot {
    pub group: u64,
    pub role: GroupRole,
    /// Per group, only grows: keep the highest seen, drop older pushes.
    pub version: u64,
    /// Members shown online.
    pub count: u32,
    /// Members, admins included.
    pub members: u32,
}

/// Where a member page starts: the previous page's last entry. Opaque:
/// pass back what `GroupPage::next` gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupCursor {
    /// The entry was in the online section.
    pub online: bool,
    pub after: u64,
}

/// One page of a group's member list: online members first, then the
/// others, each section in a stable order of the server's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPage {
    pub group: u64,
    /// The group's version when the page was taken.
    pub version: u64,
    /// Members shown online, in all.
    pub count: u32,
    pub entries: Vec<GroupEntry>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<GroupCursor>,
}

/// A member and what everybody is shown of them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupEntry {
    pub user: String,
    pub presence: Presence,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub target: String,
    /// The tier granted.
    pub tier: Tier,
    pub presence: Presence,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    pub target: String,
    pub error: WireError,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryResult {
    pub target: String,
    pub result: Result<Presence, WireError>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteEntry {
    pub device: String,
    pub kind: Kind,
    pub session: u64,
}

/// Frames on the server-opened push streams.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Push {
    /// The first frame of each push stream.
    Stream { tier: Tier },
    /// `target` is now shown as `presence`.
    Update { target: String, presence: Presence },
    /// The group's online count (members shown online; invisible members
    /// count as offline). To a member on the batched stream, at most once
    /// per group interval and only when it changed; to an admin on the
    /// realtime stream, after each membership write.
    GroupCount {
        group: u64,
        version: u64,
        count: u32,
    },
    /// To an admin, on the realtime stream: `member` is now shown online
    /// (or offline), and the count after it.
    GroupMember {
        group: u64,
        version: u64,
        member: String,
        online: bool,
        count: u32,
    },
    /// On the realtime stream: the subscription ended (the user left the
    /// group, or it was removed).
    GroupEnded { group: u64 },
    /// On the batched stream, to a session watching pages of `group`
    /// (`Request::GroupWatchPage`): the members of its watched pages whose
    /// published view changed since the last such push, each with its
    /// latest view (at most 100 entries a push; more come in several).
    /// Each entry's `presence.version` rises per member: keep the highest.
    GroupPageDelta {
        group: u64,
        entries: Vec<GroupEntry>,
    },
}

/// What a viewer is told about a user.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Presence {
    /// Per user, only grows: keep the highest seen, drop older ones.
    pub version: u64,
    pub online: bool,
    pub status: Status,
    pub message: Option<String>,
    /// Bit set of device kinds online: 1 mobile, 2 desktop, 4 web, 8 other.
    pub kinds: u8,
    /// While offline: when the user was last shown online, in Unix
    /// milliseconds of the server's clock.
    pub last_seen: Option<u64>,
    /// Only ever true in a user's view of themselves.
    pub invisible: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    Realtime,
    Batched,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Status {
    #[default]
    Available,
    Away,
    Busy,
    DoNotDisturb,
}

/// Device kinds; in tokens they are written in lower case.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Mobile,
    Desktop,
    Web,
    #[default]
    Other,
}

/// A typed error with a human-readable message.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError {
            code,
            message: message.into(),
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} ({}): {}",
            self.code,
            self.code.code(),
            self.message
        )
    }
}

impl std::error::Error for WireError {}

/// Error codes, encoded as a `u16` so that a client can carry codes it does not
/// know yet (`Other`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "u16", into = "u16")]
pub enum ErrorCode {
    /// A frame could not be decoded.
    BadFrame,
    /// A frame's length exceeded the cap.
    FrameTooLarge,
    /// The hello's version is not spoken here.
    UnsupportedVersion,
    /// Missing, malformed or forged token, or claims that make no sense.
    BadToken,
    /// The token has expired.
    TokenExpired,
    /// A hello after the hello, or a request before it.
    UnexpectedFrame,
    /// Too many requests: this one was not processed.
    RateLimited,
    /// The token's `watch` does not allow that user.
    NotAllowed,
    NotSubscribed,
    /// The session is no longer current (superseded, logged out, expired).
    Stale,
    UnknownSession,
    /// Only service tokens may do this.
    ServiceOnly,
    TooManyConnections,
    /// A malformed request (an empty or over-long name...).
    BadRequest,
    Internal,
    ShuttingDown,
    /// The per-session subscription cap.
    TooManySubscriptions,
    /// The per-target realtime cap (when the server rejects instead of downgrading).
    RealtimeFull,
    MessageTooLong,
    TooManyDevices,
    TooManySessions,
    TooManyUsers,
    /// More targets in one request than allowed.
    TooManyTargets,
    /// The token was revoked (issued before a revocation of its user or device).
    TokenRevoked,
    /// The revocation list is full.
    TooManyRevocations,
    /// The session's user is not a member of that group (or there is no
    /// such group: a non-member cannot tell).
    NotMember,
    /// Removing a group that does not exist.
    UnknownGroup,
    /// More members (admins included) in a group than allowed.
    TooManyGroupMembers,
    /// More admins in a group than allowed.
    TooManyGroupAdmins,
    /// The per-session group subscription cap.
    TooManyGroupSubscriptions,
    /// The server holds as many groups as it may.
    TooManyGroups,
    /// This server does not serve that request in its configuration
    /// (member pages and watches on a node of a cluster).
    Unsupported,
    /// A session watches as many member pages (3), or entries (600), as
    /// it may: the message says which.
    TooManyWatchedPages,
    /// Too many member pages of one group asked too quickly; nothing was
    /// done. The message ends with `retry_ms=N`: the next page of that
    /// group is granted N ms from now.
    PageRateLimited,
    /// A `ChangeGroup` expected another membership version (another writer
    /// changed the group); nothing was changed. The message ends with
    /// `version=N`, the group's membership version (0: no such group).
    VersionMismatch,
    Other(u16),
}

impl ErrorCode {
    pub fn code(self) -> u16 {
        match self {
            ErrorCode::BadFrame => 1,
            ErrorCode::FrameTooLarge => 2,
            ErrorCode::UnsupportedVersion => 3,
            ErrorCode::BadToken => 4,
            ErrorCode::TokenExpired => 5,
            ErrorCode::UnexpectedFrame => 6,
            ErrorCode::RateLimited => 7,
            ErrorCode::NotAllowed => 8,
            ErrorCode::NotSubscribed => 9,
            ErrorCode::Stale => 10,
            ErrorCode::UnknownSession => 11,
            ErrorCode::ServiceOnly => 12,
            ErrorCode::TooManyConnections => 13,
            ErrorCode::BadRequest => 14,
            ErrorCode::Internal => 15,
            ErrorCode::ShuttingDown => 16,
            ErrorCode::TooManySubscriptions => 20,
            ErrorCode::RealtimeFull => 21,
            ErrorCode::MessageTooLong => 22,
            ErrorCode::TooManyDevices => 23,
            ErrorCode::TooManySessions => 24,
            ErrorCode::TooManyUsers => 25,
            ErrorCode::TooManyTargets => 26,
            ErrorCode::TokenRevoked => 27,
            ErrorCode::TooManyRevocations => 28,
            ErrorCode::NotMember => 29,
            ErrorCode::UnknownGroup => 30,
            ErrorCode::TooManyGroupMembers => 31,
            ErrorCode::TooManyGroupAdmins => 32,
            ErrorCode::TooManyGroupSubscriptions => 33,
            ErrorCode::TooManyGroups => 34,
            ErrorCode::Unsupported => 35,
            ErrorCode::TooManyWatchedPages => 36,
            ErrorCode::PageRateLimited => 37,
            ErrorCode::VersionMismatch => 38,
            ErrorCode::Other(code) => code,
        }
    }
}

impl From<u16> for ErrorCode {
    fn from(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::BadFrame,
            2 => ErrorCode::FrameTooLarge,
            3 => ErrorCode::UnsupportedVersion,
            4 => ErrorCode::BadToken,
            5 => ErrorCode::TokenExpired,
            6 => ErrorCode::UnexpectedFrame,
            7 => ErrorCode::RateLimited,
            8 => ErrorCode::NotAllowed,
            9 => ErrorCode::NotSubscribed,
            10 => ErrorCode::Stale,
            11 => ErrorCode::UnknownSession,
            12 => ErrorCode::ServiceOnly,
            13 => ErrorCode::TooManyConnections,
            14 => ErrorCode::BadRequest,
            15 => ErrorCode::Internal,
            16 => ErrorCode::ShuttingDown,
            20 => ErrorCode::TooManySubscriptions,
            21 => ErrorCode::RealtimeFull,
            22 => ErrorCode::MessageTooLong,
            23 => ErrorCode::TooManyDevices,
            24 => ErrorCode::TooManySessions,
            25 => ErrorCode::TooManyUsers,
            26 => ErrorCode::TooManyTargets,
            27 => ErrorCode::TokenRevoked,
            28 => ErrorCode::TooManyRevocations,
            29 => ErrorCode::NotMember,
            30 => ErrorCode::UnknownGroup,
            31 => ErrorCode::TooManyGroupMembers,
            32 => ErrorCode::TooManyGroupAdmins,
            33 => ErrorCode::TooManyGroupSubscriptions,
            34 => ErrorCode::TooManyGroups,
            35 => ErrorCode::Unsupported,
            36 => ErrorCode::TooManyWatchedPages,
            37 => ErrorCode::PageRateLimited,
            38 => ErrorCode::VersionMismatch,
            other => ErrorCode::Other(other),
        }
    }
}

impl From<ErrorCode> for u16 {
    fn from(code: ErrorCode) -> u16 {
        code.code()
    }
}

// ----- conversions to and from the core's types ----------------------------

impl From<greendot_core::Tier> for Tier {
    fn from(tier: greendot_core::Tier) -> Tier {
        match tier {
            greendot_core::Tier::Realtime => Tier::Realtime,
            greendot_core::Tier::Batched => Tier::Batched,
        }
    }
}

impl From<Tier> for greendot_core::Tier {
    fn from(tier: Tier) -> greendot_core::Tier {
        match tier {
            Tier::Realtime => greendot_core::Tier::Realtime,
            Tier::Batched => greendot_core::Tier::Batched,
        }
    }
}

impl From<greendot_core::Status> for Status {
    fn from(status: greendot_core::Status) -> Status {
        match status {
            greendot_core::Status::Available => Status::Available,
            greendot_core::Status::Away => Status::Away,
            greendot_core::Status::Busy => Status::Busy,
            greendot_core::Status::DoNotDisturb => Status::DoNotDisturb,
        }
    }
}

impl From<Status> for greendot_core::Status {
    fn from(status: Status) -> greendot_core::Status {
        match status {
            Status::Available => greendot_core::Status::Available,
            Status::Away => greendot_core::Status::Away,
            Status::Busy => greendot_core::Status::Busy,
            Status::DoNotDisturb => greendot_core::Status::DoNotDisturb,
        }
    }
}

impl From<greendot_core::DeviceKind> for Kind {
    fn from(kind: greendot_core::DeviceKind) -> Kind {
        match kind {
            greendot_core::DeviceKind::Mobile => Kind::Mobile,
            greendot_core::DeviceKind::Desktop => Kind::Desktop,
            greendot_core::DeviceKind::Web => Kind::Web,
            greendot_core::DeviceKind::Other => Kind::Other,
        }
    }
}

impl From<Kind> for greendot_core::DeviceKind {
    fn from(kind: Kind) -> greendot_core::DeviceKind {
        match kind {
            Kind::Mobile => greendot_core::DeviceKind::Mobile,
            Kind::Desktop => greendot_core::DeviceKind::Desktop,
            Kind::Web => greendot_core::DeviceKind::Web,
            Kind::Other => greendot_core::DeviceKind::Other,
        }
    }
}

impl Presence {
    /// From the core's presence; `unix_base_ms` is the Unix time of the
    /// server's `Millis(0)`.
    pub fn from_core(p: &greendot_core::Presence, unix_base_ms: u64) -> Presence {
        Presence {
            version: p.version,
            online: p.online,
            status: p.status.into(),
            message: p.message.as_deref().map(str::to_owned),
            kinds: p.kinds.bits(),
            last_seen: p.last_seen.map(|m| unix_base_ms.saturating_add(m.0)),
            invisible: p.invisible,
        }
    }

    /// To the core's presence, for a client's `View`: `last_seen` stays in
    /// Unix milliseconds.
    pub fn to_core(&self) -> greendot_core::Presence {
        greendot_core::Presence {
            version: self.version,
            online: self.online,
            status: self.status.into(),
            message: self.message.as_deref().map(std::sync::Arc::from),
            kinds: greendot_core::Kinds::from_bits(self.kinds),
            last_seen: self.last_seen.map(greendot_core::Millis),
            invisible: self.invisible,
        }
    }
}

impl From<greendot_core::Error> for WireError {
    fn from(error: greendot_core::Error) -> WireError {
        use greendot_core::{Error, Limit};
        let code = match error {
            Error::Stale => ErrorCode::Stale,
            Error::UnknownSession => ErrorCode::UnknownSession,
            Error::NotAllowed => ErrorCode::NotAllowed,
            Error::NotSubscribed => ErrorCode::NotSubscribed,
            Error::LimitExceeded(limit) => match limit {
                Limit::SubscriptionsPerSession => ErrorCode::TooManySubscriptions,
                Limit::RealtimePerTarget => ErrorCode::RealtimeFull,
                Limit::MessageLength => ErrorCode::MessageTooLong,
                Limit::DevicesPerUser => ErrorCode::TooManyDevices,
                Limit::Sessions => ErrorCode::TooManySessions,
                Limit::Users => ErrorCode::TooManyUsers,
                Limit::GroupMembers => ErrorCode::TooManyGroupMembers,
                Limit::GroupAdmins => ErrorCode::TooManyGroupAdmins,
                Limit::GroupSubscriptionsPerSession => ErrorCode::TooManyGroupSubscriptions,
                Limit::Groups => ErrorCode::TooManyGroups,
                Limit::WatchedPages | Limit::WatchedEntries => ErrorCode::TooManyWatchedPages,
                _ => ErrorCode::Internal,
            },
            Error::NotMember => ErrorCode::NotMember,
            Error::UnknownGroup => ErrorCode::UnknownGroup,
            Error::PageRateLimited { retry_after } => {
                // `retry_ms=` as in close reasons, so one parser reads both.
                return WireError::new(
                    ErrorCode::PageRateLimited,
                    format!(
                        "too many member pages of this group: retry_ms={}",
                        retry_after.0
                    ),
                );
            }
            Error::VersionMismatch { current } => {
                // `version=` last, so a backend reads the version to retry from.
                return WireError::new(
                    ErrorCode::VersionMismatch,
                    format!("the group changed: version={current}"),
                );
            }
            _ => ErrorCode::Internal,
        };
        WireError::new(code, error.to_string())
    }
}

impl From<greendot_core::GroupRole> for GroupRole {
    fn from(role: greendot_core::GroupRole) -> GroupRole {
        match role {
            greendot_core::GroupRole::Member => GroupRole::Member,
            greendot_core::GroupRole::Admin => GroupRole::Admin,
        }
    }
}
