//! A group's sum at its aggregator (`GroupSum`, issue 28 across a cluster),
//! against the truth, under a bus that delays, repeats, reorders and loses
//! partials, owners that fail over (a higher epoch, sequence from 1 again),
//! membership writes and aggregators that fail over (a fresh sum, a higher
//! epoch floor). Checked:
//! - G1: once every shard's owner has sent its latest partial and it
//!   arrived (before any older one still on the way), the count is the
//!   members online in truth, and so is the count of the last output the
//!   edges took;
//! - G2: 0 ≤ count ≤ members, in the sum and in every output;
//! - G3: the versions the edges take (by version, as fed cores do) rise,
//!   across aggregators too; the last output after an input says the
//!   sum's count.
//!
//! `SumMutant::PartialsAdd` and `SumMutant::StalePartialWins` are caught
//! by G1.

use greendot_core::cluster::{epoch_base, Epoch};
use greendot_core::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const SHARDS: u32 = 3;
const USERS: u32 = 9;
const DEADLINE: u64 = 1_000;

fn shard_of(user: u32) -> u32 {
    user % SHARDS
}

#[derive(Clone, Debug)]
enum Op {
    /// A user goes online or offline (in truth); its shard's owner sends.
    Flip(u32),
    /// A shard's owner fails over: the new one sends its partial afresh.
    Failover(u32),
    Deliver(usize),
    Repeat(usize),
    /// Loses a partial in flight (its owner sends again later).
    Lose(usize),
    /// A membership write (bit mask of the users).
    Write(u16),
    /// The aggregator fails over: a fresh sum under a higher epoch.
    NewAggregator,
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..USERS).prop_map(Op::Flip),
        1 => (0..SHARDS).prop_map(Op::Failover),
        5 => (0usize..16).prop_map(Op::Deliver),
        1 => (0usize..16).prop_map(Op::Repeat),
        1 => (0usize..16).prop_map(Op::Lose),
        1 => (0u16..512).prop_map(Op::Write),
        1 => Just(Op::NewAggregator),
        1 => (1u64..600).prop_map(Op::Advance),
    ]
}

#[derive(Clone, Debug)]
struct Partial {
    shard: u32,
    epoch: u64,
    seq: u64,
    online: BTreeSet<u32>,
}

struct Run {
    truth: BTreeSet<u32>,
    members: BTreeSet<u32>,
    /// Per shard: its owner's epoch and last sequence number.
    owners: BTreeMap<u32, (u64, u64)>,
    inflight: Vec<Partial>,
    sum: GroupSum<u32>,
    aggregator_epoch: u32,
    now: u64,
    /// The edges' view: the last version and count taken.
    taken: (u64, u32),
    mutant: Option<SumMutant>,
    outputs: u64,
}

fn shards_of(members: &BTreeSet<u32>) -> BTreeSet<u32> {
    members.iter().map(|&m| shard_of(m)).collect()
}

impl Run {
    fn new(mutant: Option<SumMutant>) -> Run {
        let members: BTreeSet<u32> = (0..USERS).collect();
        let mut run = Run {
            truth: BTreeSet::new(),
            owners: (0..SHARDS).map(|s| (s, (1, 0))).collect(),
            inflight: Vec::new(),
            sum: GroupSum::new(
                members.clone(),
                shards_of(&members),
                epoch_base(Epoch(1)),
                Millis(DEADLINE),
            ),
            members,
            aggregator_epoch: 1,
            now: 0,
            taken: (0, 0),
            mutant,
            outputs: 0,
        };
        run.sum.set_mutant(mutant);
        for s in 0..SHARDS {
            run.send(s);
        }
        run
    }

    /// The shard's owner sends its partial: the truth of its slice.
    fn send(&mut self, shard: u32) {
        let (epoch, seq) = self.owners.get_mut(&shard).unwrap();
        *seq += 1;
        self.inflight.push(Partial {
            shard,
            epoch: *epoch,
            seq: *seq,
            online: self
                .truth
                .iter()
                .copied()
                .filter(|&u| shard_of(u) == shard)
                .collect(),
        });
    }

