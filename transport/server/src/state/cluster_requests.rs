//! What `ServerState` does with the cluster link (only with
//! `ServerConfig::cluster`): inputs from the NATS I/O in, the fanout's
//! pushes and the link's outputs out, and a session's requests that the
//! owner of its user (or of its targets) answers, held under a ticket.

use super::tickets::Ticket;
use super::{ServerOutput, ServerState};
use crate::cluster::{ClusterInput, ClusterLink, Finished, GroupWrite, WireOp, PAGE_WATCHER};
use crate::conn::{Handled, Step};
use bytes::Bytes;
use greendot_core::{SessionId, Tier};
use greendot_proto::{self as proto, encode_frame, ServerFrame};
use std::time::{Duration, Instant};

impl ServerState {
    /// What the cluster's NATS I/O delivered.
    pub(super) fn cluster_input(&mut self, now: Instant, input: ClusterInput) {
        let at = self.clock.at(now);
        if let Some(c) = self.cluster.as_deref_mut() {
            c.handle_input(now, at, input);
        }
        self.route(now);
    }

    /// The fanout's pushes, the answers the cluster finished, and what it
    /// asks of the NATS I/O.
    /// Whether the hub may have outputs to route since (groups fed to its
    /// core, requests finished).
    pub(super) fn route_cluster(&mut self, now: Instant) -> bool {
        let mut fed = false;
        loop {
            let Some(c) = self.cluster.as_deref_mut() else {
                return fed;
            };
            // Members no watched page lists: no longer followed.
            while let Some(member) = self.hub.poll_fed_unlisted() {
                c.unfollow_page_member(self.clock.at(now), &member);
            }
            if let Some(out) = c.poll_fanout() {
                if let greendot_core::Output::Push {
                    to,
                    target,
                    tier,
                    presence,
                } = out
                {
                    let name = c.user_name(target).unwrap_or_default();
                    if to == PAGE_WATCHER {
                        // A member of a watched page: the hub's core
                        // batches it for the sessions watching her.
                        let name = name.to_owned();
                        self.hub.fed_view(self.clock.at(now), &name, presence);
                        fed = true;
                        continue;
                    }
                    let push = proto::Push::Update {
                        target: name.to_owned(),
                        // Presences at the edge carry Unix milliseconds.
                        presence: proto::Presence::from_core(&presence, 0),
                    };
                    let frame = Bytes::from(encode_frame(&push).unwrap_or_default());
                    self.deliver(now, to, tier, frame);
                }
                continue;
            }
            if let Some(feed) = c.poll_group_feed() {
                let at = self.clock.at(now);
                if let Err(e) = self.hub.group_feed(at, feed) {
                    // Over this node's limits (lower than the writer's).
                    tracing::warn!(error = %e, "a group from the cluster was not taken");
                }
                fed = true;
                continue;
            }
            if let Some(ms) = c.poll_latency() {
                self.stats
                    .cluster_latency
                    .observe(Duration::from_millis(ms));
                continue;
            }
            if let Some((wait, finished)) = c.poll_finished() {
                self.cluster_finished(now, wait, finished);
                // A subscribe run again may have made the hub push.
                fed = true;
                continue;
            }
            match c.poll_output() {
                Some(out) => self.outputs.push_back(ServerOutput::Cluster(out)),
                None => return fed,
            }
        }
    }

    /// The cluster link's timers (its cores' and its requests' deadlines).
    pub(super) fn cluster_timers(&mut self, now: Instant) {
        if let Some(c) = self.cluster.as_deref_mut() {
            let at = self.clock.at(now);
            let core_due = c
                .poll_timeout()
                .and_then(|m| self.clock.instant(m))
                .is_some_and(|t| t <= now);
            if core_due || c.poll_deadline(now).is_some_and(|t| t <= now) {
                c.handle_timeout(now, at);
            }
        }
    }

