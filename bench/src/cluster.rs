//! What the cluster benchmarks share: `greendot serve` processes (the
//! release binary next to the benchmark's), their metrics, and the NATS
//! servers' monitoring counters.

use greendot_client::rustls::pki_types::pem::PemObject;
use greendot_client::rustls::pki_types::CertificateDer;
use greendot_client::ClientConfig;
use greendot_cluster::testing::NatsCluster;
use greendot_proto::Kind;
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const SECRET: &str = "0123456789abcdef0123456789abcdef";

/// A client of `at` as `user`/`device` (desktop, may watch anyone) that
/// trusts every node's certificate, without reconnects or the WebSocket
/// fallback (a bench measures one connection).
pub fn client_config(roots: &[&Node], at: &Node, user: &str, device: &str) -> ClientConfig {
    let keys = TokenKeys::new(SECRET.as_bytes(), Duration::ZERO);
    let token = keys
        .mint(&Claims::new(
            user,
            device,
            Kind::Desktop,
            WatchClaim::all(),
            Duration::from_secs(3600),
        ))
        .expect("a token of the bench's secret");
    let mut config = ClientConfig::new(
        at.addr,
        roots
            .iter()
            .map(|n| greendot_client::Certificate::from_der(n.cert.to_vec()))
            .collect::<Vec<_>>(),
        token,
    );
    config.reconnect = None;
    config.websocket = greendot_client::WebSocket::Off;
    config
}

/// A `greendot serve` process, killed (`kill -9`) when dropped.
pub struct Node {
    pub id: String,
    pub child: Child,
    pub addr: SocketAddr,
    pub metrics: String,
    pub cert: CertificateDer<'static>,
}

impl Node {
    /// `kill -9`.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The value of the sample `name` (with its labels) on its metrics page,
    /// 0 when absent.
    pub fn metric(&self, name: &str) -> u64 {
        http_get(&self.metrics, "/metrics")
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<u64>().ok())
            .unwrap_or(0)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The `greendot` binary next to this one.
pub fn greendot() -> PathBuf {
    let exe = std::env::current_exe().expect("this binary's path");
    exe.parent().unwrap().join("greendot")
}

/// A fresh directory with the token secret every node shares.
pub fn bench_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("greendot-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    dir
}

/// How a node joins: NATS URLs, shard count, lease TTL.
#[derive(Clone, Copy)]
pub struct Join<'a> {
    pub urls: &'a str,
    pub shards: u32,
    pub ttl: Duration,
}

