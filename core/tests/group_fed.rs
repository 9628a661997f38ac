//! Fed group counts (`Core::set_group_counts_fed`, the `group_fed` module):
//! a core whose counts come from outside, as a cluster's edge gets them,
//! against a core that counts its own published views.
//!
//! Both cores get the same sessions, group writes and subscriptions. The
//! counting core (`one`) stands for the whole cluster: after each step the
//! test, as the count source, turns its members' published changes into a
//! stream of member changes and counts under rising versions, and delivers
//! that stream to the fed core (`edge`) late, out of order and repeated.
//! Checked on the fed core's pushes:
//! - G1: once the stream is delivered and an interval passed, every Online
//!   session subscribed (member or admin) was last told the counting
//!   core's count;
//! - G2: structural (`check_invariants`: 0 ≤ count ≤ members);
//! - G3: per (session, group), pushed versions strictly rise, and none is
//!   below the snapshot's;
//! - G4: member changes reach only Online sessions holding an admin
//!   subscription, of an admin;
//! - the same `Ended` as the counting core, step by step (membership and
//!   sessions decide them, not counts).
//!
//! `GroupMutant::FedOlderCountTaken` is caught by G3, `DeltasToMembers` by
//! G4.

use greendot_core::mutants::GroupMutant;
use greendot_core::*;

mod group_setup;
use group_setup::{connect, drain};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const GROUP: GroupId = GroupId(1);
const USERS: u64 = 4;

