//! A connection's requests and answers: frames read from its control
//! channel, handed to the hub (or the cluster, or a durable write), the
//! welcome, and the answers written back in order.

use super::cluster_requests::forwarded_op;
use super::tickets::Ticket;
use super::{slot, ServerMutant, ServerOutput, ServerState, StoreRequest};
use crate::conn::{Handled, Step};
use crate::session::{Binding, Flushed, Next, Pushed};
use crate::store::Batch;
use crate::{durable_user, reason_label, reason_text, record, ServerEvent};
use greendot_core::SessionId;
use greendot_proto::{self as proto, encode_frame, CloseCode, ServerFrame};
use std::time::{Duration, Instant};

/// How long a closing answer may take to reach the peer.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// Bytes read from a control stream per round: one maximal frame and its
/// prefix, so what is buffered per connection stays bounded.
fn read_budget(max_frame: usize) -> usize {
    max_frame + 4
}

impl ServerState {
    /// Reads and handles frames until the control channel has no more, or
    /// the connection waits (for the store, for its answers to be read) or
    /// is condemned.
    pub(super) fn read_control(&mut self, ch: usize, now: Instant) {
        let budget = read_budget(self.config.max_frame);
        let at = self.clock.at(now);
        loop {
            let Some(conn) = slot(&mut self.conns, ch) else {
                return;
            };
            match conn.session.next_frame(&mut conn.link, at, budget) {
                Next::Step(step) => self.on_step(ch, now, step),
                Next::Idle => break,
            }
        }
        self.touch(ch);
    }

