//! The core's own heartbeat timeout is the safety net: with lease renewal
//! effectively off (as if the connection's task hung), the core reaps the
//! session, the server closes the connection, and the client reconnects with a
//! new session and subscribes again to what it had.

use greendot_client::Event;
use greendot_core::{Millis, Tier};
use greendot_proto::Kind;
use greendot_tests::{TestServer, SLACK};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reaped_session_reconnects_and_subscribes_again() {
    let ts = TestServer::start(|c| {
        c.lease_renewal = Some(Duration::from_secs(3600));
        for kind in &mut c.core.kinds {
            kind.heartbeat_timeout = Millis(1000);
        }
    });
    let heartbeat = Duration::from_millis(1000);
    let wait = Duration::from_millis(ts.config().core.debounce.0) + SLACK;

    let (ann, mut events) = ts.connect("ann", "phone", Kind::Mobile).await;
    let first = ann.session();
    ann.subscribe(&["walt"], Tier::Realtime).await.unwrap();

    // Silent past the heartbeat timeout: reaped, closed, reconnected afresh.
    let (_, event) = events
        .wait_for(heartbeat + SLACK, |e| {
            matches!(e, Event::Reconnected { .. })
        })
        .await
        .expect("the client reconnects after the core reaped its session");
    assert!(
        matches!(event, Event::Reconnected { resumed: false, .. }),
        "{event:?}"
    );
    assert_ne!(ann.session(), first);
    let counters = ts.server.counters().await.unwrap();
    assert!(counters.ghosts_reaped >= 1, "{counters:?}");

    // The subscription was made again: walt's arrival reaches ann.
    let (_walt, _) = ts.connect("walt", "laptop", Kind::Desktop).await;
    events
        .wait_presence("walt", wait + heartbeat, |p| p.online)
        .await
        .expect("ann is subscribed to walt again");
}