#[derive(Clone, Debug)]
enum Op {
    Connect {
        user: u64,
        resume: bool,
    },
    Disconnect(u64),
    SetInvisible(u64, bool),
    /// Members and admins as bit masks of the users.
    SetGroup(u8, u8),
    Subscribe(u64),
    Unsubscribe(u64),
    /// Watches the group's first page (read from the counting core, as an
    /// edge reads it from the owners).
    Watch(u64),
    Unwatch(u64),
    Advance(u64),
    /// Delivers the in-flight message at this index (mod their number).
    Deliver(usize),
    /// Delivers a copy of it and keeps it in flight.
    Repeat(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let user = 1..=USERS;
    prop_oneof![
        3 => (user.clone(), any::<bool>()).prop_map(|(user, resume)| Op::Connect { user, resume }),
        1 => user.clone().prop_map(Op::Disconnect),
        2 => (user.clone(), any::<bool>()).prop_map(|(u, on)| Op::SetInvisible(u, on)),
        // Most writes keep most users members: subscriptions then live on.
        2 => (prop_oneof![0u8..16, Just(15u8)], 0u8..16).prop_map(|(m, a)| Op::SetGroup(m, a)),
        5 => user.clone().prop_map(Op::Subscribe),
        1 => user.clone().prop_map(Op::Unsubscribe),
        2 => user.clone().prop_map(Op::Watch),
        1 => user.prop_map(Op::Unwatch),
        4 => (1u64..400).prop_map(Op::Advance),
        4 => (0usize..8).prop_map(Op::Deliver),
        1 => (0usize..8).prop_map(Op::Repeat),
    ]
}

/// What the count source sends.
#[derive(Clone, Debug)]
enum Fed {
    Count {
        version: u64,
        count: u32,
    },
    Member {
        version: u64,
        member: UserId,
        online: bool,
        count: u32,
    },
}

fn config() -> Config {
    Config {
        debounce: Millis(100),
        group_interval: Millis(300),
        batch_interval: Millis(300),
        kinds: [KindConfig {
            heartbeat_timeout: Millis(60_000),
            grace: Millis(200),
        }; 4],
        ..Config::default()
    }
}

fn users(mask: u8) -> Vec<UserId> {
    (1..=USERS)
        .filter(|u| mask & (1 << (u - 1)) != 0)
        .map(UserId)
        .collect()
}

struct Run {
    one: Core,
    edge: Core,
    now: u64,
    /// Each user's latest session (the same id in both cores).
    session: BTreeMap<u64, SessionId>,
    /// The count source: its version, and what it last said of each member.
    version: u64,
    said: BTreeMap<UserId, bool>,
    inflight: Vec<Fed>,
    /// Per fed-core session: the last version and count it was told.
    told: BTreeMap<SessionId, (u64, u32)>,
    pushes: u64,
    /// Per (fed-core session, member): the last view a page delta told.
    deltas: BTreeMap<(SessionId, UserId), u64>,
    page_entries: u64,
}

impl Run {
    fn new(mutant: Option<GroupMutant>) -> Run {
        let one = Core::new(config()).unwrap();
        let mut edge = Core::new(config()).unwrap();
        assert!(edge.set_group_counts_fed());
        edge.set_group_mutant(mutant);
        Run {
            one,
            edge,
            now: 0,
            session: BTreeMap::new(),
            version: 0,
            said: BTreeMap::new(),
            inflight: Vec::new(),
            told: BTreeMap::new(),
            pushes: 0,
            deltas: BTreeMap::new(),
            page_entries: 0,
        }
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        let now = Millis(self.now);
        let both = |run: &mut Run, f: &dyn Fn(&mut Core) -> Result<(), Error>| {
            let (a, b) = (f(&mut run.one), f(&mut run.edge));
            if a != b {
                return Err(format!(
                    "{op:?}: the counting core said {a:?}, the fed one {b:?}"
                ));
            }
            Ok(())
        };
        match *op {
            Op::Connect { user, resume } => {
                let c = Connect {
                    user: UserId(user),
                    device: DeviceId(1),
                    kind: DeviceKind::Desktop,
                    watch: Watch::All,
                    resume: if resume {
                        self.session.get(&user).copied()
                    } else {
                        None
                    },
                    foreground: true,
                };
                let a = self.one.handle_connect(now, c.clone()).map(|c| c.session);
                let b = self.edge.handle_connect(now, c).map(|c| c.session);
                if a != b {
                    return Err(format!("{op:?}: sessions {a:?} and {b:?}"));
                }
                if let Ok(s) = a {
                    self.session.insert(user, s);
                }
            }
            Op::Disconnect(user) => {
                let Some(&s) = self.session.get(&user) else {
                    return Ok(());
                };
                both(self, &|c| c.handle_disconnect(now, s, now))?;
            }
            Op::SetInvisible(user, on) => {
                let Some(&s) = self.session.get(&user) else {
                    return Ok(());
                };
                both(self, &|c| c.handle_set_invisible(now, s, on))?;
            }
            Op::SetGroup(members, admins) => {
                let (m, a) = (users(members), users(admins));
                both(self, &|c| {
                    c.handle_set_group(now, GROUP, &m, &a).map(|_| ())
                })?;
            }
            Op::Subscribe(user) => {
                let Some(&s) = self.session.get(&user) else {
                    return Ok(());
                };
                let a = self.one.handle_group_subscribe(now, s, GROUP);
                let b = self.edge.handle_group_subscribe(now, s, GROUP);
                match (a, b) {
                    (Ok(a), Ok(b)) if a.role == b.role => {
                        let last = self.told.get(&s).map_or(0, |t| t.0);
                        if b.version < last {
                            return Err(format!("G3: {s} snapshot {} after {last}", b.version));
                        }
                        self.told.insert(s, (b.version, b.count));
                    }
                    (Err(a), Err(b)) if a == b => {}
                    (a, b) => return Err(format!("{op:?}: {a:?} and {b:?}")),
                }
            }
            Op::Unsubscribe(user) => {
                let Some(&s) = self.session.get(&user) else {
                    return Ok(());
                };
                both(self, &|c| c.handle_group_unsubscribe(now, s, GROUP))?;
            }
            Op::Watch(user) => {
                let Some(&s) = self.session.get(&user) else {
                    return Ok(());
                };
                let a = self.one.handle_group_watch_page(now, s, GROUP, None, 10);
                let b = self
                    .edge
                    .handle_fed_group_page(now, s, GROUP, 10, Some(None));
                match (a, b) {
                    (Ok(page), Ok(_)) => self
                        .edge
                        .handle_fed_watched_page(now, s, GROUP, None, page.entries)
                        .map_err(|e| format!("{op:?}: the read page refused: {e:?}"))?,
                    (Err(a), Err(b)) if a == b => {}
                    (a, b) => return Err(format!("{op:?}: {:?} and {b:?}", a.map(|_| ()))),
                }
            }
            Op::Unwatch(user) => {
                let Some(&s) = self.session.get(&user) else {
                    return Ok(());
                };
                both(self, &|c| c.handle_group_unwatch(now, s, GROUP, None))?;
            }
            Op::Advance(ms) => {
                self.now += ms;
                let now = Millis(self.now);
                self.one.handle_timeout(now);
                self.edge.handle_timeout(now);
            }
            Op::Deliver(i) | Op::Repeat(i) => {
                if self.inflight.is_empty() {
                    return Ok(());
                }
                let i = i % self.inflight.len();
                let fed = match op {
                    Op::Deliver(_) => self.inflight.remove(i),
                    _ => self.inflight[i].clone(),
                };
                self.deliver(fed)?;
            }
        }
        self.after(op)
    }

