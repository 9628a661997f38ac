//! The client library across an outage: a reconnect resumes the TLS session
//! (no certificate check, no certificate signature on the server), a request
//! that timed out before it was sent never takes effect later, retrying
//! set_status / set_invisible after a timeout converges, and a server's
//! `retry_ms` spreads the reconnects.
//!
//! The outage is a UDP relay between client and server that can drop every
//! datagram, as a dead network would.

use greendot_client::rustls::{
    self,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    client::WebPkiServerVerifier,
    pki_types::{CertificateDer, ServerName, UnixTime},
    DigitallySignedStruct, SignatureScheme,
};
use greendot_client::{ClientConfig, ClientError, Event};
use greendot_core::Status;
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_tests::{Relay, TestServer, SLACK};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The usual certificate check, counted: a resumed TLS 1.3 handshake sends
/// no certificate, so nothing is checked.
#[derive(Debug)]
struct CountingVerifier {
    inner: Arc<WebPkiServerVerifier>,
    checks: Arc<AtomicUsize>,
}

impl ServerCertVerifier for CountingVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        self.inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A client of `user` through `relay`, with short request and connect
/// timeouts.
fn via_relay(ts: &TestServer, relay: &Relay, user: &str) -> ClientConfig {
    let mut config = ts.client_config(ts.token(user, "phone", Kind::Mobile, WatchClaim::all()));
    config.servers = vec![relay.addr.into()];
    config.request_timeout = Duration::from_millis(500);
    config.connect_timeout = Duration::from_secs(3);
    config
}

