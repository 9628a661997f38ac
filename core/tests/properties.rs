//! Property tests: random sequences of at least 200 inputs over a few users,
//! devices and sessions, with random time steps. After every step the driver
//! checks `check_invariants()`, every invariant I1–I12 against the outputs and
//! getters, and compares every output and answer with the reference
//! implementation in `reference/`. Each test's input mix aims at the
//! invariants in its name.

mod reference;

use greendot_core::*;
use proptest::prelude::*;
use reference::Reference;
use std::collections::BTreeSet;

const USERS: u8 = 5;

#[derive(Clone, Debug)]
enum Op {
    Connect {
        user: u8,
        device: u8,
        kind: DeviceKind,
        watch: Option<Vec<u8>>,
        /// Resume a session picked from those issued.
        resume: Option<u8>,
        foreground: bool,
    },
    Activity(u8),
    /// The app went to the foreground (`true`) or the background (I12).
    SetForeground(u8, bool),
    /// The driver last heard from the connection this many ms before now
    /// (negative: a driver's instant after `now`, which the core clamps).
    Disconnect(u8, i16),
    Logout(u8),
    SetStatus(u8, Status, Option<u8>),
    SetInvisible(u8, bool),
    Subscribe(u8, u8, Tier),
    Unsubscribe(u8, u8),
    Query(u8, u8),
    /// `Core::release` of a user.
    Release(u8),
    Tick,
}

#[derive(Clone, Debug)]
struct Step {
    dt: u64,
    op: Op,
}

/// Relative weights of the inputs in a test's mix.
#[derive(Clone, Copy)]
struct Mix {
    connect: u32,
    activity: u32,
    disconnect: u32,
    logout: u32,
    status: u32,
    invisible: u32,
    foreground: u32,
    subscribe: u32,
    unsubscribe: u32,
    query: u32,
    release: u32,
    tick: u32,
}

const BALANCED: Mix = Mix {
    connect: 8,
    activity: 4,
    disconnect: 2,
    logout: 1,
    status: 3,
    invisible: 2,
    foreground: 3,
    subscribe: 10,
    unsubscribe: 1,
    query: 1,
    release: 2,
    tick: 3,
};

/// Users come and go within a debounce window and watchers let go of them,
/// so that records become releasable.
const RELEASES: Mix = Mix {
    connect: 8,
    logout: 8,
    disconnect: 1,
    activity: 2,
    status: 1,
    invisible: 1,
    subscribe: 4,
    unsubscribe: 4,
    release: 16,
    ..BALANCED
};

fn kind() -> impl Strategy<Value = DeviceKind> {
    prop::sample::select(DeviceKind::ALL.to_vec())
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Realtime), Just(Tier::Batched)]
}

fn user() -> impl Strategy<Value = u8> {
    1..=USERS
}

fn op(mix: Mix) -> impl Strategy<Value = Op> {
    let pick = any::<u8>;
    prop_oneof![
        mix.connect => (
            user(),
            1u8..=2,
            kind(),
            prop::option::weighted(0.3, prop::collection::vec(user(), 0..3)),
            prop::option::weighted(0.5, pick()),
            prop::bool::weighted(0.8),
        )
            .prop_map(|(user, device, kind, watch, resume, foreground)| Op::Connect {
                user,
                device,
                kind,
                watch,
                resume,
                foreground,
            }),
        mix.foreground => (pick(), any::<bool>()).prop_map(|(s, f)| Op::SetForeground(s, f)),
        mix.activity => pick().prop_map(Op::Activity),
        mix.disconnect => (pick(), prop_oneof![
            2 => Just(0i16),
            4 => 1i16..=3000,
            1 => -500i16..=-1,
        ]).prop_map(|(s, back)| Op::Disconnect(s, back)),
        mix.logout => pick().prop_map(Op::Logout),
        mix.status => (pick(), prop::sample::select(Status::ALL.to_vec()), prop::option::of(0u8..12))
            .prop_map(|(s, status, len)| Op::SetStatus(s, status, len)),
        mix.invisible => (pick(), any::<bool>()).prop_map(|(s, b)| Op::SetInvisible(s, b)),
        mix.subscribe => (pick(), user(), tier()).prop_map(|(s, t, tier)| Op::Subscribe(s, t, tier)),
        mix.unsubscribe => (pick(), user()).prop_map(|(s, t)| Op::Unsubscribe(s, t)),
        mix.query => (pick(), user()).prop_map(|(s, t)| Op::Query(s, t)),
        mix.release => user().prop_map(Op::Release),
        mix.tick => Just(Op::Tick),
    ]
}

