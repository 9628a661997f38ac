//! Model 1 (groups): the real core with one group, explored exhaustively.
//!
//! Three users of one device each, all members of group 1: user 1 (the
//! mover) connects, drops (and is gone after grace) and toggles
//! invisibility; user 2 subscribes as a member and may drop and resume;
//! user 3 connects and subscribes as the admin at time 0, if at all. A
//! backend may rewrite the group once: demote the admin, remove the mover,
//! or swap the admin for user 2. Time advances one millisecond per tick, so
//! every tick's outputs are those of one instant (debounce 1, group
//! interval 2, grace 1). User 2 may also watch the group's one page (all
//! three members), renew and end the watch, which runs out 2 ms after it
//! was last asked for or renewed; a resume carries the watch over.
//!
//! Each transition drains the group outputs and checks, with the id in front
//! of each violation: G1 (an interval after the count last changed, every
//! Online member session was last told it), G2 (`check_invariants`: the
//! count is the members published online; and every count pushed equals it),
//! G3 (per session, pushes strictly rise and snapshots never go back), G4
//! (deltas only to Online sessions holding an admin subscription of an
//! admin; admins told every count at once), G5 (page deltas only to an
//! Online session holding an unexpired watch of a page listing the member,
//! each with the member's published view; the watches the core holds are
//! the ones asked for, renewed, carried over a resume and not run out). The
//! mover's own inputs are
//! bounded, so the state space is small (see `model/tests/groups.rs`).

use greendot_core::{
    Config, Connect, Core, DeviceId, DeviceKind, Error, GroupId, GroupOutput, GroupRole,
    KindConfig, Millis, SessionId, UserId, Watch,
};
use stateright::{Model, Property};
use std::collections::BTreeMap;

pub const GROUP: GroupId = GroupId(1);
const USERS: [UserId; 3] = [UserId(1), UserId(2), UserId(3)];

/// The size of the checked world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupBounds {
    /// `now` never passes this.
    pub max_time: u64,
    /// Sessions issued over the run.
    pub max_sessions: u8,
    /// The mover's `SetInvisible` inputs over the run.
    pub max_toggles: u8,
    /// Membership writes over the run.
    pub max_writes: u8,
    /// User 2's watch, renew and unwatch inputs over the run.
    pub max_watch_ops: u8,
}

impl GroupBounds {
    pub const CI: GroupBounds = GroupBounds {
        max_time: 4,
        max_sessions: 3,
        max_toggles: 1,
        max_writes: 1,
        max_watch_ops: 0,
    };

    /// Watched pages: user 2's watch, renewal and end, with every other
    /// input of [`GroupBounds::CI`] but the membership write (user 2 stays
    /// a member through every write, so a write adds states, not cases).
    pub const WATCH: GroupBounds = GroupBounds {
        max_time: 4,
        max_sessions: 3,
        max_toggles: 1,
        max_writes: 0,
        max_watch_ops: 2,
    };
}

/// A membership write: (members, admins).
fn write(w: u8) -> (Vec<UserId>, Vec<UserId>) {
    let [a, b, c] = USERS;
    match w {
        0 => (vec![a, b, c], vec![]),
        1 => (vec![b, c], vec![c]),
        _ => (vec![a, b, c], vec![b]),
    }
}

