//! `greendot-model`: run the models with bigger bounds, or browse them.
//!
//! ```text
//! greendot-model check [--model core|protocol|both] [--users N] [--devices M]
//!                      [--depth D] [--time T] [--sessions S] [--toggles K]
//!                      [--versions V] [--watcher-versions W] [--clients C]
//!                      [--drops K] [--flips F] [--lossy|--lossless]
//!                      [--threads N] [--mutant NAME (needs --features mutants)]
//! greendot-model explore [--model core|protocol] [--addr 127.0.0.1:3000] [bounds as above]
//! ```

use greendot_core::Core;
use greendot_model::core_model::{describe_path, Bounds, CoreModel};
use greendot_model::protocol::{protocol_config, protocol_model_with, ProtocolBounds};
use stateright::{Checker, Model};
use std::process::ExitCode;
use std::time::{Duration, Instant};

struct Args {
    command: String,
    model: String,
    bounds: Bounds,
    protocol: ProtocolBounds,
    depth: Option<usize>,
    threads: usize,
    addr: String,
    mutant: Option<String>,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: greendot-model check|explore [--model core|protocol|both] [--users N] [--devices M] \
         [--depth D] [--time T] [--sessions S] [--versions V] [--clients C] [--drops K] \
         [--flips F] [--lossy|--lossless] [--threads N] [--addr HOST:PORT] [--mutant NAME]"
    );
    ExitCode::from(2)
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("missing command")?;
    let mut a = Args {
        command,
        model: "both".into(),
        bounds: Bounds::CI,
        protocol: ProtocolBounds::CI,
        depth: None,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        addr: "127.0.0.1:3000".into(),
        mutant: None,
    };
    while let Some(flag) = it.next() {
        if flag == "--lossless" || flag == "--lossy" {
            a.protocol.lossy = flag == "--lossy";
            continue;
        }
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--model" => a.model = value()?,
            "--users" => a.bounds.users = num(value()?)? as usize,
            "--devices" => a.bounds.devices = num(value()?)? as usize,
            "--depth" => a.depth = Some(num(value()?)? as usize),
            "--time" => {
                let t = num(value()?)?;
                a.bounds.max_time = t;
                a.protocol.max_time = t;
            }
            "--sessions" => a.bounds.max_sessions = num(value()?)? as u8,
            "--versions" => a.bounds.max_version = num(value()?)?,
            "--watcher-versions" => a.bounds.max_watcher_version = num(value()?)?,
            "--toggles" => a.bounds.max_toggles = num(value()?)? as u8,
            "--clients" => a.protocol.clients = num(value()?)? as usize,
            "--drops" => a.protocol.drops = num(value()?)? as u8,
            "--flips" => a.protocol.flips = num(value()?)? as u8,
            "--threads" => a.threads = num(value()?)? as usize,
            "--addr" => a.addr = value()?,
            "--mutant" => a.mutant = Some(value()?),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

#[cfg(feature = "mutants")]
fn make_core(config: greendot_core::Config, mutant: &Option<String>) -> Result<Core, String> {
    use greendot_core::mutants::Mutant;
    let mut core = Core::new(config).map_err(|e| e.to_string())?;
    if let Some(name) = mutant {
        let m = Mutant::ALL
            .into_iter()
            .find(|m| format!("{m:?}").eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("unknown mutant {name}; one of {:?}", Mutant::ALL))?;
        core.set_mutant(Some(m));
    }
    Ok(core)
}

#[cfg(not(feature = "mutants"))]
fn make_core(config: greendot_core::Config, mutant: &Option<String>) -> Result<Core, String> {
    if mutant.is_some() {
        return Err("--mutant needs a build with `--features mutants`".into());
    }
    Core::new(config).map_err(|e| e.to_string())
}

/// Runs a BFS, printing progress, then each property's result.
fn run<M>(
    name: &str,
    model: M,
    a: &Args,
    describe: impl Fn(&M, &stateright::Path<M::State, M::Action>) -> Vec<String>,
) -> bool
where
    M: Model + Send + Sync + 'static,
    M::State: std::fmt::Debug + std::hash::Hash + Send + Sync + Clone + PartialEq + 'static,
    M::Action: std::fmt::Debug + Clone + PartialEq + Send + Sync,
{
    println!("== {name}");
    let properties = model.properties();
    let mut builder = model.checker().threads(a.threads.max(1));
    if let Some(d) = a.depth {
        builder = builder.target_max_depth(d);
    }
    let start = Instant::now();
    let checker = builder.spawn_bfs();
    let mut last = Instant::now();
    while !checker.is_done() {
        std::thread::sleep(Duration::from_millis(100));
        if last.elapsed() >= Duration::from_secs(5) {
            last = Instant::now();
            let secs = start.elapsed().as_secs_f64();
            println!(
                "  {:>8.1}s  {:>11} unique states  {:>10.0} states/s  depth {}",
                secs,
                checker.unique_state_count(),
                checker.unique_state_count() as f64 / secs,
                checker.max_depth()
            );
        }
    }
    let checker = checker.join();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "  done in {secs:.1}s: {} unique states ({} generated), max depth {}, {:.0} states/s",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        checker.unique_state_count() as f64 / secs.max(1e-9)
    );
    let mut ok = true;
    for p in &properties {
        let found = checker.discovery(p.name);
        let failure = p.expectation.discovery_is_failure();
        let verdict = match (&found, failure) {
            (None, true) => "holds",
            (Some(_), true) => "VIOLATED",
            (Some(_), false) => "reached",
            (None, false) => "NEVER REACHED",
        };
        println!("  {:<42} {verdict}", p.name);
        if found.is_some() == failure {
            ok = false;
        }
        if let (Some(path), true) = (found, failure) {
            println!("    counterexample:");
            for line in describe(checker.model(), &path) {
                println!("      {line}");
            }
        }
    }
    ok
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return usage();
        }
    };
    let core_model = || -> Result<CoreModel, String> {
        let model = CoreModel::new(a.bounds);
        let core = make_core(model.init.config().clone(), &a.mutant)?;
        Ok(model.with_core(core))
    };
    let protocol = || -> Result<_, String> {
        Ok(protocol_model_with(
            a.protocol,
            make_core(protocol_config(), &a.mutant)?,
        ))
    };
    match a.command.as_str() {
        "check" => {
            let mut ok = true;
            if a.model == "core" || a.model == "both" {
                let model = match core_model() {
                    Ok(m) => m,
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::from(2);
                    }
                };
                let name = format!("Model 1 (core): {:?}", a.bounds);
                ok &= run(&name, model, &a, |m, path| {
                    describe_path(m, &path.clone().into_vec())
                });
            }
            if a.model == "protocol" || a.model == "both" {
                let model = match protocol() {
                    Ok(m) => m,
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::from(2);
                    }
                };
                let name = format!("Model 2 (protocol): {:?}", a.protocol);
                ok &= run(&name, model, &a, |m, path| {
                    path.clone()
                        .into_vec()
                        .into_iter()
                        .filter_map(|(_, action)| action.map(|act| m.format_action(&act)))
                        .collect()
                });
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        "explore" => {
            println!("Explorer on http://{}", a.addr);
            let result = if a.model == "protocol" {
                protocol().map(|m| {
                    m.checker().threads(a.threads).serve(a.addr.as_str());
                })
            } else {
                core_model().map(|m| {
                    m.checker().threads(a.threads).serve(a.addr.as_str());
                })
            };
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::from(2)
                }
            }
        }
        _ => usage(),
    }
}
