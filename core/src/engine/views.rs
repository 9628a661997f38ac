//! Subscriptions, and the views they see: what each user is shown, the
//! debounce before a change is published, and the fan-out to watchers.

use super::*;

impl Core {
    // ----- subscriptions ----------------------------------------------------

    pub(super) fn realtime_has_room(&self, viewer: u32, target: u32, tier: Tier) -> bool {
        tier == Tier::Batched
            || viewer == target
            || self.users[target as usize]
                .watchers
                .as_deref()
                .map_or(0, |w| w.others[0].len())
                < self.config.max_realtime_per_target
    }

    /// Subscribes an Online session that is not yet subscribed to `target`.
    pub(super) fn attach(
        &mut self,
        id: SessionId,
        target: u32,
        mut tier: Tier,
        may_reject: bool,
    ) -> Result<Snapshot, Error> {
        let Some(viewer) = self.session(id).map(|s| s.user) else {
            return Err(Error::Stale);
        };
        if !self.realtime_has_room(viewer, target, tier) {
            if may_reject && self.config.realtime_overflow == RealtimeOverflow::Reject {
                return Err(self.limit(Limit::RealtimePerTarget));
            }
            tier = Tier::Batched;
            self.counters.downgraded += 1;
        }
        let own = viewer == target;
        let list = self.users[target as usize]
            .watchers
            .get_or_insert_with(Default::default)
            .list_mut(own, tier);
        if let Err(at) = list.binary_search(&id) {
            list.insert(at, id);
        }
        if let Some(session) = self.session_mut(id) {
            let subs = session.subs.get_or_insert_with(Default::default);
            if let Err(at) = subs.list.binary_search_by_key(&target, |s| s.target) {
                subs.list.insert(
                    at,
                    Sub {
                        target,
                        tier,
                        queued: false,
                    },
                );
                self.users[target as usize].subscribers += 1;
            }
        }
        self.counters.snapshots += 1;
        Ok(Snapshot {
            target: self.users[target as usize].id,
            tier,
            presence: self.view_of(Some(viewer), target),
        })
    }

    /// Unsubscribes; false if the session was not subscribed to `target`.
    pub(super) fn detach(&mut self, id: SessionId, target: u32) -> bool {
        self.dequeue(id, target);
        let Some(session) = self.session_mut(id) else {
            return false;
        };
        let viewer = session.user;
        let Some(subs) = session.subs.as_deref_mut() else {
            return false;
        };
        let Ok(at) = subs.list.binary_search_by_key(&target, |s| s.target) else {
            return false;
        };
        let sub = subs.list.remove(at);
        if subs.list.is_empty() {
            session.subs = None;
        }
        self.users[target as usize].subscribers -= 1;
        self.unlist(id, target, viewer == target, sub.tier);
        true
    }

    /// Drops `target` from the session's pending batch.
    pub(super) fn dequeue(&mut self, id: SessionId, target: u32) {
        let Some(subs) = self.session_mut(id).and_then(|s| s.subs.as_deref_mut()) else {
            return;
        };
        let Some(sub) = find_sub_mut(subs, target) else {
            return;
        };
        if !sub.queued {
            return;
        }
        sub.queued = false;
        subs.batch.retain(|&t| t != target);
        if subs.batch.is_empty() {
            if let Some(due) = subs.batch_due.take() {
                self.timers.remove(&(due, Timer::Batch(id)));
            }
        }
    }

    pub(super) fn unlist(&mut self, id: SessionId, target: u32, own: bool, tier: Tier) {
        let u = &mut self.users[target as usize];
        let Some(watchers) = u.watchers.as_deref_mut() else {
            return;
        };
        let list = watchers.list_mut(own, tier);
        if let Ok(at) = list.binary_search(&id) {
            list.remove(at);
        }
        if watchers.is_empty() {
            u.watchers = None;
        }
    }

    // ----- views, debounce and fan-out -------------------------------------

