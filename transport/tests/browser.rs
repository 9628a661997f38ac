//! Browsers against the real `greendot serve`, in headless Chromium
//! (Debian's `chromium`, installed here with apt-get when missing) driven by
//! puppeteer-core from `clients/typescript` (`npm ci`, pinned; no browser
//! download):
//!
//! - the page (`http://HTTP/`): it connects by WebTransport (the dev
//!   certificate's hash from `/page.json`) as a dev-token user watching
//!   alice; a native client (the Rust client library over QUIC) brings alice
//!   online, changes her status, goes invisible, comes back and logs out, and
//!   the page's row shows each change; its group panel (bob an admin of a
//!   group written with `greendot group set`) shows the count, alice's
//!   changes as they come, and the member list in pages of 2, the page
//!   shown watched so that alice's changes update it in place; screenshots
//!   are saved under `CARGO_TARGET_TMPDIR/browser-page/`;
//! - the TypeScript client's suite against the same kind of server
//!   (`clients/typescript/e2e/real-server.test.ts`): in Node over WebSocket,
//!   in Chromium over WebTransport, Chromium's fallback to WebSocket, and
//!   groups in Node.

use greendot_client::rustls::pki_types::pem::PemObject;
use greendot_client::rustls::pki_types::CertificateDer;
use greendot_client::{Client, ClientConfig};
use greendot_core::Status;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_greendot");
const CHROMIUM: &str = "/usr/bin/chromium";
/// Room for a loaded 2-core machine (a browser start included).
const SLACK: Duration = Duration::from_secs(30);

fn ts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/typescript")
}

fn sh(what: &str, command: &mut Command) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Chromium, the pinned npm packages and the compiled TypeScript, once per
/// test process (the tests here share them).
fn prepare() {
    static DONE: Mutex<bool> = Mutex::new(false);
    let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
    if *done {
        return;
    }
    if !Path::new(CHROMIUM).exists() {
        sh(
            "apt-get update",
            Command::new("apt-get").args(["update", "-q"]),
        );
        sh(
            "apt-get install chromium",
            Command::new("apt-get")
                .args(["install", "-y", "-q", "chromium"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        );
    }
    sh(
        "npm ci",
        Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(ts_dir())
            .env("PUPPETEER_SKIP_DOWNLOAD", "1"),
    );
    sh(
        "tsc",
        Command::new("npx")
            .args(["tsc", "-p", "."])
            .current_dir(ts_dir()),
    );
    *done = true;
}

mod support;
use support::{temp_dir, Proc};

struct Served {
    /// `greendot serve`, logging every connection's start and end (its
    /// lines are shown when a test fails).
    proc: Proc,
    dir: PathBuf,
    quic: SocketAddr,
    websocket: String,
    /// The page's address as `serve` printed it, with the dev code.
    page_url: String,
    hash: String,
}

fn after<'a>(line: &'a str, prefix: &str) -> &'a str {
    line.trim_start_matches(prefix)
        .split_whitespace()
        .next()
        .unwrap_or_else(|| panic!("nothing after {prefix:?} in {line:?}"))
}

/// `greendot serve` on free ports (QUIC, WebSocket, HTTP) in a new data
/// directory, with a short debounce and group interval, and member pages
/// of at most 2 (so that 3 members take two pages).
fn serve(name: &str) -> Served {
    let dir = temp_dir(name);
    let mut command = Command::new(BIN);
    command
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
            "--debounce",
            "100ms",
            "--grace",
            "2s",
            "--group-interval",
            "200ms",
            "--group-page-size",
            "2",
        ])
        .current_dir(&dir)
        .env("RUST_LOG", "info,greendot::connections=debug");
    let mut proc = Proc::spawn("serve", {
        command.stdin(Stdio::piped());
        command
    });
    let line = proc.wait_for(SLACK, "listening", |l| {
        l.starts_with("greendot listening on ")
    });
    let quic = after(&line, "greendot listening on ")
        .parse()
        .expect("addr");
    let line = proc.wait_for(SLACK, "WebSocket", |l| l.starts_with("WebSocket on wss://"));
    let websocket = after(&line, "WebSocket on ").to_owned();
    let line = proc.wait_for(SLACK, "hash", |l| {
        l.starts_with("WebTransport serverCertificateHashes sha-256: ")
    });
    let hash = after(&line, "WebTransport serverCertificateHashes sha-256: ").to_owned();
    let line = proc.wait_for(SLACK, "page", |l| l.starts_with("page on http://"));
    let page_url = after(&line, "page on ").to_owned();
    assert!(page_url.contains("/#dev="), "no dev code in {page_url}");
    proc.wait_for(SLACK, "dev tokens", |l| l.starts_with("dev tokens on "));
    Served {
        proc,
        dir,
        quic,
        websocket,
        page_url,
        hash,
    }
}