    /// The cluster is done with the request behind `wait`.
    pub(super) fn cluster_finished(&mut self, now: Instant, wait: u64, finished: Finished) {
        let finished = match finished {
            Finished::WatchedPage {
                session,
                after,
                page,
                followed,
                refused,
            } => {
                let read = (page, refused);
                self.watched_page_read(now, wait, (session, after), read, &followed)
            }
            Finished::GroupSubscribeAgain { session, group } => {
                match self.group_subscribe_again(now, wait, session, group) {
                    Some(finished) => finished,
                    None => return, // answered once recorded
                }
            }
            other => other,
        };
        if let Finished::Carry {
            session,
            subscriptions,
            groups,
        } = finished
        {
            if self.tickets.contains_key(&wait) {
                self.carry_groups(now, session, &groups);
                self.carry_over(now, wait, session, subscriptions);
            }
            return;
        }
        let Some(ticket) = self.tickets.remove(&wait) else {
            return; // answered at the backstop already
        };
        self.ticket_deadlines.remove(&(ticket.deadline(), wait));
        let Ticket::Cluster {
            ch,
            serial,
            mut handled,
            ..
        } = ticket
        else {
            return;
        };
        let result = match finished {
            Finished::Done
            | Finished::Carry { .. }
            | Finished::GroupSubscribeAgain { .. }
            | Finished::WatchedPage { .. } => None,
            Finished::Answer(answer) => Some(Ok(answer)),
            Finished::Failed(error) => Some(Err(error)),
        };
        match (result, handled.reply.as_mut()) {
            (Some(result), Some(ServerFrame::Reply { result: r, .. })) => *r = result,
            // A resume from another node's record: what carried over.
            (
                Some(Ok(proto::Answer::Subscribed { snapshots, .. })),
                Some(ServerFrame::Welcome(w)),
            ) => {
                w.resumed = true;
                w.snapshots = snapshots;
            }
            _ => {}
        }
        self.refresh_welcome(&mut handled);
        self.saved(now, ch, serial, wait, handled, None);
    }

    /// A welcome that waited (for owners' answers, a record, or the
    /// backstop) shows no view older than what this edge knows when it
    /// goes.
    pub(super) fn refresh_welcome(&self, handled: &mut Handled) {
        if let (Some(c), Some(ServerFrame::Welcome(w))) =
            (self.cluster.as_deref(), handled.reply.as_mut())
        {
            c.refresh_snapshots(&w.user, &mut w.snapshots);
        }
    }

    /// Holds `handled` (the hub's answer) until the owner took `op`.
    pub(super) fn cluster_wait(
        &mut self,
        ch: usize,
        now: Instant,
        session: SessionId,
        op: WireOp,
        handled: Handled,
    ) {
        let Some((wait, backstop)) = self.cluster_ticket(ch, now, handled) else {
            return;
        };
        let at = self.clock.at(now);
        let taken = self
            .cluster
            .as_deref_mut()
            .is_some_and(|c| c.input(now, at, session, op, Some(wait)));
        if taken {
            return self.hold_for(ch, wait);
        }
        // Not a session the cluster knows (it never got through): answered
        // as it is.
        if let Some(Ticket::Cluster { handled, .. }) = self.tickets.remove(&wait) {
            self.ticket_deadlines.remove(&(backstop, wait));
            self.answer(ch, now, handled);
        }
    }

    pub(super) fn cluster_backstop(&self, now: Instant) -> Instant {
        let timeout = self
            .config
            .cluster
            .as_ref()
            .map_or(Duration::ZERO, |c| c.request_timeout);
        now + timeout + Duration::from_secs(1)
    }

