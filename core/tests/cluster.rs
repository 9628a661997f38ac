//! Property tests of the cluster's core parts: the owner's inputs
//! (`enter_epoch`, `restore_owned`, `hold_offline_until`, `handle_edge_lost`,
//! `poll_published`) and the edge's `Fanout`, with C6 as a differential test:
//! an owner core plus an edge's `Fanout` push to every watcher exactly what
//! one core pushes, for the same inputs.

use greendot_core::cluster::{epoch_base, epoch_of, DeviceRecord, OwnedRecord};
use greendot_core::*;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunConfig, TestRunner};
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
enum Op {
    Connect { user: u8, device: u8 },
    Activity(u8),
    Disconnect(u8),
    Logout(u8),
    SetStatus(u8, Status),
    SetInvisible(u8, bool),
    Subscribe(u8, u8, Tier),
    Unsubscribe(u8, u8),
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let tier = prop_oneof![Just(Tier::Realtime), Just(Tier::Batched)];
    prop_oneof![
        4 => (1u8..=3, 1u8..=2).prop_map(|(user, device)| Op::Connect { user, device }),
        1 => any::<u8>().prop_map(Op::Activity),
        2 => any::<u8>().prop_map(Op::Disconnect),
        1 => any::<u8>().prop_map(Op::Logout),
        2 => (any::<u8>(), prop::sample::select(Status::ALL.to_vec()))
            .prop_map(|(s, st)| Op::SetStatus(s, st)),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(s, b)| Op::SetInvisible(s, b)),
        5 => (any::<u8>(), 1u8..=3, tier).prop_map(|(s, t, tier)| Op::Subscribe(s, t, tier)),
        1 => (any::<u8>(), 1u8..=3).prop_map(|(s, t)| Op::Unsubscribe(s, t)),
        4 => prop_oneof![0u64..20, 0u64..400, 0u64..3000].prop_map(Op::Wait),
    ]
}

fn config() -> Config {
    let mut config = Config {
        max_realtime_per_target: 1_000,
        ..Config::default()
    };
    config.debounce = Millis(100);
    config.batch_interval = Millis(250);
    for kind in &mut config.kinds {
        kind.grace = Millis(1_000);
        kind.heartbeat_timeout = Millis(4_000);
    }
    config
}

/// How the cluster side of the differential is wired; `DropTruth` is a
/// deliberately broken edge that fans out only what others see.
#[derive(Clone, Copy, PartialEq)]
enum Wiring {
    Correct,
    DropTruth,
}

/// One core (A) against an owner core (B, told only device inputs) whose
/// published views feed an edge's `Fanout` (F) holding the subscriptions.
struct Differential {
    one: Core,
    owner: Core,
    edge: Fanout,
    wiring: Wiring,
    now: Millis,
    sessions: Vec<SessionId>,
    users: BTreeMap<SessionId, UserId>,
    pushes_one: BTreeMap<SessionId, Vec<(UserId, Tier, Presence)>>,
    pushes_edge: BTreeMap<SessionId, Vec<(UserId, Tier, Presence)>>,
}

impl Differential {
    fn new(wiring: Wiring) -> Differential {
        let mut owner = Core::new(config()).unwrap();
        owner.set_publish_views(true);
        Differential {
            one: Core::new(config()).unwrap(),
            owner,
            edge: Fanout::new(config().batch_interval),
            wiring,
            now: Millis::ZERO,
            sessions: Vec::new(),
            users: BTreeMap::new(),
            pushes_one: BTreeMap::new(),
            pushes_edge: BTreeMap::new(),
        }
    }

    /// A push as compared: truths (to the target's own sessions) without
    /// their version.
    fn comparable(&self, to: SessionId, target: UserId, mut presence: Presence) -> Presence {
        if self.users.get(&to) == Some(&target) {
            presence.version = 0;
        }
        presence
    }

    fn pick(&self, i: u8) -> Option<SessionId> {
        (!self.sessions.is_empty()).then(|| self.sessions[i as usize % self.sessions.len()])
    }

