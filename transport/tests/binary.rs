//! The real `greendot` binary, end to end: `serve` in a temporary data
//! directory, `token`, `connect`, `watch --json`, `query`, `group`, the HTTP port
//! (`/metrics`, `/healthz`, `/readyz`);
//! `kill -9` of a client (the watcher sees it offline within the bound),
//! `kill -9` of the server and a restart (an invisible user stays invisible,
//! last seen survives), and a graceful drain (SIGTERM) and restart that no
//! watcher notices.
//!
//! Every wait is for an observable line with a deadline; the only timed
//! windows are the ones in which something must *not* happen.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_greendot");

/// Quick timers: a killed client is offline after idle timeout (1 s) + one
/// keep-alive (250 ms) + grace (1 s) + debounce (100 ms).
const FLAGS: &[&str] = &[
    "--idle-timeout",
    "1s",
    "--keep-alive",
    "250ms",
    "--grace",
    "1s",
    "--debounce",
    "100ms",
    "--heartbeat-timeout",
    "20s",
    "--flush-interval",
    "1s",
];
const OFFLINE_BOUND: Duration = Duration::from_millis(1000 + 250 + 1000 + 100);
/// Room for a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(8);

mod support;
use support::{temp_dir, Proc};

/// `greendot ARGS` in `dir`, its output read line by line.
fn greendot(name: &str, dir: &Path, args: &[&str]) -> Proc {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    Proc::spawn(name, command)
}

fn run(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("greendot runs");
    assert!(
        out.status.success(),
        "greendot {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn token(dir: &Path, user: &str, device: &str, kind: &str, watch: &str) -> String {
    let mut args = vec![
        "token", "--user", user, "--device", device, "--kind", kind, "--ttl", "1h",
    ];
    if !watch.is_empty() {
        args.extend(["--watch", watch]);
    }
    let out = run(dir, &args);
    // Only the token on stdout.
    assert_eq!(out.lines().count(), 1, "{out:?}");
    let jwt = out.trim().to_owned();
    assert_eq!(jwt.split('.').count(), 3, "{jwt}");
    jwt
}

/// A service token for user `backend` (groups are written with one).
fn service_token(dir: &Path) -> String {
    let out = run(
        dir,
        &[
            "token",
            "--user",
            "backend",
            "--device",
            "cli",
            "--service",
            "--ttl",
            "1h",
        ],
    );
    out.trim().to_owned()
}

/// `greendot group set` of `group` at `addr`, with `extra` arguments.
fn group_set(dir: &Path, addr: &str, service: &str, group: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "group", "set", "--token", service, "--server", addr, "--group", group,
    ];
    args.extend(extra);
    run(dir, &args)
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
}

fn is(line: &str, user: &str, online: bool) -> bool {
    serde_json::from_str::<serde_json::Value>(line)
        .is_ok_and(|v| v["user"] == user && v["online"] == online)
}

struct Served {
    proc: Proc,
    addr: SocketAddr,
    metrics: SocketAddr,
}

fn serve(dir: &Path, listen: &str) -> Served {
    serve_with(dir, listen, &[])
}

fn serve_with(dir: &Path, listen: &str, extra: &[&str]) -> Served {
    let mut args = vec!["serve", "--listen", listen, "--metrics", "127.0.0.1:0"];
    args.extend(FLAGS);
    args.extend(extra);
    let mut proc = greendot("serve", dir, &args);
    let line = proc.wait_for(SLACK, "listening", |l| {
        l.starts_with("greendot listening on ")
    });
    let addr = line
        .trim_start_matches("greendot listening on ")
        .split_whitespace()
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let line = proc.metrics_addr(SLACK);
    let metrics: SocketAddr = line
        .parse()
        .unwrap_or_else(|_| panic!("no metrics address in {line:?}"));
    proc.wait_for(SLACK, "health", |l| {
        l == format!("health on http://{metrics}/healthz and /readyz")
    });
    proc.wait_for(SLACK, "an example", |l| l.starts_with("try: "));
    Served {
        proc,
        addr,
        metrics,
    }
}

fn client(dir: &Path, name: &str, served: &Served, args: &[&str]) -> Proc {
    let addr = served.addr.to_string();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--server", &addr]);
    greendot(name, dir, &all)
}

