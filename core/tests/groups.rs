//! Group presence (issue 28): property tests against a reference model of
//! the group layer (examples in `group_examples.rs` and `group_watch.rs`). The reference computes every count
//! from the published views (`Core::presence`, itself checked against the
//! reference of `properties.rs`), and checks G1–G4 on every output:
//! - G1: after `group_interval` without a change of a group's count, every
//!   Online member session was last told the count;
//! - G2: every count pushed is at most the members, and equals the members
//!   published online (admins: after every step; members: at each flush);
//! - G3: per (session, group), pushes carry strictly rising versions and a
//!   snapshot is never older than a push before it;
//! - G4: member deltas reach only Online sessions holding an admin
//!   subscription of a current admin; members get counts only when they
//!   changed, at most once per interval;
//! - G5: page deltas reach only Online sessions with a live, unexpired
//!   watch of a page of that group listing that member, and carry its
//!   published view; the watches held are exactly the reference's (asked,
//!   renewed, unwatched, run out, carried over a resume, dropped with the
//!   session or membership),
//!   and the watch limits refuse exactly when the reference says.
//!
//! Each `GroupMutant` is shown caught.

use greendot_core::mutants::GroupMutant;
use greendot_core::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const USERS: u8 = 5;
const GROUPS: u8 = 3;

#[derive(Clone, Debug)]
enum Op {
    Connect {
        user: u8,
        device: u8,
        resume: bool,
    },
    Activity(u8),
    Disconnect(u8),
    Logout(u8),
    SetInvisible(u8, bool),
    SetForeground(u8, bool),
    SetGroup {
        group: u8,
        members: Vec<u8>,
        admins: Vec<u8>,
    },
    /// A change by difference; `expect`: none, the current membership
    /// version (`true`) or another (`false`).
    ChangeGroup {
        group: u8,
        add: Vec<u8>,
        remove: Vec<u8>,
        add_admins: Vec<u8>,
        remove_admins: Vec<u8>,
        expect: Option<bool>,
    },
    RemoveGroup(u8),
    Subscribe(u8, u8),
    Unsubscribe(u8, u8),
    /// Every page of a group's member list, pages of this many, at one instant.
    Pages(u8, u8, u8),
    /// Watch a page of this many: the first (`false`) or the second.
    WatchPage(u8, u8, u8, bool),
    /// Renew or end (`false`) the n-th watch of a session.
    Rewatch(u8, u8, bool),
    Release(u8),
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    let user = || 1..=USERS;
    let group = || 1..=GROUPS;
    prop_oneof![
        6 => (user(), 1u8..=2, prop::bool::weighted(0.6))
            .prop_map(|(user, device, resume)| Op::Connect { user, device, resume }),
        2 => any::<u8>().prop_map(Op::Activity),
        2 => any::<u8>().prop_map(Op::Disconnect),
        1 => any::<u8>().prop_map(Op::Logout),
        6 => (any::<u8>(), any::<bool>()).prop_map(|(s, b)| Op::SetInvisible(s, b)),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(s, b)| Op::SetForeground(s, b)),
        3 => (group(), prop::collection::vec(user(), 1..=6), prop::collection::vec(user(), 0..=2))
            .prop_map(|(group, members, admins)| Op::SetGroup { group, members, admins }),
        3 => (
            group(),
            prop::collection::vec(user(), 0..=3),
            prop::collection::vec(user(), 0..=3),
            prop::collection::vec(user(), 0..=3),
            prop::collection::vec(user(), 0..=2),
            prop::option::of(prop::bool::weighted(0.8)),
        )
            .prop_map(|(group, add, remove, add_admins, remove_admins, expect)| Op::ChangeGroup {
                group,
                add,
                remove,
                add_admins,
                remove_admins,
                expect,
            }),
        1 => group().prop_map(Op::RemoveGroup),
        14 => (any::<u8>(), group()).prop_map(|(s, g)| Op::Subscribe(s, g)),
        1 => (any::<u8>(), group()).prop_map(|(s, g)| Op::Unsubscribe(s, g)),
        3 => (any::<u8>(), group(), 1u8..=4).prop_map(|(s, g, n)| Op::Pages(s, g, n)),
        3 => (any::<u8>(), group(), 1u8..=3, any::<bool>())
            .prop_map(|(s, g, n, second)| Op::WatchPage(s, g, n, second)),
        1 => (any::<u8>(), any::<u8>(), prop::bool::weighted(0.7))
            .prop_map(|(s, n, renew)| Op::Rewatch(s, n, renew)),
        1 => user().prop_map(Op::Release),
        3 => Just(Op::Tick),
    ]
}

fn dt() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => Just(0u64),
        6 => 1u64..=60,
        5 => 100u64..=450,
        3 => 800u64..=2500,
    ]
}

