//! The edge's subscribes (and a resume's carry-over): snapshots from the
//! targets' owners, then subscribed in the fanout. Queries and member
//! pages read the same snapshots and subscribe no session; a watched
//! page's members are then followed by the node's page watcher (the
//! `group_pages` module).

use crate::cluster::edge::devices::InFlight;
use crate::cluster::edge::Edge;
use crate::cluster::wire::ToOwner;
use crate::cluster::DetMap;
use crate::cluster::{ClusterLink, Finished, RequestKind, RETRY_AFTER};
use greendot_core::{Millis, Presence, SessionId, Tier, UserId};
use greendot_proto::{self as proto, ErrorCode, Refused, Snapshot, WireError};
use std::collections::BTreeMap;
use std::time::Instant;

/// What a subscribe (or a resume's carry-over) asks for.
struct Wanted {
    pub(in crate::cluster) targets: Vec<String>,
    refused: Vec<Refused>,
    tier: Tier,
    /// Targets with a tier of their own (carried over by a resume).
    tiers: DetMap<String, Tier>,
    pub(in crate::cluster) query: bool,
    /// A member page's read (a query of what others are shown).
    page: Option<PageRead>,
}

/// A member page whose keys came: its members' views are read, then it is
/// answered in the keys' order.
pub(in crate::cluster) struct PageRead {
    pub(in crate::cluster) group: u64,
    /// The cursor it was asked from.
    pub(in crate::cluster) after: Option<proto::GroupCursor>,
    /// To be watched: the members' shards are watched from the start, and
    /// the members followed once read.
    pub(in crate::cluster) watch: bool,
    /// When the page fails, from when it was asked.
    pub(in crate::cluster) deadline: Instant,
    pub(in crate::cluster) version: u64,
    pub(in crate::cluster) count: u32,
    pub(in crate::cluster) next: Option<proto::GroupCursor>,
}

pub(in crate::cluster) struct PendingSubscribe {
    pub(in crate::cluster) session: SessionId,
    pub(in crate::cluster) viewer: String,
    tier: Tier,
    /// Targets with a tier of their own (carried over by a resume).
    tiers: DetMap<String, Tier>,
    /// Targets in request order: their snapshot once known.
    pub(in crate::cluster) targets: Vec<(String, Option<Presence>)>,
    refused: Vec<Refused>,
    pub(in crate::cluster) deadline: Instant,
    /// Shards still to answer, and when to ask each again.
    pub(in crate::cluster) asking: BTreeMap<u32, Option<Instant>>,
    /// Views of the targets that arrived before their snapshot (the shard is
    /// watched first, and a view may overtake the owner's answer, a hole
    /// the model found): the newest is what the subscribe starts from.
    pub(in crate::cluster) early: DetMap<String, Presence>,
    /// A query: answered with the presences, no session subscribed (nor a
    /// shard watched, but for a watched page).
    pub(in crate::cluster) query: bool,
    /// A query for a member page: what others are shown of each target,
    /// answered as the page.
    page: Option<PageRead>,
}

impl ClusterLink {
    /// A subscribe of a session in the cluster: `targets` already checked
    /// against the session's credentials (refusals in `refused`). Answered
    /// now (`Some`) when every snapshot is at hand, else through
    /// [`ClusterLink::poll_finished`] under `wait`.
    #[allow(clippy::too_many_arguments)]
    pub fn subscribe(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        viewer: &str,
        targets: Vec<String>,
        refused: Vec<Refused>,
        tier: Tier,
        query: bool,
    ) -> Option<proto::Answer> {
        let wanted = Wanted {
            targets,
            refused,
            tier,
            tiers: DetMap::default(),
            query,
            page: None,
        };
        self.start_subscribe(now, at, wait, session, viewer, wanted)
    }

    /// Reads the views of a member page's members (`names`, in page order)
    /// from their owners; answered as the page, now (`Some`) or under
    /// `wait`.
    pub(in crate::cluster) fn read_page(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        names: Vec<String>,
        read: PageRead,
    ) -> Option<proto::Answer> {
        let wanted = Wanted {
            targets: names,
            refused: Vec::new(),
            tier: Tier::Batched,
            tiers: DetMap::default(),
            query: true,
            page: Some(read),
        };
        self.start_subscribe(now, at, wait, session, "", wanted)
    }

