//! [`ServerState`] driven directly, on virtual time: quinn-proto clients
//! and the server exchange datagrams in memory, with no socket, runtime or
//! clock.

use super::*;
use crate::store::Loaded;
use crate::token::{Claims, WatchClaim};
use crate::Shed;
use greendot_proto::{
    decode, encode_frame, Hello, Kind, Push, Request, RequestFrame, ServerFrame, Status, Tier,
    ALPN, VERSION,
};
use quinn_proto::{
    ClientConfig, ConnectionError, ConnectionHandle, Dir, Event, StreamEvent, StreamId,
};

const SERVER: SocketAddr = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1)), 4433);
/// Virtual time advances by this much per step.
const TICK: Duration = Duration::from_millis(5);

/// One in-memory client: a quinn-proto endpoint and connection, with the
/// frames it got.
struct Client {
    endpoint: Endpoint,
    ch: ConnectionHandle,
    conn: quinn_proto::Connection,
    /// Where it sends from (and gets its datagrams at).
    addr: SocketAddr,
    control: Option<StreamId>,
    /// Sent on the control stream once the handshake is done.
    hello: Vec<u8>,
    answers: greendot_proto::FrameReader,
    replies: Vec<ServerFrame>,
    pushes: Vec<(StreamId, greendot_proto::FrameReader)>,
    updates: Vec<Push>,
    lost: Option<ConnectionError>,
    next_id: u64,
    /// Gets none of the server's datagrams (a spoofed source, a dead link).
    deaf: bool,
    /// Sends nothing either (a phone whose network went).
    dead: bool,
}

struct Net {
    server: ServerState,
    now: Instant,
    clients: Vec<Client>,
    events: Vec<ServerEvent>,
    store: Vec<StoreRequest>,
}

fn config() -> ServerConfig {
    ServerConfig::new(b"secret".to_vec())
}

impl Net {
    fn new(config: ServerConfig, restored: Option<Loaded>) -> Net {
        Net::seeded(config, restored, 7)
    }

    fn seeded(config: ServerConfig, restored: Option<Loaded>, seed: u64) -> Net {
        let now = Instant::now();
        let server = ServerState::new(config, now, super::super::unix_now_ms(), seed, restored)
            .expect("a server");
        Net {
            server,
            now,
            clients: Vec::new(),
            events: Vec::new(),
            store: Vec::new(),
        }
    }

    /// A client that connects and says hello as `user`/`device`.
    fn connect(&mut self, user: &str, device: &str) -> usize {
        let addr = SocketAddr::from(([10, 0, 1, self.clients.len() as u8 + 1], 5000));
        let i = self.start(user, device, addr);
        self.run_until(Duration::from_secs(5), |net| {
            matches!(
                net.clients[i].replies.first(),
                Some(ServerFrame::Welcome(_))
            )
        });
        i
    }

    fn welcomed(&self, i: usize) -> bool {
        matches!(
            self.clients[i].replies.first(),
            Some(ServerFrame::Welcome(_))
        )
    }

    /// A client that never hears the server: its handshake stays in flight.
    fn start_deaf(&mut self, user: &str, device: &str, addr: SocketAddr) -> usize {
        let i = self.start(user, device, addr);
        self.clients[i].deaf = true;
        i
    }

    /// A client from `addr` that starts its handshake (and says hello once
    /// connected), without waiting for anything.
    fn start(&mut self, user: &str, device: &str, addr: SocketAddr) -> usize {
        let i = self.clients.len();
        let mut endpoint = Endpoint::new(
            Arc::new(quinn_proto::EndpointConfig::default()),
            None,
            false,
            None,
        );
        let crypto = greendot_client::tls::client_crypto(
            std::slice::from_ref(self.server.certificate()),
            ALPN,
        )
        .unwrap();
        let (ch, conn) = endpoint
            .connect(
                self.now,
                ClientConfig::new(Arc::new(crypto)),
                SERVER,
                "localhost",
            )
            .unwrap();
        let claims = Claims::new(
            user,
            device,
            Kind::Desktop,
            WatchClaim::all(),
            Duration::from_secs(3600),
        );
        let hello = Hello {
            version: VERSION,
            token: self.server.keys().mint(&claims).unwrap(),
            resume: None,
            foreground: true,
        };
        self.clients.push(Client {
            endpoint,
            ch,
            conn,
            addr,
            control: None,
            hello: encode_frame(&hello).unwrap(),
            answers: greendot_proto::FrameReader::new(1 << 20),
            replies: Vec::new(),
            pushes: Vec::new(),
            updates: Vec::new(),
            lost: None,
            next_id: 1,
            deaf: false,
            dead: false,
        });
        i
    }

