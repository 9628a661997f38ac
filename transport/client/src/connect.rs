//! Opening a connection: the server's addresses (resolved at every
//! attempt), for each the race of QUIC and WebSocket, and the hello.

use super::*;
use crate::error::Cause;

/// What one [`Client`] connects with, whatever the carrier.
pub(crate) struct Dialer {
    pub(crate) endpoint: quinn::Endpoint,
    /// The WebSocket carrier's TLS (one session cache for all its connections).
    pub(crate) ws_tls: Arc<rustls::ClientConfig>,
}

/// A transport that is up (QUIC handshake done, or TLS and WebSocket
/// upgrade done) but has carried no greendot frame yet.
enum Transport {
    Quic(quinn::Connection),
    WebSocket(Box<ws::Stream>),
}

/// One address to try, and the name its certificate must have.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub(crate) addr: SocketAddr,
    pub(crate) name: String,
}

/// The server's addresses, in the configured order (a host name's in the
/// order the resolver gave). A name that does not resolve is skipped
/// unless nothing resolves.
pub(crate) async fn targets(config: &ClientConfig) -> Result<Vec<Target>, ClientError> {
    let mut out: Vec<Target> = Vec::new();
    let mut failure = None;
    for server in &config.servers {
        match server {
            ServerAddr::Ip(addr) => out.push(Target {
                addr: *addr,
                name: config
                    .server_name
                    .clone()
                    .unwrap_or_else(|| "localhost".into()),
            }),
            ServerAddr::Host { name, port } => {
                // The system resolver may take long on a dead network: it
                // counts against the connect timeout too.
                let lookup = tokio::net::lookup_host((name.as_str(), *port));
                let found = tokio::time::timeout(config.connect_timeout, lookup)
                    .await
                    .unwrap_or_else(|_| {
                        Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "no answer from the resolver in time",
                        ))
                    })
                    .and_then(|addrs| {
                        let addrs: Vec<SocketAddr> = addrs.collect();
                        if addrs.is_empty() {
                            Err(std::io::Error::new(
                                std::io::ErrorKind::NotFound,
                                "no address",
                            ))
                        } else {
                            Ok(addrs)
                        }
                    });
                match found {
                    Ok(addrs) => {
                        let name = config.server_name.clone().unwrap_or_else(|| name.clone());
                        for addr in addrs {
                            out.push(Target {
                                addr,
                                name: name.clone(),
                            });
                        }
                    }
                    Err(e) => {
                        debug!(host = %name, error = %e, "cannot resolve");
                        failure.get_or_insert(ConnectError::Resolve {
                            host: name.clone(),
                            source: Arc::new(e),
                        });
                    }
                }
            }
        }
    }
    // The same address twice (two names of one host) is tried once.
    let mut seen = std::collections::HashSet::new();
    out.retain(|t| seen.insert(t.addr));
    if out.is_empty() {
        return Err(failure.map_or(ConfigError::NoServer.into(), ClientError::from));
    }
    Ok(out)
}

/// Opens a connection and says hello: resolves the servers, then races the
/// transports of their addresses (see [`first_up`]), `avoid` (the address
/// of a connection just lost) last, and says hello on the first one up. A
/// refusal that ends the client (a bad token) ends the attempt; a hello
/// that fails otherwise (a node refusing while it drains) moves on to the
/// addresses not tried yet. The error is the last one met.
pub(crate) async fn establish(
    dialer: &Dialer,
    config: &ClientConfig,
    token: &str,
    resume: Option<SessionId>,
    foreground: bool,
    avoid: Option<SocketAddr>,
) -> Result<Established, ClientError> {
    let mut left = targets(config).await?;
    if let Some(at) = avoid.and_then(|a| left.iter().position(|t| t.addr == a)) {
        left.rotate_left(at + 1);
    }
    let mut last = None;
    while !left.is_empty() {
        let (i, transport) = first_up(dialer, config, &left).await?;
        let target = left.remove(i);
        let said = hello(transport, config, target.addr, token, resume, foreground);
        let error = match tokio::time::timeout(config.connect_timeout, said).await {
            Ok(Ok(est)) => return Ok(est),
            Ok(Err(e @ ClientError::Rejected { code, .. }))
                if !driver::may_reconnect(config, code) =>
            {
                return Err(e)
            }
            Ok(Err(e)) => e,
            Err(_) => ClientError::Connect(ConnectError::TimedOut {
                server: target.addr,
                after: config.connect_timeout,
            }),
        };
        debug!(addr = %target.addr, error = %error, "no hello at this address");
        last = Some(error);
    }
    Err(last.unwrap_or_else(|| ConfigError::NoServer.into()))
}

