//! `greendot serve`: the data directory, the server, the HTTP port
//! (`/metrics`, `/healthz`, `/readyz`, the page) and a graceful drain on SIGTERM or
//! Ctrl-C.

use crate::settings::{Dur, Settings};
use crate::{CERT_FILE, KEY_FILE};
use greendot_core::{KindConfig, Millis};
use greendot_server::http::HttpService;
use greendot_server::tls::Identity;
use greendot_server::token::TokenKeys;
use greendot_server::{Server, ServerConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tracing::{info, warn};

/// Writes `bytes` to a new file readable by its owner only.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn random_hex(n: usize) -> Result<String, String> {
    use ring::rand::SecureRandom;
    let mut bytes = vec![0u8; n];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| "no system randomness".to_string())?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// SHA-256 of a certificate, as colon-separated hex.
pub fn fingerprint(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    digest
        .as_ref()
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Whether the generated dev certificate is due for renewal: written
/// (by this code, which makes it valid for `DEV_CERT_DAYS`) more than
/// `DEV_CERT_DAYS - 1` days ago, so that browsers never see it expired.
fn dev_cert_due(cert: &Path) -> bool {
    let renew_after = Duration::from_secs(
        u64::try_from(greendot_server::tls::DEV_CERT_DAYS - 1).unwrap_or(0) * 86_400,
    );
    std::fs::metadata(cert)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|written| written.elapsed().ok())
        .is_none_or(|age| age > renew_after)
}

/// With `RUST_LOG=greendot::connections=debug`, every connection's start,
/// migration and end (with why it ended: the client's close, an idle
/// timeout, a reset…) as a log line: what an operator needs to tell why a
/// client was dropped. Nothing is subscribed otherwise.
fn log_connections(server: &Server) {
    use greendot_server::ServerEvent;
    const TARGET: &str = "greendot::connections";
    if !tracing::enabled!(target: TARGET, tracing::Level::DEBUG) {
        return;
    }
    let mut events = server.events();
    tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(ServerEvent::Connected {
                    session,
                    user,
                    device,
                    resumed,
                    remote,
                }) => {
                    tracing::debug!(target: TARGET, ?session, %user, %device, resumed, %remote, "connected");
                }
                Ok(ServerEvent::Migrated { session, from, to }) => {
                    tracing::debug!(target: TARGET, ?session, %from, %to, "migrated");
                }
                Ok(ServerEvent::Closed {
                    session,
                    logout,
                    reason,
                }) => {
                    tracing::debug!(target: TARGET, ?session, logout, %reason, "closed");
                }
                Ok(ServerEvent::Rejected { remote, reason }) => {
                    tracing::debug!(target: TARGET, %remote, %reason, "rejected");
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    tracing::debug!(target: TARGET, missed = n, "connection events dropped (the log fell behind)");
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    });
}

/// What `serve` made or found in the data directory.
struct DataDir {
    cert: PathBuf,
    identity: Identity,
    secret: Vec<u8>,
    secret_path: PathBuf,
    created: Vec<PathBuf>,
}

