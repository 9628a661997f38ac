//! The load generator's WebSocket devices (`LoadOptions::websocket`): the
//! same device life as over QUIC (connect, hold, churn, close), over
//! `wss://…/greendot` (docs/protocol.md, "WebSocket over TLS"). One task
//! per device owns its socket and reads it all the time, so that the
//! server's pings are answered and pushes are timed as they arrive.

use super::{Ctx, PHASE_MEASURE, PHASE_RAMP};
use futures_util::{SinkExt, StreamExt};
use greendot_proto::{
    self as proto, encode_frame, Answer, CloseCode, Hello, Request, RequestFrame, ServerFrame,
};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

type Stream = WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// TLS 1.3 with ALPN `http/1.1`, shared by every device (one session cache).
pub(crate) fn tls(ctx: &Ctx) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut tls = greendot_client::tls::client_tls(&ctx.opts.roots).map_err(|e| e.to_string())?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(tls))
}

/// What a server message was.
enum Got {
    Control(ServerFrame),
    Other,
    Closed,
}

/// Reads one message: pushes go to the latency count, control frames back.
async fn next(ctx: &Ctx, ws: &mut Stream) -> Got {
    match ws.next().await {
        Some(Ok(Message::Binary(bytes))) => match bytes.split_first() {
            Some((0, payload)) => match proto::decode::<ServerFrame>(payload) {
                Ok(frame) => Got::Control(frame),
                Err(_) => Got::Closed,
            },
            Some((1 | 2, payload)) => {
                ctx.on_push(payload);
                Got::Other
            }
            _ => Got::Closed,
        },
        Some(Ok(Message::Close(_))) | Some(Err(_)) | None => Got::Closed,
        Some(Ok(_)) => Got::Other,
    }
}

async fn send(ws: &mut Stream, frame: &impl serde::Serialize) -> Result<(), String> {
    let bytes = encode_frame(frame).map_err(|e| e.to_string())?;
    ws.send(Message::Binary(bytes[4..].to_vec().into()))
        .await
        .map_err(|e| e.to_string())
}

/// One request and its reply (pushes meanwhile are counted).
async fn call(ctx: &Ctx, ws: &mut Stream, id: u64, request: Request) -> Result<Answer, String> {
    send(ws, &RequestFrame { id, request }).await?;
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match next(ctx, ws).await {
                Got::Control(ServerFrame::Reply { id: got, result }) if got == id => {
                    return result.map_err(|e| e.to_string())
                }
                Got::Control(ServerFrame::Reply { .. }) | Got::Other => continue,
                Got::Control(other) => return Err(format!("unexpected {other:?}")),
                Got::Closed => return Err("connection ended".into()),
            }
        }
    })
    .await;
    answer.unwrap_or_else(|_| Err("no reply in 10 s".into()))
}

/// TCP, TLS, upgrade, hello (resuming `resume`), and on a fresh session the
/// subscribe.
async fn establish(
    ctx: &Arc<Ctx>,
    addr: SocketAddr,
    tls: &Arc<rustls::ClientConfig>,
    token: &str,
    i: usize,
    resume: Option<u64>,
) -> Result<(Stream, u64), String> {
    let attempt = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        let name = rustls::pki_types::ServerName::try_from(ctx.opts.server_name.clone())
            .map_err(|e| e.to_string())?;
        let tls = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        let url = format!("wss://{}:{}/greendot", ctx.opts.server_name, addr.port());
        let mut request = url
            .as_str()
            .into_client_request()
            .map_err(|e| e.to_string())?;
        request.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static("greendot.v1"),
        );
        let (mut ws, _) = tokio_tungstenite::client_async(request, tls)
            .await
            .map_err(|e| e.to_string())?;
        let hello = Hello {
            version: proto::VERSION,
            token: token.to_owned(),
            resume,
            foreground: true,
        };
        send(&mut ws, &hello).await?;
        let welcome = loop {
            match next(ctx, &mut ws).await {
                Got::Control(ServerFrame::Welcome(w)) => break w,
                Got::Other => continue,
                Got::Control(other) => return Err(format!("refused: {other:?}")),
                Got::Closed => return Err("no welcome".into()),
            }
        };
        if !welcome.resumed {
            let request = Request::Subscribe {
                targets: ctx.contacts(i),
                tier: ctx.opts.tier,
            };
            match call(ctx, &mut ws, 1, request).await? {
                Answer::Subscribed { refused, .. } if refused.is_empty() => {}
                other => return Err(format!("subscribe: {other:?}")),
            }
        }
        Ok((ws, welcome.session))
    };
    tokio::time::timeout(CONNECT_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err("connect, hello or subscribe timed out".into()))
}

