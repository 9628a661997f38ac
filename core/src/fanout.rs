//! `Fanout`: an edge's local fan-out in a cluster.
//!
//! The owner of a user publishes each view once on the shard's subject; every
//! edge whose sessions watch the user receives it and hands it to its
//! `Fanout`, which keeps the newest view per target (by version: a view of an
//! older epoch, or a reordered one, is dropped, so no watcher goes back, C1),
//! pushes it at once to realtime subscribers and coalesces it for batched
//! ones exactly as [`Core`](crate::Core) does on one node: a session's batch
//! is flushed `batch_interval` after its first queued change, with the
//! latest view of each queued target (C6).
//!
//! It is a separate, small state machine rather than a second `Core`: an
//! edge holds no presence of its own (the owner is the single writer), and
//! the single-node core stays as it is. Per-target realtime caps are not
//! enforced here (a cap across nodes would need coordination): the edge caps
//! subscriptions per session before calling `subscribe`, and checks the
//! session's credentials (`Watch::allows`).

use crate::error::Error;
use crate::output::{EndReason, Output};
use crate::types::{Millis, Presence, SessionId, Tier, UserId};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FanSession {
    user: UserId,
    /// Target → (tier, queued in the pending batch).
    subs: BTreeMap<UserId, (Tier, bool)>,
    /// Queued targets, in the order they changed.
    batch: Vec<UserId>,
    batch_due: Option<Millis>,
}

/// The newest views of one watched target: what others see, and the truth
/// for the target's own sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Known {
    others: Option<Presence>,
    own: Option<Presence>,
    /// Sessions of this edge subscribed to the target.
    watchers: BTreeSet<SessionId>,
}

impl Known {
    fn stream(&mut self, own: bool) -> &mut Option<Presence> {
        if own {
            &mut self.own
        } else {
            &mut self.others
        }
    }
}

/// An edge's fan-out state machine. Deterministic and sans-IO like `Core`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fanout {
    batch_interval: Millis,
    clock: Millis,
    sessions: BTreeMap<SessionId, FanSession>,
    known: BTreeMap<UserId, Known>,
    timers: BTreeSet<(Millis, SessionId)>,
    outputs: VecDeque<Output>,
}

impl Fanout {
    pub fn new(batch_interval: Millis) -> Fanout {
        Fanout {
            batch_interval,
            clock: Millis::ZERO,
            sessions: BTreeMap::new(),
            known: BTreeMap::new(),
            timers: BTreeSet::new(),
            outputs: VecDeque::new(),
        }
    }

    /// A session of `user` connected to this edge (no subscriptions yet).
    /// Opening a session that is open already changes nothing.
    pub fn open(&mut self, session: SessionId, user: UserId) {
        self.sessions.entry(session).or_insert(FanSession {
            user,
            subs: BTreeMap::new(),
            batch: Vec::new(),
            batch_due: None,
        });
    }

    /// Session `old` of the same user resumed as `new` (open already): its
    /// subscriptions and its pending batch carry over, as
    /// `Core::handle_connect` carries them on one node, and `old` is gone
    /// without a `SessionEnded`. Returns what carried over.
    pub fn carry(&mut self, old: SessionId, new: SessionId) -> Vec<(UserId, Tier)> {
        if old == new {
            return self.subscriptions(new);
        }
        let Some(mut s) = self.sessions.remove(&old) else {
            return Vec::new();
        };
        if let Some(due) = s.batch_due {
            self.timers.remove(&(due, old));
            self.timers.insert((due, new));
        }
        for target in s.subs.keys() {
            if let Some(known) = self.known.get_mut(target) {
                known.watchers.remove(&old);
                known.watchers.insert(new);
            }
        }
        if let Some(fresh) = self.sessions.remove(&new) {
            // Whatever `new` subscribed to already stays as it is.
            s.user = fresh.user;
            s.subs.extend(fresh.subs);
            for target in fresh.batch {
                if !s.batch.contains(&target) {
                    s.batch.push(target);
                }
            }
            if let Some(due) = fresh.batch_due {
                self.timers.remove(&(due, new));
                let due = s.batch_due.map_or(due, |d| d.min(due));
                self.timers.retain(|&(_, id)| id != new);
                self.timers.insert((due, new));
                s.batch_due = Some(due);
            }
        }
        let carried = s.subs.iter().map(|(t, (tier, _))| (*t, *tier)).collect();
        self.sessions.insert(new, s);
        carried
    }

