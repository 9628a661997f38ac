//! Time: renewals, lapses, write-behind, expiries, claims, retries; and crashes.

use super::*;

impl ClusterModel {
    pub(super) fn tick(&self, s: &mut ClusterState) {
        s.t += 1;
        let t = s.t;
        let nodes = self.bounds.nodes;
        // Renewals (compare-and-set on the claim) and lapses.
        for n in 0..nodes {
            let node = &mut s.nodes[n as usize];
            if !node.up {
                continue;
            }
            if !node.cut {
                node.renewed = t;
                s.kv.leases[n as usize] = Some((node.inc, t + TTL));
                if let Some(o) = node.owner.as_deref_mut() {
                    match s.kv.claim {
                        Some((holder, e, _)) if holder == n && e == o.epoch => {
                            s.kv.claim = Some((n, e, t + TTL));
                            o.renewed = t;
                        }
                        _ => node.owner = None, // lost it: stop at once
                    }
                }
            } else {
                let lapse = |renewed: u64| t + MARGIN >= renewed + TTL;
                if node.owner.as_deref().is_some_and(|o| lapse(o.renewed))
                    && !self.is(ClusterMutant::KeepOwningAfterLapse)
                {
                    node.owner = None;
                }
                if lapse(node.renewed) && node.devices[MOBILE as usize].is_some() {
                    // Cut off: close the clients before the lease runs out.
                    // (The desktop's node is never cut off.)
                    node.devices[MOBILE as usize] = None;
                    s.alice.at = None;
                    s.alice.away_since = Some(t);
                    s.alice.gone |= s.alice.logout_asked;
                }
                if lapse(node.renewed) && node.watcher.is_some() {
                    node.watcher = None;
                    s.bob.at = None;
                }
            }
        }
        // Device changes are written behind, two ticks after they happen
        // (so a crash at the tick in between loses them).
        for n in 0..nodes {
            let node = &mut s.nodes[n as usize];
            let due = |o: &&mut OwnerState| o.dirty.is_some_and(|d| t >= d + 2);
            if let Some(o) = node.owner.as_deref_mut().filter(due).filter(|_| !node.cut) {
                o.dirty = None;
                s.kv.devices = o
                    .sessions
                    .values()
                    .map(|&(e, i, c, d)| (e, i, c, d, t))
                    .collect();
            }
        }
        // KV expiries.
        let mut lost = Vec::new();
        for n in 0..nodes as usize {
            if let Some((inc, expires)) = s.kv.leases[n] {
                if expires <= t {
                    s.kv.leases[n] = None;
                    lost.push((n as u8, inc, expires - TTL));
                }
            }
        }
        if s.kv.claim.is_some_and(|(_, _, expires)| expires <= t) {
            s.kv.claim = None;
        }
        // Owners handle lost edges (a watch on the lease bucket), and under
        // the fix, a lease whose incarnation changed (a restarted edge).
        for n in 0..nodes {
            let Some(mut o) = s.nodes[n as usize].owner.take() else {
                continue;
            };
            if !self.is(ClusterMutant::IgnoreEdgeLost) {
                let gone: Vec<(SessionId, u64)> = o
                    .sessions
                    .iter()
                    .filter_map(|(&session, &(edge, inc, _, _))| {
                        let expired = lost
                            .iter()
                            .find(|&&(e, i, _)| e == edge && i == inc)
                            .map(|&(_, _, renewed)| renewed);
                        let replaced = !self.is(ClusterMutant::NoIncarnation)
                            && s.kv.leases[edge as usize].is_some_and(|(i, _)| i != inc);
                        expired
                            .or(replaced.then_some(t))
                            .map(|renewed| (session, renewed))
                    })
                    .collect();
                let takes_user = self.is(ClusterMutant::EdgeLostTakesUser);
                for (session, renewed) in gone {
                    let all: Vec<SessionId> = if takes_user {
                        o.sessions.keys().copied().collect()
                    } else {
                        vec![session]
                    };
                    o.core.handle_edge_lost(Millis(t), &all, Millis(renewed));
                }
            }
            s.nodes[n as usize].owner = Some(o);
        }
        // A free shard is claimed by its preferred node among the live ones.
        if s.kv.claim.is_none() {
            let live: Vec<NodeId> = (0..nodes)
                .filter(|&n| {
                    let node = &s.nodes[n as usize];
                    node.up && !node.cut && s.kv.leases[n as usize].is_some()
                })
                .map(|n| NodeId(n.into()))
                .collect();
            if let Some(NodeId(n)) = owner_of(SHARD, &live) {
                self.claim_shard(s, n as u8);
            }
        }
        // Owners: timers, beacons, resync retries.
        for n in 0..nodes {
            let Some(mut o) = s.nodes[n as usize].owner.take() else {
                continue;
            };
            o.core.handle_timeout(Millis(t));
            self.drain(s, n, &mut o);
            // Beacons and resync retries only matter where messages get
            // lost; without losses they would only add interleavings.
            if self.bounds.drops > 0 {
                for m in watching(s) {
                    let beacon = Body::Beacon {
                        epoch: o.epoch,
                        seq: o.seq,
                    };
                    s.send(n, m, beacon);
                }
            }
            if t < o.resync_until && self.bounds.drops > 0 {
                for m in (0..nodes).filter(|&m| m != n) {
                    if o.resynced & (1 << m) == 0 && s.kv.leases[m as usize].is_some() {
                        s.send(n, m, Body::Resync { epoch: o.epoch });
                    }
                }
            }
            s.nodes[n as usize].owner = Some(o);
        }
        // Edges: retries to the current claim holder.
        if let Some((holder, _, _)) = s.kv.claim {
            for n in 0..nodes {
                let node = &s.nodes[n as usize];
                if !node.up {
                    continue;
                }
                let reqs: Vec<Body> = (0..2u8)
                    .filter_map(|dev| {
                        let d = node.devices[dev as usize].as_ref()?;
                        d.pending.map(|op| Body::Req {
                            edge: n,
                            inc: node.inc,
                            rid: d.rid,
                            dev,
                            op,
                        })
                    })
                    .collect();
                let snap = node.watcher.as_ref().is_some_and(|w| w.snap_pending);
                for req in reqs {
                    s.send(n, holder, req);
                }
                if snap {
                    s.send(n, holder, Body::SnapReq { edge: n });
                }
            }
        }
        if let Some(since) = s.alice.away_since {
            if s.alice.at.is_none() && t >= since + GRACE {
                s.alice.gone = true;
            }
        }
    }

    pub(super) fn deliver(&self, s: &mut ClusterState, m: Msg) {
        if !s.nodes[m.to as usize].up {
            return;
        }
        match m.body {
            Body::Req { .. } | Body::SnapReq { .. } | Body::Resynced { .. } => {
                self.owner_msg(s, m.to, m.body)
            }
            body => self.edge_msg(s, m.to, body),
        }
    }

    pub(super) fn crash(&self, s: &mut ClusterState, n: u8) {
        // What was on its way to the process is lost with it (replies go to
        // its connection's inboxes; a restarted process subscribes anew).
        s.net.retain(|m| m.to != n);
        s.local.retain(|m| m.to != n);
        let node = &mut s.nodes[n as usize];
        node.up = false;
        node.owner = None;
        if node.watcher.take().is_some() {
            s.bob.at = None;
        }
        if node.devices[MOBILE as usize].take().is_some() {
            s.alice.at = None;
            s.alice.away_since = Some(s.t);
            s.alice.gone |= s.alice.logout_asked;
        }
        node.devices[DESKTOP as usize] = None;
    }
}
