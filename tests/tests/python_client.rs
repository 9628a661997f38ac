//! The Python binding's suite (clients/python/tests), run from the README's
//! test command: builds greendot-ffi and the workspace's uniffi-bindgen,
//! generates the Python module next to a copy of the library, starts a
//! server (and a UDP relay the suite cuts and restores) and runs the suite
//! with python3. Fails with Python's output when a Python test fails, and
//! when fewer tests ran than the file defines.

use greendot_server::ServerEvent;
use greendot_tests::ffi;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The Python module and a copy of the library in `<target>/<profile>/<name>`
/// (one directory per test: they run at once), and a server for them.
async fn python_bindings(name: &str) -> (PathBuf, ffi::Harness) {
    let (library, bindgen) = tokio::task::spawn_blocking(ffi::build).await.unwrap();
    let dir = library.parent().unwrap().join(name);
    ffi::generate(&bindgen, &library, "python", &dir);
    std::fs::copy(&library, dir.join(library.file_name().unwrap())).unwrap();
    let harness = ffi::Harness::start(&dir).await;
    (dir, harness)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_suite_passes() {
    let (dir, harness) = python_bindings("python-bindings").await;
    let suite = ffi::workspace().join("clients/python/tests/test_greendot.py");
    let defined = std::fs::read_to_string(&suite)
        .unwrap()
        .matches("    async def test_")
        .count();
    let mut python = Command::new("python3");
    python.arg(&suite).env("GREENDOT_BINDINGS", &dir);
    harness.run_suite("Python", python, defined).await;
}

/// An app's interpreter exits while a thread of the library's is in
/// Python: the runtime's (the continuation waking an async call's
/// coroutine) or a listener's (`on_event`). With `shutdown` registered with
/// `atexit` the process exits with 0; without it (the broken variant) the
/// thread is ended under the library and the process aborts after the test
/// passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_interpreter_exits_cleanly_while_the_library_calls_into_it() {
    let (dir, harness) = python_bindings("python-exit-bindings").await;
    let script = ffi::workspace().join("clients/python/tests/exit_while_called.py");
    for case in [
        "test_a_call_completes_as_the_interpreter_exits",
        "test_a_listener_runs_as_the_interpreter_exits",
    ] {
        for registered in [true, false] {
            let mut python = Command::new("python3");
            python
                .arg(&script)
                .arg(format!("ExitTest.{case}"))
                .env("GREENDOT_BINDINGS", &dir);
            if !registered {
                python.env("GREENDOT_EXIT_WITHOUT_SHUTDOWN", "1");
            }
            let (status, stdout, stderr) = harness.run(python).await;
            assert!(
                stderr.contains("Ran 1 test") && stderr.contains("\nOK"),
                "{case} failed before the exit ({status:?}):\n{stderr}\n{stdout}"
            );
            assert_eq!(
                status.is_some_and(|s| s.success()),
                registered,
                "{case}, shutdown registered: {registered}; exit status {status:?}:\n{stderr}"
            );
        }
    }
}

/// A client the app never closed: `shutdown` at the exit closes it, so the
/// server hears the client's close at once. Without `shutdown` (the broken
/// variant) the server finds the silence at its idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exit_closes_every_client_the_app_left_open() {
    let (dir, harness) = python_bindings("python-close-bindings").await;
    let script = ffi::workspace().join("clients/python/tests/exit_while_called.py");
    for registered in [true, false] {
        let mut events = harness.ts.server.events();
        let mut python = Command::new("python3");
        python
            .arg(&script)
            .arg("ExitTest.test_a_client_left_open_at_the_exit")
            .env("GREENDOT_BINDINGS", &dir);
        if !registered {
            python.env("GREENDOT_EXIT_WITHOUT_SHUTDOWN", "1");
        }
        let (status, _, stderr) = harness.run(python).await;
        assert!(status.is_some_and(|s| s.success()), "{status:?}:\n{stderr}");
        let reason = tokio::time::timeout(Duration::from_secs(10), async {
            let mut session = None;
            loop {
                match events.recv().await.expect("the server's events") {
                    ServerEvent::Connected {
                        session: s, user, ..
                    } if user == "cy" => {
                        session = Some(s);
                    }
                    ServerEvent::Closed {
                        session: Some(s),
                        reason,
                        ..
                    } if Some(s) == session => return reason,
                    _ => {}
                }
            }
        })
        .await
        .expect("the server never heard cy's connection end");
        // Without it the connection times out, or, if the process lives
        // long enough after the client is freed, ends with the drop's close.
        assert_eq!(
            reason.contains("closed by the application"),
            registered,
            "shutdown registered: {registered}; the connection ended with {reason:?}"
        );
    }
}
