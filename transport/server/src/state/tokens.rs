//! The server's side of tokens on live sessions (the hub keeps the
//! expiries and the revocation list, `tokens.rs`): the timer that closes a
//! session whose token ran out, the closes a revocation asks for, and a
//! refresh's narrower watch applied to a cluster edge's subscriptions.

use super::ServerState;
use crate::conn::Handled;
use crate::session::Binding;
use greendot_core::{Millis, SessionId};
use greendot_proto::{self as proto, CloseCode, ServerFrame};
use std::time::Instant;

impl ServerState {
    /// Tokens that ran out by `now` (their `exp` plus the leeway, with no
    /// refresh): their sessions are closed by the next `route`.
    pub(super) fn expire_tokens(&mut self, now: Instant) {
        let due = self
            .hub
            .token_timeout()
            .and_then(|m| self.clock.instant(m))
            .is_some_and(|t| t <= now);
        if due {
            self.hub.expire_tokens(self.clock.at(now));
        }
    }

    /// Closes the connections of sessions whose token expired (the device
    /// lingers for its grace: a reconnect with a fresh token resumes it) or
    /// was revoked (logged out: offline at once).
    pub(super) fn close_for_tokens(&mut self, now: Instant) {
        for (session, code) in self.hub.take_token_closes() {
            let Some(&ch) = self.sessions.get(&session) else {
                continue;
            };
            let (text, logout): (&[u8], bool) = match code {
                CloseCode::Revoked => (b"TokenRevoked: the session's token was revoked", true),
                _ => (b"TokenExpired: the session's token expired", false),
            };
            self.stats.reject(&format!("{code:?}"));
            let Some(conn) = self.conn(ch) else { continue };
            conn.link.close(now, code, text);
            self.touch(ch);
            self.end(ch, logout, format!("closed by the server: {code:?}"));
        }
    }

    /// In a cluster the edge's subscriptions live in its fanout, not in the
    /// core: those the refreshed token no longer allows end there too, and
    /// the answer names them.
    pub(super) fn after_refresh(&mut self, at: Millis, session: SessionId, handled: &mut Handled) {
        let Some(c) = self.cluster.as_deref_mut() else {
            return;
        };
        let Some(ServerFrame::Reply {
            result: Ok(proto::Answer::Refreshed { ended, .. }),
            ..
        }) = &mut handled.reply
        else {
            return;
        };
        let Some(viewer) = self
            .hub
            .session_user(session)
            .and_then(|u| self.hub.user_name(u))
        else {
            return;
        };
        for snapshot in c.snapshots(session, viewer) {
            if self.hub.may_watch(session, &snapshot.target).is_err()
                && c.unsubscribe(at, session, &snapshot.target)
            {
                ended.push(snapshot.target);
            }
        }
    }
}
