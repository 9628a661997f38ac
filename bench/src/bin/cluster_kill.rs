//! `kill -9` (or SIGSTOP) of a cluster node under load: a 3-node NATS
//! cluster, three `greendot serve --cluster` nodes a, b, c (the release
//! binary next to this one), and `--n` devices (one user each, web: the
//! smallest grace) spread over them in thirds (the first third on a).
//! Watchers on b and c (realtime) watch the first `--watched` users: all of
//! them on a. Then a is `kill -9`ed; its devices notice when their
//! connection times out (the nodes' idle timeout) and reconnect to b or c,
//! as a client given the cluster's addresses would.
//!
//! `cargo build --release -p greendot-transport --bin greendot && cargo
//! build --release -p greendot-bench --bin cluster_kill &&
//! target/release/cluster_kill` (`--n 10000 --watched 1000 --watchers 2
//! --ttl-s 10 --grace-s 30 --idle-s 5 --keep-alive-s 1 --debounce-ms 300
//! --shards 64 --concurrency 32`).
//!
//! `--defaults`: the nodes get no grace, idle timeout, keep-alive or
//! debounce flags (and a 15 s TTL unless `--ttl-s`): what `greendot serve
//! --cluster` picks by itself, read back with `--print-config` and printed.
//! `--pause`: SIGSTOP instead of `kill -9` (a node frozen past its lease:
//! its sockets stay open, it answers nothing); after the watch window a is
//! sent SIGCONT and watched 5 s more (it finds its lease gone and drains;
//! nothing it says then may show anybody offline).
//!
//! Printed: per device of a, the time from the kill to its welcome on
//! another node (p50, p99, max: when the last one was back); the users any
//! watcher was shown offline from the kill until the bound after which an
//! owner could show any (goal 0); and the ghost check: every device then
//! logs out, and every watched user must be shown offline at once (a user
//! still online after TTL + grace + debounce would be a ghost of the dead
//! node's sessions).

use greendot_bench::cluster::{bench_dir, client_config, placed, serve, Join, Node, SECRET};
use greendot_bench::{arg, flag, quantile, raise_nofile};
use greendot_client::{Client, Event};
use greendot_cluster::testing::NatsCluster;
use greendot_core::Tier;
use greendot_loadgen::{Herd, HerdOptions};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a checker client is shown of each user, kept current.
type Shown = Arc<Mutex<HashMap<String, bool>>>;

fn online_of(shown: &Shown) -> usize {
    shown.lock().unwrap().values().filter(|o| **o).count()
}

/// A client on `at` watching `users` (realtime); returns it and what it is
/// shown, updated as pushes arrive.
async fn checker(roots: &[&Node], at: &Node, users: &[String]) -> (Client, Shown) {
    let config = client_config(roots, at, "checker", "laptop");
    let (client, mut updates) = Client::connect(config).await.expect("checker connects");
    let shown: Shown = Arc::default();
    for chunk in users.chunks(1000) {
        // Not answered (seen when the nodes were cut off): the ghost check
        // then reports nobody shown, and says so.
        let answer = match client.subscribe(chunk, Tier::Realtime).await {
            Ok(answer) => answer,
            Err(e) => {
                eprintln!("  the checker cannot subscribe: {e}");
                continue;
            }
        };
        let mut map = shown.lock().unwrap();
        for (user, _, presence) in answer.snapshots {
            map.insert(user, presence.online);
        }
    }
    let map = shown.clone();
    tokio::spawn(async move {
        while let Some(event) = updates.next().await {
            if let Event::Presence {
                target, presence, ..
            } = event
            {
                map.lock().unwrap().insert(target, presence.online);
            }
        }
    });
    (client, shown)
}

