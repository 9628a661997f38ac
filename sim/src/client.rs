//! A simulated device: a sans-IO client over a real quinn-proto client
//! `Endpoint` and `Connection` (seeded), speaking greendot's wire protocol
//! with the real frame types and codec, and keeping what it is told in the
//! core's real `View`.
//!
//! Departure: this is not `greendot_client` (the async library,
//! which owns a socket and tasks); its protocol logic (hello with resume,
//! requests and replies by id, the two push streams, a `View` that only takes
//! newer versions, forgetting on a non-resumed welcome) is re-driven here
//! without IO, so that time and the network are the simulator's.

use bytes::{Bytes, BytesMut};
use greendot_core::{UserId, View};
use greendot_proto::{
    self as proto, decode, encode_frame, Answer, CloseCode, FrameReader, Hello, Push, Request,
    RequestFrame, ServerFrame, Tier,
};
use quinn_proto::{
    ClientConfig, ConnectionError, ConnectionHandle, DatagramEvent, Dir, Endpoint, EndpointConfig,
    Event, StreamEvent, StreamId, VarInt,
};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests a client keeps unanswered at most (it waits for replies before
/// sending more), which bounds its send buffer.
pub const MAX_PENDING: usize = 4;

/// What happened to a client, for the simulator's checks.
#[derive(Clone, Debug)]
pub enum ClientEvent {
    Welcomed {
        session: u64,
        resumed: bool,
        /// The subscriptions carried over (by a resume), with their tiers.
        subs: Vec<(String, Tier)>,
    },
    /// A snapshot (on the control stream) or a push (on a push stream).
    Update {
        target: String,
        presence: proto::Presence,
        push: Option<Tier>,
    },
    Answered {
        request: Request,
        result: Result<Answer, proto::WireError>,
        sent: Duration,
    },
    /// A connection-level error frame from the server.
    ErrorFrame(proto::WireError),
    Lost {
        reason: ConnectionError,
        welcomed: bool,
        logout_sent: bool,
        opened_at: Duration,
    },
    /// The server broke the protocol (a bad frame, an unknown reply id...).
    Broken(String),
}

struct PushStream {
    id: StreamId,
    reader: FrameReader,
    tier: Option<Tier>,
    /// Per target, the last version pushed on this stream.
    last: BTreeMap<String, u64>,
}

pub struct Pending {
    pub request: Request,
    pub sent: Duration,
}

/// One QUIC connection of a client.
pub struct Live {
    ch: ConnectionHandle,
    conn: quinn_proto::Connection,
    control: Option<StreamId>,
    /// Bytes of the control stream not yet accepted by QUIC.
    out: Vec<u8>,
    reader: FrameReader,
    pushes: Vec<PushStream>,
    pub welcomed: Option<u64>,
    pub pending: BTreeMap<u64, Pending>,
    /// When a Logout was answered `Done`.
    pub logout_answered: Option<Duration>,
    pub logout_sent: bool,
    pub opened_at: Duration,
    pub lost: bool,
    /// The server process this connection was welcomed by.
    pub epoch: u32,
}

impl Live {
    pub fn is_open(&self) -> bool {
        !self.lost
    }
}

pub struct Client {
    pub index: usize,
    pub user: usize,
    pub user_name: String,
    pub device_name: String,
    pub kind: proto::Kind,
    token: String,
    endpoint: Endpoint,
    config: ClientConfig,
    server: SocketAddr,
    pub addr: SocketAddr,
    pub live: Option<Live>,
    /// The latest welcome's session, for the next hello's `resume`.
    pub resume: Option<u64>,
    pub view: View,
    next_id: u64,
    /// The client does not read its streams (its application is stuck).
    pub stalled: bool,
    buf: Vec<u8>,
}

/// The core's view is keyed by user id; the simulator names user `i`
/// `u{i}` and keys it `UserId(i)`.
pub fn user_key(name: &str) -> Option<UserId> {
    name.strip_prefix('u')?.parse().ok().map(UserId)
}

impl Client {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: usize,
        user: usize,
        device: usize,
        kind: proto::Kind,
        token: String,
        config: ClientConfig,
        server: SocketAddr,
        addr: SocketAddr,
        seed: [u8; 32],
        reset_key: [u8; 32],
    ) -> Client {
        let mut endpoint_config = EndpointConfig::new(Arc::new(ring::hmac::Key::new(
            ring::hmac::HMAC_SHA256,
            &reset_key,
        )));
        let cid_seed = u64::from_le_bytes(seed[..8].try_into().unwrap_or([0; 8]));
        let generators = std::sync::atomic::AtomicU64::new(0);
        endpoint_config.cid_generator(move || {
            let n = generators.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::new(SeededCids(crate::rng::Rng::new(
                cid_seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            )))
        });
        Client {
            index,
            user,
            user_name: format!("u{user}"),
            device_name: format!("d{device}"),
            kind,
            token,
            endpoint: Endpoint::new(Arc::new(endpoint_config), None, false, Some(seed)),
            config,
            server,
            addr,
            live: None,
            resume: None,
            view: View::new(),
            next_id: 0,
            stalled: false,
            buf: Vec::new(),
        }
    }

    /// Opens a connection (the hello goes once QUIC is connected), resuming
    /// the last session if `resume`.
    pub fn connect(&mut self, now: Instant, at: Duration, epoch: u32) -> Result<(), String> {
        let (ch, conn) = self
            .endpoint
            .connect(now, self.config.clone(), self.server, "localhost")
            .map_err(|e| format!("connect: {e}"))?;
        self.live = Some(Live {
            ch,
            conn,
            control: None,
            out: Vec::new(),
            reader: FrameReader::new(proto::MAX_SERVER_FRAME),
            pushes: Vec::new(),
            welcomed: None,
            pending: BTreeMap::new(),
            logout_answered: None,
            logout_sent: false,
            opened_at: at,
            lost: false,
            epoch,
        });
        Ok(())
    }

    /// Sends a request; `None` if there is no welcomed connection or too
    /// many requests wait.
    pub fn request(&mut self, at: Duration, request: Request) -> Option<u64> {
        let live = self
            .live
            .as_mut()
            .filter(|l| l.is_open() && l.welcomed.is_some())?;
        if live.pending.len() >= MAX_PENDING || live.logout_sent {
            return None;
        }
        self.next_id += 1;
        let id = self.next_id;
        let frame = encode_frame(&RequestFrame {
            id,
            request: request.clone(),
        })
        .ok()?;
        live.logout_sent = matches!(request, Request::Logout);
        live.out.extend_from_slice(&frame);
        live.pending.insert(id, Pending { request, sent: at });
        Some(id)
    }

    /// Vanishes: the connection is dropped without a word.
    pub fn kill(&mut self) {
        self.live = None;
    }

    /// Closes with `code` (the connection then drains).
    pub fn close(&mut self, now: Instant, code: CloseCode) {
        if let Some(live) = self.live.as_mut() {
            live.conn.close(
                now,
                VarInt::from_u32(code as u32),
                Bytes::from_static(b"bye"),
            );
        }
    }

    /// The client's address changed (NAT rebinding, another network).
    pub fn migrate(&mut self, addr: SocketAddr) {
        self.addr = addr;
        if let Some(live) = self.live.as_mut() {
            live.conn.local_address_changed();
        }
    }

    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.live.as_mut().and_then(|l| l.conn.poll_timeout())
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(live) = self.live.as_mut() {
            live.conn.handle_timeout(now);
        }
    }

    /// A datagram for this client.
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        data: Vec<u8>,
        out: &mut Vec<(SocketAddr, Vec<u8>)>,
    ) {
        let mut buf = Vec::new();
        let event =
            self.endpoint
                .handle(now, from, None, None, BytesMut::from(&data[..]), &mut buf);
        match event {
            Some(DatagramEvent::ConnectionEvent(ch, event)) => {
                if let Some(live) = self.live.as_mut().filter(|l| l.ch == ch) {
                    live.conn.handle_event(event);
                }
            }
            Some(DatagramEvent::Response(t)) => {
                buf.truncate(t.size);
                out.push((t.destination, buf));
            }
            Some(DatagramEvent::NewConnection(_)) | None => {}
        }
    }

    /// Handles what the connection has to say, reads and writes its streams,
    /// and collects its datagrams.
    pub fn drive(
        &mut self,
        now: Instant,
        at: Duration,
        events: &mut Vec<ClientEvent>,
        out: &mut Vec<(SocketAddr, Vec<u8>)>,
    ) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        while let Some(event) = live.conn.poll() {
            match event {
                Event::Connected => {
                    let hello = Hello {
                        version: proto::VERSION,
                        token: self.token.clone(),
                        resume: self.resume,
                        foreground: true,
                    };
                    match (live.conn.streams().open(Dir::Bi), encode_frame(&hello)) {
                        (Some(id), Ok(frame)) => {
                            live.control = Some(id);
                            live.out.splice(0..0, frame);
                        }
                        _ => events.push(ClientEvent::Broken("no control stream".into())),
                    }
                }
                Event::ConnectionLost { reason } => {
                    live.lost = true;
                    events.push(ClientEvent::Lost {
                        reason,
                        welcomed: live.welcomed.is_some(),
                        logout_sent: live.logout_sent,
                        opened_at: live.opened_at,
                    });
                }
                Event::Stream(StreamEvent::Opened { dir: Dir::Uni }) => {
                    while let Some(id) = live.conn.streams().accept(Dir::Uni) {
                        live.pushes.push(PushStream {
                            id,
                            reader: FrameReader::new(proto::MAX_SERVER_FRAME),
                            tier: None,
                            last: BTreeMap::new(),
                        });
                    }
                }
                _ => {}
            }
        }
        if !live.lost {
            // Write what waits for the control stream.
            if let Some(id) = live.control {
                if !live.out.is_empty() {
                    if let Ok(n) = live.conn.send_stream(id).write(&live.out) {
                        live.out.drain(..n);
                    }
                }
            }
            if !self.stalled {
                read_all(live, at, &mut self.view, &mut self.resume, events);
            }
        }
        while let Some(event) = live.conn.poll_endpoint_events() {
            if let Some(event) = self.endpoint.handle_event(live.ch, event) {
                live.conn.handle_event(event);
            }
        }
        loop {
            self.buf.clear();
            let Some(t) = live.conn.poll_transmit(now, 1, &mut self.buf) else {
                break;
            };
            out.push((t.destination, self.buf[..t.size].to_vec()));
        }
    }

    /// Whether the connection is over and its state may go (after its
    /// events were handled: see [`Client::reap`]).
    pub fn is_drained(&self) -> bool {
        self.live.as_ref().is_some_and(|l| l.conn.is_drained())
    }

    pub fn reap(&mut self) {
        if self.is_drained() {
            self.live = None;
        }
    }

    /// Bytes this client buffers (for the bound checks).
    pub fn buffered(&self) -> usize {
        self.live.as_ref().map_or(0, |l| {
            l.out.len()
                + l.reader.pending()
                + l.pushes.iter().map(|p| p.reader.pending()).sum::<usize>()
        })
    }
}

