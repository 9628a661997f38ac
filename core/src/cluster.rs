//! The cluster's nouns: shards, nodes, epochs in versions, the messages that
//! travel between nodes, and what an owner core hands its driver to publish.
//!
//! Pure like the rest of the core: the NATS runtime moves these messages and
//! KV entries; docs/cluster.md says which subject and which bucket each uses.
//! The owner's side lives in [`Core`](crate::Core) (`enter_epoch`,
//! `set_publish_views`, `poll_published`, `restore_owned`,
//! `hold_offline_until`, `handle_edge_lost`); the edge's side is
//! [`Fanout`](crate::Fanout).

use crate::engine::Saved;
use crate::types::{DeviceId, DeviceKind, Millis, Presence, SessionId, Status, Tier, UserId};
use serde::{Deserialize, Serialize};

/// Versions carry the owner's epoch above this many low bits: every version a
/// new owner issues is above every version an older owner of the shard could
/// have issued (2^40 changes of one user within one ownership is out of reach:
/// 35,000 years at one change per millisecond).
pub const EPOCH_SHIFT: u32 = 40;

/// The first version of `epoch`: a new owner's core starts every user at or
/// above it ([`Core::enter_epoch`](crate::Core::enter_epoch)).
pub const fn epoch_base(epoch: Epoch) -> u64 {
    (epoch.0 as u64) << EPOCH_SHIFT
}

/// The epoch a version was issued under.
pub const fn epoch_of(version: u64) -> Epoch {
    Epoch((version >> EPOCH_SHIFT) as u32)
}

/// A shard: a fixed slice of the users (`user → shard` never changes while a
/// cluster runs with the same shard count).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ShardId(pub u32);

/// A greendot node of the cluster (every node is an edge and an owner).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u32);

/// One ownership of a shard. Epochs of a shard only grow: a claimer bumps the
/// shard's epoch counter (a KV key without TTL, compare-and-set) before it
/// acts, so an epoch is never reused even after the claim key expired.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Epoch(pub u32);

/// A 64-bit mix (splitmix64's finaliser): stable across platforms and
/// releases, so every node computes the same shard and owner.
pub const fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The shard of `user` among `shards` (at least 1).
pub fn shard_of(user: UserId, shards: u32) -> ShardId {
    ShardId((mix(user.0) % u64::from(shards.max(1))) as u32)
}

/// The preferred owner of `shard` among the nodes with a live lease:
/// rendezvous (highest random weight) hashing, so a node joining or leaving
/// moves only the shards it wins or held. `None` without nodes.
pub fn owner_of(shard: ShardId, nodes: &[NodeId]) -> Option<NodeId> {
    nodes
        .iter()
        .copied()
        .max_by_key(|n| (mix(mix(u64::from(shard.0)) ^ u64::from(n.0)), *n))
}

/// What the new owner of a shard loads of one user from the KV to restore it
/// ([`Core::restore_owned`](crate::Core::restore_owned)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OwnedRecord {
    /// Preferences and last seen (bucket `gd_prefs`, written before the ack).
    pub status: Status,
    pub message: Option<String>,
    pub invisible: bool,
    pub last_seen: Option<Millis>,
    /// The last view the old owner published (bucket `gd_views`, written
    /// behind the publish). Default if none was written.
    pub published: Presence,
    /// The user's devices as the old owner last wrote them (bucket
    /// `gd_devices`, written behind): restored as Lingering.
    pub devices: Vec<DeviceRecord>,
    /// The highest version of the user this owner published before it
    /// released them, in this epoch (0: none). The view in the KV is written
    /// behind and may be older (a write lost in an outage, or landed before
    /// an older one): if `published` is below this, watchers were shown
    /// newer, so it is published again above it.
    pub shown_before: u64,
}

impl OwnedRecord {
    pub fn saved(&self) -> Saved {
        Saved {
            status: self.status,
            message: self.message.as_deref().map(Into::into),
            invisible: self.invisible,
            last_seen: self.last_seen,
        }
    }
}

