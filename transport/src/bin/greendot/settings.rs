//! `greendot serve`'s settings: defaults, then a TOML file (`--config`), then
//! `GREENDOT_…` environment variables, then flags (clap reads the last two).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// A duration written as `300ms`, `2s`, `15m`, `24h` or `7d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dur(pub Duration);

pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (like 300ms, 2s, 15m, 24h, 7d)"))?;
    let ms = match unit.trim() {
        "ms" => Some(n),
        "s" | "" => n.checked_mul(1_000),
        "m" | "min" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => {
            return Err(format!(
                "`{text}`: unknown unit `{unit}` (use ms, s, m, h or d)"
            ))
        }
    };
    ms.map(Duration::from_millis)
        .ok_or_else(|| format!("`{text}` is too long"))
}

/// What a backgrounded device means (the core's [`greendot_core::Backgrounded`]),
/// as the settings spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backgrounded {
    /// Not present: shown offline once no device is in the foreground.
    Offline,
    /// Present but away: shown online with status away.
    Away,
}

impl From<greendot_core::Backgrounded> for Backgrounded {
    fn from(b: greendot_core::Backgrounded) -> Backgrounded {
        match b {
            greendot_core::Backgrounded::Offline => Backgrounded::Offline,
            greendot_core::Backgrounded::Away => Backgrounded::Away,
        }
    }
}

impl From<Backgrounded> for greendot_core::Backgrounded {
    fn from(b: Backgrounded) -> greendot_core::Backgrounded {
        match b {
            Backgrounded::Offline => greendot_core::Backgrounded::Offline,
            Backgrounded::Away => greendot_core::Backgrounded::Away,
        }
    }
}

impl std::str::FromStr for Dur {
    type Err = String;
    fn from_str(s: &str) -> Result<Dur, String> {
        parse_duration(s).map(Dur)
    }
}

impl std::fmt::Display for Dur {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0.as_millis();
        for (unit, size) in [
            ("d", 86_400_000),
            ("h", 3_600_000),
            ("m", 60_000),
            ("s", 1_000),
        ] {
            if ms >= size && (ms / size) * size == ms {
                return write!(f, "{}{unit}", ms / size);
            }
        }
        write!(f, "{ms}ms")
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Dur, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

fn secs(n: u64) -> Dur {
    Dur(Duration::from_secs(n))
}

/// One duration per device kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerKind {
    pub mobile: Dur,
    pub desktop: Dur,
    pub web: Dur,
    pub other: Dur,
}

impl PerKind {
    /// The largest of the four.
    pub fn largest(&self) -> Duration {
        [self.web, self.desktop, self.other, self.mobile]
            .into_iter()
            .map(|d| d.0)
            .max()
            .unwrap_or(Duration::ZERO)
    }

    pub fn all(d: Dur) -> PerKind {
        PerKind {
            mobile: d,
            desktop: d,
            web: d,
            other: d,
        }
    }
}

impl PerKind {
    /// The smallest of the four, and its kind's name (web's on a tie: the
    /// smallest by default).
    pub fn smallest(&self) -> (&'static str, Duration) {
        [
            ("web", self.web),
            ("desktop", self.desktop),
            ("other", self.other),
            ("mobile", self.mobile),
        ]
        .into_iter()
        .map(|(kind, d)| (kind, d.0))
        .min_by_key(|(_, d)| *d)
        .unwrap_or(("web", Duration::ZERO))
    }
}

/// The timings an operator set (in the file, the environment or a flag):
/// the cluster defaults replace only the others. A grace is never changed:
/// the cluster defaults follow from the graces in effect, set or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Chosen {
    pub keep_alive: bool,
    pub idle_timeout: bool,
}

// The failover rule (docs/cluster-operations.md, "Failover timing"). A
// device's grace counts from the moment its owner learns that the device's
// node is gone: its lease expired (up to a TTL after the death), or the node
// came back under a new incarnation (a supervisor restarting it at once: no
// head start at all). So a device must be back within its grace of the death
// itself: notice + reconnect <= smallest grace, without counting on the lease.