    /// The session is over (logout, lost, superseded): its subscriptions end
    /// and nothing more is pushed to it.
    pub fn close(&mut self, session: SessionId, reason: EndReason) -> bool {
        let Some(s) = self.sessions.remove(&session) else {
            return false;
        };
        if let Some(due) = s.batch_due {
            self.timers.remove(&(due, session));
        }
        for target in s.subs.keys() {
            self.unwatch(*target, session);
        }
        // Pushes still queued for it would go out after its end, naming
        // targets the edge may have forgotten with its subscriptions.
        self.outputs
            .retain(|o| !matches!(o, Output::Push { to, .. } if *to == session));
        self.outputs
            .push_back(Output::SessionEnded { session, reason });
        true
    }

    /// Watch `target` in `tier`, with `snapshot` as the owner (or this
    /// edge's cache) answered it. Returns the snapshot to send: the newest of
    /// `snapshot` and what this edge already knows, so it is never older than
    /// a push already sent. Subscribing again changes the tier and drops
    /// what was queued, like `Core::handle_subscribe`.
    pub fn subscribe(
        &mut self,
        now: Millis,
        session: SessionId,
        target: UserId,
        tier: Tier,
        snapshot: Presence,
    ) -> Result<Presence, Error> {
        self.advance(now);
        let user = self
            .sessions
            .get(&session)
            .ok_or(Error::UnknownSession)?
            .user;
        self.dequeue(session, target);
        if let Some(s) = self.sessions.get_mut(&session) {
            s.subs.insert(target, (tier, false));
        }
        let own = user == target;
        let known = self.known.entry(target).or_default();
        known.watchers.insert(session);
        let stream = known.stream(own);
        if stream
            .as_ref()
            .is_some_and(|p| p.version >= snapshot.version)
        {
            return Ok(stream.clone().unwrap_or_default());
        }
        let missed = stream.as_ref().is_some_and(|p| !p.same_view(&snapshot));
        *stream = Some(snapshot.clone());
        if missed {
            // Newer than what the other watchers here were shown, and
            // different (a view they missed): it is news to them too. (A
            // truth's version moves with others' views, so a newer one
            // alike is not.)
            self.fan_out(target, own, snapshot.clone(), Some(session));
        }
        Ok(snapshot)
    }

    /// Stop watching `target`.
    pub fn unsubscribe(
        &mut self,
        now: Millis,
        session: SessionId,
        target: UserId,
    ) -> Result<(), Error> {
        self.advance(now);
        let s = self.sessions.get(&session).ok_or(Error::UnknownSession)?;
        if !s.subs.contains_key(&target) {
            return Err(Error::NotSubscribed);
        }
        self.dequeue(session, target);
        if let Some(s) = self.sessions.get_mut(&session) {
            s.subs.remove(&target);
        }
        self.unwatch(target, session);
        Ok(())
    }

    /// A view of `target` published by its owner (`own`: the truth, for the
    /// target's own sessions). Kept and fanned out only if some session here
    /// watches the target and it is newer than what is known; returns whether
    /// it was.
    ///
    /// A view arriving at `now` is merged before the batches due at `now`
    /// flush (call `handle_timeout(now)` after), as one core publishes before
    /// it flushes within the same millisecond.
    pub fn apply(&mut self, now: Millis, target: UserId, own: bool, presence: Presence) -> bool {
        if now > self.clock {
            self.advance(Millis(now.0 - 1));
            self.clock = now;
        }
        let Some(known) = self.known.get_mut(&target) else {
            return false; // nobody here watches: drop
        };
        let stream = known.stream(own);
        if stream
            .as_ref()
            .is_some_and(|p| p.version >= presence.version)
        {
            return false; // older epoch, reordered or repeated
        }
        *stream = Some(presence.clone());
        self.fan_out(target, own, presence, None);
        true
    }

