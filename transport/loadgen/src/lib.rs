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
//! stime` from `/proc/<pid>/stat`). All traffic goes to `server`; the run is
//! bounded by `ramp_timeout + duration` plus a few seconds to close.

mod ws;

use greendot_client::tls;
use greendot_proto::{
    self as proto, codec::read_frame, encode_frame, Answer, CloseCode, FrameReader, Hello, Push,
    Request, RequestFrame, ServerFrame, Status, Tier,
};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use rustls::pki_types::CertificateDer;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};

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
    /// The server's process, for memory and CPU (`None`: not measured).
    pub server_pid: Option<u32>,
    /// Print progress to stderr.
    pub progress: bool,
    /// User names are `{prefix}{i}`.
    pub user_prefix: String,
    /// Connect over WebSocket (`wss://…/greendot`) to this TCP address
    /// instead of over QUIC to `server`. Default `None`.
    pub websocket: Option<SocketAddr>,
    /// A mass reconnect inside the measured window (QUIC only). Default
    /// `None`.
    pub burst: Option<Burst>,
}

/// Devices `0..sessions` close their connection `after` into the measured
/// window, all at once, and reconnect with resume (retrying with the client
/// library's full-jitter backoff); the others keep their churn, whose
/// latency is then reported before, during and after.
#[derive(Clone, Copy, Debug)]
pub struct Burst {
    pub after: Duration,
    pub sessions: usize,
}

