//! The QUIC binding: a `quinn_proto::Connection` as a [`Binding`]. The
//! client's one bidirectional stream is the control channel; the server
//! opens two unidirectional push streams at the welcome, realtime at the
//! higher priority. quinn-proto's events become [`Happened`]s.

use super::session::{Binding, Happened, ReadEnd, Write};
use bytes::Bytes;
use greendot_proto::{CloseCode, FrameReader};
use quinn_proto::{ConnectionError, Dir, Event, StreamEvent, StreamId};
use std::net::SocketAddr;
use std::time::Instant;

/// One QUIC connection under a session.
pub(crate) struct QuicLink {
    pub quic: quinn_proto::Connection,
    /// The client's bidirectional control stream, once opened.
    control: Option<StreamId>,
    /// Realtime and batched, opened at the welcome.
    pushes: Option<[StreamId; 2]>,
}

impl QuicLink {
    pub fn new(quic: quinn_proto::Connection) -> QuicLink {
        QuicLink {
            quic,
            control: None,
            pushes: None,
        }
    }

    /// quinn-proto's event in session terms (`None`: nothing for the
    /// session). `refuse_control`: a control stream was already opened (or
    /// finished) once; a new one is stopped.
    pub fn translate(&mut self, event: Event, refuse_control: bool) -> Option<Happened> {
        match event {
            Event::Connected => Some(Happened::Connected),
            Event::ConnectionLost { reason } => Some(Happened::Lost {
                logout: matches!(
                    &reason,
                    ConnectionError::ApplicationClosed(close)
                        if close.error_code == CloseCode::Logout.varint()
                ),
                reason: reason.to_string(),
            }),
            Event::Stream(StreamEvent::Opened { dir: Dir::Bi }) => {
                while let Some(id) = self.quic.streams().accept(Dir::Bi) {
                    if self.control.is_none() && !refuse_control {
                        self.control = Some(id);
                    } else {
                        // One control stream per connection.
                        let _ = self.quic.recv_stream(id).stop(0u32.into());
                    }
                }
                Some(Happened::ControlReadable)
            }
            Event::Stream(StreamEvent::Readable { id }) if self.control == Some(id) => {
                Some(Happened::ControlReadable)
            }
            Event::Stream(StreamEvent::Writable { id }) => self.channel(id).map(|c| match c {
                Channel::Control => Happened::ControlWritable,
                Channel::Push(tier) => Happened::PushWritable(tier),
            }),
            Event::Stream(StreamEvent::Stopped { id, .. }) => self.channel(id).map(|c| match c {
                Channel::Control => Happened::ControlStopped,
                Channel::Push(_) => Happened::PushStopped,
            }),
            Event::Stream(StreamEvent::Finished { id }) if self.control == Some(id) => {
                Some(Happened::AnswersDelivered)
            }
            _ => None,
        }
    }

    fn channel(&self, id: StreamId) -> Option<Channel> {
        if self.control == Some(id) {
            return Some(Channel::Control);
        }
        let pushes = self.pushes?;
        pushes.iter().position(|&p| p == id).map(Channel::Push)
    }
}

enum Channel {
    Control,
    Push(usize),
}

fn written(result: Result<usize, quinn_proto::WriteError>) -> Write {
    match result {
        Ok(n) => Write::Took(n),
        Err(quinn_proto::WriteError::Blocked) => Write::Blocked,
        Err(_) => Write::Gone,
    }
}

impl Binding for QuicLink {
    fn remote(&self) -> SocketAddr {
        self.quic.remote_address()
    }

    fn has_control(&self) -> bool {
        self.control.is_some()
    }

    fn read_control(
        &mut self,
        budget: usize,
        reader: &mut FrameReader,
    ) -> Option<(usize, ReadEnd)> {
        let id = self.control?;
        let mut recv = self.quic.recv_stream(id);
        let mut chunks = recv.read(true).ok()?;
        let mut got = 0usize;
        let mut end = ReadEnd::Open;
        while got < budget {
            match chunks.next(budget - got) {
                Ok(Some(chunk)) => {
                    got += chunk.bytes.len();
                    reader.push(&chunk.bytes);
                }
                Ok(None) => {
                    end = ReadEnd::Finished;
                    break;
                }
                Err(quinn_proto::ReadError::Blocked) => break,
                Err(quinn_proto::ReadError::Reset(_)) => {
                    end = ReadEnd::Reset;
                    break;
                }
            }
        }
        // Credit the peer gets back goes out with the next transmit.
        let _ = chunks.finalize();
        Some((got, end))
    }

    fn write_control(&mut self, bytes: &[u8]) -> Write {
        match self.control {
            Some(id) => written(self.quic.send_stream(id).write(bytes)),
            None => Write::Blocked,
        }
    }

    fn finish_control(&mut self) -> bool {
        match self.control {
            // `Finished` comes once the client acknowledged everything.
            Some(id) => self.quic.send_stream(id).finish().is_ok(),
            None => false,
        }
    }

    fn open_pushes(&mut self) -> bool {
        let mut open = || {
            let id = self.quic.streams().open(Dir::Uni)?;
            Some(id)
        };
        let (Some(realtime), Some(batched)) = (open(), open()) else {
            return false;
        };
        let _ = self.quic.send_stream(realtime).set_priority(1);
        let _ = self.quic.send_stream(batched).set_priority(0);
        self.pushes = Some([realtime, batched]);
        true
    }

    fn write_push(&mut self, tier: usize, bytes: &[u8]) -> Write {
        match self.pushes.and_then(|p| p.get(tier).copied()) {
            Some(id) => written(self.quic.send_stream(id).write(bytes)),
            None => Write::Gone,
        }
    }

    fn close(&mut self, now: Instant, code: CloseCode, text: &[u8]) {
        self.quic
            .close(now, code.varint(), Bytes::copy_from_slice(text));
    }
}
