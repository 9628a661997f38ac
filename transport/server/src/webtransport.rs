//! WebTransport over HTTP/3 (ALPN `h3`): the HTTP/3 state a QUIC connection
//! carries when the browser binding was negotiated. The connection stays a
//! [`QuicLink`](super::quic::QuicLink) in the server's own quinn-proto
//! driver; this module only adds what HTTP/3 puts around the greendot
//! streams, with `web-transport-proto` doing the HTTP/3 encoding:
//!
//! - the server's control stream (type 0x00) with a SETTINGS frame that
//!   enables extended CONNECT, HTTP datagrams and WebTransport;
//! - the client's control and QPACK streams, read and discarded (the server
//!   uses no dynamic table, so there is nothing in them it needs);
//! - the extended CONNECT (`:protocol webtransport`, path `/greendot`) on
//!   the client's first bidirectional stream, answered 200 (404 for another
//!   path, 431 for a header block past [`MAX_CONNECT_BYTES`], 400 for one it
//!   cannot parse);
//! - the greendot control stream: the next client bidirectional stream,
//!   after its WebTransport header (signal 0x41, session id);
//! - the two push streams: server unidirectional streams after their header
//!   (type 0x54, session id);
//! - closes both ways as `CLOSE_WEBTRANSPORT_SESSION` capsules on the
//!   CONNECT stream, whose code is the greendot close code.
//!
//! Every byte a peer can make this module hold is bounded: the CONNECT
//! request by [`MAX_CONNECT_BYTES`], capsules by [`MAX_CAPSULE_BYTES`], a
//! stream header by two varints.

use quinn_proto::{Connection, Dir, StreamId};
use std::time::{Duration, Instant};
use web_transport_proto::{
    Capsule, CapsuleError, ConnectError, ConnectRequest, ConnectResponse, Settings, StreamUni,
    VarInt,
};

/// The ALPN of HTTP/3: a connection that negotiated it speaks WebTransport.
pub const H3_ALPN: &[u8] = b"h3";

/// The one path a WebTransport session may be opened on.
pub const PATH: &str = "/greendot";

/// The most bytes of a CONNECT request held while waiting for the rest of
/// it (also advertised as SETTINGS_MAX_FIELD_SECTION_SIZE). A browser's is
/// a few hundred bytes.
pub const MAX_CONNECT_BYTES: usize = 4096;

/// The most bytes of an incomplete capsule held (a close capsule carries at
/// most a 1024-byte reason).
pub const MAX_CAPSULE_BYTES: usize = 2048;

/// The most bytes of a close reason in a capsule (WebTransport's limit).
const MAX_REASON_BYTES: usize = 1024;

/// How long a server close waits for the client to acknowledge its close
/// capsule before the QUIC connection is closed anyway.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// The bidirectional stream signal of a WebTransport stream.
const BIDI_SIGNAL: u64 = 0x41;

/// HTTP/3's "no error", for the QUIC close after the session's own close.
const H3_NO_ERROR: u32 = 0x100;

/// Where the session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for (the rest of) the CONNECT request.
    Requested,
    /// Answered 200: WebTransport streams are accepted.
    Established,
    /// Refused (an HTTP error status), or closed either way.
    Over,
}

/// What happened to the session, for the QUIC link to report.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SessionEvent {
    /// The client closed the session: with this code (none: the CONNECT
    /// stream ended or was reset without a close capsule).
    Closed { code: Option<u32>, reason: String },
}

/// A stream whose header is being read.
#[derive(Debug)]
struct Header {
    id: StreamId,
    bytes: Vec<u8>,
}

