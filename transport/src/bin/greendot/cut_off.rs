//! What a cluster node does with its clients while it is cut off from NATS:
//! its lease ran out, it owns nothing, and its duty task tries to take a
//! lease again. From inside, two cases look the same:
//! - **The whole cluster lost NATS.** Nobody owns a shard, so nobody can
//!   publish an offline. The node keeps every client connected; when it
//!   rejoins, the new owners ask the edges to resend their devices, and they
//!   are online again without having been shown offline.
//! - **Only this node lost NATS.** The other nodes' owners see its lease
//!   expire and treat its devices as lost: its clients must move to another
//!   node within their grace.
//!
//! The node tells the two apart by asking its peers, at the HTTP addresses
//! their leases advertised, whether they hold their leases steadily
//! (`GET /cluster/lease?cut_off_ms=N`: held since before this node was cut
//! off N ms ago, and at least an act window, and renewed within the last
//! half of the window). A peer that shares the outage still holds a lease
//! for a moment, but renewed it at the latest when the outage began; one
//! that rejoined after it took its lease after this node's cut-off, so it
//! never says yes however long this node takes to rejoin. A peer that says
//! yes means the cluster works without this node:
//! it drains, and its clients reconnect to the others. While none does, it
//! holds, asking again every second, until it rejoins or the hold has
//! lasted the longest grace (past it, every device it holds would be
//! offline at any owner anyway); then it drains.

use greendot_cluster::{NodeId, NodePhase, NodeStatus};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tracing::{info, warn};

/// How long a peer has to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the peers are asked again while the node holds.
const ASK_EVERY: Duration = Duration::from_secs(1);

/// Why the node must drain. Returns only then; pending while the node's
/// duty runs and every cut-off ends in a rejoin within `hold_limit`.
pub async fn supervise(mut status: watch::Receiver<NodeStatus>, hold_limit: Duration) -> String {
    loop {
        if !phase_is(&mut status, NodePhase::CutOff).await {
            return "the node's cluster duty ended".into();
        }
        let since = Instant::now();
        let peers = status.borrow().peers.clone();
        let asked = peers.iter().filter(|(_, http)| http.is_some()).count();
        let mut said_holding = false;
        loop {
            if let Some(peer) = peer_holding_its_lease(&peers, since.elapsed()).await {
                return format!(
                    "cut off from NATS while node {peer} holds its lease: only this node lost \
                     NATS, so its clients move to the others"
                );
            }
            if !said_holding {
                warn!(
                    peers = peers.len(),
                    asked,
                    hold = ?hold_limit,
                    "cut off from NATS and no peer holds its lease: keeping every client \
                     connected until NATS is back"
                );
                said_holding = true;
            }
            let held = since.elapsed();
            if held >= hold_limit {
                return format!(
                    "cut off from NATS for {held:?}, past the longest grace ({hold_limit:?})"
                );
            }
            let next = (Instant::now() + ASK_EVERY).min(since + hold_limit);
            tokio::select! {
                _ = tokio::time::sleep_until(next.into()) => {}
                back = phase_is(&mut status, NodePhase::Active) => {
                    if !back {
                        return "the node's cluster duty ended".into();
                    }
                    info!(after = ?since.elapsed(), "rejoined the cluster: every client kept");
                    break;
                }
            }
        }
    }
}

/// Waits until the status is in `phase`; `false` if the duty task ended.
async fn phase_is(status: &mut watch::Receiver<NodeStatus>, phase: NodePhase) -> bool {
    loop {
        if status.borrow_and_update().phase == phase {
            return true;
        }
        if status.changed().await.is_err() {
            return false;
        }
    }
}

/// The first peer that answers that it has held its lease since before
/// this node was cut off (`cut_off_for` ago), asking all at once.
async fn peer_holding_its_lease(
    peers: &[(NodeId, Option<String>)],
    cut_off_for: Duration,
) -> Option<NodeId> {
    let mut asks = tokio::task::JoinSet::new();
    for (node, http) in peers {
        if let Some(http) = http.clone() {
            let node = node.clone();
            asks.spawn(async move { holds_its_lease(&http, cut_off_for).await.then_some(node) });
        }
    }
    while let Some(answer) = asks.join_next().await {
        if let Ok(Some(node)) = answer {
            return Some(node);
        }
    }
    None
}

