//! Shared helpers of the end-to-end tests in `tests/tests/`: a server on
//! loopback port 0 with small, quick settings; clients; an event recorder that
//! waits for events with deadlines (never a fixed sleep as synchronisation).

use greendot_client::quinn;
use greendot_client::{Client, ClientConfig, ClientError, Event, Reconnect, Updates};
use greendot_core::{KindConfig, Millis, Presence};
use greendot_proto::{self as proto, CloseCode, Kind, ServerFrame};
use greendot_server::token::{Claims, WatchClaim};
use greendot_server::{Server, ServerConfig};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

pub use {greendot_client, greendot_proto, greendot_server};

pub mod ffi;

pub const SECRET: &[u8] = b"greendot end-to-end test secret";

/// Settings small enough for quick tests, large enough for a loaded 2-core
/// machine: idle timeout 1.5 s (keep-alive 300 ms), grace 2 s, debounce
/// 150 ms, batches every 1.5 s, heartbeat timeout 4 s.
pub fn quick_config() -> ServerConfig {
    let mut config = ServerConfig::new(SECRET);
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.keep_alive = Duration::from_millis(300);
    config.idle_timeout = Duration::from_millis(1500);
    config.core.debounce = Millis(150);
    config.core.batch_interval = Millis(1500);
    config.core.kinds = [KindConfig {
        heartbeat_timeout: Millis(4000),
        grace: Millis(2000),
    }; 4];
    config.token_leeway = Duration::ZERO;
    // The one-node suite runs on the cluster path too, as a cluster of one
    // (docs/cluster.md "A cluster of one").
    config.cluster_of_one = std::env::var_os("GREENDOT_TEST_CLUSTER_OF_ONE").is_some();
    config
}

/// A server on 127.0.0.1, port 0.
pub struct TestServer {
    pub server: Server,
}

impl TestServer {
    /// Starts a server with [`quick_config`] changed by `tweak`. Call inside a
    /// tokio runtime.
    pub fn start(tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let mut config = quick_config();
        tweak(&mut config);
        let server = Server::bind(config).expect("server binds");
        TestServer { server }
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn config(&self) -> &ServerConfig {
        self.server.config()
    }

    pub fn token(&self, user: &str, device: &str, kind: Kind, watch: WatchClaim) -> String {
        self.server
            .mint(&Claims::new(
                user,
                device,
                kind,
                watch,
                Duration::from_secs(600),
            ))
            .expect("token")
    }

    pub fn service_token(&self, user: &str) -> String {
        let claims = Claims::new(
            user,
            "backend",
            Kind::Other,
            WatchClaim::all(),
            Duration::from_secs(600),
        )
        .service();
        self.server.mint(&claims).expect("token")
    }

    /// A client configuration matching the server's quick timers.
    pub fn client_config(&self, token: String) -> ClientConfig {
        let mut config =
            ClientConfig::new(self.addr(), vec![self.server.certificate().clone()], token);
        config.bind = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        // The fallback goes to this server's WebSocket listener, if it has
        // one (the default, the QUIC port number over TCP, may be another
        // test's listener).
        config.websocket = self.server.websocket_addr().into();
        config.keep_alive = self.config().keep_alive;
        config.idle_timeout = self.config().idle_timeout;
        config.reconnect = Some(Reconnect::new(
            Duration::from_millis(50),
            Duration::from_millis(400),
            Some(Duration::from_secs(30)),
        ));
        config
    }

    /// Connects `user`/`device` allowed to watch anybody.
    pub async fn connect(&self, user: &str, device: &str, kind: Kind) -> (Client, Recorder) {
        let token = self.token(user, device, kind, WatchClaim::all());
        self.connect_with(self.client_config(token)).await
    }

    pub async fn connect_with(&self, config: ClientConfig) -> (Client, Recorder) {
        let (client, updates) = Client::connect(config).await.expect("client connects");
        (client, Recorder::new(updates))
    }

    /// The worst time from a client's death to its offline being published:
    /// idle timeout (+ one keep-alive) + grace + debounce.
    pub fn death_to_offline(&self) -> Duration {
        let c = self.config();
        let grace = c.core.kinds.iter().map(|k| k.grace.0).max().unwrap_or(0);
        c.idle_timeout
            + c.keep_alive
            + Duration::from_millis(grace)
            + Duration::from_millis(c.core.debounce.0)
    }
}

/// Generous slack for a loaded machine.
pub const SLACK: Duration = Duration::from_secs(4);

/// Records a client's events with their arrival times.
pub struct Recorder {
    updates: Updates,
    pub seen: Vec<(Instant, Event)>,
}

impl Recorder {
    pub fn new(updates: Updates) -> Recorder {
        Recorder {
            updates,
            seen: Vec::new(),
        }
    }

