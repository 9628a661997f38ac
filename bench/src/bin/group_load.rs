//! Issue 28's benchmark: a group of M members, of which A admins, every
//! member connected over QUIC and subscribed to the group, `rate` of the
//! other members changing per second (each change a member going invisible
//! or visible again, which is what the count sees). Against the baseline of
//! today: the same sessions each subscribed to every other member, one by
//! one (the admins in the realtime tier, the rest batched).
//!
//! `cargo run --release -p greendot-bench --bin group_load -- --members 10000
//! --admins 10 --rate 0.01 --duration 60 --mode group` (or `--mode
//! subscribe`, the baseline; `--interval 10` seconds, the group interval).
//!
//! Printed, one row per run: changes made; pushes per change (every push
//! any session got in the window, over the changes); push bytes per second
//! to members (frames with their 4-byte length, not QUIC's overhead); the
//! admins' change-to-push latency p50/p99 (from the change request leaving
//! its client to the admin's push, debounce included: going invisible is
//! published at once, visible again after the debounce); the count's error
//! while changing (how far each count pushed, by version, is from what the
//! published views may have been when it was computed, each change taking
//! effect between its request and its answer); and
//! at quiescence (the changes stopped, then debounce + interval + 2 s):
//! every session's last count against the truth, the goal being 0.
//!
//! The server runs in this process on a thread of its own (one runtime
//! thread, as `greendot serve`), the clients on two more. Its admission
//! rate is raised so that the ramp is quick, its frame cap to 1 MiB (a
//! `SetGroup` of 10,000 names is about 60 KB, at the 64 KiB default), and
//! in the baseline its subscription cap to M (today's 1,000 would refuse
//! the baseline past 1,001 members).

use greendot_bench::{arg, load_average, raise_nofile, random_read_baseline};
use greendot_client::rustls::pki_types::CertificateDer;
use greendot_client::tls;
use greendot_core::Millis;
use greendot_proto::{
    self as proto, codec::read_frame, encode_frame, Answer, FrameReader, Hello, Push, Request,
    RequestFrame, ServerFrame, Tier,
};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use greendot_server::{Server, ServerConfig};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SECRET: &[u8] = b"greendot-group-bench-secret";
const GROUP: u64 = 1;
const DEBOUNCE: Duration = Duration::from_millis(300);
/// From a count's computing to its first arrival at a client, at most
/// (loopback).
const LAG: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Group,
    Subscribe,
}

fn name(i: usize) -> String {
    format!("m{i}")
}

fn index_of(name: &str) -> Option<usize> {
    name.strip_prefix('m')?.parse().ok()
}

/// One member's connection: its control stream, and what its pushes told.
struct Session {
    control: tokio::sync::Mutex<(quinn::SendStream, quinn::RecvStream, FrameReader)>,
    conn: quinn::Connection,
    next_id: AtomicU64,
    /// The last count pushed (group mode), or the members shown online
    /// among its subscriptions (baseline).
    count: AtomicU64,
    /// Baseline: what it was last told of each member.
    views: Mutex<HashMap<usize, bool>>,
}

/// What the run records, shared by every reader.
struct Record {
    admins: usize,
    measuring: AtomicBool,
    pushes: AtomicU64,
    member_bytes: AtomicU64,
    /// Per member: when its last change was sent and whether it is now
    /// visible (shown online once published).
    changed: Mutex<Vec<(Option<Instant>, bool)>>,
    latencies_us: Mutex<Vec<u64>>,
    /// Each count the server pushed while measuring (by its version: every
    /// member gets the same one), with its first arrival at any session.
    counts: Mutex<HashMap<u64, (Instant, u64)>>,
}

impl Record {
    fn admin_saw(&self, member: &str, online: bool) {
        let Some(j) = index_of(member) else { return };
        let sent = self.changed.lock().unwrap().get(j).copied();
        if let Some((Some(at), visible)) = sent {
            if visible == online && self.measuring.load(Relaxed) {
                let us = at.elapsed().as_micros() as u64;
                self.latencies_us.lock().unwrap().push(us);
            }
        }
    }

