//! One connection's session layer, whatever binding carries it: where the
//! connection is in its life ([`Phase`]), its frames in ([`ConnState`], a
//! [`FrameReader`]), its answers and pushes out (with their queues and
//! byte counts), and what it asks the server to do next. It never sees
//! QUIC: it talks to its transport through the small [`Binding`] trait
//! (a control channel of frames in and answers out, two push channels, a
//! close with a code). QUIC is one binding (`quic`); WebTransport,
//! WebSocket and a cluster bus would be others. A new binding implements
//! [`Binding`], turns its own events into [`Happened`]s, and takes its
//! place beside `QuicLink` in the server's connection slot (an enum of
//! links once there are two); nothing in this file changes.

use super::conn::{ConnState, Step};
use bytes::{Buf, Bytes};
use greendot_core::{Millis, SessionId, Tier};
use greendot_proto::{CloseCode, FrameError, FrameReader};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

/// Where a connection is in its life. Every transition is one method of
/// [`Session`] (or of the server for the ones that need the hub).
#[derive(Debug)]
pub(crate) enum Phase {
    /// The transport's handshake is in flight, counted among the handshakes
    /// from `ip`; the hello is due by `hello_by` (counted from the first
    /// packet, not from the end of a slow handshake).
    Handshaking { ip: IpAddr, hello_by: Instant },
    /// Connected and counted among the open connections; no session yet.
    AwaitingHello { hello_by: Instant },
    /// Welcomed (or rejected and being closed): frames are read and answered.
    Live,
    /// A durable change waits for the store (`ticket`): the frames after it
    /// wait too, so that answers keep their order.
    WaitingStore { ticket: u64 },
    /// After the answer in flight, close with `code` (at the latest at `by`).
    Closing {
        code: CloseCode,
        text: Vec<u8>,
        by: Instant,
    },
    /// Its end was reported (hub, counters, event); nothing more is read.
    /// The transport may still be sending its close.
    Ended,
}

impl Phase {
    /// When the server must look at the connection again by itself.
    pub fn deadline(&self) -> Option<Instant> {
        match *self {
            Phase::Handshaking { hello_by, .. } | Phase::AwaitingHello { hello_by } => {
                Some(hello_by)
            }
            Phase::Closing { by, .. } => Some(by),
            _ => None,
        }
    }

    /// Past the handshake and counted in the open connections.
    pub fn is_open(&self) -> bool {
        matches!(
            self,
            Phase::AwaitingHello { .. }
                | Phase::Live
                | Phase::WaitingStore { .. }
                | Phase::Closing { .. }
        )
    }
}

/// What a binding did with bytes written to one of its channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// Took this many bytes (maybe fewer than offered: try the rest).
    Took(usize),
    /// Takes nothing now; the binding reports the channel writable later.
    Blocked,
    /// The peer reads this channel no more.
    Gone,
}

/// How a read of the control channel ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadEnd {
    /// More may come.
    Open,
    /// The peer finished the channel.
    Finished,
    /// The peer abandoned it mid-stream: nothing buffered is trusted.
    Reset,
}

/// The transport under a session: what the session layer needs of QUIC
/// (or any other binding).
pub(crate) trait Binding {
    /// The peer's current address.
    fn remote(&self) -> SocketAddr;
    /// Whether the peer opened its control channel.
    fn has_control(&self) -> bool;
    /// Moves at most `budget` bytes from the control channel into `reader`:
    /// how many, and how the read ended; `None` if there is no channel to
    /// read (yet or any more).
    fn read_control(&mut self, budget: usize, reader: &mut FrameReader)
        -> Option<(usize, ReadEnd)>;
    fn write_control(&mut self, bytes: &[u8]) -> Write;
    /// No more answers: `true` if the binding will report
    /// [`Happened::AnswersDelivered`] once the peer has them all, `false` if
    /// there is nothing to wait for (close now).
    fn finish_control(&mut self) -> bool;
    /// Opens the two push channels (realtime first, at the higher priority).
    fn open_pushes(&mut self) -> bool;
    fn write_push(&mut self, tier: usize, bytes: &[u8]) -> Write;
    /// Closes the connection now; the peer gets `code` and `text`.
    fn close(&mut self, now: Instant, code: CloseCode, text: &[u8]);
}