    /// What a resume carries over (checked against the new credentials),
    /// subscribed again here with snapshots from the targets' owners, each
    /// in its tier; answered like a subscribe under `wait`.
    pub fn carry_over(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        viewer: &str,
        subscriptions: Vec<(String, Tier)>,
    ) -> Option<proto::Answer> {
        let wanted = Wanted {
            targets: subscriptions.iter().map(|(t, _)| t.clone()).collect(),
            refused: Vec::new(),
            tier: Tier::Realtime,
            tiers: subscriptions.into_iter().collect(),
            query: false,
            page: None,
        };
        self.start_subscribe(now, at, wait, session, viewer, wanted)
    }

    fn start_subscribe(
        &mut self,
        now: Instant,
        at: Millis,
        wait: u64,
        session: SessionId,
        viewer: &str,
        wanted: Wanted,
    ) -> Option<proto::Answer> {
        let Wanted {
            targets,
            mut refused,
            tier,
            tiers,
            query,
            page,
        } = wanted;
        let held = self.edge.fanout.subscriptions(session);
        let mut room = self.edge.max_subscriptions.saturating_sub(held.len());
        let mut wanted = Vec::new();
        for target in targets {
            if query {
                wanted.push((target, None));
                continue;
            }
            let already = self
                .edge
                .names
                .get(&target)
                .is_some_and(|id| held.iter().any(|(t, _)| t.0 == id));
            if !already {
                if room == 0 {
                    refused.push(Refused {
                        target,
                        error: WireError::new(
                            ErrorCode::TooManySubscriptions,
                            "too many subscriptions",
                        ),
                    });
                    continue;
                }
                room -= 1;
            }
            wanted.push((target, None));
        }
        let mut p = PendingSubscribe {
            session,
            viewer: viewer.to_owned(),
            tier,
            targets: wanted,
            tiers,
            refused,
            deadline: page
                .as_ref()
                .map_or(now + self.shared.settings.request_timeout, |r| r.deadline),
            asking: BTreeMap::new(),
            early: DetMap::default(),
            query,
            page,
        };
        // What this edge knows already (another session watches the target)
        // is answered at once; not what it knows of a shard it may have
        // missed a view of (it would answer a view the owner has moved past,
        // as an invisible user shown online). The rest is asked of the
        // targets' owners, this node's own in process (answered before this
        // returns, unless a record must be read first).
        let viewer_id = self
            .edge
            .names
            .get(viewer)
            .map(UserId)
            .filter(|_| p.page.is_none());
        for (target, snap) in &mut p.targets {
            let shard = (self.shared.settings.shard_of)(target, self.shared.settings.shard_count);
            if let (Some(v), Some(t)) = (viewer_id, self.edge.names.get(target)) {
                if let Some(known) = self
                    .edge
                    .fanout
                    .known(v, UserId(t))
                    .filter(|_| !self.edge.behind_on(shard))
                {
                    *snap = Some(known.clone());
                    continue;
                }
            }
            p.asking.insert(shard, Some(now));
        }
        // Watch the shards before asking (so no view published after the
        // snapshot is missed).
        let watched = !query || p.page.as_ref().is_some_and(|r| r.watch);
        for (target, _) in p.targets.iter().filter(|_| watched) {
            let shard = self.shared.shard(target);
            self.watch_shard(shard);
        }
        self.edge.subscribes.insert(wait, p);
        let shards: Vec<u32> = self.edge.subscribes[&wait].asking.keys().copied().collect();
        for shard in shards {
            self.ask_snapshot(wait, shard, now, at);
        }
        self.try_finish_subscribe(wait, at)
    }

    fn ask_snapshot(&mut self, wait: u64, shard: u32, now: Instant, at: Millis) {
        let Some(p) = self.edge.subscribes.get_mut(&wait) else {
            return;
        };
        let targets: Vec<String> = p
            .targets
            .iter()
            .filter(|(t, snap)| {
                snap.is_none()
                    && (self.shared.settings.shard_of)(t, self.shared.settings.shard_count) == shard
            })
            .map(|(t, _)| t.clone())
            .collect();
        if targets.is_empty() {
            p.asking.remove(&shard);
            return;
        }
        p.asking.insert(shard, None);
        // A page's entries are what others are shown, the viewer's own too.
        let viewer = p.page.is_none().then(|| p.viewer.clone());
        let msg = match viewer {
            Some(viewer) => ToOwner::Snapshot { viewer, targets },
            None => ToOwner::Views {
                targets,
                own: false,
            },
        };
        let waiting = InFlight::Snapshot { wait, shard };
        self.ask_owner((now, at), waiting, shard, RequestKind::Snapshot, msg);
    }