fn dt() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => Just(0u64),
        8 => 1u64..=60,
        5 => 100u64..=450,
        1 => 800u64..=4000,
    ]
}

fn steps(mix: Mix) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (dt(), op(mix)).prop_map(|(dt, op)| Step { dt, op }),
        200..320,
    )
}

fn config() -> impl Strategy<Value = Config> {
    (any::<bool>(), prop::bool::weighted(0.25)).prop_map(|(reject, away)| {
        let mut c = Config {
            debounce: Millis(300),
            batch_interval: Millis(1000),
            max_subscriptions_per_session: 3,
            max_realtime_per_target: 1,
            realtime_overflow: if reject {
                RealtimeOverflow::Reject
            } else {
                RealtimeOverflow::Downgrade
            },
            max_message_len: 8,
            max_devices_per_user: 2,
            max_sessions: 7,
            max_users: 4,
            backgrounded: if away {
                Backgrounded::Away
            } else {
                Backgrounded::Offline
            },
            ..Config::default()
        };
        let timeouts = [(2000, 9000), (1000, 7000), (0, 5000), (500, 6000)];
        for (kind, (grace, heartbeat)) in DeviceKind::ALL.into_iter().zip(timeouts) {
            *c.kind_mut(kind) = KindConfig {
                grace: Millis(grace),
                heartbeat_timeout: Millis(heartbeat),
            };
        }
        c
    })
}

/// Every session id the core issued, in order (inputs pick from these).
#[derive(Default)]
struct Issued(Vec<SessionId>);

impl Issued {
    /// Mostly a live session (inputs on dead ones are tested, but they
    /// teach little), sometimes any issued one, rarely one never issued.
    fn pick(&self, i: u8, live: &BTreeSet<SessionId>, online: &[SessionId]) -> SessionId {
        if i == u8::MAX || self.0.is_empty() {
            SessionId(u64::MAX)
        } else if i < 160 && !online.is_empty() {
            online[i as usize % online.len()]
        } else if i < 208 && !live.is_empty() {
            *live.iter().nth(i as usize % live.len()).unwrap()
        } else {
            self.0[i as usize % self.0.len()]
        }
    }
}

fn audited(r: Result<(), String>) -> Result<(), TestCaseError> {
    r.map_err(TestCaseError::fail)
}

struct Driver {
    core: Core,
    reference: Reference,
    issued: Issued,
    audit: Audit,
    now: u64,
    /// The highest (own, published) version seen of each user id, across
    /// releases: a re-created user starts above both.
    versions_seen: std::collections::BTreeMap<UserId, (u64, u64)>,
    /// Users released and not yet created again.
    released: BTreeSet<UserId>,
    /// Released users that were created again.
    recreated: u64,
}

impl Driver {
    fn new(config: Config) -> Driver {
        Driver {
            core: Core::new(config.clone()).unwrap(),
            reference: Reference::new(config),
            issued: Issued::default(),
            audit: Audit::new(),
            now: 0,
            versions_seen: Default::default(),
            released: BTreeSet::new(),
            recreated: 0,
        }
    }

    /// Drains both sides' outputs, compares them, and observes them.
    fn outputs(&mut self) -> Result<(), TestCaseError> {
        let core: Vec<Output> = std::iter::from_fn(|| self.core.poll_output()).collect();
        let reference = self.reference.take_outputs();
        prop_assert_eq!(
            &core,
            &reference,
            "outputs differ from the reference at {}",
            self.now
        );
        for o in &core {
            audited(self.audit.output(o))?;
        }
        Ok(())
    }

