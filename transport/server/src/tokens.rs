//! Tokens on live sessions, sans IO: each session's token expiry (a session
//! whose token is past `exp` plus the leeway, with no refresh, is closed
//! with `TokenExpired`) and the revocation list ("every token of user U, or
//! of U's device D, issued before T is refused"), bounded, and persisted by
//! the server's store.

use crate::token::Claims;
use greendot_core::{DeviceId, Millis, SessionId, UserId};
use greendot_proto::{CloseCode, ErrorCode, WireError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};

/// One revocation: tokens of `user` (only of `device`, if given) whose `iat`
/// is before `before` (Unix seconds) are refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revocation {
    pub user: String,
    pub device: Option<String>,
    pub before: u64,
}

/// What a live session's token says, kept while the session lives.
#[derive(Clone, Copy, Debug)]
struct Held {
    user: UserId,
    device: DeviceId,
    /// `None`: the token had no `iat` (counts as issued at 0).
    iat: Option<u64>,
    /// When the session is closed unless refreshed (`exp` plus the leeway).
    due: Millis,
}

/// The revocations of one user.
#[derive(Clone, Debug, Default)]
struct UserRevocations {
    all: Option<u64>,
    devices: HashMap<String, u64>,
}

impl UserRevocations {
    /// The latest `before` that applies to `device`.
    fn before(&self, device: &str) -> Option<u64> {
        let one = self.devices.get(device).copied();
        match (self.all, one) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Token expiry and revocation for every live session.
#[derive(Debug)]
pub struct Credentials {
    /// `exp` is Unix seconds; the hub's clock is Unix ms minus this.
    unix_base_ms: u64,
    leeway_ms: u64,
    held: HashMap<SessionId, Held>,
    deadlines: BTreeSet<(Millis, SessionId)>,
    revoked: HashMap<String, UserRevocations>,
    entries: usize,
    max_revocations: usize,
    /// Revocations made since the last [`Credentials::take_changed`], to store.
    changed: Vec<Revocation>,
    /// Sessions to close, with the code to close them with.
    closes: Vec<(SessionId, CloseCode)>,
}

impl Credentials {
    pub fn new(unix_base_ms: u64, leeway_ms: u64, max_revocations: usize) -> Credentials {
        Credentials {
            unix_base_ms,
            leeway_ms,
            held: HashMap::new(),
            deadlines: BTreeSet::new(),
            revoked: HashMap::new(),
            entries: 0,
            max_revocations,
            changed: Vec::new(),
            closes: Vec::new(),
        }
    }

    /// Whether `claims` may be used (hello or refresh): not revoked.
    pub fn check(&self, claims: &Claims) -> Result<(), WireError> {
        let before = self
            .revoked
            .get(&claims.sub)
            .and_then(|r| r.before(&claims.dev));
        match before {
            Some(before) if claims.iat.unwrap_or(0) < before => Err(WireError::new(
                ErrorCode::TokenRevoked,
                "the token was revoked (issued before a revocation of its user or device)",
            )),
            _ => Ok(()),
        }
    }

    fn due(&self, exp: u64) -> Millis {
        Millis(
            exp.saturating_mul(1000)
                .saturating_sub(self.unix_base_ms)
                .saturating_add(self.leeway_ms),
        )
    }

    /// A session was welcomed with `claims`, or refreshed to them.
    pub fn hold(&mut self, session: SessionId, user: UserId, device: DeviceId, claims: &Claims) {
        self.release(session);
        let due = self.due(claims.exp);
        self.held.insert(
            session,
            Held {
                user,
                device,
                iat: claims.iat,
                due,
            },
        );
        self.deadlines.insert((due, session));
    }

    /// The session ended.
    pub fn release(&mut self, session: SessionId) {
        if let Some(held) = self.held.remove(&session) {
            self.deadlines.remove(&(held.due, session));
        }
    }

    /// When the next token runs out.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.deadlines.first().map(|&(at, _)| at)
    }

    /// Sessions whose token ran out by `now` are to be closed with
    /// `TokenExpired`.
    pub fn handle_timeout(&mut self, now: Millis) {
        while let Some(&(at, session)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.pop_first();
            self.held.remove(&session);
            self.closes.push((session, CloseCode::TokenExpired));
        }
    }

    /// Adds a revocation (the later `before` wins for one user and device);
    /// refused past the cap when it needs a new entry. Returns the live
    /// sessions it revokes (`user` and `device` are the ids of those names,
    /// if interned: a name nobody holds has no session).
    pub fn revoke(
        &mut self,
        revocation: Revocation,
        user: Option<UserId>,
        device: Option<DeviceId>,
    ) -> Result<Vec<SessionId>, WireError> {
        let entry = self.revoked.get(&revocation.user);
        let exists = entry.is_some_and(|r| match &revocation.device {
            None => r.all.is_some(),
            Some(d) => r.devices.contains_key(d),
        });
        if !exists && self.entries >= self.max_revocations {
            return Err(WireError::new(
                ErrorCode::TooManyRevocations,
                format!("the revocation list holds {} entries", self.max_revocations),
            ));
        }
        let r = self.revoked.entry(revocation.user.clone()).or_default();
        let before = match &revocation.device {
            None => r.all.get_or_insert(0),
            Some(d) => r.devices.entry(d.clone()).or_insert(0),
        };
        *before = (*before).max(revocation.before);
        if !exists {
            self.entries += 1;
        }
        self.changed.push(revocation.clone());
        let Some(user) = user else {
            return Ok(Vec::new());
        };
        let mut hit: Vec<SessionId> = self
            .held
            .iter()
            .filter(|(_, h)| {
                h.user == user
                    && (revocation.device.is_none() || Some(h.device) == device)
                    && h.iat.unwrap_or(0) < revocation.before
            })
            .map(|(&s, _)| s)
            .collect();
        hit.sort_unstable();
        for &s in &hit {
            self.release(s);
            self.closes.push((s, CloseCode::Revoked));
        }
        Ok(hit)
    }

    /// Revocations loaded from the store at start (past the cap too: what
    /// was stored is never dropped).
    pub fn restore(&mut self, revocations: impl IntoIterator<Item = Revocation>) {
        let cap = self.max_revocations;
        self.max_revocations = usize::MAX;
        for r in revocations {
            let _ = self.revoke(r, None, None);
        }
        self.max_revocations = cap;
        self.changed.clear();
    }

    /// Revocations to store since the last call.
    pub fn take_changed(&mut self) -> Vec<Revocation> {
        std::mem::take(&mut self.changed)
    }

    /// Sessions to close since the last call.
    pub fn take_closes(&mut self) -> Vec<(SessionId, CloseCode)> {
        std::mem::take(&mut self.closes)
    }

    /// Revocation entries held.
    pub fn revocations(&self) -> usize {
        self.entries
    }

    /// Sessions whose token is held.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::WatchClaim;
    use greendot_proto::Kind;
    use std::time::Duration;

    fn claims(user: &str, device: &str, iat: Option<u64>, exp: u64) -> Claims {
        let mut c = Claims::new(
            user,
            device,
            Kind::Mobile,
            WatchClaim::all(),
            Duration::ZERO,
        );
        c.iat = iat;
        c.exp = exp;
        c
    }

    fn revocation(user: &str, device: Option<&str>, before: u64) -> Revocation {
        Revocation {
            user: user.into(),
            device: device.map(Into::into),
            before,
        }
    }

    #[test]
    fn a_token_runs_out_at_exp_plus_the_leeway_unless_refreshed() {
        let mut c = Credentials::new(0, 2_000, 10);
        let s = SessionId(1);
        c.hold(
            s,
            UserId(1),
            DeviceId(1),
            &claims("ann", "phone", Some(1), 10),
        );
        assert_eq!(c.poll_timeout(), Some(Millis(12_000)));
        c.handle_timeout(Millis(11_999));
        assert!(c.take_closes().is_empty());
        // Refreshed: the new exp counts.
        c.hold(
            s,
            UserId(1),
            DeviceId(1),
            &claims("ann", "phone", Some(9), 20),
        );
        assert_eq!(c.held(), 1);
        c.handle_timeout(Millis(12_000));
        assert!(c.take_closes().is_empty(), "the old deadline is gone");
        c.handle_timeout(Millis(22_000));
        assert_eq!(c.take_closes(), vec![(s, CloseCode::TokenExpired)]);
        assert_eq!((c.held(), c.poll_timeout()), (0, None));
        // An ended session is forgotten.
        c.hold(
            s,
            UserId(1),
            DeviceId(1),
            &claims("ann", "phone", Some(9), 30),
        );
        c.release(s);
        c.handle_timeout(Millis(u64::MAX));
        assert!(c.take_closes().is_empty());
    }

    #[test]
    fn revocations_refuse_older_tokens_and_close_their_sessions() {
        let mut c = Credentials::new(0, 0, 10);
        let (phone, laptop) = (SessionId(1), SessionId(2));
        c.hold(
            phone,
            UserId(1),
            DeviceId(1),
            &claims("ann", "phone", Some(100), 999),
        );
        c.hold(
            laptop,
            UserId(1),
            DeviceId(2),
            &claims("ann", "laptop", Some(100), 999),
        );
        // The phone only.
        let hit = c
            .revoke(
                revocation("ann", Some("phone"), 101),
                Some(UserId(1)),
                Some(DeviceId(1)),
            )
            .unwrap();
        assert_eq!(hit, vec![phone]);
        assert_eq!(c.take_closes(), vec![(phone, CloseCode::Revoked)]);
        let code = |r: Result<(), WireError>| r.err().map(|e| e.code);
        assert_eq!(
            code(c.check(&claims("ann", "phone", Some(100), 999))),
            Some(ErrorCode::TokenRevoked)
        );
        assert_eq!(
            code(c.check(&claims("ann", "phone", Some(101), 999))),
            None,
            "issued at T"
        );
        assert_eq!(
            code(c.check(&claims("ann", "laptop", Some(100), 999))),
            None
        );
        assert_eq!(
            code(c.check(&claims("ann", "phone", None, 999))),
            Some(ErrorCode::TokenRevoked)
        );
        // An earlier `before` changes nothing; the whole user.
        c.revoke(revocation("ann", Some("phone"), 50), None, None)
            .unwrap();
        assert_eq!(
            code(c.check(&claims("ann", "phone", Some(100), 999))),
            Some(ErrorCode::TokenRevoked)
        );
        let hit = c
            .revoke(revocation("ann", None, 101), Some(UserId(1)), None)
            .unwrap();
        assert_eq!(hit, vec![laptop]);
        assert_eq!(
            code(c.check(&claims("ann", "laptop", Some(100), 999))),
            Some(ErrorCode::TokenRevoked)
        );
        assert_eq!(code(c.check(&claims("bob", "phone", None, 999))), None);
        assert_eq!(c.revocations(), 2);
        assert_eq!(c.take_changed().len(), 3);
    }

    #[test]
    fn the_revocation_list_is_capped_before_storing() {
        let mut c = Credentials::new(0, 0, 2);
        c.revoke(revocation("a", None, 1), None, None).unwrap();
        c.revoke(revocation("b", Some("d"), 1), None, None).unwrap();
        let e = c.revoke(revocation("c", None, 1), None, None).unwrap_err();
        assert_eq!(e.code, ErrorCode::TooManyRevocations);
        assert_eq!(c.revocations(), 2);
        assert_eq!(c.take_changed().len(), 2, "the refused one is not stored");
        // Raising an existing entry needs no room.
        c.revoke(revocation("a", None, 5), None, None).unwrap();
        assert_eq!(c.revocations(), 2);
        // What the store held comes back whole, and is not stored again.
        let mut d = Credentials::new(0, 0, 1);
        d.restore(vec![revocation("a", None, 5), revocation("b", None, 5)]);
        assert_eq!(d.revocations(), 2);
        assert!(d.take_changed().is_empty());
    }
}
