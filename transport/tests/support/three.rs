//! Three `greendot serve --cluster` processes on a real 3-node NATS
//! cluster, real QUIC clients, and the waits the cluster tests share
//! (`cluster_data.rs`, `cluster_outage.rs`).

#![allow(dead_code)] // each test file uses its own part

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::Proc;
use greendot_client::rustls::pki_types::pem::PemObject;
use greendot_client::rustls::pki_types::CertificateDer;
use greendot_client::{Client, ClientConfig, Event, Source, Updates};
use greendot_cluster::testing::NatsCluster;
use greendot_core::{Kinds, Presence, SessionId, Tier};
use greendot_proto::Kind;
use greendot_server::cluster::decode_device_record;
use greendot_server::token::{Claims, TokenKeys, WatchClaim};

pub const BIN: &str = env!("CARGO_BIN_EXE_greendot");
pub const SHARDS: u32 = 64;
pub const LEASE_TTL: Duration = Duration::from_secs(2);
pub const DEBOUNCE: Duration = Duration::from_millis(300);
pub const GRACE: Duration = Duration::from_secs(1);
pub const BATCH: Duration = Duration::from_secs(1);
pub const GROUP_INTERVAL: Duration = Duration::from_secs(1);
/// A loaded 2-core machine, NATS round trips, process start.
pub const SLACK: Duration = Duration::from_secs(8);
/// Tokens' lifetime.
pub const HOUR: Duration = Duration::from_secs(3600);
pub const SECRET: &str = "0123456789abcdef0123456789abcdef";

pub struct Node {
    pub id: String,
    /// Killed when dropped.
    pub proc: Proc,
    pub addr: SocketAddr,
    pub metrics: String,
    pub cert: CertificateDer<'static>,
}

/// The tests of this file run one at a time: each starts three NATS and
/// three greendot processes, and their deadlines come from the configured
/// timeouts, not from a machine that runs six clusters at once on 2 cores
/// (seen: `cargo test` running them in parallel missed an 8.3 s deadline).
pub static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A 3-node NATS cluster and three greendot nodes a, b, c on it, with every
/// shard placed.
pub struct Three {
    pub nats: NatsCluster,
    pub urls: String,
    pub dir: PathBuf,
    pub a: Node,
    pub b: Node,
    pub c: Node,
}

pub async fn three_nodes(test: &str) -> Three {
    three_nodes_with_a_on(test, "127.0.0.1:0", "127.0.0.1:0").await
}

/// [`three_nodes`] with `a` listening on `listen` (QUIC) and `metrics`
/// (HTTP), for a test that restarts it on the same addresses.
pub async fn three_nodes_with_a_on(test: &str, listen: &str, metrics: &str) -> Three {
    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let dir = temp_dir(test);
    let a = serve_on(&dir, Some((&urls, LEASE_TTL)), "a", listen, metrics);
    let b = serve(&dir, &urls, "b");
    let c = serve(&dir, &urls, "c");
    wait_placed(&urls);
    Three {
        nats,
        urls,
        dir,
        a,
        b,
        c,
    }
}

pub fn serve(dir: &Path, urls: &str, id: &str) -> Node {
    serve_with(dir, Some((urls, LEASE_TTL)), id)
}

/// `greendot serve`, in the cluster at `cluster` (NATS URLs, lease TTL) or,
/// with `None`, alone; every other setting the same.
pub fn serve_with(dir: &Path, cluster: Option<(&str, Duration)>, id: &str) -> Node {
    serve_on(dir, cluster, id, "127.0.0.1:0", "127.0.0.1:0")
}

/// `greendot serve` listening on `listen` (QUIC) and `metrics` (HTTP).
pub fn serve_on(
    dir: &Path,
    cluster: Option<(&str, Duration)>,
    id: &str,
    listen: &str,
    metrics: &str,
) -> Node {
    serve_graced(dir, cluster, id, listen, metrics, GRACE)
}

