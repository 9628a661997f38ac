//! Requests that wait under a ticket: for a durable store write, for the
//! cluster, or the final write of a stop; answered when it comes back or
//! at its deadline.

use super::ServerState;
use crate::conn::Handled;
use crate::not_saved;
use crate::session::Phase;
use crate::store::StoreError;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tracing::warn;

/// What a durable write in flight is for.
pub(super) enum Ticket {
    /// A request's answer waits for it.
    Answer {
        ch: usize,
        serial: u64,
        handled: Handled,
        deadline: Instant,
    },
    /// The final write of a stop.
    Stop { deadline: Instant },
    /// A request's answer waits for the owner of its user (in a cluster);
    /// the cluster link answers before `deadline`, which is a backstop.
    Cluster {
        ch: usize,
        serial: u64,
        handled: Handled,
        deadline: Instant,
    },
}

impl Ticket {
    pub(super) fn deadline(&self) -> Instant {
        match self {
            Ticket::Answer { deadline, .. }
            | Ticket::Stop { deadline }
            | Ticket::Cluster { deadline, .. } => *deadline,
        }
    }
}

impl ServerState {
    pub(super) fn ticket(&mut self, ticket: Ticket) -> u64 {
        self.next_ticket += 1;
        self.ticket_deadlines
            .insert((ticket.deadline(), self.next_ticket));
        self.tickets.insert(self.next_ticket, ticket);
        self.next_ticket
    }

    pub(super) fn store_done(&mut self, now: Instant, ticket: u64, result: Result<(), StoreError>) {
        let Some(waiting) = self.tickets.remove(&ticket) else {
            // Timed out already (answered then), or unknown.
            return;
        };
        self.ticket_deadlines.remove(&(waiting.deadline(), ticket));
        match waiting {
            Ticket::Answer {
                ch,
                serial,
                handled,
                ..
            } => self.saved(now, ch, serial, ticket, handled, result.err()),
            Ticket::Cluster { .. } => {}
            Ticket::Stop { .. } => {
                if let Err(e) = result {
                    warn!(error = %e, "the store was not written at the stop");
                    self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                }
                self.stopped();
            }
        }
    }

    /// A durable write finished (or failed, or timed out): answer the
    /// request that waited for it, then the frames behind it.
    pub(super) fn saved(
        &mut self,
        now: Instant,
        ch: usize,
        serial: u64,
        ticket: u64,
        handled: Handled,
        error: Option<StoreError>,
    ) {
        let handled = match error {
            None => handled,
            Some(error) => {
                self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                not_saved(handled, &error.to_string())
            }
        };
        let Some(conn) = self.conn(ch) else { return };
        if conn.serial != serial {
            return;
        }
        match conn.session.phase {
            Phase::WaitingStore { ticket: t } if t == ticket => conn.session.phase = Phase::Live,
            _ => return,
        }
        self.answer(ch, now, handled);
        // Frames that waited behind it.
        self.read_control(ch, now);
        self.touch(ch);
    }

    /// Durable writes that took too long: answered "not saved".
    pub(super) fn expire_tickets(&mut self, now: Instant) {
        while let Some(&(deadline, ticket)) = self.ticket_deadlines.first() {
            if deadline > now {
                break;
            }
            self.ticket_deadlines.pop_first();
            let Some(waiting) = self.tickets.remove(&ticket) else {
                continue;
            };
            let error = StoreError::Timeout(self.config.store_timeout);
            match waiting {
                Ticket::Answer {
                    ch,
                    serial,
                    handled,
                    ..
                } => self.saved(now, ch, serial, ticket, handled, Some(error)),
                Ticket::Cluster {
                    ch,
                    serial,
                    handled,
                    ..
                } => {
                    let mut handled = not_saved(handled, "the owner of this user did not answer");
                    self.refresh_welcome(&mut handled);
                    self.saved(now, ch, serial, ticket, handled, None);
                }
                Ticket::Stop { .. } => {
                    warn!("the store was not written at the stop: no commit in time");
                    self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                    self.stopped();
                }
            }
        }
    }
}
