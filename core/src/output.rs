//! What the core asks its driver to do, drained with `Core::poll_output()`.

use crate::types::{Presence, SessionId, Tier, UserId};

/// One thing for the driver to do.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Output {
    /// Tell session `to` that `target` is now shown as `presence`.
    Push {
        to: SessionId,
        target: UserId,
        tier: Tier,
        presence: Presence,
    },
    /// The session is over; close its connection if it still has one. Nothing
    /// more will be pushed to it and inputs naming it are `Stale`.
    SessionEnded {
        session: SessionId,
        reason: EndReason,
    },
}

/// Why a session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EndReason {
    /// The device connected again; the new session replaces this one.
    Superseded,
    /// Graceful logout.
    LoggedOut,
    /// Online but silent past the heartbeat timeout: a reaped ghost.
    HeartbeatTimeout,
    /// Lost and not back within grace.
    GraceExpired,
}