/// Creates the data directory, a dev certificate and a token secret when
/// missing; loads them.
fn prepare(settings: &Settings) -> Result<DataDir, String> {
    let dir = &settings.data_dir;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut created = Vec::new();
    let (cert, key) = match (&settings.cert, &settings.key) {
        (Some(cert), Some(key)) => (cert.clone(), key.clone()),
        (None, None) => {
            let cert = dir.join(CERT_FILE);
            let key = dir.join(KEY_FILE);
            if !cert.exists() || !key.exists() || dev_cert_due(&cert) {
                // One that browsers accept for WebTransport by its hash:
                // ECDSA P-256, valid 13 days, renewed a day before it expires.
                let (new_cert, new_key) =
                    greendot_server::tls::browser_certificate(&["localhost", "127.0.0.1"])
                        .map_err(|e| format!("cannot make a certificate: {e}"))?;
                let _ = std::fs::remove_file(&cert);
                let _ = std::fs::remove_file(&key);
                write_private(&key, new_key.serialize_pem().as_bytes())?;
                write_private(&cert, new_cert.pem().as_bytes())?;
                created.push(cert.clone());
                created.push(key.clone());
            }
            (cert, key)
        }
        _ => return Err("set both `cert` and `key`, or neither".into()),
    };
    let certs = CertificateDer::pem_file_iter(&cert)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read the certificate {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate in {}", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(&key)
        .map_err(|e| format!("cannot read the key {}: {e}", key.display()))?;

    let secret_path = settings.secret_path();
    if !secret_path.exists() {
        write_private(&secret_path, format!("{}\n", random_hex(32)?).as_bytes())?;
        created.push(secret_path.clone());
    }
    let secret = crate::read_secret(&secret_path)?;
    Ok(DataDir {
        cert,
        identity: Identity { certs, key },
        secret,
        secret_path,
        created,
    })
}

fn server_config(settings: &Settings, data: &DataDir) -> Result<ServerConfig, String> {
    let mut config = ServerConfig::new(data.secret.clone());
    config.listen = settings.listen;
    config.websocket = settings.websocket_addr()?;
    config.identity = Some(data.identity.clone());
    config.keep_alive = settings.keep_alive.0;
    config.idle_timeout = settings.idle_timeout.0;
    config.token_leeway = settings.token_leeway.0;
    config.max_connections = settings.max_connections;
    config.max_handshakes_per_sec = settings.max_handshakes_per_sec;
    config.max_hello = settings.max_hello;
    config.max_websocket_pending = settings.max_websocket_pending;
    config.store_timeout = settings.store_timeout.0;
    config.push_queue_bytes = settings.push_queue_bytes;
    config.push_budget_bytes = settings.push_budget_bytes;
    config.flush_interval = settings.flush_interval.0;
    config.store = Some(settings.store_path());
    config.core = core_config(settings);
    Ok(config)
}

/// The presence core's settings: its defaults with what the operator set.
pub(crate) fn core_config(settings: &Settings) -> greendot_core::Config {
    let mut core = greendot_core::Config::default();
    let ms = |d: Duration| Millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    core.debounce = ms(settings.debounce.0);
    core.batch_interval = ms(settings.batch_interval.0);
    core.group_interval = ms(settings.group_interval.0);
    core.max_group_members = settings.max_group_members;
    core.max_group_admins = settings.max_group_admins;
    core.max_group_subscriptions_per_session = settings.max_group_subscriptions;
    core.max_groups = settings.max_groups;
    core.group_page_size = settings.group_page_size;
    core.group_watch_ttl = ms(settings.group_watch_ttl.0);
    core.max_watched_pages = settings.max_watched_pages;
    core.max_watched_entries = settings.max_watched_entries;
    core.group_page_burst = settings.group_page_burst;
    core.group_page_refill = ms(settings.group_page_refill.0);
    core.backgrounded = settings.backgrounded.into();
    let (g, h) = (&settings.grace, &settings.heartbeat_timeout);
    core.kinds = [
        (g.mobile, h.mobile),
        (g.desktop, h.desktop),
        (g.web, h.web),
        (g.other, h.other),
    ]
    .map(|(grace, heartbeat)| KindConfig {
        grace: ms(grace.0),
        heartbeat_timeout: ms(heartbeat.0),
    });
    core
}

/// Why `/dev/token` is off, or `None` when it may run: only on a machine of
/// one's own (the generated dev certificate and secret, the HTTP port and
/// the QUIC port on loopback: the tokens connect from this machine only). Loopback is
/// still shared with the machine's other users and with containers in the
/// same network namespace: each request must also carry the code printed
/// at start (see `page::DevTokens`).
fn dev_tokens_refused(
    settings: &Settings,
    http: SocketAddr,
    quic: SocketAddr,
) -> Option<&'static str> {
    if !settings.dev_tokens {
        Some("dev_tokens = false")
    } else if settings.cert.is_some() {
        Some("a certificate of its own is configured")
    } else if settings.secret_file.is_some() {
        Some("a token secret file of its own is configured")
    } else if !http.ip().is_loopback() {
        Some("the HTTP port is not on loopback")
    } else if !quic.ip().is_loopback() {
        Some("the QUIC port is not on loopback")
    } else {
        None
    }
}