/// Races the transports of `targets`: the first attempt starts at once,
/// each next one `address_delay` after the one before, or at once when
/// every attempt started has failed (RFC 8305's connection attempt delay),
/// so a dead address costs `address_delay`, not the connect timeout. Each
/// attempt is bounded by the connect timeout. Returns the first transport
/// up and its target's index; the attempts still running are dropped
/// (closed). A refusal that ends the client ends the race.
async fn first_up(
    dialer: &Dialer,
    config: &ClientConfig,
    targets: &[Target],
) -> Result<(usize, Transport), ClientError> {
    use futures_util::StreamExt;
    let attempt = |i: usize| async move {
        let target = &targets[i];
        let up = tokio::time::timeout(config.connect_timeout, race(dialer, config, target)).await;
        let up = up.unwrap_or_else(|_| {
            Err(ClientError::Connect(ConnectError::TimedOut {
                server: target.addr,
                after: config.connect_timeout,
            }))
        });
        (i, up)
    };
    let mut racing = futures_util::stream::FuturesUnordered::new();
    racing.push(attempt(0));
    let mut next = 1;
    let mut next_at = tokio::time::Instant::now() + config.address_delay;
    let mut last = None;
    loop {
        tokio::select! {
            Some((i, up)) = racing.next() => match up {
                Ok(transport) => return Ok((i, transport)),
                Err(e @ ClientError::Rejected { code, .. })
                    if !driver::may_reconnect(config, code) =>
                {
                    return Err(e)
                }
                Err(e) => {
                    debug!(addr = %targets[i].addr, error = %e, "cannot connect to this address");
                    last = Some(e);
                    if racing.is_empty() && next < targets.len() {
                        racing.push(attempt(next));
                        next += 1;
                        next_at = tokio::time::Instant::now() + config.address_delay;
                    }
                }
            },
            _ = tokio::time::sleep_until(next_at), if next < targets.len() => {
                debug!(addr = %targets[next].addr, "no transport up yet: trying the next address too");
                racing.push(attempt(next));
                next += 1;
                next_at = tokio::time::Instant::now() + config.address_delay;
            }
            else => return Err(last.unwrap_or_else(|| ConfigError::NoServer.into())),
        }
    }
}

async fn quic_handshake(
    endpoint: &quinn::Endpoint,
    target: &Target,
) -> Result<quinn::Connection, ClientError> {
    let connecting = endpoint
        .connect(target.addr, &target.name)
        .map_err(|e| ClientError::Connect(ConnectError::Quic(Cause::new(e))))?;
    connecting.await.map_err(|e| match &e {
        quinn::ConnectionError::ApplicationClosed(_) => lost(&e),
        _ => ClientError::Connect(ConnectError::QuicHandshake(Cause::new(e))),
    })
}

/// The WebSocket address for `target`, if the fallback is on.
fn websocket_addr(config: &ClientConfig, target: &Target) -> Option<SocketAddr> {
    match config.websocket {
        WebSocket::Off => None,
        WebSocket::SamePort => Some(target.addr),
        WebSocket::At(addr) => Some(addr),
    }
}

