//! What an owner does with the requests of the edges ([`ToOwner`]): device
//! inputs (filtered by incarnation and request id, preferences written to
//! the KV before the ack), snapshots, views and routes.

use crate::cluster::owner::prefs_writes::Waiting;
use crate::cluster::owner::shard::{
    forget_device, forget_user_if_unknown, note_idle, route_of, HeldSession, Holder, Owner, ReplyTo,
};
use crate::cluster::owner::OwnedShards;
use crate::cluster::shared::Shared;
use crate::cluster::to_edge::ToEdge;
use crate::cluster::wire::{decode, encode, FromOwner, ToOwner, WireOp, WirePrefs};
use crate::cluster::DetMap;
use crate::cluster::{
    ClusterOutput, RequestKind, MAX_EDGES_REMEMBERED, MAX_HOLDERS_REMEMBERED, MAX_PENDING_PREFS,
    MAX_QUEUED_OPS, MAX_SNAPSHOT_TARGETS,
};
use greendot_core::{Connect, DeviceId, DeviceKind, Millis, SessionId, UserId, Watch};
use greendot_proto::{self as proto, ErrorCode, WireError};
use std::time::Instant;

pub(in crate::cluster) struct PendingPrefs {
    pub(in crate::cluster) reply: ReplyTo,
    pub(in crate::cluster) since: Instant,
    pub(in crate::cluster) shard: u32,
    pub(in crate::cluster) epoch: u64,
    holder: Holder,
    rid: u64,
}

fn remember_rid(last: &mut DetMap<Holder, u64>, key: Holder, rid: u64) {
    if last.len() >= MAX_HOLDERS_REMEMBERED && !last.contains_key(&key) {
        // Bounded memory over a perfect filter: after this, a request that
        // was in flight for a long-gone connection could be applied late.
        last.clear();
    }
    let r = last.entry(key).or_insert(0);
    *r = (*r).max(rid);
}

fn owner_connect(
    o: &mut Owner,
    at: Millis,
    user: &str,
    device: &str,
    (kind, foreground): (DeviceKind, bool),
    (holder, wire, since, welcomed): (Holder, u64, u64, Option<u64>),
) -> Result<UserId, WireError> {
    let too_many = || WireError::new(ErrorCode::TooManyUsers, "the owner holds too many users");
    let uid = o.users.intern(user).ok_or_else(too_many)?;
    let Some(did) = o.devices.intern(device) else {
        forget_user_if_unknown(o, uid);
        return Err(too_many());
    };
    // A device connecting again (here or at another edge) supersedes its
    // older session; a Lingering one is taken over unseen.
    let connect = Connect {
        user: UserId(uid),
        device: DeviceId(did),
        kind,
        watch: Watch::All,
        resume: None,
        foreground,
    };
    let connected = match o.core.handle_connect(at, connect) {
        Ok(c) => c,
        Err(e) => {
            // Nothing refers to names interned for a refused connect.
            if o.devices.refs(did) == 0 {
                o.devices.remove(did);
            }
            forget_user_if_unknown(o, uid);
            return Err(e.into());
        }
    };
    if let Some(old) = o.by_holder.insert(holder.clone(), connected.session) {
        if let Some(held) = o.sessions.remove(&old) {
            o.record.changed(held.user);
            forget_device(&mut o.devices, held.device);
        }
    }
    o.record.changed(UserId(uid));
    o.devices.acquire(did);
    o.sessions.insert(
        connected.session,
        HeldSession {
            holder,
            device: did,
            wire,
            user: UserId(uid),
            kind,
            since,
            welcomed,
        },
    );
    o.ended.remove(&(user.to_owned(), device.to_owned()));
    Ok(UserId(uid))
}

