//! A load generator for a running greendot server (`greendot bench`, and
//! `cargo run --release -p greendot-bench --bin quic_load`).
//!
//! It opens `connections` QUIC connections from a few client endpoints (UDP
//! sockets shared by many connections, as a NAT or a load balancer would
//! concentrate them), each for its own user and device, each subscribed to
//! `contacts` other users; then, for `duration`, each connection acts at
//! random times (Poisson, `churn` of the connections per second): a status
//! change (with a sequence number in the status message, so that every
//! watcher's push can be matched to the moment it was asked for), or a
//! reconnect (a plain close, so the device lingers, then a new handshake that
//! resumes the session). It speaks the wire protocol directly (not
//! [`crate::client`], which costs one UDP socket and several tasks per client).
//!
//! Measured: connections held, handshakes/s while ramping up, change-to-push
//! latency (from the status request leaving the client to each watcher's
//! push, minus the server's debounce) p50/p99/p99.9, notifications/s, and,
//! when given the server's process id, its resident memory per session
//! (`VmRSS` before and after the ramp, from `/proc`) and its CPU (`utime +
//! stime` from `/proc/<pid>/stat`). All traffic goes to `server`; the run is
//! bounded by `ramp_timeout + duration` plus a few seconds to close.

use crate::proto::{
    self, codec::read_frame, encode_frame, Answer, CloseCode, FrameReader, Hello, Push, Request,
    RequestFrame, ServerFrame, Status, Tier,
};
use crate::tls;
use crate::token::{Claims, TokenKeys, WatchClaim};
use rustls::pki_types::CertificateDer;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};

/// What to run.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub server: SocketAddr,
    /// The server's certificate (or its CA), trusted as a root.
    pub roots: Vec<CertificateDer<'static>>,
    /// The server's token secret: the generator mints its users' tokens.
    pub token_secret: Vec<u8>,
    pub server_name: String,
    /// Concurrent connections to open and hold.
    pub connections: usize,
    /// Client UDP endpoints the connections are spread over.
    pub endpoints: usize,
    /// Users each connection subscribes to.
    pub contacts: usize,
    pub tier: Tier,
    /// Fraction of the connections that act per second while measuring
    /// (0.01: 1% per second).
    pub churn: f64,
    /// Of those actions, the share that are reconnects (the rest are status
    /// changes).
    pub reconnect_share: f64,
    /// How long the churn runs and is measured.
    pub duration: Duration,
    /// Handshakes in flight at once while ramping up.
    pub connect_concurrency: usize,
    /// Give up ramping up after this long (what is connected by then is held).
    pub ramp_timeout: Duration,
    /// The server's debounce, subtracted from the change-to-push latency.
    pub debounce: Duration,
    /// The server's process, for memory and CPU (`None`: not measured).
    pub server_pid: Option<u32>,
    /// Print progress to stderr.
    pub progress: bool,
    /// User names are `{prefix}{i}`.
    pub user_prefix: String,
}

impl LoadOptions {
    /// Defaults: 8 endpoints, 20 realtime contacts, 1% churn per second (half
    /// reconnects), 30 s, 256 handshakes in flight, debounce 300 ms.
    pub fn new(
        server: SocketAddr,
        roots: Vec<CertificateDer<'static>>,
        token_secret: impl Into<Vec<u8>>,
        connections: usize,
    ) -> LoadOptions {
        LoadOptions {
            server,
            roots,
            token_secret: token_secret.into(),
            server_name: "localhost".into(),
            connections,
            endpoints: 8,
            contacts: 20,
            tier: Tier::Realtime,
            churn: 0.01,
            reconnect_share: 0.5,
            duration: Duration::from_secs(30),
            connect_concurrency: 256,
            ramp_timeout: Duration::from_secs(300),
            debounce: Duration::from_millis(300),
            server_pid: None,
            progress: true,
            user_prefix: "lg".into(),
        }
    }
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    pub target: usize,
    /// Connections established by the end of the ramp.
    pub connected: usize,
    /// Connections that could not be established during the ramp.
    pub failed: usize,
    /// Connections open at the end of the measured window.
    pub held: usize,
    pub ramp: Duration,
    /// When 99% of the connections had connected or failed (the last 1% can
    /// wait for handshake retransmissions).
    pub ramp_99: Duration,
    /// Handshakes (QUIC + hello + subscribe) per second until 99% were done.
    pub handshakes_per_sec: f64,
    /// Server resident memory before and after the ramp, bytes.
    pub server_rss_before: Option<u64>,
    pub server_rss_after: Option<u64>,
    /// Server CPU during the ramp and during the window, in cores (1.0 = one
    /// core busy).
    pub server_cpu_ramp: Option<f64>,
    pub server_cpu_window: Option<f64>,
    /// The generator's own CPU during the window, in cores.
    pub client_cpu_window: Option<f64>,
    pub status_changes: u64,
    pub reconnects: u64,
    pub reconnect_failures: u64,
    /// Pushes received during the window.
    pub notifications: u64,
    pub window: Duration,
    pub latency_samples: usize,
    pub latency_p50: Option<Duration>,
    pub latency_p99: Option<Duration>,
    pub latency_p999: Option<Duration>,
    /// Requests answered with an error, or not answered in time.
    pub request_errors: u64,
}

