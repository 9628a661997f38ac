//! Forged publishes (issue 30 §5): two `greendot serve --cluster` nodes on
//! NATS, alice's phone on node a, watchers of alice on both nodes. A plain
//! NATS client with publish rights on the subjects but without the token
//! secret forges a view (a huge epoch and version: the attack that used to
//! make watchers drop every real view after it), copies a genuine view onto
//! an edge's subject, and forges device inputs (a logout and an
//! invisibility change under a made-up edge incarnation), signed with
//! another key and unsigned (the format before the envelope). No watcher
//! sees any change, every forgery is counted in
//! `greendot_cluster_rejected_total`, and alice's next real change reaches
//! both watchers.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use support::Proc;

use bytes::Bytes;
use futures_util::StreamExt;
use greendot_client::rustls::pki_types::pem::PemObject;
use greendot_client::rustls::pki_types::CertificateDer;
use greendot_client::{Client, ClientConfig, Event, Updates};
use greendot_cluster::testing::NatsCluster;
use greendot_cluster::{Envelope, MessageKey, RequestKind};
use greendot_core::{Presence, Status, Tier};
use greendot_proto::Kind;
use greendot_server::cluster::{ShardView, ToOwner, WireOp};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};

const BIN: &str = env!("CARGO_BIN_EXE_greendot");
const SHARDS: u32 = 64;
const DEBOUNCE: Duration = Duration::from_millis(300);
/// A loaded 2-core machine, NATS round trips, process start.
const SLACK: Duration = Duration::from_secs(8);
const SECRET: &str = "0123456789abcdef0123456789abcdef";

struct Node {
    id: String,
    /// Killed when dropped.
    proc: Proc,
    addr: SocketAddr,
    metrics: String,
    cert: CertificateDer<'static>,
}

fn serve(dir: &Path, urls: &str, id: &str) -> Node {
    serve_as(dir, urls, id, &[])
}

