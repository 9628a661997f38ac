//! An idle connected client, what it costs a phone (issue 27, "Numbers"):
//! resident memory, wake-ups and bytes on the wire, for the Rust client and
//! the Python binding, each in the foreground and in the background, all
//! four at once in one window so they share the machine's noise.
//!
//! `bench/idle_client.sh` builds what it needs and runs it; by hand:
//! `target/release/idle_client -- --minutes 10` with `target/release/greendot`
//! and the generated Python module in `target/release/python-bindings`
//! (clients/python/README.md, "Install"); `--greendot PATH`,
//! `--python-bindings DIR` and `--python PATH` say otherwise.
//!
//! What it does:
//! - starts `greendot serve` on its defaults, but on a free port
//!   (`--listen 127.0.0.1:0`), a fresh data directory in the temp dir, and
//!   no WebSocket or HTTP port, and prints the settings in effect that make
//!   an idle connection talk (keep-alive, idle timeout);
//! - mints one token per client (`greendot token`, a mobile device each);
//! - starts each client as a process of its own (this binary with
//!   `rust-client`, or `python3 bench/idle_client.py`) behind a UDP relay of
//!   its own in this process, which counts the datagrams and their UDP
//!   payload bytes each way (what the client's socket sends and gets; IP
//!   and UDP headers, 28 bytes a datagram over IPv4, come on top);
//! - each client connects, registers for events (a Rust task on `Updates`,
//!   a Python `PresenceListener`), the background ones then call
//!   `app_backgrounded()`, and each says it is ready;
//! - after a settling pause the window opens: memory (`VmRSS`, `VmHWM` of
//!   `/proc/PID/status`), context switches summed over every thread
//!   (`voluntary_ctxt_switches` + `nonvoluntary_ctxt_switches` of
//!   `/proc/PID/task/*/status`: each is a wake-up, the battery cost) and the
//!   relay's counters are read at its start and end;
//! - at the end the clients are told to close (stdin closes) and report how
//!   many times their connection was lost, so a window with a reconnect
//!   shows it.
//!
//! The server's own row is informational: it includes the server's own
//! timers (the store's write-behind and others), not only its share of
//! these four connections.

use greendot_bench::{arg, load_average};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() {
    if std::env::args().nth(1).as_deref() == Some("rust-client") {
        rust_client();
    } else {
        measure();
    }
}

// ---------------------------------------------------------------------------
// The Rust client, one process.

/// `idle_client rust-client SERVER CA_PEM TOKEN foreground|background`:
/// connects, goes to the background if asked, prints `ready`, stays idle
/// until stdin closes, then prints `done disconnects=N` and closes without
/// logging out.
fn rust_client() {
    let args: Vec<String> = std::env::args().skip(2).collect();
    let [server, ca, token, state] = args.as_slice() else {
        eprintln!("usage: idle_client rust-client SERVER CA_PEM TOKEN foreground|background");
        std::process::exit(2);
    };
    // The binding's shape (bindings/greendot-ffi: one worker thread), so
    // the two clients differ by the binding and the interpreter only.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        use greendot_client::{Certificate, Client, ClientConfig, Event, ServerAddr};
        let server = ServerAddr::parse(server).expect("a server address");
        let roots = Certificate::from_pem_file(Path::new(ca)).expect("the server's certificate");
        let config = ClientConfig::new(server, roots, token.trim());
        let (client, mut updates) = Client::connect(config).await.expect("connect");
        let disconnects = Arc::new(AtomicU64::new(0));
        let counted = disconnects.clone();
        tokio::spawn(async move {
            while let Some(event) = updates.next().await {
                if matches!(event, Event::Disconnected { .. }) {
                    counted.fetch_add(1, Relaxed);
                }
            }
        });
        if state == "background" {
            client.app_backgrounded();
        }
        println!("ready");
        // A thread blocked in read(2) wakes nobody until stdin closes.
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            let _ = closed_tx.send(());
        });
        let _ = closed_rx.await;
        let stats = client.stats();
        println!(
            "done disconnects={} quic_connections={} websocket_connections={}",
            disconnects.load(Relaxed),
            stats.quic_connections,
            stats.websocket_connections
        );
        client.close().await;
    });
}

// ---------------------------------------------------------------------------
// The measurement.

/// Counts what goes through one relay.
#[derive(Default)]
struct Counters {
    up_datagrams: AtomicU64,
    up_bytes: AtomicU64,
    down_datagrams: AtomicU64,
    down_bytes: AtomicU64,
}

#[derive(Clone, Copy, Default)]
struct Traffic {
    up_datagrams: u64,
    up_bytes: u64,
    down_datagrams: u64,
    down_bytes: u64,
}

impl Counters {
    fn read(&self) -> Traffic {
        Traffic {
            up_datagrams: self.up_datagrams.load(Relaxed),
            up_bytes: self.up_bytes.load(Relaxed),
            down_datagrams: self.down_datagrams.load(Relaxed),
            down_bytes: self.down_bytes.load(Relaxed),
        }
    }
}

