//! A connection's binding, QUIC or WebSocket, behind the session layer's
//! `Binding` trait.

use crate::quic::QuicLink;
use crate::session::{Binding, ReadEnd, Write};
use crate::ws::WsLink;
use greendot_proto::{self as proto, CloseCode};
use quinn_proto::ConnectionHandle;
use std::net::SocketAddr;
use std::time::Instant;

/// A connection's binding. The QUIC link stays inline (the `Conn` is
/// boxed already; boxing it too would cost every QUIC connection an
/// allocation); a WebSocket slot pays its size for now.
#[allow(clippy::large_enum_variant)]
pub(super) enum Link {
    Quic(QuicLink),
    Ws(WsLink),
}

impl Link {
    pub(super) fn quic(&mut self) -> Option<&mut quinn_proto::Connection> {
        match self {
            Link::Quic(l) => Some(&mut l.quic),
            Link::Ws(_) => None,
        }
    }

    pub(super) fn handle_timeout(&mut self, now: Instant) {
        match self {
            Link::Quic(l) => l.handle_timeout(now),
            Link::Ws(l) => l.handle_timeout(now),
        }
    }

    pub(super) fn poll_timeout(&mut self) -> Option<Instant> {
        match self {
            Link::Quic(l) => l.poll_timeout(),
            Link::Ws(l) => l.poll_timeout(),
        }
    }

    pub(super) fn is_ws(&self) -> bool {
        matches!(self, Link::Ws(_))
    }

    /// A QUIC connection that negotiated HTTP/3 (known once connected).
    pub(super) fn is_webtransport(&self) -> bool {
        matches!(self, Link::Quic(l) if l.is_webtransport())
    }
}

impl Binding for Link {
    fn remote(&self) -> SocketAddr {
        match self {
            Link::Quic(l) => l.remote(),
            Link::Ws(l) => l.remote(),
        }
    }
    fn has_control(&self) -> bool {
        match self {
            Link::Quic(l) => l.has_control(),
            Link::Ws(l) => l.has_control(),
        }
    }
    fn read_control(
        &mut self,
        budget: usize,
        reader: &mut proto::FrameReader,
    ) -> Option<(usize, ReadEnd)> {
        match self {
            Link::Quic(l) => l.read_control(budget, reader),
            Link::Ws(l) => l.read_control(budget, reader),
        }
    }
    fn write_control(&mut self, bytes: &[u8]) -> Write {
        match self {
            Link::Quic(l) => l.write_control(bytes),
            Link::Ws(l) => l.write_control(bytes),
        }
    }
    fn finish_control(&mut self) -> bool {
        match self {
            Link::Quic(l) => l.finish_control(),
            Link::Ws(l) => l.finish_control(),
        }
    }
    fn open_pushes(&mut self) -> bool {
        match self {
            Link::Quic(l) => l.open_pushes(),
            Link::Ws(l) => l.open_pushes(),
        }
    }
    fn write_push(&mut self, tier: usize, bytes: &[u8]) -> Write {
        match self {
            Link::Quic(l) => l.write_push(tier, bytes),
            Link::Ws(l) => l.write_push(tier, bytes),
        }
    }
    fn close(&mut self, now: Instant, code: CloseCode, text: &[u8]) {
        match self {
            Link::Quic(l) => l.close(now, code, text),
            Link::Ws(l) => l.close(now, code, text),
        }
    }
}

/// Slots of QUIC connections are even (twice quinn's handle), those of
/// WebSocket connections odd: both live in one table.
pub(super) fn quic_slot(ch: ConnectionHandle) -> usize {
    ch.0 * 2
}