/// `GET /cluster/lease?cut_off_ms=N` at `addr`: 200 means the node has
/// held its lease steadily since before the asker was cut off. No answer
/// within `ASK_TIMEOUT` is a no.
pub async fn holds_its_lease(addr: &str, cut_off_for: Duration) -> bool {
    let request = format!(
        "GET /cluster/lease?cut_off_ms={} HTTP/1.1\r\nHost: greendot\r\nConnection: close\r\n\r\n",
        cut_off_for.as_millis()
    );
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.ok()?;
        Some(&head[..] == b"HTTP/1.1 200" || &head[..] == b"HTTP/1.0 200")
    };
    matches!(tokio::time::timeout(ASK_TIMEOUT, ask).await, Ok(Some(true)))
}

/// The route peers ask: 200 while this node has held its lease steadily
/// since before the asker was cut off (`cut_off_ms`, milliseconds ago; an
/// act window when absent or unreadable), else 503
/// ([`NodeStatus::steadily_holding`]). A peer whose lease is still valid
/// but not renewed for a while shares the asker's outage, and one that
/// rejoined after it may be followed by the asker: neither must send the
/// asker's clients away.
pub fn lease_route(status: watch::Receiver<NodeStatus>) -> greendot_server::http::axum::Router {
    use greendot_server::http::axum::{extract::RawQuery, http::StatusCode, routing::get, Router};
    Router::new().route(
        "/cluster/lease",
        get(move |RawQuery(query): RawQuery| {
            let cut_off_for = query.as_deref().map_or(Duration::ZERO, cut_off_for);
            let holds = status
                .borrow()
                .steadily_holding(Instant::now(), cut_off_for);
            async move {
                if holds {
                    (StatusCode::OK, "held\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not held\n")
                }
            }
        }),
    )
}

