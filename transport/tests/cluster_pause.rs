//! A paused greendot node (issue 30 §5): three `greendot serve --cluster`
//! nodes on a 3-node NATS cluster; node a is stopped (`SIGSTOP`) until its
//! lease has run out and the others own all its shards, then continued.
//!
//! - **Nothing stale when it wakes.** Right before the stop, a user of a's
//!   shards changes her status, so a's core holds a publish due within the
//!   debounce; after the failover she changes it again at her new owner.
//!   A plain NATS client reads every view and truth on the wire: none that
//!   a stamped after it woke carries an epoch a held (or one older than a
//!   view already seen of the shard). Raw QUIC watchers on b and c (the
//!   client library would drop older versions before a test could see
//!   them) record every push: no user's version ever goes down.
//! - **Its devices are served elsewhere.** Phones on a were given every
//!   node's address: while a is stopped nothing answers them, so their
//!   connections time out (the 1 s idle timeout) and they reconnect to b or
//!   c within their grace; no watcher ever sees one of them offline, and a
//!   change by one of them after the failover reaches the watchers.
//! - **What the woken node does** is printed: it finds its lease gone,
//!   asks its peers, hears that they hold theirs (only it was away), drains
//!   and exits non-zero for its supervisor to start it again.

mod support;
#[path = "support/three.rs"]
mod three;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use three::*;

use futures_util::StreamExt;
use greendot_client::Event;
use greendot_cluster::testing::NatsCluster;
use greendot_cluster::{Envelope, MessageKey, NatsAccess};
use greendot_core::Status;
use greendot_proto::{self as proto, Kind, Push, Request, RequestFrame, ServerFrame};
use greendot_server::cluster::ShardView;
use greendot_server::token::{Claims, TokenKeys, WatchClaim};

/// Longer than a's stop (lease TTL, NATS's expiry lag, a claim) plus a
/// reconnect, so that a device that moved in time is never shown offline.
const PAUSE_GRACE: Duration = Duration::from_secs(6);
/// How far past its lease TTL a stays stopped.
const STOP_MARGIN: Duration = Duration::from_secs(2);

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Claims by shard (owner, epoch), as the KV has them now.
async fn claims(urls: &str) -> BTreeMap<u32, (String, u64)> {
    let view = greendot_cluster::observe(urls, &NatsAccess::default(), "gd", SLACK)
        .await
        .expect("the cluster's KV");
    view.claims
        .iter()
        .map(|(s, c)| (s.0, (c.owner.to_string(), c.epoch)))
        .collect()
}

/// Every write to the claims bucket from now on (a claim taken, renewed,
/// expired): what a look at the claims waits for.
async fn claim_changes(urls: &str) -> async_nats::jetstream::kv::Watch {
    let url = urls.split(',').next().expect("a NATS URL");
    let nats = async_nats::connect(url).await.expect("NATS");
    async_nats::jetstream::new(nats)
        .get_key_value("gd_claims")
        .await
        .expect("the claims bucket")
        .watch_all()
        .await
        .expect("a watch of the claims")
}

/// One view or truth seen on the wire.
#[derive(Debug, Clone)]
struct WireView {
    subject: String,
    shard: u32,
    epoch: u64,
    published_ms: u64,
    user: String,
    version: u64,
}