/// The HTTP/3 and WebTransport state of one connection.
#[derive(Debug)]
pub(crate) struct WebTransport {
    phase: Phase,
    /// The client's CONNECT stream (its id is the session id).
    connect: Option<StreamId>,
    /// Request bytes, then capsule bytes, read from the CONNECT stream and
    /// not yet decoded.
    inbound: Vec<u8>,
    /// Bytes for the CONNECT stream the stream did not take yet.
    connect_out: Vec<u8>,
    /// Finish the CONNECT stream once `connect_out` is written.
    finish_connect: bool,
    /// The server's HTTP/3 control stream and what it still has to write.
    own_control: Option<StreamId>,
    control_out: Vec<u8>,
    /// The client's bidirectional stream whose WebTransport header is read.
    pending_bidi: Option<Header>,
    /// The client's unidirectional streams: type being read, or known
    /// (control, QPACK) and discarded.
    peer_uni: Vec<Header>,
    /// The push streams' headers not yet written.
    push_headers: [Vec<u8>; 2],
    /// A server close waiting for the close capsule to be acknowledged: the
    /// latest instant to close the QUIC connection anyway, and its text.
    closing: Option<(Instant, Vec<u8>)>,
}

/// The negotiated ALPN of a connection, once its handshake data is there.
pub(crate) fn negotiated_h3(quic: &Connection) -> bool {
    quic.crypto_session()
        .handshake_data()
        .and_then(|data| {
            data.downcast::<quinn_proto::crypto::rustls::HandshakeData>()
                .ok()
        })
        .and_then(|data| data.protocol)
        .is_some_and(|alpn| alpn == H3_ALPN)
}

/// How reading a stream ended.
enum End {
    Open,
    Finished,
    Reset,
}

/// Reads at most `max` bytes of `id` into `into` (or drops them if `into`
/// is `None`).
fn read(quic: &mut Connection, id: StreamId, max: usize, into: Option<&mut Vec<u8>>) -> End {
    let mut recv = quic.recv_stream(id);
    let Ok(mut chunks) = recv.read(true) else {
        return End::Reset;
    };
    let mut got = 0usize;
    let mut end = End::Open;
    let mut into = into;
    while got < max {
        match chunks.next(max - got) {
            Ok(Some(chunk)) => {
                got += chunk.bytes.len();
                if let Some(into) = into.as_deref_mut() {
                    into.extend_from_slice(&chunk.bytes);
                }
            }
            Ok(None) => {
                end = End::Finished;
                break;
            }
            Err(quinn_proto::ReadError::Blocked) => break,
            Err(quinn_proto::ReadError::Reset(_)) => {
                end = End::Reset;
                break;
            }
        }
    }
    let _ = chunks.finalize();
    end
}

/// How far a stream header was read.
enum HeaderRead {
    /// Its varints.
    Done(Vec<u64>),
    /// Not all of it yet.
    More,
    /// The stream ended (or was reset) before it.
    Ended,
}

/// Reads a stream header of `count` varints byte by byte, so that nothing
/// after it is consumed.
fn read_header(quic: &mut Connection, header: &mut Header, count: usize) -> HeaderRead {
    loop {
        let mut slice = &header.bytes[..];
        let mut values = Vec::with_capacity(count);
        while values.len() < count {
            match VarInt::decode(&mut slice) {
                Ok(v) => values.push(v.into_inner()),
                Err(_) => break,
            }
        }
        if values.len() == count {
            return HeaderRead::Done(values);
        }
        let before = header.bytes.len();
        let end = read(quic, header.id, 1, Some(&mut header.bytes));
        if header.bytes.len() == before {
            return match end {
                End::Open => HeaderRead::More,
                End::Finished | End::Reset => HeaderRead::Ended,
            };
        }
    }
}

fn varints(values: &[u64]) -> Vec<u8> {
    let mut out = Vec::new();
    for &v in values {
        VarInt::from_u64(v).unwrap_or(VarInt::MAX).encode(&mut out);
    }
    out
}

fn stream_number(id: StreamId) -> u64 {
    quinn_proto::VarInt::from(id).into_inner()
}

/// Writes what `out` holds to stream `id`, keeping what it did not take.
fn flush(quic: &mut Connection, id: StreamId, out: &mut Vec<u8>) -> bool {
    if out.is_empty() {
        return true;
    }
    match quic.send_stream(id).write(out) {
        Ok(n) => {
            out.drain(..n);
            out.is_empty()
        }
        Err(_) => {
            out.clear();
            false
        }
    }
}