/// The asker's `cut_off_ms` from a query string; zero when absent or not
/// a number (the act window then applies alone).
fn cut_off_for(query: &str) -> Duration {
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix("cut_off_ms="))
        .and_then(|ms| ms.parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn status(
        phase: NodePhase,
        lease_left: Duration,
        peers: Vec<(NodeId, Option<String>)>,
    ) -> NodeStatus {
        NodeStatus {
            node: NodeId::new("me").unwrap(),
            phase,
            lease_until: Instant::now() + lease_left,
            shards: BTreeMap::new(),
            live_nodes: 1 + peers.len(),
            epoch_changes: 0,
            lease_renewals: 0,
            cut_offs: 0,
            rejoins: 0,
            peers,
            act_window: Duration::from_secs(12),
            held_since: Instant::now() - Duration::from_secs(60),
        }
    }

    /// A peer's HTTP port serving `/cluster/lease` from its status.
    async fn peer(node: &str, lease_left: Duration) -> (NodeId, Option<String>) {
        peer_held(node, lease_left, Duration::from_secs(60)).await
    }

    /// As `peer`, holding its lease for `held_for`.
    async fn peer_held(
        node: &str,
        lease_left: Duration,
        held_for: Duration,
    ) -> (NodeId, Option<String>) {
        let held = NodeStatus {
            held_since: Instant::now() - held_for,
            ..status(NodePhase::Active, lease_left, Vec::new())
        };
        let (_tx, rx) = watch::channel(held);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _keep = _tx;
            greendot_server::http::axum::serve(listener, lease_route(rx))
                .await
                .unwrap();
        });
        (NodeId::new(node).unwrap(), Some(addr.to_string()))
    }

    #[test]
    fn a_lease_held_since_the_askers_cut_off_and_renewed_within_half_a_window_is_steady() {
        let s = |left| status(NodePhase::Active, left, Vec::new());
        let now = Instant::now();
        let secs = Duration::from_secs;
        // Held 60 s, renewed recently: steady for an asker cut off 5 s ago.
        assert!(s(secs(11)).steadily_holding(now, secs(5)));
        let rejoined = |held| NodeStatus {
            held_since: now - secs(held),
            ..s(secs(11))
        };
        assert!(
            !rejoined(3).steadily_holding(now, Duration::ZERO),
            "rejoined less than a window ago"
        );
        // Rejoined 20 s ago, more than a window: steady for an asker cut
        // off after that, not for one cut off before it (the peer shared
        // its outage and only rejoined first).
        assert!(rejoined(20).steadily_holding(now, secs(15)));
        assert!(
            !rejoined(20).steadily_holding(now, secs(30)),
            "rejoined after the asker's cut-off"
        );
        assert!(
            !s(secs(5)).steadily_holding(now, Duration::ZERO),
            "shares the outage"
        );
        let cut = status(NodePhase::CutOff, secs(11), Vec::new());
        assert!(!cut.steadily_holding(now, Duration::ZERO));
    }

    #[test]
    fn the_askers_cut_off_is_read_from_the_query() {
        assert_eq!(cut_off_for("cut_off_ms=2500"), Duration::from_millis(2500));
        assert_eq!(
            cut_off_for("x=1&cut_off_ms=7&y=2"),
            Duration::from_millis(7)
        );
        assert_eq!(cut_off_for("cut_off_ms=-1"), Duration::ZERO);
        assert_eq!(cut_off_for("cut_off_ms="), Duration::ZERO);
        assert_eq!(cut_off_for(""), Duration::ZERO);
    }

    /// A peer that rejoined after the asker was cut off answers no, however
    /// long it has held since: the asker shares its outage and is late to
    /// rejoin, so its clients stay; one cut off after the peer rejoined is
    /// told yes.
    #[tokio::test]
    async fn a_peer_that_rejoined_after_the_askers_cut_off_says_no() {
        let (_, addr) = peer_held("early", Duration::from_secs(11), Duration::from_secs(20)).await;
        let addr = addr.unwrap();
        assert!(!holds_its_lease(&addr, Duration::from_secs(30)).await);
        assert!(holds_its_lease(&addr, Duration::from_secs(15)).await);
    }

    /// Only this node lost NATS: a peer renewed recently, so it drains.
    #[tokio::test]
    async fn a_node_alone_cut_off_drains() {
        let peers = vec![
            peer("sharing", Duration::from_secs(2)).await,
            peer("healthy", Duration::from_secs(11)).await,
        ];
        let (_tx, rx) = watch::channel(status(NodePhase::CutOff, Duration::ZERO, peers));
        let why = tokio::time::timeout(
            Duration::from_secs(5),
            supervise(rx, Duration::from_secs(600)),
        )
        .await
        .expect("decides at once");
        assert!(why.contains("node healthy holds its lease"), "{why}");
    }

    /// The whole cluster lost NATS: no peer renewed recently, so it holds
    /// its clients through the cut-off and the rejoin, and drains only
    /// after a hold longer than the limit.
    #[tokio::test]
    async fn a_cluster_wide_outage_holds_until_the_rejoin_or_the_limit() {
        let peers = vec![
            peer("sharing", Duration::from_secs(2)).await,
            (NodeId::new("silent").unwrap(), None),
        ];
        let (tx, rx) = watch::channel(status(NodePhase::CutOff, Duration::ZERO, peers.clone()));
        let mut supervised = Box::pin(supervise(rx, Duration::from_secs(600)));
        // Held: asked, answered no, and waiting.
        assert!(
            tokio::time::timeout(Duration::from_millis(1500), &mut supervised)
                .await
                .is_err()
        );
        tx.send(status(
            NodePhase::Active,
            Duration::from_secs(11),
            peers.clone(),
        ))
        .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut supervised)
                .await
                .is_err()
        );

        // Cut off again, with a short limit: drains when the hold is over.
        let (_tx, rx) = watch::channel(status(NodePhase::CutOff, Duration::ZERO, peers));
        let why = tokio::time::timeout(
            Duration::from_secs(5),
            supervise(rx, Duration::from_millis(200)),
        )
        .await
        .expect("drains after the limit");
        assert!(why.contains("past the longest grace"), "{why}");
    }
}
