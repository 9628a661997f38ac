//! Foreground and background (DESIGN.md, "Backgrounded(session)"; I12).
//!
//! A device reports whether its app is in the foreground or the background,
//! at connect ([`Connect::foreground`](crate::Connect::foreground)) and with
//! [`Core::handle_set_foreground`]. A backgrounded session is a live (Online
//! or Lingering) session like any other: its subscriptions, its lease and its
//! grace are unchanged, so a return to the foreground is instant, or a resume
//! if the connection died meanwhile. What changes is presence:
//!
//! - **I12 background**: a backgrounded device is not present.
//!   (a) The user is shown online, to others (debounced, I6) and to their own
//!   sessions, only while some device is Online or Lingering in the
//!   foreground, and the kinds shown are those of such devices.
//!   (b) `route(user)` names exactly the Online sessions in the foreground.
//!   (c) When the last foreground device of a shown user goes to the
//!   background, the user's `last_seen` is the moment it went; nothing a
//!   backgrounded device does later (keep-alives, its disconnect, its logout)
//!   moves it.
//!   (d) A toggle that returns within debounce publishes nothing (I6).
//!
//! With [`Backgrounded::Away`](crate::Backgrounded::Away) a backgrounded
//! device is present instead, and while every device of the user is in the
//! background the status shown is `Away` (unless the user chose busy or
//! do-not-disturb); (b) holds either way, and (c) does not apply since the
//! user stays shown.

use crate::config::Backgrounded;
use crate::engine::{Core, Link, Session};
use crate::error::Error;
use crate::types::{Millis, SessionId, Status};

impl Core {
    /// The app of `session`'s device went to the foreground (`true`) or the
    /// background (I12). A sign of life: the device was heard from at `now`.
    /// Going to the background at `now` is what last seen reads if it was
    /// the user's last present device. Idempotent.
    pub fn handle_set_foreground(
        &mut self,
        now: Millis,
        id: SessionId,
        foreground: bool,
    ) -> Result<(), Error> {
        self.advance(now);
        let id = self.online(id)?;
        let Some((user, was_present)) = self.session(id).map(|s| (s.user, self.present(s))) else {
            return Err(Error::Stale);
        };
        let before = self.views(user);
        let clock = self.now();
        let Some(session) = self.session_mut(id) else {
            return Err(Error::Stale);
        };
        session.background = !foreground;
        session.set_link(Link::Online {
            last_activity: clock,
        });
        let now_present = self.session(id).is_some_and(|s| self.present(s));
        if was_present || now_present {
            self.heard(user);
        }
        self.after_change(user, before);
        Ok(())
    }

    /// Whether `session`'s device counts as present (I12).
    pub(crate) fn present(&self, session: &Session) -> bool {
        !session.background
            || self.config.backgrounded == Backgrounded::Away
            || self.mutant_background_counted()
    }

    /// The user's present sessions, Online or Lingering.
    pub(crate) fn present_sessions(&self, user: u32) -> impl Iterator<Item = &Session> {
        self.users[user as usize]
            .sessions
            .iter()
            .filter_map(|&s| self.session(s))
            .filter(|s| self.present(s))
    }

    /// Some device of the user is present (I1, I12).
    pub(crate) fn is_present(&self, user: u32) -> bool {
        self.present_sessions(user).next().is_some()
    }

    /// The status shown: the chosen one, except `Away` under
    /// `Backgrounded::Away` while every device is in the background and the
    /// choice is the default `Available` (an explicit choice beats an
    /// inferred one).
    pub(crate) fn shown_status(&self, user: u32) -> Status {
        let u = &self.users[user as usize];
        let all_background = !u.sessions.is_empty()
            && u.sessions
                .iter()
                .filter_map(|&s| self.session(s))
                .all(|s| s.background);
        if self.config.backgrounded == Backgrounded::Away
            && all_background
            && u.status == Status::Available
        {
            Status::Away
        } else {
            u.status
        }
    }

    #[cfg(feature = "mutants")]
    fn mutant_background_counted(&self) -> bool {
        self.mutant == Some(crate::mutants::Mutant::BackgroundCounted)
    }

    #[cfg(not(feature = "mutants"))]
    fn mutant_background_counted(&self) -> bool {
        false
    }
}