fn token(served: &Served, user: &str, device: &str, kind: &str, watch: &str) -> String {
    let out = Command::new(BIN)
        .args([
            "token", "--user", user, "--device", device, "--kind", kind, "--ttl", "1h", "--watch",
            watch,
        ])
        .current_dir(&served.dir)
        .output()
        .expect("greendot token");
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned()
}

/// A service token (it may write groups).
fn service_token(served: &Served) -> String {
    let out = Command::new(BIN)
        .args([
            "token",
            "--user",
            "backend",
            "--device",
            "cli",
            "--ttl",
            "1h",
            "--service",
        ])
        .current_dir(&served.dir)
        .output()
        .expect("greendot token --service");
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned()
}

/// `greendot group set` as the page's hint says, from files in the data
/// directory's parent.
fn group_set(served: &Served, group: u64, members: &[&str], admins: &[&str]) {
    std::fs::write(served.dir.join("members.txt"), members.join("\n")).expect("members.txt");
    std::fs::write(served.dir.join("admins.txt"), admins.join("\n")).expect("admins.txt");
    let out = Command::new(BIN)
        .args([
            "group",
            "set",
            "--server",
            &served.quic.to_string(),
            "--group",
        ])
        .arg(group.to_string())
        .args([
            "--members",
            "members.txt",
            "--admins",
            "admins.txt",
            "--token",
        ])
        .arg(service_token(served))
        .current_dir(&served.dir)
        .output()
        .expect("greendot group set");
    assert!(
        out.status.success(),
        "greendot group set: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Tells the page driver to do `cmd` (see e2e/page-driver.ts); returns its
/// answer, failing the test if the page did not show it.
fn step(page: &mut Proc, name: &str, mut cmd: serde_json::Value) -> serde_json::Value {
    cmd["name"] = name.into();
    page.send(&cmd.to_string());
    let line = page.wait_for(SLACK, name, |l| {
        l.starts_with('{') && (l.contains("\"ok\":") || l.contains("\"fail\":"))
    });
    let answer = json(&line);
    assert_eq!(
        answer["ok"],
        name,
        "the page did not show {name}: {answer:#}\n{}",
        page.seen.join("\n")
    );
    answer
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
}

/// Tells the page driver what alice's row (and the operator view) must
/// show next; returns its answer.
fn expect(
    page: &mut Proc,
    name: &str,
    row: serde_json::Value,
    operator: Option<serde_json::Value>,
) -> serde_json::Value {
    let mut cmd = serde_json::json!({ "expect": row });
    if let Some(op) = operator {
        cmd["operator"] = op;
    }
    step(page, name, cmd)
}

fn screenshots() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("browser-page");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    dir
}

#[test]
fn the_page_shows_a_native_clients_changes_live_in_chromium() {
    prepare();
    let served = serve("page");
    let shots = screenshots();
    let mut command = Command::new("node");
    command
        .arg("dist/e2e/page-driver.js")
        .current_dir(ts_dir())
        .env("GREENDOT_PAGE_URL", &served.page_url)
        .env("GREENDOT_SCREENSHOTS", &shots)
        .env("GREENDOT_PAGE_USER", "bob")
        .env("GREENDOT_WATCH", "alice");
    let mut page = Proc::spawn("page driver", {
        command.stdin(Stdio::piped());
        command
    });
    let ready = json(&page.wait_for(SLACK, "ready", |l| l.starts_with("{\"ready\"")));
    assert_eq!(
        ready["state"]["binding"], "webtransport",
        "the page connects by WebTransport: {ready}"
    );
    expect(
        &mut page,
        "1-alice-never-seen",
        serde_json::json!({ "online": "false", "lastSeen": "" }),
        None,
    );
    // The group panel: bob (the page) is an admin of group 42; only he is online.
    group_set(&served, 42, &["alice", "carol"], &["bob"]);
    step(
        &mut page,
        "1-group-subscribed",
        serde_json::json!({
            "group": "42",
            "groupState": { "group": "42", "role": "admin", "count": "1", "members": "3", "ended": "false" },
        }),
    );

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let roots: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(served.dir.join("greendot-data/cert.pem"))
            .and_then(|i| i.collect())
            .expect("cert.pem");
    let alice_token = token(&served, "alice", "phone", "mobile", "alice");
    let (alice, _updates) = rt
        .block_on(Client::connect(ClientConfig::new(
            served.quic,
            roots,
            alice_token,
        )))
        .expect("alice connects over QUIC");

    // Online: bob (the page, over WebTransport) and alice (raw QUIC), each
    // counted under its binding.
    expect(
        &mut page,
        "2-alice-online",
        serde_json::json!({ "online": "true", "status": "available", "devices": "mobile" }),
        Some(
            serde_json::json!({ "op-users": "2", "op-quic": "1", "op-webtransport": "1", "op-websocket": "0" }),
        ),
    );
    // The admin sees alice's change as it comes, and the count after it.
    step(
        &mut page,
        "2-group-alice-online",
        serde_json::json!({
            "groupChange": { "member": "alice", "online": "true" },
            "groupState": { "count": "2", "members": "3" },
        }),
    );
    // The member list in pages of 2 (the server's cap here): online first;
    // then back on the first page, which the panel watches.
    let listed = step(
        &mut page,
        "2-group-members",
        serde_json::json!({ "group": "42", "allMembers": true, "firstPage": true }),
    );
    let members = listed["members"].as_array().expect("members");
    let mut online: Vec<&str> = members
        .iter()
        .filter(|m| m[1] == "true")
        .map(|m| m[0].as_str().unwrap_or(""))
        .collect();
    online.sort_unstable();
    assert_eq!(online, ["alice", "bob"], "{listed}");
    assert_eq!(members.len(), 3, "{listed}");
    assert_eq!(members[2][0], "carol", "online first: {listed}");
    assert!(
        listed["group"]["text"]
            .as_str()
            .is_some_and(|t| t.contains("2 of 3 online")),
        "{listed}"
    );
    rt.block_on(alice.set_status(Status::Busy, Some("in a meeting")))
        .expect("status");
    expect(
        &mut page,
        "3-alice-busy",
        serde_json::json!({ "online": "true", "status": "busy", "message": "in a meeting" }),
        None,
    );
    // The watched page shows it too, without being read again.
    let busy = step(
        &mut page,
        "3-group-member-alice-busy",
        serde_json::json!({ "groupMember": { "user": "alice", "online": "true", "status": "busy" } }),
    );
    assert_eq!(busy["group"]["state"]["watched"], "true", "{busy}");
    rt.block_on(alice.set_invisible(true)).expect("invisible");
    let hidden = expect(
        &mut page,
        "4-alice-invisible",
        serde_json::json!({ "online": "false", "devices": "", "invisible": "false" }),
        None,
    );
    let frozen = hidden["row"]["data"]["lastSeen"]
        .as_str()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("an invisible user shows a last seen: {hidden}"));
    rt.block_on(alice.set_invisible(false)).expect("visible");
    expect(
        &mut page,
        "5-alice-visible-again",
        serde_json::json!({ "online": "true", "status": "busy", "lastSeen": "" }),
        None,
    );
    rt.block_on(alice.logout()).expect("logout");
    let out = expect(
        &mut page,
        "6-alice-logged-out",
        serde_json::json!({ "online": "false", "devices": "" }),
        Some(serde_json::json!({ "op-users": "1", "op-quic": "0", "op-webtransport": "1" })),
    );
    step(
        &mut page,
        "6-group-alice-offline",
        serde_json::json!({
            "groupChange": { "member": "alice", "online": "false" },
            "groupState": { "count": "1" },
            "groupMember": { "user": "alice", "online": "false" },
        }),
    );
    let seen = out["row"]["data"]["lastSeen"]
        .as_str()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("a logged-out user shows a last seen: {out}"));
    assert!(seen >= frozen, "last seen {seen} before {frozen}");
    let text = out["row"]["text"].as_str().unwrap_or("");
    assert!(
        text.contains("offline") && text.contains("last seen"),
        "{text}"
    );
    let push_count: u64 = out["operator"]["op-pushes"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(
        push_count >= 4,
        "the latency histogram counts pushes: {out}"
    );

    page.send("{\"quit\":true}");
    let status = page.wait_exit(SLACK);
    assert!(
        status.success(),
        "page driver: {status}\n{}",
        page.seen.join("\n")
    );
    println!(
        "screenshots of the page: {}/*.png (last: {})",
        shots.display(),
        out["screenshot"]
    );
    drop(rt);
    std::fs::remove_dir_all(&served.dir).ok();
}

