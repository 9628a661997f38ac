//! A network path with a round-trip time, in user space: a relay on loopback
//! that holds every datagram (UDP) or chunk (TCP) for half the round trip in
//! each direction. Kernel shaping (netem) is not available on this machine,
//! and would slow every process on it; this delays only the traffic sent
//! through the relay.
//!
//! - UDP: each client address gets its own upstream socket, so a client that
//!   moves to a new socket reaches the server from a new address, as after a
//!   real network switch.
//! - TCP: the relay accepts, waits one round trip (the handshake a real path
//!   costs before the first byte), connects upstream, then relays each
//!   direction with the one-way delay.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Sends what arrives on `rx` at its due time, in order.
async fn deliver<F, Fut>(mut rx: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>, mut send: F)
where
    F: FnMut(Vec<u8>) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    while let Some((due, bytes)) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if !send(bytes).await {
            return;
        }
    }
}

/// Starts a UDP relay to `server` with round trip `rtt`; returns its address.
pub async fn udp(server: SocketAddr, rtt: Duration) -> std::io::Result<SocketAddr> {
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await?);
    let addr = front.local_addr()?;
    let one_way = rtt / 2;
    tokio::spawn(async move {
        let mut flows: HashMap<SocketAddr, Flow> = HashMap::new();
        let mut buf = vec![0u8; 65536];
        loop {
            let Ok((n, client)) = front.recv_from(&mut buf).await else {
                continue;
            };
            let tx = match flows.get(&client) {
                Some(tx) => tx.clone(),
                None => {
                    let Ok(tx) = open_flow(front.clone(), client, server, one_way).await else {
                        continue;
                    };
                    flows.insert(client, tx.clone());
                    tx
                }
            };
            let _ = tx.send((Instant::now() + one_way, buf[..n].to_vec()));
        }
    });
    Ok(addr)
}

type Flow = mpsc::UnboundedSender<(Instant, Vec<u8>)>;

/// The relay's side of one client address: its own upstream socket, and a
/// delayed queue each way.
async fn open_flow(
    front: Arc<UdpSocket>,
    client: SocketAddr,
    server: SocketAddr,
    one_way: Duration,
) -> std::io::Result<Flow> {
    let up = Arc::new(UdpSocket::bind("127.0.0.1:0").await?);
    let (tx, rx) = mpsc::unbounded_channel();
    let sender = up.clone();
    tokio::spawn(deliver(rx, move |b| {
        let sender = sender.clone();
        async move { sender.send_to(&b, server).await.is_ok() }
    }));
    // Server to client, through the front socket.
    let (back_tx, back_rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(deliver(back_rx, move |b| {
        let front = front.clone();
        async move { front.send_to(&b, client).await.is_ok() }
    }));
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, _)) = up.recv_from(&mut buf).await {
            if back_tx
                .send((Instant::now() + one_way, buf[..n].to_vec()))
                .is_err()
            {
                return;
            }
        }
    });
    Ok(tx)
}

/// Starts a TCP relay to `server` with round trip `rtt`; returns its address.
pub async fn tcp(server: SocketAddr, rtt: Duration) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                // The three-way handshake of a real path.
                tokio::time::sleep(rtt).await;
                let Ok(upstream) = TcpStream::connect(server).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (ur, uw) = upstream.into_split();
                tokio::spawn(pipe(cr, uw, rtt / 2));
                tokio::spawn(pipe(ur, cw, rtt / 2));
            });
        }
    });
    Ok(addr)
}

/// Copies `from` to `to`, each chunk `delay` after it was read; a close
/// travels with the same delay.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        let mut to = to;
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if bytes.is_empty() || to.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buf = vec![0u8; 16384];
    loop {
        let n = from.read(&mut buf).await.unwrap_or(0);
        if tx
            .send((Instant::now() + delay, buf[..n].to_vec()))
            .is_err()
            || n == 0
        {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}
