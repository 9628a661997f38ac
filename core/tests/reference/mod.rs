//! A small, obviously correct reference implementation of DESIGN.md's
//! semantics: ordered maps, full scans, no lazy timers, no parking tricks.
//! Slow on purpose; the property tests compare every output of the real core
//! with it.
//!
//! Session ids are not semantics: the reference is told which id the core
//! issued. Everything else (errors, outputs and their order, views) must match.

use greendot_core::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

#[derive(Clone, Debug)]
struct RSub {
    tier: Tier,
    queued: bool,
}

#[derive(Clone, Debug)]
struct RSession {
    user: UserId,
    device: DeviceId,
    kind: DeviceKind,
    online: bool,
    /// The app is in the foreground (I12).
    foreground: bool,
    last_activity: u64,
    until: u64,
    /// While Lingering: when the connection was last heard from.
    last_heard: u64,
    watch: Watch,
    subs: BTreeMap<UserId, RSub>,
    batch: Vec<UserId>,
    batch_due: Option<u64>,
}

#[derive(Clone, Debug, Default)]
struct RUser {
    status: Status,
    message: Option<Arc<str>>,
    invisible: bool,
    last_seen: Option<u64>,
    /// The latest moment any device of the user was heard from since others
    /// were last shown them going online (what last seen becomes when they
    /// stop being shown).
    heard_while_shown: u64,
    version: u64,
    published: Presence,
    debounce_due: Option<u64>,
    /// When what others would be shown last changed (I6).
    shown_changed_at: u64,
}

pub struct Reference {
    cfg: Config,
    now: u64,
    users: BTreeMap<UserId, RUser>,
    sessions: BTreeMap<SessionId, RSession>,
    issued: BTreeSet<SessionId>,
    /// The highest version of any released user.
    version_floor: u64,
    pub out: Vec<Output>,
    /// Publishes that went out after less than a full debounce window (I6);
    /// must stay empty.
    pub early_publishes: Vec<(UserId, u64)>,
}

struct Before {
    shown: Presence,
    own: Presence,
}

enum Due {
    Lease(SessionId),
    Debounce(UserId),
    Batch(SessionId),
}

impl Reference {
    pub fn new(cfg: Config) -> Reference {
        Reference {
            cfg,
            now: 0,
            users: BTreeMap::new(),
            sessions: BTreeMap::new(),
            issued: BTreeSet::new(),
            version_floor: 0,
            out: Vec::new(),
            early_publishes: Vec::new(),
        }
    }

