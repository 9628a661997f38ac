//! End-to-end QUIC load: a greendot server in a child process (so that its
//! memory and CPU are its own), and `greendot_loadgen::run` in this
//! one, for N = 1k, 10k, 100k connections (or `--n 1000,5000`), each
//! subscribed to 20 contacts in the realtime tier, with 1% churn per second
//! (half status changes, half reconnects that resume).
//!
//! `cargo run --release -p greendot-bench --bin quic_load` (`-- --duration 30`
//! seconds of churn per N, `-- --churn 0.01`, `-- --endpoints 8`). Everything
//! goes to 127.0.0.1; each N gets a fresh server, stopped at the end.
//!
//! `-- --mass-reconnect K` (with one `--n N`, N ≥ K) instead holds N sessions
//! and makes K of them reconnect at the same moment (a plain close, then a
//! new handshake that resumes the session, no wait), first offering TLS
//! session tickets and then without: how long until all K are back, and
//! handshakes per second, for the overload run.
//!
//! `-- --burst K` (`-- --burst-after 5` seconds into the window) keeps the
//! churn and makes devices 0..K reconnect at once inside the measured
//! window: the other sessions' change-to-push p99 before, during and after,
//! and how long after the burst until it is back to normal. The server
//! prints what it shed when it stops.
//!
//! `-- --step K --step-rate R` (`-- --step-after 5`) keeps the churn and
//! makes K new devices connect at R per second from that moment on, each
//! retrying with the client library's backoff: a step in new connections,
//! reported as a burst is.
//!
//! `-- --server-cpu 0.25` caps the server process at a quarter of a core:
//! a cgroup of its own (v1 `cpu.cfs_quota_us` or v2 `cpu.max`, 25 ms of
//! every 100 ms), made before the server starts and removed after it
//! stops; it needs root. Then the server, not the load generator on the
//! same cores, is the bottleneck, and the tables say how often the cap
//! held it back. The generator is not pinned: a quota is enforced on
//! whichever core the server runs, and pinning the generator to one core
//! would take from it the 0.75 of a core the cap leaves free.
//!
//! `-- --server-keep-alive 15 --server-idle-timeout 45` set the server's
//! QUIC keep-alive and idle timeout in seconds (its defaults), and
//! `-- --keep-alive 10` gives the devices a keep-alive of their own (none
//! by default: they answer the server's, as the client library does when
//! its own is off). quinn restarts a side's keep-alive timer at every
//! packet it receives, so the shorter of the two sets the pace: what a calm
//! session costs against the keep-alive (docs/benchmarks-overload.md,
//! "what keep-alive costs").
//!
//! `-- --cluster-of-one` runs the server as a cluster of one
//! (`ServerConfig::cluster_of_one`, docs/cluster.md): its presence through
//! the cluster's edge and owner path, for a before/after against the hub's.
//!
//! `-- --server-nice -10` runs the server process at that nice value (a
//! negative one needs root): the scheduler then gives the server the CPU
//! it asks for before the load generator, as on a machine of its own,
//! instead of an equal share per thread (the generator has two).

use greendot_bench::plot;
use greendot_bench::{arg, flag, load_average, raise_nofile, random_read_baseline};
use greendot_client::rustls::pki_types::CertificateDer;
use greendot_loadgen::{
    self as loadgen, CapProbe, CpuCap, Herd, HerdOptions, LoadOptions, LoadReport,
};
use greendot_server::{Server, ServerConfig};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

// As the `greendot` binary (see its main.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SECRET: &str = "greendot-bench-secret";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Seconds as given on the command line; a bad value stops the run.
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_else(|e| {
        eprintln!("quic_load: {s} is not a number of seconds: {e}");
        std::process::exit(2);
    })
}

