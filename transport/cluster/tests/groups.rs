//! Live tests of the groups bucket against a real nats-server (one node,
//! R1), started by `greendot_cluster::testing`.

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::StreamExt;
use greendot_cluster::testing::{connect_retrying, NatsCluster};
use greendot_cluster::{
    Cluster, ClusterConfig, ClusterError, Envelope, GroupDef, GroupDefect, GroupEvent, MessageKey,
    NodeId,
};

const STARTUP: Duration = Duration::from_secs(20);
/// How long a watch may take to bring a write made after it started.
const DELIVERY: Duration = Duration::from_secs(5);

fn config(node: &str) -> ClusterConfig {
    let mut c = ClusterConfig::new(NodeId::new(node).unwrap());
    c.replicas = 1;
    c.shard_count = 16;
    c
}

async fn connect(urls: &str, node: &str) -> Cluster {
    connect_retrying(urls, config(node), STARTUP).await
}

/// `n` members with names of `len` bytes, ordinals 1..=n.
fn def(group: u64, membership: u64, n: u32, len: usize, tag: &str) -> GroupDef {
    let members = (1..=n)
        .map(|i| {
            let mut name = format!("{tag}{i:06}-");
            name.push_str(&"m".repeat(len - name.len()));
            (name, i)
        })
        .collect();
    GroupDef {
        group,
        membership,
        next_ordinal: n + 1,
        members,
        admins: vec![format!("{tag}000001-")],
        removed: false,
    }
}

/// The chunk keys stored for `group`, as (nonce, index).
async fn chunk_keys(cluster: &Cluster, group: u64) -> BTreeSet<(u64, u16)> {
    let js = async_nats::jetstream::new(cluster.client().clone());
    let store = js.get_key_value("gd_groups").await.unwrap();
    let mut keys = store.keys().await.unwrap();
    let prefix = format!("c.{group}.");
    let mut out = BTreeSet::new();
    while let Some(key) = keys.next().await {
        let key = key.unwrap();
        if let Some(rest) = key.strip_prefix(&prefix) {
            let (nonce, i) = rest.split_once('.').unwrap();
            out.insert((nonce.parse().unwrap(), i.parse().unwrap()));
        }
    }
    out
}

/// The groups stream's last sequence (purges do not move it).
async fn last_sequence(cluster: &Cluster) -> u64 {
    let js = async_nats::jetstream::new(cluster.client().clone());
    let mut stream = js.get_stream("KV_gd_groups").await.unwrap();
    stream.info().await.unwrap().state.last_sequence
}

