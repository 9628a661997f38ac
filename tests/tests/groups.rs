//! Group presence (issue 28) against a real single-node server through the
//! Rust client: members get the online count at most once per interval on
//! the batched stream, admins each change in realtime, invisible members
//! are not counted, the member list pages online-first with a cursor, and
//! non-members, non-service tokens and hostile lists are refused with
//! clear errors while the session goes on; a client whose session ended
//! while it was away subscribes again itself. A watched page gets batched
//! deltas of its members and runs out unless renewed; a 4th watch and a
//! page past the budget are refused clearly.

use greendot_client::{Client, ClientError, ConfigError, Event, GroupChange, Source};
use greendot_core::Millis;
use greendot_proto::{ErrorCode, GroupRole, Kind};
use greendot_tests::{Recorder, Relay, TestServer, SLACK};
use std::collections::HashSet;
use std::time::Duration;

const GROUP: u64 = 42;
const NONE: &[&str] = &[];

async fn service(ts: &TestServer) -> Client {
    ts.connect_with(ts.client_config(ts.service_token("backend")))
        .await
        .0
}

/// Waits for a count of `group` equal to `count` (any source).
async fn count_reaches(seen: &mut Recorder, count: u32, within: Duration) -> bool {
    seen.wait_for(
        within,
        |e| matches!(e, Event::GroupCount { group: GROUP, count: c, .. } if *c == count),
    )
    .await
    .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_sees_the_count_batched_at_most_once_per_interval() {
    let interval = Duration::from_millis(1000);
    let ts = TestServer::start(|c| c.core.group_interval = Millis(1000));
    let svc = service(&ts).await;
    // A 1,000-member group: eight members who come online, mona, and 991
    // who stay away.
    let users: Vec<String> = (0..8).map(|i| format!("u{i}")).collect();
    let mut members = users.clone();
    members.push("mona".into());
    members.extend((0..991).map(|i| format!("away{i}")));
    svc.set_group(GROUP, &members, NONE).await.unwrap();
    let (mona, mut seen) = ts.connect("mona", "phone", Kind::Mobile).await;
    let snapshot = mona.group_subscribe(GROUP).await.unwrap();
    assert_eq!(snapshot.role, GroupRole::Member);
    assert_eq!(snapshot.members, 1_000);
    // Eight members come online one after the other, quickly: one count
    // per change would be eight pushes tens of ms apart.
    let mut clients = Vec::new();
    for user in &users {
        clients.push(ts.connect(user, "phone", Kind::Mobile).await.0);
    }
    assert!(
        count_reaches(&mut seen, 9, interval * 3 + SLACK).await,
        "the count reaches 9: {:?}",
        seen.seen
    );
    let counts: Vec<_> = seen
        .seen
        .iter()
        .filter_map(|(at, e)| match e {
            Event::GroupCount { count, source, .. } => Some((*at, *count, *source)),
            _ => None,
        })
        .collect();
    assert!(counts.iter().all(|(_, _, s)| *s == Source::Batched));
    for pair in counts.windows(2) {
        let gap = pair[1].0 - pair[0].0;
        // The server flushes an interval apart; arrivals jitter a little.
        assert!(
            gap >= interval / 2,
            "two counts {gap:?} apart (interval {interval:?}): {counts:?}"
        );
        assert!(pair[1].1 != pair[0].1, "an unchanged count was pushed");
    }
    if let (Some(first), Some(last)) = (counts.first(), counts.last()) {
        let intervals = (last.0 - first.0).as_millis() / interval.as_millis();
        assert!(counts.len() as u128 <= intervals + 2, "{counts:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_sees_each_change_in_realtime() {
    // A long interval: only realtime deltas can arrive in time.
    let ts = TestServer::start(|c| c.core.group_interval = Millis(30_000));
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["ann", "bob", "cy"], &["ada"])
        .await
        .unwrap();
    let (ada, mut seen) = ts.connect("ada", "laptop", Kind::Desktop).await;
    assert_eq!(
        ada.group_subscribe(GROUP).await.unwrap().role,
        GroupRole::Admin
    );
    let debounce = Duration::from_millis(ts.config().core.debounce.0);
    let mut online = Vec::new();
    for user in ["ann", "bob", "cy"] {
        online.push(ts.connect(user, "phone", Kind::Mobile).await.0);
        let delta = seen
            .wait_for(
                debounce + SLACK,
                |e| matches!(e, Event::GroupMember { member, online: true, .. } if member == user),
            )
            .await;
        assert!(
            delta.is_some(),
            "{user} online, in realtime: {:?}",
            seen.seen
        );
    }
    online[1].logout().await.unwrap();
    let delta = seen
        .wait_for(
            debounce + SLACK,
            |e| matches!(e, Event::GroupMember { member, online: false, .. } if member == "bob"),
        )
        .await;
    assert!(delta.is_some(), "bob offline, in realtime: {:?}", seen.seen);
    let versions: Vec<u64> = seen
        .seen
        .iter()
        .filter_map(|(_, e)| match e {
            Event::GroupMember { version, .. } | Event::GroupCount { version, .. } => {
                Some(*version)
            }
            _ => None,
        })
        .collect();
    assert!(versions.windows(2).all(|v| v[0] < v[1]), "{versions:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invisible_member_is_not_counted() {
    let ts = TestServer::start(|c| c.core.group_interval = Millis(300));
    let wait = Duration::from_millis(ts.config().core.debounce.0 + 300) + SLACK;
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["mona", "ivy", "zed"], NONE)
        .await
        .unwrap();
    let (mona, mut seen) = ts.connect("mona", "phone", Kind::Mobile).await;
    mona.group_subscribe(GROUP).await.unwrap();
    let (ivy, _) = ts.connect("ivy", "phone", Kind::Mobile).await;
    assert!(count_reaches(&mut seen, 2, wait).await, "{:?}", seen.seen);
    ivy.set_invisible(true).await.unwrap();
    assert!(
        count_reaches(&mut seen, 1, wait).await,
        "ivy went invisible: not counted any more: {:?}",
        seen.seen
    );
    let page = mona.group_page(GROUP, None, 10).await.unwrap();
    assert_eq!(page.count, 1);
    let ivy_entry = page.entries.iter().find(|(u, _)| u == "ivy").unwrap();
    assert!(!ivy_entry.1.online && !ivy_entry.1.invisible);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_list_pages_online_first_with_a_cursor() {
    let ts = TestServer::start(|_| {});
    let svc = service(&ts).await;
    let members = ["b", "c", "d", "e", "f", "g"];
    svc.set_group(GROUP, &members, &["ada"]).await.unwrap();
    let (ada, mut seen) = ts.connect("ada", "laptop", Kind::Desktop).await;
    ada.group_subscribe(GROUP).await.unwrap();
    let _b = ts.connect("b", "phone", Kind::Mobile).await;
    let _c = ts.connect("c", "phone", Kind::Mobile).await;
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let three = seen
        .wait_for(wait, |e| matches!(e, Event::GroupMember { count: 3, .. }))
        .await;
    assert!(three.is_some(), "ada, b and c online: {:?}", seen.seen);

    let mut listed = Vec::new();
    let mut after = None;
    let mut pages = 0;
    loop {
        let page = ada.group_page(GROUP, after, 2).await.unwrap();
        assert!(page.entries.len() <= 2);
        assert_eq!(page.count, 3);
        listed.extend(page.entries.into_iter().map(|(u, p)| (u, p.online)));
        pages += 1;
        assert!(pages <= 10, "the cursor goes nowhere: {listed:?}");
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(pages, 4, "7 members in pages of 2: {listed:?}");
    let names: HashSet<&str> = listed.iter().map(|(u, _)| u.as_str()).collect();
    assert_eq!(names.len(), 7, "each member once: {listed:?}");
    let online: Vec<bool> = listed.iter().map(|(_, o)| *o).collect();
    assert_eq!(online, [true, true, true, false, false, false, false]);
    let first: HashSet<&str> = listed[..3].iter().map(|(u, _)| u.as_str()).collect();
    assert_eq!(first, HashSet::from(["ada", "b", "c"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_member_is_refused() {
    let ts = TestServer::start(|_| {});
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["ann"], NONE).await.unwrap();
    let (nora, _) = ts.connect("nora", "phone", Kind::Mobile).await;
    let refused = nora.group_subscribe(GROUP).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotMember), "{refused}");
    let refused = nora.group_page(GROUP, None, 10).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotMember), "{refused}");
    // No such group: the same answer (a non-member cannot tell).
    let refused = nora.group_subscribe(GROUP + 1).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotMember), "{refused}");
    let refused = nora.group_unsubscribe(GROUP).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotSubscribed), "{refused}");
    nora.ping().await.unwrap();
}

