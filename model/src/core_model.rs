//! Model 1: the core itself.
//!
//! The model's state holds a real [`Core`]; every action is one
//! [`Core::handle_input`] call, after which the outputs are drained. What the
//! invariants need beyond the core's own state (what each watcher received,
//! since when a view has held, which sessions were logged out) is recorded in
//! the model state and checked on every transition. A violation is written
//! into the reached state (`bad`), so each `always` property is a plain look-up
//! and the counterexample ends at the state that broke it.

use greendot_core::Core;
use greendot_core::{
    Backgrounded, Config, Connect, DeviceId, DeviceKind, EndReason, Error, Input, KindConfig,
    Millis, Output, Presence, RealtimeOverflow, Reply, SessionId, Status, Tier, UserId, Watch,
};
use stateright::{Model, Property};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

mod checks;
use checks::check_shown_to_other;

/// What a device's actions may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A device of the watched user: connects, drops, logs out, changes its
    /// status and invisibility, and may watch itself (its own truth).
    Target,
    /// A device of a watcher: connects, drops, logs out and subscribes to,
    /// unsubscribes from and queries other users.
    Watcher,
}

/// What a device may do, beyond connecting and logging out.
pub mod cap {
    /// `Activity` (only worth it where the heartbeat timeout is within the time bound).
    pub const ACTIVITY: u16 = 1;
    /// `Disconnect`.
    pub const DROP: u16 = 1 << 1;
    /// `Connect` with resume.
    pub const RESUME: u16 = 1 << 8;
    /// `Logout`.
    pub const LOGOUT: u16 = 1 << 9;
    /// `SetStatus`.
    pub const STATUS: u16 = 1 << 2;
    /// `SetInvisible`.
    pub const INVISIBLE: u16 = 1 << 3;
    /// Subscribe to oneself (the truth), in both tiers, and unsubscribe.
    pub const OWN: u16 = 1 << 4;
    /// Subscribe to other users, in both tiers, and unsubscribe.
    pub const WATCH: u16 = 1 << 5;
    /// Inputs on ended sessions.
    pub const STALE: u16 = 1 << 6;
    /// `Connect` without resume while a session is live (supersede).
    pub const RECONNECT: u16 = 1 << 7;
    /// `Disconnect` of a device that went silent before the loss was
    /// noticed: the driver last heard from it before `now` (at time 0, which
    /// the core clamps up to its last activity).
    pub const SILENT_LOSS: u16 = 1 << 10;
    /// `SetForeground`: the app goes to the background and back (I12); a
    /// reconnect's `Connect` carries the app's state.
    pub const BACKGROUND: u16 = 1 << 11;
    pub const ALL: u16 = u16::MAX;
}

/// One simulated device.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceSpec {
    pub user: UserId,
    pub device: DeviceId,
    pub kind: DeviceKind,
    pub watch: Watch,
    pub role: Role,
    /// `cap::*` bits.
    pub caps: u16,
}

/// The size of the checked world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// Users: the first is watched and has `devices` devices; each other user
    /// has one watcher device.
    pub users: usize,
    /// Devices of the watched user.
    pub devices: usize,
    /// `now` never passes this many milliseconds.
    pub max_time: u64,
    /// Sessions issued over the whole run (each `Connect` issues one).
    pub max_sessions: u8,
    /// `SetStatus` and `SetInvisible` inputs over the whole run.
    pub max_toggles: u8,
    /// `SetForeground` inputs over the whole run (I12).
    pub max_backgrounds: u8,
    /// States where the watched user's version passes this are not explored
    /// (the version grows with every change of what anyone sees of a user).
    pub max_version: u64,
    /// The same for the watchers' own users, whose presence nobody watches.
    pub max_watcher_version: u64,
}

impl Bounds {
    /// The bounds checked by `cargo test` (CI): 4 sessions, 0.83 M states
    /// in about 40 s. Every `sometimes` property is reached there; 5
    /// sessions ([`Bounds::FIVE_SESSIONS`], 3.0 M states, 140–190 s) took
    /// most of the models' CI time for longer supersede and resume chains.
    pub const CI: Bounds = Bounds {
        users: 3,
        devices: 2,
        max_time: 3,
        max_sessions: 4,
        max_toggles: 2,
        max_backgrounds: 0,
        max_version: 4,
        max_watcher_version: 2,
    };

    /// CI's bounds with a fifth session: `cargo test --release -p
    /// greendot-model -- --ignored` (or `greendot-model check --sessions 5`).
    pub const FIVE_SESSIONS: Bounds = Bounds {
        max_sessions: 5,
        ..Bounds::CI
    };

    /// I12 (foreground and background): CI's bounds with the watched
    /// user's phone going to the background and back, connecting in
    /// either state, within 3 sessions and one status or invisibility
    /// change (the toggles and sessions multiply the states; I12 needs a
    /// background, a second device and a reconnect to show).
    pub const BACKGROUND: Bounds = Bounds {
        max_sessions: 3,
        max_toggles: 1,
        max_backgrounds: 2,
        ..Bounds::CI
    };
}

