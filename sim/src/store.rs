//! The simulator plays the server's store thread: it answers the write
//! requests of `ServerState` on time, late, with errors, or (stalled) not
//! until the stall ends or the process restarts, and keeps what a real store
//! would hold durably, from which a restarted server is built.

use greendot_server::{Batch, GroupWrite, Loaded, Record, StoreError, StoredGroup};
use greendot_server::{LiveDevice, StoreRequest};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// Durable writes waiting for an answer at most (the real store's channel
/// holds 1,024).
pub const MAX_WAITING: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Healthy,
    /// Every commit fails until then.
    Failing {
        until: Duration,
    },
    /// Commits hang until then (answered afterwards).
    Stalled {
        until: Duration,
    },
}

/// A durable write's wait: its batch is pending from the request on, as
/// the real writer merges it when it is handed over.
#[derive(Debug)]
pub struct Waiting {
    pub ticket: u64,
    /// Answered no earlier than this.
    pub at: Duration,
}

/// What the store holds on disk.
#[derive(Clone, Debug, Default)]
pub struct Disk {
    pub users: BTreeMap<String, Record>,
    pub alive_at: Option<u64>,
    pub clean: bool,
    pub drained: Vec<LiveDevice>,
    pub groups: BTreeMap<u64, StoredGroup>,
    pub group_membership_floor: u64,
}

#[derive(Debug)]
pub struct SimStore {
    pub disk: Disk,
    pub mode: Mode,
    /// Records not yet committed, durable or written behind (merged in the
    /// order handed over, newest wins), as the real writer keeps them.
    pending: Batch,
    pub waiting: VecDeque<Waiting>,
    pub commits: u64,
    pub failures: u64,
}

fn merge(into: &mut Batch, batch: Batch) {
    for (user, record) in batch.users {
        match into.users.iter_mut().find(|(u, _)| *u == user) {
            Some(slot) => slot.1 = record,
            None => into.users.push((user, record)),
        }
    }
    if batch.alive_at.is_some() {
        into.alive_at = batch.alive_at;
    }
    if batch.drained.is_some() {
        into.drained = batch.drained;
    }
    for write in batch.groups {
        into.groups.retain(|w| w.group() != write.group());
        into.groups.push(write);
    }
}

impl SimStore {
    pub fn new() -> SimStore {
        SimStore {
            disk: Disk::default(),
            mode: Mode::Healthy,
            pending: Batch::default(),
            waiting: VecDeque::new(),
            commits: 0,
            failures: 0,
        }
    }

    pub fn mode_at(&mut self, now: Duration) -> Mode {
        match self.mode {
            Mode::Failing { until } | Mode::Stalled { until } if now >= until => {
                self.mode = Mode::Healthy;
            }
            _ => {}
        }
        self.mode
    }

    /// A request from the server at `now`; durable ones are answered by
    /// [`SimStore::poll_answer`] no earlier than `now + latency`.
    pub fn request(
        &mut self,
        now: Duration,
        latency: Duration,
        request: StoreRequest,
    ) -> Result<(), String> {
        match request {
            StoreRequest::Behind(batch) => {
                merge(&mut self.pending, batch);
                if self.mode_at(now) == Mode::Healthy {
                    self.commit_pending();
                }
            }
            StoreRequest::Durable { ticket, batch, .. } => {
                merge(&mut self.pending, batch);
                self.waiting.push_back(Waiting {
                    ticket,
                    at: now + latency,
                });
                if self.waiting.len() > MAX_WAITING {
                    return Err(format!(
                        "unbounded queue: {} durable writes wait",
                        self.waiting.len()
                    ));
                }
            }
        }
        Ok(())
    }

    fn commit_pending(&mut self) {
        let batch = std::mem::take(&mut self.pending);
        if batch.users.is_empty()
            && batch.alive_at.is_none()
            && batch.drained.is_none()
            && batch.groups.is_empty()
        {
            return;
        }
        self.apply(batch);
    }

    fn apply(&mut self, batch: Batch) {
        self.commits += 1;
        for (user, record) in batch.users {
            self.disk.users.insert(user, record);
        }
        if let Some(alive) = batch.alive_at {
            self.disk.alive_at = Some(alive);
        }
        if let Some(mut drained) = batch.drained {
            // As redb reads them back: by key (user, device).
            drained.sort_by(|a, b| (&a.user, &a.device).cmp(&(&b.user, &b.device)));
            self.disk.clean = true;
            self.disk.drained = drained;
        }
        for write in batch.groups {
            match write {
                GroupWrite::Set(g) => {
                    self.disk.groups.insert(g.group, g);
                }
                GroupWrite::Removed {
                    group,
                    membership_floor,
                } => {
                    self.disk.groups.remove(&group);
                    self.disk.group_membership_floor =
                        self.disk.group_membership_floor.max(membership_floor);
                }
            }
        }
    }

    /// When the next answer is due (`None`: none, or stalled).
    pub fn next_at(&self) -> Option<Duration> {
        let first = self.waiting.front()?.at;
        Some(match self.mode {
            Mode::Stalled { until } => first.max(until),
            // A failing store answers (with errors) on time.
            Mode::Failing { .. } | Mode::Healthy => first,
        })
    }

    /// The next answer due at `now`, in order.
    pub fn poll_answer(&mut self, now: Duration) -> Option<(u64, Result<(), StoreError>)> {
        if self.waiting.front()?.at > now {
            return None;
        }
        match self.mode_at(now) {
            Mode::Stalled { .. } => None,
            Mode::Failing { .. } => {
                let w = self.waiting.pop_front()?;
                self.failures += 1;
                // Its batch stays pending for a later commit, as the real
                // writer merges a failed commit back.
                Some((w.ticket, Err(StoreError::Injected)))
            }
            Mode::Healthy => {
                let w = self.waiting.pop_front()?;
                self.commit_pending();
                Some((w.ticket, Ok(())))
            }
        }
    }

    /// A healthy store commits what waits behind (called as time passes).
    pub fn tick(&mut self, now: Duration) {
        if self.mode_at(now) == Mode::Healthy {
            self.commit_pending();
        }
    }

    /// The process died: whatever was not committed is lost.
    pub fn crash(&mut self) {
        self.pending = Batch::default();
        self.waiting.clear();
        self.mode = Mode::Healthy;
    }

    /// What a starting server loads; then the store is marked in use (not
    /// clean, no drained devices, alive now), as `load_and_begin` does.
    pub fn load_and_begin(&mut self, wall_ms: u64) -> Loaded {
        let loaded = Loaded {
            users: self
                .disk
                .users
                .iter()
                .map(|(u, r)| (u.clone(), r.clone()))
                .collect(),
            alive_at: self.disk.alive_at,
            clean: self.disk.clean,
            // The simulated clients revoke nothing.
            revocations: Vec::new(),
            groups: self.disk.groups.values().cloned().collect(),
            group_membership_floor: self.disk.group_membership_floor,
            drained: if self.disk.clean {
                self.disk.drained.clone()
            } else {
                Vec::new()
            },
        };
        self.disk.clean = false;
        self.disk.drained.clear();
        self.disk.alive_at = Some(wall_ms);
        loaded
    }
}

impl Default for SimStore {
    fn default() -> Self {
        SimStore::new()
    }
}