    fn step(&mut self, step: &Step) -> Result<(), TestCaseError> {
        self.now += step.dt;
        let now = self.now;
        let at = Millis(now);
        // Timers first, so the input's own outputs follow the change it makes.
        self.core.handle_timeout(at);
        self.reference.advance(now);
        self.outputs()?;
        let before = self.core.clone();
        let live = self.reference.live();
        let online: Vec<SessionId> = live
            .iter()
            .copied()
            .filter(|s| self.core.session_info(*s).is_some_and(|i| i.online))
            .collect();
        let pick = |i| self.issued.pick(i, &live, &online);
        let result: Result<(), Error> = match step.op.clone() {
            Op::Connect {
                user,
                device,
                kind,
                watch,
                resume,
                foreground,
            } => {
                let watch = match watch {
                    None => Watch::All,
                    Some(users) => Watch::only(users.into_iter().map(|u| UserId(u.into()))),
                };
                let (user, device) = (UserId(user.into()), DeviceId(device.into()));
                // Usually name the device's current session, as a reconnecting
                // client does; sometimes any session at all.
                let current = live.iter().copied().find(|s| {
                    self.core
                        .session_info(*s)
                        .is_some_and(|i| i.user == user && i.device == device)
                });
                let resume = resume.map(|i| match current {
                    Some(current) if i < 192 => current,
                    _ => pick(i),
                });
                let c = Connect {
                    user,
                    device,
                    kind,
                    watch: watch.clone(),
                    resume,
                    foreground,
                };
                let got = self.core.handle_connect(at, c.clone());
                let issued = got.as_ref().ok().map(|c| c.session);
                let want = self.reference.connect(now, &c, issued);
                let sort = |c: Result<Connected, Error>| {
                    c.map(|mut c| {
                        c.snapshots.sort_by_key(|s| s.target);
                        c
                    })
                };
                prop_assert_eq!(sort(got.clone()), sort(want));
                if let Ok(connected) = &got {
                    self.issued.0.push(connected.session);
                    audited(self.audit.connected(&c, connected))?;
                    self.audit.heard(connected.session, at);
                }
                got.map(|_| ())
            }
            Op::Activity(s) => {
                let s = pick(s);
                let got = self.core.handle_activity(at, s);
                prop_assert_eq!(got, self.reference.activity(now, s));
                if got.is_ok() {
                    self.audit.heard(s, at);
                }
                got
            }
            Op::SetForeground(s, foreground) => {
                let s = pick(s);
                let got = self.core.handle_set_foreground(at, s, foreground);
                prop_assert_eq!(got, self.reference.set_foreground(now, s, foreground));
                if got.is_ok() {
                    self.audit.heard(s, at);
                }
                got
            }
            Op::Disconnect(s, back) => {
                let s = pick(s);
                let last_heard = now.saturating_add_signed(-i64::from(back));
                let got = self.core.handle_disconnect(at, s, Millis(last_heard));
                prop_assert_eq!(got, self.reference.disconnect(now, s, last_heard));
                if got.is_ok() {
                    self.audit.disconnected(s, at, Millis(last_heard));
                }
                got
            }
            Op::Logout(s) => {
                let s = pick(s);
                let got = self.core.handle_logout(at, s);
                prop_assert_eq!(got, self.reference.logout(now, s));
                if got.is_ok() {
                    self.audit.heard(s, at);
                    let user = self.audit.owner(s).unwrap();
                    prop_assert!(!self.core.route(user).contains(&s), "I4: {s} still routed");
                    prop_assert!(
                        self.core.subscriptions(s).is_empty(),
                        "I4: {s} keeps subscriptions"
                    );
                }
                got
            }
            Op::SetStatus(s, status, len) => {
                let s = pick(s);
                let message = len.map(|n| "x".repeat(n.into()));
                let got = self
                    .core
                    .handle_set_status(at, s, status, message.as_deref());
                prop_assert_eq!(
                    got,
                    self.reference
                        .set_status(now, s, status, message.as_deref())
                );
                got
            }
            Op::SetInvisible(s, invisible) => {
                let s = pick(s);
                let got = self.core.handle_set_invisible(at, s, invisible);
                prop_assert_eq!(got, self.reference.set_invisible(now, s, invisible));
                if got.is_ok() {
                    let user = self.audit.owner(s).unwrap();
                    self.audit.invisible(user, invisible, at);
                    self.audit.heard(s, at);
                }
                got
            }
            Op::Subscribe(s, t, tier) => {
                let (s, t) = (pick(s), UserId(t.into()));
                let got = self.core.handle_subscribe(at, s, t, tier);
                prop_assert_eq!(&got, &self.reference.subscribe(now, s, t, tier));
                if let Ok(snapshot) = &got {
                    audited(self.audit.subscribed(s, snapshot))?;
                }
                got.map(|_| ())
            }
            Op::Unsubscribe(s, t) => {
                let (s, t) = (pick(s), UserId(t.into()));
                let got = self.core.handle_unsubscribe(at, s, t);
                prop_assert_eq!(got, self.reference.unsubscribe(now, s, t));
                if got.is_ok() {
                    self.audit.unsubscribed(s, t);
                }
                got
            }
            Op::Query(s, t) => {
                let (s, t) = (pick(s), UserId(t.into()));
                let got = self.core.handle_query(at, s, t);
                prop_assert_eq!(&got, &self.reference.query(now, s, t));
                if let Ok(p) = &got {
                    audited(self.audit.answered(s, t, p))?;
                }
                got.map(|_| ())
            }
            Op::Release(u) => {
                let user = UserId(u.into());
                let releasable = self.core.is_releasable(user);
                let got = self.core.release(user);
                prop_assert_eq!(got, self.reference.release(user), "release {:?}", user);
                prop_assert_eq!(got, releasable, "is_releasable {:?}", user);
                if got {
                    self.released.insert(user);
                    prop_assert_eq!(self.core.truth(user), Presence::default());
                    prop_assert!(!self.core.release(user), "released twice");
                } else {
                    prop_assert_eq!(&self.core, &before, "a refused release changed the state");
                }
                Ok(())
            }
            Op::Tick => Ok(()),
        };
        if result == Err(Error::Stale) || result == Err(Error::UnknownSession) {
            prop_assert_eq!(&self.core, &before, "I3: a stale input changed the state");
        }
        self.outputs()?;
        self.check_state()
    }

