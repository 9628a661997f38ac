//! The server's settings ([`ServerConfig`], with the documented defaults)
//! and the checks made of them before a server or its state starts.

use crate::{
    cluster, store, transport_config, HubLimits, Identity, RateLimit, ServerError, ServerMutant,
    SettingError,
};
use greendot_proto as proto;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Server settings. `ServerConfig::new(secret)` gives the documented defaults.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The WebSocket binding's TCP address (`wss://…/greendot`, see
    /// docs/protocol.md); `None`: no WebSocket listener. Default `None`
    /// (`greendot serve` listens on the QUIC port number over TCP).
    pub websocket: Option<SocketAddr>,
    /// The presence core's settings (debounce, grace, caps...).
    pub core: greendot_core::Config,
    /// The HMAC secret tokens are signed with.
    pub token_secret: Vec<u8>,
    /// Clock skew tolerated on a token's `exp`: at the hello, and on a live
    /// session, which is closed with `TokenExpired` once `exp` plus this has
    /// passed without a refresh. Default 30 s.
    pub token_leeway: Duration,
    /// The TLS certificate; `None` generates a self-signed one for `localhost`.
    pub identity: Option<Identity>,
    /// QUIC keep-alive. Default 15 s: under the 30 s after which many mobile
    /// NATs forget a UDP mapping. Each connection gets its own interval,
    /// drawn from [0.75, 1] × this, so connections opened together do not
    /// keep sending their keep-alives together.
    pub keep_alive: Duration,
    /// QUIC idle timeout: silence this long means the connection is lost
    /// (Disconnect). Default 45 s: three keep-alives may be lost, and a phone
    /// that dozes for a minute still lingers for its grace before anyone sees it.
    pub idle_timeout: Duration,
    /// Connection migration. Default on.
    pub migration: bool,
    /// Default 100 000.
    pub max_connections: usize,
    /// Cap on a frame's length. Default 64 KiB.
    pub max_frame: usize,
    /// Requests per session. Default 50/s, bursts of 100.
    pub rate: RateLimit,
    /// Time allowed from a client's first packet to its hello: the
    /// handshake, opening the control stream and sending the hello. Default
    /// 10 s (well under the idle timeout: a handshake that stalls holds its
    /// state no longer than this).
    pub hello_timeout: Duration,
    /// The largest hello (a connection's first frame) on every binding, and
    /// what a WebSocket connection may send before it besides its upgrade
    /// request. Default 8 KiB: a token whose watch list names a few hundred
    /// users. A larger hello gets `FrameTooLarge`.
    pub max_hello: usize,
    /// WebSocket connections that may wait for their hello at once (each
    /// holds its TLS state and at most `max_hello` + 16 KiB of input); of
    /// them at most `max_handshakes_per_address` from one IP address.
    /// Default 1024. They take no connection slot until their hello.
    pub max_websocket_pending: usize,
    /// Admission rate: at most this many new handshakes accepted per second
    /// (bursts of one second's worth); beyond it new connections are
    /// refused at once, cheaply, and established ones keep being served.
    /// The rate in force follows the loop's load, between 5% of this and
    /// this ([`ServerInput::Load`]). Also sets the
    /// reconnect spread the server suggests when it drains, and how long
    /// restored devices may take to come back. Default 3000.
    pub max_handshakes_per_sec: u32,
    /// Unvalidated handshakes in flight beyond which a new client must first
    /// prove its address with a QUIC Retry (one round trip, no state kept):
    /// a flood of spoofed Initials then costs a stateless answer each, not a
    /// handshake. Default 512.
    pub retry_threshold: usize,
    /// Handshakes in flight from one IP address beyond which its new ones
    /// get a Retry (if unproven) or are refused. Default 512 (addresses
    /// behind a carrier NAT share one).
    pub max_handshakes_per_address: usize,
    /// How often a live connection renews its lease in the core; `None`: a
    /// third of the shortest heartbeat timeout of the core's config.
    pub lease_renewal: Option<Duration>,
    /// Push bytes queued per connection (both tiers) before the client
    /// counts as stalled (`Overloaded`). Default 256 KiB.
    pub push_queue_bytes: usize,
    /// Push bytes queued in the whole server; beyond it the connections with
    /// the largest queues are closed (`Overloaded`). Default 256 MiB.
    pub push_budget_bytes: usize,
    pub limits: HubLimits,
    /// The durable store's file (a redb database); `None`: nothing survives
    /// a restart.
    pub store: Option<PathBuf>,
    /// How often what changed is written behind to the store (last seen, who
    /// is shown online). Default 1 s.
    pub flush_interval: Duration,
    /// How long a status or invisibility change waits for its commit before
    /// it is answered "in effect but could not be saved". Default 5 s.
    pub store_timeout: Duration,
    /// Faults injected into the store writer (tests only).
    #[doc(hidden)]
    pub store_faults: Option<Arc<store::StoreFaults>>,
    /// The UDP socket's receive and send buffers, asked of the kernel (which
    /// may grant less: see `/proc/sys/net/core/rmem_max`; the server logs
    /// what it got). Default 8 MiB: a burst of keep-alives or handshakes
    /// from 100,000 clients must wait there, not be dropped.
    pub socket_buffer: usize,
    /// What one pass of the server's loop does at most.
    pub pass: PassBudget,
    /// The largest UDP payload the server accepts, advertised to clients.
    /// Default 1200, QUIC's minimum: clients then never send path-MTU
    /// probes, datagrams padded to up to 1452 bytes that the server must
    /// parse padding byte by byte (measured: 6-10% of the server's CPU
    /// under load). Presence requests are small; what the server sends is
    /// not limited by this.
    pub max_udp_payload: u16,
    /// A deliberately broken variant of the server, for the simulator to
    /// catch (tests only; `None` by default).
    #[doc(hidden)]
    pub mutant: Option<ServerMutant>,
    /// Takes part in a cluster (docs/cluster.md): device inputs go to the
    /// owner of their user's shard, views come from it. `None` (the
    /// default): one node, and no cluster code runs.
    pub cluster: Option<cluster::ClusterSettings>,
    /// Runs this one node as a cluster of one (docs/cluster.md "A cluster
    /// of one"): the edge and owner path of a cluster, over an in-process
    /// bus and KV, in place of the hub's own presence. Ignored with
    /// [`ServerConfig::cluster`]. Default `false`.
    pub cluster_of_one: bool,
}