/// Model 1: the real core under every input, with time in small steps.
#[derive(Clone, Debug)]
pub struct CoreModel {
    pub bounds: Bounds,
    pub devices: Vec<DeviceSpec>,
    pub users: Vec<UserId>,
    /// The core every run starts from (a test may switch a mutant on in it).
    pub init: Core,
}

/// Config values scaled to small integers so that every threshold is crossed
/// within a few ticks: debounce 1, batch interval 2; mobile: grace 1,
/// heartbeat timeout 2; desktop and web: grace 1 (the heartbeat of
/// kinds other than mobile is beyond the time bound: only the mobile device
/// needs `Activity` to live); one realtime subscriber per target (the second
/// is downgraded to batched) and two subscriptions per session.
pub fn small_config(devices: usize) -> Config {
    let kind = |grace, heartbeat| KindConfig {
        heartbeat_timeout: Millis(heartbeat),
        grace: Millis(grace),
    };
    Config {
        debounce: Millis(1),
        batch_interval: Millis(2),
        kinds: [kind(1, 2), kind(1, 1000), kind(1, 1000), kind(2, 1000)],
        max_subscriptions_per_session: 2,
        max_realtime_per_target: 1,
        realtime_overflow: RealtimeOverflow::Downgrade,
        max_message_len: 16,
        max_devices_per_user: devices.max(1),
        max_sessions: 64,
        max_users: 16,
        backgrounded: Backgrounded::Offline,
        // Groups are not modelled here: their defaults.
        ..Config::default()
    }
}

/// An input of one device. `old` names the device's last superseded session
/// instead of its current one (a stale input).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Activity,
    /// `silent`: last heard before `now` (see `cap::SILENT_LOSS`); otherwise
    /// last heard at `now`.
    Disconnect {
        silent: bool,
    },
    Logout,
    SetStatus(Status),
    SetInvisible(bool),
    SetForeground(bool),
    Subscribe(u8, Tier),
    Unsubscribe(u8),
    Query(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Advance `now` to this time and run what is due.
    Tick(u64),
    /// Device `dev` connects; with `resume`, naming its last session.
    Connect { dev: u8, resume: bool },
    /// Device `dev` sends an input on its current session, or (`stale`) on
    /// a session of it that has ended.
    Input { dev: u8, stale: bool, op: Op },
}

/// What one device has been issued.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Dev {
    /// The latest session the device was given (it may have ended since).
    pub cur: Option<SessionId>,
    /// The session before it, ended (superseded or resumed).
    pub old: Option<SessionId>,
    /// While `cur` is Online: its last activity (connect or `Activity`).
    pub active_at: Option<Millis>,
    /// While `cur` is Lingering: when it was lost.
    pub lost_at: Option<Millis>,
    /// The app is in the background (I12); kept across reconnects, whose
    /// `Connect` carries it.
    pub background: bool,
}

/// Per user: since when the views have held (for I6 and I8).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Track {
    /// When `shown(user)` last changed; `None` once settled (at least
    /// `debounce + batch_interval` ago).
    pub shown_since: Option<Millis>,
    /// When `truth(user)` last changed; `None` once `batch_interval` ago.
    pub truth_since: Option<Millis>,
    /// When the user went invisible, while invisible.
    pub invisible_since: Option<Millis>,
    /// The latest moment the user's devices were heard from (accepted
    /// Connect, Activity, Logout, SetInvisible at `now`, a Disconnect at its
    /// last heard) since others were shown the user online; `None` while
    /// they are not.
    pub heard: Option<Millis>,
}

