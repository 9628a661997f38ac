//! How the world takes what its clients say: welcomes, answers, pushes
//! and lost connections, each checked against what the world expects.

use super::*;

impl Sim {
    pub(super) fn on_client_event(&mut self, i: usize, event: ClientEvent) -> Result<(), String> {
        let now = self.now;
        match event {
            ClientEvent::Welcomed {
                session,
                resumed,
                subs,
            } => {
                self.welcomes += 1;
                self.note(format!(
                    "c{i} welcomed session {session:x} resumed {resumed}"
                ));
                let epoch = self.epoch;
                if let Some(live) = self.clients[i].live.as_mut() {
                    live.epoch = epoch;
                }
                let device = &mut self.devices[i];
                device.welcomed_at = Some(now);
                device.subs.clear();
                for (target, tier) in subs {
                    if let Some(t) = user_key(&target) {
                        device.subs.insert(t.0 as usize, (tier, now));
                    }
                }
                if !resumed {
                    // Subscribe again to what it watched.
                    let wanted: Vec<(usize, Tier)> =
                        device.wanted.iter().map(|(&u, &t)| (u, t)).collect();
                    for tier in [Tier::Realtime, Tier::Batched] {
                        let targets: Vec<String> = wanted
                            .iter()
                            .filter(|(_, t)| *t == tier)
                            .map(|(u, _)| format!("u{u}"))
                            .collect();
                        if !targets.is_empty() {
                            self.clients[i].request(now, Request::Subscribe { targets, tier });
                        }
                    }
                }
            }
            ClientEvent::Update {
                target,
                presence,
                push,
            } => {
                self.updates += 1;
                if push.is_some() {
                    self.check_push_after_logout(i, &target, &presence)?;
                }
                self.note(format!(
                    "c{i} {} {target} v{} online {} {:?}",
                    if push.is_some() { "push" } else { "snapshot" },
                    presence.version,
                    presence.online,
                    presence.status
                ));
                self.check_update(i, &target, &presence)?;
            }
            ClientEvent::Answered {
                request,
                result,
                sent,
            } => {
                self.answered += 1;
                self.note(format!("c{i} answer to {request:?}: {result:?}"));
                self.on_answer(i, request, result, sent)?;
            }
            ClientEvent::ErrorFrame(e) => {
                self.note(format!("c{i} error frame {e:?}"));
            }
            ClientEvent::Lost {
                reason,
                welcomed,
                logout_sent,
                opened_at,
            } => {
                self.note(format!("c{i} lost: {reason} (welcomed {welcomed})"));
                self.on_lost(i, &reason, welcomed, logout_sent, opened_at)?;
            }
            ClientEvent::Broken(what) => return Err(format!("c{i}: {what}")),
        }
        Ok(())
    }

