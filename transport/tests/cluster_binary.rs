//! Three `greendot serve --cluster` processes on a real 3-node NATS cluster:
//! `greendot cluster status` shows the nodes and every shard owned once;
//! the metrics page shows the node's cluster gauges; SIGTERM hands a node's
//! shards over at once; `kill -9` within the lease TTL plus NATS's expiry
//! slack. Status against no NATS is a clear error.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use support::Proc;

use greendot_cluster::testing::NatsCluster;
use greendot_cluster::{rendezvous_owner, NodeId, ShardId};

const BIN: &str = env!("CARGO_BIN_EXE_greendot");
const LEASE_TTL: Duration = Duration::from_secs(2);
/// How late after a TTL NATS may expire a key, plus a loaded machine.
const SLACK: Duration = Duration::from_secs(8);

struct Node {
    /// Killed when dropped.
    proc: Proc,
    metrics: String,
}

fn serve(dir: &Path, urls: &str, id: &str) -> Node {
    let data = dir.join(id);
    let mut command = Command::new(BIN);
    command
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(&data)
        .arg("--secret-file")
        .arg(dir.join("secret"))
        .args(["--cluster", urls, "--node-id", id, "--cluster-shards", "64"])
        .args(["--cluster-lease-ttl", "2s", "--advertise"])
        .arg(format!("{id}.test:4433"));
    let mut proc = Proc::spawn(id, command);
    let metrics = proc.metrics_addr(SLACK);
    Node { proc, metrics }
}

fn status(urls: &str) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["cluster", "status", "--cluster", urls, "--shard", "7"])
        .output()
        .expect("greendot cluster status");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn until_status(urls: &str, within: Duration, what: &str, done: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    let mut last = String::new();
    while t0.elapsed() < within {
        let (ok, text) = status(urls);
        if ok && done(&text) {
            return text;
        }
        last = text;
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what}: not within {within:?}; last status:\n{last}");
}

fn metrics(at: &str) -> String {
    let mut stream = TcpStream::connect(at).expect("metrics port");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// The SHARDS column of `node`'s row.
fn shards_of(text: &str, node: &str) -> Option<usize> {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(node))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("greendot-cluster-bin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // One token secret for every node, as in a real cluster: it also keys
    // the tags of their messages to each other.
    std::fs::write(dir.join("secret"), "0123456789abcdef0123456789abcdef").unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_greendot_nodes_status_drain_and_kill_9() {
    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let dir = temp_dir();
    let mut a = serve(&dir, &urls, "a");
    let mut b = serve(&dir, &urls, "b");
    let c = serve(&dir, &urls, "c");

    // Settled: every shard with the owner rendezvous hashing gives it (all
    // shards owned is not enough: a node that saw the others late hands
    // shards over for a while after).
    let nodes: Vec<NodeId> = ["a", "b", "c"]
        .iter()
        .map(|n| NodeId::new(*n).unwrap())
        .collect();
    let expected: Vec<usize> = nodes
        .iter()
        .map(|n| {
            (0..64)
                .filter(|s| rendezvous_owner(ShardId(*s), &nodes) == Some(n))
                .count()
        })
        .collect();
    assert!(
        expected.iter().all(|n| (10..=32).contains(n)),
        "{expected:?}"
    );
    let counts_in = |t: &str| -> Vec<usize> {
        ["a", "b", "c"]
            .iter()
            .map(|n| shards_of(t, n).unwrap_or(0))
            .collect()
    };
    let text = until_status(
        &urls,
        LEASE_TTL * 3 + SLACK,
        "three nodes own their shards",
        |t| t.contains("nodes: 3") && t.contains("owned 64, unowned 0") && counts_in(t) == expected,
    );
    println!("{text}");
    assert!(text.contains("a.test:4433"), "{text}");
    assert!(text.contains("shard 7: owner "), "{text}");
    let page = metrics(&a.metrics);
    assert!(
        page.contains("greendot_cluster_acting{node=\"a\"} 1"),
        "{page}"
    );
    assert!(page.contains(&format!(
        "greendot_cluster_shards_owned{{node=\"a\"}} {}",
        expected[0]
    )));
    // The nodes hear each other (the beacons of their owners, every
    // second): nothing of theirs is taken for a forgery.
    for reason in ["forged", "version", "malformed"] {
        let sample = format!("greendot_cluster_rejected_total{{reason=\"{reason}\"}} 0");
        assert!(page.contains(&sample), "{sample}: {page}");
    }

    // SIGTERM of b: its shards are released at once.
    let t0 = Instant::now();
    b.proc.signal("-TERM");
    let text = until_status(&urls, LEASE_TTL, "b's shards taken over", |t| {
        t.contains("nodes: 2") && t.contains("owned 64, unowned 0")
    });
    println!(
        "SIGTERM of b: all shards owned again after {:?}\n{text}",
        t0.elapsed()
    );
    assert!(b.proc.wait_exit(SLACK).success());

    // kill -9 of a: within its lease TTL plus NATS's slack.
    let t0 = Instant::now();
    a.proc.kill9();
    let text = until_status(&urls, LEASE_TTL + SLACK, "a's shards taken over", |t| {
        t.contains("nodes: 1") && shards_of(t, "c") == Some(64)
    });
    println!(
        "kill -9 of a: c owns all shards after {:?}\n{text}",
        t0.elapsed()
    );
    drop(c);
    drop(nats);

    let (ok, text) = status("nats://127.0.0.1:1");
    assert!(!ok);
    assert!(
        text.contains("cannot read the cluster at nats://127.0.0.1:1"),
        "{text}"
    );
}