fn query(dir: &Path, served: &Served, token: &str, user: &str) -> serde_json::Value {
    let addr = served.addr.to_string();
    let out = run(
        dir,
        &["query", "--token", token, "--server", &addr, user, "--json"],
    );
    json(out.trim())
}

/// `GET path` on the HTTP port: the whole response.
fn http_get(at: SocketAddr, path: &str) -> String {
    http_get_with(at, path, "")
}

/// A GET with `headers` (each line ending in CRLF) added.
fn http_get_with(at: SocketAddr, path: &str, headers: &str) -> String {
    let mut stream = TcpStream::connect(at).expect("HTTP port");
    stream.set_read_timeout(Some(SLACK)).expect("read timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {at}\r\n{headers}Connection: close\r\n\r\n"
    )
    .expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("response");
    text
}

fn metrics(at: SocketAddr) -> String {
    let text = http_get(at, "/metrics");
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{text}"
    );
    text
}

#[test]
fn the_binary_serves_survives_kill_9_and_drains() {
    let dir = temp_dir("bin");
    // A port the kernel never hands a client meanwhile: the server restarts on it.
    let port = support::port_outside_ephemeral_range();
    let mut server = serve(&dir, &format!("127.0.0.1:{port}"));
    let first = server.proc.seen.join("\n");
    assert!(first.contains("created greendot-data/cert.pem"), "{first}");
    assert!(first.contains("certificate SHA-256: "), "{first}");
    assert!(first.contains("token --user"), "{first}");
    let listen = server.addr.to_string();

    let alice = token(&dir, "alice", "phone", "mobile", "");
    let carol = token(&dir, "carol", "desk", "desktop", "");
    let carol_cli = token(&dir, "carol", "cli", "other", "");
    let dave = token(&dir, "dave", "tablet", "web", "");
    let bob = token(&dir, "bob", "laptop", "desktop", "alice,carol,dave");
    let bob_cli = token(&dir, "bob", "cli", "other", "*");

    let mut watch = client(
        &dir,
        "watch",
        &server,
        &["watch", "--token", &bob, "alice", "carol", "dave", "--json"],
    );
    for user in ["alice", "carol", "dave"] {
        watch.wait_for(SLACK, "snapshot", |l| is(l, user, false));
    }

    // connect: the watcher sees alice online.
    let mut alice_proc = client(&dir, "alice", &server, &["connect", "--token", &alice]);
    alice_proc.wait_for(SLACK, "online", |l| l.starts_with("online as alice/phone"));
    let line = watch.wait_for(SLACK, "alice online", |l| is(l, "alice", true));
    assert_eq!(json(&line)["devices"], serde_json::json!(["mobile"]));

    // kill -9 of the client: offline after idle timeout + grace + debounce.
    let killed = Instant::now();
    alice_proc.kill9();
    let line = watch.wait_for(OFFLINE_BOUND + SLACK, "alice offline", |l| {
        is(l, "alice", false)
    });
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_millis(1000),
        "offline after {took:?}: sooner than grace"
    );
    let alice_seen = json(&line)["last_seen_ms"].as_u64().expect("last seen");
    let alice_offline = Instant::now();

    // carol connects invisible; the store has it before the answer.
    let mut carol_proc = client(
        &dir,
        "carol",
        &server,
        &["connect", "--token", &carol, "--invisible"],
    );
    carol_proc.wait_for(SLACK, "online", |l| l.contains("(invisible)"));
    let own = query(&dir, &server, &carol_cli, "carol");
    assert_eq!(own["invisible"], true, "{own}");
    let page = metrics(server.metrics);
    for (path, answer) in [
        ("/healthz", "HTTP/1.1 200 OK"),
        ("/readyz", "HTTP/1.1 200 OK"),
        ("/nope", "HTTP/1.1 404 Not Found"),
    ] {
        let text = http_get(server.metrics, path);
        assert!(text.starts_with(answer), "{path}: {text}");
    }
    for name in [
        "greendot_users_online 2", // bob (watching) and carol
        "greendot_devices{state=\"online\"}",
        "greendot_connections ",
        "greendot_push_latency_seconds_bucket{le=\"+Inf\"}",
        "greendot_notifications_total{tier=\"realtime\"}",
    ] {
        assert!(page.contains(name), "no {name} in\n{page}");
    }

    // kill -9 of the server, and a restart on the same port: alice's offline
    // had one flush interval (1 s) to be written behind.
    let flushed = alice_offline + Duration::from_millis(1000 + 250);
    std::thread::sleep(flushed.saturating_duration_since(Instant::now()));
    server.proc.kill9();
    let server = serve(&dir, &listen);
    // carol's client reconnects (a new session: a new process)...
    carol_proc.wait_for(SLACK, "reconnected", |l| l.contains("reconnected"));
    watch.wait_for(SLACK, "reconnected", |l| l.contains("reconnected"));
    // ... and is still invisible: her own view says so.
    let own = query(&dir, &server, &carol_cli, "carol");
    assert_eq!(own["invisible"], true, "{own}");
    assert_eq!(own["online"], true, "{own}");
    assert!(
        own["devices"]
            .as_array()
            .is_some_and(|d| d.contains(&serde_json::json!("desktop"))),
        "carol's client is back: {own}"
    );
    // A visible user after the restart: the watcher is live again.
    let _dave_proc = client(&dir, "dave", &server, &["connect", "--token", &dave]);
    watch.wait_for(SLACK, "dave online", |l| is(l, "dave", true));
    // alice's last seen survived the crash (written behind within 1 s).
    let p = query(&dir, &server, &bob_cli, "alice");
    let restored = p["last_seen_ms"].as_u64().expect("last seen");
    assert!(
        restored.abs_diff(alice_seen) <= 1000,
        "last seen {restored} vs {alice_seen}"
    );

    // A graceful drain (SIGTERM) and a restart: nobody is shown offline.
    let drained_at = watch.seen.len();
    let mut server = server;
    server.proc.signal("-TERM");
    let status = server.proc.wait_exit(SLACK);
    assert!(status.success(), "serve exited with {status}");
    server.proc.drain();
    assert!(
        server.proc.seen.iter().any(|l| l == "greendot stopped"),
        "{:?}",
        server.proc.seen
    );
    let server = serve(&dir, &listen);
    watch.wait_for(SLACK, "reconnected", |l| l.contains("reconnected"));
    let p = query(&dir, &server, &bob_cli, "dave");
    assert_eq!(p["online"], true, "{p}");
    // Past grace + debounce: a storm would have shown by now.
    std::thread::sleep(Duration::from_millis(1000 + 100 + 1500));
    let p = query(&dir, &server, &bob_cli, "dave");
    assert_eq!(p["online"], true, "dave stayed online: {p}");
    watch.drain();

    let carol_online: Vec<_> = watch.seen.iter().filter(|l| is(l, "carol", true)).collect();
    assert!(
        carol_online.is_empty(),
        "invisible carol shown online: {carol_online:?}"
    );
    let dave_offline: Vec<_> = watch.seen[drained_at..]
        .iter()
        .filter(|l| is(l, "dave", false))
        .collect();
    assert!(
        dave_offline.is_empty(),
        "a drain showed dave offline: {dave_offline:?}"
    );
    let page = metrics(server.metrics);
    assert!(
        page.contains("greendot_devices{state=\"online\"} 3"),
        "{page}"
    );

    drop(watch);
    drop(carol_proc);
    drop(server);
    std::fs::remove_dir_all(&dir).ok();
}