/// What a client needs after it noticed that its node is gone: its first
/// backoff wait (at most 100 ms with the client library's defaults), then a
/// handshake and a welcome at another node while that node takes over the
/// dead one's devices (1.5 s at most for 3,334 devices at once on this
/// project's loaded 2-core machine: docs/benchmarks.md section 7).
pub const RECONNECT_ALLOWANCE: Duration = Duration::from_secs(2);
/// What the cluster defaults keep to spare beyond the rule: late timers,
/// slow handshakes and slow NATS operations on a loaded machine.
pub const FAILOVER_MARGIN: Duration = Duration::from_secs(2);
/// The cluster default idle timeout never goes below this (a connection to
/// a live node must survive a lost packet or two).
const MIN_CLUSTER_IDLE: Duration = Duration::from_secs(1);

fn floor_100ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis() / 100 * 100).unwrap_or(u64::MAX))
}

/// A secret setting (a NATS password or token): `Debug` never shows it and
/// `--print-config` never prints it (see [`Settings::to_toml`]).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct SecretText(pub String);

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<secret>")
    }
}

impl std::str::FromStr for SecretText {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<SecretText, Self::Err> {
        Ok(SecretText(s.to_owned()))
    }
}

/// The `websocket` value meaning "the QUIC address, over TCP".
pub const WEBSOCKET_LISTEN: &str = "listen";