/// A backend changes a group by difference through a real server: a
/// member added subscribes, an admin hears the count of each change, a
/// stale expected version is refused with the group's version and changes
/// nothing, a member removed gets `GroupEnded`, and only a service token
/// may change a group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_changed_by_difference_tells_its_subscribers() {
    let ts = TestServer::start(|c| c.core.group_interval = Millis(30_000));
    let svc = service(&ts).await;
    let add = |names: &[&str], expect| GroupChange {
        add: names.iter().map(|n| n.to_string()).collect(),
        expect_version: expect,
        ..GroupChange::default()
    };
    assert_eq!(
        svc.change_group(GROUP, add(&["ann"], Some(0)))
            .await
            .unwrap(),
        1
    );
    let promote = GroupChange {
        add_admins: vec!["ada".into()],
        ..GroupChange::default()
    };
    assert_eq!(svc.change_group(GROUP, promote).await.unwrap(), 2);
    let (ada, mut ada_seen) = ts.connect("ada", "laptop", Kind::Desktop).await;
    assert_eq!(
        ada.group_subscribe(GROUP).await.unwrap().role,
        GroupRole::Admin
    );
    let (bob, mut bob_seen) = ts.connect("bob", "phone", Kind::Mobile).await;
    let refused = bob.group_subscribe(GROUP).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotMember), "{refused}");
    assert_eq!(
        svc.change_group(GROUP, add(&["bob"], Some(2)))
            .await
            .unwrap(),
        3
    );
    let snap = bob.group_subscribe(GROUP).await.unwrap();
    assert_eq!((snap.role, snap.members), (GroupRole::Member, 3));
    // The admin is told a count after the change, at once.
    let told = ada_seen
        .wait_for(SLACK, |e| {
            matches!(e, Event::GroupCount { group: GROUP, .. })
        })
        .await;
    assert!(told.is_some(), "{:?}", ada_seen.seen);
    let stale = svc
        .change_group(GROUP, add(&["cy"], Some(2)))
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Some(ErrorCode::VersionMismatch), "{stale}");
    assert!(stale.to_string().ends_with("version=3"), "{stale}");
    let (cy, _) = ts.connect("cy", "phone", Kind::Mobile).await;
    let refused = cy.group_subscribe(GROUP).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(ErrorCode::NotMember),
        "nothing changed"
    );
    let leave = GroupChange {
        remove: vec!["bob".into()],
        expect_version: Some(3),
        ..GroupChange::default()
    };
    assert_eq!(svc.change_group(GROUP, leave).await.unwrap(), 4);
    let ended = bob_seen
        .wait_for(SLACK, |e| matches!(e, Event::GroupEnded { group: GROUP }))
        .await;
    assert!(ended.is_some(), "{:?}", bob_seen.seen);
    let refused = bob
        .change_group(GROUP, add(&["bob"], None))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::ServiceOnly), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_service_token_cannot_set_or_remove_a_group() {
    let ts = TestServer::start(|_| {});
    let (mal, _) = ts.connect("mal", "phone", Kind::Mobile).await;
    let refused = mal.set_group(GROUP, &["mal"], &["mal"]).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::ServiceOnly), "{refused}");
    let refused = mal.group_subscribe(GROUP).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(ErrorCode::NotMember),
        "no group was made"
    );
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["ann"], NONE).await.unwrap();
    let refused = mal.remove_group(GROUP).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::ServiceOnly), "{refused}");
    svc.remove_group(GROUP).await.unwrap();
    let refused = svc.remove_group(GROUP).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::UnknownGroup), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_list_or_a_long_name_is_refused_clearly_and_the_session_goes_on() {
    let ts = TestServer::start(|c| {
        c.core.max_group_members = 50;
        c.core.max_group_admins = 4;
    });
    let svc = service(&ts).await;
    let many: Vec<String> = (0..51).map(|i| format!("m{i}")).collect();
    let refused = svc.set_group(GROUP, &many, NONE).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(ErrorCode::TooManyGroupMembers),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("at most 50"),
        "says the limit: {refused}"
    );
    let refused = svc
        .set_group(GROUP, &["ann"], &["a1", "a2", "a3", "a4", "a5"])
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Some(ErrorCode::TooManyGroupAdmins),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("at most 4"),
        "says the limit: {refused}"
    );
    let long = "x".repeat(ts.config().limits.max_name_len + 1);
    let refused = svc
        .set_group(GROUP, &["ann", &long], NONE)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    let refused = svc.set_group(GROUP, &["ann", ""], NONE).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    // A list past the frame cap is refused by the client before it is sent.
    let huge: Vec<String> = (0..5_000)
        .map(|i| format!("member-with-a-long-name-{i}"))
        .collect();
    let refused = svc.set_group(GROUP, &huge, NONE).await.unwrap_err();
    assert!(
        matches!(
            refused,
            ClientError::Config(ConfigError::RequestTooLarge { .. })
        ),
        "{refused}"
    );
    // Nothing of the refused writes stayed; the session goes on.
    let (ann, _) = ts.connect("ann", "phone", Kind::Mobile).await;
    let refused = ann.group_subscribe(GROUP).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotMember), "{refused}");
    assert_eq!(
        svc.set_group(GROUP, &many[..49], &["ann"]).await.unwrap(),
        1
    );
    assert_eq!(ann.group_subscribe(GROUP).await.unwrap().members, 50);
}

