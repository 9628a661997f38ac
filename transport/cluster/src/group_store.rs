//! The groups bucket's I/O (layout in `groups`): a compare-and-set write
//! of chunks then header, a read from the stream leader, and a watch of the
//! headers that assembles each definition as it arrives.

use async_nats::jetstream::consumer::{push, DeliverPolicy, ReplayPolicy};
use async_nats::jetstream::kv;
use bytes::Bytes;
use futures_util::StreamExt;

use crate::client::Cluster;
use crate::error::{ClusterError, Result};
use crate::groups::{
    assemble, chunk_key, encode, header_key, open_header, parse_header_key, GroupDef, GroupDefect,
    GroupLimits,
};
use crate::kv::{op_from_headers, read, write_if, KvOp, Write};

/// One step of [`GroupWatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupEvent {
    /// A header changed: the group's definition at `revision` (a tombstone
    /// included), or `None` when the header itself was deleted or purged.
    Changed {
        group: u64,
        revision: u64,
        def: Option<GroupDef>,
    },
    /// Every header stored when the watch started has been delivered
    /// (once, first if the bucket held none).
    Synced,
}

/// What loading a header found.
enum Loaded {
    Def(GroupDef),
    /// Its chunks are gone because a newer header replaced it: the newer
    /// one is what counts (the watch brings it next).
    Superseded,
}

impl Cluster {
    fn corrupt(&self, store: &kv::Store, key: &str, reason: GroupDefect) -> ClusterError {
        ClusterError::GroupCorrupt {
            bucket: store.name.clone(),
            key: key.to_owned(),
            reason,
        }
    }