/// Notes `holder` as the newest connection of `user`'s `device` heard of,
/// unless a later one of the same edge run was (connections are numbered
/// in welcome order, from one counter per edge run). Whether an older one
/// of the same run was heard of first: this one is stale.
fn heard_newer_conn(o: &mut Owner, user: &str, device: &str, holder: &Holder) -> bool {
    if let Some(devices) = o.newest_conn.get_mut(user) {
        let full = devices.len() >= MAX_DEVICES_REMEMBERED;
        match devices.iter_mut().find(|(d, _)| d == device) {
            Some((_, h)) if h.0 == holder.0 && h.1 == holder.1 && h.2 > holder.2 => return true,
            Some((_, h)) => h.clone_from(holder),
            None if !full => devices.push((device.to_owned(), holder.clone())),
            None => {}
        }
        return false;
    }
    if o.newest_conn.len() >= MAX_HOLDERS_REMEMBERED {
        // Bounded memory over a perfect filter, as for request ids.
        o.newest_conn.clear();
    }
    let devices = vec![(device.to_owned(), holder.clone())];
    o.newest_conn.insert(user.to_owned(), devices);
    false
}

/// Devices of one user whose newest connection is remembered.
const MAX_DEVICES_REMEMBERED: usize = 64;

/// How far apart two nodes' clocks may be: welcome times of sessions at two
/// nodes are ordered only when they differ by more.
const CLOCK_SKEW_MS: u64 = 3_000;

/// Whether `device` of `user` is online under a session welcomed after this
/// one (`holder`, `since`, `welcomed`): by the same edge run (`since`, its
/// welcome order), or by another node more than [`CLOCK_SKEW_MS`] after
/// (`welcomed`, when both connects said: protocol 3 and later).
fn welcomed_later(
    o: &Owner,
    (user, device): (&str, &str),
    holder: &Holder,
    since: u64,
    welcomed: Option<u64>,
) -> bool {
    let (Some(uid), Some(did)) = (o.users.get(user), o.devices.get(device)) else {
        return false;
    };
    o.core.sessions_of(UserId(uid)).into_iter().any(|s| {
        let online = o
            .core
            .session_info(s)
            .is_some_and(|i| i.online && i.device == DeviceId(did));
        online
            && o.sessions.get(&s).is_some_and(|held| {
                let h = &held.holder;
                if h.0 == holder.0 && h.1 == holder.1 {
                    return held.since > since;
                }
                match (held.welcomed, welcomed) {
                    (Some(later), Some(this)) => later > this.saturating_add(CLOCK_SKEW_MS),
                    _ => false,
                }
            })
    })
}

/// The session of `user`'s `device` held here for an earlier session of
/// the same edge run than `holder`'s (a smaller connection number: an
/// edge numbers them from one counter, and a closed session never gets a
/// new one). An edge holds one session per device, and replaces the older
/// one without a word when a newer one is welcomed; so an ending op of
/// the newer one, whose connect never reached this owner (lost, then
/// dropped as moot once it ended), ends the older one. `online`: only a
/// connected one (what a disconnect ends).
fn replaced_at_its_edge(
    o: &Owner,
    (user, device): (&str, &str),
    holder: &Holder,
    online: bool,
) -> Option<SessionId> {
    let (uid, did) = (o.users.get(user)?, o.devices.get(device)?);
    o.core.sessions_of(UserId(uid)).into_iter().find(|&s| {
        o.core
            .session_info(s)
            .is_some_and(|i| i.device == DeviceId(did) && (i.online || !online))
            && o.sessions.get(&s).is_some_and(|held| {
                let h = &held.holder;
                h.0 == holder.0 && h.1 == holder.1 && h.2 < holder.2
            })
    })
}

impl OwnedShards {
    /// Remembers `incarnation` as the edge's newest if it is; `false` if a
    /// newer one of the edge is known (`incarnation` is a dead run's).
    pub(in crate::cluster) fn saw_incarnation(&mut self, edge: &str, incarnation: u64) -> bool {
        match self.incarnations.get_mut(edge) {
            Some(newest) if *newest > incarnation => false,
            Some(newest) => {
                *newest = incarnation;
                true
            }
            None => {
                if self.incarnations.len() < MAX_EDGES_REMEMBERED {
                    self.incarnations.insert(edge.to_owned(), incarnation);
                }
                true
            }
        }
    }