fn steps() -> impl Strategy<Value = Vec<(u64, Op)>> {
    prop::collection::vec((dt(), op()), 170..290)
}

fn config() -> impl Strategy<Value = Config> {
    (1usize..=2).prop_map(|subs| {
        let mut c = Config {
            debounce: Millis(300),
            batch_interval: Millis(1000),
            group_interval: Millis(1000),
            max_group_members: 5,
            max_group_admins: 2,
            max_group_subscriptions_per_session: subs,
            max_groups: 2,
            max_sessions: 8,
            max_users: 5,
            group_watch_ttl: Millis(4000),
            max_watched_pages: 2,
            max_watched_entries: 4,
            // No page budget here (its own examples test it): the
            // reference walks every page at one instant.
            group_page_refill: Millis(0),
            ..Config::default()
        };
        for (kind, grace) in DeviceKind::ALL.into_iter().zip([2000, 1000, 0, 500]) {
            *c.kind_mut(kind) = KindConfig {
                grace: Millis(grace),
                heartbeat_timeout: Millis(20_000),
            };
        }
        c
    })
}

#[derive(Default)]
struct RefGroup {
    members: BTreeSet<UserId>,
    admins: BTreeSet<UserId>,
    membership: u64,
}

impl RefGroup {
    fn role(&self, user: UserId) -> Option<GroupRole> {
        if self.admins.contains(&user) {
            Some(GroupRole::Admin)
        } else if self.members.contains(&user) {
            Some(GroupRole::Member)
        } else {
            None
        }
    }
}

/// What one session was told of one group.
#[derive(Clone, Copy, Debug)]
struct Told {
    version: u64,
    count: u32,
    /// When the last `Count` reached it as a member (pacing).
    pushed_at: Option<u64>,
}

/// A watched page: its session, group and the cursor it was asked from.
type WatchKey = (SessionId, GroupId, Option<PageCursor>);

struct Driver {
    core: Core,
    now: u64,
    issued: Vec<SessionId>,
    groups: BTreeMap<GroupId, RefGroup>,
    /// Subscriptions as the reference expects them.
    subs: BTreeMap<SessionId, BTreeMap<GroupId, GroupRole>>,
    told: BTreeMap<(SessionId, GroupId), Told>,
    /// The count each group had after the last step, and since when.
    counts: BTreeMap<GroupId, (u32, u64)>,
    /// Member sessions G1 was checked on (so the test is not vacuous).
    g1_checked: u64,
    member_deltas: u64,
    count_pushes: u64,
    pages_walked: u64,
    /// Watched pages as the reference expects them: members and expiry.
    watches: BTreeMap<WatchKey, (BTreeSet<UserId>, u64)>,
    page_deltas: u64,
    /// Changes by difference made, and refused for their expected version.
    changes: u64,
    mismatches: u64,
    /// The highest membership version a removed group reached.
    membership_floor: u64,
}

fn fail(why: String) -> TestCaseError {
    TestCaseError::fail(why)
}

impl Driver {
    fn new(config: Config, mutant: Option<GroupMutant>) -> Driver {
        let mut core = Core::new(config).unwrap();
        core.set_group_mutant(mutant);
        Driver {
            core,
            now: 0,
            issued: Vec::new(),
            groups: BTreeMap::new(),
            subs: BTreeMap::new(),
            told: BTreeMap::new(),
            counts: BTreeMap::new(),
            g1_checked: 0,
            member_deltas: 0,
            count_pushes: 0,
            pages_walked: 0,
            watches: BTreeMap::new(),
            page_deltas: 0,
            changes: 0,
            mismatches: 0,
            membership_floor: 0,
        }
    }

    fn expected_count(&self, group: GroupId) -> u32 {
        self.groups[&group]
            .members
            .iter()
            .filter(|&&m| self.core.presence(m).online)
            .count() as u32
    }

    fn online(&self, s: SessionId) -> bool {
        self.core.session_info(s).is_some_and(|i| i.online)
    }

    fn pick(&self, i: u8) -> SessionId {
        let live: Vec<SessionId> = self
            .issued
            .iter()
            .copied()
            .filter(|&s| self.online(s))
            .collect();
        if i < 200 && !live.is_empty() {
            live[i as usize % live.len()]
        } else if !self.issued.is_empty() {
            self.issued[i as usize % self.issued.len()]
        } else {
            SessionId(u64::MAX)
        }
    }

    /// Checks and records a snapshot (G3: never older than a push before).
    fn snapshot(&mut self, s: SessionId, snap: &GroupSnapshot) -> Result<(), TestCaseError> {
        let key = (s, snap.group);
        if let Some(told) = self.told.get(&key) {
            prop_assert!(
                snap.version >= told.version,
                "G3: snapshot {} of {:?} to {s} older than {}",
                snap.version,
                snap.group,
                told.version
            );
        }
        let pushed_at = self.told.get(&key).and_then(|t| t.pushed_at);
        self.told.insert(
            key,
            Told {
                version: snap.version,
                count: snap.count,
                pushed_at,
            },
        );
        Ok(())
    }

