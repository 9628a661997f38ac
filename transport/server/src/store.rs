//! The durable store: what the server keeps across restarts, in one embedded,
//! crash-safe [redb](https://docs.rs/redb) file in the data directory.
//!
//! - `users`: per user, the status and message, invisibility, last seen and
//!   whether they were shown online when written. Status and invisibility
//!   changes are committed before the request is answered; everything else is
//!   written behind, at most one flush interval (1 s) late.
//! - `meta`: `alive_at`, the server's clock (Unix ms) at the latest flush, so
//!   that after a crash a user who was shown online gets `last_seen` at most
//!   one flush interval before the crash; `clean`, set by a drained shutdown.
//! - `drained`: the devices live at a drained shutdown, which the next
//!   process brings back as lingering (lost connections within grace), so a
//!   restart shows nobody offline who reconnects in time.
//! - `revoked`: the token revocations, by user and device (`""` for every
//!   device of the user): tokens issued before the stored Unix second are
//!   refused. Committed before a revocation is answered; bounded by the
//!   list's cap, checked before storing.
//! - `groups`: each group's members, admins and membership version, by
//!   group id. Committed before a `SetGroup`, `ChangeGroup` or `RemoveGroup`
//!   is answered; bounded by the groups cap and the members cap, both
//!   checked before storing. `meta`'s `group_membership_floor` keeps the
//!   highest membership version a removed group reached, so a group
//!   written again after a restart starts above it too.
//!
//! Every commit is redb's default `Durability::Immediate`: on disk when
//! `commit` returns. One writer thread groups whatever is queued into one
//! transaction, so many acknowledgements share one fsync.
//!
//! Order: every batch, durable or written behind, is merged into the
//! pending set when it is handed over (the newest record of a key wins), so
//! a commit never carries an older record of a user or group than one
//! already committed, whatever order the waits for commits run in.
//!
//! Bounded: durable waits queue in a channel of [`DURABLE_QUEUE`] (a
//! sender waits for room, with the server's `store_timeout`); batches are
//! not queued but merged into one pending set (one record per user or
//! group, the newest), so a slow disk costs memory per dirty user or group
//! (a group's record is its whole list, up to about 1.3 MB at the default
//! caps), not per flush. A batch that fails to commit is merged back under
//! what came since and written with the next one: a failure loses no dirty
//! user or group.

use crate::hub::{GroupWrite, LiveDevice, StoredGroup};
use crate::tokens::Revocation;
use greendot_core::{Millis, Saved};
use greendot_proto::{Kind, Status};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tracing::error;

/// Durable requests queued for the writer at most; more wait for room.
pub const DURABLE_QUEUE: usize = 1024;

const USERS: TableDefinition<&str, &[u8]> = TableDefinition::new("users");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const DRAINED: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("drained");
const REVOKED: TableDefinition<(&str, &str), u64> = TableDefinition::new("revoked");
const GROUPS: TableDefinition<u64, &[u8]> = TableDefinition::new("groups");

/// Why the store failed. `Clone` because one commit answers every request
/// that waited on it, so sources are shared.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("cannot open the store at {}: {source}", path.display())]
    Open {
        path: std::path::PathBuf,
        #[source]
        source: Arc<redb::Error>,
    },
    #[error("store database error: {0}")]
    Database(#[source] Arc<redb::Error>),
    /// Fail closed: a record that cannot be read may be an invisible
    /// user's, who must not be shown.
    #[error("unreadable record of user {user:?}")]
    Unreadable {
        user: String,
        #[source]
        source: postcard::Error,
    },
    /// Fail closed: the group's members would be refused their
    /// subscriptions, and a backend's expected version would not match.
    #[error("unreadable record of group {group}")]
    UnreadableGroup {
        group: u64,
        #[source]
        source: postcard::Error,
    },
    #[error("cannot encode a record")]
    Encode(#[source] postcard::Error),
    #[error("the store writer has stopped")]
    WriterStopped,
    #[error("the store did not commit within {0:?}")]
    Timeout(Duration),
    /// A failure made on purpose (tests, the simulator).
    #[error("injected store failure")]
    Injected,
}

fn err(e: impl Into<redb::Error>) -> StoreError {
    StoreError::Database(Arc::new(e.into()))
}

/// What is kept of one user (postcard; the enum tag is the format version).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    V1 {
        status: Status,
        message: Option<String>,
        invisible: bool,
        /// Unix milliseconds.
        last_seen: Option<u64>,
        /// Shown online to others when written.
        shown_online: bool,
    },
}