/// Forwards datagrams between one client and `server`, counting them; the
/// client is whoever sent last to the returned address.
async fn relay(server: SocketAddr) -> (SocketAddr, Arc<Counters>) {
    let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    back.connect(server).await.unwrap();
    let addr = front.local_addr().unwrap();
    let counters = Arc::new(Counters::default());
    let (client_tx, mut client_rx) = tokio::sync::watch::channel(None::<SocketAddr>);
    {
        let (front, back, counters) = (front.clone(), back.clone(), counters.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = front.recv_from(&mut buf).await {
                client_tx.send_if_modified(|c| c.replace(from) != Some(from));
                counters.up_datagrams.fetch_add(1, Relaxed);
                counters.up_bytes.fetch_add(n as u64, Relaxed);
                let _ = back.send(&buf[..n]).await;
            }
        });
    }
    {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = back.recv(&mut buf).await {
                let Some(to) = *client_rx.borrow_and_update() else {
                    continue;
                };
                counters.down_datagrams.fetch_add(1, Relaxed);
                counters.down_bytes.fetch_add(n as u64, Relaxed);
                let _ = front.send_to(&buf[..n], to).await;
            }
        });
    }
    (addr, counters)
}

/// One process's numbers at one moment.
#[derive(Clone, Default)]
struct Sample {
    rss_kib: u64,
    hwm_kib: u64,
    /// Context switches per thread, by `tid`: (its name, the count).
    threads: BTreeMap<u32, (String, u64)>,
}

impl Sample {
    fn switches(&self) -> u64 {
        self.threads.values().map(|(_, n)| n).sum()
    }
}

fn status_field(status: &str, name: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn sample(pid: u32) -> Sample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mut s = Sample {
        rss_kib: status_field(&status, "VmRSS"),
        hwm_kib: status_field(&status, "VmHWM"),
        threads: BTreeMap::new(),
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return s;
    };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        let name = status
            .lines()
            .find_map(|l| l.strip_prefix("Name:"))
            .unwrap_or("")
            .trim()
            .to_string();
        let n = status_field(&status, "voluntary_ctxt_switches")
            + status_field(&status, "nonvoluntary_ctxt_switches");
        s.threads.insert(tid, (name, n));
    }
    s
}

/// A measured client: its process and relay.
struct Measured {
    label: &'static str,
    state: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    counters: Arc<Counters>,
}

