//! A shard's owner: claiming, the core's outputs, device requests.

use super::*;

impl ClusterModel {
    pub(super) fn claim_shard(&self, s: &mut ClusterState, n: u8) {
        let t = s.t;
        let epoch = Epoch(s.kv.epoch.0 + 1);
        s.kv.epoch = epoch;
        s.kv.claim = Some((n, epoch, t + TTL));
        let mut core = Core::new(self.config.clone()).expect("valid config");
        core.set_publish_views(true);
        if !self.is(ClusterMutant::NoEpochInVersions) {
            core.enter_epoch(epoch);
        }
        if !self.is(ClusterMutant::NoResyncHold) {
            core.hold_offline_until(Millis(t + RESYNC));
        }
        let mut published = s.kv.view.clone().unwrap_or_default();
        if self.is(ClusterMutant::NoEpochInVersions) {
            published.version = 0;
        }
        let record = OwnedRecord {
            invisible: s.kv.invisible,
            published,
            devices: s
                .kv
                .devices
                .iter()
                .map(|&(edge, _, _, dev, heard)| DeviceRecord {
                    device: device_id(dev),
                    kind: device_kind(dev),
                    edge: NodeId(edge.into()),
                    last_heard: Millis(heard),
                    foreground: true,
                })
                .collect(),
            ..OwnedRecord::default()
        };
        let mut sessions = BTreeMap::new();
        if let Ok(restored) = core.restore_owned(Millis(t), ALICE, &record, Millis(t + RESYNC)) {
            for (session, &(edge, inc, conn, dev, _)) in restored.into_iter().zip(&s.kv.devices) {
                sessions.insert(session, (edge, inc, conn, dev));
            }
        }
        let mut owner = OwnerState {
            epoch,
            core,
            sessions,
            last_rid: BTreeMap::new(),
            seq: 0,
            resync_until: t + RESYNC,
            resynced: 0,
            dirty: None,
            renewed: t,
            writing: None,
        };
        // This node's own edge resends at once, without a message.
        let inc = s.nodes[n as usize].inc;
        for dev in [MOBILE, DESKTOP] {
            if let Some(conn) = s.nodes[n as usize].devices[dev as usize].as_ref() {
                let conn = conn.conn;
                self.connect(s, &mut owner, n, inc, conn, dev);
            }
        }
        if let Some(w) = s.nodes[n as usize]
            .watcher
            .as_deref_mut()
            .filter(|w| w.watches())
        {
            w.snap_pending = true;
            w.seen = w.seen.max((epoch, 0));
        }
        self.drain(s, n, &mut owner);
        s.nodes[n as usize].owner = Some(Box::new(owner));
        // Ask every other edge to resend (retried each tick of the window
        // where messages get lost); the first owner has nothing to recover.
        for m in (0..self.bounds.nodes).filter(|&m| m != n && epoch.0 > 1) {
            s.send(n, m, Body::Resync { epoch });
        }
    }

    /// Sends what the owner's core produced: published views on the shard's
    /// subject (and into the KV), and forgets ended sessions.
    pub(super) fn drain(&self, s: &mut ClusterState, n: u8, o: &mut OwnerState) {
        while let Some(out) = o.core.poll_output() {
            if let Output::SessionEnded { session, reason } = out {
                if let Some((edge, inc, conn, _)) = o.sessions.remove(&session) {
                    o.dirty = o.dirty.or(Some(s.t));
                    if reason == greendot_core::EndReason::Superseded {
                        s.send(n, edge, Body::Ended { inc, conn });
                    }
                }
            }
        }
        while let Some(p) = o.core.poll_published() {
            if p.own || p.user != ALICE {
                continue; // alice's own sessions are not modelled
            }
            if s.kv
                .claim
                .is_none_or(|(holder, e, _)| holder != n || e != o.epoch)
            {
                s.bad.push(format!(
                    "C1: node {n} published at epoch {:?} without holding the claim {:?}",
                    o.epoch, s.kv.claim
                ));
            }
            if p.presence.online && s.alice.invisible_acked {
                s.bad.push(format!(
                    "C4: node {n} published invisible alice online: {:?}",
                    p.presence
                ));
            }
            o.seq += 1;
            s.kv.view = Some(p.presence.clone());
            // On the shard's subject: to every edge with a watcher of it.
            for m in watching(s) {
                let view = Body::View {
                    epoch: o.epoch,
                    seq: o.seq,
                    presence: Shown(p.presence.clone()),
                };
                s.send(n, m, view);
            }
        }
    }