/// What a binding reports about its connection, in session terms.
#[derive(Debug)]
pub(crate) enum Happened {
    /// The handshake completed.
    Connected,
    /// The connection is gone; `logout` if the peer closed with the logout code.
    Lost { logout: bool, reason: String },
    /// The peer opened its control channel, or sent more on it.
    ControlReadable,
    /// The control channel takes bytes again.
    ControlWritable,
    /// A push channel takes bytes again.
    PushWritable(usize),
    /// The peer stopped reading a push channel.
    PushStopped,
    /// The peer stopped reading answers: what waits for it is dropped.
    ControlStopped,
    /// Every answer reached the peer (after [`Binding::finish_control`]).
    AnswersDelivered,
}

/// The push channel of a tier.
pub(crate) fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::Realtime => 0,
        Tier::Batched => 1,
    }
}

/// What one queued push entry costs beside its bytes: with it, the byte
/// limits also bound how many tiny pushes a queue can hold.
pub(crate) const PUSH_ENTRY_OVERHEAD: usize = std::mem::size_of::<(Instant, Bytes)>();

/// The bytes a queued push counts for in the per-connection limit and the
/// server's budget.
pub(crate) fn queued_cost(bytes: &Bytes) -> usize {
    bytes.len() + PUSH_ENTRY_OVERHEAD
}

/// What the server must do after a connection's deadline passed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Overdue {
    /// The close that waited for an answer.
    Close(CloseCode, Vec<u8>),
    /// No hello in time; `handshaking` if the handshake had not even ended.
    NoHello { handshaking: bool },
}

/// What a push offered to a session came to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Into the channel at once.
    Sent,
    /// Queued behind flow control: this many bytes more are queued.
    Queued(usize),
    /// Dropped: the channel is gone or there is none.
    Dropped,
    /// The queue would pass its limit: the client does not read.
    Stalled,
}

/// What the server must do after answers were written.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Flushed {
    /// Nothing (more answers wait, or nothing to do).
    Nothing,
    /// Every answer is out and a close waited for them: close now.
    Close(CloseCode, Vec<u8>),
}

/// A frame read from the control channel, or why there is none.
#[derive(Debug)]
pub(crate) enum Next {
    Step(Step),
    /// Nothing to read now.
    Idle,
}

/// Pushes a push channel did not take yet, with the instant of the change
/// behind each.
type PushQueue = VecDeque<(Instant, Bytes)>;

/// One connection's session layer.
#[derive(Debug)]
pub(crate) struct Session {
    pub phase: Phase,
    /// The welcomed session.
    pub id: Option<SessionId>,
    pub state: ConnState,
    reader: FrameReader,
    /// The peer finished (or reset) its side of the control channel.
    control_done: bool,
    /// Answer bytes the control channel did not take yet.
    unsent: Vec<u8>,
    /// Encoded pushes each push channel did not take yet (flow control),
    /// with the instant of the change behind each: realtime, batched.
    pushes: Option<Box<[PushQueue; 2]>>,
    /// Bytes waiting in `pushes` (counted in the server's total too).
    pub queued: usize,
    /// The peer's address as last reported.
    pub address: SocketAddr,
    /// When anything of this connection last arrived (Unix ms): the user's
    /// last seen if the connection is lost.
    pub last_heard: Millis,
}

impl Session {
    /// `max_hello`: the largest first frame (the hello); [`Session::welcome`]
    /// raises it to the largest frame.
    pub fn new(
        state: ConnState,
        max_hello: usize,
        address: SocketAddr,
        heard: Millis,
        phase: Phase,
    ) -> Session {
        Session {
            phase,
            id: None,
            state,
            reader: FrameReader::new(max_hello),
            control_done: false,
            unsent: Vec::new(),
            pushes: None,
            queued: 0,
            address,
            last_heard: heard,
        }
    }

    pub fn is_ended(&self) -> bool {
        matches!(self.phase, Phase::Ended)
    }

    /// The handshake ended: from `Handshaking` to `AwaitingHello`; the IP it
    /// was counted under, if it was.
    pub fn connected(&mut self, hello_by: Instant) -> Option<IpAddr> {
        match self.phase {
            Phase::Handshaking { ip, hello_by } => {
                self.phase = Phase::AwaitingHello { hello_by };
                Some(ip)
            }
            Phase::Ended => None,
            _ => {
                self.phase = Phase::AwaitingHello { hello_by };
                None
            }
        }
    }

    /// Its end is being reported: `Ended` from now on. What it held is
    /// freed; returns the phase it was in.
    pub fn end(&mut self) -> Phase {
        self.pushes = None;
        self.unsent = Vec::new();
        self.reader = FrameReader::new(0);
        std::mem::replace(&mut self.phase, Phase::Ended)
    }

