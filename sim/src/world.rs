//! The simulated world: one real `ServerState`, many simulated clients, the
//! network between them, the store under the server and the host around
//! it, all on virtual time and all driven by one seed. After every step the
//! invariants are checked as a watcher sees them (see [`crate`]).

use crate::client::{user_key, Client, ClientEvent};
use crate::net::{Link, Net};
use crate::rng::Rng;
use crate::store::{Mode, SimStore};
use bytes::BytesMut;
use greendot_proto::{self as proto, Answer, CloseCode, Kind, Request, Status, Tier};
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use greendot_server::Identity;
use greendot_server::{
    Datagram, ServerConfig, ServerInput, ServerMutant, ServerOutput, ServerState,
};
use quinn_proto::{ConnectionError, TransportErrorCode};
use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"greendot simulation secret, not for production use";
/// Tokens expire in 2096: far beyond any run, and the same bytes every run.
const TOKEN_EXP: u64 = 4_000_000_000;
/// The wall clock at the start of a run (plus up to a day, by seed).
const WALL_START_MS: u64 = 1_767_225_600_000;
/// A request on a healthy connection is answered within this: the durable
/// writes of the requests before it each wait at most `store_timeout` (5 s).
const ANSWER_BOUND: Duration = Duration::from_secs(35);
/// After a logout is answered, the server closes within this on a healthy link.
const LOGOUT_CLOSE_BOUND: Duration = Duration::from_secs(25);
/// A client's own send and read buffers, at most.
const CLIENT_BUFFER_CAP: usize = 1 << 20;
/// `handle_timeout` calls one step may need, at most (work carried from a
/// call to the next is bounded by the pass budget).
const MAX_PASSES: usize = 10_000;

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    pub steps: u64,
    /// Users, each with one to three devices (clients).
    pub users: usize,
    /// A deliberately broken server.
    pub mutant: Option<ServerMutant>,
    /// Network, store and host faults (off: a clean network and host).
    pub faults: bool,
    /// Wall-clock steps of minutes, beyond the small corrections (a second
    /// or two) always injected with `faults`.
    pub large_clock_jumps: bool,
    /// A fuzzer's input: the run's first random choices are read from it.
    pub script: Option<Arc<[u8]>>,
}

impl Options {
    pub fn new(seed: u64, steps: u64) -> Options {
        Options {
            seed,
            steps,
            users: 5,
            mutant: None,
            faults: true,
            large_clock_jumps: false,
            script: None,
        }
    }

    /// The one-line command that replays this run.
    pub fn replay_line(&self) -> String {
        if self.script.is_some() {
            return "a fuzz input: RUSTC_BOOTSTRAP=1 cargo fuzz run sim <its artifact> (in fuzz/)"
                .into();
        }
        let mut line = format!(
            "GREENDOT_SIM_SEED={} GREENDOT_SIM_STEPS={}",
            self.seed, self.steps
        );
        if let Some(m) = self.mutant {
            line.push_str(&format!(" GREENDOT_SIM_MUTANT={m:?}"));
        }
        if self.large_clock_jumps {
            line.push_str(" GREENDOT_SIM_CLOCK_JUMPS=large");
        }
        if !self.faults {
            line.push_str(" GREENDOT_SIM_FAULTS=0");
        }
        line.push_str(" cargo test --release -p greendot-sim --test sim replay -- --nocapture");
        line
    }
}

/// Faults injected, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    pub partitions: u64,
    pub deaf: u64,
    pub stalled_readers: u64,
    pub link_changes: u64,
    pub migrations: u64,
    pub kills: u64,
    pub store_failing: u64,
    pub store_stalls: u64,
    pub drains: u64,
    pub crashes: u64,
    pub clock_jumps: u64,
}

impl Faults {
    pub fn total(&self) -> u64 {
        self.partitions
            + self.deaf
            + self.stalled_readers
            + self.link_changes
            + self.migrations
            + self.kills
            + self.store_failing
            + self.store_stalls
            + self.drains
            + self.crashes
            + self.clock_jumps
    }

    pub fn add(&mut self, o: &Faults) {
        self.partitions += o.partitions;
        self.deaf += o.deaf;
        self.stalled_readers += o.stalled_readers;
        self.link_changes += o.link_changes;
        self.migrations += o.migrations;
        self.kills += o.kills;
        self.store_failing += o.store_failing;
        self.store_stalls += o.store_stalls;
        self.drains += o.drains;
        self.crashes += o.crashes;
        self.clock_jumps += o.clock_jumps;
    }
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct Report {
    pub seed: u64,
    pub steps: u64,
    pub simulated: Duration,
    pub faults: Faults,
    /// A hash of everything observable that happened, in order.
    pub trace: u64,
    pub datagrams: u64,
    pub welcomes: u64,
    pub requests_answered: u64,
    pub updates: u64,
    pub store_commits: u64,
}

/// A run that broke an invariant (or panicked).
#[derive(Clone, Debug)]
pub struct Failure {
    pub options: Options,
    pub step: u64,
    pub at: Duration,
    pub what: String,
    /// The last things that happened.
    pub log: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {} failed at step {} ({:.3} s simulated): {}",
            self.options.seed,
            self.step,
            self.at.as_secs_f64(),
            self.what
        )?;
        for line in &self.log {
            writeln!(f, "  {line}")?;
        }
        write!(f, "replay: {}", self.options.replay_line())
    }
}

/// Runs one seed.
pub fn run(options: Options) -> Result<Report, Box<Failure>> {
    let opts = options.clone();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let mut sim = match Sim::new(opts.clone()) {
            Ok(sim) => sim,
            Err(what) => {
                return Err(Box::new(Failure {
                    options: opts,
                    step: 0,
                    at: Duration::ZERO,
                    what,
                    log: Vec::new(),
                }))
            }
        };
        for step in 0..sim.opts.steps {
            sim.step = step;
            if let Err(what) = sim.step_once() {
                return Err(Box::new(Failure {
                    options: sim.opts.clone(),
                    step,
                    at: sim.now,
                    what,
                    log: sim.log.iter().cloned().collect(),
                }));
            }
        }
        Ok(sim.report())
    }));
    match outcome {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            Err(Box::new(Failure {
                options,
                step: 0,
                at: Duration::ZERO,
                what: format!("panic: {what}"),
                log: Vec::new(),
            }))
        }
    }
}

/// FNV-1a over what happened: the same seed must give the same value.
#[derive(Clone, Copy, Debug)]
struct Trace(u64);