    /// A request on a shard's subject: checked, then taken as its owner.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::cluster) fn request_message(
        &mut self,
        sh: &mut Shared,
        now: Instant,
        at: Millis,
        shard: u32,
        kind: RequestKind,
        payload: &[u8],
        reply: u64,
    ) {
        match decode::<ToOwner>(payload) {
            Some(msg) if self.well_formed(sh, &msg) => {
                let matches_kind = matches!(
                    (&msg, kind),
                    (ToOwner::Device { .. }, RequestKind::Input)
                        | (ToOwner::Snapshot { .. }, RequestKind::Snapshot)
                        | (ToOwner::Views { .. }, RequestKind::Snapshot)
                        | (ToOwner::Route { .. }, RequestKind::Snapshot)
                        | (ToOwner::GroupPartials { .. }, RequestKind::Snapshot)
                        | (ToOwner::GroupPage { .. }, RequestKind::Snapshot)
                );
                if !matches_kind {
                    sh.counters.malformed += 1;
                    return;
                }
                self.owner_request(sh, shard, msg, ReplyTo::Remote(reply), now, at);
            }
            _ => sh.counters.malformed += 1,
        }
    }

    /// Names within the limits (checked before anything is interned).
    pub(in crate::cluster) fn well_formed(&self, sh: &Shared, msg: &ToOwner) -> bool {
        let ok = |s: &str| !s.is_empty() && s.len() <= sh.max_name_len;
        match msg {
            ToOwner::Device {
                edge,
                user,
                device,
                op,
                ..
            } => {
                ok(edge)
                    && ok(user)
                    && ok(device)
                    && match op {
                        WireOp::SetStatus {
                            message: Some(m), ..
                        } => m.len() <= sh.owner_config.max_message_len,
                        _ => true,
                    }
            }
            ToOwner::Snapshot { viewer, targets } => {
                ok(viewer) && targets.len() <= MAX_SNAPSHOT_TARGETS && targets.iter().all(|t| ok(t))
            }
            ToOwner::Views { targets, .. } => {
                targets.len() <= MAX_SNAPSHOT_TARGETS && targets.iter().all(|t| ok(t))
            }
            ToOwner::Route { user } => ok(user),
            ToOwner::GroupPartials { parts } => parts.iter().all(|p| {
                p.shard < sh.settings.shard_count
                    && p.online.len() <= sh.owner_config.max_group_members
            }),
            ToOwner::GroupPage { .. } => true,
        }
    }

    pub(in crate::cluster) fn owner_request(
        &mut self,
        sh: &mut Shared,
        shard: u32,
        msg: ToOwner,
        reply: ReplyTo,
        now: Instant,
        at: Millis,
    ) {
        if !self.serves(sh, shard, now) {
            self.reply(sh, reply, FromOwner::NotOwner, now, at);
            return;
        }
        let answer = match msg {
            ToOwner::GroupPartials { parts } => self.take_partials(sh, shard, parts, now, at),
            ToOwner::GroupPage {
                group,
                after,
                limit,
            } => self.page_keys(sh, shard, group, after, limit, now),
            msg => return self.view_request(sh, shard, msg, reply, now, at),
        };
        self.reply(sh, reply, answer, now, at);
    }

    /// Views, snapshots, routes and device inputs to an owner acting for
    /// `shard`.
    pub(in crate::cluster) fn view_request(
        &mut self,
        sh: &mut Shared,
        shard: u32,
        msg: ToOwner,
        reply: ReplyTo,
        now: Instant,
        at: Millis,
    ) {
        // Whether each target gets its truth: the viewer's own, or all.
        let (viewer, all_own, targets) = match msg {
            ToOwner::Snapshot { viewer, targets } => (Some(viewer), false, targets),
            ToOwner::Views { targets, own } => (None, own, targets),
            ToOwner::Route { user } => {
                if sh.shard(&user) != shard {
                    sh.counters.malformed += 1;
                    return;
                }
                let entries = self.owners.get(&shard).map(|o| route_of(o, &user));
                self.reply(
                    sh,
                    reply,
                    FromOwner::Route(entries.unwrap_or_default()),
                    now,
                    at,
                );
                return;
            }
            device => {
                if let ReplyTo::Remote(_) = reply {
                    sh.counters.owner_inputs += 1;
                }
                return self.owner_input(sh, shard, device, reply, now, at);
            }
        };
        if targets.iter().any(|t| sh.shard(t) != shard) {
            sh.counters.malformed += 1;
            return;
        }
        if !self.load_users(sh, shard, targets.iter().map(String::as_str), now) {
            self.reply(sh, reply, FromOwner::Loading, now, at);
            return;
        }
        let mut presences = Vec::with_capacity(targets.len());
        let base = sh.unix_base_ms;
        for t in &targets {
            let Some(o) = self.owners.get_mut(&shard) else {
                return;
            };
            let Some(uid) = o.users.intern(t) else {
                // At the cap: no answer, the edge times out.
                return;
            };
            match o
                .core
                .handle_snapshot(at, UserId(uid), all_own || viewer.as_ref() == Some(t))
            {
                Ok(p) => presences.push(proto::Presence::from_core(&p, base)),
                Err(_) => return,
            }
            if !o.core.is_online(UserId(uid)) {
                note_idle(o, UserId(uid), at);
            }
        }
        self.drain_owner(sh, shard, now, at);
        let (epoch, seq) = self.published_up_to(shard);
        self.reply(
            sh,
            reply,
            FromOwner::Snapshot {
                presences,
                epoch,
                seq,
            },
            now,
            at,
        );
    }

    pub(in crate::cluster) fn reply(
        &mut self,
        sh: &mut Shared,
        to: ReplyTo,
        answer: FromOwner,
        now: Instant,
        at: Millis,
    ) {
        match to {
            ReplyTo::Remote(reply) => sh.outputs.push_back(ClusterOutput::Reply {
                reply,
                payload: encode(&answer),
            }),
            ReplyTo::Loopback(id) => sh.to_edge.push_back(ToEdge::Answer {
                id,
                answer,
                now,
                at,
            }),
        }
    }

    /// A device input at the owner of `shard`.
    pub(in crate::cluster) fn owner_input(
        &mut self,
        sh: &mut Shared,
        shard: u32,
        msg: ToOwner,
        reply: ReplyTo,
        now: Instant,
        at: Millis,
    ) {
        let ToOwner::Device {
            edge,
            incarnation,
            rid,
            conn,
            user,
            device,
            op,
        } = msg
        else {
            return;
        };
        if sh.shard(&user) != shard {
            sh.counters.malformed += 1;
            return;
        }
        if !self.saw_incarnation(&edge, incarnation) {
            // Sent by a run of the edge that is gone (a `kill -9` just
            // after it sent): applied, it would connect a device nobody
            // holds, a ghost until the next owner change.
            sh.counters.stale_incarnation += 1;
            return;
        }
        let from_unix = |unix: u64| Millis(unix.saturating_sub(sh.unix_base_ms)).min(at);
        let loads = self.pending_loads.len();
        // `max_users` is the node's, over all the shards it owns: a user
        // new to every owner core here is refused at it.
        let node_users: usize = self.owners.values().map(|o| o.users.len()).sum();
        let Some(o) = self.owners.get_mut(&shard) else {
            return self.reply(sh, reply, FromOwner::NotOwner, now, at);
        };
        let (connects, foreground) = match op {
            WireOp::Connect { .. } => (true, true),
            WireOp::ConnectInBackground { .. } => (true, false),
            WireOp::ConnectWelcomed { foreground, .. } => (true, foreground),
            _ => (false, true),
        };
        if connects && node_users >= sh.owner_config.max_users && o.users.get(&user).is_none() {
            let full = WireError::new(ErrorCode::TooManyUsers, "this node holds too many users");
            return self.reply(sh, reply, FromOwner::Refused(full), now, at);
        }
        let epoch = o.epoch;
        if !o.loaded.contains(&user) {
            // The user's KV record first: a new owner keeps their choices,
            // and a user last published online whose device it never hears
            // of goes offline once the resync window closed (no ghost).
            let msg = ToOwner::Device {
                edge,
                incarnation,
                rid,
                conn,
                user: user.clone(),
                device,
                op,
            };
            if let Some(queue) = o.loading.get_mut(&user) {
                if queue.len() < MAX_QUEUED_OPS * 4 {
                    queue.push((msg, reply));
                }
                return;
            }
            if loads >= MAX_PENDING_PREFS {
                return self.reply(sh, reply, FromOwner::NotOwner, now, at);
            }
            o.loading.insert(user.clone(), vec![(msg, reply)]);
            sh.next_id += 1;
            let id = sh.next_id;
            self.pending_loads
                .insert(id, (shard, epoch, user.clone(), now));
            sh.outputs.push_back(ClusterOutput::LoadUser { id, user });
            return;
        }
        let holder = (edge, incarnation, conn);
        if o.last_rid.get(&holder).is_some_and(|&r| rid <= r) {
            return self.reply(sh, reply, FromOwner::Done { epoch }, now, at);
        }
        let session = o.by_holder.get(&holder).copied();
        let ends = matches!(op, WireOp::Disconnect { .. } | WireOp::Logout);
        let stale = (connects || ends) && heard_newer_conn(o, &user, &device, &holder);
        let live = |o: &Owner, s: SessionId| o.core.session_info(s).is_some_and(|i| i.online);
        let mut prefs = false;
        let answer = match op {
            WireOp::Connect {
                kind,
                session: wire,
                since,
            }
            | WireOp::ConnectInBackground {
                kind,
                session: wire,
                since,
            }
            | WireOp::ConnectWelcomed {
                kind,
                session: wire,
                since,
                ..
            } => {
                let welcomed = match op {
                    WireOp::ConnectWelcomed { welcomed, .. } => Some(welcomed),
                    _ => None,
                };
                let names = (user.as_str(), device.as_str());
                if session.is_some_and(|s| live(o, s)) {
                    FromOwner::Done { epoch }
                } else if stale || welcomed_later(o, names, &holder, since, welcomed) {
                    // A session welcomed after this one holds the device:
                    // this one was given up by its client and must not
                    // take the device over (its end would show the device
                    // offline while it is connected).
                    sh.counters.stale_connects += 1;
                    FromOwner::Done { epoch }
                } else {
                    let named = (holder.clone(), wire, since, welcomed);
                    let state = (kind.into(), foreground);
                    match owner_connect(o, at, &user, &device, state, named) {
                        Ok(uid) => {
                            o.dirty_since.get_or_insert(at);
                            if holder.0 != sh.settings.node {
                                o.greet.push((uid, holder.0.clone()));
                            }
                            FromOwner::Done { epoch }
                        }
                        Err(e) => FromOwner::Refused(e),
                    }
                }
            }
            WireOp::Disconnect { last_heard } => {
                let names = (user.as_str(), device.as_str());
                let ended = session.or_else(|| replaced_at_its_edge(o, names, &holder, true));
                if let Some(s) = ended {
                    let _ = o.core.handle_disconnect(at, s, from_unix(last_heard));
                }
                FromOwner::Done { epoch }
            }
            WireOp::Logout => {
                let names = (user.as_str(), device.as_str());
                if let Some(s) = session.or_else(|| replaced_at_its_edge(o, names, &holder, false))
                {
                    let _ = o.core.handle_logout(at, s);
                }
                FromOwner::Done { epoch }
            }
            WireOp::SetStatus { status, message } => match session.filter(|&s| live(o, s)) {
                None => FromOwner::Unknown,
                Some(s) => match o
                    .core
                    .handle_set_status(at, s, status.into(), message.as_deref())
                {
                    Ok(()) => {
                        prefs = true;
                        FromOwner::Done { epoch }
                    }
                    Err(e) => FromOwner::Refused(e.into()),
                },
            },
            WireOp::SetInvisible(invisible) => match session.filter(|&s| live(o, s)) {
                None => FromOwner::Unknown,
                Some(s) => match o.core.handle_set_invisible(at, s, invisible) {
                    Ok(()) => {
                        prefs = true;
                        FromOwner::Done { epoch }
                    }
                    Err(e) => FromOwner::Refused(e.into()),
                },
            },
            WireOp::SetForeground(foreground) => match session.filter(|&s| live(o, s)) {
                None => FromOwner::Unknown,
                Some(s) => match o.core.handle_set_foreground(at, s, foreground) {
                    Ok(()) => {
                        if let Some(held) = o.sessions.get(&s) {
                            o.record.changed(held.user);
                        }
                        // Last seen may move: written behind, like a connect.
                        o.dirty_since.get_or_insert(at);
                        FromOwner::Done { epoch }
                    }
                    Err(e) => FromOwner::Refused(e.into()),
                },
            },
        };
        let key_rid = holder.clone();
        if prefs {
            // Preferences are in the KV before the ack (C4).
            let uid = o.users.get(&user).map(UserId);
            let saved = uid.map(|u| o.core.saved(u)).unwrap_or_default();
            let value = encode(&WirePrefs {
                status: saved.status.into(),
                message: saved.message.as_deref().map(str::to_owned),
                invisible: saved.invisible,
                last_seen: saved.last_seen.map(|m| sh.to_unix(m)),
            });
            if self.pending_prefs.len() < MAX_PENDING_PREFS {
                let id = sh.id();
                self.pending_prefs.insert(
                    id,
                    PendingPrefs {
                        reply,
                        since: now,
                        shard,
                        epoch,
                        holder: key_rid,
                        rid,
                    },
                );
                let write = Waiting {
                    shard,
                    epoch,
                    value,
                    requests: vec![id],
                };
                let pending = &self.pending_prefs;
                let live = |r: u64| pending.contains_key(&r);
                if let Some(w) = self.prefs_writes.start(now, id, &user, write, live) {
                    sh.outputs.push_back(ClusterOutput::PutPrefs {
                        id,
                        user,
                        epoch,
                        value: w.value,
                    });
                }
            }
            self.drain_owner(sh, shard, now, at);
            return;
        }
        if matches!(answer, FromOwner::Done { .. }) {
            if let Some(o) = self.owners.get_mut(&shard) {
                remember_rid(&mut o.last_rid, key_rid, rid);
            }
        }
        self.drain_owner(sh, shard, now, at);
        self.reply(sh, reply, answer, now, at);
    }

    /// The KV write of preferences `id` is done (`ok`) or failed: the
    /// requests it carried are answered, and the user's value that waited
    /// for it goes out, while its epoch is still acted for.
    pub(in crate::cluster) fn prefs_stored(
        &mut self,
        sh: &mut Shared,
        now: Instant,
        at: Millis,
        id: u64,
        ok: bool,
    ) {
        let Some(done) = self.prefs_writes.finished(id) else {
            return;
        };
        for request in done.requests {
            self.answer_prefs(sh, now, at, request, ok);
        }
        let Some(next) = done.next else {
            return;
        };
        if self.acting_epoch(sh, next.shard, now) != Some(next.epoch) {
            for request in next.requests {
                self.answer_prefs(sh, now, at, request, false);
            }
            return;
        }
        let write = sh.id();
        self.prefs_writes
            .sent(now, write, &done.user, next.requests);
        sh.outputs.push_back(ClusterOutput::PutPrefs {
            id: write,
            user: done.user,
            epoch: next.epoch,
            value: next.value,
        });
    }

    /// Answers request `id`, which waited for its preferences to be stored
    /// (`ok`) or not.
    pub(in crate::cluster) fn answer_prefs(
        &mut self,
        sh: &mut Shared,
        now: Instant,
        at: Millis,
        id: u64,
        ok: bool,
    ) {
        let Some(p) = self.pending_prefs.remove(&id) else {
            return;
        };
        // Done only while this node still acts for the epoch it
        // wrote under (C4): after the shard moved, the new owner may
        // show otherwise, so the edge asks it again.
        let acting = self
            .acting
            .get(&p.shard)
            .is_some_and(|(epoch, until)| *epoch == p.epoch && now < *until);
        let owner = self
            .owners
            .get_mut(&p.shard)
            .filter(|o| acting && o.epoch == p.epoch);
        let acked_anyway =
            sh.settings.mutant == Some(crate::cluster::LinkMutant::AckAfterShardLost);
        let answer = match owner {
            Some(o) if ok => {
                remember_rid(&mut o.last_rid, p.holder, p.rid);
                FromOwner::Done { epoch: p.epoch }
            }
            None if ok && acked_anyway => FromOwner::Done { epoch: p.epoch },
            // Not stored (or fenced by a newer owner's write), or
            // the shard moved: the edge asks again.
            _ => FromOwner::NotOwner,
        };
        self.reply(sh, p.reply, answer, now, at);
    }
}
