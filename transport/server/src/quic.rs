//! The QUIC binding: a `quinn_proto::Connection` as a [`Binding`]. The
//! client's one bidirectional stream is the control channel; the server
//! opens two unidirectional push streams at the welcome, realtime at the
//! higher priority. quinn-proto's events become [`Happened`]s.
//!
//! A connection that negotiated ALPN `h3` is a WebTransport session
//! (`webtransport`): the same three streams inside HTTP/3, with its
//! handshake, stream headers and close capsules handled there, and the
//! session layer none the wiser.

use super::session::{Binding, Happened, ReadEnd, Write};
use super::webtransport::{negotiated_h3, SessionEvent, WebTransport};
use bytes::Bytes;
use greendot_proto::{CloseCode, FrameReader};
use quinn_proto::{ConnectionError, Dir, Event, StreamEvent, StreamId};
use std::net::SocketAddr;
use std::time::Instant;

/// One QUIC connection under a session.
pub(crate) struct QuicLink {
    pub quic: quinn_proto::Connection,
    /// The client's bidirectional control stream, once opened.
    control: Option<StreamId>,
    /// Realtime and batched, opened at the welcome.
    pushes: Option<[StreamId; 2]>,
    /// The HTTP/3 state when the connection negotiated `h3`.
    wt: Option<Box<WebTransport>>,
}

impl QuicLink {
    pub fn new(quic: quinn_proto::Connection) -> QuicLink {
        QuicLink {
            quic,
            control: None,
            pushes: None,
            wt: None,
        }
    }