/// Everything `greendot serve` runs with. `--print-config` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// UDP address of the QUIC server.
    pub listen: SocketAddr,
    /// Holds the dev certificate, the token secret and the store.
    pub data_dir: PathBuf,
    /// TCP address of the WebSocket binding (`wss://ADDR/greendot`);
    /// "listen" (the default): the QUIC address over TCP (TCP and UDP share
    /// the port number; port 0 picks a free TCP port); "off" disables it.
    pub websocket: String,
    /// TCP address of the HTTP port (`/metrics` for Prometheus, `/healthz`,
    /// `/readyz`, the page); "off" disables it.
    pub metrics: String,
    /// `/dev/token` on the HTTP port mints tokens for the page; it only ever
    /// runs with the generated dev certificate and token secret, loopback
    /// HTTP and QUIC ports, and for requests with the code printed at start
    /// (see README "The page"). `false` turns it off.
    pub dev_tokens: bool,
    /// A PEM certificate chain and its PEM private key; when unset, a
    /// self-signed certificate for `localhost` is made in the data directory.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The file holding the HS256 token secret; default `<data_dir>/token-secret`
    /// (made on first start).
    pub secret_file: Option<PathBuf>,
    /// QUIC keep-alive; with `cluster`, when not set: a third of the idle
    /// timeout.
    pub keep_alive: Dur,
    /// QUIC idle timeout; with `cluster`, when not set: from the smallest
    /// grace, so that the failover rule holds (3 s with the default graces).
    pub idle_timeout: Dur,
    pub debounce: Dur,
    pub batch_interval: Dur,
    /// How often last seen and who is shown online are written behind.
    pub flush_interval: Dur,
    /// Clock skew tolerated on a token's expiry.
    pub token_leeway: Dur,
    pub max_connections: usize,
    /// Admission rate: new handshakes per second beyond which new
    /// connections are refused (established ones are served).
    pub max_handshakes_per_sec: u32,
    /// The largest hello, and what a WebSocket client may send before it
    /// (besides its upgrade request), in bytes.
    pub max_hello: usize,
    /// WebSocket connections that may wait for their hello at once.
    pub max_websocket_pending: usize,
    /// How long a status or invisibility change waits for its commit before
    /// it is answered "in effect but could not be saved".
    pub store_timeout: Dur,
    /// Push bytes one connection may have waiting; past it the client is
    /// closed as Overloaded.
    pub push_queue_bytes: usize,
    /// Push bytes all connections together may have waiting; past it the
    /// largest queues are closed as Overloaded.
    pub push_budget_bytes: usize,
    pub grace: PerKind,
    pub heartbeat_timeout: PerKind,
    /// A group member's online count comes at most this often, only when
    /// it changed (docs/groups.md).
    pub group_interval: Dur,
    /// Members of one group, admins included.
    pub max_group_members: usize,
    pub max_group_admins: usize,
    /// Groups one session may subscribe to.
    pub max_group_subscriptions: usize,
    /// Groups the server keeps.
    pub max_groups: usize,
    /// Entries of a member-list page, at most.
    pub group_page_size: usize,
    /// A watched member page stops getting deltas this long after it was
    /// last asked for or renewed.
    pub group_watch_ttl: Dur,
    /// Pages one session may watch at once, and their entries in all.
    pub max_watched_pages: usize,
    pub max_watched_entries: usize,
    /// Member pages a session may ask of one group in a burst, and how
    /// often one more is allowed after it.
    pub group_page_burst: u32,
    pub group_page_refill: Dur,
    /// What a device whose app is in the background means: `offline` (not
    /// present) or `away` (present, shown away).
    pub backgrounded: Backgrounded,
    /// NATS URLs (comma-separated) of the cluster to join; unset: one
    /// process, no NATS.
    pub cluster: Option<String>,
    /// This node's id in the cluster (`[A-Za-z0-9_-]`, unique per node).
    pub node_id: Option<String>,
    /// Where clients and operators reach this node [default: `listen`].
    pub advertise: Option<String>,
    /// Shards of the cluster (the same on every node).
    pub cluster_shards: u32,
    /// TTL of the node lease and the shard claims, whole seconds (the same
    /// on every node); a node stops acting a fifth of it before expiry.
    pub cluster_lease_ttl: Dur,
    /// Replicas of the cluster's KV buckets (3 on a 3-node NATS cluster).
    pub cluster_replicas: usize,
    /// The inter-node protocol version this node sends: unset, its own;
    /// the one before while nodes of the previous release are still in the
    /// cluster (docs/cluster.md "Rolling upgrades").
    pub cluster_protocol: Option<u8>,
    /// NATS user (with `nats_password`).
    pub nats_user: Option<String>,
    /// NATS password of `nats_user`: never printed.
    #[serde(skip_serializing)]
    pub nats_password: Option<SecretText>,
    /// NATS token: never printed.
    #[serde(skip_serializing)]
    pub nats_token: Option<SecretText>,
    /// A file holding the node's NATS nkey seed (`SU…`).
    pub nats_nkey_file: Option<PathBuf>,
    /// A NATS `.creds` file (user JWT and nkey seed).
    pub nats_creds: Option<PathBuf>,
    /// PEM file of the CAs that NATS servers' certificates are checked
    /// against (besides the system's).
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate and key for NATS (both or neither).
    pub nats_tls_cert: Option<PathBuf>,
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse a NATS connection without TLS.
    pub nats_require_tls: bool,
}

