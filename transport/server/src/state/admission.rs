//! Admission: how a new QUIC connection is shed or accepted (the
//! handshake rate following the loop's load, the per-address and capacity
//! limits, Retry), the handshakes in flight, and the hold on devices
//! restored at start while the server still sheds.

use super::link::{quic_slot, Link};
use super::rng::SmallRng;
use super::{Conn, ServerState};
use crate::conn::ConnState;
use crate::quic::QuicLink;
use crate::session::{Phase, Session};
use crate::{readmit_ms, ServerEvent, Shed};
use greendot_core::Millis;
use quinn_proto::ConnectionHandle;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

/// Connections allowed past `max_connections` while they handshake.
const HANDSHAKE_HEADROOM: usize = 1024;

/// How often the server looks whether it still sheds while restored devices
/// wait ([`ServerState::hold_restored`]), and the step their deadlines move by.
pub(super) const HOLD_TICK: Duration = Duration::from_secs(1);

const HOLD_STEP: Duration = Duration::from_secs(5);

/// How a new connection is accepted: its server config, one of the
/// keep-alive variants, picked by the state's own randomness.
pub(crate) struct Accept {
    /// (keep-alive interval, server config with it).
    variants: Vec<(Duration, Arc<quinn_proto::ServerConfig>)>,
    rng: SmallRng,
}

impl Accept {
    pub(super) fn new(
        variants: Vec<(Duration, Arc<quinn_proto::ServerConfig>)>,
        seed: u64,
    ) -> Accept {
        Accept {
            variants,
            rng: SmallRng::new(seed),
        }
    }

    /// A new connection's server config (`None`: the endpoint's own).
    pub(crate) fn pick(&mut self) -> Option<&(Duration, Arc<quinn_proto::ServerConfig>)> {
        let n = self.variants.len() as u64;
        if n == 0 {
            return None;
        }
        let i = self.rng.below(n);
        self.variants.get(usize::try_from(i).ok()?)
    }
}

/// The admission rate: a token bucket of handshakes, refilled at `rate`,
/// holding at most one second's worth.
pub(crate) struct Pacer {
    rate: f64,
    tokens: f64,
    at: Instant,
}

/// How the admission rate follows the loop's load (see
/// [`ServerInput::Load`](super::ServerInput::Load)): cut by [`Admission::CUT`] in every report of an
/// overloaded loop (the socket dropped datagrams, or a pass left datagrams
/// unread past its budget: a backlog), raised by [`Admission::STEP`] of the
/// configured rate in every report of a loop with room (neither, and busy
/// less than [`Admission::ROOM`] of the time), never below
/// [`Admission::FLOOR`] of it. A loop that is busy but keeps up is at
/// capacity, not overloaded: the rate is kept.
/// A static rate is either above what a loaded machine can complete (then
/// handshakes pile up, time out and are retried, and the retries take the
/// CPU established sessions need) or wastes an idle one.
pub(super) struct Admission {
    pacer: Pacer,
    max: f64,
}

impl Admission {
    /// Busy share of the loop's wall time below which the rate goes back
    /// up (a CPU-starved loop counts as busy: its passes take longer).
    pub(super) const ROOM: f64 = 0.75;
    pub(super) const CUT: f64 = 0.7;
    pub(super) const STEP: f64 = 0.05;
    pub(super) const FLOOR: f64 = 0.05;

    pub(super) fn new(per_sec: u32, now: Instant) -> Admission {
        let pacer = Pacer::new(per_sec, now);
        Admission {
            max: pacer.rate,
            pacer,
        }
    }

    /// Whether a handshake may be admitted now (takes nothing: the other
    /// sheds come between this and [`Admission::take`]).
    fn has_room(&mut self, now: Instant) -> bool {
        self.pacer.refill(now);
        self.pacer.tokens >= 1.0
    }

    /// Takes the token [`Admission::has_room`] found.
    fn take(&mut self) {
        debug_assert!(self.pacer.tokens >= 1.0, "take without room");
        self.pacer.tokens -= 1.0;
    }