impl Record {
    /// From the core's saved state (the server runs the core on Unix ms).
    pub fn new(saved: &Saved, shown_online: bool) -> Record {
        Record::V1 {
            status: saved.status.into(),
            message: saved.message.as_deref().map(str::to_owned),
            invisible: saved.invisible,
            last_seen: saved.last_seen.map(|m| m.0),
            shown_online,
        }
    }

    /// What to restore. A user shown online when last written was seen at
    /// least until `alive_at` (the last flush before the process ended). An
    /// invisible user is never shown online, so their frozen last seen stays.
    pub fn to_saved(&self, alive_at: Option<u64>) -> Saved {
        let Record::V1 {
            status,
            message,
            invisible,
            last_seen,
            shown_online,
        } = self;
        let last_seen = match (*shown_online && !*invisible, alive_at) {
            (true, Some(alive)) => Some(last_seen.unwrap_or(0).max(alive)),
            _ => *last_seen,
        };
        Saved {
            status: (*status).into(),
            message: message.as_deref().map(Arc::from),
            invisible: *invisible,
            last_seen: last_seen.map(Millis),
        }
    }
}

/// What is kept of one group (postcard; the enum tag is the format version).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum GroupRecord {
    V1 {
        membership: u64,
        members: Vec<String>,
        admins: Vec<String>,
    },
}

/// What a starting server finds.
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    pub users: Vec<(String, Record)>,
    pub alive_at: Option<u64>,
    /// The previous process drained (shut down gracefully).
    pub clean: bool,
    /// Devices live at that drained shutdown (empty after a crash).
    pub drained: Vec<LiveDevice>,
    /// The token revocations.
    pub revocations: Vec<Revocation>,
    /// The groups, by id.
    pub groups: Vec<StoredGroup>,
    /// The highest membership version a removed group reached.
    pub group_membership_floor: u64,
}

/// One transaction's worth of writes.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub users: Vec<(String, Record)>,
    pub alive_at: Option<u64>,
    /// A drained shutdown: these devices were live; marks the store clean.
    pub drained: Option<Vec<LiveDevice>>,
    /// Token revocations (for one user and device, the latest `before` wins).
    pub revocations: Vec<Revocation>,
    /// Group writes, in the order made (for one group, the last wins).
    pub groups: Vec<GroupWrite>,
}

fn kind_code(kind: Kind) -> u8 {
    match kind {
        Kind::Mobile => 0,
        Kind::Desktop => 1,
        Kind::Web => 2,
        Kind::Other => 3,
    }
}

fn kind_from(code: u8) -> Kind {
    match code {
        0 => Kind::Mobile,
        1 => Kind::Desktop,
        2 => Kind::Web,
        _ => Kind::Other,
    }
}

/// The redb database.
pub struct Store {
    db: Database,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store(..)")
    }
}