/// What `client` is shown as to itself; a query that times out (the
/// relay just healed, retransmissions pending) is simply asked again.
async fn shown_to_self(client: &greendot_client::Client) -> greendot_core::Presence {
    let deadline = tokio::time::Instant::now() + SLACK;
    loop {
        match client.query(&client.user()).await {
            Ok(p) => return p,
            Err(ClientError::OutcomeUnknown { .. } | ClientError::NotSent)
                if tokio::time::Instant::now() < deadline => {}
            Err(e) => panic!("query: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_resumes_the_tls_session() {
    let ts = TestServer::start(|_| {});
    let relay = Relay::start(ts.addr()).await;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ts.server.certificate().clone()).unwrap();
    let checks = Arc::new(AtomicUsize::new(0));
    let verifier = CountingVerifier {
        inner: WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .unwrap(),
        checks: checks.clone(),
    };
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    let mut config = via_relay(&ts, &relay, "tess");
    config.tls = Some(Arc::new(tls));
    let (client, mut events) = ts.connect_with(config).await;
    client.ping().await.unwrap();
    assert_eq!(
        checks.load(Ordering::SeqCst),
        1,
        "the first handshake is full"
    );

    // The network dies: the client notices (idle timeout), then it is back.
    relay.cut(true);
    let idle = ts.config().idle_timeout;
    events
        .wait_for(idle + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("the client notices the dead network");
    relay.cut(false);
    let (_, event) = events
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("the client reconnects");
    assert!(
        matches!(event, Event::Reconnected { resumed: true, .. }),
        "{event:?}"
    );
    client.ping().await.unwrap();
    // Resumed TLS: the server sent no certificate, so none was checked (and
    // the server signed nothing).
    assert_eq!(
        checks.load(Ordering::SeqCst),
        1,
        "the reconnect made a full TLS handshake"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_request_is_never_sent_late_and_retries_converge() {
    let ts = TestServer::start(|_| {});
    let relay = Relay::start(ts.addr()).await;
    let (client, mut events) = ts.connect_with(via_relay(&ts, &relay, "rita")).await;
    let idle = ts.config().idle_timeout;

    // 1. Sent, then the network died: the outcome is unknown to the caller
    //    (not a failure), and the change may still take effect (QUIC
    //    retransmits it) when the network is back before the connection is
    //    declared lost.
    relay.cut(true);
    let sent = client.set_status(Status::Busy, Some("sent")).await;
    assert!(
        matches!(sent, Err(ClientError::OutcomeUnknown { lost: None })),
        "{sent:?}"
    );
    relay.cut(false);
    let me = shown_to_self(&client).await;
    assert_eq!(me.status, Status::Busy, "{me:?}");

    // 2. Asked while the client was reconnecting, and given up on: never
    //    sent, never in effect, even after the client is back.
    relay.cut(true);
    events
        .wait_for(idle + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("the client notices the dead network");
    let unsent = client.set_status(Status::Away, Some("unsent")).await;
    assert!(matches!(unsent, Err(ClientError::NotSent)), "{unsent:?}");
    let invisible = client.set_invisible(true).await;
    assert!(
        matches!(invisible, Err(ClientError::NotSent)),
        "{invisible:?}"
    );
    relay.cut(false);
    events
        .wait_for(SLACK, |e| matches!(e, Event::Reconnected { .. }))
        .await
        .expect("the client reconnects");
    // Requests are answered in order: had the abandoned ones been sent on
    // the new connection, this query would see them.
    let me = shown_to_self(&client).await;
    assert_eq!(
        (me.status, me.message.as_deref(), me.invisible),
        (Status::Busy, Some("sent"), false),
        "{me:?}"
    );

    // 3. Retrying converges: the retry takes effect once, and a second
    //    retry of the same values changes nothing (same version).
    client
        .set_status(Status::Away, Some("retried"))
        .await
        .unwrap();
    client.set_invisible(true).await.unwrap();
    let once = shown_to_self(&client).await;
    assert_eq!(
        (once.status, once.message.as_deref(), once.invisible),
        (Status::Away, Some("retried"), true)
    );
    client
        .set_status(Status::Away, Some("retried"))
        .await
        .unwrap();
    client.set_invisible(true).await.unwrap();
    let twice = shown_to_self(&client).await;
    assert_eq!(twice, once, "a repeated value changed what is shown");
}

/// A status sent just before the connection was lost, with a deadline
/// longer than the outage, is sent again on the next connection: the
/// call succeeds, and the status is in effect (before, it failed with the
/// lost connection's error though it might have taken effect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_sent_into_an_outage_is_sent_again_after_the_reconnect() {
    let ts = TestServer::start(|_| {});
    let relay = Relay::start(ts.addr()).await;
    let mut config = via_relay(&ts, &relay, "olga");
    config.request_timeout = Duration::from_secs(30);
    let (client, mut events) = ts.connect_with(config).await;
    client.ping().await.unwrap();

    relay.cut(true);
    let call = {
        let client = client.clone();
        tokio::spawn(async move { client.set_status(Status::Busy, Some("outage")).await })
    };
    let idle = ts.config().idle_timeout;
    events
        .wait_for(idle + SLACK, |e| matches!(e, Event::Disconnected { .. }))
        .await
        .expect("the client notices the dead network");
    assert!(!call.is_finished(), "the call waits for the path");
    relay.cut(false);
    let answered = tokio::time::timeout(SLACK + SLACK, call)
        .await
        .expect("answered once the path is back")
        .unwrap();
    assert!(answered.is_ok(), "{answered:?}");
    let me = shown_to_self(&client).await;
    assert_eq!(
        (me.status, me.message.as_deref()),
        (Status::Busy, Some("outage"))
    );
}

/// A close reason's `retry_ms` spreads the reconnects: each client waits a
/// random delay in `[0, retry_ms]`, not its own short backoff. A fake server
/// welcomes 20 clients, closes them all with `Draining` and `retry_ms=3000`,
/// and times their returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_spread_their_reconnects_over_the_servers_retry_ms() {
    use greendot_client::quinn;
    use greendot_client::Client;
    use greendot_proto::{self as proto, encode_frame, CloseCode, Hello, ServerFrame, Welcome};
    use greendot_server::tls::{self, Identity};
    use tokio::time::Instant;

    const CLIENTS: usize = 20;
    let retry = Duration::from_millis(3000);
    let identity = Identity::self_signed(&["localhost"]).unwrap();
    let crypto = tls::server_crypto(&identity, b"test ticket secret").unwrap();
    let server = quinn::Endpoint::server(
        quinn::ServerConfig::with_crypto(Arc::new(crypto)),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    // (closed at, back at) per client, in the order they first came.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, bool, Instant)>();
    let reason = format!(
        "server draining: reconnect and resume retry_ms={}",
        retry.as_millis()
    );
    let accept = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(incoming) = server.accept().await {
            let Ok(conn) = incoming.await else { continue };
            let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                continue;
            };
            let mut reader = proto::FrameReader::new(1 << 16);
            let Ok(Some(payload)) = proto::codec::read_frame(&mut recv, &mut reader).await else {
                continue;
            };
            let hello: Hello = proto::decode(&payload).unwrap();
            let session = hello.resume.unwrap_or(held.len() as u64 + 1);
            let welcome = ServerFrame::Welcome(Welcome {
                version: proto::VERSION,
                session,
                resumed: hello.resume.is_some(),
                user: "u".into(),
                device: "d".into(),
                snapshots: Vec::new(),
                max_frame: proto::DEFAULT_MAX_FRAME as u32,
            });
            send.write_all(&encode_frame(&welcome).unwrap())
                .await
                .unwrap();
            if hello.resume.is_none() {
                // After the welcome is out: a close discards unsent data.
                let (conn, reason, tx) = (conn.clone(), reason.clone(), tx.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    conn.close(CloseCode::Draining.varint(), reason.as_bytes());
                    let _ = tx.send((session, false, Instant::now()));
                });
            } else {
                let _ = tx.send((session, true, Instant::now()));
            }
            held.push((conn, send, recv));
        }
    });

    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        // One at a time: the fake server answers hellos one by one.
        let mut config = ClientConfig::new(addr, identity.certs.clone(), "token");
        config.bind = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        config.reconnect = Some(greendot_client::Reconnect::new(
            Duration::from_millis(50),
            Duration::from_millis(400),
            Some(Duration::from_secs(30)),
        ));
        clients.push(Client::connect(config).await.unwrap());
    }
    let mut closed = std::collections::HashMap::new();
    let mut delays = Vec::new();
    let deadline = Instant::now() + retry + SLACK;
    while delays.len() < CLIENTS {
        let Ok(Some((session, back, at))) = tokio::time::timeout_at(deadline, rx.recv()).await
        else {
            panic!("only {} of {CLIENTS} came back: {delays:?}", delays.len());
        };
        if back {
            delays.push(at - closed[&session]);
        } else {
            closed.insert(session, at);
        }
    }
    accept.abort();
    let longest = delays.iter().max().unwrap();
    // Within the hint (plus a handshake on a loaded machine)...
    assert!(*longest <= retry + SLACK, "{delays:?}");
    // ... and spread over it: with only the clients' own 50 ms backoff all
    // would be back in well under 600 ms; uniform in [0, 3 s], 20 clients
    // all under 600 ms has a chance of 0.2^20.
    assert!(*longest > Duration::from_millis(600), "{delays:?}");
}
