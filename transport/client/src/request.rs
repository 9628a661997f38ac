//! What a request's caller and the connection task know of it: whether it
//! was sent ([`Ticket`]), and whether it may be sent again after a lost
//! connection ([`resendable`]).

use greendot_proto::Request;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

const WAITING: u8 = 0;
const SENT: u8 = 1;
const ABANDONED: u8 = 2;

/// Shared by a call and the connection task: the call gives up (its
/// deadline passed) or the task sends, whichever comes first; so a call
/// that reports "not sent" is never sent later.
#[derive(Clone, Debug, Default)]
pub(crate) struct Ticket(Arc<AtomicU8>);

impl Ticket {
    /// The task is about to send (or send again): `false` if the caller
    /// gave up first, and then it must not.
    pub(crate) fn send(&self) -> bool {
        match self
            .0
            .compare_exchange(WAITING, SENT, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(state) => state == SENT,
        }
    }

    /// The caller gives up: `true` if the request was never sent (and now
    /// never will be), `false` if it was.
    pub(crate) fn abandon(&self) -> bool {
        self.0
            .compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    pub(crate) fn was_sent(&self) -> bool {
        self.0.load(Ordering::Acquire) == SENT
    }
}

/// Whether a request sent on a connection that was then lost is sent again
/// on the next one: a request whose repetition changes nothing that one
/// did not (status, invisibility, subscriptions, reads). A refresh, a
/// revocation and a logout are not: their caller learns the outcome is
/// unknown.
pub(crate) fn resendable(request: &Request) -> bool {
    matches!(
        request,
        Request::Ping
            | Request::Subscribe { .. }
            | Request::Unsubscribe { .. }
            | Request::Query { .. }
            | Request::SetStatus { .. }
            | Request::SetInvisible { .. }
            | Request::SetForeground { .. }
            | Request::Route { .. }
            | Request::GroupSubscribe { .. }
            | Request::GroupUnsubscribe { .. }
            | Request::GroupPage { .. }
            | Request::GroupWatchPage { .. }
            | Request::GroupRenewWatch { .. }
            | Request::GroupUnwatchPage { .. }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_either_sent_or_abandoned_never_both() {
        let sent = Ticket::default();
        assert!(sent.send());
        assert!(sent.send(), "sent again after a lost connection");
        assert!(!sent.abandon(), "the caller learns it was sent");
        assert!(sent.was_sent());

        let abandoned = Ticket::default();
        assert!(abandoned.abandon());
        assert!(!abandoned.send(), "never sent after the caller gave up");
        assert!(!abandoned.was_sent());
    }
}
