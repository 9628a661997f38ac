//! One simulated QUIC device of [`run`](super::run): connect, churn, reconnect.

use super::{Ctx, LoadOptions, PHASE_MEASURE, PHASE_RAMP, PHASE_STOP};
use greendot_client::tls;
use greendot_proto::{
    self as proto, codec::read_frame, encode_frame, Answer, CloseCode, FrameReader, Hello, Request,
    RequestFrame, ServerFrame,
};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

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
pub(crate) const CONNECT_ATTEMPTS: usize = 8;
/// How long one attempt (handshake, hello, subscribe) may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

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
pub(crate) async fn call(
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
pub(crate) async fn device(
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
        .filter(|b| i < b.sessions && b.arrivals_per_sec.is_none())
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

/// A new device of a [`Burst`](crate::Burst) step: connects at `at`
/// (retrying with the client library's backoff while the window lasts),
/// then holds its connection until the stop.
pub(crate) async fn newcomer(
    ctx: Arc<Ctx>,
    endpoint: quinn::Endpoint,
    i: usize,
    at: tokio::time::Instant,
    mut phase: watch::Receiver<u8>,
) {
    let Some(token) = ctx.token(i) else {
        ctx.burst_failed.fetch_add(1, Relaxed);
        return;
    };
    tokio::select! {
        _ = tokio::time::sleep_until(at) => {}
        _ = phase.wait_for(|p| *p != PHASE_MEASURE) => {
            ctx.burst_failed.fetch_add(1, Relaxed);
            return;
        }
    }
    let mut rand = device_rng(i);
    let mut backoff = Backoff::new(&mut rand, phase.clone(), PHASE_MEASURE);
    let live = loop {
        match attempt(&ctx, &endpoint, &token, i, None).await {
            Ok(live) => break Some(live),
            Err(_) if backoff.wait().await => continue,
            Err(_) => break None,
        }
    };
    let Some(live) = live else {
        ctx.burst_failed.fetch_add(1, Relaxed);
        return;
    };
    ctx.burst_back.fetch_add(1, Relaxed);
    tokio::select! {
        _ = phase.wait_for(|p| *p == PHASE_STOP) => {}
        _ = live.conn.closed() => {}
    }
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
pub(crate) fn device_rng(i: usize) -> impl FnMut() -> f64 {
    let mut rng = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        (rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub(crate) fn client_endpoint(opts: &LoadOptions, index: usize) -> Result<quinn::Endpoint, String> {
    let crypto = tls::client_crypto(&opts.roots, proto::ALPN).map_err(|e| e.to_string())?;
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(opts.keep_alive);
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
pub(crate) fn endpoint_at(server: SocketAddr, index: usize) -> Result<quinn::Endpoint, String> {
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
