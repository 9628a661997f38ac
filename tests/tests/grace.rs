//! With migration disabled on purpose, moving to a new socket kills the
//! connection. A client that reconnects and resumes within grace is never seen
//! offline (and keeps its subscriptions); one that does not is published
//! offline after grace.

use greendot_client::Event;
use greendot_core::{Status, Tier};
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_tests::{TestServer, SLACK};
use std::time::Duration;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_within_grace_is_unseen_and_no_resume_is_offline_after_grace() {
    let ts = TestServer::start(|c| c.migration = false);
    let config = ts.config().clone();
    let grace = Duration::from_millis(config.core.kinds[0].grace.0);
    let wait = Duration::from_millis(config.core.debounce.0) + SLACK;

    let (watcher, mut seen) = ts.connect("walt", "laptop", Kind::Desktop).await;
    let (gus, mut gus_events) = ts.connect("gus", "phone", Kind::Mobile).await;
    let mut hal_config =
        ts.client_config(ts.token("hal", "phone", Kind::Mobile, WatchClaim::all()));
    hal_config.reconnect = None;
    let (hal, mut hal_events) = ts.connect_with(hal_config).await;
    gus.subscribe(&["walt"], Tier::Realtime).await.unwrap();
    watcher
        .subscribe(&["gus", "hal"], Tier::Realtime)
        .await
        .unwrap();
    for user in ["gus", "hal"] {
        seen.wait_presence(user, wait, |p| p.online)
            .await
            .unwrap_or_else(|| panic!("{user} online"));
    }
    seen.reset();

    // gus changes networks; the server refuses the migration, the connection
    // dies, the client reconnects and resumes.
    let old_session = gus.session();
    gus.rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .unwrap();
    let reconnect_bound = config.idle_timeout * 2 + SLACK;
    let (_, event) = gus_events
        .wait_for(reconnect_bound, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("gus reconnects");
    assert!(
        matches!(event, Event::Reconnected { resumed: true, .. }),
        "not resumed: {event:?}"
    );
    assert_ne!(gus.session(), old_session);

    // Subscriptions carried over: walt's change reaches gus.
    watcher
        .set_status(Status::Busy, Some("after gus moved"))
        .await
        .unwrap();
    gus_events
        .wait_presence("walt", wait, |p| {
            p.message.as_deref() == Some("after gus moved")
        })
        .await
        .expect("gus still subscribed to walt");
    // And gus's own changes reach the watcher.
    gus.set_status(Status::Away, Some("back")).await.unwrap();
    seen.wait_presence("gus", wait, |p| p.message.as_deref() == Some("back"))
        .await
        .expect("watcher sees gus's status");
    assert_eq!(seen.offline_count("gus"), 0, "gus was seen offline");

    // hal changes networks and does not reconnect: offline after grace.
    let t0 = Instant::now();
    hal.rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .unwrap();
    let bound = ts.death_to_offline() + SLACK;
    let (at, _) = seen
        .wait_presence("hal", bound, |p| !p.online)
        .await
        .unwrap_or_else(|| panic!("hal still online {bound:?} after losing his connection"));
    let took = at - t0;
    assert!(
        took >= grace,
        "hal offline after {took:?}, before grace {grace:?}"
    );
    hal_events
        .wait_for(SLACK, |e| matches!(e, Event::Closed { .. }))
        .await
        .expect("hal's client gives up");

    assert_eq!(seen.offline_count("gus"), 0, "gus was seen offline");
    assert!(seen.presences_of("gus").all(|p| p.online));
    let counters = ts.server.counters().await.unwrap();
    assert_eq!(counters.resumed, 1, "{counters:?}");
    assert!(counters.grace_expired >= 1, "{counters:?}");
}