/// What a [`Burst`] did.
#[derive(Clone, Debug, Default)]
pub struct BurstReport {
    pub sessions: usize,
    /// Of them, welcomed again, and given up.
    pub back: usize,
    pub failed: usize,
    /// From the burst to the last of them back.
    pub all_back: Option<Duration>,
    /// Change-to-push p99 of the other sessions' changes: received in the
    /// window before the burst, from the burst until all were back, after.
    pub p99_before: Option<Duration>,
    pub p99_during: Option<Duration>,
    pub p99_after: Option<Duration>,
    /// From the burst's end (all back) to the first second from which every
    /// second's p99 stays within twice the one before the burst (at least
    /// 50 ms): the server back to normal.
    pub normal_after: Option<Duration>,
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
            websocket: None,
            burst: None,
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
    pub burst: Option<BurstReport>,
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

/// The p99 of latencies (µs).
fn p99(mut lat: Vec<u32>) -> Option<Duration> {
    lat.sort_unstable();
    let i = ((lat.len() as f64 - 1.0) * 0.99).round() as usize;
    lat.get(i.min(lat.len().saturating_sub(1)))
        .map(|&us| Duration::from_micros(u64::from(us)))
}

/// `timed`: (received ms, latency µs); the burst from `start` to `end` ms.
fn burst_report(
    ctx: &Ctx,
    b: Burst,
    timed: &[(u32, u32)],
    start: u32,
    end: Option<u32>,
) -> BurstReport {
    BurstReport {
        sessions: b.sessions,
        back: ctx.burst_back.load(Relaxed),
        failed: ctx.burst_failed.load(Relaxed),
        all_back: end.map(|e| Duration::from_millis(u64::from(e.saturating_sub(start)))),
        ..burst_latency(timed, start, end)
    }
}

/// The latency figures of a [`BurstReport`].
fn burst_latency(timed: &[(u32, u32)], start: u32, end: Option<u32>) -> BurstReport {
    let end_ms = end.unwrap_or(u32::MAX);
    let within = |from: u32, to: u32| -> Vec<u32> {
        timed
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, l)| *l)
            .collect()
    };
    let before = p99(within(0, start));
    // Back to normal: seconds after the end whose p99 all stay under the bar.
    let bar = before.map_or(Duration::from_millis(50), |p| {
        (p * 2).max(Duration::from_millis(50))
    });
    let last = timed.iter().map(|(at, _)| *at).max().unwrap_or(0);
    let normal_after = end.and_then(|end| {
        let seconds: Vec<u32> = (end..=last).step_by(1000).collect();
        let ok = |from: u32| p99(within(from, from + 1000)).is_none_or(|p| p <= bar);
        let first_bad_from_end = seconds.iter().rposition(|&s| !ok(s));
        let from = match first_bad_from_end {
            None => end,
            Some(k) => seconds.get(k + 1).copied()?,
        };
        Some(Duration::from_millis(u64::from(from - end)))
    });
    BurstReport {
        p99_before: before,
        p99_during: p99(within(start, end_ms)),
        p99_after: end.and_then(|e| p99(within(e, u32::MAX))),
        normal_after,
        ..BurstReport::default()
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
            foreground: true,
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
/// can cost seconds of backoff; a fresh attempt is quicker), with the
/// client library's backoff between them (a server that sheds refuses at
/// once).
const CONNECT_ATTEMPTS: usize = 8;
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
    let Some(token) = ctx.token(i) else {
        return;
    };
    let mut rand = device_rng(i);
    let first = {
        let _permit = ctx.connect_gate.acquire().await;
        if *phase.borrow() != PHASE_RAMP {
            ctx.failed.fetch_add(1, Relaxed);
            return;
        }
        let mut backoff = Backoff::new(&mut rand, phase.clone(), PHASE_RAMP);
        let mut tries = 1;
        loop {
            let result = attempt(&ctx, &endpoint, &token, i, None).await;
            if result.is_ok() || tries == CONNECT_ATTEMPTS || !backoff.wait().await {
                break result;
            }
            tries += 1;
        }
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
    // Wait for the measured window.
    while *phase.borrow() == PHASE_RAMP {
        if phase.changed().await.is_err() {
            break;
        }
    }
    let mut next_id = 2u64;
    let mut alive = true;
    let mut burst = ctx
        .opts
        .burst
        .filter(|b| i < b.sessions)
        .map(|b| tokio::time::Instant::now() + b.after);
    while alive && *phase.borrow() == PHASE_MEASURE && (ctx.opts.churn > 0.0 || burst.is_some()) {
        let wait = if ctx.opts.churn > 0.0 {
            -(1.0 - rand()).ln() / ctx.opts.churn
        } else {
            3600.0
        };
        let burst_at = burst.unwrap_or_else(tokio::time::Instant::now);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs_f64(wait.min(3600.0))) => {}
            _ = tokio::time::sleep_until(burst_at), if burst.is_some() => {
                burst = None;
                let backoff = Backoff::new(&mut rand, phase.clone(), PHASE_MEASURE);
                alive = reconnect(&ctx, &endpoint, &token, i, &mut live, backoff).await;
                let count = if alive { &ctx.burst_back } else { &ctx.burst_failed };
                count.fetch_add(1, Relaxed);
                continue;
            }
            _ = phase.changed() => continue,
            _ = live.conn.closed() => { alive = false; continue; }
        }
        if rand() < ctx.opts.reconnect_share {
            let backoff = Backoff::new(&mut rand, phase.clone(), PHASE_MEASURE);
            alive = reconnect(&ctx, &endpoint, &token, i, &mut live, backoff).await;
            let count = if alive {
                &ctx.reconnects
            } else {
                &ctx.reconnect_failures
            };
            count.fetch_add(1, Relaxed);
        } else {
            let request = ctx.status_change();
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

/// As the client library retries a connect: full-jitter backoff (its
/// defaults, 100 ms doubling to 5 s), while the run is in `during`. A
/// server that sheds refuses the attempt at once; retrying at once would
/// only add to its load.
struct Backoff<'a, R> {
    rand: &'a mut R,
    cap: Duration,
    phase: watch::Receiver<u8>,
    during: u8,
}

impl<'a, R: FnMut() -> f64> Backoff<'a, R> {
    fn new(rand: &'a mut R, phase: watch::Receiver<u8>, during: u8) -> Self {
        Backoff {
            rand,
            cap: Duration::from_millis(100),
            phase,
            during,
        }
    }

    /// Waits before the next attempt; `false`: the phase ended (before or
    /// during the wait), make no more.
    async fn wait(&mut self) -> bool {
        if *self.phase.borrow() != self.during {
            return false;
        }
        let wait = self.cap.mul_f64((self.rand)());
        self.cap = (self.cap * 2).min(Duration::from_secs(5));
        tokio::time::sleep(wait).await;
        *self.phase.borrow() == self.during
    }
}

/// Closes `live` and connects again with resume, retrying after `backoff`
/// until its phase ends. `false`: not back. The device is out of
/// `ctx.open` while it retries, so one still retrying when the window ends
/// is not counted as held (one that gives up does so after the count).
async fn reconnect(
    ctx: &Arc<Ctx>,
    endpoint: &quinn::Endpoint,
    token: &str,
    i: usize,
    live: &mut Live,
    mut backoff: Backoff<'_, impl FnMut() -> f64>,
) -> bool {
    live.pushes.abort();
    live.conn.close(CloseCode::Normal.varint(), b"reconnect");
    ctx.open.fetch_sub(1, Relaxed);
    let resume = Some(live.session);
    let back = loop {
        if let Ok(l) = attempt(ctx, endpoint, token, i, resume).await {
            *live = l;
            break true;
        }
        if !backoff.wait().await {
            break false;
        }
    };
    ctx.open.fetch_add(1, Relaxed);
    back
}

/// Device `i`'s own uniform draws in [0, 1) (xorshift64*, seeded by `i`),
/// for when it acts.
fn device_rng(i: usize) -> impl FnMut() -> f64 {
    let mut rng = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        (rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn client_endpoint(opts: &LoadOptions, index: usize) -> Result<quinn::Endpoint, String> {
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
    let mut endpoint = endpoint_at(opts.server, index)?;
    endpoint.set_default_client_config(config);
    Ok(endpoint)
}

/// Client socket buffers: a server's burst of answers to thousands of
/// devices on one socket must not be dropped by a 208 KiB default.
const CLIENT_SOCKET_BUFFER: usize = 8 << 20;

/// Client endpoint `index`. Against a server on IPv4 loopback each endpoint
/// has a source address of its own (127.0.0.2, 127.0.0.3, ...: Linux routes
/// all of 127/8 to the loopback device), as real devices come from many
/// addresses: otherwise the server's limit of handshakes in flight per
/// address, meant for one abusive host, would apply to the whole load.
fn endpoint_at(server: SocketAddr, index: usize) -> Result<quinn::Endpoint, String> {
    let bind = match server.ip() {
        std::net::IpAddr::V6(_) => SocketAddr::from(([0u16, 0, 0, 0, 0, 0, 0, 1], 0)),
        std::net::IpAddr::V4(ip) if ip.is_loopback() => {
            SocketAddr::from(([127, 0, 0, 2 + (index % 250) as u8], 0))
        }
        std::net::IpAddr::V4(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
    };
    let socket = std::net::UdpSocket::bind(bind).map_err(|e| format!("bind {bind}: {e}"))?;
    greendot_server::testing::socket_buffers(&socket, CLIENT_SOCKET_BUFFER);
    let runtime = quinn::default_runtime().ok_or("no async runtime")?;
    quinn::Endpoint::new(quinn::EndpointConfig::default(), None, socket, runtime)
        .map_err(|e| e.to_string())
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
    ctx.measuring.store(true, Relaxed);
    let _ = phase_tx.send(PHASE_MEASURE);
    let window_start = Instant::now();
    let mut burst_done: Option<Instant> = None;
    while window_start.elapsed() < opts.duration {
        tokio::time::sleep(Duration::from_millis(250).min(opts.duration)).await;
        if let Some(b) = opts.burst.filter(|_| burst_done.is_none()) {
            let settled = ctx.burst_back.load(Relaxed) + ctx.burst_failed.load(Relaxed);
            if settled >= b.sessions.min(report.connected) {
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

// ---------------------------------------------------------------------------
// Herds: many sessions coming back together (a server restart, a mass
// reconnect), and watchers that count who they saw go offline meanwhile.

/// What a [`Herd`] holds and how its devices reconnect.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct HerdOptions {
    pub server: SocketAddr,
    pub roots: Vec<CertificateDer<'static>>,
    pub token_secret: Vec<u8>,
    pub server_name: String,
    /// Devices (one user each) held.
    pub sessions: usize,
    /// Client UDP endpoints the devices are spread over.
    pub endpoints: usize,
    /// Watchers, each subscribed (batched) to `watched` of the users.
    pub watchers: usize,
    /// Users each watcher watches: the first `watched` users (at most 1,000
    /// per request; more are sent in several requests).
    pub watched: usize,
    /// Handshakes in flight at once while ramping up.
    pub connect_concurrency: usize,
    /// Attempts in flight at once when coming back (after a drain or a
    /// kick). More than the server's `retry_threshold`, so a herd still
    /// meets its shedding, but bounded: 100,000 simulated devices share the
    /// machine's cores, and unbounded attempts (an X25519 key and a quinn
    /// connection each) starved the load generator's own endpoint drivers:
    /// its 16 sockets' receive queues sat full at 16 MB while the server
    /// idled, and every answer was dropped. Not much less either: an attempt
    /// at a server still draining or not yet listening holds its slot for
    /// the whole connect timeout (1,024 slots let 280 devices a second back).
    pub reconnect_concurrency: usize,
    /// Reconnect waits: full jitter, or within a `retry_ms` from the server
    /// (as the client library does).
    pub reconnect: greendot_client::Reconnect,
    /// Offer TLS session tickets when reconnecting (each device keeps its
    /// own); switch with [`Herd::set_resumption`].
    pub resumption: bool,
    /// The devices' kind (web: the shortest grace).
    pub kind: proto::Kind,
    /// The devices' QUIC keep-alive and idle timeout; default the client
    /// library's (10 s, 30 s). A device that missed the Draining close
    /// learns that its connection is gone from the next process's stateless
    /// reset to its next keep-alive; with none it waits for the idle timeout.
    pub keep_alive: Option<Duration>,
    pub idle_timeout: Duration,
    pub user_prefix: String,
    pub progress: bool,
    /// Servers of a cluster (empty: `server` alone): the devices are placed
    /// on them in contiguous blocks (the first `sessions / len` on the
    /// first, …), and a device that lost its connection (not one still
    /// ramping up) tries another of them, as a client given the cluster's
    /// addresses would.
    pub servers: Vec<SocketAddr>,
    /// Where the watchers connect, round robin (empty: `server`).
    pub watcher_servers: Vec<SocketAddr>,
    /// The watchers' tier.
    pub watch_tier: Tier,
}

impl HerdOptions {
    /// Defaults: 16 endpoints, 1 watcher of 1,000 users, web devices,
    /// 256 handshakes in flight while ramping and 4,096 when coming back, the
    /// client library's backoff, resumption on.
    pub fn new(
        server: SocketAddr,
        roots: Vec<CertificateDer<'static>>,
        token_secret: impl Into<Vec<u8>>,
        sessions: usize,
    ) -> HerdOptions {
        HerdOptions {
            server,
            roots,
            token_secret: token_secret.into(),
            server_name: "localhost".into(),
            sessions,
            endpoints: 16,
            watchers: 1,
            watched: 1000,
            connect_concurrency: 256,
            reconnect_concurrency: 4096,
            reconnect: greendot_client::Reconnect::default(),
            resumption: true,
            kind: proto::Kind::Web,
            keep_alive: Some(Duration::from_secs(10)),
            idle_timeout: Duration::from_secs(30),
            user_prefix: "herd".into(),
            progress: true,
            servers: Vec::new(),
            watcher_servers: Vec::new(),
            watch_tier: Tier::Batched,
        }
    }
}

/// A certificate check that counts: a resumed TLS 1.3 handshake has no
/// certificate to check, so the count is the number of full handshakes.
#[derive(Debug)]
struct CountingVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    checks: Arc<AtomicU64>,
}

impl rustls::client::danger::ServerCertVerifier for CountingVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.checks.fetch_add(1, Relaxed);
        self.inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Counters of a herd, read at any time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HerdCounts {
    /// Devices (and watchers) connected now.
    pub connected: usize,
    /// Devices back since the last [`Herd::mark`].
    pub back: usize,
    /// QUIC handshakes completed, and of those the full ones (a certificate
    /// checked); the rest resumed TLS.
    pub handshakes: u64,
    pub full_handshakes: u64,
    /// Welcomes that resumed the session.
    pub resumed_sessions: u64,
    /// Attempts that failed (refused, timed out).
    pub failed_attempts: u64,
}

struct HerdCtx {
    opts: HerdOptions,
    keys: TokenKeys,
    t0: Instant,
    base_tls: rustls::ClientConfig,
    transport: Arc<quinn::TransportConfig>,
    full_handshakes: Arc<AtomicU64>,
    resumption: AtomicBool,
    handshakes: AtomicU64,
    resumed_sessions: AtomicU64,
    failed_attempts: AtomicU64,
    connected: AtomicUsize,
    /// Bumped by [`Herd::mark`]; a device counts as back once per mark.
    mark: AtomicU64,
    back: AtomicUsize,
    /// When the last device came back, in nanoseconds since `t0`.
    last_back: AtomicU64,
    /// Each device that came back since the mark, and when (ns since `t0`).
    back_at: Mutex<Vec<(usize, u64)>>,
    /// Count offline pushes and snapshots from now on.
    watching: AtomicBool,
    offline_seen: Mutex<std::collections::BTreeSet<String>>,
    /// The last presence any watcher was shown of each user: online or not.
    last_shown: Mutex<std::collections::HashMap<String, bool>>,
    connect_gate: Semaphore,
    reconnect_gate: Semaphore,
    /// (generation, how many): devices below `how many` reconnect at once.
    kick: watch::Sender<(u64, usize)>,
    stop: watch::Sender<bool>,
}

impl HerdCtx {
    fn user(&self, i: usize) -> String {
        format!("{}{i}", self.opts.user_prefix)
    }

    /// A QUIC client configuration of one device: with its own TLS session
    /// cache, or with none.
    fn device_config(&self, resumption: bool) -> Result<quinn::ClientConfig, String> {
        let mut tls = self.base_tls.clone();
        tls.resumption = if resumption {
            rustls::client::Resumption::in_memory_sessions(1)
        } else {
            rustls::client::Resumption::disabled()
        };
        let crypto = QuicClientConfigAlias::try_from(tls).map_err(|e| e.to_string())?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(self.transport.clone());
        Ok(config)
    }

    fn came_back(&self, seen_mark: &mut u64, device: usize) {
        let mark = self.mark.load(Relaxed);
        if *seen_mark != mark {
            *seen_mark = mark;
            self.back.fetch_add(1, Relaxed);
            let now = u64::try_from(self.t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.last_back.fetch_max(now, Relaxed);
            let mut back_at = self.back_at.lock().unwrap_or_else(|p| p.into_inner());
            back_at.push((device, now));
        }
    }

    /// The servers device `i` (or watcher `i`) may use, its home first.
    fn servers_of(&self, i: usize, watcher: bool) -> Vec<SocketAddr> {
        let (list, home) = if watcher {
            let list = &self.opts.watcher_servers;
            (list, i % list.len().max(1))
        } else {
            let list = &self.opts.servers;
            let per = self.opts.sessions.div_ceil(list.len().max(1)).max(1);
            (list, i / per)
        };
        if list.is_empty() {
            return vec![self.opts.server];
        }
        let home = home.min(list.len() - 1);
        let mut out = vec![list[home]];
        // The others in an order that spreads a lost node's devices.
        let n = list.len();
        for k in 0..n - 1 {
            out.push(list[(home + 1 + (i + k) % (n - 1)) % n]);
        }
        out
    }

    fn saw(&self, target: &str, presence: &proto::Presence) {
        self.last_shown
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(target.to_owned(), presence.online);
        if !presence.online && self.watching.load(Relaxed) {
            let mut seen = self.offline_seen.lock().unwrap_or_else(|p| p.into_inner());
            seen.insert(target.to_owned());
        }
    }
}

use quinn::crypto::rustls::QuicClientConfig as QuicClientConfigAlias;

/// Many devices held open, reconnecting as the client library does.
pub struct Herd {
    ctx: Arc<HerdCtx>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    endpoints: Vec<quinn::Endpoint>,
}

struct HerdLive {
    conn: quinn::Connection,
    session: u64,
    pushes: tokio::task::JoinHandle<()>,
    _control: (quinn::SendStream, quinn::RecvStream),
}

/// One attempt: handshake, hello (resuming), and for a watcher on a fresh
/// session the subscriptions.
async fn herd_establish(
    ctx: &Arc<HerdCtx>,
    endpoint: &quinn::Endpoint,
    server: SocketAddr,
    config: &quinn::ClientConfig,
    token: &str,
    resume: Option<u64>,
    watcher: bool,
) -> Result<HerdLive, String> {
    let connecting = endpoint
        .connect_with(config.clone(), server, &ctx.opts.server_name)
        .map_err(|e| e.to_string())?;
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
    ctx.handshakes.fetch_add(1, Relaxed);
    let pushes = tokio::spawn(herd_pushes(conn.clone(), ctx.clone()));
    let result = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let hello = Hello {
            version: proto::VERSION,
            token: token.to_owned(),
            resume,
            foreground: true,
        };
        send.write_all(&encode_frame(&hello).map_err(|e| e.to_string())?)
            .await
            .map_err(|e| e.to_string())?;
        let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
        let welcome = match read_frame(&mut recv, &mut reader).await {
            Ok(Some(p)) => proto::decode::<ServerFrame>(&p).map_err(|e| e.to_string())?,
            _ => return Err("no welcome".to_string()),
        };
        let welcome = match welcome {
            ServerFrame::Welcome(w) => w,
            other => return Err(format!("refused: {other:?}")),
        };
        for s in &welcome.snapshots {
            ctx.saw(&s.target, &s.presence);
        }
        if welcome.resumed {
            ctx.resumed_sessions.fetch_add(1, Relaxed);
        }
        let mut live = (send, recv, reader);
        if watcher && !welcome.resumed {
            let targets: Vec<String> = (0..ctx.opts.watched.min(ctx.opts.sessions))
                .map(|i| ctx.user(i))
                .collect();
            for (k, chunk) in targets.chunks(1000).enumerate() {
                let request = Request::Subscribe {
                    targets: chunk.to_vec(),
                    tier: ctx.opts.watch_tier,
                };
                match call(&mut live, k as u64 + 1, request).await? {
                    Answer::Subscribed { snapshots, .. } => {
                        for s in &snapshots {
                            ctx.saw(&s.target, &s.presence);
                        }
                    }
                    other => return Err(format!("subscribe: {other:?}")),
                }
            }
        }
        Ok(((live.0, live.1), welcome.session))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, result)
        .await
        .unwrap_or_else(|_| Err("hello timed out".into()))
    {
        Ok((control, session)) => Ok(HerdLive {
            conn,
            session,
            pushes,
            _control: control,
        }),
        Err(e) => {
            pushes.abort();
            conn.close(CloseCode::Normal.varint(), b"hello failed");
            Err(e)
        }
    }
}

async fn herd_pushes(conn: quinn::Connection, ctx: Arc<HerdCtx>) {
    let read = |mut stream: quinn::RecvStream| {
        let ctx = ctx.clone();
        async move {
            let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
            while let Ok(Some(payload)) = read_frame(&mut stream, &mut reader).await {
                if let Ok(Push::Update { target, presence }) = proto::decode::<Push>(&payload) {
                    ctx.saw(&target, &presence);
                }
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

/// One device (or watcher) of a herd: connects, holds, and whenever its
/// connection ends reconnects with resume after a full-jitter wait (within
/// the server's `retry_ms` if its close reason had one).
async fn herd_device(ctx: Arc<HerdCtx>, endpoint: quinn::Endpoint, i: usize, watcher: bool) {
    let (user, watch) = if watcher {
        (
            format!("{}-watcher{i}", ctx.opts.user_prefix),
            WatchClaim::all(),
        )
    } else {
        (ctx.user(i), WatchClaim::only(Vec::<String>::new()))
    };
    let claims = Claims::new(
        user,
        "d",
        ctx.opts.kind,
        watch,
        Duration::from_secs(24 * 3600),
    );
    let (Ok(token), Ok(resuming), Ok(full)) = (
        ctx.keys.mint(&claims),
        ctx.device_config(true),
        ctx.device_config(false),
    ) else {
        ctx.failed_attempts.fetch_add(1, Relaxed);
        return;
    };
    let mut stop = ctx.stop.subscribe();
    let mut kick = ctx.kick.subscribe();
    let mut kicked = kick.borrow().0;
    let mut backoff = greendot_client::Backoff::new(ctx.opts.reconnect);
    let mut resume = None;
    let mut seen_mark = ctx.mark.load(Relaxed);
    let mut wait = None;
    let mut ramping = true;
    let servers = ctx.servers_of(i, watcher);
    let mut at = 0;
    loop {
        if let Some(delay) = wait.take() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stop.changed() => return,
            }
        }
        if *stop.borrow() {
            return;
        }
        let config = if ctx.resumption.load(Relaxed) {
            &resuming
        } else {
            &full
        };
        let attempt = async {
            let gate = if ramping {
                &ctx.connect_gate
            } else {
                &ctx.reconnect_gate
            };
            let _permit = gate.acquire().await;
            herd_establish(
                &ctx,
                &endpoint,
                servers[at],
                config,
                &token,
                resume,
                watcher,
            )
            .await
        };
        let live = match attempt.await {
            Ok(live) => live,
            Err(e) => {
                ctx.failed_attempts.fetch_add(1, Relaxed);
                if !ramping {
                    at = (at + 1) % servers.len();
                }
                wait = Some(backoff.next_delay(greendot_client::retry_hint(&e)));
                continue;
            }
        };
        ramping = false;
        backoff.reset();
        resume = Some(live.session);
        ctx.connected.fetch_add(1, Relaxed);
        if !watcher {
            ctx.came_back(&mut seen_mark, i);
        }
        let hint = loop {
            tokio::select! {
                error = live.conn.closed() => {
                    break match error {
                        quinn::ConnectionError::ApplicationClosed(c) => {
                            greendot_client::retry_hint(&String::from_utf8_lossy(&c.reason))
                        }
                        _ => None,
                    };
                }
                _ = stop.changed() => {
                    ctx.connected.fetch_sub(1, Relaxed);
                    live.pushes.abort();
                    live.conn.close(CloseCode::Logout.varint(), b"herd done");
                    return;
                }
                changed = kick.changed() => {
                    let (generation, below) = *kick.borrow();
                    if changed.is_ok() && generation != kicked && i < below && !watcher {
                        kicked = generation;
                        // A plain close (the device lingers), then back at once.
                        live.conn.close(CloseCode::Normal.varint(), b"mass reconnect");
                        break Some(Duration::ZERO);
                    }
                    kicked = generation;
                }
            }
        };
        live.pushes.abort();
        ctx.connected.fetch_sub(1, Relaxed);
        // Lost (not kicked): try another server of the cluster.
        if hint != Some(Duration::ZERO) {
            at = (at + 1) % servers.len();
        }
        wait = Some(backoff.next_delay(hint));
    }
}

impl Herd {
    /// Connects every device, then the watchers (once the devices are shown
    /// online); returns when all are connected or `ramp_timeout` passed.
    pub async fn start(opts: HerdOptions, ramp_timeout: Duration) -> Result<Herd, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for root in &opts.roots {
            roots.add(root.clone()).map_err(|e| e.to_string())?;
        }
        let full_handshakes = Arc::new(AtomicU64::new(0));
        let verifier = CountingVerifier {
            inner: rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots),
                provider.clone(),
            )
            .build()
            .map_err(|e| e.to_string())?,
            checks: full_handshakes.clone(),
        };
        let mut base_tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        base_tls.alpn_protocols = vec![proto::ALPN.to_vec()];
        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(opts.keep_alive);
        transport.max_idle_timeout(Some(
            opts.idle_timeout
                .try_into()
                .map_err(|_| "idle timeout".to_string())?,
        ));
        let endpoints: Vec<quinn::Endpoint> = (0..opts.endpoints.max(1))
            .map(|i| endpoint_at(opts.server, i))
            .collect::<Result<_, _>>()?;
        let ctx = Arc::new(HerdCtx {
            keys: TokenKeys::new(&opts.token_secret, Duration::from_secs(30)),
            t0: Instant::now(),
            base_tls,
            transport: Arc::new(transport),
            full_handshakes,
            resumption: AtomicBool::new(opts.resumption),
            handshakes: AtomicU64::new(0),
            resumed_sessions: AtomicU64::new(0),
            failed_attempts: AtomicU64::new(0),
            connected: AtomicUsize::new(0),
            mark: AtomicU64::new(0),
            back: AtomicUsize::new(0),
            last_back: AtomicU64::new(0),
            back_at: Mutex::new(Vec::new()),
            watching: AtomicBool::new(false),
            offline_seen: Mutex::new(Default::default()),
            last_shown: Mutex::new(std::collections::HashMap::new()),
            connect_gate: Semaphore::new(opts.connect_concurrency.max(1)),
            reconnect_gate: Semaphore::new(opts.reconnect_concurrency.max(1)),
            kick: watch::channel((0, 0)).0,
            stop: watch::channel(false).0,
            opts,
        });
        let mut herd = Herd {
            ctx: ctx.clone(),
            tasks: Vec::new(),
            endpoints,
        };
        let started = Instant::now();
        let n = ctx.opts.sessions;
        for i in 0..n {
            let endpoint = herd.endpoints[i % herd.endpoints.len()].clone();
            herd.tasks
                .push(tokio::spawn(herd_device(ctx.clone(), endpoint, i, false)));
        }
        herd.wait_connected(n, started, ramp_timeout).await?;
        for w in 0..ctx.opts.watchers {
            let endpoint = herd.endpoints[w % herd.endpoints.len()].clone();
            herd.tasks
                .push(tokio::spawn(herd_device(ctx.clone(), endpoint, w, true)));
        }
        herd.wait_connected(n + ctx.opts.watchers, started, ramp_timeout)
            .await?;
        Ok(herd)
    }

    async fn wait_connected(
        &self,
        want: usize,
        started: Instant,
        timeout: Duration,
    ) -> Result<(), String> {
        let mut last_print = Instant::now();
        while self.ctx.connected.load(Relaxed) < want {
            if started.elapsed() > timeout {
                return Err(format!(
                    "only {} of {want} connected in {timeout:?}",
                    self.ctx.connected.load(Relaxed)
                ));
            }
            if self.ctx.opts.progress && last_print.elapsed() > Duration::from_secs(2) {
                last_print = Instant::now();
                eprintln!(
                    "  ramp: {} of {want} connected, {:.0} s",
                    self.ctx.connected.load(Relaxed),
                    started.elapsed().as_secs_f64()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// From now on, count every user a watcher is shown offline.
    pub fn watch_for_offline(&self) {
        self.ctx.watching.store(true, Relaxed);
    }

    /// Users whose last presence shown to a watcher was online.
    pub fn shown_online(&self) -> usize {
        let shown = self
            .ctx
            .last_shown
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        shown.values().filter(|online| **online).count()
    }

    /// Users a watcher was shown offline since [`Herd::watch_for_offline`].
    pub fn offline_seen(&self) -> Vec<String> {
        let seen = self
            .ctx
            .offline_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        seen.iter().cloned().collect()
    }

    /// Starts counting devices coming back: after this each device counts
    /// once in [`HerdCounts::back`] when it next connects.
    pub fn mark(&self) {
        self.ctx.back.store(0, Relaxed);
        self.ctx.last_back.store(0, Relaxed);
        self.ctx
            .back_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.ctx.mark.fetch_add(1, Relaxed);
    }

    pub fn counts(&self) -> HerdCounts {
        let c = &self.ctx;
        HerdCounts {
            connected: c.connected.load(Relaxed),
            back: c.back.load(Relaxed),
            handshakes: c.handshakes.load(Relaxed),
            full_handshakes: c.full_handshakes.load(Relaxed),
            resumed_sessions: c.resumed_sessions.load(Relaxed),
            failed_attempts: c.failed_attempts.load(Relaxed),
        }
    }

    /// Whether reconnects from now on offer TLS session tickets.
    pub fn set_resumption(&self, on: bool) {
        self.ctx.resumption.store(on, Relaxed);
    }

    /// Waits until `n` devices are back since the last [`Herd::mark`];
    /// returns when the last of them came back, measured from `since`
    /// (`None`: not all back within `timeout`).
    pub async fn wait_back(&self, n: usize, since: Instant, timeout: Duration) -> Option<Duration> {
        let mut last_print = Instant::now();
        while self.ctx.back.load(Relaxed) < n {
            if since.elapsed() > timeout {
                return None;
            }
            if self.ctx.opts.progress && last_print.elapsed() > Duration::from_secs(2) {
                last_print = Instant::now();
                eprintln!(
                    "  back: {} of {n}, {:.1} s",
                    self.ctx.back.load(Relaxed),
                    since.elapsed().as_secs_f64()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let last = Duration::from_nanos(self.ctx.last_back.load(Relaxed));
        Some((self.ctx.t0 + last).saturating_duration_since(since))
    }

    /// The first `k` devices close (plainly: they linger) and reconnect at
    /// once, resuming. Call [`Herd::mark`] first to time them.
    pub fn mass_reconnect(&self, k: usize) {
        self.ctx.kick.send_modify(|(generation, below)| {
            *generation += 1;
            *below = k;
        });
    }

    /// Each device that came back since the last mark (its index) and how
    /// long after `since`.
    pub fn back_times(&self, since: Instant) -> Vec<(usize, Duration)> {
        let back_at = self.ctx.back_at.lock().unwrap_or_else(|p| p.into_inner());
        back_at
            .iter()
            .map(|&(d, ns)| {
                let at = self.ctx.t0 + Duration::from_nanos(ns);
                (d, at.saturating_duration_since(since))
            })
            .collect()
    }

    /// Devices that came back since the last mark.
    pub fn back(&self) -> usize {
        self.ctx.back.load(Relaxed)
    }

    /// Every device logs out; waits a little for them to go.
    pub async fn stop(self) {
        let _ = self.ctx.stop.send(true);
        let tasks = async {
            for t in self.tasks {
                let _ = t.await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(30), tasks).await;
        for e in &self.endpoints {
            let _ = tokio::time::timeout(Duration::from_secs(5), e.wait_idle()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_back_to_normal_from_the_first_second_that_stays_under_the_bar() {
        let ms = Duration::from_millis;
        // 5 ms before the burst (at 10 s), 900 ms during it (to 12 s), then
        // two slow seconds, a fast one, a slow one, and fast ones.
        let mut timed: Vec<(u32, u32)> = (0..10_000).step_by(10).map(|t| (t, 5_000)).collect();
        timed.extend((10_000..12_000).step_by(10).map(|t| (t, 900_000)));
        for (second, us) in [(12, 300_000), (13, 300_000), (14, 5_000), (15, 200_000)] {
            timed.extend(
                (second * 1000..second * 1000 + 1000)
                    .step_by(10)
                    .map(|t| (t, us)),
            );
        }
        timed.extend((16_000..20_000).step_by(10).map(|t| (t, 5_000)));
        let r = burst_latency(&timed, 10_000, Some(12_000));
        assert_eq!(r.p99_before, Some(ms(5)));
        assert_eq!(r.p99_during, Some(ms(900)));
        assert_eq!(r.p99_after, Some(ms(300)));
        // The bar is 50 ms (twice 5 ms is less); the slow second at 15 s
        // counts, so normal from 16 s: 4 s after the burst.
        assert_eq!(r.normal_after, Some(ms(4_000)));
        // Never back within the samples.
        timed.push((20_500, 400_000));
        assert_eq!(
            burst_latency(&timed, 10_000, Some(12_000)).normal_after,
            None
        );
        // Not over within the window: nothing after it.
        let r = burst_latency(&timed, 10_000, None);
        assert_eq!((r.p99_after, r.normal_after), (None, None));
    }
}