    fn count_seen(&self, version: u64, count: u64) {
        if self.measuring.load(Relaxed) {
            let now = Instant::now();
            self.counts
                .lock()
                .unwrap()
                .entry(version)
                .or_insert((now, count));
        }
    }

    /// How far each count pushed was from what the published views may
    /// have been when the server computed it (`changes`: member, visible
    /// after, sent, answered). A change took effect between its sending and
    /// its answer; going invisible is published then (I5), visible again a
    /// debounce later (neither if reverted within the debounce). The count
    /// was computed at most 50 ms before its first arrival at any session,
    /// after which it is judged once per version: the time 10,000 copies
    /// take to reach their sessions is not the count's error.
    fn count_errors(
        &self,
        members: usize,
        changes: &[(usize, bool, Instant, Instant)],
    ) -> Vec<u64> {
        let mut by_member: HashMap<usize, Vec<(bool, Instant, Instant)>> = HashMap::new();
        for &(member, visible, sent, answered) in changes {
            by_member
                .entry(member)
                .or_default()
                .push((visible, sent, answered));
        }
        // (+1 or -1, earliest, latest publish)
        let mut steps: Vec<(i64, Instant, Instant)> = Vec::new();
        for list in by_member.values() {
            let mut i = 0;
            while i < list.len() {
                let (visible, sent, answered) = list[i];
                match list.get(i + 1) {
                    Some(&(_, next, _)) if visible && next < sent + DEBOUNCE => i += 2,
                    _ => {
                        steps.push(if visible {
                            (1, sent + DEBOUNCE, answered + DEBOUNCE)
                        } else {
                            (-1, sent, answered)
                        });
                        i += 1;
                    }
                }
            }
        }
        let counts: Vec<(Instant, u64)> = self.counts.lock().unwrap().values().copied().collect();
        counts
            .into_iter()
            .map(|(at, count)| {
                let (early, late) = (at - LAG, at);
                let (mut low, mut high) = (members as i64, members as i64);
                for &(step, first, last) in &steps {
                    // Certainly published by `early`, or possibly by `late`.
                    let certain = last <= early;
                    let possible = first <= late;
                    match step {
                        1 if certain => (low, high) = (low + 1, high + 1),
                        1 if possible => high += 1,
                        -1 if certain => (low, high) = (low - 1, high - 1),
                        -1 if possible => low -= 1,
                        _ => {}
                    }
                }
                let count = count as i64;
                (low - count).max(count - high).max(0) as u64
            })
            .collect()
    }
}

fn endpoint(roots: &[CertificateDer<'static>], index: usize) -> quinn::Endpoint {
    let crypto = tls::client_crypto(roots, proto::ALPN).expect("client TLS");
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(None);
    transport.max_idle_timeout(Some(Duration::from_secs(120).try_into().unwrap()));
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(transport));
    let bind = SocketAddr::from(([127, 0, 0, 2 + (index % 250) as u8], 0));
    let socket = std::net::UdpSocket::bind(bind).expect("a client socket");
    greendot_server::testing::socket_buffers(&socket, 8 << 20);
    let runtime = quinn::default_runtime().expect("a runtime");
    let mut endpoint =
        quinn::Endpoint::new(quinn::EndpointConfig::default(), None, socket, runtime).unwrap();
    endpoint.set_default_client_config(config);
    endpoint
}

async fn call(session: &Session, request: Request) -> Result<Answer, String> {
    let id = session.next_id.fetch_add(1, Relaxed);
    let mut control = session.control.lock().await;
    let bytes = encode_frame(&RequestFrame { id, request }).map_err(|e| e.to_string())?;
    control
        .0
        .write_all(&bytes)
        .await
        .map_err(|e| e.to_string())?;
    let (_, recv, reader) = &mut *control;
    loop {
        match tokio::time::timeout(Duration::from_secs(30), read_frame(recv, reader)).await {
            Ok(Ok(Some(p))) => match proto::decode::<ServerFrame>(&p) {
                Ok(ServerFrame::Reply { id: got, result }) if got == id => {
                    return result.map_err(|e| e.to_string())
                }
                Ok(_) => continue,
                Err(e) => return Err(e.to_string()),
            },
            _ => return Err("no answer".into()),
        }
    }
}

