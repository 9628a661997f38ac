//! The records, enums and the error that cross the FFI, and their
//! conversions from greendot-client's types. Names avoid clashes in the
//! generated languages (an enum variant may not share its name with a
//! record it carries: Kotlin nests the variant's class).

use greendot_client::{Carrier as ClientCarrier, ClientError, Event, Source};
use greendot_core::{DeviceKind as CoreKind, Status as CoreStatus, Tier as CoreTier};

use crate::groups::{member_entry, GroupMemberEntry};

/// What a viewer is told about a user.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct Presence {
    /// Per user, only grows; a newer presence has a higher version.
    pub version: u64,
    /// Shown online (to others: online, in the foreground on some device,
    /// and not invisible; to the user's own sessions: online).
    pub online: bool,
    /// Only meaningful while `online`.
    pub status: Status,
    /// The status message, only while `online`.
    pub message: Option<String>,
    /// The kinds of the user's devices online, only while `online`.
    pub kinds: Vec<DeviceKind>,
    /// While offline: when the user was last seen (Unix milliseconds), e.g.
    /// the moment their last foreground device went to the background.
    pub last_seen_ms: Option<u64>,
    /// Only ever true in a user's view of themselves.
    pub invisible: bool,
}

impl From<greendot_core::Presence> for Presence {
    fn from(p: greendot_core::Presence) -> Presence {
        Presence {
            version: p.version,
            online: p.online,
            status: p.status.into(),
            message: p.message.map(|m| m.to_string()),
            kinds: p.kinds.iter().map(DeviceKind::from).collect(),
            last_seen_ms: p.last_seen.map(|m| m.0),
            invisible: p.invisible,
        }
    }
}

/// The user's chosen status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum Status {
    Available,
    Away,
    Busy,
    DoNotDisturb,
}

impl From<CoreStatus> for Status {
    fn from(s: CoreStatus) -> Status {
        match s {
            CoreStatus::Available => Status::Available,
            CoreStatus::Away => Status::Away,
            CoreStatus::Busy => Status::Busy,
            CoreStatus::DoNotDisturb => Status::DoNotDisturb,
        }
    }
}

impl From<Status> for CoreStatus {
    fn from(s: Status) -> CoreStatus {
        match s {
            Status::Available => CoreStatus::Available,
            Status::Away => CoreStatus::Away,
            Status::Busy => CoreStatus::Busy,
            Status::DoNotDisturb => CoreStatus::DoNotDisturb,
        }
    }
}

/// How changes of a subscribed user are delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum Tier {
    /// Each change at once (the chat that is open).
    Realtime,
    /// Changes coalesced and delivered every batch interval (a contact list).
    Batched,
}

impl From<Tier> for CoreTier {
    fn from(t: Tier) -> CoreTier {
        match t {
            Tier::Realtime => CoreTier::Realtime,
            Tier::Batched => CoreTier::Batched,
        }
    }
}

impl From<CoreTier> for Tier {
    fn from(t: CoreTier) -> Tier {
        match t {
            CoreTier::Realtime => Tier::Realtime,
            CoreTier::Batched => Tier::Batched,
        }
    }
}

/// The kind of a device (from its token).
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum DeviceKind {
    Mobile,
    Desktop,
    Web,
    Other,
}

impl From<CoreKind> for DeviceKind {
    fn from(k: CoreKind) -> DeviceKind {
        match k {
            CoreKind::Mobile => DeviceKind::Mobile,
            CoreKind::Desktop => DeviceKind::Desktop,
            CoreKind::Web => DeviceKind::Web,
            CoreKind::Other => DeviceKind::Other,
        }
    }
}

/// What a connection runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum Carrier {
    /// QUIC over UDP.
    Quic,
    /// WebSocket over TLS over TCP: the fallback when UDP is blocked.
    WebSocket,
}

impl From<ClientCarrier> for Carrier {
    fn from(c: ClientCarrier) -> Carrier {
        match c {
            ClientCarrier::Quic => Carrier::Quic,
            ClientCarrier::WebSocket => Carrier::WebSocket,
        }
    }
}