/// [`serve_on`] with every kind's grace `grace`.
pub fn serve_graced(
    dir: &Path,
    cluster: Option<(&str, Duration)>,
    id: &str,
    listen: &str,
    metrics: &str,
    grace: Duration,
) -> Node {
    let data = dir.join(id);
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--listen", listen, "--metrics", metrics])
        .arg("--data-dir")
        .arg(&data)
        .arg("--secret-file")
        .arg(dir.join("secret"));
    if let Some((urls, ttl)) = cluster {
        command
            .args(["--cluster", urls, "--node-id", id])
            .args(["--cluster-shards", &SHARDS.to_string()])
            .args(["--cluster-lease-ttl", &format!("{}s", ttl.as_secs())]);
    }
    command
        .args(["--debounce", &format!("{}ms", DEBOUNCE.as_millis())])
        .args(["--grace", &format!("{}ms", grace.as_millis())])
        .args(["--batch-interval", &format!("{}ms", BATCH.as_millis())])
        .args([
            "--group-interval",
            &format!("{}ms", GROUP_INTERVAL.as_millis()),
        ])
        .args(["--idle-timeout", "1s", "--keep-alive", "250ms"])
        // GREENDOT_TEST_LOG (e.g. `warn,greendot_cluster=info`) for more.
        .env(
            "RUST_LOG",
            std::env::var("GREENDOT_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        );
    let mut proc = Proc::spawn(id, command);
    // A start waits for NATS and its buckets: on a loaded machine a
    // restarted node took over 8 s once (the suite's other tests running).
    let addr = proc.listening_addr(SLACK * 2);
    let metrics = proc.metrics_addr(SLACK);
    let pem = std::fs::read(data.join("cert.pem")).expect("the node's certificate");
    let cert = CertificateDer::from_pem_slice(&pem).expect("a PEM certificate");
    Node {
        id: id.to_owned(),
        proc,
        addr,
        metrics,
        cert,
    }
}

/// The value of the sample `name` (with its labels) on a node's metrics page.
pub fn metric(node: &Node, name: &str) -> u64 {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(&node.metrics).expect("metrics port");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} on {}'s metrics:\n{text}", node.id))
}

pub fn status(urls: &str, shard: Option<u32>) -> (bool, String) {
    match shard {
        Some(s) => status_with(urls, &["--shard", &s.to_string()]),
        None => status_with(urls, &[]),
    }
}

/// `greendot cluster status` with `extra` arguments: success, and its
/// output and errors.
fn status_with(urls: &str, extra: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["cluster", "status", "--cluster", urls])
        .args(extra)
        .output()
        .expect("greendot cluster status");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Three nodes up and every shard held by the node rendezvous hashing gives
/// it to: what a test that picks a user by owner needs.
pub fn wait_placed(urls: &str) {
    wait_placed_within(urls, LEASE_TTL * 3 + SLACK)
}

/// As `wait_placed`, within `within`. "Every shard owned" alone is not
/// enough: the first node up claims every shard, and until it has seen the
/// others join it still owns theirs, so a node may own none for a moment.
pub fn wait_placed_within(urls: &str, within: Duration) {
    if let Err(last) = status_within(urls, within, at_rendezvous) {
        panic!("shards not placed within {within:?}:\n{last}");
    }
}

/// Three nodes up and every shard owned within `within`, or the last status.
pub fn placed_within(urls: &str, within: Duration) -> Result<(), String> {
    status_within(urls, within, |_| true)
}

/// Asks `greendot cluster status --shards` until three nodes are up, every
/// shard is owned and `placed` holds for the text, or `within` has passed.
fn status_within(urls: &str, within: Duration, placed: fn(&str) -> bool) -> Result<(), String> {
    let t0 = Instant::now();
    let mut last = String::new();
    while t0.elapsed() < within {
        let (ok, text) = status_with(urls, &["--shards"]);
        if ok
            && text.contains("nodes: 3")
            && text.contains(&format!("owned {SHARDS}, unowned 0"))
            && placed(&text)
        {
            return Ok(());
        }
        last = text;
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(last)
}

/// Every shard's holder and epoch, read from `greendot cluster status
/// --shards`; panics if the status cannot be read.
pub fn claims(urls: &str) -> std::collections::BTreeMap<u32, (String, u64)> {
    let (ok, text) = status_with(urls, &["--shards"]);
    assert!(ok, "cluster status failed:\n{text}");
    parse_claims(&text).unwrap_or_else(|| panic!("a claim that does not parse in:\n{text}"))
}

/// The claims a status lists under a, b and c ("a: 0@1 5@2 …"): shard to
/// (holder, epoch); `None` if one does not parse.
fn parse_claims(text: &str) -> Option<std::collections::BTreeMap<u32, (String, u64)>> {
    let mut claims = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some((owner, shards)) = line.split_once(": ") else {
            continue;
        };
        if !["a", "b", "c"].contains(&owner) {
            continue;
        }
        for entry in shards.split_whitespace() {
            let (shard, epoch) = entry.split_once('@')?;
            claims.insert(shard.parse().ok()?, (owner.to_owned(), epoch.parse().ok()?));
        }
    }
    Some(claims)
}

/// Whether every shard listed under a node ("a: 0@1 5@2 …") is the one
/// rendezvous hashing over a, b and c gives that node.
fn at_rendezvous(text: &str) -> bool {
    let live: Vec<greendot_cluster::NodeId> = ["a", "b", "c"]
        .into_iter()
        .map(|n| greendot_cluster::NodeId::new(n).unwrap())
        .collect();
    let Some(claims) = parse_claims(text) else {
        return false;
    };
    claims.len() == SHARDS as usize
        && claims.iter().all(|(shard, (owner, _))| {
            let desired =
                greendot_cluster::rendezvous_owner(greendot_cluster::ShardId(*shard), &live);
            desired.map(|n| n.as_str()) == Some(owner.as_str())
        })
}

/// The node that owns `user`'s shard. Right after the nodes joined a shard
/// may be between owners (released by one, not claimed yet by the next):
/// asked again until it has one.
pub fn owner_of(urls: &str, user: &str) -> String {
    let shard = greendot_cluster::shard_of(user, SHARDS).0;
    let prefix = format!("shard {shard}: owner ");
    let t0 = Instant::now();
    loop {
        let (ok, text) = status(urls, Some(shard));
        assert!(ok, "{text}");
        let owner = text
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split_whitespace().next());
        match owner {
            Some(owner) => return owner.to_owned(),
            None if t0.elapsed() < SLACK => std::thread::sleep(Duration::from_millis(100)),
            None => panic!("no owner of shard {shard} within {SLACK:?}:\n{text}"),
        }
    }
}