/// mona's path dies for longer than her grace: her session ends at the
/// server, with its group subscription. When the path is back the client
/// connects afresh (not resumed) and subscribes to the group again itself:
/// she is told the count at once, and counts reach her again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_subscribes_again_after_a_reconnect_that_did_not_resume() {
    let ts = TestServer::start(|c| c.core.group_interval = Millis(200));
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["mona", "ulla"], NONE).await.unwrap();
    let relay = Relay::start(ts.addr()).await;
    let mut config = ts.client_config(ts.token(
        "mona",
        "phone",
        Kind::Mobile,
        greendot_server::token::WatchClaim::all(),
    ));
    config.servers = vec![relay.addr.into()];
    config.websocket = greendot_client::WebSocket::Off;
    let (mona, mut seen) = ts.connect_with(config).await;
    mona.group_subscribe(GROUP).await.unwrap();
    let (_watcher, mut watched) = ts.connect("walt", "laptop", Kind::Desktop).await;
    _watcher
        .subscribe(&["mona"], greendot_core::Tier::Realtime)
        .await
        .unwrap();

    relay.cut(true);
    seen.wait_for(ts.death_to_offline() + SLACK, |e| {
        matches!(e, Event::Disconnected { .. })
    })
    .await
    .expect("mona notices the loss");
    // Her session is over once watchers see her offline (past her grace).
    watched
        .wait_presence("mona", ts.death_to_offline() + SLACK, |p| !p.online)
        .await
        .expect("mona's session ends");
    relay.cut(false);
    let (_, back) = seen
        .wait_for(SLACK * 2, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("mona reconnects");
    assert!(
        matches!(back, Event::Reconnected { resumed: false, .. }),
        "{back:?}"
    );
    // The count comes at once, as a snapshot of the re-subscribe: it may
    // have moved while she was gone, and no push comes until it moves again.
    let (_, first) = seen
        .wait_for(SLACK, |e| matches!(e, Event::GroupCount { .. }))
        .await
        .expect("a count after the re-subscribe");
    assert!(
        matches!(
            first,
            Event::GroupCount {
                group: GROUP,
                source: Source::Snapshot,
                ..
            }
        ),
        "{first:?}"
    );
    // ulla comes online: the count (mona and ulla) reaches mona only if
    // she is subscribed again.
    let (_ulla, _) = ts.connect("ulla", "phone", Kind::Mobile).await;
    assert!(
        count_reaches(&mut seen, 2, Duration::from_millis(200) * 3 + SLACK).await,
        "no count after the reconnect: {:?}",
        seen.seen
    );
}