/// Where a presence update came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum UpdateSource {
    /// A snapshot: in a subscribe answer or a resumed session's welcome.
    Snapshot,
    Realtime,
    Batched,
}

/// A subscribed target: the tier granted and what it is now.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct Snapshot {
    pub target: String,
    pub tier: Tier,
    pub presence: Presence,
}

/// A target the server would not subscribe to, and why.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct RefusedTarget {
    pub target: String,
    /// The server's error code, e.g. `NotAllowed`.
    pub code: String,
    pub reason: String,
}

/// The answer to a subscribe.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct Subscribed {
    pub snapshots: Vec<Snapshot>,
    pub refused: Vec<RefusedTarget>,
}

impl From<greendot_client::Subscribed> for Subscribed {
    fn from(s: greendot_client::Subscribed) -> Subscribed {
        Subscribed {
            snapshots: s
                .snapshots
                .into_iter()
                .map(|(target, tier, presence)| Snapshot {
                    target,
                    tier: tier.into(),
                    presence: presence.into(),
                })
                .collect(),
            refused: s
                .refused
                .into_iter()
                .map(|r| RefusedTarget {
                    target: r.target,
                    code: format!("{:?}", r.error.code),
                    reason: r.error.message,
                })
                .collect(),
        }
    }
}

/// A foreground device of a user, as `route` lists it.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct RouteEntry {
    pub device: String,
    pub kind: DeviceKind,
    pub session: u64,
}

impl From<greendot_proto::RouteEntry> for RouteEntry {
    fn from(e: greendot_proto::RouteEntry) -> RouteEntry {
        RouteEntry {
            device: e.device,
            kind: CoreKind::from(e.kind).into(),
            session: e.session,
        }
    }
}

/// What the client tells the app, through [`crate::PresenceListener`].
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum ClientEvent {
    /// What the client knows of `target` changed (newer versions only).
    PresenceChanged {
        target: String,
        presence: Presence,
        source: UpdateSource,
    },
    /// The connection was lost; the client is reconnecting.
    Disconnected { reason: String },
    /// Connected again; `resumed` if the session carried over unseen.
    Reconnected {
        session: u64,
        resumed: bool,
        carrier: Carrier,
    },
    /// A new token took over; `ended`: the subscriptions it no longer allows.
    TokenRefreshed { ended: Vec<String> },
    /// A subscribed group's online count (members shown online; invisible
    /// members count as offline): batched for a member, realtime for an
    /// admin. Versions rise per group; older ones are never delivered.
    GroupCount {
        group: u64,
        version: u64,
        count: u32,
        source: UpdateSource,
    },
    /// To an admin, in realtime: `member` is now shown online (`online`) or
    /// offline, and the group's count after it.
    GroupMember {
        group: u64,
        version: u64,
        member: String,
        online: bool,
        count: u32,
    },
    /// The group subscription ended: the user left the group, or it was
    /// removed.
    GroupEnded { group: u64 },
    /// Batched, to a session watching pages of `group`
    /// (`group_watch_page`): the members of its watched pages whose view
    /// changed, each with its latest view, as a page lists them. One event
    /// covers every watched page of the group (the server does not say
    /// which page a member is on: match `entries` by `user`). A member's
    /// `presence.version` rises with each change: keep the highest.
    GroupPageDelta {
        group: u64,
        entries: Vec<GroupMemberEntry>,
    },
    /// The client is finished (closed, logged out, refused, superseded, or
    /// gave up reconnecting). The last event.
    Closed {
        code: Option<String>,
        reason: String,
    },
}

fn update_source(source: Source) -> UpdateSource {
    match source {
        Source::Snapshot => UpdateSource::Snapshot,
        Source::Realtime => UpdateSource::Realtime,
        Source::Batched => UpdateSource::Batched,
    }
}

