//! `Hub`: the core plus what the wire needs around it (names ⇄ ids, which
//! sessions hold service tokens), sans IO. The server's core task owns exactly
//! one; a fuzzer can own one too and drive it without a network.

use crate::proto::{
    self, Answer, ErrorCode, QueryResult, Refused, Request, RouteEntry, ServerFrame, Snapshot,
    Welcome, WireError,
};
use crate::server::conn::{Handled, Step};
use crate::token::{Claims, WatchClaim};
use greendot_core::{
    Config, ConfigError, Connect, Core, DeviceId, DeviceKind, EndReason, Millis, Output, Saved,
    SessionId, Tier, UserId, Watch,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Names to dense ids and back, with a cap. Ids are never reused.
#[derive(Debug, Default)]
pub struct Interner {
    ids: HashMap<Arc<str>, u64>,
    names: Vec<Arc<str>>,
    cap: usize,
}

impl Interner {
    pub fn new(cap: usize) -> Interner {
        Interner {
            ids: HashMap::new(),
            names: Vec::new(),
            cap,
        }
    }

    pub fn get(&self, name: &str) -> Option<u64> {
        self.ids.get(name).copied()
    }

    pub fn intern(&mut self, name: &str) -> Option<u64> {
        if let Some(id) = self.get(name) {
            return Some(id);
        }
        if self.names.len() >= self.cap {
            return None;
        }
        let id = self.names.len() as u64;
        let name: Arc<str> = Arc::from(name);
        self.names.push(name.clone());
        self.ids.insert(name, id);
        Some(id)
    }

    pub fn name(&self, id: u64) -> Option<&Arc<str>> {
        usize::try_from(id).ok().and_then(|i| self.names.get(i))
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// Limits the hub enforces on requests (the core enforces its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HubLimits {
    /// User and device names, in bytes.
    pub max_name_len: usize,
    /// Distinct user names and device names remembered (each).
    pub max_names: usize,
    /// Targets in one `Subscribe`, and in one `Query` by a service token.
    pub max_targets: usize,
    /// Users in a token's `watch` list.
    pub max_watch: usize,
}

impl Default for HubLimits {
    fn default() -> HubLimits {
        HubLimits {
            max_name_len: 128,
            max_names: 10_000_000,
            max_targets: 1_000,
            max_watch: 10_000,
        }
    }
}

/// What the hub asks its driver to do, drained with [`Hub::poll_output`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HubOutput {
    /// Send this update on the session's push stream of this tier.
    Push {
        session: SessionId,
        tier: Tier,
        push: proto::Push,
    },
    /// The session is over: close its connection if it still has one.
    End {
        session: SessionId,
        reason: EndReason,
    },
}

#[derive(Clone, Copy, Debug)]
struct Meta {
    svc: bool,
    watch_all: bool,
    user: UserId,
    device: DeviceId,
    kind: DeviceKind,
}

/// A live device, as a restarted server may restore it (see
/// [`Hub::restore_device`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveDevice {
    pub user: String,
    pub device: String,
    pub kind: proto::Kind,
}

/// The core with names, service flags and wire conversions around it.
#[derive(Debug)]
pub struct Hub {
    core: Core,
    users: Interner,
    devices: Interner,
    sessions: HashMap<SessionId, Meta>,
    unix_base_ms: u64,
    limits: HubLimits,
    max_frame: u32,
    /// Session ids on the wire are the core's XOR this key, so that a session
    /// id from another process (a client resuming after a restart) names no
    /// session here.
    session_key: u64,
    /// Users whose saved state ([`Hub::saved`]) may have changed, for a
    /// driver that persists it; drained with [`Hub::take_touched`].
    touched: Vec<UserId>,
}

impl Hub {
    /// `unix_base_ms` is the Unix time (ms) of `Millis(0)` on the driver's clock,
    /// used to tell clients `last_seen` in wall-clock time.
    pub fn new(config: Config, limits: HubLimits, unix_base_ms: u64) -> Result<Hub, ConfigError> {
        Ok(Hub {
            core: Core::new(config)?,
            users: Interner::new(limits.max_names),
            devices: Interner::new(limits.max_names),
            sessions: HashMap::new(),
            unix_base_ms,
            limits,
            max_frame: proto::DEFAULT_MAX_FRAME as u32,
            session_key: 0,
            touched: Vec::new(),
        })
    }

