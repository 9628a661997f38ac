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
//!
//! Every commit is redb's default `Durability::Immediate`: on disk when
//! `commit` returns. One writer thread groups whatever is queued into one
//! transaction, so many acknowledgements share one fsync.

use crate::proto::{Kind, Status};
use crate::server::hub::LiveDevice;
use greendot_core::{Millis, Saved};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use tokio::sync::oneshot;
use tracing::error;

const USERS: TableDefinition<&str, &[u8]> = TableDefinition::new("users");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const DRAINED: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("drained");

/// Why the store failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("store: {0}")]
pub struct StoreError(pub String);

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
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

/// What a starting server finds.
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    pub users: Vec<(String, Record)>,
    pub alive_at: Option<u64>,
    /// The previous process drained (shut down gracefully).
    pub clean: bool,
    /// Devices live at that drained shutdown (empty after a crash).
    pub drained: Vec<LiveDevice>,
}

/// One transaction's worth of writes.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub users: Vec<(String, Record)>,
    pub alive_at: Option<u64>,
    /// A drained shutdown: these devices were live; marks the store clean.
    pub drained: Option<Vec<LiveDevice>>,
}

impl Batch {
    fn absorb(&mut self, other: Batch) {
        self.users.extend(other.users);
        if other.alive_at.is_some() {
            self.alive_at = other.alive_at;
        }
        if other.drained.is_some() {
            self.drained = other.drained;
        }
    }
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
        let db = Database::create(path)
            .map_err(|e| StoreError(format!("cannot open {}: {e}", path.display())))?;
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
                        let record = postcard::from_bytes::<Record>(v.value()).map_err(|e| {
                            StoreError(format!("unreadable record of {:?}: {e}", k.value()))
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
                    loaded.clean = table
                        .get("clean")
                        .map_err(err)?
                        .is_some_and(|v| v.value() == 1);
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
                let bytes = postcard::to_allocvec(record).map_err(err)?;
                users.insert(name.as_str(), bytes.as_slice()).map_err(err)?;
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

struct Job {
    batch: Batch,
    done: Option<oneshot::Sender<Result<(), StoreError>>>,
}

/// The writer thread's mailbox. Sending never blocks.
#[derive(Clone, Debug)]
pub struct StoreWriter {
    tx: mpsc::Sender<Job>,
}

impl StoreWriter {
    /// Starts the writer thread (it ends when every `StoreWriter` is dropped).
    pub fn spawn(store: Store) -> Result<StoreWriter, StoreError> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("greendot-store".into())
            .spawn(move || write_loop(store, rx))
            .map_err(err)?;
        Ok(StoreWriter { tx })
    }

    /// Queues a write-behind batch.
    pub fn write_behind(&self, batch: Batch) {
        if self.tx.send(Job { batch, done: None }).is_err() {
            error!("the store writer has stopped: a write is lost");
        }
    }

    /// Queues a batch; the answer comes once it is on disk.
    pub fn write_durable(&self, batch: Batch) -> oneshot::Receiver<Result<(), StoreError>> {
        let (done, rx) = oneshot::channel();
        let job = Job {
            batch,
            done: Some(done),
        };
        if let Err(mpsc::SendError(job)) = self.tx.send(job) {
            if let Some(done) = job.done {
                let _ = done.send(Err(StoreError("the store writer has stopped".into())));
            }
        }
        rx
    }
}

fn write_loop(store: Store, rx: mpsc::Receiver<Job>) {
    while let Ok(first) = rx.recv() {
        let mut batch = first.batch;
        let mut waiting: Vec<_> = first.done.into_iter().collect();
        // Group commit: everything already queued goes in the same transaction.
        while let Ok(more) = rx.try_recv() {
            batch.absorb(more.batch);
            waiting.extend(more.done);
        }
        let result = store.write(&batch);
        if let Err(e) = &result {
            error!(error = %e, users = batch.users.len(), "store write failed");
        }
        for done in waiting {
            let _ = done.send(result.clone());
        }
    }
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
                })
                .unwrap();
        }
        let store = Store::open(&path).unwrap();
        let loaded = store.load_and_begin(3_000).unwrap();
        assert!(loaded.clean);
        assert_eq!(loaded.alive_at, Some(2_000));
        assert_eq!(loaded.drained.len(), 1);
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
}
