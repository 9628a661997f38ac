//! A restart under a herd: a greendot server (in this process, on its own
//! runtime thread) with a store holds N sessions (web devices: the shortest
//! grace, 10 s) and a watcher subscribed (batched) to 1,000 of the users. The
//! server drains and a new one starts on the same port and store; every
//! client reconnects as the client library does (full jitter, within the
//! `retry_ms` of the Draining close if it has one, resuming its session and,
//! where the server allows, its TLS session). Then, on the restarted server,
//! all N reconnect at once (a mass reconnect) with TLS resumption offered and
//! without, for handshakes per second either way.
//!
//! `cargo run --release -p greendot-bench --bin restart_herd -- --n 100000`
//! (`--watched 1000`, `--watchers 1`, `--endpoints 16`, `--kind web`,
//! `--concurrency 256` handshakes in flight while ramping up,
//! `--keep-alive 10` seconds for the devices as in the client library, 0
//! for none).
//!
//! Printed: users a watcher saw go offline and, for every user, restored
//! devices whose grace ran out on the restarted server (goal 0 for both),
//! the time from the start of the drain until every session is back, the
//! admission rate during the herd, the share of handshakes that resumed
//! TLS, and the mass reconnects' handshakes per second.

use greendot_bench::{arg, raise_nofile};
use greendot_loadgen::{Herd, HerdCounts, HerdOptions};
use greendot_proto::Kind;
use greendot_server::tls::Identity;
use greendot_server::{Server, ServerConfig};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

const SECRET: &str = "greendot-herd-secret";

fn server_config(
    listen: SocketAddr,
    store: &Path,
    identity: &Identity,
    n: usize,
    admissions: u32,
) -> ServerConfig {
    let mut config = ServerConfig::new(SECRET.as_bytes().to_vec());
    config.listen = listen;
    config.max_handshakes_per_sec = admissions;
    config.identity = Some(identity.clone());
    config.store = Some(store.to_path_buf());
    config.max_connections = n + n / 5 + 1000;
    config
}