    /// Pushes `presence` of `target` to the sessions here that watch it
    /// (realtime at once, batched at their next batch), but `except`.
    fn fan_out(
        &mut self,
        target: UserId,
        own: bool,
        presence: Presence,
        except: Option<SessionId>,
    ) {
        let Some(known) = self.known.get(&target) else {
            return;
        };
        let watchers: Vec<SessionId> = known
            .watchers
            .iter()
            .copied()
            .filter(|w| Some(*w) != except)
            .collect();
        let Fanout {
            sessions,
            timers,
            outputs,
            clock,
            batch_interval,
            ..
        } = self;
        // Realtime first, then batched, as the core does.
        for to in &watchers {
            let Some(s) = sessions.get(to) else { continue };
            if (s.user == target) != own {
                continue;
            }
            if let Some((Tier::Realtime, _)) = s.subs.get(&target) {
                outputs.push_back(Output::Push {
                    to: *to,
                    target,
                    tier: Tier::Realtime,
                    presence: presence.clone(),
                });
            }
        }
        for to in &watchers {
            let Some(s) = sessions.get_mut(to) else {
                continue;
            };
            if (s.user == target) != own {
                continue;
            }
            if let Some((Tier::Batched, queued)) = s.subs.get_mut(&target) {
                if *queued {
                    continue;
                }
                *queued = true;
                s.batch.push(target);
                if s.batch_due.is_none() {
                    let due = clock.plus(*batch_interval);
                    s.batch_due = Some(due);
                    timers.insert((due, *to));
                }
            }
        }
    }

    /// The newest view known of `target` for a session of `viewer` (a
    /// snapshot this edge can answer without asking the owner).
    pub fn known(&self, viewer: UserId, target: UserId) -> Option<&Presence> {
        let known = self.known.get(&target)?;
        if viewer == target {
            known.own.as_ref()
        } else {
            known.others.as_ref()
        }
    }

    /// Targets some session here watches: what the edge resends to a new
    /// owner, and which shard subjects it subscribes to.
    pub fn watched(&self) -> impl Iterator<Item = UserId> + '_ {
        self.known.keys().copied()
    }

    /// The session's subscriptions.
    pub fn subscriptions(&self, session: SessionId) -> Vec<(UserId, Tier)> {
        self.sessions
            .get(&session)
            .map(|s| s.subs.iter().map(|(t, (tier, _))| (*t, *tier)).collect())
            .unwrap_or_default()
    }

    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Millis> {
        self.timers.first().map(|(due, _)| *due)
    }

    /// Flushes the batches due at `now`.
    pub fn handle_timeout(&mut self, now: Millis) {
        self.advance(now);
    }

    fn advance(&mut self, now: Millis) {
        let now = now.max(self.clock);
        while let Some(&(due, session)) = self.timers.first() {
            if due > now {
                break;
            }
            self.timers.pop_first();
            self.clock = self.clock.max(due);
            self.flush(session);
        }
        self.clock = now;
    }

    fn flush(&mut self, session: SessionId) {
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        s.batch_due = None;
        let batch = std::mem::take(&mut s.batch);
        for target in &batch {
            if let Some((_, queued)) = s.subs.get_mut(target) {
                *queued = false;
            }
        }
        let viewer = s.user;
        for target in batch {
            let presence = self.known(viewer, target).cloned().unwrap_or_default();
            self.outputs.push_back(Output::Push {
                to: session,
                target,
                tier: Tier::Batched,
                presence,
            });
        }
    }

    fn dequeue(&mut self, session: SessionId, target: UserId) {
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        let Some((_, queued)) = s.subs.get_mut(&target) else {
            return;
        };
        if !*queued {
            return;
        }
        *queued = false;
        s.batch.retain(|&t| t != target);
        if s.batch.is_empty() {
            if let Some(due) = s.batch_due.take() {
                self.timers.remove(&(due, session));
            }
        }
    }

    /// Forgets the target's views once nobody here watches it: the edge's
    /// memory follows its sessions' subscriptions.
    fn unwatch(&mut self, target: UserId, session: SessionId) {
        if let Some(known) = self.known.get_mut(&target) {
            known.watchers.remove(&session);
            if known.watchers.is_empty() {
                self.known.remove(&target);
            }
        }
    }
}
