//! Model 3: the cluster. Nodes that are each an edge and an owner, a
//! linearizable KV with leases (TTL) and compare-and-set, and a network that
//! loses, delays and reorders messages; nodes crash, restart, and get cut off
//! from the KV. Every owner runs the real [`Core`] (with the cluster inputs:
//! `enter_epoch`, `restore_owned`, `hold_offline_until`, `handle_edge_lost`,
//! `poll_published`) and the watcher's edge runs the real [`Fanout`] and the
//! client's [`View`].
//!
//! It is written as a plain stateright `Model` whose actions are the steps of
//! actors (one node handles one message; the KV applies one operation; the
//! network drops one message; time advances), because the protocol rests on
//! one timing assumption an actor model cannot state: clocks run at the same
//! rate, so an owner that failed to renew stops acting before the KV expires
//! its claim. Time is global and advances in ticks; a `Tick` runs everything
//! time-driven, deterministically: lease renewals (compare-and-set), lapses,
//! KV expiries, edge-lost handling, claims of free shards, core timers,
//! beacons and retries.
//!
//! The world: one shard; alice (user 1) has a mobile, connected at an edge,
//! and in some bounds a desktop, connected at node 0 throughout; bob (user
//! 2) watches alice in realtime from node 0, which never fails, or in the
//! `roam` bound from node 1, and resumes his session elsewhere from its
//! session record when node 1 crashes. Faults (bounded counts): crash,
//! restart, cut-off of any other node; a lost message. Alice's mobile
//! reconnects to a live node within grace after its edge died, or gives
//! up; it may turn invisible once, and log out.
//!
//! Delay: a message sent at tick t is delivered (or lost) before the clock
//! passes t + 1, in any order: delays shorter than two ticks. Faults and
//! alice's reconnects happen at tick starts; a node's calls to itself are
//! in process. docs/cluster.md ("The model") describes the protocol as
//! checked, the bounds and the holes found.

mod bounds;
mod check;
mod edge;
mod owner;
mod state;
mod tick;

pub use bounds::{
    ClusterBounds, ClusterMutant, AGGREGATE, FAILOVER, LOGGED_OUT, ONLINE, ONLINE_LATER, QUIET,
    RESUMED, STALE_WRITE,
};
pub use check::describe;
use check::{c3, c5, has, quiet};
use owner::watching;
pub use state::*;

use greendot_core::cluster::{epoch_of, owner_of, DeviceRecord, OwnedRecord};
use greendot_core::{
    Config, Connect, Core, DeviceId, DeviceKind, Epoch, Fanout, KindConfig, Millis, NodeId, Output,
    Presence, RealtimeOverflow, SessionId, ShardId, Tier, UserId, View, Watch,
};
use stateright::{Model, Property};
use std::collections::{BTreeMap, BTreeSet};

use crate::protocol::Shown;

pub const ALICE: UserId = UserId(1);
pub const BOB: UserId = UserId(2);
/// Bob's session at node 0's edge (edge-local id).
const BOB_SESSION: SessionId = SessionId(1);
/// The node that never fails: bob's watcher (unless `ClusterBounds::bob_edge`
/// says otherwise) and alice's desktop are there.
pub const WATCHER_NODE: u8 = 0;
const SHARD: ShardId = ShardId(0);
/// Alice's devices, as indexes of `NodeState::devices`: the mobile moves
/// between nodes; the desktop (when `ClusterBounds::desktop`) stays
/// connected at the watcher's node, which never fails.
pub const MOBILE: u8 = 0;
pub const DESKTOP: u8 = 1;

/// The core's id of alice's device `dev`.
pub(crate) fn device_id(dev: u8) -> DeviceId {
    DeviceId(u64::from(dev) + 1)
}

/// The core's kind of alice's device `dev`.
pub(crate) fn device_kind(dev: u8) -> DeviceKind {
    if dev == MOBILE {
        DeviceKind::Mobile
    } else {
        DeviceKind::Desktop
    }
}

/// Timing, in ticks (the cores' milliseconds are ticks).
pub const TTL: u64 = 3;
/// An owner that could not renew stops this long before its claim can
/// expire; an edge closes its clients then too.
pub const MARGIN: u64 = 1;
pub const GRACE: u64 = 2;
pub const DEBOUNCE: u64 = 1;
/// A new owner's resync window.
pub const RESYNC: u64 = 3;