    fn check_state(&mut self) -> Result<(), TestCaseError> {
        if let Err(why) = self.core.check_invariants() {
            return Err(TestCaseError::fail(why));
        }
        prop_assert_eq!(self.core.user_count(), self.reference.user_count());
        for u in 1..=USERS {
            let user = UserId(u.into());
            if !self.reference.knows(user) {
                continue; // never created, or released: unknown
            }
            if self.released.remove(&user) {
                self.recreated += 1;
            }
            let now = (
                self.core.truth(user).version,
                self.core.presence(user).version,
            );
            let seen = self.versions_seen.entry(user).or_default();
            prop_assert!(
                now.0 >= seen.0 && now.1 >= seen.1,
                "I7: versions of {user:?} went back across a release: {now:?} after {seen:?}"
            );
            *seen = now;
        }
        prop_assert!(
            self.reference.early_publishes.is_empty(),
            "I6: {:?}",
            self.reference.early_publishes
        );
        let live = self.reference.live();
        prop_assert_eq!(self.core.session_count(), live.len());
        for u in 1..=USERS {
            let user = UserId(u.into());
            // I1: aggregation.
            prop_assert_eq!(
                self.core.is_online(user),
                self.reference.is_online(user),
                "I1 {:?}",
                user
            );
            // I1, I12: present only through a foreground device (or any
            // device under `Backgrounded::Away`).
            prop_assert_eq!(
                self.core.truth(user).online,
                self.reference.present(user),
                "I1/I12 {:?}",
                user
            );
            // I9, I12: route is exactly the Online sessions in the foreground.
            let route: BTreeSet<_> = self.core.route(user).into_iter().collect();
            prop_assert_eq!(&route, &self.reference.route(user), "I9/I12 {:?}", user);
            for s in &route {
                prop_assert!(
                    self.core
                        .session_info(*s)
                        .is_some_and(|i| i.online && i.foreground && i.user == user),
                    "I9/I12"
                );
            }
            prop_assert_eq!(self.core.presence(user), self.reference.published(user));
        }
        for &s in &live {
            let subs: BTreeSet<_> = self.core.subscriptions(s).into_iter().collect();
            prop_assert_eq!(&subs, &self.reference.subscriptions(s));
            // I11: only what the credentials allow.
            let owner = self.audit.owner(s).unwrap();
            for (target, _) in &subs {
                prop_assert!(
                    *target == owner || self.audit.watch(s).unwrap().allows(*target),
                    "I11: {s} watches {target:?}"
                );
            }
        }
        Ok(())
    }

