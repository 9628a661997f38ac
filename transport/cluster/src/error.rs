//! Typed errors of the cluster layer; NATS's own error is kept as the source.

use std::time::Duration;

use crate::config::ConfigError;
use crate::ids::{IdError, NodeId, ShardId};

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("invalid cluster configuration")]
    Config(#[from] ConfigError),
    #[error("shard {shard} does not exist (shard_count {shard_count})")]
    NoSuchShard { shard: ShardId, shard_count: u32 },
    #[error("invalid id")]
    Id(#[from] IdError),
    #[error("connecting to NATS at {urls}")]
    Connect {
        urls: String,
        #[source]
        source: async_nats::ConnectError,
    },
    #[error("shard {shard}'s epoch is {epoch}, the last whose versions fit (2^24 - 1): claiming it again would wrap versions")]
    EpochExhausted { shard: ShardId, epoch: u64 },
    #[error("NATS credentials")]
    Credentials {
        #[source]
        source: std::io::Error,
    },
    /// An owner's answer that is not a sealed message of this cluster
    /// (counted in `greendot_cluster_rejected_total`).
    #[error("the answer to {subject} was dropped: {reason}")]
    Dropped {
        subject: String,
        reason: &'static str,
    },
    #[error("creating or opening KV bucket {bucket}")]
    Bucket {
        bucket: String,
        #[source]
        source: async_nats::jetstream::context::CreateKeyValueError,
    },
    /// A compare-and-set found another revision: someone else wrote the key.
    #[error("{bucket}/{key} changed since revision {expected}")]
    Conflict {
        bucket: String,
        key: String,
        expected: u64,
    },
    /// A fenced write found a record of a newer owner's epoch: the writer
    /// no longer owns the key's shard.
    #[error("{bucket}/{key} was written under epoch {newer}, newer than the writer's {epoch}")]
    Fenced {
        bucket: String,
        key: String,
        epoch: u64,
        newer: u64,
    },
    #[error("node {node} already holds a live lease (another process with this id, or this node's previous run whose lease has not expired yet)")]
    LeaseHeld { node: NodeId },
    #[error("shard {shard} is held by {owner} (epoch {epoch})")]
    ShardHeld {
        shard: ShardId,
        owner: NodeId,
        epoch: u64,
    },
    #[error("writing {bucket}/{key}")]
    Write {
        bucket: String,
        key: String,
        #[source]
        source: async_nats::jetstream::context::PublishError,
    },
    #[error("deleting {bucket}/{key}")]
    Delete {
        bucket: String,
        key: String,
        #[source]
        source: async_nats::jetstream::kv::DeleteError,
    },
    #[error("reading {bucket}/{key}")]
    Read {
        bucket: String,
        key: String,
        #[source]
        source: async_nats::jetstream::stream::LastRawMessageError,
    },
    #[error("{bucket}/{key} holds a value greendot did not write")]
    Corrupt { bucket: String, key: String },
    #[error("watching {bucket}")]
    Watch {
        bucket: String,
        #[source]
        source: async_nats::jetstream::kv::WatchError,
    },
    #[error("watch of {bucket} broke")]
    Watcher {
        bucket: String,
        #[source]
        source: async_nats::jetstream::kv::WatcherError,
    },
    #[error("{op} timed out after {after:?}")]
    TimedOut { op: &'static str, after: Duration },
    #[error("publishing on {subject}")]
    Publish {
        subject: String,
        #[source]
        source: async_nats::PublishError,
    },
    #[error("subscribing to {subject}")]
    Subscribe {
        subject: String,
        #[source]
        source: async_nats::SubscribeError,
    },
    #[error("flushing the NATS connection")]
    Flush {
        #[source]
        source: async_nats::client::FlushError,
    },
    /// The client is not connected to NATS (it is making the connection
    /// again): nothing is handed to it, because it would queue it and send
    /// it after the reconnect, when its asker has given up on it.
    #[error("{op} not sent: the NATS connection is down")]
    Reconnecting { op: &'static str },
    /// Nobody serves the shard right now (no owner, or it is changing):
    /// retry once the claims settle.
    #[error("no owner answers for shard {shard}")]
    NoOwner { shard: ShardId },
    #[error("listing the keys of {bucket}")]
    Keys {
        bucket: String,
        #[source]
        source: async_nats::jetstream::kv::HistoryError,
    },
    #[error("no greendot cluster on this NATS: KV bucket {bucket} does not exist (no node ever ran with this prefix)")]
    NoBuckets {
        bucket: String,
        #[source]
        source: async_nats::jetstream::context::KeyValueError,
    },
    /// A group definition over the limits or against its rules: refused
    /// before anything is stored.
    #[error("group {group} refused: {reason}")]
    GroupRefused {
        group: u64,
        #[source]
        reason: crate::groups::GroupLimitError,
    },
    /// A stored group definition that does not open (forged header,
    /// chunks that do not match, over the limits).
    #[error("{bucket}/{key}: {reason}")]
    GroupCorrupt {
        bucket: String,
        key: String,
        #[source]
        reason: crate::groups::GroupDefect,
    },
    #[error("purging {subject} from {bucket}")]
    Purge {
        bucket: String,
        subject: String,
        #[source]
        source: async_nats::jetstream::stream::PurgeError,
    },
    /// The groups bucket's watch could not start, or broke.
    #[error("watching {bucket}")]
    GroupWatch {
        bucket: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("request to {subject}")]
    Request {
        subject: String,
        #[source]
        source: async_nats::RequestError,
    },
}

impl ClusterError {
    /// Whether trying again cannot help: the settings are wrong (NATS
    /// refuses the credentials, the TLS files or handshake, the cluster
    /// settings, the credentials files) rather than NATS being away.
    pub fn is_permanent(&self) -> bool {
        use async_nats::ConnectErrorKind;
        match self {
            ClusterError::Config(_) | ClusterError::Corrupt { .. } => true,
            ClusterError::Credentials { .. } => true,
            ClusterError::Connect { source, .. } => matches!(
                source.kind(),
                ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Tls
            ),
            _ => false,
        }
    }
}

pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// An error and its sources, on one line: what a log needs to say why
/// (a `Read` error's own text names only the key).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
