//! Change-to-push across a cluster against one node, in the same run.
//!
//! `cargo build --release -p greendot-transport --bin greendot && cargo run
//! --release -p greendot-bench --bin cluster_latency` (`-- --users 20
//! --changes 50 --gap-ms 20`). Starts a 3-node NATS cluster (greendot-cluster's
//! test harness, monitoring on), three `greendot serve --cluster` processes
//! a, b, c (the release binary next to this one) and one `greendot serve`
//! alone, all with the same core settings and a 1 ms debounce (the least; what is
//! measured is the path, not the debounce). Each of `users` users has a
//! device on a; one watcher on c watches them all (realtime); every user
//! changes her status message `changes` times, one change at a time, `gap`
//! apart, all users at once. Measured per change: from the `set_status`
//! call to the watcher's push of that message. Then the same on the single
//! node (device and watcher on it). NATS messages per change: the three
//! NATS servers' `in_msgs` from `/varz` (every message a server received:
//! clients' and its routes') over the cluster run, less the same servers'
//! count over an idle period as long, divided by the changes.

use greendot_bench::cluster::{
    bench_dir, client_config, http_get, nats_in_msgs, placed, Join, Node,
};
use greendot_bench::{arg, ms, quantile};
use greendot_client::{Client, Event, Updates};
use greendot_cluster::testing::NatsCluster;
use greendot_core::{Status, Tier};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A node of the cluster (64 shards, 15 s TTL) or, with `None`, alone.
fn serve(dir: &Path, cluster: Option<&str>, id: &str) -> Node {
    let join = cluster.map(|urls| Join {
        urls,
        shards: 64,
        ttl: Duration::from_secs(15),
    });
    greendot_bench::cluster::serve(dir, join, id, &["--debounce", "1ms"])
}

async fn connect(roots: &[&Node], at: &Node, user: &str, device: &str) -> (Client, Updates) {
    let config = client_config(roots, at, user, device);
    Client::connect(config).await.expect("connect")
}

/// Change-to-push samples: users on `edge`, the watcher on `watch_at`.
async fn run(
    roots: &[&Node],
    edge: &Node,
    watch_at: &Node,
    users: usize,
    changes: usize,
    gap: Duration,
) -> Vec<Duration> {
    let names: Vec<String> = (0..users).map(|i| format!("user{i}")).collect();
    let (watcher, mut updates) = connect(roots, watch_at, "watcher", "laptop").await;
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    watcher.subscribe(&refs, Tier::Realtime).await.unwrap();
    let sent: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut devices = Vec::new();
    for name in &names {
        devices.push(connect(roots, edge, name, "phone").await);
    }
    // Everyone online first.
    tokio::time::sleep(Duration::from_secs(2)).await;
    while tokio::time::timeout(Duration::from_millis(200), updates.next())
        .await
        .is_ok()
    {}
    let total = users * changes;
    let collector = {
        let sent = sent.clone();
        tokio::spawn(async move {
            let mut samples = Vec::with_capacity(total);
            while samples.len() < total {
                match tokio::time::timeout(Duration::from_secs(10), updates.next()).await {
                    Ok(Some(Event::Presence { presence, .. })) => {
                        if let Some(m) = presence.message.as_deref() {
                            if let Some(at) = sent.lock().unwrap().remove(m) {
                                samples.push(at.elapsed());
                            }
                        }
                    }
                    Ok(Some(_)) => {}
                    _ => break,
                }
            }
            drop(watcher);
            samples
        })
    };
    let mut tasks = Vec::new();
    for (i, (client, _)) in devices.iter().enumerate() {
        let client = client.clone();
        let sent = sent.clone();
        tasks.push(tokio::spawn(async move {
            for k in 0..changes {
                let message = format!("u{i}c{k}");
                sent.lock().unwrap().insert(message.clone(), Instant::now());
                let status = if k % 2 == 0 {
                    Status::Busy
                } else {
                    Status::Away
                };
                client
                    .set_status(status, Some(&message))
                    .await
                    .expect("set_status");
                tokio::time::sleep(gap).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut samples = collector.await.unwrap();
    if samples.len() < total {
        eprintln!(
            "{} of {total} changes never reached the watcher",
            total - samples.len()
        );
    }
    samples.sort();
    drop(devices);
    samples
}

fn row(name: &str, s: &[Duration]) {
    let q = |x| quantile(s, x).map(ms).unwrap_or_default();
    println!(
        "| {name} | {} | {} | {} | {} |",
        s.len(),
        q(0.5),
        q(0.99),
        q(1.0)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let users: usize = arg("--users", 20);
    let changes: usize = arg("--changes", 50);
    let gap = Duration::from_millis(arg("--gap-ms", 20));
    let dir = bench_dir("cluster-bench");

    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let (a, b, c) = (
        serve(&dir, Some(&urls), "a"),
        serve(&dir, Some(&urls), "b"),
        serve(&dir, Some(&urls), "c"),
    );
    placed(&urls, 3, 64);
    let roots = [&a, &b, &c];
    let t0 = Instant::now();
    let before = nats_in_msgs(&nats);
    let cluster = run(&roots, &a, &c, users, changes, gap).await;
    let during = nats_in_msgs(&nats) - before;
    let took = t0.elapsed();
    // As long again with no clients, for the background (leases, claims).
    let quiet = nats_in_msgs(&nats);
    tokio::time::sleep(took).await;
    let idle = (nats_in_msgs(&nats) - quiet) as f64;
    let metric = |n: &Node, name: &str| {
        http_get(&n.metrics, "/metrics")
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let forwarded = metric(&a, "greendot_cluster_forwarded_inputs_total{to=\"remote\"}");
    let local = metric(&a, "greendot_cluster_forwarded_inputs_total{to=\"local\"}");
    drop((a, b, c));
    drop(nats);

    let one = serve(&dir, None, "single");
    let single = run(&[&one], &one, &one, users, changes, gap).await;
    drop(one);
    let _ = std::fs::remove_dir_all(&dir);

    let n = (users * changes) as f64;
    println!("{users} users x {changes} changes, {gap:?} apart; device on a, watcher on c; debounce 1 ms");
    println!();
    println!("| run | changes seen | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|");
    row("one node", &single);
    row("3-node cluster (a -> owner -> c)", &cluster);
    println!();
    println!(
        "NATS in_msgs during the cluster run: {during} over {took:.1?} ({:.1} per change); \
         idle over as long: {idle:.0}; so {:.1} per change. Edge a forwarded {forwarded} inputs over NATS, {local} in process.",
        during as f64 / n,
        (during as f64 - idle) / n
    );
}