    /// Its deadline passed: what to do.
    pub fn overdue(&mut self, now: Instant) -> Option<Overdue> {
        match self.phase.deadline() {
            Some(d) if d <= now => {}
            _ => return None,
        }
        match std::mem::replace(&mut self.phase, Phase::Live) {
            Phase::Closing { code, text, .. } => Some(Overdue::Close(code, text)),
            Phase::Handshaking { ip, hello_by } => {
                self.phase = Phase::Handshaking { ip, hello_by };
                Some(Overdue::NoHello { handshaking: true })
            }
            phase @ Phase::AwaitingHello { .. } => {
                self.phase = phase;
                Some(Overdue::NoHello { handshaking: false })
            }
            phase => {
                self.phase = phase;
                None
            }
        }
    }

    /// Its later frames wait for `ticket` (a store write or the owner of its
    /// user). Only a connection that reads frames waits: one whose end was
    /// reported, or that closes, stays so (a wait would make it open again).
    pub fn wait_for(&mut self, ticket: u64) {
        if matches!(self.phase, Phase::AwaitingHello { .. } | Phase::Live) {
            self.phase = Phase::WaitingStore { ticket };
        }
    }

    /// The hub welcomed it: frames up to `max_frame` from now on.
    pub fn welcome(
        &mut self,
        session: SessionId,
        link: &mut impl Binding,
        max_frame: usize,
    ) -> bool {
        self.state.on_welcome(session);
        self.id = Some(session);
        self.reader.set_max(max_frame);
        if matches!(self.phase, Phase::AwaitingHello { .. }) {
            self.phase = Phase::Live;
        }
        if !link.open_pushes() {
            return false;
        }
        self.pushes = Some(Box::new([VecDeque::new(), VecDeque::new()]));
        true
    }

    /// Queues an answer; `close`: then close with this code and reason (the
    /// answer goes first, for at most `linger`).
    pub fn answer(&mut self, frame: &[u8], close: Option<(CloseCode, Vec<u8>)>, by: Instant) {
        if self.is_ended() {
            return;
        }
        self.unsent.extend_from_slice(frame);
        if let Some((code, text)) = close {
            self.phase = Phase::Closing { code, text, by };
        }
    }

    /// The close waiting for the answers, if any, taken.
    pub fn take_close(&mut self) -> Option<(CloseCode, Vec<u8>)> {
        if !matches!(self.phase, Phase::Closing { .. }) {
            return None;
        }
        match std::mem::replace(&mut self.phase, Phase::Live) {
            Phase::Closing { code, text, .. } => Some((code, text)),
            _ => None,
        }
    }

    /// Writes the answers that wait, until all are out or the channel
    /// blocks; once all are out before a close, finishes the channel.
    pub fn write_answers(&mut self, link: &mut impl Binding) -> Flushed {
        // Until all is taken or the binding says `Blocked`: only a write
        // refused outright promises a writable report later.
        while !self.unsent.is_empty() {
            match link.write_control(&self.unsent) {
                Write::Took(n) => {
                    self.unsent.drain(..n);
                }
                Write::Blocked => return Flushed::Nothing,
                // Stopped by the client: it reads no answers.
                Write::Gone => self.unsent.clear(),
            }
        }
        self.unsent = Vec::new();
        // The answer before a close is all out: finish, and close once it
        // is delivered (or at the deadline).
        if matches!(self.phase, Phase::Closing { .. }) && !link.finish_control() {
            if let Some((code, text)) = self.take_close() {
                return Flushed::Close(code, text);
            }
        }
        Flushed::Nothing
    }

    /// Every answer is delivered (or dropped): the close that waited for
    /// them, if any.
    pub fn answers_delivered(&mut self) -> Option<(CloseCode, Vec<u8>)> {
        if !self.unsent.is_empty() {
            return None;
        }
        self.take_close()
    }

    /// Whether the answers are all out, so that more requests may be read.
    pub fn answers_out(&self) -> bool {
        self.unsent.is_empty()
    }

