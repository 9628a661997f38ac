//! The edge: this node's sessions' devices, their inputs queued and
//! forwarded to the owner of their user's shard one at a time (retried until
//! taken), the answers to the requests out, resyncs, and routes.

use crate::cluster::edge::records::SessionSync;
use crate::cluster::owner::shard::ReplyTo;
use crate::cluster::wire::{
    decode, encode, FromOwner, ResyncRequest, ToOwner, WireOp, CONNECT_WELCOMED_SINCE,
    RECORD_FOREGROUND_SINCE,
};
use crate::cluster::{
    ClusterLink, Finished, RequestKind, MAX_LOCAL_HOPS, MAX_QUEUED_OPS, RETRY_AFTER,
};
use bytes::Bytes;
use greendot_core::{EndReason, Millis, SessionId, UserId};
use greendot_proto::{self as proto, ErrorCode, WireError};
use std::collections::VecDeque;
use std::time::Instant;

#[derive(Debug)]
pub(in crate::cluster) struct QueuedOp {
    pub(in crate::cluster) op: WireOp,
    /// The client request waiting for it, if any.
    pub(in crate::cluster) wait: Option<u64>,
    /// The client is answered with an error after this.
    pub(in crate::cluster) deadline: Instant,
    /// Its owner did not know the session, which was connected again for
    /// it: a second such answer drops it (the owner does not take the
    /// session, so connecting it again would loop).
    pub(in crate::cluster) reconnected: bool,
}

#[derive(Debug)]
pub(in crate::cluster) struct EdgeDevice {
    pub(in crate::cluster) user: String,
    pub(in crate::cluster) device: String,
    pub(in crate::cluster) kind: proto::Kind,
    /// The session's wire id.
    pub(in crate::cluster) wire: u64,
    pub(in crate::cluster) conn: u64,
    /// When this edge run welcomed the session (its first `conn`).
    pub(in crate::cluster) since: u64,
    /// When its client last connected here (a hello, new or resumed), in
    /// Unix milliseconds.
    pub(in crate::cluster) welcomed: u64,
    pub(in crate::cluster) queue: VecDeque<QueuedOp>,
    /// The request id of the op at the queue's head, once sent.
    sent: Option<u64>,
    /// Not before this instant (a retry's pause).
    pub(in crate::cluster) not_before: Option<Instant>,
    /// The session is over here: forget the device once its queue is empty.
    pub(in crate::cluster) closed: bool,
    /// The app is in the background (I12): a connect sent again (to a new
    /// owner) says so.
    background: bool,
    /// A newer session of the device, welcomed here, ended this one: its
    /// connect is moot (see `pump_one`).
    superseded: bool,
}

impl EdgeDevice {
    /// Puts a connect at the head of the queue that carries the app's
    /// state: in one step (protocol 2 and later), or as a `Connect`
    /// followed by `SetForeground(false)`.
    fn connect_first(&mut self, now: Instant, protocol: u8) {
        if self.background && protocol < RECORD_FOREGROUND_SINCE {
            self.queue.push_front(QueuedOp {
                op: WireOp::SetForeground(false),
                wait: None,
                deadline: now,
                reconnected: false,
            });
        }
        self.queue.push_front(self.connect(now, protocol));
    }

    /// The connect of the protocol sent (see [`WireOp::ConnectWelcomed`]).
    fn connect(&self, now: Instant, protocol: u8) -> QueuedOp {
        let (kind, session, since) = (self.kind, self.wire, self.since);
        let op = if protocol >= CONNECT_WELCOMED_SINCE {
            WireOp::ConnectWelcomed {
                kind,
                session,
                since,
                welcomed: self.welcomed,
                foreground: !self.background,
            }
        } else if self.background && protocol >= RECORD_FOREGROUND_SINCE {
            WireOp::ConnectInBackground {
                kind,
                session,
                since,
            }
        } else {
            WireOp::Connect {
                kind,
                session,
                since,
            }
        };
        QueuedOp {
            op,
            wait: None,
            deadline: now,
            reconnected: false,
        }
    }
}

/// A connect of either kind.
fn connects(op: &WireOp) -> bool {
    matches!(
        op,
        WireOp::Connect { .. }
            | WireOp::ConnectInBackground { .. }
            | WireOp::ConnectWelcomed { .. }
    )
}

