//! Connections and their lifecycle: driving one (its binding's events,
//! transmits and timer), WebSocket connections opened and fed by the
//! driver, a migration, the connection counted open, its end reported
//! once, and the close.

use super::drain::DRAIN_HOLD;
use super::link::Link;
use super::{slot, Conn, ServerMutant, ServerOutput, ServerState};
use crate::cluster::WireOp;
use crate::conn::ConnState;
use crate::session::{Binding, Happened, Overdue, Phase, Session};
use crate::ws::{ws_code, WsId, WsLink, WsMessage, WsOut};
use crate::{with_retry_hint, ServerEvent, Shed};
use greendot_proto::CloseCode;
use quinn_proto::ConnectionHandle;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tracing::debug;

impl ServerState {
    /// The due connection timers, at most the budget of them (earliest
    /// first; the rest stay due for the next call).
    pub(super) fn connection_timers(&mut self, now: Instant) {
        for _ in 0..self.budget.timers {
            let Some(ch) = self.timers.pop_due(now) else {
                break;
            };
            let Some(conn) = self.conn(ch) else {
                continue;
            };
            conn.link.handle_timeout(now);
            match conn.session.overdue(now) {
                Some(Overdue::Close(code, text)) => self.close(ch, now, code, &text),
                Some(Overdue::NoHello { handshaking }) => {
                    if handshaking {
                        self.stats.shed(Shed::HandshakeTimeout);
                    }
                    self.close(ch, now, CloseCode::HelloTimeout, b"no hello in time");
                }
                None => {}
            }
            self.touch(ch);
        }
    }

    /// Everything a connection has to say and do, then its transmits and its
    /// timer.
    pub(super) fn drive(&mut self, ch: usize, now: Instant) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        conn.touched = false;
        let mut drained = false;
        loop {
            if !drained {
                drained = self.endpoint_events(ch);
            }
            let Some(conn) = slot(&mut self.conns, ch) else {
                return;
            };
            let refuse = conn.session.control_done();
            let (happened, aborted) = match &mut conn.link {
                Link::Quic(link) => {
                    let Some(event) = link.quic.poll() else {
                        break;
                    };
                    let aborted = match &event {
                        quinn_proto::Event::ConnectionLost { reason } => {
                            crate::handshake_aborted(reason)
                        }
                        _ => false,
                    };
                    (link.translate(event, refuse, now), aborted)
                }
                Link::Ws(link) => {
                    let Some(happened) = link.poll() else {
                        break;
                    };
                    (Some(happened), false)
                }
            };
            if let Some(happened) = happened {
                self.on_happened(ch, now, happened, aborted);
            }
        }
        self.check_address(ch, now);
        self.route(now);
        if drained {
            self.remove(ch);
            return;
        }
        if let Some(Link::Ws(link)) = slot(&mut self.conns, ch).map(|c| &mut c.link) {
            let id = link.id;
            let gone = link.gone;
            while let Some(out) = link.poll_out() {
                self.outputs.push_back(match out {
                    WsOut::Send(bytes) => ServerOutput::WsSend { id, bytes },
                    WsOut::Ping => ServerOutput::WsPing { id },
                    WsOut::Close(code, reason) => ServerOutput::WsClose { id, code, reason },
                    WsOut::Credit(bytes) => ServerOutput::WsCredit { id, bytes },
                });
            }
            if gone {
                self.remove(ch);
                return;
            }
        }
        let segments = self.max_datagrams;
        loop {
            let mut buf = self.buffer();
            let Some(quic) = slot(&mut self.conns, ch).and_then(|c| c.link.quic()) else {
                self.recycle(buf);
                break;
            };
            // quinn-proto writes each transmit from the start of `buf`.
            match quic.poll_transmit(now, segments, &mut buf) {
                Some(t) => self.queue_transmit(t, buf),
                None => {
                    self.recycle(buf);
                    break;
                }
            }
        }
        // Transmitting can emit endpoint events (new connection ids).
        if self.endpoint_events(ch) {
            self.remove(ch);
            return;
        }
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        let next = match (conn.link.poll_timeout(), conn.session.phase.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.timers.set(ch, next);
    }

    /// Hands a connection's endpoint events to the endpoint; `true` once the
    /// connection is drained (the endpoint has forgotten it: nothing more may
    /// be handed over for it).
    pub(super) fn endpoint_events(&mut self, ch: usize) -> bool {
        let Some(quic) = slot(&mut self.conns, ch).and_then(|c| c.link.quic()) else {
            return false;
        };
        while let Some(event) = quic.poll_endpoint_events() {
            let drained = event.is_drained();
            if let Some(back) = self.endpoint.handle_event(ConnectionHandle(ch / 2), event) {
                quic.handle_event(back);
            }
            if drained {
                return true;
            }
        }
        false
    }

