//! `Core`: the presence state machine.
//!
//! Layout, chosen for 1,000,000 users and 2,000,000 devices resident:
//! - sessions live in a slab (`Slots`); a `SessionId` is slot index plus
//!   generation, so every session input is one array access;
//! - users live in a `Vec`, found by id through a deterministic hash index;
//! - every deadline (lease, debounce, batch flush) sits in one ordered set, so
//!   `handle_timeout` touches only what is due. Heartbeat leases are renewed
//!   lazily: `Activity` only writes a timestamp, and a lease that fires early
//!   re-arms itself at the real deadline;
//! - a target's subscribers are sorted `Vec<SessionId>` per tier, so a publish
//!   walks a contiguous list and fan-out order never depends on hashing.
//!
//! Every input first runs the timers that are due at its `now`, so the state
//! always reflects the present: an `Activity` cannot revive a session whose
//! deadline has already passed.

use crate::cluster::{epoch_base, Epoch, OwnedRecord, Published};
use crate::config::{Config, ConfigError, RealtimeOverflow};
use crate::error::{Error, Limit};
use crate::index::UserIndex;
use crate::output::{EndReason, Output};
use crate::timers::{Timer, Timers};
use crate::types::{
    DeviceId, DeviceKind, Kinds, Millis, Presence, SessionId, Status, Tier, UserId, Watch,
};
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

#[cfg(feature = "mutants")]
macro_rules! mutant {
    ($core:expr, $m:ident) => {
        $core.mutant == Some($crate::mutants::Mutant::$m)
    };
}
#[cfg(not(feature = "mutants"))]
macro_rules! mutant {
    ($core:expr, $m:ident) => {
        false
    };
}

/// A device connects (or reconnects).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Connect {
    pub user: UserId,
    pub device: DeviceId,
    pub kind: DeviceKind,
    /// What this session may watch (from its credentials).
    pub watch: Watch,
    /// The session this device had before, to resume it and keep its
    /// subscriptions. Ignored unless it is the device's current session.
    pub resume: Option<SessionId>,
    /// The app is in the foreground (`false`: the OS put it in the
    /// background, and the device is not present, I12). A resumed session
    /// takes this state, not the lingering one's.
    pub foreground: bool,
}

/// The answer to a `Connect`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Connected {
    pub session: SessionId,
    /// The previous session was resumed: its subscriptions carried over and
    /// `snapshots` holds a fresh snapshot of each.
    pub resumed: bool,
    /// An Online session of the same device that this one replaced; an
    /// `Output::SessionEnded` for it follows.
    pub superseded: Option<SessionId>,
    pub snapshots: Vec<Snapshot>,
}

/// The presence of one subscribed target, as of subscribing.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Snapshot {
    pub target: UserId,
    /// The tier granted (a realtime request may be downgraded to batched).
    pub tier: Tier,
    pub presence: Presence,
}

/// Every input, for drivers that prefer one entry point (the model checker,
/// the fuzzers).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Input {
    Connect(Connect),
    Activity(SessionId),
    /// The connection was lost; the driver last heard from it at `last_heard`
    /// (see [`Core::handle_disconnect`]).
    Disconnect {
        session: SessionId,
        last_heard: Millis,
    },
    Logout(SessionId),
    SetStatus {
        session: SessionId,
        status: Status,
        message: Option<String>,
    },
    SetInvisible {
        session: SessionId,
        invisible: bool,
    },
    /// The app went to the foreground (`true`) or the background (I12).
    SetForeground {
        session: SessionId,
        foreground: bool,
    },
    Subscribe {
        session: SessionId,
        target: UserId,
        tier: Tier,
    },
    Unsubscribe {
        session: SessionId,
        target: UserId,
    },
    Query {
        session: SessionId,
        target: UserId,
    },
    /// Nothing but the passing of time.
    Tick,
}

/// The answer to an `Input`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    Done,
    Connected(Connected),
    Subscribed(Snapshot),
    Presence(Presence),
}

/// What a server keeps of a user across restarts: the user's choices and
/// when they were last seen.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Saved {
    pub status: Status,
    pub message: Option<Arc<str>>,
    pub invisible: bool,
    pub last_seen: Option<Millis>,
}