/// Notable things the last transition did (for `sometimes` properties).
pub mod event {
    pub const FLAP_SUPPRESSED: u16 = 1;
    pub const RESUMED_IN_GRACE: u16 = 1 << 1;
    pub const GHOST_REAPED: u16 = 1 << 2;
    pub const BATCH_COALESCED: u16 = 1 << 3;
    pub const SUPERSEDED: u16 = 1 << 4;
    pub const CAP_REACHED: u16 = 1 << 5;
    pub const INVISIBLE_AT_ONCE: u16 = 1 << 6;
    pub const GRACE_EXPIRED: u16 = 1 << 7;
    pub const NOT_ALLOWED: u16 = 1 << 8;
    pub const STALE_REFUSED: u16 = 1 << 9;
    /// Last seen was set to a moment before the transition's `now` (a silent
    /// device, a reaped ghost, a grace that ran out).
    pub const LAST_SEEN_BEFORE_NOW: u16 = 1 << 10;
    /// A user was published offline while a session of theirs lives on in
    /// the background (I12).
    pub const BACKGROUND_OFFLINE: u16 = 1 << 11;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CoreState {
    pub core: Core,
    pub devs: Vec<Dev>,
    pub users: Vec<Track>,
    /// What each Online session last received about each target it is
    /// subscribed to (snapshot or push), as a client's view would hold it.
    pub recv: BTreeMap<(SessionId, UserId), Presence>,
    /// Batched subscriptions with changes published since their last push
    /// (1, or 2 for "two or more"), to see a flush coalesce two changes.
    pub pending: BTreeMap<(SessionId, UserId), u8>,
    /// Sessions issued so far.
    pub issued: u8,
    /// `SetStatus` and `SetInvisible` inputs accepted so far.
    pub toggles: u8,
    /// `SetForeground` inputs accepted so far.
    pub backgrounds: u8,
    /// `event::*` bits of the transition that led here.
    pub events: u16,
    /// Invariant violations found on the transition that led here, each
    /// prefixed with its id ("I5: ..."). States with violations are not
    /// explored further.
    pub bad: Vec<String>,
}

impl CoreModel {
    /// The watched user 1 has `bounds.devices` devices: the first (mobile)
    /// does everything, stale inputs included; the others (desktop, web, ...)
    /// connect, drop, resume and log out. Each other user has one watcher
    /// device: user 2 may watch only user 1 (so its attempts to watch user 3
    /// are refused, I11) and drops and resumes; user 3 and beyond may watch
    /// anyone and stay connected until they log out.
    pub fn new(bounds: Bounds) -> CoreModel {
        let config = small_config(bounds.devices);
        let target = UserId(1);
        let mut users = vec![target];
        let mut devices = Vec::new();
        let kinds = [
            DeviceKind::Mobile,
            DeviceKind::Desktop,
            DeviceKind::Web,
            DeviceKind::Other,
        ];
        for w in 1..bounds.users {
            let user = UserId(w as u64 + 1);
            users.push(user);
            devices.push(DeviceSpec {
                user,
                device: DeviceId(1),
                kind: if w == 1 {
                    DeviceKind::Web
                } else {
                    DeviceKind::Other
                },
                watch: if w == 1 {
                    Watch::only([target])
                } else {
                    Watch::All
                },
                role: Role::Watcher,
                caps: if w == 1 {
                    cap::WATCH | cap::DROP | cap::RESUME | cap::LOGOUT
                } else {
                    cap::WATCH
                },
            });
        }
        for d in 0..bounds.devices {
            devices.push(DeviceSpec {
                user: target,
                device: DeviceId(d as u64 + 1),
                kind: kinds[d % 4],
                watch: Watch::All,
                role: Role::Target,
                caps: if d == 0 {
                    cap::ALL
                } else {
                    cap::DROP | cap::LOGOUT
                },
            });
        }
        let init = Core::new(config).expect("the small config is valid");
        CoreModel {
            bounds,
            devices,
            users,
            init,
        }
    }

    /// Starts every run from `core` instead (built from `self.init.config()`,
    /// e.g. with a mutant switched on).
    pub fn with_core(mut self, core: Core) -> CoreModel {
        self.init = core;
        self
    }

    fn user_index(&self, user: UserId) -> usize {
        self.users.iter().position(|&u| u == user).unwrap_or(0)
    }

    fn config(&self) -> &Config {
        self.init.config()
    }

    /// The input an action stands for in a state, with its `now`.
    pub fn input_of(&self, s: &CoreState, action: &Action) -> Option<(Millis, Input)> {
        let now = s.core.now();
        match *action {
            Action::Tick(to) => Some((Millis(to), Input::Tick)),
            Action::Connect { dev, resume } => {
                let spec = &self.devices[dev as usize];
                Some((
                    now,
                    Input::Connect(Connect {
                        user: spec.user,
                        device: spec.device,
                        kind: spec.kind,
                        watch: spec.watch.clone(),
                        resume: if resume {
                            s.devs[dev as usize].cur
                        } else {
                            None
                        },
                        foreground: !s.devs[dev as usize].background,
                    }),
                ))
            }
            Action::Input { dev, stale, op } => {
                let d = &s.devs[dev as usize];
                let session = if stale { d.old.or(d.cur)? } else { d.cur? };
                let user = |i: u8| self.users[i as usize];
                let input = match op {
                    Op::Activity => Input::Activity(session),
                    Op::Disconnect { silent } => Input::Disconnect {
                        session,
                        last_heard: if silent { Millis::ZERO } else { now },
                    },
                    Op::Logout => Input::Logout(session),
                    Op::SetStatus(status) => Input::SetStatus {
                        session,
                        status,
                        message: None,
                    },
                    Op::SetInvisible(invisible) => Input::SetInvisible { session, invisible },
                    Op::SetForeground(foreground) => Input::SetForeground {
                        session,
                        foreground,
                    },
                    Op::Subscribe(t, tier) => Input::Subscribe {
                        session,
                        target: user(t),
                        tier,
                    },
                    Op::Unsubscribe(t) => Input::Unsubscribe {
                        session,
                        target: user(t),
                    },
                    Op::Query(t) => Input::Query {
                        session,
                        target: user(t),
                    },
                };
                Some((now, input))
            }
        }
    }

