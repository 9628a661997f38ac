//! Live tests against a real 3-node NATS cluster with JetStream (R3
//! buckets), started and stopped by `greendot_cluster::testing`. TTLs are
//! 1–2 s; every wait is derived from them, plus generous bounds where NATS
//! itself must act (an expiry, a leader election).

use std::time::{Duration, Instant};

use bytes::Bytes;
use greendot_cluster::testing::NatsCluster;
use greendot_cluster::{
    ClaimState, Cluster, ClusterConfig, ClusterError, GroupDef, KvOp, MemberEvent, NodeId,
    Ownership, RequestKind, ShardId,
};

const LEASE_TTL: Duration = Duration::from_secs(2);
const CLAIM_TTL: Duration = Duration::from_secs(2);
const MARGIN: Duration = Duration::from_millis(500);
/// How late after a key's TTL NATS may report its expiry before a test
/// fails: NATS checks TTLs on a timer; measured here about 0.2–1 s late.
const EXPIRY_SLACK: Duration = Duration::from_secs(5);
/// How long a JetStream stream may go without a leader after its leader is
/// killed (raft election timeouts are 4–9 s in nats-server).
const ELECTION_BOUND: Duration = Duration::from_secs(25);

fn config(node: &str) -> ClusterConfig {
    let mut c = ClusterConfig::new(NodeId::new(node).unwrap());
    c.replicas = 3;
    c.shard_count = 64;
    c.lease_ttl = LEASE_TTL;
    c.claim_ttl = CLAIM_TTL;
    c.margin = MARGIN;
    c.marker_ttl = Duration::from_secs(1);
    c.op_timeout = Duration::from_millis(500);
    c
}

async fn connect(urls: &str, node: &str) -> Cluster {
    greendot_cluster::testing::connect_retrying(urls, config(node), STARTUP).await
}

/// Retries `f` until it succeeds or `within` passes (for the first
/// operations against a fresh cluster and after a NATS node is killed).
/// How long a test's first connection may keep failing while the fresh
/// cluster makes its buckets.
const STARTUP: Duration = Duration::from_secs(20);