    /// The current rate, handshakes per second.
    pub(super) fn rate(&self) -> f64 {
        self.pacer.rate
    }

    /// One load report; `true` if the rate was cut.
    fn on_load(&mut self, busy: f64, socket_drops: u64, backlogged_passes: u32) -> bool {
        let floor = (self.max * Self::FLOOR).max(1.0);
        let rate = self.pacer.rate;
        let (next, cut) = if socket_drops > 0 || backlogged_passes > 0 {
            ((rate * Self::CUT).max(floor), true)
        } else if busy < Self::ROOM {
            ((rate + self.max * Self::STEP).min(self.max), false)
        } else {
            (rate, false)
        };
        self.pacer.rate = next;
        self.pacer.tokens = self.pacer.tokens.min(next);
        cut
    }
}

impl Pacer {
    pub(crate) fn new(per_sec: u32, now: Instant) -> Pacer {
        let rate = f64::from(per_sec.max(1));
        Pacer {
            rate,
            tokens: rate,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = self.at.max(now);
        self.tokens = (self.tokens + elapsed * self.rate).min(self.rate);
    }

    /// Takes a token if there is one.
    pub(crate) fn admit(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl ServerState {
    /// A new client's first packet: shed it early and cheaply when the
    /// server is past what it can take, otherwise accept it.
    pub(super) fn on_incoming(
        &mut self,
        now: Instant,
        incoming: quinn_proto::Incoming,
        mut buf: Vec<u8>,
    ) {
        let config = &self.config;
        let ip = incoming.remote_address().ip();
        let from_ip = self.per_address.get(&ip).copied().unwrap_or(0);
        let crowded = self.handshaking >= config.retry_threshold
            || from_ip >= config.max_handshakes_per_address;
        // Connections still in their handshake count too: past the cap plus
        // some headroom (where clients still get the typed
        // `TooManyConnections` close) a new one is refused outright.
        let cap = config.max_connections.saturating_add(HANDSHAKE_HEADROOM);
        let shed = if self.stopping.is_some() {
            Some(Shed::Draining)
        } else if !self.admission.has_room(now) {
            // Refused now rather than after a Retry's round trip: a Retry
            // brings the Initial straight back, to be refused then.
            Some(Shed::Rate)
        } else if crowded && !incoming.remote_address_validated() && incoming.may_retry() {
            Some(Shed::Retry)
        } else if from_ip >= config.max_handshakes_per_address {
            Some(Shed::PerAddress)
        } else if self.endpoint.open_connections() >= cap {
            Some(Shed::Capacity)
        } else {
            None
        };
        if let Some(reason) = shed {
            if !self.shed_answers.admit(now) {
                // A herd or a flood: answering each Initial would take the
                // loop the admitted handshakes need.
                self.stats.shed(Shed::Ignored);
                self.endpoint.ignore(incoming);
                self.recycle(buf);
                return;
            }
            self.stats.shed(reason);
            let t = match reason {
                Shed::Retry => match self.endpoint.retry(incoming, &mut buf) {
                    Ok(t) => t,
                    Err(e) => self.endpoint.refuse(e.into_incoming(), &mut buf),
                },
                _ => self.endpoint.refuse(incoming, &mut buf),
            };
            self.queue_transmit(t, buf);
            return;
        }
        self.admission.take();
        let remote = incoming.remote_address();
        let server_config = self.accept.pick().map(|(_, c)| c.clone());
        match self.endpoint.accept(incoming, now, &mut buf, server_config) {
            Ok((ch, quic)) => {
                self.recycle(buf);
                self.insert(ch, quic, ip, now);
            }
            Err(e) => {
                match e.response {
                    Some(t) => self.queue_transmit(t, buf),
                    None => self.recycle(buf),
                }
                debug!(%remote, error = %e.cause, "handshake refused");
                self.stats.reject("handshake");
                self.event(ServerEvent::Rejected {
                    remote,
                    reason: format!("handshake failed: {}", e.cause),
                });
            }
        }
    }

    /// A new connection, counted among the handshakes in flight, with
    /// `hello_timeout` from now to complete and send its hello.
    pub(super) fn insert(
        &mut self,
        ch: ConnectionHandle,
        quic: quinn_proto::Connection,
        ip: IpAddr,
        now: Instant,
    ) {
        self.next_serial += 1;
        let phase = Phase::Handshaking {
            ip,
            hello_by: now + self.config.hello_timeout,
        };
        let session = Session::new(
            ConnState::new(self.keys.clone(), self.config.rate),
            self.config.max_hello.min(self.config.max_frame),
            quic.remote_address(),
            self.clock.at(now),
            phase,
        );
        let ch = quic_slot(ch);
        let conn = Conn {
            link: Link::Quic(QuicLink::new(quic)),
            session,
            serial: self.next_serial,
            touched: false,
            counted: false,
        };
        if self.conns.len() <= ch {
            self.conns.resize_with(ch + 1, || None);
        }
        self.conns[ch] = Some(Box::new(conn));
        self.handshaking += 1;
        *self.per_address.entry(ip).or_default() += 1;
        self.stats
            .handshaking
            .store(self.handshaking, Ordering::Relaxed);
        self.touch(ch);
    }

    /// A handshake no longer in flight (it completed, or the connection
    /// ended during it).
    pub(super) fn handshake_over(&mut self, ip: IpAddr) {
        self.handshaking = self.handshaking.saturating_sub(1);
        if let Some(n) = self.per_address.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_address.remove(&ip);
            }
        }
        self.stats
            .handshaking
            .store(self.handshaking, Ordering::Relaxed);
    }

    /// A handshake the client abandoned or lost (its network came back
    /// mid-attempt, or it gave up): counted apart from bad input.
    pub(super) fn handshake_failed(&mut self, remote: SocketAddr, error: &str, aborted: bool) {
        debug!(%remote, %error, "handshake failed");
        if aborted {
            // Not bad input: a client whose network went away mid-handshake.
            self.stats
                .handshakes_aborted
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.stats.reject("handshake");
        self.event(ServerEvent::Rejected {
            remote,
            reason: format!("handshake failed: {error}"),
        });
    }

    /// The reconnect spread suggested in a close for shedding or draining:
    /// the time to readmit every open connection at the admission rate.
    pub(super) fn retry_ms(&self) -> u64 {
        let open = self.stats.open.load(Ordering::Relaxed);
        readmit_ms(open, self.config.max_handshakes_per_sec)
    }

    /// A report of the loop's load: the admission rate follows it.
    pub(super) fn on_load(
        &mut self,
        busy_permille: u32,
        socket_drops: u64,
        backlogged_passes: u32,
    ) {
        self.stats
            .loop_busy_permille
            .store(u64::from(busy_permille), Ordering::Relaxed);
        let busy = f64::from(busy_permille) / 1000.0;
        if self
            .admission
            .on_load(busy, socket_drops, backlogged_passes)
        {
            self.stats.admission_cuts.fetch_add(1, Ordering::Relaxed);
        }
        self.stats
            .admission_rate
            .store(self.admission.rate() as u64, Ordering::Relaxed);
    }

    /// Devices restored at start come back at the rate the server admits
    /// handshakes, which under a herd can be well below the configured one
    /// the first estimate used (`restore`). While the server still sheds,
    /// each still waiting lingers until at least its grace past the shed
    /// client's retry spread; once the shedding stops, their grace runs
    /// out as usual. Deadlines go up in steps of [`HOLD_STEP`] so that a
    /// device's timer moves once per step, not once per tick.
    pub(super) fn hold_restored(&mut self, now: Instant) {
        self.next_hold = Some(now + HOLD_TICK);
        let shed = self.stats.shed_total();
        if shed == self.shed_seen {
            return;
        }
        self.shed_seen = shed;
        let at = self.clock.at(now);
        let step = HOLD_STEP.as_millis() as u64;
        let from = Millis(at.0.saturating_add(self.retry_ms()).div_ceil(step) * step);
        // Within one step every deadline is already there.
        if from <= self.held_from {
            return;
        }
        self.held_from = from;
        if self.hub.hold_restored(at, from) == 0 {
            self.next_hold = None;
        }
    }
}
