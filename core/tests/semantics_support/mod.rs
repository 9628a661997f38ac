//! What the semantics tests share: users and devices, a core on a virtual
//! clock that checks the invariants after every step, and readers of its
//! outputs.

#![allow(dead_code)] // each test file uses its own part

use greendot_core::*;

pub const ALICE: UserId = UserId(1);
pub const BOB: UserId = UserId(2);
pub const CAROL: UserId = UserId(3);
pub const PHONE: DeviceId = DeviceId(1);
pub const LAPTOP: DeviceId = DeviceId(2);

/// A core on a virtual clock; checks the invariants after every step.
pub struct Harness {
    pub core: Core,
    pub now: u64,
}

impl Harness {
    pub fn new() -> Harness {
        Harness::with(Config::default())
    }

    pub fn with(config: Config) -> Harness {
        Harness {
            core: Core::new(config).expect("valid config"),
            now: 0,
        }
    }

    pub fn at(&mut self, ms: u64) -> &mut Harness {
        assert!(ms >= self.now, "tests move time forward");
        self.now = ms;
        self
    }

    pub fn now(&self) -> Millis {
        Millis(self.now)
    }

    pub fn check(&self) {
        if let Err(why) = self.core.check_invariants() {
            panic!("invariant broken at {}: {why}", self.now);
        }
    }

    pub fn connect(&mut self, user: UserId, device: DeviceId, kind: DeviceKind) -> SessionId {
        self.connect_with(user, device, kind, Watch::All, None)
            .session
    }

    pub fn connect_with(
        &mut self,
        user: UserId,
        device: DeviceId,
        kind: DeviceKind,
        watch: Watch,
        resume: Option<SessionId>,
    ) -> Connected {
        let c = Connect {
            user,
            device,
            kind,
            watch,
            resume,
            foreground: true,
        };
        let connected = self.core.handle_connect(self.now(), c).expect("connect");
        self.check();
        connected
    }

    pub fn subscribe(&mut self, s: SessionId, target: UserId, tier: Tier) -> Snapshot {
        let snapshot = self
            .core
            .handle_subscribe(self.now(), s, target, tier)
            .expect("subscribe");
        self.check();
        snapshot
    }

    /// Runs what is due now and drains every output.
    pub fn tick(&mut self) -> Vec<Output> {
        self.core.handle_timeout(self.now());
        self.check();
        self.drain()
    }

    pub fn drain(&mut self) -> Vec<Output> {
        std::iter::from_fn(|| self.core.poll_output()).collect()
    }

    /// Runs the timers up to `ms`, one deadline at a time, collecting outputs.
    pub fn run_until(&mut self, ms: u64) -> Vec<Output> {
        let mut out = self.drain();
        while let Some(due) = self.core.poll_timeout() {
            if due.0 > ms {
                break;
            }
            self.now = self.now.max(due.0);
            out.extend(self.tick());
        }
        self.now = self.now.max(ms);
        out.extend(self.tick());
        out
    }
}

pub fn pushes_to(outputs: &[Output], session: SessionId) -> Vec<(UserId, Tier, Presence)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Push {
                to,
                target,
                tier,
                presence,
            } if *to == session => Some((*target, *tier, presence.clone())),
            _ => None,
        })
        .collect()
}

pub fn ended(outputs: &[Output]) -> Vec<(SessionId, EndReason)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::SessionEnded { session, reason } => Some((*session, *reason)),
            _ => None,
        })
        .collect()
}

/// Bob watches Alice in `tier`; returns Bob's session.
pub fn bob_watches_alice(h: &mut Harness, tier: Tier) -> SessionId {
    let bob = h.connect(BOB, PHONE, DeviceKind::Desktop);
    h.subscribe(bob, ALICE, tier);
    h.drain();
    bob
}