impl Trace {
    fn add(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The simulator's record of one client, beyond its protocol state.
#[derive(Debug, Default)]
struct Device {
    /// Gone (killed, logged out, closed) and not trying to come back, since.
    absent_since: Option<Duration>,
    /// When to (re)connect.
    reconnect_at: Option<Duration>,
    /// Resume the last session at the next connect.
    resume: bool,
    welcomed_at: Option<Duration>,
    /// The latest partition, deafness or reading stall: its start and end.
    disrupted_from: Duration,
    disrupted_until: Duration,
    /// When the link is back to normal: after a disruption, QUIC's
    /// retransmission timer has backed off for about as long as it lasted.
    recovered_at: Duration,
    /// Granted subscriptions: target user, tier, since.
    subs: BTreeMap<usize, (Tier, Duration)>,
    /// What it wants to watch (subscribed again after a fresh welcome).
    wanted: BTreeMap<usize, Tier>,
    /// Whom its token lets it watch (`None`: anybody).
    watch: Option<Vec<usize>>,
    /// It closed the connection itself (a close of ours is no finding).
    closing: bool,
}

/// The simulator's record of one user.
#[derive(Debug, Default)]
struct UserTruth {
    /// `SetInvisible` requests sent and not answered.
    in_flight: u32,
    /// Two were in flight at once: which the server applied last is unknown.
    ambiguous: bool,
    /// A request went unanswered with its connection; it may still be
    /// applied (it may wait behind a stalled write) until then.
    tainted_until: Duration,
    /// A `SetInvisible(true)` was acknowledged (saved) then, and nothing
    /// since asked for visibility.
    invisible_acked: Option<Duration>,
    /// Visible for sure since then: no invisibility asked for, or the last
    /// `SetInvisible(false)` was saved then and none since asked for it.
    visible_since: Option<Duration>,
}

struct Sim {
    opts: Options,
    rng: Rng,
    base: Instant,
    now: Duration,
    step: u64,
    config: ServerConfig,
    server: Option<ServerState>,
    epoch: u32,
    server_addr: SocketAddr,
    /// The server is down (restarting) until then.
    down_until: Option<Duration>,
    /// A drain is under way (since).
    draining: Option<Duration>,
    /// The latest moment a server process ended (crash or drain).
    last_restart: Option<Duration>,
    /// The latest large step of the wall clock.
    last_clock_jump: Option<Duration>,
    wall_start: u64,
    /// Added to the wall clock by jumps, in ms.
    wall_offset: i64,
    store: SimStore,
    net: Net,
    links: Vec<Link>,
    clients: Vec<Client>,
    devices: Vec<Device>,
    users: Vec<UserTruth>,
    addrs: BTreeMap<SocketAddr, usize>,
    next_port: u16,
    /// (epoch, user, version) → what was published and when it was first seen.
    published: BTreeMap<(u32, usize, u64), (proto::Presence, Duration)>,
    next_action: Duration,
    next_fault: Duration,
    /// Busy phases act often; quiet ones let virtual time run.
    busy_until: Duration,
    quiet: bool,
    faults: Faults,
    trace: Trace,
    log: std::collections::VecDeque<String>,
    welcomes: u64,
    answered: u64,
    updates: u64,
    /// `GREENDOT_SIM_VERBOSE=1`: every event to stderr.
    verbose: bool,
}

fn kind_of(rng: &mut Rng) -> Kind {
    [Kind::Mobile, Kind::Desktop, Kind::Web, Kind::Other][rng.index(4)]
}

/// A fixed-size server identity from the seed: an Ed25519 key (its
/// signatures are always 64 bytes, unlike ECDSA's DER) and a self-signed
/// certificate, so that packet sizes, and hence the run, depend on the
/// seed only.
fn identity(rng: &mut Rng) -> Result<Identity, String> {
    let seed = rng.bytes32();
    // PKCS#8 v1 of an Ed25519 private key: a fixed prefix, then the seed.
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(&seed);
    let pkcs8 = rustls::pki_types::PrivatePkcs8KeyDer::from(der);
    let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
        .map_err(|e| format!("ed25519 key: {e}"))?;
    let params = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .map_err(|e| format!("certificate params: {e}"))?;
    let cert = params
        .self_signed(&key)
        .map_err(|e| format!("certificate: {e}"))?;
    Ok(Identity {
        certs: vec![cert.der().clone()],
        key: rustls::pki_types::PrivateKeyDer::Pkcs8(pkcs8),
    })
}

fn code_of(reason: &ConnectionError) -> Option<u64> {
    match reason {
        ConnectionError::ApplicationClosed(c) => Some(c.error_code.into_inner()),
        _ => None,
    }
}

impl Sim {
    fn new(opts: Options) -> Result<Sim, String> {
        let mut rng = match &opts.script {
            Some(script) => Rng::scripted(opts.seed, script.clone()),
            None => Rng::new(opts.seed),
        };
        let identity = identity(&mut rng)?;
        let mut config = ServerConfig::new(SECRET.to_vec());
        config.identity = Some(identity.clone());
        config.mutant = opts.mutant;
        let keys = TokenKeys::new(SECRET, Duration::from_secs(30));
        let server_addr = SocketAddr::from((Ipv4Addr::new(10, 0, 0, 1), 4433));
        let crypto = greendot_client::tls::client_crypto(&identity.certs, proto::ALPN)
            .map_err(|e| e.to_string())?;
        let mut transport = quinn_proto::TransportConfig::default();
        // As the client library's defaults.
        transport.keep_alive_interval(Some(Duration::from_secs(10)));
        transport.max_idle_timeout(Some(
            quinn_proto::IdleTimeout::try_from(Duration::from_secs(30))
                .map_err(|e| e.to_string())?,
        ));
        let transport = Arc::new(transport);
        let crypto = Arc::new(crypto);

        let mut clients = Vec::new();
        let mut devices = Vec::new();
        let mut links = Vec::new();
        let mut addrs = BTreeMap::new();
        let users = opts.users.max(2);
        let mut next_port = 1000;
        for user in 0..users {
            let watch: Option<Vec<usize>> = if rng.chance(0.5) {
                None
            } else {
                Some((0..users).filter(|_| rng.chance(0.6)).collect())
            };
            let claim = match &watch {
                None => WatchClaim::all(),
                Some(list) => WatchClaim::only(list.iter().map(|u| format!("u{u}"))),
            };
            let devices_of_user = rng.range(1, 3) as usize;
            for device in 0..devices_of_user {
                let kind = kind_of(&mut rng);
                let claims = Claims {
                    sub: format!("u{user}"),
                    dev: format!("d{device}"),
                    kind,
                    watch: claim.clone(),
                    svc: false,
                    exp: TOKEN_EXP,
                    iat: None,
                };
                let token = keys.mint(&claims).map_err(|e| e.to_string())?;
                let mut client_config = quinn_proto::ClientConfig::new(crypto.clone());
                client_config.transport_config(transport.clone());
                let index = clients.len();
                next_port += 1;
                let addr = SocketAddr::from((Ipv4Addr::new(10, 1, 0, index as u8 + 1), next_port));
                addrs.insert(addr, index);
                clients.push(Client::new(
                    index,
                    user,
                    device,
                    kind,
                    token,
                    client_config,
                    server_addr,
                    addr,
                    rng.bytes32(),
                    rng.bytes32(),
                ));
                links.push(Link::random(&mut rng));
                devices.push(Device {
                    reconnect_at: Some(Duration::from_millis(rng.range(0, 3000))),
                    watch: watch.clone(),
                    ..Device::default()
                });
            }
        }
        let wall_start = WALL_START_MS + rng.below(86_400_000);
        let mut sim = Sim {
            opts,
            rng,
            base: Instant::now(),
            now: Duration::ZERO,
            step: 0,
            config,
            server: None,
            epoch: 0,
            server_addr,
            down_until: None,
            draining: None,
            last_restart: None,
            last_clock_jump: None,
            wall_start,
            wall_offset: 0,
            store: SimStore::new(),
            net: Net::default(),
            links,
            clients,
            devices,
            users: (0..users)
                .map(|_| UserTruth {
                    visible_since: Some(Duration::ZERO),
                    ..UserTruth::default()
                })
                .collect(),
            addrs,
            next_port,
            published: BTreeMap::new(),
            next_action: Duration::ZERO,
            next_fault: Duration::from_secs(5),
            busy_until: Duration::from_secs(60),
            quiet: false,
            faults: Faults::default(),
            trace: Trace(0xcbf2_9ce4_8422_2325),
            log: std::collections::VecDeque::new(),
            welcomes: 0,
            answered: 0,
            updates: 0,
            verbose: std::env::var("GREENDOT_SIM_VERBOSE").is_ok_and(|v| v == "1"),
        };
        sim.start_server()?;
        Ok(sim)
    }

    fn wall(&self) -> u64 {
        (self.wall_start as i64 + self.now.as_millis() as i64 + self.wall_offset).max(0) as u64
    }

    fn instant(&self) -> Instant {
        self.base + self.now
    }

    fn note(&mut self, line: String) {
        self.trace.add(line.as_bytes());
        if self.verbose {
            eprintln!("[{:>10.6}s] {line}", self.now.as_secs_f64());
        }
        if self.log.len() >= 40 {
            self.log.pop_front();
        }
        self.log
            .push_back(format!("[{:>10.3}s] {line}", self.now.as_secs_f64()));
    }

    fn start_server(&mut self) -> Result<(), String> {
        self.epoch += 1;
        let loaded = self.store.load_and_begin(self.wall());
        let seed = self.rng.next_u64();
        let server = ServerState::new(
            self.config.clone(),
            self.instant(),
            self.wall(),
            seed,
            Some(loaded),
        )
        .map_err(|e| format!("server start: {e}"))?;
        self.server = Some(server);
        self.down_until = None;
        self.draining = None;
        self.note(format!("server epoch {} up", self.epoch));
        Ok(())
    }

    fn report(&self) -> Report {
        Report {
            seed: self.opts.seed,
            steps: self.opts.steps,
            simulated: self.now,
            faults: self.faults,
            trace: self.trace.0,
            datagrams: self.net.sent,
            welcomes: self.welcomes,
            requests_answered: self.answered,
            updates: self.updates,
            store_commits: self.store.commits,
        }
    }

    // ---- one step ----

    fn next_time(&mut self) -> Duration {
        let mut next = self.next_action.min(self.next_fault);
        let mut consider = |t: Option<Duration>| {
            if let Some(t) = t {
                next = next.min(t);
            }
        };
        consider(self.net.next_at());
        consider(self.store.next_at());
        consider(self.down_until);
        let base = self.base;
        if let Some(server) = &self.server {
            consider(
                server
                    .poll_timeout()
                    .map(|t| t.saturating_duration_since(base)),
            );
        }
        for (client, device) in self.clients.iter_mut().zip(&self.devices) {
            consider(
                client
                    .poll_timeout()
                    .map(|t| t.saturating_duration_since(base)),
            );
            consider(device.reconnect_at);
        }
        next
    }

    fn step_once(&mut self) -> Result<(), String> {
        let next = self.next_time();
        self.now = self.now.max(next);
        let now = self.now;
        self.trace.add(&(now.as_nanos() as u64).to_le_bytes());

        if self.down_until.is_some_and(|t| t <= now) {
            self.start_server()?;
        }
        while let Some(d) = self.net.pop_due(now) {
            self.deliver(d)?;
        }
        self.store.tick(now);
        while let Some((ticket, result)) = self.store.poll_answer(now) {
            self.note(format!("store answers ticket {ticket}: {result:?}"));
            let instant = self.instant();
            if let Some(server) = self.server.as_mut() {
                server.handle_input(instant, ServerInput::StoreDone { ticket, result });
            }
        }
        let instant = self.instant();
        for client in &mut self.clients {
            if client.poll_timeout().is_some_and(|t| t <= instant) {
                client.handle_timeout(instant);
            }
        }
        for i in 0..self.clients.len() {
            if self.devices[i].reconnect_at.is_some_and(|t| t <= now) {
                self.reconnect(i)?;
            }
        }
        if self.next_action <= now {
            self.act()?;
            self.schedule_action();
        }
        if self.next_fault <= now {
            if self.opts.faults {
                self.fault()?;
            }
            self.next_fault = now + Duration::from_millis(self.rng.range(2_000, 60_000));
        }
        // Readers resume when their stall is over.
        for (client, device) in self.clients.iter_mut().zip(&self.devices) {
            if client.stalled && device.disrupted_until <= now {
                client.stalled = false;
            }
        }
        self.drive()?;
        self.record_published();
        self.check()
    }

    fn schedule_action(&mut self) {
        let now = self.now;
        if now >= self.busy_until {
            self.quiet = !self.quiet;
            let len = if self.quiet {
                self.rng.range(30_000, 600_000)
            } else {
                self.rng.range(10_000, 120_000)
            };
            self.busy_until = now + Duration::from_millis(len);
        }
        let gap = if self.quiet {
            self.rng.range(5_000, 60_000)
        } else {
            self.rng.range(50, 1_500)
        };
        self.next_action = now + Duration::from_millis(gap);
    }

    /// Runs the server and the clients until nothing more happens at `now`.
    fn drive(&mut self) -> Result<(), String> {
        let instant = self.instant();
        let mut passes = 0;
        loop {
            let mut progress = false;
            if let Some(server) = self.server.as_mut() {
                while server.poll_timeout().is_some_and(|t| t <= instant) {
                    if self.verbose {
                        eprintln!("[{:>10.6}s] server timeout", self.now.as_secs_f64());
                    }
                    server.handle_timeout(instant);
                    passes += 1;
                    progress = true;
                    if passes > MAX_PASSES {
                        return Err("the server keeps asking for work at the same instant".into());
                    }
                }
            }
            progress |= self.drain_server()?;
            for i in 0..self.clients.len() {
                progress |= self.drive_client(i)?;
            }
            if !progress {
                return Ok(());
            }
            passes += 1;
            if passes > MAX_PASSES {
                return Err("no quiescence at one instant".into());
            }
        }
    }

    fn drain_server(&mut self) -> Result<bool, String> {
        let mut progress = false;
        let now = self.now;
        let mut outputs = Vec::new();
        let mut transmits = Vec::new();
        if let Some(server) = self.server.as_mut() {
            while let Some(t) = server.poll_transmit() {
                let segment = t.segment_size.unwrap_or(t.contents.len()).max(1);
                for chunk in t.contents.chunks(segment) {
                    transmits.push((t.destination, chunk.to_vec()));
                }
                server.recycle(t.contents);
            }
            while let Some(o) = server.poll_output() {
                outputs.push(o);
            }
        }
        for (to, data) in transmits {
            progress = true;
            if self.verbose {
                eprintln!(
                    "[{:>10.6}s] server sends {} bytes to {to}",
                    now.as_secs_f64(),
                    data.len()
                );
            }
            // An address nobody holds any more (a client that moved): lost.
            let Some(&client) = self.addrs.get(&to) else {
                continue;
            };
            let link = self.links[client].clone();
            self.net.send(
                &mut self.rng,
                now,
                &link,
                client,
                self.server_addr,
                to,
                data,
            )?;
        }
        for output in outputs {
            progress = true;
            match output {
                ServerOutput::Store(request) => {
                    let latency = Duration::from_millis(self.rng.range(0, 30));
                    self.store.request(now, latency, request)?;
                }
                ServerOutput::Event(event) => self.note(format!("server: {event:?}")),
                ServerOutput::Stopped => {
                    self.note(format!("server epoch {} stopped (drained)", self.epoch));
                    self.server = None;
                    // The process exits: what the store did not commit is lost.
                    self.store.crash();
                    self.last_restart = Some(now);
                    self.down_until = Some(now + Duration::from_millis(self.rng.range(100, 3_000)));
                }
                // The simulated clients speak raw QUIC only: a WebSocket
                // output here would be the server inventing a connection.
                other @ (ServerOutput::WsSend { .. }
                | ServerOutput::WsPing { .. }
                | ServerOutput::WsClose { .. }
                | ServerOutput::WsCredit { .. }) => {
                    return Err(format!(
                        "WebSocket output without a WebSocket client: {other:?}"
                    ));
                }
                // One node: a cluster output would be cluster code on the
                // single-node path.
                ServerOutput::Cluster(out) => {
                    return Err(format!("cluster output on one node: {out:?}"));
                }
            }
        }
        Ok(progress)
    }

    fn drive_client(&mut self, i: usize) -> Result<bool, String> {
        let instant = self.instant();
        let now = self.now;
        let mut events = Vec::new();
        let mut out = Vec::new();
        self.clients[i].drive(instant, now, &mut events, &mut out);
        let progress = !events.is_empty() || !out.is_empty();
        let from = self.clients[i].addr;
        let link = self.links[i].clone();
        for (to, data) in out {
            self.net
                .send(&mut self.rng, now, &link, i, from, to, data)?;
        }
        for event in events {
            self.on_client_event(i, event)?;
        }
        if self.clients[i].is_drained() {
            self.drop_pending(i);
            self.clients[i].reap();
        }
        Ok(progress)
    }

    fn deliver(&mut self, d: crate::net::Datagram) -> Result<(), String> {
        let now = self.now;
        let link = &self.links[d.client];
        if link.partitioned(now) {
            return Ok(());
        }
        self.trace.add(&(d.data.len() as u64).to_le_bytes());
        if self.verbose {
            eprintln!(
                "[{:>10.6}s] datagram {} -> {} ({} bytes)",
                self.now.as_secs_f64(),
                d.from,
                d.to,
                d.data.len()
            );
        }
        if d.to == self.server_addr {
            let instant = self.instant();
            if let Some(server) = self.server.as_mut() {
                server.handle_datagram(
                    instant,
                    Datagram {
                        remote: d.from,
                        local_ip: None,
                        ecn: None,
                        data: BytesMut::from(&d.data[..]),
                    },
                );
            }
            return Ok(());
        }
        if link.deaf(now) || self.clients[d.client].addr != d.to {
            return Ok(());
        }
        let instant = self.instant();
        let mut out = Vec::new();
        self.clients[d.client].handle_datagram(instant, d.from, d.data, &mut out);
        let from = self.clients[d.client].addr;
        let link = self.links[d.client].clone();
        for (to, data) in out {
            self.net
                .send(&mut self.rng, now, &link, d.client, from, to, data)?;
        }
        Ok(())
    }

    // ---- clients ----

    fn reconnect(&mut self, i: usize) -> Result<(), String> {
        let device = &mut self.devices[i];
        device.reconnect_at = None;
        if let Some(live) = self.clients[i].live.as_ref() {
            if !live.lost && !device.closing {
                return Ok(());
            }
            // The old connection is closing: leave it behind.
            self.drop_pending(i);
            self.clients[i].kill();
        }
        let device = &mut self.devices[i];
        device.absent_since = None;
        device.closing = false;
        if !device.resume {
            self.clients[i].resume = None;
        }
        let instant = self.instant();
        let epoch = if self.server.is_some() && self.draining.is_none() {
            self.epoch
        } else {
            self.epoch + 1
        };
        self.note(format!(
            "c{i} connects (resume {:?})",
            self.clients[i].resume
        ));
        self.clients[i].connect(instant, self.now, epoch)
    }

    fn on_client_event(&mut self, i: usize, event: ClientEvent) -> Result<(), String> {
        let now = self.now;
        match event {
            ClientEvent::Welcomed {
                session,
                resumed,
                subs,
            } => {
                self.welcomes += 1;
                self.note(format!(
                    "c{i} welcomed session {session:x} resumed {resumed}"
                ));
                let epoch = self.epoch;
                if let Some(live) = self.clients[i].live.as_mut() {
                    live.epoch = epoch;
                }
                let device = &mut self.devices[i];
                device.welcomed_at = Some(now);
                device.subs.clear();
                for (target, tier) in subs {
                    if let Some(t) = user_key(&target) {
                        device.subs.insert(t.0 as usize, (tier, now));
                    }
                }
                if !resumed {
                    // Subscribe again to what it watched.
                    let wanted: Vec<(usize, Tier)> =
                        device.wanted.iter().map(|(&u, &t)| (u, t)).collect();
                    for tier in [Tier::Realtime, Tier::Batched] {
                        let targets: Vec<String> = wanted
                            .iter()
                            .filter(|(_, t)| *t == tier)
                            .map(|(u, _)| format!("u{u}"))
                            .collect();
                        if !targets.is_empty() {
                            self.clients[i].request(now, Request::Subscribe { targets, tier });
                        }
                    }
                }
            }
            ClientEvent::Update {
                target,
                presence,
                push,
            } => {
                self.updates += 1;
                if push.is_some() {
                    self.check_push_after_logout(i, &target, &presence)?;
                }
                self.note(format!(
                    "c{i} {} {target} v{} online {} {:?}",
                    if push.is_some() { "push" } else { "snapshot" },
                    presence.version,
                    presence.online,
                    presence.status
                ));
                self.check_update(i, &target, &presence)?;
            }
            ClientEvent::Answered {
                request,
                result,
                sent,
            } => {
                self.answered += 1;
                self.note(format!("c{i} answer to {request:?}: {result:?}"));
                self.on_answer(i, request, result, sent)?;
            }
            ClientEvent::ErrorFrame(e) => {
                self.note(format!("c{i} error frame {e:?}"));
            }
            ClientEvent::Lost {
                reason,
                welcomed,
                logout_sent,
                opened_at,
            } => {
                self.note(format!("c{i} lost: {reason} (welcomed {welcomed})"));
                self.on_lost(i, &reason, welcomed, logout_sent, opened_at)?;
            }
            ClientEvent::Broken(what) => return Err(format!("c{i}: {what}")),
        }
        Ok(())
    }

    fn on_answer(
        &mut self,
        i: usize,
        request: Request,
        result: Result<Answer, proto::WireError>,
        _sent: Duration,
    ) -> Result<(), String> {
        let now = self.now;
        let user = self.clients[i].user;
        match (request, result) {
            (Request::Subscribe { .. }, Ok(Answer::Subscribed { snapshots, refused })) => {
                for s in snapshots {
                    let Some(t) = user_key(&s.target) else {
                        continue;
                    };
                    let t = t.0 as usize;
                    let allowed = t == user
                        || self.devices[i]
                            .watch
                            .as_ref()
                            .is_none_or(|list| list.contains(&t));
                    if !allowed {
                        return Err(format!(
                            "I11: c{i} (u{user}) granted {} outside its token's watch",
                            s.target
                        ));
                    }
                    self.devices[i].subs.insert(t, (s.tier, now));
                }
                for r in refused {
                    if let Some(t) = user_key(&r.target) {
                        self.devices[i].wanted.remove(&(t.0 as usize));
                    }
                }
            }
            (Request::Unsubscribe { target }, _) => {
                if let Some(t) = user_key(&target) {
                    self.devices[i].subs.remove(&(t.0 as usize));
                    self.devices[i].wanted.remove(&(t.0 as usize));
                    self.clients[i].view.forget(t);
                }
            }
            (Request::SetInvisible { invisible }, result) => {
                let truth = &mut self.users[user];
                truth.in_flight = truth.in_flight.saturating_sub(1);
                // Only a saved change with nothing else in flight is known
                // to hold (across a crash too).
                if truth.in_flight == 0 {
                    if !truth.ambiguous
                        && now >= truth.tainted_until
                        && matches!(result, Ok(Answer::Done))
                    {
                        if invisible {
                            truth.invisible_acked = Some(now);
                        } else {
                            truth.visible_since = Some(now);
                        }
                    }
                    truth.ambiguous = false;
                }
            }
            (Request::Logout, Ok(Answer::Done)) => {
                self.devices[i].absent_since = Some(now);
            }
            (Request::Query { .. }, Ok(Answer::Presences(results))) => {
                for r in results {
                    let Ok(p) = r.result else { continue };
                    if r.target != self.clients[i].user_name && p.invisible {
                        return Err(format!(
                            "I5: c{i} queried {} and was told it is invisible",
                            r.target
                        ));
                    }
                }
            }
            (Request::Ping, Ok(Answer::Done)) | (Request::SetStatus { .. }, _) => {}
            (_, Err(e)) if e.code == proto::ErrorCode::Internal => {}
            (_, Err(e)) if e.code == proto::ErrorCode::RateLimited => {
                return Err(format!(
                    "c{i} rate limited though it keeps under the limit: {e:?}"
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// A connection ended: was there a reason for the server to end it?
    fn on_lost(
        &mut self,
        i: usize,
        reason: &ConnectionError,
        welcomed: bool,
        logout_sent: bool,
        opened: Duration,
    ) -> Result<(), String> {
        let now = self.now;
        let within = |t: Option<Duration>, w: Duration| t.is_some_and(|t| now <= t + w);
        let device = &self.devices[i];
        let disrupted = |w: Duration| device.disrupted_until + w >= now;
        let restarted = |w: Duration| within(self.last_restart, w) || within(self.draining, w);
        let jumped = within(self.last_clock_jump, Duration::from_secs(120));
        let idle = self.config.idle_timeout + Duration::from_secs(35);
        let fine = match reason {
            ConnectionError::LocallyClosed => true,
            ConnectionError::ApplicationClosed(_) if device.closing => true,
            ConnectionError::ApplicationClosed(c) => {
                let code = c.error_code.into_inner();
                let text = String::from_utf8_lossy(&c.reason).into_owned();
                let ok = match code {
                    1 => logout_sent,
                    10 | 14 => restarted(Duration::from_secs(30)),
                    11 | 16 => disrupted(Duration::from_secs(120)),
                    3 => {
                        disrupted(Duration::from_secs(150))
                            || restarted(Duration::from_secs(150))
                            || jumped
                    }
                    // A hello that did not arrive in time (lost, on a lossy
                    // link, until the retransmission timer backed off).
                    12 => true,
                    _ => false,
                };
                if !ok {
                    return Err(format!(
                        "c{i}: the server closed a connection with code {code} ({text:?}) with no cause (link healthy since {:.3}s, logout sent {logout_sent})",
                        device.disrupted_until.as_secs_f64()
                    ));
                }
                true
            }
            ConnectionError::TimedOut => disrupted(idle) || restarted(idle) || jumped,
            // A close we did not hear (lost) is learnt by a stateless reset:
            // after a logout, or a hello that timed out on a lossy link.
            ConnectionError::Reset => {
                logout_sent
                    || !welcomed
                    || restarted(idle)
                    || disrupted(idle)
                    || self.server.is_none()
            }
            // Closed during the handshake (the hello timeout, a refusal).
            // An application close of a connection still in its QUIC
            // handshake goes out as APPLICATION_ERROR without its code; past
            // the hello timeout that is the hello timeout (code 12 above),
            // reached on a lossy link once QUIC's retransmission timer has
            // backed off for seconds.
            ConnectionError::ConnectionClosed(c) => {
                restarted(idle)
                    || self.server.is_none()
                    || disrupted(now.saturating_sub(opened) + Duration::from_secs(15))
                    || (c.error_code == TransportErrorCode::APPLICATION_ERROR
                        && now >= opened + self.config.hello_timeout)
            }
            _ => false,
        };
        if !fine {
            return Err(format!(
                "c{i}: connection lost without cause: {reason} (disrupted until {:.3}s)",
                device.disrupted_until.as_secs_f64()
            ));
        }
        self.drop_pending(i);
        let device = &mut self.devices[i];
        device.welcomed_at = None;
        device.subs.clear();
        if logout_sent || code_of(reason) == Some(CloseCode::Logout as u64) {
            device.absent_since.get_or_insert(now);
            device.resume = false;
            if device.reconnect_at.is_none() {
                device.reconnect_at =
                    Some(now + Duration::from_millis(self.rng.range(1_000, 180_000)));
            }
        } else if device.reconnect_at.is_none() {
            device.resume = true;
            // Backoff as the client library: full jitter, up to 5 s.
            device.reconnect_at = Some(now + Duration::from_millis(self.rng.range(100, 5_000)));
        }
        Ok(())
    }

    fn act(&mut self) -> Result<(), String> {
        let i = self.rng.index(self.clients.len());
        let now = self.now;
        let instant = self.instant();
        let users = self.users.len();
        let welcomed = self.clients[i]
            .live
            .as_ref()
            .is_some_and(|l| l.is_open() && l.welcomed.is_some() && !l.logout_sent);
        if !welcomed {
            return Ok(());
        }
        let roll = self.rng.below(100);
        let request = match roll {
            0..=24 => {
                let n = self.rng.range(1, 3);
                let tier = if self.rng.chance(0.5) {
                    Tier::Realtime
                } else {
                    Tier::Batched
                };
                let targets: Vec<usize> = (0..n).map(|_| self.rng.index(users)).collect();
                for &t in &targets {
                    self.devices[i].wanted.insert(t, tier);
                }
                Some(Request::Subscribe {
                    targets: targets.iter().map(|t| format!("u{t}")).collect(),
                    tier,
                })
            }
            25..=29 => {
                let subs: Vec<usize> = self.devices[i].subs.keys().copied().collect();
                if subs.is_empty() {
                    None
                } else {
                    let t = subs[self.rng.index(subs.len())];
                    Some(Request::Unsubscribe {
                        target: format!("u{t}"),
                    })
                }
            }
            30..=49 => {
                let status = [
                    Status::Available,
                    Status::Away,
                    Status::Busy,
                    Status::DoNotDisturb,
                ][self.rng.index(4)];
                let message = if self.rng.chance(0.5) {
                    Some(format!("m{}", self.rng.below(1000)))
                } else {
                    None
                };
                Some(Request::SetStatus { status, message })
            }
            50..=57 => {
                let invisible = self.rng.chance(0.4);
                let user = self.clients[i].user;
                let truth = &mut self.users[user];
                truth.visible_since = None;
                truth.invisible_acked = None;
                truth.ambiguous |= truth.in_flight > 0;
                truth.in_flight += 1;
                Some(Request::SetInvisible { invisible })
            }
            58..=64 => Some(Request::Query {
                targets: vec![format!("u{}", self.rng.index(users))],
            }),
            65..=69 => Some(Request::Ping),
            70..=74 => Some(Request::Logout),
            75..=81 => {
                self.note(format!("c{i} killed"));
                self.faults.kills += 1;
                self.drop_pending(i);
                self.clients[i].kill();
                // Its next connection comes from a new socket: the old one
                // answers nothing (not even a stateless reset).
                let addr = self.new_address(i);
                self.clients[i].addr = addr;
                let device = &mut self.devices[i];
                device.welcomed_at = None;
                device.subs.clear();
                device.absent_since = Some(now);
                device.resume = true;
                device.reconnect_at =
                    Some(now + Duration::from_millis(self.rng.range(200, 150_000)));
                None
            }
            82..=86 => {
                self.note(format!("c{i} closes (lingers)"));
                self.clients[i].close(instant, CloseCode::Normal);
                let device = &mut self.devices[i];
                device.closing = true;
                device.absent_since = Some(now);
                device.resume = true;
                device.reconnect_at =
                    Some(now + Duration::from_millis(self.rng.range(100, 60_000)));
                None
            }
            _ => {
                self.migrate(i);
                None
            }
        };
        if let Some(request) = request {
            let id = self.clients[i].request(now, request.clone());
            self.note(format!("c{i} asks {request:?} (id {id:?})"));
        }
        Ok(())
    }

    /// The requests of a connection that is gone will never be answered.
    fn drop_pending(&mut self, i: usize) {
        let user = self.clients[i].user;
        if let Some(live) = self.clients[i].live.as_mut() {
            for p in std::mem::take(&mut live.pending).into_values() {
                if matches!(p.request, Request::SetInvisible { .. }) {
                    let truth = &mut self.users[user];
                    truth.in_flight = truth.in_flight.saturating_sub(1);
                    truth.tainted_until =
                        truth.tainted_until.max(self.now + Duration::from_secs(90));
                }
            }
        }
    }

    /// A fresh address (a new socket), not counted as a migration.
    fn new_address(&mut self, i: usize) -> SocketAddr {
        self.next_port = self.next_port.wrapping_add(1).max(1000);
        let old = self.clients[i].addr;
        let new = SocketAddr::from((Ipv4Addr::new(10, 1, 0, i as u8 + 1), self.next_port));
        self.addrs.remove(&old);
        self.addrs.insert(new, i);
        new
    }

    /// Client `i` can neither send nor receive (or read) for `len`.
    fn disrupt(&mut self, i: usize, len: Duration) {
        let now = self.now;
        let device = &mut self.devices[i];
        if device.disrupted_until <= now {
            device.disrupted_from = now;
        }
        device.disrupted_until = device.disrupted_until.max(now + len);
        // Found by seed 16: after a partition of tens of seconds, the RTT
        // estimate of a connection that then only exchanges keep-alives and
        // ACK-only packets (no new RTT samples) stays inflated for minutes,
        // so a lost push is retransmitted ~10 s later, each time. The link
        // counts as recovered only after 20 times the disruption (at most
        // 10 minutes).
        let length = device.disrupted_until - device.disrupted_from;
        let settle = (length * 20).min(Duration::from_secs(600));
        device.recovered_at = device.recovered_at.max(device.disrupted_until + settle);
    }

    fn migrate(&mut self, i: usize) {
        self.faults.migrations += 1;
        self.next_port = self.next_port.wrapping_add(1).max(1000);
        let old = self.clients[i].addr;
        let ip = if self.rng.chance(0.5) {
            Ipv4Addr::new(10, 2, self.rng.below(250) as u8, i as u8 + 1)
        } else {
            match old.ip() {
                std::net::IpAddr::V4(v4) => v4,
                std::net::IpAddr::V6(_) => Ipv4Addr::new(10, 1, 0, i as u8 + 1),
            }
        };
        let new = SocketAddr::from((ip, self.next_port));
        self.addrs.remove(&old);
        self.addrs.insert(new, i);
        self.clients[i].migrate(new);
        self.note(format!("c{i} moves {old} -> {new}"));
        // The new path is validated by one padded PATH_CHALLENGE; if it is
        // lost, the client's small packets do not lift the anti-amplification
        // limit, quinn-proto reverts to the old path and the client is cut
        // off until its idle timeout (it then reconnects and resumes). Until
        // then the client is not counted as healthy (answers and views may
        // lag), but nothing excuses the server closing it.
        let now = self.now;
        let device = &mut self.devices[i];
        if device.disrupted_until <= now {
            device.disrupted_from = now;
        }
        device.disrupted_until = device.disrupted_until.max(now);
        device.recovered_at = device.recovered_at.max(now + Duration::from_secs(40));
    }

    fn fault(&mut self) -> Result<(), String> {
        let now = self.now;
        let i = self.rng.index(self.clients.len());
        let roll = self.rng.below(100);
        match roll {
            0..=17 => {
                let len = Duration::from_millis(self.rng.range(500, 60_000));
                self.faults.partitions += 1;
                self.links[i].partitioned_until = now + len;
                self.disrupt(i, len);
                self.note(format!("c{i} partitioned for {len:?}"));
            }
            18..=29 => {
                let len = Duration::from_millis(self.rng.range(500, 20_000));
                self.faults.deaf += 1;
                self.links[i].deaf_until = now + len;
                self.disrupt(i, len);
                self.note(format!("c{i} stops reading its socket for {len:?}"));
            }
            30..=39 => {
                let len = Duration::from_millis(self.rng.range(500, 30_000));
                self.faults.stalled_readers += 1;
                self.clients[i].stalled = true;
                self.disrupt(i, len);
                self.note(format!("c{i} stops reading its streams for {len:?}"));
            }
            40..=51 => {
                self.faults.link_changes += 1;
                let mut link = Link::random(&mut self.rng);
                link.partitioned_until = self.links[i].partitioned_until;
                link.deaf_until = self.links[i].deaf_until;
                self.note(format!("c{i} link now {link:?}"));
                self.links[i] = link;
            }
            52..=61 => self.migrate(i),
            62..=71 => {
                let len = Duration::from_millis(self.rng.range(500, 20_000));
                self.faults.store_failing += 1;
                self.store.mode = Mode::Failing { until: now + len };
                self.note(format!("store fails for {len:?}"));
            }
            72..=81 => {
                let len = Duration::from_millis(self.rng.range(500, 30_000));
                self.faults.store_stalls += 1;
                self.store.mode = Mode::Stalled { until: now + len };
                self.note(format!("store stalls for {len:?}"));
            }
            82..=85 => {
                if self.server.is_some() && self.draining.is_none() {
                    self.faults.drains += 1;
                    self.draining = Some(now);
                    self.note("server drains (restart)".into());
                    let instant = self.instant();
                    if let Some(server) = self.server.as_mut() {
                        server.handle_input(
                            instant,
                            ServerInput::Stop {
                                code: CloseCode::Draining,
                                text: b"server draining: reconnect and resume".to_vec(),
                                save: true,
                            },
                        );
                    }
                }
            }
            86..=88 => {
                if self.server.is_some() {
                    self.faults.crashes += 1;
                    self.note(format!("server epoch {} crashes", self.epoch));
                    self.server = None;
                    self.store.crash();
                    self.last_restart = Some(now);
                    self.draining = None;
                    self.down_until = Some(now + Duration::from_millis(self.rng.range(100, 5_000)));
                }
            }
            _ => {
                let large = self.opts.large_clock_jumps && self.rng.chance(0.3);
                let ms = if large {
                    self.rng.range(60_000, 3_600_000) as i64
                } else {
                    self.rng.range(1, 2_000) as i64
                };
                let jump = if self.rng.chance(0.5) { ms } else { -ms };
                self.faults.clock_jumps += 1;
                self.wall_offset += jump;
                if large {
                    self.last_clock_jump = Some(now);
                }
                let unix_ms = self.wall();
                self.note(format!("wall clock jumps {jump} ms"));
                let instant = self.instant();
                if let Some(server) = self.server.as_mut() {
                    server.handle_input(instant, ServerInput::SetWallClock { unix_ms });
                }
            }
        }
        Ok(())
    }

    // ---- checks ----

    fn record_published(&mut self) {
        let Some(server) = &self.server else { return };
        let hub = server.hub();
        for u in 0..self.users.len() {
            let Some(id) = hub.user_id(&format!("u{u}")) else {
                continue;
            };
            let p = hub.core().presence(id);
            let key = (self.epoch, u, p.version);
            if !self.published.contains_key(&key) {
                let wire = proto::Presence::from_core(&p, 0);
                self.published.insert(key, (wire, self.now));
            }
        }
    }

    /// What a watcher was told of `target` agrees with what the core
    /// published under that version, and leaks nothing.
    fn check_update(
        &mut self,
        i: usize,
        target: &str,
        presence: &proto::Presence,
    ) -> Result<(), String> {
        let Some(t) = user_key(target).map(|t| t.0 as usize) else {
            return Err(format!("c{i} told of unknown user {target}"));
        };
        let me = self.clients[i].user;
        if t == me {
            return Ok(());
        }
        let allowed = self.devices[i]
            .watch
            .as_ref()
            .is_none_or(|list| list.contains(&t));
        if !allowed {
            return Err(format!("I11: c{i} told of {target} outside its watch"));
        }
        if presence.invisible {
            return Err(format!(
                "I5: c{i} told that {target} is invisible: {presence:?}"
            ));
        }
        let epoch = self.clients[i]
            .live
            .as_ref()
            .map_or(self.epoch, |l| l.epoch);
        if let Some((published, at)) = self.published.get(&(epoch, t, presence.version)) {
            if published != presence {
                return Err(format!(
                    "I7: c{i} got {target} v{} as {presence:?}, but v{} was published as {published:?}",
                    presence.version, presence.version
                ));
            }
            if presence.online {
                if let Some(acked) = self.users[t].invisible_acked {
                    if *at > acked {
                        return Err(format!(
                            "I5: c{i} shown {target} online (published at {:.3}s) after its invisibility was saved at {:.3}s",
                            at.as_secs_f64(),
                            acked.as_secs_f64()
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Since when client `i`'s connection has been welcomed by the current
    /// server and its link undisturbed (`None`: it is not). A connection
    /// that asked to log out counts only if `logout_too`.
    /// I10: nothing published after a session's logout is pushed to it.
    fn check_push_after_logout(
        &self,
        i: usize,
        target: &str,
        presence: &proto::Presence,
    ) -> Result<(), String> {
        let Some(live) = self.clients[i].live.as_ref() else {
            return Ok(());
        };
        let (Some(logout), Some(t)) = (live.logout_answered, user_key(target)) else {
            return Ok(());
        };
        let key = (live.epoch, t.0 as usize, presence.version);
        match self.published.get(&key) {
            Some((_, at)) if *at > logout => Err(format!(
                "I10: c{i} logged out at {:.3}s and was pushed {target} v{} published at {:.3}s",
                logout.as_secs_f64(),
                presence.version,
                at.as_secs_f64()
            )),
            _ => Ok(()),
        }
    }

    fn healthy_since(&self, i: usize, logout_too: bool) -> Option<Duration> {
        let device = &self.devices[i];
        let live = self.clients[i].live.as_ref()?;
        if live.lost
            || live.welcomed.is_none()
            || (live.logout_sent && !logout_too)
            || live.epoch != self.epoch
            || device.closing
            || self.draining.is_some()
        {
            return None;
        }
        let mut since = device.welcomed_at?.max(device.recovered_at);
        if let Some(r) = self.last_restart {
            since = since.max(r);
        }
        (self.now >= device.disrupted_until).then_some(since)
    }

    fn check(&mut self) -> Result<(), String> {
        let now = self.now;
        let config = &self.config;
        let debounce = Duration::from_millis(config.core.debounce.0);
        let batch = Duration::from_millis(config.core.batch_interval.0);
        let max_grace = config
            .core
            .kinds
            .iter()
            .map(|k| Duration::from_millis(k.grace.0))
            .max()
            .unwrap_or_default();
        // Generous: on a lossy link QUIC's RTT estimate (from a handshake whose
        // packets were retransmitted, say) can put a lost push's retransmission
        // several seconds away, twice in a row (seed 78).
        let converge = debounce + batch + Duration::from_secs(30);
        let ghost_bound =
            config.idle_timeout + max_grace * 2 + debounce + batch + Duration::from_secs(20);

        for (i, client) in self.clients.iter().enumerate() {
            if client.buffered() > CLIENT_BUFFER_CAP {
                return Err(format!(
                    "unbounded queue: c{i} buffers {} bytes",
                    client.buffered()
                ));
            }
        }
        let Some(server) = &self.server else {
            return Ok(());
        };
        if let Err(e) = server.hub().core().check_invariants() {
            return Err(format!("core: {e}"));
        }
        // The state's own bookkeeping (push bytes, sessions, timers, tickets).
        if let Err(e) = server.check() {
            return Err(format!("server state: {e}"));
        }
        if server.queued_push_bytes() > config.push_budget_bytes {
            return Err(format!(
                "unbounded queue: the server holds {} push bytes",
                server.queued_push_bytes()
            ));
        }
        let hub = server.hub();
        let core = hub.core();

        // Per client: answers, logout, convergence.
        for i in 0..self.clients.len() {
            let Some(live) = self.clients[i].live.as_ref() else {
                continue;
            };
            let Some(healthy) = self.healthy_since(i, true) else {
                continue;
            };
            for (id, p) in &live.pending {
                if healthy <= p.sent && now > p.sent + ANSWER_BOUND {
                    return Err(format!(
                        "c{i}: request {id} ({:?}) sent at {:.3}s is unanswered on a healthy connection",
                        p.request,
                        p.sent.as_secs_f64()
                    ));
                }
            }
            if let Some(at) = live.logout_answered {
                if healthy <= at && now > at + LOGOUT_CLOSE_BOUND {
                    return Err(format!(
                        "I4: c{i}'s logout was answered at {:.3}s but its connection is still open",
                        at.as_secs_f64()
                    ));
                }
                continue;
            }
            if live.logout_sent {
                continue;
            }
            // I9: a device connected on a healthy link is routable.
            if let Some(wire) = live.welcomed {
                let session = server.wire(greendot_core::SessionId(wire));
                let user = hub.user_id(&self.clients[i].user_name);
                if now >= healthy + Duration::from_secs(1)
                    && !user.is_some_and(|u| core.route(u).contains(&session))
                {
                    return Err(format!(
                        "I9: c{i} is connected and healthy since {:.3}s, but its session is not in its user's route",
                        healthy.as_secs_f64()
                    ));
                }
            }
            if now < healthy + converge || live.epoch != self.epoch {
                continue;
            }
            for (&t, &(_, since)) in &self.devices[i].subs {
                if t == self.clients[i].user || now < since + converge {
                    continue;
                }
                let Some(id) = hub.user_id(&format!("u{t}")) else {
                    continue;
                };
                let p = core.presence(id);
                let Some((published, at)) = self.published.get(&(self.epoch, t, p.version)) else {
                    continue;
                };
                if now < *at + converge {
                    continue;
                }
                let seen = self.clients[i].view.get(greendot_core::UserId(t as u64));
                let agrees = seen.is_some_and(|s| proto::Presence::from_core(s, 0) == *published);
                if !agrees {
                    return Err(format!(
                        "I8: c{i} watching u{t} shows {seen:?}, but the core published {published:?} at {:.3}s",
                        at.as_secs_f64()
                    ));
                }
            }
        }

        // Per user: no ghost, no flap.
        for u in 0..self.users.len() {
            let Some(id) = hub.user_id(&format!("u{u}")) else {
                continue;
            };
            let mine: Vec<usize> = (0..self.clients.len())
                .filter(|&i| self.clients[i].user == u)
                .collect();
            let gone = mine
                .iter()
                .map(|&i| self.devices[i].absent_since)
                .collect::<Option<Vec<_>>>()
                .and_then(|v| v.into_iter().max());
            if let Some(gone) = gone {
                let restarted = self.last_restart.is_some_and(|r| r + ghost_bound > now);
                if now > gone + ghost_bound && !restarted && core.is_online(id) {
                    return Err(format!(
                        "I2: ghost: every device of u{u} has been gone since {:.3}s, yet the core has it online",
                        gone.as_secs_f64()
                    ));
                }
            }
            let p = core.presence(id);
            if p.online {
                continue;
            }
            let Some(visible) = self.users[u].visible_since else {
                continue;
            };
            let Some((_, at)) = self.published.get(&(self.epoch, u, p.version)) else {
                continue;
            };
            for &i in &mine {
                let Some(healthy) = self.healthy_since(i, false) else {
                    continue;
                };
                let since = healthy.max(visible);
                if *at >= since + debounce + Duration::from_secs(1) {
                    return Err(format!(
                        "flap: u{u} published offline at {:.3}s while c{i} was connected and healthy since {:.3}s",
                        at.as_secs_f64(),
                        since.as_secs_f64()
                    ));
                }
            }
        }
        Ok(())
    }
}