impl Default for Settings {
    fn default() -> Settings {
        let core = greendot_core::Config::default();
        let server = greendot_server::ServerConfig::new(b"defaults".to_vec());
        let per = |f: fn(&greendot_core::KindConfig) -> greendot_core::Millis| PerKind {
            mobile: Dur(Duration::from_millis(f(&core.kinds[0]).0)),
            desktop: Dur(Duration::from_millis(f(&core.kinds[1]).0)),
            web: Dur(Duration::from_millis(f(&core.kinds[2]).0)),
            other: Dur(Duration::from_millis(f(&core.kinds[3]).0)),
        };
        Settings {
            listen: SocketAddr::from(([127, 0, 0, 1], 4433)),
            data_dir: PathBuf::from("greendot-data"),
            websocket: WEBSOCKET_LISTEN.into(),
            metrics: "127.0.0.1:9464".into(),
            dev_tokens: true,
            cert: None,
            key: None,
            secret_file: None,
            keep_alive: secs(15),
            idle_timeout: secs(45),
            debounce: Dur(Duration::from_millis(core.debounce.0)),
            batch_interval: Dur(Duration::from_millis(core.batch_interval.0)),
            flush_interval: secs(1),
            token_leeway: secs(30),
            max_connections: 100_000,
            max_handshakes_per_sec: 3000,
            max_hello: server.max_hello,
            max_websocket_pending: server.max_websocket_pending,
            store_timeout: Dur(server.store_timeout),
            push_queue_bytes: server.push_queue_bytes,
            push_budget_bytes: server.push_budget_bytes,
            grace: per(|k| k.grace),
            heartbeat_timeout: per(|k| k.heartbeat_timeout),
            group_interval: Dur(Duration::from_millis(core.group_interval.0)),
            max_group_members: core.max_group_members,
            max_group_admins: core.max_group_admins,
            max_group_subscriptions: core.max_group_subscriptions_per_session,
            max_groups: core.max_groups,
            group_page_size: core.group_page_size,
            group_watch_ttl: Dur(Duration::from_millis(core.group_watch_ttl.0)),
            max_watched_pages: core.max_watched_pages,
            max_watched_entries: core.max_watched_entries,
            group_page_burst: core.group_page_burst,
            group_page_refill: Dur(Duration::from_millis(core.group_page_refill.0)),
            backgrounded: core.backgrounded.into(),
            cluster: None,
            node_id: None,
            advertise: None,
            cluster_shards: 4096,
            cluster_lease_ttl: secs(15),
            cluster_replicas: 3,
            cluster_protocol: None,
            nats_user: None,
            nats_password: None,
            nats_token: None,
            nats_nkey_file: None,
            nats_creds: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            nats_require_tls: false,
        }
    }
}

impl Settings {
    pub fn from_toml(text: &str) -> Result<Settings, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// [`Settings::from_toml`], and which timings the file sets.
    pub fn from_toml_chosen(text: &str) -> Result<(Settings, Chosen), String> {
        let settings = Settings::from_toml(text)?;
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
        let chosen = Chosen {
            keep_alive: table.contains_key("keep_alive"),
            idle_timeout: table.contains_key("idle_timeout"),
        };
        Ok((settings, chosen))
    }

    /// The settings as TOML, secrets left out: a line of comment says which
    /// are set.
    pub fn to_toml(&self) -> Result<String, String> {
        let mut text = toml::to_string(self).map_err(|e| e.to_string())?;
        for (name, set) in [
            ("nats_password", self.nats_password.is_some()),
            ("nats_token", self.nats_token.is_some()),
        ] {
            if set {
                text.insert_str(0, &format!("# {name} is set (not printed)\n"));
            }
        }
        Ok(text)
    }