    /// The next instant the link must be looked at: QUIC's timer, or a
    /// WebTransport close waiting for its capsule to be acknowledged.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let quic = self.quic.poll_timeout();
        match (quic, self.wt.as_ref().and_then(|wt| wt.deadline())) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.quic.handle_timeout(now);
        if let Some(wt) = self.wt.as_mut() {
            wt.handle_timeout(&mut self.quic, now);
        }
    }

    /// quinn-proto's event in session terms (`None`: nothing for the
    /// session). `refuse_control`: a control stream was already opened (or
    /// finished) once; a new one is stopped.
    /// Whether the connection is a WebTransport session (ALPN h3).
    pub fn is_webtransport(&self) -> bool {
        self.wt.is_some()
    }

    pub fn translate(
        &mut self,
        event: Event,
        refuse_control: bool,
        now: Instant,
    ) -> Option<Happened> {
        if self.wt.is_some() {
            return self.translate_wt(event, refuse_control, now);
        }
        match event {
            Event::Connected => {
                if negotiated_h3(&self.quic) {
                    self.wt = Some(Box::new(WebTransport::start(&mut self.quic)));
                } else {
                    // The transport's limits leave room for HTTP/3's streams;
                    // raw QUIC has one control stream and no client pushes.
                    self.quic.set_max_concurrent_streams(Dir::Bi, 1u32.into());
                    self.quic.set_max_concurrent_streams(Dir::Uni, 0u32.into());
                }
                Some(Happened::Connected)
            }
            Event::Stream(StreamEvent::Opened { dir: Dir::Uni }) => {
                // Clients push nothing on raw QUIC.
                while let Some(id) = self.quic.streams().accept(Dir::Uni) {
                    let _ = self.quic.recv_stream(id).stop(0u32.into());
                }
                None
            }
            Event::DatagramReceived => {
                self.drop_datagrams();
                None
            }
            Event::ConnectionLost { reason } => Some(Happened::Lost {
                logout: matches!(
                    &reason,
                    ConnectionError::ApplicationClosed(close)
                        if close.error_code == CloseCode::Logout.varint()
                ),
                reason: reason.to_string(),
            }),
            Event::Stream(StreamEvent::Opened { dir: Dir::Bi }) => {
                while let Some(id) = self.quic.streams().accept(Dir::Bi) {
                    if self.control.is_none() && !refuse_control {
                        self.control = Some(id);
                    } else {
                        // One control stream per connection.
                        let _ = self.quic.recv_stream(id).stop(0u32.into());
                    }
                }
                Some(Happened::ControlReadable)
            }
            Event::Stream(StreamEvent::Readable { id }) if self.control == Some(id) => {
                Some(Happened::ControlReadable)
            }
            Event::Stream(StreamEvent::Writable { id }) => self.channel(id).map(|c| match c {
                Channel::Control => Happened::ControlWritable,
                Channel::Push(tier) => Happened::PushWritable(tier),
            }),
            Event::Stream(StreamEvent::Stopped { id, .. }) => self.channel(id).map(|c| match c {
                Channel::Control => Happened::ControlStopped,
                Channel::Push(_) => Happened::PushStopped,
            }),
            Event::Stream(StreamEvent::Finished { id }) if self.control == Some(id) => {
                Some(Happened::AnswersDelivered)
            }
            _ => None,
        }
    }

    /// Datagrams are not used by either binding (they are allowed only
    /// because WebTransport requires HTTP datagrams to be on): dropped.
    fn drop_datagrams(&mut self) {
        while self.quic.datagrams().recv().is_some() {}
    }

    /// A quinn-proto event of a WebTransport connection.
    fn translate_wt(
        &mut self,
        event: Event,
        refuse_control: bool,
        now: Instant,
    ) -> Option<Happened> {
        let wt = self.wt.as_mut()?;
        let quic = &mut self.quic;
        match event {
            Event::ConnectionLost { reason } => Some(Happened::Lost {
                logout: false,
                reason: reason.to_string(),
            }),
            Event::Stream(StreamEvent::Opened { dir: Dir::Bi }) => {
                let mut ready = None;
                while let Some(id) = quic.streams().accept(Dir::Bi) {
                    let refuse = refuse_control || self.control.is_some();
                    let was_connect = wt.session_id().is_none();
                    wt.on_bidi(quic, id, refuse);
                    if was_connect {
                        if let Some(SessionEvent::Closed { code, reason }) =
                            wt.read_connect(quic, now)
                        {
                            return Some(peer_closed(code, reason));
                        }
                    } else if wt.is_pending_bidi(id) {
                        ready = ready.or(wt.control_ready(quic, id));
                    }
                }
                if let Some(id) = ready {
                    self.control = Some(id);
                    return Some(Happened::ControlReadable);
                }
                None
            }
            Event::Stream(StreamEvent::Opened { dir: Dir::Uni }) => {
                wt.on_uni(quic);
                None
            }
            Event::Stream(StreamEvent::Readable { id }) => {
                if self.control == Some(id) {
                    return Some(Happened::ControlReadable);
                }
                if wt.is_connect(id) {
                    return wt
                        .read_connect(quic, now)
                        .map(|SessionEvent::Closed { code, reason }| peer_closed(code, reason));
                }
                if wt.is_pending_bidi(id) {
                    if let Some(id) = wt.control_ready(quic, id) {
                        self.control = Some(id);
                        return Some(Happened::ControlReadable);
                    }
                    return None;
                }
                wt.read_uni(quic, id);
                None
            }
            Event::Stream(StreamEvent::Writable { id }) => {
                if wt.is_connect(id) {
                    wt.write_connect(quic, now);
                    return None;
                }
                if wt.is_own_control(id) {
                    wt.write_own_control(quic);
                    return None;
                }
                match self.channel(id)? {
                    Channel::Control => Some(Happened::ControlWritable),
                    Channel::Push(tier) => Some(Happened::PushWritable(tier)),
                }
            }
            Event::Stream(StreamEvent::Stopped { id, .. }) => match self.channel(id)? {
                Channel::Control => Some(Happened::ControlStopped),
                Channel::Push(_) => Some(Happened::PushStopped),
            },
            Event::Stream(StreamEvent::Finished { id }) => {
                if self.control == Some(id) {
                    return Some(Happened::AnswersDelivered);
                }
                None
            }
            Event::DatagramReceived => {
                self.drop_datagrams();
                None
            }
            _ => None,
        }
    }

    fn channel(&self, id: StreamId) -> Option<Channel> {
        if self.control == Some(id) {
            return Some(Channel::Control);
        }
        let pushes = self.pushes?;
        pushes.iter().position(|&p| p == id).map(Channel::Push)
    }
}