/// Every view (`gd.shard.*`) and truth (`gd.edge.*`) the nodes publish, in
/// the order NATS delivered them.
async fn watch_wire(urls: &str) -> Arc<Mutex<Vec<WireView>>> {
    let url = urls.split(',').next().expect("a NATS URL");
    let nats = async_nats::connect(url).await.expect("NATS");
    let mut shards = nats.subscribe("gd.shard.*").await.unwrap();
    let mut edges = nats.subscribe("gd.edge.*").await.unwrap();
    // Subscribed at the server once it answers a request after them.
    assert!(nats
        .request("barrier.none", Default::default())
        .await
        .is_err());
    let envelope = Envelope::new(MessageKey::derive(SECRET.as_bytes()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = seen.clone();
    tokio::spawn(async move {
        let _nats = nats;
        loop {
            let message = tokio::select! {
                Some(m) = shards.next() => m,
                Some(m) = edges.next() => m,
                else => break,
            };
            let subject = message.subject.to_string();
            let payload = envelope
                .open(&subject, &message.payload)
                .unwrap_or_else(|| panic!("a message on {subject} not sealed with the secret"));
            let v: ShardView = postcard::from_bytes(&payload).expect("a view");
            out.lock().unwrap().push(WireView {
                shard: greendot_cluster::shard_of(&v.user, SHARDS).0,
                subject,
                epoch: v.epoch,
                published_ms: v.published_ms,
                user: v.user,
                version: v.presence.version,
            });
        }
    });
    seen
}

/// A push (or subscribe snapshot) a raw watcher got.
#[derive(Debug, Clone)]
struct Seen {
    target: String,
    version: u64,
    online: bool,
    status: proto::Status,
}

/// A watcher speaking the protocol itself, keeping every update the server
/// pushed (the client library drops versions older than it knows).
struct RawWatcher {
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Signalled after every push recorded in `seen`.
    arrived: Arc<tokio::sync::Notify>,
}

async fn raw_watcher(at: &Node, user: &str, targets: &[String]) -> RawWatcher {
    let claims = Claims::new(user, "laptop", Kind::Desktop, WatchClaim::all(), HOUR);
    let token = TokenKeys::new(SECRET.as_bytes(), Duration::ZERO)
        .mint(&claims)
        .unwrap();
    let crypto =
        greendot_client::tls::client_crypto(std::slice::from_ref(&at.cert), proto::ALPN).unwrap();
    let mut endpoint = quinn::Endpoint::client(([127, 0, 0, 1], 0).into()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = endpoint
        .connect(at.addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let pushes = seen.clone();
    let arrived = Arc::new(tokio::sync::Notify::new());
    let signal = arrived.clone();
    let accept = conn.clone();
    tokio::spawn(async move {
        while let Ok(mut recv) = accept.accept_uni().await {
            let (pushes, signal) = (pushes.clone(), signal.clone());
            tokio::spawn(async move {
                let mut reader = proto::FrameReader::new(proto::MAX_SERVER_FRAME);
                while let Ok(Some(frame)) = proto::codec::read_frame(&mut recv, &mut reader).await {
                    if let Ok(Push::Update { target, presence }) = proto::decode::<Push>(&frame) {
                        pushes.lock().unwrap().push(Seen {
                            target,
                            version: presence.version,
                            online: presence.online,
                            status: presence.status,
                        });
                        // One stored permit: a waiter between its look and
                        // its wait still wakes.
                        signal.notify_one();
                    }
                }
            });
        }
    });
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = proto::Hello {
        version: proto::VERSION,
        token,
        resume: None,
        foreground: true,
    };
    let subscribe = RequestFrame {
        id: 1,
        request: Request::Subscribe {
            targets: targets.to_vec(),
            tier: proto::Tier::Realtime,
        },
    };
    send.write_all(&proto::encode_frame(&hello).unwrap())
        .await
        .unwrap();
    send.write_all(&proto::encode_frame(&subscribe).unwrap())
        .await
        .unwrap();
    let mut reader = proto::FrameReader::new(proto::MAX_SERVER_FRAME);
    loop {
        let frame = tokio::time::timeout(SLACK, proto::codec::read_frame(&mut recv, &mut reader))
            .await
            .expect("the watcher's subscribe answered")
            .unwrap()
            .expect("a frame");
        match proto::decode::<ServerFrame>(&frame).unwrap() {
            ServerFrame::Welcome(_) => {}
            ServerFrame::Reply {
                id: 1,
                result: Ok(proto::Answer::Subscribed { snapshots, refused }),
            } => {
                assert!(refused.is_empty(), "{refused:?}");
                let mut s = seen.lock().unwrap();
                for snap in snapshots {
                    s.push(Seen {
                        target: snap.target,
                        version: snap.presence.version,
                        online: snap.presence.online,
                        status: snap.presence.status,
                    });
                }
                break;
            }
            other => panic!("the watcher got {other:?}"),
        }
    }
    // The control stream stays open (kept by the task) for the session.
    tokio::spawn(async move {
        let _send = send;
        while let Ok(Some(_)) = proto::codec::read_frame(&mut recv, &mut reader).await {}
    });
    RawWatcher {
        _endpoint: endpoint,
        conn,
        seen,
        arrived,
    }
}

impl RawWatcher {
    /// Waits until the latest of `target` satisfies `pred`.
    async fn wait(&self, target: &str, within: Duration, what: &str, pred: impl Fn(&Seen) -> bool) {
        let deadline = Instant::now() + within;
        loop {
            let latest = self
                .seen
                .lock()
                .unwrap()
                .iter()
                .filter(|s| s.target == target)
                .max_by_key(|s| s.version)
                .cloned();
            if latest.as_ref().is_some_and(&pred) {
                return;
            }
            assert!(
                self.conn.close_reason().is_none(),
                "{what}: the watcher's connection ended: {:?}",
                self.conn.close_reason()
            );
            assert!(
                Instant::now() < deadline,
                "{what}: not within {within:?}; latest {latest:?}"
            );
            tokio::select! {
                _ = self.arrived.notified() => {}
                _ = self.conn.closed() => {}
                _ = tokio::time::sleep_until(deadline.into()) => {}
            }
        }
    }

    /// No target's version went down, and none of `online` was shown
    /// offline once shown online (a snapshot may come before the owner
    /// published a phone's connect, a debounce after it).
    fn check(&self, name: &str, online: &[String]) -> usize {
        let seen = self.seen.lock().unwrap();
        let mut highest: BTreeMap<&str, u64> = BTreeMap::new();
        let mut was_online: std::collections::BTreeSet<&str> = Default::default();
        for s in seen.iter() {
            let top = highest.entry(&s.target).or_insert(0);
            assert!(
                s.version >= *top,
                "{name} was pushed {} at version {} after version {}: {s:?}",
                s.target,
                s.version,
                *top
            );
            *top = s.version;
            assert!(
                s.online || !online.contains(&s.target) || !was_online.contains(s.target.as_str()),
                "{name} saw {} offline: {s:?}",
                s.target
            );
            if s.online {
                was_online.insert(&s.target);
            }
        }
        seen.len()
    }
}

/// Watches both watchers until `until`: every 100 ms, no version went
/// down and nobody of `online` was shown offline (a window something must
/// not happen in, not a wait for something to happen). Returns the pushes.
async fn nothing_false_until(
    watchers: [&RawWatcher; 2],
    until: Instant,
    online: &[String],
) -> usize {
    loop {
        let pushes =
            watchers[0].check("bob (on b)", online) + watchers[1].check("carol (on c)", online);
        if Instant::now() >= until {
            return pushes;
        }
        let next = (Instant::now() + Duration::from_millis(100)).min(until);
        tokio::time::sleep_until(next.into()).await;
    }
}

/// `n` users named `stem0`, `stem1`, … whose shard's owner satisfies `pred`.
fn users_where(urls: &str, stem: &str, n: usize, pred: impl Fn(&str) -> bool) -> Vec<String> {
    let found: Vec<String> = (0..400)
        .map(|i| format!("{stem}{i}"))
        .filter(|u| pred(&owner_of(urls, u)))
        .take(n)
        .collect();
    assert_eq!(found.len(), n, "not {n} users {stem}…: {found:?}");
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_wakes_without_publishing_stale_and_its_devices_move() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let nats = NatsCluster::start(3).await;
    let urls = nats.urls();
    let dir = temp_dir("pause");
    let node = |id| {
        let cluster = Some((urls.as_str(), LEASE_TTL));
        serve_graced(&dir, cluster, id, "127.0.0.1:0", "127.0.0.1:0", PAUSE_GRACE)
    };
    let (mut a, b, c) = (node("a"), node("b"), node("c"));
    wait_placed(&urls);
    let nodes = [&a, &b, &c];

    // Phones on a: two users of a's shards, two of the others'.
    let mut phones_users = users_where(&urls, "pa", 2, |o| o == "a");
    phones_users.extend(users_where(&urls, "po", 2, |o| o != "a"));
    // Sam, of a's shards, on b: the change a holds when it is stopped.
    let sam = users_where(&urls, "sam", 1, |o| o == "a").remove(0);
    let mut targets = phones_users.clone();
    targets.push(sam.clone());

    let wire = watch_wire(&urls).await;
    let mut phones = Vec::new();
    for user in &phones_users {
        phones.push(moving_client(&nodes, &a, user, "phone", Kind::Mobile).await);
    }
    let (sam_laptop, _sam_updates) =
        connect(&nodes, &b, &sam, "laptop", Kind::Desktop, WatchClaim::all()).await;
    let on_b = raw_watcher(&b, "bob", &targets).await;
    let on_c = raw_watcher(&c, "carol", &targets).await;
    for w in [&on_b, &on_c] {
        for t in &targets {
            w.wait(t, DEBOUNCE + SLACK, &format!("{t} online"), |s| s.online)
                .await;
        }
    }
    let before = claims(&urls).await;
    let a_held: BTreeMap<u32, u64> = before
        .iter()
        .filter(|(_, (owner, _))| owner == "a")
        .map(|(s, (_, e))| (*s, *e))
        .collect();
    let sam_shard = greendot_cluster::shard_of(&sam, SHARDS).0;
    assert!(a_held.contains_key(&sam_shard));

    // Sam's change, answered once a's owner took it; its publish waits the
    // debounce, so a is stopped with it due.
    sam_laptop.set_status(Status::Busy, None).await.unwrap();
    a.proc.signal("-STOP");
    let stopped_ms = unix_ms();
    let stopped_at = Instant::now();

    // a's devices move: each phone's connection times out and it
    // reconnects to b or c, within its grace.
    for (user, (phone, updates)) in phones_users.iter().zip(phones.iter_mut()) {
        let deadline = tokio::time::Instant::from_std(stopped_at + PAUSE_GRACE);
        loop {
            match tokio::time::timeout_at(deadline, updates.next()).await {
                Ok(Some(Event::Reconnected { .. })) => break,
                Ok(Some(Event::Closed { reason, .. })) => panic!("{user}'s phone closed: {reason}"),
                Ok(Some(_)) => {}
                Ok(None) => panic!("{user}'s phone ended"),
                Err(_) => panic!("{user}'s phone did not move within its grace {PAUSE_GRACE:?}"),
            }
        }
        assert_ne!(phone.stats().server, a.addr, "{user} reconnected to a");
    }
    let moved_after = stopped_at.elapsed();

    // a's lease runs out and b and c take every shard it held.
    let t0 = Instant::now();
    let taken = LEASE_TTL * 2 + SLACK;
    let mut changes = claim_changes(&urls).await;
    let after = loop {
        let now = claims(&urls).await;
        let all_taken = now.len() == SHARDS as usize && now.values().all(|(o, _)| o != "a");
        if all_taken {
            break now;
        }
        assert!(
            t0.elapsed() < taken,
            "a's shards not taken within {taken:?} of the stop: {now:?}"
        );
        // Read again at the next claim written (or at the deadline).
        let _ = tokio::time::timeout_at((t0 + taken).into(), changes.next()).await;
    };
    let taken_after = stopped_at.elapsed();
    for (shard, epoch) in &a_held {
        assert!(after[shard].1 > *epoch, "shard {shard}: {:?}", after[shard]);
    }

    // Sam's next change, at her new owner: views of a newer epoch on the
    // wire before a wakes.
    sam_laptop.set_status(Status::Away, None).await.unwrap();
    for w in [&on_b, &on_c] {
        w.wait(&sam, DEBOUNCE + SLACK, "sam away at her new owner", |s| {
            s.status == proto::Status::Away
        })
        .await;
    }
    let mut online = phones_users.clone();
    online.push(sam.clone());
    // The stop lasts past the lease TTL by a margin, however soon the
    // others took over.
    nothing_false_until(
        [&on_b, &on_c],
        stopped_at + LEASE_TTL + STOP_MARGIN,
        &online,
    )
    .await;
    let stopped_for = stopped_at.elapsed();
    a.proc.signal("-CONT");
    let woke_ms = unix_ms();
    println!(
        "a stopped for {stopped_for:?}: its phones moved within {moved_after:?}, its shards \
         were taken within {taken_after:?}"
    );

    // What a does once awake.
    let status = a.proc.wait_exit(PAUSE_GRACE + SLACK);
    let mut said: Vec<&String> = a
        .proc
        .seen
        .iter()
        .filter(|l| l.starts_with("stderr:"))
        .collect();
    let claims_dropped = said
        .iter()
        .filter(|l| l.contains("claim not renewed in time"))
        .count();
    said.retain(|l| !l.contains("claim not renewed in time"));
    println!(
        "a woke, stopped acting for {claims_dropped} shards, and exited ({status}) after it \
         said:\n{said:#?}"
    );
    assert!(!status.success(), "a exits to be restarted: {status}");
    // It leaves nothing behind: a claim it took again after it woke would
    // keep the shard from the others for a TTL.
    let left: Vec<(u32, u64)> = claims(&urls)
        .await
        .into_iter()
        .filter(|(_, (owner, _))| owner == "a")
        .map(|(s, (_, e))| (s, e))
        .collect();
    assert!(
        left.is_empty(),
        "a exited holding claims (shard, epoch): {left:?}"
    );

    // A phone that moved is served: its change reaches both watchers.
    let (mover, _) = &phones[0];
    mover.set_status(Status::Busy, Some("moved")).await.unwrap();
    for w in [&on_b, &on_c] {
        w.wait(
            &phones_users[0],
            DEBOUNCE + SLACK,
            "a moved phone's change",
            |s| s.status == proto::Status::Busy,
        )
        .await;
    }
    // Past every grace since the stop, and past a's wake by a grace: no
    // offline of a device that moved (its session at a ends by a's idle
    // timeout when a wakes) reached a watcher.
    let quiet_until = (stopped_at + PAUSE_GRACE * 2).max(Instant::now() + PAUSE_GRACE);
    let pushes = nothing_false_until([&on_b, &on_c], quiet_until, &online).await;

    // Nothing on the wire that a stamped after it woke carries a's epochs,
    // or an epoch older than one already seen of its shard.
    let wire = wire.lock().unwrap();
    let mut newest: BTreeMap<u32, u64> = BTreeMap::new();
    let mut sam_epochs = Vec::new();
    for v in wire.iter() {
        let top = newest.entry(v.shard).or_insert(0);
        let old_epoch = v.epoch < *top || a_held.get(&v.shard).is_some_and(|e| v.epoch <= *e);
        assert!(
            !(old_epoch && v.published_ms > stopped_ms + 50),
            "a stale publish {} ms after a woke (epoch {}, the shard's newest seen {}; a \
             held {:?}): {v:?}",
            v.published_ms as i64 - woke_ms as i64,
            v.epoch,
            *top,
            a_held.get(&v.shard)
        );
        *top = (*top).max(v.epoch);
        if v.user == sam && !v.subject.starts_with("gd.edge.") {
            sam_epochs.push((
                v.epoch,
                v.version,
                v.published_ms as i64 - stopped_ms as i64,
            ));
        }
    }
    // The failover was on the wire (else nothing could have been stale).
    assert!(
        sam_epochs.iter().any(|(e, ..)| *e > a_held[&sam_shard]),
        "no view of sam under her new owner's epoch: {sam_epochs:?}"
    );
    println!(
        "{} views and truths on the wire, {pushes} pushes to the watchers: none stale, \
         nobody shown offline; sam's views (epoch, version, ms after the stop): {sam_epochs:?}",
        wire.len()
    );
}
