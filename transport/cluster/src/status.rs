//! A read-only look at a running cluster (`greendot cluster status`): the
//! node leases and the shard claims, read from the stream leaders. Opens the
//! buckets without creating or changing them.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures_util::StreamExt;

use crate::error::{ClusterError, Result};
use crate::ids::{NodeId, ShardId};
use crate::kv::{read, KvEntry, KvOp};
use crate::node::NodeInfo;
use crate::ownership::{decode_claim, parse_shard_key, ClaimRecord, ClaimState};

/// One live node lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    pub node: NodeId,
    pub revision: u64,
    /// `None` when the lease value is not one a greendot node wrote.
    pub info: Option<NodeInfo>,
}

/// The cluster at one moment (each key read once; keys change meanwhile).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterView {
    pub nodes: Vec<NodeView>,
    /// Live claims by shard.
    pub claims: BTreeMap<ShardId, ClaimRecord>,
}

impl ClusterView {
    /// The shard count the live nodes run with (the largest, if they
    /// disagree, which a misconfigured cluster may).
    pub fn shard_count(&self) -> Option<u32> {
        self.nodes
            .iter()
            .filter_map(|n| n.info.as_ref().map(|i| i.shard_count))
            .max()
    }

    /// Live claims per owner.
    pub fn owned_by(&self) -> BTreeMap<&NodeId, Vec<(ShardId, u64)>> {
        let mut owned: BTreeMap<&NodeId, Vec<(ShardId, u64)>> = BTreeMap::new();
        for (shard, claim) in &self.claims {
            owned
                .entry(&claim.owner)
                .or_default()
                .push((*shard, claim.epoch));
        }
        owned
    }
}

/// Reads every live key of `store`, `IN_FLIGHT` reads at a time.
async fn entries(store: &kv::Store, timeout: Duration) -> Result<Vec<KvEntry>> {
    let bucket = || store.name.clone();
    let keys = async {
        let keys = store.keys().await.map_err(|source| ClusterError::Keys {
            bucket: bucket(),
            source,
        })?;
        keys.collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<std::result::Result<Vec<String>, _>>()
            .map_err(|source| ClusterError::Watcher {
                bucket: bucket(),
                source,
            })
    };
    let keys = tokio::time::timeout(timeout * 4, keys)
        .await
        .map_err(|_| ClusterError::TimedOut {
            op: "listing KV keys",
            after: timeout * 4,
        })??;
    let reads = futures_util::stream::iter(keys)
        .map(|key| async move { read(store, &key, timeout).await })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    let mut out = Vec::new();
    for r in reads {
        if let Some(e) = r? {
            if e.op == KvOp::Put {
                out.push(e);
            }
        }
    }
    Ok(out)
}

/// Connects to NATS (`urls` comma-separated) and reads the cluster under
/// `prefix`. Fails with `Connect` when no NATS node answers and `NoBuckets`
/// when no greendot node ever ran there. `access`: the credentials and TLS
/// of the connection, as the nodes'.
pub async fn observe(
    urls: &str,
    access: &crate::access::NatsAccess,
    prefix: &str,
    timeout: Duration,
) -> Result<ClusterView> {
    let servers: Vec<&str> = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let options = async_nats::ConnectOptions::new()
        .name("greendot-cluster-status")
        .connection_timeout(timeout)
        .request_timeout(Some(timeout));
    let options = access
        .apply(options)
        .await
        .map_err(|source| ClusterError::Credentials { source })?;
    let client = async_nats::connect_with_options(servers, options)
        .await
        .map_err(|source| ClusterError::Connect {
            urls: urls.to_owned(),
            source,
        })?;
    let mut js = jetstream::new(client);
    js.set_timeout(timeout);
    let open = |kind: &str| {
        let bucket = format!("{prefix}_{kind}");
        let js = js.clone();
        async move {
            js.get_key_value(&bucket)
                .await
                .map_err(|source| ClusterError::NoBuckets { bucket, source })
        }
    };
    let leases = open("leases").await?;
    let claims = open("claims").await?;
    let mut nodes = Vec::new();
    for e in entries(&leases, timeout).await? {
        let Ok(node) = NodeId::new(e.key.as_str()) else {
            continue;
        };
        nodes.push(NodeView {
            node,
            revision: e.revision,
            info: NodeInfo::decode(&e.value),
        });
    }
    nodes.sort_by(|a, b| a.node.cmp(&b.node));
    let mut table = BTreeMap::new();
    for e in entries(&claims, timeout).await? {
        let Some(shard) = parse_shard_key(&e.key, u32::MAX) else {
            continue;
        };
        if let Some(ClaimState::Held(record)) = decode_claim(&e) {
            table.insert(shard, record);
        }
    }
    Ok(ClusterView {
        nodes,
        claims: table,
    })
}