// ----- watched pages and the page budget ------------------------------------

/// Whether `e` is a page delta of `group` listing `member` as `online`.
fn delta_of(e: &Event, group: u64, member: &str, online: bool) -> bool {
    matches!(e, Event::GroupPageDelta { group: g, entries }
        if *g == group && entries.iter().any(|(u, p)| u == member && p.online == online))
}

fn deltas_of_group(seen: &Recorder, group: u64) -> Vec<&Event> {
    seen.seen
        .iter()
        .map(|(_, e)| e)
        .filter(|e| matches!(e, Event::GroupPageDelta { group: g, .. } if *g == group))
        .collect()
}

/// mona watches the page listing bob: bob's arrival reaches her batched.
/// nils reads the same page without watching it, and watches a page of
/// another group that lists cy: when cy's delta reaches him, on the same
/// batched stream and after bob's change, nothing of the first group has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_page_gets_batched_deltas_and_a_session_not_watching_does_not() {
    let ts = TestServer::start(|c| c.core.batch_interval = Millis(300));
    let other = GROUP + 1;
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["mona", "bob", "cy", "nils"], NONE)
        .await
        .unwrap();
    svc.set_group(other, &["nils", "cy"], NONE).await.unwrap();
    let (mona, mut mona_seen) = ts.connect("mona", "phone", Kind::Mobile).await;
    let (nils, mut nils_seen) = ts.connect("nils", "phone", Kind::Mobile).await;
    let page = mona.group_watch_page(GROUP, None, 10).await.unwrap();
    assert!(page.entries.iter().any(|(u, p)| u == "bob" && !p.online));
    nils.group_page(GROUP, None, 10).await.unwrap();
    nils.group_watch_page(other, None, 10).await.unwrap();

    let wait = Duration::from_millis(150 + 300) + SLACK;
    let _bob = ts.connect("bob", "phone", Kind::Mobile).await;
    let got = mona_seen
        .wait_for(wait, |e| delta_of(e, GROUP, "bob", true))
        .await;
    assert!(got.is_some(), "bob's delta: {:?}", mona_seen.seen);
    let _cy = ts.connect("cy", "phone", Kind::Mobile).await;
    let marker = nils_seen
        .wait_for(wait, |e| delta_of(e, other, "cy", true))
        .await;
    assert!(marker.is_some(), "cy's delta to nils: {:?}", nils_seen.seen);
    assert!(
        deltas_of_group(&nils_seen, GROUP).is_empty(),
        "nils watches no page of {GROUP}: {:?}",
        nils_seen.seen
    );
    assert!(
        mona_seen
            .wait_for(wait, |e| delta_of(e, GROUP, "cy", true))
            .await
            .is_some(),
        "cy is on mona's page too: {:?}",
        mona_seen.seen
    );
}

