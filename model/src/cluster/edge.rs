//! An edge: device replies, resyncs, snapshots and views for bob.

use super::*;

impl ClusterModel {
    /// An edge handles a message; a snapshot found stale or missing is
    /// asked for at once (and again at each tick until answered).
    pub(super) fn edge_msg(&self, s: &mut ClusterState, n: u8, body: Body) {
        let pending = |s: &ClusterState| {
            s.nodes[n as usize]
                .watcher
                .as_ref()
                .is_some_and(|w| w.snap_pending)
        };
        // A stale snapshot answers the pending request: ask again.
        let before = pending(s) && !matches!(body, Body::Snap { .. });
        self.edge_msg_inner(s, n, body);
        if !before && pending(s) {
            if let Some((holder, _, _)) = s.kv.claim {
                s.send(n, holder, Body::SnapReq { edge: n });
            }
        }
    }

    pub(super) fn edge_msg_inner(&self, s: &mut ClusterState, n: u8, body: Body) {
        let t = s.t;
        let node = &mut s.nodes[n as usize];
        match body {
            Body::Ended { inc, conn } => {
                let this_process =
                    node.inc == inc || self.is(ClusterMutant::EndedWithoutIncarnation);
                let dev = node
                    .devices
                    .iter()
                    .position(|d| d.as_ref().is_some_and(|d| d.conn == conn));
                if let Some(dev) = dev.filter(|_| this_process) {
                    node.devices[dev] = None;
                    if dev == MOBILE as usize {
                        s.alice.at = None;
                        s.alice.away_since = Some(t);
                        s.alice.gone |= s.alice.logout_asked;
                    }
                }
            }
            Body::Ack { rid, .. } => {
                let dev = node
                    .devices
                    .iter()
                    .position(|d| d.as_ref().is_some_and(|d| d.rid == rid));
                if let Some(dev) = dev {
                    let d = node.devices[dev].as_mut().expect("found");
                    if let Some(Op::SetInvisible(true)) = d.pending {
                        s.alice.invisible_acked = true;
                    }
                    if d.pending == Some(Op::Logout) {
                        // Logged out: the mobile is done.
                        node.devices[dev] = None;
                        s.alice.at = None;
                        s.alice.gone = true;
                        return;
                    }
                    d.pending = d.then.take();
                    if let Some(op) = d.pending {
                        node.rids += 1;
                        d.rid = node.rids;
                        let req = Body::Req {
                            edge: n,
                            inc: node.inc,
                            rid: d.rid,
                            dev: dev as u8,
                            op,
                        };
                        if let Some((holder, _, _)) = s.kv.claim {
                            s.send(n, holder, req);
                        }
                    }
                }
            }
            Body::Unknown { rid } => {
                let dev = node
                    .devices
                    .iter()
                    .position(|d| d.as_ref().is_some_and(|d| d.rid == rid));
                if let Some(dev) = dev {
                    let d = node.devices[dev].as_mut().expect("found");
                    d.then = d.pending.take();
                    node.rids += 1;
                    d.rid = node.rids;
                    d.conn = d.rid; // a new connection to the owner
                    d.pending = Some(Op::Connect);
                    let req = Body::Req {
                        edge: n,
                        inc: node.inc,
                        rid: d.rid,
                        dev: dev as u8,
                        op: Op::Connect,
                    };
                    if let Some((holder, _, _)) = s.kv.claim {
                        s.send(n, holder, req);
                    }
                }
            }
            Body::Resync { epoch } => {
                let watches = node.watcher.as_ref().is_some_and(|w| w.watches());
                if let Some(w) = node.watcher.as_deref_mut().filter(|w| w.watches()) {
                    w.snap_pending = true; // the snapshot comes with the answer
                    w.seen = w.seen.max((epoch, 0));
                }
                let body = Body::Resynced {
                    edge: n,
                    inc: node.inc,
                    epoch,
                    devices: node.devices.clone().map(|d| d.map(|d| d.conn)),
                    watches,
                };
                if let Some((holder, _, _)) = s.kv.claim.filter(|c| c.1 == epoch) {
                    s.send(n, holder, body);
                }
            }
            Body::Snap {
                epoch,
                seq,
                presence,
            } => {
                let Some(w) = node.watcher.as_deref_mut() else {
                    return;
                };
                // Hole found by the model: a view may overtake the snapshot
                // of an edge still subscribing; a snapshot older than a view
                // already seen is applied but asked for again.
                w.snap_pending = (epoch, seq) < w.seen;
                w.seen = w.seen.max((epoch, seq));
                let updates = if !w.subscribed {
                    w.subscribed = true;
                    let snap = w
                        .fanout
                        .subscribe(Millis(t), BOB_SESSION, ALICE, Tier::Realtime, presence.0)
                        .unwrap_or_default();
                    vec![snap]
                } else {
                    w.fanout.apply(Millis(t), ALICE, false, presence.0);
                    pushes(&mut w.fanout)
                };
                for p in updates {
                    bob_sees(s, n, p);
                }
            }
            Body::View {
                epoch,
                seq,
                presence,
            } => {
                let Some(w) = node.watcher.as_deref_mut() else {
                    return;
                };
                if (epoch, seq) > w.seen && !w.subscribed {
                    w.seen = (epoch, seq); // the snapshot must be at least this new
                    return;
                }
                if (epoch, seq) > w.seen {
                    if epoch == w.seen.0 && seq > w.seen.1 + 1 {
                        w.snap_pending = true; // a view was lost
                    }
                    w.seen = (epoch, seq);
                }
                w.fanout.apply(Millis(t), ALICE, false, presence.0);
                for p in pushes(&mut w.fanout) {
                    bob_sees(s, n, p);
                }
            }
            Body::Beacon { epoch, seq } => {
                if self.is(ClusterMutant::NoBeacon) {
                    return;
                }
                let Some(w) = node.watcher.as_deref_mut() else {
                    return;
                };
                if (epoch, seq) > w.seen {
                    w.snap_pending = true;
                    w.seen = (epoch, seq);
                }
            }
            _ => {}
        }
    }
}

