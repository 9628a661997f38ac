//! The nouns of presence: time, identifiers, statuses, tiers and what a viewer sees.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// A point on the driver's monotonic millisecond clock, or a span of it.
///
/// The core never reads a clock: every input carries `now`. A `now` older than
/// one already seen is treated as the newest seen, so time never runs backwards
/// inside the core.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Millis(pub u64);

impl Millis {
    pub const ZERO: Millis = Millis(0);

    pub const fn from_secs(secs: u64) -> Millis {
        Millis(secs * 1000)
    }

    /// `self + span`, saturating: deadlines far in the future stay in the future.
    pub const fn plus(self, span: Millis) -> Millis {
        Millis(self.0.saturating_add(span.0))
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// A user, as the driver names it (the transport interns user names into these).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct UserId(pub u64);

/// A device of one user; unique within that user only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DeviceId(pub u64);

/// What sort of device a session runs on; each kind has its own timeouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum DeviceKind {
    Mobile,
    Desktop,
    Web,
    Other,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 4] = [
        DeviceKind::Mobile,
        DeviceKind::Desktop,
        DeviceKind::Web,
        DeviceKind::Other,
    ];

    pub const fn index(self) -> usize {
        self as usize
    }

    pub const fn name(self) -> &'static str {
        match self {
            DeviceKind::Mobile => "mobile",
            DeviceKind::Desktop => "desktop",
            DeviceKind::Web => "web",
            DeviceKind::Other => "other",
        }
    }
}

/// A set of device kinds ("on mobile and desktop"), as a bit set.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Kinds(u8);

impl Kinds {
    pub const EMPTY: Kinds = Kinds(0);

    pub fn insert(&mut self, kind: DeviceKind) {
        self.0 |= 1 << kind.index();
    }

    pub fn contains(self, kind: DeviceKind) -> bool {
        self.0 & (1 << kind.index()) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = DeviceKind> {
        DeviceKind::ALL
            .into_iter()
            .filter(move |k| self.contains(*k))
    }

    /// The raw bits, for wire formats.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// From raw bits; unknown bits are dropped.
    pub fn from_bits(bits: u8) -> Kinds {
        Kinds(bits & 0b1111)
    }
}

impl FromIterator<DeviceKind> for Kinds {
    fn from_iter<I: IntoIterator<Item = DeviceKind>>(iter: I) -> Kinds {
        let mut kinds = Kinds::EMPTY;
        for kind in iter {
            kinds.insert(kind);
        }
        kinds
    }
}

/// A session: one connection's identity, assigned by the core at connect and
/// never reused while the core lives (a slot index plus a generation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionId(pub u64);

impl SessionId {
    pub(crate) const fn new(index: u32, generation: u32) -> SessionId {
        SessionId(((generation as u64) << 32) | index as u64)
    }

    pub(crate) const fn index(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }

    pub(crate) const fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}.{}", self.index(), self.generation())
    }
}

/// The status a user chose to display. An explicit choice always wins; the only
/// inferred status in version 1 is the default, `Available`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum Status {
    #[default]
    Available,
    Away,
    Busy,
    DoNotDisturb,
}

impl Status {
    pub const ALL: [Status; 4] = [
        Status::Available,
        Status::Away,
        Status::Busy,
        Status::DoNotDisturb,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Status::Available => "available",
            Status::Away => "away",
            Status::Busy => "busy",
            Status::DoNotDisturb => "do-not-disturb",
        }
    }
}

/// How quickly a subscriber hears about changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Tier {
    /// Each published change is pushed at once (the chat that is open).
    Realtime,
    /// Changes are coalesced per target and flushed every `batch_interval`
    /// (a contact list).
    Batched,
}

/// Which users a session may watch, from its credentials.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Watch {
    /// Anybody.
    All,
    /// Only these users (sorted, without duplicates). A user may always watch
    /// themselves.
    Only(Arc<[UserId]>),
}

impl Watch {
    /// A list of allowed targets, in any order, duplicates allowed.
    pub fn only(users: impl IntoIterator<Item = UserId>) -> Watch {
        let mut users: Vec<UserId> = users.into_iter().collect();
        users.sort_unstable();
        users.dedup();
        Watch::Only(users.into())
    }

    pub fn allows(&self, user: UserId) -> bool {
        match self {
            Watch::All => true,
            Watch::Only(users) => users.binary_search(&user).is_ok(),
        }
    }
}

/// What a viewer is told about a user: others get the published, debounced
/// view; the user's own sessions get the truth (including `invisible`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Presence {
    /// Per-user, only grows. A viewer keeps the highest it has seen.
    pub version: u64,
    /// Shown online (to others: really online and not invisible; to the user's
    /// own sessions: really online).
    pub online: bool,
    /// Only meaningful while `online`; `Available` otherwise.
    pub status: Status,
    /// The status message, only while `online`.
    pub message: Option<Arc<str>>,
    /// Kinds of the devices online, only while `online`.
    pub kinds: Kinds,
    /// While offline: the last moment the server heard from one of the
    /// user's devices (its last packet, or the logout) while others were
    /// shown the user online; never when a grace period or a timeout ran
    /// out. Frozen at the moment they went invisible; a connection nobody was
    /// shown, because it ended or turned invisible within the debounce
    /// window, does not move it. `None` if never, and while online.
    pub last_seen: Option<Millis>,
    /// Only ever true in a user's view of themselves.
    pub invisible: bool,
}

impl Presence {
    /// Equal in everything a viewer sees, whatever the versions.
    pub fn same_view(&self, other: &Presence) -> bool {
        self.online == other.online
            && self.status == other.status
            && self.message == other.message
            && self.kinds == other.kinds
            && self.last_seen == other.last_seen
            && self.invisible == other.invisible
    }
}
