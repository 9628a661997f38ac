//! Network switch: QUIC connection migration against a WebSocket-over-TCP
//! baseline, when a client's address changes (Wi-Fi to 4G).
//!
//! `cargo run --release -p greendot-bench --bin switch` (`-- --movers 100
//! --switches 10 --gap-ms 1000`; `-- --rtt-ms 50` puts the movers behind a
//! path with that round trip, see `greendot_bench::path`). 1,000 switches per scenario by default:
//! 100 movers switch 10 times each, concurrently; each mover is watched
//! (realtime) by one watcher that never moves. A switch is: the network goes
//! away for `gap`, comes back on a new address, and the mover sets a status
//! whose message names the switch. Measured per switch: whether the watcher
//! was told the mover went offline (a false offline: the person never left),
//! and the time from the network coming back to the watcher's push of the new
//! status ("pushes flow again"; it includes the core's 300 ms debounce, the
//! same in every scenario), and to the mover's own request being answered.
//!
//! Scenarios, each on a fresh server with the core's defaults:
//! - **QUIC, migration**: greendot's server and client library; the client
//!   `rebind`s to a new UDP socket after the gap (the old socket stays open
//!   during the gap, unused).
//! - **WebSocket/TCP, grace as the core**: a small tokio-tungstenite server
//!   in this file driving the same core (through the transport's sans-IO
//!   `Hub`, the same code the QUIC server runs); the TCP connection is dropped
//!   when the network goes away (the server sees it end at once) and a new
//!   one is opened after the gap, resuming the lingering session.
//! - **WebSocket/TCP, no grace**: the same with grace 0, what the classic
//!   design does (`DEL` on disconnect).
//!
//! The WebSocket baseline has no TLS (ws:// on loopback): it is cheaper than
//! a real deployment, never dearer.

use futures_util::{SinkExt, StreamExt};
use greendot_bench::plot::{self, Group};
use greendot_bench::{arg, path, quantile, raise_nofile};
use greendot_client::{Client, ClientConfig, Event};
use greendot_core::{Config, Millis, SessionId};
use greendot_proto::{
    self as proto, Answer, Hello, Kind, Push, Request, RequestFrame, ServerFrame, Status, Tier,
};
use greendot_server::testing::{ConnState, Handled, Hub, HubOutput, Step};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use greendot_server::{HubLimits, RateLimit};
use greendot_server::{Server, ServerConfig};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

const SECRET: &[u8] = b"greendot-switch-secret";

// ------------------------------------------------- WebSocket baseline server

enum CoreMsg {
    Apply {
        step: Step,
        link: Option<mpsc::UnboundedSender<Vec<u8>>>,
        reply: oneshot::Sender<Handled>,
    },
    Activity(SessionId),
    Closed(SessionId),
    Tick,
}

/// Frames server → client: tag 0 + postcard `ServerFrame`, tag 1 + postcard `Push`.
fn tagged(tag: u8, payload: Result<Vec<u8>, postcard::Error>) -> Vec<u8> {
    let mut out = vec![tag];
    out.extend(payload.unwrap_or_default());
    out
}

/// The one task that owns the hub (and so the core), like the QUIC server's.
async fn ws_core(mut hub: Hub, mut rx: mpsc::Receiver<CoreMsg>, start: Instant) {
    let now = || Millis(start.elapsed().as_millis() as u64 + 1);
    let mut links: HashMap<SessionId, mpsc::UnboundedSender<Vec<u8>>> = HashMap::new();
    loop {
        let due = hub.poll_timeout();
        let msg = match due {
            Some(due) => {
                let wait = Duration::from_millis(due.0.saturating_sub(now().0));
                tokio::select! {
                    m = rx.recv() => m,
                    _ = tokio::time::sleep(wait) => Some(CoreMsg::Tick),
                }
            }
            None => rx.recv().await,
        };
        let Some(msg) = msg else { return };
        match msg {
            CoreMsg::Apply { step, link, reply } => {
                let handled = hub.apply(now(), step);
                if let (Some(s), Some(link)) = (handled.welcomed, link) {
                    links.insert(s, link);
                }
                let _ = reply.send(handled);
            }
            CoreMsg::Activity(s) => hub.activity(now(), s),
            CoreMsg::Tick => {}
            CoreMsg::Closed(s) => hub.closed(now(), s, false, now()),
        }
        if hub.poll_timeout().is_some_and(|t| t <= now()) {
            hub.handle_timeout(now());
        }
        while let Some(out) = hub.poll_output() {
            match out {
                HubOutput::Push { session, frame, .. } => {
                    if let Some(link) = links.get(&session) {
                        let _ = link.send(tagged(1, Ok(frame[4..].to_vec())));
                    }
                }
                HubOutput::End { session, .. } => {
                    links.remove(&session);
                }
            }
        }
    }
}