    /// I8: inputs stop; once nothing is pending, every Online subscriber's
    /// latest view of each target is what that target is shown as.
    fn converge(&mut self) -> Result<(), TestCaseError> {
        let window = self.core.config().debounce.0 + self.core.config().batch_interval.0;
        for _ in 0..64 {
            self.now += window;
            self.core.handle_timeout(Millis(self.now));
            self.reference.advance(self.now);
            self.outputs()?;
            self.check_state()?;
            if !self.reference.quiet() {
                continue;
            }
            for u in 1..=USERS {
                let user = UserId(u.into());
                prop_assert!(
                    self.core.presence(user).same_view(&self.core.shown(user)),
                    "I8: {user:?} published {:?} but shown {:?}",
                    self.core.presence(user),
                    self.core.shown(user)
                );
            }
            for s in self.reference.live() {
                if !self.core.session_info(s).is_some_and(|i| i.online) {
                    continue;
                }
                for (target, _) in self.core.subscriptions(s) {
                    let want = self.core.view(s, target).unwrap();
                    let got = self.audit.view(s).and_then(|v| v.get(target));
                    prop_assert!(
                        got.is_some_and(|g| g.same_view(&want)),
                        "I8: {s} sees {target:?} as {got:?}, shown as {want:?}"
                    );
                }
            }
            return Ok(());
        }
        Err(TestCaseError::fail("I8: never quiet after inputs stopped"))
    }
}

fn run(config: Config, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut d = Driver::new(config);
    for step in steps {
        d.step(step)?;
    }
    d.converge()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn differential_every_output_matches_the_reference(config in config(), steps in steps(BALANCED)) {
        run(config, &steps)?;
    }

    #[test]
    fn i1_i2_i9_aggregation_expiry_and_routing(config in config(), steps in steps(Mix {
        connect: 8, activity: 6, disconnect: 5, logout: 3, tick: 6, subscribe: 2, ..BALANCED
    })) {
        run(config, &steps)?;
    }

    #[test]
    fn i3_stale_inputs_change_nothing(config in config(), steps in steps(Mix {
        connect: 10, disconnect: 6, logout: 5, activity: 6, ..BALANCED
    })) {
        run(config, &steps)?;
    }

    #[test]
    fn i4_i10_i11_logout_subscriptions_and_authorization(config in config(), steps in steps(Mix {
        subscribe: 10, unsubscribe: 3, logout: 5, query: 3, ..BALANCED
    })) {
        run(config, &steps)?;
    }

    #[test]
    fn i5_invisible_never_shown_online(config in config(), steps in steps(Mix {
        invisible: 8, subscribe: 8, query: 4, ..BALANCED
    })) {
        run(config, &steps)?;
    }

    #[test]
    fn i6_i7_debounce_and_versions(config in config(), steps in steps(Mix {
        status: 8, logout: 4, connect: 8, disconnect: 4, subscribe: 6, ..BALANCED
    })) {
        run(config, &steps)?;
    }

    /// Releases among everything else: I1–I12 hold, versions per (session,
    /// target) still increase, and a user that comes back is a new record
    /// whose versions start above every released one.
    #[test]
    fn releases_keep_every_invariant_and_versions_above_the_floor(config in config(), steps in steps(RELEASES)) {
        run(config, &steps)?;
    }

    #[test]
    fn i12_background_is_not_present(config in config(), steps in steps(Mix {
        foreground: 10, connect: 8, activity: 6, disconnect: 3, logout: 2, subscribe: 8, ..BALANCED
    })) {
        run(config, &steps)?;
    }

    #[test]
    fn i8_convergence_after_inputs_stop(config in config(), steps in steps(Mix {
        subscribe: 10, status: 6, ..BALANCED
    })) {
        run(config, &steps)?;
    }

    /// A late `handle_timeout` leaves the same state as a timely one.
    #[test]
    fn late_timeouts_equal_timely_ones(config in config(), steps in steps(BALANCED), late in 1u64..5000) {
        let mut timely = Driver::new(config.clone());
        for step in &steps {
            timely.step(step)?;
        }
        let mut lazy = timely.core.clone();
        let end = timely.now + late;
        while let Some(due) = timely.core.poll_timeout() {
            if due.0 > end { break; }
            timely.core.handle_timeout(due);
        }
        timely.core.handle_timeout(Millis(end));
        lazy.handle_timeout(Millis(end));
        prop_assert_eq!(&timely.core, &lazy);
    }
}

