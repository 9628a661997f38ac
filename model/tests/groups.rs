//! Model 1 (groups): exhaustive BFS of the core with one group at
//! `GroupBounds::CI`, and with watched pages at `GroupBounds::WATCH`, each
//! with a pinned state count, and every `GroupMutant` caught by the
//! invariant it breaks. Apart from `models.rs`, whose pinned
//! counts this leaves alone.

use greendot_core::mutants::GroupMutant;
use greendot_model::group_model::{GroupBounds, GroupModel, GroupState};
use stateright::{Checker, HasDiscoveries, Model};
use std::collections::BTreeSet;
use std::time::Instant;

/// Unique states at `GroupBounds::CI`, as a lower bound (see `models.rs`):
/// 337,479 in about 4 s and 0.5 GB on one thread.
const GROUP_STATES: usize = 337_479;

fn threads() -> usize {
    std::env::var("GREENDOT_MODEL_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
        .max(1)
}

fn describe(path: &[(GroupState, Option<greendot_model::group_model::GroupAction>)]) {
    for (state, action) in path {
        match action {
            Some(a) => println!("  t={} {a:?}", state.core.now().0),
            None => state.bad.iter().for_each(|b| println!("    => {b}")),
        }
    }
}

/// Explores `bounds` whole: no `always` property fails, every `sometimes`
/// one is reached, and at least `pinned` unique states are seen.
fn check_bound(name: &str, bounds: GroupBounds, pinned: usize) {
    let start = Instant::now();
    let checker = GroupModel::new(bounds)
        .checker()
        .threads(threads())
        .spawn_bfs()
        .join();
    let states = checker.unique_state_count();
    println!(
        "{name}: {states} unique states ({} generated) in {:.1?}",
        checker.state_count(),
        start.elapsed()
    );
    for p in checker.model().properties() {
        let found = checker.discovery(p.name);
        if p.expectation.discovery_is_failure() {
            if let Some(path) = found {
                describe(&path.into_vec());
                panic!("{} violated", p.name);
            }
        } else {
            assert!(found.is_some(), "never: {}", p.name);
        }
    }
    assert!(states >= pinned, "{states} states, fewer than pinned");
}

#[test]
fn model1_groups_g1_g4_hold_at_ci_bounds() {
    check_bound("Model 1 (groups)", GroupBounds::CI, GROUP_STATES);
}

/// Unique states at `GroupBounds::WATCH`, as a lower bound: 501,686 in
/// about 12 s on one thread.
const WATCH_STATES: usize = 501_686;

#[test]
fn model1_groups_g5_holds_for_watched_pages() {
    check_bound(
        "Model 1 (groups, watched pages)",
        GroupBounds::WATCH,
        WATCH_STATES,
    );
}

#[test]
fn model1_groups_catches_every_group_mutant() {
    for (m, want) in [
        (
            GroupMutant::CountMissesOffline,
            "G2 count of published views",
        ),
        (GroupMutant::MembershipNotFlushed, "G1 exact at quiescence"),
        (GroupMutant::VersionNotBumped, "G3 versions rise"),
        (
            GroupMutant::AdminKeptAfterDemotion,
            "G4 deltas to live admins",
        ),
        (GroupMutant::SubsKeptAfterEnd, "G4 deltas to live admins"),
        (
            GroupMutant::WatchOutlivesExpiry,
            "G5 page deltas to live watches",
        ),
    ] {
        // Only the watched pages' bounds drive watches.
        let bounds = match m {
            GroupMutant::WatchOutlivesExpiry => GroupBounds::WATCH,
            _ => GroupBounds::CI,
        };
        let model = GroupModel::new(bounds);
        let mut core = model.init.clone();
        core.set_group_mutant(Some(m));
        let checker = model
            .with_core(core)
            .checker()
            .threads(threads())
            .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([want])))
            .spawn_bfs()
            .join();
        let path = checker
            .discovery(want)
            .unwrap_or_else(|| panic!("{m:?} not caught by {want}"));
        println!("{m:?} caught by {want:?}:");
        describe(&path.into_vec());
    }
}
