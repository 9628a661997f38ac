//! The WebSocket binding's I/O (docs/protocol.md, "WebSocket over TLS"): a
//! TCP listener, and one task per connection that does the TLS handshake,
//! the upgrade (path `/greendot`, subprotocol `greendot.v1`) and the
//! WebSocket framing, and otherwise only shuttles whole messages between
//! its socket and the server's loop ([`WsEvent`]s in, commands out). The
//! session layer is the state's (`ws`).
//!
//! It runs on a thread of its own with its own runtime: TLS handshakes and
//! upgrades never take the server loop's turn.
//!
//! Before its hello a connection is the door's ([`WsGate`]): admitted
//! within the admission rate, the cap on connections waiting for their
//! hello and the cap per address (past them it is dropped at once); TLS,
//! upgrade and its first message within one `hello_timeout` from the
//! accept; at most `max_hello` bytes of that message and
//! [`UPGRADE_ALLOWANCE`] more for the upgrade read. It takes no slot of the
//! server's: the state hears of it (`Opened`) with its first message.
//!
//! After it: TCP connections held at most `max_connections` + the pending
//! cap; a message over `max_frame` is refused by tungstenite from its
//! header, before it is buffered; a task reads a message only with read
//! credit (`ws::read_credit`), given back as the session reads; what the
//! state hands a task to send is bounded by its send window
//! (`ws::SEND_WINDOW`). The events channel to the loop is bounded: a task
//! waits for room, and reads nothing meanwhile.