    /// A welcome in a cluster: the device goes to its owner. A session
    /// resumed here keeps its subscriptions (they live in the fanout, not
    /// the hub's core) except what the new credentials no longer allow.
    /// Returns the wire id the hello named if it is no session here (so
    /// perhaps another node's: its record is read before the welcome).
    pub(super) fn cluster_welcome(
        &mut self,
        now: Instant,
        session: SessionId,
        resume: Option<u64>,
        handled: &mut Handled,
    ) -> Option<u64> {
        let at = self.clock.at(now);
        let kind = self.hub.session_kind(session);
        let foreground = self.hub.session_foreground(session).unwrap_or(true);
        let carried_from = resume.map(|wire| self.wire(SessionId(wire)));
        let (Some(c), Some(ServerFrame::Welcome(w)), Some(kind)) =
            (self.cluster.as_deref_mut(), handled.reply.as_mut(), kind)
        else {
            return None;
        };
        let carried_from = carried_from.filter(|_| w.resumed);
        c.connected(
            now,
            at,
            session,
            w.session,
            &w.user,
            &w.device,
            kind.into(),
            carried_from,
        );
        if !foreground {
            // A hello in the background: the owner hears it right after
            // the connect (I12).
            c.input(now, at, session, WireOp::SetForeground(false), None);
        }
        if !w.resumed {
            return resume;
        }
        let (kept, refused): (Vec<_>, Vec<_>) = c
            .snapshots(session, &w.user)
            .into_iter()
            .partition(|s| self.hub.may_watch(session, &s.target).is_ok());
        for s in refused {
            c.unsubscribe(at, session, &s.target);
        }
        w.snapshots = kept;
        None
    }

    /// The hello named `wire`, no session of this node: the welcome waits
    /// while the device's record is read; if it names `wire`, its
    /// subscriptions carry over and the welcome says resumed.
    pub(super) fn resume_elsewhere(
        &mut self,
        ch: usize,
        now: Instant,
        session: SessionId,
        wire: u64,
        handled: Handled,
    ) {
        let (user, device) = match &handled.reply {
            Some(ServerFrame::Welcome(w)) => (w.user.clone(), w.device.clone()),
            _ => return self.answer(ch, now, handled),
        };
        let Some((wait, _)) = self.cluster_ticket(ch, now, handled) else {
            return;
        };
        if let Some(c) = self.cluster.as_deref_mut() {
            c.resume_elsewhere(wait, session, &user, &device, wire);
        }
        self.hold_for(ch, wait);
    }

    /// A resume's record named the session: its group subscriptions go on
    /// in the hub's core (each told its count at once; one its user left
    /// while away is told `Ended`), and the record keeps those held.
    fn carry_groups(&mut self, now: Instant, session: SessionId, groups: &[u64]) {
        if groups.is_empty() {
            return;
        }
        let at = self.clock.at(now);
        let gone = self.hub.carry_groups(at, session, groups);
        let held: Vec<u64> = groups
            .iter()
            .copied()
            .filter(|g| !gone.contains(g))
            .collect();
        if let Some(c) = self.cluster.as_deref_mut() {
            c.groups_carried(session, &held);
        }
    }

    /// A group subscribe or unsubscribe the hub's core answered `handled`
    /// in a cluster: answered once the session's record has it, so that a
    /// resume on another node carries it over.
    pub(super) fn record_group_subscription(
        &mut self,
        ch: usize,
        now: Instant,
        (session, group, subscribed): (SessionId, u64, bool),
        handled: Handled,
    ) {
        let Some(ServerFrame::Reply {
            id,
            result: Ok(answer),
        }) = &handled.reply
        else {
            return self.answer(ch, now, handled);
        };
        let (id, answer) = (*id, answer.clone());
        let deadline = recorded_by(self.cluster_backstop(now));
        self.cluster_ask_holding(ch, now, (id, handled), |c, wait| {
            c.group_subscription_changed(session, group, subscribed, (wait, answer, deadline))
        });
    }

    /// A resume's record named the session: what the new credentials still
    /// allow is subscribed again, under the same wait.
    pub(super) fn carry_over(
        &mut self,
        now: Instant,
        wait: u64,
        session: SessionId,
        subscriptions: Vec<(String, Tier)>,
    ) {
        let at = self.clock.at(now);
        let allowed: Vec<(String, Tier)> = subscriptions
            .into_iter()
            .filter(|(t, _)| self.hub.may_watch(session, t).is_ok())
            .collect();
        let viewer = self
            .hub
            .session_user(session)
            .and_then(|u| self.hub.user_name(u))
            .map(str::to_owned);
        let (Some(c), Some(viewer)) = (self.cluster.as_deref_mut(), viewer) else {
            return self.cluster_finished(now, wait, Finished::Done);
        };
        if let Some(answer) = c.carry_over(now, at, wait, session, &viewer, allowed) {
            self.cluster_finished(now, wait, Finished::Answer(answer));
        }
    }

