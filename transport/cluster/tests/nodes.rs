//! Live tests of the node duty task (`Node`): three greendot nodes on a real
//! 3-node NATS cluster (R3 buckets). TTLs are 2 s; every bound is derived
//! from them, plus `EXPIRY_SLACK` where NATS itself must expire a key.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use greendot_cluster::testing::NatsCluster;
use greendot_cluster::{
    observe, rendezvous_owner, ClusterConfig, ClusterView, Node, NodeExit, NodeId, NodePhase,
    ShardId,
};

const SHARDS: u32 = 64;
const LEASE_TTL: Duration = Duration::from_secs(2);
const CLAIM_TTL: Duration = Duration::from_secs(2);
const MARGIN: Duration = Duration::from_millis(500);
const OP_TIMEOUT: Duration = Duration::from_millis(500);
/// How late after a key's TTL NATS may report its expiry (it checks TTLs on
/// a timer; measured about 0.2–1 s late).
const EXPIRY_SLACK: Duration = Duration::from_secs(5);

fn config(node: &str) -> ClusterConfig {
    let mut c = ClusterConfig::new(NodeId::new(node).unwrap());
    c.replicas = 3;
    c.shard_count = SHARDS;
    c.lease_ttl = LEASE_TTL;
    c.claim_ttl = CLAIM_TTL;
    c.margin = MARGIN;
    c.marker_ttl = Duration::from_secs(1);
    c.op_timeout = OP_TIMEOUT;
    c
}

async fn start(urls: &str, node: &str) -> Node {
    // RUST_LOG=greendot_cluster=debug shows what the nodes do.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let cluster = greendot_cluster::testing::connect_retrying(urls, config(node), STARTUP).await;
    Node::start(
        cluster,
        format!("{node}.example:4433"),
        greendot_cluster::unix_ms(),
    )
    .await
    .unwrap()
}

/// How long a test's first connection may keep failing while the fresh
/// cluster makes its buckets.
const STARTUP: Duration = Duration::from_secs(20);

fn ids(names: &[&str]) -> Vec<NodeId> {
    names.iter().map(|n| NodeId::new(*n).unwrap()).collect()
}

