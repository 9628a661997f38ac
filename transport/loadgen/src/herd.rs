//! Herds: many sessions coming back together (a server restart, a mass
//! reconnect), and watchers that count who they saw go offline meanwhile.

use crate::device::{call, endpoint_at, CONNECT_TIMEOUT};
use greendot_proto::{
    self as proto, codec::read_frame, encode_frame, Answer, CloseCode, FrameReader, Hello, Push,
    Request, ServerFrame, Tier,
};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use rustls::pki_types::CertificateDer;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};

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
