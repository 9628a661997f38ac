//! Model 1's judgements of a step: what a snapshot, a publish and a logout
//! must look like, and the invariants every state must hold.

use super::*;

impl CoreModel {
    /// A snapshot (subscribe answer or resume) given to `session`.
    pub(super) fn check_snapshot(
        &self,
        s: &CoreState,
        n: &mut CoreState,
        session: SessionId,
        target: UserId,
        presence: &Presence,
        bad: &mut Vec<String>,
    ) {
        let viewer = n.core.session_info(session).map(|i| i.user);
        if viewer != Some(target) {
            let t = self.user_index(target);
            check_shown_to_other(s, n, t, target, presence, "snapshot", bad);
        }
        let key = (session, target);
        if let Some(prev) = n.recv.get(&key) {
            if presence.version < prev.version {
                bad.push(format!(
                    "I7: {session} got a snapshot of {target:?} at version {} after a delta at {}",
                    presence.version, prev.version
                ));
            }
        }
        n.pending.remove(&key);
        n.recv.insert(key, presence.clone());
    }

    /// I6: a state published to others held for the whole debounce window,
    /// unless it hides a user who just went invisible.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_publish(
        &self,
        s: &CoreState,
        n: &CoreState,
        t: usize,
        user: UserId,
        published: &Presence,
        now: Millis,
        bad: &mut Vec<String>,
    ) {
        let debounce = self.config().debounce.0;
        let was_shown = s.core.shown(user);
        // I5 beats I6: a user who goes invisible is hidden at once, also
        // when the offline they are hidden with was already being debounced
        // (a backgrounded device going invisible, I12).
        let hidden_at_once =
            !published.online && n.core.truth(user).invisible && !s.core.truth(user).invisible;
        if published.same_view(&was_shown) && !hidden_at_once {
            if let Some(since) = s.users[t].shown_since {
                if now.0 < since.0 + debounce {
                    bad.push(format!(
                        "I6: {user:?} published at {now} a state shown only since {since}: {published:?}"
                    ));
                }
            }
        } else if published.online || !n.core.truth(user).invisible {
            bad.push(format!(
                "I6: {user:?} published at {now} a state that had not held (was {was_shown:?}): {published:?}"
            ));
        }
    }

    pub(super) fn check_logout(&self, core: &Core, id: SessionId, bad: &mut Vec<String>) {
        if core.session_info(id).is_some() {
            bad.push(format!("I4: {id} is still live after its Logout"));
        }
        if self.users.iter().any(|&u| core.route(u).contains(&id)) {
            bad.push(format!("I4: {id} is still routable after its Logout"));
        }
        if !core.subscriptions(id).is_empty() {
            bad.push(format!(
                "I4: {id} still holds subscriptions after its Logout"
            ));
        }
        if let Err(e) = core.check_invariants() {
            if e.contains(&id.to_string()) {
                bad.push(format!("I4: {id} still listed after its Logout: {e}"));
            }
        }
    }

    /// Invariants of the state reached.
    pub(super) fn check_state(&self, n: &CoreState, now: Millis, bad: &mut Vec<String>) {
        let core = &n.core;
        let cfg = self.config();
        if let Err(e) = core.check_invariants() {
            let tagged = e.split_once(':').is_some_and(|(id, _)| {
                id.len() >= 2 && id.starts_with('I') && id[1..].bytes().all(|b| b.is_ascii_digit())
            });
            bad.push(if tagged { e } else { format!("S: {e}") });
        }
        for (t, &user) in self.users.iter().enumerate() {
            // I1 and I9, from the devices' sessions.
            let mut live = false;
            // I12: only foreground devices are present and routable.
            let mut present = false;
            let mut kinds = greendot_core::Kinds::EMPTY;
            let mut online_sessions = Vec::new();
            let mut backgrounded_online = Vec::new();
            for (d, spec) in self.devices.iter().enumerate() {
                if spec.user != user {
                    continue;
                }
                let dev = &n.devs[d];
                let Some(info) = dev.cur.and_then(|c| core.session_info(c)) else {
                    if let Some(c) = dev.cur {
                        if core.route(user).contains(&c) {
                            bad.push(format!("I9: ended {c} is routable"));
                        }
                    }
                    continue;
                };
                live = true;
                if info.foreground == dev.background {
                    bad.push(format!(
                        "I12: {} is foreground={} but the app reported background={}",
                        dev.cur.unwrap(),
                        info.foreground,
                        dev.background
                    ));
                }
                if !dev.background {
                    present = true;
                    kinds.insert(info.kind);
                }
                if info.online && dev.background {
                    backgrounded_online.push(dev.cur.unwrap());
                }
                if info.online && !dev.background {
                    online_sessions.push(dev.cur.unwrap());
                }
                if info.online {
                    // I2, from the model's own record of activity.
                    let hb = cfg.kind(spec.kind).heartbeat_timeout.0;
                    match dev.active_at {
                        Some(at) if at.0 + hb > now.0 => {}
                        other => bad.push(format!(
                            "I2: {} Online at {now} with last activity {other:?} (heartbeat timeout {hb})",
                            dev.cur.unwrap()
                        )),
                    }
                } else {
                    let grace = cfg.kind(spec.kind).grace.0;
                    match dev.lost_at {
                        Some(at) if at.0 + grace > now.0 => {}
                        other => bad.push(format!(
                            "I2: {} Lingering at {now}, lost at {other:?} (grace {grace})",
                            dev.cur.unwrap()
                        )),
                    }
                }
            }
            // A disagreement only a backgrounded device explains is I12's.
            let id = if live == present { "I1" } else { "I12" };
            let truth = core.truth(user);
            if core.is_online(user) != live || truth.online != present {
                bad.push(format!(
                    "{id}: {user:?} is_online={} truth.online={} but a device is live: {live}, present: {present}",
                    core.is_online(user),
                    truth.online
                ));
            }
            if present && truth.kinds != kinds {
                bad.push(format!(
                    "{id}: {user:?} shows kinds {:?}, present devices are {kinds:?}",
                    truth.kinds
                ));
            }
            let shown = core.shown(user);
            if shown.online != (present && !truth.invisible) {
                bad.push(format!(
                    "{id}: {user:?} shown online={} (live {live}, present {present}, invisible {})",
                    shown.online, truth.invisible
                ));
            }
            let mut route = core.route(user);
            route.sort();
            online_sessions.sort();
            if route != online_sessions {
                let id = if route.iter().any(|r| backgrounded_online.contains(r)) {
                    "I12"
                } else {
                    "I9"
                };
                bad.push(format!(
                    "{id}: route({user:?}) = {route:?}, Online foreground sessions are {online_sessions:?}"
                ));
            }
            // I5 on what others are shown and would be told.
            let published = core.presence(user);
            if truth.invisible {
                if published.online {
                    bad.push(format!("I5: invisible {user:?} is published online"));
                }
                if let (Some(seen), Some(since)) = (published.last_seen, n.users[t].invisible_since)
                {
                    if seen > since {
                        bad.push(format!(
                            "I5: invisible since {since}, {user:?} shows last seen {seen}"
                        ));
                    }
                }
            }
            if published.invisible {
                bad.push(format!("I5: others are told that {user:?} is invisible"));
            }
        }
        for (d, spec) in self.devices.iter().enumerate() {
            let dev = &n.devs[d];
            let Some(sess) = dev.cur else { continue };
            let Some(info) = core.session_info(sess) else {
                continue;
            };
            for (target, tier) in core.subscriptions(sess) {
                // I11.
                if target != spec.user && !spec.watch.allows(target) {
                    bad.push(format!(
                        "I11: {sess} subscribed to {target:?} outside its credentials"
                    ));
                }
                if !info.online {
                    continue;
                }
                // I8: once settled, the view received equals what is shown.
                let t = self.user_index(target);
                let got = n.recv.get(&(sess, target));
                if target == spec.user {
                    if n.users[t].truth_since.is_none() {
                        let truth = core.truth(target);
                        if !got.is_some_and(|p| p.same_view(&truth)) {
                            bad.push(format!(
                                "I8: {sess} ({tier:?}) sees itself as {got:?}, truth is {truth:?}"
                            ));
                        }
                    }
                } else if n.users[t].shown_since.is_none() {
                    let published = core.presence(target);
                    let shown = core.shown(target);
                    if got != Some(&published) || !published.same_view(&shown) {
                        bad.push(format!(
                            "I8: {sess} ({tier:?}) sees {target:?} as {got:?}; shown is {shown:?}, published {published:?}"
                        ));
                    }
                }
            }
        }
    }
}

/// I5 for anything shown to another user's session about `target`.
pub(super) fn check_shown_to_other(
    s: &CoreState,
    n: &CoreState,
    t: usize,
    target: UserId,
    presence: &Presence,
    what: &str,
    bad: &mut Vec<String>,
) {
    if presence.invisible {
        bad.push(format!(
            "I5: a {what} tells another user that {target:?} is invisible"
        ));
    }
    let invisible = s.core.truth(target).invisible && n.core.truth(target).invisible;
    if !invisible {
        return;
    }
    if presence.online {
        bad.push(format!(
            "I5: a {what} shows invisible {target:?} online: {presence:?}"
        ));
    }
    if let (Some(seen), Some(since)) = (presence.last_seen, s.users[t].invisible_since) {
        if seen > since {
            bad.push(format!(
                "I5: a {what} shows {target:?} last seen {seen}, invisible since {since}"
            ));
        }
    }
}
