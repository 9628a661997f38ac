//! The checked worlds (bounds) and the deliberately broken protocols.

use super::*;

/// Deliberately broken variants of the protocol, one per property.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClusterMutant {
    /// An owner that failed to renew its claim keeps acting (C1).
    KeepOwningAfterLapse,
    /// A new owner publishes offline before its resync window closes (C2).
    NoResyncHold,
    /// Owners ignore the expiry of an edge's lease: its devices stay Online
    /// until the heartbeat timeout (C3).
    IgnoreEdgeLost,
    /// `SetInvisible` is acknowledged without writing the KV (C4).
    InvisibleInMemory,
    /// A new owner's versions restart from zero (C5).
    NoEpochInVersions,
    /// An owner acknowledges `SetInvisible` for a device it has no live
    /// session of (a new owner before the device's resync) without storing
    /// anything (C4; a hole the model found, see docs/cluster.md).
    AckWithoutSession,
    /// An edge takes an owner's `Ended` by connection id alone, which
    /// restarts with the process (C3; a hole the model found).
    EndedWithoutIncarnation,
    /// A restarted node renews its lease under the same key, value and
    /// owners keep its old incarnation's devices (C3; the hole the model
    /// found, see docs/cluster.md).
    NoIncarnation,
    /// Edges ignore the owner's beacons: a lost last view leaves the
    /// watcher stale until the next change (C5).
    NoBeacon,
    /// An owner answers a preference write that landed after it stopped
    /// acting for the epoch it wrote under (C4: the client is told
    /// "invisible" while the new owner, which read the KV before the write
    /// landed, shows her online; bug 1 of issue 30).
    AckAfterLostShard,
    /// An owner handles one device's logout by logging out every session of
    /// its user (the aggregate; only a world with two devices shows it).
    LogoutEndsUser,
    /// An owner that sees an edge's lease expire loses every session of a
    /// user with a device there, not only the devices that edge held (the
    /// aggregate, across edges).
    EdgeLostTakesUser,
    /// An edge that reads a resuming session's record answers `resumed`
    /// but does not subscribe it again: the client, told its
    /// subscriptions were carried over, waits for views that never come
    /// (C5, after bob resumes on another node).
    ResumeDropsSubscriptions,
}

impl ClusterMutant {
    pub const ALL: [ClusterMutant; 13] = [
        ClusterMutant::KeepOwningAfterLapse,
        ClusterMutant::NoResyncHold,
        ClusterMutant::IgnoreEdgeLost,
        ClusterMutant::InvisibleInMemory,
        ClusterMutant::NoEpochInVersions,
        ClusterMutant::NoIncarnation,
        ClusterMutant::AckWithoutSession,
        ClusterMutant::EndedWithoutIncarnation,
        ClusterMutant::NoBeacon,
        ClusterMutant::AckAfterLostShard,
        ClusterMutant::LogoutEndsUser,
        ClusterMutant::EdgeLostTakesUser,
        ClusterMutant::ResumeDropsSubscriptions,
    ];

    /// The CI bound it is checked at: the smallest that shows it.
    pub fn bound(self) -> (&'static str, ClusterBounds) {
        let name = match self {
            ClusterMutant::KeepOwningAfterLapse => "cut",
            ClusterMutant::NoIncarnation
            | ClusterMutant::IgnoreEdgeLost
            | ClusterMutant::EndedWithoutIncarnation => "edge",
            ClusterMutant::NoResyncHold | ClusterMutant::AckWithoutSession => "three",
            ClusterMutant::InvisibleInMemory | ClusterMutant::NoEpochInVersions => "crash",
            ClusterMutant::NoBeacon => "lossy",
            ClusterMutant::AckAfterLostShard => "slow",
            ClusterMutant::LogoutEndsUser => "two",
            ClusterMutant::EdgeLostTakesUser => "two-edge",
            ClusterMutant::ResumeDropsSubscriptions => "roam",
        };
        *ClusterBounds::CI
            .iter()
            .find(|(n, _)| *n == name)
            .expect("a CI bound")
    }

