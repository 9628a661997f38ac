//! `Core::check_invariants()` (feature `check`): a full structural check of
//! the state, run after every step by property tests, fuzzers and the model.

use crate::engine::{tier_index, Core, Link, User};
use crate::timers::Timer;
use crate::types::{Millis, SessionId, Tier};
use std::collections::BTreeSet;

impl Core {
    /// Checks every structural invariant; the first violation found is
    /// returned with the invariant's id (I1…I12) where it maps to one.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut expected_timers = BTreeSet::new();
        let mut live = 0;
        let free: BTreeSet<u32> = self.free_users.iter().copied().collect();
        ensure(free.len() == self.free_users.len(), || {
            "a user slot is free twice".to_string()
        })?;
        // Subscriptions held to each user slot, Online or Lingering.
        let mut subscribers = vec![0u32; self.users.len()];
        for (index, slot) in self.slots.iter().enumerate() {
            let Some(s) = &slot.session else { continue };
            live += 1;
            let id = SessionId::new(index as u32, slot.generation);
            let user = self
                .users
                .get(s.user as usize)
                .filter(|_| !free.contains(&s.user))
                .ok_or_else(|| format!("session {id} of unknown user slot {}", s.user))?;
            ensure(user.sessions.contains(&id), || {
                format!("I1: session {id} missing from its user's sessions")
            })?;
            expected_timers.insert((s.lease_due, Timer::Lease(id)));
            ensure(s.link().last_heard() <= self.clock, || {
                format!("{id} was last heard after now")
            })?;
            match s.link() {
                Link::Online { last_activity } => {
                    let deadline = last_activity.plus(self.config.kind(s.kind).heartbeat_timeout);
                    ensure(s.lease_due <= deadline, || {
                        format!("I2: lease of {id} armed after its heartbeat deadline")
                    })?;
                    ensure(deadline > self.clock, || {
                        format!(
                            "I2: ghost {id}: heartbeat deadline {deadline} <= now {}",
                            self.clock
                        )
                    })?;
                }
                Link::Lingering { .. } => {
                    let until = s.lease_due;
                    ensure(until > self.clock, || {
                        format!("I2: lingering {id} past grace ({until} <= {})", self.clock)
                    })?;
                }
            }
            let Some(subs) = s.subs.as_deref() else {
                continue;
            };
            ensure(!subs.list.is_empty(), || {
                format!("{id} keeps an empty subscription box")
            })?;
            ensure(
                subs.list.len() <= self.config.max_subscriptions_per_session,
                || format!("{id} over the subscription cap"),
            )?;
            ensure(
                subs.list.windows(2).all(|w| w[0].target < w[1].target),
                || format!("{id} subscriptions not sorted"),
            )?;
            let online = matches!(s.link(), Link::Online { .. });
            for sub in &subs.list {
                let target = self
                    .users
                    .get(sub.target as usize)
                    .filter(|_| !free.contains(&sub.target))
                    .ok_or_else(|| format!("{id} subscribed to unknown user slot"))?;
                subscribers[sub.target as usize] += 1;
                ensure(sub.target == s.user || s.watch.allows(target.id), || {
                    format!("I11: {id} subscribed to {:?} outside its watch", target.id)
                })?;
                let own = sub.target == s.user;
                let listed = target
                    .watchers
                    .as_deref()
                    .is_some_and(|w| w.list(own, sub.tier).binary_search(&id).is_ok());
                ensure(listed == online, || {
                    format!(
                        "I10: {id} listed={listed} under {:?} while online={online}",
                        target.id
                    )
                })?;
                ensure(sub.queued == subs.batch.contains(&sub.target), || {
                    format!(
                        "{id}: queued flag of {:?} disagrees with its batch",
                        target.id
                    )
                })?;
                ensure(!sub.queued || sub.tier == Tier::Batched, || {
                    format!("{id}: realtime subscription queued")
                })?;
            }
            ensure(
                subs.batch.len() == subs.list.iter().filter(|s| s.queued).count(),
                || format!("{id}: batch holds duplicates or strangers"),
            )?;
            ensure(subs.batch_due.is_some() != subs.batch.is_empty(), || {
                format!("{id}: batch deadline without batch, or the reverse")
            })?;
            ensure(online || subs.batch.is_empty(), || {
                format!("{id}: lingering with a batch")
            })?;
            if let Some(due) = subs.batch_due {
                expected_timers.insert((due, Timer::Batch(id)));
            }
        }
        ensure(self.index.len() + free.len() == self.users.len(), || {
            "index size is off".to_string()
        })?;
        ensure(live == self.live_sessions, || {
            "live session count is off".to_string()
        })?;

