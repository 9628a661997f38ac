//! The driver's pass structure, run by hand on a real socket.

use super::*;
use crate::state::Pacer;
use crate::{PassBudget, Server, ServerConfig};
use greendot_client::tls;
use greendot_proto::ALPN;
use quinn_proto::Endpoint;
use std::net::SocketAddr;

/// A server built but not running, on a loopback port.
fn built(pass: PassBudget) -> super::super::Built {
    built_on("127.0.0.1:0", pass)
}

fn built_on(listen: &str, pass: PassBudget) -> super::super::Built {
    let mut config = ServerConfig::new(b"secret".to_vec());
    config.listen = listen.parse().unwrap();
    config.pass = pass;
    Server::build(config).unwrap()
}

/// A QUIC client's first datagram (an Initial) to `server`.
fn client_initial(
    server: SocketAddr,
    cert: &rustls::pki_types::CertificateDer<'static>,
) -> Vec<u8> {
    let mut client = Endpoint::new(
        Arc::new(quinn_proto::EndpointConfig::default()),
        None,
        false,
        None,
    );
    let crypto = tls::client_crypto(std::slice::from_ref(cert), ALPN).unwrap();
    let config = quinn_proto::ClientConfig::new(Arc::new(crypto));
    let (_, mut conn) = client
        .connect(std::time::Instant::now(), config, server, "localhost")
        .unwrap();
    let mut buf = Vec::new();
    let t = conn
        .poll_transmit(std::time::Instant::now(), 1, &mut buf)
        .unwrap();
    buf.truncate(t.size);
    buf
}

#[tokio::test]
async fn a_pass_reads_the_socket_while_thousands_of_timers_are_due() {
    const TIMERS: usize = 5000;
    // Timer slots past any connection's.
    const FAKE: usize = 100_000;
    const NOISE: usize = 300;
    let budget = PassBudget {
        datagrams: 1024,
        timers: 16,
        connections: 16,
    };
    let built = built(budget);
    let server = built.local_addr;
    let mut driver = built.driver;
    // Thousands of due timers: the scheduler handles them as any
    // connection's (these name no live connection, so each costs little,
    // but each counts against the budget).
    let due = Instant::now();
    for i in 0..TIMERS {
        driver.state.timers.set(FAKE + i, Some(due));
    }
    // A backlog: datagrams the endpoint drops, then a real client's Initial.
    let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..NOISE {
        client.send_to(&[0u8], server).unwrap();
    }
    client
        .send_to(&client_initial(server, &built.certificate), server)
        .unwrap();
    driver.io.socket.readable().await.unwrap();

    let read = driver.pass(Instant::now());

    // Everything waiting was read in the one pass, the Initial answered...
    assert_eq!(read, NOISE + 1, "the pass did not read the whole backlog");
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 2048];
    let (n, from) = client
        .recv_from(&mut buf)
        .expect("the Initial was not answered in the pass that read it");
    assert_eq!(from, server);
    assert!(n >= 1200, "an Initial's answer is padded, got {n} bytes");
    // ...and only the pass's share of the timers handled: the rest is carried.
    let fake = |d: &Driver| d.state.timers.iter().filter(|(ch, _)| *ch >= FAKE).count();
    assert_eq!(fake(&driver), TIMERS - budget.timers);
    assert!(driver.state.has_carried_work(Instant::now()));
    // Carried, never skipped: later passes handle every one.
    let mut passes = 0;
    while fake(&driver) > 0 {
        driver.pass(Instant::now());
        passes += 1;
        assert!(passes <= TIMERS, "due timers are never handled");
    }
    assert_eq!(passes, (TIMERS - budget.timers).div_ceil(budget.timers));
}

