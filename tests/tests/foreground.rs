//! Foreground and background (I12) against a real server, through the Rust
//! client's lifecycle surface: a backgrounded phone is offline to watchers
//! after the debounce, last seen when it went, and routes nowhere; back in
//! the foreground it is online and routable; a quick toggle shows nothing;
//! the app's state survives a reconnect (the hello carries it); a client
//! left in the background closes its connection and comes back resuming.

use greendot_client::{ClientConfig, Event};
use greendot_core::{Status, Tier};
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_tests::{Recorder, Relay, TestServer, SLACK};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

async fn routed(svc: &greendot_client::Client, user: &str) -> Vec<String> {
    let mut devices: Vec<String> = svc
        .route(user)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.device)
        .collect();
    devices.sort();
    devices
}

/// A watcher of `user` that saw them online.
async fn watching(
    ts: &TestServer,
    user: &str,
    wait: Duration,
) -> (greendot_client::Client, Recorder) {
    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    watcher.subscribe(&[user], Tier::Realtime).await.unwrap();
    seen.wait_presence(user, wait, |p| p.online)
        .await
        .expect("online at first");
    seen.reset();
    (watcher, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backgrounded_is_offline_after_debounce_last_seen_when_it_went_and_routes_nowhere() {
    let ts = TestServer::start(|_| {});
    let debounce = Duration::from_millis(ts.config().core.debounce.0);
    let wait = debounce + SLACK;
    let (phone, _) = ts.connect("bea", "phone", Kind::Mobile).await;
    let (svc, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;
    let (_watcher, mut seen) = watching(&ts, "bea", wait).await;
    assert_eq!(routed(&svc, "bea").await, ["phone"]);

    let went_from = unix_ms();
    phone.app_backgrounded();
    assert!(!phone.is_foreground());
    // Requests after the change go after it: once answered, the server
    // took the change.
    phone.ping().await.unwrap();
    let went_by = unix_ms();
    assert!(
        routed(&svc, "bea").await.is_empty(),
        "a backgrounded phone is routable: a backend would not push"
    );
    let (at, offline) = seen
        .wait_presence("bea", wait, |p| !p.online)
        .await
        .expect("watchers see bea offline");
    let last_seen = offline.last_seen.expect("a last seen").0;
    // The server's Unix time is its monotonic clock from a Unix start:
    // a few ms from this process's wall clock.
    assert!(
        (went_from.saturating_sub(50)..=went_by + 50).contains(&last_seen),
        "last seen {last_seen} is not when she went to the background ({went_from}..={went_by})"
    );
    // The session is kept: it answers, its keep-alives go on, and last
    // seen does not move with them.
    phone.ping().await.unwrap();
    assert!(
        !phone.query("bea").await.unwrap().online,
        "her own view: not present"
    );
    let queried = svc.query("bea").await.unwrap();
    assert_eq!(queried.last_seen.map(|t| t.0), Some(last_seen));

    // Back in the foreground: online again and routable at once.
    phone.app_foregrounded();
    phone.ping().await.unwrap();
    assert_eq!(routed(&svc, "bea").await, ["phone"]);
    let (back_at, back) = seen
        .wait_presence("bea", wait, |p| p.online)
        .await
        .expect("watchers see bea online again");
    assert!(back.online && back.last_seen.is_none(), "{back:?}");
    assert!(back_at > at);
    assert_eq!(
        seen.offline_count("bea"),
        1,
        "one offline, then online: {:?}",
        seen.seen
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_toggle_shorter_than_debounce_is_never_published() {
    // A long debounce, so that the toggle is well inside it on a loaded
    // machine.
    let ts = TestServer::start(|c| c.core.debounce = greendot_core::Millis(1_500));
    let wait = Duration::from_millis(1_500) + SLACK;
    let (phone, _) = ts.connect("bea", "phone", Kind::Mobile).await;
    let (_watcher, mut seen) = watching(&ts, "bea", wait).await;

    phone.app_backgrounded();
    phone.ping().await.unwrap();
    phone.app_foregrounded();
    phone.ping().await.unwrap();
    // A change after the toggle: published once its own debounce held, so
    // anything the toggle published would have come before it.
    phone.set_status(Status::Busy, None).await.unwrap();
    seen.wait_presence("bea", wait, |p| p.status == Status::Busy)
        .await
        .expect("the status change is published");
    assert_eq!(
        seen.offline_count("bea"),
        0,
        "a quick toggle flapped: {:?}",
        seen.seen
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_state_survives_a_reconnect_and_the_foreground_reconnects_at_once() {
    let ts = TestServer::start(|_| {});
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let (svc, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;

    // A phone that starts in the background (woken by a push): never shown,
    // never routed.
    let mut config: ClientConfig =
        ts.client_config(ts.token("cy", "phone", Kind::Mobile, WatchClaim::all()));
    config.foreground = false;
    let relay = Relay::start(ts.addr()).await;
    config.servers = vec![relay.addr.into()];
    config.websocket = greendot_client::WebSocket::Off;
    config.request_timeout = Duration::from_millis(500);
    // The connection stays up in the background: what dies is the path.
    config.close_in_background = None;
    // Redials are far apart: a quick reconnect comes from the lifecycle.
    config.reconnect = Some(greendot_client::Reconnect::new(
        Duration::from_secs(60),
        Duration::from_secs(60),
        None,
    ));
    let (phone, mut events) = ts.connect_with(config).await;
    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let snapshot = watcher.subscribe(&["cy"], Tier::Realtime).await.unwrap();
    assert!(!snapshot.snapshots[0].2.online, "{snapshot:?}");
    assert!(routed(&svc, "cy").await.is_empty());

    // The connection dies in the background; a network change reconnects,
    // and the hello says the app is still in the background.
    relay.cut(true);
    let idle = ts.config().idle_timeout;
    events
        .wait_for(idle + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("the client notices the loss");
    relay.cut(false);
    phone.network_changed();
    let (_, reconnected) = events
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("reconnects on the network change");
    assert!(
        matches!(reconnected, Event::Reconnected { resumed: true, .. }),
        "{reconnected:?}"
    );
    phone.ping().await.unwrap();
    assert!(
        routed(&svc, "cy").await.is_empty(),
        "the reconnect's hello lost the background"
    );

    // Dies again; back in the foreground it reconnects at once (the
    // backoff would wait up to a minute) and resumes.
    relay.cut(true);
    events
        .wait_for(idle + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("the client notices the loss");
    relay.cut(false);
    phone.app_foregrounded();
    let (_, reconnected) = events
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("reconnects at once in the foreground");
    assert!(
        matches!(reconnected, Event::Reconnected { resumed: true, .. }),
        "{reconnected:?}"
    );
    phone.ping().await.unwrap();
    assert_eq!(routed(&svc, "cy").await, ["phone"]);
    seen.wait_presence("cy", wait, |p| p.online)
        .await
        .expect("watchers see cy online");
}

/// `close_in_background`: a phone left in the background closes its
/// connection (nothing of it wakes the device any more) while the server
/// keeps the session; a request in the background reconnects, resuming,
/// and the connection goes quiet again; back in the foreground it resumes
/// at once and is online. Watchers see one offline and one online.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phone_left_in_the_background_closes_its_connection_and_resumes() {
    let ts = TestServer::start(|_| {});
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let quiet = Duration::from_millis(300);
    let (svc, _) = ts
        .connect_with(ts.client_config(ts.service_token("backend")))
        .await;
    let mut config = ts.client_config(ts.token("dot", "phone", Kind::Mobile, WatchClaim::all()));
    config.close_in_background = Some(quiet);
    // Redials are far apart: a quick reconnect comes from the lifecycle or
    // a request.
    config.reconnect = Some(greendot_client::Reconnect::new(
        Duration::from_secs(60),
        Duration::from_secs(60),
        None,
    ));
    let (phone, mut events) = ts.connect_with(config).await;
    let (_watcher, mut seen) = watching(&ts, "dot", wait).await;
    let session = phone.session();

    phone.app_backgrounded();
    phone.ping().await.unwrap();
    let (_, closed) = events
        .wait_for(quiet + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("the backgrounded phone closes its connection");
    assert!(
        matches!(&closed, Event::Disconnected { reason } if reason.contains("background")),
        "{closed:?}"
    );
    seen.wait_presence("dot", wait, |p| !p.online)
        .await
        .expect("watchers see dot offline");
    assert!(routed(&svc, "dot").await.is_empty());

    // A request of the app in the background reconnects, resuming.
    phone.set_status(Status::Away, None).await.unwrap();
    let (_, back) = events
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("a request reconnects");
    assert!(
        matches!(back, Event::Reconnected { resumed: true, .. }),
        "{back:?}"
    );
    assert!(
        routed(&svc, "dot").await.is_empty(),
        "still in the background"
    );
    events
        .wait_for(quiet + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("quiet again after the request");

    // Back in the foreground: resumed at once, online and routable.
    events.reset();
    phone.app_foregrounded();
    let (_, back) = events
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("the foreground reconnects at once");
    assert!(
        matches!(back, Event::Reconnected { resumed: true, .. }),
        "{back:?}"
    );
    phone.ping().await.unwrap();
    assert_eq!(routed(&svc, "dot").await, ["phone"]);
    let (_, online) = seen
        .wait_presence("dot", wait, |p| p.online)
        .await
        .expect("watchers see dot online again");
    assert_eq!(
        online.status,
        Status::Away,
        "the status set in the background"
    );
    // One offline, then online: the closes and the reconnects show nothing.
    let mut shown: Vec<bool> = seen.presences_of("dot").map(|p| p.online).collect();
    shown.dedup();
    assert_eq!(shown, [false, true], "{:?}", seen.seen);
    assert_ne!(phone.session(), session, "every welcome names a new id");
    assert_eq!(phone.stats().quic_connections, 3);
}