/// The server is one task (the driver), plus the store's own thread: one
/// runtime thread serves it and its durable waits, with no second worker to
/// wake and no work stealing. The HTTP port has a thread and runtime of its
/// own (see `greendot_server::http`): HTTP load never takes the loop's turn.
pub fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// How this node takes part in the cluster's data path.
/// `incarnation`: this run's start time in Unix milliseconds, in the node's
/// lease too; it grows from one run to the next (a restart takes longer
/// than a millisecond), which is how owners tell a restart within the lease
/// TTL from a renewal.
/// `protocol`: the inter-node protocol version this node sends.
fn cluster_settings(
    config: &greendot_cluster::ClusterConfig,
    incarnation: u64,
    protocol: u8,
) -> Result<greendot_server::cluster::ClusterSettings, String> {
    Ok(greendot_server::cluster::ClusterSettings {
        node: config.node.to_string(),
        incarnation,
        shard_count: config.shard_count,
        shard_of: |user, shards| greendot_cluster::shard_of(user, shards).0,
        // Long enough for a shard to change hands (its claim's TTL).
        request_timeout: config.claim_ttl.max(Duration::from_secs(2)),
        // The edges resend their devices within a request's time.
        resync_window: config.claim_ttl.max(Duration::from_secs(2)),
        protocol,
        mutant: None,
    })
}

/// In a cluster: the failover timing on one line, and a warning for each
/// part of the rule the settings break (they are the operator's to keep).
fn log_failover_timing(settings: &Settings) {
    if settings.cluster.is_none() {
        return;
    }
    let (kind, grace) = settings.grace.smallest();
    info!(
        idle_timeout = %settings.idle_timeout,
        keep_alive = %settings.keep_alive,
        "cluster failover: a client of a node that dies notices within {} and needs about {} more \
         to reconnect elsewhere; the smallest grace is {kind} {}",
        Dur(settings.worst_notice()),
        Dur(crate::settings::RECONNECT_ALLOWANCE),
        Dur(grace),
    );
    for problem in settings.failover_problems() {
        warn!("{problem}");
    }
}

