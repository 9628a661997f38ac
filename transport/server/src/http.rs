//! The HTTP port, for people and machines: `/metrics` (Prometheus text),
//! `/healthz`, `/readyz`, and whatever routes the binary merges in (the
//! page, see [`HttpService::merge`]).
//!
//! HTTP/1.1 only, served by hyper (through axum's router) with limits that a
//! malformed or slow client cannot get around:
//! - the request head must arrive within [`HttpConfig::header_read_timeout`]
//!   (also an idle keep-alive connection's wait for its next request), or the
//!   connection is closed: a slowloris holds a connection for that long at
//!   most, however it trickles its bytes (hyper sets the deadline when it
//!   starts reading a head and clears it only once a whole head is parsed);
//! - a response the client does not take (it stopped reading) fails its
//!   connection after [`HttpConfig::send_timeout`];
//! - the head is at most [`HttpConfig::max_head_bytes`] (431 beyond);
//! - at most [`HttpConfig::max_connections`] connections at once, and at most
//!   [`HttpConfig::max_connections_per_address`] from one client address (an
//!   IPv6 client counts by its /64, which one host usually holds whole): one
//!   more is closed at once, and the ones held are freed by the timeouts
//!   above. One address alone cannot fill the port, so a probe from another
//!   one (a load balancer's, a kubelet's) still gets its answer;
//! - no request bodies (413 and the connection closed);
//! - a malformed request gets a 400 from hyper and its connection is closed.
//!
//! Nothing here runs on the presence server's loop: [`HttpService::spawn`]
//! serves from a thread of its own with its own single-threaded runtime, so a
//! flood of HTTP work competes for a core, not for the loop's turn on its
//! runtime (the server runs on a current-thread runtime: a task sharing it
//! would delay datagrams by however long each of its polls takes). The loop
//! is asked one question at a time (`/metrics`, `/healthz`): the port adds
//! at most one message to the loop's control queue.

use crate::Monitor;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Semaphore};
use tower::ServiceExt;
use tracing::{debug, warn};

/// The page's routes are built with axum (see [`HttpService::merge`]):
/// re-exported so that they use the same version.
pub use axum;
pub use axum::Router;

/// The Prometheus text format's content type.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// hyper's smallest read buffer: the head cap is enforced separately.
const MIN_READ_BUFFER: usize = 8192;

/// Limits of the HTTP port. Start from [`HttpConfig::default`] and change
/// what differs with the setters.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct HttpConfig {
    header_read_timeout: Duration,
    send_timeout: Duration,
    max_head_bytes: usize,
    max_connections: usize,
    max_connections_per_address: usize,
    loop_timeout: Duration,
}

impl Default for HttpConfig {
    /// Head within 5 s, responses taken within 10 s, 8 KiB of head, 256
    /// connections of which 16 from one address (a browser opens at most 6
    /// to one host), the loop's answer within 2 s.
    fn default() -> HttpConfig {
        HttpConfig {
            header_read_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(10),
            max_head_bytes: 8 * 1024,
            max_connections: 256,
            max_connections_per_address: 16,
            loop_timeout: Duration::from_secs(2),
        }
    }
}

impl HttpConfig {
    /// How long a connection may take to send a request head (request line
    /// and headers), counted from its accept or from its previous response.
    pub fn header_read_timeout(mut self, timeout: Duration) -> HttpConfig {
        self.header_read_timeout = timeout;
        self
    }

    /// How long a write to a connection may wait for the client to take
    /// something (its receive window full: it stopped reading) before the
    /// connection is closed.
    pub fn send_timeout(mut self, timeout: Duration) -> HttpConfig {
        self.send_timeout = timeout;
        self
    }

    /// The largest request head (request line and headers), in bytes.
    pub fn max_head_bytes(mut self, bytes: usize) -> HttpConfig {
        self.max_head_bytes = bytes.max(1);
        self
    }

    /// Connections served at once; one more is closed at once.
    pub fn max_connections(mut self, connections: usize) -> HttpConfig {
        self.max_connections = connections.max(1);
        self
    }

    /// Connections served at once from one client address (an IPv4
    /// address, or an IPv6 /64); one more from it is closed at once.
    pub fn max_connections_per_address(mut self, connections: usize) -> HttpConfig {
        self.max_connections_per_address = connections.max(1);
        self
    }

    /// How long `/metrics` and `/healthz` wait for the server's loop (and
    /// for the question another request is asking it) before a 503.
    pub fn loop_timeout(mut self, timeout: Duration) -> HttpConfig {
        self.loop_timeout = timeout;
        self
    }
}

/// What the handlers share.
#[derive(Clone)]
struct Ctx {
    monitor: Monitor,
    /// One question to the server's loop at a time.
    asking: Arc<Semaphore>,
    loop_timeout: Duration,
    more_metrics: Option<MoreMetrics>,
}

