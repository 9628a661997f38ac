//! The WebSocket binding, sans IO: one WebSocket connection as a
//! [`Binding`] (docs/protocol.md, "WebSocket over TLS"). The driver's
//! per-connection tasks (`ws_io`) do the TLS, the upgrade and the framing;
//! the state sees whole messages in ([`WsMessage`]) and hands whole
//! messages out (`ServerOutput::WsSend`).
//!
//! - Client messages are control frames without their length prefix: each
//!   is given to the session's `FrameReader` with a prefix put back, so the
//!   session layer reads them exactly as a QUIC control stream (a message
//!   too large arrives as a bare prefix over the cap: refused before
//!   anything is stored).
//! - Server messages are one stream byte (0 control, 1 and 2 the push
//!   streams, which push stream is which drawn per connection) and one
//!   frame's payload.
//! - Flow control: what the state hands out and the driver has not yet
//!   reported written (`ServerInput::WsWritten`) is bounded by
//!   [`SEND_WINDOW`]; past it the channels are `Blocked`, so pushes queue in
//!   the session under `push_queue_bytes` as on QUIC, and a reader that
//!   does not read ends `Overloaded`. What the client sends is bounded the
//!   other way: the driver reads a message only with credit, given back
//!   (`ServerOutput::WsCredit`) as the session reads.
//! - Keep-alive: a ping every `keep_alive`; nothing heard (a message, a
//!   pong) for `idle_timeout` is a lost connection.

use super::session::{Binding, Happened, ReadEnd, Write};
use greendot_proto::{CloseCode, FrameReader};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// A WebSocket connection, as the driver numbers it (never reused).
pub type WsId = u64;

/// Bytes (with [`MESSAGE_OVERHEAD`] each) handed to the driver and not yet
/// written to the socket, per connection.
pub const SEND_WINDOW: usize = 64 * 1024;
/// What one message in flight counts for beside its bytes, so that tiny
/// messages are bounded too.
pub const MESSAGE_OVERHEAD: usize = 64;
/// The most bytes of client messages the driver may hand over unread by
/// the session, per connection: two maximal frames.
pub fn read_credit(max_frame: usize) -> usize {
    2 * (max_frame + MESSAGE_OVERHEAD)
}

/// A greendot close code as a WebSocket close code (4000 + the code).
pub(crate) fn ws_code(code: CloseCode) -> u16 {
    4000 + u16::try_from(code.code()).unwrap_or(999)
}

/// The longest close reason a WebSocket close frame holds.
const REASON_CAP: usize = 123;

/// A message from a WebSocket client, as the driver read it.
#[derive(Debug)]
pub enum WsMessage {
    /// A binary message: one frame's payload.
    Binary(Vec<u8>),
    /// A text message (a protocol error).
    Text,
    /// A message over the cap, refused before it was stored; `len` as far
    /// as known.
    TooLarge { len: usize },
    /// A pong (a sign of life, nothing more).
    Pong,
}

/// What a WebSocket link asks the driver to do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WsOut {
    Send(Vec<u8>),
    Ping,
    /// Close with a WebSocket close code (`None`: drop the TCP connection
    /// without a close frame) and reason.
    Close(Option<u16>, String),
    /// The session read this many bytes: the driver may read as many more.
    Credit(usize),
}

enum Inbound {
    Binary(Vec<u8>),
    Text,
    TooLarge(usize),
}

/// One WebSocket connection under a session.
pub(crate) struct WsLink {
    pub id: WsId,
    remote: SocketAddr,
    max_frame: usize,
    inbox: VecDeque<Inbound>,
    /// Handed out and not yet reported written (bytes + overhead).
    in_flight: usize,
    /// A channel was refused for the window: report it writable when
    /// room is made. Control, realtime, batched.
    blocked: [bool; 3],
    /// The stream byte of the realtime and of the batched push stream.
    streams: [u8; 2],
    pushes_open: bool,
    /// The welcome went out: pushes may follow (one TCP connection keeps
    /// the order, and the welcome comes first).
    welcomed: bool,
    /// A close was asked for: nothing more goes out.
    closed: bool,
    /// The driver reported the connection gone.
    pub gone: bool,
    out: VecDeque<WsOut>,
    happened: VecDeque<Happened>,
    keep_alive: Duration,
    idle_timeout: Duration,
    next_ping: Instant,
    heard: Instant,
}