impl LoadReport {
    pub fn bytes_per_session(&self) -> Option<f64> {
        let (a, b) = (self.server_rss_before?, self.server_rss_after?);
        (self.connected > 0).then(|| b.saturating_sub(a) as f64 / self.connected as f64)
    }

    pub fn notifications_per_sec(&self) -> f64 {
        self.notifications as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// The markdown table header matching [`LoadReport`]'s `Display`.
    pub fn header() -> &'static str {
        "| N | held | handshakes/s | server KiB/session | p50 ms | p99 ms | p99.9 ms | notifications/s | changes / reconnects | server CPU ramp / window (cores) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    }
}

fn opt_ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

fn opt_f(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |x| format!("{x:.digits$}"))
}

impl fmt::Display for LoadReport {
    /// One markdown table row (see [`LoadReport::header`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "| {} | {} | {:.0} | {} | {} | {} | {} | {:.0} | {} / {} | {} / {} |",
            self.target,
            self.held,
            self.handshakes_per_sec,
            opt_f(self.bytes_per_session().map(|b| b / 1024.0), 1),
            opt_ms(self.latency_p50),
            opt_ms(self.latency_p99),
            opt_ms(self.latency_p999),
            self.notifications_per_sec(),
            self.status_changes,
            self.reconnects,
            opt_f(self.server_cpu_ramp, 2),
            opt_f(self.server_cpu_window, 2),
        )
    }
}

/// `VmRSS` of a process, bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// `utime + stime` of a process, in seconds (assuming the usual 100 ticks/s).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

const PHASE_RAMP: u8 = 0;
const PHASE_MEASURE: u8 = 1;
const PHASE_STOP: u8 = 2;
/// The window is over: no new actions, connections held until the stop.
const PHASE_DRAIN: u8 = 3;

struct Ctx {
    opts: LoadOptions,
    keys: TokenKeys,
    t0: Instant,
    /// Per status change: nanoseconds since `t0` when it was sent (0: none).
    sent: Vec<AtomicU64>,
    next_seq: AtomicUsize,
    /// In every status message, so that no change repeats what a server kept
    /// from an earlier run (a repeat publishes nothing).
    run: u64,
    measuring: AtomicBool,
    latencies_us: Mutex<Vec<u32>>,
    connected: AtomicUsize,
    failed: AtomicUsize,
    open: AtomicUsize,
    notifications: AtomicU64,
    status_changes: AtomicU64,
    reconnects: AtomicU64,
    reconnect_failures: AtomicU64,
    request_errors: AtomicU64,
    connect_gate: Semaphore,
}