    /// One transition, with every check. `None` if it changes nothing.
    fn step(&self, s: &CoreState, action: &Action) -> Option<CoreState> {
        let (now, input) = self.input_of(s, action)?;
        let mut n = s.clone();
        n.events = 0;
        n.bad.clear();
        let mut bad: Vec<String> = Vec::new();
        let mut ev = 0u16;

        let named = named_session(&input);
        let stale = named.is_some_and(|id| s.core.session_info(id).is_none());
        let reply = n.core.handle_input(now, input.clone());
        let outs = drain(&mut n.core);

        // ---- I3: an input naming an ended session changes nothing ---------
        if stale {
            let mut expect = s.core.clone();
            let _ = expect.handle_input(now, Input::Tick);
            let expect_outs = drain(&mut expect);
            if reply != Err(Error::Stale) {
                bad.push(format!(
                    "I3: {input:?} on an ended session answered {reply:?}, not Stale"
                ));
            }
            if n.core != expect || outs != expect_outs {
                bad.push(format!(
                    "I3: {input:?} on an ended session changed the core"
                ));
            }
            ev |= event::STALE_REFUSED;
        }

        let connected = match &reply {
            Ok(Reply::Connected(c)) => Some(c.clone()),
            _ => None,
        };
        let new_session = connected.as_ref().map(|c| c.session);
        let owner = |id: SessionId| -> Option<UserId> {
            s.core
                .session_info(id)
                .or_else(|| n.core.session_info(id))
                .map(|i| i.user)
                .or_else(|| match (*action, new_session) {
                    (Action::Connect { dev, .. }, Some(new)) if new == id => {
                        Some(self.devices[dev as usize].user)
                    }
                    _ => None,
                })
        };

        // ---- outputs: I4, I5, I6, I7, I10 ---------------------------------
        let mut ended = BTreeSet::new();
        let mut published_now: BTreeMap<UserId, u64> = BTreeMap::new();
        for out in &outs {
            match out {
                Output::SessionEnded { session, reason } => {
                    let live =
                        s.core.session_info(*session).is_some() || Some(*session) == new_session;
                    if !live || !ended.insert(*session) {
                        bad.push(format!(
                            "I10: SessionEnded for {session}, which was not live"
                        ));
                    }
                    match reason {
                        EndReason::HeartbeatTimeout => ev |= event::GHOST_REAPED,
                        EndReason::GraceExpired => ev |= event::GRACE_EXPIRED,
                        EndReason::Superseded => {
                            if connected
                                .as_ref()
                                .is_some_and(|c| c.superseded == Some(*session))
                            {
                                ev |= event::SUPERSEDED;
                            }
                        }
                        EndReason::LoggedOut => {}
                    }
                }
                Output::Push {
                    to,
                    target,
                    tier,
                    presence,
                } => {
                    let live = s.core.session_info(*to).is_some() || Some(*to) == new_session;
                    if !live || ended.contains(to) {
                        bad.push(format!(
                            "I10: push about {target:?} to {to}, which has ended"
                        ));
                    }
                    let sub = (*target, *tier);
                    if !s.core.subscriptions(*to).contains(&sub)
                        && !n.core.subscriptions(*to).contains(&sub)
                    {
                        bad.push(format!(
                            "I10: push about {target:?} to {to}, not subscribed in {tier:?}"
                        ));
                    }
                    let online = |c: &Core| c.session_info(*to).is_some_and(|i| i.online);
                    if !online(&s.core) && !online(&n.core) {
                        bad.push(format!(
                            "I10: push about {target:?} to {to}, which is not Online"
                        ));
                    }
                    let own = owner(*to) == Some(*target);
                    let t = self.user_index(*target);
                    if !own {
                        check_shown_to_other(s, &n, t, *target, presence, "push", &mut bad);
                        let before_version = s.core.presence(*target).version;
                        if *tier == Tier::Realtime && presence.version > before_version {
                            let last = published_now.get(target).copied().unwrap_or(before_version);
                            if presence.version > last {
                                self.check_publish(s, &n, t, *target, presence, now, &mut bad);
                                published_now.insert(*target, presence.version);
                            }
                        }
                    }
                    let key = (*to, *target);
                    if let Some(prev) = n.recv.get(&key) {
                        if presence.version <= prev.version {
                            bad.push(format!(
                                "I7: {to} got version {} of {target:?} after {}",
                                presence.version, prev.version
                            ));
                        }
                    }
                    if *tier == Tier::Batched && n.pending.remove(&key) == Some(2) {
                        ev |= event::BATCH_COALESCED;
                    }
                    n.recv.insert(key, presence.clone());
                }
            }
        }

        // ---- the reply ------------------------------------------------------
        match &reply {
            Ok(Reply::Connected(c)) => {
                let Action::Connect { dev, resume } = *action else {
                    unreachable!("only Connect answers Connected")
                };
                let d = &mut n.devs[dev as usize];
                if d.cur != Some(c.session) {
                    if let Some(prev) = d.cur {
                        if s.core.session_info(prev).is_some() {
                            d.old = Some(prev);
                        }
                    }
                }
                d.cur = Some(c.session);
                n.issued += 1;
                if c.resumed {
                    let was = s.devs[dev as usize]
                        .cur
                        .and_then(|p| s.core.session_info(p));
                    if was.is_some_and(|i| !i.online) {
                        ev |= event::RESUMED_IN_GRACE;
                    }
                    if !resume {
                        bad.push("I3: a Connect without resume resumed".to_string());
                    }
                }
                for snap in &c.snapshots {
                    self.check_snapshot(
                        s,
                        &mut n,
                        c.session,
                        snap.target,
                        &snap.presence,
                        &mut bad,
                    );
                }
            }
            Ok(Reply::Subscribed(snap)) => {
                let session = named.expect("Subscribe names a session");
                if let Input::Subscribe { tier, .. } = &input {
                    if *tier == Tier::Realtime && snap.tier == Tier::Batched {
                        ev |= event::CAP_REACHED;
                    }
                }
                self.check_snapshot(s, &mut n, session, snap.target, &snap.presence, &mut bad);
            }
            Ok(Reply::Presence(p)) => {
                if let Input::Query { session, target } = &input {
                    if owner(*session) != Some(*target) {
                        let t = self.user_index(*target);
                        check_shown_to_other(s, &n, t, *target, p, "query answer", &mut bad);
                    }
                }
            }
            Err(Error::LimitExceeded(_)) => ev |= event::CAP_REACHED,
            Err(Error::NotAllowed) => ev |= event::NOT_ALLOWED,
            Ok(Reply::Done) | Err(_) => {}
        }

        // ---- per-device bookkeeping ----------------------------------------
        let mut heard = None;
        if let (
            Action::Input {
                dev,
                stale: false,
                op,
            },
            Ok(_),
        ) = (*action, &reply)
        {
            let d = &mut n.devs[dev as usize];
            // A backgrounded device is not present: nothing it sends counts
            // as heard for last seen (I12).
            let present = !d.background;
            match op {
                Op::Activity => {
                    d.active_at = Some(now);
                    heard = present.then_some((dev, now));
                }
                Op::Disconnect { silent } => {
                    d.lost_at = Some(now);
                    // Clamped up to the last activity, as the core must.
                    let last_heard = if silent { d.active_at } else { Some(now) };
                    heard = last_heard.filter(|_| present).map(|at| (dev, at));
                }
                Op::Logout => heard = present.then_some((dev, now)),
                Op::SetForeground(foreground) => {
                    n.backgrounds += 1;
                    d.active_at = Some(now);
                    // Going to the background is heard at that moment.
                    if present || foreground {
                        heard = Some((dev, now));
                    }
                    d.background = !foreground;
                }
                Op::SetInvisible(_) => {
                    n.toggles += 1;
                    heard = Some((dev, now));
                }
                Op::SetStatus(_) => n.toggles += 1,
                _ => {}
            }
        }
        if let Action::Connect { dev, .. } = *action {
            if reply.is_ok() {
                let d = &mut n.devs[dev as usize];
                d.active_at = Some(now);
                d.lost_at = None;
                heard = (!d.background).then_some((dev, now));
            }
        }
        if let Some((dev, at)) = heard {
            let t = self.user_index(self.devices[dev as usize].user);
            let track = &mut n.users[t];
            track.heard = Some(track.heard.map_or(at, |h| h.max(at)));
        }
        if let (Input::Logout(id), Ok(_)) = (&input, &reply) {
            self.check_logout(&n.core, *id, &mut bad);
        }

        // ---- publishes: I6, I7 ---------------------------------------------
        for (t, &user) in self.users.iter().enumerate() {
            let before = s.core.presence(user);
            let after = n.core.presence(user);
            if after.version < before.version
                || n.core.truth(user).version < s.core.truth(user).version
            {
                bad.push(format!("I7: the version of {user:?} went down"));
            }
            if !after.same_view(&before) && after.version == before.version {
                bad.push(format!(
                    "I7: what others see of {user:?} changed without a new version"
                ));
            }
            if after.version > before.version {
                if after.same_view(&before) {
                    bad.push(format!(
                        "I6: {user:?} published again with nothing new: {after:?}"
                    ));
                }
                if published_now.get(&user) != Some(&after.version) {
                    self.check_publish(s, &n, t, user, &after, now, &mut bad);
                }
                if !after.online && n.core.truth(user).invisible && s.core.shown(user).online {
                    ev |= event::INVISIBLE_AT_ONCE;
                }
                if !after.online && n.core.is_online(user) && !n.core.truth(user).invisible {
                    ev |= event::BACKGROUND_OFFLINE;
                }
                // Changes waiting in batches.
                for (key, count) in n.pending.iter_mut() {
                    if key.1 == user {
                        *count = 2;
                    }
                }
                for (d, spec) in self.devices.iter().enumerate() {
                    let Some(sess) = n.devs[d].cur else { continue };
                    if spec.user != user
                        && n.core.subscriptions(sess).contains(&(user, Tier::Batched))
                        && n.recv
                            .get(&(sess, user))
                            .is_some_and(|p| p.version < after.version)
                    {
                        n.pending.entry((sess, user)).or_insert(1);
                    }
                }
            }
        }
        let counters = (
            s.core.counters().flaps_suppressed,
            n.core.counters().flaps_suppressed,
        );
        if counters.1 > counters.0 {
            ev |= event::FLAP_SUPPRESSED;
        }

        // ---- tracking of when views changed --------------------------------
        for (t, &user) in self.users.iter().enumerate() {
            let track = &mut n.users[t];
            if !n.core.shown(user).same_view(&s.core.shown(user)) {
                track.shown_since = Some(now);
            }
            if !n.core.truth(user).same_view(&s.core.truth(user)) {
                track.truth_since = Some(now);
            }
            let invisible = n.core.truth(user).invisible;
            if !invisible {
                track.invisible_since = None;
            } else if !s.core.truth(user).invisible {
                track.invisible_since = Some(now);
            }
            // Last seen moves only to the last moment a device was heard
            // from (going invisible is heard at that moment), never to the
            // moment a grace or a timeout ran out.
            let seen = n.core.saved(user).last_seen;
            if seen != s.core.saved(user).last_seen {
                if seen != track.heard {
                    bad.push(format!(
                        "LS: {user:?} last seen set to {seen:?} at {now}, last heard {:?}",
                        track.heard
                    ));
                }
                if seen.is_some_and(|at| at < now) {
                    ev |= event::LAST_SEEN_BEFORE_NOW;
                }
            }
        }

        // ---- state invariants ------------------------------------------------
        self.normalize(&mut n, now);
        self.check_state(&n, now, &mut bad);

        n.events = ev;
        n.bad = bad;
        if n.bad.is_empty()
            && n.core == s.core
            && n.devs == s.devs
            && n.users == s.users
            && n.recv == s.recv
            && n.pending == s.pending
        {
            return None;
        }
        Some(n)
    }