impl WsLink {
    pub fn new(
        id: WsId,
        remote: SocketAddr,
        now: Instant,
        max_frame: usize,
        keep_alive: Duration,
        idle_timeout: Duration,
        realtime_first: bool,
    ) -> WsLink {
        WsLink {
            id,
            remote,
            max_frame,
            inbox: VecDeque::new(),
            in_flight: 0,
            blocked: [false; 3],
            streams: if realtime_first { [1, 2] } else { [2, 1] },
            pushes_open: false,
            welcomed: false,
            closed: false,
            gone: false,
            out: VecDeque::new(),
            happened: VecDeque::new(),
            keep_alive,
            idle_timeout,
            next_ping: now + keep_alive,
            heard: now,
        }
    }

    /// A message arrived: a sign of life; frames wait in the inbox for the
    /// session.
    pub fn received(&mut self, now: Instant, message: WsMessage) {
        self.heard = self.heard.max(now);
        let inbound = match message {
            WsMessage::Pong => return,
            WsMessage::Binary(bytes) => Inbound::Binary(bytes),
            WsMessage::Text => Inbound::Text,
            WsMessage::TooLarge { len } => Inbound::TooLarge(len),
        };
        self.inbox.push_back(inbound);
        self.happened.push_back(Happened::ControlReadable);
    }

    /// The driver wrote a message of `len` bytes to the socket.
    pub fn written(&mut self, len: usize) {
        self.in_flight = self
            .in_flight
            .saturating_sub(len.saturating_add(MESSAGE_OVERHEAD));
        if self.in_flight < SEND_WINDOW {
            if std::mem::take(&mut self.blocked[0]) {
                self.happened.push_back(Happened::ControlWritable);
            }
            for tier in 0..2 {
                if std::mem::take(&mut self.blocked[1 + tier]) {
                    self.happened.push_back(Happened::PushWritable(tier));
                }
            }
        }
    }

    /// The connection is gone (lost, or closed by the client).
    pub fn lost(&mut self, code: Option<u16>) {
        self.gone = true;
        let logout = code == Some(ws_code(CloseCode::Logout));
        let reason = match code {
            Some(code) => format!("WebSocket closed by the client: {code}"),
            None => "WebSocket connection lost".into(),
        };
        self.happened.push_back(Happened::Lost { logout, reason });
    }

    /// What happened since the last call, for the session layer.
    pub fn poll(&mut self) -> Option<Happened> {
        self.happened.pop_front()
    }

    /// What the driver must do next.
    pub fn poll_out(&mut self) -> Option<WsOut> {
        self.out.pop_front()
    }

    /// When the link must be looked at again (a ping, the idle timeout).
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.closed || self.gone {
            return None;
        }
        Some(self.next_ping.min(self.heard + self.idle_timeout))
    }

    /// Its timers: the ping due, or the idle timeout (the connection is
    /// dropped and reported lost).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.closed || self.gone {
            return;
        }
        if now >= self.heard + self.idle_timeout {
            self.closed = true;
            self.out
                .push_back(WsOut::Close(None, "idle timeout".into()));
            self.happened.push_back(Happened::Lost {
                logout: false,
                reason: "WebSocket idle timeout".into(),
            });
            return;
        }
        if now >= self.next_ping {
            self.out.push_back(WsOut::Ping);
            self.next_ping = now + self.keep_alive;
        }
    }

    /// Hands one frame (with its 4-byte prefix) out as a message on
    /// `stream`, if the window has room; never a part of one.
    fn send(&mut self, channel: usize, stream: u8, frame: &[u8]) -> Write {
        if self.closed || self.gone {
            return Write::Gone;
        }
        if self.in_flight >= SEND_WINDOW {
            self.blocked[channel] = true;
            return Write::Blocked;
        }
        let payload = frame.get(4..).unwrap_or_default();
        let mut message = Vec::with_capacity(1 + payload.len());
        message.push(stream);
        message.extend_from_slice(payload);
        self.in_flight += message.len() + MESSAGE_OVERHEAD;
        self.out.push_back(WsOut::Send(message));
        Write::Took(frame.len())
    }
}

/// The length a frame's prefix announces.
fn announced(bytes: &[u8]) -> Option<usize> {
    let prefix: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
    usize::try_from(u32::from_be_bytes(prefix)).ok()
}

