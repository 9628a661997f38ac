//! Live tests of the trust boundary (docs/cluster.md "Trust boundary") on a
//! real NATS server: the node's NATS credentials, and the envelope every
//! inter-node message travels in (forged, copied and unsigned messages are
//! dropped and counted; sealed ones arrive).

use std::time::Duration;

use bytes::Bytes;
use greendot_cluster::testing::{connect_retrying, envelope, NatsCluster};
use greendot_cluster::{
    chain, Cluster, ClusterConfig, ClusterError, DropReason, Envelope, MessageKey, NatsCredentials,
    NodeId, RequestKind, Secret, ShardId,
};

/// How long a test's first connection may keep failing while the fresh
/// cluster makes its buckets.
const STARTUP: Duration = Duration::from_secs(20);

fn config(node: &str) -> ClusterConfig {
    let mut c = ClusterConfig::new(NodeId::new(node).unwrap());
    c.replicas = 1;
    c.shard_count = 64;
    c.lease_ttl = Duration::from_secs(2);
    c.claim_ttl = Duration::from_secs(2);
    c.margin = Duration::from_millis(500);
    c.marker_ttl = Duration::from_secs(1);
    c.op_timeout = Duration::from_millis(500);
    c
}

fn with_user(node: &str, user: &str, password: &str) -> ClusterConfig {
    let mut c = config(node);
    c.nats.credentials = NatsCredentials::UserPassword {
        user: user.into(),
        password: Secret::new(password),
    };
    c
}

