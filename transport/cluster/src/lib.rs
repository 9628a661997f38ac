//! greendot's cluster layer on NATS JetStream (DESIGN.md "Cluster (many
//! nodes)"). greendot implements no membership or consensus of its own: the
//! NATS KV does it. This crate gives the engine-facing pieces:
//!
//! - **decisions**, pure over explicit instants and KV entries: placement
//!   ([`shard_of`], [`rendezvous_owner`]), deadlines ([`Tenure`]), the live
//!   set ([`Membership`]), claims and the plan of what to claim, renew or
//!   release ([`Ownership`], [`ClaimTable`]), per-shard interest
//!   ([`ShardInterest`]);
//! - **I/O**, thin around them: [`Cluster`] (leases, claims, preferences,
//!   last views, watches), [`ViewFeed`] (per-shard published views) and
//!   [`OwnerInbox`] (requests to a shard's owner);
//! - **a node's duties** ([`Node`]): the task that holds the node lease and
//!   claims, renews and releases shards, publishing [`NodeStatus`] on a
//!   watch channel; and [`observe`], the read-only look of `greendot cluster
//!   status`.
//!
//! Buckets (history 1, `replicas` each): `<prefix>_leases` (key: node id,
//! per-key TTL `lease_ttl`), `<prefix>_claims` (key: shard number, TTL
//! `claim_ttl`; value `<owner>@<epoch>`; `epoch.<shard>` counts the shard's
//! epochs),
//! `<prefix>_prefs` and `<prefix>_views` (key: escaped user id),
//! `<prefix>_sessions` (key: escaped user id `.` escaped device id; every
//! record dropped [`SESSION_RECORD_MAX_AGE`] after its last write),
//! `<prefix>_groups` (group definitions, opened on first use and not
//! wired into the server yet: see `groups`).
//!
//! What nats-server 2.15.1 with `async-nats` 0.51 does (checked live by
//! `tests/live.rs` on a 3-node cluster, R3 buckets):
//! - a key written with `Nats-TTL` disappears on its own, and a watch then
//!   yields an expiry marker (`Purge`); with a 2 s TTL the marker arrived
//!   2.00 s after the last renewal returned. TTLs are whole seconds (≥ 1 s);
//! - a write without `Nats-TTL` (what `Store::update` sends) makes the key
//!   permanent: the TTL belongs to each message, so renewals here resend it
//!   (test `a_plain_kv_update_drops_the_per_key_ttl`). `create_with_ttl` on
//!   a deleted or expired key also writes without the TTL; `acquire_lease`
//!   and `claim_shard` write with it;
//! - a failed compare-and-set comes back as JetStream error 10164, which
//!   `async-nats` reports as `Other`, not `WrongLastSequence`: recognised
//!   here (`ClusterError::Conflict`);
//! - `kill -9` of the node leading a bucket's stream: writes to that bucket
//!   fail until a new leader is elected, 4.4–8.2 s here; data written before
//!   stays (R3), and the restarted node catches up. A watch whose consumer
//!   lived on the killed node stalls until `async-nats` recreates it.

mod access;
mod client;
mod config;
mod envelope;
mod error;
mod group_store;
mod groups;
mod hashing;
mod ids;
mod interest;
mod kv;
mod membership;
mod messaging;
mod node;
mod ownership;
mod status;
mod tenure;

#[doc(hidden)]
pub mod testing;

pub use access::{NatsAccess, NatsCredentials, Secret};
pub use client::{unfenced, ClaimWatch, Cluster, MemberWatch, NodeLease, SESSION_RECORD_MAX_AGE};
pub use config::{ClusterConfig, ConfigError};
pub use envelope::{DropCounts, DropReason, Envelope, MessageKey, PROTOCOL_VERSION};
pub use error::{chain, ClusterError, Result};
pub use group_store::{GroupEvent, GroupWatch};
pub use groups::{
    check_def, GroupDef, GroupDefect, GroupLimitError, GroupLimits, MAX_GROUP_CHUNKS,
    MAX_GROUP_CHUNK_BYTES,
};
pub use hashing::{rendezvous_owner, shard_of};
pub use ids::{device_key, user_key, IdError, NodeId, ShardId, MAX_NODE_ID_LEN, MAX_USER_ID_LEN};
pub use interest::ShardInterest;
pub use kv::{KvEntry, KvOp};
pub use membership::{Member, MemberEvent, Membership};
pub use messaging::{OwnerInbox, OwnerRequest, RequestKind, ShardMessage, SubjectFeed, ViewFeed};
pub use node::{
    unix_ms, Node, NodeExit, NodeInfo, NodePhase, NodeStatus, OwnedShard, MAX_ADVERTISE_LEN,
};
pub use ownership::{
    decode_claim, encode_claim, epoch_key, next_epoch, ClaimAction, ClaimRecord, ClaimState,
    ClaimTable, HeldShard, Ownership, MAX_EPOCH,
};
pub use status::{observe, ClusterView, NodeView};
pub use tenure::{LeaseTiming, Tenure};