/// A duration as `greendot serve --print-config` writes it (`300ms`, `3s`,
/// `1m`, `1500ms`).
fn parse_dur(text: &str) -> Option<Duration> {
    let text = text.trim().trim_matches('"');
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let n: u64 = text[..split].parse().ok()?;
    let ms = match &text[split..] {
        "ms" => n,
        "s" => n * 1000,
        "m" => n * 60_000,
        "h" => n * 3_600_000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The timings a node started with `args` runs with: grace of web devices,
/// idle timeout, keep-alive, debounce (`greendot serve --print-config`).
fn effective(args: &[String]) -> (Duration, Duration, Duration, Duration) {
    let out = std::process::Command::new(greendot_bench::cluster::greendot())
        .args(["serve", "--print-config"])
        .args(args)
        .output()
        .expect("greendot serve --print-config");
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut section, mut found) = (String::new(), HashMap::new());
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('[') {
            section = name.trim_end_matches(']').to_owned();
        } else if let Some((key, value)) = line.split_once(" = ") {
            if let Some(d) = parse_dur(value) {
                found.insert(format!("{section}.{key}"), d);
            }
        }
    }
    let get = |key: &str| *found.get(key).unwrap_or_else(|| panic!("{key} in {text}"));
    (
        get("grace.web"),
        get(".idle_timeout"),
        get(".keep_alive"),
        get(".debounce"),
    )
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {signal} {pid}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let nofile = raise_nofile();
    let n: usize = arg("--n", 10_000);
    let watched: usize = arg("--watched", 1000);
    let watchers: usize = arg("--watchers", 2);
    let shards: u32 = arg("--shards", 64);
    let defaults = flag("--defaults");
    let pause = flag("--pause");
    let ttl = Duration::from_secs(arg("--ttl-s", if defaults { 15 } else { 10 }));
    // Handshakes in flight while ramping up: each new user costs its owner
    // two KV reads, and at 256 at once the NATS servers fell behind far
    // enough here that a node missed its lease renewals and was cut off.
    let concurrency: usize = arg("--concurrency", 32);
    assert!(watched <= n / 3, "the watched users must all be on a");

    let dir = bench_dir("cluster-kill");
    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let join = Join {
        urls: &urls,
        shards,
        ttl,
    };
    let extra: Vec<String> = if defaults {
        Vec::new()
    } else {
        [
            ("--grace", format!("{}s", arg("--grace-s", 30u64))),
            ("--idle-timeout", format!("{}s", arg("--idle-s", 5u64))),
            ("--keep-alive", format!("{}s", arg("--keep-alive-s", 1u64))),
            ("--debounce", format!("{}ms", arg("--debounce-ms", 300u64))),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect()
    };
    let node_args: Vec<String> = [
        "--cluster",
        urls.as_str(),
        "--node-id",
        "a",
        "--cluster-lease-ttl",
        &format!("{}s", ttl.as_secs()),
    ]
    .iter()
    .map(|a| a.to_string())
    .chain(extra.iter().cloned())
    .collect();
    let (grace, idle, keep_alive, debounce) = effective(&node_args);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut a = serve(&dir, Some(join), "a", &extra);
    let b = serve(&dir, Some(join), "b", &extra);
    let c = serve(&dir, Some(join), "c", &extra);
    placed(&urls, 3, shards);
    let a_pid = a.child.id();
    let roots = vec![a.cert.clone(), b.cert.clone(), c.cert.clone()];
    eprintln!("open-file limit {nofile}; a pid {a_pid}");

    let mut opts = HerdOptions::new(a.addr, roots, SECRET, n);
    opts.servers = vec![a.addr, b.addr, c.addr];
    opts.watcher_servers = vec![b.addr, c.addr];
    opts.watchers = watchers;
    opts.watched = watched;
    opts.watch_tier = greendot_proto::Tier::Realtime;
    opts.user_prefix = "u".into();
    opts.connect_concurrency = concurrency;
    let started = Instant::now();
    let herd = Herd::start(opts, Duration::from_secs(600))
        .await
        .expect("the herd connects");
    let ramp = started.elapsed();
    eprintln!("  {n} devices and {watchers} watchers up in {ramp:.1?}");
    // Arrivals published and shown; every watched user online at a watcher.
    let settle = Instant::now();
    while herd.shown_online() < watched && settle.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let online_before = herd.shown_online();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let on_a = n.div_ceil(3);
    eprintln!(
        "  watchers show {online_before} of {watched} watched users online; {on_a} devices on a"
    );

    herd.watch_for_offline();
    herd.mark();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let t0 = Instant::now();
    if pause {
        signal(a_pid, "-STOP");
    } else {
        a.kill9();
    }
    let all_back = herd.wait_back(on_a, t0, Duration::from_secs(300)).await;
    let back = herd.back_times(t0);
    // An owner could show one of a's users offline at the latest after the
    // lease expires (TTL), the new owner's resync window (the claim TTL)
    // and grace pass, then the debounce: watch until then, and a little.
    let watch_until = (ttl + ttl.max(grace) + debounce + Duration::from_secs(3))
        .max(t0.elapsed() + debounce + Duration::from_secs(3));
    let left = watch_until.saturating_sub(t0.elapsed());
    eprintln!(
        "  {} of a's devices back; watching for offlines {left:.1?} more",
        back.len()
    );
    tokio::time::sleep(left).await;
    // A frozen node woken up: it finds its lease gone and drains; whatever
    // it still says must not show anybody offline.
    let woken = if pause {
        signal(a_pid, "-CONT");
        tokio::time::sleep(Duration::from_secs(5) + debounce).await;
        Some(match a.child.try_wait() {
            Ok(Some(status)) => format!("exited ({status})"),
            _ => "still running".to_owned(),
        })
    } else {
        None
    };
    let offline = herd.offline_seen();
    let online_after = herd.shown_online();

    // Ghosts: every device logs out; all watched users must go offline.
    let users: Vec<String> = (0..watched).map(|i| format!("u{i}")).collect();
    let (check, shown) = checker(&[&b, &c], &b, &users).await;
    let online_at_check = online_of(&shown);
    let checked = shown.lock().unwrap().len();
    let stop = Instant::now();
    herd.stop().await;
    let stopped = stop.elapsed();
    let bound = ttl + grace + debounce;
    let mut ghosts = online_of(&shown);
    let mut all_offline_after = None;
    while stop.elapsed() < bound + Duration::from_secs(2) {
        if ghosts == 0 {
            all_offline_after = Some(stop.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        ghosts = online_of(&shown);
    }
    drop(check);
    let (b_lost, c_lost) = (
        b.metric("greendot_cluster_edge_lost_devices_total"),
        c.metric("greendot_cluster_edge_lost_devices_total"),
    );
    drop((a, b, c));
    drop(nats);
    let _ = std::fs::remove_dir_all(&dir);

    let mut times: Vec<Duration> = back.iter().map(|(_, d)| *d).collect();
    times.sort();
    let q = |x| quantile(&times, x).map(|d| format!("{:.2}", d.as_secs_f64()));
    println!(
        "{n} web devices over a, b, c ({on_a} on a); {watchers} watchers on b and c, realtime, of {watched} users on a"
    );
    println!(
        "{}: {shards} shards, lease TTL {ttl:?} (resync window the same), web grace {grace:?}, debounce {debounce:?}, \
         idle timeout {idle:?}, keep-alive {keep_alive:?}; load average at the {}: {}",
        if defaults { "greendot serve --cluster defaults" } else { "settings" },
        if pause { "SIGSTOP" } else { "kill" },
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    println!();
    println!("| | value |");
    println!("|---|---:|");
    println!(
        "| devices of a back on b or c | {} of {on_a} |",
        times.len()
    );
    println!(
        "| kill to welcome elsewhere, p50 / p99 / max s | {} / {} / {} |",
        q(0.5).unwrap_or_default(),
        q(0.99).unwrap_or_default(),
        q(1.0).unwrap_or_default()
    );
    println!(
        "| last device back (wait_back) | {} |",
        all_back.map_or("not within 300 s".into(), |d| format!(
            "{:.2} s",
            d.as_secs_f64()
        ))
    );
    println!("| watched users shown online before the kill | {online_before} of {watched} |");
    println!(
        "| watched users any watcher was shown offline, {} + {watch_until:.1?}{} | {} (goal 0) |",
        if pause { "SIGSTOP" } else { "kill" },
        if pause { " + SIGCONT + 5 s" } else { "" },
        offline.len()
    );
    if let Some(woken) = &woken {
        println!("| a after SIGCONT at the end of that, 5 s later | {woken} |");
    }
    println!("| watched users shown online at the end of that | {online_after} of {watched} |");
    println!(
        "| watched users online at a new watcher on b before the logout | {online_at_check} of {watched} ({checked} answered) |"
    );
    println!(
        "| after every device logged out ({stopped:.1?}): all watched users offline | {} |",
        all_offline_after.map_or(
            format!(
                "no: {ghosts} still online after {:.1?} (ghosts)",
                stop.elapsed()
            ),
            |d| format!("after {:.2} s, 0 ghosts", d.as_secs_f64())
        )
    );
    println!("| devices b, c moved to lingering with a's lease | {b_lost}, {c_lost} |");
    if !offline.is_empty() {
        println!();
        println!(
            "shown offline: {:?}",
            offline.iter().take(20).collect::<Vec<_>>()
        );
    }
}
