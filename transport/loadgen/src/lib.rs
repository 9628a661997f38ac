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
//! [`greendot_client`], which costs one UDP socket and several tasks per client).
//!
//! Measured: connections held, handshakes/s while ramping up, change-to-push
//! latency (from the status request leaving the client to each watcher's
//! push, minus the server's debounce) p50/p99/p99.9, notifications/s, and,
//! when given the server's process id, its resident memory per session
//! (`VmRSS` before and after the ramp, from `/proc`) and its CPU (`utime +
//! stime` from `/proc/<pid>/stat`), the datagrams each side's sockets
//! dropped in the window, and, under a [`CpuCap`], how often the cap held
//! the server back (the cgroup's `cpu.stat`). All traffic goes to `server`; the run is
//! bounded by `ramp_timeout + duration` plus a few seconds to close.

mod cpucap;
mod device;
mod herd;
mod procfs;
mod report;
mod ws;

use greendot_proto::{self as proto, Push, Request, Status, Tier};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use rustls::pki_types::CertificateDer;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};

pub use cpucap::{CapProbe, CgroupVersion, CpuCap, CpuStat};
use device::{client_endpoint, device, newcomer};
pub(crate) use device::{device_rng, CONNECT_ATTEMPTS};
pub use herd::{Herd, HerdCounts, HerdOptions};
pub use procfs::{cpu_secs, rss_bytes, udp_drops};
use report::burst_report;
pub use report::{BurstReport, LoadReport};

/// What to run.
#[derive(Clone, Debug)]
#[non_exhaustive]
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
    /// The server's process, for memory, CPU and socket drops (`None`: not
    /// measured).
    pub server_pid: Option<u32>,
    /// The server's CPU cap, to report it and how often it held the server
    /// back. Default `None`.
    pub server_cap: Option<CapProbe>,
    /// Print progress to stderr.
    pub progress: bool,
    /// User names are `{prefix}{i}`.
    pub user_prefix: String,
    /// Connect over WebSocket (`wss://…/greendot`) to this TCP address
    /// instead of over QUIC to `server`. Default `None`.
    pub websocket: Option<SocketAddr>,
    /// A mass reconnect, or a step of new connections, inside the measured
    /// window (QUIC only). Default `None`.
    pub burst: Option<Burst>,
    /// The devices' own QUIC keep-alive. Default `None`: the server's
    /// keep-alive paces the connection and a device only answers it (quinn
    /// restarts a side's keep-alive timer at every packet it receives, so the
    /// shorter of the two sets the pace). The client library's is 10 s.
    pub keep_alive: Option<Duration>,
}

/// Devices `0..sessions` close their connection `after` into the measured
/// window, all at once, and reconnect with resume (retrying with the client
/// library's full-jitter backoff); the others keep their churn, whose
/// latency is then reported before, during and after.
///
/// With `arrivals_per_sec`, instead `sessions` new devices (users the run
/// has not connected) connect from `after` on at that rate, each retrying
/// with the same backoff until the window ends, and hold their connection:
/// a step in new connections on top of the established ones.
#[derive(Clone, Copy, Debug)]
pub struct Burst {
    pub after: Duration,
    pub sessions: usize,
    pub arrivals_per_sec: Option<f64>,
}