pub fn group_config() -> Config {
    let kind = KindConfig {
        heartbeat_timeout: Millis(1_000),
        grace: Millis(1),
    };
    Config {
        debounce: Millis(1),
        batch_interval: Millis(1),
        kinds: [kind; 4],
        group_interval: Millis(2),
        group_watch_ttl: Millis(2),
        max_sessions: 8,
        max_users: 4,
        ..Config::default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupAction {
    Tick,
    Connect {
        dev: u8,
        resume: bool,
    },
    Disconnect(u8),
    SetInvisible(bool),
    Subscribe(u8),
    Write(u8),
    /// User 2 watches the first page (all three members).
    WatchPage,
    RenewWatch,
    Unwatch,
}

/// The watch of the first page, as the model asked for it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PageWatchRef {
    pub session: SessionId,
    /// The members the page listed, sorted.
    pub members: Vec<UserId>,
    pub expires: Millis,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupState {
    pub core: Core,
    /// The latest session of each user's device.
    pub cur: [Option<SessionId>; 3],
    /// What each live subscribed session was last told: (version, count).
    pub told: BTreeMap<SessionId, (u64, u32)>,
    /// When the count last changed.
    pub since: Millis,
    pub issued: u8,
    pub toggles: u8,
    pub writes: u8,
    pub watch_ops: u8,
    /// User 2's watch of the first page, while it lives.
    pub watch: Option<PageWatchRef>,
    /// A member session was told a new count; an admin got a delta; a
    /// watcher got a page delta.
    pub counted: bool,
    pub delta: bool,
    pub paged: bool,
    pub bad: Vec<String>,
}

#[derive(Clone, Debug)]
pub struct GroupModel {
    pub bounds: GroupBounds,
    pub init: Core,
}

impl GroupModel {
    pub fn new(bounds: GroupBounds) -> GroupModel {
        let mut init = Core::new(group_config()).expect("valid config");
        init.handle_set_group(Millis(0), GROUP, &USERS, &USERS[2..])
            .expect("within limits");
        GroupModel { bounds, init }
    }

    /// Starts from `core` instead (e.g. with a mutant switched on).
    pub fn with_core(mut self, core: Core) -> GroupModel {
        self.init = core;
        self
    }

    fn online(core: &Core, s: Option<SessionId>) -> Option<SessionId> {
        s.filter(|&s| core.session_info(s).is_some_and(|i| i.online))
    }

    fn step(&self, s: &GroupState, action: GroupAction) -> Option<GroupState> {
        let mut n = s.clone();
        n.bad.clear();
        n.counted = false;
        n.delta = false;
        n.paged = false;
        let now = s.core.now();
        let ttl = s.core.config().group_watch_ttl;
        let mut snapshot = None;
        let result: Result<(), Error> = match action {
            GroupAction::Tick => {
                n.core.handle_timeout(Millis(now.0 + 1));
                Ok(())
            }
            GroupAction::Connect { dev, resume } => {
                let c = Connect {
                    user: USERS[dev as usize],
                    device: DeviceId(1),
                    kind: DeviceKind::Desktop,
                    watch: Watch::All,
                    resume: if resume { s.cur[dev as usize] } else { None },
                    foreground: true,
                };
                let connected = n.core.handle_connect(now, c).ok()?;
                n.issued += 1;
                let old = n.cur[dev as usize].replace(connected.session);
                // A resumed session holds the watch of the one it resumed.
                if let Some(w) = n
                    .watch
                    .as_mut()
                    .filter(|w| connected.resumed && Some(w.session) == old)
                {
                    w.session = connected.session;
                }
                Ok(())
            }
            GroupAction::Disconnect(dev) => {
                n.core.handle_disconnect(now, s.cur[dev as usize]?, now)
            }
            GroupAction::SetInvisible(on) => {
                n.toggles += 1;
                n.core.handle_set_invisible(now, s.cur[0]?, on)
            }
            GroupAction::Subscribe(dev) => {
                let id = s.cur[dev as usize]?;
                match n.core.handle_group_subscribe(now, id, GROUP) {
                    Ok(snap) => {
                        snapshot = Some((id, snap));
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            GroupAction::Write(w) => {
                n.writes += 1;
                let (members, admins) = write(w);
                n.core
                    .handle_set_group(now, GROUP, &members, &admins)
                    .map(|_| ())
            }
            GroupAction::WatchPage => {
                n.watch_ops += 1;
                let id = s.cur[1]?;
                n.core
                    .handle_group_watch_page(now, id, GROUP, None, 3)
                    .map(|page| {
                        let mut members: Vec<_> = page.entries.iter().map(|(u, _)| *u).collect();
                        members.sort_unstable();
                        n.watch = Some(PageWatchRef {
                            session: id,
                            members,
                            expires: Millis(now.0 + ttl.0),
                        });
                    })
            }
            GroupAction::RenewWatch | GroupAction::Unwatch => {
                n.watch_ops += 1;
                let id = s.cur[1]?;
                let renew = action == GroupAction::RenewWatch;
                let got = if renew {
                    n.core.handle_group_renew_watch(now, id, GROUP, None)
                } else {
                    n.core.handle_group_unwatch(now, id, GROUP, None)
                };
                let held = s
                    .watch
                    .as_ref()
                    .is_some_and(|w| w.session == id && now < w.expires);
                match (&got, held) {
                    (Ok(()), true) if renew => {
                        if let Some(w) = n.watch.as_mut() {
                            w.expires = Millis(now.0 + ttl.0);
                        }
                    }
                    (Ok(()), true) => n.watch = None,
                    (Err(Error::NotSubscribed), false) => {}
                    _ => n.bad.push(format!(
                        "G5: {action:?} of {id} answered {got:?}, the watch held: {held}"
                    )),
                }
                got.or_else(|e| match e {
                    Error::NotSubscribed => Ok(()),
                    e => Err(e),
                })
            }
        };
        if matches!(result, Err(Error::Stale | Error::UnknownSession)) {
            return None;
        }
        while n.core.poll_output().is_some() {}
        let now = n.core.now();
        let bad = &mut n.bad;
        if let Err(e) = n.core.check_invariants() {
            bad.push(if e.starts_with('G') {
                e
            } else {
                format!("S: {e}")
            });
        }
        n.told
            .retain(|&sess, _| n.core.session_info(sess).is_some());
        let count = n.core.group_count(GROUP).unwrap_or(0);
        if let Some((id, snap)) = snapshot {
            if let Some(&(v, _)) = n.told.get(&id) {
                if snap.version < v {
                    bad.push(format!("G3: snapshot {} to {id} after {v}", snap.version));
                }
            }
            n.told.insert(id, (snap.version, snap.count));
        }
        let admins = n
            .core
            .group_members(GROUP)
            .map(|(_, a)| a.to_vec())
            .unwrap_or_default();
        while let Some(out) = n.core.poll_group_output() {
            let (to, version, pushed) = match out {
                GroupOutput::Ended { to, .. } => {
                    n.told.remove(&to);
                    continue;
                }
                GroupOutput::Page { to, group, entries } => {
                    n.paged = true;
                    let online = n.core.session_info(to).is_some_and(|i| i.online);
                    let watch = n
                        .watch
                        .as_ref()
                        .filter(|w| w.session == to && group == GROUP && now < w.expires);
                    if !online {
                        bad.push(format!("G5: a page delta to {to}, not Online"));
                    }
                    let members = n.core.group_members(GROUP).map(|(m, _)| m.to_vec());
                    for (member, view) in &entries {
                        if !watch.is_some_and(|w| w.members.contains(member)) {
                            bad.push(format!(
                                "G5: a delta of {member:?} to {to} at {now}, no live watch lists it"
                            ));
                        }
                        if !members.as_ref().is_some_and(|m| m.contains(member)) {
                            bad.push(format!("G5: a delta of {member:?}, not a member"));
                        }
                        if *view != n.core.presence(*member) {
                            bad.push(format!(
                                "G5: a delta of {member:?} to {to}, not its published view"
                            ));
                        }
                    }
                    continue;
                }
                GroupOutput::Member {
                    to, version, count, ..
                } => {
                    n.delta = true;
                    let admin = n
                        .core
                        .session_info(to)
                        .is_some_and(|i| i.online && admins.contains(&i.user));
                    let held = n
                        .core
                        .group_subscriptions(to)
                        .contains(&(GROUP, GroupRole::Admin));
                    if !admin || !held {
                        bad.push(format!("G4: a member delta to {to}, not an Online admin"));
                    }
                    (to, version, count)
                }
                GroupOutput::Count {
                    to, version, count, ..
                } => {
                    let now_count = n.core.group_count(GROUP).unwrap_or(0);
                    if count != now_count {
                        bad.push(format!("G2: {to} told {count}, the count is {now_count}"));
                    }
                    if n.core.group_subscriptions(to) == [(GROUP, GroupRole::Member)] {
                        n.counted = true;
                    }
                    (to, version, count)
                }
            };
            if let Some(&(v, _)) = n.told.get(&to) {
                if version <= v {
                    bad.push(format!("G3: {to} got version {version} after {v}"));
                }
            }
            n.told.insert(to, (version, pushed));
        }
        // A watch lives until it runs out or its session ends; then the
        // core must hold exactly the watch asked for.
        let core = &n.core;
        n.watch = n
            .watch
            .take()
            .filter(|w| now < w.expires && core.session_info(w.session).is_some());
        let watchers = n
            .watch
            .as_ref()
            .map(|w| w.session)
            .into_iter()
            .chain(s.cur[1]);
        for sess in watchers {
            let held = n.core.group_watches(sess);
            let want: Vec<_> = n
                .watch
                .iter()
                .filter(|w| w.session == sess)
                .map(|w| (GROUP, None, w.members.clone(), w.expires))
                .collect();
            if held != want {
                bad.push(format!(
                    "G5: {sess} holds the watches {held:?}, asked for {want:?}"
                ));
            }
        }
        if Some(count) != s.core.group_count(GROUP) {
            n.since = now;
        }
        let settled = now.0 >= n.since.0 + n.core.config().group_interval.0;
        for (&sess, &(_, told)) in &n.told {
            if n.core.session_info(sess).is_none_or(|i| !i.online) {
                continue;
            }
            match n.core.group_subscriptions(sess).first() {
                Some((_, GroupRole::Admin)) if told != count => {
                    bad.push(format!(
                        "G4: admin {sess} told {told}, the count is {count}"
                    ));
                }
                Some((_, GroupRole::Member)) if settled && told != count => bad.push(format!(
                    "G1: member {sess} told {told} at {now}, the count {count} since {}",
                    n.since
                )),
                _ => {}
            }
        }
        Some(n)
    }
}

fn has(s: &GroupState, id: &str) -> bool {
    s.bad.iter().any(|b| {
        b.split_once(':')
            .is_some_and(|(tag, _)| tag.starts_with(id))
    })
}

impl Model for GroupModel {
    type State = GroupState;
    type Action = GroupAction;

    fn init_states(&self) -> Vec<GroupState> {
        vec![GroupState {
            core: self.init.clone(),
            cur: [None; 3],
            told: BTreeMap::new(),
            since: Millis(0),
            issued: 0,
            toggles: 0,
            writes: 0,
            watch_ops: 0,
            watch: None,
            counted: false,
            delta: false,
            paged: false,
            bad: Vec::new(),
        }]
    }

    fn actions(&self, s: &GroupState, actions: &mut Vec<GroupAction>) {
        if !s.bad.is_empty() {
            return;
        }
        let b = &self.bounds;
        if s.core.now().0 < b.max_time {
            actions.push(GroupAction::Tick);
        }
        for dev in 0..3u8 {
            // The admin's device connects and subscribes at time 0 only and
            // stays: its role changes through writes (this keeps the state
            // space small).
            if dev == 2 && s.core.now().0 > 0 {
                continue;
            }
            let cur = s.cur[dev as usize];
            let info = cur.and_then(|c| s.core.session_info(c));
            match info {
                None | Some(_) if s.issued >= b.max_sessions => {}
                None => actions.push(GroupAction::Connect { dev, resume: false }),
                // Only the member watcher resumes (its subscription carries
                // over); the mover's resume is unseen by anyone anyway.
                Some(i) if !i.online && dev == 1 => {
                    actions.push(GroupAction::Connect { dev, resume: true })
                }
                Some(_) => {}
            }
            let Some(id) = GroupModel::online(&s.core, cur) else {
                continue;
            };
            if dev < 2 {
                actions.push(GroupAction::Disconnect(dev));
            }
            if dev == 0 {
                if s.toggles < b.max_toggles {
                    let invisible = s.core.truth(USERS[0]).invisible;
                    actions.push(GroupAction::SetInvisible(!invisible));
                }
            } else if s.core.group_subscriptions(id).is_empty() {
                actions.push(GroupAction::Subscribe(dev));
            }
            if dev == 1 && s.watch_ops < b.max_watch_ops {
                if s.core.group_watches(id).is_empty() {
                    actions.push(GroupAction::WatchPage);
                } else {
                    actions.push(GroupAction::RenewWatch);
                    actions.push(GroupAction::Unwatch);
                }
            }
        }
        if s.writes < b.max_writes {
            for w in 0..3 {
                actions.push(GroupAction::Write(w));
            }
        }
    }

    fn next_state(&self, s: &GroupState, action: GroupAction) -> Option<GroupState> {
        self.step(s, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::<Self>::always("G1 exact at quiescence", |_, s| !has(s, "G1")),
            Property::<Self>::always("G2 count of published views", |_, s| !has(s, "G2")),
            Property::<Self>::always("G3 versions rise", |_, s| !has(s, "G3")),
            Property::<Self>::always("G4 deltas to live admins", |_, s| !has(s, "G4")),
            Property::<Self>::always("G5 page deltas to live watches", |_, s| !has(s, "G5")),
            Property::<Self>::always("core structure", |_, s| !has(s, "S")),
            Property::<Self>::sometimes("member told a new count", |_, s| s.counted),
            Property::<Self>::sometimes("admin told a delta", |_, s| s.delta),
        ];
        if self.bounds.max_watch_ops > 0 {
            properties.push(Property::<Self>::sometimes(
                "watcher told a page delta",
                |_, s| s.paged,
            ));
        }
        properties
    }
}
