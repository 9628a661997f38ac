//! The core's getters and its sessions: lookups, leases, lingering, parking
//! and the end of a session.

use super::*;

impl Core {
    // ----- getters ----------------------------------------------------------

    /// What others are shown of `user` (published, debounced).
    pub fn presence(&self, user: UserId) -> Presence {
        self.index
            .get(user)
            .map(|u| self.users[u as usize].published.clone())
            .unwrap_or_default()
    }

    /// What others would be shown of `user` if it were published now (the
    /// target of convergence, I8). Its version is the latest published one.
    pub fn shown(&self, user: UserId) -> Presence {
        match self.index.get(user) {
            Some(u) => Presence {
                version: self.users[u as usize].published.version,
                ..self.shown_view(u)
            },
            None => Presence::default(),
        }
    }

    /// The truth about `user`, as their own sessions see it.
    pub fn truth(&self, user: UserId) -> Presence {
        self.index
            .get(user)
            .map(|u| self.own_view(u))
            .unwrap_or_default()
    }

    /// Holds a live session: some device is Online or Lingering, in the
    /// foreground or not. Whether the user is present (what their own
    /// sessions see as online, I1 and I12) is [`Core::truth`]`.online`.
    pub fn is_online(&self, user: UserId) -> bool {
        self.index
            .get(user)
            .is_some_and(|u| !self.users[u as usize].sessions.is_empty())
    }

    /// Every session of `user`, Online or Lingering (a cluster's owner sends
    /// the user's truth to the edges holding them).
    pub fn sessions_of(&self, user: UserId) -> Vec<SessionId> {
        self.index
            .get(user)
            .map(|u| self.users[u as usize].sessions.to_vec())
            .unwrap_or_default()
    }

    /// Where to deliver a message to `user`: its Online sessions in the
    /// foreground, whatever its invisibility or status (I9, I12). Lingering
    /// and backgrounded devices are not routable: an application sends a
    /// push notification exactly when this is empty.
    pub fn route(&self, user: UserId) -> Vec<SessionId> {
        let Some(u) = self.index.get(user) else {
            return Vec::new();
        };
        self.users[u as usize]
            .sessions
            .iter()
            .copied()
            .filter(|&s| {
                self.session(s).is_some_and(|s| {
                    matches!(s.link(), Link::Online { .. })
                        && (!s.background || mutant!(self, BackgroundCounted))
                })
            })
            .collect()
    }

    /// What `session` is entitled to see of `target` now.
    pub fn view(&self, session: SessionId, target: UserId) -> Result<Presence, Error> {
        let s = self
            .session(session)
            .ok_or_else(|| self.classify(session))?;
        if self.users[s.user as usize].id != target && !s.watch.allows(target) {
            return Err(Error::NotAllowed);
        }
        Ok(match self.index.get(target) {
            Some(t) => self.view_of(Some(s.user), t),
            None => Presence::default(),
        })
    }

    /// A live session's owner, device and link.
    pub fn session_info(&self, session: SessionId) -> Option<SessionInfo> {
        self.session(session).map(|s| SessionInfo {
            user: self.users[s.user as usize].id,
            device: s.device,
            kind: s.kind,
            online: matches!(s.link(), Link::Online { .. }),
            foreground: !s.background,
        })
    }

