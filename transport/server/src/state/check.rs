//! The state's check of its own bookkeeping (for simulators and tests).

use super::tickets::Ticket;
use super::ServerState;
use crate::session::Phase;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::Ordering;

impl ServerState {
    /// Switches on one deliberate bug of group presence in the hub's core
    /// (feature `mutants`): what a simulator's group checks must catch.
    #[cfg(feature = "mutants")]
    pub fn set_group_mutant(&mut self, mutant: Option<greendot_core::mutants::GroupMutant>) {
        self.hub.set_group_mutant(mutant);
    }

    /// Checks the state's own bookkeeping against itself (for simulators
    /// and tests; it walks every connection): the byte counts of the push
    /// queues, the session and handshake tables, the open-connection count,
    /// the timer and touched sets, the store tickets.
    pub fn check(&self) -> Result<(), String> {
        let mut queued = 0;
        let (mut open, mut open_ws, mut open_wt, mut handshaking) =
            (0usize, 0usize, 0usize, 0usize);
        let mut per_address: BTreeMap<IpAddr, usize> = BTreeMap::new();
        let touched: BTreeSet<usize> = self.touched.iter().copied().collect();
        for (ch, conn) in self.conns.iter().enumerate() {
            let Some(conn) = conn.as_deref() else {
                continue;
            };
            conn.session
                .check()
                .map_err(|e| format!("connection {ch}: {e}"))?;
            queued += conn.session.queued;
            match &conn.session.phase {
                Phase::Handshaking { ip, .. } => {
                    handshaking += 1;
                    *per_address.entry(*ip).or_default() += 1;
                }
                Phase::WaitingStore { ticket } => {
                    let waits_here = matches!(
                        self.tickets.get(ticket),
                        Some(Ticket::Answer { ch: c, serial, .. } | Ticket::Cluster { ch: c, serial, .. })
                            if *c == ch && *serial == conn.serial
                    );
                    if !waits_here {
                        return Err(format!(
                            "connection {ch} waits for ticket {ticket}, which is not its"
                        ));
                    }
                }
                _ => {}
            }
            if conn.session.phase.is_open() != conn.counted {
                return Err(format!(
                    "connection {ch}: phase {:?} but counted open: {}",
                    conn.session.phase, conn.counted
                ));
            }
            if conn.counted {
                open += 1;
                open_ws += usize::from(conn.link.is_ws());
                open_wt += usize::from(conn.link.is_webtransport());
            }
            if conn.touched != touched.contains(&ch) {
                return Err(format!("connection {ch}: touched mark and list disagree"));
            }
        }
        if queued != self.queued {
            return Err(format!(
                "{} push bytes counted, {queued} queued",
                self.queued
            ));
        }
        if self.queued > self.config.push_budget_bytes {
            return Err(format!(
                "{} push bytes queued, over the budget",
                self.queued
            ));
        }
        if handshaking != self.handshaking {
            return Err(format!(
                "{} handshakes counted, {handshaking} in flight",
                self.handshaking
            ));
        }
        let counted: BTreeMap<IpAddr, usize> =
            self.per_address.iter().map(|(k, v)| (*k, *v)).collect();
        if counted != per_address {
            return Err("handshakes by address disagree with the connections".into());
        }
        let counts = [
            ("", &self.stats.open, open),
            (" WebSocket", &self.stats.open_websocket, open_ws),
            (" WebTransport", &self.stats.open_webtransport, open_wt),
        ];
        for (binding, count, are) in counts {
            let counted = count.load(Ordering::Relaxed);
            if counted != are {
                return Err(format!(
                    "{counted}{binding} connections counted open, {are} are"
                ));
            }
        }
        self.timers.check()?;
        for (ch, _) in self.timers.iter() {
            if self.conns.get(ch).and_then(|c| c.as_deref()).is_none() {
                return Err(format!("a timer for connection {ch}, which is not open"));
            }
        }
        for (&session, &ch) in &self.sessions {
            let conn = self.conns.get(ch).and_then(|c| c.as_deref());
            if !conn.is_some_and(|c| c.session.id == Some(session) && !c.session.is_ended()) {
                return Err(format!(
                    "session {session:?} routed to connection {ch}, not its"
                ));
            }
        }
        if self.tickets.len() != self.ticket_deadlines.len()
            || self
                .ticket_deadlines
                .iter()
                .any(|(at, t)| self.tickets.get(t).map(Ticket::deadline) != Some(*at))
        {
            return Err("store tickets and their deadlines disagree".into());
        }
        Ok(())
    }
}