    /// Forgets what no longer matters, so equal situations are equal states.
    fn normalize(&self, n: &mut CoreState, now: Millis) {
        let cfg = self.config();
        let (debounce, batch) = (cfg.debounce.0, cfg.batch_interval.0);
        for track in &mut n.users {
            if track
                .shown_since
                .is_some_and(|t| now.0 >= t.0 + debounce + batch)
            {
                track.shown_since = None;
            }
            if track.truth_since.is_some_and(|t| now.0 >= t.0 + batch) {
                track.truth_since = None;
            }
        }
        for (t, track) in n.users.iter_mut().enumerate() {
            if !n.core.shown(self.users[t]).online {
                // Only what is heard while shown counts; the next shown
                // stay starts with a moment heard (a connect, going visible).
                track.heard = None;
            }
        }
        for (dev, spec) in n.devs.iter_mut().zip(&self.devices) {
            if spec.caps & cap::STALE == 0 {
                dev.old = None; // only devices that send stale inputs need it
            }
            let info = dev.cur.and_then(|c| n.core.session_info(c));
            if !info.is_some_and(|i| i.online) {
                dev.active_at = None;
            }
            if !matches!(info, Some(i) if !i.online) {
                dev.lost_at = None;
            }
        }
        let core = &n.core;
        let keep = |&(sess, target): &(SessionId, UserId)| {
            core.session_info(sess).is_some_and(|i| i.online)
                && core.subscriptions(sess).iter().any(|&(t, _)| t == target)
        };
        n.recv.retain(|k, _| keep(k));
        n.pending.retain(|k, _| keep(k));
    }
}

fn named_session(input: &Input) -> Option<SessionId> {
    match input {
        Input::Connect(_) | Input::Tick => None,
        Input::Activity(s) | Input::Logout(s) => Some(*s),
        Input::Disconnect { session, .. } => Some(*session),
        Input::SetStatus { session, .. }
        | Input::SetInvisible { session, .. }
        | Input::SetForeground { session, .. }
        | Input::Subscribe { session, .. }
        | Input::Unsubscribe { session, .. }
        | Input::Query { session, .. } => Some(*session),
    }
}

fn drain(core: &mut Core) -> Vec<Output> {
    std::iter::from_fn(|| core.poll_output()).collect()
}

fn has(s: &CoreState, id: &str) -> bool {
    s.bad
        .iter()
        .any(|b| b.split_once(':').is_some_and(|(p, _)| p == id))
}

impl Model for CoreModel {
    type State = CoreState;
    type Action = Action;