        let mut present = 0;
        for (u, user) in self.users.iter().enumerate() {
            if free.contains(&(u as u32)) {
                ensure(*user == User::vacant(), || {
                    format!("released user slot {u} is not vacant")
                })?;
                continue;
            }
            ensure(self.index.get(user.id) == Some(u as u32), || {
                format!("index does not map {:?} to slot {u}", user.id)
            })?;
            let held = subscribers[u];
            ensure(user.subscribers == held, || {
                format!(
                    "{:?} counts {} subscribers, sessions hold {held}",
                    user.id, user.subscribers
                )
            })?;
            ensure(user.heard <= self.clock, || {
                format!("{:?} was heard from after now", user.id)
            })?;
            ensure(
                !user.sessions.is_empty() || user.heard == Millis::ZERO,
                || format!("{:?} keeps a last heard without a session", user.id),
            )?;
            let mut devices = BTreeSet::new();
            for &sid in &user.sessions {
                let s = self
                    .session(sid)
                    .ok_or_else(|| format!("I1: {:?} lists dead session {sid}", user.id))?;
                ensure(s.user as usize == u, || {
                    format!("{sid} listed under another user")
                })?;
                ensure(devices.insert(s.device), || {
                    format!("{:?} has two sessions on device {:?}", user.id, s.device)
                })?;
            }
            // I12: presence counts foreground devices only (any device
            // under `Backgrounded::Away`), in the gauge as in the views.
            let is_present = self.is_present(u as u32);
            present += usize::from(is_present);
            ensure(self.own_view(u as u32).online == is_present, || {
                format!(
                    "I12: {:?} own view online disagrees with its devices",
                    user.id
                )
            })?;
            // I6/I12: without a debounce running, others are shown exactly
            // what was last published (a foreground/background change that
            // skipped the debounce would show here).
            ensure(
                user.debounce_due.is_some() || user.published.same_view(&self.shown_view(u as u32)),
                || {
                    format!(
                        "I12: {:?} shown differs from published with no debounce",
                        user.id
                    )
                },
            )?;
            ensure(user.published.version <= user.version, || {
                format!("I7: {:?} published a version above its counter", user.id)
            })?;
            ensure(!(user.invisible && user.published.online), || {
                format!("I5: invisible {:?} published as online", user.id)
            })?;
            if let Some(due) = user.debounce_due {
                expected_timers.insert((due, Timer::Debounce(user.id)));
            }
            if let Some(w) = user.watchers.as_deref() {
                ensure(
                    w.others[tier_index(Tier::Realtime)].len()
                        <= self.config.max_realtime_per_target,
                    || format!("{:?} over the realtime fan-out cap", user.id),
                )?;
                let lists = [(false, &w.others), (true, &w.own)];
                let mut any = false;
                for (own, tiers) in lists {
                    for (tier, list) in [Tier::Realtime, Tier::Batched].into_iter().zip(tiers) {
                        any |= !list.is_empty();
                        ensure(list.windows(2).all(|p| p[0] < p[1]), || {
                            format!("watchers of {:?} unsorted", user.id)
                        })?;
                        for &sid in list {
                            self.check_watcher(sid, u as u32, own, tier)?;
                        }
                    }
                }
                ensure(any, || format!("{:?} keeps an empty watcher box", user.id))?;
            }
        }

        ensure(present as u64 == self.counters.users_online, || {
            format!(
                "I12: {present} users present, the gauge says {}",
                self.counters.users_online
            )
        })?;

        self.check_groups(&mut expected_timers)?;
        let timers = self.timers.set();
        ensure(*timers == expected_timers, || {
            let extra: Vec<_> = timers.difference(&expected_timers).collect();
            let missing: Vec<_> = expected_timers.difference(timers).collect();
            format!("timers disagree with state: extra {extra:?}, missing {missing:?}")
        })?;
        ensure(self.timers.first_is_cached(), || {
            "the earliest deadline kept at hand is not the set's first".to_string()
        })?;
        Ok(())
    }

    fn check_watcher(
        &self,
        sid: SessionId,
        target: u32,
        own: bool,
        tier: Tier,
    ) -> Result<(), String> {
        let s = self
            .session(sid)
            .ok_or_else(|| format!("I10: dead session {sid} still watches user slot {target}"))?;
        ensure(matches!(s.link(), Link::Online { .. }), || {
            format!("I10: lingering {sid} listed as a watcher")
        })?;
        ensure((s.user == target) == own, || {
            format!("{sid} in the wrong own/others list")
        })?;
        let sub = s
            .subs
            .as_deref()
            .and_then(|subs| subs.list.iter().find(|sub| sub.target == target));
        ensure(sub.is_some_and(|sub| sub.tier == tier), || {
            format!("{sid} listed as a watcher without that subscription")
        })
    }
}

fn ensure(ok: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(why())
    }
}