    /// Session ids on the wire become the core's XOR `key` (default 0). A
    /// server picks a random key per process, so that a client resuming a
    /// session of a previous process never names one of this process.
    pub fn with_session_key(mut self, key: u64) -> Hub {
        self.session_key = key;
        self
    }

    /// The session id a client is told for a core session.
    pub fn wire_session(&self, session: SessionId) -> u64 {
        session.0 ^ self.session_key
    }

    /// Users whose saved state may have changed since the last call (with
    /// repeats): connects, disconnects, logouts, status and invisibility
    /// changes, ended sessions.
    pub fn take_touched(&mut self) -> Vec<UserId> {
        std::mem::take(&mut self.touched)
    }

    /// The user of a live session.
    pub fn session_user(&self, session: SessionId) -> Option<UserId> {
        self.sessions.get(&session).map(|m| m.user)
    }

    /// What a server keeps of `user` across restarts, and whether others are
    /// shown them online right now.
    pub fn saved(&self, user: UserId) -> (Saved, bool) {
        (self.core.saved(user), self.core.shown(user).online)
    }

    /// Restores what was saved of the user `name` before a restart (see
    /// `Core::restore`): before the user connects.
    pub fn restore(&mut self, name: &str, saved: Saved) -> Result<UserId, WireError> {
        let user = self.intern_user(name)?;
        self.core.restore(user, saved)?;
        Ok(user)
    }

    /// Brings back a device that was live when the previous process drained,
    /// as a lost connection: it lingers for its grace (others keep seeing the
    /// user online, unless invisible) and a reconnect of that device takes
    /// over unseen. Call before accepting connections, after [`Hub::restore`].
    pub fn restore_device(
        &mut self,
        now: Millis,
        user: &str,
        device: &str,
        kind: proto::Kind,
        linger_until: Millis,
    ) -> Result<(), WireError> {
        self.name_ok(device, "device")?;
        let user = self.intern_user(user)?;
        let device =
            self.devices.intern(device).map(DeviceId).ok_or_else(|| {
                WireError::new(ErrorCode::TooManyDevices, "too many device names")
            })?;
        let kind: DeviceKind = kind.into();
        let connected = self.core.handle_connect(
            now,
            Connect {
                user,
                device,
                kind,
                watch: Watch::only([]),
                resume: None,
            },
        )?;
        self.sessions.insert(
            connected.session,
            Meta {
                svc: false,
                watch_all: false,
                user,
                device,
                kind,
            },
        );
        // Lingering at least until `linger_until` (the restart's readmission
        // time past the grace).
        self.core
            .handle_disconnect_until(now, connected.session, linger_until)?;
        Ok(())
    }

    /// Every live device (Online or Lingering).
    pub fn live_devices(&self) -> Vec<LiveDevice> {
        self.sessions
            .values()
            .filter_map(|m| {
                Some(LiveDevice {
                    user: self.users.name(m.user.0)?.to_string(),
                    device: self.devices.name(m.device.0)?.to_string(),
                    kind: m.kind.into(),
                })
            })
            .collect()
    }

    /// The frame cap announced in welcomes (the server's `max_frame`).
    pub fn with_max_frame(mut self, max_frame: u32) -> Hub {
        self.max_frame = max_frame;
        self
    }

    pub fn core(&self) -> &Core {
        &self.core
    }

    /// The user id of a name, if it was ever seen.
    pub fn user_id(&self, name: &str) -> Option<UserId> {
        self.users.get(name).map(UserId)
    }

    pub fn user_name(&self, id: UserId) -> Option<&str> {
        self.users.name(id.0).map(|n| &**n)
    }

    pub fn poll_timeout(&self) -> Option<Millis> {
        self.core.poll_timeout()
    }

    pub fn handle_timeout(&mut self, now: Millis) {
        self.core.handle_timeout(now);
    }

    /// Any sign of life from a connection.
    pub fn activity(&mut self, now: Millis, session: SessionId) {
        let _ = self.core.handle_activity(now, session);
    }

    /// The connection of `session` is gone: a logout if it closed with the
    /// logout code, otherwise a disconnect (the device lingers for grace).
    /// A stale session changes nothing.
    pub fn closed(&mut self, now: Millis, session: SessionId, logout: bool) {
        if let Some(user) = self.session_user(session) {
            self.touched.push(user);
        }
        let _ = if logout {
            self.core.handle_logout(now, session)
        } else {
            self.core.handle_disconnect(now, session)
        };
    }