async fn close(ws: &mut Stream, code: CloseCode) {
    let frame = CloseFrame {
        code: WsCloseCode::from(4000 + code.code() as u16),
        reason: "load generator".into(),
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), ws.close(Some(frame))).await;
}

/// Waits for the phase to leave `phase` while reading the socket; `false`
/// if the connection ended.
async fn hold(
    ctx: &Ctx,
    ws: &mut Stream,
    phase: &mut watch::Receiver<u8>,
    until_not: &[u8],
) -> bool {
    while until_not.contains(&*phase.borrow()) {
        tokio::select! {
            r = phase.changed() => if r.is_err() { return true },
            got = next(ctx, ws) => if matches!(got, Got::Closed) { return false },
        }
    }
    true
}

/// One simulated device over WebSocket (see the QUIC `device`).
pub(crate) async fn device(
    ctx: Arc<Ctx>,
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    i: usize,
    mut phase: watch::Receiver<u8>,
) {
    let Some(token) = ctx.token(i) else {
        return;
    };
    let first = {
        let _permit = ctx.connect_gate.acquire().await;
        let mut result = Err(String::new());
        for _ in 0..super::CONNECT_ATTEMPTS {
            if *phase.borrow() != PHASE_RAMP {
                break;
            }
            result = establish(&ctx, addr, &tls, &token, i, None).await;
            if result.is_ok() {
                break;
            }
        }
        result
    };
    let Ok((mut ws, mut session)) = first else {
        ctx.failed.fetch_add(1, Relaxed);
        return;
    };
    ctx.connected.fetch_add(1, Relaxed);
    ctx.open.fetch_add(1, Relaxed);
    let mut rand = super::device_rng(i);
    let mut alive = hold(&ctx, &mut ws, &mut phase, &[PHASE_RAMP]).await;
    let mut next_id = 2u64;
    while alive && *phase.borrow() == PHASE_MEASURE && ctx.opts.churn > 0.0 {
        let wait = -(1.0 - rand()).ln() / ctx.opts.churn;
        let sleep = tokio::time::sleep(Duration::from_secs_f64(wait.min(3600.0)));
        tokio::pin!(sleep);
        let act = loop {
            tokio::select! {
                _ = &mut sleep => break true,
                _ = phase.changed() => break false,
                got = next(&ctx, &mut ws) => if matches!(got, Got::Closed) {
                    alive = false;
                    break false;
                },
            }
        };
        if !act {
            continue;
        }
        if rand() < ctx.opts.reconnect_share {
            close(&mut ws, CloseCode::Normal).await;
            let resume = Some(session);
            let mut result = establish(&ctx, addr, &tls, &token, i, resume).await;
            if result.is_err() {
                result = establish(&ctx, addr, &tls, &token, i, resume).await;
            }
            match result {
                Ok((w, s)) => {
                    (ws, session) = (w, s);
                    ctx.reconnects.fetch_add(1, Relaxed);
                }
                Err(_) => {
                    ctx.reconnect_failures.fetch_add(1, Relaxed);
                    alive = false;
                }
            }
        } else {
            let request = ctx.status_change();
            let result = call(&ctx, &mut ws, next_id, request).await;
            next_id += 1;
            match result {
                Ok(_) => ctx.status_changes.fetch_add(1, Relaxed),
                Err(_) => ctx.request_errors.fetch_add(1, Relaxed),
            };
        }
    }
    // Hold the connection until the stop.
    if alive {
        hold(
            &ctx,
            &mut ws,
            &mut phase,
            &[PHASE_RAMP, PHASE_MEASURE, super::PHASE_DRAIN],
        )
        .await;
    }
    ctx.open.fetch_sub(1, Relaxed);
    close(&mut ws, CloseCode::Logout).await;
}