/// The pushes a `Fanout` produced for bob.
pub(super) fn pushes(fanout: &mut Fanout) -> Vec<Presence> {
    std::iter::from_fn(|| fanout.poll_output())
        .filter_map(|out| match out {
            Output::Push { presence, .. } => Some(presence),
            Output::SessionEnded { .. } => None,
        })
        .collect()
}

/// Bob's client applies an update; C1 and C2 are judged as it does.
pub(super) fn bob_sees(s: &mut ClusterState, n: u8, p: Presence) {
    if s.bob.at != Some(n) {
        return;
    }
    let before = s.bob.view.get(ALICE).cloned();
    let newest_epoch = before.as_ref().map(|b| epoch_of(b.version));
    if s.bob.view.apply(ALICE, p.clone()) == greendot_core::Applied::Dropped {
        return;
    }
    if newest_epoch.is_some_and(|e| epoch_of(p.version) < e) {
        s.bad
            .push(format!("C1: bob took a view of an older epoch: {p:?}"));
    }
    let desktop = s.nodes[WATCHER_NODE as usize].devices[DESKTOP as usize].is_some();
    if before.as_ref().is_some_and(|b| b.online) && !p.online && desktop && !s.alice.invisible_asked
    {
        s.bad.push(format!(
            "AG: bob shown alice offline while her desktop is connected: {p:?}"
        ));
    }
    let excused = s.alice.gone || s.alice.invisible_asked || s.alice.logout_asked;
    if before.is_some_and(|b| b.online) && !p.online && !excused {
        s.bad.push(format!(
            "C2: bob shown alice offline while she is connected or back within grace: {p:?}"
        ));
    }
}
