//! Session records (resume on any node): the KV copy of each local
//! session's subscriptions, and the reads of a resumed session's record.

use crate::cluster::edge::Edge;
use crate::cluster::wire::{decode_session_record, encode_session_record, SessionRecord};
use crate::cluster::{ClusterLink, ClusterOutput, Finished};
use bytes::Bytes;
use greendot_core::{SessionId, UserId};
use greendot_proto::{self as proto, Snapshot};
use std::collections::BTreeSet;
use std::time::Instant;

/// The KV copy of a local session's subscriptions ([`SessionRecord`]): one
/// put in flight at a time (so they land in order), subscribe answers held
/// until a put that covers them landed.
pub(in crate::cluster) struct SessionSync {
    pub(in crate::cluster) user: String,
    pub(in crate::cluster) device: String,
    pub(in crate::cluster) wire: u64,
    /// Changes made to the subscriptions, and how many the KV has.
    pub(in crate::cluster) changed: u64,
    pub(in crate::cluster) stored: u64,
    /// The put in flight: its id and the changes it covers.
    pub(in crate::cluster) putting: Option<(u64, u64)>,
    /// A failed put is tried again at the tick.
    pub(in crate::cluster) retry: bool,
    /// Answers waiting for change `n` to be stored, with their deadline.
    pub(in crate::cluster) waiting: Vec<(u64, u64, proto::Answer, Instant)>,
    /// The session's group subscriptions (the hub's core serves them).
    pub(in crate::cluster) groups: BTreeSet<u64>,
}

/// A hello naming a session this node does not hold: its device's record is
/// being read.
pub(in crate::cluster) struct PendingResume {
    pub(in crate::cluster) wait: u64,
    pub(in crate::cluster) session: SessionId,
    pub(in crate::cluster) wire: u64,
}

impl ClusterLink {
    /// The session's subscriptions changed: its record is written again.
    pub(in crate::cluster) fn record_changed(&mut self, session: SessionId) {
        if let Some(r) = self.edge.records.get_mut(&session) {
            r.changed += 1;
            self.store_record(session);
        }
    }

    /// A group subscription of `session` began (`subscribed`) or ended:
    /// `answer` goes once the record that has it landed, as a subscribe's.
    pub fn group_subscription_changed(
        &mut self,
        session: SessionId,
        group: u64,
        subscribed: bool,
        (wait, answer, deadline): (u64, proto::Answer, Instant),
    ) -> Option<proto::Answer> {
        let Some(r) = self.edge.records.get_mut(&session) else {
            return Some(answer);
        };
        match subscribed {
            true => r.groups.insert(group),
            false => r.groups.remove(&group),
        };
        self.when_recorded(session, wait, answer, deadline)
    }

    /// A resumed session holds these group subscriptions of its record (the
    /// others ended while it was away): its record says so.
    pub fn groups_carried(&mut self, session: SessionId, groups: &[u64]) {
        if let Some(r) = self.edge.records.get_mut(&session) {
            r.groups = groups.iter().copied().collect();
            self.record_changed(session);
        }
    }

    /// `answer` (to a subscribe of `session`) once the record that has it
    /// landed, so that a resume anywhere after the answer carries it over.
    pub(in crate::cluster) fn when_recorded(
        &mut self,
        session: SessionId,
        wait: u64,
        answer: proto::Answer,
        deadline: Instant,
    ) -> Option<proto::Answer> {
        let Some(r) = self.edge.records.get_mut(&session) else {
            return Some(answer);
        };
        r.changed += 1;
        r.waiting.push((r.changed, wait, answer, deadline));
        self.store_record(session);
        None
    }

    fn store_record(&mut self, session: SessionId) {
        let Some(r) = self.edge.records.get(&session) else {
            return;
        };
        if r.putting.is_some() || r.retry || r.changed == r.stored {
            return;
        }
        let subscriptions = self
            .edge
            .fanout
            .subscriptions(session)
            .into_iter()
            .filter_map(|(t, tier)| Some((self.edge.names.name(t.0)?.to_string(), tier.into())))
            .collect();
        let record = SessionRecord {
            wire: r.wire,
            subscriptions,
        };
        let groups: Vec<u64> = r.groups.iter().copied().collect();
        let value = encode_session_record(&record, &groups, self.shared.settings.protocol);
        let (user, device, changed) = (r.user.clone(), r.device.clone(), r.changed);
        let id = self.shared.id();
        if let Some(r) = self.edge.records.get_mut(&session) {
            r.putting = Some((id, changed));
        }
        self.edge.record_puts.insert(id, session);
        self.shared.outputs.push_back(ClusterOutput::PutSession {
            id,
            user,
            device,
            value,
        });
    }

    pub(in crate::cluster) fn session_stored(&mut self, now: Instant, id: u64, ok: bool) {
        let Some(session) = self.edge.record_puts.remove(&id) else {
            return;
        };
        let Some(r) = self.edge.records.get_mut(&session) else {
            return;
        };
        let Some((_, covers)) = r.putting.take() else {
            return;
        };
        if ok {
            r.stored = r.stored.max(covers);
        } else {
            self.shared.counters.session_writes_failed += 1;
            r.retry = true;
            self.edge.record_retries.insert(session);
        }
        self.release_answers(session, now);
        self.store_record(session);
    }