/// Binds on the server runtime, retrying while the old socket is going away.
async fn bind(rt: &tokio::runtime::Handle, config: ServerConfig) -> Result<Server, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let config = config.clone();
        let bound = rt
            .spawn(async move { Server::bind(config) })
            .await
            .map_err(|e| e.to_string())?;
        match bound {
            Ok(server) => return Ok(server),
            Err(e) if Instant::now() < deadline => {
                eprintln!("  bind: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

struct Burst {
    k: usize,
    took: Option<Duration>,
    counts: HerdCounts,
}

/// All `k` first devices reconnect at once; how long until all are back.
async fn mass_reconnect(herd: &Herd, k: usize, resumption: bool) -> Burst {
    herd.set_resumption(resumption);
    let before = herd.counts();
    herd.mark();
    let since = Instant::now();
    herd.mass_reconnect(k);
    let took = herd.wait_back(k, since, Duration::from_secs(600)).await;
    let after = herd.counts();
    Burst {
        k,
        took,
        counts: diff(after, before),
    }
}

fn diff(a: HerdCounts, b: HerdCounts) -> HerdCounts {
    HerdCounts {
        connected: a.connected,
        back: a.back,
        handshakes: a.handshakes - b.handshakes,
        full_handshakes: a.full_handshakes - b.full_handshakes,
        resumed_sessions: a.resumed_sessions - b.resumed_sessions,
        failed_attempts: a.failed_attempts - b.failed_attempts,
    }
}

fn resumed_share(c: &HerdCounts) -> String {
    if c.handshakes == 0 {
        return "-".into();
    }
    let resumed = c.handshakes.saturating_sub(c.full_handshakes);
    format!("{:.0}%", 100.0 * resumed as f64 / c.handshakes as f64)
}

fn main() {
    let nofile = raise_nofile();
    let n: usize = arg("--n", 100_000);
    let watchers: usize = arg("--watchers", 1);
    let watched: usize = arg("--watched", 1000);
    let endpoints: usize = arg("--endpoints", 16);
    let concurrency: usize = arg("--concurrency", 256);
    let reconnect_concurrency: usize = arg("--reconnect-concurrency", 4096);
    // The server's admission rate (its default: 3,000/s).
    let admissions: u32 = arg("--admissions", 3000);
    // The devices' keep-alive in seconds (0: none, as before stateless
    // resets: a device that missed the close waited for its idle timeout).
    let keep_alive: u64 = arg("--keep-alive", 10);
    let kind = match arg("--kind", "web".to_string()).as_str() {
        "mobile" => Kind::Mobile,
        "desktop" => Kind::Desktop,
        "other" => Kind::Other,
        _ => Kind::Web,
    };
    eprintln!("open-file limit {nofile}; N = {n}, {watchers} watcher(s) of {watched} users, {kind:?} devices (keep-alive {keep_alive} s), server admits {admissions} handshakes/s");

    // The server on its own thread, so that the clients do not slow its loop.
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("server")
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("server runtime: {e}"));
    let clients = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("client runtime: {e}"));
    let dir = std::env::temp_dir().join(format!("greendot-herd-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let store = dir.join("store.redb");
    let identity = Identity::self_signed(&["localhost"]).unwrap_or_else(|e| panic!("{e}"));
    let handle = server_rt.handle().clone();

    let result = clients.block_on(async {
        let any: SocketAddr = "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?;
        let first = bind(
            &handle,
            server_config(any, &store, &identity, n, admissions),
        )
        .await?;
        let addr = first.local_addr();
        let mut opts = HerdOptions::new(addr, identity.certs.clone(), SECRET, n);
        opts.watchers = watchers;
        opts.watched = watched;
        opts.endpoints = endpoints;
        opts.connect_concurrency = concurrency;
        opts.reconnect_concurrency = reconnect_concurrency;
        opts.kind = kind;
        opts.keep_alive = (keep_alive > 0).then(|| Duration::from_secs(keep_alive));
        let started = Instant::now();
        let herd = Herd::start(opts, Duration::from_secs(900)).await?;
        let ramp = started.elapsed();
        eprintln!(
            "  {n} sessions and {watchers} watcher(s) up in {:.1} s",
            ramp.as_secs_f64()
        );
        // Let the arrivals be published and reach the watcher, then the
        // store's write-behind catch up.
        tokio::time::sleep(Duration::from_secs(4)).await;
        herd.watch_for_offline();
        let before = herd.counts();
        herd.mark();

        // Drain, and a new server on the same port and store.
        let drain_start = Instant::now();
        handle
            .spawn(async move { first.drain().await })
            .await
            .map_err(|e| e.to_string())?;
        let drained = drain_start.elapsed();
        let second = bind(
            &handle,
            server_config(addr, &store, &identity, n, admissions),
        )
        .await?;
        let restarted = drain_start.elapsed();
        eprintln!(
            "  drained in {:.2} s, listening again after {:.2} s",
            drained.as_secs_f64(),
            restarted.as_secs_f64()
        );
        // What the restarted server sheds while the herd comes back.
        let monitor = second.monitor();
        let report = handle.spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(4)).await;
                if let Some(m) = monitor.metrics().await {
                    eprintln!(
                        "  server: {} open, {} handshaking, shed {:?}, aborted {}, rejected {:?}",
                        m.connections_open,
                        m.handshakes_in_flight,
                        m.shed,
                        m.handshakes_aborted,
                        m.rejected
                    );
                }
            }
        });
        let back = herd
            .wait_back(n, drain_start, Duration::from_secs(600))
            .await;
        report.abort();
        let herd_counts = diff(herd.counts(), before);
        // The grace of anyone not back has run out by now: an offline would
        // have been published.
        let grace = Duration::from_millis(second.config().core.kind(kind.into()).grace.0);
        tokio::time::sleep(grace + Duration::from_secs(3)).await;
        let offline = herd.offline_seen();
        // Every user, not only the watched: on the restarted server a
        // restored device whose grace ran out is a user shown offline (one
        // device each).
        let monitor = second.monitor();
        let expired = handle
            .spawn(async move { monitor.metrics().await.map(|m| m.counters.grace_expired) })
            .await
            .map_err(|e| e.to_string())?;
        eprintln!(
            "  herd: {} watched users seen offline, {} devices' grace ran out on the restarted server, all back after {}, {} failed attempts",
            offline.len(),
            expired.map_or("?".into(), |n| n.to_string()),
            back.map_or("not all back".into(), |d| format!(
                "{:.2} s",
                d.as_secs_f64()
            )),
            herd_counts.failed_attempts
        );

        let with = mass_reconnect(&herd, n, true).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let without = mass_reconnect(&herd, n, false).await;
        herd.stop().await;
        let _ = handle.spawn(async move { second.shutdown().await }).await;
        Ok::<_, String>((
            ramp,
            drained,
            restarted,
            back,
            herd_counts,
            offline,
            expired,
            with,
            without,
        ))
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (ramp, drained, restarted, back, herd_counts, offline, expired, with, without) =
        match result {
            Ok(r) => r,
            Err(e) => {
                eprintln!("restart_herd: {e}");
                std::process::exit(2);
            }
        };

    let rate = |k: usize, d: Option<Duration>| {
        d.map_or("-".into(), |d| {
            format!("{:.0}", k as f64 / d.as_secs_f64().max(1e-9))
        })
    };
    let secs = |d: Option<Duration>| {
        d.map_or("not all back".into(), |d| format!("{:.2}", d.as_secs_f64()))
    };
    let herd_time = back.map(|b| b.saturating_sub(restarted));
    println!();
    println!(
        "Restart herd: {n} {kind:?} sessions (ramp {:.1} s), {watchers} watcher(s) of {watched} users (batched); drain {:.2} s, listening again {:.2} s after the drain began",
        ramp.as_secs_f64(),
        drained.as_secs_f64(),
        restarted.as_secs_f64()
    );
    println!();
    println!("| N | watched users seen offline | devices whose grace ran out (all users) | all back after drain (s) | admissions/s after restart | handshakes (full) in the herd | TLS resumed in the herd | failed attempts | mass reconnect, resumption offered: handshakes/s (TLS resumed) | mass reconnect, no resumption: handshakes/s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {n} | {} | {} | {} | {} | {} ({}) | {} | {} | {} ({}) | {} |",
        offline.len(),
        expired.map_or("?".into(), |n| n.to_string()),
        secs(back),
        rate(n, herd_time),
        herd_counts.handshakes,
        herd_counts.full_handshakes,
        resumed_share(&herd_counts),
        herd_counts.failed_attempts,
        rate(with.k, with.took),
        resumed_share(&with.counts),
        rate(without.k, without.took),
    );
    println!();
    if !offline.is_empty() {
        let shown: Vec<_> = offline.iter().take(10).collect();
        println!("seen offline (first 10): {shown:?}");
    }
    for (name, b) in [("with resumption", &with), ("without", &without)] {
        println!(
            "mass reconnect {name}: {} back in {}, {} handshakes ({} full), {} sessions resumed, {} failed attempts",
            b.k,
            secs(b.took),
            b.counts.handshakes,
            b.counts.full_handshakes,
            b.counts.resumed_sessions,
            b.counts.failed_attempts
        );
    }
}