/// A device as recorded in the KV by its owner.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceRecord {
    pub device: DeviceId,
    pub kind: DeviceKind,
    /// The edge holding its connection.
    pub edge: NodeId,
    /// When it was last heard from (as the owner last knew).
    pub last_heard: Millis,
    /// Its app was in the foreground (I12): a backgrounded device is
    /// restored backgrounded, so it does not show its user present.
    pub foreground: bool,
}

/// What an owner core hands its driver to publish, drained with
/// [`Core::poll_published`](crate::Core::poll_published) once
/// [`Core::set_publish_views`](crate::Core::set_publish_views) is on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Published {
    pub user: UserId,
    /// `false`: the view others see (debounced; published once per change).
    /// `true`: the truth, for the user's own sessions (including invisible).
    pub own: bool,
    pub presence: Presence,
}

/// A device input an edge forwards to the owner of the device's user
/// (request/reply on the owner's subject; see docs/cluster.md).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceOp {
    /// `resume` names the owner-side session of the device, of any epoch; a
    /// session of an older epoch is unknown to the new owner, which is fine:
    /// a Lingering device reconnecting is unseen whatever the resume says.
    Connect {
        kind: DeviceKind,
        resume: Option<SessionId>,
    },
    /// Signs of life since the last forward (batched by the edge).
    Heard {
        at: Millis,
    },
    Disconnect {
        last_heard: Millis,
    },
    Logout,
    SetStatus {
        status: Status,
        message: Option<String>,
    },
    SetInvisible(bool),
}

/// Edge → owner.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ToOwner {
    Device {
        user: UserId,
        device: DeviceId,
        edge: NodeId,
        op: DeviceOp,
    },
    /// A snapshot of `target` for a subscribe at the edge.
    Snapshot { target: UserId, own: bool },
    /// The edge's answer to [`FromOwner::Resync`]: every live device of the
    /// shard's users it holds, and the shard's users its sessions watch.
    Resynced {
        shard: ShardId,
        epoch: Epoch,
        edge: NodeId,
        devices: Vec<(UserId, DeviceId, DeviceKind)>,
        watched: Vec<UserId>,
    },
}

/// Owner → edge (replies), or owner → every edge (published on the shard's
/// subject).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FromOwner {
    /// The answer to a `ToOwner::Device` (after the KV write for preferences).
    Done {
        session: Option<SessionId>,
        epoch: Epoch,
    },
    /// A refusal: this node does not own the shard (any more); the edge looks
    /// the owner up again and retries.
    NotOwner {
        shard: ShardId,
    },
    Snapshot {
        target: UserId,
        presence: Presence,
    },
    /// On `gd.shard.<n>`: a published view (`own == false`) or a truth.
    View {
        shard: ShardId,
        user: UserId,
        own: bool,
        presence: Presence,
    },
    /// On `gd.shard.<n>`: a new owner asks every edge to resend.
    Resync {
        shard: ShardId,
        epoch: Epoch,
    },
}

/// A subscription an edge holds for one of its sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EdgeSub {
    pub target: UserId,
    pub tier: Tier,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_order_versions() {
        let old = epoch_base(Epoch(3)) + 1_000_000;
        let new = epoch_base(Epoch(4)) + 1;
        assert!(new > old);
        assert_eq!(epoch_of(old), Epoch(3));
        assert_eq!(epoch_of(new), Epoch(4));
        assert_eq!(epoch_base(Epoch(0)), 0);
    }

    #[test]
    fn rendezvous_moves_only_the_leaving_nodes_shards() {
        let all = [NodeId(1), NodeId(2), NodeId(3)];
        let without_2 = [NodeId(1), NodeId(3)];
        let mut moved = 0;
        for s in 0..4096 {
            let shard = ShardId(s);
            let before = owner_of(shard, &all).unwrap();
            let after = owner_of(shard, &without_2).unwrap();
            if before != NodeId(2) {
                assert_eq!(before, after, "shard {s} moved though its owner stayed");
            } else {
                moved += 1;
            }
        }
        // Roughly a third each.
        assert!((1000..1800).contains(&moved), "{moved}");
        assert_eq!(owner_of(ShardId(0), &[]), None);
        assert!(shard_of(UserId(42), 4096).0 < 4096);
    }
}