    /// Waits until an event matching `pred` arrives (recording every event on
    /// the way); `None` at the deadline.
    pub async fn wait_for(
        &mut self,
        within: Duration,
        mut pred: impl FnMut(&Event) -> bool,
    ) -> Option<(Instant, Event)> {
        let deadline = Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.updates.next()).await {
                Ok(Some(event)) => {
                    let at = Instant::now();
                    self.seen.push((at, event.clone()));
                    if pred(&event) {
                        return Some((at, event));
                    }
                }
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// Waits until `target` is seen in a state matching `pred`.
    pub async fn wait_presence(
        &mut self,
        target: &str,
        within: Duration,
        mut pred: impl FnMut(&Presence) -> bool,
    ) -> Option<(Instant, Presence)> {
        self.wait_for(within, |e| {
            matches!(e, Event::Presence { target: t, presence, .. } if t == target && pred(presence))
        })
        .await
        .and_then(|(at, e)| match e {
            Event::Presence { presence, .. } => Some((at, presence)),
            _ => None,
        })
    }

    /// Records what already arrived, then forgets everything recorded.
    pub fn reset(&mut self) {
        self.drain();
        self.seen.clear();
    }

    /// Records whatever already arrived, without waiting.
    pub fn drain(&mut self) {
        while let Some(event) = self.updates.try_next() {
            self.seen.push((Instant::now(), event));
        }
    }

    /// Recorded presence events of `target`.
    pub fn presences_of<'a>(&'a self, target: &'a str) -> impl Iterator<Item = &'a Presence> {
        self.seen.iter().filter_map(move |(_, e)| match e {
            Event::Presence {
                target: t,
                presence,
                ..
            } if t == target => Some(presence),
            _ => None,
        })
    }

    /// How many recorded events showed `target` offline.
    pub fn offline_count(&self, target: &str) -> usize {
        self.presences_of(target).filter(|p| !p.online).count()
    }

    /// Recorded connection-level events (disconnects, reconnects, close).
    pub fn connection_events(&self) -> Vec<&Event> {
        self.seen
            .iter()
            .map(|(_, e)| e)
            .filter(|e| !matches!(e, Event::Presence { .. }))
            .collect()
    }
}

/// A client that runs on its own thread and runtime, so that it can die
/// without closing anything: `kill` stops its runtime mid-flight, like a
/// phone whose battery died.
pub struct Doomed {
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Doomed {
    pub async fn spawn(config: ClientConfig) -> Result<Doomed, ClientError> {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (kill_tx, kill_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            let client = rt.block_on(async {
                match Client::connect(config).await {
                    Ok((client, _updates)) => {
                        let _ = ready_tx.send(Ok(()));
                        let _ = kill_rx.await;
                        Some(client)
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        None
                    }
                }
            });
            // Never close: the handle is leaked and the runtime stops without
            // running another poll, so no close frame is ever sent.
            std::mem::forget(client);
            rt.shutdown_background();
        });
        match ready_rx.await {
            Ok(Ok(())) => Ok(Doomed {
                kill: Some(kill_tx),
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ClientError::Closed),
        }
    }

    /// Dies without a word.
    pub fn kill(mut self) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A bare QUIC connection to the server, for speaking bad protocol on purpose.
pub async fn raw_connect(
    server: &TestServer,
    alpn: &[u8],
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    let crypto = greendot_client::tls::client_crypto(&[server.server.certificate().clone()], alpn)
        .map_err(|e| e.to_string())?;
    let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0)))
        .map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = endpoint
        .connect(server.addr(), "localhost")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    Ok((endpoint, conn))
}

/// What the server did with bytes sent on a fresh control stream: the frames
/// it answered and how it closed the connection.
pub struct RawOutcome {
    pub frames: Vec<ServerFrame>,
    pub close: Option<CloseCode>,
    pub reason: String,
}

/// Sends `bytes` on a new control stream and waits (up to `within`) for the
/// server's answer and close.
pub async fn raw_exchange(conn: &quinn::Connection, bytes: &[u8], within: Duration) -> RawOutcome {
    let exchange = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(bytes).await.map_err(|e| e.to_string())?;
        let mut reader = proto::FrameReader::new(1 << 20);
        let mut frames = Vec::new();
        while let Ok(Some(payload)) = proto::codec::read_frame(&mut recv, &mut reader).await {
            match proto::decode::<ServerFrame>(&payload) {
                Ok(frame) => frames.push(frame),
                Err(_) => break,
            }
        }
        Ok::<_, String>(frames)
    };
    let frames = tokio::time::timeout(within, exchange)
        .await
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or_default();
    let (close, reason) = match tokio::time::timeout(within, conn.closed()).await {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => (
            CloseCode::from_code(c.error_code.into_inner()),
            String::from_utf8_lossy(&c.reason).into_owned(),
        ),
        Ok(other) => (None, other.to_string()),
        Err(_) => (None, "still open".into()),
    };
    RawOutcome {
        frames,
        close,
        reason,
    }
}