/// The child: a server on 127.0.0.1, until its standard input closes.
fn serve() {
    let max: usize = arg("--max-connections", 110_000);
    let nice: i32 = arg("--server-nice", 0);
    if nice != 0 {
        // Before any thread starts: Linux keeps a nice value per thread,
        // and new threads inherit it.
        // SAFETY: setpriority reads no memory of ours.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
            eprintln!(
                "quic_load: cannot set the server's nice value to {nice}: {}",
                std::io::Error::last_os_error()
            );
            std::process::exit(2);
        }
    }
    // As `greendot serve`: the server is one task, on one runtime thread.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    runtime.block_on(async {
        let mut config = ServerConfig::new(SECRET.as_bytes().to_vec());
        config.listen = "127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}"));
        config.max_connections = max;
        config.max_handshakes_per_sec =
            arg("--max-handshakes-per-sec", config.max_handshakes_per_sec);
        config.cluster_of_one = flag("--cluster-of-one");
        if flag("--websocket") {
            config.websocket = Some("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")));
        }
        config.keep_alive = secs(arg("--server-keep-alive", config.keep_alive.as_secs_f64()));
        config.idle_timeout = secs(arg(
            "--server-idle-timeout",
            config.idle_timeout.as_secs_f64(),
        ));
        let server = Server::bind(config).unwrap_or_else(|e| panic!("server: {e}"));
        println!("ADDR {}", server.local_addr());
        if let Some(ws) = server.websocket_addr() {
            println!("WS {ws}");
        }
        println!("CERT {}", hex(server.certificate()));
        let _ = std::io::stdout().flush();
        // Until the parent closes our stdin (or dies).
        let _ = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
                line.clear();
            }
        })
        .await;
        if let Some(m) = server.monitor().metrics().await {
            // Passes of the loop longer than a bound: whether the server
            // itself fell behind.
            let (passes, _) = &m.loop_pass;
            let over = |us: u64| {
                let within = greendot_server::metrics::BOUNDS_US
                    .iter()
                    .position(|&b| b == us)
                    .and_then(|i| passes.get(i))
                    .copied()
                    .unwrap_or(0);
                passes.last().copied().unwrap_or(0) - within
            };
            eprintln!(
                "  server: shed {:?}, handshakes aborted {}, rejected {:?}; admission rate cut {} times (now {}/s); loop passes {}, over 100 ms {}, over 1 s {}; socket drops {:?}",
                m.shed,
                m.handshakes_aborted,
                m.rejected,
                m.admission_cuts,
                m.admission_rate,
                passes.last().copied().unwrap_or(0),
                over(100_000),
                over(1_000_000),
                m.udp.map(|u| u.drops)
            );
        }
        server.shutdown().await;
    });
}

struct Child_ {
    child: Child,
    /// Dropped after the child has ended (fields drop after `drop`).
    cap: Option<CpuCap>,
}

impl Child_ {
    fn cap_probe(&self) -> Option<CapProbe> {
        self.cap.as_ref().map(CpuCap::probe)
    }
}