impl WebTransport {
    /// The connection negotiated `h3`: open the server's control stream with
    /// its SETTINGS, and let the client open the streams HTTP/3 needs.
    pub fn start(quic: &mut Connection) -> WebTransport {
        let mut settings = Settings::default();
        settings.enable_webtransport(1);
        settings.insert(
            web_transport_proto::Setting::MAX_FIELD_SECTION_SIZE,
            VarInt::from_u32(MAX_CONNECT_BYTES as u32),
        );
        let mut control_out = Vec::new();
        settings.encode(&mut control_out);
        // The CONNECT stream and the greendot control stream; the client's
        // HTTP/3 control stream and its two QPACK streams.
        quic.set_max_concurrent_streams(Dir::Bi, 2u32.into());
        quic.set_max_concurrent_streams(Dir::Uni, 3u32.into());
        let own_control = quic.streams().open(Dir::Uni);
        let mut wt = WebTransport {
            phase: Phase::Requested,
            connect: None,
            inbound: Vec::new(),
            connect_out: Vec::new(),
            finish_connect: false,
            own_control,
            control_out,
            pending_bidi: None,
            peer_uni: Vec::new(),
            push_headers: [Vec::new(), Vec::new()],
            closing: None,
        };
        if let Some(id) = wt.own_control {
            flush(quic, id, &mut wt.control_out);
        }
        wt
    }

    pub fn session_id(&self) -> Option<u64> {
        self.connect.map(stream_number)
    }

    /// A bidirectional stream the client opened: the CONNECT stream, the
    /// greendot control stream (`true` once its header is read: ask
    /// [`Self::control_ready`]), or one to refuse.
    pub fn on_bidi(&mut self, quic: &mut Connection, id: StreamId, refuse_control: bool) {
        if self.connect.is_none() {
            self.connect = Some(id);
            return;
        }
        if self.phase == Phase::Established && self.pending_bidi.is_none() && !refuse_control {
            self.pending_bidi = Some(Header {
                id,
                bytes: Vec::new(),
            });
            return;
        }
        let _ = quic.recv_stream(id).stop(0u32.into());
        let _ = quic.send_stream(id).reset(0u32.into());
    }

    /// The pending bidirectional stream's header, if this is it: `Some(id)`
    /// once it names this session (the greendot control stream from now on).
    pub fn control_ready(&mut self, quic: &mut Connection, id: StreamId) -> Option<StreamId> {
        let pending = self.pending_bidi.as_mut().filter(|h| h.id == id)?;
        let values = match read_header(quic, pending, 2) {
            HeaderRead::More => return None,
            HeaderRead::Done(values) => Some(values),
            HeaderRead::Ended => None,
        };
        self.pending_bidi = None;
        if values.is_some_and(|v| v[0] == BIDI_SIGNAL && Some(v[1]) == self.session_id()) {
            Some(id)
        } else {
            let _ = quic.recv_stream(id).stop(0u32.into());
            let _ = quic.send_stream(id).reset(0u32.into());
            None
        }
    }

    pub fn is_pending_bidi(&self, id: StreamId) -> bool {
        self.pending_bidi.as_ref().is_some_and(|h| h.id == id)
    }

    /// Unidirectional streams the client opened.
    pub fn on_uni(&mut self, quic: &mut Connection) {
        while let Some(id) = quic.streams().accept(Dir::Uni) {
            // At most three are open at once (the stream limit): bounded.
            self.peer_uni.push(Header {
                id,
                bytes: Vec::new(),
            });
            self.read_uni(quic, id);
        }
    }

