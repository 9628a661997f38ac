//! The FFI crate's library and the workspace's `uniffi-bindgen`, for the
//! tests of the generated bindings (python_client.rs, kotlin_client.rs,
//! swift_bindings.rs), and the server the bindings' suites run against.

use crate::{Relay, TestServer};
use greendot_core::Millis;
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The workspace's root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Builds `greendot-ffi` (its cdylib) and `uniffi-bindgen` in this test's
/// own target directory and profile (a no-op once they are up to date);
/// returns (the library, the bindgen binary).
pub fn build() -> (PathBuf, PathBuf) {
    // This test runs as <target>/<profile>/deps/<test>-<hash>.
    let exe = std::env::current_exe().expect("the test's own path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in <target>/<profile>/deps");
    let target = profile_dir.parent().expect("a target directory");
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .current_dir(workspace())
        .args([
            "build",
            "-p",
            "greendot-ffi",
            "-p",
            "greendot-uniffi-bindgen",
        ])
        .arg("--target-dir")
        .arg(target);
    if release {
        cargo.arg("--release");
    }
    // What cargo sets for this test is not the inner build's: ring's build
    // script reruns when CARGO_PKG_NAME changes, which would rebuild the
    // client under it at every run.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_")
            || matches!(
                name.as_ref(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_MANIFEST_LINKS"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            )
        {
            cargo.env_remove(name.as_ref());
        }
    }
    let out = cargo.output().expect("cannot run cargo");
    assert!(
        out.status.success(),
        "cargo build -p greendot-ffi -p greendot-uniffi-bindgen failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let library = profile_dir.join(format!(
        "{}greendot_ffi{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let bindgen = profile_dir.join(format!("uniffi-bindgen{}", std::env::consts::EXE_SUFFIX));
    assert!(library.exists(), "no {}", library.display());
    assert!(bindgen.exists(), "no {}", bindgen.display());
    (library, bindgen)
}

/// Generates `language`'s bindings of `library` into `out` (emptied first),
/// unformatted (the output must not depend on which formatters are
/// installed).
pub fn generate(bindgen: &Path, library: &Path, language: &str, out: &Path) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).expect("cannot create the bindings' directory");
    let run = Command::new(bindgen)
        .current_dir(workspace())
        .args([
            "generate",
            "--no-format",
            "--language",
            language,
            "--out-dir",
        ])
        .arg(out)
        .arg("--library")
        .arg(library)
        .output()
        .expect("cannot run uniffi-bindgen");
    assert!(
        run.status.success(),
        "uniffi-bindgen generate --language {language} failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}

/// What the bindings' suites (clients/python/tests, clients/kotlin/tests)
/// run against: a server with a 1 s debounce (the quick toggle is well
/// inside it on a loaded machine), a UDP relay in front of it that the
/// suite cuts and restores, the server's certificate in a file, and the
/// suites' tokens: "walt" and "wes" (laptops), "svc" (a service token) and
/// one phone per test (three for the group test). Group counts come every
/// 300 ms.
pub struct Harness {
    pub ts: TestServer,
    relay: Arc<Relay>,
    ca: PathBuf,
    tokens: String,
}

/// Far above the suites' own deadlines: only a hung suite hits it.
const WATCHDOG: Duration = Duration::from_secs(300);

impl Harness {
    /// Starts the server and the relay (inside a tokio runtime); writes the
    /// certificate into `dir`.
    pub async fn start(dir: &Path) -> Harness {
        let ts = TestServer::start(|c| {
            c.core.debounce = Millis(1_000);
            c.core.group_interval = Millis(300);
        });
        let ca = dir.join("server-ca.der");
        std::fs::write(&ca, ts.server.certificate().as_ref()).unwrap();
        let relay = Arc::new(Relay::start(ts.addr()).await);
        let mut tokens = vec![
            (
                "walt",
                ts.token("walt", "laptop", Kind::Desktop, WatchClaim::all()),
            ),
            (
                "wes",
                ts.token("wes", "laptop", Kind::Desktop, WatchClaim::all()),
            ),
            ("svc", ts.service_token("backend")),
        ];
        for user in [
            "bea", "cy", "dee", "ed", "fay", "gus", "hal", "ida", "jo", "kai", "lu", "mo",
        ] {
            tokens.push((
                user,
                ts.token(user, "phone", Kind::Mobile, WatchClaim::all()),
            ));
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
        Harness {
            ts,
            relay,
            ca,
            tokens,
        }
    }

    /// Runs `suite` (a command with its arguments) with the suite's
    /// environment, doing what it asks of the relay, and asserts that it
    /// passed, that it ran `defined` tests (its stderr says `Ran N tests`)
    /// and skipped none. Fails with its output otherwise.
    pub async fn run_suite(&self, language: &str, suite: Command, defined: usize) {
        let (status, stdout, stderr) = self.run(suite).await;
        let ran = stderr
            .lines()
            .find_map(|l| l.strip_prefix("Ran "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        assert!(
            status.is_some_and(|s| s.success()),
            "the {language} suite failed ({status:?}):\n{stderr}\n{stdout}"
        );
        assert!(
            defined > 0 && ran == defined,
            "{ran} of {defined} {language} tests ran:\n{stderr}"
        );
        assert!(
            !stderr.contains("skipped"),
            "a {language} test was skipped:\n{stderr}"
        );
    }

    /// Runs `suite` with the suite's environment, doing what it asks of the
    /// relay; returns its exit status (`None` if the watchdog killed it),
    /// its other stdout and its stderr.
    pub async fn run(&self, mut suite: Command) -> (Option<ExitStatus>, String, String) {
        suite
            .env("GREENDOT_ADDRESS", self.ts.addr().to_string())
            .env("GREENDOT_RELAY", self.relay.addr.to_string())
            .env("GREENDOT_CA_DER", &self.ca)
            .env("GREENDOT_TOKENS", &self.tokens)
            .env(
                "GREENDOT_DEBOUNCE_MS",
                self.ts.config().core.debounce.0.to_string(),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let relay = self.relay.clone();
        tokio::task::spawn_blocking(move || run(suite, &relay))
            .await
            .unwrap()
    }
}

/// Runs the suite, doing what it asks of the relay (`@@relay cut|uncut` on
/// its stdout, answered `ok` on its stdin). Returns its exit status (`None`
/// if the watchdog killed it), its other stdout and its stderr.
fn run(mut suite: Command, relay: &Relay) -> (Option<ExitStatus>, String, String) {
    let mut child = suite
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", suite.get_program()));
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
    let deadline = Instant::now() + WATCHDOG;
    let finished = loop {
        let left = deadline.saturating_duration_since(Instant::now());
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