/// Returns once the NATS server has processed everything `client` sent
/// before: a request nobody serves is answered "no responders" by the
/// server, in order. (`flush` only writes the client's buffer out.)
async fn barrier(client: &async_nats::Client) {
    let answer = client.request("barrier.none", Bytes::new()).await;
    assert!(
        matches!(&answer, Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders),
        "{answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_with_the_right_nats_credentials_only() {
    let nats = NatsCluster::start_with_user(1, "greendot", "s3cret-pass").await;
    let urls = nats.urls();

    let node = Cluster::connect(&urls, with_user("a", "greendot", "s3cret-pass"), envelope())
        .await
        .expect("the right user and password join");
    node.put_preferences("alice", 1, Bytes::from_static(b"busy"))
        .await
        .unwrap();

    for (what, config) in [
        ("no credentials", config("b")),
        ("a wrong password", with_user("b", "greendot", "wrong")),
    ] {
        let err = match Cluster::connect(&urls, config, envelope()).await {
            Ok(_) => panic!("{what}: joined"),
            Err(e) => e,
        };
        assert!(
            matches!(err, ClusterError::Connect { .. }),
            "{what}: {err:?}"
        );
        let text = chain(&err);
        assert!(
            text.contains("connecting to NATS at")
                && text.to_lowercase().contains("authorization violation"),
            "{what}: {text}"
        );
        // The password is in no error.
        assert!(!text.contains("s3cret-pass"), "{text}");
    }

    // `greendot cluster status` gives the same credentials.
    let access = with_user("x", "greendot", "s3cret-pass").nats;
    greendot_cluster::observe(&urls, &access, "gd", Duration::from_secs(2))
        .await
        .expect("status reads with the credentials");
    assert!(
        greendot_cluster::observe(&urls, &Default::default(), "gd", Duration::from_secs(2))
            .await
            .is_err(),
        "status reads without credentials"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_copied_and_unsigned_messages_are_dropped_and_counted() {
    let nats = NatsCluster::start(1).await;
    let urls = nats.urls();
    let owner = connect_retrying(&urls, config("owner"), STARTUP).await;
    let edge = connect_retrying(&urls, config("edge"), STARTUP).await;
    // Someone with publish rights on the subjects but not the token secret.
    let raw = async_nats::connect(urls.clone()).await.unwrap();
    let stranger = Envelope::new(MessageKey::derive(b"not the cluster's secret"));

    let (seven, eight) = (ShardId(7), ShardId(8));
    let mut feed = edge.view_feed();
    feed.watch(seven).await.unwrap();
    feed.watch(eight).await.unwrap();
    let mut resyncs = edge.resync_feed().await.unwrap();
    let mut inbox = owner.owner_inbox();
    inbox.serve(seven).await.unwrap();
    barrier(edge.client()).await;
    barrier(owner.client()).await;

    let subject = |s: ShardId| owner.config().view_subject(s);
    // Unsigned (the old format), signed with another key, and a genuine
    // view of shard 7 copied onto shard 8's subject.
    raw.publish(subject(seven), Bytes::from_static(b"forged view"))
        .await
        .unwrap();
    raw.publish(
        subject(seven),
        stranger.seal(&subject(seven), b"forged view"),
    )
    .await
    .unwrap();
    let genuine = envelope().seal(&subject(seven), b"genuine view");
    raw.publish(subject(eight), genuine).await.unwrap();
    // A resync request and a device input, forged.
    let resync = owner.config().resync_subject();
    raw.publish(resync.clone(), stranger.seal(&resync, b"resync"))
        .await
        .unwrap();
    let input = owner.config().request_subject(seven, RequestKind::Input);
    raw.publish(input.clone(), stranger.seal(&input, b"logout alice"))
        .await
        .unwrap();
    barrier(&raw).await;

    // Then the real ones, through the node: each feed yields its real
    // message first, so the forgeries before it were dropped.
    for shard in [seven, eight] {
        owner
            .publish_view(shard, Bytes::from_static(b"real view"))
            .await
            .unwrap();
    }
    owner
        .publish_resync(Bytes::from_static(b"real resync"))
        .await
        .unwrap();
    let within = Duration::from_secs(5);
    let mut views = Vec::new();
    for _ in 0..2 {
        let view = tokio::time::timeout(within, feed.recv()).await.unwrap();
        assert_eq!(&view.payload[..], b"real view");
        views.push(view.shard);
    }
    views.sort();
    assert_eq!(views, [seven, eight]);
    let got = tokio::time::timeout(within, resyncs.recv()).await.unwrap();
    assert_eq!(got.as_deref(), Some(&b"real resync"[..]));

    // A real request is answered, sealed for its inbox; the forged input
    // before it never came out of the inbox.
    let server = tokio::spawn(async move {
        let req = inbox.recv().await;
        let answer = format!("owner got {}", String::from_utf8_lossy(&req.payload));
        inbox.reply(&req, Bytes::from(answer)).await.unwrap();
        inbox
    });
    let answer = edge
        .request(seven, RequestKind::Input, Bytes::from_static(b"connect"))
        .await
        .unwrap();
    assert_eq!(answer, "owner got connect");
    let _inbox = server.await.unwrap();

    // An answer not sealed with the cluster's key is dropped: the
    // request fails as `Dropped` (the edge retries), and it is counted.
    let mut fake_owner = raw.subscribe(input.clone()).await.unwrap();
    barrier(&raw).await;
    let raw2 = raw.clone();
    let liar = tokio::spawn(async move {
        use futures_util::StreamExt;
        let msg = fake_owner.next().await.unwrap();
        let reply = msg.reply.unwrap();
        let answer = stranger.seal(reply.as_str(), b"done");
        raw2.publish(reply, answer).await.unwrap();
        raw2.flush().await.unwrap();
    });
    let asked = edge
        .request(seven, RequestKind::Input, Bytes::from_static(b"x"))
        .await;
    liar.await.unwrap();
    // The real owner's inbox is not read any more: the liar answers first.
    assert!(
        matches!(asked, Err(ClusterError::Dropped { .. })),
        "{asked:?}"
    );

    let (o, e) = (owner.dropped(), edge.dropped());
    // Edge: the view signed with another key, the copied one, the forged
    // resync and the liar's answer; the unsigned view is too short to be an
    // envelope.
    assert_eq!(e.get(DropReason::Forged), 4, "edge drops");
    assert_eq!(e.get(DropReason::Malformed), 1, "edge drops");
    assert_eq!(e.get(DropReason::Version), 0);
    // Owner: the forged input.
    assert_eq!(o.get(DropReason::Forged), 1, "owner drops");
    let text = e.render_metrics();
    assert!(
        text.contains("greendot_cluster_rejected_total{reason=\"forged\"} 4\n"),
        "{text}"
    );
}

/// A shard whose epoch counter is at the last epoch whose versions fit is
/// not claimed again (it would wrap every version of its users), and the
/// counter is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_would_wrap_versions_is_refused() {
    let nats = NatsCluster::start(1).await;
    let node = connect_retrying(&nats.urls(), config("a"), STARTUP).await;
    let js = async_nats::jetstream::new(node.client().clone());
    let claims = js.get_key_value("gd_claims").await.unwrap();
    let last = greendot_cluster::MAX_EPOCH;
    claims
        .put("epoch.5", Bytes::from((last - 1).to_string()))
        .await
        .unwrap();
    let held = node.claim_shard(ShardId(5), 0).await.unwrap();
    assert_eq!(held.epoch, last, "the last epoch that fits is claimed");
    node.release_claim(held).await.unwrap();
    let free = match node.read_claim(ShardId(5)).await.unwrap() {
        greendot_cluster::ClaimState::Free { revision } => revision,
        other => panic!("{other:?}"),
    };
    match node.claim_shard(ShardId(5), free).await {
        Err(ClusterError::EpochExhausted { shard, epoch }) => {
            assert_eq!((shard, epoch), (ShardId(5), last));
        }
        other => panic!("claimed past the last epoch: {other:?}"),
    }
    let counter = claims.get("epoch.5").await.unwrap().unwrap();
    assert_eq!(counter, last.to_string().as_bytes());
}
