//! The Python binding's suite (clients/python/tests), run from the README's
//! test command: builds greendot-ffi and the workspace's uniffi-bindgen,
//! generates the Python module next to a copy of the library, starts a
//! server (and a UDP relay the suite cuts and restores) and runs the suite
//! with python3. Fails with Python's output when a Python test fails, and
//! when fewer tests ran than the file defines.

use greendot_core::Millis;
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_tests::{ffi, Relay, TestServer};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Far above the suite's own deadlines: only a hung interpreter hits it.
const WATCHDOG: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_suite_passes() {
    let (library, bindgen) = tokio::task::spawn_blocking(ffi::build).await.unwrap();
    let dir = library.parent().unwrap().join("python-bindings");
    ffi::generate(&bindgen, &library, "python", &dir);
    std::fs::copy(&library, dir.join(library.file_name().unwrap())).unwrap();
    let ca = dir.join("server-ca.der");
    // A debounce long enough that the quick toggle is well inside it on a
    // loaded machine.
    let ts = TestServer::start(|c| c.core.debounce = Millis(1_000));
    std::fs::write(&ca, ts.server.certificate().as_ref()).unwrap();
    let relay = Arc::new(Relay::start(ts.addr()).await);

    let mut tokens = vec![
        (
            "walt".to_owned(),
            ts.token("walt", "laptop", Kind::Desktop, WatchClaim::all()),
        ),
        (
            "wes".to_owned(),
            ts.token("wes", "laptop", Kind::Desktop, WatchClaim::all()),
        ),
        ("svc".to_owned(), ts.service_token("backend")),
    ];
    for user in ["bea", "cy", "dee", "ed", "fay", "gus", "hal", "ida", "jo"] {
        let token = ts.token(user, "phone", Kind::Mobile, WatchClaim::all());
        tokens.push((user.to_owned(), token));
    }
    // Tokens are base64url with dots: no JSON escaping needed.
    let tokens = format!(
        "{{{}}}",
        tokens
            .iter()
            .map(|(name, token)| format!("\"{name}\": \"{token}\""))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let suite = ffi::workspace().join("clients/python/tests/test_greendot.py");
    let defined = std::fs::read_to_string(&suite)
        .unwrap()
        .matches("    async def test_")
        .count();

    let mut python = Command::new("python3");
    python
        .arg(&suite)
        .env("GREENDOT_BINDINGS", &dir)
        .env("GREENDOT_ADDRESS", ts.addr().to_string())
        .env("GREENDOT_RELAY", relay.addr.to_string())
        .env("GREENDOT_CA_DER", &ca)
        .env("GREENDOT_TOKENS", tokens)
        .env(
            "GREENDOT_DEBOUNCE_MS",
            ts.config().core.debounce.0.to_string(),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let (status, stdout, stderr) = tokio::task::spawn_blocking(move || run(python, &relay))
        .await
        .unwrap();

    let ran = stderr
        .lines()
        .find_map(|l| l.strip_prefix("Ran "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0);
    assert!(
        status.is_some_and(|s| s.success()),
        "the Python suite failed ({status:?}):\n{stderr}\n{stdout}"
    );
    assert!(
        defined > 0 && ran == defined,
        "{ran} of {defined} Python tests ran:\n{stderr}"
    );
    assert!(
        !stderr.contains("skipped"),
        "a Python test was skipped:\n{stderr}"
    );
    drop(ts);
}

/// Runs the suite, doing what it asks of the relay (`@@relay cut|uncut` on
/// its stdout, answered `ok` on its stdin). Returns its exit status (`None`
/// if the watchdog killed it), its other stdout and its stderr.
fn run(mut python: Command, relay: &Relay) -> (Option<std::process::ExitStatus>, String, String) {
    let mut child = python.spawn().expect("cannot run python3");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let (cmd_tx, cmd_rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut other = String::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            match line.strip_prefix("@@relay ") {
                Some(cmd) => {
                    let _ = cmd_tx.send(cmd.to_owned());
                }
                None => {
                    other.push_str(&line);
                    other.push('\n');
                }
            }
        }
        other
    });
    // The relay is driven from here; the reader's end (the suite closed its
    // stdout: it exited) ends the loop.
    let deadline = std::time::Instant::now() + WATCHDOG;
    let finished = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match cmd_rx.recv_timeout(left) {
            Ok(cmd) => {
                match cmd.as_str() {
                    "cut" => relay.cut(true),
                    "uncut" => relay.cut(false),
                    other => panic!("the suite asked the relay for {other:?}"),
                }
                let _ = stdin.write_all(b"ok\n").and_then(|()| stdin.flush());
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break true,
            Err(mpsc::RecvTimeoutError::Timeout) => break false,
        }
    };
    if !finished {
        let _ = child.kill();
    }
    drop(stdin);
    let status = child.wait().ok().filter(|_| finished);
    let other = reader.join().unwrap_or_default();
    let errors = errors.join().unwrap_or_default();
    (status, other, errors)
}