/// Every chunk stored for `group` belongs to one write, numbered from 0:
/// no loser's and no replaced write's chunks are left.
async fn assert_one_write_of_chunks(cluster: &Cluster, group: u64, at_least: u16) {
    let keys = chunk_keys(cluster, group).await;
    let nonces: BTreeSet<u64> = keys.iter().map(|(n, _)| *n).collect();
    assert_eq!(nonces.len(), 1, "chunks of several writes: {keys:?}");
    let indices: Vec<u16> = keys.iter().map(|(_, i)| *i).collect();
    assert_eq!(indices, (0..indices.len() as u16).collect::<Vec<_>>());
    assert!(indices.len() >= at_least as usize, "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_group_writers_one_wins_and_the_losers_chunks_are_gone() {
    let nats = NatsCluster::start(1).await;
    let a = connect(&nats.url(0), "a").await;
    let b = connect(&nats.url(0), "b").await;
    let group = 17;
    assert_eq!(a.read_group(group).await.unwrap(), None);

    let mut expected = 0;
    let mut conflicts_after_chunks = 0;
    for round in 1..=4u64 {
        // 3,000 names of 128 bytes: ~400 KB, in two chunks.
        let from_a = def(group, round, 3_000, 128, "a");
        let from_b = def(group, round, 3_000, 128, "b");
        let (ra, rb) = tokio::join!(
            a.write_group_if(&from_a, expected),
            b.write_group_if(&from_b, expected)
        );
        let (revision, winner) = match (ra, rb) {
            (Ok(r), Err(ClusterError::Conflict { .. })) => (r, from_a),
            (Err(ClusterError::Conflict { .. }), Ok(r)) => (r, from_b),
            other => panic!("round {round}: not one winner: {other:?}"),
        };
        assert!(revision > expected);
        // Read through the other connection: the chunks round-trip.
        let (read_rev, read) = b.read_group(group).await.unwrap().unwrap();
        assert_eq!((read_rev, &read), (revision, &winner));
        // The loser's chunks were purged (if it wrote any before its
        // compare-and-set failed), and so were the previous header's.
        assert_one_write_of_chunks(&a, group, 2).await;
        // Five messages since the last round (two writes of two chunks and
        // one header): the loser wrote its chunks before it lost.
        if last_sequence(&a).await - expected == 5 {
            conflicts_after_chunks += 1;
        }
        expected = revision;
    }
    // Whether a loser got as far as its chunks before it lost depends on
    // the scheduling (usually it does): either way no chunk of it is left,
    // which is what the rounds check. Not asserted, so the test cannot
    // fail on a machine that runs one writer ahead of the other.
    println!("{conflicts_after_chunks} of 4 losers wrote chunks before they lost");

    // A stale expected revision: refused before any chunk is written.
    let stale = def(group, 9, 3_000, 128, "c");
    assert!(matches!(
        a.write_group_if(&stale, expected - 1).await,
        Err(ClusterError::Conflict { .. })
    ));
    assert!(matches!(
        a.write_group_if(&stale, 0).await,
        Err(ClusterError::Conflict { .. })
    ));
    assert_one_write_of_chunks(&a, group, 2).await;

    // Over the configured limits: refused, nothing stored.
    let huge = def(group, 10, 10_001, 20, "d");
    assert!(matches!(
        a.write_group_if(&huge, expected).await,
        Err(ClusterError::GroupRefused { group: 17, .. })
    ));
    assert_eq!(a.read_group(group).await.unwrap().unwrap().0, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tombstone_keeps_membership_and_the_watch_syncs_then_follows() {
    let nats = NatsCluster::start(1).await;
    let a = connect(&nats.url(0), "a").await;
    let b = connect(&nats.url(0), "b").await;

    // An empty bucket: the watch is synced at once.
    let mut watch = b.watch_groups().await.unwrap();
    let first = tokio::time::timeout(DELIVERY, watch.next()).await.unwrap();
    assert_eq!(first.unwrap().unwrap(), GroupEvent::Synced);

    let one = def(1, 5, 10, 16, "u");
    let r1 = a.write_group_if(&one, 0).await.unwrap();
    let seen = tokio::time::timeout(DELIVERY, watch.next()).await.unwrap();
    assert_eq!(
        seen.unwrap().unwrap(),
        GroupEvent::Changed {
            group: 1,
            revision: r1,
            def: Some(one.clone())
        }
    );

    // Removed: a tombstone that keeps the membership version.
    let gone = GroupDef::tombstone(1, 6, one.next_ordinal);
    let r2 = a.write_group_if(&gone, r1).await.unwrap();
    let seen = tokio::time::timeout(DELIVERY, watch.next()).await.unwrap();
    assert_eq!(
        seen.unwrap().unwrap(),
        GroupEvent::Changed {
            group: 1,
            revision: r2,
            def: Some(gone.clone())
        }
    );
    let (rev, read) = b.read_group(1).await.unwrap().unwrap();
    assert_eq!(rev, r2);
    assert!(read.removed);
    assert_eq!(read.membership, 6);
    assert!(
        chunk_keys(&a, 1).await.is_empty(),
        "the live group's chunks"
    );

    // A header sealed with another key, stored under a group's key: it
    // does not open, for a read and for a watch, and the watch goes on.
    let other = Envelope::new(MessageKey::derive(b"not this cluster's secret"));
    let js = async_nats::jetstream::new(a.client().clone());
    let store = js.get_key_value("gd_groups").await.unwrap();
    let forged = other.seal_record("g.9", b"whatever the forger likes");
    store.put("g.9", forged).await.unwrap();
    match b.read_group(9).await {
        Err(ClusterError::GroupCorrupt { key, reason, .. }) => {
            assert_eq!(key, "g.9");
            assert_eq!(reason, GroupDefect::Dropped("forged"));
        }
        other => panic!("a forged header read as {other:?}"),
    }
    let seen = tokio::time::timeout(DELIVERY, watch.next()).await.unwrap();
    assert!(matches!(
        seen.unwrap(),
        Err(ClusterError::GroupCorrupt { .. })
    ));

    let two = def(2, 1, 3_000, 128, "v");
    let r3 = a.write_group_if(&two, 0).await.unwrap();
    let seen = tokio::time::timeout(DELIVERY, watch.next()).await.unwrap();
    assert!(
        matches!(seen.unwrap().unwrap(), GroupEvent::Changed { group: 2, revision, def: Some(d) } if revision == r3 && d == two)
    );

    // A new watch: every stored header (the forged one as an error), then
    // the marker, then what is written after it.
    let mut late = a.watch_groups().await.unwrap();
    let mut changed = Vec::new();
    let mut errors = 0;
    loop {
        let event = tokio::time::timeout(DELIVERY, late.next())
            .await
            .unwrap()
            .unwrap();
        match event {
            Ok(GroupEvent::Synced) => break,
            Ok(GroupEvent::Changed { group, def, .. }) => changed.push((group, def.unwrap())),
            Err(_) => errors += 1,
        }
    }
    assert_eq!(changed, vec![(1, gone), (2, two)]);
    assert_eq!(errors, 1);
    let three = def(3, 1, 1, 8, "w");
    let r4 = a.write_group_if(&three, 0).await.unwrap();
    let seen = tokio::time::timeout(DELIVERY, late.next()).await.unwrap();
    assert_eq!(
        seen.unwrap().unwrap(),
        GroupEvent::Changed {
            group: 3,
            revision: r4,
            def: Some(three)
        }
    );
}