impl Drop for Child_ {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(n: usize) -> Result<(Child_, std::net::SocketAddr, Vec<u8>), String> {
    start_server_with(n, false).map(|(child, addr, _, cert)| (child, addr, cert))
}

/// The server process, with a WebSocket listener if `websocket`.
type Started = (
    Child_,
    std::net::SocketAddr,
    Option<std::net::SocketAddr>,
    Vec<u8>,
);

fn start_server_with(n: usize, websocket: bool) -> Result<Started, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let max = (n + n / 5 + 1000).to_string();
    let mut args = vec!["--serve", "--max-connections", &max];
    // Passed on to the server process as given.
    let passed = [
        "--max-handshakes-per-sec",
        "--server-nice",
        "--server-keep-alive",
        "--server-idle-timeout",
    ]
    .map(|name| (name, arg(name, String::new())));
    for (name, value) in &passed {
        if !value.is_empty() {
            args.extend([*name, value.as_str()]);
        }
    }
    if websocket {
        args.push("--websocket");
    }
    if flag("--cluster-of-one") {
        args.push("--cluster-of-one");
    }
    // Made before the server starts, so that a missing cgroup file system
    // or root stops the run before any work.
    let cap = match arg("--server-cpu", 0.0f64) {
        0.0 => None,
        cores => Some(CpuCap::create(
            &format!("greendot-quic-load-{}", std::process::id()),
            cores,
        )?),
    };
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start the server process: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    if let Some(cap) = &cap {
        // Before the server has bound its socket: its threads all start
        // inside the cap (moving the process moves every thread).
        if let Err(e) = cap.add(child.id()) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        eprintln!(
            "server process {} capped at {} cores in {}",
            child.id(),
            arg("--server-cpu", 0.0f64),
            cap.dir().display()
        );
    }
    let guard = Child_ { child, cap };
    let mut lines = BufReader::new(stdout).lines();
    let mut addr = None;
    let mut ws = None;
    let mut cert = None;
    while addr.is_none() || cert.is_none() || (websocket && ws.is_none()) {
        let line = lines
            .next()
            .ok_or("the server process ended before saying its address")?
            .map_err(|e| e.to_string())?;
        if let Some(a) = line.strip_prefix("ADDR ") {
            addr = a.parse().ok();
        } else if let Some(a) = line.strip_prefix("WS ") {
            ws = a.parse().ok();
        } else if let Some(c) = line.strip_prefix("CERT ") {
            cert = unhex(c);
        }
    }
    match (addr, cert) {
        (Some(a), Some(c)) => Ok((guard, a, ws, c)),
        _ => Err("bad address or certificate from the server process".into()),
    }
}

/// `--mass-reconnect K`: N sessions held, K reconnect at once, with TLS
/// resumption offered and without.
fn mass_reconnect(n: usize, k: usize) {
    let endpoints: usize = arg("--endpoints", 8);
    let concurrency: usize = arg("--concurrency", 32);
    let ramp_timeout = Duration::from_secs(arg("--ramp-timeout", 240));
    let k = k.min(n);
    let (child, addr, cert) = match start_server(n) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("quic_load: {e}");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let result = runtime.block_on(async {
        let mut opts = HerdOptions::new(addr, vec![CertificateDer::from(cert)], SECRET, n);
        opts.watchers = 0;
        opts.endpoints = endpoints;
        opts.connect_concurrency = concurrency;
        opts.kind = greendot_proto::Kind::Mobile;
        // As this benchmark's other sessions: the server's keep-alive is the
        // heartbeat, the load generator only answers it.
        opts.keep_alive = None;
        opts.idle_timeout = Duration::from_secs(120);
        let herd = Herd::start(opts, ramp_timeout).await?;
        let mut rows = Vec::new();
        for resumption in [true, false] {
            tokio::time::sleep(Duration::from_secs(2)).await;
            herd.set_resumption(resumption);
            let before = herd.counts();
            herd.mark();
            let since = std::time::Instant::now();
            herd.mass_reconnect(k);
            let took = herd.wait_back(k, since, Duration::from_secs(600)).await;
            let after = herd.counts();
            rows.push((resumption, took, before, after));
        }
        herd.stop().await;
        Ok::<_, String>(rows)
    });
    drop(child);
    let rows = match result {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("quic_load: {e}");
            std::process::exit(2);
        }
    };
    println!();
    println!(
        "Mass reconnect: {k} of {n} held sessions reconnect at once (server in its own process)"
    );
    println!();
    println!("| K | TLS tickets offered | all back (s) | handshakes/s | handshakes (full) | failed attempts |");
    println!("|---:|---|---:|---:|---:|---:|");
    for (resumption, took, before, after) in rows {
        let handshakes = after.handshakes - before.handshakes;
        let full = after.full_handshakes - before.full_handshakes;
        println!(
            "| {k} | {} | {} | {} | {handshakes} ({full}) | {} |",
            if resumption { "yes" } else { "no" },
            took.map_or("not all back".into(), |d| format!("{:.2}", d.as_secs_f64())),
            took.map_or("-".into(), |d| format!(
                "{:.0}",
                k as f64 / d.as_secs_f64().max(1e-9)
            )),
            after.failed_attempts - before.failed_attempts
        );
    }
}