    fn init_states(&self) -> Vec<CoreState> {
        vec![CoreState {
            core: self.init.clone(),
            devs: vec![Dev::default(); self.devices.len()],
            users: vec![Track::default(); self.users.len()],
            recv: BTreeMap::new(),
            pending: BTreeMap::new(),
            issued: 0,
            toggles: 0,
            backgrounds: 0,
            events: 0,
            bad: Vec::new(),
        }]
    }

    fn actions(&self, s: &CoreState, actions: &mut Vec<Action>) {
        if !s.bad.is_empty() {
            return; // a counterexample ends here
        }
        let now = s.core.now().0;
        if now < self.bounds.max_time {
            actions.push(Action::Tick(now + 1));
            if let Some(due) = s.core.poll_timeout() {
                if due.0 > now + 1 && due.0 <= self.bounds.max_time {
                    actions.push(Action::Tick(due.0));
                }
            }
        }
        for (d, spec) in self.devices.iter().enumerate() {
            let dev = d as u8;
            let caps = spec.caps;
            let can = |c: u16| caps & c != 0;
            let state = &s.devs[d];
            let info = state.cur.and_then(|c| s.core.session_info(c));
            // First connects happen in device order (watchers first): the
            // core numbers sessions by slot, so other orders would only
            // repeat the same situations under other session ids.
            // Watchers are there from the start (their connect time would
            // only shift their heartbeat deadlines, far beyond the bound).
            let first_in_order = state.cur.is_some()
                || (s.devs[..d].iter().all(|o| o.cur.is_some())
                    && (spec.role == Role::Target || s.core.now() == Millis::ZERO));
            if s.issued < self.bounds.max_sessions && first_in_order {
                if info.is_none() || can(cap::RECONNECT) {
                    actions.push(Action::Connect { dev, resume: false });
                }
                if state.cur.is_some() && can(cap::RESUME) {
                    actions.push(Action::Connect { dev, resume: true });
                }
            }
            let mut input = |op| {
                actions.push(Action::Input {
                    dev,
                    stale: false,
                    op,
                })
            };
            match info {
                Some(i) if i.online => {
                    if can(cap::ACTIVITY) {
                        input(Op::Activity);
                    }
                    if can(cap::DROP) {
                        input(Op::Disconnect { silent: false });
                    }
                    // Silent only differs when something was heard before now.
                    let active = state.active_at.unwrap_or(s.core.now());
                    if can(cap::SILENT_LOSS) && active < s.core.now() {
                        input(Op::Disconnect { silent: true });
                    }
                    if can(cap::LOGOUT) {
                        input(Op::Logout);
                    }
                    let truth = s.core.truth(spec.user);
                    let toggle = s.toggles < self.bounds.max_toggles;
                    if can(cap::STATUS) && toggle {
                        let next = if truth.status == Status::Available {
                            Status::Away
                        } else {
                            Status::Available
                        };
                        input(Op::SetStatus(next));
                    }
                    if can(cap::INVISIBLE) && toggle {
                        input(Op::SetInvisible(!truth.invisible));
                    }
                    if can(cap::BACKGROUND) && s.backgrounds < self.bounds.max_backgrounds {
                        input(Op::SetForeground(state.background));
                    }
                    let subs = s.core.subscriptions(state.cur.unwrap());
                    let mut sub = |t: usize, tiers: &[Tier], unsub: bool| {
                        let target = self.users[t];
                        for &tier in tiers {
                            if !subs.contains(&(target, tier)) {
                                input(Op::Subscribe(t as u8, tier));
                            }
                        }
                        if unsub && subs.iter().any(|&(u, _)| u == target) {
                            input(Op::Unsubscribe(t as u8));
                        }
                    };
                    const BOTH: [Tier; 2] = [Tier::Realtime, Tier::Batched];
                    if can(cap::OWN) {
                        sub(self.user_index(spec.user), &BOTH, false);
                    }
                    if can(cap::WATCH) {
                        if spec.watch == Watch::All {
                            // Asks for realtime: downgraded while user 2 holds it.
                            sub(0, &[Tier::Realtime], false);
                        } else {
                            // Both tiers, switching and unsubscribing; and an
                            // attempt outside its credentials (refused, I11).
                            sub(0, &BOTH, true);
                            if self.users.len() > 2 {
                                sub(2, &[Tier::Realtime], false);
                            }
                        }
                    }
                }
                Some(_) if can(cap::LOGOUT) => input(Op::Logout), // Lingering: only a logout acts
                Some(_) => {}
                None => {}
            }
            // Stale inputs: on the superseded session, or on an ended current one.
            let stale_id = state
                .old
                .or(state.cur.filter(|&c| s.core.session_info(c).is_none()));
            if stale_id.is_some() && can(cap::STALE) {
                for op in [
                    Op::Activity,
                    Op::Disconnect { silent: false },
                    Op::Logout,
                    Op::SetInvisible(true),
                    Op::SetStatus(Status::Busy),
                    Op::Subscribe(0, Tier::Realtime),
                    Op::Query(0),
                ] {
                    actions.push(Action::Input {
                        dev,
                        stale: true,
                        op,
                    });
                }
            }
        }
    }

