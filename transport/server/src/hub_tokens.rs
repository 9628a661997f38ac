//! The hub's part in tokens on live sessions (docs/protocol.md, "Tokens on
//! live sessions"): expiry deadlines, refreshes that replace a session's
//! watch, and revocations.

use super::*;

impl Hub {
    /// A live session is closed once its token's `exp` plus `leeway` has
    /// passed without a refresh (default: at `exp`).
    pub fn with_token_leeway(mut self, leeway: std::time::Duration) -> Hub {
        let ms = u64::try_from(leeway.as_millis()).unwrap_or(u64::MAX);
        self.credentials = Credentials::new(self.unix_base_ms, ms, self.limits.max_revocations);
        self
    }

    /// When the next live session's token runs out.
    pub fn token_timeout(&self) -> Option<Millis> {
        self.credentials.poll_timeout()
    }

    /// Notes the sessions whose token ran out by `now` for closing
    /// ([`Hub::take_token_closes`]).
    pub fn expire_tokens(&mut self, now: Millis) {
        self.credentials.handle_timeout(now);
    }

    /// Sessions to close because of their token (expired, revoked), with
    /// the close code. A revoked session is already logged out.
    pub fn take_token_closes(&mut self) -> Vec<(SessionId, proto::CloseCode)> {
        self.credentials.take_closes()
    }

    /// Revocations made since the last call, for a driver that stores them.
    pub fn take_revocations(&mut self) -> Vec<Revocation> {
        self.credentials.take_changed()
    }

    /// Revocations stored by a previous process: before connections.
    pub fn restore_revocations(&mut self, revocations: impl IntoIterator<Item = Revocation>) {
        self.credentials.restore(revocations);
    }

    /// Entries in the revocation list.
    pub fn revocation_count(&self) -> usize {
        self.credentials.revocations()
    }

    /// A verified refresh of a live session's token: the same user and
    /// device, whose `watch` and `svc` replace the old ones. Subscriptions
    /// the new `watch` no longer allows end; returns their targets' names.
    pub fn refresh(
        &mut self,
        now: Millis,
        session: SessionId,
        claims: &Claims,
    ) -> Result<Vec<String>, WireError> {
        let stale = || WireError::new(ErrorCode::Stale, "session is no longer current");
        let meta = self.sessions.get(&session).ok_or_else(stale)?;
        if self.user_name(meta.user) != Some(claims.sub.as_str())
            || self.devices.name(meta.device.0).map(|n| &**n) != Some(claims.dev.as_str())
        {
            return Err(WireError::new(
                ErrorCode::BadToken,
                "the token names another user or device than this session's",
            ));
        }
        self.check_watch(&claims.watch)?;
        let (watch, watched) = self.intern_watch(&claims.watch)?;
        let ended = match self.core.handle_set_watch(now, session, watch) {
            Ok(ended) => ended,
            Err(e) => {
                self.idle
                    .extend(watched.iter().flat_map(|ids| ids.iter().copied()));
                return Err(e.into());
            }
        };
        for id in watched.iter().flat_map(|ids| ids.iter()) {
            self.users.acquire(id.0);
        }
        let Some(meta) = self.sessions.get_mut(&session) else {
            return Err(stale());
        };
        let old = std::mem::replace(&mut meta.watch, watched);
        meta.watch_all = matches!(claims.watch, WatchClaim::Star(_));
        meta.svc = claims.svc;
        for id in old.iter().flat_map(|ids| ids.iter()) {
            if self.users.drop_ref(id.0) == 0 {
                self.idle.push(*id);
            }
        }
        let names = ended
            .into_iter()
            .map(|id| {
                self.idle.push(id);
                self.user_name(id).unwrap_or_default().to_owned()
            })
            .collect();
        Ok(names)
    }

    /// A verified refresh: not revoked, then the new watch (see
    /// [`Hub::refresh`]), then the new expiry.
    pub(super) fn refresh_token(
        &mut self,
        now: Millis,
        session: SessionId,
        claims: &Claims,
    ) -> Result<Answer, WireError> {
        self.core.handle_activity(now, session)?;
        self.credentials.check(claims)?;
        let ended = self.refresh(now, session, claims)?;
        if let Some(meta) = self.sessions.get(&session) {
            self.credentials
                .hold(session, meta.user, meta.device, claims);
        }
        Ok(Answer::Refreshed {
            expires: claims.exp,
            ended,
        })
    }

    /// A service's revocation: stored in the list (within its cap), and
    /// every session holding a revoked token is logged out and closed.
    pub(super) fn revoke(
        &mut self,
        now: Millis,
        svc: bool,
        user: String,
        device: Option<String>,
        before: u64,
    ) -> Result<Answer, WireError> {
        if !svc {
            return Err(WireError::new(
                ErrorCode::ServiceOnly,
                "revoking tokens needs a service token",
            ));
        }
        self.name_ok(&user, "user")?;
        if let Some(d) = &device {
            self.name_ok(d, "device")?;
        }
        let user_id = self.users.get(&user).map(UserId);
        let device_id = device
            .as_deref()
            .and_then(|d| self.devices.get(d))
            .map(DeviceId);
        let revocation = Revocation {
            user,
            device,
            before,
        };
        let hit = self.credentials.revoke(revocation, user_id, device_id)?;
        for &s in &hit {
            if let Some(u) = self.session_user(s) {
                self.touched.push(u);
            }
            self.note_targets(s);
            let _ = self.core.handle_logout(now, s);
        }
        Ok(Answer::Revoked {
            closed: u32::try_from(hit.len()).unwrap_or(u32::MAX),
        })
    }
}