/// The bound of C3: a device whose edge died and that does not come back
/// is shown offline by its owner within this many ticks of the death.
pub const GHOST_BOUND: u64 = TTL + if GRACE > RESYNC { GRACE } else { RESYNC } + DEBOUNCE;

pub struct ClusterModel {
    pub bounds: ClusterBounds,
    pub mutant: Option<ClusterMutant>,
    pub config: Config,
}

pub fn cluster_config() -> Config {
    let kind = KindConfig {
        // Edges forward liveness through their leases; not what this is about.
        heartbeat_timeout: Millis(1_000),
        grace: Millis(GRACE),
    };
    Config {
        debounce: Millis(DEBOUNCE),
        batch_interval: Millis(1),
        kinds: [kind; 4],
        max_subscriptions_per_session: 4,
        max_realtime_per_target: 4,
        realtime_overflow: RealtimeOverflow::Downgrade,
        max_message_len: 16,
        max_devices_per_user: 2,
        max_sessions: 64,
        max_users: 16,
        backgrounded: greendot_core::Backgrounded::Offline,
        // Groups are not modelled here: their defaults.
        ..Config::default()
    }
}

impl ClusterModel {
    pub fn new(bounds: ClusterBounds, mutant: Option<ClusterMutant>) -> ClusterModel {
        ClusterModel {
            bounds,
            mutant,
            config: cluster_config(),
        }
    }

    fn is(&self, m: ClusterMutant) -> bool {
        self.mutant == Some(m)
    }
}

/// Alice's mobile sends `op` to the shard's owner (resent each tick until
/// acknowledged).
fn mobile_asks(s: &mut ClusterState, op: Op) -> Option<()> {
    let n = s.alice.at?;
    let node = &mut s.nodes[n as usize];
    let d = node.devices[MOBILE as usize].as_mut()?;
    node.rids += 1;
    d.rid = node.rids;
    d.pending = Some(op);
    let body = Body::Req {
        edge: n,
        inc: node.inc,
        rid: d.rid,
        dev: MOBILE,
        op,
    };
    if let Some((holder, _, _)) = s.kv.claim {
        s.send(n, holder, body);
    }
    Some(())
}

impl ClusterModel {
    /// Bob's session at an edge, about to subscribe to alice or not.
    fn watcher(&self, subscribes: bool) -> Box<Watcher> {
        let mut fanout = Fanout::new(self.config.batch_interval);
        fanout.open(BOB_SESSION, BOB);
        Box::new(Watcher {
            fanout,
            subscribed: false,
            snap_pending: subscribes,
            seen: (Epoch(0), 0),
        })
    }
}

impl Model for ClusterModel {
    type State = ClusterState;
    type Action = Action;

    fn init_states(&self) -> Vec<ClusterState> {
        let b = &self.bounds;
        let nodes: Vec<NodeState> = (0..b.nodes)
            .map(|n| NodeState {
                up: true,
                cut: false,
                inc: 0,
                rids: u8::from(n == b.alice_edge) + u8::from(b.desktop && n == WATCHER_NODE),
                renewed: 0,
                owner: None,
                devices: [
                    (n == b.alice_edge).then_some(EdgeDevice {
                        rid: 1,
                        conn: 1,
                        pending: Some(Op::Connect),
                        then: None,
                    }),
                    (b.desktop && n == WATCHER_NODE).then(|| {
                        let rid = u8::from(n == b.alice_edge) + 1;
                        EdgeDevice {
                            rid,
                            conn: rid,
                            pending: Some(Op::Connect),
                            then: None,
                        }
                    }),
                ],
                watcher: (n == b.bob_edge).then(|| self.watcher(true)),
            })
            .collect();
        let mut s = ClusterState {
            t: 0,
            nodes,
            kv: Kv {
                leases: (0..b.nodes).map(|_| Some((0, TTL))).collect(),
                claim: None,
                epoch: Epoch(0),
                invisible: false,
                prefs_epoch: Epoch(0),
                view: None,
                devices: Vec::new(),
                bob_record: Some(BOB_SESSION),
            },
            bob: Bob {
                view: View::new(),
                at: Some(b.bob_edge),
                resumed: false,
            },
            net: BTreeSet::new(),
            alice: Alice {
                at: Some(b.alice_edge),
                away_since: None,
                gone: false,
                flips: b.flips,
                invisible_asked: false,
                invisible_acked: false,
                logout_asked: false,
            },
            crashes: b.crashes,
            restarts: b.restarts,
            cuts: b.cuts,
            drops: b.drops,
            quiet_since: 0,
            fresh: true,
            bad: Vec::new(),
            local: Default::default(),
            writes: BTreeSet::new(),
            slow: b.slow,
        };
        self.claim_shard(&mut s, b.first_owner);
        // The first requests go out at once.
        for n in 0..b.nodes {
            for (dev, d) in s.nodes[n as usize].devices.clone().iter().enumerate() {
                if let Some(d) = d {
                    let req = Body::Req {
                        edge: n,
                        inc: 0,
                        rid: d.rid,
                        dev: dev as u8,
                        op: Op::Connect,
                    };
                    s.send(n, b.first_owner, req);
                }
            }
        }
        s.send(
            b.bob_edge,
            b.first_owner,
            Body::SnapReq { edge: b.bob_edge },
        );
        while let Some(m) = s.local.pop_front() {
            self.deliver(&mut s, m);
        }
        vec![s]
    }