async fn ws_conn(
    tcp: TcpStream,
    core: mpsc::Sender<CoreMsg>,
    keys: Arc<TokenKeys>,
    start: Instant,
) {
    let _ = tcp.set_nodelay(true);
    let Ok(ws) = tokio_tungstenite::accept_async(tcp).await else {
        return;
    };
    let (mut sink, mut stream) = ws.split();
    let mut conn = ConnState::new(keys, RateLimit::default());
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let mut out_tx = Some(out_tx);
    loop {
        tokio::select! {
            msg = stream.next() => {
                let payload = match msg {
                    Some(Ok(Message::Binary(b))) => b,
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                    Some(Ok(_)) => continue,
                };
                if let Some(s) = conn.session() {
                    let _ = core.send(CoreMsg::Activity(s)).await;
                }
                let now = Millis(start.elapsed().as_millis() as u64 + 1);
                let step = conn.on_frame(now, &payload);
                let (tx, rx) = oneshot::channel();
                let link = matches!(step, Step::Hello { .. }).then(|| out_tx.take()).flatten();
                if core.send(CoreMsg::Apply { step, link, reply: tx }).await.is_err() {
                    break;
                }
                let Ok(handled) = rx.await else { break };
                if let Some(s) = handled.welcomed {
                    conn.on_welcome(s);
                }
                if let Some(frame) = handled.reply {
                    if sink.send(Message::Binary(tagged(0, postcard::to_stdvec(&frame)).into())).await.is_err() {
                        break;
                    }
                }
                if handled.close.is_some() {
                    break;
                }
            }
            out = out_rx.recv() => match out {
                Some(bytes) => {
                    if sink.send(Message::Binary(bytes.into())).await.is_err() {
                        break;
                    }
                }
                // The core ended the session (superseded, logged out, expired).
                None => if conn.session().is_some() { break },
            }
        }
    }
    if let Some(s) = conn.session() {
        let _ = core.send(CoreMsg::Closed(s)).await;
    }
}

/// Starts the WebSocket baseline server; returns its address.
async fn ws_server(config: Config) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let hub = Hub::new(config, HubLimits::default(), 0).unwrap_or_else(|e| panic!("{e}"));
    let (tx, rx) = mpsc::channel(4096);
    let start = Instant::now();
    tokio::spawn(ws_core(hub, rx, start));
    let keys = Arc::new(TokenKeys::new(SECRET, Duration::from_secs(30)));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(ws_conn(tcp, tx.clone(), keys.clone(), start));
        }
    });
    addr
}

// ------------------------------------------------- WebSocket baseline client

type WsStream = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>;

struct WsClient {
    ws: WsStream,
    session: u64,
    next_id: u64,
}

enum Incoming {
    Frame(ServerFrame),
    Push(Push),
}

async fn ws_read(ws: &mut WsStream) -> Option<Incoming> {
    loop {
        match ws.next().await? {
            Ok(Message::Binary(b)) if !b.is_empty() => {
                return match b[0] {
                    0 => postcard::from_bytes(&b[1..]).ok().map(Incoming::Frame),
                    _ => postcard::from_bytes(&b[1..]).ok().map(Incoming::Push),
                };
            }
            Ok(Message::Close(_)) | Err(_) => return None,
            Ok(_) => continue,
        }
    }
}

