//! `Audit` (feature `check`): watches what a core tells its sessions and
//! checks the invariants about outputs, for property tests and fuzzers.
//!
//! Feed it every accepted input's answer and every output, in order; each call
//! returns the first violation found, named by invariant:
//! - I5: no other user's session is shown an invisible user online, nor a
//!   last seen later than the moment they went invisible, nor later than the
//!   last moment the user's devices were heard from (fed with `heard`);
//! - I7: per (session, target), pushed versions strictly increase and a
//!   snapshot is never older than what was sent before;
//! - I10: pushes go only to live, Online subscribers in the tier they hold;
//! - I11: a session only ever holds subscriptions its credentials allow.

use crate::engine::{Connect, Connected, Snapshot};
use crate::output::Output;
use crate::types::{Millis, Presence, SessionId, Tier, UserId, Watch};
use crate::view::View;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Debug, Default)]
pub struct Audit {
    owner: BTreeMap<SessionId, UserId>,
    watch: BTreeMap<SessionId, Watch>,
    ended: BTreeSet<SessionId>,
    lingering: BTreeSet<SessionId>,
    subs: BTreeMap<SessionId, BTreeMap<UserId, Tier>>,
    versions: BTreeMap<(SessionId, UserId), u64>,
    views: BTreeMap<SessionId, View>,
    invisible_since: BTreeMap<UserId, Millis>,
    /// The latest moment each user's devices were heard from.
    heard: BTreeMap<UserId, Millis>,
}

impl Audit {
    pub fn new() -> Audit {
        Audit::default()
    }

    /// What `session` has been told of its subscriptions, by version.
    pub fn view(&self, session: SessionId) -> Option<&View> {
        self.views.get(&session)
    }

    /// The user that owns `session`, if the audit saw it connect.
    pub fn owner(&self, session: SessionId) -> Option<UserId> {
        self.owner.get(&session).copied()
    }

    /// What `session` may watch, if the audit saw it connect.
    pub fn watch(&self, session: SessionId) -> Option<&Watch> {
        self.watch.get(&session)
    }

    pub fn connected(&mut self, c: &Connect, answer: &Connected) -> Result<(), String> {
        let id = answer.session;
        self.owner.insert(id, c.user);
        self.watch.insert(id, c.watch.clone());
        self.subs.insert(id, BTreeMap::new());
        for snapshot in &answer.snapshots {
            self.subscribed(id, snapshot)?;
        }
        Ok(())
    }

    pub fn subscribed(&mut self, session: SessionId, snapshot: &Snapshot) -> Result<(), String> {
        let target = snapshot.target;
        let owner = self.owner.get(&session).copied();
        let allowed =
            owner == Some(target) || self.watch.get(&session).is_some_and(|w| w.allows(target));
        if !allowed {
            return Err(format!(
                "I11: {session} subscribed to {target:?} outside its watch"
            ));
        }
        self.subs
            .entry(session)
            .or_default()
            .insert(target, snapshot.tier);
        self.receive(session, target, &snapshot.presence, true)
    }

    pub fn unsubscribed(&mut self, session: SessionId, target: UserId) {
        if let Some(subs) = self.subs.get_mut(&session) {
            subs.remove(&target);
        }
        if let Some(view) = self.views.get_mut(&session) {
            view.forget(target);
        }
    }

    /// The server heard from `session`'s device at `at`: an accepted
    /// Connect, Activity, Logout or SetInvisible at its `now`. Every such
    /// moment must be fed, or a true last seen reads as a violation.
    pub fn heard(&mut self, session: SessionId, at: Millis) {
        if let Some(&user) = self.owner.get(&session) {
            let heard = self.heard.entry(user).or_insert(at);
            *heard = (*heard).max(at);
        }
    }

    /// An accepted Disconnect at `now` whose connection was last heard from
    /// at `last_heard`: the session lingers and must get nothing.
    pub fn disconnected(&mut self, session: SessionId, now: Millis, last_heard: Millis) {
        self.lingering.insert(session);
        self.heard(session, last_heard.min(now));
    }

    /// An accepted SetInvisible of a session of `user` at `now`.
    pub fn invisible(&mut self, user: UserId, invisible: bool, now: Millis) {
        if invisible {
            self.invisible_since.entry(user).or_insert(now);
        } else {
            self.invisible_since.remove(&user);
        }
    }

    /// An answer to a query: checked for leaks, not recorded.
    pub fn answered(
        &self,
        session: SessionId,
        target: UserId,
        presence: &Presence,
    ) -> Result<(), String> {
        self.check_leak(session, target, presence)
    }

    pub fn output(&mut self, output: &Output) -> Result<(), String> {
        match output {
            Output::Push {
                to,
                target,
                tier,
                presence,
            } => {
                if self.ended.contains(to) {
                    return Err(format!("I10: push to ended session {to}"));
                }
                if self.lingering.contains(to) {
                    return Err(format!("I10: push to lingering session {to}"));
                }
                let held = self.subs.get(to).and_then(|s| s.get(target));
                if held != Some(tier) {
                    return Err(format!(
                        "I10: {tier:?} push of {target:?} to {to}, which holds {held:?}"
                    ));
                }
                self.receive(*to, *target, presence, false)
            }
            Output::SessionEnded { session, .. } => {
                if !self.ended.insert(*session) {
                    return Err(format!("{session} ended twice"));
                }
                self.lingering.remove(session);
                self.subs.remove(session);
                self.views.remove(session);
                Ok(())
            }
        }
    }

    fn check_leak(&self, to: SessionId, target: UserId, p: &Presence) -> Result<(), String> {
        if self.owner.get(&to) == Some(&target) {
            return Ok(());
        }
        if let Some(seen) = p.last_seen {
            match self.heard.get(&target) {
                Some(&heard) if seen <= heard => {}
                heard => {
                    return Err(format!(
                        "I5: {to} shown {target:?} last seen {seen}, last heard {heard:?}"
                    ))
                }
            }
        }
        let Some(&since) = self.invisible_since.get(&target) else {
            return Ok(());
        };
        if p.online {
            return Err(format!("I5: {to} shown invisible {target:?} online: {p:?}"));
        }
        if p.last_seen.is_some_and(|t| t > since) {
            return Err(format!(
                "I5: {to} shown {target:?} last seen {:?}, after going invisible at {since}",
                p.last_seen
            ));
        }
        Ok(())
    }

    fn receive(
        &mut self,
        to: SessionId,
        target: UserId,
        p: &Presence,
        snapshot: bool,
    ) -> Result<(), String> {
        self.check_leak(to, target, p)?;
        let last = self.versions.entry((to, target)).or_insert(0);
        if snapshot && p.version < *last {
            return Err(format!(
                "I7: snapshot v{} of {target:?} to {to} after v{last}",
                p.version
            ));
        }
        if !snapshot && p.version <= *last {
            return Err(format!(
                "I7: {to} got v{} of {target:?} after v{last}",
                p.version
            ));
        }
        *last = p.version;
        self.views.entry(to).or_default().apply(target, p.clone());
        Ok(())
    }
}