    pub(in crate::cluster) fn retry_snapshot(&mut self, wait: u64, shard: u32, now: Instant) {
        self.shared.counters.retries += 1;
        if let Some(p) = self.edge.subscribes.get_mut(&wait) {
            p.asking.insert(shard, Some(now + RETRY_AFTER));
        }
    }

    /// This node's owner of `shard` read a user from its KV: the
    /// subscribes it answered `Loading` are asked again at once, so a
    /// node's own reads cost no retry delay. One still loading is answered
    /// `Loading` again and waits for the next read.
    pub(in crate::cluster) fn loaded_here(&mut self, shard: u32, now: Instant, at: Millis) {
        let Some(waits) = self.edge.awaiting_load.remove(&shard) else {
            return;
        };
        for wait in waits {
            let retrying = self
                .edge
                .subscribes
                .get(&wait)
                .is_some_and(|p| matches!(p.asking.get(&shard), Some(Some(_))));
            if retrying {
                self.ask_snapshot(wait, shard, now, at);
            }
        }
    }

    pub(in crate::cluster) fn snapshot_answer(
        &mut self,
        wait: u64,
        shard: u32,
        targets: &[String],
        presences: Vec<Presence>,
        at: Millis,
    ) {
        let Some(p) = self.edge.subscribes.get_mut(&wait) else {
            return;
        };
        if presences.len() != targets.len() {
            return;
        }
        for (name, presence) in targets.iter().zip(presences) {
            for (t, snap) in &mut p.targets {
                if t == name && snap.is_none() {
                    *snap = Some(presence.clone());
                }
            }
        }
        p.asking.remove(&shard);
        if let Some(answer) = self.try_finish_subscribe(wait, at) {
            self.finished.push_back((wait, Finished::Answer(answer)));
        }
    }

    /// Subscribes in the fanout once every snapshot is in.
    fn try_finish_subscribe(&mut self, wait: u64, at: Millis) -> Option<proto::Answer> {
        let p = self.edge.subscribes.get(&wait)?;
        if p.targets.iter().any(|(_, s)| s.is_none()) {
            return None;
        }
        let p = self.edge.subscribes.remove(&wait)?;
        if let Some(read) = p.page {
            let mut views: Vec<(String, Presence)> = p
                .targets
                .into_iter()
                .map(|(user, snap)| {
                    let presence = newest(snap, p.early.get(&user));
                    (user, presence)
                })
                .collect();
            let (followed, refused) = match read.watch {
                true => self.follow_page_members(at, &mut views),
                false => (Vec::new(), None),
            };
            let entries = views
                .into_iter()
                .map(|(user, presence)| proto::GroupEntry {
                    user,
                    presence: proto::Presence::from_core(&presence, 0),
                })
                .collect();
            let page = proto::GroupPage {
                group: read.group,
                version: read.version,
                count: read.count,
                entries,
                next: read.next,
            };
            if !read.watch {
                return Some(proto::Answer::GroupPage(page));
            }
            let watched = Finished::WatchedPage {
                session: p.session,
                after: read.after,
                page,
                followed,
                refused,
            };
            self.finished.push_back((wait, watched));
            return None;
        }
        if p.query {
            let mut results: Vec<proto::QueryResult> = p
                .targets
                .into_iter()
                .map(|(target, snap)| {
                    let presence = newest(snap, p.early.get(&target));
                    proto::QueryResult {
                        target,
                        result: Ok(proto::Presence::from_core(&presence, 0)),
                    }
                })
                .collect();
            results.extend(p.refused.into_iter().map(|r| proto::QueryResult {
                target: r.target,
                result: Err(r.error),
            }));
            return Some(proto::Answer::Presences(results));
        }
        let mut snapshots = Vec::new();
        let mut refused = p.refused;
        let held: Vec<UserId> = self
            .edge
            .fanout
            .subscriptions(p.session)
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        for (target, snap) in p.targets {
            let snap = newest(snap, p.early.get(&target));
            let tier = p.tiers.get(&target).copied().unwrap_or(p.tier);
            match self.fanout_subscribe(at, p.session, &target, (tier, snap), &held) {
                Ok(presence) => snapshots.push(Snapshot {
                    target,
                    tier: tier.into(),
                    presence: proto::Presence::from_core(&presence, 0),
                }),
                Err(error) => refused.push(Refused { target, error }),
            }
        }
        let answer = proto::Answer::Subscribed { snapshots, refused };
        self.when_recorded(p.session, wait, answer, p.deadline)
    }

