//! `greendot`: the presence server and its command-line tools.
//!
//! - `greendot serve`: runs the server (defaults: 127.0.0.1:4433/udp, data in
//!   `./greendot-data/`, metrics and health over HTTP on 127.0.0.1:9464);
//! - `greendot token`: mints a token with the data directory's secret;
//! - `greendot connect`, `watch`, `query`: a client on a terminal;
//! - `greendot cluster status`: the nodes and shard owners of a cluster.

mod client;
mod cluster;
mod cluster_io;
mod cut_off;
mod group;
mod page;
mod serve;
mod settings;

use clap::{Args, Parser, Subcommand, ValueEnum};
use greendot_proto::Kind;
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use settings::{Backgrounded, Chosen, Dur, PerKind, Settings};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

// The server's packets allocate and free small buffers all the time:
// mimalloc takes about 13% less CPU and handshakes 17% faster than glibc's
// malloc (docs/benchmarks-overload.md), for about 8% more memory.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub const CERT_FILE: &str = "cert.pem";
pub const KEY_FILE: &str = "key.pem";
pub const SECRET_FILE: &str = "token-secret";

#[derive(Parser, Debug)]
#[command(
    name = "greendot",
    version,
    about = "greendot: a presence server over QUIC, and its tools",
    after_help = "Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug) to change how much."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the server (settings: flags > GREENDOT_* environment > --config file > defaults).
    Serve(Box<ServeArgs>),
    /// Print a token (a JWT signed with the data directory's secret) on stdout.
    Token(TokenArgs),
    /// Stay online as the token's device until Ctrl-C (which logs out).
    Connect {
        #[command(flatten)]
        client: ClientArgs,
        /// available, away, busy or do-not-disturb.
        #[arg(long)]
        status: Option<String>,
        /// A status message.
        #[arg(long)]
        message: Option<String>,
        /// Appear offline to everyone else.
        #[arg(long)]
        invisible: bool,
        /// On Ctrl-C leave without logging out: the device lingers for its
        /// grace, as after a crash.
        #[arg(long)]
        no_logout: bool,
    },
    /// Print one line per change of these users until Ctrl-C.
    Watch {
        #[command(flatten)]
        client: ClientArgs,
        /// The users to watch.
        #[arg(required = true)]
        users: Vec<String>,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
        /// Subscribe in the batched tier (coalesced, every batch interval).
        #[arg(long)]
        batched: bool,
    },
    /// Load-test a running server: open N connections (users bench0…), each
    /// watching 20 others, with churn; print one table row.
    Bench(BenchArgs),
    /// Operate a cluster (see docs/cluster-operations.md).
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Groups: write one from files, watch its online count, read its
    /// member list (docs/groups.md).
    #[command(subcommand)]
    Group(GroupCommand),
    /// Print what is shown of these users now, once.
    Query {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(required = true)]
        users: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a user's tokens (of one device with --device) issued before
    /// now (or --before): live sessions holding one are closed; needs a
    /// service token. In a cluster, run it against every node.
    Revoke {
        #[command(flatten)]
        client: ClientArgs,
        /// The user whose tokens are revoked.
        user: String,
        /// Only this device's tokens.
        #[arg(long)]
        device: Option<String>,
        /// Unix seconds: tokens issued before it are revoked. Default: now.
        #[arg(long)]
        before: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
enum GroupCommand {
    /// Write a group whole from files of user ids, one per line ('#'
    /// starts a comment); needs a service token. Prints its version. A
    /// list larger than the server's frame cap is written in parts (the
    /// first part set, the rest added), and it says so.
    Set {
        #[command(flatten)]
        client: ClientArgs,
        /// The group's number.
        #[arg(long)]
        group: u64,
        /// The members' file.
        #[arg(long)]
        members: PathBuf,
        /// The admins' file (admins are members whether listed or not).
        #[arg(long)]
        admins: Option<PathBuf>,
    },
    /// Change a group by difference, without sending its whole list; needs
    /// a service token. Prints its new version. Each flag may be given
    /// many times; removals come first, so a user both removed and added
    /// ends added.
    Change {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        group: u64,
        /// A user who joins.
        #[arg(long, value_name = "USER")]
        add: Vec<String>,
        /// A user who leaves (an admin too).
        #[arg(long, value_name = "USER")]
        remove: Vec<String>,
        /// A user who becomes an admin (and a member).
        #[arg(long, value_name = "USER")]
        add_admin: Vec<String>,
        /// An admin who stays a member only.
        #[arg(long, value_name = "USER")]
        remove_admin: Vec<String>,
        /// Change the group only at this version (0: only if it does not
        /// exist yet), as printed by `set` and `change`.
        #[arg(long)]
        expect_version: Option<u64>,
    },
    /// Remove a group; needs a service token.
    Remove {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        group: u64,
    },
    /// Subscribe as the token's user (a member) and print the online count
    /// when it changes; an admin also sees each member's change. Until Ctrl-C.
    Watch {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        group: u64,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print a page of the member list, online members first, then
    /// `next: CURSOR` if there is more (pass it to --after).
    Page {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        group: u64,
        /// Where the page starts: a `next:` printed before.
        #[arg(long, value_parser = group::parse_cursor)]
        after: Option<greendot_client::GroupCursor>,
        /// Entries per page (the server allows at most 200).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Every page, one after another.
        #[arg(long, conflicts_with = "watch")]
        all: bool,
        /// Then watch the page: print a line for each change of a member it
        /// lists, renewing the watch, until Ctrl-C or the user leaves the
        /// group.
        #[arg(long)]
        watch: bool,
        /// How often --watch renews the watch: under the server's
        /// --group-watch-ttl (60s by default), or the watch runs out.
        #[arg(long, default_value = "30s", requires = "watch")]
        renew_every: settings::Dur,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum ClusterCommand {
    /// Nodes and their leases, shards owned per node with epochs, unowned shards.
    Status {
        /// NATS URLs, comma-separated.
        #[arg(long, env = "GREENDOT_CLUSTER")]
        cluster: String,
        /// Details of one shard.
        #[arg(long)]
        shard: Option<u32>,
        /// Each node's shards with their epochs.
        #[arg(long)]
        shards: bool,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

/// How a node (or `greendot cluster status`) logs in to NATS and checks it.
/// Passwords and tokens in flags show in the process list: prefer the
/// environment or the settings file.
#[derive(Args, Debug)]
struct NatsArgs {
    /// NATS user (with --nats-password).
    #[arg(long, env = "GREENDOT_NATS_USER")]
    nats_user: Option<String>,
    /// NATS password of --nats-user.
    #[arg(long, env = "GREENDOT_NATS_PASSWORD", hide_env_values = true)]
    nats_password: Option<settings::SecretText>,
    /// NATS token.
    #[arg(long, env = "GREENDOT_NATS_TOKEN", hide_env_values = true)]
    nats_token: Option<settings::SecretText>,
    /// File holding the node's NATS nkey seed.
    #[arg(long, env = "GREENDOT_NATS_NKEY_FILE")]
    nats_nkey_file: Option<PathBuf>,
    /// NATS .creds file (user JWT and nkey seed).
    #[arg(long, env = "GREENDOT_NATS_CREDS")]
    nats_creds: Option<PathBuf>,
    /// PEM CA file the NATS servers' certificates are checked against.
    #[arg(long, env = "GREENDOT_NATS_TLS_CA")]
    nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate for NATS (with --nats-tls-key).
    #[arg(long, env = "GREENDOT_NATS_TLS_CERT")]
    nats_tls_cert: Option<PathBuf>,
    /// PEM private key of --nats-tls-cert.
    #[arg(long, env = "GREENDOT_NATS_TLS_KEY")]
    nats_tls_key: Option<PathBuf>,
    /// Refuse a NATS connection without TLS [default: false].
    #[arg(long, env = "GREENDOT_NATS_REQUIRE_TLS")]
    nats_require_tls: Option<bool>,
}

impl NatsArgs {
    /// Over what the settings say (the file's, or the defaults).
    fn apply(&self, s: &mut Settings) {
        fn over<T: Clone>(slot: &mut Option<T>, value: &Option<T>) {
            if value.is_some() {
                *slot = value.clone();
            }
        }
        over(&mut s.nats_user, &self.nats_user);
        over(&mut s.nats_password, &self.nats_password);
        over(&mut s.nats_token, &self.nats_token);
        over(&mut s.nats_nkey_file, &self.nats_nkey_file);
        over(&mut s.nats_creds, &self.nats_creds);
        over(&mut s.nats_tls_ca, &self.nats_tls_ca);
        over(&mut s.nats_tls_cert, &self.nats_tls_cert);
        over(&mut s.nats_tls_key, &self.nats_tls_key);
        if let Some(v) = self.nats_require_tls {
            s.nats_require_tls = v;
        }
    }
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// A TOML file of settings (see --print-config for every key).
    #[arg(long, env = "GREENDOT_CONFIG")]
    config: Option<PathBuf>,
    /// Print the effective settings as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// UDP address to listen on [default: 127.0.0.1:4433]; port 0 picks one.
    #[arg(long, env = "GREENDOT_LISTEN")]
    listen: Option<SocketAddr>,
    /// Directory for the certificate, the token secret and the store
    /// [default: greendot-data].
    #[arg(long, env = "GREENDOT_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// TCP address of the WebSocket binding (wss://ADDR/greendot), "listen"
    /// for the --listen address over TCP, or "off" [default: listen].
    #[arg(long, env = "GREENDOT_WEBSOCKET")]
    websocket: Option<String>,
    /// TCP address of the HTTP port (/metrics, /healthz, /readyz, the page),
    /// or "off" [default: 127.0.0.1:9464].
    #[arg(long, env = "GREENDOT_METRICS")]
    metrics: Option<String>,
    /// Serve /dev/token (tokens for the page, with the code printed at
    /// start) when the dev certificate and secret are in use and the HTTP
    /// and QUIC ports are on loopback [default: true].
    #[arg(long, env = "GREENDOT_DEV_TOKENS")]
    dev_tokens: Option<bool>,
    /// PEM certificate chain (with --key) instead of the dev certificate.
    #[arg(long, env = "GREENDOT_CERT")]
    cert: Option<PathBuf>,
    /// PEM private key of --cert.
    #[arg(long, env = "GREENDOT_KEY")]
    key: Option<PathBuf>,
    /// File holding the token secret [default: <data-dir>/token-secret].
    #[arg(long, env = "GREENDOT_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    /// QUIC keep-alive interval [default: 15s; with --cluster: a third of
    /// the idle timeout, 1s with the default graces].
    #[arg(long, env = "GREENDOT_KEEP_ALIVE")]
    keep_alive: Option<Dur>,
    /// QUIC idle timeout: silence this long is a lost connection [default:
    /// 45s; with --cluster: from the smallest grace, 3s with the default
    /// graces (docs/cluster-operations.md, "Failover timing")].
    #[arg(long, env = "GREENDOT_IDLE_TIMEOUT")]
    idle_timeout: Option<Dur>,
    /// Debounce window of visible changes [default: 300ms].
    #[arg(long, env = "GREENDOT_DEBOUNCE")]
    debounce: Option<Dur>,
    /// Batched tier flush interval [default: 2s].
    #[arg(long, env = "GREENDOT_BATCH_INTERVAL")]
    batch_interval: Option<Dur>,
    /// How often last seen is written behind to the store [default: 1s].
    #[arg(long, env = "GREENDOT_FLUSH_INTERVAL")]
    flush_interval: Option<Dur>,
    /// Grace of a lost connection, for every device kind (the config file
    /// can set each kind).
    #[arg(long, env = "GREENDOT_GRACE")]
    grace: Option<Dur>,
    /// Heartbeat timeout, for every device kind.
    #[arg(long, env = "GREENDOT_HEARTBEAT_TIMEOUT")]
    heartbeat_timeout: Option<Dur>,
    /// What a device whose app is in the background means: offline (not
    /// present, the default) or away (present, shown away).
    #[arg(long, env = "GREENDOT_BACKGROUNDED", value_enum)]
    backgrounded: Option<Backgrounded>,
    /// A group member's online count at most this often [default: 10s].
    #[arg(long, env = "GREENDOT_GROUP_INTERVAL")]
    group_interval: Option<Dur>,
    /// Members of one group, admins included [default: 10000].
    #[arg(long, env = "GREENDOT_MAX_GROUP_MEMBERS")]
    max_group_members: Option<usize>,
    /// Admins of one group [default: 32].
    #[arg(long, env = "GREENDOT_MAX_GROUP_ADMINS")]
    max_group_admins: Option<usize>,
    /// Group subscriptions of one session [default: 100].
    #[arg(long, env = "GREENDOT_MAX_GROUP_SUBSCRIPTIONS")]
    max_group_subscriptions: Option<usize>,
    /// Groups the server keeps [default: 100000].
    #[arg(long, env = "GREENDOT_MAX_GROUPS")]
    max_groups: Option<usize>,
    /// Entries of a member-list page, at most [default: 200].
    #[arg(long, env = "GREENDOT_GROUP_PAGE_SIZE")]
    group_page_size: Option<usize>,
    /// A watched member page expires this long after it was last asked
    /// for or renewed [default: 60s].
    #[arg(long, env = "GREENDOT_GROUP_WATCH_TTL")]
    group_watch_ttl: Option<Dur>,
    /// Member pages one session may watch at once [default: 3].
    #[arg(long, env = "GREENDOT_MAX_WATCHED_PAGES")]
    max_watched_pages: Option<usize>,
    /// Entries of the pages one session watches, in all [default: 600].
    #[arg(long, env = "GREENDOT_MAX_WATCHED_ENTRIES")]
    max_watched_entries: Option<usize>,
    /// Member pages a session may ask of one group in a burst [default: 10].
    #[arg(long, env = "GREENDOT_GROUP_PAGE_BURST")]
    group_page_burst: Option<u32>,
    /// After the burst, one more member page this often [default: 1s].
    #[arg(long, env = "GREENDOT_GROUP_PAGE_REFILL")]
    group_page_refill: Option<Dur>,
    /// Clock skew tolerated on token expiry [default: 30s].
    #[arg(long, env = "GREENDOT_TOKEN_LEEWAY")]
    token_leeway: Option<Dur>,
    /// Connection cap [default: 100000].
    #[arg(long, env = "GREENDOT_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Admission rate, new handshakes per second [default: 3000].
    #[arg(long, env = "GREENDOT_MAX_HANDSHAKES_PER_SEC")]
    max_handshakes_per_sec: Option<u32>,
    /// Largest hello, and what a WebSocket client may send before it, in
    /// bytes [default: 8192].
    #[arg(long, env = "GREENDOT_MAX_HELLO")]
    max_hello: Option<usize>,
    /// WebSocket connections that may wait for their hello at once
    /// [default: 1024].
    #[arg(long, env = "GREENDOT_MAX_WEBSOCKET_PENDING")]
    max_websocket_pending: Option<usize>,
    /// Longest wait for a status or invisibility change's commit [default: 5s].
    #[arg(long, env = "GREENDOT_STORE_TIMEOUT")]
    store_timeout: Option<Dur>,
    /// Push bytes one connection may have waiting [default: 262144].
    #[arg(long, env = "GREENDOT_PUSH_QUEUE_BYTES")]
    push_queue_bytes: Option<usize>,
    /// Push bytes all connections may have waiting [default: 268435456].
    #[arg(long, env = "GREENDOT_PUSH_BUDGET_BYTES")]
    push_budget_bytes: Option<usize>,
    /// Join a cluster: NATS URLs, comma-separated (nats://host:4222,…).
    #[arg(long, env = "GREENDOT_CLUSTER")]
    cluster: Option<String>,
    /// This node's id in the cluster ([A-Za-z0-9_-], unique per node).
    #[arg(long, env = "GREENDOT_NODE_ID")]
    node_id: Option<String>,
    /// Address clients and operators reach this node at [default: --listen].
    #[arg(long, env = "GREENDOT_ADVERTISE")]
    advertise: Option<String>,
    /// Shards of the cluster, the same on every node [default: 4096].
    #[arg(long, env = "GREENDOT_CLUSTER_SHARDS")]
    cluster_shards: Option<u32>,
    /// Node lease and shard claim TTL, whole seconds, the same on every node [default: 15s].
    #[arg(long, env = "GREENDOT_CLUSTER_LEASE_TTL")]
    cluster_lease_ttl: Option<Dur>,
    /// Replicas of the cluster's KV buckets [default: 3].
    #[arg(long, env = "GREENDOT_CLUSTER_REPLICAS")]
    cluster_replicas: Option<usize>,
    /// The inter-node protocol version to send [default: this build's];
    /// the previous one while a rolling upgrade raises it (docs/cluster.md).
    #[arg(long, env = "GREENDOT_CLUSTER_PROTOCOL")]
    cluster_protocol: Option<u8>,
    #[command(flatten)]
    nats: NatsArgs,
}

impl ServeArgs {
    /// Defaults, then the file, then environment and flags.
    fn settings(&self) -> Result<Settings, String> {
        let (mut s, mut chosen) = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                Settings::from_toml_chosen(&text).map_err(|e| format!("{}: {e}", path.display()))?
            }
            None => (Settings::default(), Chosen::default()),
        };
        fn set<T: Clone>(slot: &mut T, value: &Option<T>) {
            if let Some(v) = value {
                *slot = v.clone();
            }
        }
        set(&mut s.listen, &self.listen);
        set(&mut s.data_dir, &self.data_dir);
        set(&mut s.websocket, &self.websocket);
        set(&mut s.metrics, &self.metrics);
        set(&mut s.dev_tokens, &self.dev_tokens);
        if self.cert.is_some() {
            s.cert = self.cert.clone();
        }
        if self.key.is_some() {
            s.key = self.key.clone();
        }
        if self.secret_file.is_some() {
            s.secret_file = self.secret_file.clone();
        }
        set(&mut s.keep_alive, &self.keep_alive);
        set(&mut s.idle_timeout, &self.idle_timeout);
        set(&mut s.debounce, &self.debounce);
        set(&mut s.batch_interval, &self.batch_interval);
        set(&mut s.flush_interval, &self.flush_interval);
        set(&mut s.token_leeway, &self.token_leeway);
        set(&mut s.backgrounded, &self.backgrounded);
        set(&mut s.max_connections, &self.max_connections);
        set(&mut s.group_interval, &self.group_interval);
        set(&mut s.max_group_members, &self.max_group_members);
        set(&mut s.max_group_admins, &self.max_group_admins);
        set(
            &mut s.max_group_subscriptions,
            &self.max_group_subscriptions,
        );
        set(&mut s.max_groups, &self.max_groups);
        set(&mut s.group_page_size, &self.group_page_size);
        set(&mut s.group_watch_ttl, &self.group_watch_ttl);
        set(&mut s.max_watched_pages, &self.max_watched_pages);
        set(&mut s.max_watched_entries, &self.max_watched_entries);
        set(&mut s.group_page_burst, &self.group_page_burst);
        set(&mut s.group_page_refill, &self.group_page_refill);
        set(&mut s.max_handshakes_per_sec, &self.max_handshakes_per_sec);
        set(&mut s.max_hello, &self.max_hello);
        set(&mut s.max_websocket_pending, &self.max_websocket_pending);
        set(&mut s.store_timeout, &self.store_timeout);
        set(&mut s.push_queue_bytes, &self.push_queue_bytes);
        set(&mut s.push_budget_bytes, &self.push_budget_bytes);
        for (slot, value) in [
            (&mut s.cluster, &self.cluster),
            (&mut s.node_id, &self.node_id),
            (&mut s.advertise, &self.advertise),
        ] {
            if value.is_some() {
                *slot = value.clone();
            }
        }
        set(&mut s.cluster_shards, &self.cluster_shards);
        set(&mut s.cluster_lease_ttl, &self.cluster_lease_ttl);
        set(&mut s.cluster_replicas, &self.cluster_replicas);
        if self.cluster_protocol.is_some() {
            s.cluster_protocol = self.cluster_protocol;
        }
        self.nats.apply(&mut s);
        if let Some(g) = self.grace {
            s.grace = PerKind::all(g);
        }
        if let Some(h) = self.heartbeat_timeout {
            s.heartbeat_timeout = PerKind::all(h);
        }
        chosen.keep_alive |= self.keep_alive.is_some();
        chosen.idle_timeout |= self.idle_timeout.is_some();
        s.apply_cluster_defaults(chosen);
        Ok(s)
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CliKind {
    Mobile,
    Desktop,
    Web,
    Other,
}

impl From<CliKind> for Kind {
    fn from(k: CliKind) -> Kind {
        match k {
            CliKind::Mobile => Kind::Mobile,
            CliKind::Desktop => Kind::Desktop,
            CliKind::Web => Kind::Web,
            CliKind::Other => Kind::Other,
        }
    }
}

#[derive(Args, Debug)]
struct TokenArgs {
    /// The user (the token's `sub`).
    #[arg(long)]
    user: String,
    /// The device, unique within the user.
    #[arg(long)]
    device: String,
    /// The device kind (each has its own grace and heartbeat timeout).
    #[arg(long, value_enum, default_value = "other")]
    kind: CliKind,
    /// Whom the holder may watch: names separated by commas, or '*' for anybody.
    #[arg(long, value_delimiter = ',')]
    watch: Vec<String>,
    /// How long the token is valid (e.g. 30m, 24h, 7d).
    #[arg(long, default_value = "24h")]
    ttl: Dur,
    /// A service token: may ask where a user's devices are and query many users.
    #[arg(long)]
    service: bool,
    /// The data directory whose secret signs the token.
    #[arg(long, env = "GREENDOT_DATA_DIR", default_value = "greendot-data")]
    data_dir: PathBuf,
    /// The secret file [default: <data-dir>/token-secret].
    #[arg(long, env = "GREENDOT_SECRET_FILE")]
    secret_file: Option<PathBuf>,
}

/// How the client commands reach the server.
#[derive(Args, Debug)]
pub struct ClientArgs {
    /// The token (from `greendot token`).
    #[arg(long, env = "GREENDOT_TOKEN")]
    pub token: String,
    /// The server's UDP address, or HOST:PORT (every address the name
    /// resolves to is tried).
    #[arg(long, env = "GREENDOT_SERVER", default_value = "127.0.0.1:4433")]
    pub server: String,
    /// The name in the server's certificate [default: the host of
    /// --server, `localhost` for an IP address].
    #[arg(long)]
    pub server_name: Option<String>,
    /// The certificate to trust (PEM) [default: <data-dir>/cert.pem].
    #[arg(long, env = "GREENDOT_CA")]
    pub ca: Option<PathBuf>,
    /// The server's data directory, for its certificate.
    #[arg(long, env = "GREENDOT_DATA_DIR", default_value = "greendot-data")]
    pub data_dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The server's UDP address.
    #[arg(long, env = "GREENDOT_SERVER", default_value = "127.0.0.1:4433")]
    pub server: SocketAddr,
    /// The certificate to trust (PEM) [default: <data-dir>/cert.pem].
    #[arg(long, env = "GREENDOT_CA")]
    pub ca: Option<PathBuf>,
    /// The server's data directory: its certificate and token secret (the
    /// load generator mints its users' tokens).
    #[arg(long, env = "GREENDOT_DATA_DIR", default_value = "greendot-data")]
    pub data_dir: PathBuf,
    /// Concurrent connections to open and hold.
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub connections: usize,
    /// Users each connection subscribes to (realtime).
    #[arg(long, default_value_t = 20)]
    pub contacts: usize,
    /// Share of the connections that act (status change or reconnect) per second.
    #[arg(long, default_value_t = 0.01)]
    pub churn: f64,
    /// How long the churn runs and is measured.
    #[arg(long, default_value = "30s")]
    pub duration: Dur,
    /// Client UDP endpoints the connections are spread over.
    #[arg(long, default_value_t = 8)]
    pub endpoints: usize,
    /// The server's process id, to report its memory per session and CPU.
    #[arg(long)]
    pub server_pid: Option<u32>,
}

/// Reads a token secret file (surrounding whitespace is not part of it).
pub fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read(path).map_err(|e| {
        format!(
            "cannot read the token secret {} ({e}); `greendot serve` makes one on first start",
            path.display()
        )
    })?;
    let secret = text.trim_ascii().to_vec();
    if secret.is_empty() {
        return Err(format!("the token secret {} is empty", path.display()));
    }
    Ok(secret)
}

fn token(args: TokenArgs) -> Result<(), String> {
    let secret_path = args
        .secret_file
        .clone()
        .unwrap_or_else(|| args.data_dir.join(SECRET_FILE));
    let secret = read_secret(&secret_path)?;
    let watch = if args.watch.iter().any(|w| w == "*") {
        WatchClaim::all()
    } else {
        WatchClaim::only(args.watch.iter().filter(|w| !w.is_empty()).cloned())
    };
    let mut claims = Claims::new(args.user, args.device, args.kind.into(), watch, args.ttl.0);
    if args.service {
        claims = claims.service();
    }
    let keys = TokenKeys::new(&secret, Duration::ZERO);
    let jwt = keys.mint(&claims).map_err(|e| e.to_string())?;
    println!("{jwt}");
    Ok(())
}

fn init_logs(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Token(args) => token(args),
        Command::Serve(args) => args.settings().and_then(|settings| {
            if args.print_config {
                return settings.to_toml().map(|text| print!("{text}"));
            }
            init_logs("info");
            serve::runtime()?.block_on(serve::serve(settings))
        }),
        Command::Connect {
            client,
            status,
            message,
            invisible,
            no_logout,
        } => {
            init_logs("warn");
            runtime().and_then(|rt| {
                rt.block_on(client::run_connect(
                    &client, status, message, invisible, no_logout,
                ))
            })
        }
        Command::Watch {
            client,
            users,
            json,
            batched,
        } => {
            init_logs("warn");
            runtime().and_then(|rt| rt.block_on(client::run_watch(&client, users, json, batched)))
        }
        Command::Cluster(ClusterCommand::Status {
            cluster,
            shard,
            shards,
            nats,
        }) => {
            init_logs("warn");
            let mut s = Settings::default();
            nats.apply(&mut s);
            s.nats_access().and_then(|access| {
                runtime()
                    .and_then(|rt| rt.block_on(cluster::status(&cluster, &access, shard, shards)))
            })
        }
        Command::Bench(args) => {
            init_logs("warn");
            runtime().and_then(|rt| rt.block_on(client::run_bench(args)))
        }
        Command::Revoke {
            client,
            user,
            device,
            before,
        } => {
            init_logs("warn");
            runtime().and_then(|rt| {
                rt.block_on(client::run_revoke(
                    &client,
                    &user,
                    device.as_deref(),
                    before,
                ))
            })
        }
        Command::Group(command) => {
            init_logs("warn");
            runtime().and_then(|rt| rt.block_on(run_group(command)))
        }
        Command::Query {
            client,
            users,
            json,
        } => {
            init_logs("warn");
            runtime().and_then(|rt| rt.block_on(client::run_query(&client, users, json)))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("greendot: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run_group(command: GroupCommand) -> Result<(), String> {
    match command {
        GroupCommand::Set {
            client,
            group,
            members,
            admins,
        } => group::run_set(&client, group, &members, admins.as_deref()).await,
        GroupCommand::Change {
            client,
            group,
            add,
            remove,
            add_admin,
            remove_admin,
            expect_version,
        } => {
            let change = greendot_client::GroupChange {
                add,
                remove,
                add_admins: add_admin,
                remove_admins: remove_admin,
                expect_version,
            };
            group::run_change(&client, group, change).await
        }
        GroupCommand::Remove { client, group } => group::run_remove(&client, group).await,
        GroupCommand::Watch {
            client,
            group,
            json,
        } => group::run_watch(&client, group, json).await,
        GroupCommand::Page {
            client,
            group,
            after,
            limit,
            all,
            watch: false,
            json,
            ..
        } => group::run_page(&client, group, after, limit, all, json).await,
        GroupCommand::Page {
            client,
            group,
            after,
            limit,
            renew_every,
            json,
            ..
        } => group::run_watch_page(&client, group, after, limit, renew_every.0, json).await,
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve_settings(args: &[&str]) -> Settings {
        let argv = ["greendot", "serve"].iter().chain(args).copied();
        match Cli::try_parse_from(argv).expect("arguments").command {
            Command::Serve(a) => a.settings().expect("settings"),
            _ => unreachable!(),
        }
    }

    fn timings(s: &Settings) -> (String, String) {
        (s.idle_timeout.to_string(), s.keep_alive.to_string())
    }

    #[test]
    fn cluster_timings_unless_the_operator_set_them() {
        let cluster = ["--cluster", "nats://a:4222", "--node-id", "n1"];
        let with = |more: &[&str]| serve_settings(&[&cluster[..], more].concat());
        let t = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(timings(&serve_settings(&[])), t("45s", "15s"));
        assert_eq!(timings(&with(&[])), t("3s", "1s"));
        assert_eq!(timings(&with(&["--idle-timeout", "6s"])), t("6s", "2s"));
        assert_eq!(timings(&with(&["--keep-alive", "500ms"])), t("3s", "500ms"));
        assert_eq!(timings(&with(&["--grace", "30s"])), t("13s", "4300ms"));

        // Set in the file: kept, with or without the flag.
        let file =
            std::env::temp_dir().join(format!("greendot-timings-{}.toml", std::process::id()));
        std::fs::write(&file, "idle_timeout = \"20s\"\n").unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(timings(&with(&["--config", path])), t("20s", "6600ms"));
        let one = serve_settings(&["--config", path]);
        assert_eq!(timings(&one), t("20s", "15s"));
        std::fs::remove_file(&file).ok();
    }

    #[test]
    fn nats_credentials_from_flags_over_the_file() {
        let file = std::env::temp_dir().join(format!("greendot-nats-{}.toml", std::process::id()));
        std::fs::write(
            &file,
            "nats_user = \"from-file\"\nnats_password = \"file-pass\"\nnats_tls_ca = \"/ca.pem\"\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let s = serve_settings(&[
            "--config",
            path,
            "--cluster",
            "nats://a:4222",
            "--node-id",
            "n1",
            "--nats-user",
            "greendot",
            "--nats-password",
            "flag-pass",
            "--nats-require-tls",
            "true",
            "--cluster-protocol",
            "1",
        ]);
        std::fs::remove_file(&file).ok();
        let access = s.nats_access().unwrap();
        assert!(matches!(
            &access.credentials,
            greendot_cluster::NatsCredentials::UserPassword { user, password }
                if user == "greendot" && password.expose() == "flag-pass"
        ));
        assert_eq!(access.tls_ca.as_deref(), Some(Path::new("/ca.pem")));
        assert!(access.require_tls);
        assert_eq!(s.cluster_protocol, Some(1));
        assert!(!s.to_toml().unwrap().contains("flag-pass"));
    }

    #[test]
    fn the_background_means_offline_unless_set_to_away() {
        let core = |s: &Settings| crate::serve::core_config(s).backgrounded;
        assert_eq!(
            core(&serve_settings(&[])),
            greendot_core::Backgrounded::Offline
        );
        assert_eq!(
            core(&serve_settings(&["--backgrounded", "away"])),
            greendot_core::Backgrounded::Away
        );
        let file = std::env::temp_dir().join(format!("greendot-bg-{}.toml", std::process::id()));
        std::fs::write(&file, "backgrounded = \"away\"\n").unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(
            core(&serve_settings(&["--config", path])),
            greendot_core::Backgrounded::Away
        );
        assert_eq!(
            core(&serve_settings(&[
                "--config",
                path,
                "--backgrounded",
                "offline"
            ])),
            greendot_core::Backgrounded::Offline
        );
        std::fs::write(&file, "backgrounded = \"asleep\"\n").unwrap();
        let bad = Settings::from_toml(&std::fs::read_to_string(&file).unwrap()).unwrap_err();
        std::fs::remove_file(&file).ok();
        assert!(bad.contains("asleep"), "{bad}");
        let argv = ["greendot", "serve", "--backgrounded", "asleep"];
        assert!(Cli::try_parse_from(argv).is_err());
    }
}