    fn next_state(&self, s: &CoreState, action: Action) -> Option<CoreState> {
        self.step(s, &action)
    }

    fn within_boundary(&self, s: &CoreState) -> bool {
        !s.bad.is_empty()
            || self.users.iter().enumerate().all(|(t, &u)| {
                let max = if t == 0 {
                    self.bounds.max_version
                } else {
                    self.bounds.max_watcher_version
                };
                s.core.truth(u).version <= max
            })
    }

    fn format_action(&self, action: &Action) -> String {
        format!("{action:?}")
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::<Self>::always("I1 aggregation", |_, s| !has(s, "I1")),
            Property::<Self>::always("I2 no ghosts", |_, s| !has(s, "I2")),
            Property::<Self>::always("I3 stale inputs", |_, s| !has(s, "I3")),
            Property::<Self>::always("I4 logout is final", |_, s| !has(s, "I4")),
            Property::<Self>::always("I5 invisible", |_, s| !has(s, "I5")),
            Property::<Self>::always("I6 debounce", |_, s| !has(s, "I6")),
            Property::<Self>::always("I7 versions", |_, s| !has(s, "I7")),
            Property::<Self>::always("I8 convergence", |_, s| !has(s, "I8")),
            Property::<Self>::always("I9 routing", |_, s| !has(s, "I9")),
            Property::<Self>::always("I10 no stray output", |_, s| !has(s, "I10")),
            Property::<Self>::always("I11 authorization", |_, s| !has(s, "I11")),
            Property::<Self>::always("I12 background", |_, s| !has(s, "I12")),
            Property::<Self>::always("core structure", |_, s| !has(s, "S")),
            Property::<Self>::always("last seen is last heard", |_, s| !has(s, "LS")),
            Property::<Self>::sometimes("flap suppressed by debounce", |_, s| {
                s.events & event::FLAP_SUPPRESSED != 0
            }),
            Property::<Self>::sometimes("resume within grace", |_, s| {
                s.events & event::RESUMED_IN_GRACE != 0
            }),
            Property::<Self>::sometimes("ghost reaped", |_, s| s.events & event::GHOST_REAPED != 0),
            Property::<Self>::sometimes("grace expired", |_, s| {
                s.events & event::GRACE_EXPIRED != 0
            }),
            Property::<Self>::sometimes("batched flush coalesced two changes", |_, s| {
                s.events & event::BATCH_COALESCED != 0
            }),
            Property::<Self>::sometimes("superseded session", |_, s| {
                s.events & event::SUPERSEDED != 0
            }),
            Property::<Self>::sometimes("cap reached", |_, s| s.events & event::CAP_REACHED != 0),
            Property::<Self>::sometimes("invisible published at once", |_, s| {
                s.events & event::INVISIBLE_AT_ONCE != 0
            }),
            Property::<Self>::sometimes("converged batched watcher", converged_batched),
            Property::<Self>::sometimes("last seen set to an earlier moment", |_, s| {
                s.events & event::LAST_SEEN_BEFORE_NOW != 0
            }),
        ];
        if self.bounds.max_backgrounds > 0 {
            properties.push(Property::<Self>::sometimes(
                "backgrounded user published offline",
                |_, s| s.events & event::BACKGROUND_OFFLINE != 0,
            ));
        }
        properties
    }
}

