//! Model 4 (a group's count across a cluster): the real `GroupSum`
//! explored whole at `SumBounds::CI`, with a pinned state count, and both
//! broken sums caught by G1.

use greendot_core::SumMutant;
use greendot_model::sum_model::{SumBounds, SumModel};
use stateright::{Checker, HasDiscoveries, Model};
use std::collections::BTreeSet;
use std::time::Instant;

/// Unique states at `SumBounds::CI`, as a lower bound: 912,138 in about
/// 4 s on one thread.
const SUM_STATES: usize = 912_138;

#[test]
fn model4_sums_hold_g1_to_g3() {
    let start = Instant::now();
    let checker = SumModel::new(SumBounds::CI).checker().spawn_bfs().join();
    let states = checker.unique_state_count();
    println!(
        "Model 4 (sums): {states} unique states ({} generated) in {:.1?}",
        checker.state_count(),
        start.elapsed()
    );
    for p in checker.model().properties() {
        let found = checker.discovery(p.name);
        if p.expectation.discovery_is_failure() {
            if let Some(path) = found {
                let last = path.last_state();
                panic!("{} violated: {:?}", p.name, last);
            }
        } else {
            assert!(found.is_some(), "never: {}", p.name);
        }
    }
    assert!(states >= SUM_STATES, "{states} states, fewer than pinned");
}

#[test]
fn model4_catches_both_broken_sums() {
    type Prepare = fn(&mut greendot_core::GroupSum<u8>);
    let mutants: [(SumMutant, Prepare); 2] = [
        (SumMutant::PartialsAdd, |s| {
            s.set_mutant(Some(SumMutant::PartialsAdd))
        }),
        (SumMutant::StalePartialWins, |s| {
            s.set_mutant(Some(SumMutant::StalePartialWins))
        }),
    ];
    for (mutant, prepare) in mutants {
        let want = "G1 exact once the latest partials are in";
        let checker = SumModel::new(SumBounds::CI)
            .with_prepare(prepare)
            .checker()
            .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([want])))
            .spawn_bfs()
            .join();
        let path = checker
            .discovery(want)
            .unwrap_or_else(|| panic!("{mutant:?} went unnoticed"));
        println!(
            "{mutant:?} caught by G1 in {} steps",
            path.into_actions().len()
        );
    }
}