/// What one pass of the server's loop does at most; what is left is carried
/// to the next pass, never skipped. Each pass reads the socket first, so a
/// backlog of timers or busy connections never stops datagrams being read
/// (and the kernel dropping them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PassBudget {
    /// Datagrams read from the socket (it is read until empty or this many).
    pub datagrams: usize,
    /// Connection timers handled (retransmits, keep-alives, deadlines).
    pub timers: usize,
    /// Connections driven (their events handled, their packets built).
    pub connections: usize,
}

impl Default for PassBudget {
    fn default() -> PassBudget {
        PassBudget {
            datagrams: 1024,
            timers: 1024,
            connections: 1024,
        }
    }
}

impl ServerConfig {
    pub fn new(token_secret: impl Into<Vec<u8>>) -> ServerConfig {
        ServerConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 4433)),
            websocket: None,
            core: greendot_core::Config::default(),
            token_secret: token_secret.into(),
            token_leeway: Duration::from_secs(30),
            identity: None,
            keep_alive: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(45),
            migration: true,
            max_connections: 100_000,
            max_frame: proto::DEFAULT_MAX_FRAME,
            rate: RateLimit::default(),
            hello_timeout: Duration::from_secs(10),
            max_hello: 8 * 1024,
            max_websocket_pending: 1024,
            max_handshakes_per_sec: 3000,
            retry_threshold: 512,
            max_handshakes_per_address: 512,
            lease_renewal: None,
            push_queue_bytes: 256 * 1024,
            push_budget_bytes: 256 * 1024 * 1024,
            limits: HubLimits::default(),
            store: None,
            flush_interval: Duration::from_secs(1),
            store_timeout: Duration::from_secs(5),
            store_faults: None,
            socket_buffer: 8 << 20,
            pass: PassBudget::default(),
            max_udp_payload: 1200,
            mutant: None,
            cluster: None,
            cluster_of_one: false,
        }
    }

    pub(crate) fn renewal(&self) -> Duration {
        self.lease_renewal.unwrap_or_else(|| {
            let shortest = self
                .core
                .kinds
                .iter()
                .map(|k| k.heartbeat_timeout.0)
                .min()
                .unwrap_or(3000);
            Duration::from_millis((shortest / 3).max(1))
        })
    }
}

/// Refuses settings the server cannot run with.
pub(crate) fn validate(config: &ServerConfig) -> Result<(), ServerError> {
    if config.token_secret.is_empty() {
        return Err(SettingError::EmptyTokenSecret.into());
    }
    if config.max_frame < 64 || config.max_frame > u32::MAX as usize {
        return Err(SettingError::MaxFrame.into());
    }
    if config.max_hello < 256 || config.max_websocket_pending == 0 {
        return Err(SettingError::HelloLimits.into());
    }
    if config.push_queue_bytes == 0 || config.push_budget_bytes == 0 {
        return Err(SettingError::PushBytes.into());
    }
    if config.max_handshakes_per_sec == 0 || config.max_handshakes_per_address == 0 {
        return Err(SettingError::HandshakeLimits.into());
    }
    let pass = config.pass;
    if pass.datagrams == 0 || pass.timers == 0 || pass.connections == 0 {
        return Err(SettingError::PassBudget.into());
    }
    if config.flush_interval.is_zero() {
        return Err(SettingError::FlushInterval.into());
    }
    transport_config(config, config.keep_alive)?;
    Ok(())
}