/// Waits until `cond` holds, polling every 20 ms, up to `within`.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a [`Relay`] forwarded: datagrams are numbered in the order they
/// went through, either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Datagrams forwarded so far, both ways.
    pub forwarded: u64,
    /// The number of the last one from the client (0: none yet).
    pub last_from_client: u64,
    /// The number of the last one from the server (0: none yet).
    pub last_from_server: u64,
    /// Datagrams from the client forwarded on the current path (since the
    /// last [`Relay::new_path`]).
    pub from_client_on_path: u64,
}

impl Traffic {
    fn forward(&mut self, from_client: bool) {
        self.forwarded += 1;
        if from_client {
            self.last_from_client = self.forwarded;
            self.from_client_on_path += 1;
        } else {
            self.last_from_server = self.forwarded;
        }
    }
}

/// Forwards datagrams between one client and the server; `cut` drops them
/// all; `new_path` moves the relay's server side to a new socket, so that
/// the server sees the client at a new address while the client's own
/// socket stays the same (a NAT rebinding, a phone on a new network).
pub struct Relay {
    pub addr: SocketAddr,
    server: SocketAddr,
    cut: Arc<AtomicBool>,
    traffic: Arc<tokio::sync::watch::Sender<Traffic>>,
    front: Arc<tokio::net::UdpSocket>,
    back: Arc<std::sync::Mutex<Arc<tokio::net::UdpSocket>>>,
    client: Arc<std::sync::Mutex<Option<SocketAddr>>>,
    up: tokio::task::JoinHandle<()>,
    down: std::sync::Mutex<tokio::task::JoinHandle<()>>,
}

