//! The cluster layer's settings, checked once (`ClusterConfig::validate`).

use std::time::Duration;

use crate::ids::NodeId;
use crate::tenure::LeaseTiming;

/// Settings of one node's cluster layer. Every node of a cluster must use the
/// same `prefix`, `shard_count` and TTLs.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub node: NodeId,
    /// Prefix of bucket names (`<prefix>_leases`, …) and subjects
    /// (`<prefix>.shard.<shard>`, …): `[A-Za-z0-9_-]+`.
    pub prefix: String,
    /// Replicas of every bucket (3 on a 3-node NATS cluster; 1 on one node).
    pub replicas: usize,
    pub shard_count: u32,
    /// TTL of a node lease. NATS counts per-key TTLs in whole seconds
    /// (`Nats-TTL`), at least 1 s.
    pub lease_ttl: Duration,
    /// TTL of a shard claim: whole seconds, at most `lease_ttl` so that a
    /// node cut off from NATS stops owning before it closes its clients.
    pub claim_ttl: Duration,
    /// Safety margin before a lease's or claim's earliest expiry.
    pub margin: Duration,
    /// How long an expiry marker stays in the KV (whole seconds, ≥ 1).
    pub marker_ttl: Duration,
    /// Timeout of one KV operation or request.
    pub op_timeout: Duration,
    /// Capacity of the channels from NATS subscriptions to the node.
    pub channel_capacity: usize,
    /// Credentials and TLS of the connection to NATS.
    pub nats: crate::access::NatsAccess,
    /// How large a group definition in the groups bucket may be.
    pub groups: crate::groups::GroupLimits,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("prefix must be 1..=32 characters of [A-Za-z0-9_-], got {0:?}")]
    BadPrefix(String),
    #[error("replicas must be 1..=5, got {0}")]
    BadReplicas(usize),
    #[error("shard_count must be 1..=65536, got {0}")]
    BadShardCount(u32),
    #[error("{name} must be a whole number of seconds, at least 1 s (NATS per-key TTLs are in seconds), got {value:?}")]
    NotWholeSeconds { name: &'static str, value: Duration },
    #[error("claim_ttl ({claim:?}) must not exceed lease_ttl ({lease:?})")]
    ClaimOutlivesLease { claim: Duration, lease: Duration },
    #[error(
        "margin ({margin:?}) must be more than zero and less than half of claim_ttl ({claim:?})"
    )]
    BadMargin { margin: Duration, claim: Duration },
    #[error("op_timeout ({op:?}) must be more than zero and at most a third of the act window ({window:?}), so a renewal can time out and be retried before the holder must stop")]
    BadOpTimeout { op: Duration, window: Duration },
    #[error("channel_capacity must be 1..=1048576, got {0}")]
    BadChannelCapacity(usize),
    #[error(
        "groups.max_members {0} does not fit in the groups bucket's chunks at the longest names"
    )]
    BadGroupLimits(u32),
}

