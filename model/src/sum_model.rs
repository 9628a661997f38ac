//! Model 4 (a group's count across a cluster): the real `GroupSum` at the
//! aggregator, explored exhaustively.
//!
//! Three users, all members: users 0 and 1 in shard 0, user 2 in shard 1.
//! Each shard's owner sends its partial (the slice's users online in truth,
//! an absolute set) tagged with its epoch and its own sequence number,
//! whenever a user of its shard goes online or offline, and again when it
//! is replaced (a failover: a higher epoch, sequence from 1) or when the
//! aggregator is. The bus holds the partials on the way and may deliver any
//! of them, lose one, or deliver one twice. The aggregator may fail over (a
//! fresh sum under a higher epoch floor, waiting for every shard or its
//! deadline), and the backend may write the group once (user 1 leaves).
//! The edges take the aggregator's outputs by version.
//!
//! Properties, with the id in front of each violation:
//! - G1: once the latest partial of every shard has reached the current
//!   aggregator (delivered since it was sent; older ones may still come),
//!   and the aggregator is not waiting, its count is the members online in
//!   truth, and so is the count the edges took last;
//! - G2: the count is at most the members, in the sum and in every output;
//! - G3: every output's version is above the one the edges took before it
//!   (across aggregators too).
//!
//! `SumMutant::PartialsAdd` and `SumMutant::StalePartialWins` are caught by
//! G1 (`model/tests/sums.rs`).

use greendot_core::cluster::{epoch_base, Epoch};
use greendot_core::{GroupSum, Millis, SumOutput};
use stateright::{Model, Property};
use std::collections::BTreeSet;

const SHARDS: usize = 2;
const USERS: [u8; 3] = [0, 1, 2];
/// How long a new aggregator waits for every shard's partial.
const WAIT: u64 = 2;

fn shard_of(user: u8) -> usize {
    usize::from(user == 2)
}

/// How much of the model is explored.
#[derive(Clone, Copy, Debug)]
pub struct SumBounds {
    /// Users going online or offline over the run.
    pub max_flips: u8,
    /// Owner failovers over the run.
    pub max_owner_failovers: u8,
    pub max_aggregator_failovers: u8,
    /// Partials delivered twice, and lost, over the run.
    pub max_repeats: u8,
    pub max_losses: u8,
    /// Partials on the way at once.
    pub max_inflight: usize,
    pub max_time: u64,
}