    pub(super) fn remove(&mut self, ch: usize) {
        self.end(ch, false, "drained".into());
        debug!(slot = ch, "connection forgotten");
        if let Some(conn) = self.conns.get_mut(ch).and_then(Option::take) {
            self.timers.set(ch, None);
            if let Link::Ws(link) = &conn.link {
                self.ws.remove(&link.id);
                self.ws_free.push(ch);
            }
        }
    }

    /// A WebSocket connection is open (its TLS and upgrade are the
    /// driver's): it counts as connected at once, with `hello_timeout` for
    /// its hello, under the same connection cap as QUIC.
    pub(super) fn ws_opened(&mut self, now: Instant, id: WsId, remote: SocketAddr) {
        if self.ws.contains_key(&id) {
            return;
        }
        if self.stopping.is_some() {
            self.outputs.push_back(ServerOutput::WsClose {
                id,
                code: Some(ws_code(CloseCode::Draining)),
                reason: "server draining".into(),
            });
            return;
        }
        let ch = self.ws_free.pop().unwrap_or_else(|| {
            // The next odd slot past the table.
            let n = self.conns.len();
            n | 1
        });
        if self.conns.len() <= ch {
            self.conns.resize_with(ch + 1, || None);
        }
        self.next_serial += 1;
        let hello_by = now + self.config.hello_timeout;
        let session = Session::new(
            ConnState::new(self.keys.clone(), self.config.rate),
            self.config.max_hello.min(self.config.max_frame),
            remote,
            self.clock.at(now),
            Phase::AwaitingHello { hello_by },
        );
        let link = WsLink::new(
            id,
            remote,
            now,
            self.config.max_frame,
            self.config.keep_alive,
            self.config.idle_timeout,
            self.ws_rng.next() & 1 == 0,
        );
        self.conns[ch] = Some(Box::new(Conn {
            link: Link::Ws(link),
            session,
            serial: self.next_serial,
            touched: false,
            counted: false,
        }));
        self.ws.insert(id, ch);
        self.on_connected(ch, now);
        self.touch(ch);
    }

    /// A message from WebSocket `id`: a sign of life, and work for its session.
    pub(super) fn ws_received(&mut self, now: Instant, id: WsId, message: WsMessage) {
        let heard = self.clock.at(now);
        let renew = !self.mutant(ServerMutant::LeaseNotRenewedOnTraffic);
        let Some(ch) = self.ws.get(&id).copied() else {
            return;
        };
        let Some(conn) = self.conn(ch) else { return };
        if let Link::Ws(link) = &mut conn.link {
            if renew {
                conn.session.last_heard = heard;
            }
            link.received(now, message);
        }
        self.touch(ch);
    }

    pub(super) fn with_ws(&mut self, id: WsId, f: impl FnOnce(&mut WsLink)) {
        let Some(ch) = self.ws.get(&id).copied() else {
            return;
        };
        if let Some(Link::Ws(link)) = self.conn(ch).map(|c| &mut c.link) {
            f(link);
        }
        self.touch(ch);
    }

    pub(super) fn check_address(&mut self, ch: usize, now: Instant) {
        let Some(conn) = self.conn(ch) else { return };
        let to = conn.link.remote();
        if to == conn.session.address || conn.session.is_ended() {
            return;
        }
        let from = std::mem::replace(&mut conn.session.address, to);
        let session = conn.session.id;
        self.stats.migrations.fetch_add(1, Ordering::Relaxed);
        debug!(?session, %from, %to, "migrated");
        self.event(ServerEvent::Migrated {
            session: session.map(|s| self.wire(s)),
            from,
            to,
        });
        if self.mutant(ServerMutant::MigrationAsDisconnect) {
            self.close(ch, now, CloseCode::Normal, b"address changed");
        }
    }

    /// What the binding reported, in session terms.
    pub(super) fn on_happened(
        &mut self,
        ch: usize,
        now: Instant,
        happened: Happened,
        aborted: bool,
    ) {
        match happened {
            Happened::Connected => self.on_connected(ch, now),
            Happened::Lost { logout, reason } => {
                let Some(conn) = self.conn(ch) else { return };
                if matches!(conn.session.phase, Phase::Handshaking { .. }) {
                    let remote = conn.session.address;
                    self.handshake_failed(remote, &reason, aborted);
                }
                self.end(ch, logout, reason);
            }
            Happened::ControlReadable => self.read_control(ch, now),
            Happened::ControlWritable => {
                self.write_answers(ch, now);
                // Requests held back behind unread answers.
                self.read_control(ch, now);
            }
            Happened::PushWritable(tier) => self.write_pushes(ch, now, tier),
            Happened::PushStopped => {
                // A client that stops a push stream would stay online while
                // missing every update of that tier: a protocol error.
                let Some(conn) = self.conn(ch) else { return };
                let remote = conn.session.address;
                self.stats.reject("StreamStopped");
                self.event(ServerEvent::Rejected {
                    remote,
                    reason: "the client stopped a push stream".into(),
                });
                self.close(
                    ch,
                    now,
                    CloseCode::StreamStopped,
                    b"the client stopped a push stream",
                );
            }
            Happened::ControlStopped => {
                // The client reads no more answers: what waits for it is
                // dropped (the write fails), which may unblock the reading
                // or the close.
                self.write_answers(ch, now);
                self.after_answers(ch, now);
            }
            Happened::AnswersDelivered => self.after_answers(ch, now),
        }
    }