    pub(super) fn user_slot(&mut self, user: UserId) -> Result<u32, Error> {
        if let Some(u) = self.index.get(user) {
            return Ok(u);
        }
        if self.user_count() >= self.config.max_users {
            return Err(self.limit(Limit::Users));
        }
        let record = User::new(user, self.version_floor);
        let u = match self.free_users.pop() {
            Some(u) => {
                self.users[u as usize] = record;
                u
            }
            None => {
                self.users.push(record);
                (self.users.len() - 1) as u32
            }
        };
        self.index.insert(user, u);
        Ok(u)
    }

    pub(super) fn limit(&mut self, limit: Limit) -> Error {
        self.counters.limits_hit += 1;
        Error::LimitExceeded(limit)
    }

    /// Kinds of the user's present devices.
    pub(super) fn kinds(&self, user: u32) -> Kinds {
        self.present_sessions(user).map(|s| s.kind).collect()
    }

    /// What others would be shown now (version 0: not yet published).
    pub(crate) fn shown_view(&self, user: u32) -> Presence {
        let u = &self.users[user as usize];
        let hidden = u.invisible && !mutant!(self, InvisibleIgnored);
        if self.is_present(user) && !hidden {
            Presence {
                version: 0,
                online: true,
                status: self.shown_status(user),
                message: u.message.clone(),
                kinds: self.kinds(user),
                last_seen: None,
                invisible: false,
            }
        } else {
            Presence {
                last_seen: u.last_seen,
                ..Presence::default()
            }
        }
    }

    /// The truth, as the user's own sessions see it.
    pub(crate) fn own_view(&self, user: u32) -> Presence {
        let u = &self.users[user as usize];
        let online = self.is_present(user);
        Presence {
            version: u.version,
            online,
            status: self.shown_status(user),
            message: u.message.clone(),
            kinds: self.kinds(user),
            last_seen: if online { None } else { u.last_seen },
            invisible: u.invisible,
        }
    }

    /// What a session of `viewer` is told about `target`.
    pub(super) fn view_of(&self, viewer: Option<u32>, target: u32) -> Presence {
        if viewer == Some(target) {
            self.own_view(target)
        } else {
            self.users[target as usize].published.clone()
        }
    }

    pub(crate) fn views(&self, user: u32) -> Views {
        Views {
            shown: self.shown_view(user),
            own: self.own_view(user),
        }
    }

    /// After a change to `user`: last seen, the own view (pushed at once) and
    /// the shown view (debounced, except that going invisible is published
    /// at once so that no snapshot can show an invisible user online, I5).
    pub(crate) fn after_change(&mut self, user: u32, before: Views) {
        let clock = self.clock;
        let now_shown_online = self.is_present(user) && {
            let u = &self.users[user as usize];
            !u.invisible || mutant!(self, InvisibleIgnored)
        };
        let present = self.is_present(user);
        // Last seen is the last moment a device was heard from while others
        // saw the user online: a change nobody was shown (connect then
        // invisible inside one debounce window) must not move it, or it would
        // reveal the connection.
        let live_heard = self
            .present_sessions(user)
            .map(|s| s.link().last_heard())
            .max();
        let u = &mut self.users[user as usize];
        if before.shown.online && !now_shown_online && u.published.online {
            // No device present (gone, or in the background): their last
            // heard are in `heard`. Still present: the user went invisible,
            // which freezes it now.
            let heard = if present { clock } else { u.heard };
            u.last_seen = Some(if mutant!(self, LastSeenAtExpiry) {
                clock
            } else {
                heard.min(clock)
            });
        }
        // `heard` only matters while the user is shown, and only if no live
        // session was heard from as late: keep it zero otherwise, so that
        // equal situations are equal states (what a model checker counts).
        if !now_shown_online || live_heard.is_some_and(|live| u.heard <= live) {
            u.heard = Millis::ZERO;
        }
        let own_online = present;
        if before.own.online != own_online {
            if own_online {
                self.counters.users_online += 1;
            } else {
                self.counters.users_online -= 1;
            }
        }

        let own = self.own_view(user);
        if !own.same_view(&before.own) {
            self.users[user as usize].version += 1;
            if let Some(cluster) = self.cluster.as_deref_mut() {
                cluster.published.push_back(Published {
                    user: self.users[user as usize].id,
                    own: true,
                    presence: Presence {
                        version: self.users[user as usize].version,
                        ..own
                    },
                });
            }
            self.fan_out(user, true);
        }

        let shown = self.shown_view(user);
        let u = &self.users[user as usize];
        // Invisible while still published online: published at once even
        // if what is shown did not change with this input (a backgrounded
        // device went invisible inside the debounce of its going offline).
        let leak = u.invisible && u.published.online;
        if shown.same_view(&before.shown) && !leak {
            return;
        }
        if leak || mutant!(self, NoDebounce) {
            self.cancel_debounce(user);
            if !shown.same_view(&self.users[user as usize].published) {
                self.publish(user, shown);
            }
            return;
        }
        // (Re)start the window: a state is published only once it has held
        // for the whole of it (I6).
        self.cancel_debounce(user);
        let due = clock.plus(self.config.debounce);
        let u = &mut self.users[user as usize];
        u.debounce_due = Some(due);
        let id = u.id;
        self.timers.insert((due, Timer::Debounce(id)));
    }

