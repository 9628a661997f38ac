//! NATS messages per published change as the watchers of the changing user
//! grow: a 3-node NATS cluster (monitoring on), three `greendot serve
//! --cluster` nodes a, b, c (the release binary next to this one; 64 shards,
//! 15 s TTL, debounce 1 ms). The changing user, `star`, is owned by a and has
//! her device on a (so the edge's request to the owner is in process and
//! what crosses NATS per change is the owner's preference write and the
//! view). `W` watchers (realtime) watch her, spread over b and c (W = 1: on
//! b only). For each W she changes her status message `--changes` times,
//! `--gap-ms` apart, and every watcher must see every change.
//!
//! `cargo build --release -p greendot-transport --bin greendot && cargo
//! build --release -p greendot-bench --bin cluster_fanout &&
//! target/release/cluster_fanout` (`--watchers 1,10,100,1000 --changes 300
//! --gap-ms 50`).
//!
//! Counted per change, over the changes (less the same counts over an idle
//! period as long, with the watchers connected: leases and claims):
//! - view publishes: the owner's `greendot_cluster_views_published_total`;
//! - truths sent to other edges: the owner's
//!   `greendot_cluster_truths_sent_total` (her device is on the owner, so
//!   her truth stays in process: 0 expected);
//! - view deliveries: what NATS delivered to the greendot nodes'
//!   connections on their `gd.shard.*` subscriptions (`/connz?subs=detail`,
//!   each subscription's `msgs`), per node;
//! - all of NATS: the three servers' `/varz` `in_msgs` and `out_msgs` (every
//!   message a server received or sent, from clients and routes:
//!   JetStream's KV writes, their replication and acks included).

use greendot_bench::arg;
use greendot_bench::cluster::{
    bench_dir, client_config, delivered_on, nats_msgs, owner_of, placed, serve, stream_seqs, Join,
    Node,
};
use greendot_client::{Client, Event, Updates};
use greendot_cluster::testing::NatsCluster;
use greendot_core::{Status, Tier};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SHARDS: u32 = 64;

async fn connect(roots: &[&Node], at: &Node, user: &str, device: &str) -> (Client, Updates) {
    let config = client_config(roots, at, user, device);
    // A loaded machine times a handshake out now and then: try again.
    let mut tries = 0;
    loop {
        match Client::connect(config.clone()).await {
            Ok(c) => return c,
            Err(e) if tries < 5 => {
                tries += 1;
                eprintln!("  {user}: {e}; again");
            }
            Err(e) => panic!("{user} cannot connect: {e}"),
        }
    }
}

/// Every counter this bench reads, at one moment.
#[derive(Clone, Default)]
struct Counts {
    published: u64,
    truths: u64,
    delivered: BTreeMap<String, u64>,
    /// Each stream's last sequence: its KV writes.
    streams: BTreeMap<String, u64>,
    in_msgs: u64,
    out_msgs: u64,
}

fn counts(nats: &NatsCluster, owner: &Node) -> Counts {
    let (in_msgs, out_msgs) = nats_msgs(nats);
    Counts {
        published: owner.metric("greendot_cluster_views_published_total"),
        truths: owner.metric("greendot_cluster_truths_sent_total"),
        delivered: delivered_on(nats, "gd.shard."),
        streams: stream_seqs(nats),
        in_msgs,
        out_msgs,
    }
}

fn minus_map(a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    a.iter()
        .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0)))
        .collect()
}