/// The client closed its WebTransport session: the close code is the
/// greendot close code, so 1 is a logout.
fn peer_closed(code: Option<u32>, reason: String) -> Happened {
    Happened::Lost {
        logout: code == Some(CloseCode::Logout.code()),
        reason: match code {
            Some(code) => format!("session closed by the client with code {code}: {reason}"),
            None => reason,
        },
    }
}

enum Channel {
    Control,
    Push(usize),
}

fn written(result: Result<usize, quinn_proto::WriteError>) -> Write {
    match result {
        Ok(n) => Write::Took(n),
        Err(quinn_proto::WriteError::Blocked) => Write::Blocked,
        Err(_) => Write::Gone,
    }
}

impl Binding for QuicLink {
    fn remote(&self) -> SocketAddr {
        self.quic.remote_address()
    }

    fn has_control(&self) -> bool {
        self.control.is_some()
    }

    fn read_control(
        &mut self,
        budget: usize,
        reader: &mut FrameReader,
    ) -> Option<(usize, ReadEnd)> {
        let id = self.control?;
        let mut recv = self.quic.recv_stream(id);
        let mut chunks = recv.read(true).ok()?;
        let mut got = 0usize;
        let mut end = ReadEnd::Open;
        while got < budget {
            match chunks.next(budget - got) {
                Ok(Some(chunk)) => {
                    got += chunk.bytes.len();
                    reader.push(&chunk.bytes);
                }
                Ok(None) => {
                    end = ReadEnd::Finished;
                    break;
                }
                Err(quinn_proto::ReadError::Blocked) => break,
                Err(quinn_proto::ReadError::Reset(_)) => {
                    end = ReadEnd::Reset;
                    break;
                }
            }
        }
        // Credit the peer gets back goes out with the next transmit.
        let _ = chunks.finalize();
        Some((got, end))
    }

    fn write_control(&mut self, bytes: &[u8]) -> Write {
        match self.control {
            Some(id) => written(self.quic.send_stream(id).write(bytes)),
            None => Write::Blocked,
        }
    }

    fn finish_control(&mut self) -> bool {
        match self.control {
            // `Finished` comes once the client acknowledged everything.
            Some(id) => self.quic.send_stream(id).finish().is_ok(),
            None => false,
        }
    }

    fn open_pushes(&mut self) -> bool {
        let mut open = || {
            let id = self.quic.streams().open(Dir::Uni)?;
            Some(id)
        };
        let (Some(realtime), Some(batched)) = (open(), open()) else {
            return false;
        };
        let _ = self.quic.send_stream(realtime).set_priority(1);
        let _ = self.quic.send_stream(batched).set_priority(0);
        self.pushes = Some([realtime, batched]);
        if let Some(wt) = self.wt.as_mut() {
            wt.push_opened();
            wt.push_header(&mut self.quic, 0, realtime);
            wt.push_header(&mut self.quic, 1, batched);
        }
        true
    }

    fn write_push(&mut self, tier: usize, bytes: &[u8]) -> Write {
        let Some(id) = self.pushes.and_then(|p| p.get(tier).copied()) else {
            return Write::Gone;
        };
        if let Some(wt) = self.wt.as_mut() {
            // The WebTransport header goes first; frames wait behind it.
            if !wt.push_header(&mut self.quic, tier, id) {
                return Write::Blocked;
            }
        }
        written(self.quic.send_stream(id).write(bytes))
    }

    fn close(&mut self, now: Instant, code: CloseCode, text: &[u8]) {
        if let Some(wt) = self.wt.as_mut() {
            // A session's close is a capsule (its code the greendot code);
            // the QUIC connection closes once the client has ended its side
            // of the session stream, or at the linger.
            if wt.close(&mut self.quic, now, code.code(), text) {
                return;
            }
        }
        self.quic
            .close(now, code.varint(), Bytes::copy_from_slice(text));
    }
}
