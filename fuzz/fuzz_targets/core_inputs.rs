//! An arbitrary configuration and sequence of inputs and time steps through
//! the core: it never panics, `check_invariants()` holds after every step, and
//! the output invariants (I5 with last seen never after the last heard, I7,
//! I10, I11, through `Audit`) and I1, I3, I4, I9 are checked after every step
//! too, across releases of users.
#![no_main]

use arbitrary::Arbitrary;
use greendot_core::*;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Case {
    debounce: u16,
    batch: u16,
    timeouts: [(u16, u16); 4],
    caps: [u8; 5],
    reject: bool,
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
struct Step {
    dt: u16,
    op: Op,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Connect {
        user: u8,
        device: u8,
        kind: u8,
        watch: Option<Vec<u8>>,
        resume: Option<u8>,
        background: bool,
    },
    Activity(u8),
    /// Last heard this many ms before now (negative: after now, clamped).
    Disconnect(u8, i16),
    Logout(u8),
    SetStatus(u8, u8, Option<String>),
    SetInvisible(u8, bool),
    SetForeground(u8, bool),
    Subscribe(u8, u8, bool),
    Unsubscribe(u8, u8),
    Query(u8, u8),
    Release(u8),
    Tick,
}

fn config(case: &Case) -> Config {
    let mut c = Config {
        debounce: Millis(u64::from(case.debounce % 1000) + 1),
        batch_interval: Millis(u64::from(case.batch % 3000) + 1),
        max_subscriptions_per_session: usize::from(case.caps[0] % 6) + 1,
        max_realtime_per_target: usize::from(case.caps[1] % 4) + 1,
        max_message_len: usize::from(case.caps[2] % 16),
        max_devices_per_user: usize::from(case.caps[3] % 3) + 1,
        max_sessions: usize::from(case.caps[4] % 12) + 1,
        max_users: 6,
        realtime_overflow: if case.reject {
            RealtimeOverflow::Reject
        } else {
            RealtimeOverflow::Downgrade
        },
        ..Config::default()
    };
    for (kind, (grace, heartbeat)) in DeviceKind::ALL.into_iter().zip(case.timeouts) {
        *c.kind_mut(kind) = KindConfig {
            grace: Millis(u64::from(grace % 8000)),
            heartbeat_timeout: Millis(u64::from(heartbeat % 8000) + 1),
        };
    }
    c
}

fn user(u: u8) -> UserId {
    UserId(u64::from(u % 5))
}

fuzz_target!(|case: Case| {
    let mut core = Core::new(config(&case)).expect("the fuzz config is valid");
    let mut audit = Audit::new();
    let mut issued: Vec<SessionId> = Vec::new();
    let pick = |issued: &Vec<SessionId>, i: u8| {
        if issued.is_empty() || i == u8::MAX {
            SessionId(u64::from(i) << 7)
        } else {
            issued[usize::from(i) % issued.len()]
        }
    };
    let mut now = 0u64;
    for step in &case.steps {
        now += u64::from(step.dt);
        let at = Millis(now);
        core.handle_timeout(at);
        drain(&mut core, &mut audit);
        let before = core.clone();
        let result = match &step.op {
            Op::Connect {
                user: u,
                device,
                kind,
                watch,
                resume,
                background,
            } => {
                let c = Connect {
                    user: user(*u),
                    device: DeviceId(u64::from(device % 3)),
                    kind: DeviceKind::ALL[usize::from(kind % 4)],
                    watch: match watch {
                        None => Watch::All,
                        Some(list) => Watch::only(list.iter().map(|u| user(*u))),
                    },
                    resume: resume.map(|i| pick(&issued, i)),
                    foreground: !background,
                };
                let got = core.handle_connect(at, c.clone());
                if let Ok(connected) = &got {
                    issued.push(connected.session);
                    ok(audit.connected(&c, connected));
                    audit.heard(connected.session, at);
                }
                got.map(|_| ())
            }
            Op::Activity(s) => {
                let s = pick(&issued, *s);
                let got = core.handle_activity(at, s);
                if got.is_ok() {
                    audit.heard(s, at);
                }
                got
            }
            Op::Disconnect(s, back) => {
                let s = pick(&issued, *s);
                let last_heard = Millis(now.saturating_add_signed(-i64::from(*back)));
                let got = core.handle_disconnect(at, s, last_heard);
                if got.is_ok() {
                    audit.disconnected(s, at, last_heard);
                }
                got
            }
            Op::Logout(s) => {
                let s = pick(&issued, *s);
                let got = core.handle_logout(at, s);
                if got.is_ok() {
                    audit.heard(s, at);
                    let owner = audit.owner(s).expect("an accepted session was audited");
                    assert!(!core.route(owner).contains(&s), "I4: {s} still routed");
                    assert!(
                        core.subscriptions(s).is_empty(),
                        "I4: {s} keeps subscriptions"
                    );
                }
                got
            }
            Op::SetStatus(s, status, message) => core.handle_set_status(
                at,
                pick(&issued, *s),
                Status::ALL[usize::from(status % 4)],
                message.as_deref(),
            ),
            Op::SetInvisible(s, invisible) => {
                let s = pick(&issued, *s);
                let got = core.handle_set_invisible(at, s, *invisible);
                if got.is_ok() {
                    let owner = audit.owner(s).expect("an accepted session was audited");
                    audit.invisible(owner, *invisible, at);
                    audit.heard(s, at);
                }
                got
            }
            Op::SetForeground(s, foreground) => {
                let s = pick(&issued, *s);
                let got = core.handle_set_foreground(at, s, *foreground);
                if got.is_ok() {
                    audit.heard(s, at);
                }
                got
            }
            Op::Subscribe(s, t, realtime) => {
                let s = pick(&issued, *s);
                let tier = if *realtime {
                    Tier::Realtime
                } else {
                    Tier::Batched
                };
                let got = core.handle_subscribe(at, s, user(*t), tier);
                if let Ok(snapshot) = &got {
                    ok(audit.subscribed(s, snapshot));
                }
                got.map(|_| ())
            }
            Op::Unsubscribe(s, t) => {
                let s = pick(&issued, *s);
                let got = core.handle_unsubscribe(at, s, user(*t));
                if got.is_ok() {
                    audit.unsubscribed(s, user(*t));
                }
                got
            }
            Op::Query(s, t) => {
                let s = pick(&issued, *s);
                let got = core.handle_query(at, s, user(*t));
                if let Ok(p) = &got {
                    ok(audit.answered(s, user(*t), p));
                }
                got.map(|_| ())
            }
            Op::Release(u) => {
                let u = user(*u);
                let releasable = core.is_releasable(u);
                let released = core.release(u);
                assert_eq!(released, releasable, "is_releasable disagrees with release");
                if released {
                    assert_eq!(
                        core.truth(u),
                        Presence::default(),
                        "a released user is unknown"
                    );
                } else {
                    assert!(core == before, "a refused release changed the state");
                }
                Ok(())
            }
            Op::Tick => Ok(()),
        };
        if matches!(result, Err(Error::Stale | Error::UnknownSession)) {
            assert!(core == before, "I3: a stale input changed the state");
        }
        drain(&mut core, &mut audit);
        ok(core.check_invariants());
        for u in 0..5 {
            let u = UserId(u);
            // I1 with I12: shown online to their own sessions exactly while
            // a live session is present (in the foreground, or any live
            // session when background means away).
            let away = core.config().backgrounded == Backgrounded::Away;
            let present = core
                .sessions_of(u)
                .into_iter()
                .any(|s| core.session_info(s).is_some_and(|i| i.foreground || away));
            assert_eq!(core.truth(u).online, present, "I1 {u:?}");
            assert!(
                !present || core.is_online(u),
                "I1: present but not live {u:?}"
            );
            for s in core.route(u) {
                let info = core.session_info(s).expect("I9: a routed session is live");
                assert!(info.online && info.user == u, "I9: {s} routed for {u:?}");
            }
        }
    }
});

fn drain(core: &mut Core, audit: &mut Audit) {
    while let Some(o) = core.poll_output() {
        ok(audit.output(&o));
    }
}

fn ok(r: Result<(), String>) {
    if let Err(why) = r {
        panic!("{why}");
    }
}
