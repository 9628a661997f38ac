//! Groups are served by a single node only for now (docs/groups.md): a
//! node started with `--cluster` answers every group request `Unsupported`
//! with a message saying so, and the session goes on.

mod support;
#[path = "support/three.rs"]
mod three;

use std::time::Duration;
use three::*;

use greendot_client::GroupChange;
use greendot_proto::{ErrorCode, Kind};
use greendot_server::token::{Claims, WatchClaim};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_refuses_group_requests_clearly() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let cluster = three_nodes("groups-refused").await;
    let nodes = [&cluster.a, &cluster.b, &cluster.c];
    let svc = Claims::new(
        "backend",
        "svc",
        Kind::Other,
        WatchClaim::all(),
        Duration::from_secs(3600),
    )
    .service();
    let (svc, _) = connect_as(&nodes, &cluster.a, svc).await;
    let refused = svc.set_group(7, &["ann"], &["ann"]).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::Unsupported), "{refused}");
    assert!(
        refused.to_string().contains("single node"),
        "says why: {refused}"
    );
    let (ann, _) = connect(
        &nodes,
        &cluster.b,
        "ann",
        "phone",
        Kind::Mobile,
        WatchClaim::all(),
    )
    .await;
    for refused in [
        svc.change_group(7, GroupChange::default())
            .await
            .unwrap_err(),
        ann.group_subscribe(7).await.unwrap_err(),
        ann.group_page(7, None, 10).await.unwrap_err(),
        ann.group_unsubscribe(7).await.unwrap_err(),
    ] {
        assert_eq!(refused.code(), Some(ErrorCode::Unsupported), "{refused}");
    }
    ann.ping().await.unwrap();
    svc.ping().await.unwrap();
}