    /// The credentials and TLS of the connection to NATS; `Err`: settings
    /// that do not go together, or an nkey file that cannot be read.
    pub fn nats_access(&self) -> Result<greendot_cluster::NatsAccess, String> {
        use greendot_cluster::{NatsCredentials, Secret};
        let mut ways = Vec::new();
        match (&self.nats_user, &self.nats_password) {
            (Some(user), Some(password)) => ways.push(NatsCredentials::UserPassword {
                user: user.clone(),
                password: Secret::new(password.0.clone()),
            }),
            (None, None) => {}
            _ => return Err("set both nats_user and nats_password, or neither".into()),
        }
        if let Some(token) = &self.nats_token {
            ways.push(NatsCredentials::Token(Secret::new(token.0.clone())));
        }
        if let Some(path) = &self.nats_nkey_file {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the nkey seed {}: {e}", path.display()))?;
            ways.push(NatsCredentials::NkeySeed(Secret::new(seed.trim())));
        }
        if let Some(path) = &self.nats_creds {
            ways.push(NatsCredentials::CredsFile(path.clone()));
        }
        if ways.len() > 1 {
            return Err(
                "set one way of logging in to NATS: nats_user and nats_password, \
                        nats_token, nats_nkey_file or nats_creds"
                    .into(),
            );
        }
        let tls_client = match (&self.nats_tls_cert, &self.nats_tls_key) {
            (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            (None, None) => None,
            _ => return Err("set both nats_tls_cert and nats_tls_key, or neither".into()),
        };
        Ok(greendot_cluster::NatsAccess {
            credentials: ways.pop().unwrap_or_default(),
            tls_ca: self.nats_tls_ca.clone(),
            tls_client,
            require_tls: self.nats_require_tls,
        })
    }

    /// The envelope of this node's inter-node messages: a key derived from
    /// the token secret, and the protocol version it sends.
    pub fn envelope(&self, token_secret: &[u8]) -> Result<greendot_cluster::Envelope, String> {
        let envelope =
            greendot_cluster::Envelope::new(greendot_cluster::MessageKey::derive(token_secret));
        match self.cluster_protocol {
            None => Ok(envelope),
            Some(v) => envelope.sending(v),
        }
    }

    pub fn secret_path(&self) -> PathBuf {
        self.secret_file
            .clone()
            .unwrap_or_else(|| self.data_dir.join(crate::SECRET_FILE))
    }

    /// The cluster layer's settings when `cluster` is set: the same TTL for
    /// leases and claims, a margin of a fifth of it, operations bounded by
    /// a third of the window a holder may act without a renewal.
    pub fn cluster_config(
        &self,
    ) -> Result<Option<(String, greendot_cluster::ClusterConfig)>, String> {
        let Some(urls) = &self.cluster else {
            return Ok(None);
        };
        let id = self.node_id.as_deref().ok_or(
            "--cluster needs --node-id (GREENDOT_NODE_ID, node_id): a name unique to this node",
        )?;
        let node = greendot_cluster::NodeId::new(id).map_err(|e| e.to_string())?;
        let mut c = greendot_cluster::ClusterConfig::new(node);
        c.shard_count = self.cluster_shards;
        c.replicas = self.cluster_replicas;
        c.lease_ttl = self.cluster_lease_ttl.0;
        c.claim_ttl = self.cluster_lease_ttl.0;
        c.marker_ttl = self.cluster_lease_ttl.0;
        c.margin = self.cluster_lease_ttl.0 / 5;
        c.op_timeout = (c.claim_timing().act_window() / 3).min(Duration::from_secs(2));
        c.nats = self.nats_access()?;
        // Group definitions in the cluster's store follow the core's limits.
        c.groups = greendot_cluster::GroupLimits {
            max_members: u32::try_from(self.max_group_members).unwrap_or(u32::MAX),
            max_admins: u32::try_from(self.max_group_admins).unwrap_or(u32::MAX),
        };
        c.validate().map_err(|e| format!("cluster settings: {e}"))?;
        Ok(Some((urls.clone(), c)))
    }

    /// The longest a QUIC client may take to notice that its node died or
    /// stopped: its idle timer runs from the last packet it got and restarts
    /// once, at the first ack-eliciting packet it sends after that (its own
    /// keep-alive or a request), which it sends within the idle timeout or
    /// not at all. The lower of the client's and the server's idle timeouts
    /// applies, so the server's bounds it: at most twice the idle timeout
    /// (once, for a quiet client whose keep-alive is longer than it).
    pub fn worst_notice(&self) -> Duration {
        self.idle_timeout.0.saturating_mul(2)
    }

    /// With `cluster` set, what breaks the failover rule, one sentence each
    /// (empty: it holds). Without `cluster`, nothing.
    pub fn failover_problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.cluster.is_none() {
            return problems;
        }
        let (kind, grace) = self.grace.smallest();
        let notice = self.worst_notice();
        let needed = notice.saturating_add(RECONNECT_ALLOWANCE);
        if needed > grace {
            let idle_max = floor_100ms(grace.saturating_sub(RECONNECT_ALLOWANCE) / 2);
            let fix = if idle_max.is_zero() {
                format!("use a grace of at least {}", Dur(needed))
            } else {
                format!(
                    "use an idle timeout of at most {} or a grace of at least {}",
                    Dur(idle_max),
                    Dur(needed)
                )
            };
            problems.push(format!(
                "idle_timeout {} breaks the cluster failover rule: a client of a node that died or \
                 stopped may notice only after up to {} (twice the idle timeout) and needs about {} \
                 more to reconnect to another node, past the {kind} grace ({}): its user would be \
                 shown offline (DESIGN.md C2); {fix} (docs/cluster-operations.md, \"Failover timing\")",
                self.idle_timeout,
                Dur(notice),
                Dur(RECONNECT_ALLOWANCE),
                Dur(grace),
            ));
        }
        if self.keep_alive.0.saturating_mul(2) > self.idle_timeout.0 {
            problems.push(format!(
                "keep_alive {} is more than half the idle timeout ({}): a quiet connection to a live \
                 node may time out after one lost keep-alive; use at most {}",
                self.keep_alive,
                self.idle_timeout,
                Dur(floor_100ms(self.idle_timeout.0 / 3).max(Duration::from_millis(100)))
            ));
        }
        problems
    }