async fn connect(
    endpoint: &quinn::Endpoint,
    server: SocketAddr,
    token: String,
) -> Result<Session, String> {
    let conn = endpoint
        .connect(server, "localhost")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    let hello = Hello {
        version: proto::VERSION,
        token,
        resume: None,
        foreground: true,
    };
    send.write_all(&encode_frame(&hello).map_err(|e| e.to_string())?)
        .await
        .map_err(|e| e.to_string())?;
    let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
    match read_frame(&mut recv, &mut reader).await {
        Ok(Some(p)) => match proto::decode::<ServerFrame>(&p) {
            Ok(ServerFrame::Welcome(_)) => {}
            other => return Err(format!("refused: {other:?}")),
        },
        _ => return Err("no welcome".into()),
    }
    Ok(Session {
        control: tokio::sync::Mutex::new((send, recv, reader)),
        conn,
        next_id: AtomicU64::new(1),
        count: AtomicU64::new(0),
        views: Mutex::new(HashMap::new()),
    })
}

/// Reads session `i`'s push streams until its connection ends.
async fn read_pushes(i: usize, session: Arc<Session>, record: Arc<Record>) {
    let read = |mut stream: quinn::RecvStream| {
        let (session, record) = (session.clone(), record.clone());
        async move {
            let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
            while let Ok(Some(payload)) = read_frame(&mut stream, &mut reader).await {
                let Ok(push) = proto::decode::<Push>(&payload) else {
                    continue;
                };
                if matches!(push, Push::Stream { .. }) {
                    continue;
                }
                if record.measuring.load(Relaxed) {
                    record.pushes.fetch_add(1, Relaxed);
                    if i >= record.admins {
                        record
                            .member_bytes
                            .fetch_add(payload.len() as u64 + 4, Relaxed);
                    }
                }
                match push {
                    Push::GroupCount { count, version, .. } => {
                        session.count.store(u64::from(count), Relaxed);
                        record.count_seen(version, u64::from(count));
                    }
                    Push::GroupMember {
                        member,
                        online,
                        count,
                        version,
                        ..
                    } => {
                        session.count.store(u64::from(count), Relaxed);
                        record.admin_saw(&member, online);
                        record.count_seen(version, u64::from(count));
                    }
                    Push::Update { target, presence } => {
                        let Some(j) = index_of(&target) else { continue };
                        let online = {
                            let mut views = session.views.lock().unwrap();
                            views.insert(j, presence.online);
                            views.values().filter(|v| **v).count() as u64
                        };
                        session.count.store(online, Relaxed);
                        if i < record.admins {
                            record.admin_saw(&target, presence.online);
                        }
                    }
                    _ => {}
                }
            }
        }
    };
    let conn = session.conn.clone();
    let (Ok(a), Ok(b)) = (conn.accept_uni().await, conn.accept_uni().await) else {
        return;
    };
    tokio::join!(read(a), read(b));
}

fn start_server(mode: Mode, members: usize, interval: Duration) -> (SocketAddr, Vec<u8>) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the server's runtime");
        runtime.block_on(async move {
            let mut config = ServerConfig::new(SECRET.to_vec());
            config.listen = "127.0.0.1:0".parse().unwrap();
            config.max_connections = members + 100;
            config.max_handshakes_per_sec = 100_000;
            config.max_frame = 1 << 20;
            config.core.debounce = Millis(DEBOUNCE.as_millis() as u64);
            config.core.group_interval = Millis(interval.as_millis() as u64);
            config.core.max_group_members = members;
            if mode == Mode::Subscribe {
                config.core.max_subscriptions_per_session = members;
                config.core.max_realtime_per_target = members;
            }
            let server = Server::bind(config).expect("the server");
            tx.send((server.local_addr(), server.certificate().to_vec()))
                .unwrap();
            std::future::pending::<()>().await;
        });
    });
    rx.recv().expect("the server started")
}