    pub(in crate::cluster) fn retry_records(&mut self, now: Instant) {
        let due: Vec<SessionId> = self.edge.record_retries.drain().collect();
        for session in due {
            if let Some(r) = self.edge.records.get_mut(&session) {
                r.retry = false;
                self.release_answers(session, now);
                self.store_record(session);
            }
        }
    }

    /// Subscribe answers go once their record is stored; past their
    /// deadline, anyway (the subscription holds here; a resume elsewhere
    /// would miss it).
    fn release_answers(&mut self, session: SessionId, now: Instant) {
        let Some(r) = self.edge.records.get_mut(&session) else {
            return;
        };
        let stored = r.stored;
        let (done, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut r.waiting)
            .into_iter()
            .partition(|&(n, _, _, deadline)| n <= stored || deadline <= now);
        r.waiting = kept;
        let viewer = r.user.clone();
        for (_, wait, answer, _) in done {
            let answer = self.edge.fresh_snapshots(&viewer, answer);
            self.finished.push_back((wait, Finished::Answer(answer)));
        }
    }

    /// A hello named `wire`, which is no session of this node (another
    /// node's, or a previous process's): the device's record is read, and
    /// if it names `wire` its subscriptions come back as
    /// [`Finished::Carry`] under `wait`; if not, [`Finished::Done`] (the
    /// session is fresh).
    pub fn resume_elsewhere(
        &mut self,
        wait: u64,
        session: SessionId,
        user: &str,
        device: &str,
        wire: u64,
    ) {
        let id = self.shared.id();
        self.edge.resumes.insert(
            id,
            PendingResume {
                wait,
                session,
                wire,
            },
        );
        self.shared.outputs.push_back(ClusterOutput::LoadSession {
            id,
            user: user.to_owned(),
            device: device.to_owned(),
        });
    }

    pub(in crate::cluster) fn session_loaded(&mut self, id: u64, record: Option<Bytes>) {
        let Some(p) = self.edge.resumes.remove(&id) else {
            return;
        };
        let max_groups = self.shared.owner_config.max_group_subscriptions_per_session;
        let record = record
            .as_deref()
            .and_then(decode_session_record)
            .filter(|(r, _)| r.wire == p.wire)
            .filter(|(r, _)| r.subscriptions.len() <= self.edge.max_subscriptions)
            .filter(|(_, groups)| groups.len() <= max_groups)
            .filter(|_| self.edge.open.contains_key(&p.session));
        let finished = match record {
            Some((r, groups)) => {
                self.shared.counters.resumed_elsewhere += 1;
                let subscriptions = r
                    .subscriptions
                    .into_iter()
                    .map(|(t, tier)| (t, tier.into()))
                    .collect();
                Finished::Carry {
                    session: p.session,
                    subscriptions,
                    groups,
                }
            }
            None => Finished::Done,
        };
        self.finished.push_back((p.wait, finished));
    }

    /// Brings a waited welcome's `snapshots` up to what this edge holds now.
    pub fn refresh_snapshots(&self, viewer: &str, snapshots: &mut [Snapshot]) {
        self.edge.refresh_snapshots(viewer, snapshots)
    }

    /// The session's subscriptions with what this edge knows of each (for a
    /// resumed session's welcome).
    pub fn snapshots(&self, session: SessionId, viewer: &str) -> Vec<Snapshot> {
        let viewer = self.edge.names.get(viewer).map(UserId);
        self.edge
            .fanout
            .subscriptions(session)
            .into_iter()
            .filter_map(|(t, tier)| {
                let presence = viewer
                    .and_then(|v| self.edge.fanout.known(v, t))
                    .cloned()
                    .unwrap_or_default();
                Some(Snapshot {
                    target: self.user_name(t)?.to_owned(),
                    tier: tier.into(),
                    presence: proto::Presence::from_core(&presence, 0),
                })
            })
            .collect()
    }
}

impl Edge {
    /// A held subscribe answer (or resume) with each snapshot brought up to
    /// the newest view the fanout has: views that came while the record was
    /// being stored are newer than the snapshots, and an invisibility among
    /// them would otherwise be shown as online in the answer.
    pub(in crate::cluster) fn fresh_snapshots(
        &self,
        viewer: &str,
        answer: proto::Answer,
    ) -> proto::Answer {
        let proto::Answer::Subscribed {
            mut snapshots,
            refused,
        } = answer
        else {
            return answer;
        };
        if let Some(viewer) = self.names.get(viewer) {
            for s in &mut snapshots {
                let Some(target) = self.names.get(&s.target) else {
                    continue;
                };
                if let Some(known) = self.fanout.known(UserId(viewer), UserId(target)) {
                    if known.version > s.presence.version {
                        s.presence = proto::Presence::from_core(known, 0);
                    }
                }
            }
        }
        proto::Answer::Subscribed { snapshots, refused }
    }

    /// Brings `snapshots` up to what this edge knows now: a welcome that
    /// waited (for owners' answers, or for the session's record) is not
    /// sent with views older than ones that came while it waited.
    pub(in crate::cluster) fn refresh_snapshots(&self, viewer: &str, snapshots: &mut [Snapshot]) {
        let Some(viewer) = self.names.get(viewer).map(UserId) else {
            return;
        };
        for s in snapshots {
            let known = self
                .names
                .get(&s.target)
                .and_then(|t| self.fanout.known(viewer, UserId(t)))
                .filter(|p| p.version > s.presence.version);
            if let Some(p) = known {
                s.presence = proto::Presence::from_core(p, 0);
            }
        }
    }
}