    /// Drains and checks the group outputs of one instant.
    fn outputs(&mut self) -> Result<(), TestCaseError> {
        let out: Vec<GroupOutput> = std::iter::from_fn(|| self.core.poll_group_output()).collect();
        let mut last_delta: BTreeMap<UserId, bool> = BTreeMap::new();
        for o in out {
            match o {
                GroupOutput::Ended { to, group } => {
                    prop_assert!(self.online(to), "Ended to {to}, not Online");
                    let held = self.subs.get_mut(&to).and_then(|m| m.remove(&group));
                    prop_assert!(held.is_some(), "Ended of {group:?} to {to}, not subscribed");
                    self.told.remove(&(to, group));
                }
                GroupOutput::Member {
                    to,
                    group,
                    version,
                    member,
                    online,
                    count,
                } => {
                    self.member_deltas += 1;
                    prop_assert!(self.online(to), "G4: delta to {to}, not Online");
                    let user = self.core.session_info(to).unwrap().user;
                    let g = &self.groups[&group];
                    prop_assert_eq!(
                        self.subs.get(&to).and_then(|m| m.get(&group)),
                        Some(&GroupRole::Admin),
                        "G4: delta of {:?} to {} without an admin subscription",
                        group,
                        to
                    );
                    prop_assert!(g.admins.contains(&user), "G4: delta to non-admin {user:?}");
                    prop_assert!(
                        g.members.contains(&member),
                        "delta of non-member {member:?}"
                    );
                    prop_assert!(count as usize <= g.members.len(), "G2: {count} > members");
                    last_delta.insert(member, online);
                    self.push(to, group, version, count, false)?;
                }
                GroupOutput::Count {
                    to,
                    group,
                    version,
                    count,
                } => {
                    self.count_pushes += 1;
                    prop_assert!(self.online(to), "Count to {to}, not Online");
                    let role = self.subs.get(&to).and_then(|m| m.get(&group)).copied();
                    prop_assert!(role.is_some(), "Count of {group:?} to unsubscribed {to}");
                    prop_assert_eq!(
                        count,
                        self.expected_count(group),
                        "G2: count of {:?} is not the members published online",
                        group
                    );
                    let told = self.told.get(&(to, group)).copied();
                    // A member's first count (after a resume) is its snapshot.
                    let member = role == Some(GroupRole::Member) && told.is_some();
                    if member {
                        prop_assert!(
                            told.is_none_or(|t| t.count != count),
                            "a count pushed to {to} that did not change: {count}"
                        );
                        let interval = self.core.config().group_interval.0;
                        prop_assert!(
                            told.and_then(|t| t.pushed_at)
                                .is_none_or(|at| self.now >= at + interval),
                            "{to} told counts of {group:?} less than an interval apart"
                        );
                    }
                    self.push(to, group, version, count, member)?;
                }
                GroupOutput::Page { to, group, entries } => {
                    self.page_deltas += 1;
                    prop_assert!(self.online(to), "G5: page delta to {to}, not Online");
                    prop_assert!(!entries.is_empty(), "an empty page delta");
                    for (member, presence) in &entries {
                        let watched = self.watches.iter().any(|((s, g, _), (set, expires))| {
                            *s == to && *g == group && set.contains(member) && self.now < *expires
                        });
                        prop_assert!(
                            watched,
                            "G5: delta of {:?} in {:?} to {} at {}, no live watch lists it",
                            member,
                            group,
                            to,
                            self.now
                        );
                        prop_assert_eq!(presence, &self.core.presence(*member));
                        prop_assert!(
                            self.groups[&group].members.contains(member),
                            "G5: delta of {:?}, not a member of {:?}",
                            member,
                            group
                        );
                    }
                }
            }
        }
        for (member, online) in last_delta {
            prop_assert_eq!(
                online,
                self.core.presence(member).online,
                "delta of {:?} disagrees with its published view",
                member
            );
        }
        Ok(())
    }

    fn push(
        &mut self,
        to: SessionId,
        group: GroupId,
        version: u64,
        count: u32,
        paced: bool,
    ) -> Result<(), TestCaseError> {
        let now = self.now;
        let told = self.told.entry((to, group)).or_insert(Told {
            version: 0,
            count,
            pushed_at: None,
        });
        prop_assert!(
            version > told.version || told.version == 0,
            "G3: {to} got {group:?} version {version} after {}",
            told.version
        );
        told.version = version;
        told.count = count;
        if paced {
            told.pushed_at = Some(now);
        }
        Ok(())
    }

