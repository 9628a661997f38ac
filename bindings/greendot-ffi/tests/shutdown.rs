//! `shutdown` is for the whole process, so it has a test binary of its own.

use greendot_ffi::{connect, shutdown, ConnectConfig, GreendotError};

fn config() -> ConnectConfig {
    ConnectConfig {
        // Refused before any I/O: no address.
        addresses: vec![],
        token: "token".into(),
        ca_certificates_pem: None,
        certificate_sha256: vec![],
        server_name: None,
        foreground: true,
        close_in_background_ms: 10_000,
        websocket_address: None,
        reconnect: None,
        request_timeout_ms: None,
        resume_session: None,
    }
}

#[test]
fn after_shutdown_a_request_fails_closed_and_runs_nothing() {
    let app = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // Before: the request runs on the library's runtime and is refused there.
    let before = app.block_on(connect(config())).map(|_| ());
    assert!(
        matches!(before, Err(GreendotError::Config { .. })),
        "{before:?}"
    );
    shutdown();
    let after = app.block_on(connect(config())).map(|_| ());
    assert!(matches!(after, Err(GreendotError::Closed)), "{after:?}");
    // Twice is safe.
    shutdown();
}