#[test]
fn the_typescript_client_works_against_greendot_serve_in_node_and_chromium() {
    prepare();
    let served = serve("ts");
    let mut command = Command::new("node");
    command
        .args(["--test", "dist/e2e/real-server.test.js"])
        .current_dir(ts_dir())
        .env("GREENDOT_PAGE_URL", &served.page_url)
        .env("GREENDOT_WS_URL", &served.websocket)
        .env(
            "GREENDOT_WT_URL",
            format!("https://{}/greendot", served.quic),
        )
        .env("GREENDOT_CERT_HASH", &served.hash)
        // Chromium's network log, summed up by the suite when a browser
        // test fails (how a QUIC or WebTransport session ended).
        .env("GREENDOT_NETLOG_DIR", &served.dir)
        .env("GREENDOT_CA", served.dir.join("greendot-data/cert.pem"))
        .env(
            "GREENDOT_TOKEN_AL",
            token(&served, "al", "laptop", "desktop", "bob"),
        )
        .env(
            "GREENDOT_TOKEN_AL_BROWSER",
            token(&served, "al", "browser", "web", "bob"),
        )
        .env(
            "GREENDOT_TOKEN_BOB",
            token(&served, "bob", "phone", "mobile", "al"),
        )
        .env(
            "GREENDOT_TOKEN_CAROL",
            token(&served, "carol", "laptop", "desktop", "carol"),
        )
        .env("GREENDOT_TOKEN_SERVICE", service_token(&served));
    let mut node = Proc::spawn("node --test", {
        command.stdin(Stdio::piped());
        command
    });
    let status = node.wait_exit(Duration::from_secs(90));
    let out = node.seen.join("\n");
    let mut served = served;
    served.proc.drain();
    assert!(
        status.success(),
        "the TypeScript e2e suite failed:\n{out}\n\nthe server said:\n{}",
        served.proc.seen.join("\n")
    );
    let passed = node
        .seen
        .iter()
        .find_map(|l| l.trim().strip_prefix("# pass "))
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or(0);
    // Node over WebSocket, Chromium over WebTransport, Chromium's fallback, groups.
    assert!(passed >= 4, "too few e2e tests ran:\n{out}");
    assert!(out.contains("# fail 0"), "{out}");
    for line in node
        .seen
        .iter()
        .filter(|l| l.starts_with("ok ") || l.starts_with("# "))
    {
        println!("{line}");
    }
    std::fs::remove_dir_all(&served.dir).ok();
}