/// The binding's form of a client event; `None` for a kind of event the
/// binding does not know yet (the client's `Event` is non-exhaustive).
pub(crate) fn client_event(e: Event) -> Option<ClientEvent> {
    Some(match e {
        Event::Presence {
            target,
            presence,
            source,
        } => ClientEvent::PresenceChanged {
            target,
            presence: presence.into(),
            source: update_source(source),
        },
        Event::Disconnected { reason } => ClientEvent::Disconnected { reason },
        Event::Reconnected {
            session,
            resumed,
            carrier,
        } => ClientEvent::Reconnected {
            session: session.0,
            resumed,
            carrier: carrier.into(),
        },
        Event::TokenRefreshed { ended } => ClientEvent::TokenRefreshed { ended },
        Event::GroupCount {
            group,
            version,
            count,
            source,
        } => ClientEvent::GroupCount {
            group,
            version,
            count,
            source: update_source(source),
        },
        Event::GroupMember {
            group,
            version,
            member,
            online,
            count,
        } => ClientEvent::GroupMember {
            group,
            version,
            member,
            online,
            count,
        },
        Event::GroupEnded { group } => ClientEvent::GroupEnded { group },
        Event::GroupPageDelta { group, entries } => ClientEvent::GroupPageDelta {
            group,
            entries: entries.into_iter().map(member_entry).collect(),
        },
        Event::Closed { code, reason } => ClientEvent::Closed {
            code: code.map(|c| format!("{c:?}")),
            reason,
        },
        _ => return None,
    })
}

/// Why a call failed. Every variant carries a sentence for people
/// (`detail`); match on the variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, uniffi::Error)]
pub enum GreendotError {
    /// A setting cannot be used (an address, a certificate, a request too
    /// large to send).
    #[error("invalid setting: {detail}")]
    Config { detail: String },
    /// No connection could be opened.
    #[error("cannot connect: {detail}")]
    Connect { detail: String },
    /// The server refused the connection (e.g. `BadToken`, `TokenExpired`).
    #[error("refused by the server: {detail}")]
    Rejected {
        code: Option<String>,
        detail: String,
    },
    /// The connection was lost.
    #[error("connection lost: {detail}")]
    Lost { detail: String },
    /// The server answered with an error (e.g. `NotAllowed`).
    #[error("server error {code}: {detail}")]
    Server { code: String, detail: String },
    /// The request was sent but not answered by its deadline
    /// (`request_timeout_ms`), or the connection ended before the answer:
    /// the outcome is unknown (it may have taken effect, or may yet). Not a
    /// failure. `set_status`, `set_invisible` and the foreground state are
    /// idempotent: call them again with the same values.
    #[error("outcome unknown: {detail}")]
    OutcomeUnknown { detail: String },
    /// The request was never sent before its deadline (the client was
    /// reconnecting): it has not taken effect and never will.
    #[error("not sent: {detail}")]
    NotSent { detail: String },
    /// The client is closed.
    #[error("the client is closed")]
    Closed,
    /// The server broke the protocol, or a bug in this library.
    #[error("internal error: {detail}")]
    Internal { detail: String },
}

impl From<ClientError> for GreendotError {
    fn from(e: ClientError) -> GreendotError {
        let detail = e.to_string();
        match e {
            ClientError::Config(_) | ClientError::Tls(_) | ClientError::Encode(_) => {
                GreendotError::Config { detail }
            }
            ClientError::Connect(_) => GreendotError::Connect { detail },
            ClientError::Rejected { code, .. } => GreendotError::Rejected {
                code: code.map(|c| format!("{c:?}")),
                detail,
            },
            ClientError::Lost(_) => GreendotError::Lost { detail },
            ClientError::Server(error) => GreendotError::Server {
                code: format!("{:?}", error.code),
                detail,
            },
            ClientError::OutcomeUnknown { .. } => GreendotError::OutcomeUnknown { detail },
            ClientError::NotSent => GreendotError::NotSent { detail },
            ClientError::Closed => GreendotError::Closed,
            // Protocol, and whatever the client adds later.
            _ => GreendotError::Internal { detail },
        }
    }
}