    /// A drain for a restart: Draining closes, then the save.
    fn drain(&mut self) {
        self.server.handle_input(
            self.now,
            ServerInput::Stop {
                code: CloseCode::Draining,
                text: b"draining".to_vec(),
                save: true,
            },
        );
    }

    /// Runs until the final durable write is asked for (at most 5 s).
    fn run_until_saved(&mut self) {
        self.run_until(Duration::from_secs(5), |net| {
            net.store
                .iter()
                .any(|r| matches!(r, StoreRequest::Durable { .. }))
        });
    }

    /// Sends a request; its id.
    fn request(&mut self, i: usize, request: Request) -> u64 {
        let c = &mut self.clients[i];
        let id = c.next_id;
        c.next_id += 1;
        let frame = encode_frame(&RequestFrame { id, request }).unwrap();
        let control = c.control.unwrap();
        c.conn.send_stream(control).write(&frame).unwrap();
        id
    }

    /// The reply to request `id` of client `i`, waiting for it.
    fn reply(&mut self, i: usize, id: u64) -> Option<ServerFrame> {
        let find = |net: &Net| {
            net.clients[i]
                .replies
                .iter()
                .find(|f| matches!(f, ServerFrame::Reply { id: r, .. } if *r == id))
                .cloned()
        };
        self.run_until(Duration::from_secs(10), |net| find(net).is_some());
        find(self)
    }

    fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Net) -> bool) {
        let end = self.now + limit;
        while self.now < end && !done(self) {
            self.step();
        }
    }

    fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.step();
        }
    }

    /// Everything due at `now`, then time moves on one tick.
    fn step(&mut self) {
        let now = self.now;
        for _ in 0..1000 {
            let mut moved = self.clients_send(now);
            if self.server.poll_timeout().is_some_and(|t| t <= now) {
                self.server.handle_timeout(now);
                moved = true;
            }
            while let Some(out) = self.server.poll_output() {
                match out {
                    ServerOutput::Event(e) => self.events.push(e),
                    ServerOutput::Store(r) => self.store.push(r),
                    ServerOutput::Stopped => {}
                    // No WebSocket connections in these tests.
                    ServerOutput::WsSend { .. }
                    | ServerOutput::WsPing { .. }
                    | ServerOutput::WsClose { .. }
                    | ServerOutput::WsCredit { .. } => {}
                    // No cluster in these tests.
                    ServerOutput::Cluster(out) => panic!("a cluster output on one node: {out:?}"),
                }
            }
            while let Some(t) = self.server.poll_transmit() {
                moved = true;
                if let Some(c) = self
                    .clients
                    .iter_mut()
                    .find(|c| c.addr == t.destination && !c.deaf && !c.dead)
                {
                    let mut buf = Vec::new();
                    let data = BytesMut::from(&t.contents[..]);
                    if let Some(DatagramEvent::ConnectionEvent(_, e)) =
                        c.endpoint.handle(now, SERVER, None, t.ecn, data, &mut buf)
                    {
                        c.conn.handle_event(e);
                    }
                }
                self.server.recycle(t.contents);
            }
            if !moved {
                break;
            }
        }
        if let Err(e) = self.server.check() {
            panic!("the state's bookkeeping broke: {e}");
        }
        self.now += TICK;
    }

    /// Lets every client handle its events, timers and transmits; whether
    /// any sent something.
    fn clients_send(&mut self, now: Instant) -> bool {
        let mut sent = false;
        for c in self.clients.iter_mut().filter(|c| !c.dead) {
            if c.conn.poll_timeout().is_some_and(|t| t <= now) {
                c.conn.handle_timeout(now);
            }
            while let Some(e) = c.conn.poll_endpoint_events() {
                if let Some(back) = c.endpoint.handle_event(c.ch, e) {
                    c.conn.handle_event(back);
                }
            }
            while let Some(event) = c.conn.poll() {
                match event {
                    Event::ConnectionLost { reason } => c.lost = Some(reason),
                    Event::Connected => {
                        let id = c.conn.streams().open(Dir::Bi).expect("a control stream");
                        c.conn.send_stream(id).write(&c.hello).unwrap();
                        c.control = Some(id);
                    }
                    Event::Stream(StreamEvent::Opened { dir: Dir::Uni }) => {
                        while let Some(id) = c.conn.streams().accept(Dir::Uni) {
                            c.pushes
                                .push((id, greendot_proto::FrameReader::new(1 << 20)));
                        }
                    }
                    _ => {}
                }
            }
            c.read();
            let mut buf = Vec::new();
            while let Some(t) = c.conn.poll_transmit(now, 1, &mut buf) {
                sent = true;
                let datagram = Datagram {
                    remote: c.addr,
                    local_ip: None,
                    ecn: t.ecn,
                    data: BytesMut::from(&buf[..t.size]),
                };
                self.server.handle_datagram(now, datagram);
                buf.clear();
            }
        }
        sent
    }
}