impl WsClient {
    async fn connect(
        addr: SocketAddr,
        token: &str,
        resume: Option<u64>,
    ) -> Result<WsClient, String> {
        let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/"))
            .await
            .map_err(|e| e.to_string())?;
        let hello = postcard::to_stdvec(&Hello {
            version: proto::VERSION,
            token: token.to_owned(),
            resume,
            foreground: true,
        })
        .map_err(|e| e.to_string())?;
        ws.send(Message::Binary(hello.into()))
            .await
            .map_err(|e| e.to_string())?;
        loop {
            match ws_read(&mut ws).await {
                Some(Incoming::Frame(ServerFrame::Welcome(w))) => {
                    return Ok(WsClient {
                        ws,
                        session: w.session,
                        next_id: 1,
                    })
                }
                Some(Incoming::Push(_)) => continue,
                other => return Err(format!("no welcome: {}", other.is_some())),
            }
        }
    }

    /// One request; pushes that arrive meanwhile go to `on_push`.
    async fn call(
        &mut self,
        request: Request,
        mut on_push: impl FnMut(Push),
    ) -> Result<Answer, String> {
        let id = self.next_id;
        self.next_id += 1;
        let bytes =
            postcard::to_stdvec(&RequestFrame { id, request }).map_err(|e| e.to_string())?;
        self.ws
            .send(Message::Binary(bytes.into()))
            .await
            .map_err(|e| e.to_string())?;
        loop {
            match ws_read(&mut self.ws).await {
                Some(Incoming::Frame(ServerFrame::Reply { id: got, result })) if got == id => {
                    return result.map_err(|e| e.to_string())
                }
                Some(Incoming::Push(p)) => on_push(p),
                Some(_) => continue,
                None => return Err("connection ended".into()),
            }
        }
    }
}

// ------------------------------------------------------------- the scenarios

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Quic,
    WsGrace,
    WsNoGrace,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Quic => "QUIC, connection migration",
            Scenario::WsGrace => "WebSocket/TCP, reconnect + resume, core grace",
            Scenario::WsNoGrace => "WebSocket/TCP, reconnect, no grace (classic)",
        }
    }
}

/// What the watchers saw, shared by all tasks of one scenario.
#[derive(Default)]
struct Seen {
    /// Switch key -> when its push reached the watcher.
    pushed: Mutex<HashMap<String, Instant>>,
    false_offline: AtomicU64,
}

impl Seen {
    fn record(&self, online: bool, message: Option<&str>) {
        if !online {
            self.false_offline.fetch_add(1, Relaxed);
        }
        if let Some(m) = message {
            let mut p = self.pushed.lock().unwrap_or_else(|e| e.into_inner());
            p.entry(m.to_owned()).or_insert_with(Instant::now);
        }
    }
}

struct SwitchResult {
    key: String,
    back: Instant,
    answered: Option<Instant>,
}

#[derive(Default)]
struct Outcome {
    switches: usize,
    false_offline: u64,
    missed: usize,
    failed: usize,
    /// Network back -> mover's request answered, ms.
    answer_ms: Vec<f64>,
    /// Network back -> watcher's push, ms.
    push_ms: Vec<f64>,
}

fn token(user: &str, watch: WatchClaim) -> String {
    let keys = TokenKeys::new(SECRET, Duration::from_secs(30));
    let claims = Claims::new(
        user,
        "phone",
        Kind::Mobile,
        watch,
        Duration::from_secs(3600),
    );
    keys.mint(&claims).unwrap_or_else(|e| panic!("mint: {e}"))
}

fn core_status(k: usize) -> greendot_core::Status {
    greendot_core::Status::ALL[(k + 1) % 4]
}

fn status(k: usize) -> Status {
    [
        Status::Away,
        Status::Busy,
        Status::DoNotDisturb,
        Status::Available,
    ][k % 4]
}