/// Waits until the owner of `user`'s shard has written the shard's device
/// record behind to the KV (the views bucket, key `shard.N`) with `device`
/// of `user` in it: what a next owner restores after a crash.
pub async fn wait_recorded(urls: &str, user: &str, device: &str, within: Duration) {
    use futures_util::StreamExt;
    let url = urls.split(',').next().expect("a NATS URL");
    let client = async_nats::connect(url).await.expect("NATS");
    let views = async_nats::jetstream::new(client)
        .get_key_value("gd_views")
        .await
        .expect("the views bucket");
    let key = format!("shard.{}", greendot_cluster::shard_of(user, SHARDS).0);
    // The latest record, then every new one.
    let mut records = views.watch_with_history(&key).await.expect("a watch");
    let recorded = tokio::time::timeout(within, async {
        while let Some(entry) = records.next().await {
            let entry = entry.expect("a record");
            let record = greendot_cluster::unfenced(&entry.value);
            let devices = decode_device_record(&record).unwrap_or_default();
            if devices.iter().any(|d| d.user == user && d.device == device) {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(
        recorded,
        Ok(true),
        "{user}'s {device} not in {key}'s device record within {within:?}"
    );
}

/// A user name whose owner is `owner`.
pub fn user_owned_by(urls: &str, owner: &str, stem: &str) -> String {
    (0..200)
        .map(|i| format!("{stem}{i}"))
        .find(|u| owner_of(urls, u) == owner)
        .unwrap_or_else(|| panic!("no user of {owner}"))
}

/// A user whose shard `owner` holds now and that rendezvous placement gives
/// to `next` once `owner` is gone (a, b and c being the nodes).
pub fn user_moving(urls: &str, owner: &str, next: &str) -> String {
    let live: Vec<greendot_cluster::NodeId> = ["a", "b", "c"]
        .into_iter()
        .filter(|n| *n != owner)
        .map(|n| greendot_cluster::NodeId::new(n).unwrap())
        .collect();
    let next_owner = |user: &str| {
        let shard = greendot_cluster::shard_of(user, SHARDS);
        greendot_cluster::rendezvous_owner(shard, &live).map(|n| n.to_string())
    };
    (0..200)
        .map(|i| format!("alice{i}"))
        .find(|u| next_owner(u).as_deref() == Some(next) && owner_of(urls, u) == owner)
        .unwrap_or_else(|| panic!("no user of {owner} whose next owner is {next}"))
}

pub fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "greendot-cluster-data-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    dir
}

pub async fn connect(
    nodes: &[&Node],
    at: &Node,
    user: &str,
    device: &str,
    kind: Kind,
    watch: WatchClaim,
) -> (Client, Updates) {
    let claims = Claims::new(user, device, kind, watch, Duration::from_secs(3600));
    connect_as(nodes, at, claims).await
}

pub async fn connect_as(nodes: &[&Node], at: &Node, claims: Claims) -> (Client, Updates) {
    connect_resuming(nodes, at, claims, None).await
}

/// [`connect_as`], resuming `resume` (an earlier client's session).
pub async fn connect_resuming(
    nodes: &[&Node],
    at: &Node,
    claims: Claims,
    resume: Option<SessionId>,
) -> (Client, Updates) {
    let (user, device) = (claims.sub.clone(), claims.dev.clone());
    let keys = TokenKeys::new(SECRET.as_bytes(), Duration::ZERO);
    let token = keys.mint(&claims).unwrap();
    let roots: Vec<_> = nodes.iter().map(|n| n.cert.clone()).collect();
    let mut config = ClientConfig::new(at.addr, roots, token);
    config.reconnect = None;
    config.websocket = greendot_client::WebSocket::Off;
    config.resume = resume;
    Client::connect(config)
        .await
        .unwrap_or_else(|e| panic!("{user}/{device} cannot connect to {}: {e}", at.id))
}

/// A device of `user` on `at` that knows every node's address and
/// reconnects (the library's defaults) to another one when `at` fails or
/// goes quiet.
pub async fn moving_client(
    nodes: &[&Node],
    at: &Node,
    user: &str,
    device: &str,
    kind: Kind,
) -> (Client, Updates) {
    let claims = Claims::new(user, device, kind, WatchClaim::all(), HOUR);
    let token = TokenKeys::new(SECRET.as_bytes(), Duration::ZERO)
        .mint(&claims)
        .unwrap();
    let roots: Vec<_> = nodes.iter().map(|n| n.cert.clone()).collect();
    let mut config = ClientConfig::new(at.addr, roots, token);
    config.servers = std::iter::once(at)
        .chain(nodes.iter().copied().filter(|n| n.id != at.id))
        .map(|n| greendot_client::ServerAddr::from(n.addr))
        .collect();
    config.websocket = greendot_client::WebSocket::Off;
    // A stopped node answers nothing: a try at it costs this much.
    config.connect_timeout = Duration::from_secs(1);
    Client::connect(config)
        .await
        .unwrap_or_else(|e| panic!("{user}/{device} cannot connect to {}: {e}", at.id))
}

/// Bob's laptop on `at`, subscribed to `targets` in realtime.
pub async fn bob_watching(nodes: &[&Node], at: &Node, targets: &[&str]) -> (Client, Updates) {
    let (bob, updates) =
        connect(nodes, at, "bob", "laptop", Kind::Desktop, WatchClaim::all()).await;
    bob.subscribe(targets, Tier::Realtime).await.unwrap();
    (bob, updates)
}

/// A phone of each of `users` on `at` (kept open while the result lives).
pub async fn phones_on(nodes: &[&Node], at: &Node, users: &[&str]) -> Vec<(Client, Updates)> {
    let mut phones = Vec::new();
    for user in users {
        phones.push(connect(nodes, at, user, "phone", Kind::Mobile, WatchClaim::all()).await);
    }
    phones
}

/// The next presence of `target` that satisfies `pred`, within `within`.
pub async fn wait_presence(
    updates: &mut Updates,
    target: &str,
    within: Duration,
    what: &str,
    pred: impl Fn(&Presence) -> bool,
) -> Presence {
    wait_presence_by(updates, target, within, what, None, pred).await
}

/// [`wait_presence`], checking that every update of `target` but the
/// subscribe's snapshot came by `source` when given.
pub async fn wait_presence_by(
    updates: &mut Updates,
    target: &str,
    within: Duration,
    what: &str,
    source: Option<Source>,
    pred: impl Fn(&Presence) -> bool,
) -> Presence {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, updates.next()).await {
            Ok(Some(Event::Presence {
                target: t,
                presence,
                source: by,
            })) if t == target => {
                if let Some(source) = source.filter(|_| by != Source::Snapshot) {
                    assert_eq!(by, source, "{what}: {presence:?}");
                }
                if pred(&presence) {
                    return presence;
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => panic!("{what}: the watcher's client ended"),
            Err(_) => panic!("{what}: not within {within:?}"),
        }
    }
}

/// Waits until every one of `users` was shown online, in any order (users
/// of different owners are published independently).
pub async fn all_online(updates: &mut Updates, users: &[&str], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    let mut waiting: std::collections::BTreeSet<&str> = users.iter().copied().collect();
    while !waiting.is_empty() {
        match tokio::time::timeout_at(deadline, updates.next()).await {
            Ok(Some(Event::Presence {
                target, presence, ..
            })) if presence.online => {
                waiting.remove(target.as_str());
            }
            Ok(Some(_)) => {}
            Ok(None) => panic!("online: the watcher's client ended"),
            Err(_) => panic!("online: {waiting:?} not within {within:?}"),
        }
    }
}

/// Nothing of `target` that satisfies `bad` arrives for `window`.
pub async fn never(
    updates: &mut Updates,
    target: &str,
    window: Duration,
    what: &str,
    bad: impl Fn(&Presence) -> bool,
) -> Vec<Presence> {
    let deadline = tokio::time::Instant::now() + window;
    let mut seen = Vec::new();
    while let Ok(event) = tokio::time::timeout_at(deadline, updates.next()).await {
        match event {
            Some(Event::Presence {
                target: t,
                presence,
                ..
            }) if t == target => {
                assert!(!bad(&presence), "{what}: {presence:?}");
                seen.push(presence);
            }
            Some(_) => {}
            None => break,
        }
    }
    seen
}

pub fn kinds(list: &[Kind]) -> Kinds {
    let mut k = Kinds::default();
    for kind in list {
        k.insert((*kind).into());
    }
    k
}