    /// The property that must catch it.
    pub fn property(self) -> &'static str {
        match self {
            ClusterMutant::KeepOwningAfterLapse => "C1 one writer",
            ClusterMutant::NoResyncHold => "C2 no false offline on failover",
            ClusterMutant::IgnoreEdgeLost
            | ClusterMutant::NoIncarnation
            | ClusterMutant::EndedWithoutIncarnation => "C3 bounded ghosts",
            ClusterMutant::InvisibleInMemory
            | ClusterMutant::AckWithoutSession
            | ClusterMutant::AckAfterLostShard => "C4 invisible survives failover",
            ClusterMutant::NoEpochInVersions
            | ClusterMutant::NoBeacon
            | ClusterMutant::ResumeDropsSubscriptions => "C5 convergence",
            ClusterMutant::LogoutEndsUser | ClusterMutant::EdgeLostTakesUser => AGGREGATE,
        }
    }
}

/// The size of the checked world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClusterBounds {
    /// 2 or 3.
    pub nodes: u8,
    /// Where alice's mobile first connects.
    pub alice_edge: u8,
    /// Alice also has a desktop, connected at the watcher's node (which
    /// never fails) for the whole run.
    pub desktop: bool,
    /// Alice's mobile logs out at this tick.
    pub logout_at: Option<u64>,
    /// Where bob's watching session first is (node 0 never fails; on
    /// another node, it may crash and bob resumes elsewhere).
    pub bob_edge: u8,
    /// Who holds the shard's claim at time 0 (epoch 1).
    pub first_owner: u8,
    pub crashes: u8,
    pub restarts: u8,
    /// Cut-offs from the KV (the node can still send and receive messages:
    /// the worst case for a zombie owner).
    pub cuts: u8,
    /// Messages the network may lose.
    pub drops: u8,
    /// Faults (crash, restart, cut) strike only this node, when set.
    pub faulty: Option<u8>,
    /// Preference writes the KV may hold past the next tick (slow writes).
    pub slow: u8,
    /// Invisibility toggles of alice (to invisible only), only at tick
    /// `invisible_at`.
    pub flips: u8,
    pub invisible_at: u64,
    /// Faults (crash, restart, cut, loss) happen at ticks up to this one.
    pub faults_until: u64,
    pub max_time: u64,
    /// Which of the "sometimes" properties this bound must reach.
    pub reaches: &'static [&'static str],
}