fn main() {
    if flag("--serve") {
        serve();
        return;
    }
    let nofile = raise_nofile();
    let mass: usize = arg("--mass-reconnect", 0);
    if mass > 0 {
        let k = mass;
        let n: usize = arg("--n", k.to_string())
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .next()
            .unwrap_or(k);
        eprintln!("open-file limit {nofile}; mass reconnect of {k} of {n} sessions");
        mass_reconnect(n, k);
        return;
    }
    if flag("--websocket") {
        let n: usize = arg("--n", "10000".to_string())
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .next()
            .unwrap_or(10_000);
        eprintln!("open-file limit {nofile}; {n} QUIC sessions, then {n} WebSocket sessions");
        quic_vs_websocket(n);
        return;
    }
    let ns: Vec<usize> = arg("--n", "1000,10000,100000".to_string())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let duration = Duration::from_secs(arg("--duration", 30));
    let churn: f64 = arg("--churn", 0.01);
    let endpoints: usize = arg("--endpoints", 8);
    let concurrency: usize = arg("--concurrency", 32);
    let ramp_timeout = Duration::from_secs(arg("--ramp-timeout", 240));
    let burst = match (arg("--burst", 0usize), arg("--step", 0usize)) {
        (0, 0) => None,
        (sessions, 0) => Some(loadgen::Burst {
            after: Duration::from_secs(arg("--burst-after", 5)),
            sessions,
            arrivals_per_sec: None,
        }),
        (_, sessions) => Some(loadgen::Burst {
            after: Duration::from_secs(arg("--step-after", 5)),
            sessions,
            arrivals_per_sec: Some(arg("--step-rate", 1000.0)),
        }),
    };
    let step = burst
        .filter(|b| b.arrivals_per_sec.is_some())
        .map_or(0, |b| b.sessions);
    let load = load_average();
    let baseline = random_read_baseline();
    eprintln!(
        "load average {load}; random-read baseline {:.2} M/s",
        baseline / 1e6
    );
    eprintln!("open-file limit {nofile}; N = {ns:?}, {duration:?} of churn at {churn} per second");
    eprintln!(
        "keep-alive: the server's {} s (jittered over 0.75-1 of it), idle timeout {} s; the devices' {}",
        arg("--server-keep-alive", 15.0f64),
        arg("--server-idle-timeout", 45.0f64),
        match arg("--keep-alive", 0.0f64) {
            0.0 => "none (they answer)".to_string(),
            s => format!("{s} s"),
        }
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let mut reports: Vec<LoadReport> = Vec::new();
    for &n in &ns {
        eprintln!("N = {n}: starting a server process");
        let (child, addr, cert) = match start_server(n + step) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("quic_load: {e}");
                std::process::exit(2);
            }
        };
        let mut opts = LoadOptions::new(addr, vec![CertificateDer::from(cert)], SECRET, n);
        opts.server_pid = Some(child.child.id());
        opts.server_cap = child.cap_probe();
        opts.duration = duration;
        opts.churn = churn;
        opts.endpoints = endpoints;
        opts.connect_concurrency = concurrency;
        opts.ramp_timeout = ramp_timeout;
        opts.burst = burst;
        opts.keep_alive = match arg("--keep-alive", 0.0f64) {
            0.0 => None,
            s => Some(secs(s)),
        };
        let report = runtime.block_on(loadgen::run(opts));
        eprintln!("{}\n{report}", LoadReport::header());
        eprintln!(
            "{}\n{}",
            LoadReport::bottleneck_header(),
            report.bottleneck_row()
        );
        eprintln!(
            "  ramp {:.1} s, failed {}, reconnect failures {}, request errors {}, latency samples {}, client CPU {:.2} cores",
            report.ramp.as_secs_f64(),
            report.failed,
            report.reconnect_failures,
            report.request_errors,
            report.latency_samples,
            report.client_cpu_window.unwrap_or(0.0)
        );
        drop(child);
        let stop = report.connected < n / 2;
        reports.push(report);
        if stop {
            eprintln!("fewer than half of the connections came up: not trying a larger N");
            break;
        }
    }

    println!();
    println!(
        "QUIC load: 20 realtime contacts per connection, churn {:.1}%/s (half status changes, half reconnects with resume), {} s measured per N, {endpoints} client endpoints; server in its own process, debounce 300 ms subtracted from latency",
        churn * 100.0,
        duration.as_secs()
    );
    println!();
    println!(
        "Load average {load} at the start; random-read baseline {:.2} M/s (one dependent read per step in a 16 MiB array, as the core bench){}",
        baseline / 1e6,
        match arg("--server-cpu", 0.0f64) {
            0.0 => String::new(),
            c => format!("; **server capped at {c} of a core** (cgroup CPU quota)"),
        }
    );
    println!();
    println!("{}", LoadReport::header());
    for r in &reports {
        println!("{r}");
    }
    println!();
    println!("Who was the bottleneck in the window:");
    println!();
    println!("{}", LoadReport::bottleneck_header());
    for r in &reports {
        println!("{}", r.bottleneck_row());
    }
    println!();
    for r in &reports {
        println!(
            "N = {}: connected {} in {:.1} s (99% in {:.1} s; {} failed), server RSS {} -> {} MiB, {} latency samples, {} reconnect failures, {} request errors, load generator CPU {:.2} cores",
            r.target,
            r.connected,
            r.ramp.as_secs_f64(),
            r.ramp_99.as_secs_f64(),
            r.failed,
            r.server_rss_before.unwrap_or(0) >> 20,
            r.server_rss_after.unwrap_or(0) >> 20,
            r.latency_samples,
            r.reconnect_failures,
            r.request_errors,
            r.client_cpu_window.unwrap_or(0.0)
        );
    }

    let bursts: Vec<_> = reports
        .iter()
        .filter_map(|r| Some((r.target, r.burst.as_ref()?)))
        .collect();
    if !bursts.is_empty() {
        println!();
        if step > 0 {
            println!(
                "Step: K new devices connect at {} per second (retrying with backoff), the established keep churning; p99 of the established sessions' change-to-push",
                arg("--step-rate", 1000.0)
            );
        } else {
            println!("Burst: devices 0..K reconnect at once (resume), the rest keep churning; p99 of the others' change-to-push");
        }
        println!();
        println!("| N | K | back | given up | all back (s) | p99 before ms | p99 during ms | p99 after ms | normal after the burst (s) |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let ms =
            |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3));
        let s = |d: Option<Duration>| {
            d.map_or("not within the window".into(), |d| {
                format!("{:.1}", d.as_secs_f64())
            })
        };
        for (n, b) in bursts {
            println!(
                "| {n} | {} | {} | {} | {} | {} | {} | {} | {} |",
                b.sessions,
                b.back,
                b.failed,
                s(b.all_back),
                ms(b.p99_before),
                ms(b.p99_during),
                ms(b.p99_after),
                s(b.normal_after)
            );
        }
    }

    let docs = greendot_bench::docs_dir();
    let x = |r: &LoadReport| r.connected as f64;
    let lat = |f: fn(&LoadReport) -> Option<Duration>| -> Vec<(f64, f64)> {
        reports
            .iter()
            .filter_map(|r| Some((x(r), f(r)?.as_secs_f64() * 1e3)))
            .collect()
    };
    let series = vec![
        ("p50".to_string(), lat(|r| r.latency_p50)),
        ("p99".to_string(), lat(|r| r.latency_p99)),
        ("p99.9".to_string(), lat(|r| r.latency_p999)),
    ];
    let path = docs.join("bench-quic-latency.svg");
    match plot::lines(
        &path,
        "Change-to-push latency after debounce, by connections held",
        "connections",
        "milliseconds",
        &series,
        true,
    ) {
        Ok(()) => eprintln!("plot: {}", path.display()),
        Err(e) => eprintln!("plot failed: {e}"),
    }
    let mem: Vec<(f64, f64)> = reports
        .iter()
        .filter_map(|r| Some((x(r), r.bytes_per_session()? / 1024.0)))
        .collect();
    let path = docs.join("bench-quic-memory.svg");
    match plot::lines(
        &path,
        "Server memory per session (RSS delta / sessions), goal 16 KiB",
        "connections",
        "KiB per session",
        &[
            ("server KiB/session".to_string(), mem),
            (
                "goal".to_string(),
                reports.iter().map(|r| (x(r), 16.0)).collect(),
            ),
        ],
        true,
    ) {
        Ok(()) => eprintln!("plot: {}", path.display()),
        Err(e) => eprintln!("plot failed: {e}"),
    }
}

