//! The app's lifecycle, one surface for a phone's callbacks:
//! [`Client::app_backgrounded`], [`Client::app_foregrounded`] and
//! [`Client::network_changed`].
//!
//! The app's state (foreground or background) is the client's, kept across
//! reconnects: every hello carries it, and a change is sent to the server as
//! `SetForeground` on the live connection. A backgrounded device is not
//! present (docs/protocol.md, "Foreground and background"): its user is shown
//! offline to watchers after the debounce, last seen when it went, and
//! `route` does not list it, while the session and its pushes go on.
//!
//! In the background the client adds nothing of its own: no request, no
//! probe, and a lost connection is not redialled (no backoff timers to wake
//! the phone) until the app comes back to the foreground, makes a request,
//! or the network changes. After `close_in_background` (10 s by default)
//! with nothing awaiting an answer it closes the connection itself, so
//! that its keep-alives stop too; then only the foreground or a request
//! reconnects (a network change does not). The server keeps the session
//! for the device's grace, so the reconnect resumes it. Back in the
//! foreground the client tells the server and checks the connection: with
//! no answer within `probe_timeout` the connection counts as dead and the
//! client reconnects at once, resuming its session; while reconnecting it
//! tries at once with the backoff reset.

use crate::driver::{take_command, Exit};
use crate::{Backoff, Client, Cmd};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

impl Client {
    /// The app went to the background: the server is told (the user is
    /// shown offline once no device of theirs is in the foreground, after
    /// the debounce; a quick return shows nothing) and the client goes
    /// quiet: it closes the connection after
    /// [`ClientConfig::close_in_background`](crate::ClientConfig::close_in_background)
    /// unless the app returns first. Returns at once; call it from the platform's lifecycle
    /// callback (Android `ON_STOP`, iOS `scenePhase == .background`).
    /// Idempotent: calling it again (or after a reconnect, whose hello
    /// carries the state anyway) changes nothing anybody sees; the client
    /// delivers the latest state itself, so there is nothing to retry.
    pub fn app_backgrounded(&self) {
        self.shared.foreground.send_replace(false);
    }

    /// The app came back to the foreground: the server is told, the
    /// connection is checked (a dead one is replaced at once, resuming the
    /// session) and a reconnect in progress tries at once with its backoff
    /// reset. Returns at once. Idempotent, like
    /// [`Client::app_backgrounded`].
    pub fn app_foregrounded(&self) {
        self.shared.foreground.send_replace(true);
    }

    /// Whether the app is in the foreground, as last told to the client
    /// (`ClientConfig::foreground` until then).
    pub fn is_foreground(&self) -> bool {
        *self.shared.foreground.borrow()
    }
}

/// What ended a wait before a reconnect attempt.
#[derive(Clone, Copy)]
pub(crate) enum Woke {
    /// The backoff wait ran out, or the app made a request in the
    /// background.
    Due,
    /// The network changed (a new path may work where the old one failed):
    /// try now, with the backoff reset.
    NetworkChanged,
    /// The app came to the foreground: try now, with the backoff reset.
    Foregrounded,
}

/// Waits before a reconnect attempt: `delay` in the foreground, for as long
/// as it takes in the background (no timer: the app is quiet there), where
/// a request of the app, or a network change unless `quiet` (the client
/// closed the connection for quiet), tries at once. Requests wait for the
/// connection, a close ends the client.
pub(crate) async fn wait_to_reconnect(
    delay: Duration,
    app: &mut watch::Receiver<bool>,
    (cmd_rx, deferred): (&mut mpsc::Receiver<Cmd>, &mut VecDeque<Cmd>),
    quiet: bool,
) -> Result<Woke, Exit> {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    loop {
        // `app` is the connection's: a change it did not see yet (the app
        // came back while the loss was being noticed) counts too.
        let changed = app.has_changed().unwrap_or(false);
        let foreground = *app.borrow_and_update();
        if changed && foreground {
            return Ok(Woke::Foregrounded);
        }
        let timer = async {
            if foreground {
                (&mut sleep).await
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            _ = timer => return Ok(Woke::Due),
            cmd = cmd_rx.recv() => {
                let network_changed = take_command(cmd, deferred)?;
                let in_background = !*app.borrow();
                if network_changed && !(quiet && in_background) {
                    return Ok(Woke::NetworkChanged);
                }
                if in_background && !network_changed {
                    return Ok(Woke::Due); // the app's request
                }
            },
            changed = app.changed() => {
                if changed.is_err() {
                    return Err(Exit::Closed(greendot_proto::CloseCode::Normal));
                }
                if *app.borrow_and_update() {
                    return Ok(Woke::Foregrounded);
                }
            }
        }
    }
}

/// Starts the next reconnect wait: after [`Woke::Foregrounded`] or
/// [`Woke::NetworkChanged`] the backoff starts again from its first step.
pub(crate) fn after_wake(woke: Woke, backoff: &mut Backoff) {
    if let Woke::Foregrounded | Woke::NetworkChanged = woke {
        backoff.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Ticket;
    use greendot_proto::Request;

    /// In the background with a connection lost, a network change tries at
    /// once; with the connection closed for quiet it does not (a phone in a
    /// pocket changes networks), and only the app's request does. Both are
    /// queued before the wait: what is left queued shows which woke it.
    #[tokio::test]
    async fn a_quiet_client_wakes_for_a_request_not_a_network_change() {
        for quiet in [false, true] {
            let (tx, mut rx) = mpsc::channel(4);
            let (reply, _answer) = tokio::sync::oneshot::channel();
            tx.try_send(Cmd::NetworkChanged).unwrap();
            let request = Request::Ping;
            let ticket = Ticket::default();
            tx.try_send(Cmd::Request {
                request,
                reply,
                ticket,
            })
            .unwrap();
            let (_app_tx, mut app) = watch::channel(false);
            let mut deferred = VecDeque::new();
            let woke = wait_to_reconnect(
                Duration::from_secs(3600),
                &mut app,
                (&mut rx, &mut deferred),
                quiet,
            )
            .await;
            // Not quiet: the network change woke it, the request is still
            // on its way. Quiet: the request woke it, and waits for the
            // connection.
            if quiet {
                assert!(matches!(woke, Ok(Woke::Due)));
            } else {
                assert!(matches!(woke, Ok(Woke::NetworkChanged)));
            }
            let expected = usize::from(quiet);
            assert_eq!(deferred.len(), expected, "quiet: {quiet}");
            assert_eq!(rx.len(), 1 - expected, "quiet: {quiet}");
        }
    }

    /// A network change, like the foreground, starts the backoff again from
    /// its first step: the next wait is at most the initial backoff (drawn
    /// with jitter, so checked on many clients that had all backed off to
    /// their ceiling).
    #[test]
    fn a_network_change_resets_the_backoff() {
        let policy =
            crate::Reconnect::new(Duration::from_millis(100), Duration::from_secs(60), None);
        for (woke, resets) in [
            (Woke::NetworkChanged, true),
            (Woke::Foregrounded, true),
            (Woke::Due, false),
        ] {
            let reset = (0..32).all(|_| {
                let mut backoff = Backoff::new(policy);
                for _ in 0..12 {
                    backoff.next_delay(None);
                }
                after_wake(woke, &mut backoff);
                backoff.next_delay(None) <= Duration::from_millis(100)
            });
            assert_eq!(reset, resets);
        }
    }
}