impl ClusterBounds {
    /// Two nodes: bob on 0; alice's edge and her shard's owner on 1, which
    /// crashes once and may restart (at ticks up to 3); alice may go
    /// invisible at tick 1; failover to node 0, where she reconnects (or to
    /// the restarted 1).
    pub const CRASH: ClusterBounds = ClusterBounds {
        nodes: 2,
        alice_edge: 1,
        desktop: false,
        logout_at: None,
        bob_edge: WATCHER_NODE,
        first_owner: 1,
        crashes: 1,
        restarts: 1,
        cuts: 0,
        drops: 0,
        faulty: None,
        slow: 0,
        flips: 1,
        invisible_at: 1,
        faults_until: 3,
        max_time: 8,
        reaches: &[FAILOVER, ONLINE, ONLINE_LATER, QUIET],
    };
    /// Two nodes: node 1 (alice's edge and owner) is cut off from the KV
    /// but still sends and receives: the zombie owner.
    pub const CUT: ClusterBounds = ClusterBounds {
        cuts: 1,
        crashes: 0,
        restarts: 0,
        reaches: &[FAILOVER, ONLINE, QUIET],
        ..ClusterBounds::CRASH
    };
    /// Two nodes: alice's edge (1) crashes under a live owner (0), and may
    /// restart (a new incarnation renews the same lease key) before its
    /// lease expires; long enough for C3's bound to pass.
    pub const EDGE: ClusterBounds = ClusterBounds {
        first_owner: 0,
        flips: 0,
        faults_until: 2,
        max_time: 2 + GHOST_BOUND,
        reaches: &[ONLINE, QUIET],
        ..ClusterBounds::CRASH
    };
    /// Three nodes: alice's edge and bob on 0, the owner on 2; 2 (or the
    /// bystander 1) crashes, and 1 takes the shard over from a distance:
    /// it hears of alice's device only through the resync. Alice may go
    /// invisible at tick 1.
    pub const THREE: ClusterBounds = ClusterBounds {
        nodes: 3,
        alice_edge: 0,
        first_owner: 2,
        restarts: 0,
        faults_until: 2,
        max_time: 5,
        ..ClusterBounds::CRASH
    };
    /// Two nodes, no crash: two messages may be lost, at ticks up to 2.
    pub const LOSSY: ClusterBounds = ClusterBounds {
        crashes: 0,
        restarts: 0,
        drops: 2,
        flips: 0,
        faults_until: 2,
        max_time: 5,
        reaches: &[ONLINE, QUIET],
        ..ClusterBounds::CRASH
    };
    /// Three nodes: alice's edge and bob on 0, the owner on 2. Alice goes
    /// invisible at tick 1 and the owner's write to the KV is slow; the
    /// owner (only it) is cut off from the KV, stops acting, and 1 takes the
    /// shard over, reading the KV, before or after the slow write lands.
    pub const SLOW: ClusterBounds = ClusterBounds {
        crashes: 0,
        cuts: 1,
        faulty: Some(2),
        slow: 1,
        faults_until: 2,
        max_time: 6,
        reaches: &[FAILOVER, ONLINE, STALE_WRITE],
        ..ClusterBounds::THREE
    };
    /// Two nodes, two devices: alice's desktop on 0 (with bob), her mobile
    /// on 1, the owner; the mobile may go invisible at tick 1 and logs out
    /// at tick 2, and node 1 may crash (at ticks up to 3: before, during or
    /// after the logout): node 0 takes the shard over and restores both
    /// devices' records. Bob must see her online throughout, unless she
    /// asked to be invisible.
    pub const TWO: ClusterBounds = ClusterBounds {
        desktop: true,
        logout_at: Some(2),
        restarts: 0,
        max_time: 7,
        reaches: &[FAILOVER, ONLINE, ONLINE_LATER, LOGGED_OUT, QUIET],
        ..ClusterBounds::CRASH
    };
    /// Two nodes, two devices: the owner is node 0 (bob, alice's desktop);
    /// the mobile's edge (1) crashes and may restart; the mobile comes back
    /// (and may go invisible at tick 1, log out at tick 3) or gives up. Bob
    /// must see her online throughout, unless she asked to be invisible.
    pub const TWO_EDGE: ClusterBounds = ClusterBounds {
        desktop: true,
        flips: 1,
        logout_at: Some(3),
        reaches: &[ONLINE, LOGGED_OUT, QUIET],
        ..ClusterBounds::EDGE
    };
    /// Two nodes: bob's session, alice's mobile and the owner on node 1,
    /// which crashes (at a tick ≤ 2) and may restart; node 0 takes the
    /// shard over; bob resumes his session on node 0 (or the restarted 1)
    /// from his session record, and alice comes back or is gone (shown
    /// offline); she may go invisible at tick 1. Bob's view must follow
    /// hers across the move (C1, C2, C5).
    pub const ROAM: ClusterBounds = ClusterBounds {
        bob_edge: 1,
        first_owner: 1,
        flips: 1,
        reaches: &[FAILOVER, ONLINE, ONLINE_LATER, RESUMED, QUIET],
        ..ClusterBounds::EDGE
    };
    pub const CI: [(&'static str, ClusterBounds); 9] = [
        ("crash", ClusterBounds::CRASH),
        ("cut", ClusterBounds::CUT),
        ("edge", ClusterBounds::EDGE),
        ("three", ClusterBounds::THREE),
        ("lossy", ClusterBounds::LOSSY),
        ("slow", ClusterBounds::SLOW),
        ("two", ClusterBounds::TWO),
        ("two-edge", ClusterBounds::TWO_EDGE),
        ("roam", ClusterBounds::ROAM),
    ];
}

/// The "sometimes" properties: situations a bound must reach, so a check
/// that passes is not vacuous.
pub const FAILOVER: &str = "failover happened";
pub const ONLINE: &str = "bob saw alice online";
pub const ONLINE_LATER: &str = "bob saw alice online at a later epoch";
pub const QUIET: &str = "converged and quiet";
pub const STALE_WRITE: &str = "a former owner's write in flight after failover";
pub const RESUMED: &str = "bob resumed on another node and saw alice go offline";
pub const LOGGED_OUT: &str = "alice's mobile logged out, her desktop keeps her online";

/// The property of the aggregate across the cluster: while alice's desktop
/// is connected, bob never sees her offline (unless she asked to be
/// invisible), whatever her mobile does: log out, lose its edge, move.
pub const AGGREGATE: &str = "no wrong aggregate across the cluster";