    /// Runs one step of a connection (see [`crate::server::handle_frame`]).
    pub fn apply(&mut self, now: Millis, step: Step) -> Handled {
        match step {
            Step::Hello { claims, resume } => match self.hello(now, &claims, resume) {
                Ok(welcome) => Handled {
                    welcomed: Some(SessionId(welcome.session ^ self.session_key)),
                    reply: Some(ServerFrame::Welcome(welcome)),
                    close: None,
                },
                Err(error) => Handled::close(error),
            },
            Step::Request {
                session,
                id,
                request,
            } => {
                let logout = matches!(request, Request::Logout);
                let result = self.request(now, session, request);
                let close = (logout && result.is_ok()).then_some(proto::CloseCode::Logout);
                Handled {
                    welcomed: None,
                    reply: Some(ServerFrame::Reply { id, result }),
                    close,
                }
            }
            Step::Reply(frame) => Handled {
                welcomed: None,
                reply: Some(frame),
                close: None,
            },
            Step::Close(error) => Handled::close(error),
            Step::Nothing => Handled::default(),
        }
    }

    fn name_ok(&self, name: &str, what: &str) -> Result<(), WireError> {
        if name.is_empty() || name.len() > self.limits.max_name_len {
            return Err(WireError::new(
                ErrorCode::BadRequest,
                format!(
                    "{what} name must be 1 to {} bytes",
                    self.limits.max_name_len
                ),
            ));
        }
        Ok(())
    }

    fn intern_user(&mut self, name: &str) -> Result<UserId, WireError> {
        self.name_ok(name, "user")?;
        self.users
            .intern(name)
            .map(UserId)
            .ok_or_else(|| WireError::new(ErrorCode::TooManyUsers, "too many user names"))
    }

    /// A verified hello: connect (or resume) the device.
    pub fn hello(
        &mut self,
        now: Millis,
        claims: &Claims,
        resume: Option<u64>,
    ) -> Result<Welcome, WireError> {
        self.name_ok(&claims.dev, "device")?;
        let user = self.intern_user(&claims.sub)?;
        let watch = match &claims.watch {
            WatchClaim::Star(_) => Watch::All,
            WatchClaim::List(list) => {
                if list.len() > self.limits.max_watch {
                    return Err(WireError::new(
                        ErrorCode::BadToken,
                        format!("watch lists more than {} users", self.limits.max_watch),
                    ));
                }
                let mut ids = Vec::with_capacity(list.len());
                for name in list {
                    ids.push(self.intern_user(name)?);
                }
                Watch::only(ids)
            }
        };
        let device = self
            .devices
            .intern(&claims.dev)
            .map(DeviceId)
            .ok_or_else(|| WireError::new(ErrorCode::TooManyDevices, "too many device names"))?;
        let connected = self.core.handle_connect(
            now,
            Connect {
                user,
                device,
                kind: claims.kind.into(),
                watch,
                resume: resume.map(|s| SessionId(s ^ self.session_key)),
            },
        )?;
        self.touched.push(user);
        self.sessions.insert(
            connected.session,
            Meta {
                svc: claims.svc,
                watch_all: matches!(claims.watch, WatchClaim::Star(_)),
                user,
                device,
                kind: claims.kind.into(),
            },
        );
        let snapshots = connected
            .snapshots
            .iter()
            .map(|s| self.snapshot(s))
            .collect();
        Ok(Welcome {
            version: proto::VERSION,
            session: self.wire_session(connected.session),
            resumed: connected.resumed,
            user: claims.sub.clone(),
            device: claims.dev.clone(),
            snapshots,
            max_frame: self.max_frame,
        })
    }

    fn snapshot(&self, s: &greendot_core::Snapshot) -> Snapshot {
        Snapshot {
            target: self.user_name(s.target).unwrap_or_default().to_owned(),
            tier: s.tier.into(),
            presence: proto::Presence::from_core(&s.presence, self.unix_base_ms),
        }
    }