    /// Subscribe and unsubscribe in a cluster: through the fanout, with
    /// snapshots from the targets' owners.
    pub(super) fn cluster_subscription(&mut self, ch: usize, now: Instant, step: Step) {
        let Some((session, id, request, viewer)) = self.current_request(ch, now, step) else {
            return;
        };
        let at = self.clock.at(now);
        let reply = |result| reply(id, result);
        match request {
            request @ (proto::Request::Subscribe { .. } | proto::Request::Query { .. }) => {
                let (targets, tier, query) = match request {
                    proto::Request::Subscribe { targets, tier } => (targets, tier.into(), false),
                    proto::Request::Query { targets } => (targets, Tier::Realtime, true),
                    _ => return,
                };
                if query && targets.len() > 1 && !self.hub.is_service(session) {
                    let error = proto::WireError::new(
                        proto::ErrorCode::ServiceOnly,
                        "querying several users at once needs a service token",
                    );
                    return self.answer(ch, now, reply(Err(error)));
                }
                if targets.len() > self.config.limits.max_targets {
                    let error = proto::WireError::new(
                        proto::ErrorCode::TooManyTargets,
                        format!(
                            "at most {} targets per request",
                            self.config.limits.max_targets
                        ),
                    );
                    return self.answer(ch, now, reply(Err(error)));
                }
                let mut allowed = Vec::with_capacity(targets.len());
                let mut refused = Vec::new();
                for target in targets {
                    match self.hub.may_watch(session, &target) {
                        Ok(()) => allowed.push(target),
                        Err(error) => refused.push(proto::Refused { target, error }),
                    }
                }
                self.cluster_ask(ch, now, id, |c, wait| {
                    c.subscribe(
                        now, at, wait, session, &viewer, allowed, refused, tier, query,
                    )
                });
            }
            proto::Request::Route { user } => {
                let svc = self.hub.is_service(session);
                if let Err(error) = self.hub.may_route(svc, &user) {
                    return self.answer(ch, now, reply(Err(error)));
                }
                self.cluster_ask(ch, now, id, |c, wait| {
                    c.route(now, at, wait, &user);
                    None
                });
            }
            proto::Request::Unsubscribe { target } => {
                // A name no user can have is a bad request, as on one node.
                if let Err(error) = self.hub.name_ok(&target, "user") {
                    return self.answer(ch, now, reply(Err(error)));
                }
                let done = self
                    .cluster
                    .as_deref_mut()
                    .is_some_and(|c| c.unsubscribe(at, session, &target));
                let result = if done {
                    Ok(proto::Answer::Done)
                } else {
                    Err(proto::WireError::new(
                        proto::ErrorCode::NotSubscribed,
                        "not subscribed to that user",
                    ))
                };
                self.answer(ch, now, reply(result));
            }
            _ => {}
        }
    }

    /// A member page in a cluster, watched or not: the hub's core checks the
    /// session, its membership, its page budget and its watch limits; the
    /// keys come from the group's aggregator and the entries from the
    /// members' owners; a watched page is then watched in the hub's core.
    pub(super) fn cluster_group_page(&mut self, ch: usize, now: Instant, step: Step) {
        let Some((session, id, request, _)) = self.current_request(ch, now, step) else {
            return;
        };
        let (group, after, limit, watch) = match request {
            proto::Request::GroupPage {
                group,
                after,
                limit,
            } => (group, after, limit, false),
            proto::Request::GroupWatchPage {
                group,
                after,
                limit,
            } => (group, after, limit, true),
            _ => return,
        };
        let at = self.clock.at(now);
        match self
            .hub
            .fed_group_page(at, session, group, (after, limit), watch)
        {
            Err(error) => self.answer(ch, now, reply(id, Err(error))),
            Ok(limit) => self.cluster_ask(ch, now, id, |c, wait| {
                c.group_page(now, at, wait, session, group, (after, limit), watch);
                None
            }),
        }
    }