    /// Runs the timers due up to `now` one instant at a time, each instant's
    /// outputs checked on their own.
    fn advance(&mut self, now: u64) -> Result<(), TestCaseError> {
        while let Some(due) = self.core.poll_timeout().filter(|d| d.0 <= now) {
            self.now = due.0;
            self.core.handle_timeout(due);
            while self.core.poll_output().is_some() {}
            self.forget_dead();
            self.core.check_invariants().map_err(fail)?;
            self.outputs()?;
            self.after()?;
        }
        self.now = now;
        self.core.handle_timeout(Millis(now));
        Ok(())
    }

    /// The reference's membership write: a new group starts above the
    /// highest version a removed group reached. Returns the new version.
    fn write_ref(
        &mut self,
        group: GroupId,
        members: BTreeSet<UserId>,
        admins: BTreeSet<UserId>,
    ) -> u64 {
        let floor = self.membership_floor;
        let g = self.groups.entry(group).or_insert_with(|| RefGroup {
            membership: floor,
            ..RefGroup::default()
        });
        g.membership += 1;
        g.members = members;
        g.admins = admins;
        g.membership
    }

    fn forget_dead(&mut self) {
        let dead: Vec<SessionId> = self
            .subs
            .keys()
            .copied()
            .filter(|&s| self.core.session_info(s).is_none())
            .collect();
        for s in dead {
            self.subs.remove(&s);
            self.told.retain(|(t, _), _| *t != s);
        }
        let now = self.now;
        let core = &self.core;
        self.watches
            .retain(|(s, _, _), (_, expires)| now < *expires && core.session_info(*s).is_some());
    }