    fn deliver(&mut self, p: Partial) -> Result<(), String> {
        self.sum
            .handle_partial(Millis(self.now), p.shard, p.epoch, p.seq, p.online);
        self.drain()
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Flip(u) => {
                if !self.truth.remove(&u) {
                    self.truth.insert(u);
                }
                self.send(shard_of(u));
            }
            Op::Failover(s) => {
                let o = self.owners.get_mut(&s).unwrap();
                *o = (o.0 + 1, 0);
                self.send(s);
            }
            Op::Deliver(i) | Op::Repeat(i) | Op::Lose(i) => {
                if self.inflight.is_empty() {
                    return Ok(());
                }
                let i = i % self.inflight.len();
                match op {
                    Op::Deliver(_) => {
                        let p = self.inflight.remove(i);
                        self.deliver(p)?;
                    }
                    Op::Repeat(_) => {
                        let p = self.inflight[i].clone();
                        self.deliver(p)?;
                    }
                    _ => {
                        self.inflight.remove(i);
                    }
                }
            }
            Op::Write(mask) => {
                self.members = (0..USERS).filter(|u| mask & (1 << u) != 0).collect();
                let shards = shards_of(&self.members);
                self.sum
                    .handle_members(Millis(self.now), self.members.clone(), shards);
                self.drain()?;
            }
            Op::NewAggregator => {
                // Owners send to the new one when they see its epoch.
                self.aggregator_epoch += 1;
                self.sum = GroupSum::new(
                    self.members.clone(),
                    shards_of(&self.members),
                    epoch_base(Epoch(self.aggregator_epoch)),
                    Millis(self.now + DEADLINE),
                );
                self.sum.set_mutant(self.mutant);
                for s in 0..SHARDS {
                    self.send(s);
                }
            }
            Op::Advance(ms) => {
                self.now += ms;
                self.sum.handle_timeout(Millis(self.now));
                self.drain()?;
            }
        }
        if self.sum.count() as usize > self.members.len() {
            return Err(format!(
                "G2: a count of {} of {} members",
                self.sum.count(),
                self.members.len()
            ));
        }
        Ok(())
    }

    /// The outputs, as the edges take them: by version.
    fn drain(&mut self) -> Result<(), String> {
        let before = self.outputs;
        while let Some(out) = self.sum.poll_output() {
            self.outputs += 1;
            let (version, count) = match out {
                SumOutput::Count { version, count } => (version, count),
                SumOutput::Member {
                    version,
                    member,
                    count,
                    ..
                } => {
                    if !self.members.contains(&member) {
                        return Err(format!("a change of non-member {member}"));
                    }
                    (version, count)
                }
            };
            if version <= self.taken.0 {
                return Err(format!(
                    "G3: version {version} after {} (aggregator epoch {})",
                    self.taken.0, self.aggregator_epoch
                ));
            }
            if count as usize > self.members.len() {
                return Err(format!(
                    "G2: {count} told of {} members",
                    self.members.len()
                ));
            }
            self.taken = (version, count);
        }
        if self.outputs > before && self.taken.1 != self.sum.count() {
            return Err(format!(
                "the last output says {}, the sum counts {}",
                self.taken.1,
                self.sum.count()
            ));
        }
        Ok(())
    }

    /// Every owner sends its latest partial, which arrives first; then
    /// whatever older partials were still on the way arrive, late.
    fn settle(&mut self) -> Result<(), String> {
        for s in 0..SHARDS {
            self.send(s);
        }
        let latest = self
            .inflight
            .split_off(self.inflight.len() - SHARDS as usize);
        for p in latest.into_iter().chain(std::mem::take(&mut self.inflight)) {
            self.deliver(p)?;
        }
        self.step(&Op::Advance(DEADLINE))?;
        let want = self.truth.intersection(&self.members).count() as u32;
        if self.sum.count() != want {
            return Err(format!(
                "G1: the sum counts {}, the truth {want}",
                self.sum.count()
            ));
        }
        if self.taken.1 != want {
            return Err(format!(
                "G1: the edges took {}, the truth {want}",
                self.taken.1
            ));
        }
        Ok(())
    }
}

fn run(ops: &[Op], mutant: Option<SumMutant>) -> Result<u64, String> {
    let mut run = Run::new(mutant);
    for op in ops {
        run.step(op)?;
    }
    run.settle()?;
    Ok(run.outputs)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_sum_keeps_g1_to_g3(ops in prop::collection::vec(op(), 1..150)) {
        run(&ops, None).map_err(TestCaseError::fail)?;
    }
}

