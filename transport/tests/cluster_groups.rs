//! Groups on a 3-node cluster (docs/groups.md, docs/cluster.md "The groups
//! bucket"): a group written at one node is changed at another by
//! difference at the version the first answered, and removed at the third;
//! an expected version that moved on is refused as on one node, and a group
//! written again after its removal goes on above its version. Group
//! subscriptions and member pages are answered `Unsupported` with a message
//! saying why, and the session goes on.

mod support;
#[path = "support/three.rs"]
mod three;

use std::time::Duration;
use three::*;

use greendot_client::GroupChange;
use greendot_proto::{ErrorCode, Kind};
use greendot_server::token::{Claims, WatchClaim};

fn service() -> Claims {
    Claims::new(
        "backend",
        "svc",
        Kind::Other,
        WatchClaim::all(),
        Duration::from_secs(3600),
    )
    .service()
}

fn add(names: &[&str], expect: Option<u64>) -> GroupChange {
    GroupChange {
        add: names.iter().map(|n| n.to_string()).collect(),
        expect_version: expect,
        ..GroupChange::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_written_at_one_node_is_changed_at_another_and_removed_at_a_third() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let cluster = three_nodes("groups-written").await;
    let nodes = [&cluster.a, &cluster.b, &cluster.c];
    let mut svc = Vec::new();
    for at in nodes {
        svc.push(connect_as(&nodes, at, service()).await.0);
    }
    assert_eq!(svc[0].set_group(7, &["ann"], &["ann"]).await.unwrap(), 1);
    // At c, expecting the version a answered: c's copy may not have it
    // yet, and the store's is what counts.
    assert_eq!(
        svc[2]
            .change_group(7, add(&["bob"], Some(1)))
            .await
            .unwrap(),
        2
    );
    // At b, expecting 1 again: refused with the group's version.
    let stale = svc[1]
        .change_group(7, add(&["cy"], Some(1)))
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Some(ErrorCode::VersionMismatch), "{stale}");
    assert!(stale.to_string().contains("version=2"), "{stale}");
    svc[1].remove_group(7).await.unwrap();
    let gone = svc[0].remove_group(7).await.unwrap_err();
    assert_eq!(gone.code(), Some(ErrorCode::UnknownGroup), "{gone}");
    // Written again, at a: above the removed group's version (3).
    assert_eq!(
        svc[0].set_group(7, &["dee"], &[] as &[&str]).await.unwrap(),
        4
    );
    // A user token may not write.
    let (ann, _) = connect(
        &nodes,
        &cluster.b,
        "ann",
        "phone",
        Kind::Mobile,
        WatchClaim::all(),
    )
    .await;
    let refused = ann.set_group(8, &["ann"], &["ann"]).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::ServiceOnly), "{refused}");
    for s in &svc {
        s.ping().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_refuses_group_subscriptions_and_pages_clearly() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let cluster = three_nodes("groups-refused").await;
    let nodes = [&cluster.a, &cluster.b, &cluster.c];
    let (svc, _) = connect_as(&nodes, &cluster.a, service()).await;
    svc.set_group(7, &["ann"], &["ann"]).await.unwrap();
    let (ann, _) = connect(
        &nodes,
        &cluster.b,
        "ann",
        "phone",
        Kind::Mobile,
        WatchClaim::all(),
    )
    .await;
    let refused = ann.group_subscribe(7).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::Unsupported), "{refused}");
    assert!(
        refused.to_string().contains("single node"),
        "says why: {refused}"
    );
    for refused in [
        ann.group_page(7, None, 10).await.unwrap_err(),
        ann.group_unsubscribe(7).await.unwrap_err(),
        ann.group_watch_page(7, None, 10).await.unwrap_err(),
    ] {
        assert_eq!(refused.code(), Some(ErrorCode::Unsupported), "{refused}");
    }
    ann.ping().await.unwrap();
    svc.ping().await.unwrap();
}