    /// With `cluster` set: an idle timeout and a keep-alive the operator did
    /// not set follow from the smallest grace (theirs or the default), so
    /// that the failover rule holds with [`FAILOVER_MARGIN`] to spare: the
    /// idle timeout is (smallest grace - reconnect allowance - margin) / 2,
    /// 1 s at least and the one-process default (45 s) at most (3 s with
    /// the default graces, the web's 10 s being the smallest); the
    /// keep-alive a third of the idle timeout. Without `cluster`, nothing
    /// changes.
    pub fn apply_cluster_defaults(&mut self, chosen: Chosen) {
        if self.cluster.is_none() {
            return;
        }
        let single = Settings::default();
        if !chosen.idle_timeout {
            let (_, grace) = self.grace.smallest();
            let room = grace.saturating_sub(RECONNECT_ALLOWANCE + FAILOVER_MARGIN) / 2;
            self.idle_timeout =
                Dur(floor_100ms(room).clamp(MIN_CLUSTER_IDLE, single.idle_timeout.0));
        }
        if !chosen.keep_alive {
            let third = floor_100ms(self.idle_timeout.0 / 3).max(Duration::from_millis(100));
            self.keep_alive = Dur(third.min(single.keep_alive.0));
        }
    }

    /// The WebSocket binding's TCP address; `None`: off.
    pub fn websocket_addr(&self) -> Result<Option<SocketAddr>, String> {
        let text = self.websocket.trim();
        if text.eq_ignore_ascii_case("off") {
            Ok(None)
        } else if text.eq_ignore_ascii_case(WEBSOCKET_LISTEN) {
            Ok(Some(self.listen))
        } else {
            text.parse().map(Some).map_err(|_| {
                format!("websocket = `{text}`: not an address (IP:PORT), `listen` or `off`")
            })
        }
    }