/// Runs `cases` generated cases of `mix` with a fixed seed; returns the first
/// failure, the core counters summed over the cases that passed, and how many
/// released users were created again.
fn sample(
    cases: u32,
    mutant: Option<mutants::Mutant>,
    mix: Mix,
) -> (Option<String>, Counters, u64) {
    use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        RunnerConfig {
            cases,
            failure_persistence: None,
            ..RunnerConfig::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let total = std::cell::RefCell::new(Counters::default());
    let recreated = std::cell::Cell::new(0);
    let result = runner.run(&(config(), steps(mix)), |(config, steps)| {
        let mut d = Driver::new(config);
        d.core.set_mutant(mutant);
        for step in &steps {
            d.step(step)?;
        }
        d.converge()?;
        recreated.set(recreated.get() + d.recreated);
        let c = d.core.counters();
        let mut t = total.borrow_mut();
        t.resumed += c.resumed;
        t.superseded += c.superseded;
        t.ghosts_reaped += c.ghosts_reaped;
        t.grace_expired += c.grace_expired;
        t.flaps_suppressed += c.flaps_suppressed;
        t.publishes += c.publishes;
        t.notifications_realtime += c.notifications_realtime;
        t.notifications_batched += c.notifications_batched;
        t.stale_inputs += c.stale_inputs;
        t.downgraded += c.downgraded;
        t.limits_hit += c.limits_hit;
        t.logouts += c.logouts;
        t.users_released += c.users_released;
        Ok(())
    });
    (
        result.err().map(|e| e.to_string()),
        total.into_inner(),
        recreated.get(),
    )
}

/// The generated inputs are not vacuous: they reach every transition.
#[test]
fn the_input_mix_reaches_every_transition() {
    let (failure, c, _) = sample(32, None, BALANCED);
    assert_eq!(failure, None);
    for (what, n) in [
        ("resumes", c.resumed),
        ("supersedes", c.superseded),
        ("reaped ghosts", c.ghosts_reaped),
        ("grace expiries", c.grace_expired),
        ("suppressed flaps", c.flaps_suppressed),
        ("publishes", c.publishes),
        ("realtime pushes", c.notifications_realtime),
        ("batched pushes", c.notifications_batched),
        ("stale inputs", c.stale_inputs),
        ("downgrades", c.downgraded),
        ("limits hit", c.limits_hit),
        ("logouts", c.logouts),
    ] {
        assert!(n >= 10, "only {n} {what} in 32 cases: {c:?}");
    }
    let (failure, c, recreated) = sample(32, None, RELEASES);
    assert_eq!(failure, None);
    assert!(
        c.users_released >= 20 && recreated >= 10,
        "only {} releases and {recreated} re-creations in 32 cases",
        c.users_released
    );
}

/// The property tests catch each deliberately broken core.
#[test]
fn every_mutant_fails_the_property_tests() {
    for mutant in mutants::Mutant::ALL {
        let (failure, ..) = sample(64, Some(mutant), BALANCED);
        assert!(failure.is_some(), "{mutant:?} went unnoticed");
    }
}