fn read_stream(
    conn: &mut quinn_proto::Connection,
    id: StreamId,
    reader: &mut FrameReader,
) -> Result<(), String> {
    let mut recv = conn.recv_stream(id);
    let Ok(mut chunks) = recv.read(true) else {
        return Ok(());
    };
    let mut result = Ok(());
    loop {
        match chunks.next(usize::MAX) {
            Ok(Some(chunk)) => reader.push(&chunk.bytes),
            Ok(None) => break,
            Err(quinn_proto::ReadError::Blocked) => break,
            Err(e) => {
                result = Err(format!("stream {id} reset: {e}"));
                break;
            }
        }
    }
    let _ = chunks.finalize();
    result
}

fn read_all(
    live: &mut Live,
    at: Duration,
    view: &mut View,
    resume: &mut Option<u64>,
    events: &mut Vec<ClientEvent>,
) {
    if let Some(id) = live.control {
        if let Err(e) = read_stream(&mut live.conn, id, &mut live.reader) {
            events.push(ClientEvent::Broken(e));
        }
        loop {
            let frame = match live.reader.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    events.push(ClientEvent::Broken(format!("control stream: {e}")));
                    break;
                }
            };
            match decode::<ServerFrame>(&frame) {
                Ok(frame) => on_control(live, at, frame, view, resume, events),
                Err(e) => events.push(ClientEvent::Broken(format!("control frame: {e}"))),
            }
        }
    }
    for push in &mut live.pushes {
        if let Err(e) = read_stream(&mut live.conn, push.id, &mut push.reader) {
            events.push(ClientEvent::Broken(e));
        }
        loop {
            let frame = match push.reader.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    events.push(ClientEvent::Broken(format!("push stream: {e}")));
                    break;
                }
            };
            match (decode::<Push>(&frame), push.tier) {
                (Ok(Push::Stream { tier }), None) => push.tier = Some(tier),
                (Ok(Push::Update { target, presence }), Some(tier)) => {
                    let last = push.last.entry(target.clone()).or_insert(0);
                    if presence.version <= *last {
                        events.push(ClientEvent::Broken(format!(
                            "I7: {tier:?} push of {target} v{} after v{last}",
                            presence.version
                        )));
                    }
                    *last = presence.version;
                    if let Some(key) = user_key(&target) {
                        view.apply(key, presence.to_core());
                    }
                    events.push(ClientEvent::Update {
                        target,
                        presence,
                        push: Some(tier),
                    });
                }
                (other, tier) => events.push(ClientEvent::Broken(format!(
                    "push stream of tier {tier:?}: unexpected {other:?}"
                ))),
            }
        }
    }
}

