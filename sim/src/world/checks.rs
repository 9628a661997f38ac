//! The invariants as a watcher sees them, checked after every step.

use super::*;

impl Sim {
    pub(super) fn record_published(&mut self) {
        let Some(server) = &self.server else { return };
        let hub = server.hub();
        for u in 0..self.users.len() {
            let Some(id) = hub.user_id(&format!("u{u}")) else {
                continue;
            };
            let p = hub.core().presence(id);
            let key = (self.epoch, u, p.version);
            if !self.published.contains_key(&key) {
                let wire = proto::Presence::from_core(&p, 0);
                self.published.insert(key, (wire, self.now));
            }
        }
    }

    /// What a watcher was told of `target` agrees with what the core
    /// published under that version, and leaks nothing.
    pub(super) fn check_update(
        &mut self,
        i: usize,
        target: &str,
        presence: &proto::Presence,
    ) -> Result<(), String> {
        let Some(t) = user_key(target).map(|t| t.0 as usize) else {
            return Err(format!("c{i} told of unknown user {target}"));
        };
        let me = self.clients[i].user;
        if t == me {
            return Ok(());
        }
        let allowed = self.devices[i]
            .watch
            .as_ref()
            .is_none_or(|list| list.contains(&t));
        if !allowed {
            return Err(format!("I11: c{i} told of {target} outside its watch"));
        }
        if presence.invisible {
            return Err(format!(
                "I5: c{i} told that {target} is invisible: {presence:?}"
            ));
        }
        let epoch = self.clients[i]
            .live
            .as_ref()
            .map_or(self.epoch, |l| l.epoch);
        if let Some((published, at)) = self.published.get(&(epoch, t, presence.version)) {
            if published != presence {
                return Err(format!(
                    "I7: c{i} got {target} v{} as {presence:?}, but v{} was published as {published:?}",
                    presence.version, presence.version
                ));
            }
            if presence.online {
                if let Some(acked) = self.users[t].invisible_acked {
                    if *at > acked {
                        return Err(format!(
                            "I5: c{i} shown {target} online (published at {:.3}s) after its invisibility was saved at {:.3}s",
                            at.as_secs_f64(),
                            acked.as_secs_f64()
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Since when client `i`'s connection has been welcomed by the current
    /// server and its link undisturbed (`None`: it is not). A connection
    /// that asked to log out counts only if `logout_too`.
    /// I10: nothing published after a session's logout is pushed to it.
    pub(super) fn check_push_after_logout(
        &self,
        i: usize,
        target: &str,
        presence: &proto::Presence,
    ) -> Result<(), String> {
        let Some(live) = self.clients[i].live.as_ref() else {
            return Ok(());
        };
        let (Some(logout), Some(t)) = (live.logout_answered, user_key(target)) else {
            return Ok(());
        };
        let key = (live.epoch, t.0 as usize, presence.version);
        match self.published.get(&key) {
            Some((_, at)) if *at > logout => Err(format!(
                "I10: c{i} logged out at {:.3}s and was pushed {target} v{} published at {:.3}s",
                logout.as_secs_f64(),
                presence.version,
                at.as_secs_f64()
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn healthy_since(&self, i: usize, logout_too: bool) -> Option<Duration> {
        let device = &self.devices[i];
        let live = self.clients[i].live.as_ref()?;
        if live.lost
            || live.welcomed.is_none()
            || (live.logout_sent && !logout_too)
            || live.epoch != self.epoch
            || device.closing
            || self.draining.is_some()
        {
            return None;
        }
        let mut since = device.welcomed_at?.max(device.recovered_at);
        if let Some(r) = self.last_restart {
            since = since.max(r);
        }
        (self.now >= device.disrupted_until).then_some(since)
    }

    pub(super) fn check(&mut self) -> Result<(), String> {
        let now = self.now;
        let config = &self.config;
        let debounce = Duration::from_millis(config.core.debounce.0);
        let batch = Duration::from_millis(config.core.batch_interval.0);
        let max_grace = config
            .core
            .kinds
            .iter()
            .map(|k| Duration::from_millis(k.grace.0))
            .max()
            .unwrap_or_default();
        // Generous: on a lossy link QUIC's RTT estimate (from a handshake whose
        // packets were retransmitted, say) can put a lost push's retransmission
        // several seconds away, twice in a row (seed 78).
        let converge = debounce + batch + Duration::from_secs(30);
        let ghost_bound =
            config.idle_timeout + max_grace * 2 + debounce + batch + Duration::from_secs(20);

        for (i, client) in self.clients.iter().enumerate() {
            if client.buffered() > CLIENT_BUFFER_CAP {
                return Err(format!(
                    "unbounded queue: c{i} buffers {} bytes",
                    client.buffered()
                ));
            }
        }
        let Some(server) = &self.server else {
            return Ok(());
        };
        if let Err(e) = server.hub().core().check_invariants() {
            return Err(format!("core: {e}"));
        }
        // The state's own bookkeeping (push bytes, sessions, timers, tickets).
        if let Err(e) = server.check() {
            return Err(format!("server state: {e}"));
        }
        if server.queued_push_bytes() > config.push_budget_bytes {
            return Err(format!(
                "unbounded queue: the server holds {} push bytes",
                server.queued_push_bytes()
            ));
        }
        let hub = server.hub();
        let core = hub.core();

        // Per client: answers, logout, convergence.
        for i in 0..self.clients.len() {
            let Some(live) = self.clients[i].live.as_ref() else {
                continue;
            };
            let Some(healthy) = self.healthy_since(i, true) else {
                continue;
            };
            for (id, p) in &live.pending {
                if healthy <= p.sent && now > p.sent + ANSWER_BOUND {
                    return Err(format!(
                        "c{i}: request {id} ({:?}) sent at {:.3}s is unanswered on a healthy connection",
                        p.request,
                        p.sent.as_secs_f64()
                    ));
                }
            }
            if let Some(at) = live.logout_answered {
                if healthy <= at && now > at + LOGOUT_CLOSE_BOUND {
                    return Err(format!(
                        "I4: c{i}'s logout was answered at {:.3}s but its connection is still open",
                        at.as_secs_f64()
                    ));
                }
                continue;
            }
            if live.logout_sent {
                continue;
            }
            // I9: a device connected on a healthy link is routable.
            if let Some(wire) = live.welcomed {
                let session = server.wire(greendot_core::SessionId(wire));
                let user = hub.user_id(&self.clients[i].user_name);
                if now >= healthy + Duration::from_secs(1)
                    && !user.is_some_and(|u| core.route(u).contains(&session))
                {
                    return Err(format!(
                        "I9: c{i} is connected and healthy since {:.3}s, but its session is not in its user's route",
                        healthy.as_secs_f64()
                    ));
                }
            }
            if now < healthy + converge || live.epoch != self.epoch {
                continue;
            }
            for (&t, &(_, since)) in &self.devices[i].subs {
                if t == self.clients[i].user || now < since + converge {
                    continue;
                }
                let Some(id) = hub.user_id(&format!("u{t}")) else {
                    continue;
                };
                let p = core.presence(id);
                let Some((published, at)) = self.published.get(&(self.epoch, t, p.version)) else {
                    continue;
                };
                if now < *at + converge {
                    continue;
                }
                let seen = self.clients[i].view.get(greendot_core::UserId(t as u64));
                let agrees = seen.is_some_and(|s| proto::Presence::from_core(s, 0) == *published);
                if !agrees {
                    return Err(format!(
                        "I8: c{i} watching u{t} shows {seen:?}, but the core published {published:?} at {:.3}s",
                        at.as_secs_f64()
                    ));
                }
            }
        }

        // Per user: no ghost, no flap.
        for u in 0..self.users.len() {
            let Some(id) = hub.user_id(&format!("u{u}")) else {
                continue;
            };
            let mine: Vec<usize> = (0..self.clients.len())
                .filter(|&i| self.clients[i].user == u)
                .collect();
            let gone = mine
                .iter()
                .map(|&i| self.devices[i].absent_since)
                .collect::<Option<Vec<_>>>()
                .and_then(|v| v.into_iter().max());
            if let Some(gone) = gone {
                let restarted = self.last_restart.is_some_and(|r| r + ghost_bound > now);
                if now > gone + ghost_bound && !restarted && core.is_online(id) {
                    return Err(format!(
                        "I2: ghost: every device of u{u} has been gone since {:.3}s, yet the core has it online",
                        gone.as_secs_f64()
                    ));
                }
            }
            let p = core.presence(id);
            if p.online {
                continue;
            }
            let Some(visible) = self.users[u].visible_since else {
                continue;
            };
            let Some((_, at)) = self.published.get(&(self.epoch, u, p.version)) else {
                continue;
            };
            for &i in &mine {
                let Some(healthy) = self.healthy_since(i, false) else {
                    continue;
                };
                let since = healthy.max(visible);
                if *at >= since + debounce + Duration::from_secs(1) {
                    return Err(format!(
                        "flap: u{u} published offline at {:.3}s while c{i} was connected and healthy since {:.3}s",
                        at.as_secs_f64(),
                        since.as_secs_f64()
                    ));
                }
            }
        }
        Ok(())
    }
}