/// `--websocket`: N sessions over QUIC, then N over WebSocket, in one run,
/// each against a fresh server process (with both listeners), with the same
/// contacts, churn and duration; one table.
fn quic_vs_websocket(n: usize) {
    let duration = Duration::from_secs(arg("--duration", 30));
    let churn: f64 = arg("--churn", 0.01);
    let endpoints: usize = arg("--endpoints", 8);
    let concurrency: usize = arg("--concurrency", 32);
    let ramp_timeout = Duration::from_secs(arg("--ramp-timeout", 240));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let mut rows = Vec::new();
    for binding in ["QUIC", "WebSocket"] {
        eprintln!("{binding}: starting a server process");
        let (child, addr, ws, cert) = match start_server_with(n, true) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("quic_load: {e}");
                std::process::exit(2);
            }
        };
        let mut opts = LoadOptions::new(addr, vec![CertificateDer::from(cert)], SECRET, n);
        opts.server_pid = Some(child.child.id());
        opts.server_cap = child.cap_probe();
        opts.duration = duration;
        opts.churn = churn;
        opts.endpoints = endpoints;
        opts.connect_concurrency = concurrency;
        opts.ramp_timeout = ramp_timeout;
        if binding == "WebSocket" {
            opts.websocket = ws;
        }
        let report = runtime.block_on(loadgen::run(opts));
        eprintln!("{}\n{report}", LoadReport::header());
        drop(child);
        rows.push((binding, report));
    }
    println!();
    println!(
        "QUIC against WebSocket: {n} sessions each, 20 realtime contacts per session, churn {:.1}%/s (half status changes, half reconnects with resume), {} s measured; a fresh server process per binding; debounce 300 ms subtracted from latency",
        churn * 100.0,
        duration.as_secs()
    );
    println!();
    println!("| binding | N | held | handshakes/s | server KiB/session | p50 ms | p99 ms | p99.9 ms | notifications/s | server CPU window (cores) | load generator CPU (cores) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let ms =
        |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3));
    for (binding, r) in &rows {
        println!(
            "| {binding} | {} | {} | {:.0} | {} | {} | {} | {} | {:.0} | {} | {} |",
            r.target,
            r.held,
            r.handshakes_per_sec,
            r.bytes_per_session()
                .map_or("-".into(), |b| format!("{:.1}", b / 1024.0)),
            ms(r.latency_p50),
            ms(r.latency_p99),
            ms(r.latency_p999),
            r.notifications_per_sec(),
            r.server_cpu_window
                .map_or("-".into(), |c| format!("{c:.2}")),
            r.client_cpu_window
                .map_or("-".into(), |c| format!("{c:.2}")),
        );
    }
    println!();
    for (binding, r) in &rows {
        println!(
            "{binding}: connected {} of {} ({} failed) in {:.1} s, server RSS {} -> {} MiB, {} latency samples, {} changes, {} reconnects ({} failed), {} request errors",
            r.connected,
            r.target,
            r.failed,
            r.ramp.as_secs_f64(),
            r.server_rss_before.unwrap_or(0) >> 20,
            r.server_rss_after.unwrap_or(0) >> 20,
            r.latency_samples,
            r.status_changes,
            r.reconnects,
            r.reconnect_failures,
            r.request_errors,
        );
    }
}