    /// A page read to be watched: watched in the hub's core if its request
    /// still waits and every member could be followed, then answered (or
    /// the refusal); then settled, so the members no watch lists are no
    /// longer followed.
    fn watched_page_read(
        &mut self,
        now: Instant,
        wait: u64,
        (session, after): (SessionId, Option<proto::GroupCursor>),
        (page, refused): (proto::GroupPage, Option<proto::WireError>),
        followed: &[String],
    ) -> Finished {
        let at = self.clock.at(now);
        let stored = match (refused, self.tickets.contains_key(&wait)) {
            (Some(error), _) => Err(error),
            (None, true) => {
                self.hub
                    .fed_watched_page(at, session, page.group, after, &page.entries)
            }
            (None, false) => Err(proto::WireError::new(
                proto::ErrorCode::Internal,
                "answered already",
            )),
        };
        if let Some(c) = self.cluster.as_deref_mut() {
            let hub = &self.hub;
            c.settle_page_read(at, followed, |name| hub.is_fed_listed(name));
        }
        match stored {
            Ok(()) => Finished::Answer(proto::Answer::GroupPage(page)),
            Err(error) => Finished::Failed(error),
        }
    }

    /// A group write in a cluster: checked as one node checks it, then
    /// written to the cluster's store, answered once stored.
    pub(super) fn cluster_group_write(&mut self, ch: usize, now: Instant, step: Step) {
        let Some((session, id, request, _)) = self.current_request(ch, now, step) else {
            return;
        };
        let svc = self.hub.is_service(session);
        if let Err(error) = self.hub.check_group_write(svc, &request) {
            return self.answer(ch, now, reply(id, Err(error)));
        }
        let (group, write) = match request {
            proto::Request::SetGroup {
                group,
                members,
                admins,
            } => (group, GroupWrite::Set { members, admins }),
            proto::Request::ChangeGroup {
                group,
                add,
                remove,
                add_admins,
                remove_admins,
                expect_version,
            } => (
                group,
                GroupWrite::Change {
                    add,
                    remove,
                    add_admins,
                    remove_admins,
                    expect: expect_version,
                },
            ),
            proto::Request::RemoveGroup { group } => (group, GroupWrite::Remove),
            _ => return,
        };
        self.cluster_ask(ch, now, id, |c, wait| {
            c.group_write(now, wait, group, write);
            None
        });
    }

    /// A group subscribe the hub's core refused in a cluster (no such
    /// group, not a member): this node's copy of the directory may lag a
    /// write made at another node, so the refusal waits for a read of the
    /// group from the store, and the subscribe is tried again then
    /// (`handled`, the refusal, answers at the backstop).
    pub(super) fn confirm_group_subscribe(
        &mut self,
        ch: usize,
        now: Instant,
        (session, group): (SessionId, u64),
        handled: Handled,
    ) {
        let Some(ServerFrame::Reply { id, .. }) = handled.reply else {
            return self.answer(ch, now, handled);
        };
        self.cluster_ask_holding(ch, now, (id, handled), |c, wait| {
            c.confirm_group(now, wait, session, group);
            None
        });
    }

    /// The subscribe of a refusal being confirmed, once this node holds the
    /// group as the store does: what the hub answers now.
    /// `None`: taken, and answered under `wait` once the session's record
    /// has it.
    fn group_subscribe_again(
        &mut self,
        now: Instant,
        wait: u64,
        session: SessionId,
        group: u64,
    ) -> Option<Finished> {
        let at = self.clock.at(now);
        let step = Step::Request {
            session,
            id: 0,
            request: proto::Request::GroupSubscribe { group },
        };
        let answer = match self.hub.apply(at, step).reply {
            Some(ServerFrame::Reply { result: Ok(a), .. }) => a,
            Some(ServerFrame::Reply { result: Err(e), .. }) => return Some(Finished::Failed(e)),
            _ => return Some(Finished::Done),
        };
        let deadline = recorded_by(self.tickets.get(&wait)?.deadline());
        let c = self.cluster.as_deref_mut()?;
        c.group_subscription_changed(session, group, true, (wait, answer, deadline))
            .map(Finished::Answer)
    }