impl Ctx {
    fn nanos(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn user(&self, i: usize) -> String {
        format!("{}{i}", self.opts.user_prefix)
    }

    /// The contacts of user `i`: a fixed stride through the users, so every
    /// user is also watched by exactly `contacts` others.
    fn contacts(&self, i: usize) -> Vec<String> {
        let n = self.opts.connections;
        let stride = (n / (self.opts.contacts + 1)).max(1);
        (1..=self.opts.contacts)
            .map(|k| (i + k * stride) % n)
            .filter(|&j| j != i)
            .map(|j| self.user(j))
            .collect()
    }

    fn on_push(&self, payload: &[u8]) {
        let Ok(Push::Update { presence, .. }) = proto::decode::<Push>(payload) else {
            return;
        };
        if !self.measuring.load(Relaxed) {
            return;
        }
        self.notifications.fetch_add(1, Relaxed);
        let seq = presence
            .message
            .as_deref()
            .and_then(|m| m.strip_prefix('c'))
            .and_then(|m| m.split_once('-'))
            .filter(|(_, run)| run.parse::<u64>().ok() == Some(self.run))
            .and_then(|(seq, _)| seq.parse::<usize>().ok());
        if let Some(sent) = seq.and_then(|s| self.sent.get(s)) {
            let at = sent.load(Relaxed);
            if at != 0 {
                let d = self.nanos().saturating_sub(at) / 1000;
                let d = d.saturating_sub(self.opts.debounce.as_micros() as u64);
                let mut l = self.latencies_us.lock().unwrap_or_else(|p| p.into_inner());
                l.push(u32::try_from(d).unwrap_or(u32::MAX));
            }
        }
    }
}

struct Live {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    reader: FrameReader,
    session: u64,
    pushes: tokio::task::JoinHandle<()>,
}

/// Connects, says hello (resuming `resume`), and on a fresh session subscribes.
async fn establish(
    ctx: &Arc<Ctx>,
    endpoint: &quinn::Endpoint,
    token: &str,
    i: usize,
    resume: Option<u64>,
) -> Result<Live, String> {
    let connecting = endpoint
        .connect(ctx.opts.server, &ctx.opts.server_name)
        .map_err(|e| e.to_string())?;
    // Dropping a handshake that timed out abandons it.
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let pushes = tokio::spawn(read_pushes(conn.clone(), ctx.clone()));
    let result = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let hello = Hello {
            version: proto::VERSION,
            token: token.to_owned(),
            resume,
        };
        let bytes = encode_frame(&hello).map_err(|e| e.to_string())?;
        send.write_all(&bytes).await.map_err(|e| e.to_string())?;
        let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
        let welcome = match read_frame(&mut recv, &mut reader).await {
            Ok(Some(p)) => proto::decode::<ServerFrame>(&p).map_err(|e| e.to_string())?,
            _ => return Err("no welcome".to_string()),
        };
        let welcome = match welcome {
            ServerFrame::Welcome(w) => w,
            other => return Err(format!("refused: {other:?}")),
        };
        let mut live = (send, recv, reader);
        if !welcome.resumed {
            let request = Request::Subscribe {
                targets: ctx.contacts(i),
                tier: ctx.opts.tier,
            };
            match call(&mut live, 1, request).await? {
                Answer::Subscribed { refused, .. } if refused.is_empty() => {}
                other => return Err(format!("subscribe: {other:?}")),
            }
        }
        Ok((live, welcome.session))
    };
    let result = tokio::time::timeout(CONNECT_TIMEOUT, result)
        .await
        .unwrap_or_else(|_| Err("hello or subscribe timed out".into()));
    match result {
        Ok(((send, recv, reader), session)) => Ok(Live {
            conn,
            send,
            recv,
            reader,
            session,
            pushes,
        }),
        Err(e) => {
            pushes.abort();
            conn.close(CloseCode::Normal.varint(), b"hello failed");
            Err(e)
        }
    }
}

/// Attempts to connect per device while ramping up (a lost handshake packet
/// can cost seconds of backoff; a fresh attempt is quicker).
const CONNECT_ATTEMPTS: usize = 3;
/// How long one attempt (handshake, hello, subscribe) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

async fn attempt(
    ctx: &Arc<Ctx>,
    endpoint: &quinn::Endpoint,
    token: &str,
    i: usize,
    resume: Option<u64>,
) -> Result<Live, String> {
    establish(ctx, endpoint, token, i, resume).await
}

/// One request and its reply on the control stream.
async fn call(
    live: &mut (quinn::SendStream, quinn::RecvStream, FrameReader),
    id: u64,
    request: Request,
) -> Result<Answer, String> {
    let bytes = encode_frame(&RequestFrame { id, request }).map_err(|e| e.to_string())?;
    live.0.write_all(&bytes).await.map_err(|e| e.to_string())?;
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match read_frame(&mut live.1, &mut live.2).await {
                Ok(Some(p)) => match proto::decode::<ServerFrame>(&p) {
                    Ok(ServerFrame::Reply { id: got, result }) if got == id => {
                        return result.map_err(|e| e.to_string())
                    }
                    Ok(ServerFrame::Reply { .. }) => continue,
                    Ok(other) => return Err(format!("unexpected {other:?}")),
                    Err(e) => return Err(e.to_string()),
                },
                _ => return Err("control stream ended".to_string()),
            }
        }
    })
    .await;
    answer.unwrap_or_else(|_| Err("no reply in 10 s".into()))
}