    /// The user's device was heard from now (a logout, `SetInvisible`).
    pub(crate) fn heard(&mut self, user: u32) {
        let u = &mut self.users[user as usize];
        u.heard = u.heard.max(self.clock);
    }

    pub(super) fn cancel_debounce(&mut self, user: u32) {
        let u = &mut self.users[user as usize];
        if let Some(due) = u.debounce_due.take() {
            let id = u.id;
            self.timers.remove(&(due, Timer::Debounce(id)));
        }
    }

    pub(super) fn publish(&mut self, user: u32, mut shown: Presence) {
        let u = &mut self.users[user as usize];
        if mutant!(self, VersionNotBumped) {
            shown.version = u.published.version;
        } else {
            u.version += 1;
            shown.version = u.version;
        }
        let was_online = std::mem::replace(&mut u.published, shown).online;
        u.behind = false;
        let (id, online) = (u.id, u.published.online);
        self.group_published(id, was_online, online);
        self.counters.publishes += 1;
        if let Some(cluster) = self.cluster.as_deref_mut() {
            let u = &self.users[user as usize];
            cluster.published.push_back(Published {
                user: u.id,
                own: false,
                presence: u.published.clone(),
            });
        }
        self.fan_out(user, false);
    }

    /// Pushes the user's published view (or, for `own`, the truth) to its
    /// realtime subscribers and queues it for the batched ones.
    pub(super) fn fan_out(&mut self, user: u32, own: bool) {
        if self.users[user as usize].watchers.is_none() {
            return;
        }
        let presence = if own {
            self.own_view(user)
        } else {
            self.users[user as usize].published.clone()
        };
        let Core {
            users,
            slots,
            timers,
            outputs,
            counters,
            config,
            clock,
            ..
        } = self;
        let u = &users[user as usize];
        let Some(watchers) = u.watchers.as_deref() else {
            return;
        };
        for &to in watchers.list(own, Tier::Realtime) {
            counters.notifications_realtime += 1;
            outputs.push_back(Output::Push {
                to,
                target: u.id,
                tier: Tier::Realtime,
                presence: presence.clone(),
            });
        }
        for &to in watchers.list(own, Tier::Batched) {
            let Some(subs) = slots
                .get_mut(to.index())
                .filter(|slot| slot.generation == to.generation())
                .and_then(|slot| slot.session.as_mut())
                .and_then(|s| s.subs.as_deref_mut())
            else {
                continue; // only a mutant lists a dead session; check_invariants says so
            };
            let Some(sub) = find_sub_mut(subs, user) else {
                continue;
            };
            if sub.queued {
                continue; // coalesced: the flush sends the latest
            }
            sub.queued = true;
            subs.batch.push(user);
            if subs.batch_due.is_none() {
                let due = clock.plus(config.batch_interval);
                subs.batch_due = Some(due);
                timers.insert((due, Timer::Batch(to)));
            }
        }
    }
}