/// `greendot serve` with data in `dir/<id>`, in the cluster `join` (or
/// alone), with `extra` arguments; returns once it listens.
pub fn serve(dir: &Path, join: Option<Join>, id: &str, extra: &[&str]) -> Node {
    let data = dir.join(id);
    let mut command = Command::new(greendot());
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
        .args(extra);
    if let Some(j) = join {
        command
            .args(["--cluster", j.urls, "--node-id", id])
            .args(["--cluster-shards", &j.shards.to_string()])
            .args(["--cluster-lease-ttl", &format!("{}s", j.ttl.as_secs())]);
    }
    let mut child = command
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect(
            "greendot serve (build it: cargo build --release -p greendot-transport --bin greendot)",
        );
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut addr = None;
    let mut metrics = None;
    let mut lines = out.lines();
    while metrics.is_none() {
        let line = lines.next().expect("greendot serve ended").unwrap();
        if let Some(rest) = line.strip_prefix("greendot listening on ") {
            addr = rest.split_whitespace().next().and_then(|a| a.parse().ok());
        }
        if let Some(at) = line.strip_prefix("metrics on http://") {
            metrics = Some(at.trim_end_matches("/metrics").to_owned());
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let pem = std::fs::read(data.join("cert.pem")).expect("the node's certificate");
    Node {
        id: id.to_owned(),
        child,
        addr: addr.expect("an address"),
        metrics: metrics.unwrap(),
        cert: CertificateDer::from_pem_slice(&pem).expect("PEM"),
    }
}

pub fn http_get(addr: &str, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("HTTP port");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// The sums over the NATS servers of `/varz` `in_msgs` and `out_msgs`
/// (every message a server received or sent: clients' and its routes',
/// JetStream's replication and acknowledgements included).
pub fn nats_msgs(nats: &NatsCluster) -> (u64, u64) {
    (0..nats.size()).fold((0, 0), |(i, o), n| {
        let varz = nats_json(nats, n, "/varz");
        (
            i + varz["in_msgs"].as_u64().expect("in_msgs in /varz"),
            o + varz["out_msgs"].as_u64().expect("out_msgs in /varz"),
        )
    })
}

/// The sum of the NATS servers' `in_msgs`.
pub fn nats_in_msgs(nats: &NatsCluster) -> u64 {
    nats_msgs(nats).0
}

/// A NATS server's monitoring page (`path` on node `n`) as JSON. HTTP/1.0,
/// so that the answer is not chunked.
pub fn nats_json(nats: &NatsCluster, n: usize, path: &str) -> serde_json::Value {
    let mut stream = std::net::TcpStream::connect(nats.monitor_addr(n)).expect("NATS monitoring");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path} on NATS node {n}: {e}"))
}

/// Messages NATS delivered to each greendot node's connection on
/// subscriptions to subjects starting with `prefix` (`/connz?subs=detail`:
/// per subscription, `msgs` delivered), by node id.
pub fn delivered_on(nats: &NatsCluster, prefix: &str) -> std::collections::BTreeMap<String, u64> {
    let mut by_node = std::collections::BTreeMap::new();
    for n in 0..nats.size() {
        let connz = nats_json(nats, n, "/connz?subs=detail&limit=4096");
        let conns = connz["connections"].as_array().cloned().unwrap_or_default();
        for conn in conns {
            let Some(node) = conn["name"]
                .as_str()
                .and_then(|name| name.strip_prefix("greendot-"))
            else {
                continue;
            };
            let subs = conn["subscriptions_list_detail"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let sum: u64 = subs
                .iter()
                .filter(|s| s["subject"].as_str().is_some_and(|x| x.starts_with(prefix)))
                .filter_map(|s| s["msgs"].as_u64())
                .sum();
            *by_node.entry(node.to_owned()).or_insert(0) += sum;
        }
    }
    by_node
}

/// Each JetStream stream's last sequence (one per message stored: a KV
/// write), as NATS node 0 holds it (`/jsz?streams=true`; every stream is
/// replicated to every node).
pub fn stream_seqs(nats: &NatsCluster) -> std::collections::BTreeMap<String, u64> {
    let jsz = nats_json(nats, 0, "/jsz?streams=true");
    let mut out = std::collections::BTreeMap::new();
    for account in jsz["account_details"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        for stream in account["stream_detail"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            if let (Some(name), Some(seq)) = (
                stream["name"].as_str(),
                stream["state"]["last_seq"].as_u64(),
            ) {
                out.insert(name.to_owned(), seq);
            }
        }
    }
    out
}

/// Waits until `nodes` nodes are up and all `shards` shards owned.
pub fn placed(urls: &str, nodes: usize, shards: u32) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        let out = Command::new(greendot())
            .args(["cluster", "status", "--cluster", urls])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if text.contains(&format!("nodes: {nodes}"))
            && text.contains(&format!("owned {shards}, unowned 0"))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("shards not placed");
}

/// The node owning `user`'s shard, from `greendot cluster status --shard`.
pub fn owner_of(urls: &str, user: &str, shards: u32) -> String {
    let shard = greendot_cluster::shard_of(user, shards).0;
    let out = Command::new(greendot())
        .args(["cluster", "status", "--cluster", urls])
        .args(["--shard", &shard.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let prefix = format!("shard {shard}: owner ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or("?")
        .to_owned()
}