/// [`serve`] with these environment variables (NATS credentials).
fn serve_as(dir: &Path, urls: &str, id: &str, env: &[(&str, &str)]) -> Node {
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
        .args(["--cluster", urls, "--node-id", id])
        .args(["--cluster-shards", &SHARDS.to_string()])
        .args(["--cluster-lease-ttl", "2s", "--cluster-replicas", "1"])
        .args(["--debounce", &format!("{}ms", DEBOUNCE.as_millis())])
        .envs(env.iter().copied())
        // Claims at info: tests wait on them (`until_claimed`).
        .env("RUST_LOG", "warn,greendot_cluster::node=info");
    let mut proc = Proc::spawn(id, command);
    let addr = proc.listening_addr(SLACK);
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

fn dropped(node: &Node, reason: &str) -> u64 {
    let name = format!("greendot_cluster_rejected_total{{reason=\"{reason}\"}}");
    support::metric(&node.metrics, &name)
        .unwrap_or_else(|| panic!("no {name} on {}'s metrics", node.id))
}

async fn connect(nodes: &[&Node], at: &Node, user: &str, device: &str) -> (Client, Updates) {
    let claims = Claims::new(
        user,
        device,
        Kind::Mobile,
        WatchClaim::all(),
        Duration::from_secs(3600),
    );
    connect_with(nodes, at, claims).await
}

async fn connect_with(nodes: &[&Node], at: &Node, claims: Claims) -> (Client, Updates) {
    let (user, device) = (claims.sub.clone(), claims.dev.clone());
    let token = TokenKeys::new(SECRET.as_bytes(), Duration::ZERO)
        .mint(&claims)
        .unwrap();
    let roots: Vec<_> = nodes.iter().map(|n| n.cert.clone()).collect();
    let mut config = ClientConfig::new(at.addr, roots, token);
    config.reconnect = None;
    config.websocket = greendot_client::WebSocket::Off;
    Client::connect(config)
        .await
        .unwrap_or_else(|e| panic!("{user}/{device} cannot connect to {}: {e}", at.id))
}

/// The next presence of alice that satisfies `pred`, within `within`.
async fn wait_alice(
    updates: &mut Updates,
    within: Duration,
    what: &str,
    pred: impl Fn(&Presence) -> bool,
) -> Presence {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, updates.next()).await {
            Ok(Some(Event::Presence {
                target, presence, ..
            })) if target == "alice" => {
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

/// No presence of alice at all arrives for `after`.
async fn alice_unchanged(updates: &mut Updates, what: &str, after: Duration) {
    let deadline = tokio::time::Instant::now() + after;
    while let Ok(event) = tokio::time::timeout_at(deadline, updates.next()).await {
        if let Some(Event::Presence {
            target, presence, ..
        }) = event
        {
            assert!(target != "alice", "{what}: alice changed: {presence:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_views_and_inputs_change_nothing_and_are_counted() {
    let nats = NatsCluster::start(1).await;
    let urls = nats.urls();
    let dir = support::temp_dir("cluster-trust");
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    let a = serve(&dir, &urls, "a");
    let b = serve(&dir, &urls, "b");
    let nodes = [&a, &b];

    // A client of the same NATS without the token secret; it listens on
    // alice's shard to copy a genuine view.
    let raw = async_nats::connect(urls.clone()).await.unwrap();
    let shard = greendot_cluster::shard_of("alice", SHARDS);
    let view_subject = format!("gd.shard.{}", shard.0);
    let mut genuine_views = raw.subscribe(view_subject.clone()).await.unwrap();
    // Subscribed at the server once it answers a request after it (flush
    // only writes the client's buffer out).
    let barrier = raw.request("barrier.none", Bytes::new()).await;
    assert!(barrier.is_err(), "nobody serves barrier.none");

    // Alice online on a, watched from a and from b.
    let (alice, _alice_updates) = connect(&nodes, &a, "alice", "phone").await;
    let mut watchers = Vec::new();
    for (at, user) in [(&a, "carol"), (&b, "bob")] {
        let (client, mut updates) = connect(&nodes, at, user, "laptop").await;
        client.subscribe(&["alice"], Tier::Realtime).await.unwrap();
        let seen = wait_alice(&mut updates, SLACK, "alice online", |p| p.online).await;
        watchers.push((client, updates, seen.version));
    }
    let genuine = tokio::time::timeout(SLACK, genuine_views.next())
        .await
        .expect("a genuine view of alice's shard")
        .unwrap()
        .payload;
    let before: Vec<(u64, u64, u64)> = nodes
        .iter()
        .map(|n| {
            (
                dropped(n, "forged"),
                dropped(n, "version"),
                dropped(n, "malformed"),
            )
        })
        .collect();

    let stranger = Envelope::new(MessageKey::derive(b"not the cluster's secret"));
    let forged_view = postcard::to_stdvec(&ShardView {
        epoch: u64::MAX / 2,
        seq: 1,
        published_ms: greendot_cluster::unix_ms(),
        user: "alice".into(),
        own: false,
        presence: greendot_proto::Presence {
            version: u64::MAX / 2,
            online: false,
            status: Default::default(),
            message: None,
            kinds: 0,
            last_seen: Some(1),
            invisible: false,
        },
    })
    .unwrap();
    let input_subject = format!("gd.req.{}.{}", shard.0, RequestKind::Input.token());
    let input = |rid: u64, op: WireOp| {
        postcard::to_stdvec(&ToOwner::Device {
            edge: "a".into(),
            incarnation: u64::MAX / 2,
            rid,
            conn: 1,
            user: "alice".into(),
            device: "phone".into(),
            op,
        })
        .unwrap()
    };
    let (logout, invisible) = (
        input(1, WireOp::Logout),
        input(2, WireOp::SetInvisible(true)),
    );
    let b_edge = "gd.edge.b".to_string();
    // Forged (another key): a view to both nodes' watchers of the shard, a
    // logout to the owner, a genuine view copied onto b's edge subject.
    let forgeries = [
        (&view_subject, stranger.seal(&view_subject, &forged_view)),
        (&input_subject, stranger.seal(&input_subject, &logout)),
        (&b_edge, genuine.clone()),
        // Unsigned, as before the envelope (dropped for their version).
        (&view_subject, Bytes::from(forged_view.clone())),
        (&input_subject, Bytes::from(invisible.clone())),
    ];
    for (subject, payload) in forgeries {
        raw.publish(subject.clone(), payload).await.unwrap();
    }
    raw.flush().await.unwrap();

    // Nothing changed for either watcher: a forged view arrives within
    // milliseconds, a forged input that got through would be published
    // after the debounce.
    for (_, updates, _) in watchers.iter_mut() {
        alice_unchanged(updates, "after the forgeries", DEBOUNCE + SLACK / 4).await;
    }

    // Every forgery is counted where it arrived: the view by both nodes
    // (each has a watcher of the shard), the input by the shard's owner,
    // the copy by b. The unsigned ones start with a byte that is no
    // version this build reads (postcard's first varint byte).
    let expected_forged = 2 + 1 + 1;
    let expected_other = 2 + 1;
    let t0 = std::time::Instant::now();
    let totals = loop {
        let now: Vec<(u64, u64, u64)> = nodes
            .iter()
            .map(|n| {
                (
                    dropped(n, "forged"),
                    dropped(n, "version"),
                    dropped(n, "malformed"),
                )
            })
            .collect();
        let forged: u64 = now.iter().zip(&before).map(|(n, b)| n.0 - b.0).sum();
        let other: u64 = now
            .iter()
            .zip(&before)
            .map(|(n, b)| n.1 + n.2 - b.1 - b.2)
            .sum();
        if (forged, other) == (expected_forged, expected_other) || t0.elapsed() > SLACK {
            break (forged, other);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(totals, (expected_forged, expected_other), "dropped counts");

    // Alice's next real change reaches both, above the versions they had:
    // the forged huge version poisoned nothing.
    alice.set_status(Status::Busy, None).await.unwrap();
    for (_, updates, version) in watchers.iter_mut() {
        let busy = wait_alice(updates, SLACK, "alice busy", |p| {
            p.online && p.status == Status::Busy
        })
        .await;
        assert!(busy.version > *version && busy.version < u64::MAX / 2);
    }
    drop(nats);
}

/// `greendot cluster status` against `urls` with these extra arguments and
/// environment: (success, stdout and stderr).
fn status(urls: &str, env: &[(&str, &str)]) -> (bool, String) {
    let mut command = Command::new(BIN);
    command.args(["cluster", "status", "--cluster", urls]);
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("greendot cluster status");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Waits on a node's log until it has claimed each of `shards`: its
/// `claimed shard shard=N` lines (greendot_cluster::node at info) are the
/// claims succeeding.
fn until_claimed(node: &mut Proc, shards: impl IntoIterator<Item = u32>) {
    let claimed = |line: &str| -> Option<u32> {
        let line = plain(line);
        let rest = line.split("claimed shard shard=").nth(1)?;
        rest.split_whitespace().next()?.parse().ok()
    };
    let mut missing: std::collections::BTreeSet<u32> = shards.into_iter().collect();
    // Claims logged while the test waited for other lines are in `seen`.
    for line in &node.seen {
        if let Some(shard) = claimed(line) {
            missing.remove(&shard);
        }
    }
    while !missing.is_empty() {
        let line = node.wait_for(SLACK, "claiming its shards", |l| claimed(l).is_some());
        if let Some(shard) = claimed(&line) {
            missing.remove(&shard);
        }
    }
}

/// A log line without its ANSI colours.
fn plain(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ parameters final-letter
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The shards rendezvous placement gives `node` among `live`.
fn share_of(node: &str, live: &[&str]) -> Vec<u32> {
    let live: Vec<greendot_cluster::NodeId> = live
        .iter()
        .map(|n| greendot_cluster::NodeId::new(*n).unwrap())
        .collect();
    (0..SHARDS)
        .filter(|s| {
            greendot_cluster::rendezvous_owner(greendot_cluster::ShardId(*s), &live)
                .is_some_and(|owner| owner.as_str() == node)
        })
        .collect()
}

/// `cluster status` (with `env`) succeeds and its text satisfies `holds`.
fn assert_status(urls: &str, env: &[(&str, &str)], what: &str, holds: impl Fn(&str) -> bool) {
    let (ok, text) = status(urls, env);
    assert!(ok && holds(&text), "{what}: {text}");
}

/// NATS requiring a user and password: a node given them (in the
/// environment) joins and owns every shard; `cluster status` without them
/// fails with NATS's reason, with them shows the node; `--print-config`
/// and the node's output never show the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_a_nats_that_requires_a_password_given_it() {
    const PASSWORD: &str = "pa55-for-nats";
    let nats = NatsCluster::start_with_user(1, "greendot", PASSWORD).await;
    let urls = nats.urls();
    let dir = support::temp_dir("cluster-trust-auth");
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    let creds = [
        ("GREENDOT_NATS_USER", "greendot"),
        ("GREENDOT_NATS_PASSWORD", PASSWORD),
    ];

    let printed = Command::new(BIN)
        .args([
            "serve",
            "--print-config",
            "--cluster",
            &urls,
            "--node-id",
            "a",
        ])
        .envs(creds)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&printed.stdout).into_owned();
    assert!(
        printed.contains("nats_user = \"greendot\"")
            && printed.contains("# nats_password is set (not printed)")
            && !printed.contains(PASSWORD),
        "{printed}"
    );

    let (ok, text) = status(&urls, &[]);
    assert!(!ok, "status without credentials: {text}");
    assert!(
        text.contains("cannot read the cluster at")
            && text.to_lowercase().contains("authorization violation"),
        "{text}"
    );

    let data = dir.join("a");
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
        .args(["--cluster", &urls, "--node-id", "a"])
        .args(["--cluster-shards", &SHARDS.to_string()])
        .args(["--cluster-lease-ttl", "2s", "--cluster-replicas", "1"])
        .envs(creds)
        .env("RUST_LOG", "info");
    let mut node = Proc::spawn("a", command);
    node.wait_for(SLACK, "joined", |l| l.starts_with("cluster node a on NATS"));
    until_claimed(&mut node, 0..SHARDS);
    assert_status(&urls, &creds, "not every shard owned", |t| {
        t.contains("shards: 64, owned 64, unowned 0")
    });
    node.drain();
    assert!(
        node.seen.iter().all(|l| !l.contains(PASSWORD)),
        "{:?}",
        node.seen
    );
}

/// The NATS account of docs/cluster.md ("Trust boundary"), read from the
/// document itself with these passwords: two nodes as user `node` join,
/// own every shard and carry alice's presence from one to the other, and a
/// group written at one is changed at the other;
/// `greendot cluster status` runs as the read-only `status`; NATS refuses
/// `app` a publish on greendot's subjects; and NATS logs no permission
/// violation of `node` or `status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_nats_permissions_suffice_and_keep_others_out() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/cluster.md"))
        .expect("docs/cluster.md");
    let after = doc
        .split("A NATS account for greendot alone")
        .nth(1)
        .expect("the account in docs/cluster.md");
    let config = after
        .split("```")
        .nth(1)
        .expect("its configuration block")
        .replace(
            "{ user: node, password: \"…\"",
            "{ user: node, password: \"node-pw\"",
        )
        .replace(
            "{ user: status, password: \"…\"",
            "{ user: status, password: \"status-pw\"",
        )
        .replace(
            "{ user: app, password: \"…\"",
            "{ user: app, password: \"app-pw\"",
        );
    assert!(
        !config.contains('…'),
        "a user of the document not given a password:\n{config}"
    );
    let nats = NatsCluster::start_with_config(1, &config, "node", "node-pw").await;
    let urls = nats.urls();
    let dir = support::temp_dir("cluster-trust-permissions");
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    let as_node = [
        ("GREENDOT_NATS_USER", "node"),
        ("GREENDOT_NATS_PASSWORD", "node-pw"),
    ];
    let mut a = serve_as(&dir, &urls, "a", &as_node);
    let mut b = serve_as(&dir, &urls, "b", &as_node);
    // Placed: each node holds its rendezvous share (b's claims succeed only
    // once a has released them).
    until_claimed(&mut a.proc, share_of("a", &["a", "b"]));
    until_claimed(&mut b.proc, share_of("b", &["a", "b"]));
    let nodes = [&a, &b];

    let as_status = [
        ("GREENDOT_NATS_USER", "status"),
        ("GREENDOT_NATS_PASSWORD", "status-pw"),
    ];
    assert_status(&urls, &as_status, "status as `status`", |t| {
        t.contains("nodes: 2") && t.contains("owned 64, unowned 0")
    });

    // alice on a, watched from b and from a: her presence crosses nodes.
    let (_alice, _alice_updates) = connect(&nodes, &a, "alice", "phone").await;
    let mut watchers = Vec::new();
    for (at, user) in [(&b, "bob"), (&a, "carol")] {
        let (client, mut updates) = connect(&nodes, at, user, "laptop").await;
        client.subscribe(&["alice"], Tier::Realtime).await.unwrap();
        wait_alice(&mut updates, SLACK, "alice online", |p| p.online).await;
        watchers.push((client, updates));
    }

    // A backend writes a group at a and changes it at b: the groups bucket.
    let service = Claims::new(
        "backend",
        "svc",
        Kind::Other,
        WatchClaim::all(),
        Duration::from_secs(3600),
    )
    .service();
    let (svc_a, _) = connect_with(&nodes, &a, service.clone()).await;
    let (svc_b, _) = connect_with(&nodes, &b, service).await;
    assert_eq!(svc_a.set_group(7, &["alice"], &["bob"]).await.unwrap(), 1);
    let carol = greendot_client::GroupChange {
        add: vec!["carol".into()],
        expect_version: Some(1),
        ..Default::default()
    };
    assert_eq!(svc_b.change_group(7, carol).await.unwrap(), 2);

    // `app`, in the same account, may not publish on greendot's subjects.
    let app = async_nats::ConnectOptions::new()
        .user_and_password("app".into(), "app-pw".into())
        .connect(urls.clone())
        .await
        .unwrap();
    let shard = greendot_cluster::shard_of("alice", SHARDS);
    app.publish(
        format!("gd.shard.{}", shard.0),
        Bytes::from_static(b"forged"),
    )
    .await
    .unwrap();
    app.flush().await.unwrap();
    let log = nats.dir().join("n0.log");
    let refused = format!(
        "\"GREENDOT/user:app\" - Publish Violation - Subject \"gd.shard.{}\"",
        shard.0
    );
    let t0 = std::time::Instant::now();
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(&refused) {
            break text;
        }
        assert!(
            t0.elapsed() < SLACK,
            "NATS did not refuse app's publish:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for user in ["node", "status"] {
        let denied = format!("\"GREENDOT/user:{user}\" - ");
        assert!(
            !text
                .lines()
                .any(|l| l.contains(&denied) && l.contains("Violation")),
            "a permission {user} needs is missing:\n{text}"
        );
    }
    // Refused by NATS: no node ever saw it.
    for node in nodes {
        for reason in ["forged", "version", "malformed"] {
            assert_eq!(dropped(node, reason), 0, "{} {reason}", node.id);
        }
    }
}

/// A CA, and certificates it signed for `names` (PEM certificate, PEM key).
struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    fn new() -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "greendot test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        TestCa {
            issuer: rcgen::CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    fn sign(&self, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let params = rcgen::CertificateParams::new(names).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// NATS over TLS that verifies its clients' certificates: a node given the
/// CA, a client certificate and `--nats-require-tls` joins and owns every
/// shard; without the CA, or without the client certificate, `cluster
/// status` fails with the TLS reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_a_nats_over_tls_with_a_client_certificate() {
    let dir = support::temp_dir("cluster-trust-tls");
    std::fs::write(dir.join("secret"), SECRET).unwrap();
    let ca = TestCa::new();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let ca_pem = write("ca.pem", &ca.issuer.pem());
    let (server_cert, server_key) = ca.sign(&["127.0.0.1", "localhost"]);
    let (client_cert, client_key) = ca.sign(&["greendot-node"]);
    let (server_cert, server_key) = (
        write("server.pem", &server_cert),
        write("server.key", &server_key),
    );
    let (client_cert, client_key) = (
        write("client.pem", &client_cert),
        write("client.key", &client_key),
    );
    let config = write(
        "nats.conf",
        &format!(
            "tls {{\n  cert_file: \"{server_cert}\"\n  key_file: \"{server_key}\"\n  \
             ca_file: \"{ca_pem}\"\n  verify: true\n}}\n"
        ),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let binary = greendot_cluster::testing::nats_server_binary().unwrap();
    let mut command = Command::new(binary);
    command
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir.join("js"))
        .args(["-c", &config]);
    let mut nats = Proc::spawn("nats", command);
    nats.wait_for(SLACK, "ready", |l| l.contains("Server is ready"));
    let urls = format!("nats://127.0.0.1:{port}");

    let tls = [
        ("GREENDOT_NATS_TLS_CA", ca_pem.as_str()),
        ("GREENDOT_NATS_TLS_CERT", client_cert.as_str()),
        ("GREENDOT_NATS_TLS_KEY", client_key.as_str()),
        ("GREENDOT_NATS_REQUIRE_TLS", "true"),
    ];
    let (ok, text) = status(&urls, &[]);
    assert!(!ok && text.contains("UnknownIssuer"), "no CA: {text}");
    let (ok, text) = status(&urls, &tls[..1]);
    assert!(
        !ok && text.contains("connecting to NATS at"),
        "no client certificate: {text}"
    );
    // Connected, and no node ran yet.
    let (ok, text) = status(&urls, &tls);
    assert!(
        !ok && text.contains("no greendot cluster on this NATS"),
        "{text}"
    );

    let mut a = serve_as(&dir, &urls, "a", &tls);
    until_claimed(&mut a.proc, 0..SHARDS);
    assert_status(&urls, &tls, "not every shard owned", |t| {
        t.contains("shards: 64, owned 64, unowned 0")
    });
}