    /// One request of an established session. Every request renews the lease.
    pub fn request(
        &mut self,
        now: Millis,
        session: SessionId,
        request: Request,
    ) -> Result<Answer, WireError> {
        self.core.handle_activity(now, session)?;
        let svc = self.sessions.get(&session).is_some_and(|m| m.svc);
        if matches!(
            request,
            Request::SetStatus { .. } | Request::SetInvisible { .. } | Request::Logout
        ) {
            if let Some(user) = self.session_user(session) {
                self.touched.push(user);
            }
        }
        match request {
            Request::Ping => Ok(Answer::Done),
            Request::Subscribe { targets, tier } => {
                self.check_targets(targets.len())?;
                let mut snapshots = Vec::new();
                let mut refused = Vec::new();
                for target in targets {
                    let result = self.intern_user(&target).and_then(|id| {
                        self.core
                            .handle_subscribe(now, session, id, tier.into())
                            .map_err(WireError::from)
                    });
                    match result {
                        Ok(s) => snapshots.push(self.snapshot(&s)),
                        Err(error) => refused.push(Refused { target, error }),
                    }
                }
                Ok(Answer::Subscribed { snapshots, refused })
            }
            Request::Unsubscribe { target } => {
                let id = self.users.get(&target).ok_or_else(|| {
                    WireError::new(ErrorCode::NotSubscribed, "not subscribed to that user")
                })?;
                self.core.handle_unsubscribe(now, session, UserId(id))?;
                Ok(Answer::Done)
            }
            Request::Query { targets } => {
                if targets.len() > 1 && !svc {
                    return Err(WireError::new(
                        ErrorCode::ServiceOnly,
                        "querying several users at once needs a service token",
                    ));
                }
                self.check_targets(targets.len())?;
                let mut results = Vec::with_capacity(targets.len());
                for target in targets {
                    let result = match self.users.get(&target) {
                        Some(id) => self
                            .core
                            .handle_query(now, session, UserId(id))
                            .map(|p| proto::Presence::from_core(&p, self.unix_base_ms))
                            .map_err(WireError::from),
                        // Never seen: offline, if the session may know that much.
                        None => self
                            .name_ok(&target, "user")
                            .and_then(|()| self.query_unknown(session)),
                    };
                    results.push(QueryResult { target, result });
                }
                Ok(Answer::Presences(results))
            }
            Request::SetStatus { status, message } => {
                self.core
                    .handle_set_status(now, session, status.into(), message.as_deref())?;
                Ok(Answer::Done)
            }
            Request::SetInvisible { invisible } => {
                self.core.handle_set_invisible(now, session, invisible)?;
                Ok(Answer::Done)
            }
            Request::Route { user } => {
                if !svc {
                    return Err(WireError::new(
                        ErrorCode::ServiceOnly,
                        "route needs a service token",
                    ));
                }
                let Some(id) = self.users.get(&user) else {
                    return Ok(Answer::Route(Vec::new()));
                };
                let entries = self
                    .core
                    .route(UserId(id))
                    .into_iter()
                    .filter_map(|s| {
                        let info = self.core.session_info(s)?;
                        Some(RouteEntry {
                            device: self.devices.name(info.device.0)?.to_string(),
                            kind: info.kind.into(),
                            session: self.wire_session(s),
                        })
                    })
                    .collect();
                Ok(Answer::Route(entries))
            }
            Request::Logout => {
                self.core.handle_logout(now, session)?;
                Ok(Answer::Done)
            }
        }
    }

    fn check_targets(&self, n: usize) -> Result<(), WireError> {
        if n > self.limits.max_targets {
            return Err(WireError::new(
                ErrorCode::TooManyTargets,
                format!("at most {} targets per request", self.limits.max_targets),
            ));
        }
        Ok(())
    }

    /// A user never seen is offline; only a session that may watch anybody
    /// may be told so (restricted watch lists were interned at hello).
    fn query_unknown(&self, session: SessionId) -> Result<proto::Presence, WireError> {
        match self.sessions.get(&session) {
            Some(meta) if meta.watch_all => Ok(proto::Presence::default()),
            Some(_) => Err(WireError::new(
                ErrorCode::NotAllowed,
                "not allowed to watch that user",
            )),
            None => Err(WireError::new(
                ErrorCode::Stale,
                "session is no longer current",
            )),
        }
    }

    /// The next output for the driver.
    pub fn poll_output(&mut self) -> Option<HubOutput> {
        let out = self.core.poll_output()?;
        Some(match out {
            Output::Push {
                to,
                target,
                tier,
                presence,
            } => HubOutput::Push {
                session: to,
                tier,
                push: proto::Push::Update {
                    target: self.user_name(target).unwrap_or_default().to_owned(),
                    presence: proto::Presence::from_core(&presence, self.unix_base_ms),
                },
            },
            Output::SessionEnded { session, reason } => {
                if let Some(meta) = self.sessions.remove(&session) {
                    self.touched.push(meta.user);
                }
                HubOutput::End { session, reason }
            }
        })
    }
}