    pub(super) fn on_answer(
        &mut self,
        i: usize,
        request: Request,
        result: Result<Answer, proto::WireError>,
        _sent: Duration,
    ) -> Result<(), String> {
        let now = self.now;
        let user = self.clients[i].user;
        match (request, result) {
            (Request::Subscribe { .. }, Ok(Answer::Subscribed { snapshots, refused })) => {
                for s in snapshots {
                    let Some(t) = user_key(&s.target) else {
                        continue;
                    };
                    let t = t.0 as usize;
                    let allowed = t == user
                        || self.devices[i]
                            .watch
                            .as_ref()
                            .is_none_or(|list| list.contains(&t));
                    if !allowed {
                        return Err(format!(
                            "I11: c{i} (u{user}) granted {} outside its token's watch",
                            s.target
                        ));
                    }
                    self.devices[i].subs.insert(t, (s.tier, now));
                }
                for r in refused {
                    if let Some(t) = user_key(&r.target) {
                        self.devices[i].wanted.remove(&(t.0 as usize));
                    }
                }
            }
            (Request::Unsubscribe { target }, _) => {
                if let Some(t) = user_key(&target) {
                    self.devices[i].subs.remove(&(t.0 as usize));
                    self.devices[i].wanted.remove(&(t.0 as usize));
                    self.clients[i].view.forget(t);
                }
            }
            (Request::SetInvisible { invisible }, result) => {
                let truth = &mut self.users[user];
                truth.in_flight = truth.in_flight.saturating_sub(1);
                // Only a saved change with nothing else in flight is known
                // to hold (across a crash too).
                if truth.in_flight == 0 {
                    if !truth.ambiguous
                        && now >= truth.tainted_until
                        && matches!(result, Ok(Answer::Done))
                    {
                        if invisible {
                            truth.invisible_acked = Some(now);
                        } else {
                            truth.visible_since = Some(now);
                        }
                    }
                    truth.ambiguous = false;
                }
            }
            (Request::Logout, Ok(Answer::Done)) => {
                self.devices[i].absent_since = Some(now);
            }
            (Request::Query { .. }, Ok(Answer::Presences(results))) => {
                for r in results {
                    let Ok(p) = r.result else { continue };
                    if r.target != self.clients[i].user_name && p.invisible {
                        return Err(format!(
                            "I5: c{i} queried {} and was told it is invisible",
                            r.target
                        ));
                    }
                }
            }
            (Request::Ping, Ok(Answer::Done)) | (Request::SetStatus { .. }, _) => {}
            (_, Err(e)) if e.code == proto::ErrorCode::Internal => {}
            (_, Err(e)) if e.code == proto::ErrorCode::RateLimited => {
                return Err(format!(
                    "c{i} rate limited though it keeps under the limit: {e:?}"
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// A connection ended: was there a reason for the server to end it?
    pub(super) fn on_lost(
        &mut self,
        i: usize,
        reason: &ConnectionError,
        welcomed: bool,
        logout_sent: bool,
        opened: Duration,
    ) -> Result<(), String> {
        let now = self.now;
        let within = |t: Option<Duration>, w: Duration| t.is_some_and(|t| now <= t + w);
        let device = &self.devices[i];
        let disrupted = |w: Duration| device.disrupted_until + w >= now;
        let restarted = |w: Duration| within(self.last_restart, w) || within(self.draining, w);
        let jumped = within(self.last_clock_jump, Duration::from_secs(120));
        let idle = self.config.idle_timeout + Duration::from_secs(35);
        let fine = match reason {
            ConnectionError::LocallyClosed => true,
            ConnectionError::ApplicationClosed(_) if device.closing => true,
            ConnectionError::ApplicationClosed(c) => {
                let code = c.error_code.into_inner();
                let text = String::from_utf8_lossy(&c.reason).into_owned();
                let ok = match code {
                    1 => logout_sent,
                    10 | 14 => restarted(Duration::from_secs(30)),
                    11 | 16 => disrupted(Duration::from_secs(120)),
                    3 => {
                        disrupted(Duration::from_secs(150))
                            || restarted(Duration::from_secs(150))
                            || jumped
                    }
                    // A hello that did not arrive in time (lost, on a lossy
                    // link, until the retransmission timer backed off).
                    12 => true,
                    _ => false,
                };
                if !ok {
                    return Err(format!(
                        "c{i}: the server closed a connection with code {code} ({text:?}) with no cause (link healthy since {:.3}s, logout sent {logout_sent})",
                        device.disrupted_until.as_secs_f64()
                    ));
                }
                true
            }
            ConnectionError::TimedOut => disrupted(idle) || restarted(idle) || jumped,
            // A close we did not hear (lost) is learnt by a stateless reset:
            // after a logout, or a hello that timed out on a lossy link.
            ConnectionError::Reset => {
                logout_sent
                    || !welcomed
                    || restarted(idle)
                    || disrupted(idle)
                    || self.server.is_none()
            }
            // Closed during the handshake (the hello timeout, a refusal).
            // An application close of a connection still in its QUIC
            // handshake goes out as APPLICATION_ERROR without its code; past
            // the hello timeout that is the hello timeout (code 12 above),
            // reached on a lossy link once QUIC's retransmission timer has
            // backed off for seconds.
            ConnectionError::ConnectionClosed(c) => {
                restarted(idle)
                    || self.server.is_none()
                    || disrupted(now.saturating_sub(opened) + Duration::from_secs(15))
                    || (c.error_code == TransportErrorCode::APPLICATION_ERROR
                        && now >= opened + self.config.hello_timeout)
            }
            _ => false,
        };
        if !fine {
            return Err(format!(
                "c{i}: connection lost without cause: {reason} (disrupted until {:.3}s)",
                device.disrupted_until.as_secs_f64()
            ));
        }
        self.drop_pending(i);
        let device = &mut self.devices[i];
        device.welcomed_at = None;
        device.subs.clear();
        if logout_sent || code_of(reason) == Some(CloseCode::Logout as u64) {
            device.absent_since.get_or_insert(now);
            device.resume = false;
            if device.reconnect_at.is_none() {
                device.reconnect_at =
                    Some(now + Duration::from_millis(self.rng.range(1_000, 180_000)));
            }
        } else if device.reconnect_at.is_none() {
            device.resume = true;
            // Backoff as the client library: full jitter, up to 5 s.
            device.reconnect_at = Some(now + Duration::from_millis(self.rng.range(100, 5_000)));
        }
        Ok(())
    }
}