    pub(super) fn owner_msg(&self, s: &mut ClusterState, n: u8, body: Body) {
        let Some(mut o) = s.nodes[n as usize].owner.take() else {
            return; // not an owner (any more): the edge retries elsewhere
        };
        let t = s.t;
        match body {
            Body::Req {
                edge,
                inc,
                rid,
                dev,
                op,
            } => {
                let done = o.last_rid.get(&(edge, inc, dev)).is_some_and(|&r| rid <= r);
                let mut reply = Some(Body::Ack {
                    epoch: o.epoch,
                    rid,
                });
                if !done {
                    match op {
                        Op::Connect => {
                            o.last_rid.insert((edge, inc, dev), rid);
                            self.connect(s, &mut o, edge, inc, rid, dev);
                        }
                        Op::Logout => {
                            match live_session(&o, edge, inc, dev) {
                                Some(session) => {
                                    o.last_rid.insert((edge, inc, dev), rid);
                                    let all: Vec<SessionId> =
                                        if self.is(ClusterMutant::LogoutEndsUser) {
                                            o.sessions.keys().copied().collect()
                                        } else {
                                            vec![session]
                                        };
                                    for session in all {
                                        let _ = o.core.handle_logout(Millis(t), session);
                                    }
                                }
                                // As for SetInvisible: connected first, so
                                // the logout ends a session this owner has.
                                None => reply = Some(Body::Unknown { rid }),
                            }
                        }
                        Op::SetInvisible(b) => {
                            let session = live_session(&o, edge, inc, dev);
                            // Hole found by the model: a new owner that has
                            // not heard of the device yet (its resync or its
                            // KV record still to come) acked without storing
                            // anything. It answers Unknown instead, unrecorded,
                            // and the edge connects the device again first.
                            match session {
                                // Its write is on its way: the answer
                                // comes when it lands.
                                Some(_) if o.writing == Some((edge, inc, dev, rid)) => reply = None,
                                Some(session) => {
                                    let set = o.core.handle_set_invisible(Millis(t), session, b);
                                    if set.is_ok() && !self.is(ClusterMutant::InvisibleInMemory) {
                                        // Answered when the KV has it (or
                                        // never, from a node cut off from
                                        // it: the edge asks again).
                                        reply = None;
                                        if !s.nodes[n as usize].cut {
                                            o.writing = Some((edge, inc, dev, rid));
                                            s.writes.insert(Write {
                                                sent: t,
                                                node: n,
                                                inc: s.nodes[n as usize].inc,
                                                epoch: o.epoch,
                                                request: (edge, inc, dev, rid),
                                                invisible: b,
                                                held: false,
                                            });
                                        }
                                    } else {
                                        o.last_rid.insert((edge, inc, dev), rid);
                                    }
                                }
                                None if self.is(ClusterMutant::AckWithoutSession) => {
                                    o.last_rid.insert((edge, inc, dev), rid);
                                }
                                None => reply = Some(Body::Unknown { rid }),
                            }
                        }
                    }
                }
                if let Some(reply) = reply {
                    s.send(n, edge, reply);
                }
            }
            Body::SnapReq { edge } => {
                if let Ok(p) = o.core.handle_snapshot(Millis(t), ALICE, false) {
                    s.send(
                        n,
                        edge,
                        Body::Snap {
                            epoch: o.epoch,
                            seq: o.seq,
                            presence: Shown(p),
                        },
                    );
                }
            }
            Body::Resynced {
                edge,
                inc,
                epoch,
                devices,
                watches,
            } if epoch == o.epoch => {
                o.resynced |= 1 << edge;
                for (dev, conn) in devices.into_iter().enumerate() {
                    if let Some(conn) = conn {
                        self.connect(s, &mut o, edge, inc, conn, dev as u8);
                    }
                }
                if watches {
                    if let Ok(p) = o.core.handle_snapshot(Millis(t), ALICE, false) {
                        s.send(
                            n,
                            edge,
                            Body::Snap {
                                epoch: o.epoch,
                                seq: o.seq,
                                presence: Shown(p),
                            },
                        );
                    }
                }
            }
            _ => {}
        }
        self.drain(s, n, &mut o);
        s.nodes[n as usize].owner = Some(o);
    }