    /// After every instant: structure, subscriptions, admins exact, G1.
    fn after(&mut self) -> Result<(), TestCaseError> {
        let now = self.now;
        let interval = self.core.config().group_interval.0;
        for (&group, g) in &self.groups {
            prop_assert_eq!(
                self.core.group_count(group),
                Some(self.expected_count(group))
            );
            let members = self.core.group_members(group).unwrap();
            prop_assert_eq!(members.0.len(), g.members.len());
            let count = self.expected_count(group);
            let since = match self.counts.get(&group) {
                Some(&(c, since)) if c == count => since,
                _ => now,
            };
            self.counts.insert(group, (count, since));
        }
        self.counts.retain(|g, _| self.groups.contains_key(g));
        for s in self.issued.clone() {
            let got: BTreeSet<_> = self
                .core
                .group_watches(s)
                .into_iter()
                .map(|(g, from, members, expires)| {
                    (
                        g,
                        from,
                        members.into_iter().collect::<BTreeSet<_>>(),
                        expires.0,
                    )
                })
                .collect();
            let want: BTreeSet<_> = self
                .watches
                .iter()
                .filter(|((t, _, _), _)| *t == s)
                .map(|((_, g, from), (set, expires))| (*g, *from, set.clone(), *expires))
                .collect();
            prop_assert_eq!(got, want, "G5: the pages {} watches", s);
            let got: BTreeMap<GroupId, GroupRole> =
                self.core.group_subscriptions(s).into_iter().collect();
            let want = self.subs.get(&s).cloned().unwrap_or_default();
            prop_assert_eq!(&got, &want, "subscriptions of {}", s);
            if !self.online(s) {
                continue;
            }
            for (group, role) in want {
                let told = self.told.get(&(s, group)).copied();
                let count = self.expected_count(group);
                match role {
                    // Admins are told every change at once.
                    GroupRole::Admin => prop_assert_eq!(
                        told.map(|t| t.count),
                        Some(count),
                        "admin {} of {:?} not up to date",
                        s,
                        group
                    ),
                    // G1: an interval after the count last changed.
                    GroupRole::Member => {
                        let since = self.counts[&group].1;
                        if now >= since + interval {
                            self.g1_checked += 1;
                            prop_assert_eq!(
                                told.map(|t| t.count),
                                Some(count),
                                "G1: member {} of {:?} was last told another count, {} ms after it settled",
                                s,
                                group,
                                now - since
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn step(&mut self, dt: u64, op: &Op) -> Result<(), TestCaseError> {
        let now = self.now + dt;
        self.advance(now)?;
        let at = Millis(now);
        let before = self.core.clone();
        let result: Result<(), Error> = match op.clone() {
            Op::Connect {
                user,
                device,
                resume,
            } => {
                let (user, device) = (UserId(user.into()), DeviceId(device.into()));
                let old = self.issued.iter().copied().find(|&s| {
                    self.core
                        .session_info(s)
                        .is_some_and(|i| i.user == user && i.device == device)
                });
                let c = Connect {
                    user,
                    device,
                    kind: DeviceKind::ALL[usize::from(device.0 as u8) % 4],
                    watch: Watch::All,
                    resume: if resume { old } else { None },
                    foreground: true,
                };
                let got = self.core.handle_connect(at, c);
                if let Ok(connected) = &got {
                    self.issued.push(connected.session);
                    if connected.resumed {
                        let carried = self.subs.remove(&old.unwrap()).unwrap_or_default();
                        for &group in carried.keys() {
                            self.told.remove(&(old.unwrap(), group));
                        }
                        if !carried.is_empty() {
                            self.subs.insert(connected.session, carried);
                        }
                        // Watched pages carry over too, if not run out.
                        let old = old.unwrap();
                        let moved: Vec<WatchKey> = self
                            .watches
                            .keys()
                            .filter(|k| k.0 == old)
                            .copied()
                            .collect();
                        for key in moved {
                            let (set, expires) = self.watches.remove(&key).unwrap();
                            if at.0 < expires {
                                let key = (connected.session, key.1, key.2);
                                self.watches.insert(key, (set, expires));
                            }
                        }
                    }
                }
                got.map(|_| ())
            }
            Op::Activity(s) => {
                let s = self.pick(s);
                self.core.handle_activity(at, s)
            }
            Op::Disconnect(s) => {
                let s = self.pick(s);
                self.core.handle_disconnect(at, s, at)
            }
            Op::Logout(s) => {
                let s = self.pick(s);
                self.core.handle_logout(at, s)
            }
            Op::SetInvisible(s, b) => {
                let s = self.pick(s);
                self.core.handle_set_invisible(at, s, b)
            }
            Op::SetForeground(s, b) => {
                let s = self.pick(s);
                self.core.handle_set_foreground(at, s, b)
            }
            Op::SetGroup {
                group,
                members,
                admins,
            } => {
                let group = GroupId(group.into());
                let members: Vec<UserId> = members.into_iter().map(|u| UserId(u.into())).collect();
                let admins: Vec<UserId> = admins.into_iter().map(|u| UserId(u.into())).collect();
                let got = self.core.handle_set_group(at, group, &members, &admins);
                let config = self.core.config().clone();
                let union: BTreeSet<UserId> = members.iter().chain(&admins).copied().collect();
                let exists = self.groups.contains_key(&group);
                let want = if admins.len() > config.max_group_admins {
                    Err(Error::LimitExceeded(Limit::GroupAdmins))
                } else if members.len() > config.max_group_members {
                    Err(Error::LimitExceeded(Limit::GroupMembers))
                } else if !exists && self.groups.len() >= config.max_groups {
                    Err(Error::LimitExceeded(Limit::Groups))
                } else if union.len() > config.max_group_members {
                    Err(Error::LimitExceeded(Limit::GroupMembers))
                } else {
                    Ok(self.write_ref(group, union, admins.iter().copied().collect()))
                };
                prop_assert_eq!(&got, &want, "set group {:?}", group);
                if got.is_ok() {
                    self.reroles(group);
                }
                got.map(|_| ())
            }
            Op::ChangeGroup {
                group,
                add,
                remove,
                add_admins,
                remove_admins,
                expect,
            } => {
                let group = GroupId(group.into());
                let ids = |list: Vec<u8>| -> Vec<UserId> {
                    list.into_iter().map(|u| UserId(u.into())).collect()
                };
                let (add, remove) = (ids(add), ids(remove));
                let (add_admins, remove_admins) = (ids(add_admins), ids(remove_admins));
                let current = self.groups.get(&group).map_or(0, |g| g.membership);
                let expect = expect.map(|same| if same { current } else { current + 1 });
                let change = GroupChange {
                    add: &add,
                    remove: &remove,
                    add_admins: &add_admins,
                    remove_admins: &remove_admins,
                    expect,
                };
                let got = self.core.handle_change_group(at, group, &change);
                let config = self.core.config().clone();
                let exists = self.groups.contains_key(&group);
                let (mut members, mut admins) = self
                    .groups
                    .get(&group)
                    .map(|g| (g.members.clone(), g.admins.clone()))
                    .unwrap_or_default();
                for u in &remove {
                    members.remove(u);
                    admins.remove(u);
                }
                for u in &remove_admins {
                    admins.remove(u);
                }
                members.extend(add.iter().chain(&add_admins));
                admins.extend(&add_admins);
                let want = if add_admins.len().max(remove_admins.len()) > config.max_group_admins {
                    Err(Error::LimitExceeded(Limit::GroupAdmins))
                } else if add.len().max(remove.len()) > config.max_group_members {
                    Err(Error::LimitExceeded(Limit::GroupMembers))
                } else if expect.is_some_and(|v| v != current) {
                    Err(Error::VersionMismatch { current })
                } else if admins.len() > config.max_group_admins {
                    Err(Error::LimitExceeded(Limit::GroupAdmins))
                } else if members.len() > config.max_group_members {
                    Err(Error::LimitExceeded(Limit::GroupMembers))
                } else if !exists && self.groups.len() >= config.max_groups {
                    Err(Error::LimitExceeded(Limit::Groups))
                } else {
                    Ok(self.write_ref(group, members, admins))
                };
                prop_assert_eq!(&got, &want, "change group {:?}", group);
                match got {
                    Ok(_) => {
                        self.changes += 1;
                        self.reroles(group);
                    }
                    Err(Error::VersionMismatch { .. }) => self.mismatches += 1,
                    Err(_) => {}
                }
                got.map(|_| ())
            }
            Op::RemoveGroup(group) => {
                let group = GroupId(group.into());
                let got = self.core.handle_remove_group(at, group);
                if let Some(g) = self.groups.remove(&group) {
                    // A group created later starts above this one's version.
                    self.membership_floor = self.membership_floor.max(g.membership);
                    prop_assert_eq!(got, Ok(()));
                    self.drop_subs_of(group, true);
                } else {
                    prop_assert_eq!(got, Err(Error::UnknownGroup));
                }
                got
            }
            Op::Subscribe(s, group) => {
                let (s, group) = (self.pick(s), GroupId(group.into()));
                let got = self.core.handle_group_subscribe(at, s, group);
                if self.online(s) {
                    let user = self.core.session_info(s).unwrap().user;
                    let role = self.groups.get(&group).and_then(|g| g.role(user));
                    let held = self.subs.get(&s).map_or(0, |m| m.len());
                    let again = self.subs.get(&s).is_some_and(|m| m.contains_key(&group));
                    let cap = self.core.config().max_group_subscriptions_per_session;
                    match role {
                        None => prop_assert_eq!(&got, &Err(Error::NotMember)),
                        Some(_) if !again && held >= cap => prop_assert_eq!(
                            &got,
                            &Err(Error::LimitExceeded(Limit::GroupSubscriptionsPerSession))
                        ),
                        Some(role) => {
                            let snap = got.clone().map_err(|e| fail(format!("{e:?}")))?;
                            prop_assert_eq!(snap.role, role);
                            prop_assert_eq!(snap.count, self.expected_count(group));
                            prop_assert_eq!(
                                snap.members as usize,
                                self.groups[&group].members.len()
                            );
                            self.snapshot(s, &snap)?;
                            self.subs.entry(s).or_default().insert(group, role);
                        }
                    }
                } else {
                    prop_assert!(matches!(got, Err(Error::Stale | Error::UnknownSession)));
                }
                got.map(|_| ())
            }
            Op::Unsubscribe(s, group) => {
                let (s, group) = (self.pick(s), GroupId(group.into()));
                let got = self.core.handle_group_unsubscribe(at, s, group);
                if self.online(s) {
                    let held = self.subs.get_mut(&s).and_then(|m| m.remove(&group));
                    let want = if held.is_some() {
                        Ok(())
                    } else {
                        Err(Error::NotSubscribed)
                    };
                    prop_assert_eq!(got, want);
                    self.told.remove(&(s, group));
                }
                got
            }
            Op::Pages(s, group, limit) => {
                let (s, group) = (self.pick(s), GroupId(group.into()));
                self.pages(at, s, group, limit.into())?
            }
            Op::WatchPage(s, group, limit, second) => {
                let (s, group) = (self.pick(s), GroupId(group.into()));
                self.watch_page(at, s, group, limit.into(), second)?
            }
            Op::Rewatch(s, n, renew) => {
                let s = self.pick(s);
                self.rewatch(at, s, n, renew)?
            }
            Op::Release(u) => {
                self.core.release(UserId(u.into()));
                Ok(())
            }
            Op::Tick => Ok(()),
        };
        if matches!(result, Err(Error::Stale | Error::UnknownSession)) {
            prop_assert_eq!(&self.core, &before, "a stale input changed the state");
        }
        self.subs.retain(|_, m| !m.is_empty());
        while self.core.poll_output().is_some() {}
        self.forget_dead();
        self.core.check_invariants().map_err(fail)?;
        self.outputs()?;
        self.subs.retain(|_, m| !m.is_empty());
        self.after()
    }

    /// Walks every page: together they list each member once, online ones
    /// first, each section by id, with their published views.
    fn pages(
        &mut self,
        at: Millis,
        s: SessionId,
        group: GroupId,
        limit: usize,
    ) -> Result<Result<(), Error>, TestCaseError> {
        let member = self.online(s)
            && self
                .groups
                .get(&group)
                .is_some_and(|g| g.members.contains(&self.core.session_info(s).unwrap().user));
        let mut from = None;
        let mut listed = Vec::new();
        loop {
            let got = self.core.handle_group_page(at, s, group, from, limit);
            let page = match got {
                Ok(page) => page,
                Err(e) => {
                    prop_assert!(!member, "a member's page refused: {e:?}");
                    prop_assert!(from.is_none());
                    return Ok(Err(e));
                }
            };
            prop_assert!(member, "a page for a non-member or a dead session");
            prop_assert!(page.entries.len() <= limit && !page.entries.is_empty());
            prop_assert_eq!(page.count, self.expected_count(group));
            for (user, presence) in &page.entries {
                prop_assert_eq!(presence, &self.core.presence(*user));
                listed.push((!presence.online, *user));
            }
            self.pages_walked += 1;
            match page.next {
                Some(next) => from = Some(next),
                None => break,
            }
        }
        let mut want: Vec<(bool, UserId)> = self.groups[&group]
            .members
            .iter()
            .map(|&m| (!self.core.presence(m).online, m))
            .collect();
        want.sort();
        prop_assert_eq!(listed, want, "pages of {:?}", group);
        Ok(Ok(()))
    }

    /// Watches the first or the second page of `limit`: refused exactly as
    /// the reference says (not a member, past the watch limits), else the
    /// page is the truth and its members are watched for the TTL.
    fn watch_page(
        &mut self,
        at: Millis,
        s: SessionId,
        group: GroupId,
        limit: usize,
        second: bool,
    ) -> Result<Result<(), Error>, TestCaseError> {
        let from = if second {
            match self.core.handle_group_page(at, s, group, None, limit) {
                Ok(page) => match page.next {
                    Some(next) => Some(next),
                    None => return Ok(Ok(())),
                },
                Err(e) => return Ok(Err(e)),
            }
        } else {
            None
        };
        let got = self.core.handle_group_watch_page(at, s, group, from, limit);
        if !self.online(s) {
            prop_assert!(matches!(got, Err(Error::Stale | Error::UnknownSession)));
            return Ok(got.map(|_| ()));
        }
        let user = self.core.session_info(s).unwrap().user;
        let Some(g) = self
            .groups
            .get(&group)
            .filter(|g| g.members.contains(&user))
        else {
            prop_assert_eq!(got, Err(Error::NotMember));
            return Ok(Err(Error::NotMember));
        };
        let config = self.core.config().clone();
        let key = (s, group, from);
        let again = self.watches.contains_key(&key);
        let mine: Vec<usize> = self
            .watches
            .iter()
            .filter(|(k, _)| k.0 == s && **k != key)
            .map(|(_, (set, _))| set.len())
            .collect();
        let bound = limit.clamp(1, config.group_page_size).min(g.members.len());
        let want = if !again && mine.len() >= config.max_watched_pages {
            Some(Error::LimitExceeded(Limit::WatchedPages))
        } else if mine.iter().sum::<usize>() + bound > config.max_watched_entries {
            Some(Error::LimitExceeded(Limit::WatchedEntries))
        } else {
            None
        };
        match (got, want) {
            (Err(e), Some(w)) => {
                prop_assert_eq!(e, w);
                Ok(Err(e))
            }
            (Ok(page), None) => {
                prop_assert_eq!(page.count, self.expected_count(group));
                for (u, p) in &page.entries {
                    prop_assert_eq!(p, &self.core.presence(*u));
                }
                let set = page.entries.iter().map(|(u, _)| *u).collect();
                let expires = at.0 + config.group_watch_ttl.0;
                self.watches.insert(key, (set, expires));
                Ok(Ok(()))
            }
            (got, want) => Err(fail(format!("watch page: {got:?}, want {want:?}"))),
        }
    }

    /// Renews or ends the `n`-th watch of `s` (or a page it does not watch).
    fn rewatch(
        &mut self,
        at: Millis,
        s: SessionId,
        n: u8,
        renew: bool,
    ) -> Result<Result<(), Error>, TestCaseError> {
        let mine: Vec<_> = self.watches.keys().filter(|k| k.0 == s).copied().collect();
        let key = if mine.is_empty() || n >= 200 {
            (s, GroupId(u64::from(n % GROUPS) + 1), None)
        } else {
            mine[n as usize % mine.len()]
        };
        let got = if renew {
            self.core.handle_group_renew_watch(at, s, key.1, key.2)
        } else {
            self.core.handle_group_unwatch(at, s, key.1, key.2)
        };
        if !self.online(s) {
            prop_assert!(matches!(got, Err(Error::Stale | Error::UnknownSession)));
            return Ok(got);
        }
        let ttl = self.core.config().group_watch_ttl.0;
        match self.watches.get_mut(&key) {
            Some(w) => {
                prop_assert_eq!(got, Ok(()));
                if renew {
                    w.1 = at.0 + ttl;
                } else {
                    self.watches.remove(&key);
                }
            }
            None => prop_assert_eq!(got, Err(Error::NotSubscribed)),
        }
        Ok(got)
    }

    /// After a membership write: each subscription takes its user's new
    /// role; a non-member's ends (told `Ended` if Online, checked then).
    fn reroles(&mut self, group: GroupId) {
        let g = &self.groups[&group];
        let core = &self.core;
        self.watches.retain(|(s, wg, _), _| {
            *wg != group
                || core
                    .session_info(*s)
                    .is_some_and(|i| g.members.contains(&i.user))
        });
        for (&s, held) in self.subs.iter_mut() {
            let Some(role) = held.get_mut(&group) else {
                continue;
            };
            let user = self.core.session_info(s).unwrap().user;
            match g.role(user) {
                Some(new) => {
                    if *role != new {
                        // A member's pacing starts again.
                        if let Some(t) = self.told.get_mut(&(s, group)) {
                            t.pushed_at = None;
                        }
                    }
                    *role = new;
                }
                None => {
                    // Online ones are removed when their `Ended` is seen.
                    if !self.core.session_info(s).unwrap().online {
                        held.remove(&group);
                        self.told.remove(&(s, group));
                    }
                }
            }
        }
    }

    fn drop_subs_of(&mut self, group: GroupId, told_online: bool) {
        self.watches.retain(|(_, g, _), _| *g != group);
        for (&s, held) in self.subs.iter_mut() {
            let online = self.core.session_info(s).is_some_and(|i| i.online);
            if !(told_online && online) && held.remove(&group).is_some() {
                self.told.remove(&(s, group));
            }
        }
    }

    /// Inputs stop: G1 for every member session once counts settle.
    fn converge(&mut self) -> Result<(), TestCaseError> {
        let window = self.core.config().debounce.0 + self.core.config().group_interval.0;
        for _ in 0..4 {
            let now = self.now + window;
            self.advance(now)?;
            self.after()?;
        }
        Ok(())
    }
}

fn run(
    config: Config,
    steps: &[(u64, Op)],
    mutant: Option<GroupMutant>,
) -> Result<[u64; 7], TestCaseError> {
    let mut d = Driver::new(config, mutant);
    for (dt, op) in steps {
        d.step(*dt, op)?;
    }
    d.converge()?;
    Ok([
        d.g1_checked,
        d.member_deltas,
        d.count_pushes,
        d.pages_walked,
        d.page_deltas,
        d.changes,
        d.mismatches,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn g1_to_g5_group_presence_matches_the_reference(config in config(), steps in steps()) {
        run(config, &steps, None)?;
    }
}

/// Runs `cases` cases with a fixed seed: the first failure, and the sums of
/// G1 checks, member deltas, count pushes and pages over the passing cases.
fn sample(cases: u32, mutant: Option<GroupMutant>) -> (Option<String>, [u64; 7]) {
    use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        RunnerConfig {
            cases,
            failure_persistence: None,
            ..RunnerConfig::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let sums = std::cell::Cell::new([0; 7]);
    let result = runner.run(&(config(), steps()), |(config, steps)| {
        let got = run(config, &steps, mutant)?;
        let mut total = sums.get();
        for (t, g) in total.iter_mut().zip(got) {
            *t += g;
        }
        sums.set(total);
        Ok(())
    });
    (result.err().map(|e| e.to_string()), sums.get())
}

/// The generated inputs are not vacuous.
#[test]
fn the_group_mix_reaches_every_check() {
    let (failure, [g1, deltas, counts, pages, page_deltas, changes, mismatches]) = sample(48, None);
    assert_eq!(failure, None);
    println!(
        "48 cases: {g1} G1 checks, {deltas} member deltas, {counts} count pushes, {pages} pages, \
         {page_deltas} page deltas, {changes} changes, {mismatches} version mismatches"
    );
    assert!(
        g1 >= 1000 && deltas >= 100 && counts >= 100 && pages >= 100 && page_deltas >= 30,
        "{g1} {deltas} {counts} {pages} {page_deltas}"
    );
    assert!(changes >= 100 && mismatches >= 10, "{changes} {mismatches}");
}

/// Each broken variant is caught, by the invariant it breaks.
#[test]
fn every_group_mutant_is_caught() {
    for (mutant, want) in [
        (GroupMutant::CountMissesOffline, "G2"),
        (GroupMutant::MembershipNotFlushed, "G1"),
        (GroupMutant::VersionNotBumped, "G3"),
        (GroupMutant::AdminKeptAfterDemotion, "G4"),
        (GroupMutant::SubsKeptAfterEnd, "G4"),
        (GroupMutant::WatchOutlivesExpiry, "G5"),
    ] {
        let (failure, _) = sample(64, Some(mutant));
        let failure = failure.unwrap_or_else(|| panic!("{mutant:?} went unnoticed"));
        println!("{mutant:?}: {}", failure.lines().next().unwrap_or(""));
        assert!(
            failure.contains(want),
            "{mutant:?} caught, but not by {want}: {failure}"
        );
    }
    // The fed counts' two, FedOlderCountTaken and DeltasToMembers, are
    // caught in `group_fed.rs`.
    assert_eq!(GroupMutant::ALL.len(), 8);
}