/// Metrics. Two counter sets compare by value; a `Core`'s equality and hash
/// leave its counters out (two cores that differ only in counters behave
/// alike, and the model checker relies on it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub sessions_started: u64,
    pub resumed: u64,
    pub superseded: u64,
    pub logouts: u64,
    pub disconnects: u64,
    /// Online devices silent past their heartbeat timeout.
    pub ghosts_reaped: u64,
    /// Lingering sessions not resumed within grace.
    pub grace_expired: u64,
    pub publishes: u64,
    /// Debounce windows that ended with nothing new to publish.
    pub flaps_suppressed: u64,
    pub notifications_realtime: u64,
    pub notifications_batched: u64,
    pub snapshots: u64,
    pub stale_inputs: u64,
    pub downgraded: u64,
    pub limits_hit: u64,
    /// User records freed by `Core::release`.
    pub users_released: u64,
    /// Gauges.
    pub sessions_online: u64,
    pub sessions_lingering: u64,
    pub users_online: u64,
}

/// The core's counters, left out of its `Eq` and `Hash`: metrics describe
/// the history, not the state, so two cores that differ only in counters are
/// the same state. Private: `Counters` itself compares by value.
#[derive(Clone, Debug, Default)]
pub(crate) struct Metrics(pub(crate) Counters);

impl PartialEq for Metrics {
    fn eq(&self, _: &Metrics) -> bool {
        true
    }
}

impl Eq for Metrics {}

impl Hash for Metrics {
    fn hash<H: Hasher>(&self, _: &mut H) {}
}

impl std::ops::Deref for Metrics {
    type Target = Counters;
    fn deref(&self) -> &Counters {
        &self.0
    }
}

