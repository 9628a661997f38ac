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
//! the phone) until the app comes back to the foreground or the network
//! changes. Back in the foreground it tells the server and checks the
//! connection: with no answer within `probe_timeout` the connection counts
//! as dead and the client reconnects at once, resuming its session; while
//! reconnecting it tries at once with the backoff reset.

use crate::driver::{take_command, Exit};
use crate::{Backoff, Client, Cmd};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

impl Client {
    /// The app went to the background: the server is told (the user is
    /// shown offline once no device of theirs is in the foreground, after
    /// the debounce; a quick return shows nothing) and the client goes
    /// quiet. Returns at once; call it from the platform's lifecycle
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
pub(crate) enum Woke {
    /// The backoff wait ran out, or the network changed.
    Due,
    /// The app came to the foreground: try now, with the backoff reset.
    Foregrounded,
}

/// Waits before a reconnect attempt: `delay` in the foreground, for as long
/// as it takes in the background (no timer: the app is quiet there).
/// Requests wait for the connection, a close ends the client.
pub(crate) async fn wait_to_reconnect(
    delay: Duration,
    app: &mut watch::Receiver<bool>,
    cmd_rx: &mut mpsc::Receiver<Cmd>,
    deferred: &mut VecDeque<Cmd>,
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
            cmd = cmd_rx.recv() => if take_command(cmd, deferred)? {
                return Ok(Woke::Due);
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

/// Starts the next reconnect wait: after [`Woke::Foregrounded`] the
/// backoff starts again from its first step.
pub(crate) fn after_wake(woke: Woke, backoff: &mut Backoff) {
    if let Woke::Foregrounded = woke {
        backoff.reset();
    }
}