pub async fn serve(settings: Settings) -> Result<(), String> {
    log_failover_timing(&settings);
    let data = prepare(&settings)?;
    let mut config = server_config(&settings, &data)?;
    let cluster_config = settings.cluster_config()?;
    let incarnation = greendot_cluster::unix_ms();
    if let Some((_, c)) = &cluster_config {
        let protocol = settings.envelope(&data.secret)?.send_version();
        config.cluster = Some(cluster_settings(c, incarnation, protocol)?);
    }
    let server = Server::bind(config).map_err(|e| e.to_string())?;
    let addr = server.local_addr();

    // Bound before joining: the node's lease advertises it (peers cut off
    // from NATS ask it whether this node holds its lease).
    let listener = if settings.metrics.eq_ignore_ascii_case("off") {
        None
    } else {
        let listener = std::net::TcpListener::bind(&settings.metrics)
            .map_err(|e| format!("cannot listen for HTTP on {}: {e}", settings.metrics))?;
        let http_addr = listener
            .local_addr()
            .map_err(|e| format!("cannot listen for HTTP on {}: {e}", settings.metrics))?;
        Some((listener, http_addr))
    };

    // Joined before the metrics page starts, so that it shows the node.
    let mut dropped = None;
    let node = match cluster_config {
        None => None,
        Some((urls, config)) => {
            // Every inter-node message is sealed with a key derived from the
            // token secret, which every node of the cluster shares.
            let envelope = settings.envelope(&data.secret)?;
            let advertise = settings
                .advertise
                .clone()
                .unwrap_or_else(|| addr.to_string());
            let http = listener
                .as_ref()
                .map(|(_, at)| advertised_http(&advertise, *at));
            let Some((cluster, node)) =
                join(&urls, config, envelope, advertise, http, incarnation).await?
            else {
                info!("stopped before joining the cluster");
                server.shutdown().await;
                return Ok(());
            };
            dropped = Some(cluster.dropped());
            // The data path: presence crosses nodes through this task.
            if let Some(outputs) = server.take_cluster_outputs() {
                tokio::spawn(crate::cluster_io::run(
                    cluster,
                    node.status(),
                    outputs,
                    server.cluster_inputs(),
                ));
            }
            Some(node)
        }
    };
    let cluster_status = node.as_ref().map(|n| n.status());

    // Kept until the process exits: it serves `/readyz` 503 while draining.
    let http = if let Some((listener, http_addr)) = listener {
        let refused = dev_tokens_refused(&settings, http_addr, addr);
        let dev_tokens = match refused {
            Some(_) => None,
            None => Some(crate::page::DevTokens::new(TokenKeys::new(
                &data.secret,
                Duration::ZERO,
            ))?),
        };
        let dev_code = dev_tokens.as_ref().map(|d| d.code().to_owned());
        let dev_cert = settings.cert.is_none();
        let page = crate::page::PageConfig {
            quic: addr,
            websocket: server.websocket_addr(),
            certificate_hash: data
                .identity
                .certs
                .first()
                .filter(|_| dev_cert)
                .map(|c| greendot_server::tls::certificate_hash(c.as_ref())),
            dev_tokens,
        };
        let mut service = HttpService::new(server.monitor()).merge(crate::page::routes(page));
        if let (Some(status), Some(dropped)) = (cluster_status.clone(), dropped.clone()) {
            service = service.merge(crate::cut_off::lease_route(status.clone()));
            service = service.more_metrics(std::sync::Arc::new(move || {
                let mut text = status.borrow().render_metrics(std::time::Instant::now());
                text.push_str(&dropped.render_metrics());
                text
            }));
        }
        let thread = service
            .spawn(listener)
            .map_err(|e| format!("cannot start the HTTP port: {e}"))?;
        Some((thread, refused, dev_code))
    } else {
        None
    };

    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "greendot listening on {addr} (QUIC and WebTransport https://{addr}/greendot, udp)"
    );
    match server.websocket_addr() {
        Some(ws) => {
            let _ = writeln!(out, "WebSocket on wss://{ws}/greendot (tcp)");
        }
        None => {
            let _ = writeln!(out, "WebSocket off");
        }
    }
    for path in &data.created {
        let _ = writeln!(out, "created {}", path.display());
    }
    let _ = writeln!(out, "data directory: {}", settings.data_dir.display());
    let _ = writeln!(out, "certificate: {}", data.cert.display());
    if let Some(cert) = data.identity.certs.first() {
        let _ = writeln!(out, "certificate SHA-256: {}", fingerprint(cert.as_ref()));
        // What a browser's WebTransport takes in `serverCertificateHashes`.
        let _ = writeln!(
            out,
            "WebTransport serverCertificateHashes sha-256: {}",
            greendot_server::tls::certificate_hash(cert.as_ref())
        );
    }
    let _ = writeln!(out, "token secret: {}", data.secret_path.display());
    let _ = writeln!(out, "store: {}", settings.store_path().display());
    if let (Some(status), Some(urls)) = (&cluster_status, &settings.cluster) {
        let s = status.borrow();
        let _ = writeln!(
            out,
            "cluster node {} on NATS {urls} ({} live nodes)",
            s.node, s.live_nodes
        );
    }
    match &http {
        Some((http, refused, dev_code)) => {
            let at = http.local_addr();
            let _ = writeln!(out, "metrics on http://{at}/metrics");
            let _ = writeln!(out, "health on http://{at}/healthz and /readyz");
            match (refused, dev_code) {
                (None, Some(code)) => {
                    // The code is in the fragment: the browser keeps it
                    // (the page reads it), and never sends it in a request
                    // line, a log or a Referer.
                    let _ = writeln!(out, "page on http://{at}/#dev={code}");
                    let _ = writeln!(
                        out,
                        "dev tokens on http://{at}/dev/token/USER for the page opened at that address (dev certificate and secret, loopback, the code after #dev=)"
                    );
                }
                (why, _) => {
                    let _ = writeln!(out, "page on http://{at}/");
                    let why = why.unwrap_or("no dev code");
                    let _ = writeln!(out, "dev tokens off ({why}): paste a token into the page");
                }
            }
        }
        None => {
            let _ = writeln!(out, "HTTP off (no metrics, health or readiness)");
        }
    }
    // The program as it was run (e.g. target/release/greendot), so the
    // example works when pasted.
    let program = std::env::args()
        .next()
        .filter(|p| p.contains(std::path::MAIN_SEPARATOR))
        .unwrap_or_else(|| "greendot".into());
    let _ = writeln!(
        out,
        "try: {program} token --user alice --device phone --watch bob"
    );
    drop(out);
    log_connections(&server);

    let must_drain = match &cluster_status {
        None => {
            wait_for_signal().await;
            None
        }
        Some(status) => tokio::select! {
            _ = wait_for_signal() => None,
            why = crate::cut_off::supervise(status.clone(), settings.grace.largest()) => Some(why),
        },
    };
    if let Some(why) = must_drain {
        // Its clients go to other nodes; a supervisor starts it again. Its
        // lease and claims are released with the drain: the node may have
        // taken them again while it decided (a paused node that wakes
        // rejoins before a peer's answer comes), and left behind they would
        // keep its shards from the others for a TTL after it exits.
        warn!("{why}: draining");
        let leave = async {
            if let Some(n) = node {
                if let Err(e) = n.leave().await {
                    warn!(error = %e, "leaving the cluster failed; its keys expire on their TTL");
                }
            }
        };
        tokio::join!(leave, server.drain());
        return Err(format!(
            "{why}: clients were told to reconnect elsewhere; restart this node"
        ));
    }
    if let Some(n) = node {
        // Shards and lease released at once: other nodes take over now.
        match n.leave().await {
            Ok(_) => info!("left the cluster"),
            Err(e) => warn!(error = %e, "leaving the cluster failed; its keys expire on their TTL"),
        }
    }
    info!("draining: closing connections and writing the store");
    server.drain().await;
    drop(http);
    println!("greendot stopped");
    Ok(())
}