/// Accepts the two push streams and reads them until the connection ends.
async fn read_pushes(conn: quinn::Connection, ctx: Arc<Ctx>) {
    let read = |mut stream: quinn::RecvStream| {
        let ctx = ctx.clone();
        async move {
            let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
            while let Ok(Some(payload)) = read_frame(&mut stream, &mut reader).await {
                ctx.on_push(&payload);
            }
        }
    };
    let Ok(a) = conn.accept_uni().await else {
        return;
    };
    let Ok(b) = conn.accept_uni().await else {
        read(a).await;
        return;
    };
    tokio::join!(read(a), read(b));
}

/// One simulated device: connect, hold, churn, close.
async fn device(
    ctx: Arc<Ctx>,
    endpoint: quinn::Endpoint,
    i: usize,
    mut phase: watch::Receiver<u8>,
) {
    let claims = Claims::new(
        ctx.user(i),
        "d",
        proto::Kind::Mobile,
        WatchClaim::only(ctx.contacts(i)),
        Duration::from_secs(24 * 3600),
    );
    let Ok(token) = ctx.keys.mint(&claims) else {
        ctx.failed.fetch_add(1, Relaxed);
        return;
    };
    let first = {
        let _permit = ctx.connect_gate.acquire().await;
        if *phase.borrow() != PHASE_RAMP {
            ctx.failed.fetch_add(1, Relaxed);
            return;
        }
        let mut result = Err(String::new());
        for _ in 0..CONNECT_ATTEMPTS {
            result = attempt(&ctx, &endpoint, &token, i, None).await;
            if result.is_ok() || *phase.borrow() != PHASE_RAMP {
                break;
            }
        }
        result
    };
    let mut live = match first {
        Ok(live) => live,
        Err(_) => {
            ctx.failed.fetch_add(1, Relaxed);
            return;
        }
    };
    ctx.connected.fetch_add(1, Relaxed);
    ctx.open.fetch_add(1, Relaxed);
    let mut rng = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut rand = move || {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        (rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    };
    // Wait for the measured window.
    while *phase.borrow() == PHASE_RAMP {
        if phase.changed().await.is_err() {
            break;
        }
    }
    let mut next_id = 2u64;
    let mut alive = true;
    while alive && *phase.borrow() == PHASE_MEASURE && ctx.opts.churn > 0.0 {
        let wait = -(1.0 - rand()).ln() / ctx.opts.churn;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs_f64(wait.min(3600.0))) => {}
            _ = phase.changed() => continue,
            _ = live.conn.closed() => { alive = false; continue; }
        }
        if rand() < ctx.opts.reconnect_share {
            live.pushes.abort();
            live.conn.close(CloseCode::Normal.varint(), b"reconnect");
            let resume = Some(live.session);
            let mut result = attempt(&ctx, &endpoint, &token, i, resume).await;
            if result.is_err() {
                result = attempt(&ctx, &endpoint, &token, i, resume).await;
            }
            match result {
                Ok(l) => {
                    live = l;
                    ctx.reconnects.fetch_add(1, Relaxed);
                }
                Err(_) => {
                    ctx.reconnect_failures.fetch_add(1, Relaxed);
                    alive = false;
                }
            }
        } else {
            let seq = ctx.next_seq.fetch_add(1, Relaxed);
            let status = [Status::Away, Status::Busy, Status::Available][seq % 3];
            if let Some(slot) = ctx.sent.get(seq) {
                slot.store(ctx.nanos().max(1), Relaxed);
            }
            let request = Request::SetStatus {
                status,
                message: Some(format!("c{seq}-{}", ctx.run)),
            };
            let mut halves = (live.send, live.recv, live.reader);
            let result = call(&mut halves, next_id, request).await;
            (live.send, live.recv, live.reader) = halves;
            next_id += 1;
            match result {
                Ok(_) => {
                    ctx.status_changes.fetch_add(1, Relaxed);
                }
                Err(_) => {
                    ctx.request_errors.fetch_add(1, Relaxed);
                }
            }
        }
    }
    // Wait for the stop, holding the connection.
    while alive && *phase.borrow() != PHASE_STOP {
        tokio::select! {
            r = phase.changed() => if r.is_err() { break },
            _ = live.conn.closed() => alive = false,
        }
    }
    ctx.open.fetch_sub(1, Relaxed);
    live.pushes.abort();
    live.conn
        .close(CloseCode::Logout.varint(), b"load generator done");
}