    pub(super) fn on_step(&mut self, ch: usize, now: Instant, step: Step) {
        let at = self.clock.at(now);
        let Some(conn) = self.conn(ch) else { return };
        let session = conn.session.id;
        let remote = conn.session.address;
        // Any frame of an established session is a sign of life.
        if let Some(s) = session {
            if !self.mutant(ServerMutant::LeaseNotRenewedOnTraffic) {
                self.hub.activity(at, s);
            }
        }
        if let Step::Close(e) = &step {
            self.stats.reject(&reason_label(e));
            self.event(ServerEvent::Rejected {
                remote,
                reason: e.to_string(),
            });
        }
        if !step.needs_hub() {
            let handled = Handled::default().merge_local(step);
            self.answer(ch, now, handled);
            return;
        }
        if self.mutant(ServerMutant::PushAfterLogout) {
            if let Step::Request {
                id,
                request: proto::Request::Logout,
                ..
            } = &step
            {
                let handled = Handled {
                    reply: Some(ServerFrame::Reply {
                        id: *id,
                        result: Ok(proto::Answer::Done),
                    }),
                    ..Handled::default()
                };
                self.answer(ch, now, handled);
                return;
            }
        }
        if self.cluster.is_some() {
            if let Step::Request {
                request:
                    proto::Request::Subscribe { .. }
                    | proto::Request::Unsubscribe { .. }
                    | proto::Request::Query { .. }
                    | proto::Request::Route { .. },
                ..
            } = &step
            {
                return self.cluster_subscription(ch, now, step);
            }
        }
        if self.cluster.is_some() {
            if let Step::Request {
                request:
                    proto::Request::SetGroup { .. }
                    | proto::Request::ChangeGroup { .. }
                    | proto::Request::RemoveGroup { .. },
                ..
            } = &step
            {
                return self.cluster_group_write(ch, now, step);
            }
            // Subscriptions and watches go to the hub's core, fed with
            // counts summed across the cluster and with the views of the
            // members its watched pages list; pages are read from the
            // group's aggregator and the members' owners (docs/groups.md).
            // Each is served from the protocol whose nodes all answer it.
            let link = self.cluster.as_deref();
            let groups = link.is_some_and(|c| c.serves_groups());
            let pages = link.is_some_and(|c| c.serves_pages());
            let unserved = match &step {
                Step::Request { id, request, .. } => match request {
                    proto::Request::GroupSubscribe { .. }
                    | proto::Request::GroupUnsubscribe { .. } => (!groups).then_some(*id),
                    proto::Request::GroupPage { .. }
                    | proto::Request::GroupWatchPage { .. }
                    | proto::Request::GroupRenewWatch { .. }
                    | proto::Request::GroupUnwatchPage { .. } => (!pages).then_some(*id),
                    _ => None,
                },
                _ => None,
            };
            if let Some(id) = unserved {
                let message = match groups {
                    true => {
                        "member pages are served in a cluster from protocol 5 \
                         (cluster_protocol); group subscriptions and writes are"
                    }
                    false => {
                        "groups are served in a cluster from protocol 4 \
                         (cluster_protocol); group writes are"
                    }
                };
                let error = proto::WireError::new(proto::ErrorCode::Unsupported, message);
                let handled = Handled {
                    reply: Some(ServerFrame::Reply {
                        id,
                        result: Err(error),
                    }),
                    ..Handled::default()
                };
                return self.answer(ch, now, handled);
            }
            if let Step::Request {
                request: proto::Request::GroupPage { .. } | proto::Request::GroupWatchPage { .. },
                ..
            } = &step
            {
                return self.cluster_group_page(ch, now, step);
            }
        }
        let forward = self.cluster.as_ref().and_then(|_| forwarded_op(&step));
        let durable = durable_user(&self.hub, &step);
        let resume = match &step {
            Step::Hello { resume, .. } => *resume,
            _ => None,
        };
        let refreshed = match &step {
            Step::Refresh { session, .. } => Some(*session),
            _ => None,
        };
        let fed = self.cluster.as_ref().is_some_and(|c| c.serves_groups());
        let group_sub = group_subscription(&step).filter(|_| fed);
        let mut handled = self.hub.apply(at, step);
        if let Some((session, group, subscribe)) = group_sub {
            let refused = match &handled.reply {
                Some(ServerFrame::Reply { result: Err(e), .. }) => Some(e.code),
                _ => None,
            };
            return match refused {
                Some(proto::ErrorCode::NotMember) if subscribe => {
                    self.confirm_group_subscribe(ch, now, (session, group), handled)
                }
                Some(_) => self.answer(ch, now, handled),
                None => {
                    self.record_group_subscription(ch, now, (session, group, subscribe), handled)
                }
            };
        }
        if let Some(s) = refreshed {
            self.after_refresh(at, s, &mut handled);
        }
        let revocations = self.hub.take_revocations();
        let group_writes = self.hub.take_group_writes();
        if let Some(s) = handled.welcomed {
            let elsewhere = match self.cluster {
                Some(_) => self.cluster_welcome(now, s, resume, &mut handled),
                None => None,
            };
            self.welcome(ch, now, s, &handled);
            // The welcome may have closed the connection (no push streams):
            // nothing more is done for it.
            if self.conn(ch).is_none_or(|c| c.session.is_ended()) {
                return;
            }
            if let Some(wire) = elsewhere {
                return self.resume_elsewhere(ch, now, s, wire, handled);
            }
        } else if let Some(ServerFrame::Error(e)) = &handled.reply {
            self.stats.reject(&reason_label(e));
            self.event(ServerEvent::Rejected {
                remote,
                reason: e.to_string(),
            });
        }
        let answered_ok = matches!(
            &handled.reply,
            Some(ServerFrame::Reply { result: Ok(_), .. })
        );
        if let Some((session, op)) = forward.filter(|_| answered_ok) {
            // In a cluster the owner of the user takes it before the answer.
            return self.cluster_wait(ch, now, session, op, handled);
        }
        let pending = durable
            .filter(|_| answered_ok && self.stored)
            .and_then(|user| record(&self.hub, user));
        let (revocations, group_writes) = match answered_ok && self.stored {
            true => (revocations, group_writes),
            false => (Vec::new(), Vec::new()),
        };
        match (pending, revocations.is_empty() && group_writes.is_empty()) {
            (None, true) => self.answer(ch, now, handled),
            // On disk before it is acknowledged; later frames wait.
            (user, _) => {
                let timeout = self.config.store_timeout;
                let Some(conn) = self.conn(ch) else { return };
                let serial = conn.serial;
                let ticket = self.ticket(Ticket::Answer {
                    ch,
                    serial,
                    handled,
                    deadline: now + timeout,
                });
                if let Some(conn) = self.conn(ch) {
                    conn.session.wait_for(ticket);
                }
                let batch = Batch {
                    users: user.into_iter().collect(),
                    revocations,
                    groups: group_writes,
                    ..Batch::default()
                };
                self.outputs
                    .push_back(ServerOutput::Store(StoreRequest::Durable {
                        ticket,
                        batch,
                        timeout,
                    }));
            }
        }
        // What the step made the core emit is routed by `drive` or `pump`.
    }