    /// Subscribes `session` to `target` in the fanout in `tier` from
    /// `snap`, the target's shard watched already (one reference, which
    /// only a new subscription keeps; `held`: what the session held
    /// before), its name held here. Returns the snapshot to show.
    pub(in crate::cluster) fn fanout_subscribe(
        &mut self,
        at: Millis,
        session: SessionId,
        target: &str,
        (tier, snap): (Tier, Presence),
        held: &[UserId],
    ) -> Result<Presence, WireError> {
        let shard = self.shared.shard(target);
        let Some(id) = self.edge.names.intern(target) else {
            self.unwatch_shard(shard);
            return Err(WireError::new(
                ErrorCode::TooManyUsers,
                "too many user names",
            ));
        };
        match self
            .edge
            .fanout
            .subscribe(at, session, UserId(id), tier, snap)
        {
            Ok(presence) => {
                if held.contains(&UserId(id)) {
                    self.unwatch_shard(shard); // counted once per subscription
                } else {
                    self.edge.names.acquire(id);
                }
                Ok(presence)
            }
            Err(e) => {
                self.unwatch_shard(shard);
                if self.edge.names.refs(id) == 0 {
                    self.edge.names.remove(id);
                }
                Err(e.into())
            }
        }
    }

    fn fail_subscribe(&mut self, wait: u64, p: PendingSubscribe) {
        let watched = !p.query || p.page.as_ref().is_some_and(|r| r.watch);
        for (target, _) in p.targets.iter().filter(|_| watched) {
            let shard = self.shared.shard(target);
            self.unwatch_shard(shard);
        }
        self.finished.push_back((
            wait,
            Finished::Failed(WireError::new(
                ErrorCode::Internal,
                "the owner of a target did not answer in time",
            )),
        ));
    }

    /// Subscribes past their deadline fail; snapshots due are asked again.
    pub(in crate::cluster) fn tick_subscribes(&mut self, now: Instant, at: Millis) {
        // Those no longer waiting (answered, failed, or their shard's
        // owner gone from this node) are forgotten.
        let Edge {
            awaiting_load,
            subscribes,
            ..
        } = &mut self.edge;
        awaiting_load.retain(|_, waits| {
            waits.retain(|w| subscribes.contains_key(w));
            !waits.is_empty()
        });
        let waits: Vec<u64> = self.edge.subscribes.keys().copied().collect();
        for wait in waits {
            let Some(p) = self.edge.subscribes.get_mut(&wait) else {
                continue;
            };
            if p.deadline <= now {
                if let Some(p) = self.edge.subscribes.remove(&wait) {
                    self.fail_subscribe(wait, p);
                }
                continue;
            }
            let again: Vec<u32> = p
                .asking
                .iter()
                .filter(|(_, t)| t.is_some_and(|t| t <= now))
                .map(|(s, _)| *s)
                .collect();
            for shard in again {
                self.ask_snapshot(wait, shard, now, at);
            }
        }
    }

    /// Stops watching `target`. `false`: not subscribed.
    pub fn unsubscribe(&mut self, at: Millis, session: SessionId, target: &str) -> bool {
        let Some(id) = self.edge.names.get(target) else {
            return false;
        };
        if self
            .edge
            .fanout
            .unsubscribe(at, session, UserId(id))
            .is_err()
        {
            return false;
        }
        self.forget_target(UserId(id));
        // Behind: a record that still lists it carries one target too many,
        // never one too few.
        self.record_changed(session);
        true
    }
}

/// A query's answer for a target: its snapshot, or a view that came after
/// it with a higher version.
fn newest(snap: Option<Presence>, early: Option<&Presence>) -> Presence {
    match (snap, early) {
        (Some(s), Some(e)) if e.version > s.version => e.clone(),
        (snap, _) => snap.unwrap_or_default(),
    }
}
