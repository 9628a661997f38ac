//! Deliberately broken variants of the core (feature `mutants`), so that the
//! model checker and the property tests can show they catch each bug.

/// One bug to switch on with `Core::set_mutant`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mutant {
    /// An input naming a superseded session acts on the device's current one.
    IgnoreStale,
    /// Visible changes are published at once, with no debounce.
    NoDebounce,
    /// Others see invisible users as they really are.
    InvisibleIgnored,
    /// Logout leaves the session lingering, like a lost connection.
    LogoutAsDisconnect,
    /// A publish goes out under the previous published version.
    VersionNotBumped,
    /// A logged-out session stays in its targets' subscriber lists.
    KeepSubsAfterLogout,
    /// Last seen reads the moment the user stopped being shown (the end of
    /// grace, the heartbeat timeout) instead of when a device was last heard.
    LastSeenAtExpiry,
    /// A backgrounded device still counts as present: its user stays shown
    /// online and it stays routable (I12).
    BackgroundCounted,
}

impl Mutant {
    pub const ALL: [Mutant; 8] = [
        Mutant::IgnoreStale,
        Mutant::NoDebounce,
        Mutant::InvisibleIgnored,
        Mutant::LogoutAsDisconnect,
        Mutant::VersionNotBumped,
        Mutant::KeepSubsAfterLogout,
        Mutant::LastSeenAtExpiry,
        Mutant::BackgroundCounted,
    ];
}

/// One bug of group presence to switch on with `Core::set_group_mutant`
/// (kept apart from `Mutant`, whose models have no groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupMutant {
    /// A member going offline leaves the count as it was (G2).
    CountMissesOffline,
    /// A membership write that changes the count never schedules a flush,
    /// so members keep the old count (G1).
    MembershipNotFlushed,
    /// A member's change is pushed to admins under the previous version (G3).
    VersionNotBumped,
    /// An admin demoted to member keeps getting member deltas (G4).
    AdminKeptAfterDemotion,
    /// An ended session keeps its group subscriptions (G4).
    SubsKeptAfterEnd,
    /// A page watch that runs out is kept, and its deltas go on (G5).
    WatchOutlivesExpiry,
    /// A fed count is taken whatever its version, so a late or repeated
    /// one sends versions back (G3; `tests/group_fed.rs`).
    FedOlderCountTaken,
    /// A fed member change goes to the members' sessions too, not only to
    /// the admins' (G4; `tests/group_fed.rs`, and the multi-node
    /// simulator's groups).
    DeltasToMembers,
}

impl GroupMutant {
    pub const ALL: [GroupMutant; 8] = [
        GroupMutant::CountMissesOffline,
        GroupMutant::MembershipNotFlushed,
        GroupMutant::VersionNotBumped,
        GroupMutant::AdminKeptAfterDemotion,
        GroupMutant::SubsKeptAfterEnd,
        GroupMutant::WatchOutlivesExpiry,
        GroupMutant::FedOlderCountTaken,
        GroupMutant::DeltasToMembers,
    ];
}
