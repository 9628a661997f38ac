//! A longer random run of the simulator:
//! `cargo run --release -p greendot-sim --bin soak -- [--seeds N] [--from S] [--steps N] [--large-clock-jumps] [--mutant NAME]`,
//! or of the multi-node simulation with `--nodes N` (1 to 5) [`--protocol V`
//! (the inter-node protocol version the nodes send)] [`--groups` (a group
//! of every user, 12 users, checked by G1–G4)] [`--buffered` (a cut-off
//! node's messages and requests are held by its NATS client and sent once
//! it is back)].
//! Without `--from` the first seed is drawn from the time of day (printed),
//! so each run explores new seeds; every failure prints its replay line.

use greendot_sim::{run, Faults, Options, ServerMutant};
use std::str::FromStr;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: soak [--seeds N] [--from SEED] [--steps N]
            [--large-clock-jumps] [--mutant PushAfterLogout|LeaseNotRenewedOnTraffic|MigrationAsDisconnect]
       soak --nodes N (1 to 5) [--seeds N] [--from SEED] [--steps N]
            [--protocol V] [--groups] [--buffered]
Without --from the first seed comes from the time of day. Every failure
prints its replay line.";

/// Says what is wrong, with the usage, and exits with 2.
fn refuse(problem: &str) -> ! {
    eprintln!("soak: {problem}\n{USAGE}");
    std::process::exit(2);
}

/// The value after `flag`, parsed.
fn value<T: FromStr>(args: &mut impl Iterator<Item = String>, flag: &str) -> T {
    let Some(text) = args.next() else {
        refuse(&format!("{flag} needs a value"))
    };
    text.parse()
        .unwrap_or_else(|_| refuse(&format!("{flag} {text}: not a valid value")))
}

fn main() {
    let mut seeds = 64u64;
    let mut steps = 20_000u64;
    let mut from = None;
    let mut large = false;
    let mut mutant = None;
    let mut nodes = None;
    let mut protocol = None;
    let mut groups = false;
    let mut buffered = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seeds" => seeds = value(&mut args, "--seeds"),
            "--steps" => steps = value(&mut args, "--steps"),
            "--from" => from = Some(value(&mut args, "--from")),
            "--large-clock-jumps" => large = true,
            "--nodes" => {
                let n: usize = value(&mut args, "--nodes");
                if !(1..=5).contains(&n) {
                    refuse(&format!("--nodes {n}: from 1 to 5"));
                }
                nodes = Some(n);
            }
            "--protocol" => protocol = Some(value(&mut args, "--protocol")),
            "--groups" => groups = true,
            "--buffered" => buffered = true,
            "--mutant" => {
                let name: String = value(&mut args, "--mutant");
                mutant = Some(
                    ServerMutant::ALL
                        .into_iter()
                        .find(|m| format!("{m:?}") == name)
                        .unwrap_or_else(|| refuse(&format!("--mutant {name}: no such mutant"))),
                );
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                return;
            }
            other => refuse(&format!("unknown argument {other}")),
        }
    }
    if nodes.is_none() && (protocol.is_some() || groups || buffered) {
        refuse(
            "--protocol, --groups and --buffered are the multi-node simulation's (with --nodes)",
        );
    }
    if nodes.is_some() && (mutant.is_some() || large) {
        refuse(
            "--nodes runs the multi-node simulation alone (no --mutant, no --large-clock-jumps)",
        );
    }
    let from = from.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    if let Some(nodes) = nodes {
        let protocol = protocol.unwrap_or(greendot_cluster::PROTOCOL_VERSION);
        std::process::exit(soak_cluster(
            from,
            seeds,
            steps,
            (nodes, protocol, groups, buffered),
        ));
    }
    println!(
        "soak: seeds {from}..{} x {steps} steps",
        from.wrapping_add(seeds)
    );
    let started = Instant::now();
    let mut simulated = Duration::ZERO;
    let mut faults = Faults::default();
    let mut failed = 0;
    for seed in from..from.wrapping_add(seeds) {
        let mut options = Options::new(seed, steps);
        options.large_clock_jumps = large;
        options.mutant = mutant;
        match run(options) {
            Ok(report) => {
                simulated += report.simulated;
                faults.add(&report.faults);
            }
            Err(failure) => {
                failed += 1;
                println!("{failure}");
            }
        }
    }
    println!(
        "soak: {seeds} seeds x {steps} steps in {:.1} s: {:.2} simulated hours, {} faults injected ({faults:?}), {failed} failed",
        started.elapsed().as_secs_f64(),
        simulated.as_secs_f64() / 3600.0,
        faults.total(),
    );
    if failed > 0 {
        std::process::exit(1);
    }
}

/// The multi-node simulation's seeds; the process's exit code.
fn soak_cluster(
    from: u64,
    seeds: u64,
    steps: u64,
    (nodes, protocol, groups, buffered): (usize, u8, bool, bool),
) -> i32 {
    use greendot_sim::cluster;
    println!(
        "soak: {nodes} nodes, seeds {from}..{} x {steps} steps",
        from.wrapping_add(seeds)
    );
    let started = Instant::now();
    let mut simulated = Duration::ZERO;
    let mut faults = cluster::Faults::default();
    let mut failed = 0;
    let mut sent_late = 0;
    for seed in from..from.wrapping_add(seeds) {
        let mut options = cluster::Options::new(seed, steps);
        options.nodes = nodes;
        options.protocol = protocol;
        options.buffered = buffered;
        if groups {
            options.groups = true;
            options.users = 12;
        }
        match cluster::run(options) {
            Ok(report) => {
                simulated += report.simulated;
                faults.add(&report.faults);
                sent_late += report.sent_late;
            }
            Err(failure) => {
                failed += 1;
                println!("{failure}");
            }
        }
    }
    println!(
        "soak: {seeds} seeds x {steps} steps on {nodes} nodes in {:.1} s: {:.2} simulated hours, {} faults injected ({faults:?}), {sent_late} messages sent late by cut-off nodes, {failed} failed",
        started.elapsed().as_secs_f64(),
        simulated.as_secs_f64() / 3600.0,
        faults.total(),
    );
    i32::from(failed > 0)
}
