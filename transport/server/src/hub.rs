//! `Hub`: the core plus what the wire needs around it (names ⇄ ids, which
//! sessions hold service tokens, which names may be forgotten), sans IO. The
//! server's sans-IO state (`ServerState`, driven by the one task in
//! `driver.rs`) owns exactly one, next to every connection; a fuzzer can own one too and drive it without a network.

use crate::conn::{Handled, Step};
use crate::token::{Claims, WatchClaim};
use crate::tokens::{Credentials, Revocation};
use bytes::Bytes;
use greendot_core::{
    Config, ConfigError, Connect, Core, DeviceId, DeviceKind, EndReason, Millis, Output, Saved,
    SessionId, Tier, UserId, Watch,
};
use greendot_proto::{
    self as proto, Answer, ErrorCode, QueryResult, Refused, Request, RouteEntry, ServerFrame,
    Snapshot, Welcome, WireError,
};
use std::collections::HashMap;
use std::sync::Arc;

#[path = "hub_groups.rs"]
mod groups;
pub use crate::interner::Interner;
pub use groups::{GroupFeed, GroupWrite, StoredGroup};
#[path = "hub_tokens.rs"]
mod tokens;

/// The users a session's token lets it watch (`None`: anybody).
type Watched = Option<Arc<[UserId]>>;

/// Why saved state could not be restored at start.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// A saved name is not valid under the current limits, or past the cap.
    #[error("saved name refused: {}", .0.message)]
    Name(WireError),
    /// A saved group is refused under the current limits.
    #[error("saved group refused: {}", .0.message)]
    Group(WireError),
    #[error("the core refused the saved state: {0}")]
    Core(#[from] greendot_core::Error),
}

/// Limits the hub enforces on requests (the core enforces its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HubLimits {
    /// User and device names, in bytes.
    pub max_name_len: usize,
    /// Distinct user names and device names remembered (each).
    pub max_names: usize,
    /// Targets in one `Subscribe`, and in one `Query` by a service token.
    pub max_targets: usize,
    /// Users in a token's `watch` list.
    pub max_watch: usize,
    /// Entries in the revocation list (one per user, or user and device).
    pub max_revocations: usize,
}

impl Default for HubLimits {
    fn default() -> HubLimits {
        HubLimits {
            max_name_len: 128,
            max_names: 10_000_000,
            max_targets: 1_000,
            max_watch: 10_000,
            max_revocations: 100_000,
        }
    }
}

/// What the hub asks its driver to do, drained with [`Hub::poll_output`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HubOutput {
    /// Send this update on the session's push stream of this tier: `frame`
    /// is the encoded [`proto::Push::Update`] (length prefix included),
    /// encoded once per target and view and shared by every subscriber it
    /// goes to.
    Push {
        session: SessionId,
        tier: Tier,
        frame: Bytes,
    },
    /// The session is over: close its connection if it still has one.
    End {
        session: SessionId,
        reason: EndReason,
    },
}

#[derive(Clone, Debug)]
struct Meta {
    svc: bool,
    watch_all: bool,
    /// The token's watch list (shared with the core's `Watch`): each entry
    /// holds a reference on its name while the session lives.
    watch: Option<Arc<[UserId]>>,
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
    /// Users that may hold nothing any more, freed by [`Hub::release_idle`].
    idle: Vec<UserId>,
    /// Users offline with default saved state that could not be freed yet
    /// (a debounce running, a watcher): tried again by [`Hub::sweep`].
    retry: Vec<UserId>,
    /// Where [`Hub::sweep`] goes on in the user names.
    sweep_at: usize,
    /// A cluster's edge ([`Hub::set_cluster_edge`]): the users' owners keep
    /// their saved state, so the core's copy does not hold a user here.
    cluster_edge: bool,
    /// Push frames encoded since the outputs were last drained, by target
    /// and view: a publish to many subscribers is encoded once.
    encoded: HashMap<(UserId, greendot_core::Presence), Bytes>,
    /// Devices restored as lingering at start that may still be waiting for
    /// their turn ([`Hub::hold_restored`]), and devices lost while they do.
    restored: Vec<SessionId>,
    /// Each session's token expiry, and the revocation list.
    credentials: Credentials,
    /// The last group push encoded, and its frame.
    group_frame: Option<(proto::Push, Bytes)>,
    /// Group writes since [`Hub::take_group_writes`], in order, while
    /// `store_groups`.
    group_writes: Vec<GroupWrite>,
    store_groups: bool,
    /// Members no watched page lists any more, named before a membership
    /// write may free their names (counts fed).
    fed_unlisted: std::collections::VecDeque<String>,
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
            idle: Vec::new(),
            retry: Vec::new(),
            sweep_at: 0,
            cluster_edge: false,
            encoded: HashMap::new(),
            restored: Vec::new(),
            credentials: Credentials::new(unix_base_ms, 0, limits.max_revocations),
            group_frame: None,
            group_writes: Vec::new(),
            store_groups: false,
            fed_unlisted: std::collections::VecDeque::new(),
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