    /// The answers are all out (or dropped): close if a close was waiting
    /// for them, otherwise read the requests held back.
    pub(super) fn after_answers(&mut self, ch: usize, now: Instant) {
        let Some(conn) = self.conn(ch) else { return };
        if !conn.link.has_control() || !conn.session.answers_out() {
            return;
        }
        match conn.session.answers_delivered() {
            Some((code, text)) => self.close(ch, now, code, &text),
            None => self.read_control(ch, now),
        }
    }

    pub(super) fn on_connected(&mut self, ch: usize, now: Instant) {
        let hello = now + self.config.hello_timeout;
        let Some(conn) = self.conn(ch) else { return };
        // Counted once, and never after its end was reported (a late
        // report must not count a connection nothing will uncount).
        if conn.counted || conn.session.is_ended() {
            return;
        }
        // The hello is due `hello_timeout` after the first packet (set when
        // accepted), not after a slow handshake.
        let hello_by = conn.session.phase.deadline().unwrap_or(hello);
        let ip = conn.session.connected(hello_by);
        if let Some(ip) = ip {
            self.handshake_over(ip);
        }
        let stats = self.stats.clone();
        let open = stats.open.load(Ordering::Relaxed);
        stats.total.fetch_add(1, Ordering::Relaxed);
        if open >= self.config.max_connections {
            stats.reject("TooManyConnections");
            let text = with_retry_hint(
                b"TooManyConnections: the server is at its connection cap",
                self.retry_ms(),
            );
            // Connected but never counted: closed and reported at once.
            let Some(conn) = self.conn(ch) else { return };
            conn.link.close(now, CloseCode::TooManyConnections, &text);
            conn.session.end();
            self.touch(ch);
            self.event(ServerEvent::Closed {
                session: None,
                logout: false,
                reason: "closed by the server: TooManyConnections".into(),
            });
            return;
        }
        let Some(conn) = self.conn(ch) else { return };
        conn.counted = true;
        let (ws, wt) = (conn.link.is_ws(), conn.link.is_webtransport());
        stats.open.fetch_add(1, Ordering::Relaxed);
        if ws {
            stats.open_websocket.fetch_add(1, Ordering::Relaxed);
        }
        if wt {
            stats.open_webtransport.fetch_add(1, Ordering::Relaxed);
        }
        // Frames that came with the end of the handshake.
        self.read_control(ch, now);
    }

    /// The connection is over for the application: report it once.
    pub(super) fn end(&mut self, ch: usize, logout: bool, reason: String) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        if conn.session.is_ended() {
            return;
        }
        let was = conn.session.end();
        let connected = std::mem::take(&mut conn.counted);
        let session = conn.session.id;
        let last_heard = conn.session.last_heard;
        let ws = conn.link.is_ws();
        let wt = conn.link.is_webtransport();
        self.queued -= std::mem::take(&mut conn.session.queued);
        if let Phase::Handshaking { ip, .. } = was {
            self.handshake_over(ip);
        }
        if connected {
            uncount(&self.stats.open);
            if ws {
                uncount(&self.stats.open_websocket);
            }
            if wt {
                uncount(&self.stats.open_webtransport);
            }
        }
        if let Some(session) = session {
            if self.sessions.get(&session) == Some(&ch) {
                self.sessions.remove(&session);
            }
            let now = self.clock.at(self.last_now);
            if self.drain_holds && !logout {
                self.hub
                    .closed_until(now, session, last_heard.min(now), now.plus(DRAIN_HOLD));
            } else {
                self.hub.closed(now, session, logout, last_heard.min(now));
            }
            if let Some(c) = self.cluster.as_deref_mut() {
                let op = if logout {
                    WireOp::Logout
                } else {
                    WireOp::Disconnect {
                        last_heard: last_heard.min(now).0,
                    }
                };
                c.input(self.last_now, now, session, op, None);
            }
        }
        if connected {
            let session = session.map(|s| self.wire(s));
            self.event(ServerEvent::Closed {
                session,
                logout,
                reason,
            });
        }
    }

    /// Closes the connection now (the peer gets `code` and `text`).
    pub(super) fn close(&mut self, ch: usize, now: Instant, code: CloseCode, text: &[u8]) {
        let Some(conn) = self.conn(ch) else { return };
        conn.link.close(now, code, text);
        self.touch(ch);
        self.end(ch, false, format!("closed by the server: {code:?}"));
    }
}

/// One connection less on `count`. A count taken below zero is a bug in
/// the bookkeeping (a debug build stops there); a release build keeps it at
/// zero rather than wrap to a count that refuses everyone.
fn uncount(count: &AtomicUsize) {
    let was = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    debug_assert!(was.is_ok(), "an open-connection count went below zero");
}