/// Runs `command` to completion and returns its stdout, or exits with its
/// stderr.
fn output(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    if !out.status.success() {
        eprintln!(
            "{command:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::process::exit(1);
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn read_line(stdout: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    let _ = stdout.read_line(&mut line);
    line.trim().to_string()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn measure() {
    let exe = std::env::current_exe().expect("this binary's path");
    let dir = exe.parent().expect("a directory").to_path_buf();
    let minutes: f64 = arg("--minutes", 10.0);
    let greendot = PathBuf::from(arg(
        "--greendot",
        dir.join("greendot").display().to_string(),
    ));
    let bindings = PathBuf::from(arg(
        "--python-bindings",
        dir.join("python-bindings").display().to_string(),
    ));
    let python: String = arg("--python", "python3".to_string());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("idle_client.py");
    let settle = Duration::from_secs(arg("--settle-secs", 5));
    assert!(
        bindings.join("greendot_ffi.py").exists(),
        "no {}/greendot_ffi.py (see clients/python/README.md, \"Install\", or bench/idle_client.sh)",
        bindings.display()
    );

    let data = std::env::temp_dir().join(format!("greendot-idle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let serve_args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--websocket",
        "off",
        "--metrics",
        "off",
    ];
    let config = output(
        Command::new(&greendot)
            .args(serve_args)
            .arg("--data-dir")
            .arg(&data)
            .arg("--print-config"),
    );
    let mut server = Command::new(&greendot)
        .args(serve_args)
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("cannot start greendot serve");
    let mut server_out = BufReader::new(server.stdout.take().unwrap());
    let mut server_addr = None;
    let mut cert = None;
    while server_addr.is_none() || cert.is_none() {
        let line = read_line(&mut server_out);
        if line.is_empty() {
            panic!("greendot serve ended before it listened");
        }
        if let Some(rest) = line.strip_prefix("greendot listening on ") {
            server_addr = rest.split_whitespace().next().and_then(|a| a.parse().ok());
        }
        if let Some(rest) = line.strip_prefix("certificate: ") {
            cert = Some(PathBuf::from(rest));
        }
    }
    let (server_addr, cert): (SocketAddr, PathBuf) = (server_addr.unwrap(), cert.unwrap());
    // The rest of its output, so that its pipe never fills.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut server_out, &mut std::io::sink());
    });

    let mut clients = Vec::new();
    for (label, state) in [
        ("Rust", "foreground"),
        ("Rust", "background"),
        ("Python", "foreground"),
        ("Python", "background"),
    ] {
        let user = format!("idle-{}-{}", label.to_lowercase(), state);
        let token = output(
            Command::new(&greendot)
                .args([
                    "token", "--user", &user, "--device", "phone", "--kind", "mobile",
                ])
                .arg("--data-dir")
                .arg(&data),
        );
        let (addr, counters) = relay(server_addr).await;
        let mut command = if label == "Rust" {
            let mut c = Command::new(&exe);
            c.arg("rust-client");
            c
        } else {
            let mut c = Command::new(&python);
            c.arg(&script).arg(&bindings);
            c
        };
        command
            .arg(addr.to_string())
            .arg(&cert)
            .arg(token.trim())
            .arg(state)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        clients.push(Measured {
            label,
            state,
            child,
            stdin,
            stdout,
            counters,
        });
    }
    for c in &mut clients {
        let line = read_line(&mut c.stdout);
        assert_eq!(
            line, "ready",
            "the {} {} client: {line:?}",
            c.label, c.state
        );
    }
    // Past the connects and the background requests' answers.
    tokio::time::sleep(settle).await;

    let load = load_average();
    let pids: Vec<u32> = clients
        .iter()
        .map(|c| c.child.id())
        .chain([server.id()])
        .collect();
    let before: Vec<Sample> = pids.iter().map(|&p| sample(p)).collect();
    let traffic_before: Vec<Traffic> = clients.iter().map(|c| c.counters.read()).collect();
    let window = Duration::from_secs_f64(minutes * 60.0);
    let start = Instant::now();
    eprintln!("window of {minutes} min opened; load average {load}");
    while start.elapsed() < window {
        let left = window.saturating_sub(start.elapsed());
        tokio::time::sleep(left.min(Duration::from_secs(60))).await;
        eprintln!("{:.0} s", start.elapsed().as_secs_f64());
    }
    let elapsed_min = start.elapsed().as_secs_f64() / 60.0;
    let after: Vec<Sample> = pids.iter().map(|&p| sample(p)).collect();
    let traffic_after: Vec<Traffic> = clients.iter().map(|c| c.counters.read()).collect();

    let mut reports = Vec::new();
    for c in &mut clients {
        drop(c.stdin.take());
        reports.push(read_line(&mut c.stdout));
        let _ = c.child.wait();
    }
    // SIGTERM: it drains and exits.
    unsafe { libc::kill(server.id() as libc::pid_t, libc::SIGTERM) };
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&data);

    println!("idle clients, {elapsed_min:.2} min window, load average {load} at its start");
    println!();
    println!("server settings in effect (greendot serve --print-config):");
    for line in config.lines() {
        let key = line.split('=').next().unwrap_or("").trim();
        if matches!(key, "keep_alive" | "idle_timeout") {
            println!("  {line}");
        }
    }
    println!("client settings: greendot-client's defaults (keep_alive 10 s, idle_timeout 30 s)");
    println!();
    println!(
        "| client | app | threads | VmRSS start → end (KiB) | VmHWM (KiB) | wake-ups/min | \
         datagrams/min sent / received | bytes sent / received | bytes/min sent / received | \
         connection lost |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for (i, c) in clients.iter().enumerate() {
        let (b, a) = (&before[i], &after[i]);
        let (tb, ta) = (traffic_before[i], traffic_after[i]);
        let per_min = |x: u64| x as f64 / elapsed_min;
        let up = ta.up_bytes - tb.up_bytes;
        let down = ta.down_bytes - tb.down_bytes;
        let report = &reports[i];
        let lost = report
            .split_whitespace()
            .find_map(|w| w.strip_prefix("disconnects="))
            .map_or_else(|| format!("? ({report})"), |n| format!("{n} times"));
        println!(
            "| {} | {} | {} | {} → {} | {} | {:.1} | {:.1} / {:.1} | {} / {} | {:.0} / {:.0} | {} |",
            c.label,
            c.state,
            a.threads.len(),
            b.rss_kib,
            a.rss_kib,
            a.hwm_kib,
            per_min(a.switches().saturating_sub(b.switches())),
            per_min(ta.up_datagrams - tb.up_datagrams),
            per_min(ta.down_datagrams - tb.down_datagrams),
            up,
            down,
            per_min(up),
            per_min(down),
            lost
        );
    }
    let (b, a) = (&before[clients.len()], &after[clients.len()]);
    println!(
        "| server (all four) | | {} | {} → {} | {} | {:.1} | | | | |",
        a.threads.len(),
        b.rss_kib,
        a.rss_kib,
        a.hwm_kib,
        a.switches().saturating_sub(b.switches()) as f64 / elapsed_min
    );
    println!();
    println!("wake-ups per minute by thread (threads that woke in the window):");
    println!();
    println!("| client | app | thread | wake-ups/min |");
    println!("|---|---|---|---:|");
    for (i, c) in clients.iter().enumerate() {
        for (tid, (name, n)) in &after[i].threads {
            let was = before[i].threads.get(tid).map_or(0, |(_, n)| *n);
            if n > &was {
                println!(
                    "| {} | {} | {name} | {:.1} |",
                    c.label,
                    c.state,
                    (n - was) as f64 / elapsed_min
                );
            }
        }
    }
    let _ = std::io::stdout().flush();
}