    /// Offers a push: into its channel, behind what waits, or refused when
    /// the queue would pass `limit` bytes.
    pub fn push(
        &mut self,
        link: &mut impl Binding,
        tier: usize,
        at: Instant,
        mut bytes: Bytes,
        limit: usize,
    ) -> Pushed {
        let Some(queue) = self.pushes.as_deref_mut().and_then(|p| p.get_mut(tier)) else {
            return Pushed::Dropped;
        };
        let cost = queued_cost(&bytes);
        if self.queued.saturating_add(cost) > limit {
            return Pushed::Stalled;
        }
        if !queue.is_empty() {
            queue.push_back((at, bytes));
            self.queued += cost;
            return Pushed::Queued(cost);
        }
        // Until all is taken or the binding says `Blocked` (see above).
        while !bytes.is_empty() {
            match link.write_push(tier, &bytes) {
                Write::Took(n) => bytes.advance(n),
                Write::Blocked => {
                    let cost = queued_cost(&bytes);
                    queue.push_back((at, bytes));
                    self.queued += cost;
                    return Pushed::Queued(cost);
                }
                // Stopped by the client (the connection is being closed for it).
                Write::Gone => return Pushed::Dropped,
            }
        }
        Pushed::Sent
    }

    /// Writes what waits on a push channel; calls `delivered` with the
    /// instant behind each push fully written. Returns how many queued
    /// bytes it freed.
    pub fn write_pushes(
        &mut self,
        link: &mut impl Binding,
        tier: usize,
        mut delivered: impl FnMut(Instant),
    ) -> usize {
        let Some(queue) = self.pushes.as_deref_mut().and_then(|p| p.get_mut(tier)) else {
            return 0;
        };
        let mut freed = 0;
        while let Some((at, bytes)) = queue.front_mut() {
            match link.write_push(tier, bytes) {
                Write::Took(n) if n == bytes.len() => {
                    delivered(*at);
                    freed += n + PUSH_ENTRY_OVERHEAD;
                    queue.pop_front();
                }
                // Part taken: try the rest.
                Write::Took(n) => {
                    freed += n;
                    bytes.advance(n);
                }
                Write::Blocked => break,
                Write::Gone => {
                    freed += queue.iter().map(|(_, b)| queued_cost(b)).sum::<usize>();
                    queue.clear();
                    break;
                }
            }
        }
        if queue.is_empty() {
            *queue = VecDeque::new();
        }
        self.queued -= freed;
        freed
    }

    /// The next frame to handle: from what is buffered, else read from the
    /// control channel (at most `budget` bytes per read). `Idle` while the
    /// connection may not go on (it waits for the store, closes, or its
    /// answers are not read).
    pub fn next_frame(&mut self, link: &mut impl Binding, now: Millis, budget: usize) -> Next {
        loop {
            // Answers the client does not read stop its requests being
            // read (flow control then stops the client).
            if !matches!(self.phase, Phase::AwaitingHello { .. } | Phase::Live)
                || !self.unsent.is_empty()
            {
                return Next::Idle;
            }
            match self.reader.next_frame() {
                Ok(Some(payload)) => return Next::Step(self.state.on_frame(now, &payload)),
                Ok(None) => self.reader.compact(),
                Err(e) => return Next::Step(self.state.on_frame_error(e)),
            }
            if self.control_done {
                // The client finished its control channel: a partial frame
                // left over is an error; otherwise nothing more comes.
                if self.reader.finish().is_err() {
                    self.reader = FrameReader::new(0);
                    return Next::Step(self.state.on_frame_error(FrameError::Truncated));
                }
                return Next::Idle;
            }
            let Some((got, end)) = link.read_control(budget, &mut self.reader) else {
                return Next::Idle;
            };
            match end {
                ReadEnd::Open => {}
                ReadEnd::Finished => self.control_done = true,
                ReadEnd::Reset => {
                    self.control_done = true;
                    self.reader = FrameReader::new(0);
                }
            }
            if got == 0 && end == ReadEnd::Open {
                return Next::Idle;
            }
        }
    }

    /// The session's own bookkeeping: `queued` is what its push queues hold.
    pub fn check(&self) -> Result<(), String> {
        let held: usize = self
            .pushes
            .iter()
            .flat_map(|p| p.iter())
            .flat_map(|q| q.iter())
            .map(|(_, b)| queued_cost(b))
            .sum();
        if held != self.queued {
            return Err(format!("{} push bytes counted, {held} held", self.queued));
        }
        if self.is_ended() && (self.queued != 0 || self.pushes.is_some() || !self.unsent.is_empty())
        {
            return Err("an ended session still holds pushes or answers".into());
        }
        Ok(())
    }

    /// Whether the peer already finished its control channel (a second
    /// one is refused).
    pub fn control_done(&self) -> bool {
        self.control_done
    }
}