/// A watch lives `group_watch_ttl` (2 s here). The clock is read off an
/// event: tick's device dies after mona watched the page, and its offline
/// reaches her only after idle timeout + grace (2 s) + debounce, so the
/// watch has run out by then. cy (on the expired page) then comes online,
/// then zed (on a page mona watches afresh): when zed's delta arrives, no
/// delta of cy has. Asking the page again watches it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_page_expires_unless_renewed() {
    let ts = TestServer::start(|c| {
        c.core.group_watch_ttl = Millis(2000);
        c.core.batch_interval = Millis(200);
    });
    let marks = GROUP + 1;
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["mona", "bob", "cy", "dan"], NONE)
        .await
        .unwrap();
    svc.set_group(marks, &["mona", "zed"], NONE).await.unwrap();
    let (mona, mut seen) = ts.connect("mona", "phone", Kind::Mobile).await;
    mona.subscribe(&["tick"], greendot_core::Tier::Realtime)
        .await
        .unwrap();
    let tick_token = ts.token(
        "tick",
        "phone",
        Kind::Mobile,
        greendot_server::token::WatchClaim::all(),
    );
    let tick = greendot_tests::Doomed::spawn(ts.client_config(tick_token))
        .await
        .unwrap();
    let quick = Duration::from_millis(150 + 200) + SLACK;
    assert!(
        seen.wait_presence("tick", quick, |p| p.online)
            .await
            .is_some(),
        "tick online"
    );

    mona.group_watch_page(GROUP, None, 10).await.unwrap();
    // Renewed while alive: it was there to renew.
    mona.group_renew_watch(GROUP, None).await.unwrap();
    let _bob = ts.connect("bob", "phone", Kind::Mobile).await;
    assert!(
        seen.wait_for(quick, |e| delta_of(e, GROUP, "bob", true))
            .await
            .is_some(),
        "the watch works: {:?}",
        seen.seen
    );

    tick.kill();
    assert!(
        seen.wait_presence("tick", ts.death_to_offline() + SLACK, |p| !p.online)
            .await
            .is_some(),
        "tick's offline: the watch has run out by now"
    );
    let refused = mona.group_renew_watch(GROUP, None).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotSubscribed), "{refused}");
    mona.group_watch_page(marks, None, 10).await.unwrap();
    let _cy = ts.connect("cy", "phone", Kind::Mobile).await;
    let _zed = ts.connect("zed", "phone", Kind::Mobile).await;
    assert!(
        seen.wait_for(quick, |e| delta_of(e, marks, "zed", true))
            .await
            .is_some(),
        "zed's delta: {:?}",
        seen.seen
    );
    let after_expiry: Vec<_> = seen
        .seen
        .iter()
        .filter(|(_, e)| delta_of(e, GROUP, "cy", true))
        .collect();
    assert!(
        after_expiry.is_empty(),
        "cy's change after the watch ran out: {after_expiry:?}"
    );

    // Asked again, the page is watched again.
    mona.group_watch_page(GROUP, None, 10).await.unwrap();
    let _dan = ts.connect("dan", "phone", Kind::Mobile).await;
    assert!(
        seen.wait_for(quick, |e| delta_of(e, GROUP, "dan", true))
            .await
            .is_some(),
        "watched again: {:?}",
        seen.seen
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fourth_watched_page_is_refused_clearly() {
    let ts = TestServer::start(|_| {});
    let svc = service(&ts).await;
    let members: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    let mut all = members.clone();
    all.push("mona".into());
    svc.set_group(GROUP, &all, NONE).await.unwrap();
    let (mona, _) = ts.connect("mona", "phone", Kind::Mobile).await;
    let mut cursors = vec![None];
    for _ in 0..3 {
        let page = mona
            .group_watch_page(GROUP, *cursors.last().unwrap(), 2)
            .await
            .unwrap();
        cursors.push(page.next);
    }
    let refused = mona
        .group_watch_page(GROUP, cursors[3], 2)
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Some(ErrorCode::TooManyWatchedPages),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("watched pages"),
        "says which limit: {refused}"
    );
    // Asking a watched page again renews it: no 4th watch.
    mona.group_watch_page(GROUP, cursors[0], 2).await.unwrap();
    mona.group_unwatch_page(GROUP, cursors[1]).await.unwrap();
    mona.group_watch_page(GROUP, cursors[3], 2).await.unwrap();
    let refused = mona
        .group_unwatch_page(GROUP, cursors[1])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotSubscribed), "{refused}");
    mona.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_pages_are_rate_limited_with_a_retry_after() {
    let ts = TestServer::start(|c| {
        c.core.group_page_burst = 3;
        // No refill within the test: the 4th page is refused whatever the
        // machine's speed.
        c.core.group_page_refill = Millis(60_000);
    });
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["mona", "bob"], NONE).await.unwrap();
    svc.set_group(GROUP + 1, &["mona"], NONE).await.unwrap();
    let (mona, _) = ts.connect("mona", "phone", Kind::Mobile).await;
    for _ in 0..3 {
        mona.group_page(GROUP, None, 10).await.unwrap();
    }
    let refused = mona.group_page(GROUP, None, 10).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(ErrorCode::PageRateLimited),
        "{refused}"
    );
    let retry = refused.retry_after().expect("a retry-after");
    assert!(
        retry > Duration::from_secs(50) && retry <= Duration::from_secs(60),
        "{retry:?}: {refused}"
    );
    let refused = mona.group_watch_page(GROUP, None, 10).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(ErrorCode::PageRateLimited),
        "{refused}"
    );
    // Another group has its own budget; the session goes on.
    mona.group_page(GROUP + 1, None, 10).await.unwrap();
    mona.ping().await.unwrap();
}