impl SumBounds {
    /// The bound CI explores.
    pub const CI: SumBounds = SumBounds {
        max_flips: 2,
        max_owner_failovers: 1,
        max_aggregator_failovers: 1,
        max_repeats: 1,
        max_losses: 1,
        max_inflight: 3,
        max_time: 2,
    };
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Partial {
    shard: usize,
    epoch: u64,
    seq: u64,
    online: BTreeSet<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SumAction {
    Flip(u8),
    OwnerFailover(usize),
    Deliver(usize),
    Repeat(usize),
    Lose(usize),
    AggregatorFailover,
    /// User 1 leaves the group.
    Write,
    Tick,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SumState {
    truth: [bool; 3],
    members: BTreeSet<u8>,
    /// Per shard: its owner's epoch and last sequence number.
    owners: [(u64, u64); SHARDS],
    /// Whether each shard's latest partial reached the current aggregator.
    latest_in: [bool; SHARDS],
    inflight: Vec<Partial>,
    sum: GroupSum<u8>,
    aggregator: u32,
    now: u64,
    /// The last version and count the edges took.
    taken: (u64, u32),
    flips: u8,
    owner_failovers: u8,
    aggregator_failovers: u8,
    repeats: u8,
    losses: u8,
    wrote: bool,
    bad: Vec<String>,
}

impl SumState {
    fn members_online(&self) -> u32 {
        USERS
            .iter()
            .filter(|&&u| self.truth[usize::from(u)] && self.members.contains(&u))
            .count() as u32
    }
}

pub struct SumModel {
    pub bounds: SumBounds,
    /// Applied to every sum the model makes (a test switches a mutant on).
    prepare: fn(&mut GroupSum<u8>),
}

impl SumModel {
    pub fn new(bounds: SumBounds) -> SumModel {
        SumModel {
            bounds,
            prepare: |_| {},
        }
    }

    /// Applies `prepare` to every sum (e.g. to switch a mutant on).
    pub fn with_prepare(mut self, prepare: fn(&mut GroupSum<u8>)) -> SumModel {
        self.prepare = prepare;
        self
    }

    fn shards(members: &BTreeSet<u8>) -> BTreeSet<u32> {
        members.iter().map(|&u| shard_of(u) as u32).collect()
    }

    fn fresh_sum(&self, members: &BTreeSet<u8>, aggregator: u32, now: u64) -> GroupSum<u8> {
        let mut sum = GroupSum::new(
            members.clone(),
            Self::shards(members),
            epoch_base(Epoch(aggregator)),
            Millis(now + WAIT),
        );
        (self.prepare)(&mut sum);
        sum
    }

    /// The shard's owner sends its partial: the truth of its slice.
    fn send(s: &mut SumState, shard: usize) {
        let (epoch, seq) = &mut s.owners[shard];
        *seq += 1;
        s.inflight.push(Partial {
            shard,
            epoch: *epoch,
            seq: *seq,
            online: USERS
                .iter()
                .copied()
                .filter(|&u| shard_of(u) == shard && s.truth[usize::from(u)])
                .collect(),
        });
        s.latest_in[shard] = false;
    }

    fn deliver(s: &mut SumState, p: Partial) {
        let latest = s.owners[p.shard] == (p.epoch, p.seq);
        s.sum
            .handle_partial(Millis(s.now), p.shard as u32, p.epoch, p.seq, p.online);
        if latest {
            s.latest_in[p.shard] = true;
        }
    }

    /// The edges take the outputs by version; then the checks.
    fn after(s: &mut SumState) {
        while let Some(out) = s.sum.poll_output() {
            let (version, count) = match out {
                SumOutput::Count { version, count } => (version, count),
                SumOutput::Member { version, count, .. } => (version, count),
            };
            if version <= s.taken.0 {
                s.bad
                    .push(format!("G3: version {version} after {}", s.taken.0));
            }
            if count as usize > s.members.len() {
                s.bad
                    .push(format!("G2: {count} told of {} members", s.members.len()));
            }
            s.taken = (version, count);
        }
        if s.sum.count() as usize > s.members.len() {
            s.bad.push(format!("G2: a count of {}", s.sum.count()));
        }
        if s.latest_in.iter().all(|&x| x) && !s.sum.is_waiting() {
            let want = s.members_online();
            if s.sum.count() != want || s.taken.1 != want {
                s.bad.push(format!(
                    "G1: the sum counts {}, the edges took {}, the truth is {want}",
                    s.sum.count(),
                    s.taken.1
                ));
            }
        }
    }
}

fn has(s: &SumState, id: &str) -> bool {
    s.bad.iter().any(|b| b.starts_with(id))
}

impl Model for SumModel {
    type State = SumState;
    type Action = SumAction;

    fn init_states(&self) -> Vec<SumState> {
        let members: BTreeSet<u8> = USERS.into();
        let mut s = SumState {
            truth: [false; 3],
            sum: self.fresh_sum(&members, 1, 0),
            members,
            owners: [(1, 0); SHARDS],
            latest_in: [false; SHARDS],
            inflight: Vec::new(),
            aggregator: 1,
            now: 0,
            taken: (0, 0),
            flips: 0,
            owner_failovers: 0,
            aggregator_failovers: 0,
            repeats: 0,
            losses: 0,
            wrote: false,
            bad: Vec::new(),
        };
        for shard in 0..SHARDS {
            SumModel::send(&mut s, shard);
        }
        vec![s]
    }

    fn actions(&self, s: &SumState, actions: &mut Vec<SumAction>) {
        if !s.bad.is_empty() {
            return;
        }
        let b = &self.bounds;
        let room = s.inflight.len() < b.max_inflight;
        if s.flips < b.max_flips && room {
            actions.extend(USERS.map(SumAction::Flip));
        }
        if s.owner_failovers < b.max_owner_failovers && room {
            actions.extend((0..SHARDS).map(SumAction::OwnerFailover));
        }
        if s.aggregator_failovers < b.max_aggregator_failovers
            && s.inflight.len() + SHARDS <= b.max_inflight
        {
            actions.push(SumAction::AggregatorFailover);
        }
        for i in 0..s.inflight.len() {
            actions.push(SumAction::Deliver(i));
            if s.repeats < b.max_repeats {
                actions.push(SumAction::Repeat(i));
            }
            // A loss is only of a partial that is not its shard's latest:
            // owners send their latest again until it lands.
            let p = &s.inflight[i];
            if s.losses < b.max_losses && s.owners[p.shard] != (p.epoch, p.seq) {
                actions.push(SumAction::Lose(i));
            }
        }
        if !s.wrote {
            actions.push(SumAction::Write);
        }
        if s.now < b.max_time {
            actions.push(SumAction::Tick);
        }
    }

    fn next_state(&self, s: &SumState, action: SumAction) -> Option<SumState> {
        let mut n = s.clone();
        match action {
            SumAction::Flip(u) => {
                n.flips += 1;
                n.truth[usize::from(u)] = !n.truth[usize::from(u)];
                SumModel::send(&mut n, shard_of(u));
            }
            SumAction::OwnerFailover(shard) => {
                n.owner_failovers += 1;
                n.owners[shard] = (n.owners[shard].0 + 1, 0);
                SumModel::send(&mut n, shard);
            }
            SumAction::Deliver(i) => {
                let p = n.inflight.remove(i);
                SumModel::deliver(&mut n, p);
            }
            SumAction::Repeat(i) => {
                n.repeats += 1;
                let p = n.inflight[i].clone();
                SumModel::deliver(&mut n, p);
            }
            SumAction::Lose(i) => {
                n.losses += 1;
                n.inflight.remove(i);
            }
            SumAction::AggregatorFailover => {
                n.aggregator_failovers += 1;
                n.aggregator += 1;
                n.sum = self.fresh_sum(&n.members, n.aggregator, n.now);
                // Every owner sends to the new aggregator.
                for shard in 0..SHARDS {
                    SumModel::send(&mut n, shard);
                }
            }
            SumAction::Write => {
                n.wrote = true;
                n.members.remove(&1);
                let shards = SumModel::shards(&n.members);
                n.sum
                    .handle_members(Millis(n.now), n.members.clone(), shards);
            }
            SumAction::Tick => {
                n.now += 1;
                n.sum.handle_timeout(Millis(n.now));
            }
        }
        SumModel::after(&mut n);
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::<Self>::always("G1 exact once the latest partials are in", |_, s| {
                !has(s, "G1")
            }),
            Property::<Self>::always("G2 count within members", |_, s| !has(s, "G2")),
            Property::<Self>::always("G3 versions rise", |_, s| !has(s, "G3")),
            Property::<Self>::sometimes("settled with members online", |_, s| {
                s.latest_in.iter().all(|&x| x) && !s.sum.is_waiting() && s.sum.count() >= 2
            }),
            Property::<Self>::sometimes("a second aggregator settled", |_, s| {
                s.aggregator == 2 && s.latest_in.iter().all(|&x| x) && !s.sum.is_waiting()
            }),
        ]
    }
}