    fn actions(&self, s: &ClusterState, actions: &mut Vec<Action>) {
        let b = &self.bounds;
        let in_time =
            s.net.iter().all(|m| m.sent == s.t) && s.writes.iter().all(|w| w.held || w.sent == s.t);
        if s.t < b.max_time && in_time {
            actions.push(Action::Tick);
        }
        let faults = s.t <= b.faults_until && s.fresh;
        for m in &s.net {
            actions.push(Action::Deliver(m.clone()));
            if s.drops > 0 && faults {
                actions.push(Action::Drop(m.clone()));
            }
        }
        for w in &s.writes {
            actions.push(Action::Store(w.clone()));
            if s.slow > 0 && !w.held && faults {
                actions.push(Action::Hold(w.clone()));
            }
        }
        for n in 0..b.nodes {
            let node = &s.nodes[n as usize];
            if n == WATCHER_NODE || !faults || b.faulty.is_some_and(|f| f != n) {
                continue;
            }
            if node.up && s.crashes > 0 {
                actions.push(Action::Crash(n));
            }
            if !node.up && s.restarts > 0 {
                actions.push(Action::Restart(n));
            }
            if node.up && !node.cut && s.cuts > 0 {
                actions.push(Action::Cut(n));
            }
        }
        if s.alice.at.is_none() && !s.alice.gone && s.fresh {
            for n in 0..b.nodes {
                let node = &s.nodes[n as usize];
                if node.up && !node.cut {
                    actions.push(Action::Reconnect(n));
                }
            }
        }
        if s.bob.at.is_none() && s.fresh {
            for n in 0..b.nodes {
                let node = &s.nodes[n as usize];
                if node.up && !node.cut {
                    actions.push(Action::BobResumes(n));
                }
            }
        }
        let mobile_idle = s
            .alice
            .at
            .and_then(|n| s.nodes[n as usize].devices[MOBILE as usize].as_ref())
            .is_some_and(|d| d.pending.is_none());
        if s.alice.flips > 0 && s.t == b.invisible_at && mobile_idle {
            actions.push(Action::GoInvisible);
        }
        if b.logout_at == Some(s.t) && !s.alice.logout_asked && mobile_idle {
            actions.push(Action::Logout);
        }
    }

