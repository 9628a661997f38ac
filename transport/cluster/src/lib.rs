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
//!   [`OwnerInbox`] (requests to a shard's owner).
//!
//! Buckets (history 1, `replicas` each): `<prefix>_leases` (key: node id,
//! per-key TTL `lease_ttl`), `<prefix>_claims` (key: shard number, TTL
//! `claim_ttl`; value `<owner>@<epoch>`; `epoch.<shard>` counts the shard's
//! epochs),
//! `<prefix>_prefs` and `<prefix>_views` (key: escaped user id).
//!
//! What NATS 2.15 does (checked by `tests/live.rs`): a key written with
//! `Nats-TTL` disappears on its own and watchers get an expiry marker
//! (`Purge`); a write without `Nats-TTL` (what `async_nats`'s `Store::update`
//! sends) makes the key permanent, so renewals here always resend the TTL.

mod client;
mod config;
mod error;
mod hashing;
mod ids;
mod interest;
mod kv;
mod membership;
mod messaging;
mod ownership;
mod tenure;

#[doc(hidden)]
pub mod testing;

pub use client::{ClaimWatch, Cluster, MemberWatch, NodeLease};
pub use config::{ClusterConfig, ConfigError};
pub use error::{ClusterError, Result};
pub use hashing::{rendezvous_owner, shard_of};
pub use ids::{user_key, IdError, NodeId, ShardId, MAX_NODE_ID_LEN, MAX_USER_ID_LEN};
pub use interest::ShardInterest;
pub use kv::{KvEntry, KvOp};
pub use membership::{Member, MemberEvent, Membership};
pub use messaging::{OwnerInbox, OwnerRequest, RequestKind, ShardMessage, ViewFeed};
pub use ownership::{
    decode_claim, encode_claim, epoch_key, ClaimAction, ClaimRecord, ClaimState, ClaimTable,
    HeldShard, Ownership,
};
pub use tenure::{LeaseTiming, Tenure};