impl Relay {
    pub async fn start(server: SocketAddr) -> Relay {
        let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        back.connect(server).await.unwrap();
        let addr = front.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let client = Arc::new(std::sync::Mutex::new(None::<SocketAddr>));
        let back_slot = Arc::new(std::sync::Mutex::new(back.clone()));
        let traffic = Arc::new(tokio::sync::watch::Sender::new(Traffic::default()));
        let up = {
            let (front, back, cut, client, traffic) = (
                front.clone(),
                back_slot.clone(),
                cut.clone(),
                client.clone(),
                traffic.clone(),
            );
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok((n, from)) = front.recv_from(&mut buf).await {
                    *client.lock().unwrap() = Some(from);
                    if !cut.load(Ordering::Relaxed) {
                        // Counted under the path's lock, so that a datagram
                        // is counted on the path it is sent on.
                        let back = {
                            let back = back.lock().unwrap();
                            traffic.send_modify(|t| t.forward(true));
                            back.clone()
                        };
                        let _ = back.send(&buf[..n]).await;
                    }
                }
            })
        };
        let down = Relay::spawn_down(
            front.clone(),
            back,
            cut.clone(),
            client.clone(),
            traffic.clone(),
        );
        Relay {
            addr,
            server,
            cut,
            traffic,
            front,
            back: back_slot,
            client,
            up,
            down: std::sync::Mutex::new(down),
        }
    }

    fn spawn_down(
        front: Arc<tokio::net::UdpSocket>,
        back: Arc<tokio::net::UdpSocket>,
        cut: Arc<AtomicBool>,
        client: Arc<std::sync::Mutex<Option<SocketAddr>>>,
        traffic: Arc<tokio::sync::watch::Sender<Traffic>>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = back.recv(&mut buf).await {
                let to = *client.lock().unwrap();
                if let (false, Some(to)) = (cut.load(Ordering::Relaxed), to) {
                    traffic.send_modify(|t| t.forward(false));
                    let _ = front.send_to(&buf[..n], to).await;
                }
            }
        })
    }

    pub fn cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::Relaxed);
    }

    /// The server side moves to a new socket (a new address for the
    /// server); the old one is closed, so what the server sends to it is
    /// lost. Returns the new address.
    pub async fn new_path(&self) -> SocketAddr {
        let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        back.connect(self.server).await.unwrap();
        let addr = back.local_addr().unwrap();
        // The old path stops carrying anything to the client before the
        // new one starts: what the server still sends there is lost.
        self.down.lock().unwrap().abort();
        {
            let mut path = self.back.lock().unwrap();
            *path = back.clone();
            self.traffic.send_modify(|t| t.from_client_on_path = 0);
        }
        let down = Relay::spawn_down(
            self.front.clone(),
            back,
            self.cut.clone(),
            self.client.clone(),
            self.traffic.clone(),
        );
        *self.down.lock().unwrap() = down;
        addr
    }

    /// What has been forwarded so far.
    pub fn traffic(&self) -> Traffic {
        *self.traffic.borrow()
    }

    /// Waits (up to `within`) until the client has answered everything the
    /// server sent: the last datagram through the relay came from the
    /// client (its acknowledgement of the server's last one). Returns what
    /// had been forwarded then; panics past `within`.
    pub async fn client_answered_last(&self, within: Duration) -> Traffic {
        let mut watch = self.traffic.subscribe();
        let seen = tokio::time::timeout(
            within,
            watch.wait_for(|t| t.last_from_client > t.last_from_server),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the client did not answer the server's last datagram within {within:?}: {:?}",
                self.traffic()
            )
        });
        // Copied out before `watch` goes: the borrow it holds ends here.
        let traffic: Traffic = *seen.expect("the relay lives");
        traffic
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.up.abort();
        self.down.lock().unwrap().abort();
    }
}

/// A TCP proxy in front of a server's WebSocket listener: `cut` resets
/// every connection it carries (as a dying network or a NAT would), `freeze`
/// stops forwarding on them without closing anything (a link that went
/// dark: neither side hears of it). New connections are forwarded normally.
pub struct TcpProxy {
    pub addr: SocketAddr,
    conns: Arc<std::sync::Mutex<Vec<ProxiedConn>>>,
    accept: tokio::task::JoinHandle<()>,
}

struct ProxiedConn {
    frozen: Arc<AtomicBool>,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = Arc::new(std::sync::Mutex::new(Vec::<ProxiedConn>::new()));
        let accept = {
            let conns = conns.clone();
            tokio::spawn(async move {
                while let Ok((front, _)) = listener.accept().await {
                    let Ok(back) = tokio::net::TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let _ = (front.set_nodelay(true), back.set_nodelay(true));
                    let frozen = Arc::new(AtomicBool::new(false));
                    let (front_r, front_w) = front.into_split();
                    let (back_r, back_w) = back.into_split();
                    let tasks = [
                        tokio::spawn(pump(front_r, back_w, frozen.clone())),
                        tokio::spawn(pump(back_r, front_w, frozen.clone())),
                    ];
                    conns.lock().unwrap().push(ProxiedConn { frozen, tasks });
                }
            })
        };
        TcpProxy {
            addr,
            conns,
            accept,
        }
    }

    /// Drops every connection carried so far (both sides see it end).
    pub fn cut(&self) {
        for conn in self.conns.lock().unwrap().drain(..) {
            conn.tasks.iter().for_each(|t| t.abort());
        }
    }

    /// Stops forwarding on every connection carried so far, silently.
    pub fn freeze(&self) {
        for conn in self.conns.lock().unwrap().iter() {
            conn.frozen.store(true, Ordering::SeqCst);
        }
    }

    /// Connections carried so far and not cut.
    pub fn connections(&self) -> usize {
        self.conns.lock().unwrap().len()
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Copies one direction; once frozen it holds what it read and both
/// sockets stay open.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await.unwrap_or(0);
        // Frozen, even the end of the other side is not passed on.
        if n == 0 && !frozen.load(Ordering::SeqCst) {
            return;
        }
        if frozen.load(Ordering::SeqCst) {
            // Keep both halves (and so both sockets) open, silently.
            let _keep = (from, to);
            std::future::pending::<()>().await;
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