async fn retry<T, F, Fut>(within: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClusterError>>,
{
    let deadline = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() < deadline => {
                eprintln!("retrying: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("still failing after {within:?}: {e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_appear_renew_and_expire_with_a_marker() {
    let nats = NatsCluster::start(3).await;
    let a = connect(&nats.url(0), "a").await;
    let b = connect(&nats.url(1), "b").await;
    let mut members = b.watch_members().await.unwrap();

    let mut lease = a
        .acquire_lease(Bytes::from_static(b"a-addr"))
        .await
        .unwrap();
    let joined = tokio::time::timeout(LEASE_TTL, members.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        joined,
        MemberEvent::Joined {
            node: NodeId::new("a").unwrap(),
            revision: lease.revision
        }
    );
    assert_eq!(
        members
            .membership()
            .member(&NodeId::new("a").unwrap())
            .unwrap()
            .value,
        "a-addr"
    );

    // A second process with the same id cannot take a live lease.
    let twin = connect(&nats.url(2), "a").await;
    assert!(matches!(
        twin.acquire_lease(Bytes::new()).await,
        Err(ClusterError::LeaseHeld { .. })
    ));

    // Renewed for 2.5 TTLs: it stays (each renewal re-sends the TTL).
    let renew_until = Instant::now() + LEASE_TTL * 5 / 2;
    while Instant::now() < renew_until {
        tokio::time::sleep_until(lease.tenure.renew_at().into()).await;
        a.renew_lease(&mut lease, Bytes::from_static(b"a-addr"))
            .await
            .unwrap();
    }
    let last_renewal_sent_by = Instant::now();
    // No leave while it was renewed.
    assert!(tokio::time::timeout(Duration::ZERO, members.next())
        .await
        .is_err());

    // Not renewed any more: NATS removes it and watchers get the marker.
    let left = tokio::time::timeout(LEASE_TTL + EXPIRY_SLACK, members.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let seen = Instant::now();
    assert!(
        matches!(left, MemberEvent::Left { expired: true, ref node, .. } if node.as_str() == "a"),
        "{left:?}"
    );
    assert!(
        seen >= lease.tenure.expires_no_earlier_than(),
        "expired before its TTL"
    );
    assert!(seen > lease.may_act_until());
    eprintln!(
        "lease expiry seen {:?} after the last renewal was sent (TTL {LEASE_TTL:?})",
        seen - (last_renewal_sent_by.min(seen))
    );

    // The expired id can be taken again, and the new lease expires too (a
    // re-create on the marker keeps its TTL).
    let again = twin
        .acquire_lease(Bytes::from_static(b"twin"))
        .await
        .unwrap();
    assert!(again.revision > lease.revision);
    let joined = tokio::time::timeout(LEASE_TTL, members.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(joined, MemberEvent::Joined { .. }));
    let left = tokio::time::timeout(LEASE_TTL + EXPIRY_SLACK, members.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(left, MemberEvent::Left { expired: true, .. }));
}

/// What STACK.md left open: `async_nats`'s `Store::update` (a CAS without a
/// `Nats-TTL` header) does NOT keep a key's per-key TTL: the key becomes
/// permanent. This is why renewals write the TTL again (`Cluster::renew_*`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_kv_update_drops_the_per_key_ttl() {
    use async_nats::jetstream::kv;
    let nats = NatsCluster::start(3).await;
    let js = async_nats::jetstream::new(async_nats::connect(nats.url(0)).await.unwrap());
    let store = js
        .create_key_value(kv::Config {
            bucket: "ttl_probe".into(),
            history: 1,
            num_replicas: 3,
            limit_markers: Some(Duration::from_secs(1)),
            ..Default::default()
        })
        .await
        .unwrap();
    let ttl = Duration::from_secs(1);
    let rev = store
        .create_with_ttl("updated", "v1".into(), ttl)
        .await
        .unwrap();
    store.update("updated", "v2".into(), rev).await.unwrap();
    store
        .create_with_ttl("untouched", "v1".into(), ttl)
        .await
        .unwrap();
    // Three TTLs plus slack: the untouched key is gone, the updated one stays.
    let deadline = Instant::now() + ttl * 3 + EXPIRY_SLACK;
    while store.get("untouched").await.unwrap().is_some() {
        assert!(Instant::now() < deadline, "a key with a TTL did not expire");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(
        store.get("updated").await.unwrap().as_deref(),
        Some(&b"v2"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_one_wins_and_a_takeover_raises_the_epoch() {
    let nats = NatsCluster::start(3).await;
    let a = connect(&nats.url(0), "a").await;
    let b = connect(&nats.url(1), "b").await;
    let mut watch = b.watch_claims().await.unwrap();
    let shard = ShardId(5);
    let _lease_a = a.acquire_lease(Bytes::new()).await.unwrap();
    let _lease_b = b.acquire_lease(Bytes::new()).await.unwrap();

    // Both saw the shard free and race: exactly one wins.
    assert_eq!(
        a.read_claim(shard).await.unwrap(),
        ClaimState::Free { revision: 0 }
    );
    let (ra, rb) = tokio::join!(a.claim_shard(shard, 0), b.claim_shard(shard, 0));
    let (winner, loser, held, lost) = match (ra, rb) {
        (Ok(h), Err(e)) => (&a, &b, h, e),
        (Err(e), Ok(h)) => (&b, &a, h, e),
        other => panic!("not exactly one winner: {other:?}"),
    };
    // The loser reads the claim after its compare-and-set failed: it names
    // the winner, unless the read came from a replica that has not applied
    // the winning write yet (KV reads may be served by any replica; seen on
    // a loaded machine), which says only that the race was lost.
    assert!(
        matches!(&lost, ClusterError::ShardHeld { epoch, .. } if *epoch == held.epoch)
            || matches!(&lost, ClusterError::Conflict { expected: 0, .. }),
        "{lost:?}"
    );
    let ClaimState::Held(record) = loser.read_claim(shard).await.unwrap() else {
        panic!("claim not held")
    };
    assert_eq!((&record.owner, record.epoch), (winner.node(), held.epoch));

    // The winner renews once (same epoch), then dies: never renews again.
    let mut held = held;
    winner.renew_claim(&mut held).await.unwrap();
    let ClaimState::Held(record) = loser.read_claim(shard).await.unwrap() else {
        panic!()
    };
    assert_eq!(record.epoch, held.epoch, "a renewal keeps the epoch");
    assert_eq!(record.revision, held.revision);
    // A stale compare-and-set loses.
    let stale = loser.claim_shard(shard, held.revision - 1).await;
    assert!(
        matches!(stale, Err(ClusterError::ShardHeld { .. })),
        "{stale:?}"
    );

    // The loser waits for the expiry marker, then takes over with a higher epoch.
    let deadline = Instant::now() + CLAIM_TTL + EXPIRY_SLACK;
    let free_at = loop {
        let (s, state) = tokio::time::timeout_at(deadline.into(), watch.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let (true, ClaimState::Free { revision }) = (s == shard, state) {
            break revision;
        }
    };
    assert!(Instant::now() >= held.tenure.expires_no_earlier_than());
    let taken = loser.claim_shard(shard, free_at).await.unwrap();
    assert!(
        taken.epoch > held.epoch,
        "epoch {} not above {}",
        taken.epoch,
        held.epoch
    );
    let ClaimState::Held(record) = winner.read_claim(shard).await.unwrap() else {
        panic!()
    };
    assert_eq!((&record.owner, record.epoch), (loser.node(), taken.epoch));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_stops_renewing_stops_acting_before_its_claim_expires() {
    let nats = NatsCluster::start(3).await;
    let a = connect(&nats.url(0), "a").await;
    let b = connect(&nats.url(1), "b").await;
    let mut watch = b.watch_claims().await.unwrap();
    let shard = ShardId(9);
    let mut ownership = Ownership::new(a.node().clone(), a.config().shard_count);
    let mut held = a.claim_shard(shard, 0).await.unwrap();
    for _ in 0..2 {
        tokio::time::sleep_until(held.tenure.renew_at().into()).await;
        a.renew_claim(&mut held).await.unwrap();
    }
    ownership.insert(held.clone());
    let no_lease_limit = Instant::now() + Duration::from_secs(3600);

    // Renewals stop. The owner acts until its deadline and not after.
    let until = held.may_act_until();
    assert_eq!(ownership.next_deadline(no_lease_limit), Some(until));
    assert_eq!(
        ownership.acting_epoch(shard, Instant::now(), no_lease_limit),
        Some(held.epoch)
    );
    tokio::time::sleep_until(until.into()).await;
    let stopped_at = Instant::now();
    assert_eq!(
        ownership.stop_expired(stopped_at, no_lease_limit),
        vec![held.clone()]
    );
    assert_eq!(
        ownership.acting_epoch(shard, stopped_at, no_lease_limit),
        None
    );
    // When it stopped, its claim was still in the KV: nobody else could own yet.
    let ClaimState::Held(record) = b.read_claim(shard).await.unwrap() else {
        panic!("the claim expired before the owner stopped acting")
    };
    assert_eq!(record.epoch, held.epoch);
    // And it expires after that.
    let deadline = Instant::now() + CLAIM_TTL + EXPIRY_SLACK;
    loop {
        let (s, state) = tokio::time::timeout_at(deadline.into(), watch.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if s == shard && matches!(state, ClaimState::Free { .. }) {
            break;
        }
    }
    let expired_seen = Instant::now();
    assert!(expired_seen > stopped_at);
    eprintln!(
        "stopped acting {:?} before the expiry marker arrived",
        expired_seen - stopped_at
    );
}

/// A node cut off from NATS stops owning, then closes its clients, each
/// while its claim and its lease are still in the KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_nats_stops_owning_then_closes_clients_before_its_keys_expire() {
    let mut nats = NatsCluster::start(3).await;
    let _buckets = connect(&nats.url(0), "setup").await;
    // Cut `a` off by killing the one NATS node it knows, chosen to lead
    // neither the leases nor the claims stream (so b's view needs no election).
    let leaders = [
        nats.stream_leader("gd_leases").await,
        nats.stream_leader("gd_claims").await,
    ];
    let k = (0..3).find(|i| !leaders.contains(i)).unwrap();
    // b stays on another NATS node, so its watches never move.
    let b = connect(&nats.url((k + 1) % 3), "b").await;
    let a = connect(&nats.url(k), "a").await;

    let mut lease = a.acquire_lease(Bytes::new()).await.unwrap();
    let mut ownership = Ownership::new(a.node().clone(), a.config().shard_count);
    let shard = ShardId(3);
    ownership.insert(a.claim_shard(shard, 0).await.unwrap());

    // b watches both keys from now on: for each, the send instant of the
    // last read that still found it (the key surely existed then). Leader
    // reads, not a watch: a watch's consumer may live on the NATS node
    // about to be killed, and then stalls until it is recreated.
    let observer = {
        let (b, node) = (b.clone(), a.node().clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + LEASE_TTL * 2 + EXPIRY_SLACK;
            let (mut claim_present, mut lease_present) = (None, None);
            let (mut claim_gone, mut lease_gone) = (false, false);
            while !(claim_gone && lease_gone) {
                assert!(Instant::now() < deadline, "claim or lease never expired");
                let sent = Instant::now();
                if !claim_gone {
                    match b.read_claim(shard).await {
                        Ok(ClaimState::Held(_)) => claim_present = Some(sent),
                        Ok(ClaimState::Free { .. }) => claim_gone = true,
                        Err(_) => {}
                    }
                }
                let sent = Instant::now();
                if !lease_gone {
                    match b.lease(&node).await {
                        Ok(Some(e)) if e.op == KvOp::Put => lease_present = Some(sent),
                        Ok(_) => lease_gone = true,
                        Err(_) => {}
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (claim_present.unwrap(), lease_present.unwrap())
        })
    };

    // a's duty loop: renew lease and claim when due; stop owning and close
    // clients at the deadlines. Renewals race the deadlines (select!), so a
    // hanging write never delays a stop.
    let cut_at = Instant::now() + LEASE_TTL;
    let mut killed = false;
    let mut stopped_owning = None;
    let closed_clients;
    loop {
        if !killed && Instant::now() >= cut_at {
            nats.kill(k);
            killed = true;
        }
        let lease_until = lease.may_act_until();
        let stop_at = ownership.next_deadline(lease_until).unwrap_or(lease_until);
        let renew_at = ownership
            .held()
            .map(|h| h.tenure.renew_at())
            .fold(lease.tenure.renew_at(), Instant::min);
        let wake = stop_at.min(lease_until).min(renew_at).max(Instant::now());
        tokio::time::sleep_until(wake.min(if killed { wake } else { cut_at }).into()).await;
        let now = Instant::now();
        if !ownership.stop_expired(now, lease_until).is_empty() {
            stopped_owning = Some(now);
        }
        if now >= lease_until {
            closed_clients = now;
            break;
        }
        if now >= lease.tenure.renew_at() {
            let renew = a.renew_lease(&mut lease, Bytes::new());
            let _ = tokio::time::timeout_at(lease_until.into(), renew).await;
        }
        if let Some(mut held) = ownership.get(shard).cloned() {
            if now >= held.tenure.renew_at() {
                let until = held.may_act_until().min(lease.may_act_until());
                if let Ok(Ok(())) =
                    tokio::time::timeout_at(until.into(), a.renew_claim(&mut held)).await
                {
                    ownership.insert(held);
                }
            }
        }
    }
    let stopped_owning = stopped_owning.expect("never stopped owning");
    assert!(killed);
    assert!(
        stopped_owning <= closed_clients,
        "closed clients before it stopped owning"
    );

    let (claim_present, lease_present) = observer.await.unwrap();
    assert!(
        stopped_owning < claim_present,
        "owned after its claim expired"
    );
    assert!(
        closed_clients < lease_present,
        "served clients after its lease expired"
    );
    eprintln!(
        "after the cut-off: stopped owning {:?} before the last read that found the claim, closed clients {:?} before the last read that found the lease",
        claim_present - stopped_owning,
        lease_present - closed_clients
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_view_reaches_each_interested_node_once() {
    let nats = NatsCluster::start(3).await;
    let owner = connect(&nats.url(0), "owner").await;
    let b = connect(&nats.url(1), "b").await;
    let c = connect(&nats.url(2), "c").await;
    let (s, t) = (ShardId(11), ShardId(12));
    let mut feed_b = b.view_feed();
    let mut feed_c = c.view_feed();
    // Five local watchers of shard s on b: one subscription.
    for _ in 0..5 {
        feed_b.watch(s).await.unwrap();
    }
    feed_b.watch(t).await.unwrap();
    feed_c.watch(t).await.unwrap();
    assert!(matches!(
        feed_c.watch(ShardId(64)).await,
        Err(ClusterError::NoSuchShard { .. })
    ));
    assert_eq!(feed_b.subscribed(), [s, t].into_iter().collect());
    assert_eq!(feed_b.watchers(s), 5);
    b.flush().await.unwrap();
    c.flush().await.unwrap();

    // Interest crosses NATS routes asynchronously: probe until both see t.
    let deadline = Instant::now() + Duration::from_secs(10);
    for feed in [&mut feed_b, &mut feed_c] {
        loop {
            owner
                .publish_view(t, Bytes::from_static(b"probe"))
                .await
                .unwrap();
            if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), feed.recv()).await {
                assert_eq!(m.shard, t);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "subscription never became effective"
            );
        }
    }
    // Ten views on s, then an end mark on s and on t.
    for i in 0..10 {
        owner
            .publish_view(s, Bytes::from(format!("view {i}")))
            .await
            .unwrap();
    }
    owner
        .publish_view(s, Bytes::from_static(b"end"))
        .await
        .unwrap();
    owner
        .publish_view(t, Bytes::from_static(b"end"))
        .await
        .unwrap();

    async fn count_until_ends(
        feed: &mut greendot_cluster::ViewFeed,
        ends: usize,
    ) -> (usize, usize) {
        let (mut views_s, mut ends_seen) = (0, 0);
        while ends_seen < ends {
            let m = tokio::time::timeout(Duration::from_secs(10), feed.recv())
                .await
                .expect("end mark lost");
            match &m.payload[..] {
                b"end" => ends_seen += 1,
                b"probe" => {}
                _ => {
                    assert_eq!(m.shard, ShardId(11));
                    views_s += 1;
                }
            }
        }
        (views_s, ends_seen)
    }
    assert_eq!(
        count_until_ends(&mut feed_b, 2).await,
        (10, 2),
        "b: one copy per view, not one per watcher"
    );
    assert_eq!(
        count_until_ends(&mut feed_c, 1).await,
        (0, 1),
        "c watches no user of s"
    );

    // Watchers leave: the subscription goes with the last one.
    for _ in 0..4 {
        feed_b.unwatch(s);
    }
    assert!(feed_b.subscribed().contains(&s));
    feed_b.unwatch(s);
    assert_eq!(feed_b.subscribed(), [t].into_iter().collect());
    owner
        .publish_view(s, Bytes::from_static(b"late"))
        .await
        .unwrap();
    owner
        .publish_view(t, Bytes::from_static(b"end"))
        .await
        .unwrap();
    let m = tokio::time::timeout(Duration::from_secs(10), feed_b.recv())
        .await
        .unwrap();
    assert_eq!(
        (m.shard, &m.payload[..]),
        (t, &b"end"[..]),
        "got a view of an unwatched shard"
    );

    // A truth goes to one node's edge subject: b hears it, c does not.
    let mut edge_b = b.edge_feed().await.unwrap();
    let mut edge_c = c.edge_feed().await.unwrap();
    b.flush().await.unwrap();
    c.flush().await.unwrap();
    // Probe until each has the interest; the first message each hears must
    // be its own.
    for (feed, node, payload) in [
        (&mut edge_b, b.node(), &b"for b"[..]),
        (&mut edge_c, c.node(), &b"for c"[..]),
    ] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            owner
                .publish_to_edge(node, Bytes::from_static(payload))
                .await
                .unwrap();
            if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), feed.recv()).await {
                assert_eq!(
                    m.as_deref(),
                    Some(payload),
                    "{node} got another node's truth"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{node}'s edge subject never got interest"
            );
        }
    }

    // Beacons and resync requests reach every node, each on its own subject.
    let mut beacons_b = b.beacon_feed().await.unwrap();
    let mut beacons_c = c.beacon_feed().await.unwrap();
    let mut resyncs_c = c.resync_feed().await.unwrap();
    b.flush().await.unwrap();
    c.flush().await.unwrap();
    for (feed, what) in [
        (&mut beacons_b, "b's beacons"),
        (&mut beacons_c, "c's beacons"),
        (&mut resyncs_c, "c's resyncs"),
    ] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            owner
                .publish_beacon(Bytes::from_static(b"beacon"))
                .await
                .unwrap();
            owner
                .publish_resync(Bytes::from_static(b"resync"))
                .await
                .unwrap();
            if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), feed.recv()).await {
                assert!(m.is_some(), "{what} ended");
                break;
            }
            assert!(Instant::now() < deadline, "{what} never got interest");
        }
    }
    for (feed, want, what) in [
        (&mut beacons_b, &b"beacon"[..], "b's beacons"),
        (&mut beacons_c, &b"beacon"[..], "c's beacons"),
        (&mut resyncs_c, &b"resync"[..], "c's resyncs"),
    ] {
        while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), feed.recv()).await
        {
            assert_eq!(&m[..], want, "{what} got another subject's message");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_the_shard_owner_and_fail_fast_without_one() {
    let nats = NatsCluster::start(3).await;
    let owner = connect(&nats.url(0), "owner").await;
    let edge = connect(&nats.url(2), "edge").await;
    let shard = ShardId(21);
    assert!(matches!(
        edge.request(shard, RequestKind::Input, Bytes::new()).await,
        Err(ClusterError::NoOwner { shard: ShardId(21) })
    ));
    let mut inbox = owner.owner_inbox();
    inbox.serve(shard).await.unwrap();
    owner.flush().await.unwrap();
    let server = tokio::spawn(async move {
        for _ in 0..2 {
            let req = inbox.recv().await;
            let answer = format!(
                "{:?} for {}: {}",
                req.kind,
                req.shard,
                String::from_utf8_lossy(&req.payload)
            );
            inbox.reply(&req, Bytes::from(answer)).await.unwrap();
        }
        inbox
    });
    // Interest crosses NATS routes asynchronously: retry NoOwner briefly.
    let answer = retry(Duration::from_secs(10), || {
        edge.request(shard, RequestKind::Input, Bytes::from_static(b"hello"))
    })
    .await;
    assert_eq!(answer, "Input for 21: hello");
    let answer = edge
        .request(shard, RequestKind::Snapshot, Bytes::from_static(b"alice"))
        .await
        .unwrap();
    assert_eq!(answer, "Snapshot for 21: alice");
    let mut inbox = server.await.unwrap();
    inbox.stop(shard);
    owner.flush().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match edge.request(shard, RequestKind::Input, Bytes::new()).await {
            Err(ClusterError::NoOwner { .. }) => break,
            other => assert!(
                Instant::now() < deadline,
                "still answered after stop: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A shard's device record is fenced by its writer's epoch: a late write
/// of an older owner is refused and changes nothing, the record reads back
/// without the epoch, and a write without one (a node sending protocol 2)
/// is stored as is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_owners_shard_record_write_is_fenced_off() {
    let nats = NatsCluster::start(3).await;
    let a = connect(&nats.urls(), "a").await;
    let shard = ShardId(3);
    a.put_shard_devices(shard, Some(7), Bytes::from_static(b"newer"))
        .await
        .unwrap();
    match a
        .put_shard_devices(shard, Some(6), Bytes::from_static(b"older"))
        .await
    {
        Err(ClusterError::Fenced {
            epoch: 6, newer: 7, ..
        }) => {}
        other => panic!("an older owner's record write was not fenced off: {other:?}"),
    }
    assert_eq!(
        a.shard_devices(shard).await.unwrap().as_deref(),
        Some(&b"newer"[..])
    );
    a.put_shard_devices(shard, Some(8), Bytes::from_static(b"next"))
        .await
        .unwrap();
    assert_eq!(
        a.shard_devices(shard).await.unwrap().as_deref(),
        Some(&b"next"[..])
    );
    a.put_shard_devices(shard, None, Bytes::from_static(b"plain"))
        .await
        .unwrap();
    assert_eq!(
        a.shard_devices(shard).await.unwrap().as_deref(),
        Some(&b"plain"[..])
    );
}

/// Preferences are fenced by the writer's epoch (C4): once a newer owner
/// wrote a user's preferences, an older owner's write is refused and
/// changes nothing; the same or a newer epoch writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_owners_preference_write_is_fenced_off() {
    let nats = NatsCluster::start(3).await;
    let a = connect(&nats.urls(), "a").await;
    a.put_preferences("carol", 5, Bytes::from_static(b"away"))
        .await
        .unwrap();
    a.put_preferences("carol", 5, Bytes::from_static(b"busy"))
        .await
        .unwrap();
    match a
        .put_preferences("carol", 4, Bytes::from_static(b"stale"))
        .await
    {
        Err(ClusterError::Fenced {
            epoch: 4, newer: 5, ..
        }) => {}
        other => panic!("an older owner's write was not fenced off: {other:?}"),
    }
    assert_eq!(
        a.preferences("carol").await.unwrap().as_deref(),
        Some(&b"busy"[..])
    );
    a.put_preferences("carol", 6, Bytes::from_static(b"online"))
        .await
        .unwrap();
    assert_eq!(
        a.preferences("carol").await.unwrap().as_deref(),
        Some(&b"online"[..])
    );
}

/// Waits until NATS's connection events say `a` is connected (`up`) or
/// not, or panics after `within`.
async fn until_connected(a: &Cluster, up: bool, within: Duration) {
    let mut events = a.connection();
    let said = tokio::time::timeout(within, events.wait_for(|c| *c == up)).await;
    assert!(
        matches!(said, Ok(Ok(_))),
        "no connection event saying connected: {up} within {within:?}"
    );
}

/// A write handed to a client whose NATS connection is down is refused
/// (once half its timeout passed with the connection still down):
/// async-nats would queue it and send it after the reconnect,
/// when the link has long taken it as failed (a view written late over a
/// newer one, a device's connect taking the device from a newer session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_queued_for_after_a_reconnect() {
    let mut nats = NatsCluster::start(1).await;
    let mut one = config("a");
    one.replicas = 1;
    let a = greendot_cluster::testing::connect_retrying(&nats.url(0), one, STARTUP).await;
    let view = |v: &'static str| Bytes::from_static(v.as_bytes());
    retry(STARTUP, || a.put_view("alice", view("before"))).await;
    let group = |member: &str| GroupDef {
        group: 7,
        membership: 1,
        next_ordinal: 2,
        members: vec![(member.to_owned(), 1)],
        admins: vec![],
        removed: false,
    };
    let before = group("before");
    let group_revision = retry(STARTUP, || a.write_group_if(&before, 0)).await;

    nats.kill(0);
    until_connected(&a, false, Duration::from_secs(10)).await;
    let during = a.put_view("alice", view("during")).await;
    assert!(
        matches!(during, Err(ClusterError::Reconnecting { .. })),
        "{during:?}"
    );
    let asked = a
        .request(ShardId(1), RequestKind::Input, view("during"))
        .await;
    assert!(
        matches!(asked, Err(ClusterError::Reconnecting { .. })),
        "{asked:?}"
    );
    let written = a.write_group_if(&group("during"), group_revision).await;
    assert!(
        matches!(written, Err(ClusterError::Reconnecting { .. })),
        "{written:?}"
    );

    nats.restart(0);
    until_connected(&a, true, Duration::from_secs(30)).await;
    // A write after the reconnect, acknowledged: one queued before it on
    // the same connection and stream would have landed first.
    retry(ELECTION_BOUND, || a.put_view("marker", view("after"))).await;
    let alice = retry(ELECTION_BOUND, || a.view("alice")).await;
    assert_eq!(
        alice.as_deref(),
        Some(&b"before"[..]),
        "a write queued while down landed"
    );
    let stored = retry(ELECTION_BOUND, || a.read_group(7)).await;
    assert_eq!(
        stored,
        Some((group_revision, group("before"))),
        "a group write queued while down landed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_nats_node_and_kv_and_claims_keep_working() {
    let mut nats = NatsCluster::start(3).await;
    let a = connect(&nats.urls(), "a").await;
    a.put_preferences("alice.ü", 1, Bytes::from_static(b"away"))
        .await
        .unwrap();
    a.put_view("alice.ü", Bytes::from_static(b"view 1"))
        .await
        .unwrap();
    let mut held = a.claim_shard(ShardId(1), 0).await.unwrap();

    // Worst case: kill the node leading the claims stream.
    let victim = nats.stream_leader("gd_claims").await;
    let killed_at = Instant::now();
    nats.kill(victim);

    // Claims: renew if the claim survived, else claim again (higher epoch).
    let first_write = retry(ELECTION_BOUND, || renew_or_reclaim(&a, &held)).await;
    let recovered = killed_at.elapsed();
    assert!(first_write.epoch >= held.epoch);
    held = first_write;
    eprintln!("claims writable again {recovered:?} after kill -9 of the stream leader");
    let races = tokio::join!(a.claim_shard(ShardId(2), 0), a.claim_shard(ShardId(2), 0));
    assert!(
        races.0.is_ok() != races.1.is_ok(),
        "CAS still decides exactly one winner"
    );

    // Preferences written before the kill are still there, and new ones land.
    let prefs = retry(ELECTION_BOUND, || a.preferences("alice.ü")).await;
    assert_eq!(prefs.as_deref(), Some(&b"away"[..]));
    retry(ELECTION_BOUND, || {
        a.put_preferences("bob", 1, Bytes::from_static(b"busy"))
    })
    .await;
    let view = retry(ELECTION_BOUND, || a.view("alice.ü")).await;
    assert_eq!(view.as_deref(), Some(&b"view 1"[..]));

    // The killed node comes back and catches up.
    nats.restart(victim);
    nats.wait_ready(ELECTION_BOUND).await;
    // A node that rejoins answers JetStream requests only once it has caught
    // up: opening the buckets through it may time out until then.
    let late_url = nats.url(victim);
    let late = retry(ELECTION_BOUND, || {
        Cluster::connect(
            &late_url,
            config("late"),
            greendot_cluster::testing::envelope(),
        )
    })
    .await;
    let deadline = Instant::now() + ELECTION_BOUND;
    loop {
        if let Ok(Some(v)) = late.preferences("bob").await {
            assert_eq!(v, "busy");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "restarted node never served the data"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let renewed = retry(ELECTION_BOUND, || renew_or_reclaim(&a, &held)).await;
    assert!(renewed.epoch >= held.epoch);
}

/// Renews `held`, or claims the shard again if it expired meanwhile (a
/// stream without a leader cannot take renewals; its TTLs still run).
async fn renew_or_reclaim(
    a: &Cluster,
    held: &greendot_cluster::HeldShard,
) -> Result<greendot_cluster::HeldShard, ClusterError> {
    let mut h = held.clone();
    match a.renew_claim(&mut h).await {
        Ok(()) => Ok(h),
        Err(ClusterError::Conflict { .. }) => match a.read_claim(h.shard).await? {
            ClaimState::Free { revision } => a.claim_shard(h.shard, revision).await,
            ClaimState::Held(r) => panic!(
                "held by {} at epoch {} though a never lost it",
                r.owner, r.epoch
            ),
        },
        Err(e) => Err(e),
    }
}

/// A device's session record: stored, read back by another node, kept apart
/// from the user's other devices, and gone once deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_record_is_read_by_another_node_and_deleted() {
    let nats = NatsCluster::start(3).await;
    let a = connect(&nats.urls(), "a").await;
    let b = connect(&nats.urls(), "b").await;
    a.put_session("alice.ü", "phone", Bytes::from_static(b"subs 1"))
        .await
        .unwrap();
    a.put_session("alice.ü", "laptop", Bytes::from_static(b"subs 2"))
        .await
        .unwrap();
    let read = b.session("alice.ü", "phone").await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"subs 1"[..]));
    b.delete_session("alice.ü", "phone").await.unwrap();
    assert_eq!(a.session("alice.ü", "phone").await.unwrap(), None);
    let other = a.session("alice.ü", "laptop").await.unwrap();
    assert_eq!(other.as_deref(), Some(&b"subs 2"[..]));
    assert_eq!(a.session("bob", "phone").await.unwrap(), None);
}