/// A server on `store` with the quick test settings and `tweak`, once the
/// previous server on it has let the file go.
async fn restart_on(
    store: &std::path::Path,
    tweak: impl Fn(&mut greendot_server::ServerConfig),
) -> TestServer {
    let mut restarted = None;
    let reopened = greendot_tests::eventually(SLACK, || {
        if restarted.is_none() {
            let mut c = greendot_tests::quick_config();
            c.store = Some(store.to_owned());
            tweak(&mut c);
            restarted = greendot_server::Server::bind(c).ok();
        }
        restarted.is_some()
    })
    .await;
    assert!(reopened, "the store did not reopen");
    TestServer {
        server: restarted.unwrap(),
    }
}

/// Groups are saved: after a restart on the same store a member subscribes
/// again and a change expecting the stored version is made. A group over a
/// cap lowered meanwhile is not restored (the server starts without it) but
/// stays stored, and is back once the cap is raised again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saved_groups_come_back_after_a_restart_and_one_over_a_lowered_cap_waits() {
    let dir = std::env::temp_dir().join(format!("greendot-groups-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("store.redb");
    let ts = restart_on(&path, |_| {}).await;
    let svc = service(&ts).await;
    assert_eq!(
        svc.set_group(GROUP, &["ann", "bob", "cy"], &["ann"])
            .await
            .unwrap(),
        1
    );
    svc.set_group(GROUP + 1, &["ann"], NONE).await.unwrap();
    drop(svc);
    ts.server.shutdown().await;

    let ts = restart_on(&path, |c| c.core.max_group_members = 2).await;
    let (bob, _) = ts.connect("bob", "phone", Kind::Mobile).await;
    let refused = bob.group_subscribe(GROUP).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::NotMember), "{refused}");
    let (ann, _) = ts.connect("ann", "phone", Kind::Mobile).await;
    let small = ann.group_subscribe(GROUP + 1).await.unwrap();
    assert_eq!((small.role, small.members), (GroupRole::Member, 1));
    drop((bob, ann));
    ts.server.shutdown().await;

    let ts = restart_on(&path, |_| {}).await;
    let (bob, _) = ts.connect("bob", "phone", Kind::Mobile).await;
    let snap = bob.group_subscribe(GROUP).await.unwrap();
    assert_eq!((snap.role, snap.members), (GroupRole::Member, 3));
    let svc = service(&ts).await;
    let add = GroupChange {
        add: vec!["dee".into()],
        expect_version: Some(1),
        ..GroupChange::default()
    };
    assert_eq!(svc.change_group(GROUP, add).await.unwrap(), 2);
    drop((bob, svc));
    ts.server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A resume carries a watched page over. mona's connection dies (migration