impl Store {
    /// Opens (or creates) the database file.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let db = Database::create(path).map_err(|e| StoreError::Open {
            path: path.to_owned(),
            source: Arc::new(e.into()),
        })?;
        Ok(Store { db })
    }

    /// Reads everything, then (durably) marks the store as in use by a new
    /// process: not clean, no drained devices, alive at `now`.
    pub fn load_and_begin(&self, now: u64) -> Result<Loaded, StoreError> {
        let mut loaded = Loaded::default();
        {
            let read = self.db.begin_read().map_err(err)?;
            match read.open_table(USERS) {
                Ok(table) => {
                    for item in table.iter().map_err(err)? {
                        let (k, v) = item.map_err(err)?;
                        // Fail closed: a record that cannot be read may
                        // be an invisible user's, who must not be shown.
                        let record =
                            postcard::from_bytes::<Record>(v.value()).map_err(|source| {
                                StoreError::Unreadable {
                                    user: k.value().to_owned(),
                                    source,
                                }
                            })?;
                        loaded.users.push((k.value().to_owned(), record));
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(err(e)),
            }
            match read.open_table(META) {
                Ok(table) => {
                    loaded.alive_at = table.get("alive_at").map_err(err)?.map(|v| v.value());
                    loaded.group_membership_floor = table
                        .get("group_membership_floor")
                        .map_err(err)?
                        .map_or(0, |v| v.value());
                    loaded.clean = table
                        .get("clean")
                        .map_err(err)?
                        .is_some_and(|v| v.value() == 1);
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(err(e)),
            }
            match read.open_table(REVOKED) {
                Ok(table) => {
                    for item in table.iter().map_err(err)? {
                        let (k, v) = item.map_err(err)?;
                        let (user, device) = k.value();
                        loaded.revocations.push(Revocation {
                            user: user.to_owned(),
                            device: (!device.is_empty()).then(|| device.to_owned()),
                            before: v.value(),
                        });
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(err(e)),
            }
            match read.open_table(GROUPS) {
                Ok(table) => {
                    for item in table.iter().map_err(err)? {
                        let (k, v) = item.map_err(err)?;
                        let group = k.value();
                        let record = postcard::from_bytes::<GroupRecord>(v.value())
                            .map_err(|source| StoreError::UnreadableGroup { group, source })?;
                        let GroupRecord::V1 {
                            membership,
                            members,
                            admins,
                        } = record;
                        loaded.groups.push(StoredGroup {
                            group,
                            membership,
                            members,
                            admins,
                        });
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(err(e)),
            }
            if loaded.clean {
                match read.open_table(DRAINED) {
                    Ok(table) => {
                        for item in table.iter().map_err(err)? {
                            let (k, v) = item.map_err(err)?;
                            let (user, device) = k.value();
                            loaded.drained.push(LiveDevice {
                                user: user.to_owned(),
                                device: device.to_owned(),
                                kind: kind_from(v.value().first().copied().unwrap_or(3)),
                            });
                        }
                    }
                    Err(redb::TableError::TableDoesNotExist(_)) => {}
                    Err(e) => return Err(err(e)),
                }
            }
        }
        let write = self.db.begin_write().map_err(err)?;
        {
            let mut meta = write.open_table(META).map_err(err)?;
            meta.insert("clean", &0).map_err(err)?;
            meta.insert("alive_at", &now).map_err(err)?;
            write.open_table(USERS).map_err(err)?;
        }
        write.delete_table(DRAINED).map_err(err)?;
        write.commit().map_err(err)?;
        Ok(loaded)
    }

    /// Writes one batch in one transaction, durable when this returns.
    pub fn write(&self, batch: &Batch) -> Result<(), StoreError> {
        let write = self.db.begin_write().map_err(err)?;
        {
            let mut users = write.open_table(USERS).map_err(err)?;
            for (name, record) in &batch.users {
                let bytes = postcard::to_allocvec(record).map_err(StoreError::Encode)?;
                users.insert(name.as_str(), bytes.as_slice()).map_err(err)?;
            }
            if !batch.revocations.is_empty() {
                let mut revoked = write.open_table(REVOKED).map_err(err)?;
                for r in &batch.revocations {
                    let key = (r.user.as_str(), r.device.as_deref().unwrap_or(""));
                    let stored = revoked.get(key).map_err(err)?.map(|v| v.value());
                    let before = stored.unwrap_or(0).max(r.before);
                    revoked.insert(key, &before).map_err(err)?;
                }
            }
            if !batch.groups.is_empty() {
                let mut groups = write.open_table(GROUPS).map_err(err)?;
                for w in &batch.groups {
                    match w {
                        GroupWrite::Set(g) => {
                            let record = GroupRecord::V1 {
                                membership: g.membership,
                                members: g.members.clone(),
                                admins: g.admins.clone(),
                            };
                            let bytes =
                                postcard::to_allocvec(&record).map_err(StoreError::Encode)?;
                            groups.insert(g.group, bytes.as_slice()).map_err(err)?;
                        }
                        GroupWrite::Removed {
                            group,
                            membership_floor,
                        } => {
                            groups.remove(*group).map_err(err)?;
                            let mut meta = write.open_table(META).map_err(err)?;
                            let key = "group_membership_floor";
                            let stored = meta.get(key).map_err(err)?.map_or(0, |v| v.value());
                            meta.insert(key, &stored.max(*membership_floor))
                                .map_err(err)?;
                        }
                    }
                }
            }
            let mut meta = write.open_table(META).map_err(err)?;
            if let Some(at) = batch.alive_at {
                meta.insert("alive_at", &at).map_err(err)?;
            }
            if let Some(devices) = &batch.drained {
                let mut drained = write.open_table(DRAINED).map_err(err)?;
                for d in devices {
                    drained
                        .insert(
                            (d.user.as_str(), d.device.as_str()),
                            [kind_code(d.kind)].as_slice(),
                        )
                        .map_err(err)?;
                }
                meta.insert("clean", &1).map_err(err)?;
            }
        }
        write.commit().map_err(err)
    }
}

/// Faults to inject into the writer, for tests of what a failing or hung
/// disk does to the server. Not for production use.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct StoreFaults {
    /// Every commit fails.
    pub fail: AtomicBool,
    /// The writer hangs before each commit while this is set.
    pub stall: AtomicBool,
    /// The user records of every successful commit, in order.
    pub committed: Mutex<Vec<(String, Record)>>,
    /// Commits refused by `fail` so far (a test waits for one).
    pub refused: AtomicU64,
}

/// A wait for the commit of a durable batch, which is already pending.
struct Job {
    done: oneshot::Sender<Result<(), StoreError>>,
}

/// Batches merged for the next commit: one record per user or group, the
/// one handed over last (by sequence number: a failed commit is merged
/// back under what was handed over since).
#[derive(Default)]
struct Pending {
    users: HashMap<String, (u64, Record)>,
    /// With the sequence number of the batch that set it.
    alive_at: Option<(u64, u64)>,
    drained: Option<(u64, Vec<LiveDevice>)>,
    /// By user and device: the latest `before` (order does not matter).
    revocations: HashMap<(String, Option<String>), u64>,
    /// By group: the last write.
    groups: HashMap<u64, (u64, GroupWrite)>,
}

impl Pending {
    fn merge(&mut self, batch: Batch, seq: u64) {
        for (name, record) in batch.users {
            keep_newest(&mut self.users, name, seq, record);
        }
        if let Some(at) = batch.alive_at {
            if self.alive_at.is_none_or(|(newer, _)| newer <= seq) {
                self.alive_at = Some((seq, at));
            }
        }
        if let Some(devices) = batch.drained {
            if self.drained.as_ref().is_none_or(|(newer, _)| *newer <= seq) {
                self.drained = Some((seq, devices));
            }
        }
        for r in batch.revocations {
            let before = self.revocations.entry((r.user, r.device)).or_insert(0);
            *before = (*before).max(r.before);
        }
        for w in batch.groups {
            keep_newest(&mut self.groups, w.group(), seq, w);
        }
    }

    /// Merges another pending set in (a failed commit back under what came
    /// since).
    fn merge_pending(&mut self, other: Pending) {
        for (name, (seq, record)) in other.users {
            self.merge(
                Batch {
                    users: vec![(name, record)],
                    ..Batch::default()
                },
                seq,
            );
        }
        if let Some((seq, at)) = other.alive_at {
            self.merge(
                Batch {
                    alive_at: Some(at),
                    ..Batch::default()
                },
                seq,
            );
        }
        if let Some((seq, devices)) = other.drained {
            self.merge(
                Batch {
                    drained: Some(devices),
                    ..Batch::default()
                },
                seq,
            );
        }
        for ((user, device), before) in other.revocations {
            let slot = self.revocations.entry((user, device)).or_insert(0);
            *slot = (*slot).max(before);
        }
        for (_, (seq, w)) in other.groups {
            self.merge(
                Batch {
                    groups: vec![w],
                    ..Batch::default()
                },
                seq,
            );
        }
    }

    fn is_empty(&self) -> bool {
        self.users.is_empty()
            && self.alive_at.is_none()
            && self.drained.is_none()
            && self.revocations.is_empty()
            && self.groups.is_empty()
    }

    fn batch(&self) -> Batch {
        Batch {
            users: self
                .users
                .iter()
                .map(|(name, (_, record))| (name.clone(), record.clone()))
                .collect(),
            alive_at: self.alive_at.map(|(_, at)| at),
            drained: self.drained.as_ref().map(|(_, d)| d.clone()),
            revocations: self
                .revocations
                .iter()
                .map(|((user, device), &before)| Revocation {
                    user: user.clone(),
                    device: device.clone(),
                    before,
                })
                .collect(),
            groups: self.groups.values().map(|(_, w)| w.clone()).collect(),
        }
    }
}

/// Keeps `value` under `key` unless a record handed over later (a higher
/// `seq`) is there.
fn keep_newest<K: Eq + std::hash::Hash, V>(
    map: &mut HashMap<K, (u64, V)>,
    key: K,
    seq: u64,
    value: V,
) {
    if map.get(&key).is_none_or(|(newer, _)| *newer <= seq) {
        map.insert(key, (seq, value));
    }
}

/// The writer thread's mailbox. Never blocks the caller: every batch is
/// merged when handed over; a durable write's wait is sent by the task that
/// waits for it.
#[derive(Clone)]
pub struct StoreWriter {
    tx: mpsc::Sender<Option<Job>>,
    pending: Arc<Mutex<Pending>>,
    seq: Arc<AtomicU64>,
}

impl std::fmt::Debug for StoreWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreWriter(..)")
    }
}

impl StoreWriter {
    /// Starts the writer thread (it ends when every `StoreWriter` is
    /// dropped), with injected faults if any (tests).
    pub fn spawn_with_faults(
        store: Store,
        faults: Option<Arc<StoreFaults>>,
    ) -> Result<StoreWriter, StoreError> {
        // One slot more than the durable queue: a write-behind wake-up
        // always finds room or a wake-up already queued.
        let (tx, rx) = mpsc::channel::<Option<Job>>(DURABLE_QUEUE + 1);
        let pending = Arc::new(Mutex::new(Pending::default()));
        let shared = pending.clone();
        std::thread::Builder::new()
            .name("greendot-store".into())
            .spawn(move || write_loop(store, rx, shared, faults))
            .map_err(err)?;
        Ok(StoreWriter {
            tx,
            pending,
            seq: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Merges a batch into the pending one, in the order handed over.
    fn hand_over(&self, batch: Batch) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        // Numbered under the lock: the order numbered is the order merged.
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        pending.merge(batch, seq);
    }

    /// Merges a write-behind batch into the pending one and wakes the writer.
    pub fn write_behind(&self, batch: Batch) {
        self.hand_over(batch);
        // Full: the writer has work queued and takes the pending batch with it.
        let _ = self.tx.try_send(None);
    }

    /// Writes a batch durably: the batch is pending when this returns (so
    /// later batches win over it), and the future is `Ok` once it is on
    /// disk. The future waits for room in the queue and for the commit,
    /// each within `timeout` in all; on an error the batch stays pending
    /// and goes out with a later commit.
    pub fn write_durable(
        &self,
        batch: Batch,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send + 'static {
        self.hand_over(batch);
        let tx = self.tx.clone();
        async move {
            let (done, rx) = oneshot::channel();
            let wait = async {
                tx.send(Some(Job { done }))
                    .await
                    .map_err(|_| StoreError::WriterStopped)?;
                rx.await.map_err(|_| StoreError::WriterStopped)?
            };
            match tokio::time::timeout(timeout, wait).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::Timeout(timeout)),
            }
        }
    }
}

fn write_loop(
    store: Store,
    mut rx: mpsc::Receiver<Option<Job>>,
    pending: Arc<Mutex<Pending>>,
    faults: Option<Arc<StoreFaults>>,
) {
    let lock = || pending.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let first = rx.blocking_recv();
        let stopping = first.is_none();
        // Group commit: every durable wait already queued is answered by
        // one transaction of everything pending. The waits are taken first:
        // each one's batch was pending before it was queued.
        let waiting: Vec<_> = first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            .flatten()
            .map(|job| job.done)
            .collect();
        let commit = std::mem::take(&mut *lock());
        // Nothing pending: the waits' batches went out with an earlier
        // commit that succeeded (a failed one merges them back).
        let mut result = Ok(());
        if !commit.is_empty() {
            let batch = commit.batch();
            result = write_with_faults(&store, &batch, faults.as_deref());
            if let Err(e) = &result {
                error!(error = %e, users = batch.users.len(), "store write failed; kept for the next flush");
                // Merged with whatever came meanwhile: the newest record wins.
                lock().merge_pending(commit);
            }
        }
        for done in waiting {
            let _ = done.send(result.clone());
        }
        if stopping {
            return;
        }
    }
}

fn write_with_faults(
    store: &Store,
    batch: &Batch,
    faults: Option<&StoreFaults>,
) -> Result<(), StoreError> {
    if let Some(faults) = faults {
        while faults.stall.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if faults.fail.load(Ordering::Relaxed) {
            faults.refused.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Injected);
        }
        store.write(batch)?;
        faults
            .committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(batch.users.iter().cloned());
        return Ok(());
    }
    store.write(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_reopen_and_drained_devices_only_once() {
        let dir = std::env::temp_dir().join(format!("greendot-store-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("t.redb");
        let _ = std::fs::remove_file(&path);
        {
            let store = Store::open(&path).unwrap();
            let loaded = store.load_and_begin(1_000).unwrap();
            assert!(loaded.users.is_empty() && !loaded.clean);
            let saved = Saved {
                status: greendot_core::Status::Busy,
                message: Some(Arc::from("hi")),
                invisible: true,
                last_seen: Some(Millis(900)),
            };
            store
                .write(&Batch {
                    users: vec![
                        ("ann".into(), Record::new(&saved, false)),
                        ("bob".into(), Record::new(&Saved::default(), true)),
                    ],
                    alive_at: Some(2_000),
                    drained: Some(vec![LiveDevice {
                        user: "bob".into(),
                        device: "phone".into(),
                        kind: Kind::Mobile,
                    }]),
                    revocations: vec![
                        Revocation {
                            user: "ann".into(),
                            device: None,
                            before: 7,
                        },
                        Revocation {
                            user: "ann".into(),
                            device: Some("phone".into()),
                            before: 9,
                        },
                    ],
                    groups: Vec::new(),
                })
                .unwrap();
        }
        let store = Store::open(&path).unwrap();
        let loaded = store.load_and_begin(3_000).unwrap();
        assert!(loaded.clean);
        assert_eq!(loaded.alive_at, Some(2_000));
        assert_eq!(loaded.drained.len(), 1);
        let mut revoked = loaded.revocations.clone();
        revoked.sort_by(|a, b| a.device.cmp(&b.device));
        assert_eq!(revoked.len(), 2);
        assert_eq!((revoked[0].device.as_deref(), revoked[0].before), (None, 7));
        assert_eq!(
            (revoked[1].device.as_deref(), revoked[1].before),
            (Some("phone"), 9)
        );
        let ann = &loaded.users.iter().find(|(n, _)| n == "ann").unwrap().1;
        let saved = ann.to_saved(loaded.alive_at);
        assert!(saved.invisible);
        assert_eq!(saved.last_seen, Some(Millis(900)), "invisible: frozen");
        let bob = &loaded.users.iter().find(|(n, _)| n == "bob").unwrap().1;
        assert_eq!(bob.to_saved(loaded.alive_at).last_seen, Some(Millis(2_000)));
        // A crash now: not clean, no drained devices.
        let loaded = store.load_and_begin(4_000).unwrap();
        assert!(!loaded.clean && loaded.drained.is_empty());
        assert_eq!(loaded.alive_at, Some(3_000));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn group(group: u64, membership: u64, members: &[&str]) -> GroupWrite {
        GroupWrite::Set(StoredGroup {
            group,
            membership,
            members: members.iter().map(|&m| m.to_owned()).collect(),
            admins: vec![members[0].to_owned()],
        })
    }

    fn temp_store(name: &str) -> (std::path::PathBuf, Store) {
        let dir = std::env::temp_dir().join(format!("greendot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = Store::open(&dir.join("t.redb")).unwrap();
        store.load_and_begin(0).unwrap();
        (dir, store)
    }

    #[test]
    fn groups_survive_reopen_and_a_removed_one_is_gone() {
        let (dir, store) = temp_store("store-groups");
        let written = Batch {
            groups: vec![
                group(1, 1, &["ann", "bob"]),
                group(2, 4, &["cy"]),
                group(1, 2, &["ann", "bob", "dee"]),
                group(3, 1, &["eve"]),
                GroupWrite::Removed {
                    group: 3,
                    membership_floor: 1,
                },
            ],
            ..Batch::default()
        };
        store.write(&written).unwrap();
        drop(store);
        let store = Store::open(&dir.join("t.redb")).unwrap();
        let mut loaded = store.load_and_begin(1).unwrap().groups;
        loaded.sort_by_key(|g| g.group);
        let want: Vec<GroupWrite> = loaded.into_iter().map(GroupWrite::Set).collect();
        assert_eq!(
            want,
            [group(1, 2, &["ann", "bob", "dee"]), group(2, 4, &["cy"])],
            "the last write of each group, and no removed one"
        );
        let floor = |store: &Store| store.load_and_begin(1).unwrap().group_membership_floor;
        assert_eq!(floor(&store), 1, "the removed group's version");
        // The floor only rises.
        let lower = Batch {
            groups: vec![GroupWrite::Removed {
                group: 2,
                membership_floor: 0,
            }],
            ..Batch::default()
        };
        store.write(&lower).unwrap();
        assert_eq!(floor(&store), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A group write whose commit failed is kept and goes out with the
    /// next commit, under what was handed over since.
    #[tokio::test]
    async fn a_group_write_that_failed_to_commit_goes_out_with_the_next() {
        let (dir, store) = temp_store("store-group-retry");
        let path = dir.join("t.redb");
        let faults = Arc::new(StoreFaults::default());
        let writer = StoreWriter::spawn_with_faults(store, Some(faults.clone())).unwrap();
        let timeout = Duration::from_secs(10);
        let batch = |writes| Batch {
            groups: writes,
            ..Batch::default()
        };
        faults.fail.store(true, Ordering::Relaxed);
        let failed = writer
            .write_durable(
                batch(vec![group(1, 1, &["ann"]), group(3, 1, &["cy"])]),
                timeout,
            )
            .await;
        assert!(failed.is_err());
        faults.fail.store(false, Ordering::Relaxed);
        let removed = GroupWrite::Removed {
            group: 3,
            membership_floor: 1,
        };
        writer
            .write_durable(batch(vec![group(2, 1, &["bob"]), removed]), timeout)
            .await
            .unwrap();
        drop(writer);
        // The writer thread lets the file go when it ends, just after.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut reopened = Store::open(&path);
        while reopened.is_err() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
            reopened = Store::open(&path);
        }
        let mut loaded = reopened.unwrap().load_and_begin(1).unwrap().groups;
        loaded.sort_by_key(|g| g.group);
        assert_eq!(
            loaded.into_iter().map(GroupWrite::Set).collect::<Vec<_>>(),
            [group(1, 1, &["ann"]), group(2, 1, &["bob"])],
            "the failed write kept, and the later removal of group 3 over it"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A durable batch is pending from the call, so two writes of one user
    /// land in the order they were made even when the second's wait runs
    /// first (as two spawned tasks may), and the first's wait, finding its
    /// batch already committed, is answered `Ok`.
    #[tokio::test]
    async fn durable_writes_land_in_the_order_made_whatever_order_they_wait_in() {
        let (dir, store) = temp_store("store-order");
        let faults = Arc::new(StoreFaults::default());
        let writer = StoreWriter::spawn_with_faults(store, Some(faults.clone())).unwrap();
        let timeout = Duration::from_secs(10);
        let record = |status| {
            let saved = Saved {
                status,
                ..Saved::default()
            };
            Record::new(&saved, true)
        };
        let (away, busy) = (
            record(greendot_core::Status::Away),
            record(greendot_core::Status::Busy),
        );
        let older = writer.write_durable(
            Batch {
                users: vec![("ann".into(), away)],
                ..Batch::default()
            },
            timeout,
        );
        let newer = writer.write_durable(
            Batch {
                users: vec![("ann".into(), busy.clone())],
                ..Batch::default()
            },
            timeout,
        );
        newer.await.unwrap();
        older.await.unwrap();
        let committed = faults.committed.lock().unwrap().clone();
        assert_eq!(
            committed.last(),
            Some(&("ann".to_owned(), busy)),
            "the older record was committed last: {committed:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