fn snapshot(view: &mut View, s: proto::Snapshot, events: &mut Vec<ClientEvent>) {
    if let Some(key) = user_key(&s.target) {
        view.apply(key, s.presence.to_core());
    }
    events.push(ClientEvent::Update {
        target: s.target,
        presence: s.presence,
        push: None,
    });
}

fn on_control(
    live: &mut Live,
    _at: Duration,
    frame: ServerFrame,
    view: &mut View,
    resume: &mut Option<u64>,
    events: &mut Vec<ClientEvent>,
) {
    match frame {
        ServerFrame::Welcome(w) => {
            if live.welcomed.is_some() {
                events.push(ClientEvent::Broken("a second welcome".into()));
                return;
            }
            live.welcomed = Some(w.session);
            *resume = Some(w.session);
            if !w.resumed {
                // Perhaps another process, whose versions begin again.
                *view = View::new();
            }
            events.push(ClientEvent::Welcomed {
                session: w.session,
                resumed: w.resumed,
                subs: w
                    .snapshots
                    .iter()
                    .map(|s| (s.target.clone(), s.tier))
                    .collect(),
            });
            for s in w.snapshots {
                snapshot(view, s, events);
            }
        }
        ServerFrame::Reply { id, result } => {
            let Some(pending) = live.pending.remove(&id) else {
                events.push(ClientEvent::Broken(format!(
                    "reply to unknown request {id}"
                )));
                return;
            };
            if let Ok(Answer::Subscribed { snapshots, .. }) = &result {
                for s in snapshots.clone() {
                    snapshot(view, s, events);
                }
            }
            if matches!(pending.request, Request::Logout) && matches!(result, Ok(Answer::Done)) {
                live.logout_answered = Some(_at);
            }
            events.push(ClientEvent::Answered {
                request: pending.request,
                result,
                sent: pending.sent,
            });
        }
        ServerFrame::Error(e) => events.push(ClientEvent::ErrorFrame(e)),
    }
}

/// Connection ids from the client's seed.
struct SeededCids(crate::rng::Rng);

impl quinn_proto::ConnectionIdGenerator for SeededCids {
    fn generate_cid(&mut self) -> quinn_proto::ConnectionId {
        quinn_proto::ConnectionId::new(&self.0.next_u64().to_le_bytes())
    }

    fn cid_len(&self) -> usize {
        8
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}