fn minus(a: &Counts, b: &Counts) -> Counts {
    Counts {
        published: a.published - b.published,
        truths: a.truths - b.truths,
        delivered: minus_map(&a.delivered, &b.delivered),
        streams: minus_map(&a.streams, &b.streams),
        in_msgs: a.in_msgs - b.in_msgs,
        out_msgs: a.out_msgs - b.out_msgs,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    greendot_bench::raise_nofile();
    let list: String = arg("--watchers", "1,10,100,1000".to_string());
    let ws: Vec<usize> = list.split(',').filter_map(|w| w.parse().ok()).collect();
    let changes: usize = arg("--changes", 300);
    let gap = Duration::from_millis(arg("--gap-ms", 50));

    let dir = bench_dir("cluster-fanout");
    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let join = Join {
        urls: &urls,
        shards: SHARDS,
        ttl: Duration::from_secs(15),
    };
    let extra = ["--debounce", "1ms", "--max-handshakes-per-sec", "100000"];
    let (a, b, c) = (
        serve(&dir, Some(join), "a", &extra),
        serve(&dir, Some(join), "b", &extra),
        serve(&dir, Some(join), "c", &extra),
    );
    placed(&urls, 3, SHARDS);
    let roots = [&a, &b, &c];
    let star = (0..500)
        .map(|i| format!("star{i}"))
        .find(|u| owner_of(&urls, u, SHARDS) == "a")
        .expect("a user owned by a");
    let (device, _device_updates) = connect(&roots, &a, &star, "phone").await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut rows = Vec::new();
    for &w in &ws {
        // The watchers, on b and c alternately (one: on b).
        let seen = Arc::new(AtomicUsize::new(0));
        let mut clients = Vec::new();
        let mut readers = Vec::new();
        for chunk in (0..w).collect::<Vec<_>>().chunks(64) {
            let names: Vec<String> = chunk.iter().map(|i| format!("w{w}x{i}")).collect();
            let mut connecting = Vec::new();
            for (&i, name) in chunk.iter().zip(&names) {
                let at = if i % 2 == 0 { &b } else { &c };
                connecting.push(connect(&roots, at, name, "laptop"));
            }
            for (client, mut updates) in futures_util::future::join_all(connecting).await {
                client
                    .subscribe(&[star.as_str()], Tier::Realtime)
                    .await
                    .expect("subscribe");
                let seen = seen.clone();
                readers.push(tokio::spawn(async move {
                    while let Some(event) = updates.next().await {
                        if let Event::Presence { presence, .. } = event {
                            if presence
                                .message
                                .as_deref()
                                .is_some_and(|m| m.starts_with('m'))
                            {
                                seen.fetch_add(1, Relaxed);
                            }
                        }
                    }
                }));
                clients.push(client);
            }
        }
        // The watchers' own arrivals published by their owners first.
        let published = || {
            [&a, &b, &c]
                .iter()
                .map(|n| n.metric("greendot_cluster_views_published_total"))
                .sum::<u64>()
        };
        let mut last = published();
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = published();
            if now == last {
                break;
            }
            last = now;
        }
        seen.store(0, Relaxed);

        let before = counts(&nats, &a);
        let t0 = Instant::now();
        for k in 0..changes {
            let status = if k % 2 == 0 {
                Status::Busy
            } else {
                Status::Away
            };
            device
                .set_status(status, Some(&format!("m{w}-{k}")))
                .await
                .expect("set_status");
            tokio::time::sleep(gap).await;
        }
        let want = w * changes;
        let wait = Instant::now();
        while seen.load(Relaxed) < want && wait.elapsed() < Duration::from_secs(20) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = t0.elapsed();
        let during = minus(&counts(&nats, &a), &before);
        // The background over as long (renewals), watchers still connected.
        let quiet = counts(&nats, &a);
        tokio::time::sleep(took).await;
        let idle = minus(&counts(&nats, &a), &quiet);
        let pushes = seen.load(Relaxed);
        drop(clients);
        for r in readers {
            r.abort();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        rows.push((w, pushes, during, idle, took));
    }
    drop(device);
    drop((a, b, c));
    drop(nats);
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "star owned by a, her device on a; watchers on b and c; {changes} changes {gap:?} apart per row; debounce 1 ms; load average at the start {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    println!();
    println!("| watchers | pushes to watchers | view publishes (shard subject) | truths to other edges | view deliveries to nodes (by node) | KV writes (by bucket) | NATS in_msgs | NATS out_msgs | idle in / out (subtracted) |");
    println!("|---:|---:|---:|---:|---|---|---:|---:|---:|");
    let n = changes as f64;
    let per = |x: u64, idle: u64| (x as f64 - idle as f64) / n;
    for (w, pushes, during, idle, _took) in rows {
        let by = |d: &BTreeMap<String, u64>, i: &BTreeMap<String, u64>, strip: &str| {
            d.iter()
                .map(|(k, v)| (k, per(*v, i.get(k).copied().unwrap_or(0))))
                .filter(|(_, v)| v.abs() >= 0.05)
                .map(|(k, v)| format!("{} {v:.2}", k.trim_start_matches(strip)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let total = |m: &BTreeMap<String, u64>| m.values().sum::<u64>();
        println!(
            "| {w} | {:.1} | {:.2} | {:.2} | {:.2} ({}) | {:.2} ({}) | {:.1} | {:.1} | {:.1} / {:.1} |",
            pushes as f64 / n,
            per(during.published, idle.published),
            per(during.truths, idle.truths),
            per(total(&during.delivered), total(&idle.delivered)),
            by(&during.delivered, &idle.delivered, ""),
            per(total(&during.streams), total(&idle.streams)),
            by(&during.streams, &idle.streams, "KV_"),
            per(during.in_msgs, idle.in_msgs),
            per(during.out_msgs, idle.out_msgs),
            idle.in_msgs as f64 / n,
            idle.out_msgs as f64 / n,
        );
    }
    println!();
    println!(
        "Per change (her status message), each less the same count over an idle period as long."
    );
}