    fn deliver(&mut self, fed: Fed) -> Result<(), String> {
        let now = Millis(self.now);
        let taken = match fed {
            Fed::Count { version, count } => {
                self.edge.handle_group_count(now, GROUP, version, count)
            }
            Fed::Member {
                version,
                member,
                online,
                count,
            } => self
                .edge
                .handle_group_member(now, GROUP, version, member, online, count),
        };
        match taken {
            // The fed core may not hold the group (yet, or any more).
            Ok(_) | Err(Error::UnknownGroup) => Ok(()),
            Err(e) => Err(format!("a fed count refused: {e:?}")),
        }
    }

    /// The count source's messages for what the step changed, then the
    /// checks of both cores' pushes.
    fn after(&mut self, op: &Op) -> Result<(), String> {
        if let Some((members, _)) = self.one.group_members(GROUP) {
            let members = members.to_vec();
            let online_now: BTreeMap<UserId, bool> = members
                .iter()
                .map(|&m| (m, self.one.presence(m).online))
                .collect();
            let mut count = members
                .iter()
                .filter(|m| self.said.get(m).copied().unwrap_or(false))
                .count() as u32;
            let rewritten = matches!(op, Op::SetGroup(..));
            for (&m, &online) in &online_now {
                if self.said.get(&m).copied().unwrap_or(false) != online {
                    count = if online { count + 1 } else { count - 1 };
                    self.version += FED_VERSION_STEP;
                    self.inflight.push(Fed::Member {
                        version: self.version,
                        member: m,
                        online,
                        count,
                    });
                }
            }
            self.said = online_now;
            if rewritten {
                self.version += FED_VERSION_STEP;
                self.inflight.push(Fed::Count {
                    version: self.version,
                    count,
                });
            }
            if count != self.one.group_count(GROUP).unwrap_or(0) {
                return Err(format!(
                    "the source's count {count} is not the counting core's {:?}",
                    self.one.group_count(GROUP)
                ));
            }
        }
        // The views of the members the fed core's watches list, as their
        // owners publish them; those it lets go of are listed no more.
        for u in (1..=USERS).map(UserId) {
            if self.edge.is_fed_listed(u) {
                let now = Millis(self.now);
                self.edge.handle_fed_view(now, u, self.one.presence(u));
            }
        }
        while let Some(u) = self.edge.poll_fed_unlisted() {
            if self.edge.is_fed_listed(u) {
                return Err(format!("{u:?} let go of while a watch lists her"));
            }
        }
        self.edge.check_invariants()?;
        self.one.check_invariants()?;
        let ended = |outputs: &[GroupOutput]| -> BTreeSet<SessionId> {
            outputs
                .iter()
                .filter_map(|o| match o {
                    GroupOutput::Ended { to, .. } => Some(*to),
                    _ => None,
                })
                .collect()
        };
        let outputs = drain(&mut self.edge);
        let edge_ended = ended(&outputs);
        let one_ended = ended(&drain(&mut self.one));
        if one_ended != edge_ended {
            return Err(format!(
                "{op:?}: Ended to {one_ended:?} on one node, {edge_ended:?} fed"
            ));
        }
        let admins: Vec<UserId> = self
            .edge
            .group_members(GROUP)
            .map(|(_, a)| a.to_vec())
            .unwrap_or_default();
        for out in outputs {
            let (to, version, count) = match out {
                GroupOutput::Ended { to, .. } => {
                    self.told.remove(&to);
                    continue;
                }
                GroupOutput::Member {
                    to, version, count, ..
                } => {
                    let admin = self
                        .edge
                        .session_info(to)
                        .is_some_and(|i| i.online && admins.contains(&i.user));
                    let held = self
                        .edge
                        .group_subscriptions(to)
                        .contains(&(GROUP, GroupRole::Admin));
                    if !admin || !held {
                        return Err(format!("G4: a member change to {to}, not an Online admin"));
                    }
                    (to, version, count)
                }
                GroupOutput::Count {
                    to, version, count, ..
                } => (to, version, count),
                GroupOutput::Page { to, entries, .. } => {
                    self.page_delta(to, &entries)?;
                    continue;
                }
            };
            self.pushes += 1;
            if let Some(&(last, _)) = self.told.get(&to) {
                if version <= last {
                    return Err(format!("G3: {to} got version {version} after {last}"));
                }
            }
            self.told.insert(to, (version, count));
        }
        Ok(())
    }

