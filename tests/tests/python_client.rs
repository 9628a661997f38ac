//! The Python binding's suite (clients/python/tests), run from the README's
//! test command: builds greendot-ffi and the workspace's uniffi-bindgen,
//! generates the Python module next to a copy of the library, starts a
//! server (and a UDP relay the suite cuts and restores) and runs the suite
//! with python3. Fails with Python's output when a Python test fails, and
//! when fewer tests ran than the file defines.

use greendot_tests::ffi;
use std::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_suite_passes() {
    let (library, bindgen) = tokio::task::spawn_blocking(ffi::build).await.unwrap();
    let dir = library.parent().unwrap().join("python-bindings");
    ffi::generate(&bindgen, &library, "python", &dir);
    std::fs::copy(&library, dir.join(library.file_name().unwrap())).unwrap();
    let harness = ffi::Harness::start(&dir).await;

    let suite = ffi::workspace().join("clients/python/tests/test_greendot.py");
    let defined = std::fs::read_to_string(&suite)
        .unwrap()
        .matches("    async def test_")
        .count();
    let mut python = Command::new("python3");
    python.arg(&suite).env("GREENDOT_BINDINGS", &dir);
    harness.run_suite("Python", python, defined).await;
}