fn sample(cases: u32, mutant: Option<SumMutant>) -> (Option<String>, u64) {
    use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        RunnerConfig {
            cases,
            failure_persistence: None,
            ..RunnerConfig::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let outputs = std::cell::Cell::new(0);
    let result = runner.run(&prop::collection::vec(op(), 1..150), |ops| {
        outputs.set(outputs.get() + run(&ops, mutant).map_err(TestCaseError::fail)?);
        Ok(())
    });
    (result.err().map(|e| e.to_string()), outputs.get())
}

#[test]
fn the_sum_mix_sends_enough_to_mean_something() {
    let (failure, outputs) = sample(64, None);
    assert_eq!(failure, None);
    println!("64 cases: {outputs} outputs");
    assert!(outputs >= 500, "{outputs}");
}

#[test]
fn each_broken_sum_is_caught_by_g1() {
    for mutant in [SumMutant::PartialsAdd, SumMutant::StalePartialWins] {
        let (failure, _) = sample(256, Some(mutant));
        let failure = failure.unwrap_or_else(|| panic!("{mutant:?} went unnoticed"));
        assert!(
            failure.contains("G1"),
            "{mutant:?} caught, but not by G1: {failure}"
        );
    }
}

/// A new aggregator holds its outputs until every shard with members has
/// sent a partial (then one count), or until its deadline.
#[test]
fn a_new_aggregator_waits_for_every_shard_or_its_deadline() {
    let members: BTreeSet<u32> = [0, 1, 2].into();
    let mut sum = GroupSum::new(members.clone(), [0, 1, 2].into(), 1 << 40, Millis(500));
    assert!(sum.handle_partial(Millis(0), 0, 1, 1, [0].into()));
    assert!(sum.handle_partial(Millis(0), 1, 1, 1, [].into()));
    assert_eq!(sum.poll_output(), None, "shard 2 has not sent");
    assert_eq!(sum.poll_timeout(), Some(Millis(500)));
    assert!(sum.handle_partial(Millis(10), 2, 1, 1, [2].into()));
    let step = FED_VERSION_STEP;
    assert_eq!(
        sum.poll_output(),
        Some(SumOutput::Count {
            version: (1 << 40) + step,
            count: 2
        })
    );
    // A late partial of an older sequence is refused; a newer one replaces.
    assert!(!sum.handle_partial(Millis(20), 0, 1, 1, [].into()));
    assert!(sum.handle_partial(Millis(20), 0, 1, 2, [].into()));
    assert_eq!(
        sum.poll_output(),
        Some(SumOutput::Member {
            version: (1 << 40) + 2 * step,
            member: 0,
            online: false,
            count: 1
        })
    );
    // Only the deadline ends the wait of a sum whose shard never sends.
    let mut sum = GroupSum::new(members, [0, 1].into(), 0, Millis(500));
    sum.handle_partial(Millis(0), 0, 1, 1, [0].into());
    sum.handle_timeout(Millis(499));
    assert!(sum.is_waiting());
    sum.handle_timeout(Millis(500));
    assert_eq!(
        sum.poll_output(),
        Some(SumOutput::Count {
            version: step,
            count: 1
        })
    );
}

/// The aggregator's pages list the members online by the latest partials
/// first, then the others, each section by key, every member exactly once
/// across the pages, and a cursor stays valid when a member joins before
/// it.
#[test]
fn the_sums_pages_list_online_members_first_and_each_member_once() {
    let members: BTreeSet<u32> = (0..10).collect();
    let mut sum = GroupSum::new(members, [0, 1].into(), 0, Millis(500));
    assert!(sum.handle_partial(Millis(0), 0, 1, 1, [2, 7].into()));
    assert!(sum.handle_partial(Millis(0), 1, 1, 1, [5].into()));
    let mut listed = Vec::new();
    let mut from = None;
    loop {
        let (keys, next) = sum.page(from, 3);
        assert!(!keys.is_empty() && keys.len() <= 3, "{keys:?}");
        listed.extend(keys);
        match next {
            Some(c) => from = Some(c),
            None => break,
        }
    }
    let online = [(2, true), (5, true), (7, true)];
    let offline = [0, 1, 3, 4, 6, 8, 9].map(|m| (m, false));
    let expected: Vec<(u32, bool)> = online.into_iter().chain(offline).collect();
    assert_eq!(listed, expected);
    // The cursor after 3 (offline) goes on at 4, whoever joined below it.
    let members: BTreeSet<u32> = (0..12).collect();
    sum.handle_members(Millis(1), members, [0, 1].into());
    assert_eq!(
        sum.page(Some((false, 3)), 2),
        (vec![(4, false), (6, false)], Some((false, 6)))
    );
    // A limit of 0 lists one.
    assert_eq!(sum.page(None, 0).0, vec![(2, true)]);
}