/// Keeps, of a device's queued ops, every `Connect` and the last status,
/// the last invisibility change and the last foreground change (in their
/// order): what the owner must still take before an ending op. Returns the
/// waits of the ops dropped.
fn compact_queue(queue: &mut VecDeque<QueuedOp>) -> Vec<u64> {
    let last_status = queue
        .iter()
        .rposition(|q| matches!(q.op, WireOp::SetStatus { .. }));
    let last_invisible = queue
        .iter()
        .rposition(|q| matches!(q.op, WireOp::SetInvisible(_)));
    let last_foreground = queue
        .iter()
        .rposition(|q| matches!(q.op, WireOp::SetForeground(_)));
    let mut dropped = Vec::new();
    let kept = std::mem::take(queue)
        .into_iter()
        .enumerate()
        .filter_map(|(i, q)| {
            let keep = connects(&q.op)
                || Some(i) == last_status
                || Some(i) == last_invisible
                || Some(i) == last_foreground;
            if !keep {
                dropped.extend(q.wait);
            }
            keep.then_some(q)
        })
        .collect();
    *queue = kept;
    dropped
}

pub(in crate::cluster) struct PendingRoute {
    pub(in crate::cluster) user: String,
    pub(in crate::cluster) deadline: Instant,
    /// Ask again then (after a refusal or a failure).
    retry_at: Option<Instant>,
}

pub(in crate::cluster) enum InFlight {
    Device {
        session: SessionId,
        rid: u64,
    },
    Snapshot {
        wait: u64,
        shard: u32,
    },
    /// The views (`own`: truths) of `targets` again, after one of `shard`
    /// was missed.
    Repair {
        shard: u32,
        targets: Vec<String>,
        own: bool,
    },
    Route {
        wait: u64,
    },
    /// Partials of this node's owners, as (shard, group), sent to a home
    /// shard's owner.
    Partials {
        sent: Vec<(u32, u64)>,
    },
    /// The keys of a member page, asked of the group's aggregator.
    PageKeys {
        wait: u64,
    },
}

/// Of requests waiting under ids, with their deadlines and when each is
/// asked again: those past their deadline, and those to ask again now.
pub(in crate::cluster) fn due_waits(
    pending: impl Iterator<Item = (u64, Instant, Option<Instant>)>,
    now: Instant,
) -> (Vec<u64>, Vec<u64>) {
    let (mut late, mut again) = (Vec::new(), Vec::new());
    for (wait, deadline, retry_at) in pending {
        if deadline <= now {
            late.push(wait);
        } else if retry_at.is_some_and(|t| t <= now) {
            again.push(wait);
        }
    }
    (late, again)
}

fn owner_late() -> WireError {
    WireError::new(
        ErrorCode::Internal,
        "the owner of this user did not answer in time",
    )
}

impl ClusterLink {
    /// A session was welcomed here: its device is forwarded to its owner.
    /// `wire`: the session's id on the wire (what `Route` lists).
    #[allow(clippy::too_many_arguments)]
    pub fn connected(
        &mut self,
        now: Instant,
        at: Millis,
        session: SessionId,
        wire: u64,
        user: &str,
        device: &str,
        kind: proto::Kind,
        carried_from: Option<SessionId>,
    ) {
        if !self.edge.open.contains_key(&session) {
            let Some(uid) = self.edge.names.intern(user) else {
                return; // at the cap: this session gets no cluster pushes
            };
            self.edge.names.acquire(uid);
            self.edge.fanout.open(session, UserId(uid));
            self.edge.open.insert(session, user.to_owned());
        }
        // A resume here: the subscriptions (in the fanout, not the hub's
        // core) and the record carry over to the new session, whose wire
        // id the record now names.
        let old = carried_from.filter(|&old| old != session);
        if let Some(old) = old {
            self.edge.fanout.carry(old, session);
        }
        match old.and_then(|old| self.edge.records.remove(&old).map(|r| (old, r))) {
            Some((old, mut r)) => {
                for id in self.edge.record_puts.values_mut() {
                    if *id == old {
                        *id = session;
                    }
                }
                if self.edge.record_retries.remove(&old) {
                    self.edge.record_retries.insert(session);
                }
                r.wire = wire;
                self.edge.records.insert(session, r);
                self.record_changed(session);
            }
            None => {
                self.edge
                    .records
                    .entry(session)
                    .or_insert_with(|| SessionSync {
                        user: user.to_owned(),
                        device: device.to_owned(),
                        wire,
                        changed: 0,
                        stored: 0,
                        putting: None,
                        retry: false,
                        waiting: Vec::new(),
                        groups: Default::default(),
                    });
            }
        }
        let conn = self.edge.next_conn();
        let (welcomed, protocol) = (self.shared.to_unix(at), self.shared.settings.protocol);
        if let Some(d) = self.edge.devices.get_mut(&session) {
            // Resumed here after a disconnect: connected again at the owner.
            if d.closed {
                d.closed = false;
                d.background = false; // the new hello's state follows
                d.conn = conn;
                d.welcomed = welcomed;
                d.queue.push_back(d.connect(now, protocol));
                self.pump(session, now, at);
            }
            return;
        }
        let mut d = EdgeDevice {
            user: user.to_owned(),
            device: device.to_owned(),
            kind,
            wire,
            conn,
            since: conn,
            welcomed,
            queue: VecDeque::new(),
            sent: None,
            not_before: None,
            closed: false,
            background: false,
            superseded: false,
        };
        d.queue.push_back(d.connect(now, protocol));
        self.edge.devices.insert(session, d);
        self.pump(session, now, at);
    }

