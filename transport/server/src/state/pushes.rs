//! Pushes to sessions: the hub's outputs routed to their connections,
//! the push queues written out, and the slowest readers closed past the
//! push byte budget.

use super::{slot, ServerState};
use crate::hub::HubOutput;
use crate::session::{tier_index, Pushed};
use bytes::Bytes;
use greendot_core::{EndReason, SessionId, Tier};
use greendot_proto::CloseCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tracing::warn;

impl ServerState {
    /// Sends every output of the hub (and, in a cluster, of the edge's
    /// fanout and the cluster link) where it goes.
    pub(super) fn route(&mut self, now: Instant) {
        loop {
            while let Some(output) = self.hub.poll_output() {
                match output {
                    HubOutput::Push {
                        session,
                        tier,
                        frame,
                    } => self.deliver(now, session, tier, frame),
                    HubOutput::End { session, reason } => self.session_ended(now, session, reason),
                }
            }
            self.close_for_tokens(now);
            // Groups fed to the hub's core: their pushes are the hub's.
            if !(self.cluster.is_some() && self.route_cluster(now)) {
                break;
            }
        }
        self.within_budget(now);
    }

    /// The core ended a session: its connection is closed with the reason.
    pub(super) fn session_ended(&mut self, now: Instant, session: SessionId, reason: EndReason) {
        if let Some(c) = self.cluster.as_deref_mut() {
            match reason {
                EndReason::Superseded => c.session_superseded(session),
                _ => c.session_ended(session),
            }
        }
        let Some(&ch) = self.sessions.get(&session) else {
            return;
        };
        let (code, text): (CloseCode, &[u8]) = match reason {
            EndReason::Superseded => (CloseCode::Superseded, b"the device connected again"),
            EndReason::HeartbeatTimeout => (CloseCode::SessionExpired, b"no sign of life in time"),
            EndReason::GraceExpired => (CloseCode::SessionExpired, b"not back within grace"),
            // The logout's answer goes out first, then the close.
            EndReason::LoggedOut => return,
        };
        self.close(ch, now, code, text);
    }

    /// One push to a session's stream of `tier`.
    pub(super) fn deliver(&mut self, now: Instant, session: SessionId, tier: Tier, frame: Bytes) {
        let Some(&ch) = self.sessions.get(&session) else {
            return;
        };
        let limit = self.config.push_queue_bytes;
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        match conn
            .session
            .push(&mut conn.link, tier_index(tier), now, frame, limit)
        {
            Pushed::Sent => {
                self.stats.latency.observe(Duration::ZERO);
                self.touch(ch);
            }
            Pushed::Queued(n) => {
                self.queued += n;
                self.touch(ch);
            }
            Pushed::Dropped => self.touch(ch),
            Pushed::Stalled => {
                warn!(%session, "push queue full: closing the stalled connection");
                self.overloaded(ch, now);
            }
        }
    }

    pub(super) fn write_pushes(&mut self, ch: usize, now: Instant, tier: usize) {
        let Some(conn) = slot(&mut self.conns, ch) else {
            return;
        };
        let latency = &self.stats.latency;
        let freed = conn.session.write_pushes(&mut conn.link, tier, |at| {
            latency.observe(now.saturating_duration_since(at))
        });
        self.queued -= freed;
    }

    pub(super) fn overloaded(&mut self, ch: usize, now: Instant) {
        self.stats.overloaded.fetch_add(1, Ordering::Relaxed);
        self.close(ch, now, CloseCode::Overloaded, b"pushes not read in time");
    }

    /// Past the server's push byte budget, the slowest readers (the largest
    /// queues) are closed until the rest fits: a few clients that do not
    /// read cannot make the server run out of memory for everybody.
    pub(super) fn within_budget(&mut self, now: Instant) {
        let budget = self.config.push_budget_bytes;
        if self.queued <= budget {
            return;
        }
        let mut queues: Vec<(usize, usize)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(ch, c)| Some((c.as_deref()?.session.queued, ch)))
            .filter(|&(queued, _)| queued > 0)
            .collect();
        queues.sort_unstable_by(|a, b| b.cmp(a));
        for (_, ch) in queues {
            if self.queued <= budget {
                break;
            }
            warn!(ch, "push byte budget exceeded: closing the slowest reader");
            self.overloaded(ch, now);
        }
    }
}