    pub fn store_path(&self) -> PathBuf {
        self.data_dir.join("greendot.redb")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_toml_round_trip() {
        assert_eq!(parse_duration("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert!(parse_duration("soon").is_err());
        assert_eq!(Dur(Duration::from_millis(1500)).to_string(), "1500ms");
        assert_eq!(Dur(Duration::from_secs(120)).to_string(), "2m");
        let s = Settings::default();
        let text = s.to_toml().unwrap();
        assert_eq!(Settings::from_toml(&text).unwrap(), s);
        let partial = Settings::from_toml("debounce = \"1s\"\n[grace]\nmobile = \"5s\"\ndesktop = \"5s\"\nweb = \"5s\"\nother = \"5s\"\n").unwrap();
        assert_eq!(partial.debounce, secs(1));
        assert!(Settings::from_toml("nonsense = 1").is_err());
        assert!(
            matches!(s.cluster_config(), Ok(None)),
            "no cluster unless asked"
        );
        let c = Settings::from_toml(
            "cluster = \"nats://a:4222\"\nnode_id = \"n1\"\ncluster_lease_ttl = \"2s\"\n",
        )
        .unwrap();
        let (urls, config) = c.cluster_config().unwrap().unwrap();
        assert_eq!(urls, "nats://a:4222");
        assert_eq!(config.lease_ttl, Duration::from_secs(2));
        assert_eq!(config.margin, Duration::from_millis(400));
        let no_id = Settings::from_toml("cluster = \"nats://a:4222\"\n").unwrap();
        assert!(no_id.cluster_config().is_err());
        let bad_ttl = Settings::from_toml(
            "cluster = \"x\"\nnode_id = \"n\"\ncluster_lease_ttl = \"1500ms\"\n",
        )
        .unwrap();
        assert!(bad_ttl.cluster_config().is_err());

        // The WebSocket binding: the QUIC address by default, an address, off.
        assert_eq!(s.websocket_addr(), Ok(Some(s.listen)));
        let ws = Settings::from_toml("websocket = \"127.0.0.1:8443\"\n").unwrap();
        assert_eq!(ws.websocket_addr(), Ok(Some(([127, 0, 0, 1], 8443).into())));
        let off = Settings::from_toml("websocket = \"off\"\n").unwrap();
        assert_eq!(off.websocket_addr(), Ok(None));
        let bad = Settings::from_toml("websocket = \"nowhere\"\n").unwrap();
        assert!(bad.websocket_addr().is_err());
    }

    fn cluster(extra: &str) -> Settings {
        Settings::from_toml(&format!(
            "cluster = \"nats://a:4222\"\nnode_id = \"n1\"\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn cluster_defaults_keep_the_failover_rule() {
        // One process: the defaults stay, and there is no rule to break.
        let mut one = Settings::default();
        one.apply_cluster_defaults(Chosen::default());
        assert_eq!((one.idle_timeout, one.keep_alive), (secs(45), secs(15)));
        assert!(one.failover_problems().is_empty());

        // A cluster at the one-process timings breaks it: 2 x 45 s + 2 s is
        // past the web grace (10 s), the smallest.
        let old = cluster("");
        assert_eq!(old.grace.smallest(), ("web", Duration::from_secs(10)));
        let problems = old.failover_problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("web grace (10s)")
                && problems[0].contains("at most 4s or a grace of at least 92s"),
            "{problems:?}"
        );

        // The cluster defaults: (10 s - 2 s - 2 s) / 2 and a third of it,
        // within the rule with the margin to spare.
        let mut s = cluster("");
        s.apply_cluster_defaults(Chosen::default());
        assert_eq!((s.idle_timeout, s.keep_alive), (secs(3), secs(1)));
        assert!(
            s.failover_problems().is_empty(),
            "{:?}",
            s.failover_problems()
        );
        let (_, grace) = s.grace.smallest();
        assert!(s.worst_notice() + RECONNECT_ALLOWANCE + FAILOVER_MARGIN <= grace);

        // What the operator set stays, and is checked.
        let mut set = cluster("idle_timeout = \"10s\"\n");
        set.apply_cluster_defaults(Chosen {
            idle_timeout: true,
            keep_alive: false,
        });
        assert_eq!(set.idle_timeout, secs(10));
        assert_eq!(set.keep_alive, Dur(Duration::from_millis(3300)));
        assert_eq!(set.failover_problems().len(), 1);
        let mut both = cluster("");
        both.keep_alive = secs(2);
        both.apply_cluster_defaults(Chosen {
            idle_timeout: false,
            keep_alive: true,
        });
        assert_eq!((both.idle_timeout, both.keep_alive), (secs(3), secs(2)));
        let problems = both.failover_problems();
        assert!(
            problems.len() == 1 && problems[0].contains("keep_alive 2s is more than half"),
            "{problems:?}"
        );

        // The defaults follow the graces in effect, the operator's included.
        let mut long = cluster(
            "[grace]\nmobile = \"60s\"\ndesktop = \"60s\"\nweb = \"30s\"\nother = \"60s\"\n",
        );
        long.apply_cluster_defaults(Chosen::default());
        assert_eq!(
            (long.idle_timeout, long.keep_alive),
            (secs(13), Dur(Duration::from_millis(4300)))
        );
        assert!(long.failover_problems().is_empty());
        let mut huge =
            cluster("[grace]\nmobile = \"5m\"\ndesktop = \"5m\"\nweb = \"5m\"\nother = \"5m\"\n");
        huge.apply_cluster_defaults(Chosen::default());
        assert_eq!((huge.idle_timeout, huge.keep_alive), (secs(45), secs(15)));
        // A grace too short for any idle timeout: the floor, and a warning.
        let mut short =
            cluster("[grace]\nmobile = \"1s\"\ndesktop = \"1s\"\nweb = \"1s\"\nother = \"1s\"\n");
        short.apply_cluster_defaults(Chosen::default());
        assert_eq!(
            (short.idle_timeout, short.keep_alive),
            (secs(1), Dur(Duration::from_millis(300)))
        );
        let problems = short.failover_problems();
        assert!(
            problems.len() == 1 && problems[0].contains("use a grace of at least 4s"),
            "{problems:?}"
        );
    }

    #[test]
    fn nats_credentials_and_tls_are_settings_and_secrets_stay_unprinted() {
        let s = cluster(
            "nats_user = \"greendot\"\nnats_password = \"hunter2\"\nnats_tls_ca = \"/etc/nats/ca.pem\"\n\
             nats_tls_cert = \"/etc/nats/c.pem\"\nnats_tls_key = \"/etc/nats/c.key\"\nnats_require_tls = true\n",
        );
        let (_, config) = s.cluster_config().unwrap().unwrap();
        let access = &config.nats;
        assert!(matches!(
            &access.credentials,
            greendot_cluster::NatsCredentials::UserPassword { user, password }
                if user == "greendot" && password.expose() == "hunter2"
        ));
        assert_eq!(
            access.tls_ca.as_deref(),
            Some(std::path::Path::new("/etc/nats/ca.pem"))
        );
        assert!(access.tls_client.is_some() && access.require_tls);
        // Neither --print-config nor a debug print shows the password.
        let text = s.to_toml().unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(
            text.contains("# nats_password is set (not printed)"),
            "{text}"
        );
        assert!(text.contains("nats_user = \"greendot\""), "{text}");
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(!format!("{config:?}").contains("hunter2"));
        let token = cluster("nats_token = \"t0ken\"\n");
        assert!(!token.to_toml().unwrap().contains("t0ken"));
        assert!(!format!("{token:?}").contains("t0ken"));

        // What does not go together is refused, with the settings named.
        for (extra, says) in [
            ("nats_user = \"u\"\n", "nats_user and nats_password"),
            ("nats_password = \"p\"\n", "nats_user and nats_password"),
            (
                "nats_token = \"t\"\nnats_creds = \"/x.creds\"\n",
                "one way of logging in",
            ),
            (
                "nats_tls_cert = \"/c.pem\"\n",
                "nats_tls_cert and nats_tls_key",
            ),
            (
                "nats_nkey_file = \"/no/such/seed\"\n",
                "cannot read the nkey seed",
            ),
        ] {
            let err = cluster(extra).cluster_config().unwrap_err();
            assert!(err.contains(says), "{extra}: {err}");
        }

        // The protocol version sent: the build's own unless set, and only
        // one this build reads.
        let own = greendot_cluster::PROTOCOL_VERSION;
        assert_eq!(cluster("").envelope(b"k").unwrap().send_version(), own);
        assert!(cluster(&format!("cluster_protocol = {}\n", own + 1))
            .envelope(b"k")
            .is_err());
    }

    #[test]
    fn a_file_says_which_timings_it_sets() {
        let (_, none) = Settings::from_toml_chosen("debounce = \"1s\"\n").unwrap();
        assert_eq!(none, Chosen::default());
        let (s, both) =
            Settings::from_toml_chosen("idle_timeout = \"8s\"\nkeep_alive = \"2s\"\n").unwrap();
        assert_eq!((s.idle_timeout, s.keep_alive), (secs(8), secs(2)));
        assert_eq!(
            both,
            Chosen {
                keep_alive: true,
                idle_timeout: true
            }
        );
        assert!(Settings::from_toml_chosen("nonsense = 1").is_err());
    }
}