/// A watcher subscribed in the batched tier whose view equals a target shown
/// online with a non-default status, after a change was published (so I8
/// is checked on a real change, not on an idle start).
fn converged_batched(m: &CoreModel, s: &CoreState) -> bool {
    s.recv.iter().any(|(&(sess, target), p)| {
        p.online
            && p.status != Status::Available
            && s.core
                .subscriptions(sess)
                .contains(&(target, Tier::Batched))
            && m.users.first() == Some(&target)
            && s.users[0].shown_since.is_none()
            && s.core.session_info(sess).is_some_and(|i| i.user != target)
    })
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// A readable counterexample: each step as the input the core received.
pub fn describe_path(model: &CoreModel, path: &[(CoreState, Option<Action>)]) -> Vec<String> {
    let mut lines = Vec::new();
    for (state, action) in path {
        if let Some(action) = action {
            if let Some((now, input)) = model.input_of(state, action) {
                lines.push(format!("t={:>2}  {}", now.0, describe_input(&input)));
            }
        } else {
            for b in &state.bad {
                lines.push(format!("      => {b}"));
            }
        }
    }
    lines
}

pub fn describe_input(input: &Input) -> String {
    match input {
        Input::Connect(c) => format!(
            "Connect user {} device {} ({}){}",
            c.user.0,
            c.device.0,
            c.kind.name(),
            c.resume.map(|r| format!(" resume {r}")).unwrap_or_default()
        ),
        Input::Activity(s) => format!("Activity {s}"),
        Input::Disconnect {
            session,
            last_heard,
        } => format!("Disconnect {session} last heard {}", last_heard.0),
        Input::Logout(s) => format!("Logout {s}"),
        Input::SetStatus {
            session, status, ..
        } => format!("SetStatus {session} {}", status.name()),
        Input::SetInvisible { session, invisible } => format!("SetInvisible {session} {invisible}"),
        Input::SetForeground {
            session,
            foreground,
        } => format!("SetForeground {session} {foreground}"),
        Input::Subscribe {
            session,
            target,
            tier,
        } => {
            format!("Subscribe {session} to user {} {tier:?}", target.0)
        }
        Input::Unsubscribe { session, target } => {
            format!("Unsubscribe {session} from user {}", target.0)
        }
        Input::Query { session, target } => format!("Query {session} user {}", target.0),
        Input::Tick => "Tick".to_string(),
    }
}
