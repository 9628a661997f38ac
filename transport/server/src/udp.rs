//! The server's UDP socket through quinn-udp: batches of datagrams per
//! system call (`recvmmsg`, GRO and GSO where the kernel has them), ECN, and
//! the local address each datagram came to, used as the source of the
//! answer (a host with several addresses answers from the one the client
//! wrote to). Waiting stays tokio's: readiness of the same socket.

use super::state::{Datagram, Transmit as Outgoing};
use bytes::BytesMut;
use quinn_udp::{RecvMeta, Transmit, UdpSocketState, BATCH_SIZE};
use std::collections::VecDeque;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tracing::debug;

/// Datagrams quinn-proto may put in one transmit (sent as one GSO write).
const MAX_SEGMENTS: usize = 10;
/// Room for one received datagram (or one GRO batch of `gro_segments`).
const MAX_DATAGRAM: usize = 1472;

/// A transmit waiting for the socket to take it.
struct Queued {
    destination: SocketAddr,
    src_ip: Option<IpAddr>,
    ecn: Option<quinn_udp::EcnCodepoint>,
    segment_size: Option<usize>,
    contents: Vec<u8>,
}

pub(super) struct Io {
    pub socket: UdpSocket,
    state: UdpSocketState,
    recv_buf: Box<[u8]>,
    /// Transmits the socket could not take yet, oldest first.
    outbox: VecDeque<Queued>,
}

impl Io {
    /// Takes a bound socket; sets it non-blocking and turns on what the
    /// platform offers (GRO, ECN, the local address of each datagram).
    pub fn new(socket: std::net::UdpSocket) -> io::Result<Io> {
        let state = UdpSocketState::new((&socket).into())?;
        let slot = (MAX_DATAGRAM * state.gro_segments()).max(65535);
        Ok(Io {
            socket: UdpSocket::from_std(socket)?,
            state,
            recv_buf: vec![0u8; slot * BATCH_SIZE].into_boxed_slice(),
            outbox: VecDeque::new(),
        })
    }

    /// Datagrams quinn-proto may put in one transmit.
    pub fn max_segments(&self) -> usize {
        self.state.max_gso_segments().clamp(1, MAX_SEGMENTS)
    }

    /// One batch of datagrams (one system call) into `out`: `Ok(0)` when the
    /// socket has none (`WouldBlock` clears tokio's readiness).
    pub fn recv(&mut self, out: &mut Vec<Datagram>) -> io::Result<usize> {
        let mut metas = [RecvMeta::default(); BATCH_SIZE];
        let slot = self.recv_buf.len() / BATCH_SIZE;
        let mut iovs: [IoSliceMut; BATCH_SIZE] = {
            let mut chunks = self.recv_buf.chunks_mut(slot).map(IoSliceMut::new);
            std::array::from_fn(|_| chunks.next().expect("BATCH_SIZE chunks"))
        };
        let (socket, state) = (&self.socket, &self.state);
        let got = match socket.try_io(Interest::READABLE, || {
            state.recv(socket.into(), &mut iovs, &mut metas)
        }) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut count = 0;
        for (meta, buf) in metas.iter().zip(iovs.iter()).take(got) {
            let mut data = BytesMut::from(&buf[..meta.len]);
            let stride = meta.stride.max(1);
            while !data.is_empty() {
                let one = data.split_to(stride.min(data.len()));
                out.push(Datagram {
                    remote: meta.addr,
                    local_ip: meta.dst_ip,
                    ecn: meta
                        .ecn
                        .and_then(|e| quinn_proto::EcnCodepoint::from_bits(e as u8)),
                    data: one,
                });
                count += 1;
            }
        }
        Ok(count)
    }

    /// Sends a transmit now, or keeps it (at most `cap` kept) until the
    /// socket can take it; beyond that it is dropped (QUIC retransmits).
    /// Gives the buffer back unless it is kept.
    pub fn send(&mut self, cap: usize, t: Outgoing) -> Option<Vec<u8>> {
        let queued = Queued {
            destination: t.destination,
            src_ip: t.src_ip,
            ecn: t
                .ecn
                .and_then(|e| quinn_udp::EcnCodepoint::from_bits(e as u8)),
            segment_size: t.segment_size,
            contents: t.contents,
        };
        if self.outbox.is_empty() {
            match self.try_send(&queued, &queued.contents) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                _ => return Some(queued.contents),
            }
        }
        if self.outbox.len() < cap {
            self.outbox.push_back(queued);
            return None;
        }
        Some(queued.contents)
    }

    /// Sends what waits, until the socket is full.
    pub fn flush(&mut self) {
        while let Some(queued) = self.outbox.front() {
            match self.try_send(queued, &queued.contents) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                _ => {
                    self.outbox.pop_front();
                }
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.outbox.is_empty()
    }

    /// Only `WouldBlock` is an error: any other failure of a datagram is
    /// logged by quinn-udp and dropped (QUIC retransmits).
    fn try_send(&self, queued: &Queued, contents: &[u8]) -> io::Result<()> {
        let transmit = Transmit {
            destination: queued.destination,
            ecn: queued.ecn,
            contents,
            segment_size: queued.segment_size,
            src_ip: queued.src_ip,
        };
        let (socket, state) = (&self.socket, &self.state);
        let sent = socket.try_io(Interest::WRITABLE, || state.send(socket.into(), &transmit));
        if let Err(e) = &sent {
            if e.kind() != io::ErrorKind::WouldBlock {
                debug!(to = %queued.destination, error = %e, "send failed");
            }
        }
        sent
    }
}