    pub(super) fn connect(
        &self,
        s: &mut ClusterState,
        o: &mut OwnerState,
        edge: u8,
        inc: u8,
        conn: u8,
        dev: u8,
    ) {
        let known: Vec<SessionId> = o
            .sessions
            .iter()
            .filter(|&(_, &e)| e == (edge, inc, conn, dev))
            .map(|(&session, _)| session)
            .collect();
        if known.iter().any(|&k| live(&o.core, k)) {
            return; // this connection is live here already (a retry, a resync)
        }
        // Restored from the KV as Lingering: the new session supersedes it,
        // and the edge must not be told to close the connection.
        for k in known {
            o.sessions.remove(&k);
        }
        let c = Connect {
            user: ALICE,
            device: device_id(dev),
            kind: device_kind(dev),
            watch: Watch::All,
            resume: None,
            foreground: true,
        };
        if let Ok(c) = o.core.handle_connect(Millis(s.t), c) {
            o.sessions.insert(c.session, (edge, inc, conn, dev));
            o.dirty = o.dirty.or(Some(s.t));
        }
    }
}

impl ClusterModel {
    /// The KV applies a preference write: refused when an owner of a newer
    /// epoch wrote the record; then its owner hears the outcome and answers
    /// the edge, but only while it still acts for the epoch it wrote under.
    /// Otherwise the edge asks again, of the current claim holder.
    pub(super) fn store(&self, s: &mut ClusterState, w: Write) {
        let ok = w.epoch >= s.kv.prefs_epoch;
        if ok {
            s.kv.invisible = w.invisible;
            s.kv.prefs_epoch = w.epoch;
        }
        let node = &mut s.nodes[w.node as usize];
        if !node.up || node.inc != w.inc {
            return; // the answer went to a process that is gone
        }
        let (edge, inc, dev, rid) = w.request;
        let owner = node.owner.as_deref_mut().filter(|o| o.epoch == w.epoch);
        let acting = owner.is_some();
        if let Some(o) = owner {
            if o.writing == Some(w.request) {
                o.writing = None;
            }
            if ok {
                o.last_rid.insert((edge, inc, dev), rid);
            }
        }
        if ok && (acting || self.is(ClusterMutant::AckAfterLostShard)) {
            let ack = Body::Ack {
                epoch: w.epoch,
                rid,
            };
            s.send(w.node, edge, ack);
        }
    }
}

/// The nodes whose edge watches the shard (NATS delivers them its subject).
pub(super) fn watching(s: &ClusterState) -> Vec<u8> {
    (0..s.nodes.len() as u8)
        .filter(|&m| {
            s.nodes[m as usize]
                .watcher
                .as_ref()
                .is_some_and(|w| w.watches())
        })
        .collect()
}

/// The Online session of alice's device `dev` at (edge, incarnation).
fn live_session(o: &OwnerState, edge: u8, inc: u8, dev: u8) -> Option<SessionId> {
    o.sessions
        .iter()
        .find(|&(&k, &(e, i, _, d))| (e, i, d) == (edge, inc, dev) && live(&o.core, k))
        .map(|(&k, _)| k)
}

/// Whether `session` is Online in `core` (not Lingering, not gone).
pub(super) fn live(core: &Core, session: SessionId) -> bool {
    core.session_info(session).is_some_and(|i| i.online)
}