async fn run_scenario(
    scenario: Scenario,
    movers: usize,
    switches: usize,
    gap: Duration,
    rtt: Duration,
) -> Outcome {
    let mut config = Config::default();
    if scenario == Scenario::WsNoGrace {
        for k in config.kinds.iter_mut() {
            k.grace = Millis(0);
        }
    }
    let settle = Duration::from_millis(900);
    let seen = Arc::new(Seen::default());
    let mut quic_server = None;
    let (addr, roots) = if scenario == Scenario::Quic {
        let mut sc = ServerConfig::new(SECRET.to_vec());
        sc.listen = "127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}"));
        sc.core = config;
        let server = Server::bind(sc).unwrap_or_else(|e| panic!("server: {e}"));
        let a = server.local_addr();
        let roots = vec![server.certificate().clone()];
        quic_server = Some(server);
        (a, roots)
    } else {
        (ws_server(config).await, Vec::new())
    };
    // Movers reach the server over a path with a round trip; watchers, who
    // only observe, directly.
    let mover_addr = if rtt.is_zero() {
        Ok(addr)
    } else if scenario == Scenario::Quic {
        path::udp(addr, rtt).await
    } else {
        path::tcp(addr, rtt).await
    }
    .unwrap_or_else(|e| panic!("the delayed path: {e}"));

    // Movers connect first and are published online; then watchers subscribe.
    let mut mover_tasks = Vec::new();
    let (ready_tx, mut ready_rx) = mpsc::channel::<()>(movers);
    let go = Arc::new(tokio::sync::Notify::new());
    let watchers_ready = Arc::new(tokio::sync::Semaphore::new(0));
    // Movers say when their switches are over, and keep their connection
    // until `finish`, so that ending the run is not counted as a switch.
    let movers_done = Arc::new(tokio::sync::Semaphore::new(0));
    let (finish_tx, finish_rx) = tokio::sync::watch::channel(false);
    for m in 0..movers {
        let user = format!("mover{m}");
        let tok = token(&user, WatchClaim::only(Vec::<String>::new()));
        let (roots, ready_tx, go) = (roots.clone(), ready_tx.clone(), go.clone());
        let (done, mut finish) = (movers_done.clone(), finish_rx.clone());
        mover_tasks.push(tokio::spawn(async move {
            let mut results = Vec::new();
            let stagger = Duration::from_millis((m as u64 * 7919) % 1000);
            if scenario == Scenario::Quic {
                let mut cc = ClientConfig::new(mover_addr, roots, tok);
                cc.bind = Some("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")));
                let Ok((client, _updates)) = Client::connect(cc).await else {
                    let _ = ready_tx.send(()).await;
                    done.add_permits(1);
                    return results;
                };
                let _ = ready_tx.send(()).await;
                go.notified().await;
                tokio::time::sleep(stagger).await;
                for k in 0..switches {
                    tokio::time::sleep(gap).await;
                    let back = Instant::now();
                    let Ok(socket) = std::net::UdpSocket::bind("127.0.0.1:0") else {
                        continue;
                    };
                    let moved = client.rebind(socket).is_ok();
                    let key = format!("m{m}-s{k}");
                    let answered = if moved {
                        client
                            .set_status(core_status(k), Some(&key))
                            .await
                            .ok()
                            .map(|_| Instant::now())
                    } else {
                        None
                    };
                    results.push(SwitchResult {
                        key,
                        back,
                        answered,
                    });
                    tokio::time::sleep(settle).await;
                }
                done.add_permits(1);
                let _ = finish.changed().await;
                client.close().await;
            } else {
                let Ok(mut ws) = WsClient::connect(mover_addr, &tok, None).await else {
                    let _ = ready_tx.send(()).await;
                    done.add_permits(1);
                    return results;
                };
                let _ = ready_tx.send(()).await;
                go.notified().await;
                tokio::time::sleep(stagger).await;
                for k in 0..switches {
                    // The network goes away: the TCP connection is gone.
                    let session = ws.session;
                    drop(ws);
                    tokio::time::sleep(gap).await;
                    let back = Instant::now();
                    let key = format!("m{m}-s{k}");
                    let mut answered = None;
                    match WsClient::connect(mover_addr, &tok, Some(session)).await {
                        Ok(mut c) => {
                            let request = Request::SetStatus {
                                status: status(k),
                                message: Some(key.clone()),
                            };
                            if c.call(request, |_| {}).await.is_ok() {
                                answered = Some(Instant::now());
                            }
                            ws = c;
                        }
                        Err(_) => {
                            // Counted as a switch that never came back; the
                            // coordinator still waits for every mover.
                            results.push(SwitchResult {
                                key,
                                back,
                                answered,
                            });
                            done.add_permits(1);
                            return results;
                        }
                    }
                    results.push(SwitchResult {
                        key,
                        back,
                        answered,
                    });
                    tokio::time::sleep(settle).await;
                }
                done.add_permits(1);
                let _ = finish.changed().await;
                let _ = ws.ws.close(None).await;
            }
            results
        }));
    }
    drop(ready_tx);
    for _ in 0..movers {
        if ready_rx.recv().await.is_none() {
            break;
        }
    }
    // Let the movers' arrivals be published (debounce) before anyone watches.
    tokio::time::sleep(Duration::from_millis(600)).await;

    // Watchers: one per mover, realtime.
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut watcher_tasks = Vec::new();
    for m in 0..movers {
        let target = format!("mover{m}");
        let tok = token(&format!("watcher{m}"), WatchClaim::only([target.clone()]));
        let (roots, seen, stop, ready) = (
            roots.clone(),
            seen.clone(),
            stop.clone(),
            watchers_ready.clone(),
        );
        watcher_tasks.push(tokio::spawn(async move {
            if scenario == Scenario::Quic {
                let mut cc = ClientConfig::new(addr, roots, tok);
                cc.bind = Some("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")));
                let Ok((client, mut updates)) = Client::connect(cc).await else {
                    ready.add_permits(1);
                    return;
                };
                let _ = client
                    .subscribe(&[target.as_str()], greendot_core::Tier::Realtime)
                    .await;
                ready.add_permits(1);
                loop {
                    tokio::select! {
                        _ = stop.notified() => break,
                        ev = updates.next() => match ev {
                            Some(Event::Presence { presence, source, .. }) => {
                                if source != greendot_client::Source::Snapshot {
                                    seen.record(presence.online, presence.message.as_deref());
                                }
                            }
                            Some(_) => {}
                            None => break,
                        }
                    }
                }
                client.close().await;
            } else {
                let Ok(mut ws) = WsClient::connect(addr, &tok, None).await else {
                    ready.add_permits(1);
                    return;
                };
                let request = Request::Subscribe {
                    targets: vec![target.clone()],
                    tier: Tier::Realtime,
                };
                let on_push = |p: Push| {
                    if let Push::Update { presence, .. } = p {
                        seen.record(presence.online, presence.message.as_deref());
                    }
                };
                let _ = ws.call(request, on_push).await;
                ready.add_permits(1);
                loop {
                    tokio::select! {
                        _ = stop.notified() => break,
                        inc = ws_read(&mut ws.ws) => match inc {
                            Some(Incoming::Push(Push::Update { presence, .. })) => {
                                seen.record(presence.online, presence.message.as_deref());
                            }
                            Some(_) => {}
                            None => break,
                        }
                    }
                }
                let _ = ws.ws.close(None).await;
            }
        }));
    }
    let _ = watchers_ready.acquire_many(movers as u32).await;
    eprintln!(
        "  {}: {movers} movers and {movers} watchers connected; switching",
        scenario.name()
    );
    go.notify_waiters();

    let _ = movers_done.acquire_many(movers as u32).await;
    // Pushes of the last switches, and any late offline.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.notify_waiters();
    for t in watcher_tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    let _ = finish_tx.send(true);
    let mut results = Vec::new();
    for t in mover_tasks {
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(10), t).await {
            results.extend(r);
        }
    }
    if let Some(server) = quic_server {
        server.shutdown().await;
    }

    let pushed = seen.pushed.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = Outcome {
        switches: results.len(),
        false_offline: seen.false_offline.load(Relaxed),
        failed: movers * switches - results.len(),
        ..Outcome::default()
    };
    for r in &results {
        if let Some(a) = r.answered {
            out.answer_ms.push((a - r.back).as_secs_f64() * 1e3);
        }
        match pushed.get(&r.key) {
            Some(t) => out.push_ms.push((*t - r.back).as_secs_f64() * 1e3),
            None => out.missed += 1,
        }
    }
    out.answer_ms.sort_by(f64::total_cmp);
    out.push_ms.sort_by(f64::total_cmp);
    out
}

