//! The shard owner's side of a core (in a cluster): publishing every view
//! once, epochs, restoring a shard's users from the KV, and the hold on
//! offlines while edges resend their devices.

use super::*;

impl Core {
    /// Makes this core a shard owner's (or back): every published view and
    /// every change of a user's truth is also queued for
    /// [`Core::poll_published`], whether or not anybody subscribed here, so
    /// the driver can publish it once on the shard's subject. Off on one node.
    pub fn set_publish_views(&mut self, on: bool) {
        if on {
            self.cluster.get_or_insert_with(Default::default);
        } else {
            self.cluster = None;
        }
    }

    /// The next view to publish (owner only). Drain after every input, like
    /// [`Core::poll_output`]; the order is the order of the changes.
    pub fn poll_published(&mut self) -> Option<Published> {
        self.cluster.as_deref_mut()?.published.pop_front()
    }

    /// Every version issued from now on is above `epoch_base(epoch)`, so a
    /// watcher's `View` takes this owner's views over any older owner's, and
    /// never goes back. Call on a fresh core when claiming a shard, before
    /// restoring its users. Never lowers a version.
    pub fn enter_epoch(&mut self, epoch: Epoch) {
        let base = epoch_base(epoch);
        self.version_floor = self.version_floor.max(base);
        let Core { users, index, .. } = self;
        for (slot, u) in users.iter_mut().enumerate() {
            if index.get(u.id) == Some(slot as u32) && u.version < base {
                u.version = base;
            }
        }
    }

    /// What an edge's subscribe of `target` is answered with, by the owner
    /// of `target`: the published view, or for `own` (the subscriber is
    /// `target` itself) the truth. Creates the record of a user never seen,
    /// as a subscribe on one node does, so its versions start at the
    /// epoch's floor. A user read back from an older view than watchers
    /// were shown (`behind`, published again after the debounce) is
    /// answered with what she shows now at her current version: the view
    /// read back is stale (it showed an invisible user online: seed 13686).
    pub fn handle_snapshot(
        &mut self,
        now: Millis,
        target: UserId,
        own: bool,
    ) -> Result<Presence, Error> {
        self.advance(now);
        let t = self.user_slot(target)?;
        self.counters.snapshots += 1;
        let u = &self.users[t as usize];
        Ok(if own {
            self.own_view(t)
        } else if u.behind {
            let version = u.version;
            Presence {
                version,
                ..self.shown_view(t)
            }
        } else {
            u.published.clone()
        })
    }

    /// A cluster owner whose user's published view is of an earlier
    /// epoch (restored from the KV): it is published again under this
    /// epoch even if unchanged, since the KV's copy is written behind and
    /// watchers may have been shown a later view of the old owner's that
    /// never reached it; only a version of this epoch takes that back.
    pub(super) fn stale_epoch(&self, user: u32) -> bool {
        self.cluster.is_some()
            && crate::cluster::epoch_of(self.users[user as usize].published.version) < self.epoch()
    }

    /// The epoch of the versions this core issues (0 on one node).
    pub fn epoch(&self) -> Epoch {
        crate::cluster::epoch_of(self.version_floor)
    }

    /// Restores a user of a newly claimed shard from the KV: preferences and
    /// last seen, the last published view (with its version, so a snapshot
    /// shows what watchers were last told), and each recorded device as
    /// Lingering until `linger_until` at the earliest (the end of the resync
    /// window), heard from at its recorded time, in the foreground or the
    /// background as recorded (a backgrounded one shows nobody present). If
    /// what the user is shown now differs from the restored view, a debounce
    /// starts, so the view heals (after [`Core::hold_offline_until`] for an
    /// offline). Refused like [`Core::restore`]. Returns the devices' new
    /// sessions.
    pub fn restore_owned(
        &mut self,
        now: Millis,
        user: UserId,
        record: &OwnedRecord,
        linger_until: Millis,
    ) -> Result<Vec<SessionId>, Error> {
        self.advance(now);
        if record.devices.len() > self.config.max_devices_per_user {
            return Err(self.limit(Limit::DevicesPerUser));
        }
        self.restore(user, record.saved())?;
        let u = self.index.get(user).ok_or(Error::UnknownSession)?;
        let floor = self.users[u as usize].version;
        let rec = &mut self.users[u as usize];
        let was_online = std::mem::replace(&mut rec.published, record.published.clone()).online;
        rec.version = floor.max(record.published.version).max(record.shown_before);
        rec.behind = record.published.version < record.shown_before;
        self.group_published(user, was_online, record.published.online);
        let mut sessions = Vec::with_capacity(record.devices.len());
        for d in &record.devices {
            let connected = self.handle_connect(
                now,
                Connect {
                    user,
                    device: d.device,
                    kind: d.kind,
                    watch: Watch::All,
                    resume: None,
                    foreground: d.foreground,
                },
            )?;
            let id = connected.session;
            self.handle_disconnect_until(now, id, now, linger_until)?;
            let clock = self.clock;
            if let Some(session) = self.session_mut(id).filter(|s| s.lingering) {
                session.link_at = d.last_heard.min(clock);
            }
            sessions.push(id);
        }
        let shown = self.shown_view(u);
        let rec = &self.users[u as usize];
        let again = self.stale_epoch(u) || rec.behind;
        if rec.debounce_due.is_none() && (!shown.same_view(&rec.published) || again) {
            let due = self.clock.plus(self.config.debounce);
            self.users[u as usize].debounce_due = Some(due);
            self.timers.insert((due, Timer::Debounce(user)));
        }
        Ok(sessions)
    }

    /// A new owner's resync window: until `until`, no user goes from shown
    /// online to shown offline through the debounce (the offline waits for
    /// the window to close, and is published then if it still holds), since
    /// an edge may yet resend a live device of theirs. Going invisible is
    /// still published at once (I5). Turns on [`Core::set_publish_views`].
    pub fn hold_offline_until(&mut self, until: Millis) {
        let cluster = self.cluster.get_or_insert_with(Default::default);
        cluster.hold_offline_until = cluster.hold_offline_until.max(until);
    }

    /// The end of the hold if `user`'s debounce ending now must wait for it:
    /// an offline after an online, or a restored offline published again
    /// under this epoch (watchers may have been shown a later online view
    /// of the old owner's that the KV never got, and an edge may yet resend
    /// the device behind it).
    pub(super) fn held_until(&self, user: u32, shown: &Presence) -> Option<Millis> {
        let hold = self.cluster.as_deref()?.hold_offline_until;
        let u = &self.users[user as usize];
        let restored = self.stale_epoch(user) || u.behind;
        (hold > self.clock && (u.published.online || restored) && !shown.online && !u.invisible)
            .then_some(hold)
    }

    /// An edge's node lease expired: each of `sessions` (the devices it
    /// held) that is still Online is lost as by [`Core::handle_disconnect`],
    /// last heard at `last_heard` (the lease's last renewal), so a device
    /// that reconnects to another edge within grace resumes unseen. Sessions
    /// already Lingering or gone are skipped. Returns how many were lost.
    pub fn handle_edge_lost(
        &mut self,
        now: Millis,
        sessions: &[SessionId],
        last_heard: Millis,
    ) -> usize {
        self.advance(now);
        sessions
            .iter()
            .filter(|&&s| self.handle_disconnect(now, s, last_heard).is_ok())
            .count()
    }
}