    /// A fed page delta: to an Online session, each member's view never
    /// older than one it was told, and never ahead of what the member's
    /// owner (the counting core) published.
    fn page_delta(&mut self, to: SessionId, entries: &[(UserId, Presence)]) -> Result<(), String> {
        if !self.edge.session_info(to).is_some_and(|i| i.online) {
            return Err(format!("G5: a page delta to {to}, not Online"));
        }
        for (m, p) in entries {
            let published = self.one.presence(*m).version;
            let last = self.deltas.insert((to, *m), p.version).unwrap_or(0);
            if p.version < last || p.version > published {
                return Err(format!(
                    "a page delta of {m:?} to {to} at version {} (told {last}, published {published})",
                    p.version
                ));
            }
            self.page_entries += 1;
        }
        Ok(())
    }

    /// G1: once the counting core is quiet (past debounce and grace), the
    /// stream delivered in order, then two intervals.
    fn settle(&mut self) -> Result<u64, String> {
        let quiet = config().debounce.0 + config().kinds[0].grace.0 + 1;
        self.step(&Op::Advance(quiet))?;
        self.step(&Op::Advance(quiet))?;
        for fed in std::mem::take(&mut self.inflight) {
            self.deliver(fed)?;
            self.after(&Op::Advance(0))?;
        }
        for _ in 0..2 {
            self.step(&Op::Advance(config().group_interval.0 + 1))?;
        }
        if !self.inflight.is_empty() {
            return Err(format!("not quiet: {:?} sent", self.inflight));
        }
        let want = self.one.group_count(GROUP);
        let mut checked = 0;
        for &s in self.session.values() {
            let subscribed = !self.edge.group_subscriptions(s).is_empty();
            let online = self.edge.session_info(s).is_some_and(|i| i.online);
            if subscribed && online {
                checked += 1;
                let told = self.told.get(&s).map(|t| t.1);
                if told != want {
                    return Err(format!(
                        "G1: {s} was last told {told:?}, the count is {want:?}"
                    ));
                }
            }
        }
        Ok(checked)
    }
}

fn run(ops: &[Op], mutant: Option<GroupMutant>) -> Result<(u64, u64, u64), String> {
    let mut run = Run::new(mutant);
    for op in ops {
        run.step(op)?;
    }
    let checked = run.settle()?;
    Ok((checked, run.pushes, run.page_entries))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn fed_counts_keep_g1_to_g4(ops in prop::collection::vec(op(), 1..120)) {
        run(&ops, None).map_err(TestCaseError::fail)?;
    }
}

/// Runs `cases` generated cases from a fixed seed: the first failure, and
/// the G1 checks, count pushes and page delta entries made.
fn sample(cases: u32, mutant: Option<GroupMutant>) -> (Option<String>, (u64, u64, u64)) {
    use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        RunnerConfig {
            cases,
            failure_persistence: None,
            ..RunnerConfig::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let sums = std::cell::Cell::new((0, 0, 0));
    let result = runner.run(&prop::collection::vec(op(), 1..120), |ops| {
        let (checked, pushes, pages) = run(&ops, mutant).map_err(TestCaseError::fail)?;
        let (c, p, e) = sums.get();
        sums.set((c + checked, p + pushes, e + pages));
        Ok(())
    });
    (result.err().map(|e| e.to_string()), sums.get())
}

/// The generated runs check G1 and push often enough to mean something.
#[test]
fn the_fed_mix_reaches_its_checks() {
    let (failure, (checked, pushes, pages)) = sample(64, None);
    assert_eq!(failure, None);
    println!("64 cases: {checked} G1 checks, {pushes} pushes, {pages} page delta entries");
    assert!(checked >= 30 && pushes >= 300, "{checked} {pushes}");
    assert!(pages >= 50, "{pages} page delta entries");
}

#[test]
fn a_fed_member_change_told_to_members_is_caught_by_g4() {
    let (failure, _) = sample(128, Some(GroupMutant::DeltasToMembers));
    let failure = failure.expect("DeltasToMembers went unnoticed");
    assert!(failure.contains("G4"), "caught, but not by G4: {failure}");
}

#[test]
fn a_fed_count_taken_whatever_its_version_is_caught_by_g3() {
    let (failure, _) = sample(128, Some(GroupMutant::FedOlderCountTaken));
    let failure = failure.expect("FedOlderCountTaken went unnoticed");
    assert!(failure.contains("G3"), "caught, but not by G3: {failure}");
}

/// A late count is dropped; a member's change reaches the admin at once
/// and the member at the flush; a membership write tells the count it
/// holds under the version after the source's.
#[test]
fn a_fed_core_takes_counts_by_version() {
    let mut edge = Core::new(config()).unwrap();
    assert!(edge.set_group_counts_fed());
    let (ann, bob) = (connect(&mut edge, 0, 1, 1), connect(&mut edge, 0, 2, 1));
    edge.handle_set_group(
        Millis(0),
        GROUP,
        &[UserId(1), UserId(2), UserId(3)],
        &[UserId(1)],
    )
    .unwrap();
    assert_eq!(
        edge.handle_group_subscribe(Millis(0), ann, GROUP)
            .unwrap()
            .role,
        GroupRole::Admin
    );
    let snap = edge.handle_group_subscribe(Millis(0), bob, GROUP).unwrap();
    assert_eq!((snap.role, snap.count), (GroupRole::Member, 0));
    assert_eq!(
        edge.handle_group_member(Millis(10), GROUP, 5, UserId(3), true, 1),
        Ok(true)
    );
    let out = drain(&mut edge);
    assert_eq!(
        out,
        [GroupOutput::Member {
            to: ann,
            group: GROUP,
            version: 5,
            member: UserId(3),
            online: true,
            count: 1
        }]
    );
    assert_eq!(
        edge.handle_group_count(Millis(20), GROUP, 4, 0),
        Ok(false),
        "late"
    );
    assert_eq!(edge.poll_group_output(), None);
    edge.handle_timeout(Millis(10 + 300));
    let out = drain(&mut edge);
    assert_eq!(
        out,
        [GroupOutput::Count {
            to: bob,
            group: GROUP,
            version: 5,
            count: 1
        }]
    );
    // A write that drops user 3 keeps the count fed, told to the admin
    // under the version after the source's; then the source's count.
    edge.handle_set_group(Millis(400), GROUP, &[UserId(1), UserId(2)], &[UserId(1)])
        .unwrap();
    let count = |to, version, count| GroupOutput::Count {
        to,
        group: GROUP,
        version,
        count,
    };
    let out = drain(&mut edge);
    assert_eq!(out, [count(ann, 6, 1)]);
    let next = 5 + FED_VERSION_STEP;
    assert_eq!(
        edge.handle_group_count(Millis(410), GROUP, next, 0),
        Ok(true)
    );
    let out = drain(&mut edge);
    assert_eq!(out, [count(ann, next, 0)]);
    // Counts of more members than the core holds are cut to its members.
    let later = next + FED_VERSION_STEP;
    assert_eq!(
        edge.handle_group_count(Millis(420), GROUP, later, 9),
        Ok(true)
    );
    assert_eq!(edge.group_count(GROUP), Some(2));
    edge.check_invariants().unwrap();

    // No version left between the source's: a write that demotes ann is
    // not told, and she hears the count (as a member) after the source's next.
    assert_eq!(
        edge.handle_group_count(Millis(500), GROUP, 4 * FED_VERSION_STEP - 1, 1),
        Ok(true)
    );
    drain(&mut edge);
    edge.handle_timeout(Millis(1000));
    drain(&mut edge);
    edge.handle_set_group(Millis(1000), GROUP, &[UserId(1), UserId(2)], &[])
        .unwrap();
    assert_eq!(
        edge.poll_group_output(),
        None,
        "no version to tell it under"
    );
    assert_eq!(
        edge.handle_group_count(Millis(1010), GROUP, 4 * FED_VERSION_STEP + 5, 1),
        Ok(true)
    );
    assert_eq!(edge.poll_group_output(), None, "no admins left");
    edge.handle_timeout(Millis(1010 + 300));
    let out = drain(&mut edge);
    assert_eq!(
        out,
        [count(ann, 4 * FED_VERSION_STEP + 5, 1)],
        "bob knew 1 already"
    );
    edge.check_invariants().unwrap();
    // A counting core refuses fed counts.
    let mut one = Core::new(config()).unwrap();
    one.handle_set_group(Millis(0), GROUP, &[UserId(1)], &[])
        .unwrap();
    assert_eq!(
        one.handle_group_count(Millis(0), GROUP, 9, 1),
        Err(Error::NotAllowed)
    );
    assert!(!one.set_group_counts_fed(), "a group exists already");
}

/// A definition from a cluster's directory takes the directory's
/// membership version, on a new group and on one held, and is written as
/// `handle_set_group` writes it: a leaver's subscription ends.
#[test]
fn a_defined_group_takes_the_directorys_membership_version() {
    let mut edge = Core::new(config()).unwrap();
    assert!(edge.set_group_counts_fed());
    let bob = connect(&mut edge, 0, 2, 1);
    edge.handle_define_group(Millis(0), GROUP, &[UserId(1), UserId(2)], &[UserId(1)], 7)
        .unwrap();
    assert_eq!(edge.group_membership(GROUP), Some(7));
    edge.handle_group_subscribe(Millis(0), bob, GROUP).unwrap();
    assert_eq!(
        edge.handle_group_count(Millis(1), GROUP, FED_VERSION_STEP, 2),
        Ok(true)
    );
    edge.handle_define_group(Millis(2), GROUP, &[UserId(1)], &[UserId(1)], 9)
        .unwrap();
    assert_eq!(edge.group_membership(GROUP), Some(9));
    assert_eq!(edge.group_count(GROUP), Some(1), "cut to the members");
    let out = drain(&mut edge);
    assert!(
        out.iter()
            .any(|o| matches!(o, GroupOutput::Ended { to, .. } if *to == bob)),
        "{out:?}"
    );
    edge.check_invariants().unwrap();
}

/// A presence fed for a watched page: online, under `version`.
fn fed_online(version: u64, status: Status) -> Presence {
    Presence {
        version,
        online: true,
        status,
        ..Presence::default()
    }
}

/// A watched page with fed counts (the `group_fed_watch` module): the page
/// read elsewhere is watched as on one node; each newer view fed of a
/// listed member comes in the session's next flush, an older one never;
/// asking the same page again renews it without letting go of its
/// members; a member who leaves the group is let go at once; the end of
/// the watch lets go of the others, and a view fed then is no one's; a
/// watch never renewed runs out and lets go of its members. A fed core reads no page itself.
#[test]
fn a_fed_watched_page_batches_the_views_fed_of_its_members() {
    let ttl = Millis(1_000);
    let mut edge = Core::new(Config {
        group_watch_ttl: ttl,
        ..config()
    })
    .unwrap();
    assert!(edge.set_group_counts_fed());
    let ann = connect(&mut edge, 0, 1, 1);
    let (bob, cy) = (UserId(2), UserId(3));
    edge.handle_define_group(Millis(0), GROUP, &[UserId(1), bob, cy], &[UserId(1)], 1)
        .unwrap();
    assert_eq!(
        edge.handle_group_page(Millis(0), ann, GROUP, None, 10),
        Err(Error::NotAllowed),
        "a fed core holds no one's view but its own users'"
    );
    let limit = edge.handle_fed_group_page(Millis(0), ann, GROUP, 500, Some(None));
    assert_eq!(limit, Ok(Config::default().group_page_size));
    let read = vec![
        (bob, fed_online(5, Status::Available)),
        (cy, Presence::default()),
        (UserId(9), Presence::default()),
    ];
    edge.handle_fed_watched_page(Millis(10), ann, GROUP, None, read)
        .unwrap();
    assert!(edge.is_fed_listed(bob) && edge.is_fed_listed(cy));
    assert!(!edge.is_fed_listed(UserId(9)), "not a member: left out");
    // An older view than the page's is dropped; a newer one is flushed.
    edge.handle_fed_view(Millis(20), bob, fed_online(4, Status::Busy));
    edge.handle_fed_view(Millis(20), bob, fed_online(6, Status::Away));
    let flush = Millis(20 + config().batch_interval.0);
    edge.handle_timeout(flush);
    let out = drain(&mut edge);
    let expected = GroupOutput::Page {
        to: ann,
        group: GROUP,
        entries: vec![(bob, fed_online(6, Status::Away))],
    };
    assert_eq!(out, vec![expected], "{out:?}");
    // The same page again renews it: nobody is let go.
    edge.handle_fed_group_page(flush, ann, GROUP, 10, Some(None))
        .unwrap();
    let read = vec![
        (bob, fed_online(6, Status::Away)),
        (cy, Presence::default()),
    ];
    edge.handle_fed_watched_page(flush, ann, GROUP, None, read)
        .unwrap();
    assert_eq!(edge.poll_fed_unlisted(), None);
    edge.check_invariants().unwrap();
    // bob leaves the group: let go at once, while the watch lives on.
    edge.handle_define_group(flush, GROUP, &[UserId(1), cy], &[UserId(1)], 2)
        .unwrap();
    assert_eq!(edge.poll_fed_unlisted(), Some(bob));
    assert!(edge.is_fed_listed(cy));
    edge.check_invariants().unwrap();
    // Unwatched: cy let go, and a view fed then is no one's.
    edge.handle_group_unwatch(flush, ann, GROUP, None).unwrap();
    let unlisted: Vec<UserId> = std::iter::from_fn(|| edge.poll_fed_unlisted()).collect();
    assert_eq!(unlisted, vec![cy]);
    edge.handle_fed_view(flush, bob, fed_online(7, Status::Busy));
    edge.handle_timeout(Millis(flush.0 * 3));
    assert_eq!(drain(&mut edge), vec![]);
    edge.check_invariants().unwrap();
    // Watched again and never renewed: it runs out, and lets go of cy.
    let at = Millis(flush.0 * 3);
    edge.handle_fed_group_page(at, ann, GROUP, 10, Some(None))
        .unwrap();
    let read = vec![(cy, Presence::default())];
    edge.handle_fed_watched_page(at, ann, GROUP, None, read)
        .unwrap();
    assert!(edge.is_fed_listed(cy));
    edge.handle_timeout(at.plus(ttl));
    assert_eq!(edge.poll_fed_unlisted(), Some(cy));
    assert_eq!(
        edge.handle_group_renew_watch(at.plus(ttl), ann, GROUP, None),
        Err(Error::NotSubscribed)
    );
    edge.check_invariants().unwrap();
}