/// Happy eyeballs: QUIC first; if no QUIC handshake completed within
/// `fallback_delay` (or QUIC failed sooner) WebSocket too, and the first
/// transport up wins. The race ends before the hello: two hellos of one
/// device would supersede each other, so only the winner says hello.
async fn race(
    dialer: &Dialer,
    config: &ClientConfig,
    target: &Target,
) -> Result<Transport, ClientError> {
    let quic = quic_handshake(&dialer.endpoint, target);
    let Some(ws_addr) = websocket_addr(config, target) else {
        return quic.await.map(Transport::Quic);
    };
    let both = |q: ClientError, w: ClientError| {
        ClientError::Connect(ConnectError::Both {
            quic: Box::new(q),
            websocket: Box::new(w),
        })
    };
    tokio::pin!(quic);
    let websocket = async {
        ws::handshake(config, ws_addr, &target.name, dialer.ws_tls.clone())
            .await
            .map(|s| Transport::WebSocket(Box::new(s)))
    };
    let quic_failed = tokio::select! {
        result = &mut quic => match result {
            Ok(conn) => return Ok(Transport::Quic(conn)),
            // The server answered over QUIC: its word is final.
            Err(e @ ClientError::Rejected { .. }) => return Err(e),
            Err(e) => Some(e),
        },
        _ = tokio::time::sleep(config.fallback_delay) => None,
    };
    if let Some(q) = quic_failed {
        return websocket.await.map_err(|w| both(q, w));
    }
    debug!(delay = ?config.fallback_delay, "no QUIC handshake yet: trying WebSocket too");
    tokio::pin!(websocket);
    tokio::select! {
        result = &mut quic => match result {
            Ok(conn) => Ok(Transport::Quic(conn)),
            Err(e @ ClientError::Rejected { .. }) => Err(e),
            Err(q) => websocket.await.map_err(|w| both(q, w)),
        },
        result = &mut websocket => match result {
            Ok(transport) => Ok(transport),
            Err(w) => quic.await.map(Transport::Quic).map_err(|q| both(q, w)),
        },
    }
}

/// Says hello on a transport that is up and waits for the welcome.
async fn hello(
    transport: Transport,
    config: &ClientConfig,
    server: SocketAddr,
    token: &str,
    resume: Option<SessionId>,
    foreground: bool,
) -> Result<Established, ClientError> {
    let hello = Hello {
        version: config.version,
        token: token.to_owned(),
        resume: resume.map(|s| s.0),
        foreground,
    };
    let bytes = encode_frame(&hello)?;
    let (tx, mut inbound) = mpsc::unbounded_channel();
    let (mut link, tasks) = match transport {
        Transport::Quic(conn) => {
            let (mut send, recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
            if send.write_all(&bytes).await.is_err() {
                return Err(lost(&conn.closed().await));
            }
            let tasks = Tasks(vec![
                tokio::spawn(driver::read_control(conn.clone(), recv, tx.clone())),
                tokio::spawn(driver::accept_pushes(conn.clone(), tx)),
            ]);
            (Link::Quic { conn, send }, tasks)
        }
        Transport::WebSocket(mut stream) => {
            use futures_util::SinkExt;
            let payload = bytes[4..].to_vec();
            stream
                .send(tokio_tungstenite::tungstenite::Message::Binary(
                    payload.into(),
                ))
                .await
                .map_err(|e| ClientError::Lost(LostReason::WebSocketSend(Cause::new(e))))?;
            let (out_tx, out_rx) = mpsc::channel(64);
            let task = tokio::spawn(ws::drive(
                *stream,
                out_rx,
                tx,
                config.keep_alive,
                config.idle_timeout,
            ));
            (Link::WebSocket(out_tx), Tasks(vec![task]))
        }
    };
    let mut early = Vec::new();
    let result = loop {
        match inbound.recv().await {
            Some(Inbound::Frame(ServerFrame::Welcome(welcome))) => break Ok(welcome),
            Some(Inbound::Frame(ServerFrame::Error(error))) => {
                break Err(rejected_after(&mut inbound, error).await)
            }
            Some(Inbound::Frame(ServerFrame::Reply { .. })) => {
                break Err(ProtocolError::ReplyBeforeWelcome.into())
            }
            Some(push @ (Inbound::Push { .. } | Inbound::Group(_))) => early.push(push),
            Some(Inbound::Ended(e)) => break Err(e),
            None => break Err(LostReason::Ended.into()),
        }
    };
    match result {
        Ok(welcome) => Ok(Established {
            link,
            inbound,
            early,
            tasks,
            welcome,
            foreground,
            server,
        }),
        Err(e) => {
            link.close(CloseCode::Normal, "hello failed").await;
            Err(e)
        }
    }
}