use super::ws::{read_credit, WsId, WsMessage};
use super::ws_gate::{over_budget, Budgeted, Pending, WsGate, WsShed, UNLIMITED};
use futures_util::{SinkExt, StreamExt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;
use tracing::debug;

/// The upgrade's path.
pub const PATH: &str = "/greendot";
/// The subprotocol a client must offer.
pub const SUBPROTOCOL: &str = "greendot.v1";
/// tungstenite's read buffer per connection.
const WS_READ_BUFFER: usize = 4 * 1024;
/// Bytes a connection may send for its upgrade request, besides its hello
/// (a browser's request with its cookies fits).
pub const UPGRADE_ALLOWANCE: usize = 16 * 1024;
/// Events from every connection's task waiting for the loop.
const EVENTS_CAP: usize = 4096;
/// How long a close may take to go out before the connection is dropped.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// The kernel's send buffer per WebSocket socket: presence messages are
/// small, and a client that does not read must fill the server's own
/// bounded queues (and be closed `Overloaded`), not gigabytes of kernel
/// memory across many sockets.
const SOCKET_SEND_BUFFER: usize = 64 * 1024;

/// What a connection's task tells the loop.
pub(super) enum WsEvent {
    Opened {
        id: WsId,
        remote: SocketAddr,
        handle: WsHandle,
    },
    Message {
        id: WsId,
        message: WsMessage,
    },
    Written {
        id: WsId,
        len: usize,
    },
    Closed {
        id: WsId,
        code: Option<u16>,
    },
}

/// What the loop tells a connection's task.
enum Command {
    Send(Vec<u8>),
    Ping,
    Close(Option<u16>, String),
}

/// The loop's end of one connection.
pub(super) struct WsHandle {
    commands: mpsc::UnboundedSender<Command>,
    credit: Arc<Semaphore>,
    closing: Arc<Notify>,
}

/// The listener and the connections' handles, owned by the driver.
pub(super) struct WsIo {
    pub events: mpsc::Receiver<WsEvent>,
    conns: HashMap<WsId, WsHandle>,
    /// Dropped with this: the listener stops, and the thread ends once the
    /// connections' tasks did (their command channels close with `conns`)
    /// or after a linger.
    _stop: oneshot::Sender<()>,
}

/// What a connection's task needs to know.
#[derive(Clone)]
pub(super) struct WsSettings {
    pub tls: Arc<rustls::ServerConfig>,
    pub max_frame: usize,
    /// The largest first message (the hello).
    pub max_hello: usize,
    /// From the accept to the first message.
    pub hello_timeout: Duration,
    pub max_connections: usize,
    /// Connections waiting for their hello at most (see [`WsGate`]).
    pub max_pending: usize,
    pub gate: Arc<WsGate>,
}

impl WsIo {
    /// Starts accepting on `listener` from a thread of its own.
    pub(super) fn start(
        listener: std::net::TcpListener,
        settings: WsSettings,
    ) -> std::io::Result<WsIo> {
        let (tx, events) = mpsc::channel(EVENTS_CAP);
        let (stop, stopped) = oneshot::channel();
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("greendot-websocket".into())
            .spawn(move || runtime.block_on(serve(listener, settings, tx, stopped)))?;
        Ok(WsIo {
            events,
            conns: HashMap::new(),
            _stop: stop,
        })
    }

    /// An event for the state: the handle of a new connection is kept.
    pub(super) fn opened(&mut self, id: WsId, handle: WsHandle) {
        self.conns.insert(id, handle);
    }

    pub(super) fn closed(&mut self, id: WsId) {
        self.conns.remove(&id);
    }

    pub(super) fn send(&self, id: WsId, bytes: Vec<u8>) {
        if let Some(h) = self.conns.get(&id) {
            let _ = h.commands.send(Command::Send(bytes));
        }
    }

    pub(super) fn ping(&self, id: WsId) {
        if let Some(h) = self.conns.get(&id) {
            let _ = h.commands.send(Command::Ping);
        }
    }

    pub(super) fn close(&self, id: WsId, code: Option<u16>, reason: String) {
        if let Some(h) = self.conns.get(&id) {
            let _ = h.commands.send(Command::Close(code, reason));
            h.closing.notify_one();
        }
    }

    pub(super) fn credit(&self, id: WsId, bytes: usize) {
        if let Some(h) = self.conns.get(&id) {
            h.credit.add_permits(bytes);
        }
    }
}

/// The thread's work: accept until stopped, then give the connections'
/// tasks a moment to send their closes.
async fn serve(
    listener: std::net::TcpListener,
    settings: WsSettings,
    events: mpsc::Sender<WsEvent>,
    stopped: oneshot::Receiver<()>,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "the WebSocket listener cannot start");
            return;
        }
    };
    let total = settings
        .max_connections
        .saturating_add(settings.max_pending);
    let held = Arc::new(Semaphore::new(total));
    tokio::select! {
        () = accept_loop(listener, settings, events, held.clone()) => {}
        _ = stopped => {}
    }
    let all = u32::try_from(total).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(CLOSE_LINGER * 2, held.acquire_many(all)).await;
}