impl LoadOptions {
    /// Defaults: 8 endpoints, 20 realtime contacts, 1% churn per second (half
    /// reconnects), 30 s, 256 handshakes in flight, debounce 300 ms, no
    /// keep-alive of the devices' own.
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
            server_cap: None,
            progress: true,
            user_prefix: "lg".into(),
            websocket: None,
            burst: None,
            keep_alive: None,
        }
    }
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
    /// (received, ms since `t0`; change-to-push latency, µs)
    latencies_us: Mutex<Vec<(u32, u32)>>,
    burst_back: AtomicUsize,
    burst_failed: AtomicUsize,
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

    /// Device `i`'s token (mobile, watching its contacts); `None` counts
    /// it as failed.
    fn token(&self, i: usize) -> Option<String> {
        let claims = Claims::new(
            self.user(i),
            "d",
            proto::Kind::Mobile,
            WatchClaim::only(self.contacts(i)),
            Duration::from_secs(24 * 3600),
        );
        let token = self.keys.mint(&claims).ok();
        if token.is_none() {
            self.failed.fetch_add(1, Relaxed);
        }
        token
    }

    /// The next status change of the churn, its sending instant recorded
    /// for the latency of the pushes it causes.
    fn status_change(&self) -> Request {
        let seq = self.next_seq.fetch_add(1, Relaxed);
        let status = [Status::Away, Status::Busy, Status::Available][seq % 3];
        if let Some(slot) = self.sent.get(seq) {
            slot.store(self.nanos().max(1), Relaxed);
        }
        Request::SetStatus {
            status,
            message: Some(format!("c{seq}-{}", self.run)),
        }
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
                let received = u32::try_from(self.nanos() / 1_000_000).unwrap_or(u32::MAX);
                let mut l = self.latencies_us.lock().unwrap_or_else(|p| p.into_inner());
                l.push((received, u32::try_from(d).unwrap_or(u32::MAX)));
            }
        }
    }
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
        .map(|i| client_endpoint(&opts, i))
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
        burst_back: AtomicUsize::new(0),
        burst_failed: AtomicUsize::new(0),
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

    let ws_tls = match opts.websocket.map(|_| ws::tls(&ctx)).transpose() {
        Ok(tls) => tls,
        Err(e) => {
            if opts.progress {
                eprintln!("loadgen: WebSocket TLS: {e}");
            }
            return report;
        }
    };
    let (phase_tx, phase_rx) = watch::channel(PHASE_RAMP);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let task = match (opts.websocket, &ws_tls) {
            (Some(addr), Some(tls)) => tokio::spawn(ws::device(
                ctx.clone(),
                addr,
                tls.clone(),
                i,
                phase_rx.clone(),
            )),
            _ => tokio::spawn(device(
                ctx.clone(),
                endpoints[i % endpoints.len()].clone(),
                i,
                phase_rx.clone(),
            )),
        };
        tasks.push(task);
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
    let drops0 = (pid.and_then(udp_drops), udp_drops(self_pid));
    let cap0 = opts.server_cap.as_ref().and_then(CapProbe::read);
    ctx.measuring.store(true, Relaxed);
    let _ = phase_tx.send(PHASE_MEASURE);
    let window_start = Instant::now();
    if let Some((b, rate)) = opts.burst.and_then(|b| Some((b, b.arrivals_per_sec?))) {
        let at0 = tokio::time::Instant::from_std(window_start + b.after);
        for k in 0..b.sessions {
            let at = at0 + Duration::from_secs_f64(k as f64 / rate.max(1e-3));
            tasks.push(tokio::spawn(newcomer(
                ctx.clone(),
                endpoints[k % endpoints.len()].clone(),
                n + k,
                at,
                phase_rx.clone(),
            )));
        }
    }
    let mut burst_done: Option<Instant> = None;
    while window_start.elapsed() < opts.duration {
        tokio::time::sleep(Duration::from_millis(250).min(opts.duration)).await;
        if let Some(b) = opts.burst.filter(|_| burst_done.is_none()) {
            let settled = ctx.burst_back.load(Relaxed) + ctx.burst_failed.load(Relaxed);
            let of = match b.arrivals_per_sec {
                Some(_) => b.sessions,
                None => b.sessions.min(report.connected),
            };
            if settled >= of {
                burst_done = Some(Instant::now());
            }
        }
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
    let drops1 = (pid.and_then(udp_drops), udp_drops(self_pid));
    let cap1 = opts.server_cap.as_ref().and_then(CapProbe::read);
    report.server_drops_window = drops0.0.zip(drops1.0).map(|(a, b)| b.saturating_sub(a));
    report.client_drops_window = drops0.1.zip(drops1.1).map(|(a, b)| b.saturating_sub(a));
    report.server_cap = opts.server_cap.as_ref().map(|c| c.cores);
    report.server_throttled = cap0.zip(cap1).map(|(a, b)| {
        let periods = b.periods.saturating_sub(a.periods);
        let throttled = b.throttled.saturating_sub(a.throttled);
        (throttled, periods)
    });
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
    let timed = std::mem::take(&mut *ctx.latencies_us.lock().unwrap_or_else(|p| p.into_inner()));
    let since_t0 = |at: Instant| at.saturating_duration_since(ctx.t0).as_millis() as u32;
    report.burst = opts.burst.map(|b| {
        let start = since_t0(window_start + b.after);
        let end = burst_done.map(since_t0);
        burst_report(&ctx, b, &timed, start, end)
    });
    let mut lat: Vec<u32> = timed.into_iter().map(|(_, l)| l).collect();
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