impl std::ops::DerefMut for Metrics {
    fn deref_mut(&mut self) -> &mut Counters {
        &mut self.0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Link {
    /// `last_activity` is also when the device was last heard from.
    Online { last_activity: Millis },
    /// Lost; its grace ends at the session's `lease_due`. `last_heard` is
    /// when the driver last heard from the connection.
    Lingering { last_heard: Millis },
}

impl Link {
    /// The last moment the server heard from this session's device.
    pub(crate) fn last_heard(self) -> Millis {
        match self {
            Link::Online { last_activity } => last_activity,
            Link::Lingering { last_heard } => last_heard,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Sub {
    pub(crate) target: u32,
    pub(crate) tier: Tier,
    /// In the session's pending batch.
    pub(crate) queued: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Subs {
    /// Sorted by target.
    pub(crate) list: Vec<Sub>,
    /// Targets with a change not yet flushed, in the order they changed.
    pub(crate) batch: Vec<u32>,
    pub(crate) batch_due: Option<Millis>,
}

/// 56 bytes, so that a `Slot` fills one cache line: an `Activity` on a random
/// session of millions then costs one line from memory, not two. Hence the
/// link stored flat (an enum `Link` field takes 16 bytes) and no id (a
/// session's id is its slot's index and generation).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Session {
    pub(crate) user: u32,
    pub(crate) device: DeviceId,
    pub(crate) kind: DeviceKind,
    /// The link is `Lingering` (else `Online`); see [`Session::link`].
    lingering: bool,
    /// The app is in the background: the device is not present (I12).
    pub(crate) background: bool,
    /// The link's time: `last_activity` while Online, `last_heard` while
    /// Lingering.
    link_at: Millis,
    /// The deadline of this session's `Timer::Lease` (heartbeat deadlines are
    /// armed at or before the real one).
    pub(crate) lease_due: Millis,
    pub(crate) watch: Watch,
    /// `None` while the session has no subscription: most sessions pay 8 bytes.
    /// While Lingering, subscriptions are parked: kept here, absent from the
    /// targets' lists.
    pub(crate) subs: Option<Box<Subs>>,
}

impl Session {
    pub(crate) fn link(&self) -> Link {
        if self.lingering {
            Link::Lingering {
                last_heard: self.link_at,
            }
        } else {
            Link::Online {
                last_activity: self.link_at,
            }
        }
    }

    pub(crate) fn set_link(&mut self, link: Link) {
        (self.lingering, self.link_at) = match link {
            Link::Online { last_activity } => (false, last_activity),
            Link::Lingering { last_heard } => (true, last_heard),
        };
    }
}

/// One cache line (see `Session`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[repr(align(64))]
pub(crate) struct Slot {
    pub(crate) generation: u32,
    pub(crate) session: Option<Session>,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Slot>() == 64);

/// Subscriber lists of one target, indexed by `tier_index`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Watchers {
    /// Other users' Online sessions: they get the published view.
    pub(crate) others: [Vec<SessionId>; 2],
    /// The target's own Online sessions: they get the truth.
    pub(crate) own: [Vec<SessionId>; 2],
}

impl Watchers {
    fn is_empty(&self) -> bool {
        self.others.iter().chain(&self.own).all(Vec::is_empty)
    }

    pub(crate) fn list(&self, own: bool, tier: Tier) -> &Vec<SessionId> {
        let lists = if own { &self.own } else { &self.others };
        &lists[tier_index(tier)]
    }

    fn list_mut(&mut self, own: bool, tier: Tier) -> &mut Vec<SessionId> {
        let lists = if own { &mut self.own } else { &mut self.others };
        &mut lists[tier_index(tier)]
    }
}

pub(crate) fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::Realtime => 0,
        Tier::Batched => 1,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct User {
    pub(crate) id: UserId,
    /// The current session of each device that is Online or Lingering.
    pub(crate) sessions: Vec<SessionId>,
    pub(crate) status: Status,
    pub(crate) message: Option<Arc<str>>,
    pub(crate) invisible: bool,
    /// The last moment the server heard from one of the user's devices while
    /// they were shown to others (set when a published online user goes
    /// offline or invisible).
    pub(crate) last_seen: Option<Millis>,
    /// While the user is shown: the latest moment heard from their devices
    /// outside their live sessions' links (sessions that ended, folded in as
    /// they end; logouts; `SetInvisible`). When the user stops being shown
    /// with no device left, last seen is this. Each change zeroes it when
    /// the user is not shown or a live session was heard from as late
    /// (it would add nothing); an `Activity` may overtake it in between,
    /// which is harmless since it only ever counts through a max.
    pub(crate) heard: Millis,
    /// Subscriptions to this user held by sessions, Online or Lingering
    /// (parked ones too): a record with subscribers cannot be released.
    pub(crate) subscribers: u32,
    /// Bumped by every publish to others and every change of the own view.
    pub(crate) version: u64,
    /// What others were last told; also what a new subscriber's snapshot shows.
    pub(crate) published: Presence,
    /// `published` was restored from a KV view older than one this owner
    /// published before it released the user: it is published again at the
    /// next debounce, under a higher version, even if it looks the same.
    pub(crate) behind: bool,
    /// End of the running debounce window, if any.
    pub(crate) debounce_due: Option<Millis>,
    pub(crate) watchers: Option<Box<Watchers>>,
}

impl User {
    /// A user never seen, whose versions start at `version` (the core's
    /// floor, above every version a released record ever issued).
    fn new(id: UserId, version: u64) -> User {
        User {
            id,
            sessions: Vec::new(),
            status: Status::Available,
            message: None,
            invisible: false,
            last_seen: None,
            heard: Millis::ZERO,
            subscribers: 0,
            version,
            published: Presence {
                version,
                ..Presence::default()
            },
            behind: false,
            debounce_due: None,
            watchers: None,
        }
    }

    /// What a released slot holds until it is reused (the slot is listed in
    /// `Core::free_users`; its contents mean nothing).
    pub(crate) fn vacant() -> User {
        User::new(UserId(u64::MAX), 0)
    }

    /// Nothing would be lost by forgetting this record: no session, no
    /// subscriber, no pending publish, and saved state that is the default.
    fn holds_nothing(&self) -> bool {
        self.holds_only_saved()
            && self.status == Status::Available
            && self.message.is_none()
            && !self.invisible
            && self.last_seen.is_none()
    }

    /// No session, no subscriber and no pending publish: what is left is
    /// the saved state and the published view.
    fn holds_only_saved(&self) -> bool {
        self.sessions.is_empty()
            && self.subscribers == 0
            && self.watchers.is_none()
            && self.debounce_due.is_none()
    }
}

/// Both views of a user, taken before a change to see what it changed.
pub(crate) struct Views {
    shown: Presence,
    own: Presence,
}

/// What an owner core keeps for the cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Owning {
    /// Views to publish on the shard's subject, in order.
    pub(crate) published: VecDeque<Published>,
    /// Until then no user goes from shown online to offline through the
    /// debounce: the resync window of a new owner.
    pub(crate) hold_offline_until: Millis,
}

/// The presence state machine. See the crate documentation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Core {
    pub(crate) config: Config,
    pub(crate) clock: Millis,
    /// Indexed by user slot; slots in `free_users` are vacant.
    pub(crate) users: Vec<User>,
    /// Released user slots, reused before `users` grows.
    pub(crate) free_users: Vec<u32>,
    /// The highest version any released user reached: a user created after
    /// a release starts above it, so a watcher never sees a version of a
    /// re-created user that is not newer than one it saw before the release.
    pub(crate) version_floor: u64,
    pub(crate) index: UserIndex,
    pub(crate) slots: Vec<Slot>,
    pub(crate) free: Vec<u32>,
    pub(crate) live_sessions: usize,
    pub(crate) timers: Timers,
    pub(crate) outputs: VecDeque<Output>,
    pub(crate) counters: Metrics,
    /// Only on a cluster's owner (`set_publish_views`): `None` on one node,
    /// which then pays one branch per publish.
    pub(crate) cluster: Option<Box<Owning>>,
    /// Group presence (the `groups` module).
    pub(crate) groups: crate::groups::Groups,
    #[cfg(feature = "mutants")]
    pub(crate) mutant: Option<crate::mutants::Mutant>,
    /// Under `Mutant::IgnoreStale` only: the device of each superseded session.
    #[cfg(feature = "mutants")]
    pub(crate) tombstones: std::collections::BTreeMap<SessionId, (u32, DeviceId)>,
}

impl Core {
    pub fn new(config: Config) -> Result<Core, ConfigError> {
        config.validate()?;
        Ok(Core {
            config,
            clock: Millis::ZERO,
            users: Vec::new(),
            free_users: Vec::new(),
            version_floor: 0,
            index: UserIndex::default(),
            slots: Vec::new(),
            free: Vec::new(),
            live_sessions: 0,
            timers: Timers::default(),
            outputs: VecDeque::new(),
            counters: Metrics::default(),
            cluster: None,
            groups: Default::default(),
            #[cfg(feature = "mutants")]
            mutant: None,
            #[cfg(feature = "mutants")]
            tombstones: Default::default(),
        })
    }

    /// Switches on one deliberate bug (feature `mutants`).
    #[cfg(feature = "mutants")]
    pub fn set_mutant(&mut self, mutant: Option<crate::mutants::Mutant>) {
        self.mutant = mutant;
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The latest `now` seen.
    pub fn now(&self) -> Millis {
        self.clock
    }

    pub fn counters(&self) -> &Counters {
        &self.counters.0
    }

    // ----- outputs and time -------------------------------------------------

    /// The next thing for the driver to do. Drain after every input.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// When `handle_timeout` next has work to do.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.timers.first().map(|(due, _)| *due)
    }

    /// Expiry, debounce ends and batch flushes due at `now`. A no-op when
    /// nothing is due.
    pub fn handle_timeout(&mut self, now: Millis) {
        self.advance(now);
    }

    /// Runs what is due up to `now`, each at its own deadline, so that a late
    /// `handle_timeout` leaves the same state as a timely one.
    pub(crate) fn advance(&mut self, now: Millis) {
        let now = now.max(self.clock);
        if self.timers.any_due(now) {
            self.run_timers_until(now);
        }
        self.clock = now;
    }

    fn run_timers(&mut self) {
        self.run_timers_until(self.clock);
    }

    fn run_timers_until(&mut self, now: Millis) {
        while let Some(&(due, timer)) = self.timers.first() {
            if due > now {
                break;
            }
            self.clock = self.clock.max(due);
            self.timers.pop_first();
            match timer {
                Timer::Lease(session) => self.on_lease(session),
                Timer::Debounce(user) => self.on_debounce(user),
                Timer::Batch(session) => self.on_batch(session),
                Timer::PageFlush(session) => self.on_page_flush(session),
                Timer::WatchExpiry(watch) => self.on_watch_expiry(watch),
                Timer::Group(group) => self.on_group_flush(group),
            }
        }
    }

    fn on_lease(&mut self, id: SessionId) {
        let Some(session) = self.session(id) else {
            debug_assert!(false, "lease timer of a dead session {id}");
            return;
        };
        let (user, kind) = (session.user, session.kind);
        match session.link() {
            Link::Online { last_activity } => {
                let deadline = last_activity.plus(self.config.kind(kind).heartbeat_timeout);
                if deadline <= self.clock {
                    let before = self.views(user);
                    self.counters.ghosts_reaped += 1;
                    self.end_session(id, EndReason::HeartbeatTimeout);
                    self.after_change(user, before);
                } else {
                    // Renewed since armed: re-arm at the real deadline.
                    self.set_lease(id, deadline);
                }
            }
            Link::Lingering { .. } => {
                debug_assert!(session.lease_due <= self.clock);
                let before = self.views(user);
                self.counters.grace_expired += 1;
                self.end_session(id, EndReason::GraceExpired);
                self.after_change(user, before);
            }
        }
    }

    fn on_debounce(&mut self, user: UserId) {
        let Some(u) = self.index.get(user) else {
            debug_assert!(false, "debounce timer of an unknown user");
            return;
        };
        self.users[u as usize].debounce_due = None;
        let shown = self.shown_view(u);
        if let Some(hold) = self.held_until(u, &shown) {
            // A new owner's resync window: an edge may still resend a device
            // of this user; offline waits for the window to close.
            self.users[u as usize].debounce_due = Some(hold);
            self.timers.insert((hold, Timer::Debounce(user)));
            return;
        }
        let again = self.stale_epoch(u) || self.users[u as usize].behind;
        if shown.same_view(&self.users[u as usize].published) && !again {
            self.counters.flaps_suppressed += 1;
        } else {
            self.publish(u, shown);
        }
    }

    fn on_batch(&mut self, id: SessionId) {
        let Some(subs) = self.session_mut(id).and_then(|s| s.subs.as_deref_mut()) else {
            debug_assert!(false, "batch timer of a session without subscriptions");
            return;
        };
        subs.batch_due = None;
        let batch = std::mem::take(&mut subs.batch);
        for &target in &batch {
            if let Some(sub) = find_sub_mut(subs, target) {
                sub.queued = false;
            }
        }
        let viewer = self.session(id).map(|s| s.user);
        for target in batch {
            let presence = self.view_of(viewer, target);
            self.counters.notifications_batched += 1;
            self.outputs.push_back(Output::Push {
                to: id,
                target: self.users[target as usize].id,
                tier: Tier::Batched,
                presence,
            });
        }
    }

    // ----- inputs -----------------------------------------------------------

    /// One entry point for every input.
    pub fn handle_input(&mut self, now: Millis, input: Input) -> Result<Reply, Error> {
        match input {
            Input::Connect(connect) => self.handle_connect(now, connect).map(Reply::Connected),
            Input::Activity(s) => self.handle_activity(now, s).map(|()| Reply::Done),
            Input::Disconnect {
                session,
                last_heard,
            } => self
                .handle_disconnect(now, session, last_heard)
                .map(|()| Reply::Done),
            Input::Logout(s) => self.handle_logout(now, s).map(|()| Reply::Done),
            Input::SetStatus {
                session,
                status,
                message,
            } => self
                .handle_set_status(now, session, status, message.as_deref())
                .map(|()| Reply::Done),
            Input::SetInvisible { session, invisible } => self
                .handle_set_invisible(now, session, invisible)
                .map(|()| Reply::Done),
            Input::SetForeground {
                session,
                foreground,
            } => self
                .handle_set_foreground(now, session, foreground)
                .map(|()| Reply::Done),
            Input::Subscribe {
                session,
                target,
                tier,
            } => self
                .handle_subscribe(now, session, target, tier)
                .map(Reply::Subscribed),
            Input::Unsubscribe { session, target } => self
                .handle_unsubscribe(now, session, target)
                .map(|()| Reply::Done),
            Input::Query { session, target } => {
                self.handle_query(now, session, target).map(Reply::Presence)
            }
            Input::Tick => {
                self.handle_timeout(now);
                Ok(Reply::Done)
            }
        }
    }

    /// A device connects: Offline → Online, Lingering → Online (unseen), or
    /// Online → Online with a new session (the old one is superseded).
    pub fn handle_connect(&mut self, now: Millis, c: Connect) -> Result<Connected, Error> {
        self.advance(now);
        let known = self.index.get(c.user);
        let old = known.and_then(|u| self.device_session(u, c.device));
        if old.is_none() {
            if self.live_sessions >= self.config.max_sessions {
                return Err(self.limit(Limit::Sessions));
            }
            if known.is_some_and(|u| {
                self.users[u as usize].sessions.len() >= self.config.max_devices_per_user
            }) {
                return Err(self.limit(Limit::DevicesPerUser));
            }
        }
        let user = self.user_slot(c.user)?;
        let before = self.views(user);

        let mut carried = Vec::new();
        let mut carried_groups = None;
        let mut resumed = false;
        let mut superseded = None;
        if let Some(old) = old {
            let was_online = self
                .session(old)
                .is_some_and(|s| matches!(s.link(), Link::Online { .. }));
            if c.resume == Some(old) {
                resumed = true;
                self.counters.resumed += 1;
                carried = self.detach_subs(old);
                carried_groups = Some(self.group_take(old));
            }
            if was_online {
                superseded = Some(old);
                self.counters.superseded += 1;
            }
            self.end_session(old, EndReason::Superseded);
        }

        let id = self.insert_session(user, &c);
        let mut snapshots = Vec::with_capacity(carried.len());
        for sub in carried {
            let target = self.users[sub.target as usize].id;
            if sub.target != user && !c.watch.allows(target) {
                continue; // the new credentials no longer allow it
            }
            // Never refuse a carried subscription: at worst downgrade it.
            if let Ok(snapshot) = self.attach(id, sub.target, sub.tier, false) {
                snapshots.push(snapshot);
            }
        }
        if let Some(taken) = carried_groups {
            self.group_carry(id, taken);
        }
        self.after_change(user, before);
        Ok(Connected {
            session: id,
            resumed,
            superseded,
            snapshots,
        })
    }

    /// Any sign of life: renews the session's lease; the device was heard
    /// from at `now`.
    pub fn handle_activity(&mut self, now: Millis, id: SessionId) -> Result<(), Error> {
        self.advance(now);
        let clock = self.clock;
        // The usual case, a live Online session, in one lookup.
        if let Some(session) = self.session_mut(id).filter(|s| !s.lingering) {
            session.link_at = clock;
            return Ok(());
        }
        let id = self.online(id)?;
        if let Some(session) = self.session_mut(id) {
            session.set_link(Link::Online {
                last_activity: clock,
            });
        }
        Ok(())
    }

    /// A sign of life observed by the driver at `heard` (not later than
    /// `now`): the lease counts from then. For a driver that renews the
    /// leases of open connections in a sweep: the renewal must not claim the
    /// device was heard at the sweep (that would move `last_seen` past the
    /// device's real last packet). Never moves the last activity back.
    pub fn handle_heard(&mut self, now: Millis, id: SessionId, heard: Millis) -> Result<(), Error> {
        self.advance(now);
        let id = self.online(id)?;
        let heard = heard.min(self.clock);
        if let Some(session) = self.session_mut(id) {
            if let Link::Online { last_activity } = session.link() {
                session.set_link(Link::Online {
                    last_activity: last_activity.max(heard),
                });
            }
        }
        Ok(())
    }

    /// The connection was lost without a logout: Online → Lingering, unseen by
    /// others until grace runs out.
    ///
    /// `last_heard` is when the driver last heard from the connection (its
    /// last packet), usually earlier than `now`, when the loss was noticed.
    /// It is what the user's last seen will read if this was their last
    /// device, never the end of grace. It is clamped to between the session's
    /// last activity and `now`.
    pub fn handle_disconnect(
        &mut self,
        now: Millis,
        id: SessionId,
        last_heard: Millis,
    ) -> Result<(), Error> {
        self.handle_disconnect_until(now, id, last_heard, Millis::ZERO)
    }

    /// [`Core::handle_disconnect`], with the grace lasting until `until` when
    /// that is later than its usual end (never shorter). For devices
    /// restored as lingering after a restart: they may have to wait their
    /// turn to be readmitted, and must not be shown offline meanwhile.
    pub fn handle_disconnect_until(
        &mut self,
        now: Millis,
        id: SessionId,
        last_heard: Millis,
        until: Millis,
    ) -> Result<(), Error> {
        self.advance(now);
        let id = self.online(id)?;
        let last_activity = self
            .session(id)
            .map_or(self.clock, |s| s.link().last_heard());
        self.linger(id, last_heard.clamp(last_activity, self.clock));
        if self.session(id).is_some_and(|s| until > s.lease_due) {
            self.set_lease(id, until);
        }
        self.run_timers(); // a zero grace ends the session at once
        Ok(())
    }

    /// A lingering session's grace lasts until at least `until` (never
    /// shorter). For devices restored after a restart that are still waiting
    /// for their turn while the server sheds handshakes. Whether the session
    /// is still lingering after `now`'s timers ran: `false` once it was
    /// resumed, superseded or ended (the caller can forget it).
    pub fn extend_linger(&mut self, now: Millis, id: SessionId, until: Millis) -> bool {
        self.advance(now);
        let Some(session) = self.session(id) else {
            return false;
        };
        if !matches!(session.link(), Link::Lingering { .. }) {
            return false;
        }
        if until > session.lease_due {
            self.set_lease(id, until);
        }
        true
    }

    /// Graceful logout: the session ends now, with no grace. The device was
    /// heard from at `now` (if it was present: a backgrounded device's
    /// logout does not move last seen, I12).
    pub fn handle_logout(&mut self, now: Millis, id: SessionId) -> Result<(), Error> {
        self.advance(now);
        let id = self.current(id)?;
        if mutant!(self, LogoutAsDisconnect) {
            if self
                .session(id)
                .is_some_and(|s| matches!(s.link(), Link::Online { .. }))
            {
                self.linger(id, self.clock);
            }
            return Ok(());
        }
        let Some((user, present)) = self.session(id).map(|s| (s.user, self.present(s))) else {
            return Err(Error::Stale);
        };
        let before = self.views(user);
        self.counters.logouts += 1;
        self.end_session(id, EndReason::LoggedOut);
        if present {
            self.heard(user);
        }
        self.after_change(user, before);
        Ok(())
    }

    /// The user's chosen status and message.
    pub fn handle_set_status(
        &mut self,
        now: Millis,
        id: SessionId,
        status: Status,
        message: Option<&str>,
    ) -> Result<(), Error> {
        self.advance(now);
        let id = self.online(id)?;
        if message.is_some_and(|m| m.len() > self.config.max_message_len) {
            return Err(self.limit(Limit::MessageLength));
        }
        let Some(user) = self.session(id).map(|s| s.user) else {
            return Err(Error::Stale);
        };
        let before = self.views(user);
        let u = &mut self.users[user as usize];
        u.status = status;
        if u.message.as_deref() != message {
            u.message = message.map(Arc::from);
        }
        self.after_change(user, before);
        Ok(())
    }

    /// Appear offline to everyone else (takes effect at once, not debounced).
    /// The device was heard from at `now`: going invisible freezes last seen
    /// there.
    pub fn handle_set_invisible(
        &mut self,
        now: Millis,
        id: SessionId,
        invisible: bool,
    ) -> Result<(), Error> {
        self.advance(now);
        let id = self.online(id)?;
        let Some(user) = self.session(id).map(|s| s.user) else {
            return Err(Error::Stale);
        };
        let before = self.views(user);
        self.users[user as usize].invisible = invisible;
        self.heard(user);
        self.after_change(user, before);
        Ok(())
    }

    /// Watch `target` in `tier`; answers with a snapshot. Subscribing again
    /// changes the tier and answers with a fresh snapshot.
    pub fn handle_subscribe(
        &mut self,
        now: Millis,
        id: SessionId,
        target: UserId,
        tier: Tier,
    ) -> Result<Snapshot, Error> {
        self.advance(now);
        let id = self.online(id)?;
        let Some(session) = self.session(id) else {
            return Err(Error::Stale);
        };
        let viewer = session.user;
        if self.users[viewer as usize].id != target && !session.watch.allows(target) {
            return Err(Error::NotAllowed);
        }
        let existing = self
            .index
            .get(target)
            .and_then(|t| session.subs.as_deref().and_then(|subs| find_sub(subs, t)))
            .map(|sub| (sub.target, sub.tier));
        if existing.is_none()
            && session.subs.as_ref().map_or(0, |s| s.list.len())
                >= self.config.max_subscriptions_per_session
        {
            return Err(self.limit(Limit::SubscriptionsPerSession));
        }
        let t = self.user_slot(target)?;
        if let Some((_, old_tier)) = existing {
            // Re-subscribing: the fresh snapshot replaces whatever was queued.
            if old_tier == tier {
                self.dequeue(id, t);
                self.counters.snapshots += 1;
                let presence = self.view_of(Some(viewer), t);
                return Ok(Snapshot {
                    target,
                    tier,
                    presence,
                });
            }
            if !self.realtime_has_room(viewer, t, tier)
                && self.config.realtime_overflow == RealtimeOverflow::Reject
            {
                return Err(self.limit(Limit::RealtimePerTarget));
            }
            self.detach(id, t);
        }
        self.attach(id, t, tier, true)
    }

    /// Stop watching `target`.
    pub fn handle_unsubscribe(
        &mut self,
        now: Millis,
        id: SessionId,
        target: UserId,
    ) -> Result<(), Error> {
        self.advance(now);
        let id = self.online(id)?;
        let t = self.index.get(target).ok_or(Error::NotSubscribed)?;
        if self.detach(id, t) {
            Ok(())
        } else {
            Err(Error::NotSubscribed)
        }
    }

    /// The session's credentials were renewed: `watch` replaces what it may
    /// watch, and each subscription it no longer allows ends (I11). Returns
    /// the targets whose subscriptions ended, in target order.
    pub fn handle_set_watch(
        &mut self,
        now: Millis,
        id: SessionId,
        watch: Watch,
    ) -> Result<Vec<UserId>, Error> {
        self.advance(now);
        let id = self.online(id)?;
        let Some(session) = self.session_mut(id) else {
            return Err(Error::Stale);
        };
        session.watch = watch;
        let viewer = session.user;
        let disallowed: Vec<u32> = session
            .subs
            .as_deref()
            .map(|subs| {
                subs.list
                    .iter()
                    .map(|sub| sub.target)
                    .filter(|&t| t != viewer)
                    .collect()
            })
            .unwrap_or_default();
        let mut ended = Vec::new();
        for target in disallowed {
            let user = self.users[target as usize].id;
            let allowed = self.session(id).is_some_and(|s| s.watch.allows(user));
            if !allowed && self.detach(id, target) {
                ended.push(user);
            }
        }
        Ok(ended)
    }

    /// What this session may see of `target` now, without subscribing.
    pub fn handle_query(
        &mut self,
        now: Millis,
        id: SessionId,
        target: UserId,
    ) -> Result<Presence, Error> {
        self.advance(now);
        let id = self.online(id)?;
        self.view(id, target)
    }

    /// Restores what a server saved of `user` before a restart. Only for a
    /// user who is not online yet (refused with `Error::AlreadyOnline`): the
    /// user is shown offline with the saved last seen, and keeps the saved
    /// status and invisibility when they connect.
    pub fn restore(&mut self, user: UserId, saved: Saved) -> Result<(), Error> {
        if saved
            .message
            .as_ref()
            .is_some_and(|m| m.len() > self.config.max_message_len)
        {
            return Err(self.limit(Limit::MessageLength));
        }
        let u = self.user_slot(user)?;
        let u = &mut self.users[u as usize];
        if !u.sessions.is_empty() {
            return Err(Error::AlreadyOnline);
        }
        u.status = saved.status;
        u.message = saved.message;
        u.invisible = saved.invisible;
        u.last_seen = saved.last_seen;
        let published = Presence {
            version: u.version,
            last_seen: saved.last_seen,
            ..Presence::default()
        };
        let was_online = std::mem::replace(&mut u.published, published).online;
        self.group_published(user, was_online, false);
        Ok(())
    }

    /// Frees the record of `user` if it holds nothing: no session (Online or
    /// Lingering), no subscriber (a lingering session's parked subscription
    /// counts), no pending publish, and saved state that is the default
    /// ([`Saved::default`]). Returns whether it was freed. A freed user is
    /// unknown again (shown as `Presence::default()` until they reappear);
    /// the slot is reused. A user created later under the same id starts
    /// from versions above every version any released user reached, so no
    /// watcher ever sees its versions go back.
    pub fn release(&mut self, user: UserId) -> bool {
        self.release_if(user, User::holds_nothing)
    }

    /// Frees `user` as [`Core::release`] does, whatever its saved state and
    /// published view: for a cluster's owner, whose KV keeps both (restore
    /// them with [`Core::restore_owned`] before the user's next input).
    /// Refused while a session, a subscriber or a pending publish holds it.
    pub fn release_saved(&mut self, user: UserId) -> bool {
        self.release_if(user, User::holds_only_saved)
    }

    fn release_if(&mut self, user: UserId, may_go: fn(&User) -> bool) -> bool {
        let Some(u) = self.index.get(user) else {
            return false;
        };
        if !may_go(&self.users[u as usize]) {
            return false;
        }
        let record = std::mem::replace(&mut self.users[u as usize], User::vacant());
        self.version_floor = self.version_floor.max(record.version);
        self.index.remove(user);
        self.free_users.push(u);
        #[cfg(feature = "mutants")]
        self.tombstones.retain(|_, (owner, _)| *owner != u);
        self.counters.users_released += 1;
        true
    }

    /// Whether the core keeps a record of `user` (created by a connect, a
    /// subscribe or a restore; gone after a release).
    pub fn is_known(&self, user: UserId) -> bool {
        self.index.get(user).is_some()
    }

    /// Whether [`Core::release`] would free `user` now.
    pub fn is_releasable(&self, user: UserId) -> bool {
        self.index
            .get(user)
            .is_some_and(|u| self.users[u as usize].holds_nothing())
    }

    /// What a server should keep of `user` across restarts.
    pub fn saved(&self, user: UserId) -> Saved {
        match self.index.get(user) {
            Some(u) => {
                let u = &self.users[u as usize];
                Saved {
                    status: u.status,
                    message: u.message.clone(),
                    invisible: u.invisible,
                    last_seen: u.last_seen,
                }
            }
            None => Saved::default(),
        }
    }
}

/// A live session's public description.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionInfo {
    pub user: UserId,
    pub device: DeviceId,
    pub kind: DeviceKind,
    /// Online (true) or Lingering (false).
    pub online: bool,
    /// The app is in the foreground (I12).
    pub foreground: bool,
}

fn find_sub(subs: &Subs, target: u32) -> Option<&Sub> {
    subs.list
        .binary_search_by_key(&target, |s| s.target)
        .ok()
        .map(|at| &subs.list[at])
}

fn find_sub_mut(subs: &mut Subs, target: u32) -> Option<&mut Sub> {
    subs.list
        .binary_search_by_key(&target, |s| s.target)
        .ok()
        .map(|at| &mut subs.list[at])
}

mod owned;
mod sessions;
mod views;