/// refused) right after she watched the page, and bob comes online: once
/// she has resumed, bob's view reaches her as a delta without her watching
/// again, and the watch is there to renew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_session_keeps_its_watched_page() {
    let ts = TestServer::start(|c| {
        c.migration = false;
        c.core.batch_interval = Millis(200);
    });
    let svc = service(&ts).await;
    svc.set_group(GROUP, &["mona", "bob"], NONE).await.unwrap();
    let (mona, mut seen) = ts.connect("mona", "phone", Kind::Mobile).await;
    let page = mona.group_watch_page(GROUP, None, 10).await.unwrap();
    assert_eq!(page.entries.len(), 2);
    mona.rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .unwrap();
    let _bob = ts.connect("bob", "phone", Kind::Mobile).await;
    let reconnect_bound = ts.config().idle_timeout * 2 + SLACK;
    let (_, back) = seen
        .wait_for(reconnect_bound, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("mona reconnects");
    assert!(
        matches!(back, Event::Reconnected { resumed: true, .. }),
        "{back:?}"
    );
    // The dying connection may have brought bob's change already; the
    // resumed session's first flush brings every member its watch lists.
    assert!(
        seen.wait_for(Duration::from_millis(200) + SLACK, |e| delta_of(
            e, GROUP, "bob", true
        ))
        .await
        .is_some(),
        "no delta of bob after the resume: {:?}",
        seen.seen
    );
    mona.group_renew_watch(GROUP, None)
        .await
        .expect("the watch was carried over");
}