/// Metrics the server does not hold (e.g. a cluster node's), appended to
/// `/metrics` as Prometheus text.
pub type MoreMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// The HTTP port of one server: its routes and limits.
pub struct HttpService {
    monitor: Monitor,
    config: HttpConfig,
    extra: Router,
    more_metrics: Option<MoreMetrics>,
}

impl HttpService {
    /// `/metrics`, `/healthz` and `/readyz` of the server `monitor` reads,
    /// with the default limits.
    pub fn new(monitor: Monitor) -> HttpService {
        HttpService {
            monitor,
            config: HttpConfig::default(),
            extra: Router::new(),
            more_metrics: None,
        }
    }

    pub fn config(mut self, config: HttpConfig) -> HttpService {
        self.config = config;
        self
    }

    /// Appends what `render` gives to every `/metrics` answer.
    pub fn more_metrics(mut self, render: MoreMetrics) -> HttpService {
        self.more_metrics = Some(render);
        self
    }

    /// The place for the page: `routes` (e.g. `/` and its assets) are
    /// served beside `/metrics`, `/healthz` and `/readyz`, under the same
    /// limits. They must not take those three paths, and must not set a
    /// fallback (the port's 404 is the fallback).
    pub fn merge(mut self, routes: Router) -> HttpService {
        self.extra = self.extra.merge(routes);
        self
    }

    /// Every route, with the 404 fallback.
    fn router(&self) -> Router {
        let ctx = Ctx {
            monitor: self.monitor.clone(),
            asking: Arc::new(Semaphore::new(1)),
            loop_timeout: self.config.loop_timeout,
            more_metrics: self.more_metrics.clone(),
        };
        // `get` answers HEAD too (without the body), and 405 with an
        // `Allow` header to other methods.
        Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(ctx)
            .merge(self.extra.clone())
            .fallback(not_found)
    }

    /// Serves `listener` on the current runtime until the future is dropped.
    /// [`HttpService::spawn`] runs it on a thread of its own.
    pub async fn serve(self, listener: TcpListener) {
        let router = self.router();
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(self.config.header_read_timeout)
            .max_header_size(self.config.max_head_bytes)
            .max_buf_size(self.config.max_head_bytes.max(MIN_READ_BUFFER));
        let http = Arc::new(http);
        let slots = Arc::new(Semaphore::new(self.config.max_connections));
        let per_address = PerAddress::new(self.config.max_connections_per_address);
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, most likely: wait for some to be
                    // freed rather than spin.
                    warn!(error = %e, "the HTTP port cannot accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Some(held) = per_address.take(peer.ip()) else {
                debug!(%peer, "HTTP connection refused: too many from its address");
                refuse(stream, BUSY_ADDRESS);
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                debug!(%peer, "HTTP connection refused: too many at once");
                refuse(stream, BUSY);
                continue;
            };
            let (router, http) = (router.clone(), http.clone());
            let stream = SendTimeout::new(stream, self.config.send_timeout);
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |request| answer(router.clone(), request));
                if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
                    debug!(%peer, error = %e, "HTTP connection ended");
                }
                drop((slot, held));
            });
        }
    }

    /// Serves `listener` from a new thread with its own single-threaded
    /// runtime, until the returned handle is stopped or dropped.
    pub fn spawn(self, listener: std::net::TcpListener) -> std::io::Result<HttpThread> {
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("greendot-http".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(e) => {
                            warn!(error = %e, "the HTTP port cannot start");
                            return;
                        }
                    };
                    tokio::select! {
                        () = self.serve(listener) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime ends the connections' tasks.
            })?;
        Ok(HttpThread {
            local_addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

/// The HTTP port's thread (see [`HttpService::spawn`]); dropping it stops
/// the port without waiting.
pub struct HttpThread {
    local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpThread {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every connection and waits for the thread.
    pub fn stop(mut self) {
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for HttpThread {
    fn drop(&mut self) {
        // Dropping the sender ends the thread's serve loop.
        self.stop.take();
    }
}

/// A connection whose writes fail once the client has taken nothing for
/// `limit`, so that a client that stops reading frees its slot (the header
/// read timeout does not run while a response waits to be sent).
struct SendTimeout {
    stream: TcpStream,
    limit: Duration,
    /// Armed when a write finds the socket full; disarmed by any progress.
    blocked: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl SendTimeout {
    fn new(stream: TcpStream, limit: Duration) -> SendTimeout {
        SendTimeout {
            stream,
            limit,
            blocked: None,
        }
    }

    fn progress<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.blocked = None;
            return polled;
        }
        let limit = self.limit;
        let blocked = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match blocked.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took nothing within the send timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for SendTimeout {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for SendTimeout {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.progress(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.progress(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_flush(cx);
        this.progress(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_shutdown(cx);
        this.progress(cx, polled)
    }
}

const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n";
const BUSY_ADDRESS: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 39\r\nConnection: close\r\n\r\ntoo many connections from your address\n";

/// Closes a connection beyond a cap: a 503 if its send buffer takes it at
/// once (it always has room on a new connection), never a wait.
fn refuse(stream: TcpStream, answer: &[u8]) {
    let _ = stream.try_write(answer);
}

/// Connections held per client address. Only addresses with a connection
/// are kept, so it holds at most `max_connections` entries.
#[derive(Clone)]
struct PerAddress {
    limit: usize,
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl PerAddress {
    fn new(limit: usize) -> PerAddress {
        PerAddress {
            limit,
            held: Arc::default(),
        }
    }

    /// A connection's share of its address, or `None` past the limit.
    fn take(&self, peer: IpAddr) -> Option<AddressSlot> {
        let address = address_key(peer);
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let count = held.entry(address).or_insert(0);
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            owner: self.clone(),
            address,
        })
    }
}

/// One connection's share of its address, given back when dropped.
struct AddressSlot {
    owner: PerAddress,
    address: IpAddr,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut held = self.owner.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = held.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.address);
            }
        }
    }
}

/// What the per-address cap counts by: an IPv4 address (also when mapped
/// into IPv6), or an IPv6 address's /64 (a host or a home network is
/// usually given a whole /64, so counting single addresses would not
/// limit it).
fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
    }
}

/// One request: refused if it has a body, else routed.
async fn answer(router: Router, request: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    if has_body(&request) {
        // hyper closes the connection: the body was not read.
        let mut response = (
            StatusCode::PAYLOAD_TOO_LARGE,
            "request bodies are not accepted\n",
        )
            .into_response();
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Ok(response);
    }
    router.oneshot(request.map(Body::new)).await
}

fn has_body<B>(request: &Request<B>) -> bool {
    let headers = request.headers();
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|len| len.as_bytes() != b"0")
}

/// Asks the server's loop for its metrics: one question at a time, all
/// within the loop timeout. `None` when it does not answer in time or has
/// stopped.
async fn ask(ctx: &Ctx) -> Option<crate::MetricsSnapshot> {
    let ask = async {
        let _turn = ctx.asking.acquire().await.ok()?;
        ctx.monitor.metrics().await
    };
    tokio::time::timeout(ctx.loop_timeout, ask)
        .await
        .ok()
        .flatten()
}

async fn metrics(State(ctx): State<Ctx>) -> Response<Body> {
    match ask(&ctx).await {
        Some(snapshot) => {
            let mut body = snapshot.render();
            if let Some(more) = &ctx.more_metrics {
                body.push_str(&more());
            }
            ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], body).into_response()
        }
        None => loop_silent(&ctx),
    }
}