    pub fn take_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.out)
    }

    // ----- time --------------------------------------------------------------

    fn lease_deadline(&self, s: &RSession) -> u64 {
        if s.online {
            s.last_activity + self.cfg.kind(s.kind).heartbeat_timeout.0
        } else {
            s.until
        }
    }

    /// The earliest deadline, ties broken like the core: leases, then
    /// debounces, then batches, each by id.
    fn next_due(&self) -> Option<(u64, u8, u64, Due)> {
        let mut best: Option<(u64, u8, u64, Due)> = None;
        let mut consider = |key: (u64, u8, u64), due: Due| {
            if best.as_ref().is_none_or(|b| key < (b.0, b.1, b.2)) {
                best = Some((key.0, key.1, key.2, due));
            }
        };
        for (&id, s) in &self.sessions {
            consider((self.lease_deadline(s), 0, id.0), Due::Lease(id));
            if let Some(d) = s.batch_due {
                consider((d, 2, id.0), Due::Batch(id));
            }
        }
        for (&id, u) in &self.users {
            if let Some(d) = u.debounce_due {
                consider((d, 1, id.0), Due::Debounce(id));
            }
        }
        best
    }

    pub fn advance(&mut self, now: u64) {
        let now = now.max(self.now);
        while let Some((at, _, _, due)) = self.next_due() {
            if at > now {
                break;
            }
            self.now = self.now.max(at);
            match due {
                Due::Lease(id) => {
                    let user = self.sessions[&id].user;
                    let reason = if self.sessions[&id].online {
                        EndReason::HeartbeatTimeout
                    } else {
                        EndReason::GraceExpired
                    };
                    let before = self.before(user);
                    self.end(id, reason);
                    self.after(user, before);
                }
                Due::Debounce(user) => {
                    let u = self.users.get_mut(&user).unwrap();
                    u.debounce_due = None;
                    let shown = self.shown(user);
                    if !shown.same_view(&self.users[&user].published) {
                        if self.now - self.users[&user].shown_changed_at < self.cfg.debounce.0 {
                            self.early_publishes.push((user, self.now));
                        }
                        self.publish(user, shown);
                    }
                }
                Due::Batch(id) => {
                    let s = self.sessions.get_mut(&id).unwrap();
                    s.batch_due = None;
                    let batch = std::mem::take(&mut s.batch);
                    for t in &batch {
                        s.subs.get_mut(t).unwrap().queued = false;
                    }
                    let viewer = s.user;
                    for target in batch {
                        let presence = self.view_of(viewer, target);
                        self.out.push(Output::Push {
                            to: id,
                            target,
                            tier: Tier::Batched,
                            presence,
                        });
                    }
                }
            }
        }
        self.now = now;
    }

    // ----- views ---------------------------------------------------------------

    fn live_sessions_of(&self, user: UserId) -> impl Iterator<Item = (&SessionId, &RSession)> {
        self.sessions.iter().filter(move |(_, s)| s.user == user)
    }

    /// A device counts as present in the foreground, or under
    /// `Backgrounded::Away` whatever its app does (I12).
    fn counts(&self, s: &RSession) -> bool {
        s.foreground || self.cfg.backgrounded == Backgrounded::Away
    }

    fn present_of(&self, user: UserId) -> impl Iterator<Item = &RSession> {
        self.live_sessions_of(user)
            .map(|(_, s)| s)
            .filter(|s| self.counts(s))
    }

    fn kinds(&self, user: UserId) -> Kinds {
        self.present_of(user).map(|s| s.kind).collect()
    }

    /// Some device present (I1, I12).
    fn really_online(&self, user: UserId) -> bool {
        self.present_of(user).next().is_some()
    }

    /// `Away` under `Backgrounded::Away` while every device is in the
    /// background and the choice is `Available`.
    fn status(&self, user: UserId) -> Status {
        let chosen = self.users[&user].status;
        let mut live = self.live_sessions_of(user).peekable();
        let all_background = live.peek().is_some() && live.all(|(_, s)| !s.foreground);
        if self.cfg.backgrounded == Backgrounded::Away
            && all_background
            && chosen == Status::Available
        {
            Status::Away
        } else {
            chosen
        }
    }

    fn shown(&self, user: UserId) -> Presence {
        let u = &self.users[&user];
        if self.really_online(user) && !u.invisible {
            Presence {
                version: 0,
                online: true,
                status: self.status(user),
                message: u.message.clone(),
                kinds: self.kinds(user),
                last_seen: None,
                invisible: false,
            }
        } else {
            Presence {
                last_seen: u.last_seen.map(Millis),
                ..Presence::default()
            }
        }
    }

    fn own(&self, user: UserId) -> Presence {
        let u = &self.users[&user];
        let online = self.really_online(user);
        Presence {
            version: u.version,
            online,
            status: self.status(user),
            message: u.message.clone(),
            kinds: self.kinds(user),
            last_seen: if online {
                None
            } else {
                u.last_seen.map(Millis)
            },
            invisible: u.invisible,
        }
    }

    fn view_of(&self, viewer: UserId, target: UserId) -> Presence {
        if viewer == target {
            self.own(target)
        } else {
            self.users
                .get(&target)
                .map(|u| u.published.clone())
                .unwrap_or_default()
        }
    }

    fn before(&self, user: UserId) -> Before {
        Before {
            shown: self.shown(user),
            own: self.own(user),
        }
    }

    /// A device of `user` was heard from at `at`.
    fn heard(&mut self, user: UserId, at: u64) {
        let u = self.users.get_mut(&user).unwrap();
        u.heard_while_shown = u.heard_while_shown.max(at);
    }

    fn after(&mut self, user: UserId, before: Before) {
        let now = self.now;
        let shown_online = self.really_online(user) && !self.users[&user].invisible;
        let u = self.users.get_mut(&user).unwrap();
        if !before.shown.online && shown_online {
            // Shown from now on: what was heard before does not count.
            u.heard_while_shown = now;
        }
        if before.shown.online && !shown_online && u.published.online {
            u.last_seen = Some(u.heard_while_shown);
        }
        if !self.own(user).same_view(&before.own) {
            self.users.get_mut(&user).unwrap().version += 1;
            self.fan_out(user, true);
        }
        let shown = self.shown(user);
        let u = &self.users[&user];
        let leak = u.invisible && u.published.online;
        if shown.same_view(&before.shown) && !leak {
            return;
        }
        let u = self.users.get_mut(&user).unwrap();
        u.shown_changed_at = now;
        u.debounce_due = None;
        if u.invisible && u.published.online {
            self.publish(user, shown); // I5 beats I6: hide at once
        } else {
            u.debounce_due = Some(now + self.cfg.debounce.0);
        }
    }

    fn publish(&mut self, user: UserId, mut shown: Presence) {
        let u = self.users.get_mut(&user).unwrap();
        u.version += 1;
        shown.version = u.version;
        u.published = shown;
        self.fan_out(user, false);
    }

    fn fan_out(&mut self, user: UserId, own: bool) {
        let presence = if own {
            self.own(user)
        } else {
            self.users[&user].published.clone()
        };
        let watchers: Vec<(SessionId, Tier)> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.online && (s.user == user) == own)
            .filter_map(|(id, s)| s.subs.get(&user).map(|sub| (*id, sub.tier)))
            .collect();
        for &(to, tier) in &watchers {
            if tier == Tier::Realtime {
                self.out.push(Output::Push {
                    to,
                    target: user,
                    tier,
                    presence: presence.clone(),
                });
            }
        }
        let interval = self.cfg.batch_interval.0;
        let now = self.now;
        for (to, tier) in watchers {
            if tier == Tier::Batched {
                let s = self.sessions.get_mut(&to).unwrap();
                let sub = s.subs.get_mut(&user).unwrap();
                if !sub.queued {
                    sub.queued = true;
                    s.batch.push(user);
                    s.batch_due.get_or_insert(now + interval);
                }
            }
        }
    }

    // ----- sessions -----------------------------------------------------------

    fn lookup(&self, id: SessionId, need_online: bool) -> Result<&RSession, Error> {
        match self.sessions.get(&id) {
            Some(s) if s.online || !need_online => Ok(s),
            Some(_) => Err(Error::Stale),
            None if self.issued.contains(&id) => Err(Error::Stale),
            None => Err(Error::UnknownSession),
        }
    }

    fn end(&mut self, id: SessionId, reason: EndReason) {
        self.sessions.remove(&id);
        self.out.push(Output::SessionEnded {
            session: id,
            reason,
        });
    }

    fn ensure_user(&mut self, user: UserId) -> Result<(), Error> {
        if !self.users.contains_key(&user) {
            if self.users.len() >= self.cfg.max_users {
                return Err(Error::LimitExceeded(Limit::Users));
            }
            let floor = self.version_floor;
            self.users.insert(
                user,
                RUser {
                    version: floor,
                    published: Presence {
                        version: floor,
                        ..Presence::default()
                    },
                    ..RUser::default()
                },
            );
        }
        Ok(())
    }

    fn realtime_room(&self, viewer: UserId, target: UserId, tier: Tier) -> bool {
        tier == Tier::Batched
            || viewer == target
            || self
                .sessions
                .values()
                .filter(|s| s.online && s.user != target)
                .filter(|s| {
                    s.subs
                        .get(&target)
                        .is_some_and(|sub| sub.tier == Tier::Realtime)
                })
                .count()
                < self.cfg.max_realtime_per_target
    }

    fn attach(
        &mut self,
        id: SessionId,
        target: UserId,
        tier: Tier,
        may_reject: bool,
    ) -> Result<Snapshot, Error> {
        let viewer = self.sessions[&id].user;
        let mut tier = tier;
        if !self.realtime_room(viewer, target, tier) {
            if may_reject && self.cfg.realtime_overflow == RealtimeOverflow::Reject {
                return Err(Error::LimitExceeded(Limit::RealtimePerTarget));
            }
            tier = Tier::Batched;
        }
        self.sessions.get_mut(&id).unwrap().subs.insert(
            target,
            RSub {
                tier,
                queued: false,
            },
        );
        Ok(Snapshot {
            target,
            tier,
            presence: self.view_of(viewer, target),
        })
    }

    fn dequeue(&mut self, id: SessionId, target: UserId) {
        let s = self.sessions.get_mut(&id).unwrap();
        if let Some(sub) = s.subs.get_mut(&target) {
            if sub.queued {
                sub.queued = false;
                s.batch.retain(|t| *t != target);
                if s.batch.is_empty() {
                    s.batch_due = None;
                }
            }
        }
    }

    // ----- inputs --------------------------------------------------------------

    /// `issued` is the id the core gave this connect, if it accepted it.
    pub fn connect(
        &mut self,
        now: u64,
        c: &Connect,
        issued: Option<SessionId>,
    ) -> Result<Connected, Error> {
        self.advance(now);
        let old = self
            .sessions
            .iter()
            .find(|(_, s)| s.user == c.user && s.device == c.device)
            .map(|(id, _)| *id);
        if old.is_none() {
            if self.sessions.len() >= self.cfg.max_sessions {
                return Err(Error::LimitExceeded(Limit::Sessions));
            }
            if self.live_sessions_of(c.user).count() >= self.cfg.max_devices_per_user {
                return Err(Error::LimitExceeded(Limit::DevicesPerUser));
            }
        }
        self.ensure_user(c.user)?;
        let id = issued.expect("the reference accepted a connect the core refused");
        let before = self.before(c.user);
        let mut carried = Vec::new();
        let mut resumed = false;
        let mut superseded = None;
        if let Some(old) = old {
            let s = &self.sessions[&old];
            if c.resume == Some(old) {
                resumed = true;
                carried = s.subs.iter().map(|(t, sub)| (*t, sub.tier)).collect();
            }
            if s.online {
                superseded = Some(old);
            }
            self.end(old, EndReason::Superseded);
        }
        self.issued.insert(id);
        self.sessions.insert(
            id,
            RSession {
                user: c.user,
                device: c.device,
                kind: c.kind,
                online: true,
                foreground: c.foreground,
                last_activity: self.now,
                until: 0,
                last_heard: 0,
                watch: c.watch.clone(),
                subs: BTreeMap::new(),
                batch: Vec::new(),
                batch_due: None,
            },
        );
        if self.counts(&self.sessions[&id]) {
            self.heard(c.user, self.now);
        }
        let mut snapshots = Vec::new();
        for (target, tier) in carried {
            if target != c.user && !c.watch.allows(target) {
                continue;
            }
            snapshots.push(self.attach(id, target, tier, false)?);
        }
        self.after(c.user, before);
        Ok(Connected {
            session: id,
            resumed,
            superseded,
            snapshots,
        })
    }

    pub fn activity(&mut self, now: u64, id: SessionId) -> Result<(), Error> {
        self.advance(now);
        let s = self.lookup(id, true)?;
        let (user, counts) = (s.user, self.counts(s));
        let now = self.now;
        self.sessions.get_mut(&id).unwrap().last_activity = now;
        // A backgrounded device's keep-alives do not count (I12).
        if counts {
            self.heard(user, now);
        }
        Ok(())
    }

    pub fn set_foreground(
        &mut self,
        now: u64,
        id: SessionId,
        foreground: bool,
    ) -> Result<(), Error> {
        self.advance(now);
        let s = self.lookup(id, true)?;
        let (user, counted) = (s.user, self.counts(s));
        let before = self.before(user);
        let now = self.now;
        let s = self.sessions.get_mut(&id).unwrap();
        s.foreground = foreground;
        s.last_activity = now;
        let counts = self.counts(&self.sessions[&id]);
        // Present until now, or from now on: heard now (I12 c).
        if counted || counts {
            self.heard(user, now);
        }
        self.after(user, before);
        Ok(())
    }

    pub fn disconnect(&mut self, now: u64, id: SessionId, last_heard: u64) -> Result<(), Error> {
        self.advance(now);
        let grace = self.cfg.kind(self.lookup(id, true)?.kind).grace.0;
        let now = self.now;
        let s = self.sessions.get_mut(&id).unwrap();
        // Heard from no earlier than its last activity, no later than now.
        let last_heard = last_heard.clamp(s.last_activity, now);
        let user = s.user;
        let foreground = s.foreground;
        s.online = false;
        s.until = now + grace;
        s.last_heard = last_heard;
        s.batch.clear();
        s.batch_due = None;
        for sub in s.subs.values_mut() {
            sub.queued = false;
        }
        if foreground || self.cfg.backgrounded == Backgrounded::Away {
            self.heard(user, last_heard);
        }
        self.advance(now);
        Ok(())
    }

    pub fn logout(&mut self, now: u64, id: SessionId) -> Result<(), Error> {
        self.advance(now);
        let s = self.lookup(id, false)?;
        let (user, counts) = (s.user, self.counts(s));
        let before = self.before(user);
        self.end(id, EndReason::LoggedOut);
        if counts {
            self.heard(user, self.now);
        }
        self.after(user, before);
        Ok(())
    }

    pub fn set_status(
        &mut self,
        now: u64,
        id: SessionId,
        status: Status,
        message: Option<&str>,
    ) -> Result<(), Error> {
        self.advance(now);
        let user = self.lookup(id, true)?.user;
        if message.is_some_and(|m| m.len() > self.cfg.max_message_len) {
            return Err(Error::LimitExceeded(Limit::MessageLength));
        }
        let before = self.before(user);
        let u = self.users.get_mut(&user).unwrap();
        u.status = status;
        u.message = message.map(Arc::from);
        self.after(user, before);
        Ok(())
    }

    pub fn set_invisible(&mut self, now: u64, id: SessionId, invisible: bool) -> Result<(), Error> {
        self.advance(now);
        let user = self.lookup(id, true)?.user;
        let before = self.before(user);
        self.users.get_mut(&user).unwrap().invisible = invisible;
        self.heard(user, self.now);
        self.after(user, before);
        Ok(())
    }

    pub fn subscribe(
        &mut self,
        now: u64,
        id: SessionId,
        target: UserId,
        tier: Tier,
    ) -> Result<Snapshot, Error> {
        self.advance(now);
        let s = self.lookup(id, true)?;
        let viewer = s.user;
        if viewer != target && !s.watch.allows(target) {
            return Err(Error::NotAllowed);
        }
        let existing = s.subs.get(&target).map(|sub| sub.tier);
        if existing.is_none() && s.subs.len() >= self.cfg.max_subscriptions_per_session {
            return Err(Error::LimitExceeded(Limit::SubscriptionsPerSession));
        }
        self.ensure_user(target)?;
        if let Some(old) = existing {
            if old == tier {
                self.dequeue(id, target);
                return Ok(Snapshot {
                    target,
                    tier,
                    presence: self.view_of(viewer, target),
                });
            }
            if !self.realtime_room(viewer, target, tier)
                && self.cfg.realtime_overflow == RealtimeOverflow::Reject
            {
                return Err(Error::LimitExceeded(Limit::RealtimePerTarget));
            }
            self.dequeue(id, target);
            self.sessions.get_mut(&id).unwrap().subs.remove(&target);
        }
        self.attach(id, target, tier, true)
    }

    pub fn unsubscribe(&mut self, now: u64, id: SessionId, target: UserId) -> Result<(), Error> {
        self.advance(now);
        self.lookup(id, true)?;
        self.dequeue(id, target);
        match self.sessions.get_mut(&id).unwrap().subs.remove(&target) {
            Some(_) => Ok(()),
            None => Err(Error::NotSubscribed),
        }
    }

    pub fn query(&mut self, now: u64, id: SessionId, target: UserId) -> Result<Presence, Error> {
        self.advance(now);
        let s = self.lookup(id, true)?;
        if s.user != target && !s.watch.allows(target) {
            return Err(Error::NotAllowed);
        }
        Ok(self.view_of(s.user, target))
    }

    /// Forgets `user` if nothing would be lost: no live session, no session
    /// subscribed to them, no pending publish, default saved state.
    pub fn release(&mut self, user: UserId) -> bool {
        let Some(u) = self.users.get(&user) else {
            return false;
        };
        let watched = self.sessions.values().any(|s| s.subs.contains_key(&user));
        let saved_default = u.status == Status::Available
            && u.message.is_none()
            && !u.invisible
            && u.last_seen.is_none();
        let live = self.live_sessions_of(user).next().is_some();
        if live || watched || u.debounce_due.is_some() || !saved_default {
            return false;
        }
        self.version_floor = self.version_floor.max(u.version);
        self.users.remove(&user);
        true
    }

    pub fn user_count(&self) -> usize {
        self.users.len()
    }

    /// Whether `user` has a record (created and not released).
    pub fn knows(&self, user: UserId) -> bool {
        self.users.contains_key(&user)
    }

    // ----- what tests compare -----------------------------------------------

    /// Holds a live session, in the foreground or not.
    pub fn is_online(&self, user: UserId) -> bool {
        self.live_sessions_of(user).next().is_some()
    }

    /// Some device present: what the user's own sessions see (I1, I12).
    pub fn present(&self, user: UserId) -> bool {
        self.really_online(user)
    }

    /// The Online sessions in the foreground (I9, I12).
    pub fn route(&self, user: UserId) -> BTreeSet<SessionId> {
        self.live_sessions_of(user)
            .filter(|(_, s)| s.online && s.foreground)
            .map(|(id, _)| *id)
            .collect()
    }

    pub fn published(&self, user: UserId) -> Presence {
        self.users
            .get(&user)
            .map(|u| u.published.clone())
            .unwrap_or_default()
    }

    pub fn subscriptions(&self, id: SessionId) -> BTreeSet<(UserId, Tier)> {
        self.sessions
            .get(&id)
            .map(|s| s.subs.iter().map(|(t, sub)| (*t, sub.tier)).collect())
            .unwrap_or_default()
    }

    pub fn live(&self) -> BTreeSet<SessionId> {
        self.sessions.keys().copied().collect()
    }

    /// Any deadline (lease, debounce, batch) still ahead.
    pub fn quiet(&self) -> bool {
        self.users.values().all(|u| u.debounce_due.is_none())
            && self.sessions.values().all(|s| s.batch_due.is_none())
    }
}