/// A close reason cut to what a close frame holds, at a character
/// boundary, keeping a trailing `retry_ms=<n>` word (the text before it is
/// cut first).
pub(crate) fn close_reason(text: &[u8]) -> String {
    let text = String::from_utf8_lossy(text);
    if text.len() <= REASON_CAP {
        return text.into_owned();
    }
    let (head, hint) = match text.rfind(" retry_ms=") {
        Some(at) => (&text[..at], &text[at..]),
        None => (&text[..], ""),
    };
    let mut cut = REASON_CAP.saturating_sub(hint.len());
    while !head.is_char_boundary(cut.min(head.len())) {
        cut -= 1;
    }
    let mut reason = head[..cut.min(head.len())].to_owned();
    reason.push_str(hint);
    reason
}

impl Binding for WsLink {
    fn remote(&self) -> SocketAddr {
        self.remote
    }

    fn has_control(&self) -> bool {
        true
    }

    fn read_control(
        &mut self,
        budget: usize,
        reader: &mut FrameReader,
    ) -> Option<(usize, ReadEnd)> {
        let mut got = 0usize;
        // Whole messages only, at least one per call.
        while let Some(inbound) = self.inbox.front() {
            let len = match inbound {
                Inbound::Binary(bytes) => bytes.len(),
                _ => 0,
            };
            if got > 0 && got + len > budget {
                break;
            }
            let Some(inbound) = self.inbox.pop_front() else {
                break;
            };
            match inbound {
                Inbound::Binary(bytes) => {
                    let prefix = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                    reader.push(&prefix.to_be_bytes());
                    reader.push(&bytes);
                    self.out.push_back(WsOut::Credit(bytes.len()));
                }
                // Only binary messages carry frames: an empty frame is
                // what the reader refuses as a bad frame (`BadFrame`).
                Inbound::Text => reader.push(&0u32.to_be_bytes()),
                // The prefix alone is refused (`FrameTooLarge`).
                Inbound::TooLarge(len) => {
                    let len = len.max(self.max_frame + 1);
                    reader.push(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
                }
            }
            got += len + 4;
        }
        Some((got, ReadEnd::Open))
    }

    fn write_control(&mut self, bytes: &[u8]) -> Write {
        // The answers are whole frames, one after another: one message each.
        let mut took = 0;
        while let Some(len) = bytes.get(took..).and_then(announced) {
            let end = took + 4 + len;
            let Some(frame) = bytes.get(took..end) else {
                break;
            };
            match self.send(0, 0, frame) {
                Write::Took(_) => {
                    took = end;
                    if self.pushes_open && !self.welcomed {
                        self.welcomed = true;
                        for tier in 0..2 {
                            if std::mem::take(&mut self.blocked[1 + tier]) {
                                self.happened.push_back(Happened::PushWritable(tier));
                            }
                        }
                    }
                }
                Write::Blocked if took > 0 => break,
                other => return other,
            }
        }
        Write::Took(took)
    }

    fn finish_control(&mut self) -> bool {
        // One TCP connection keeps the order: the close goes after the
        // answers it follows.
        false
    }

    fn open_pushes(&mut self) -> bool {
        self.pushes_open = true;
        true
    }

    fn write_push(&mut self, tier: usize, bytes: &[u8]) -> Write {
        match self.streams.get(tier).copied() {
            Some(_) if self.pushes_open && !self.welcomed => {
                self.blocked[1 + tier] = true;
                Write::Blocked
            }
            Some(stream) if self.pushes_open => self.send(1 + tier, stream, bytes),
            _ => Write::Gone,
        }
    }

    fn close(&mut self, _now: Instant, code: CloseCode, text: &[u8]) {
        if self.closed || self.gone {
            return;
        }
        self.closed = true;
        self.out
            .push_back(WsOut::Close(Some(ws_code(code)), close_reason(text)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_close_reason_is_cut_before_its_retry_hint() {
        let long = format!("{} retry_ms=12000", "é".repeat(100));
        let reason = close_reason(long.as_bytes());
        assert!(reason.len() <= REASON_CAP, "{}", reason.len());
        assert!(reason.ends_with(" retry_ms=12000"));
        assert_eq!(close_reason(b"short"), "short");
    }
}