    fn next_state(&self, last: &ClusterState, action: Action) -> Option<ClusterState> {
        let mut s = last.clone();
        let t = s.t;
        match action {
            Action::Tick => {
                s.fresh = true;
                self.tick(&mut s)
            }
            Action::Deliver(m) => {
                s.fresh = false;
                s.net.remove(&m);
                self.deliver(&mut s, m);
            }
            Action::Store(w) => {
                s.fresh = false;
                s.writes.remove(&w);
                self.store(&mut s, w);
            }
            Action::Hold(w) => {
                s.slow -= 1;
                s.quiet_since = t;
                s.writes.remove(&w);
                s.writes.insert(Write { held: true, ..w });
            }
            Action::Drop(m) => {
                s.fresh = false;
                s.net.remove(&m);
                s.drops -= 1;
                s.quiet_since = t;
            }
            Action::Crash(n) => {
                s.crashes -= 1;
                s.quiet_since = t;
                self.crash(&mut s, n);
            }
            Action::Restart(n) => {
                s.restarts -= 1;
                s.quiet_since = t;
                let node = &mut s.nodes[n as usize];
                node.up = true;
                node.cut = false;
                node.inc += 1;
                node.rids = 0;
                node.renewed = t;
                // A fresh process puts its lease (same key, new incarnation).
                s.kv.leases[n as usize] = Some((node.inc, t + TTL));
            }
            Action::Cut(n) => {
                s.cuts -= 1;
                s.quiet_since = t;
                s.nodes[n as usize].cut = true;
            }
            Action::Reconnect(n) => {
                s.quiet_since = t;
                s.alice.at = Some(n);
                s.alice.away_since = None;
                let node = &mut s.nodes[n as usize];
                node.rids += 1;
                let rid = node.rids;
                node.devices[MOBILE as usize] = Some(EdgeDevice {
                    rid,
                    conn: rid,
                    pending: Some(Op::Connect),
                    then: None,
                });
                let req = Body::Req {
                    edge: n,
                    inc: node.inc,
                    rid,
                    dev: MOBILE,
                    op: Op::Connect,
                };
                if let Some((holder, _, _)) = s.kv.claim {
                    s.send(n, holder, req);
                }
            }
            Action::GoInvisible => {
                s.quiet_since = t;
                s.alice.flips -= 1;
                s.alice.invisible_asked = true;
                mobile_asks(&mut s, Op::SetInvisible(true))?;
            }
            Action::BobResumes(n) => {
                s.quiet_since = t;
                // The edge reads his session record: it names his session,
                // so it subscribes him to alice again here (a snapshot from
                // her owner) and the welcome says `resumed`. Without the
                // record the session is fresh and his client subscribes
                // again itself: the same subscription either way.
                let carried = s.kv.bob_record == Some(BOB_SESSION);
                let subscribes = !(carried && self.is(ClusterMutant::ResumeDropsSubscriptions));
                s.nodes[n as usize].watcher = Some(self.watcher(subscribes));
                s.bob.at = Some(n);
                s.bob.resumed = carried;
                if let Some((holder, _, _)) = s.kv.claim.filter(|_| subscribes) {
                    s.send(n, holder, Body::SnapReq { edge: n });
                }
            }
            Action::Logout => {
                s.quiet_since = t;
                s.alice.logout_asked = true;
                mobile_asks(&mut s, Op::Logout)?;
            }
        }
        while let Some(m) = s.local.pop_front() {
            self.deliver(&mut s, m);
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("C1 one writer", |_, s: &ClusterState| {
                s.nodes.iter().filter(|n| n.owner.is_some()).count() <= 1 && !has(s, "C1")
            }),
            Property::always("C2 no false offline on failover", |_, s: &ClusterState| {
                !has(s, "C2")
            }),
            Property::always("C3 bounded ghosts", |_, s: &ClusterState| c3(s)),
            Property::always("C4 invisible survives failover", |_, s: &ClusterState| {
                let shown_online = s
                    .nodes
                    .iter()
                    .filter_map(|n| n.owner.as_deref())
                    .any(|o| o.core.presence(ALICE).online);
                let acked = s.alice.invisible_acked;
                !has(s, "C4") && (!acked || !shown_online)
            }),
            Property::always("C5 convergence", |_, s: &ClusterState| c5(s)),
            Property::always(AGGREGATE, |_, s: &ClusterState| !has(s, "AG")),
            Property::sometimes(FAILOVER, |_, s: &ClusterState| {
                s.kv.epoch.0 >= 2 && s.nodes.iter().any(|n| n.owner.is_some())
            }),
            Property::sometimes(ONLINE, |_, s: &ClusterState| {
                s.bob.view.get(ALICE).is_some_and(|p| p.online)
            }),
            Property::sometimes(ONLINE_LATER, |_, s: &ClusterState| {
                s.bob
                    .view
                    .get(ALICE)
                    .is_some_and(|p| p.online && epoch_of(p.version).0 >= 2)
            }),
            Property::sometimes(RESUMED, |_, s: &ClusterState| {
                s.bob.resumed
                    && quiet(s).is_some_and(|o| {
                        let shown = o.core.presence(ALICE);
                        !shown.online && s.bob.view.get(ALICE) == Some(&shown)
                    })
            }),
            Property::sometimes(STALE_WRITE, |_, s: &ClusterState| {
                s.writes.iter().any(|w| w.epoch < s.kv.epoch)
            }),
            Property::sometimes(LOGGED_OUT, |_, s: &ClusterState| {
                s.alice.logout_asked
                    && s.alice.gone
                    && s.nodes
                        .iter()
                        .filter_map(|n| n.owner.as_deref())
                        .any(|o| o.core.presence(ALICE).online)
            }),
            Property::sometimes(QUIET, |_, s: &ClusterState| {
                quiet(s).is_some_and(|o| o.core.presence(ALICE).version > 0)
            }),
        ]
    }
}