async fn accept_loop(
    listener: TcpListener,
    settings: WsSettings,
    events: mpsc::Sender<WsEvent>,
    held: Arc<Semaphore>,
) {
    let mut next_id: WsId = 0;
    loop {
        let (tcp, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: wait, go on.
                debug!(error = %e, "WebSocket accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let accepted = Instant::now();
        let pending = match settings.gate.admit(remote.ip(), accepted) {
            Ok(p) => p,
            Err(why) => {
                debug!(%remote, ?why, "WebSocket connection shed before its hello");
                continue;
            }
        };
        let Ok(permit) = held.clone().try_acquire_owned() else {
            settings.gate.stats().shed(WsShed::Capacity);
            debug!(%remote, "WebSocket connection refused: at the cap");
            continue;
        };
        next_id += 1;
        let id = next_id;
        let settings = settings.clone();
        let events = events.clone();
        tokio::spawn(async move {
            connection(id, tcp, remote, accepted, pending, settings, events).await;
            drop(permit);
        });
    }
}

/// Accepts the upgrade only on [`PATH`] with [`SUBPROTOCOL`] offered.
#[allow(clippy::result_large_err)]
fn upgrade(request: &Request, mut response: Response) -> Result<Response, ErrorResponse> {
    let refuse = |status: StatusCode, why: &str| {
        let mut r = ErrorResponse::new(Some(why.to_owned()));
        *r.status_mut() = status;
        r
    };
    if request.uri().path() != PATH {
        return Err(refuse(StatusCode::NOT_FOUND, "no such path"));
    }
    let offered = request
        .headers()
        .get_all("sec-websocket-protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == SUBPROTOCOL);
    if !offered {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "the subprotocol greendot.v1 is required",
        ));
    }
    response.headers_mut().insert(
        "sec-websocket-protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    Ok(response)
}

/// What came before the hello.
enum First {
    /// The first message, and the connection it came on.
    Message(
        WsMessage,
        Box<WebSocketStream<Budgeted<TlsStream<TcpStream>>>>,
    ),
    /// Dropped, counted under this reason (none: the client went away).
    Shed(Option<WsShed>),
}

/// TLS, the upgrade and the first message, within the budget of bytes the
/// connection's `budget` allows.
async fn first_message(
    tcp: TcpStream,
    remote: SocketAddr,
    settings: &WsSettings,
    config: WebSocketConfig,
    budget: Arc<AtomicUsize>,
    credit: &Semaphore,
) -> First {
    let acceptor = tokio_rustls::TlsAcceptor::from(settings.tls.clone());
    let Ok(tls) = acceptor.accept(tcp).await else {
        return First::Shed(None);
    };
    let stream = Budgeted::new(tls, budget);
    let mut ws = match tokio_tungstenite::accept_hdr_async_with_config(
        stream,
        upgrade,
        Some(config),
    )
    .await
    {
        Ok(ws) => ws,
        Err(WsError::Io(e)) if over_budget(&e) => return First::Shed(Some(WsShed::HelloTooLarge)),
        Err(_) => return First::Shed(None),
    };
    let too_large = loop {
        match ws.next().await {
            Some(Ok(Message::Binary(bytes))) => {
                if bytes.len() > settings.max_hello {
                    break bytes.len();
                }
                // The hello takes read credit like every message.
                let n = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                match credit.acquire_many(n).await {
                    Ok(permit) => permit.forget(),
                    Err(_) => return First::Shed(None),
                }
                return First::Message(WsMessage::Binary(bytes.to_vec()), Box::new(ws));
            }
            Some(Ok(Message::Text(_))) => return First::Message(WsMessage::Text, Box::new(ws)),
            // Signs of life carry no hello: wait on.
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
            Some(Err(WsError::Io(e))) if over_budget(&e) => break settings.max_hello + 1,
            Some(Err(WsError::Capacity(_))) => break settings.max_hello + 1,
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return First::Shed(None),
        }
    };
    debug!(%remote, too_large, "WebSocket hello too large");
    settings.gate.stats().shed(WsShed::HelloTooLarge);
    // The session answers it as any frame too large (an error, then close
    // 4005); nothing more is read.
    First::Message(WsMessage::TooLarge { len: too_large }, Box::new(ws))
}

/// One connection's task: handshake and hello, then shuttle until either
/// side ends.
async fn connection(
    id: WsId,
    tcp: TcpStream,
    remote: SocketAddr,
    accepted: Instant,
    pending: Pending,
    settings: WsSettings,
    events: mpsc::Sender<WsEvent>,
) {
    let _ = tcp.set_nodelay(true);
    let _ = socket2::SockRef::from(&tcp).set_send_buffer_size(SOCKET_SEND_BUFFER);
    // tungstenite allocates its read buffer at once (128 KiB by default:
    // measured, 156 KiB of server memory per WebSocket session against 22
    // for QUIC). Presence frames are small; a larger message still reads,
    // in more steps.
    let config = WebSocketConfig::default()
        .max_message_size(Some(settings.max_frame))
        .max_frame_size(Some(settings.max_frame))
        .read_buffer_size(WS_READ_BUFFER)
        .write_buffer_size(0);
    let budget = Arc::new(AtomicUsize::new(
        settings.max_hello.saturating_add(UPGRADE_ALLOWANCE),
    ));
    let credit = Arc::new(Semaphore::new(read_credit(settings.max_frame)));
    let deadline = tokio::time::Instant::from_std(accepted + settings.hello_timeout);
    let first = first_message(tcp, remote, &settings, config, budget.clone(), &credit);
    let (hello, ws) = match tokio::time::timeout_at(deadline, first).await {
        Ok(First::Message(hello, ws)) => (hello, *ws),
        Ok(First::Shed(why)) => {
            if let Some(why) = why {
                settings.gate.stats().shed(why);
            }
            return;
        }
        Err(_) => {
            // Counted and its place given back before the line that says so.
            settings.gate.stats().shed(WsShed::HelloTimeout);
            drop(pending);
            debug!(%remote, "WebSocket connection: no hello in time");
            return;
        }
    };
    // Past the door: the session's own bounds apply from here.
    let refused = matches!(hello, WsMessage::TooLarge { .. });
    budget.store(UNLIMITED, Ordering::Relaxed);
    drop(pending);
    let (commands, mut command_rx) = mpsc::unbounded_channel();
    let closing = Arc::new(Notify::new());
    let handle = WsHandle {
        commands,
        credit: credit.clone(),
        closing: closing.clone(),
    };
    if events
        .send(WsEvent::Opened { id, remote, handle })
        .await
        .is_err()
        || events
            .send(WsEvent::Message { id, message: hello })
            .await
            .is_err()
    {
        return;
    }
    let (mut sink, mut stream) = ws.split();
    let reader = async {
        if refused {
            // Nothing more is read; the server closes (4005).
            std::future::pending::<()>().await;
        }
        loop {
            let message = match stream.next().await {
                Some(Ok(Message::Binary(bytes))) => {
                    // Credit first: a client may not send past what the
                    // session has read.
                    let n = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                    match credit.acquire_many(n).await {
                        Ok(permit) => permit.forget(),
                        Err(_) => return None,
                    }
                    WsMessage::Binary(bytes.to_vec())
                }
                Some(Ok(Message::Text(_))) => WsMessage::Text,
                Some(Ok(Message::Pong(_))) => WsMessage::Pong,
                // Answered by tungstenite itself; a sign of life all the same.
                Some(Ok(Message::Ping(_))) => WsMessage::Pong,
                Some(Ok(Message::Close(frame))) => return frame.map(|f| u16::from(f.code)),
                Some(Ok(Message::Frame(_))) => continue,
                Some(Err(WsError::Capacity(e))) => {
                    let len = match e {
                        tokio_tungstenite::tungstenite::error::CapacityError::MessageTooLong {
                            size,
                            ..
                        } => size,
                        _ => settings.max_frame + 1,
                    };
                    let _ = events
                        .send(WsEvent::Message {
                            id,
                            message: WsMessage::TooLarge { len },
                        })
                        .await;
                    // Nothing more is read; the server closes (4005).
                    std::future::pending::<()>().await;
                    return None;
                }
                Some(Err(_)) | None => return None,
            };
            if events.send(WsEvent::Message { id, message }).await.is_err() {
                return None;
            }
        }
    };
    let writer = async {
        while let Some(command) = command_rx.recv().await {
            match command {
                Command::Send(bytes) => {
                    let len = bytes.len();
                    if sink.send(Message::Binary(bytes.into())).await.is_err() {
                        break;
                    }
                    if events.send(WsEvent::Written { id, len }).await.is_err() {
                        break;
                    }
                }
                Command::Ping => {
                    if sink.send(Message::Ping(Default::default())).await.is_err() {
                        break;
                    }
                }
                Command::Close(code, reason) => {
                    if let Some(code) = code {
                        let frame = CloseFrame {
                            code: WsCloseCode::from(code),
                            reason: reason.into(),
                        };
                        let _ = sink.send(Message::Close(Some(frame))).await;
                    }
                    break;
                }
            }
        }
        None
    };
    let linger = async {
        closing.notified().await;
        tokio::time::sleep(CLOSE_LINGER).await;
        None
    };
    let code = tokio::select! {
        code = reader => code,
        code = writer => code,
        code = linger => code,
    };
    let _ = events.send(WsEvent::Closed { id, code }).await;
}