    /// Reads a client unidirectional stream: HTTP/3's own (control, QPACK)
    /// are drained, any other kind is stopped.
    pub fn read_uni(&mut self, quic: &mut Connection, id: StreamId) -> bool {
        let Some(i) = self.peer_uni.iter().position(|h| h.id == id) else {
            return false;
        };
        let header = &mut self.peer_uni[i];
        let keep = match read_header(quic, header, 1) {
            HeaderRead::More => true,
            HeaderRead::Ended => false,
            HeaderRead::Done(kind) => {
                let kind = StreamUni(VarInt::from_u64(kind[0]).unwrap_or(VarInt::MAX));
                if [
                    StreamUni::CONTROL,
                    StreamUni::QPACK_ENCODER,
                    StreamUni::QPACK_DECODER,
                ]
                .contains(&kind)
                {
                    // Drained as it comes: nothing in them is kept.
                    matches!(read(quic, id, usize::MAX, None), End::Open)
                } else {
                    let _ = quic.recv_stream(id).stop(0x103u32.into());
                    false
                }
            }
        };
        if !keep {
            self.peer_uni.swap_remove(i);
        }
        true
    }

    /// The CONNECT stream is readable: the request (answered here) or a
    /// capsule. `Some` if the client closed the session.
    pub fn read_connect(&mut self, quic: &mut Connection, now: Instant) -> Option<SessionEvent> {
        let id = self.connect?;
        match self.phase {
            Phase::Requested => {
                let room = MAX_CONNECT_BYTES - self.inbound.len();
                let end = read(quic, id, room, Some(&mut self.inbound));
                let mut slice = &self.inbound[..];
                let status = match ConnectRequest::decode(&mut slice) {
                    Ok(request) if request.url.path() == PATH => http_status(200),
                    Ok(_) => http_status(404),
                    Err(ConnectError::UnexpectedEnd) => {
                        if self.inbound.len() < MAX_CONNECT_BYTES && matches!(end, End::Open) {
                            return None;
                        }
                        if self.inbound.len() >= MAX_CONNECT_BYTES {
                            http_status(431)
                        } else {
                            http_status(400)
                        }
                    }
                    Err(ConnectError::FieldSectionTooLarge | ConnectError::FrameTooLarge) => {
                        http_status(431)
                    }
                    Err(_) => http_status(400),
                };
                let consumed = self.inbound.len() - slice.len();
                self.inbound.drain(..consumed);
                let _ = ConnectResponse::new(status).encode(&mut self.connect_out);
                if status.is_success() {
                    self.phase = Phase::Established;
                } else {
                    self.phase = Phase::Over;
                    self.inbound = Vec::new();
                    self.finish_connect = true;
                    let _ = quic.recv_stream(id).stop(0x10cu32.into());
                }
                self.write_connect(quic, now);
                None
            }
            Phase::Established => {
                let room = MAX_CAPSULE_BYTES.saturating_sub(self.inbound.len()).max(1);
                let end = read(quic, id, room, Some(&mut self.inbound));
                loop {
                    let mut slice = &self.inbound[..];
                    match Capsule::decode(&mut slice) {
                        Ok(capsule) => {
                            let consumed = self.inbound.len() - slice.len();
                            self.inbound.drain(..consumed);
                            if let Capsule::CloseWebTransportSession { code, reason } = capsule {
                                return Some(self.peer_closed(quic, now, Some(code), reason));
                            }
                        }
                        Err(CapsuleError::UnexpectedEnd | CapsuleError::VarInt(_))
                            if self.inbound.len() < MAX_CAPSULE_BYTES =>
                        {
                            break;
                        }
                        Err(error) => {
                            let reason = format!("bad capsule: {error}");
                            return Some(self.peer_closed(quic, now, None, reason));
                        }
                    }
                }
                match end {
                    End::Open => None,
                    End::Finished => Some(self.peer_closed(
                        quic,
                        now,
                        None,
                        "the client ended the session stream".into(),
                    )),
                    End::Reset => Some(self.peer_closed(
                        quic,
                        now,
                        None,
                        "the client reset the session stream".into(),
                    )),
                }
            }
            Phase::Over => {
                // The client's answer to our close: its side ends.
                if !matches!(read(quic, id, usize::MAX, None), End::Open) {
                    self.close_now(quic, now);
                }
                None
            }
        }
    }

