//! The multi-node simulation: 1 to 5 real `ServerState`s in cluster mode
//! (each with its real `ClusterLink`), a simulated NATS bus and KV
//! ([`bus`]), the nodes' leases and claims ([`duty`]), and WebSocket
//! devices ([`device`]) that connect, subscribe, change status, go
//! invisible, log out and move between nodes, all on virtual time from one
//! seed. Faults: `kill -9` and restart, a process paused past its lease,
//! a node cut off from the bus, whole-bus outages, lost, duplicated and
//! delayed messages, a slow KV, and clocks skewed between nodes. What is
//! checked after every step is in [`checks`] (and, with groups, in
//! [`groups`]).

mod bus;
mod checks;
mod device;
mod duty;
mod groups;
mod world;

pub use greendot_core::mutants::GroupMutant;
pub use greendot_server::cluster::LinkMutant;
pub use world::run;

use std::time::Duration;

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    pub steps: u64,
    /// Nodes, 1 to 5.
    pub nodes: usize,
    pub users: usize,
    /// A deliberately broken cluster link.
    pub mutant: Option<LinkMutant>,
    /// Deliberately broken group presence in every node's hub core (with
    /// `groups`).
    pub group_mutant: Option<GroupMutant>,
    /// The inter-node protocol version the nodes send: the previous one
    /// shows what the current one fixed.
    pub protocol: u8,
    pub faults: bool,
    /// One group of every user, which every device subscribes to, checked
    /// by G1–G4 (`groups`). Off, the runs are what they were before groups
    /// (the regression seeds keep their traces).
    pub groups: bool,
    /// A cut-off node's messages and requests are held by its NATS client
    /// and sent once it is linked again (`bus::Bus::buffered`). Off, they
    /// are lost, and the regression seeds keep their traces.
    pub buffered: bool,
    /// A fuzzer's input: the run's first random choices are read from it.
    pub script: Option<std::sync::Arc<[u8]>>,
}

impl Options {
    pub fn new(seed: u64, steps: u64) -> Options {
        Options {
            seed,
            steps,
            nodes: 3,
            users: 6,
            mutant: None,
            group_mutant: None,
            protocol: greendot_cluster::PROTOCOL_VERSION,
            faults: true,
            groups: false,
            buffered: false,
            script: None,
        }
    }

    /// The one-line command that replays this run.
    pub fn replay_line(&self) -> String {
        if self.script.is_some() {
            return "a fuzz input: RUSTC_BOOTSTRAP=1 cargo fuzz run cluster_sim <its artifact> (in fuzz/)"
                .into();
        }
        let mut line = format!(
            "GREENDOT_SIM_SEED={} GREENDOT_SIM_STEPS={} GREENDOT_SIM_NODES={}",
            self.seed, self.steps, self.nodes
        );
        if let Some(m) = self.mutant {
            line.push_str(&format!(" GREENDOT_SIM_MUTANT={m:?}"));
        }
        if let Some(m) = self.group_mutant {
            line.push_str(&format!(" GREENDOT_SIM_GROUP_MUTANT={m:?}"));
        }
        if !self.faults {
            line.push_str(" GREENDOT_SIM_FAULTS=0");
        }
        if self.groups {
            line.push_str(" GREENDOT_SIM_GROUPS=1");
        }
        if self.buffered {
            line.push_str(" GREENDOT_SIM_BUFFERED=1");
        }
        if self.users != 6 {
            line.push_str(&format!(" GREENDOT_SIM_USERS={}", self.users));
        }
        if self.protocol != greendot_cluster::PROTOCOL_VERSION {
            line.push_str(&format!(" GREENDOT_SIM_PROTOCOL={}", self.protocol));
        }
        line.push_str(" cargo test --release -p greendot-sim --test cluster replay -- --nocapture");
        line
    }
}

/// Faults injected, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    pub kills: u64,
    pub pauses: u64,
    /// Pauses past the lease's TTL.
    pub long_pauses: u64,
    pub cut_offs: u64,
    pub outages: u64,
    pub lossy: u64,
    pub slow_kv: u64,
    pub moves: u64,
}

impl Faults {
    pub fn total(&self) -> u64 {
        self.kills + self.pauses + self.cut_offs + self.outages + self.lossy + self.slow_kv
    }

    pub fn add(&mut self, o: &Faults) {
        self.kills += o.kills;
        self.pauses += o.pauses;
        self.long_pauses += o.long_pauses;
        self.cut_offs += o.cut_offs;
        self.outages += o.outages;
        self.lossy += o.lossy;
        self.slow_kv += o.slow_kv;
        self.moves += o.moves;
    }
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct Report {
    pub seed: u64,
    pub steps: u64,
    pub simulated: Duration,
    pub faults: Faults,
    /// A hash of everything observable that happened, in order.
    pub trace: u64,
    pub bus_messages: u64,
    /// Messages and requests held by a cut-off node's client and sent when
    /// it was back (with `buffered`).
    pub sent_late: u64,
    pub welcomes: u64,
    pub views: u64,
    /// Views older than one the device was shown on an earlier connection
    /// (dropped, as clients do).
    pub stale_dropped: u64,
    /// Shard claims taken (epochs started).
    pub claims: u64,
    /// Steps at which G1 judged a group subscriber's count (at quiescence).
    pub group_judged: u64,
    /// Group subscribes answered `Unsupported` (nodes sending protocol 3).
    pub groups_refused: u64,
}

/// A run that broke a check (or panicked).
pub type Failure = crate::world::Failure<Options>;

impl crate::world::Replay for Options {
    fn seed(&self) -> u64 {
        self.seed
    }

    fn replay_line(&self) -> String {
        Options::replay_line(self)
    }
}
