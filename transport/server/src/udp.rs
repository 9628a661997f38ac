//! The server's UDP socket through quinn-udp: batches of datagrams per
//! system call (`recvmmsg`, GRO and GSO where the kernel has them), ECN, and
//! the local address each datagram came to, used as the source of the
//! answer (a host with several addresses answers from the one the client
//! wrote to). Waiting stays tokio's: readiness of the same socket.
//!
//! Sending: transmits wait in the outbox and go out in batches; on Linux a
//! run of single-datagram transmits goes in one `sendmmsg` whatever their
//! destinations (`sendmmsg`), and a GSO transmit (several segments) through
//! quinn-udp's `sendmsg`, as does everything elsewhere.

use super::state::{Datagram, Transmit as Outgoing};
use bytes::BytesMut;
use quinn_udp::{RecvMeta, Transmit, UdpSocketState, BATCH_SIZE};
use std::collections::VecDeque;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tracing::debug;

#[cfg(target_os = "linux")]
mod sendmmsg;

/// Transmits waiting before a send is tried: a full system call's worth.
#[cfg(target_os = "linux")]
const SEND_BATCH: usize = sendmmsg::BATCH;
#[cfg(not(target_os = "linux"))]
const SEND_BATCH: usize = 1;

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
    /// Transmits not sent yet, oldest first: fewer than a batch, or what
    /// the socket could not take.
    outbox: VecDeque<Queued>,
    /// The socket was found full: nothing is tried before the next
    /// [`Io::flush`] (the driver's, once a pass or when it is writable).
    blocked: bool,
    /// Buffers of the transmits sent, to give back to the state.
    spent: Vec<Vec<u8>>,
    /// `sendmmsg` is used; off for good once the kernel refused its
    /// arguments (`EINVAL`), leaving quinn-udp's own fallback.
    #[cfg(target_os = "linux")]
    batching: bool,
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
            blocked: false,
            spent: Vec::new(),
            #[cfg(target_os = "linux")]
            batching: true,
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

    /// Queues a transmit; sends the queue once it holds a batch, unless the
    /// socket was found full. At most `cap` transmits wait for a full
    /// socket; beyond that the transmit is dropped (QUIC retransmits) and
    /// its buffer given back at once. Buffers of the transmits sent come
    /// back through [`Io::spent`].
    pub fn send(&mut self, cap: usize, t: Outgoing) -> Option<Vec<u8>> {
        self.outbox.push_back(Queued {
            destination: t.destination,
            src_ip: t.src_ip,
            ecn: t
                .ecn
                .and_then(|e| quinn_udp::EcnCodepoint::from_bits(e as u8)),
            segment_size: t.segment_size,
            contents: t.contents,
        });
        if !self.blocked && self.outbox.len() >= SEND_BATCH {
            self.send_queued();
        }
        if self.outbox.len() > cap {
            return self.outbox.pop_back().map(|q| q.contents);
        }
        None
    }

    /// Sends what waits, until the socket is full.
    pub fn flush(&mut self) {
        self.send_queued();
    }

    pub fn is_empty(&self) -> bool {
        self.outbox.is_empty()
    }

    /// The buffers of the transmits sent (or failed) since the last call.
    pub fn spent(&mut self) -> impl Iterator<Item = Vec<u8>> + '_ {
        self.spent.drain(..)
    }

    fn send_queued(&mut self) {
        while !self.outbox.is_empty() {
            match self.send_front() {
                Ok(done) => {
                    for q in self.outbox.drain(..done) {
                        self.spent.push(q.contents);
                    }
                }
                Err(_) => {
                    self.blocked = true;
                    return;
                }
            }
        }
        self.blocked = false;
    }

    /// Sends from the front of the outbox; returns how many transmits are
    /// done (sent, or failed and dropped). Only `WouldBlock` is an error.
    fn send_front(&mut self) -> io::Result<usize> {
        #[cfg(target_os = "linux")]
        if self.batching {
            let single = |q: &&Queued| q.segment_size.is_none_or(|s| s >= q.contents.len());
            let run = self
                .outbox
                .iter()
                .take(SEND_BATCH)
                .take_while(single)
                .count();
            if run > 1 {
                let messages = self.outbox.iter().take(run).map(|q| sendmmsg::Message {
                    destination: q.destination,
                    src_ip: q.src_ip,
                    ecn: q.ecn,
                    contents: &q.contents,
                });
                let socket = &self.socket;
                match socket.try_io(Interest::WRITABLE, || sendmmsg::send(socket, messages)) {
                    Ok(sent) if sent > 0 => return Ok(sent),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(e),
                    // The first datagram's own error: it goes again through
                    // quinn-udp's path below, which handles and logs it as
                    // it does every failure of a single send.
                    Err(e) => {
                        if e.raw_os_error() == Some(libc::EINVAL) {
                            debug!(error = %e, "sendmmsg refused: single sends from now on");
                            self.batching = false;
                        }
                    }
                }
            }
        }
        let Some(front) = self.outbox.front() else {
            return Ok(0);
        };
        self.try_send(front, &front.contents).map(|()| 1)
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

#[cfg(test)]
mod tests;