    /// Whether a live session holds a service token.
    pub fn is_service(&self, session: SessionId) -> bool {
        self.sessions.get(&session).is_some_and(|m| m.svc)
    }

    /// The device kind of a live session.
    pub fn session_kind(&self, session: SessionId) -> Option<DeviceKind> {
        self.sessions.get(&session).map(|m| m.kind)
    }

    /// Whether `session`'s app is in the foreground (I12).
    pub fn session_foreground(&self, session: SessionId) -> Option<bool> {
        self.core.session_info(session).map(|i| i.foreground)
    }

    /// Whether `session` may watch the user `target` (its token's `watch`;
    /// a user may always watch themselves): the check a subscribe makes,
    /// for a cluster edge that subscribes outside the core.
    pub fn may_watch(&self, session: SessionId, target: &str) -> Result<(), WireError> {
        self.name_ok(target, "user")?;
        let meta = self
            .sessions
            .get(&session)
            .ok_or_else(|| WireError::new(ErrorCode::Stale, "session is no longer current"))?;
        let own = self.user_name(meta.user) == Some(target);
        let listed = || {
            let id = self.users.get(target).map(UserId);
            meta.watch
                .as_ref()
                .is_some_and(|list| id.is_some_and(|id| list.contains(&id)))
        };
        if meta.watch_all || own || listed() {
            Ok(())
        } else {
            Err(WireError::new(
                ErrorCode::NotAllowed,
                "not allowed to watch that user",
            ))
        }
    }

    /// What a server keeps of `user` across restarts, and whether others are
    /// shown them online right now.
    pub fn saved(&self, user: UserId) -> (Saved, bool) {
        (self.core.saved(user), self.core.shown(user).online)
    }

    /// Restores what was saved of the user `name` before a restart (see
    /// `Core::restore`): before the user connects.
    pub fn restore(&mut self, name: &str, saved: Saved) -> Result<UserId, RestoreError> {
        let user = self.intern_user(name).map_err(RestoreError::Name)?;
        self.idle.push(user);
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
    ) -> Result<(), RestoreError> {
        self.name_ok(device, "device").map_err(RestoreError::Name)?;
        let user = self.intern_user(user).map_err(RestoreError::Name)?;
        let device = self
            .intern_device(device, user)
            .map_err(RestoreError::Name)?;
        let kind: DeviceKind = kind.into();
        let connected = self
            .core
            .handle_connect(
                now,
                Connect {
                    user,
                    device,
                    kind,
                    watch: Watch::only([]),
                    resume: None,
                    foreground: true,
                },
            )
            .inspect_err(|_| self.forget_unused(user, device))?;
        self.devices.acquire(device.0);
        self.sessions.insert(
            connected.session,
            Meta {
                svc: false,
                watch_all: false,
                watch: None,
                user,
                device,
                kind,
            },
        );
        // Lingering at least until `linger_until` (the restart's readmission
        // time past the grace).
        self.core
            .handle_disconnect_until(now, connected.session, now, linger_until)?;
        self.restored.push(connected.session);
        Ok(())
    }

    /// Every device restored at start (or lost again while they were held)
    /// that is still lingering (not back, not ended) lingers until at least
    /// its grace past `from`; the others are forgotten. How many are still
    /// held. A server calls it while it sheds handshakes: those devices may
    /// be waiting for their turn.
    pub fn hold_restored(&mut self, now: Millis, from: Millis) -> usize {
        let core = &mut self.core;
        let sessions = &self.sessions;
        self.restored.retain(|&id| {
            let Some(meta) = sessions.get(&id) else {
                return false;
            };
            let until = from.plus(core.config().kind(meta.kind).grace);
            core.extend_linger(now, id, until)
        });
        self.restored.len()
    }