fn main() {
    raise_nofile();
    let members: usize = arg("--members", 10_000);
    let admins: usize = arg("--admins", 10).min(members);
    let rate: f64 = arg("--rate", 0.01);
    let duration = Duration::from_secs(arg("--duration", 60));
    let interval = Duration::from_secs(arg("--interval", 10));
    let mode = match arg("--mode", "group".to_string()).as_str() {
        "group" => Mode::Group,
        "subscribe" => Mode::Subscribe,
        other => {
            eprintln!("group_load: --mode is group or subscribe, not {other}");
            std::process::exit(2);
        }
    };
    eprintln!(
        "load average {}; random-read baseline {:.1} M/s",
        load_average(),
        random_read_baseline() / 1e6
    );
    let (server, cert) = start_server(mode, members, interval);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(
        mode, members, admins, rate, duration, interval, server, cert,
    ));
}

#[allow(clippy::too_many_arguments)]
async fn run(
    mode: Mode,
    members: usize,
    admins: usize,
    rate: f64,
    duration: Duration,
    interval: Duration,
    server: SocketAddr,
    cert: Vec<u8>,
) {
    let roots = vec![CertificateDer::from(cert)];
    let keys = Arc::new(TokenKeys::new(SECRET, Duration::ZERO));
    let endpoints: Vec<_> = (0..8).map(|i| endpoint(&roots, i)).collect();
    let mint = |user: &str, service: bool| {
        let mut claims = Claims::new(
            user,
            "d",
            proto::Kind::Mobile,
            WatchClaim::all(),
            Duration::from_secs(3600),
        );
        if service {
            claims = claims.service();
        }
        keys.mint(&claims).expect("a token")
    };
    let names: Vec<String> = (0..members).map(name).collect();
    if mode == Mode::Group {
        let backend = connect(&endpoints[0], server, mint("backend", true))
            .await
            .expect("the backend connects");
        let set = Request::SetGroup {
            group: GROUP,
            members: names.clone(),
            admins: names[..admins].to_vec(),
        };
        match call(&backend, set).await {
            Ok(Answer::GroupSet { .. }) => {}
            other => panic!("SetGroup: {other:?}"),
        }
    }
    let record = Arc::new(Record {
        admins,
        measuring: AtomicBool::new(false),
        pushes: AtomicU64::new(0),
        member_bytes: AtomicU64::new(0),
        changed: Mutex::new(vec![(None, true); members]),
        latencies_us: Mutex::new(Vec::new()),
        counts: Mutex::new(HashMap::new()),
    });
    // Connect and subscribe, 256 at a time.
    let ramp = Instant::now();
    let gate = Arc::new(tokio::sync::Semaphore::new(256));
    let names = Arc::new(names);
    let mut tasks = Vec::new();
    for i in 0..members {
        let (endpoint, gate, record, names) = (
            endpoints[i % endpoints.len()].clone(),
            gate.clone(),
            record.clone(),
            names.clone(),
        );
        let token = mint(&names[i], false);
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire().await.unwrap();
            let session = Arc::new(connect(&endpoint, server, token).await?);
            tokio::spawn(read_pushes(i, session.clone(), record.clone()));
            let request = match mode {
                Mode::Group => Request::GroupSubscribe { group: GROUP },
                Mode::Subscribe => Request::Subscribe {
                    targets: names
                        .iter()
                        .enumerate()
                        .filter(|(j, _)| *j != i)
                        .map(|(_, n)| n.clone())
                        .collect(),
                    tier: if i < record.admins {
                        Tier::Realtime
                    } else {
                        Tier::Batched
                    },
                },
            };
            match call(&session, request).await? {
                Answer::GroupSubscribed(s) => session.count.store(u64::from(s.count), Relaxed),
                Answer::Subscribed { snapshots, refused } if refused.is_empty() => {
                    let mut views = session.views.lock().unwrap();
                    for s in snapshots {
                        if let Some(j) = index_of(&s.target) {
                            views.entry(j).or_insert(s.presence.online);
                        }
                    }
                }
                other => return Err(format!("subscribe: {other:?}")),
            }
            Ok::<_, String>(session)
        }));
    }
    let mut sessions = Vec::with_capacity(members);
    for task in tasks {
        match task.await.unwrap() {
            Ok(s) => sessions.push(s),
            Err(e) => panic!("a member did not connect and subscribe: {e}"),
        }
    }
    eprintln!(
        "{members} sessions connected and subscribed in {:.1} s ({mode:?})",
        ramp.elapsed().as_secs_f64()
    );
    // Everybody online and published before the window.
    tokio::time::sleep(DEBOUNCE * 2 + interval).await;

    // The window: changes at a fixed spacing, each a random non-admin
    // member toggling its visibility.
    record.measuring.store(true, Relaxed);
    let per_sec = rate * (members - admins) as f64;
    let spacing = Duration::from_secs_f64(1.0 / per_sec.max(0.001));
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut ticker = tokio::time::interval(spacing);
    let started = Instant::now();
    let mut changes = 0u64;
    let mut pending = Vec::new();
    while started.elapsed() < duration {
        ticker.tick().await;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let j = admins + (rng % (members - admins) as u64) as usize;
        let visible = {
            let mut changed = record.changed.lock().unwrap();
            let visible = !changed[j].1;
            changed[j] = (Some(Instant::now()), visible);
            visible
        };
        changes += 1;
        let session = sessions[j].clone();
        pending.push(tokio::spawn(async move {
            let sent = Instant::now();
            let answer = call(
                &session,
                Request::SetInvisible {
                    invisible: !visible,
                },
            )
            .await;
            (j, visible, sent, Instant::now(), answer.is_ok())
        }));
    }
    let window = started.elapsed();
    record.measuring.store(false, Relaxed);
    let mut made = Vec::with_capacity(pending.len());
    for task in pending {
        made.push(task.await.expect("a change's task"));
    }
    let failed = made.iter().filter(|c| !c.4).count();
    let made: Vec<_> = made
        .into_iter()
        .map(|(j, v, s, a, _)| (j, v, s, a))
        .collect();
    let pushes = record.pushes.load(Relaxed);
    let bytes = record.member_bytes.load(Relaxed);

    // Quiescence: every session's last count against the truth.
    tokio::time::sleep(DEBOUNCE * 2 + interval + Duration::from_secs(2)).await;
    let invisible: Vec<bool> = record
        .changed
        .lock()
        .unwrap()
        .iter()
        .map(|c| !c.1)
        .collect();
    let truth = invisible.iter().filter(|i| !**i).count() as u64;
    let mut wrong = 0usize;
    let mut worst = 0u64;
    for (i, s) in sessions.iter().enumerate() {
        // A baseline session does not see itself: its truth is the others'.
        let expected = match mode {
            Mode::Group => truth,
            Mode::Subscribe => truth - u64::from(!invisible[i]),
        };
        let count = s.count.load(Relaxed);
        if count != expected {
            wrong += 1;
            worst = worst.max(count.abs_diff(expected));
        }
    }
    let mut lat = record.latencies_us.lock().unwrap().clone();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .map_or(f64::NAN, |us| *us as f64 / 1000.0)
    };
    let errors = record.count_errors(members, &made);
    let max_error = errors.iter().max().copied().unwrap_or(0);
    let mean_error = errors.iter().sum::<u64>() as f64 / errors.len().max(1) as f64;
    println!(
        "| mode | members | admins | changes | failed | pushes per change | push bytes/s to members | admin p50 / p99 (ms) | count error while changing: mean / max | sessions wrong at quiescence |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|---|---:|");
    println!(
        "| {} | {members} | {admins} | {changes} | {failed} | {:.1} | {:.0} | {:.0} / {:.0} ({} deltas) | {mean_error:.2} / {max_error} ({} counts pushed) | {wrong} (worst off by {worst}) |",
        match mode {
            Mode::Group => "group",
            Mode::Subscribe => "one by one",
        },
        pushes as f64 / changes.max(1) as f64,
        bytes as f64 / window.as_secs_f64(),
        pct(0.5),
        pct(0.99),
        lat.len(),
        errors.len(),
    );
}