    /// A device input of a session; `wait` is answered through
    /// [`ClusterLink::poll_finished`] once the owner took it (or with an
    /// error). `false`: the session is unknown here or already ended
    /// (nothing is forwarded).
    pub fn input(
        &mut self,
        now: Instant,
        at: Millis,
        session: SessionId,
        op: WireOp,
        wait: Option<u64>,
    ) -> bool {
        let deadline = now + self.shared.settings.request_timeout;
        let Some(d) = self.edge.devices.get_mut(&session).filter(|d| !d.closed) else {
            return false;
        };
        let ends = matches!(op, WireOp::Logout | WireOp::Disconnect { .. });
        if matches!(op, WireOp::Disconnect { .. })
            && self.shared.settings.mutant == Some(crate::cluster::LinkMutant::DropEndingOp)
        {
            d.closed = true;
            return true;
        }
        if let WireOp::SetForeground(foreground) = op {
            d.background = !foreground;
        }
        if d.queue.len() >= MAX_QUEUED_OPS && ends {
            // An ending op is never refused: dropped, the device would stay
            // online at its owner until the shard moved (a ghost past C3's
            // bound). It takes the place of the changes queued before it
            // that a later one of the same kind overwrites anyway.
            for wait in compact_queue(&mut d.queue) {
                self.finished.push_back((
                    wait,
                    Finished::Failed(WireError::new(
                        ErrorCode::Internal,
                        "a later change took its place before the owner took it",
                    )),
                ));
            }
        }
        if d.queue.len() >= MAX_QUEUED_OPS {
            // The owner has not taken the inputs before it: refuse this one
            // (a client request is answered with the error).
            if let Some(wait) = wait {
                self.finished.push_back((
                    wait,
                    Finished::Failed(WireError::new(
                        ErrorCode::Internal,
                        "the owner of this user is not taking inputs",
                    )),
                ));
            }
            return true;
        }
        d.queue.push_back(QueuedOp {
            op,
            wait,
            deadline,
            reconnected: false,
        });
        if ends {
            d.closed = true;
        }
        self.pump(session, now, at);
        true
    }

    /// The session is over here (ended by the local core, or its connection
    /// is gone and its device already told): its subscriptions end.
    /// A newer session of the same device, welcomed here, ended `session`
    /// (the hub's `Superseded`): as [`ClusterLink::session_ended`], and a
    /// connect of it still to send is moot.
    pub fn session_superseded(&mut self, session: SessionId) {
        if let Some(d) = self.edge.devices.get_mut(&session) {
            d.superseded = true;
        }
        self.session_ended(session);
    }