impl Client {
    /// Reads the control stream's answers and the push streams' updates.
    fn read(&mut self) {
        if let Some(id) = self.control {
            read_stream(&mut self.conn, id, &mut self.answers);
            while let Ok(Some(payload)) = self.answers.next_frame() {
                self.replies.push(decode(&payload).expect("a server frame"));
            }
        }
        for (id, reader) in &mut self.pushes {
            read_stream(&mut self.conn, *id, reader);
            while let Ok(Some(payload)) = reader.next_frame() {
                self.updates.push(decode(&payload).expect("a push"));
            }
        }
    }

    fn pushed_updates(&self) -> usize {
        self.updates
            .iter()
            .filter(|p| matches!(p, Push::Update { .. }))
            .count()
    }
}

fn read_stream(
    conn: &mut quinn_proto::Connection,
    id: StreamId,
    reader: &mut greendot_proto::FrameReader,
) {
    let mut recv = conn.recv_stream(id);
    let Ok(mut chunks) = recv.read(true) else {
        return;
    };
    while let Ok(Some(chunk)) = chunks.next(usize::MAX) {
        reader.push(&chunk.bytes);
    }
    let _ = chunks.finalize();
}

fn application_close(lost: &Option<ConnectionError>) -> Option<CloseCode> {
    match lost {
        Some(ConnectionError::ApplicationClosed(close)) => {
            CloseCode::from_code(close.error_code.into_inner())
        }
        _ => None,
    }
}

#[test]
fn a_session_runs_on_virtual_time_with_no_socket() {
    let mut net = Net::new(config(), None);
    let ann = net.connect("ann", "laptop");
    let bob = net.connect("bob", "phone");
    let sub = net.request(
        bob,
        Request::Subscribe {
            targets: vec!["ann".into()],
            tier: Tier::Realtime,
        },
    );
    assert!(matches!(
        net.reply(bob, sub),
        Some(ServerFrame::Reply { result: Ok(_), .. })
    ));
    let set = net.request(
        ann,
        Request::SetStatus {
            status: Status::Busy,
            message: Some("deep work".into()),
        },
    );
    assert!(net.reply(ann, set).is_some());
    // Published after the debounce, pushed on bob's realtime stream.
    net.run_until(Duration::from_secs(2), |net| {
        net.clients[bob].updates.iter().any(|p| {
            matches!(p, Push::Update { target, presence } if target == "ann" && presence.status == Status::Busy)
        })
    });
    assert!(
        net.clients[bob].updates.iter().any(|p| matches!(
            p,
            Push::Update { presence, .. } if presence.status == Status::Busy
        )),
        "bob never saw ann busy: {:?}",
        net.clients[bob].updates
    );
    let connected = net
        .events
        .iter()
        .filter(|e| matches!(e, ServerEvent::Connected { .. }))
        .count();
    assert_eq!(connected, 2);
    assert_eq!(net.server.stats().connections_open, 2);
}