    fn drain(&mut self) {
        while let Some(out) = self.one.poll_output() {
            if let Output::Push {
                to,
                target,
                tier,
                presence,
            } = out
            {
                // One core's batched truth carries the version counter as
                // of the flush, which publishes to others also move; the
                // owner publishes each truth with its version then. Both
                // grow (checked below); the truths themselves must be equal.
                let presence = self.comparable(to, target, presence);
                self.pushes_one
                    .entry(to)
                    .or_default()
                    .push((target, tier, presence));
            }
        }
        while let Some(out) = self.owner.poll_output() {
            if let Output::SessionEnded { session, reason } = out {
                self.edge.close(session, reason);
            }
        }
        while let Some(p) = self.owner.poll_published() {
            if p.own && self.wiring == Wiring::DropTruth {
                continue;
            }
            self.edge.apply(self.now, p.user, p.own, p.presence);
        }
        while let Some(out) = self.edge.poll_output() {
            if let Output::Push {
                to,
                target,
                tier,
                presence,
            } = out
            {
                let presence = self.comparable(to, target, presence);
                self.pushes_edge
                    .entry(to)
                    .or_default()
                    .push((target, tier, presence));
            }
        }
    }

    /// Runs every timer of the three machines in time order up to `until`.
    fn advance(&mut self, until: Millis) {
        loop {
            let next = [
                self.one.poll_timeout(),
                self.owner.poll_timeout(),
                self.edge.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next.filter(|&n| n <= until) else {
                break;
            };
            self.now = next;
            self.one.handle_timeout(next);
            self.owner.handle_timeout(next);
            self.drain();
            self.edge.handle_timeout(next);
            self.drain();
        }
        self.now = until;
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let now = self.now;
        match *op {
            Op::Wait(dt) => self.advance(now.plus(Millis(dt))),
            Op::Connect { user, device } => {
                let c = Connect {
                    user: UserId(user.into()),
                    device: DeviceId(device.into()),
                    kind: DeviceKind::Desktop,
                    watch: Watch::All,
                    resume: None,
                    foreground: true,
                };
                let a = self.one.handle_connect(now, c.clone());
                let b = self.owner.handle_connect(now, c);
                prop_assert_eq!(a.as_ref().map(|c| c.session), b.as_ref().map(|c| c.session));
                if let Ok(b) = b {
                    self.drain();
                    self.edge.open(b.session, UserId(user.into()));
                    self.sessions.push(b.session);
                    self.users.insert(b.session, UserId(user.into()));
                }
            }
            Op::Subscribe(s, t, tier) => {
                let Some(s) = self.pick(s) else { return Ok(()) };
                let target = UserId(t.into());
                let a = self.one.handle_subscribe(now, s, target, tier);
                let online = self.owner.session_info(s).is_some_and(|i| i.online);
                prop_assert_eq!(a.is_ok(), online);
                if let Ok(a) = a {
                    let viewer = self.owner.session_info(s).unwrap().user;
                    let snapshot = self
                        .owner
                        .handle_snapshot(now, target, viewer == target)
                        .unwrap();
                    let e = self.edge.subscribe(now, s, target, tier, snapshot).unwrap();
                    prop_assert_eq!(&a.presence, &e, "snapshot of {:?} for {}", target, s);
                }
            }
            Op::Unsubscribe(s, t) => {
                let Some(s) = self.pick(s) else { return Ok(()) };
                let target = UserId(t.into());
                if self.one.handle_unsubscribe(now, s, target).is_ok() {
                    self.edge.unsubscribe(now, s, target).unwrap();
                }
            }
            _ => {
                let Some(input) = self.device_input(op) else {
                    return Ok(());
                };
                let a = self.one.handle_input(now, input.clone());
                let b = self.owner.handle_input(now, input.clone());
                prop_assert_eq!(a.is_ok(), b.is_ok());
                if let (Ok(_), Input::Disconnect { session, .. }) = (&b, &input) {
                    // The edge's connection is gone: so are its local
                    // subscriptions (one core parks them: no pushes either).
                    self.edge.close(*session, EndReason::GraceExpired);
                }
            }
        }
        self.drain();
        Ok(())
    }

    fn device_input(&self, op: &Op) -> Option<Input> {
        Some(match *op {
            Op::Activity(s) => Input::Activity(self.pick(s)?),
            Op::Disconnect(s) => Input::Disconnect {
                session: self.pick(s)?,
                last_heard: self.now,
            },
            Op::Logout(s) => Input::Logout(self.pick(s)?),
            Op::SetStatus(s, status) => Input::SetStatus {
                session: self.pick(s)?,
                status,
                message: None,
            },
            Op::SetInvisible(s, invisible) => Input::SetInvisible {
                session: self.pick(s)?,
                invisible,
            },
            _ => return None,
        })
    }

    fn run(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        for op in ops {
            self.step(op)?;
            prop_assert_eq!(
                &self.pushes_one,
                &self.pushes_edge,
                "pushes differ after {:?} at {}",
                op,
                self.now
            );
        }
        let end = self.now.plus(Millis(10_000));
        self.advance(end);
        self.drain();
        prop_assert_eq!(&self.pushes_one, &self.pushes_edge, "at the end");
        Ok(())
    }
}

proptest! {
    #![proptest_config(RunConfig { cases: 256, ..RunConfig::default() })]

    /// C6 same answers: every snapshot and every push to every watcher.
    #[test]
    fn c6_owner_and_fanout_push_what_one_core_pushes(ops in prop::collection::vec(op(), 1..200)) {
        Differential::new(Wiring::Correct).run(&ops)?;
    }

    /// C1 (versions): after `enter_epoch`, every version published is above
    /// every version of the older epoch, and an edge's `Fanout` that gets
    /// both owners' views in any order ends on the new owner's latest.
    #[test]
    fn c1_a_new_epoch_publishes_above_the_old_one(
        ops in prop::collection::vec(op(), 1..120),
        more in prop::collection::vec(op(), 1..120),
        epoch in 1u32..1000,
        order in any::<u64>(),
    ) {
        let mut old = Differential::new(Wiring::Correct);
        old.one.enter_epoch(Epoch(epoch));
        old.owner.enter_epoch(Epoch(epoch));
        old.run(&ops)?;
        let mut old_views = Vec::new();
        // Every published view of the old owner (drained into the edge) is
        // at the old epoch.
        for list in old.pushes_edge.values() {
            // (Truths are compared without versions: skip them.)
            for (_, _, p) in list.iter().filter(|(_, _, p)| p.version != 0) {
                prop_assert_eq!(epoch_of(p.version), Epoch(epoch));
                old_views.push(p.version);
            }
        }
        // The new owner restores user 1 as the KV had it and runs on.
        let mut new = Core::new(config()).unwrap();
        new.set_publish_views(true);
        new.enter_epoch(Epoch(epoch + 1));
        let record = OwnedRecord {
            published: old.owner.presence(UserId(1)),
            ..OwnedRecord::default()
        };
        new.restore_owned(old.now, UserId(1), &record, old.now).unwrap();
        let mut new_views = Vec::new();
        let mut now = old.now;
        for op in &more {
            now = now.plus(Millis(50));
            if let Op::Connect { device, .. } = op {
                let _ = new.handle_connect(now, Connect {
                    user: UserId(1), device: DeviceId((*device).into()), kind: DeviceKind::Web,
                    watch: Watch::All, resume: None,
                    foreground: true,
                });
            }
            new.handle_timeout(now.plus(Millis(300)));
            while let Some(p) = new.poll_published() {
                prop_assert!(p.presence.version > epoch_base(Epoch(epoch + 1)));
                new_views.push(p.presence);
            }
        }
        prop_assert!(old_views.iter().all(|&v| v < epoch_base(Epoch(epoch + 1))));
        // Interleave the two owners' views of user 1 arbitrarily at one edge.
        let mut edge = Fanout::new(Millis(1));
        edge.open(SessionId(99), UserId(9));
        edge.subscribe(Millis(0), SessionId(99), UserId(1), Tier::Realtime, Presence::default()).unwrap();
        let mut olds: Vec<Presence> = old.pushes_edge.values().flatten()
            .filter(|(t, _, p)| *t == UserId(1) && !p.invisible).map(|(_, _, p)| p.clone()).collect();
        olds.sort_by_key(|p| p.version);
        let (mut i, mut j, mut bits) = (0, 0, order);
        while i < olds.len() || j < new_views.len() {
            let take_old = j >= new_views.len() || (i < olds.len() && bits & 1 == 1);
            bits = bits.rotate_right(1);
            if take_old {
                edge.apply(Millis(0), UserId(1), false, olds[i].clone());
                i += 1;
            } else {
                edge.apply(Millis(0), UserId(1), false, new_views[j].clone());
                j += 1;
            }
        }
        if let Some(last) = new_views.last() {
            prop_assert_eq!(edge.known(UserId(9), UserId(1)), Some(last));
        }
    }

    /// The resync window: a restored user shown online, with or without
    /// devices, is never published offline before the window closes (unless
    /// invisible), and is published offline by window + grace + debounce if
    /// no device comes back.
    #[test]
    fn resync_window_holds_offline_then_heals(
        devices in 0usize..3,
        invisible in any::<bool>(),
        window in 0u64..5_000,
        reconnect in prop::option::of(0u64..6_000),
    ) {
        let mut cfg = config();
        for kind in &mut cfg.kinds {
            kind.heartbeat_timeout = Millis(60_000); // not what this is about
        }
        let mut owner = Core::new(cfg.clone()).unwrap();
        owner.set_publish_views(true);
        owner.enter_epoch(Epoch(7));
        let start = Millis(10_000);
        let until = start.plus(Millis(window));
        owner.hold_offline_until(until);
        let record = OwnedRecord {
            invisible,
            published: Presence {
                version: epoch_base(Epoch(6)) + 5,
                online: !invisible,
                ..Presence::default()
            },
            devices: (0..devices)
                .map(|d| DeviceRecord {
                    device: DeviceId(d as u64 + 1),
                    kind: DeviceKind::Mobile,
                    edge: NodeId(1),
                    last_heard: Millis(9_000),
                    foreground: true,
                })
                .collect(),
            ..OwnedRecord::default()
        };
        owner.restore_owned(start, UserId(1), &record, until).unwrap();
        owner.check_invariants().map_err(TestCaseError::fail)?;
        let grace = if devices > 0 { cfg.kind(DeviceKind::Mobile).grace } else { Millis::ZERO };
        // Restored devices linger to the later of grace and the window.
        let linger_end = until.max(start.plus(grace));
        let end = linger_end.max(start).plus(cfg.debounce);
        let back = reconnect.map(|r| start.plus(Millis(r)));
        let mut offline: Option<(Millis, Presence)> = None;
        let mut t = start;
        while t < end.plus(Millis(10)) {
            if back == Some(t) {
                owner.handle_connect(t, Connect {
                    user: UserId(1), device: DeviceId(1), kind: DeviceKind::Mobile,
                    watch: Watch::All, resume: None,
                    foreground: true,
                }).unwrap();
            }
            owner.handle_timeout(t);
            owner.check_invariants().map_err(TestCaseError::fail)?;
            while let Some(p) = owner.poll_published() {
                if !p.own {
                    prop_assert!(p.presence.version > epoch_base(Epoch(7)));
                    if !p.presence.online && offline.is_none() {
                        offline = Some((t, p.presence));
                    }
                }
            }
            t = t.plus(Millis(1));
        }
        if !invisible {
            if let Some((at, p)) = &offline {
                prop_assert!(*at >= until, "offline at {at} inside the window ending {until}");
                prop_assert!(back.is_none_or(|b| b >= linger_end), "offline though back at {back:?}");
                if devices > 0 {
                    // Last seen is when the device was last heard, not the restore.
                    prop_assert_eq!(p.last_seen, Some(Millis(9_000)));
                }
            }
            if back.is_none_or(|b| b >= end) {
                prop_assert!(offline.as_ref().is_some_and(|(at, _)| *at <= end), "no offline by {end}: {offline:?}");
            }
        }
    }

    /// Edge lost: its Online devices linger, heard last at the lease's last
    /// renewal; a device reconnecting elsewhere within grace is unseen; one
    /// that does not is shown offline with last seen at the renewal.
    #[test]
    fn edge_lost_lingers_from_the_last_renewal(
        on_edge in prop::collection::vec(any::<bool>(), 1..4),
        renewal_ago in 0u64..500,
        back in prop::option::of(0u64..2_000),
    ) {
        let cfg = config();
        let mut owner = Core::new(cfg.clone()).unwrap();
        owner.set_publish_views(true);
        let mut lost = Vec::new();
        for (d, &on) in on_edge.iter().enumerate() {
            let s = owner.handle_connect(Millis(0), Connect {
                user: UserId(1), device: DeviceId(d as u64), kind: DeviceKind::Desktop,
                watch: Watch::All, resume: None,
                foreground: true,
            }).unwrap().session;
            if on { lost.push(s); }
        }
        owner.handle_timeout(Millis(1_000));
        while owner.poll_published().is_some() {}
        let now = Millis(1_000);
        let renewal = Millis(1_000 - renewal_ago);
        let n = owner.handle_edge_lost(now, &lost, renewal);
        prop_assert_eq!(n, lost.len());
        prop_assert_eq!(owner.handle_edge_lost(now, &lost, renewal), 0, "twice is a no-op");
        let everyone_lost = lost.len() == on_edge.len();
        if let Some(b) = back {
            if let Some(d) = on_edge.iter().position(|&on| on) {
                let _ = owner.handle_connect(now.plus(Millis(b)), Connect {
                    user: UserId(1), device: DeviceId(d as u64), kind: DeviceKind::Desktop,
                    watch: Watch::All, resume: None,
                    foreground: true,
                });
            }
        }
        // Before any heartbeat timeout: only the edge's loss is at work.
        owner.handle_timeout(now.plus(cfg.kind(DeviceKind::Desktop).grace).plus(cfg.debounce).plus(Millis(10)));
        owner.check_invariants().map_err(TestCaseError::fail)?;
        let offline: Vec<Presence> = std::iter::from_fn(|| owner.poll_published())
            .filter(|p| !p.own && !p.presence.online).map(|p| p.presence).collect();
        let returned = back.is_some_and(|b| b < cfg.kind(DeviceKind::Desktop).grace.0 + cfg.debounce.0);
        if everyone_lost && !returned {
            prop_assert_eq!(offline.len(), 1);
            prop_assert_eq!(offline[0].last_seen, Some(renewal));
        } else {
            prop_assert!(offline.is_empty(), "{offline:?}");
        }
    }
}

/// The differential catches an edge that drops the owner's truths: the
/// user's own sessions stop hearing about themselves.
#[test]
fn c6_catches_an_edge_that_drops_truths() {
    let mut runner = TestRunner::new(RunConfig {
        cases: 256,
        failure_persistence: None,
        ..RunConfig::default()
    });
    let found = runner.run(&prop::collection::vec(op(), 1..200), |ops| {
        Differential::new(Wiring::DropTruth).run(&ops)
    });
    assert!(found.is_err(), "the broken edge went unnoticed");
}

/// The single-node path is unchanged: without `set_publish_views` nothing
/// is queued to publish.
#[test]
fn one_node_publishes_nothing_for_a_cluster() {
    let mut core = Core::new(config()).unwrap();
    core.handle_connect(
        Millis(0),
        Connect {
            user: UserId(1),
            device: DeviceId(1),
            kind: DeviceKind::Web,
            watch: Watch::All,
            resume: None,
            foreground: true,
        },
    )
    .unwrap();
    core.handle_timeout(Millis(1_000));
    assert_eq!(core.poll_published(), None);
    assert_eq!(core.epoch(), Epoch(0));
}

/// A subscribe whose snapshot (from the owner) is newer than the view the
/// edge's other watchers of the target hold (they missed a view) pushes it
/// to them too; else they keep the old view, and a repair bringing the
/// same version changes nothing (seed 3187: an invisible user shown
/// online for good on a node back from a cut-off).
#[test]
fn a_newer_snapshot_reaches_the_other_watchers_on_the_edge() {
    let (bob, carol) = (SessionId(1), SessionId(2));
    let mut edge = Fanout::new(Millis(1_000));
    edge.open(bob, UserId(8));
    edge.open(carol, UserId(9));
    let seen = |version, online| Presence {
        version,
        online,
        ..Presence::default()
    };
    edge.subscribe(Millis(0), bob, UserId(1), Tier::Realtime, seen(4, true))
        .unwrap();
    while edge.poll_output().is_some() {}
    let shown = edge
        .subscribe(Millis(5), carol, UserId(1), Tier::Realtime, seen(6, false))
        .unwrap();
    assert_eq!(shown.version, 6);
    let mut pushed = Vec::new();
    while let Some(out) = edge.poll_output() {
        if let Output::Push { to, presence, .. } = out {
            pushed.push((to, presence.version, presence.online));
        }
    }
    assert_eq!(pushed, vec![(bob, 6, false)]);
    // An older snapshot changes nothing for anyone.
    let shown = edge
        .subscribe(Millis(6), carol, UserId(1), Tier::Realtime, seen(5, true))
        .unwrap();
    assert_eq!(shown.version, 6);
    assert!(edge.poll_output().is_none());
}

/// A push still queued when its session closes is not sent after the end:
/// the edge forgets the targets with the session's subscriptions.
#[test]
fn a_push_queued_for_a_closing_session_is_dropped() {
    let (bob, carol) = (SessionId(1), SessionId(2));
    let mut edge = Fanout::new(Millis(1_000));
    edge.open(bob, UserId(8));
    edge.open(carol, UserId(9));
    for s in [bob, carol] {
        edge.subscribe(Millis(0), s, UserId(1), Tier::Realtime, Presence::default())
            .unwrap();
    }
    while edge.poll_output().is_some() {}
    let offline = Presence {
        version: 3,
        ..Presence::default()
    };
    edge.apply(Millis(10), UserId(1), false, offline);
    edge.close(bob, EndReason::LoggedOut);
    let mut seen = Vec::new();
    while let Some(out) = edge.poll_output() {
        match out {
            Output::Push { to, .. } => seen.push(format!("push to {}", to.0)),
            Output::SessionEnded { session, .. } => seen.push(format!("end of {}", session.0)),
        }
    }
    assert_eq!(seen, ["push to 2", "end of 1"]);
}

/// A session resumed on the same edge keeps its subscriptions and its
/// pending batch under the new id, as on one node; the old id gets nothing.
#[test]
fn a_resumed_session_carries_its_subscriptions_on_the_edge() {
    let (old, new) = (SessionId(1), SessionId(2));
    let mut edge = Fanout::new(Millis(1_000));
    edge.open(old, UserId(9));
    edge.subscribe(
        Millis(0),
        old,
        UserId(1),
        Tier::Realtime,
        Presence::default(),
    )
    .unwrap();
    edge.subscribe(
        Millis(0),
        old,
        UserId(2),
        Tier::Batched,
        Presence::default(),
    )
    .unwrap();
    let changed = |version| Presence {
        version,
        online: true,
        ..Presence::default()
    };
    edge.apply(Millis(10), UserId(2), false, changed(5)); // queued in old's batch
    while edge.poll_output().is_some() {}
    edge.open(new, UserId(9));
    let carried = edge.carry(old, new);
    assert_eq!(
        carried,
        vec![(UserId(1), Tier::Realtime), (UserId(2), Tier::Batched)]
    );
    assert!(edge.subscriptions(old).is_empty());
    edge.apply(Millis(20), UserId(1), false, changed(7));
    edge.handle_timeout(Millis(1_010));
    let mut pushed = Vec::new();
    while let Some(out) = edge.poll_output() {
        assert!(!matches!(out, Output::SessionEnded { .. }));
        if let Output::Push {
            to,
            target,
            presence,
            ..
        } = out
        {
            pushed.push((to, target, presence.version));
        }
    }
    assert_eq!(pushed, vec![(new, UserId(1), 7), (new, UserId(2), 5)]);
}

/// When a new owner restores a user, in a shard record, whose one device is
/// in the background, and which the old owner last published online. Returns
/// when the new owner publishes her offline, and that view.
fn restored_offline_at(foreground: bool, until: Millis) -> (Millis, Presence) {
    let cfg = config();
    let mut owner = Core::new(cfg.clone()).unwrap();
    owner.set_publish_views(true);
    owner.enter_epoch(Epoch(7));
    let start = Millis(10_000);
    owner.hold_offline_until(until);
    let record = OwnedRecord {
        last_seen: Some(Millis(8_000)),
        published: Presence {
            version: epoch_base(Epoch(6)) + 5,
            online: true,
            ..Presence::default()
        },
        devices: vec![DeviceRecord {
            device: DeviceId(1),
            kind: DeviceKind::Mobile,
            edge: NodeId(1),
            last_heard: Millis(9_000),
            foreground,
        }],
        ..OwnedRecord::default()
    };
    owner
        .restore_owned(start, UserId(1), &record, until)
        .unwrap();
    owner.check_invariants().unwrap();
    let end = start
        .plus(cfg.kind(DeviceKind::Mobile).grace)
        .plus(cfg.debounce);
    let mut t = start;
    while t <= end.plus(Millis(10)) {
        owner.handle_timeout(t);
        owner.check_invariants().unwrap();
        while let Some(p) = owner.poll_published() {
            if !p.own && !p.presence.online {
                return (t, p.presence);
            }
        }
        t = t.plus(Millis(1));
    }
    panic!("never published offline by {end}");
}

/// A device the shard record names as backgrounded is restored
/// backgrounded: its user is shown offline when the resync window closes,
/// not after the device's grace, and last seen stays when the app left the
/// foreground (I12 across an owner failover).
#[test]
fn a_backgrounded_device_is_restored_in_the_background() {
    let cfg = config();
    let start = Millis(10_000);
    let until = start.plus(Millis(200));
    let (at, view) = restored_offline_at(false, until);
    assert!(
        at <= until.plus(cfg.debounce),
        "a backgrounded user shown online until {at}, past the window ending {until}"
    );
    assert_eq!(view.last_seen, Some(Millis(8_000)));
    // A foreground device, for contrast, lingers for its grace.
    let (at, _) = restored_offline_at(true, until);
    assert!(at >= start.plus(cfg.kind(DeviceKind::Mobile).grace));
}

/// A user read back from an older view than watchers were shown (its
/// newer write lost) is answered to a subscribe as she shows now, at a
/// version at least the one watchers were shown, not as the stale view:
/// here she went invisible after the view read back showed her online
/// (seed 13686).
#[test]
fn a_snapshot_of_a_user_read_back_behind_shows_her_as_she_is() {
    let mut owner = Core::new(config()).unwrap();
    owner.set_publish_views(true);
    owner.enter_epoch(Epoch(4));
    let base = epoch_base(Epoch(4));
    let record = OwnedRecord {
        invisible: true,
        published: Presence {
            version: base + 2,
            online: true,
            ..Presence::default()
        },
        shown_before: base + 4,
        ..OwnedRecord::default()
    };
    let start = Millis(10_000);
    owner
        .restore_owned(start, UserId(1), &record, start)
        .unwrap();
    let snapshot = owner.handle_snapshot(start, UserId(1), false).unwrap();
    assert!(!snapshot.online, "{snapshot:?}");
    assert!(snapshot.version >= base + 4, "{snapshot:?}");
}

/// A user restored offline from the KV, whose old owner may have shown
/// watchers a later online view the KV never got (its write lost in an
/// outage), is published again under the new epoch only once the resync
/// window closes: an edge may yet resend the device that is connected
/// (seed 11951: shown offline 0.4 s after the claim, connected all along).
#[test]
fn a_restored_offline_waits_for_the_resync_window() {
    let mut owner = Core::new(config()).unwrap();
    owner.set_publish_views(true);
    owner.enter_epoch(Epoch(5));
    let record = OwnedRecord {
        published: Presence {
            version: epoch_base(Epoch(3)) + 4,
            ..Presence::default()
        },
        ..OwnedRecord::default()
    };
    let start = Millis(10_000);
    let window_ends = start.plus(Millis(15_000));
    owner.hold_offline_until(window_ends);
    owner
        .restore_owned(start, UserId(1), &record, start)
        .unwrap();
    owner.handle_timeout(start.plus(config().debounce));
    let early: Vec<Published> = std::iter::from_fn(|| owner.poll_published()).collect();
    assert!(early.is_empty(), "published in the window: {early:?}");
    owner.handle_timeout(window_ends);
    owner.check_invariants().unwrap();
    let after: Vec<Presence> = std::iter::from_fn(|| owner.poll_published())
        .filter(|p| !p.own)
        .map(|p| p.presence)
        .collect();
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(!after[0].online && after[0].version > epoch_base(Epoch(5)));
}

/// An owner reads back a user it released earlier in the epoch, and the
/// KV's view of her is older than the one it published before the release
/// (the later write was lost in an outage). Watchers hold the newer
/// version and would drop the older one as stale: the restored view is
/// published again above what they were shown, though it looks the same.
/// Without `shown_before` it is not published at all.
#[test]
fn a_user_read_back_from_an_older_view_is_published_again_above_it() {
    let published_after = |shown_before: u64| {
        let mut owner = Core::new(config()).unwrap();
        owner.set_publish_views(true);
        owner.enter_epoch(Epoch(2));
        let kv_view = Presence {
            version: epoch_base(Epoch(2)) + 1,
            ..Presence::default()
        };
        let record = OwnedRecord {
            published: kv_view,
            shown_before,
            ..OwnedRecord::default()
        };
        let start = Millis(10_000);
        owner
            .restore_owned(start, UserId(1), &record, start)
            .unwrap();
        owner.handle_timeout(start.plus(config().debounce));
        owner.check_invariants().unwrap();
        std::iter::from_fn(|| owner.poll_published())
            .filter(|p| !p.own)
            .map(|p| p.presence)
            .collect::<Vec<_>>()
    };
    let shown = epoch_base(Epoch(2)) + 5;
    let again = published_after(shown);
    assert_eq!(again.len(), 1, "{again:?}");
    assert!(again[0].version > shown && !again[0].online);
    assert!(published_after(0).is_empty());
}