    pub fn session_ended(&mut self, session: SessionId) {
        let subs = self.edge.fanout.subscriptions(session);
        // The fanout's own `SessionEnded` is skipped by the driver.
        self.edge.fanout.close(session, EndReason::LoggedOut);
        for (target, _) in subs {
            self.forget_target(target);
        }
        if let Some(user) = self.edge.open.remove(&session) {
            self.edge.drop_name(&user);
        }
        // Its record stays for a resume elsewhere until the owner sees the
        // device end (and deletes it).
        self.edge.record_retries.remove(&session);
        if let Some(r) = self.edge.records.remove(&session) {
            for (_, wait, answer, _) in r.waiting {
                self.finished.push_back((wait, Finished::Answer(answer)));
            }
        }
        if let Some(d) = self.edge.devices.get_mut(&session) {
            d.closed = true;
            if d.queue.is_empty() && d.sent.is_none() {
                self.edge.devices.remove(&session);
                self.edge.busy.remove(&session);
            }
        }
    }

    /// Fanout user id `target` lost a subscription.
    pub(in crate::cluster) fn forget_target(&mut self, target: UserId) {
        let Some(name) = self.edge.names.name(target.0).cloned() else {
            return;
        };
        let shard = self.shared.shard(&name);
        self.unwatch_shard(shard);
        if self.edge.names.drop_ref(target.0) == 0 {
            self.edge.names.remove(target.0);
        }
    }

    /// This node's lease lapsed and was taken again: every live device is
    /// connected again, in case its owner dropped it with the lease.
    pub(in crate::cluster) fn rejoined(&mut self, now: Instant, at: Millis) {
        self.missed_all();
        let live: Vec<SessionId> = self
            .edge
            .devices
            .iter()
            .filter(|(_, d)| !d.closed)
            .map(|(s, _)| *s)
            .collect();
        for session in live {
            // Also a connect already on its way: the owner may have taken
            // it before it heard this node's lease expire, which moved the
            // device to lingering (seed 18689: a device shown offline one
            // grace later while connected).
            self.resend(session, now, at, true);
        }
    }

    /// Connects the session's device again to its (new) owner, ahead of
    /// whatever waits. `again`: also when a connect is on its way already;
    /// it goes again under the same connection number and a new request
    /// id, so the owner drops the first if it comes later (a late connect
    /// taken after the device's logout would be a ghost), and the answer to
    /// the first is ignored here.
    pub(in crate::cluster) fn resend(
        &mut self,
        session: SessionId,
        now: Instant,
        at: Millis,
        again: bool,
    ) {
        let connecting = match self.edge.devices.get(&session) {
            Some(d) => d.queue.front().is_some_and(|q| connects(&q.op)),
            None => return,
        };
        if connecting && !again {
            return;
        }
        let conn = if connecting {
            None
        } else {
            Some(self.edge.next_conn())
        };
        let protocol = self.shared.settings.protocol;
        let Some(d) = self.edge.devices.get_mut(&session) else {
            return;
        };
        d.sent = None;
        d.not_before = None;
        if let Some(conn) = conn {
            d.conn = conn;
            d.connect_first(now, protocol);
        }
        self.pump(session, now, at);
    }

    /// Sends the op at the head of the session's queue, unless one is out.
    fn pump(&mut self, session: SessionId, now: Instant, at: Millis) {
        if self.edge.pumping {
            self.edge.pump_later.push_back(session);
            return;
        }
        self.edge.pumping = true;
        self.pump_one(session, now, at);
        let mut hops = 0;
        while let Some(session) = self.edge.pump_later.pop_front() {
            hops += 1;
            if hops > MAX_LOCAL_HOPS {
                // Left to the tick: each waits as after a failure.
                if let Some(d) = self.edge.devices.get_mut(&session) {
                    if d.sent.is_none() {
                        d.not_before = Some(now + RETRY_AFTER);
                    }
                }
                self.edge.busy.insert(session);
                continue;
            }
            self.pump_one(session, now, at);
        }
        self.edge.pumping = false;
    }

