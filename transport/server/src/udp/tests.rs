//! The outbox: single datagrams to many destinations and a GSO transmit
//! among them, sent in order, each as what it is.

use super::*;
use std::net::Ipv4Addr;
use std::time::Duration;

/// Receives one datagram (a std socket has no GRO: one per call).
fn receive(socket: &std::net::UdpSocket) -> Vec<u8> {
    let mut buf = [0u8; 65536];
    let n = socket.recv(&mut buf).expect("a datagram never came");
    buf[..n].to_vec()
}

#[tokio::test]
async fn the_outbox_sends_batches_and_gso_transmits_alike() {
    const M: usize = 4;
    let io = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut io = Io::new(io).unwrap();
    let receivers: Vec<std::net::UdpSocket> = (0..M)
        .map(|_| {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s
        })
        .collect();
    let transmit = |to: usize, contents: Vec<u8>, segment_size: Option<usize>| Outgoing {
        destination: receivers[to].local_addr().unwrap(),
        src_ip: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        ecn: Some(quinn_proto::EcnCodepoint::Ect0),
        contents,
        segment_size,
    };
    // 50 single datagrams (more than a batch), then one GSO transmit of
    // three 100-byte segments to receiver 0, then 10 more singles.
    // tokio tries a send only once it has seen the socket writable.
    io.socket.writable().await.unwrap();
    let mut sent = 0;
    for i in 0..50u8 {
        assert!(io
            .send(usize::MAX, transmit(usize::from(i) % M, vec![i; 30], None))
            .is_none());
        sent += 1;
    }
    let gso: Vec<u8> = (0..300).map(|b| 200 + (b / 100) as u8).collect();
    assert!(io.send(usize::MAX, transmit(0, gso, Some(100))).is_none());
    sent += 1;
    for i in 50..60u8 {
        assert!(io
            .send(
                usize::MAX,
                transmit(usize::from(i) % M, vec![i; 30], Some(30))
            )
            .is_none());
        sent += 1;
    }
    io.flush();
    while !io.is_empty() {
        io.socket.writable().await.unwrap();
        io.flush();
    }
    assert_eq!(io.spent().count(), sent, "buffers not given back");

    // Each receiver gets its singles in order; receiver 0 the three
    // segments as three datagrams between singles 48 and 52.
    for (m, socket) in receivers.iter().enumerate() {
        let mut expected: Vec<Vec<u8>> = Vec::new();
        for i in 0..60u8 {
            if i == 50 && m == 0 {
                expected.extend((0..3).map(|k| vec![200 + k; 100]));
            }
            if usize::from(i) % M == m {
                expected.push(vec![i; 30]);
            }
        }
        let mut got = Vec::new();
        while got.len() < expected.len() {
            got.push(receive(socket));
        }
        assert_eq!(got, expected, "receiver {m}");
    }
}
