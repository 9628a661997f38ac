//! Groups on a 3-node cluster (docs/groups.md, docs/cluster.md "The groups
//! bucket"): a group written at one node is changed at another by
//! difference at the version the first answered, and removed at the third;
//! an expected version that moved on is refused as on one node, and a group
//! written again after its removal goes on above its version. A group's
//! count is summed across the nodes, and is exact again after `kill -9` of
//! the node that sums it; its member pages list the members online across
//! the nodes first, before and after that kill, and a watched page brings
//! the changes of its members wherever they are connected.

mod support;
#[path = "support/three.rs"]
mod three;

use std::time::Duration;
use three::*;

use greendot_client::{Event, GroupChange, GroupRole, Updates};
use greendot_core::{Presence, Status};
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

/// When each count of group 7 arrived, and the count.
type Arrivals = Vec<(tokio::time::Instant, u32)>;

/// Waits for a count of group 7 equal to `count`, noting the counts'
/// arrivals.
async fn count_until(
    updates: &mut Updates,
    arrivals: &mut Arrivals,
    within: Duration,
    (what, count): (&str, u32),
) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, updates.next()).await {
            Ok(Some(Event::GroupCount {
                group: 7, count: c, ..
            })) => {
                arrivals.push((tokio::time::Instant::now(), c));
                if c == count {
                    return;
                }
            }
            Ok(Some(Event::GroupMember {
                group: 7, count: c, ..
            })) if c == count => return,
            Ok(Some(_)) => {}
            Ok(None) => panic!("{what}: the client ended"),
            Err(_) => panic!("{what}: not within {within:?}"),
        }
    }
}

/// The counts of group 7 `updates` brings within `window`, noted.
async fn counts_during(
    updates: &mut Updates,
    arrivals: &mut Arrivals,
    window: Duration,
) -> Vec<u32> {
    let deadline = tokio::time::Instant::now() + window;
    let mut counts = Vec::new();
    while let Ok(Some(event)) = tokio::time::timeout_at(deadline, updates.next()).await {
        if let Event::GroupCount {
            group: 7, count, ..
        } = event
        {
            arrivals.push((tokio::time::Instant::now(), count));
            counts.push(count);
        }
    }
    counts
}

/// A member's counts come at most once per group interval (arrivals
/// jitter a little), each a change.
fn once_per_interval(arrivals: &Arrivals) {
    for pair in arrivals.windows(2) {
        let gap = pair[1].0 - pair[0].0;
        assert!(
            gap >= GROUP_INTERVAL / 2,
            "two counts {gap:?} apart: {arrivals:?}"
        );
        assert_ne!(pair[0].1, pair[1].1, "an unchanged count: {arrivals:?}");
    }
}

/// Waits for a page delta of group 7 with an entry that `wanted` accepts.
async fn delta_until(
    updates: &mut Updates,
    within: Duration,
    what: &str,
    wanted: impl Fn(&str, &Presence) -> bool,
) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, updates.next()).await {
            Ok(Some(Event::GroupPageDelta { group: 7, entries }))
                if entries.iter().any(|(u, p)| wanted(u, p)) =>
            {
                return
            }
            Ok(Some(_)) => {}
            Ok(None) => panic!("{what}: the client ended"),
            Err(_) => panic!("{what}: not within {within:?}"),
        }
    }
}

/// Every page of group 7, `limit` entries at a time: (name, online).
async fn pages_of(client: &greendot_client::Client, limit: u32) -> Vec<(String, bool)> {
    let mut entries = Vec::new();
    let mut after = None;
    loop {
        let page = client.group_page(7, after, limit).await.unwrap();
        assert!(page.entries.len() <= limit as usize, "{page:?}");
        let listed = page
            .entries
            .iter()
            .map(|(user, p)| (user.clone(), p.online));
        entries.extend(listed);
        match page.next {
            Some(next) => after = Some(next),
            None => return entries,
        }
    }
}

/// `online` then `offline`, as pages list them.
fn listed(online: &[&str], offline: &[&str]) -> Vec<(String, bool)> {
    let on = online.iter().map(|n| (n.to_string(), true));
    on.chain(offline.iter().map(|n| (n.to_string(), false)))
        .collect()
}