    /// Whether devices restored at start may still be waiting.
    pub fn holds_restored(&self) -> bool {
        !self.restored.is_empty()
    }

    /// Every live device (Online or Lingering), in session order (the same
    /// in every run, whatever the map's hasher).
    pub fn live_devices(&self) -> Vec<LiveDevice> {
        let mut sessions: Vec<(&SessionId, &Meta)> = self.sessions.iter().collect();
        sessions.sort_unstable_by_key(|(id, _)| **id);
        sessions
            .into_iter()
            .filter_map(|(_, m)| {
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

    /// The connection of `session` was last heard from at `heard`: renews
    /// its lease from then (see `Core::handle_heard`).
    pub fn heard(&mut self, now: Millis, session: SessionId, heard: Millis) {
        let _ = self.core.handle_heard(now, session, heard);
    }

    /// The connection of `session` is gone: a logout if it closed with the
    /// logout code, otherwise a disconnect (the device lingers for grace).
    /// `last_heard`: when the connection last received anything from the
    /// client (its last packet), what the user's `last_seen` is to show
    /// (DESIGN.md). A stale session changes nothing.
    /// A connection lost or closed (not a logout): its device lingers for
    /// its grace, or until `until` if that is later (a drain keeps its
    /// devices live until it has saved them for the next process).
    pub fn closed_until(
        &mut self,
        now: Millis,
        session: SessionId,
        last_heard: Millis,
        until: Millis,
    ) {
        if let Some(user) = self.session_user(session) {
            self.touched.push(user);
        }
        let lingers = self
            .core
            .handle_disconnect_until(now, session, last_heard, until)
            .is_ok();
        // While the devices restored at start still wait for their turn, a
        // device lost again (it got back, then its connection went in the
        // overload) waits for its turn with them. (A session is lost once:
        // no duplicates.)
        if lingers && !self.restored.is_empty() {
            self.restored.push(session);
        }
    }

    pub fn closed(&mut self, now: Millis, session: SessionId, logout: bool, last_heard: Millis) {
        if !logout {
            return self.closed_until(now, session, last_heard, Millis::ZERO);
        }
        if let Some(user) = self.session_user(session) {
            self.touched.push(user);
        }
        self.note_targets(session);
        let _ = self.core.handle_logout(now, session);
    }

    /// Runs one step of a connection (see [`crate::handle_frame`]).
    pub fn apply(&mut self, now: Millis, step: Step) -> Handled {
        match step {
            Step::Hello {
                claims,
                resume,
                foreground,
            } => match self.hello(now, &claims, resume, foreground) {
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
            Step::Refresh {
                session,
                id,
                claims,
            } => Handled {
                welcomed: None,
                reply: Some(ServerFrame::Reply {
                    id,
                    result: self.refresh_token(now, session, &claims),
                }),
                close: None,
            },
            Step::Reply(frame) => Handled {
                welcomed: None,
                reply: Some(frame),
                close: None,
            },
            Step::Close(error) => Handled::close(error),
            Step::Nothing => Handled::default(),
        }
    }

    /// DESIGN.md "Identifiers": 1 to `max_name_len` bytes of UTF-8 (the
    /// wire's strings are UTF-8 already) without control characters, which
    /// would be echoed into logs, events and other clients' screens.
    /// Whether a session (`svc`: with a service token) may ask `Route` of
    /// `user`.
    pub(crate) fn may_route(&self, svc: bool, user: &str) -> Result<(), WireError> {
        if !svc {
            return Err(WireError::new(
                ErrorCode::ServiceOnly,
                "route needs a service token",
            ));
        }
        self.name_ok(user, "user")
    }

    pub(crate) fn name_ok(&self, name: &str, what: &str) -> Result<(), WireError> {
        if name.is_empty() || name.len() > self.limits.max_name_len {
            return Err(WireError::new(
                ErrorCode::BadRequest,
                format!(
                    "{what} name must be 1 to {} bytes",
                    self.limits.max_name_len
                ),
            ));
        }
        if name.chars().any(char::is_control) {
            return Err(WireError::new(
                ErrorCode::BadRequest,
                format!("{what} name must not contain control characters"),
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

    fn intern_device(&mut self, name: &str, user: UserId) -> Result<DeviceId, WireError> {
        self.devices.intern(name).map(DeviceId).ok_or_else(|| {
            self.idle.push(user);
            WireError::new(ErrorCode::TooManyDevices, "too many device names")
        })
    }

    /// After a connect that failed: names it interned that nothing holds.
    fn forget_unused(&mut self, user: UserId, device: DeviceId) {
        if self.devices.refs(device.0) == 0 {
            self.devices.remove(device.0);
        }
        self.idle.push(user);
    }

    /// The targets of a session about to end (they may hold nothing after).
    fn note_targets(&mut self, session: SessionId) {
        let targets = self.core.subscriptions(session);
        self.idle
            .extend(targets.into_iter().map(|(target, _)| target));
    }

    /// Whether the name of `user` and its core record can go: no session's
    /// watch list names it, and the core holds nothing of it.
    fn try_release(&mut self, user: UserId) -> bool {
        if self.users.name(user.0).is_none() || self.users.refs(user.0) > 0 {
            return false;
        }
        // A name without a core record (only ever in a watch list) goes too.
        let released = match self.cluster_edge {
            true => self.core.release_saved(user),
            false => self.core.release(user),
        };
        if self.core.is_known(user) && !released {
            return false;
        }
        self.users.remove(user.0)
    }

    /// Makes this hub a cluster's edge: its core keeps the node's sessions,
    /// and the owners of their users keep what is saved of them (status,
    /// message, invisibility, last seen) in the cluster's KV. A user with
    /// no session, subscriber or watch list here is then freed whatever
    /// the core's copy of that state says, or every user who was ever
    /// shown online through this node would stay in its memory.
    pub fn set_cluster_edge(&mut self) {
        self.cluster_edge = true;
    }

    /// Frees the users noted since the last call that hold nothing (no
    /// session, no watcher, no watch list naming them, default saved state
    /// but at a cluster's edge);
    /// how many were freed. A driver that persists users calls it only after
    /// it took their records (a freed user's record cannot be read).
    pub fn release_idle(&mut self) -> usize {
        let idle = std::mem::take(&mut self.idle);
        let mut freed = 0;
        for user in idle {
            if self.try_release(user) {
                freed += 1;
            } else if self.users.name(user.0).is_some()
                && !self.core.is_online(user)
                && (self.cluster_edge || self.core.saved(user) == Saved::default())
            {
                self.retry.push(user);
            }
        }
        freed
    }

    /// Tries again the users [`Hub::release_idle`] could not free yet, then
    /// checks the next `budget` user names (round robin) and frees those that
    /// hold nothing: catches what `release_idle` is not told of (the targets
    /// of a session that ended on a timer). How many were freed.
    pub fn sweep(&mut self, budget: usize) -> usize {
        let retry = std::mem::take(&mut self.retry);
        let mut freed = 0;
        for user in retry {
            freed += usize::from(self.try_release(user));
        }
        for _ in 0..budget.min(self.users.slots()) {
            if self.sweep_at >= self.users.slots() {
                self.sweep_at = 0;
            }
            if let Some(id) = self.users.id_at(self.sweep_at) {
                freed += usize::from(self.try_release(UserId(id)));
            }
            self.sweep_at += 1;
        }
        freed
    }

    /// User names held (each has at most one core record).
    pub fn user_names(&self) -> usize {
        self.users.len()
    }

    /// User and device names held.
    pub fn names(&self) -> usize {
        self.users.len() + self.devices.len()
    }

    /// A token's watch list within its cap and of valid names: checked
    /// before any name is interned, so a refused token leaves nothing behind.
    fn check_watch(&self, watch: &WatchClaim) -> Result<(), WireError> {
        if let WatchClaim::List(list) = watch {
            if list.len() > self.limits.max_watch {
                return Err(WireError::new(
                    ErrorCode::BadToken,
                    format!("watch lists more than {} users", self.limits.max_watch),
                ));
            }
            for name in list {
                self.name_ok(name, "watched user")?;
            }
        }
        Ok(())
    }

    /// A checked watch claim for the core, and the users it names (`None`:
    /// anybody). On an error nothing of it stays interned.
    fn intern_watch(&mut self, watch: &WatchClaim) -> Result<(Watch, Watched), WireError> {
        let WatchClaim::List(list) = watch else {
            return Ok((Watch::All, None));
        };
        let mut ids = Vec::with_capacity(list.len());
        for name in list {
            match self.intern_user(name) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    self.idle.extend(ids);
                    return Err(e);
                }
            }
        }
        let watch = Watch::only(ids);
        let watched = match &watch {
            Watch::Only(ids) => Some(ids.clone()),
            Watch::All => None,
        };
        Ok((watch, watched))
    }

    /// A verified hello: connect (or resume) the device.
    pub fn hello(
        &mut self,
        now: Millis,
        claims: &Claims,
        resume: Option<u64>,
        foreground: bool,
    ) -> Result<Welcome, WireError> {
        self.credentials.check(claims)?;
        // Every name is checked before any is interned: a refused hello
        // leaves nothing behind.
        self.name_ok(&claims.dev, "device")?;
        self.name_ok(&claims.sub, "user")?;
        self.check_watch(&claims.watch)?;
        let user = self.intern_user(&claims.sub)?;
        let (watch, watched) = match self.intern_watch(&claims.watch) {
            Ok(w) => w,
            Err(e) => {
                self.idle.push(user);
                return Err(e);
            }
        };
        let device = match self.intern_device(&claims.dev, user) {
            Ok(device) => device,
            Err(e) => {
                self.idle
                    .extend(watched.iter().flat_map(|ids| ids.iter().copied()));
                return Err(e);
            }
        };
        let connected = self.core.handle_connect(
            now,
            Connect {
                user,
                device,
                kind: claims.kind.into(),
                watch,
                resume: resume.map(|s| SessionId(s ^ self.session_key)),
                foreground,
            },
        );
        let connected = match connected {
            Ok(c) => c,
            Err(e) => {
                self.forget_unused(user, device);
                self.idle
                    .extend(watched.iter().flat_map(|ids| ids.iter().copied()));
                return Err(e.into());
            }
        };
        self.devices.acquire(device.0);
        for id in watched.iter().flat_map(|ids| ids.iter()) {
            self.users.acquire(id.0);
        }
        self.credentials
            .hold(connected.session, user, device, claims);
        self.touched.push(user);
        self.sessions.insert(
            connected.session,
            Meta {
                svc: claims.svc,
                watch_all: matches!(claims.watch, WatchClaim::Star(_)),
                watch: watched,
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

    /// The user and device names of a live session.
    pub fn session_names(&self, session: SessionId) -> Option<(&str, &str)> {
        let meta = self.sessions.get(&session)?;
        Some((
            self.users.name(meta.user.0)?,
            self.devices.name(meta.device.0)?,
        ))
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
            Request::SetStatus { .. }
                | Request::SetInvisible { .. }
                | Request::SetForeground { .. }
                | Request::Logout
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
                let watch_all = self.sessions.get(&session).is_some_and(|m| m.watch_all);
                for target in targets {
                    // A name nobody holds can only be in no watch list (a
                    // session's list holds its names): refused before it is
                    // interned, so refusals create nothing.
                    let result = self.name_ok(&target, "user").and_then(|()| {
                        match self.users.get(&target) {
                            Some(id) => Ok(UserId(id)),
                            None if watch_all => self.intern_user(&target),
                            None => Err(WireError::new(
                                ErrorCode::NotAllowed,
                                "not allowed to watch that user",
                            )),
                        }
                    });
                    let result = result.and_then(|id| {
                        self.core
                            .handle_subscribe(now, session, id, tier.into())
                            .map_err(|e| {
                                self.idle.push(id);
                                WireError::from(e)
                            })
                    });
                    match result {
                        Ok(s) => snapshots.push(self.snapshot(&s)),
                        Err(error) => refused.push(Refused { target, error }),
                    }
                }
                Ok(Answer::Subscribed { snapshots, refused })
            }
            Request::Unsubscribe { target } => {
                self.name_ok(&target, "user")?;
                let id = self.users.get(&target).ok_or_else(|| {
                    WireError::new(ErrorCode::NotSubscribed, "not subscribed to that user")
                })?;
                self.core.handle_unsubscribe(now, session, UserId(id))?;
                self.idle.push(UserId(id));
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
                    let known = self
                        .name_ok(&target, "user")
                        .map(|()| self.users.get(&target));
                    let result = match known {
                        Err(e) => Err(e),
                        Ok(Some(id)) => self
                            .core
                            .handle_query(now, session, UserId(id))
                            .map(|p| proto::Presence::from_core(&p, self.unix_base_ms))
                            .map_err(WireError::from),
                        // Never seen: offline, if the session may know that much.
                        Ok(None) => self.query_unknown(session),
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
            Request::SetForeground { foreground } => {
                self.core.handle_set_foreground(now, session, foreground)?;
                Ok(Answer::Done)
            }
            Request::Route { user } => {
                self.may_route(svc, &user)?;
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
                self.note_targets(session);
                self.core.handle_logout(now, session)?;
                Ok(Answer::Done)
            }
            // The connection verifies the token first (`Step::Refresh`).
            Request::Refresh { .. } => Err(WireError::new(
                ErrorCode::Internal,
                "a refresh must come through the connection's token check",
            )),
            Request::Revoke {
                user,
                device,
                before,
            } => self.revoke(now, svc, user, device, before),
            request @ (Request::SetGroup { .. }
            | Request::RemoveGroup { .. }
            | Request::GroupSubscribe { .. }
            | Request::GroupUnsubscribe { .. }
            | Request::GroupPage { .. }
            | Request::GroupWatchPage { .. }
            | Request::GroupRenewWatch { .. }
            | Request::GroupUnwatchPage { .. }
            | Request::ChangeGroup { .. }) => self.group_request(now, session, svc, request),
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
        let Some(out) = self.core.poll_output() else {
            if let Some(group) = self.core.poll_group_output() {
                return Some(self.group_push(group));
            }
            // Drained: the next outputs are of later changes.
            self.encoded.clear();
            self.group_frame = None;
            return None;
        };
        Some(match out {
            Output::Push {
                to,
                target,
                tier,
                presence,
            } => {
                let key = (target, presence);
                let frame = match self.encoded.get(&key) {
                    Some(frame) => frame.clone(),
                    None => {
                        let push = proto::Push::Update {
                            target: self.user_name(target).unwrap_or_default().to_owned(),
                            presence: proto::Presence::from_core(&key.1, self.unix_base_ms),
                        };
                        // A push is a few small fields: it always encodes.
                        let frame = Bytes::from(proto::encode_frame(&push).unwrap_or_default());
                        self.encoded.insert(key, frame.clone());
                        frame
                    }
                };
                HubOutput::Push {
                    session: to,
                    tier,
                    frame,
                }
            }
            Output::SessionEnded { session, reason } => {
                self.credentials.release(session);
                if let Some(meta) = self.sessions.remove(&session) {
                    self.touched.push(meta.user);
                    self.idle.push(meta.user);
                    if self.devices.drop_ref(meta.device.0) == 0 {
                        self.devices.remove(meta.device.0);
                    }
                    for id in meta.watch.iter().flat_map(|ids| ids.iter()) {
                        if self.users.drop_ref(id.0) == 0 {
                            self.idle.push(*id);
                        }
                    }
                }
                HubOutput::End { session, reason }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Hub, HubLimits, HubOutput};
    use crate::token::{Claims, WatchClaim};
    use greendot_core::Millis;
    use greendot_proto::{Kind, Request, Tier};
    use std::time::Duration;

    /// A publish to many subscribers is encoded once: every push carries
    /// the same bytes.
    #[test]
    fn one_publish_is_encoded_once_for_every_subscriber() {
        let mut hub = Hub::new(Default::default(), HubLimits::default(), 0).unwrap();
        let claims = |user: &str| {
            Claims::new(
                user,
                "phone",
                Kind::Mobile,
                WatchClaim::all(),
                Duration::from_secs(60),
            )
        };
        let mut watchers = Vec::new();
        for name in ["w1", "w2", "w3"] {
            let welcome = hub.hello(Millis(1), &claims(name), None, true).unwrap();
            let session = greendot_core::SessionId(welcome.session);
            let subscribe = Request::Subscribe {
                targets: vec!["star".into()],
                tier: Tier::Realtime,
            };
            hub.request(Millis(1), session, subscribe).unwrap();
            watchers.push(session);
        }
        while hub.poll_output().is_some() {}
        hub.hello(Millis(2), &claims("star"), None, true).unwrap();
        hub.handle_timeout(Millis(60_000));
        let mut frames = Vec::new();
        while let Some(out) = hub.poll_output() {
            if let HubOutput::Push { session, frame, .. } = out {
                if watchers.contains(&session) {
                    frames.push(frame);
                }
            }
        }
        assert_eq!(frames.len(), 3);
        assert!(frames.iter().all(|f| f.as_ptr() == frames[0].as_ptr()));
    }
}
