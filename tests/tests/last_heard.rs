//! `last_seen` tells when the device was last heard from (DESIGN.md): a
//! client that falls silent without closing is shown offline, once its grace
//! ran out, with a last seen at its last packet, not at the end of its grace.

use greendot_core::Tier;
use greendot_proto::Kind;
use greendot_tests::{Doomed, TestServer, SLACK};
use std::time::{SystemTime, UNIX_EPOCH};

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

// The server measures the last packet of each connection and hands it to
// the core with the disconnect (`Hub::closed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_last_seen_at_its_last_packet() {
    let ts = TestServer::start(|_| {});
    let (watcher, mut events) = ts.connect("wanda", "phone", Kind::Mobile).await;
    let token = ts.token(
        "ghost",
        "phone",
        Kind::Mobile,
        greendot_server::token::WatchClaim::all(),
    );
    let ghost = Doomed::spawn(ts.client_config(token)).await.unwrap();
    watcher.subscribe(&["ghost"], Tier::Realtime).await.unwrap();
    events
        .wait_presence("ghost", SLACK, |p| p.online)
        .await
        .expect("ghost shown online");
    // Its runtime stops: no packet, no close, ever again. Its last packet
    // (a keep-alive at worst) left at most one keep-alive interval before.
    let silent_from = unix_ms();
    ghost.kill();
    let keep_alive = ts.config().keep_alive.as_millis() as u64;
    let (_, offline) = events
        .wait_presence("ghost", ts.death_to_offline() + SLACK, |p| !p.online)
        .await
        .expect("ghost shown offline");
    let last_seen = offline.last_seen.expect("a last seen").0;
    // The end of grace would be idle timeout + grace (3.5 s) later.
    assert!(
        last_seen + keep_alive + 100 >= silent_from && last_seen <= silent_from + 100,
        "last seen {} ms after the client fell silent",
        last_seen as i64 - silent_from as i64
    );
}