    /// Writes `def` if its header is still at `expected_revision` (0: the
    /// group has never been written). The chunks go first under a fresh
    /// nonce, then the header by compare-and-set; returns the header's new
    /// revision.
    ///
    /// `Conflict` when another write came first: this write's chunks are
    /// purged again. After a successful write the previous header's chunks
    /// are purged (best effort: a failure leaves orphans, logged). A write
    /// that fails otherwise (a timeout) may still land, so its chunks stay.
    /// `Reconnecting` when the connection is down at the start or before the
    /// header (nothing is handed to a client that would send it after the
    /// reconnect). `GroupRefused` before anything is stored when `def`
    /// breaks the configured limits or its own rules
    /// ([`crate::groups::check_def`]).
    pub async fn write_group_if(&self, def: &GroupDef, expected_revision: u64) -> Result<u64> {
        let nonce = random_nonce();
        let encoded =
            encode(def, nonce, &self.config().groups, self.envelope()).map_err(|reason| {
                ClusterError::GroupRefused {
                    group: def.group,
                    reason,
                }
            })?;
        let store = self.groups_store().await?;
        self.connected("group write").await?;
        let key = header_key(def.group);
        // The nonce whose chunks this write replaces; a header that does
        // not open names nothing we trust. Opened under no size limits: a
        // header over limits lowered since still names its chunks.
        let unlimited = GroupLimits {
            max_members: u32::MAX,
            max_admins: u32::MAX,
        };
        let previous = match read(store, &key, self.timeout()).await? {
            Some(e) if e.revision != expected_revision => {
                return Err(ClusterError::Conflict {
                    bucket: store.name.clone(),
                    key,
                    expected: expected_revision,
                })
            }
            Some(e) if e.op == KvOp::Put => {
                open_header(&key, &e.value, self.envelope(), &unlimited)
                    .ok()
                    .filter(|h| h.chunks > 0)
                    .map(|h| h.nonce)
            }
            _ => None,
        };
        for (i, chunk) in encoded.chunks.iter().enumerate() {
            let chunk_key = chunk_key(def.group, nonce, i as u16);
            // Expecting no message: chunks are immutable.
            let write = Write::Put {
                value: chunk.clone(),
                ttl: None,
            };
            if let Err(e) = write_if(self.js(), store, &chunk_key, 0, write, self.timeout()).await {
                self.purge_chunks(store, def.group, nonce).await;
                return Err(e);
            }
        }
        if let Err(e) = self.connected("group write").await {
            self.purge_chunks(store, def.group, nonce).await;
            return Err(e);
        }
        let write = Write::Put {
            value: encoded.sealed,
            ttl: None,
        };
        match write_if(
            self.js(),
            store,
            &key,
            expected_revision,
            write,
            self.timeout(),
        )
        .await
        {
            Ok(revision) => {
                if let Some(old) = previous.filter(|old| *old != nonce) {
                    self.purge_chunks(store, def.group, old).await;
                }
                Ok(revision)
            }
            Err(e @ ClusterError::Conflict { .. }) => {
                if encoded.header.chunks > 0 {
                    self.purge_chunks(store, def.group, nonce).await;
                }
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Removes every chunk of the write `nonce` of `group` in one purge
    /// (no delete markers are left behind). Best effort: logged on failure.
    async fn purge_chunks(&self, store: &kv::Store, group: u64, nonce: u64) {
        if let Err(e) = purge_nonce(store, group, nonce, self.timeout()).await {
            tracing::warn!(group, nonce, error = %e, "leaving orphan group chunks");
        }
    }

    /// A group's definition and its header's revision, read from the
    /// stream leader; `None` when the group was never written (a removed
    /// group is a tombstone: `Some` with `removed`). `GroupCorrupt` when the
    /// header does not open or its chunks do not match.
    pub async fn read_group(&self, group: u64) -> Result<Option<(u64, GroupDef)>> {
        let store = self.groups_store().await?;
        let key = header_key(group);
        // A write landing between the header read and the chunk reads
        // purges the chunks read for: read the newer header.
        for _ in 0..3 {
            let Some(entry) = read(store, &key, self.timeout()).await? else {
                return Ok(None);
            };
            if entry.op != KvOp::Put {
                return Ok(None);
            }
            match self.load(store, &key, entry.revision, &entry.value).await? {
                Loaded::Def(def) => return Ok(Some((entry.revision, def))),
                Loaded::Superseded => continue,
            }
        }
        Err(ClusterError::Conflict {
            bucket: store.name.clone(),
            key,
            expected: 0,
        })
    }

    /// Opens the header at `revision` and reads its chunks.
    async fn load(
        &self,
        store: &kv::Store,
        key: &str,
        revision: u64,
        sealed: &Bytes,
    ) -> Result<Loaded> {
        let limits = &self.config().groups;
        let header = open_header(key, sealed, self.envelope(), limits)
            .map_err(|reason| self.corrupt(store, key, reason))?;
        let mut chunks = Vec::with_capacity(header.chunks as usize);
        for i in 0..header.chunks {
            let ck = chunk_key(header.group, header.nonce, i);
            match read(store, &ck, self.timeout()).await? {
                Some(e) if e.op == KvOp::Put => chunks.push(e.value),
                _ => return self.missing_chunk(store, key, revision, i).await,
            }
        }
        let def = assemble(&header, &chunks, limits)
            .map_err(|reason| self.corrupt(store, key, reason))?;
        Ok(Loaded::Def(def))
    }

    async fn missing_chunk(
        &self,
        store: &kv::Store,
        key: &str,
        revision: u64,
        i: u16,
    ) -> Result<Loaded> {
        match read(store, key, self.timeout()).await? {
            Some(latest) if latest.revision != revision => Ok(Loaded::Superseded),
            _ => Err(self.corrupt(store, key, GroupDefect::MissingChunk(i))),
        }
    }

    /// Watches the group headers: first every stored one, then
    /// [`GroupEvent::Synced`], then every change. Each definition is
    /// assembled (its chunks read) when its header arrives.
    pub async fn watch_groups(&self) -> Result<GroupWatch> {
        let store = self.groups_store().await?.clone();
        let bucket = store.name.clone();
        let watch_error =
            |source: Box<dyn std::error::Error + Send + Sync>| ClusterError::GroupWatch {
                bucket: bucket.clone(),
                source,
            };
        // The ordered consumer a KV watch makes, on the headers only, made
        // here because `kv::Watch` does not say how many entries the first
        // pass holds: with none it would never say it is current.
        let consumer = store
            .stream
            .create_consumer(push::OrderedConfig {
                deliver_subject: self.client().new_inbox(),
                description: Some("greendot groups watch".into()),
                filter_subject: format!("$KV.{bucket}.g.>"),
                replay_policy: ReplayPolicy::Instant,
                deliver_policy: DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(|e| watch_error(Box::new(e)))?;
        let current = consumer.cached_info().num_pending == 0;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| watch_error(Box::new(e)))?;
        Ok(GroupWatch {
            cluster: self.clone(),
            prefix: format!("$KV.{bucket}."),
            store,
            messages,
            current,
            synced: false,
        })
    }
}

/// The group headers, from the groups bucket's watch ([`Cluster::watch_groups`]).
pub struct GroupWatch {
    cluster: Cluster,
    store: kv::Store,
    prefix: String,
    messages: push::Ordered,
    /// The first pass has been delivered (nothing pending).
    current: bool,
    /// [`GroupEvent::Synced`] was yielded.
    synced: bool,
}

impl GroupWatch {
    /// The next event. `None` when the watch ended (the connection closed
    /// for good). An `Err` for one header (forged, chunks that do not
    /// match) leaves the watch running.
    pub async fn next(&mut self) -> Option<Result<GroupEvent>> {
        loop {
            if self.current && !self.synced {
                self.synced = true;
                return Some(Ok(GroupEvent::Synced));
            }
            let message = match self.messages.next().await? {
                Ok(m) => m,
                Err(e) => {
                    return Some(Err(ClusterError::GroupWatch {
                        bucket: self.store.name.clone(),
                        source: Box::new(e),
                    }))
                }
            };
            let (revision, pending) = match message.info() {
                Ok(info) => (info.stream_sequence, info.pending),
                Err(e) => {
                    return Some(Err(ClusterError::GroupWatch {
                        bucket: self.store.name.clone(),
                        source: e,
                    }))
                }
            };
            if pending == 0 {
                self.current = true;
            }
            let subject = message.subject.as_str();
            let Some(key) = subject.strip_prefix(&self.prefix) else {
                continue;
            };
            let Some(group) = parse_header_key(key) else {
                continue;
            };
            let op = message.headers.as_ref().map_or(KvOp::Put, op_from_headers);
            if op != KvOp::Put {
                return Some(Ok(GroupEvent::Changed {
                    group,
                    revision,
                    def: None,
                }));
            }
            let key = key.to_owned();
            let loaded = self
                .cluster
                .load(&self.store, &key, revision, &message.payload)
                .await;
            match loaded {
                Ok(Loaded::Def(def)) => {
                    return Some(Ok(GroupEvent::Changed {
                        group,
                        revision,
                        def: Some(def),
                    }))
                }
                Ok(Loaded::Superseded) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

fn random_nonce() -> u64 {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 8];
    // The system's generator failing leaves a time-based nonce: it only has
    // to differ between racing writers of one group.
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return now.as_nanos() as u64 ^ u64::from(std::process::id());
    }
    u64::from_le_bytes(bytes)
}

async fn purge_nonce(
    store: &kv::Store,
    group: u64,
    nonce: u64,
    timeout: std::time::Duration,
) -> Result<()> {
    let subject = format!("$KV.{}.c.{group}.{nonce}.>", store.name);
    let purge = store.stream.purge().filter(subject.clone());
    match tokio::time::timeout(timeout, std::future::IntoFuture::into_future(purge)).await {
        Err(_) => Err(ClusterError::TimedOut {
            op: "KV purge",
            after: timeout,
        }),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(source)) => Err(ClusterError::Purge {
            bucket: store.name.clone(),
            subject,
            source,
        }),
    }
}
