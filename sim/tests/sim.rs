//! The simulator's fixed seeds, its determinism, the server mutants it must
//! catch, and the replay of one seed from the environment.

use greendot_sim::{run, Options, ServerMutant};

/// Seeds × steps run by `cargo test` (CI).
const SEEDS: u64 = 32;
const STEPS: u64 = 20_000;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Replays the run named by `GREENDOT_SIM_SEED` (and `GREENDOT_SIM_STEPS`,
/// `GREENDOT_SIM_MUTANT`, `GREENDOT_SIM_CLOCK_JUMPS=large`,
/// `GREENDOT_SIM_FAULTS=0`), as printed by a failing run. Without the
/// variable it replays seed 0.
#[test]
fn replay() {
    let seed = env("GREENDOT_SIM_SEED").map_or(0, |s| s.parse().expect("GREENDOT_SIM_SEED"));
    let steps = env("GREENDOT_SIM_STEPS").map_or(STEPS, |s| s.parse().expect("GREENDOT_SIM_STEPS"));
    let mut options = Options::new(seed, steps);
    options.mutant = env("GREENDOT_SIM_MUTANT").map(|name| {
        ServerMutant::ALL
            .into_iter()
            .find(|m| format!("{m:?}") == name)
            .expect("GREENDOT_SIM_MUTANT names a ServerMutant")
    });
    options.large_clock_jumps = env("GREENDOT_SIM_CLOCK_JUMPS").as_deref() == Some("large");
    options.faults = env("GREENDOT_SIM_FAULTS").as_deref() != Some("0");
    match run(options) {
        Ok(report) => println!("{report:?}"),
        Err(failure) => panic!("{failure}"),
    }
}

#[test]
fn same_seed_same_trace() {
    for seed in [1, 2, 3] {
        let a = run(Options::new(seed, 4_000))
            .map_err(|f| f.to_string())
            .unwrap();
        let b = run(Options::new(seed, 4_000))
            .map_err(|f| f.to_string())
            .unwrap();
        assert_eq!(a.trace, b.trace, "seed {seed} ran two ways");
        assert_eq!(a.simulated, b.simulated);
    }
    let other = run(Options::new(4, 4_000))
        .map_err(|f| f.to_string())
        .unwrap();
    let first = run(Options::new(1, 4_000))
        .map_err(|f| f.to_string())
        .unwrap();
    assert_ne!(
        other.trace, first.trace,
        "the trace does not depend on the seed"
    );
}