fn fmt_q(v: &[f64], q: f64) -> String {
    quantile(v, q).map_or("-".into(), |x| format!("{x:.1}"))
}

fn main() {
    raise_nofile();
    let movers: usize = arg("--movers", 100);
    let switches: usize = arg("--switches", 10);
    let gap = Duration::from_millis(arg("--gap-ms", 1000));
    let rtt = Duration::from_millis(arg("--rtt-ms", 0));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let scenarios = [Scenario::Quic, Scenario::WsGrace, Scenario::WsNoGrace];
    let mut outcomes = Vec::new();
    for s in scenarios {
        eprintln!("{}: {} switches", s.name(), movers * switches);
        let o = runtime.block_on(run_scenario(s, movers, switches, gap, rtt));
        eprintln!(
            "  done: {} switches, {} false offlines, {} pushes missed",
            o.switches, o.false_offline, o.missed
        );
        outcomes.push((s, o));
    }
    println!();
    let over = if rtt.is_zero() {
        "movers on loopback".to_string()
    } else {
        format!(
            "movers on a path with a {} ms round trip (a user-space relay)",
            rtt.as_millis()
        )
    };
    println!(
        "{movers} movers x {switches} switches each, network gone for {} ms per switch, 1 realtime watcher per mover, {over}; times from the network coming back (the push includes the 300 ms debounce)",
        gap.as_millis()
    );
    println!();
    println!("| transport | switches | false offlines seen by watchers | pushes missed | mover answered p50 / p99 ms | push at watcher p50 / p99 / max ms |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (s, o) in &outcomes {
        println!(
            "| {} | {} | {} | {} | {} / {} | {} / {} / {} |",
            s.name(),
            o.switches,
            o.false_offline,
            o.missed + o.failed,
            fmt_q(&o.answer_ms, 0.5),
            fmt_q(&o.answer_ms, 0.99),
            fmt_q(&o.push_ms, 0.5),
            fmt_q(&o.push_ms, 0.99),
            fmt_q(&o.push_ms, 1.0),
        );
    }
    let base = quantile(&outcomes[0].1.push_ms, 0.5).unwrap_or(f64::NAN);
    for (s, o) in outcomes.iter().skip(1) {
        let p = quantile(&o.push_ms, 0.5).unwrap_or(f64::NAN);
        println!();
        print!(
            "{}: median time until pushes flow {:.2}x QUIC's",
            s.name(),
            p / base
        );
    }
    println!();

    let file = if rtt.is_zero() {
        "bench-switch.svg".to_string()
    } else {
        format!("bench-switch-rtt{}.svg", rtt.as_millis())
    };
    let path = greendot_bench::docs_dir().join(file);
    let groups: Vec<Group> = outcomes
        .iter()
        .map(|(s, o)| Group {
            label: s.name().to_string(),
            values: vec![
                quantile(&o.answer_ms, 0.5).unwrap_or(0.0),
                quantile(&o.push_ms, 0.5).unwrap_or(0.0),
                quantile(&o.push_ms, 0.99).unwrap_or(0.0),
                o.false_offline as f64 / o.switches.max(1) as f64 * 1000.0,
            ],
        })
        .collect();
    match plot::grouped_bars(
        &path,
        &format!(
            "Network switch ({} per transport, {})",
            movers * switches,
            if rtt.is_zero() {
                "loopback".to_string()
            } else {
                format!("{} ms round trip", rtt.as_millis())
            }
        ),
        "ms (false offlines: per 1000 switches)",
        &[
            "mover answered p50 (ms)",
            "push at watcher p50 (ms)",
            "push at watcher p99 (ms)",
            "false offlines per 1000 switches",
        ],
        &groups,
        false,
    ) {
        Ok(()) => eprintln!("plot: {}", path.display()),
        Err(e) => eprintln!("plot failed: {e}"),
    }
}
