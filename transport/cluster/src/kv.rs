//! The KV operations the cluster needs, written on JetStream directly where
//! the `async-nats` KV API falls short:
//! - renewal must keep a per-key TTL, and `Store::update` sends none (a TTL
//!   is per message, so a renewal without `Nats-TTL` makes the key permanent);
//! - `Store::create_with_ttl` re-creates a deleted or expired key with a
//!   plain `update`, without the TTL;
//! - `Store::entry` reads through the direct-get API, which any replica may
//!   answer (possibly behind); reads here go to the stream leader.

use std::time::Duration;

use async_nats::jetstream::{self, kv::Store};
use async_nats::HeaderMap;
use bytes::Bytes;

use crate::error::{ClusterError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOp {
    Put,
    /// Deleted by a writer (`KV-Operation: DEL`).
    Delete,
    /// Purged, or removed by NATS at its TTL (an expiry marker).
    Purge,
}

impl From<async_nats::jetstream::kv::Operation> for KvOp {
    fn from(op: async_nats::jetstream::kv::Operation) -> KvOp {
        use async_nats::jetstream::kv::Operation;
        match op {
            Operation::Put => KvOp::Put,
            Operation::Delete => KvOp::Delete,
            Operation::Purge => KvOp::Purge,
        }
    }
}

/// One entry of a bucket, as read or watched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEntry {
    pub key: String,
    pub op: KvOp,
    pub revision: u64,
    pub value: Bytes,
}

impl From<async_nats::jetstream::kv::Entry> for KvEntry {
    fn from(e: async_nats::jetstream::kv::Entry) -> KvEntry {
        KvEntry {
            key: e.key,
            op: e.operation.into(),
            revision: e.revision,
            value: e.value,
        }
    }
}

pub(crate) fn op_from_headers(headers: &HeaderMap) -> KvOp {
    if let Some(op) = headers.get("KV-Operation") {
        return match op.as_str() {
            "DEL" => KvOp::Delete,
            "PURGE" => KvOp::Purge,
            _ => KvOp::Put,
        };
    }
    match headers.get("Nats-Marker-Reason").map(|r| r.as_str()) {
        Some("Remove") => KvOp::Delete,
        Some(_) => KvOp::Purge,
        None => KvOp::Put,
    }
}

fn subject(store: &Store, key: &str) -> String {
    format!("$KV.{}.{key}", store.name)
}

/// Reads the latest entry of `key` from the stream leader.
pub(crate) async fn read(store: &Store, key: &str, timeout: Duration) -> Result<Option<KvEntry>> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let subject = subject(store, key);
    let read = store.stream.get_last_raw_message_by_subject(&subject);
    match tokio::time::timeout(timeout, read).await {
        Err(_) => Err(ClusterError::TimedOut {
            op: "KV read",
            after: timeout,
        }),
        Ok(Ok(msg)) => Ok(Some(KvEntry {
            key: key.to_owned(),
            op: op_from_headers(&msg.headers),
            revision: msg.sequence,
            value: msg.payload,
        })),
        Ok(Err(e)) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Ok(Err(source)) => Err(ClusterError::Read {
            bucket: store.name.clone(),
            key: key.to_owned(),
            source,
        }),
    }
}

/// What a conditional write does.
pub(crate) enum Write {
    /// Put `value`, expiring after `ttl` when given.
    Put { value: Bytes, ttl: Option<Duration> },
    /// A delete marker.
    Delete,
}

/// Writes `key` if its latest revision is `expected` (0: the key has no
/// message at all). Returns the new revision.
pub(crate) async fn write_if(
    js: &jetstream::Context,
    store: &Store,
    key: &str,
    expected: u64,
    write: Write,
    timeout: Duration,
) -> Result<u64> {
    let mut headers = HeaderMap::new();
    headers.insert(
        "Nats-Expected-Last-Subject-Sequence",
        expected.to_string().as_str(),
    );
    let payload = match write {
        Write::Put { value, ttl } => {
            if let Some(ttl) = ttl {
                // NATS counts per-key TTLs in whole seconds (config checks it).
                headers.insert("Nats-TTL", ttl.as_secs().to_string().as_str());
            }
            value
        }
        Write::Delete => {
            headers.insert("KV-Operation", "DEL");
            Bytes::new()
        }
    };
    let bucket = || store.name.clone();
    let publish = async {
        let ack = js
            .publish_with_headers(subject(store, key), headers, payload)
            .await?;
        ack.await
    };
    match tokio::time::timeout(timeout, publish).await {
        Err(_) => Err(ClusterError::TimedOut {
            op: "KV write",
            after: timeout,
        }),
        Ok(Ok(ack)) => Ok(ack.sequence),
        Ok(Err(e)) if is_wrong_last_sequence(&e) => Err(ClusterError::Conflict {
            bucket: bucket(),
            key: key.to_owned(),
            expected,
        }),
        Ok(Err(source)) => Err(ClusterError::Write {
            bucket: bucket(),
            key: key.to_owned(),
            source,
        }),
    }
}

/// A failed compare-and-set. nats-server 2.15 answers it with error code
/// 10164 ("wrong last sequence", without the number), which `async-nats`
/// 0.51 does not map to `WrongLastSequence` (it knows only 10071).
fn is_wrong_last_sequence(e: &async_nats::jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::context::PublishErrorKind;
    use async_nats::jetstream::ErrorCode;
    if e.kind() == PublishErrorKind::WrongLastSequence {
        return true;
    }
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|j| {
            j.error_code() == ErrorCode::STREAM_WRONG_LAST_SEQUENCE
                || j.error_code() == ErrorCode(10164)
        })
}

/// An unconditional put (preferences, last published views): returns once
/// the bucket's replicas have stored it.
pub(crate) async fn put(
    js: &jetstream::Context,
    store: &Store,
    key: &str,
    value: Bytes,
    timeout: Duration,
) -> Result<u64> {
    let bucket = || store.name.clone();
    let publish = async { js.publish(subject(store, key), value).await?.await };
    match tokio::time::timeout(timeout, publish).await {
        Err(_) => Err(ClusterError::TimedOut {
            op: "KV put",
            after: timeout,
        }),
        Ok(Ok(ack)) => Ok(ack.sequence),
        Ok(Err(source)) => Err(ClusterError::Write {
            bucket: bucket(),
            key: key.to_owned(),
            source,
        }),
    }
}