/// A 1,000-member group (eight who connect) on three nodes. Its members
/// are counted across the three nodes wherever they
/// are connected and wherever their shards are owned: a member sees the
/// count on the batched stream, the admin each change in realtime, an
/// invisible member is not counted, and after `kill -9` of the node that
/// sums the group (the owner of its home shard) the count is exact again:
/// the member connected there is gone, the member it owned (connected
/// elsewhere) stays counted, and a logout after it is counted.
/// Member pages of 200 list the members online first (eve, invisible,
/// among the others), before and after the kill; a watched page brings a
/// member's change at another node. The member's counts came at most once
/// per group interval, each a change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_groups_count_is_exact_across_nodes_and_after_kill_9_of_its_summing_node() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let mut cluster = three_nodes("groups-counted").await;
    let summing = owner_of(&cluster.urls, "group/7");
    let (x, y, agg) = {
        let mut others: Vec<&Node> = [&cluster.a, &cluster.b, &cluster.c]
            .into_iter()
            .filter(|n| n.id != summing)
            .collect();
        let agg = [&cluster.a, &cluster.b, &cluster.c]
            .into_iter()
            .find(|n| n.id == summing)
            .unwrap();
        let y = others.pop().unwrap();
        (others.pop().unwrap(), y, agg)
    };
    let nodes = [&cluster.a, &cluster.b, &cluster.c];
    let (svc, _) = connect_as(&nodes, x, service()).await;
    // A member in the group's home shard, whose owner is the summing node:
    // its kill takes her owner too.
    let home = greendot_cluster::shard_of("group/7", SHARDS);
    let wes = (0..)
        .map(|i| format!("w{i}"))
        .find(|n| greendot_cluster::shard_of(n, SHARDS) == home)
        .unwrap();
    // 1,000 members: these eight, and 992 who never connect.
    let named = ["ann", "bob", "cy", "dee", "eve", "kim", "lee", &wes];
    let idle: Vec<String> = (0..992).map(|i| format!("z{i:03}")).collect();
    let members: Vec<&str> = named
        .into_iter()
        .chain(idle.iter().map(String::as_str))
        .collect();
    svc.set_group(7, &members, &["ann"]).await.unwrap();
    let mut arrivals = Arrivals::new();
    let phone = Kind::Mobile;
    let (ann, mut admin) = connect(&nodes, x, "ann", "phone", phone, WatchClaim::all()).await;
    let (bob, mut member) = connect(&nodes, y, "bob", "phone", phone, WatchClaim::all()).await;
    // At once after the write at another node: a node whose copy of the
    // directory lags reads the group from the store before it refuses.
    let snapshot = bob.group_subscribe(7).await.unwrap();
    assert_eq!(snapshot.role, GroupRole::Member);
    assert_eq!(snapshot.members, 1_000);
    let admin_snapshot = ann.group_subscribe(7).await.unwrap();
    assert_eq!(admin_snapshot.role, GroupRole::Admin);
    let (cy, _) = connect(&nodes, y, "cy", "phone", phone, WatchClaim::all()).await;
    let (dee, _) = connect(&nodes, x, "dee", "phone", phone, WatchClaim::all()).await;
    let (_kim, _) = connect(&nodes, agg, "kim", "phone", phone, WatchClaim::all()).await;
    // lee subscribes at the node that sums the group: her session's record
    // carries the subscription to the node she resumes on.
    let (lee, _) = connect(&nodes, agg, "lee", "phone", phone, WatchClaim::all()).await;
    lee.group_subscribe(7).await.unwrap();
    let (eve, _) = connect(&nodes, y, "eve", "phone", phone, WatchClaim::all()).await;
    let _wes = connect(&nodes, x, &wes, "phone", phone, WatchClaim::all()).await;
    eve.set_invisible(true).await.unwrap();
    // ann, bob, cy, dee, kim, lee and wes; eve is invisible. Counts move by a
    // partial a second at most, summed and published at once, and reach a
    // member at the next group interval (1 s here).
    let settle = DEBOUNCE + Duration::from_secs(3) + SLACK;
    count_until(&mut member, &mut arrivals, settle, ("seven online", 7)).await;
    // The admin heard the changes one by one, in realtime.
    let deadline = tokio::time::Instant::now() + SLACK;
    let mut admin_changes = 0;
    while admin_changes == 0 {
        match tokio::time::timeout_at(deadline, admin.next()).await {
            Ok(Some(Event::GroupMember { group: 7, .. })) => admin_changes += 1,
            Ok(Some(_)) => {}
            other => panic!("the admin heard no member change: {other:?}"),
        }
    }
    // eve stays uncounted.
    let later = counts_during(&mut member, &mut arrivals, GROUP_INTERVAL * 3).await;
    assert!(later.iter().all(|c| *c == 7), "eve counted: {later:?}");
    // A non-member is refused (after the store confirmed it).
    let (zed, _) = connect(&nodes, y, "zed", "phone", phone, WatchClaim::all()).await;
    let refused = zed.group_subscribe(7).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotMember), "{refused}");
    zed.ping().await.unwrap();
    // Pages of 200, online members first, each section by the order of
    // their joining; eve is invisible, so offline.
    let online = ["ann", "bob", "cy", "dee", "kim", "lee", &wes];
    let offline: Vec<&str> = ["eve"]
        .into_iter()
        .chain(idle.iter().map(String::as_str))
        .collect();
    assert_eq!(pages_of(&bob, 200).await, listed(&online, &offline));
    // A watched page: cy's change (at another node than bob's, her shard
    // owned wherever it is) comes to bob as a page delta on his batched
    // stream; the watch is renewed, then ended.
    let watched = bob.group_watch_page(7, None, 10).await.unwrap();
    assert_eq!(watched.entries.len(), 10, "{watched:?}");
    cy.set_status(Status::Busy, Some("on a call"))
        .await
        .unwrap();
    delta_until(&mut member, settle, "cy busy", |user, p| {
        user == "cy" && p.status == Status::Busy
    })
    .await;
    bob.group_renew_watch(7, None).await.unwrap();
    bob.group_unwatch_page(7, None).await.unwrap();
    let gone = bob.group_renew_watch(7, None).await.unwrap_err();
    assert_eq!(gone.code(), Some(ErrorCode::NotSubscribed), "{gone}");

    // kill -9 of the node summing the group: kim's phone goes with it;
    // lee's client resumes her session at another node, whose welcome
    // carries her group subscription over (she never subscribes again).
    let lee_session = lee.session();
    let killed = summing.clone();
    for n in [&mut cluster.a, &mut cluster.b, &mut cluster.c] {
        if n.id == killed {
            n.proc.kill9();
        }
    }
    let (x, y) = {
        let mut live = [&cluster.a, &cluster.b, &cluster.c]
            .into_iter()
            .filter(|n| n.id != killed);
        (live.next().unwrap(), live.next().unwrap())
    };
    let nodes = [x, y];
    let claims = Claims::new("lee", "phone", phone, WatchClaim::all(), HOUR);
    let (_lee, mut lee_counts) = connect_resuming(&nodes, x, claims, Some(lee_session)).await;
    assert_eq!(metric(x, "greendot_cluster_resumed_elsewhere_total"), 1);
    let deadline = tokio::time::Instant::now() + SLACK;
    loop {
        match tokio::time::timeout_at(deadline, lee_counts.next()).await {
            Ok(Some(Event::GroupCount { group: 7, .. })) => break,
            Ok(Some(_)) => {}
            other => panic!("lee's carried subscription told no count: {other:?}"),
        }
    }
    // Her shard's next owner shows her offline past the lease and her
    // grace; the home shard's next owner sums again from the partials.
    let failover = LEASE_TTL * 2 + GRACE + DEBOUNCE + Duration::from_secs(4) + SLACK;
    // wes, whose owner was killed too, stays counted: her device at a live
    // node is taken by her shard's next owner.
    count_until(&mut member, &mut arrivals, failover, ("kim gone", 6)).await;
    // The home shard's next owner answers pages: kim is offline.
    let online = ["ann", "bob", "cy", "dee", "lee", &wes];
    let offline: Vec<&str> = ["eve", "kim"]
        .into_iter()
        .chain(idle.iter().map(String::as_str))
        .collect();
    assert_eq!(pages_of(&bob, 200).await, listed(&online, &offline));
    dee.logout().await.unwrap();
    count_until(&mut member, &mut arrivals, settle, ("dee gone", 5)).await;
    once_per_interval(&arrivals);
    let mut at_lee = Arrivals::new();
    let dee_gone = ("dee gone, at lee", 5);
    count_until(&mut lee_counts, &mut at_lee, settle, dee_gone).await;
    bob.ping().await.unwrap();
}
