//! Per-shard subjects: the views an owner publishes (`<prefix>.shard.<shard>`)
//! and the requests to a shard's owner (`<prefix>.req.<shard>.<kind>`). A
//! node holds at most one subscription per shard for each, never one per
//! user or per watcher (NATS interest costs about 1 KB per subscription on
//! every NATS node).

use std::collections::HashSet;

use async_nats::{Client, Subject, Subscriber};
use bytes::Bytes;
use tokio_stream::{StreamExt, StreamMap};

use crate::config::ClusterConfig;
use crate::envelope::Envelope;
use crate::error::{ClusterError, Result};
use crate::ids::ShardId;
use crate::interest::ShardInterest;

pub(crate) fn check_shard(config: &ClusterConfig, shard: ShardId) -> Result<()> {
    if shard.0 < config.shard_count {
        Ok(())
    } else {
        Err(ClusterError::NoSuchShard {
            shard,
            shard_count: config.shard_count,
        })
    }
}

/// What an edge asks a shard's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// A device's input, forwarded by the edge holding its connection.
    Input,
    /// The current view of users, for a new subscription.
    Snapshot,
}

impl RequestKind {
    pub fn token(self) -> &'static str {
        match self {
            RequestKind::Input => "input",
            RequestKind::Snapshot => "snapshot",
        }
    }

    fn from_token(token: &str) -> Option<RequestKind> {
        match token {
            "input" => Some(RequestKind::Input),
            "snapshot" => Some(RequestKind::Snapshot),
            _ => None,
        }
    }
}

/// A published view received for a watched shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMessage {
    pub shard: ShardId,
    pub payload: Bytes,
}

/// The views of the shards this node's sessions watch. `watch`/`unwatch`
/// count local watchers; the subscription exists while the count is above 0.
pub struct ViewFeed {
    client: Client,
    config: ClusterConfig,
    envelope: Envelope,
    interest: ShardInterest,
    subscriptions: StreamMap<ShardId, Subscriber>,
}

impl ViewFeed {
    pub(crate) fn new(client: Client, config: ClusterConfig, envelope: Envelope) -> ViewFeed {
        ViewFeed {
            client,
            config,
            envelope,
            interest: ShardInterest::default(),
            subscriptions: StreamMap::new(),
        }
    }

    /// One more local watcher of `shard`: subscribes if it is the first.
    /// Call `Cluster::flush` after a batch of `watch` for the NATS server to
    /// have the interest.
    pub async fn watch(&mut self, shard: ShardId) -> Result<()> {
        check_shard(&self.config, shard)?;
        if self.interest.add(shard) {
            let subject = self.config.view_subject(shard);
            match self.client.subscribe(subject.clone()).await {
                Ok(sub) => {
                    self.subscriptions.insert(shard, sub);
                }
                Err(source) => {
                    self.interest.remove(shard);
                    return Err(ClusterError::Subscribe { subject, source });
                }
            }
        }
        Ok(())
    }

    /// One local watcher fewer: unsubscribes when it was the last. After it
    /// returns, no view of an unsubscribed shard comes out of `recv`.
    pub fn unwatch(&mut self, shard: ShardId) {
        if self.interest.remove(shard) {
            // Dropping the subscriber unsubscribes.
            self.subscriptions.remove(&shard);
        }
    }

    /// The shards with a subscription now.
    pub fn subscribed(&self) -> HashSet<ShardId> {
        self.subscriptions.keys().copied().collect()
    }

    pub fn watchers(&self, shard: ShardId) -> u32 {
        self.interest.watchers(shard)
    }

    /// The next view of a watched shard (one that does not open is dropped
    /// and counted). Pending forever while nothing is watched (use it in a
    /// `select!`).
    pub async fn recv(&mut self) -> ShardMessage {
        loop {
            if self.subscriptions.is_empty() {
                std::future::pending::<()>().await;
            }
            if let Some((shard, msg)) = self.subscriptions.next().await {
                if let Some(payload) = self.envelope.open(msg.subject.as_str(), &msg.payload) {
                    return ShardMessage { shard, payload };
                }
            }
        }
    }
}

/// The messages on one subject this node listens to: the resync requests
/// of new owners (every node hears them), or the truths owners send to this
/// node's edge.
pub struct SubjectFeed {
    pub(crate) sub: Subscriber,
    pub(crate) envelope: Envelope,
}

impl SubjectFeed {
    /// The next message's payload (one that does not open is dropped and
    /// counted); `None` once the subscription ended.
    pub async fn recv(&mut self) -> Option<Bytes> {
        loop {
            let msg = self.sub.next().await?;
            if let Some(payload) = self.envelope.open(msg.subject.as_str(), &msg.payload) {
                return Some(payload);
            }
        }
    }
}

/// A request received by a shard's owner.
#[derive(Debug)]
pub struct OwnerRequest {
    pub shard: ShardId,
    pub kind: RequestKind,
    pub payload: Bytes,
    reply: Option<Subject>,
}

/// The requests to the shards this node owns: `serve` when a claim is won,
/// `stop` when the node stops acting for the shard.
pub struct OwnerInbox {
    client: Client,
    config: ClusterConfig,
    envelope: Envelope,
    subscriptions: StreamMap<ShardId, Subscriber>,
}

impl OwnerInbox {
    pub(crate) fn new(client: Client, config: ClusterConfig, envelope: Envelope) -> OwnerInbox {
        OwnerInbox {
            client,
            config,
            envelope,
            subscriptions: StreamMap::new(),
        }
    }

    pub async fn serve(&mut self, shard: ShardId) -> Result<()> {
        check_shard(&self.config, shard)?;
        if self.subscriptions.contains_key(&shard) {
            return Ok(());
        }
        let subject = format!("{}.req.{}.*", self.config.prefix, shard.0);
        let sub = self
            .client
            .subscribe(subject.clone())
            .await
            .map_err(|source| ClusterError::Subscribe { subject, source })?;
        self.subscriptions.insert(shard, sub);
        Ok(())
    }

    /// Stops answering for `shard`: no request for it comes out of `recv`
    /// after this returns.
    pub fn stop(&mut self, shard: ShardId) {
        self.subscriptions.remove(&shard);
    }

    pub fn serving(&self) -> HashSet<ShardId> {
        self.subscriptions.keys().copied().collect()
    }

    /// The next request for a served shard (requests of an unknown kind, and
    /// those that do not open, counted, are dropped: the asker times out).
    pub async fn recv(&mut self) -> OwnerRequest {
        loop {
            if self.subscriptions.is_empty() {
                std::future::pending::<()>().await;
            }
            let Some((shard, msg)) = self.subscriptions.next().await else {
                continue;
            };
            let Some(kind) = msg
                .subject
                .rsplit('.')
                .next()
                .and_then(RequestKind::from_token)
            else {
                continue;
            };
            let Some(payload) = self.envelope.open(msg.subject.as_str(), &msg.payload) else {
                continue;
            };
            return OwnerRequest {
                shard,
                kind,
                payload,
                reply: msg.reply,
            };
        }
    }

    /// Answers a request (nothing to do if the asker wanted no answer),
    /// sealed for the asker's inbox subject: an answer copied onto another
    /// request's inbox does not open.
    pub async fn reply(&self, request: &OwnerRequest, payload: Bytes) -> Result<()> {
        let Some(reply) = request.reply.clone() else {
            return Ok(());
        };
        let sealed = self.envelope.seal(reply.as_str(), &payload);
        self.client
            .publish(reply.clone(), sealed)
            .await
            .map_err(|source| ClusterError::Publish {
                subject: reply.to_string(),
                source,
            })
    }
}