    fn pump_one(&mut self, session: SessionId, now: Instant, at: Millis) {
        let rid = self.shared.next_id + 1;
        if let Some(d) = self
            .edge
            .devices
            .get_mut(&session)
            .filter(|d| d.sent.is_none())
        {
            if d.closed
                && (d.superseded
                    || d.queue
                        .iter()
                        .any(|q| matches!(q.op, WireOp::Disconnect { .. })))
            {
                // A connect of a session that ended here before its owner
                // took it is moot: taken now, it would take the device from
                // a newer session, here or elsewhere. Its disconnect goes
                // alone, and ends it where an earlier copy of the connect
                // did land; a session superseded here has none, and the
                // newer session's connect replaces it at the owner (taken
                // after the newer one ended, it would be a ghost).
                d.queue.retain(|q| !connects(&q.op));
            }
        }
        let Some(d) = self.edge.devices.get(&session) else {
            self.edge.busy.remove(&session);
            return;
        };
        if d.sent.is_some() || d.not_before.is_some() {
            self.edge.busy.insert(session);
            return;
        }
        let Some(head) = d.queue.front() else {
            self.edge.busy.remove(&session);
            if d.closed {
                self.edge.devices.remove(&session);
            }
            return;
        };
        self.edge.busy.insert(session);
        let msg = ToOwner::Device {
            edge: self.shared.settings.node.clone(),
            incarnation: self.shared.settings.incarnation,
            rid,
            conn: d.conn,
            user: d.user.clone(),
            device: d.device.clone(),
            op: head.op.clone(),
        };
        let shard = self.shared.shard(&d.user);
        self.shared.next_id = rid;
        if let Some(d) = self.edge.devices.get_mut(&session) {
            d.sent = Some(rid);
        }
        let waiting = InFlight::Device { session, rid };
        if self.ask_owner((now, at), waiting, shard, RequestKind::Input, msg) {
            self.shared.counters.forwarded_local += 1;
        } else {
            self.shared.counters.forwarded += 1;
        }
    }

    /// Sends `msg` to the owner of `shard`: in process when this node acts
    /// for it (true), else over NATS. Either way its answer comes to
    /// `take_answer` under one id, waited for until the request timeout.
    pub(in crate::cluster) fn ask_owner(
        &mut self,
        (now, at): (Instant, Millis),
        waiting: InFlight,
        shard: u32,
        kind: RequestKind,
        msg: ToOwner,
    ) -> bool {
        let local = self.shards.serves(&self.shared, shard, now);
        if local {
            let id = self.shared.loopback(now, waiting);
            let reply = ReplyTo::Loopback(id);
            self.shards
                .owner_request(&mut self.shared, shard, msg, reply, now, at);
            self.deliver_local();
        } else {
            self.shared.request(now, waiting, shard, kind, encode(&msg));
        }
        local
    }

    /// The owner's answer to the session's op `rid`.
    pub(in crate::cluster) fn device_answer(
        &mut self,
        session: SessionId,
        rid: u64,
        answer: Option<FromOwner>,
        now: Instant,
        at: Millis,
    ) {
        let Some(d) = self.edge.devices.get_mut(&session) else {
            return;
        };
        if d.sent != Some(rid) {
            return; // a stale answer (resent since)
        }
        d.sent = None;
        match answer {
            Some(FromOwner::Done { .. }) => {
                if let Some(q) = d.queue.pop_front() {
                    if let Some(wait) = q.wait {
                        self.finished.push_back((wait, Finished::Done));
                    }
                }
            }
            Some(FromOwner::Refused(error)) => {
                if let Some(q) = d.queue.pop_front() {
                    if let Some(wait) = q.wait {
                        self.finished.push_back((wait, Finished::Failed(error)));
                    }
                }
            }
            Some(FromOwner::Unknown)
                if d.queue.front().is_some_and(|q| {
                    q.reconnected || (d.closed && !matches!(q.op, WireOp::Logout))
                }) =>
            {
                // The owner holds nothing of the session, and will not: it
                // ended here (what it still had queued has no session to
                // act on, and connecting it again to deliver it would take
                // the device from a newer session elsewhere; see
                // `pump_one`), or it was connected again for this op and
                // the owner did not take it (a later session of the device
                // here took its place). Dropped; a logout is answered as
                // landing, as at its deadline.
                if let Some(q) = d.queue.pop_front() {
                    if let Some(wait) = q.wait {
                        let answer = match q.op {
                            WireOp::Logout => Finished::Done,
                            _ => Finished::Failed(WireError::new(
                                ErrorCode::Stale,
                                "the session ended before its owner took this",
                            )),
                        };
                        self.finished.push_back((wait, answer));
                    }
                }
            }
            Some(FromOwner::Unknown) => {
                // The owner has no live session of the device (a new owner):
                // connect it again first.
                if let Some(q) = d.queue.front_mut() {
                    q.reconnected = true;
                }
                self.shared.counters.retries += 1;
                d.connect_first(now, self.shared.settings.protocol);
                self.edge.next_conn += 1;
                if let Some(d) = self.edge.devices.get_mut(&session) {
                    d.conn = self.edge.next_conn;
                }
            }
            Some(FromOwner::NotOwner)
            | Some(FromOwner::Snapshot { .. })
            | Some(FromOwner::Route(_))
            | Some(FromOwner::Loading)
            | Some(FromOwner::GroupPageKeys { .. })
            | None => {
                self.shared.counters.retries += 1;
                d.not_before = Some(now + RETRY_AFTER);
                self.edge.busy.insert(session);
                return;
            }
        }
        self.pump(session, now, at);
    }