impl ClusterConfig {
    /// Production defaults: 4096 shards, R3, leases and claims of 15 s with
    /// a 3 s margin: the 12 s a holder may act without a successful renewal
    /// outlast a JetStream stream's leader election after its leader dies
    /// (raft election timeouts 4–9 s; writes resumed 4.4–8.2 s after a
    /// `kill -9` here), so losing one NATS node stops no owner.
    pub fn new(node: NodeId) -> ClusterConfig {
        ClusterConfig {
            node,
            prefix: "gd".into(),
            replicas: 3,
            shard_count: 4096,
            lease_ttl: Duration::from_secs(15),
            claim_ttl: Duration::from_secs(15),
            margin: Duration::from_secs(3),
            marker_ttl: Duration::from_secs(15),
            op_timeout: Duration::from_secs(2),
            channel_capacity: 4096,
            nats: crate::access::NatsAccess::default(),
            groups: crate::groups::GroupLimits::default(),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let prefix_ok = !self.prefix.is_empty()
            && self.prefix.len() <= 32
            && self
                .prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !prefix_ok {
            return Err(ConfigError::BadPrefix(self.prefix.clone()));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(ConfigError::BadReplicas(self.replicas));
        }
        if !(1..=65536).contains(&self.shard_count) {
            return Err(ConfigError::BadShardCount(self.shard_count));
        }
        for (name, value) in [
            ("lease_ttl", self.lease_ttl),
            ("claim_ttl", self.claim_ttl),
            ("marker_ttl", self.marker_ttl),
        ] {
            if value < Duration::from_secs(1) || value.subsec_nanos() != 0 {
                return Err(ConfigError::NotWholeSeconds { name, value });
            }
        }
        if self.claim_ttl > self.lease_ttl {
            return Err(ConfigError::ClaimOutlivesLease {
                claim: self.claim_ttl,
                lease: self.lease_ttl,
            });
        }
        if self.margin.is_zero() || self.margin >= self.claim_ttl / 2 {
            return Err(ConfigError::BadMargin {
                margin: self.margin,
                claim: self.claim_ttl,
            });
        }
        let window = self.claim_timing().act_window();
        if self.op_timeout.is_zero() || self.op_timeout > window / 3 {
            return Err(ConfigError::BadOpTimeout {
                op: self.op_timeout,
                window,
            });
        }
        if !(1..=1 << 20).contains(&self.channel_capacity) {
            return Err(ConfigError::BadChannelCapacity(self.channel_capacity));
        }
        if !self.groups.fit_in_chunks() {
            return Err(ConfigError::BadGroupLimits(self.groups.max_members));
        }
        Ok(())
    }

    pub fn lease_timing(&self) -> LeaseTiming {
        LeaseTiming {
            ttl: self.lease_ttl,
            margin: self.margin,
        }
    }

    pub fn claim_timing(&self) -> LeaseTiming {
        LeaseTiming {
            ttl: self.claim_ttl,
            margin: self.margin,
        }
    }

    pub fn bucket(&self, kind: &str) -> String {
        format!("{}_{kind}", self.prefix)
    }

    /// Where new owners ask every edge to resend a shard's devices.
    pub fn resync_subject(&self) -> String {
        format!("{}.resync", self.prefix)
    }

    /// Where owners announce the latest view number of their shards.
    pub fn beacon_subject(&self) -> String {
        format!("{}.beacon", self.prefix)
    }

    /// Where the owners of groups' home shards publish the groups' counts
    /// (every node listens).
    pub fn group_counts_subject(&self) -> String {
        format!("{}.groups", self.prefix)
    }

    /// Where owners send the truths of users with devices at `node`'s edge
    /// (the view others see goes on the shard's subject).
    pub fn edge_subject(&self, node: &crate::NodeId) -> String {
        format!("{}.edge.{}", self.prefix, node.as_str())
    }

    pub fn view_subject(&self, shard: crate::ShardId) -> String {
        format!("{}.shard.{}", self.prefix, shard.0)
    }

    pub fn request_subject(&self, shard: crate::ShardId, kind: crate::RequestKind) -> String {
        format!("{}.req.{}.{}", self.prefix, shard.0, kind.token())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ClusterConfig {
        ClusterConfig::new(NodeId::new("n1").unwrap())
    }

    #[test]
    fn defaults_are_valid() {
        config().validate().unwrap();
    }

    #[test]
    fn bad_settings_are_refused() {
        let mut c = config();
        c.lease_ttl = Duration::from_millis(1500);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::NotWholeSeconds {
                name: "lease_ttl",
                ..
            })
        ));
        let mut c = config();
        c.claim_ttl = c.lease_ttl + Duration::from_secs(1);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::ClaimOutlivesLease { .. })
        ));
        let mut c = config();
        c.margin = c.claim_ttl / 2;
        assert!(matches!(c.validate(), Err(ConfigError::BadMargin { .. })));
        let mut c = config();
        c.op_timeout = c.claim_timing().act_window() / 3 + Duration::from_millis(1);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::BadOpTimeout { .. })
        ));
        let mut c = config();
        c.prefix = "a.b".into();
        assert!(matches!(c.validate(), Err(ConfigError::BadPrefix(_))));
        let mut c = config();
        c.groups.max_members = 1_000_000;
        assert!(matches!(c.validate(), Err(ConfigError::BadGroupLimits(_))));
        let mut c = config();
        c.shard_count = 0;
        assert!(matches!(c.validate(), Err(ConfigError::BadShardCount(0))));
    }
}