fn client_endpoint(opts: &LoadOptions) -> Result<quinn::Endpoint, String> {
    let crypto = tls::client_crypto(&opts.roots, proto::ALPN).map_err(|e| e.to_string())?;
    let mut transport = quinn::TransportConfig::default();
    // The server's keep-alive is the heartbeat; the client only answers it.
    transport.keep_alive_interval(None);
    transport.max_idle_timeout(Some(
        Duration::from_secs(120)
            .try_into()
            .map_err(|_| "idle timeout".to_string())?,
    ));
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(transport));
    let bind = if opts.server.is_ipv6() {
        SocketAddr::from(([0u16, 0, 0, 0, 0, 0, 0, 1], 0))
    } else {
        SocketAddr::from(([127, 0, 0, 1], 0))
    };
    let mut endpoint = quinn::Endpoint::client(bind).map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(config);
    Ok(endpoint)
}

/// Runs the load against `opts.server` and reports. Call inside a tokio
/// runtime (a multi-threaded one uses every core for the clients).
pub async fn run(opts: LoadOptions) -> LoadReport {
    let n = opts.connections;
    let mut report = LoadReport {
        target: n,
        ..LoadReport::default()
    };
    let endpoints: Vec<quinn::Endpoint> = match (0..opts.endpoints.max(1))
        .map(|_| client_endpoint(&opts))
        .collect::<Result<_, _>>()
    {
        Ok(e) => e,
        Err(e) => {
            if opts.progress {
                eprintln!("loadgen: cannot open client endpoints: {e}");
            }
            return report;
        }
    };
    let changes_cap = (opts.churn * n as f64 * opts.duration.as_secs_f64() * 2.0) as usize + 10_000;
    let ctx = Arc::new(Ctx {
        keys: TokenKeys::new(&opts.token_secret, Duration::from_secs(30)),
        t0: Instant::now(),
        sent: (0..changes_cap).map(|_| AtomicU64::new(0)).collect(),
        next_seq: AtomicUsize::new(0),
        run: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        measuring: AtomicBool::new(false),
        latencies_us: Mutex::new(Vec::new()),
        connected: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
        open: AtomicUsize::new(0),
        notifications: AtomicU64::new(0),
        status_changes: AtomicU64::new(0),
        reconnects: AtomicU64::new(0),
        reconnect_failures: AtomicU64::new(0),
        request_errors: AtomicU64::new(0),
        connect_gate: Semaphore::new(opts.connect_concurrency.max(1)),
        opts: opts.clone(),
    });
    let pid = opts.server_pid;
    let self_pid = std::process::id();
    report.server_rss_before = pid.and_then(rss_bytes);
    let cpu0 = pid.and_then(cpu_secs);

    let (phase_tx, phase_rx) = watch::channel(PHASE_RAMP);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let endpoint = endpoints[i % endpoints.len()].clone();
        tasks.push(tokio::spawn(device(
            ctx.clone(),
            endpoint,
            i,
            phase_rx.clone(),
        )));
    }
    // Ramp: until every device connected or failed, or the ramp timeout.
    let mut last_print = Instant::now();
    let mut connected_99 = 0;
    loop {
        let done = ctx.connected.load(Relaxed) + ctx.failed.load(Relaxed);
        if report.ramp_99.is_zero() && done * 100 >= n * 99 {
            report.ramp_99 = start.elapsed();
            connected_99 = ctx.connected.load(Relaxed);
        }
        if done >= n || start.elapsed() > opts.ramp_timeout {
            break;
        }
        if opts.progress && last_print.elapsed() > Duration::from_secs(2) {
            last_print = Instant::now();
            eprintln!(
                "  ramp: {} connected, {} failed, {:.0} s",
                ctx.connected.load(Relaxed),
                ctx.failed.load(Relaxed),
                start.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    report.ramp = start.elapsed();
    report.connected = ctx.connected.load(Relaxed);
    if report.ramp_99.is_zero() {
        report.ramp_99 = report.ramp;
        connected_99 = report.connected;
    }
    report.handshakes_per_sec = connected_99 as f64 / report.ramp_99.as_secs_f64().max(1e-9);
    // Let the arrivals' debounces and the last subscribes settle, then measure
    // the server at rest.
    tokio::time::sleep(Duration::from_secs(2)).await;
    report.server_rss_after = pid.and_then(rss_bytes);
    let cpu1 = pid.and_then(cpu_secs);
    report.server_cpu_ramp = match (cpu0, cpu1) {
        (Some(a), Some(b)) => Some((b - a) / (report.ramp.as_secs_f64() + 2.0)),
        _ => None,
    };
    if opts.progress {
        eprintln!(
            "  ramp done: {} connected, {} failed in {:.1} s; measuring {:.0} s of churn",
            report.connected,
            ctx.failed.load(Relaxed),
            report.ramp.as_secs_f64(),
            opts.duration.as_secs_f64()
        );
    }

    // The measured window.
    let self0 = cpu_secs(self_pid);
    let cpu2 = pid.and_then(cpu_secs);
    ctx.measuring.store(true, Relaxed);
    let _ = phase_tx.send(PHASE_MEASURE);
    let window_start = Instant::now();
    while window_start.elapsed() < opts.duration {
        tokio::time::sleep(Duration::from_millis(250).min(opts.duration)).await;
        if opts.progress && last_print.elapsed() > Duration::from_secs(5) {
            last_print = Instant::now();
            eprintln!(
                "  churn: {:.0} s, {} open, {} changes, {} reconnects, {} notifications",
                window_start.elapsed().as_secs_f64(),
                ctx.open.load(Relaxed),
                ctx.status_changes.load(Relaxed),
                ctx.reconnects.load(Relaxed),
                ctx.notifications.load(Relaxed)
            );
        }
    }
    // The window closes for new changes; pushes of changes already asked for
    // still count (one debounce and a little more).
    let _ = phase_tx.send(PHASE_DRAIN);
    report.held = ctx.open.load(Relaxed);
    tokio::time::sleep(opts.debounce + Duration::from_millis(500)).await;
    ctx.measuring.store(false, Relaxed);
    report.window = window_start.elapsed();
    let cpu3 = pid.and_then(cpu_secs);
    let self1 = cpu_secs(self_pid);
    let secs = report.window.as_secs_f64();
    report.server_cpu_window = match (cpu2, cpu3) {
        (Some(a), Some(b)) => Some((b - a) / secs),
        _ => None,
    };
    report.client_cpu_window = match (self0, self1) {
        (Some(a), Some(b)) => Some((b - a) / secs),
        _ => None,
    };

    // Stop: every device logs out and ends.
    let _ = phase_tx.send(PHASE_STOP);
    let close = async {
        for t in tasks {
            let _ = t.await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(30), close).await;
    for e in &endpoints {
        let _ = tokio::time::timeout(Duration::from_secs(5), e.wait_idle()).await;
    }

    report.failed = ctx.failed.load(Relaxed);
    report.notifications = ctx.notifications.load(Relaxed);
    report.status_changes = ctx.status_changes.load(Relaxed);
    report.reconnects = ctx.reconnects.load(Relaxed);
    report.reconnect_failures = ctx.reconnect_failures.load(Relaxed);
    report.request_errors = ctx.request_errors.load(Relaxed);
    let mut lat = std::mem::take(&mut *ctx.latencies_us.lock().unwrap_or_else(|p| p.into_inner()));
    lat.sort_unstable();
    report.latency_samples = lat.len();
    let q = |q: f64| {
        (!lat.is_empty()).then(|| {
            let i = ((lat.len() as f64 - 1.0) * q).round() as usize;
            Duration::from_micros(u64::from(lat[i.min(lat.len() - 1)]))
        })
    };
    report.latency_p50 = q(0.5);
    report.latency_p99 = q(0.99);
    report.latency_p999 = q(0.999);
    report
}