    /// The session's subscriptions, by target.
    pub fn subscriptions(&self, session: SessionId) -> Vec<(UserId, Tier)> {
        self.session(session)
            .and_then(|s| s.subs.as_deref())
            .map(|subs| {
                subs.list
                    .iter()
                    .map(|sub| (self.users[sub.target as usize].id, sub.tier))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Sessions currently alive (Online or Lingering).
    pub fn session_count(&self) -> usize {
        self.live_sessions
    }

    /// Users the core keeps a record of.
    pub fn user_count(&self) -> usize {
        self.users.len() - self.free_users.len()
    }

    /// User records allocated, held or released and waiting for reuse: the
    /// core's memory for users follows this, the peak of `user_count`.
    pub fn user_slots(&self) -> usize {
        self.users.len()
    }

    // ----- sessions ---------------------------------------------------------

    pub(crate) fn session(&self, id: SessionId) -> Option<&Session> {
        self.slots
            .get(id.index())
            .filter(|slot| slot.generation == id.generation())
            .and_then(|slot| slot.session.as_ref())
    }

    pub(crate) fn session_mut(&mut self, id: SessionId) -> Option<&mut Session> {
        self.slots
            .get_mut(id.index())
            .filter(|slot| slot.generation == id.generation())
            .and_then(|slot| slot.session.as_mut())
    }

    /// Why `id` names no live session.
    pub(super) fn classify(&self, id: SessionId) -> Error {
        match self.slots.get(id.index()) {
            Some(slot) if id.generation() != 0 && id.generation() <= slot.generation => {
                Error::Stale
            }
            _ => Error::UnknownSession,
        }
    }

    /// A live (Online or Lingering) session, or why not.
    pub(super) fn current(&mut self, id: SessionId) -> Result<SessionId, Error> {
        if self.session(id).is_some() {
            return Ok(id);
        }
        if mutant!(self, IgnoreStale) {
            if let Some(current) = self.tombstone_target(id) {
                return Ok(current);
            }
        }
        let error = self.classify(id);
        if error == Error::Stale {
            self.counters.stale_inputs += 1;
        }
        Err(error)
    }

    /// An Online session, or why not (a Lingering session is `Stale` here).
    pub(crate) fn online(&mut self, id: SessionId) -> Result<SessionId, Error> {
        let id = self.current(id)?;
        match self.session(id).map(|s| s.link()) {
            Some(Link::Online { .. }) => Ok(id),
            _ => {
                self.counters.stale_inputs += 1;
                Err(Error::Stale)
            }
        }
    }

    #[cfg(feature = "mutants")]
    pub(super) fn tombstone_target(&self, id: SessionId) -> Option<SessionId> {
        let &(user, device) = self.tombstones.get(&id)?;
        self.device_session(user, device)
    }

    #[cfg(not(feature = "mutants"))]
    pub(super) fn tombstone_target(&self, _: SessionId) -> Option<SessionId> {
        None
    }

    pub(super) fn device_session(&self, user: u32, device: DeviceId) -> Option<SessionId> {
        self.users[user as usize]
            .sessions
            .iter()
            .copied()
            .find(|&s| self.session(s).is_some_and(|s| s.device == device))
    }

    pub(super) fn insert_session(&mut self, user: u32, c: &Connect) -> SessionId {
        let index = match self.free.pop() {
            Some(index) => {
                let slot = &mut self.slots[index as usize];
                slot.generation += 1;
                index
            }
            None => {
                self.slots.push(Slot {
                    generation: 1,
                    session: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[index as usize];
        let id = SessionId::new(index, slot.generation);
        let lease_due = self.clock.plus(self.config.kind(c.kind).heartbeat_timeout);
        slot.session = Some(Session {
            user,
            device: c.device,
            kind: c.kind,
            lingering: false,
            background: !c.foreground,
            link_at: self.clock,
            lease_due,
            watch: c.watch.clone(),
            subs: None,
        });
        self.timers.insert((lease_due, Timer::Lease(id)));
        // Grow one at a time: most users have one or two devices, and the
        // default growth to four would cost 16 bytes per device at scale.
        let sessions = &mut self.users[user as usize].sessions;
        sessions.reserve_exact(1);
        sessions.push(id);
        self.live_sessions += 1;
        self.counters.sessions_started += 1;
        self.counters.sessions_online += 1;
        id
    }

    pub(super) fn set_lease(&mut self, id: SessionId, due: Millis) {
        let Some(session) = self.session_mut(id) else {
            return;
        };
        let old = std::mem::replace(&mut session.lease_due, due);
        self.timers.remove(&(old, Timer::Lease(id)));
        self.timers.insert((due, Timer::Lease(id)));
    }

    /// Online → Lingering: the lease becomes the grace deadline and the
    /// subscriptions are parked (nothing is pushed to a lost connection; a
    /// resume gets fresh snapshots instead).
    pub(super) fn linger(&mut self, id: SessionId, last_heard: Millis) {
        let Some(session) = self.session(id) else {
            return;
        };
        let until = self.clock.plus(self.config.kind(session.kind).grace);
        self.park(id);
        if let Some(session) = self.session_mut(id) {
            session.set_link(Link::Lingering { last_heard });
        }
        self.set_lease(id, until);
        self.counters.disconnects += 1;
        self.counters.sessions_online -= 1;
        self.counters.sessions_lingering += 1;
    }

    /// Removes an Online session from its targets' lists and drops its pending
    /// batch; its subscriptions stay recorded in the session.
    pub(super) fn park(&mut self, id: SessionId) {
        let Some(session) = self.session_mut(id) else {
            return;
        };
        let user = session.user;
        let Some(subs) = session.subs.as_deref_mut() else {
            return;
        };
        let due = subs.batch_due.take();
        subs.batch.clear();
        for sub in &mut subs.list {
            sub.queued = false;
        }
        let list: Vec<Sub> = subs.list.clone();
        if let Some(due) = due {
            self.timers.remove(&(due, Timer::Batch(id)));
        }
        for sub in list {
            self.unlist(id, sub.target, sub.target == user, sub.tier);
        }
    }

    /// Takes the subscriptions out of a session (for a resume).
    pub(super) fn detach_subs(&mut self, id: SessionId) -> Vec<Sub> {
        let online = self
            .session(id)
            .is_some_and(|s| matches!(s.link(), Link::Online { .. }));
        if online {
            self.park(id);
        }
        let list = self
            .session_mut(id)
            .and_then(|s| s.subs.take())
            .map(|subs| subs.list)
            .unwrap_or_default();
        for sub in &list {
            self.users[sub.target as usize].subscribers -= 1;
        }
        list
    }

    /// Ends a live session: no more outputs to it, its subscriptions end.
    pub(super) fn end_session(&mut self, id: SessionId, reason: EndReason) {
        let keep_listed = reason == EndReason::LoggedOut && mutant!(self, KeepSubsAfterLogout);
        let online = self
            .session(id)
            .is_some_and(|s| matches!(s.link(), Link::Online { .. }));
        if online && !keep_listed {
            self.park(id);
        }
        let Some(slot) = self.slots.get_mut(id.index()) else {
            return;
        };
        let Some(session) = slot.session.take() else {
            return;
        };
        if slot.generation < u32::MAX {
            self.free.push(id.index() as u32);
        }
        self.group_session_ended(id);
        self.timers.remove(&(session.lease_due, Timer::Lease(id)));
        if let Some(subs) = session.subs.as_deref() {
            if let Some(due) = subs.batch_due {
                self.timers.remove(&(due, Timer::Batch(id)));
            }
            for sub in &subs.list {
                self.users[sub.target as usize].subscribers -= 1;
            }
        }
        #[cfg(feature = "mutants")]
        if self.mutant == Some(crate::mutants::Mutant::IgnoreStale)
            && reason == EndReason::Superseded
        {
            self.tombstones.insert(id, (session.user, session.device));
        }
        // A backgrounded device was last present when it went to the
        // background, which `heard` took then (I12): its later keep-alives
        // do not count.
        let present = self.present(&session);
        let u = &mut self.users[session.user as usize];
        u.sessions.retain(|&s| s != id);
        if present {
            u.heard = u.heard.max(session.link().last_heard());
        }
        self.live_sessions -= 1;
        match session.link() {
            Link::Online { .. } => self.counters.sessions_online -= 1,
            Link::Lingering { .. } => self.counters.sessions_lingering -= 1,
        }
        self.outputs.push_back(Output::SessionEnded {
            session: id,
            reason,
        });
    }
}
