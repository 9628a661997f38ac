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

mod actions;
mod answers;
mod checks;

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

/// What a run names to replay it (both simulators' options).
pub trait Replay: Clone + fmt::Debug {
    fn seed(&self) -> u64;
    /// The one-line command that replays the run.
    fn replay_line(&self) -> String;
}

impl Replay for Options {
    fn seed(&self) -> u64 {
        self.seed
    }

    fn replay_line(&self) -> String {
        Options::replay_line(self)
    }
}

/// A run that broke an invariant (or panicked).
#[derive(Clone, Debug)]
pub struct Failure<O = Options> {
    pub options: O,
    pub step: u64,
    pub at: Duration,
    pub what: String,
    /// The last things that happened.
    pub log: Vec<String>,
}

impl<O> Failure<O> {
    /// A failure before the first step (or a panic, whose step is unknown).
    pub(crate) fn at_start(options: O, what: String) -> Box<Failure<O>> {
        Box::new(Failure {
            options,
            step: 0,
            at: Duration::ZERO,
            what,
            log: Vec::new(),
        })
    }
}

impl<O: Replay> fmt::Display for Failure<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {} failed at step {} ({:.3} s simulated): {}",
            self.options.seed(),
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

/// Runs a whole run; a panic in it is a failure too (at step 0: where it
/// struck is in the message).
pub(crate) fn guarded<O: Replay, R>(
    options: O,
    run: impl FnOnce() -> Result<R, Box<Failure<O>>>,
) -> Result<R, Box<Failure<O>>> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            Err(Failure::at_start(options, format!("panic: {what}")))
        }
    }
}

/// Runs one seed.
pub fn run(options: Options) -> Result<Report, Box<Failure>> {
    let opts = options.clone();
    guarded(options, move || {
        let mut sim = Sim::new(opts.clone()).map_err(|what| Failure::at_start(opts, what))?;
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
    })
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
pub(crate) fn identity(rng: &mut Rng) -> Result<Identity, String> {
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
}