    /// Client requests past their deadline, and retries due.
    pub(in crate::cluster) fn tick_devices(&mut self, now: Instant, at: Millis) {
        let sessions: Vec<SessionId> = self.edge.busy.iter().copied().collect();
        for session in sessions {
            if let Some(d) = self.edge.devices.get_mut(&session) {
                for q in &mut d.queue {
                    if q.deadline <= now {
                        if let Some(wait) = q.wait.take() {
                            // An ending op is never dropped: it lands at this
                            // owner or the next, or, if this node dies first,
                            // the owner ends the session by its grace. The
                            // client is told it will land, not that it failed.
                            let answer = match q.op {
                                WireOp::Logout => Finished::Done,
                                _ => Finished::Failed(owner_late()),
                            };
                            self.finished.push_back((wait, answer));
                        }
                    }
                }
            }
            let due = self
                .edge
                .devices
                .get(&session)
                .is_some_and(|d| d.not_before.is_some_and(|t| t <= now));
            if due {
                if let Some(d) = self.edge.devices.get_mut(&session) {
                    d.not_before = None;
                    d.sent = None;
                }
                self.pump(session, now, at);
            }
        }
    }

    /// The owner's answer to request `id` (`None`: unanswered).
    pub(in crate::cluster) fn answered(
        &mut self,
        now: Instant,
        at: Millis,
        id: u64,
        payload: Option<Bytes>,
    ) {
        if !self.shared.in_flight.contains_key(&id) {
            return;
        }
        let answer = payload.and_then(|p| {
            let a = decode::<FromOwner>(&p);
            if a.is_none() {
                self.shared.counters.malformed += 1;
            }
            a
        });
        self.take_answer(now, at, id, answer);
    }

    /// The answer to request `id` (`None`: no answer in time, or one that
    /// did not decode), from a remote owner or this node's own.
    pub(in crate::cluster) fn take_answer(
        &mut self,
        now: Instant,
        at: Millis,
        id: u64,
        answer: Option<FromOwner>,
    ) {
        let Some((what, _)) = self.shared.in_flight.remove(&id) else {
            return;
        };
        match what {
            InFlight::Device { session, rid } => self.device_answer(session, rid, answer, now, at),
            InFlight::PageKeys { wait } => {
                if let Some(answer) = self.page_keys_answer(wait, answer, now, at) {
                    self.finished.push_back((wait, Finished::Answer(answer)));
                }
            }
            InFlight::Partials { sent } => {
                if !matches!(answer, Some(FromOwner::Done { .. })) {
                    self.shared.counters.retries += 1;
                    self.shards.partials_failed(&sent, now);
                }
            }
            InFlight::Snapshot { wait, shard } => match answer {
                Some(FromOwner::Snapshot {
                    presences,
                    epoch,
                    seq,
                }) if self.messages_fit(&presences) => {
                    self.track_answer(shard, epoch, seq, at);
                    let targets: Vec<String> = self
                        .edge
                        .subscribes
                        .get(&wait)
                        .map(|p| {
                            p.targets
                                .iter()
                                .filter(|(t, s)| s.is_none() && self.shared.shard(t) == shard)
                                .map(|(t, _)| t.clone())
                                .collect()
                        })
                        .unwrap_or_default();
                    let presences = presences.iter().map(|p| p.to_core()).collect();
                    self.snapshot_answer(wait, shard, &targets, presences, at);
                }
                Some(FromOwner::Loading) if self.shards.serves(&self.shared, shard, now) => {
                    self.retry_snapshot(wait, shard, now);
                    self.edge.awaiting_load.entry(shard).or_default().push(wait);
                }
                _ => self.retry_snapshot(wait, shard, now),
            },
            InFlight::Route { wait } => match answer {
                Some(FromOwner::Route(entries))
                    if entries.iter().all(|e| {
                        !e.device.is_empty() && e.device.len() <= self.shared.max_name_len
                    }) =>
                {
                    if self.edge.routes.remove(&wait).is_some() {
                        let answer = proto::Answer::Route(entries);
                        self.finished.push_back((wait, Finished::Answer(answer)));
                    }
                }
                _ => {
                    self.shared.counters.retries += 1;
                    if let Some(p) = self.edge.routes.get_mut(&wait) {
                        p.retry_at = Some(now + RETRY_AFTER);
                    }
                }
            },
            InFlight::Repair {
                shard,
                targets,
                own,
            } => {
                if let Some(t) = self.edge.shard_tracks(own).get_mut(&shard) {
                    t.asking = t.asking.saturating_sub(1);
                }
                match answer {
                    Some(FromOwner::Snapshot {
                        presences,
                        epoch,
                        seq,
                    }) if presences.len() == targets.len() && self.messages_fit(&presences) => {
                        let presences = presences.iter().map(|p| p.to_core()).collect();
                        self.repaired(shard, &targets, presences, (epoch, seq), own, at);
                    }
                    _ => self.repair_failed(shard, own, now),
                }
            }
        }
    }