    /// The client closed the session: the connection has nothing more to carry.
    fn peer_closed(
        &mut self,
        quic: &mut Connection,
        now: Instant,
        code: Option<u32>,
        reason: String,
    ) -> SessionEvent {
        self.phase = Phase::Over;
        self.inbound = Vec::new();
        quic.close(now, H3_NO_ERROR.into(), bytes::Bytes::new());
        SessionEvent::Closed { code, reason }
    }

    /// Writes what waits for the CONNECT stream; finishes it when asked.
    pub fn write_connect(&mut self, quic: &mut Connection, now: Instant) {
        let Some(id) = self.connect else { return };
        if flush(quic, id, &mut self.connect_out) && self.finish_connect {
            self.finish_connect = false;
            if quic.send_stream(id).finish().is_err() {
                self.close_now(quic, now);
            }
        }
    }

    pub fn is_connect(&self, id: StreamId) -> bool {
        self.connect == Some(id)
    }

    pub fn is_own_control(&self, id: StreamId) -> bool {
        self.own_control == Some(id)
    }

    pub fn write_own_control(&mut self, quic: &mut Connection) {
        if let Some(id) = self.own_control {
            flush(quic, id, &mut self.control_out);
        }
    }

    /// The push streams were opened: each starts with its header.
    pub fn push_opened(&mut self) {
        let session = self.session_id().unwrap_or(0);
        for header in &mut self.push_headers {
            *header = varints(&[StreamUni::WEBTRANSPORT.0.into_inner(), session]);
        }
    }

    /// Writes the rest of push stream `tier`'s header: `true` once it is out.
    pub fn push_header(&mut self, quic: &mut Connection, tier: usize, id: StreamId) -> bool {
        match self.push_headers.get_mut(tier) {
            // A failed write drops the header: the frame's own write then
            // tells the session the stream is gone.
            Some(header) => {
                flush(quic, id, header);
                header.is_empty()
            }
            None => false,
        }
    }

    /// Closes the session with a close capsule; the QUIC connection closes
    /// once the client has ended its side of the CONNECT stream, which it
    /// does after taking in the capsule (or after [`CLOSE_LINGER`]). Closing
    /// when the capsule is acknowledged is too early: a browser acknowledges
    /// it before its page has the close code, and a page told of a
    /// connection close first sees a lost connection, not the close code.
    /// Before the session is established there is no capsule to send:
    /// `false`.
    pub fn close(&mut self, quic: &mut Connection, now: Instant, code: u32, text: &[u8]) -> bool {
        if self.phase != Phase::Established || self.connect.is_none() {
            return false;
        }
        self.phase = Phase::Over;
        let mut end = text.len().min(MAX_REASON_BYTES);
        let reason = loop {
            match std::str::from_utf8(&text[..end]) {
                Ok(s) => break s.to_owned(),
                Err(e) => end = e.valid_up_to(),
            }
        };
        let capsule = Capsule::CloseWebTransportSession { code, reason };
        capsule.encode(&mut self.connect_out);
        self.finish_connect = true;
        self.closing = Some((now + CLOSE_LINGER, text.to_vec()));
        self.write_connect(quic, now);
        true
    }

    fn close_now(&mut self, quic: &mut Connection, now: Instant) {
        if let Some((_, text)) = self.closing.take() {
            quic.close(now, H3_NO_ERROR.into(), text.into());
        }
    }

    /// When a server close gives up waiting for the client.
    pub fn deadline(&self) -> Option<Instant> {
        self.closing.as_ref().map(|(by, _)| *by)
    }

    pub fn handle_timeout(&mut self, quic: &mut Connection, now: Instant) {
        if self.deadline().is_some_and(|by| by <= now) {
            self.close_now(quic, now);
        }
    }
}

fn http_status(code: u16) -> web_transport_proto::http::StatusCode {
    use web_transport_proto::http::StatusCode;
    StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST)
}