/// 200 while the server's loop answers.
async fn healthz(State(ctx): State<Ctx>) -> Response<Body> {
    match ask(&ctx).await {
        Some(_) => (StatusCode::OK, "ok\n").into_response(),
        None => loop_silent(&ctx),
    }
}

/// 200 while the server accepts connections; 503 once it drains or stops.
async fn readyz(State(ctx): State<Ctx>) -> Response<Body> {
    if ctx.monitor.accepting() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the server is draining or stopped\n",
        )
            .into_response()
    }
}

fn loop_silent(ctx: &Ctx) -> Response<Body> {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "the server's loop did not answer within {:?}: stopping, stopped or overloaded\n",
            ctx.loop_timeout
        ),
    )
        .into_response()
}

async fn not_found() -> Response<Body> {
    (
        StatusCode::NOT_FOUND,
        "not found: this port serves /metrics (Prometheus), /healthz and /readyz\n",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_count_by_ipv4_address_and_ipv6_64() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(address_key(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(address_key(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(
            address_key(ip("2001:db8:1:2:aaaa::1")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            address_key(ip("2001:db8:1:2:ffff:ffff:ffff:ffff")),
            ip("2001:db8:1:2::")
        );
        assert_ne!(address_key(ip("2001:db8:1:3::1")), ip("2001:db8:1:2::"));
    }

    #[test]
    fn an_address_holds_at_most_its_limit_and_gets_it_back() {
        let caps = PerAddress::new(2);
        let a = "127.0.0.1".parse().unwrap();
        let b = "127.0.0.2".parse().unwrap();
        let first = caps.take(a).expect("first");
        let second = caps.take(a).expect("second");
        assert!(caps.take(a).is_none(), "a third from the same address");
        let other = caps.take(b).expect("another address has its own");
        drop(second);
        let again = caps.take(a).expect("a freed share is taken again");
        drop((first, again, other));
        assert!(
            caps.held.lock().unwrap().is_empty(),
            "nothing kept once closed"
        );
    }
}