    pub(super) fn welcome(
        &mut self,
        ch: usize,
        now: Instant,
        session: SessionId,
        handled: &Handled,
    ) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        let opened = conn
            .session
            .welcome(session, &mut conn.link, self.config.max_frame);
        let remote = conn.session.address;
        if opened {
            // Each push stream starts with its tier.
            for (i, tier) in [(0, proto::Tier::Realtime), (1, proto::Tier::Batched)] {
                if let Ok(header) = encode_frame(&proto::Push::Stream { tier }) {
                    let pushed =
                        conn.session
                            .push(&mut conn.link, i, now, header.into(), usize::MAX);
                    if let Pushed::Queued(n) = pushed {
                        self.queued += n;
                    }
                }
            }
        }
        self.sessions.insert(session, ch);
        if let Some(ServerFrame::Welcome(w)) = &handled.reply {
            self.event(ServerEvent::Connected {
                session: self.wire(session),
                user: w.user.clone(),
                device: w.device.clone(),
                resumed: w.resumed,
                remote,
            });
        }
        if !opened {
            self.close(
                ch,
                now,
                CloseCode::ProtocolError,
                b"the client allows no push streams",
            );
        }
    }

    /// Sends the answer, and arranges the close it asks for.
    pub(super) fn answer(&mut self, ch: usize, now: Instant, handled: Handled) {
        let Some(conn) = self.conn(ch) else { return };
        if conn.session.is_ended() {
            return;
        }
        let frame = match &handled.reply {
            Some(frame) => encode_frame(frame).unwrap_or_default(),
            None => Vec::new(),
        };
        let close = handled.close.map(|code| {
            let text = match &handled.reply {
                Some(ServerFrame::Error(e)) => reason_text(e),
                _ => format!("{code:?}").into_bytes(),
            };
            (code, text)
        });
        let Some(conn) = self.conn(ch) else { return };
        // Let the answer reach the peer (or the peer stop the stream), then close.
        conn.session.answer(&frame, close, now + CLOSE_LINGER);
        self.touch(ch);
        let Some(conn) = self.conn(ch) else { return };
        if conn.link.has_control() {
            self.write_answers(ch, now);
        } else if let Some((code, text)) = conn.session.take_close() {
            self.close(ch, now, code, &text);
        }
    }

    pub(super) fn write_answers(&mut self, ch: usize, now: Instant) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        if let Flushed::Close(code, text) = conn.session.write_answers(&mut conn.link) {
            self.close(ch, now, code, &text);
        }
    }
}

/// A group subscribe or unsubscribe: (session, group, subscribe?).
fn group_subscription(step: &Step) -> Option<(SessionId, u64, bool)> {
    let Step::Request {
        session, request, ..
    } = step
    else {
        return None;
    };
    match request {
        proto::Request::GroupSubscribe { group } => Some((*session, *group, true)),
        proto::Request::GroupUnsubscribe { group } => Some((*session, *group, false)),
        _ => None,
    }
}