    /// A new owner's resync request: this edge resends its devices of the
    /// shard.
    pub(in crate::cluster) fn resync_message(&mut self, now: Instant, at: Millis, payload: &[u8]) {
        match decode::<ResyncRequest>(payload) {
            Some(r)
                if r.owner.len() <= self.shared.max_name_len
                    && r.shard < self.shared.settings.shard_count =>
            {
                if r.owner == self.shared.settings.node {
                    return; // resent in process when the claim was won
                }
                // Sent again while the owner's window is open: once is
                // enough (the resent connects are retried until taken).
                let answered = self.edge.resynced.entry(r.shard).or_insert(0);
                if *answered >= r.epoch {
                    return;
                }
                *answered = r.epoch;
                // The shard's new owner sums the groups homed there anew.
                self.shards.home_changed(&mut self.shared, r.shard, now);
                let mine: Vec<SessionId> = self
                    .edge
                    .devices
                    .iter()
                    .filter(|(_, d)| !d.closed && self.shared.shard(&d.user) == r.shard)
                    .map(|(s, _)| *s)
                    .collect();
                self.shared.counters.resyncs += 1;
                for session in mine {
                    self.resend(session, now, at, false);
                }
            }
            _ => self.shared.counters.malformed += 1,
        }
    }

    /// A service's `Route` of `user`: their owner lists their Online
    /// devices on every node. Answered through
    /// [`ClusterLink::poll_finished`] under `wait` (before this returns
    /// when this node acts for the user's shard).
    pub fn route(&mut self, now: Instant, at: Millis, wait: u64, user: &str) {
        let p = PendingRoute {
            user: user.to_owned(),
            deadline: now + self.shared.settings.request_timeout,
            retry_at: None,
        };
        self.edge.routes.insert(wait, p);
        self.ask_route(wait, now, at);
    }

    fn ask_route(&mut self, wait: u64, now: Instant, at: Millis) {
        let Some(p) = self.edge.routes.get_mut(&wait) else {
            return;
        };
        p.retry_at = None;
        let shard = (self.shared.settings.shard_of)(&p.user, self.shared.settings.shard_count);
        let msg = ToOwner::Route {
            user: p.user.clone(),
        };
        let waiting = InFlight::Route { wait };
        self.ask_owner((now, at), waiting, shard, RequestKind::Snapshot, msg);
    }

    pub(in crate::cluster) fn retry_routes(&mut self, now: Instant, at: Millis) {
        let pending = self
            .edge
            .routes
            .iter()
            .map(|(w, p)| (*w, p.deadline, p.retry_at));
        let (late, again) = due_waits(pending, now);
        for wait in late {
            self.edge.routes.remove(&wait);
            self.finished
                .push_back((wait, Finished::Failed(owner_late())));
        }
        for wait in again {
            self.ask_route(wait, now, at);
        }
    }
}