/// Polls the cluster until `done` holds for its view; panics after `within`.
async fn until(
    urls: &str,
    within: Duration,
    what: &str,
    done: impl Fn(&ClusterView) -> bool,
) -> (ClusterView, Duration) {
    let t0 = Instant::now();
    let mut last = None;
    while t0.elapsed() < within {
        if let Ok(view) = observe(urls, &Default::default(), "gd", OP_TIMEOUT).await {
            if done(&view) {
                return (view, t0.elapsed());
            }
            last = Some(view);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within {within:?}; last view {last:#?}");
}

/// Every shard claimed once, by the node rendezvous placement gives it to
/// among `live`.
fn placed_over(view: &ClusterView, live: &[NodeId]) -> bool {
    (0..SHARDS).all(|s| {
        let shard = ShardId(s);
        let want = rendezvous_owner(shard, live.iter());
        view.claims.get(&shard).map(|c| &c.owner) == want
    })
}

fn epochs(view: &ClusterView) -> BTreeMap<ShardId, (NodeId, u64)> {
    view.claims
        .iter()
        .map(|(s, c)| (*s, (c.owner.clone(), c.epoch)))
        .collect()
}

/// How long the nodes may take to claim a fresh cluster: a few renewal
/// periods and operation timeouts.
fn settle_bound() -> Duration {
    LEASE_TTL * 3 + OP_TIMEOUT * 4
}

/// The node's next status; panics, naming `what` and the last status, when
/// none comes before `deadline` (a stuck node fails the test, not CI).
async fn next_status(
    status: &mut tokio::sync::watch::Receiver<greendot_cluster::NodeStatus>,
    deadline: Instant,
    what: &str,
) -> greendot_cluster::NodeStatus {
    match tokio::time::timeout_at(deadline.into(), status.changed()).await {
        Ok(changed) => {
            changed.expect("the duty task keeps its status channel open");
            status.borrow().clone()
        }
        Err(_) => panic!(
            "{what}: not by the deadline; last status {:#?}",
            *status.borrow()
        ),
    }
}

/// One test at a time: each runs a 3-node NATS cluster with R3 buckets, and
/// two of them side by side on 2 cores slowed a drain's claim releases past
/// their bound now and then (the rest then expired on their TTL, which is
/// what the drain test asserts does not happen).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_spread_over_three_nodes_then_a_crash_and_a_drain_hand_them_over() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let a = start(&urls, "a").await;
    let b = start(&urls, "b").await;
    let c = start(&urls, "c").await;
    let all = ids(&["a", "b", "c"]);

    let (view, took) = until(&urls, settle_bound(), "spread over a, b, c", |v| {
        placed_over(v, &all)
    })
    .await;
    eprintln!("3 nodes placed all {SHARDS} shards in {took:?}");
    let per_node = view.owned_by();
    for node in &all {
        let n = per_node.get(node).map_or(0, Vec::len) as u32;
        // Rendezvous hashing: about a third each.
        assert!(
            (SHARDS / 6..=SHARDS / 2).contains(&n),
            "{node} owns {n} of {SHARDS}"
        );
    }
    assert_eq!(view.nodes.len(), 3);
    let info = view.nodes[0]
        .info
        .as_ref()
        .expect("lease carries node info");
    assert_eq!(info.advertise, "a.example:4433");
    assert_eq!(info.shard_count, SHARDS);
    // Each node's own status agrees with the KV.
    for (node, handle) in [(&all[0], &a), (&all[1], &b), (&all[2], &c)] {
        let status = handle.status().borrow().clone();
        assert_eq!(status.phase, NodePhase::Active);
        let mine: Vec<ShardId> = per_node[node].iter().map(|(s, _)| *s).collect();
        assert_eq!(status.shards.keys().copied().collect::<Vec<_>>(), mine);
        assert!(status.shards_acting(Instant::now()) == mine.len());
        assert!(status.render_metrics(Instant::now()).contains(&format!(
            "greendot_cluster_shards_owned{{node=\"{node}\"}} {}",
            mine.len()
        )));
    }

    // kill -9 of c: its shards go to a and b within its lease TTL plus the
    // time NATS may take to expire the keys, each with a higher epoch.
    let before = epochs(&view);
    c.crash();
    let ab = ids(&["a", "b"]);
    let (view, took) = until(
        &urls,
        LEASE_TTL + EXPIRY_SLACK,
        "takeover after a crash",
        |v| placed_over(v, &ab),
    )
    .await;
    eprintln!("kill -9 of c: its shards owned by a and b again {took:?} after");
    assert!(
        took >= CLAIM_TTL - MARGIN - OP_TIMEOUT,
        "shards moved before c's claims could expire ({took:?})"
    );
    for (shard, (owner, epoch)) in epochs(&view) {
        let (old_owner, old_epoch) = &before[&shard];
        if old_owner.as_str() == "c" {
            assert!(
                epoch > *old_epoch,
                "shard {shard}: epoch {epoch} not above {old_epoch}"
            );
        } else {
            assert_eq!(
                (&owner, epoch),
                (old_owner, *old_epoch),
                "shard {shard} moved"
            );
        }
    }
    assert_eq!(view.nodes.len(), 2, "c's lease expired");

    // SIGTERM-like drain of b: its claims and lease are deleted at once, so
    // a takes its shards before any of them could have expired.
    let before = epochs(&view);
    let left_at = Instant::now();
    assert_eq!(b.leave().await.unwrap(), NodeExit::Left);
    let (view, took) = until(&urls, settle_bound(), "takeover after a drain", |v| {
        placed_over(v, &ids(&["a"]))
    })
    .await;
    let took = left_at.elapsed().max(took);
    eprintln!("drain of b: all shards owned by a {took:?} after leave() began");
    let renew_every = (CLAIM_TTL - MARGIN) / 3;
    assert!(
        took < CLAIM_TTL - renew_every,
        "took {took:?}: as long as waiting for the TTL"
    );
    for (shard, (_, epoch)) in epochs(&view) {
        if before[&shard].0.as_str() == "b" {
            assert!(epoch > before[&shard].1);
        }
    }
    // The KV shows a's claims before a's status does (it is published once
    // the round of claims is over).
    let mut status = a.status();
    let a_status = tokio::time::timeout(
        settle_bound(),
        status.wait_for(|s| s.shards.len() == SHARDS as usize),
    )
    .await
    .map(|s| s.map(|s| s.clone()))
    .unwrap_or_else(|_| Ok(status.borrow().clone()))
    .expect("a's status");
    assert_eq!(a_status.shards.len(), SHARDS as usize);
    assert!(a_status.epoch_changes >= u64::from(SHARDS) / 2);
    assert!(a_status.lease_renewals > 0);
    a.leave().await.unwrap();
    let (view, _) = until(&urls, settle_bound(), "all released", |v| {
        v.claims.is_empty() && v.nodes.is_empty()
    })
    .await;
    assert!(view.owned_by().is_empty());
}

/// A node cut off from NATS reports `CutOff` before NATS can expire its
/// lease, having stopped acting for every shard first; it does not end:
/// once its NATS node is back it takes a lease again and owns shards again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_nats_stops_owning_then_rejoins_when_nats_is_back() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let mut nats = NatsCluster::start(3).await;
    let _buckets =
        greendot_cluster::testing::connect_retrying(&nats.url(0), config("setup"), STARTUP).await;
    let leaders = [
        nats.stream_leader("gd_leases").await,
        nats.stream_leader("gd_claims").await,
    ];
    let k = (0..3).find(|i| !leaders.contains(i)).unwrap();
    let others: String = (0..3)
        .filter(|i| *i != k)
        .map(|i| nats.url(i))
        .collect::<Vec<_>>()
        .join(",");
    let a = start(&others, "a").await;
    // c knows only NATS node k: killing k cuts it off.
    let c = start(&nats.url(k), "c").await;
    let ac = ids(&["a", "c"]);
    until(&others, settle_bound(), "spread", |v| placed_over(v, &ac)).await;
    let mut status = c.status();
    let held_before = status.borrow().shards.len();
    assert!(held_before > 0);

    let killed_at = Instant::now();
    nats.kill(k);
    // The first status without shards, then the cut-off.
    let mut stopped_owning = None;
    let cut_off = loop {
        let s = next_status(&mut status, killed_at + LEASE_TTL * 2, "cut off").await;
        if s.shards.is_empty() && stopped_owning.is_none() {
            stopped_owning = Some(Instant::now());
        }
        if s.phase == NodePhase::CutOff {
            assert!(s.shards.is_empty(), "cut off while still owning");
            break Instant::now();
        }
    };
    let stopped_owning = stopped_owning.unwrap();
    assert!(stopped_owning <= cut_off);
    // The lease's last renewal was sent at most one renewal period before
    // the kill, so NATS cannot expire it before kill + (TTL - renew_every).
    let renew_every = (LEASE_TTL - MARGIN) / 3;
    assert!(
        cut_off - killed_at < LEASE_TTL - renew_every,
        "told to drain {:?} after the cut, after the lease could expire",
        cut_off - killed_at
    );
    eprintln!(
        "cut off: stopped owning {:?}, cut off {:?} after the kill",
        stopped_owning - killed_at,
        cut_off - killed_at
    );
    assert_eq!(status.borrow().cut_offs, 1);

    // c's NATS client may also find the other NATS nodes (they gossip
    // their addresses) before k is back: either way c takes a lease again
    // and owns its shards again.
    let back_at = Instant::now();
    nats.restart(k);
    let rejoined = loop {
        let s = next_status(
            &mut status,
            back_at + settle_bound() + EXPIRY_SLACK,
            "rejoined and owning",
        )
        .await;
        if s.phase == NodePhase::Active && !s.shards.is_empty() {
            break s;
        }
    };
    assert_eq!(rejoined.rejoins, 1);
    until(&others, settle_bound(), "spread again", |v| {
        placed_over(v, &ac)
    })
    .await;
    eprintln!(
        "rejoined and owning {:?} after NATS was back",
        back_at.elapsed()
    );
    assert_eq!(c.leave().await.unwrap(), NodeExit::Left);
    a.leave().await.unwrap();
}