    /// A request's session, id and request, with its user's name; `None`
    /// when it is not a request, or when its session is no longer current
    /// (then answered `Stale`).
    fn current_request(
        &mut self,
        ch: usize,
        now: Instant,
        step: Step,
    ) -> Option<(SessionId, u64, proto::Request, String)> {
        let Step::Request {
            session,
            id,
            request,
        } = step
        else {
            return None;
        };
        let user = self
            .hub
            .session_user(session)
            .and_then(|u| self.hub.user_name(u))
            .map(str::to_owned);
        if user.is_none() {
            let stale =
                proto::WireError::new(proto::ErrorCode::Stale, "session is no longer current");
            self.answer(ch, now, reply(id, Err(stale)));
        }
        Some((session, id, request, user?))
    }

    /// Runs a cluster request of connection `ch` (its request `id`): the
    /// answer now, or the connection waits for it under a ticket.
    pub(super) fn cluster_ask(
        &mut self,
        ch: usize,
        now: Instant,
        id: u64,
        ask: impl FnOnce(&mut ClusterLink, u64) -> Option<proto::Answer>,
    ) {
        let held = reply(id, Ok(proto::Answer::Done));
        self.cluster_ask_holding(ch, now, (id, held), ask);
    }

    /// [`ServerState::cluster_ask`], answering `held` at the backstop.
    fn cluster_ask_holding(
        &mut self,
        ch: usize,
        now: Instant,
        (id, held): (u64, Handled),
        ask: impl FnOnce(&mut ClusterLink, u64) -> Option<proto::Answer>,
    ) {
        let reply = |result| reply(id, result);
        let Some((wait, backstop)) = self.cluster_ticket(ch, now, held) else {
            return;
        };
        let Some(c) = self.cluster.as_deref_mut() else {
            return;
        };
        match ask(c, wait) {
            Some(answer) => {
                self.tickets.remove(&wait);
                self.ticket_deadlines.remove(&(backstop, wait));
                self.answer(ch, now, reply(Ok(answer)));
            }
            None => self.hold_for(ch, wait),
        }
    }

    /// A ticket for a request of connection `ch` the cluster answers
    /// (`handled`: the answer when it has nothing else to say), with its
    /// backstop deadline.
    pub(super) fn cluster_ticket(
        &mut self,
        ch: usize,
        now: Instant,
        handled: Handled,
    ) -> Option<(u64, Instant)> {
        let serial = self.conn(ch).map(|c| c.serial)?;
        let deadline = self.cluster_backstop(now);
        let wait = self.ticket(Ticket::Cluster {
            ch,
            serial,
            handled,
            deadline,
        });
        Some((wait, deadline))
    }

    /// Connection `ch` waits for ticket `wait`: its later frames wait too,
    /// so that answers keep their order.
    pub(super) fn hold_for(&mut self, ch: usize, wait: u64) {
        if let Some(conn) = self.conn(ch) {
            conn.session.wait_for(wait);
        }
    }
}

/// The device input a request is in a cluster, forwarded to the owner of
/// its user once the hub answered it.
pub(super) fn forwarded_op(step: &Step) -> Option<(SessionId, WireOp)> {
    let Step::Request {
        session, request, ..
    } = step
    else {
        return None;
    };
    let op = match request {
        proto::Request::SetStatus { status, message } => WireOp::SetStatus {
            status: *status,
            message: message.clone(),
        },
        proto::Request::SetInvisible { invisible } => WireOp::SetInvisible(*invisible),
        proto::Request::SetForeground { foreground } => WireOp::SetForeground(*foreground),
        proto::Request::Logout => WireOp::Logout,
        _ => return None,
    };
    Some((*session, op))
}

/// The reply to request `id`.
fn reply(id: u64, result: Result<proto::Answer, proto::WireError>) -> Handled {
    Handled {
        reply: Some(ServerFrame::Reply { id, result }),
        ..Handled::default()
    }
}

/// When a group subscription's answer goes even if its record has not
/// landed (the subscription holds here; a resume elsewhere would miss it):
/// before the ticket's backstop answers it with the hub's answer alone.
fn recorded_by(backstop: Instant) -> Instant {
    backstop
        .checked_sub(Duration::from_secs(1))
        .unwrap_or(backstop)
}