#[tokio::test]
async fn a_pass_drives_at_most_its_budget_of_connections() {
    let budget = PassBudget {
        datagrams: 1024,
        timers: 1024,
        connections: 4,
    };
    let built = built(budget);
    let server = built.local_addr;
    let mut driver = built.driver;
    // Ten clients' Initials: ten new connections, each touched once.
    let clients: Vec<_> = (0..10)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    for client in &clients {
        client
            .send_to(&client_initial(server, &built.certificate), server)
            .unwrap();
    }
    driver.io.socket.readable().await.unwrap();
    assert_eq!(driver.pass(Instant::now()), 10);
    assert_eq!(driver.state.touched.len(), 10 - budget.connections);
    // The rest are driven by the next passes, oldest first: every client
    // gets its answer.
    driver.pass(Instant::now());
    driver.pass(Instant::now());
    assert!(driver.state.touched.is_empty());
    let mut buf = [0u8; 2048];
    for client in &clients {
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        client
            .recv_from(&mut buf)
            .expect("a carried connection was never driven");
    }
}

/// A server on every address answers from the address the client wrote to
/// (here 127.0.0.2, where the kernel would otherwise pick 127.0.0.1): a
/// client on a host with several addresses would drop an answer from
/// another one.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn answers_come_from_the_address_the_client_wrote_to() {
    let built = built_on("0.0.0.0:0", PassBudget::default());
    let port = built.local_addr.port();
    let mut driver = built.driver;
    let to: SocketAddr = ([127, 0, 0, 2], port).into();
    let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    client
        .send_to(&client_initial(to, &built.certificate), to)
        .unwrap();
    driver.io.socket.readable().await.unwrap();
    assert_eq!(driver.pass(Instant::now()), 1);
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 2048];
    let (_, from) = client.recv_from(&mut buf).expect("no answer");
    assert_eq!(from, to);
}

/// Connections accepted together get keep-alives spread over [0.75, 1] of
/// the configured interval, not all the same one.
#[tokio::test]
async fn keep_alives_are_jittered_per_connection() {
    let built = built(PassBudget::default());
    let keep_alive = built.shared.config.keep_alive;
    let mut accept = built.driver.state.accept;
    let picked: Vec<Duration> = (0..1000)
        .map(|_| accept.pick().expect("a config").0)
        .collect();
    let (min, max) = (picked.iter().min().unwrap(), picked.iter().max().unwrap());
    assert!(*min >= keep_alive.mul_f64(0.75) && *max <= keep_alive);
    assert!(*max - *min >= keep_alive.mul_f64(0.2), "{min:?}..{max:?}");
    let distinct: std::collections::BTreeSet<_> = picked.iter().collect();
    assert!(distinct.len() >= 16, "only {} intervals", distinct.len());
}

/// The admission pacer takes a second's worth at once, then the rate.
#[test]
fn the_pacer_admits_its_rate_and_no_more() {
    let t0 = Instant::now();
    let mut pacer = Pacer::new(10, t0);
    assert_eq!((0..20).filter(|_| pacer.admit(t0)).count(), 10);
    let later = t0 + Duration::from_millis(500);
    assert_eq!((0..20).filter(|_| pacer.admit(later)).count(), 5);
    // Never more than a second's worth saved up.
    let much_later = later + Duration::from_secs(60);
    assert_eq!((0..50).filter(|_| pacer.admit(much_later)).count(), 10);
}

/// The reconnect spread: connections over the admission rate, at least 1 s.
#[test]
fn the_retry_hint_is_the_time_to_readmit_everyone() {
    use crate::{readmit_ms, with_retry_hint};
    assert_eq!(readmit_ms(100_000, 3000), 33_333);
    assert_eq!(readmit_ms(10, 3000), 1000);
    assert_eq!(readmit_ms(0, 0), 1000);
    // A count gone wrong never becomes a hint of ages (a wrapped count once
    // sent retry_ms=6148914691236517).
    assert_eq!(readmit_ms(usize::MAX, 3000), crate::MAX_RETRY_MS);
    assert_eq!(
        with_retry_hint(b"full", u64::MAX),
        b"full retry_ms=300000".to_vec()
    );
    assert_eq!(
        with_retry_hint(b"server draining", 33_333),
        b"server draining retry_ms=33333".to_vec()
    );
}