/// `serve` in `dir` with `args`; the lines it printed up to its example.
fn serve_lines(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Proc, Vec<String>) {
    let mut command_args = vec!["serve"];
    // Free loopback ports unless `args` say otherwise.
    for (flag, default) in [("--listen", "127.0.0.1:0"), ("--metrics", "127.0.0.1:0")] {
        if !args.contains(&flag) {
            command_args.extend([flag, default]);
        }
    }
    command_args.extend(args);
    let mut command = Command::new(BIN);
    command
        .args(&command_args)
        .current_dir(dir)
        .stdin(Stdio::null());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut proc = Proc::spawn(&format!("serve {args:?}"), command);
    proc.wait_for(SLACK, "an example", |l| l.starts_with("try: "));
    let seen = proc.seen.clone();
    (proc, seen)
}

fn line_after<'a>(lines: &'a [String], prefix: &str) -> &'a str {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in {lines:#?}"))
}

#[test]
fn the_websocket_port_is_a_setting_and_the_page_is_served() {
    let dir = temp_dir("bin");
    // Default: the QUIC address over TCP (port 0 there: a free TCP port).
    // One at a time: they share the data directory (and its store's lock).
    let (default, lines) = serve_lines(&dir, &[], &[]);
    let ws = line_after(&lines, "WebSocket on wss://");
    let ws: SocketAddr = ws
        .strip_suffix("/greendot (tcp)")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("{ws}"));
    assert!(ws.ip().is_loopback() && ws.port() != 0, "{ws}");
    TcpStream::connect(ws).expect("the WebSocket port accepts TCP");
    // The page's address carries this run's dev code after `#dev=`.
    let (http, code) = line_after(&lines, "page on http://")
        .split_once("/#dev=")
        .unwrap_or_else(|| panic!("no dev code in {lines:#?}"));
    let http: SocketAddr = http.parse().expect("page address");
    assert_eq!(code.len(), 32, "{code}");
    let with_code = format!("greendot-dev-code: {code}\r\n");
    assert!(
        line_after(&lines, "dev tokens on http://").contains("/dev/token/USER"),
        "{lines:#?}"
    );

    // The page, its client, where to connect, and a dev token.
    let page = http_get(http, "/");
    assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
    assert!(
        page.contains("<script type=\"module\" src=\"/app.js\">"),
        "{page}"
    );
    let js = http_get(http, "/greendot-client.js");
    assert!(
        js.to_ascii_lowercase()
            .contains("content-type: text/javascript"),
        "{js}"
    );
    assert!(js.contains("export {"), "an ES module");
    let config = http_get(http, "/page.json");
    let body = json(config.split("\r\n\r\n").nth(1).unwrap_or(""));
    assert_eq!(body["webSocket"]["port"], ws.port(), "{body}");
    assert_eq!(body["devTokens"], true, "{body}");
    let hash = line_after(&lines, "WebTransport serverCertificateHashes sha-256: ");
    assert_eq!(body["certificateHash"], hash, "{body}");
    // Without the code, or with another, nothing is minted.
    let no_code = http_get(http, "/dev/token/alice");
    assert!(no_code.starts_with("HTTP/1.1 403"), "{no_code}");
    assert!(
        no_code.contains("#dev="),
        "says where the code is: {no_code}"
    );
    let wrong = format!("greendot-dev-code: {}\r\n", "0".repeat(32));
    assert!(http_get_with(http, "/dev/token/alice", &wrong).starts_with("HTTP/1.1 403"));
    let minted = http_get_with(http, "/dev/token/alice", &with_code);
    assert!(minted.starts_with("HTTP/1.1 200 OK"), "{minted}");
    let minted = json(minted.split("\r\n\r\n").nth(1).unwrap_or(""));
    assert_eq!(minted["user"], "alice", "{minted}");
    let jwt = minted["token"].as_str().expect("a token").to_owned();
    // The token is the server's own: it connects.
    let quic = line_after(&lines, "greendot listening on ")
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let out = Command::new(BIN)
        .args([
            "query", "--token", &jwt, "--server", &quic, "alice", "--json",
        ])
        .current_dir(&dir)
        .output()
        .expect("query runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Another site rebinding its name to 127.0.0.1 sends its own Host.
    let mut stream = TcpStream::connect(http).expect("HTTP port");
    write!(
        stream,
        "GET /dev/token/alice HTTP/1.1\r\nHost: evil.example\r\n{with_code}Connection: close\r\n\r\n"
    )
    .expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("response");
    assert!(text.starts_with("HTTP/1.1 403"), "{text}");
    assert!(http_get_with(http, "/dev/token/a%0Ab", &with_code).starts_with("HTTP/1.1 400"));
    drop(default);

    // QUIC on every address: the tokens would work from elsewhere, so
    // there are none (the HTTP port is still on loopback).
    let (open, lines) = serve_lines(&dir, &["--listen", "0.0.0.0:0", "--websocket", "off"], &[]);
    assert!(
        line_after(&lines, "dev tokens off (").starts_with("the QUIC port is not on loopback"),
        "{lines:#?}"
    );
    let http: SocketAddr = line_after(&lines, "page on http://")
        .trim_end_matches('/')
        .parse()
        .expect("page address, without a code");
    assert!(http_get_with(http, "/dev/token/alice", &with_code).starts_with("HTTP/1.1 404"));
    drop(open);

    // Off, by flag; dev tokens off by flag.
    let (off, lines) = serve_lines(&dir, &["--websocket", "off", "--dev-tokens", "false"], &[]);
    assert!(lines.iter().any(|l| l == "WebSocket off"), "{lines:#?}");
    let http: SocketAddr = line_after(&lines, "page on http://")
        .trim_end_matches('/')
        .parse()
        .expect("page address");
    assert!(line_after(&lines, "dev tokens off (").starts_with("dev_tokens = false"));
    assert!(http_get(http, "/dev/token/alice").starts_with("HTTP/1.1 404"));
    let config = http_get(http, "/page.json");
    let body = json(config.split("\r\n\r\n").nth(1).unwrap_or(""));
    assert_eq!(body["webSocket"], serde_json::Value::Null, "{body}");
    assert_eq!(body["devTokens"], false, "{body}");
    drop(off);

    // Off, by environment; an address, by the TOML file (a port just free).
    let (env, lines) = serve_lines(&dir, &[], &[("GREENDOT_WEBSOCKET", "off")]);
    assert!(lines.iter().any(|l| l == "WebSocket off"), "{lines:#?}");
    drop(env);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    std::fs::write(
        dir.join("ws.toml"),
        format!("websocket = \"127.0.0.1:{port}\"\n"),
    )
    .expect("config");
    let (_file, lines) = serve_lines(&dir, &["--config", "ws.toml"], &[]);
    assert_eq!(
        line_after(&lines, "WebSocket on "),
        format!("wss://127.0.0.1:{port}/greendot (tcp)"),
        "{lines:#?}"
    );
    // The default, as --print-config writes it.
    let printed = run(&dir, &["serve", "--print-config"]);
    assert!(printed.contains("websocket = \"listen\""), "{printed}");
    assert!(printed.contains("dev_tokens = true"), "{printed}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `greendot group page --watch` renews its watch: a page watched past
/// the server's watch TTL (1 s here) still prints a member's change. The
/// renewals (every 200 ms) are waited on in its log, not slept on.
#[test]
fn a_watched_page_outlives_the_watch_ttl_by_renewing_it() {
    let dir = temp_dir("bin-group-renew");
    let served = serve_with(&dir, "127.0.0.1:0", &["--group-watch-ttl", "1s"]);
    let addr = served.addr.to_string();
    let service = service_token(&dir);
    std::fs::write(dir.join("members.txt"), "ann\nben\n").unwrap();
    group_set(&dir, &addr, &service, "7", &["--members", "members.txt"]);
    let ben = token(&dir, "ben", "phone", "mobile", "");
    let mut ben_online = client(&dir, "ben", &served, &["connect", "--token", &ben]);
    ben_online.wait_for(SLACK, "ben online", |l| l.starts_with("online as"));
    let ann = token(&dir, "ann", "cli", "desktop", "");
    let mut watched = client(
        &dir,
        "ann's watched page",
        &served,
        &[
            "group",
            "page",
            "--watch",
            "--renew-every",
            "200ms",
            "--group",
            "7",
            "--token",
            &ann,
        ],
    );
    watched.wait_for(SLACK, "the watch", |l| {
        l.contains("group 7: watching this page")
    });
    // Six renewals: 1.2 s and more since the page was watched.
    for n in 1..=6 {
        watched.wait_for(SLACK, &format!("renewal {n}"), |l| {
            l.contains("renewed the watch of the page")
        });
    }
    let busy = token(&dir, "ben", "laptop", "desktop", "");
    let _busy = client(
        &dir,
        "ben busy",
        &served,
        &["connect", "--token", &busy, "--status", "busy"],
    );
    watched.wait_for(SLACK, "ben's change", |l| l.contains(" ben online busy"));
    assert!(
        !watched.seen.iter().any(|l| l.contains("had run out")),
        "the watch ran out: {}",
        watched.seen.join("\n")
    );
}

/// `greendot group set` writes a 10,000-member group on the server's
/// default limits, whose `SetGroup` (about 120 KB) is larger than the
/// default frame cap (64 KiB): it sets the first part and adds the rest,
/// and says so. The first member's subscription counts 10,000 members,
/// and the last one (in the last part) reads a page.
#[test]
fn a_group_larger_than_a_frame_is_written_in_parts() {
    let dir = temp_dir("bin-group-parts");
    let served = serve_with(&dir, "127.0.0.1:0", &[]);
    let addr = served.addr.to_string();
    let service = service_token(&dir);
    let members: String = (1..=10_000).map(|i| format!("member{i:05}\n")).collect();
    std::fs::write(dir.join("members.txt"), members).unwrap();
    std::fs::write(dir.join("admins.txt"), "member00002\n").unwrap();
    let out = group_set(
        &dir,
        &addr,
        &service,
        "9",
        &["--members", "members.txt", "--admins", "admins.txt"],
    );
    assert!(
        out.trim().starts_with(
            "group 9: version 2, 10000 members listed, 1 admins (written in 2 requests: \
             the list is larger than the server's frame cap of 65536 bytes"
        ),
        "{out}"
    );
    let first = token(&dir, "member00001", "cli", "desktop", "");
    let mut watch = client(
        &dir,
        "member00001 watch",
        &served,
        &[
            "group", "watch", "--group", "9", "--json", "--token", &first,
        ],
    );
    let snapshot = json(&watch.wait_for(SLACK, "the snapshot", |l| l.starts_with('{')));
    assert_eq!(snapshot["members"], 10_000, "{snapshot}");
    assert_eq!(snapshot["role"], "member", "{snapshot}");
    let last = token(&dir, "member10000", "cli", "desktop", "");
    let page = run(
        &dir,
        &[
            "group", "page", "--token", &last, "--server", &addr, "--group", "9", "--json",
        ],
    );
    let lines: Vec<&str> = page.lines().collect();
    // The command's default limit: 100 entries, then the cursor.
    assert_eq!(lines.len(), 101, "100 entries and a cursor: {page}");
    assert!(json(lines[100])["next"].is_string(), "{}", lines[100]);
}

/// `greendot group`: a group written from files with a service token, a
/// member watching the count, an admin seeing members in realtime, the
/// member list in pages with a cursor, and the end when the group goes.
#[test]
fn the_group_commands_write_watch_and_page_a_group() {
    let dir = temp_dir("bin-groups");
    let served = serve_with(
        &dir,
        "127.0.0.1:0",
        &["--group-interval", "300ms", "--group-page-size", "2"],
    );
    let addr = served.addr.to_string();
    let service = service_token(&dir);
    std::fs::write(
        dir.join("members.txt"),
        "# the team\nalice\n\n bob \ncarol\n",
    )
    .unwrap();
    std::fs::write(dir.join("admins.txt"), "alice\n").unwrap();
    let set = |extra: &[&str]| group_set(&dir, &addr, &service, "42", extra);
    let out = set(&["--members", "members.txt", "--admins", "admins.txt"]);
    assert_eq!(
        out.trim(),
        "group 42: version 1, 3 members listed, 1 admins"
    );

    // Bob's watch is a member's: counts only. His own connection puts him
    // online, so the count reaches 1, then 2 when carol connects.
    let bob = token(&dir, "bob", "cli", "desktop", "");
    let mut bob_watch = client(
        &dir,
        "bob watch",
        &served,
        &["group", "watch", "--group", "42", "--json", "--token", &bob],
    );
    let first = json(&bob_watch.wait_for(SLACK, "bob's snapshot", |l| l.starts_with('{')));
    assert_eq!(first["members"], 3, "{first}");
    assert_eq!(first["role"], "member", "{first}");
    let online = |n: u32| move |l: &str| l.starts_with('{') && json(l)["online"] == n;
    bob_watch.wait_for(SLACK, "a count of 1", online(1));
    let carol = token(&dir, "carol", "phone", "mobile", "");
    let _carol = client(&dir, "carol", &served, &["connect", "--token", &carol]);
    bob_watch.wait_for(SLACK, "a count of 2", online(2));

    // Alice's watch is an admin's: her own connection is a member coming
    // online, which she sees at once with the count after it.
    let alice = token(&dir, "alice", "laptop", "desktop", "");
    let mut alice_watch = client(
        &dir,
        "alice watch",
        &served,
        &["group", "watch", "--group", "42", "--token", &alice],
    );
    alice_watch.wait_for(SLACK, "alice's snapshot", |l| {
        l.ends_with("of 3 (subscribed as admin)")
    });
    alice_watch.wait_for(SLACK, "alice's own change", |l| {
        l.ends_with("group 42: alice online, 3 online")
    });
    bob_watch.wait_for(SLACK, "a count of 3", online(3));

    // Pages of 2: online members first, then a cursor to the rest. Read
    // from another of bob's devices (the same one would supersede his watch).
    let reader = token(&dir, "bob", "pages", "other", "");
    let page = |extra: &[&str]| {
        let mut args = vec![
            "group", "page", "--token", &reader, "--server", &addr, "--group", "42",
        ];
        args.extend(extra);
        run(&dir, &args)
    };
    let first = page(&["--json"]);
    let lines: Vec<&str> = first.lines().collect();
    assert_eq!(lines.len(), 3, "two entries and a cursor: {first}");
    let next = json(lines[2])["next"]
        .as_str()
        .expect("a cursor")
        .to_owned();
    let rest = page(&["--json", "--after", &next]);
    assert_eq!(rest.lines().count(), 1, "the last entry: {rest}");
    let all = page(&["--json", "--all"]);
    let users: Vec<String> = all
        .lines()
        .map(|l| json(l)["user"].as_str().expect("a user").to_owned())
        .collect();
    let mut sorted = users.clone();
    sorted.sort();
    assert_eq!(sorted, ["alice", "bob", "carol"], "{all}");
    assert_eq!(
        users,
        [&lines[0..2], &rest.lines().collect::<Vec<_>>()[..]]
            .concat()
            .iter()
            .map(|l| json(l)["user"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>(),
        "--all reads the same pages"
    );
    assert!(all.lines().all(|l| json(l)["online"] == true), "{all}");
    let bad = Command::new(BIN)
        .args([
            "group", "page", "--token", &reader, "--server", &addr, "--group", "42",
        ])
        .args(["--after", "sideways:3"])
        .current_dir(&dir)
        .output()
        .expect("greendot runs");
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("bad cursor `sideways:3`"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );

    // A watched page (from a third device of bob's): the first page as
    // above, then a line when a member it lists changes.
    let watcher = token(&dir, "bob", "watched-page", "other", "");
    let mut watched = client(
        &dir,
        "bob's watched page",
        &served,
        &[
            "group", "page", "--watch", "--json", "--group", "42", "--token", &watcher,
        ],
    );
    let mut listed = Vec::new();
    loop {
        let l = json(&watched.wait_for(SLACK, "the watched page", |l| l.starts_with('{')));
        if l["next"].is_string() {
            break;
        }
        listed.push(l["user"].as_str().expect("a user").to_owned());
    }
    assert_eq!(listed, users[0..2], "the first page");
    let member = listed[1].clone();
    let member_token = token(&dir, &member, "status", "desktop", "");
    let _busy = client(
        &dir,
        "busy",
        &served,
        &["connect", "--token", &member_token, "--status", "busy"],
    );
    let change = json(&watched.wait_for(SLACK, "the member's change", |l| {
        l.starts_with('{') && json(l)["user"] == member.as_str() && json(l)["status"] == "busy"
    }));
    assert_eq!(change["group"], 42, "{change}");
    assert_eq!(change["online"], true, "{change}");

    // Bob leaves the group: his watch ends, saying so, and so does his
    // watched page.
    let out = set(&["--members", "admins.txt"]);
    assert_eq!(
        out.trim(),
        "group 42: version 2, 1 members listed, 0 admins"
    );
    bob_watch.wait_for(SLACK, "the end of bob's subscription", |l| {
        l.contains("group 42: the subscription ended")
    });
    assert!(!bob_watch.wait_exit(SLACK).success());
    watched.wait_for(SLACK, "the end of bob's watched page", |l| {
        l.contains("group 42: the watch ended (no longer a member")
    });
    assert!(!watched.wait_exit(SLACK).success());
    // A member token cannot write groups.
    let refused = Command::new(BIN)
        .args([
            "group", "remove", "--token", &reader, "--server", &addr, "--group", "42",
        ])
        .current_dir(&dir)
        .output()
        .expect("greendot runs");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("cannot remove group 42"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let out = run(
        &dir,
        &[
            "group", "remove", "--token", &service, "--server", &addr, "--group", "42",
        ],
    );
    assert_eq!(out.trim(), "group 42: removed");
    alice_watch.wait_for(SLACK, "the end of alice's subscription", |l| {
        l.contains("group 42: the subscription ended")
    });
}

/// Groups are committed before their writes are answered: after `kill -9`
/// of the server right after the answers and a restart on the same data
/// directory, a written group is back with its members and membership
/// version (the next write is version 3, not 1; `group change` expecting 3
/// makes 4, and expecting 3 again is refused clearly), and a removed group
/// stays removed and, written again, goes on above its version.
#[test]
fn a_written_group_survives_kill_9_of_the_server() {
    let dir = temp_dir("bin-group-stored");
    let mut served = serve_with(&dir, "127.0.0.1:0", &[]);
    let addr = served.addr.to_string();
    let service = service_token(&dir);
    std::fs::write(dir.join("two.txt"), "alice\nbob\n").unwrap();
    std::fs::write(dir.join("three.txt"), "alice\nbob\ncarol\n").unwrap();
    std::fs::write(dir.join("admins.txt"), "alice\n").unwrap();
    std::fs::write(dir.join("xena.txt"), "xena\n").unwrap();
    let set = |addr: &str, group: &str, members: &str| {
        group_set(
            &dir,
            addr,
            &service,
            group,
            &["--members", members, "--admins", "admins.txt"],
        )
    };
    let out = set(&addr, "42", "two.txt");
    assert_eq!(
        out.trim(),
        "group 42: version 1, 2 members listed, 1 admins"
    );
    let out = set(&addr, "42", "three.txt");
    assert_eq!(
        out.trim(),
        "group 42: version 2, 3 members listed, 1 admins"
    );
    let out = group_set(&dir, &addr, &service, "43", &["--members", "xena.txt"]);
    assert_eq!(
        out.trim(),
        "group 43: version 1, 1 members listed, 0 admins"
    );
    let out = run(
        &dir,
        &[
            "group", "remove", "--token", &service, "--server", &addr, "--group", "43",
        ],
    );
    assert_eq!(out.trim(), "group 43: removed");
    served.proc.kill9();

    let served = serve_with(&dir, "127.0.0.1:0", &[]);
    let addr = served.addr.to_string();
    let carol = token(&dir, "carol", "cli", "desktop", "");
    let mut watch = client(
        &dir,
        "carol watch",
        &served,
        &[
            "group", "watch", "--group", "42", "--json", "--token", &carol,
        ],
    );
    let snapshot = json(&watch.wait_for(SLACK, "carol's snapshot", |l| l.starts_with('{')));
    assert_eq!(snapshot["members"], 3, "{snapshot}");
    assert_eq!(snapshot["role"], "member", "{snapshot}");
    let out = set(&addr, "42", "two.txt");
    assert_eq!(
        out.trim(),
        "group 42: version 3, 2 members listed, 1 admins",
        "the membership version goes on from the stored one"
    );
    watch.wait_for(SLACK, "the end of carol's subscription", |l| {
        l.contains("group 42: the subscription ended")
    });
    // `group change` goes on from the restored version, and refuses a
    // stale one clearly.
    let change = |extra: &[&str]| {
        let mut args = vec![
            "group", "change", "--token", &service, "--server", &addr, "--group", "42",
        ];
        args.extend(extra);
        Command::new(BIN)
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("greendot runs")
    };
    let out = change(&[
        "--add",
        "dee",
        "--add-admin",
        "bob",
        "--expect-version",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "group 42: version 4"
    );
    let stale = change(&["--remove", "dee", "--expect-version", "3"]);
    assert!(!stale.status.success());
    let said = String::from_utf8_lossy(&stale.stderr);
    assert!(
        said.contains("cannot change group 42: it is not at the expected version")
            && said.contains("version=4"),
        "{said}"
    );
    let nothing = change(&[]);
    assert!(!nothing.status.success());
    assert!(
        String::from_utf8_lossy(&nothing.stderr).contains("nothing to change"),
        "{}",
        String::from_utf8_lossy(&nothing.stderr)
    );
    let xena = token(&dir, "xena", "cli", "desktop", "");
    let refused = Command::new(BIN)
        .args([
            "group", "watch", "--token", &xena, "--server", &addr, "--group", "43",
        ])
        .current_dir(&dir)
        .output()
        .expect("greendot runs");
    assert!(!refused.status.success(), "removed group 43 came back");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("not a member"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // Written again, group 43 goes on above the version it was removed at.
    let out = group_set(&dir, &addr, &service, "43", &["--members", "xena.txt"]);
    assert_eq!(
        out.trim(),
        "group 43: version 2, 1 members listed, 0 admins"
    );
    std::fs::remove_dir_all(&dir).ok();
}