/// A durable change is answered only once the store's ticket comes back,
/// and a later request of the same connection waits behind it; a ticket
/// that never comes back is answered "not saved" after `store_timeout`.
#[test]
fn a_durable_change_waits_for_its_store_ticket() {
    let mut c = config();
    c.store_timeout = Duration::from_millis(500);
    let mut net = Net::new(c, Some(Loaded::default()));
    let ann = net.connect("ann", "laptop");
    net.store.clear();
    let set = net.request(ann, Request::SetInvisible { invisible: true });
    let ping = net.request(ann, Request::Ping);
    net.run_until(Duration::from_millis(300), |net| !net.store.is_empty());
    let ticket = match net.store.pop() {
        Some(StoreRequest::Durable { ticket, batch, .. }) => {
            assert_eq!(batch.users.len(), 1);
            ticket
        }
        other => panic!("no durable write asked: {other:?}"),
    };
    net.run_for(Duration::from_millis(200));
    assert!(
        net.clients[ann].replies.len() == 1,
        "answered before the store committed: {:?}",
        net.clients[ann].replies
    );
    net.server.handle_input(
        net.now,
        ServerInput::StoreDone {
            ticket,
            result: Ok(()),
        },
    );
    let ok = |f: Option<ServerFrame>| matches!(f, Some(ServerFrame::Reply { result: Ok(_), .. }));
    assert!(ok(net.reply(ann, set)));
    assert!(ok(net.reply(ann, ping)));
    // In order: the change, then the ping behind it.
    let ids: Vec<u64> = net.clients[ann]
        .replies
        .iter()
        .filter_map(|f| match f {
            ServerFrame::Reply { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    assert_eq!(ids, vec![set, ping]);

    // No answer from the store: "not saved" after the timeout, not never.
    let set = net.request(ann, Request::SetInvisible { invisible: false });
    match net.reply(ann, set) {
        Some(ServerFrame::Reply { result: Err(e), .. }) => {
            assert!(e.message.contains("could not be saved"), "{e:?}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn migration_keeps_the_session_and_the_mutant_ends_it() {
    for mutant in [None, Some(ServerMutant::MigrationAsDisconnect)] {
        let mut c = config();
        c.mutant = mutant;
        let mut net = Net::new(c, None);
        let ann = net.connect("ann", "laptop");
        // A NAT rebinding: same client, new address.
        net.clients[ann].addr = SocketAddr::from(([10, 0, 9, 9], 6000));
        let ping = net.request(ann, Request::Ping);
        net.run_until(Duration::from_secs(3), |net| {
            net.clients[ann].lost.is_some()
                || net.clients[ann]
                    .replies
                    .iter()
                    .any(|f| matches!(f, ServerFrame::Reply { id, .. } if *id == ping))
        });
        net.run_for(Duration::from_millis(500));
        assert!(net
            .events
            .iter()
            .any(|e| matches!(e, ServerEvent::Migrated { .. })));
        let closed = net
            .events
            .iter()
            .any(|e| matches!(e, ServerEvent::Closed { logout: false, .. }));
        match mutant {
            None => {
                assert!(!closed && net.clients[ann].lost.is_none());
                assert_eq!(net.server.counters().sessions_online, 1);
            }
            Some(_) => {
                assert!(closed, "the mutant did not end the session");
                assert_eq!(net.server.counters().disconnects, 1);
            }
        }
    }
}

#[test]
fn traffic_renews_the_lease_and_the_mutant_does_not() {
    for mutant in [None, Some(ServerMutant::LeaseNotRenewedOnTraffic)] {
        let mut c = config();
        for kind in c.core.kinds.iter_mut() {
            kind.heartbeat_timeout = greendot_core::Millis(2_000);
        }
        // QUIC keep-alives (answered by the client) are the only traffic.
        c.keep_alive = Duration::from_millis(400);
        c.mutant = mutant;
        let mut net = Net::new(c, None);
        let ann = net.connect("ann", "laptop");
        net.run_for(Duration::from_secs(6));
        let code = application_close(&net.clients[ann].lost);
        match mutant {
            None => assert_eq!(code, None, "a live client was reaped"),
            Some(_) => assert_eq!(code, Some(CloseCode::SessionExpired)),
        }
    }
}

#[test]
fn no_push_after_logout_and_the_mutant_pushes() {
    for mutant in [None, Some(ServerMutant::PushAfterLogout)] {
        let mut c = config();
        c.mutant = mutant;
        let mut net = Net::new(c, None);
        let ann = net.connect("ann", "laptop");
        let bob = net.connect("bob", "phone");
        let sub = net.request(
            bob,
            Request::Subscribe {
                targets: vec!["ann".into()],
                tier: Tier::Realtime,
            },
        );
        net.reply(bob, sub);
        net.run_for(Duration::from_secs(1));
        let logout = net.request(bob, Request::Logout);
        assert!(net.reply(bob, logout).is_some());
        let before = net.clients[bob].pushed_updates();
        let set = net.request(
            ann,
            Request::SetStatus {
                status: Status::Away,
                message: None,
            },
        );
        net.reply(ann, set);
        net.run_for(Duration::from_secs(2));
        let after = net.clients[bob].pushed_updates() - before;
        match mutant {
            None => {
                assert_eq!(after, 0, "a push reached a logged-out session");
                assert_eq!(
                    application_close(&net.clients[bob].lost),
                    Some(CloseCode::Logout)
                );
            }
            Some(_) => assert!(after > 0, "the mutant pushed nothing after the logout"),
        }
    }
}

/// The same scenario from the same seed gives the same events (sessions
/// named the same, in the same order); another seed names them otherwise.
#[test]
fn the_same_seed_gives_the_same_run() {
    let run = |seed| {
        let mut net = Net::seeded(config(), None, seed);
        let ann = net.connect("ann", "laptop");
        let bob = net.connect("bob", "phone");
        net.clients[ann].addr = SocketAddr::from(([10, 0, 9, 9], 6000));
        net.request(ann, Request::Ping);
        let logout = net.request(bob, Request::Logout);
        net.reply(bob, logout);
        net.run_for(Duration::from_secs(1));
        net.events
    };
    let (a, b, c) = (run(3), run(3), run(4));
    assert!(a.len() >= 4, "{a:?}");
    assert_eq!(a, b);
    assert_ne!(a, c);
}

/// The seed decides the state's randomness: the same seed, the same
/// session key and keep-alive picks.
#[test]
fn the_seed_decides_the_randomness() {
    let now = Instant::now();
    let state = |seed| ServerState::new(config(), now, 1_000, seed, None).unwrap();
    let (mut a, mut b, mut c) = (state(1), state(1), state(2));
    let s = SessionId(42);
    assert_eq!(a.wire(s), b.wire(s));
    assert_ne!(a.wire(s), c.wire(s));
    let picks = |x: &mut ServerState| -> Vec<Duration> {
        (0..32).map(|_| x.accept.pick().unwrap().0).collect()
    };
    assert_eq!(picks(&mut a), picks(&mut b));
    assert_ne!(picks(&mut a), picks(&mut c));
}

/// The wall clock may step either way; the core's time is never stepped
/// (a forward step taken at once reaped every session: found by the
/// simulator) but slewed by at most 1%, and never goes back.
#[test]
fn a_wall_clock_step_is_slewed_in_never_taken_at_once() {
    let t0 = Instant::now();
    let mut clock = Clock::new(t0, 1_000_000);
    let t1 = t0 + Duration::from_secs(10);
    assert_eq!(clock.at(t1), Millis(1_010_000));
    // A step back: time goes on, 1% slower, until the wall clock caught up.
    clock.set(t1, 1_009_000);
    assert_eq!(clock.at(t1), Millis(1_010_000));
    assert_eq!(clock.at(t1 + Duration::from_secs(1)), Millis(1_010_990));
    assert_eq!(clock.at(t1 + Duration::from_secs(100)), Millis(1_109_000));
    assert_eq!(clock.at(t1 + Duration::from_secs(200)), Millis(1_209_000));
    // A step forward by an hour: one second later the core is 10 ms ahead,
    // not an hour (a heartbeat timeout of 60 s is never crossed at once).
    let t2 = t1 + Duration::from_secs(200);
    clock.set(t2, 1_209_000 + 3_600_000);
    assert_eq!(clock.at(t2 + Duration::from_secs(1)), Millis(1_210_010));
    assert_eq!(clock.at(t2 + Duration::from_secs(60)), Millis(1_269_600));
    // Caught up after 100 hours; then it runs at the wall clock's rate.
    let caught = t2 + Duration::from_secs(360_000);
    assert_eq!(
        clock.at(caught),
        Millis(1_209_000 + 3_600_000 + 360_000_000)
    );
    assert_eq!(
        clock.at(caught + Duration::from_secs(1)),
        Millis(1_209_000 + 3_600_000 + 360_001_000)
    );
}

/// A core deadline maps back to an instant at which the clock has reached
/// it (and not much later), while slewing either way and after.
#[test]
fn a_core_deadline_maps_to_the_instant_it_falls_due() {
    let t0 = Instant::now();
    for pending in [0i64, 5, -5, 3_600_000, -3_600_000] {
        let mut clock = Clock::new(t0, 1_000_000);
        clock.set(t0, (1_000_000 + pending) as u64);
        for run in [
            0u64, 1, 99, 100, 101, 1_000, 505, 500, 499, 60_000, 10_000_000,
        ] {
            let due = Millis(1_000_000 + run);
            let at = clock.instant(due).unwrap();
            assert!(clock.at(at) >= due, "pending {pending} run {run}: early");
            if run >= 3 {
                let before = at - Duration::from_millis(3);
                assert!(clock.at(before) < due, "pending {pending} run {run}: late");
            }
        }
    }
}

/// A drain: every client is closed with `Draining` (and a reconnect
/// spread), then the store is written with the live devices, and only once
/// that write's ticket comes back is the state stopped.
#[test]
fn a_drain_closes_everyone_then_saves_the_live_devices_then_stops() {
    let mut net = Net::new(config(), Some(Loaded::default()));
    let ann = net.connect("ann", "laptop");
    let bob = net.connect("bob", "phone");
    net.store.clear();
    net.drain();
    assert!(net.server.is_stopping());
    net.run_until_saved();
    for c in [ann, bob] {
        match &net.clients[c].lost {
            Some(ConnectionError::ApplicationClosed(close)) => {
                assert_eq!(close.error_code, CloseCode::Draining.varint());
                assert!(String::from_utf8_lossy(&close.reason).contains("retry_ms="));
            }
            other => panic!("not drained: {other:?}"),
        }
    }
    let ticket = match net.store.pop() {
        Some(StoreRequest::Durable { ticket, batch, .. }) => {
            let mut drained: Vec<String> = batch
                .drained
                .expect("the live devices")
                .into_iter()
                .map(|d| d.user)
                .collect();
            drained.sort();
            assert_eq!(drained, ["ann", "bob"]);
            ticket
        }
        other => panic!("{other:?}"),
    };
    assert!(
        net.server.poll_timeout().is_some(),
        "stopped before the save"
    );
    net.server.handle_input(
        net.now,
        ServerInput::StoreDone {
            ticket,
            result: Ok(()),
        },
    );
    assert!(matches!(
        net.server.poll_output(),
        Some(ServerOutput::Stopped)
    ));
    assert_eq!(net.server.poll_timeout(), None);
}

/// Devices a saving drain disconnects stay live until the save, even past
/// their grace: the next process restores them (with their grace there).
#[test]
fn a_drain_saves_devices_whose_grace_ran_out_meanwhile() {
    let mut config = config();
    config
        .core
        .kind_mut(greendot_core::DeviceKind::Desktop)
        .grace = greendot_core::Millis(1);
    let mut net = Net::new(config, Some(Loaded::default()));
    for u in ["ann", "bob", "cy"] {
        net.connect(u, "laptop");
    }
    net.store.clear();
    net.drain();
    net.run_until_saved();
    match net.store.pop() {
        Some(StoreRequest::Durable { batch, .. }) => {
            let mut users: Vec<String> = batch
                .drained
                .expect("the live devices")
                .into_iter()
                .map(|d| d.user)
                .collect();
            users.sort();
            assert_eq!(
                users,
                ["ann", "bob", "cy"],
                "a device expired during the drain"
            );
        }
        other => panic!("no final save: {other:?}"),
    }
}

/// A process that crashed (no close sent) and was started again with the
/// same secret answers its predecessor's clients with a stateless reset they
/// accept, so they reconnect at once rather than after their idle timeout;
/// a server with another secret cannot (its reset token is not theirs).
#[test]
fn a_restarted_process_resets_its_predecessors_connections() {
    for (secret, resets) in [(&b"secret"[..], true), (&b"another secret"[..], false)] {
        let mut net = Net::seeded(config(), None, 7);
        let ann = net.connect("ann", "laptop");
        net.server = ServerState::new(
            ServerConfig::new(secret.to_vec()),
            net.now,
            super::super::unix_now_ms(),
            8,
            None,
        )
        .expect("a server");
        net.request(ann, Request::Ping);
        net.run_until(Duration::from_secs(2), |net| {
            net.clients[ann].lost.is_some()
        });
        let lost = &net.clients[ann].lost;
        if resets {
            assert!(
                matches!(lost, Some(ConnectionError::Reset)),
                "not reset by the restarted process: {lost:?}"
            );
        } else {
            assert!(
                lost.is_none(),
                "reset by a server of another secret: {lost:?}"
            );
        }
    }
}

/// Whether others are shown `user` online.
fn online(net: &Net, user: &str) -> bool {
    let hub = net.server.hub();
    hub.user_id(user).is_some_and(|u| hub.core().is_online(u))
}

/// What a drain saved: ann's web laptop was live.
fn ann_drained() -> Loaded {
    Loaded {
        clean: true,
        drained: vec![crate::hub::LiveDevice {
            user: "ann".into(),
            device: "laptop".into(),
            kind: Kind::Web,
        }],
        ..Loaded::default()
    }
}

/// A device restored after a drain lingers for its grace plus the
/// estimated readmission time; while the server still sheds handshakes it
/// is held longer (it may be waiting for its turn), and once the shedding
/// stops its grace runs out as usual.
#[test]
fn restored_devices_are_held_while_the_server_sheds() {
    let ann_online = |net: &Net| online(net, "ann");
    let drained = ann_drained;
    // Web grace 10 s, readmission of one device 1 s.
    let first = Duration::from_secs(11);
    for shedding in [false, true] {
        let mut net = Net::new(config(), Some(drained()));
        assert!(ann_online(&net));
        let shed_for = first + Duration::from_secs(20);
        let start = net.now;
        while net.now < start + shed_for {
            if shedding {
                net.server.stats.shed(Shed::Rate);
            }
            net.run_for(Duration::from_millis(250));
            if !shedding && net.now >= start + first + Duration::from_millis(500) {
                break;
            }
        }
        if !shedding {
            assert!(
                !ann_online(&net),
                "no shedding: held past grace and readmission"
            );
            continue;
        }
        assert!(
            ann_online(&net),
            "shown offline while the server was still shedding"
        );
        // Shedding over: at most the retry spread, the step and her grace later.
        let stopped = net.now;
        net.run_until(Duration::from_secs(30), |net| !ann_online(net));
        let held = net.now - stopped;
        assert!(!ann_online(&net), "held after the shedding stopped");
        assert!(
            held >= Duration::from_secs(10) && held <= Duration::from_secs(17),
            "offline {held:?} after the shedding stopped"
        );
    }
}

/// A device that got back in a restart's herd and is lost again while the
/// server still sheds handshakes waits its turn like the restored ones: held
/// while the shedding lasts, its grace runs out after it.
#[test]
fn a_device_lost_again_while_the_server_sheds_is_held_too() {
    let mut net = Net::new(config(), Some(ann_drained()));
    let bob = net.connect("bob", "phone");
    net.run_until(Duration::from_secs(2), |net| net.welcomed(bob));
    assert!(net.welcomed(bob) && online(&net, "bob"));
    net.clients[bob].dead = true;
    // Shedding for longer than the idle timeout and bob's grace together.
    let start = net.now;
    let mut lost = None;
    while net.now < start + Duration::from_secs(120) {
        net.server.stats.shed(Shed::Rate);
        net.run_for(Duration::from_millis(250));
        let lingering = net
            .events
            .iter()
            .any(|e| matches!(e, ServerEvent::Closed { .. }));
        if lingering && lost.is_none() {
            lost = Some(net.now);
        }
    }
    let lost = lost.expect("bob's connection was never found lost");
    assert!(
        net.now - lost > Duration::from_secs(60),
        "bob lost too late for the test"
    );
    assert!(
        online(&net, "bob"),
        "bob shown offline while the server was still shedding"
    );
    let stopped = net.now;
    net.run_until(Duration::from_secs(40), |net| !online(net, "bob"));
    assert!(!online(&net, "bob"), "held after the shedding stopped");
    assert!(net.now - stopped >= Duration::from_secs(5));
}

/// Handshakes in flight are limited per source address (past the limit a
/// new client is sent a Retry, then refused once validated), other
/// addresses are unaffected, and a handshake that never completes is
/// closed after `hello_timeout`, which frees its address's slot.
#[test]
fn handshakes_are_limited_per_address_and_time_out() {
    let mut config = config();
    config.max_handshakes_per_address = 2;
    config.hello_timeout = Duration::from_secs(2);
    let mut net = Net::new(config, None);
    let ip = std::net::Ipv4Addr::new(10, 0, 9, 9);
    // Two clients from one address that never hear the server: their
    // handshakes stay in flight.
    let stuck: Vec<usize> = (0..2)
        .map(|port| {
            net.start_deaf(
                "ann",
                &format!("d{port}"),
                SocketAddr::from((ip, 6000 + port)),
            )
        })
        .collect();
    net.run_for(Duration::from_millis(100));
    assert_eq!(net.server.per_address.get(&IpAddr::V4(ip)), Some(&2));
    // A third from the same address: a Retry, then refused.
    let third = net.start("bob", "phone", SocketAddr::from((ip, 6100)));
    net.run_until(Duration::from_secs(1), |net| {
        net.clients[third].lost.is_some()
    });
    let shed = |net: &Net, r: Shed| net.server.stats.shed[r as usize].load(Ordering::Relaxed);
    assert!(
        matches!(
            net.clients[third].lost,
            Some(ConnectionError::ConnectionClosed(_))
        ),
        "{:?}",
        net.clients[third].lost
    );
    assert_eq!(shed(&net, Shed::Retry), 1);
    assert_eq!(shed(&net, Shed::PerAddress), 1);
    // Another address is served meanwhile.
    let other = net.start("cid", "laptop", SocketAddr::from(([10, 0, 8, 8], 6000)));
    net.run_until(Duration::from_secs(1), |net| net.welcomed(other));
    assert!(net.welcomed(other));
    // The stuck handshakes end at their hello timeout, counted as shed...
    net.run_for(Duration::from_secs(2));
    assert_eq!(shed(&net, Shed::HandshakeTimeout), 2);
    assert_eq!(net.server.per_address.get(&IpAddr::V4(ip)), None);
    assert!(stuck.iter().all(|&i| !net.welcomed(i)));
    // ... and the address may handshake again.
    let again = net.start("dee", "phone", SocketAddr::from((ip, 6200)));
    net.run_until(Duration::from_secs(1), |net| net.welcomed(again));
    assert!(net.welcomed(again));
}

/// A flood of Initials past what the server answers per second: the excess
/// is dropped without an answer (no Retry, no refusal: each costs a packet
/// and crypto, and a Retry brings the Initial straight back), counted as
/// `Ignored`, and a real client is still served (its retransmission finds
/// the budget refilled).
#[test]
fn shed_answers_are_bounded_and_the_rest_is_ignored() {
    let mut config = config();
    config.retry_threshold = 1;
    config.max_handshakes_per_sec = 10;
    let mut net = Net::new(config, None);
    // One handshake in flight makes the server crowded.
    net.start_deaf("ann", "d0", SocketAddr::from(([10, 0, 7, 1], 7000)));
    net.run_for(Duration::from_millis(20));
    for i in 0..200u16 {
        net.start_deaf(
            "bob",
            &format!("f{i}"),
            SocketAddr::from(([10, 0, 6, 1], 8000 + i)),
        );
    }
    net.run_for(Duration::from_millis(50));
    let shed = |net: &Net, r: Shed| net.server.stats.shed[r as usize].load(Ordering::Relaxed);
    let answered = shed(&net, Shed::Retry) + shed(&net, Shed::PerAddress);
    // The bucket holds 2 × 10 answers: the first 20 (less the admission of
    // the stuck client's own handshake) are answered, the rest dropped.
    assert!(answered <= 20, "{answered} shed Initials answered");
    assert!(
        shed(&net, Shed::Ignored) >= 180,
        "{} ignored",
        shed(&net, Shed::Ignored)
    );
    // A real client: its first Initials may be dropped while the bucket is
    // empty; its retransmissions get a Retry, then it is served.
    let real = net.start("cid", "laptop", SocketAddr::from(([10, 0, 5, 5], 9000)));
    net.run_until(Duration::from_secs(10), |net| net.welcomed(real));
    assert!(net.welcomed(real), "the real client was not served");
}

/// The admission rate follows the loop's load: every report of a backlog
/// (a pass that read its whole datagram budget) or of socket drops cuts it
/// by 30%, down to 5% of the configured rate, and new handshakes past it
/// are refused (`Rate`), even when the server is crowded enough to send
/// Retries; a loop busy most of the time that keeps up keeps its rate;
/// reports of a loop with room raise it by 5% of the configured rate each,
/// back to the configured rate and never above.
#[test]
fn the_admission_rate_follows_the_loops_load() {
    let mut config = config();
    config.max_handshakes_per_sec = 100;
    // Crowded once the lowered rate's 5 are in: a Retry would come next if
    // the rate were not checked before it.
    config.retry_threshold = 5;
    let mut net = Net::new(config, None);
    let load = |net: &mut Net, busy_permille: u32, socket_drops: u64, backlogged_passes: u32| {
        let now = net.now;
        net.server.handle_input(
            now,
            ServerInput::Load {
                busy_permille,
                socket_drops,
                backlogged_passes,
            },
        );
        net.server.admission.rate()
    };
    let cuts = |net: &Net| net.server.stats.admission_cuts.load(Ordering::Relaxed);
    assert_eq!(load(&mut net, 1000, 0, 1), 70.0);
    for _ in 0..9 {
        load(&mut net, 1000, 0, 2);
    }
    assert_eq!(net.server.admission.rate(), 5.0, "the floor");
    assert_eq!(cuts(&net), 10);
    assert_eq!(net.server.stats.admission_rate.load(Ordering::Relaxed), 5);
    // A second for the bucket to hold the lowered rate's worth, then 20 new
    // clients at once: 5 are admitted, the rest shed.
    net.run_for(Duration::from_secs(1));
    for i in 0..20u16 {
        net.start_deaf(
            "bob",
            &format!("d{i}"),
            SocketAddr::from(([10, 0, 4, 1], 7000 + i)),
        );
    }
    net.run_for(Duration::from_millis(20));
    let shed = net.server.stats.shed[Shed::Rate as usize].load(Ordering::Relaxed);
    assert_eq!(shed, 15, "shed past the lowered rate");
    let retries = net.server.stats.shed[Shed::Retry as usize].load(Ordering::Relaxed);
    assert_eq!(retries, 0, "refused at once, not sent a Retry first");
    assert_eq!(net.server.handshaking, 5);
    // Room again: back up in steps of 5, to the configured rate and no more.
    assert_eq!(load(&mut net, 800, 0, 0), 5.0, "busy but keeping up: kept");
    assert_eq!(load(&mut net, 500, 0, 0), 10.0);
    for _ in 0..30 {
        load(&mut net, 100, 0, 0);
    }
    assert_eq!(net.server.admission.rate(), 100.0);
    // Datagrams dropped by the socket cut it however idle the loop looks.
    assert_eq!(load(&mut net, 0, 3, 0), 70.0);
    assert_eq!(cuts(&net), 11);
}
