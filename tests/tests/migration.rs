//! A client moves to a new UDP socket five times in a row, mid-session: the
//! server sees every new address, the session carries on, pushes keep
//! arriving and watchers never see the user go offline.

use greendot_core::{Status, Tier};
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_server::ServerEvent;
use greendot_tests::{Relay, TestServer, SLACK};
use std::time::Duration;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_rebinds_keep_the_session_and_watchers_see_nothing() {
    let ts = TestServer::start(|_| {});
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;
    let mut server_events = ts.server.events();

    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let (mover, mut mover_events) = ts.connect("mia", "phone", Kind::Mobile).await;
    // The mover watches too, so pushes to the moving client are checked as well.
    mover.subscribe(&["walt"], Tier::Realtime).await.unwrap();
    watcher.subscribe(&["mia"], Tier::Realtime).await.unwrap();
    seen.wait_presence("mia", wait, |p| p.online)
        .await
        .expect("mia online");
    seen.reset();
    let session = mover.session();
    let start_addr = mover.local_addr().unwrap();

    let statuses = [
        Status::Away,
        Status::Busy,
        Status::DoNotDisturb,
        Status::Available,
        Status::Away,
    ];
    let mut addresses = vec![start_addr];
    for (i, status) in statuses.into_iter().enumerate() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let new_addr = socket.local_addr().unwrap();
        mover.rebind(socket).unwrap();
        addresses.push(new_addr);
        let message = format!("move {i}");
        mover.set_status(status, Some(&message)).await.unwrap();

        // The server saw the new address.
        let deadline = Instant::now() + SLACK;
        loop {
            match tokio::time::timeout_at(deadline, server_events.recv()).await {
                Ok(Ok(ServerEvent::Migrated { session: s, to, .. })) if to == new_addr => {
                    assert_eq!(s, Some(session));
                    break;
                }
                Ok(Ok(_)) => continue,
                Ok(Err(e)) => panic!("server events: {e}"),
                Err(_) => panic!("the server never saw move {i} to {new_addr}"),
            }
        }
        // Pushes keep arriving, both ways.
        seen.wait_presence("mia", wait, |p| {
            p.online && p.status == status && p.message.as_deref() == Some(message.as_str())
        })
        .await
        .unwrap_or_else(|| panic!("watcher missed mia's status after move {i}"));
        let walt_message = format!("seen move {i}");
        watcher
            .set_status(Status::Available, Some(&walt_message))
            .await
            .unwrap();
        mover_events
            .wait_presence("walt", wait, |p| {
                p.message.as_deref() == Some(walt_message.as_str())
            })
            .await
            .unwrap_or_else(|| panic!("mia missed walt's status after move {i}"));
    }

    assert_eq!(ts.server.stats().migrations, 5);
    assert_eq!(mover.session(), session, "the session carried on");
    assert_eq!(mover.local_addr().unwrap(), addresses[5]);
    assert_eq!(seen.offline_count("mia"), 0, "watchers saw mia offline");
    mover_events.drain();
    assert!(
        mover_events.connection_events().is_empty(),
        "the mover reconnected: {:?}",
        mover_events.connection_events()
    );
    let counters = ts.server.counters().await.unwrap();
    assert_eq!(counters.disconnects, 0);
    assert_eq!(counters.sessions_started, 2);
}

/// A silent client's address changes under it (its socket stays, the
/// path to the server moves: a NAT rebinding, a phone on a new network).
/// With `network_changed()` the server learns the new address at once (a
/// Ping goes out on the new path) and a push reaches the client within a
/// round trip plus slack; without it the push waits for the client's next
/// keep-alive (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_changed_brings_pushes_to_a_silent_moved_client_at_once() {
    // Long keep-alives on both sides: nothing but the call tells the
    // server where the client went.
    let ts = TestServer::start(|c| {
        c.keep_alive = Duration::from_secs(10);
        c.idle_timeout = Duration::from_secs(60);
    });
    let debounce = Duration::from_millis(ts.config().core.debounce.0);
    let relay = Relay::start(ts.addr()).await;
    let (watched, _) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let token = ts.token("mia", "phone", Kind::Mobile, WatchClaim::all());
    let mut config = ts.client_config(token);
    config.servers = vec![relay.addr.into()];
    config.keep_alive = Duration::from_secs(10);
    config.idle_timeout = Duration::from_secs(60);
    let (mover, mut seen) = ts.connect_with(config).await;
    mover.subscribe(&["walt"], Tier::Realtime).await.unwrap();
    // A round trip: its answer acknowledges everything the client sent, so
    // the client has nothing to send again.
    mover.ping().await.unwrap();
    // Then the client acknowledges the server's last datagram: from here
    // on it is silent (nothing to send before its keep-alive), and the old
    // path, closed by `new_path`, takes whatever the server still sends.
    relay.client_answered_last(SLACK).await;
    let mut server_events = ts.server.events();

    let new_addr = relay.new_path().await;
    // Nothing of the client's has gone out on the new path before the
    // call: what moves the connection is the call's Ping.
    let before = relay.traffic();
    assert_eq!(before.from_client_on_path, 0, "{before:?}");
    mover.network_changed();
    let changed = Instant::now();
    // The server saw the new address within a round trip (plus slack).
    let bound = Duration::from_millis(1500);
    loop {
        match tokio::time::timeout_at(changed + bound, server_events.recv()).await {
            Ok(Ok(ServerEvent::Migrated { to, .. })) if to == new_addr => break,
            Ok(Ok(_)) => continue,
            Ok(Err(e)) => panic!("server events: {e}"),
            Err(_) => panic!("the server did not learn {new_addr} within {bound:?}"),
        }
    }
    let set = Instant::now();
    watched
        .set_status(Status::Busy, Some("where are you"))
        .await
        .unwrap();
    let (at, _) = seen
        .wait_presence("walt", debounce + bound, |p| {
            p.message.as_deref() == Some("where are you")
        })
        .await
        .expect("the push reaches the moved client within the bound");
    assert!(at - set <= debounce + bound, "{:?}", at - set);
    assert_eq!(ts.server.stats().migrations, 1);
}