/// Where peers reach this node's HTTP port: the port it is bound to, at
/// its own address when it is bound to one, else at the host the node
/// advertises for QUIC.
fn advertised_http(advertise: &str, bound: SocketAddr) -> String {
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let host = advertise
        .rsplit_once(':')
        .map_or(advertise, |(host, _)| host);
    format!("{host}:{}", bound.port())
}

/// Joins the cluster: connects to NATS and takes the node lease, retrying
/// with backoff (NATS not up yet, JetStream still electing, the previous
/// run's lease not yet expired) and saying why; an error that retrying
/// cannot mend (`ClusterError::is_permanent`) ends it. `Ok(None)` on Ctrl-C or
/// SIGTERM first.
async fn join(
    urls: &str,
    config: greendot_cluster::ClusterConfig,
    envelope: greendot_cluster::Envelope,
    advertise: String,
    http: Option<String>,
    incarnation: u64,
) -> Result<Option<(greendot_cluster::Cluster, greendot_cluster::Node)>, String> {
    let mut delay = Duration::from_millis(500);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let attempt = async {
            let cluster =
                greendot_cluster::Cluster::connect(urls, config.clone(), envelope.clone()).await?;
            let node = greendot_cluster::Node::start_with_http(
                cluster.clone(),
                advertise.clone(),
                http.clone(),
                incarnation,
            )
            .await?;
            Ok::<_, greendot_cluster::ClusterError>((cluster, node))
        };
        let result = tokio::select! {
            _ = wait_for_signal() => return Ok(None),
            r = attempt => r,
        };
        match result {
            Ok(joined) => {
                if attempts > 1 {
                    info!(attempts, "joined the cluster at {urls}");
                }
                return Ok(Some(joined));
            }
            Err(e) if e.is_permanent() => {
                return Err(format!(
                    "cannot join the cluster at {urls}: {}",
                    greendot_cluster::chain(&e)
                ))
            }
            Err(e) => warn!(
                attempts,
                retry_in = ?delay,
                "cannot join the cluster at {urls} yet: {}",
                greendot_cluster::chain(&e)
            ),
        }
        tokio::select! {
            _ = wait_for_signal() => return Ok(None),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}

/// Ctrl-C or SIGTERM.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
