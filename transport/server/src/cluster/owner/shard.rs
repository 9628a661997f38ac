//! A shard's owner: one `Core` per shard this node acts for, taken on and
//! dropped with the claims, restored from the KV, publishing each view once
//! on the shard's subject (and each truth to the edges holding the user's
//! devices), and announcing its view numbers in beacons.

use crate::cluster::owner::device_record::RecordRows;
use crate::cluster::owner::group_slices::{Partials, Slice};
use crate::cluster::owner::group_sums::Sums;
use crate::cluster::owner::OwnedShards;
use crate::cluster::shared::Shared;
use crate::cluster::to_edge::ToEdge;
use crate::cluster::wire::{
    decode, decode_shard_record, encode, Beacon, FromOwner, RecordedDevice, ResyncRequest,
    ShardRecord, ShardView, ToOwner, WirePrefs,
};
use crate::cluster::{
    ClusterLink, ClusterOutput, BEACON_EVERY, MAX_BEACON_SHARDS, MAX_BEACON_TRUTHS, MAX_EPOCH,
    MAX_IDLE_USERS, MAX_PENDING_PREFS, MAX_RECORDED_DEVICES, RELEASE_AFTER, RESYNC_EVERY,
    RETRY_AFTER, TRUTH_BEACON_FOR,
};
use crate::cluster::{DetMap, DetSet};
use crate::hub::Interner;
use bytes::Bytes;
use greendot_core::{
    Core, DeviceId, DeviceKind, EndReason, Epoch, Millis, Output, SessionId, UserId,
};
use greendot_proto as proto;
use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

/// Who holds a device's connection: the edge, its incarnation, its
/// connection.
pub(in crate::cluster) type Holder = (String, u64, u64);

/// A session the owner's core holds, as the edges know it.
#[derive(Debug)]
pub(in crate::cluster) struct HeldSession {
    pub(in crate::cluster) holder: Holder,
    /// The device's name id (the owner's `devices` hold one reference per
    /// session: a name no session uses is freed).
    pub(in crate::cluster) device: u64,
    /// The edge's wire id of it (0: restored, not connected again yet).
    pub(in crate::cluster) wire: u64,
    pub(in crate::cluster) user: UserId,
    pub(in crate::cluster) kind: DeviceKind,
    /// Its edge run's welcome order (0 when restored from the device record).
    pub(in crate::cluster) since: u64,
    /// When its edge welcomed it, in Unix milliseconds, if the connect said
    /// (protocol 3 and later).
    pub(in crate::cluster) welcomed: Option<u64>,
}

/// What this node holds of a shard it acts for: the core and the names
/// and holders of the devices in it.
pub(in crate::cluster) struct Owner {
    pub(in crate::cluster) epoch: u64,
    pub(in crate::cluster) core: Core,
    pub(in crate::cluster) users: Interner,
    pub(in crate::cluster) devices: Interner,
    pub(in crate::cluster) sessions: DetMap<SessionId, HeldSession>,
    pub(in crate::cluster) by_holder: DetMap<Holder, SessionId>,
    /// The last request id taken per connection: a request that arrives
    /// late (after the edge gave up on it and sent the next) is not applied
    /// over a newer one.
    pub(in crate::cluster) last_rid: DetMap<Holder, u64>,
    /// The newest connection of each device heard of here, by user and
    /// device: a connect of an older connection of the same edge run that
    /// lands after it (delayed on the bus, or resent from a client's
    /// buffer after a reconnect to NATS) is stale, and taken it would hold
    /// a device its edge already ended (a ghost). Kept past the session's
    /// end, until the user is released.
    pub(in crate::cluster) newest_conn: DetMap<String, Vec<(String, Holder)>>,
    /// Users whose KV record was read (or is being read): the first device
    /// input of any other waits for it, so a new owner keeps the user's
    /// preferences and last published view.
    pub(in crate::cluster) loaded: DetSet<String>,
    /// Inputs waiting for their user's KV record.
    pub(in crate::cluster) loading: DetMap<String, Vec<(ToOwner, ReplyTo)>>,
    /// Devices of the shard's record (the previous owner's), by user, to be
    /// restored as lingering with the user.
    pub(in crate::cluster) recorded: DetMap<String, Vec<RecordedDevice>>,
    /// Users the previous owner's record owes an offline, not read back yet.
    pub(in crate::cluster) owed: DetSet<String>,
    /// Devices whose session ended before their user's offline was
    /// published (held in a resync window, or in the debounce), by user and
    /// device. The device record keeps them until it is: a next owner, if
    /// the shard moves first, restores and ends them, where it would
    /// otherwise never hear of the user and leave her last view, online,
    /// standing (a ghost, C3).
    pub(in crate::cluster) ended: DetMap<(String, String), RecordedDevice>,
    /// Users released in this epoch: the last version of each published
    /// before the release, and the highest of those forgotten (bounded
    /// memory). A view in the KV below it is published again when the user
    /// is read back (its write was lost, or landed before an older one).
    released: DetMap<String, u64>,
    released_floor: u64,
    /// The device set changed since this instant and is not written yet.
    pub(in crate::cluster) dirty_since: Option<Millis>,
    /// The device record's rows, kept between writes.
    pub(in crate::cluster) record: RecordRows,
    /// The previous owner's device record is being read: this one's is not
    /// written until it is (written over, its devices would be lost).
    pub(in crate::cluster) reading_record: bool,
    /// Shard records written under this epoch: the low half of each
    /// write's fence, so that of two writes in flight the later wins.
    pub(in crate::cluster) records_written: u32,
    /// Users that got a session at another node's edge in this step: that
    /// edge is sent the user's truth even if it did not change (it may
    /// have changed while the connect was on its way).
    pub(in crate::cluster) greet: Vec<(UserId, String)>,
    /// Users that went offline (or were only looked at), by when to free
    /// them if they still hold nothing.
    pub(in crate::cluster) idle: VecDeque<(Millis, UserId)>,
    /// Views published on the shard's subject in this epoch: the last
    /// one's number.
    pub(in crate::cluster) seq: u64,
    /// Truths sent to each other edge in this epoch: the last one's number,
    /// and when it went (beacons name the recent ones).
    truth_seq: DetMap<String, (u64, Instant)>,
    /// The resync request is sent again until then (it may be lost), every
    /// `RESYNC_EVERY`.
    resync_until: Instant,
    next_resync: Instant,
    /// The slice of each group with members in the shard (`group_owner`).
    pub(in crate::cluster) slices: DetMap<u64, Slice>,
    /// The partials of those groups to send (`group_owner`).
    pub(in crate::cluster) partials: Partials,
    /// The sums of the groups whose home shard this is (`group_agg`).
    pub(in crate::cluster) sums: Sums,
    /// The last partial's sequence number in this epoch (`group_owner`).
    pub(in crate::cluster) partial_seq: u64,
}

/// Where an owner's answer goes.
#[derive(Debug, Clone, Copy)]
pub(in crate::cluster) enum ReplyTo {
    /// A request over NATS: its reply handle.
    Remote(u64),
    /// A request of this node's own edge, in process: its id, answered
    /// as a remote owner's answer is (see `to_edge.rs`).
    Loopback(u64),
}

/// The user's Online devices at this owner, with the edges' session ids.
pub(in crate::cluster) fn route_of(o: &Owner, user: &str) -> Vec<proto::RouteEntry> {
    let Some(uid) = o.users.get(user) else {
        return Vec::new();
    };
    o.core
        .route(UserId(uid))
        .into_iter()
        .filter_map(|s| {
            let info = o.core.session_info(s)?;
            let held = o.sessions.get(&s)?;
            Some(proto::RouteEntry {
                device: o.devices.name(held.device)?.to_string(),
                kind: info.kind.into(),
                session: held.wire,
            })
        })
        .collect()
}

pub(in crate::cluster) fn note_idle(o: &mut Owner, user: UserId, at: Millis) {
    if o.idle.len() < MAX_IDLE_USERS {
        o.idle.push_back((at.plus(RELEASE_AFTER), user));
    }
}

/// Frees the users whose wait is over and who still hold nothing but what
/// the KV keeps; how many.
pub(in crate::cluster) fn release_idle(o: &mut Owner, at: Millis) -> usize {
    let mut freed = 0;
    while let Some(&(due, user)) = o.idle.front() {
        if due > at {
            break;
        }
        o.idle.pop_front();
        let Some(name) = o.users.name(user.0).cloned() else {
            continue; // freed already (an id is never reused)
        };
        if o.loading.contains_key(&*name) || o.recorded.contains_key(&*name) {
            continue;
        }
        let shown = o.core.presence(user).version;
        if o.core.is_known(user) && !o.core.release_saved(user) {
            continue; // back online, or a publish pending
        }
        remember_released(o, &name, shown);
        o.loaded.remove(&*name);
        o.record.released(&name);
        o.newest_conn.remove(&*name);
        // A group's slice keeps the name (and her id) for when she is back.
        if o.users.refs(user.0) == 0 {
            o.users.remove(user.0);
        }
        freed += 1;
    }
    freed
}

/// Users released in this epoch remembered at most, per shard (past it,
/// the highest of their versions stands for them all).
const MAX_RELEASED_REMEMBERED: usize = 65_536;

/// Remembers the last version of `user` published before the release: the
/// KV's view, read when the user is needed again, may be older. The
/// highest stays: a user whose name a group's slice keeps may come up for
/// release again once freed (a later idle note), unknown to the core then.
fn remember_released(o: &mut Owner, user: &str, version: u64) {
    if o.released.len() >= MAX_RELEASED_REMEMBERED {
        let highest = o.released.values().copied().max().unwrap_or(0);
        o.released_floor = o.released_floor.max(highest);
        o.released.clear();
    }
    let held = o.released.entry(user.to_owned()).or_insert(version);
    *held = (*held).max(version);
}

/// A name interned for a user the core has no record of goes again, unless
/// a group's slice holds it.
pub(in crate::cluster) fn forget_user_if_unknown(o: &mut Owner, uid: u64) {
    if !o.core.is_known(UserId(uid)) && o.users.refs(uid) == 0 {
        o.users.remove(uid);
    }
}

/// A session of device name `did` is gone: the name goes with its last.
pub(in crate::cluster) fn forget_device(devices: &mut Interner, did: u64) {
    if devices.drop_ref(did) == 0 {
        devices.remove(did);
    }
}

impl ClusterLink {
    /// The shards this node may act for now, from its claims: the owners of
    /// shards lost go, owners of shards won start, and this node's edge
    /// resends its devices of those to them.
    pub fn set_status(&mut self, now: Instant, at: Millis, shards: BTreeMap<u32, (u64, Instant)>) {
        // Shards lost, or won under a new epoch: their old cores go.
        let gone: Vec<u32> = self
            .shards
            .owners
            .iter()
            .filter(|(s, o)| shards.get(s).is_none_or(|(e, _)| *e != o.epoch))
            .map(|(s, _)| *s)
            .collect();
        for shard in gone {
            self.shards.drop_owner(&mut self.shared, shard, now, at);
            self.deliver_local();
        }
        let taken = self.shards.take_claims(&mut self.shared, now, at, shards);
        for &shard in &taken {
            // This node's own edge resends its devices of the shard at once.
            let mine: Vec<SessionId> = self
                .edge
                .devices
                .iter()
                .filter(|(_, d)| !d.closed && self.shared.shard(&d.user) == shard)
                .map(|(s, _)| *s)
                .collect();
            for session in mine {
                self.resend(session, now, at, false);
            }
        }
        // Groups: the slices of the shards taken, the sums of the groups
        // homed there, and this node's partials for those (the new sums
        // hold none).
        self.shards.load_slices(&mut self.shared, &taken, now, at);
        self.shards.load_sums(&mut self.shared, &taken, now, at);
        self.deliver_local();
        for shard in taken {
            self.shards.home_changed(&mut self.shared, shard, now);
        }
    }
}

impl OwnedShards {
    /// Takes the claims `shards` as the shards acted for, and an owner for
    /// each won since (its previous owner's record read, the edges asked to
    /// resync): the shards taken.
    pub(in crate::cluster) fn take_claims(
        &mut self,
        sh: &mut Shared,
        now: Instant,
        at: Millis,
        shards: BTreeMap<u32, (u64, Instant)>,
    ) -> Vec<u32> {
        self.acting = shards;
        self.next_lapse = self.acting.values().map(|(_, until)| *until).min();
        let won: Vec<(u32, u64)> = self
            .acting
            .iter()
            .filter(|(s, (_, until))| now < *until && !self.owners.contains_key(s))
            .filter(|(s, (e, _))| {
                // An epoch past the last whose versions fit would wrap them:
                // not acted for (the claim side refuses it first).
                let fits = *e <= MAX_EPOCH;
                if !fits {
                    tracing::error!(
                        shard = s,
                        epoch = e,
                        "not acting for the shard: its epoch would wrap versions"
                    );
                }
                fits
            })
            .map(|(s, (e, _))| (*s, *e))
            .collect();
        let mut taken = Vec::new();
        for (shard, epoch) in won {
            let Ok(mut core) = Core::new(sh.owner_config.clone()) else {
                continue; // the same config the hub's core took
            };
            core.set_publish_views(true);
            core.set_track_group_changes(sh.serves_groups());
            core.enter_epoch(Epoch(u32::try_from(epoch).unwrap_or(u32::MAX)));
            // Until the edges resent their devices, nobody restored from the
            // KV goes offline (C2).
            let window = sh.settings.resync_window.as_millis();
            if window > 0 {
                core.hold_offline_until(at.plus(Millis(u64::try_from(window).unwrap_or(u64::MAX))));
            }
            let cap = sh.owner_config.max_users;
            self.owners.insert(
                shard,
                Owner {
                    epoch,
                    core,
                    users: Interner::new(cap),
                    devices: Interner::new(sh.owner_config.max_sessions),
                    sessions: DetMap::default(),
                    by_holder: DetMap::default(),
                    last_rid: DetMap::default(),
                    newest_conn: DetMap::default(),
                    loaded: Default::default(),
                    loading: DetMap::default(),
                    recorded: DetMap::default(),
                    owed: Default::default(),
                    ended: DetMap::default(),
                    released: DetMap::default(),
                    released_floor: 0,
                    dirty_since: None,
                    record: RecordRows::default(),
                    reading_record: true,
                    records_written: 0,
                    greet: Vec::new(),
                    idle: VecDeque::new(),
                    seq: 0,
                    truth_seq: DetMap::default(),
                    resync_until: now + sh.settings.request_timeout,
                    next_resync: now + RESYNC_EVERY,
                    slices: DetMap::default(),
                    partials: Partials::default(),
                    sums: Sums::default(),
                    partial_seq: 0,
                },
            );
            // The previous owner's devices: restored as lingering, so that
            // those nobody resends go offline (no ghost when the edge died
            // with the owner, C3).
            sh.next_id += 1;
            let id = sh.next_id;
            self.pending_shards.insert(id, (shard, epoch, now));
            sh.outputs.push_back(ClusterOutput::LoadShard { id, shard });
            self.ask_resync(sh, shard, epoch);
            taken.push(shard);
        }
        taken
    }

    /// This node's owner of `shard`: its epoch and last view's number.
    pub(in crate::cluster) fn published_up_to(&self, shard: u32) -> (u64, u64) {
        self.owners.get(&shard).map_or((0, 0), |o| (o.epoch, o.seq))
    }

    pub(in crate::cluster) fn ask_resync(&mut self, sh: &mut Shared, shard: u32, epoch: u64) {
        sh.outputs.push_back(ClusterOutput::Resync {
            payload: encode(&ResyncRequest {
                shard,
                epoch,
                owner: sh.settings.node.clone(),
            }),
        });
    }

    /// Owners' periodic messages: the resync request again while its window
    /// is open, and the beacon.
    pub(in crate::cluster) fn announce(&mut self, sh: &mut Shared, now: Instant) {
        let again: Vec<(u32, u64)> = self
            .owners
            .iter()
            .filter(|(_, o)| now < o.resync_until && now >= o.next_resync)
            .map(|(s, o)| (*s, o.epoch))
            .collect();
        for (shard, epoch) in again {
            if let Some(o) = self.owners.get_mut(&shard) {
                o.next_resync = now + RESYNC_EVERY;
            }
            self.ask_resync(sh, shard, epoch);
        }
        if self.next_beacon.is_some_and(|t| now < t) {
            return;
        }
        self.next_beacon = Some(now + BEACON_EVERY);
        let acting: Vec<(&u32, &Owner)> = self
            .owners
            .iter()
            .filter(|(s, o)| self.acting_epoch(sh, **s, now) == Some(o.epoch))
            .collect();
        // Shards with nothing published yet under this epoch too: an edge
        // that missed the last views of an earlier epoch (cut off while
        // they went out) learns from the new epoch alone that it is behind.
        let shards: Vec<(u32, u64, u64)> =
            acting.iter().map(|(s, o)| (**s, o.epoch, o.seq)).collect();
        let recent = |sent: Instant| now.saturating_duration_since(sent) <= TRUTH_BEACON_FOR;
        let truths: Vec<(String, u32, u64, u64)> = acting
            .iter()
            .flat_map(|(s, o)| {
                o.truth_seq
                    .iter()
                    .filter(move |(_, (_, sent))| recent(*sent))
                    .map(move |(edge, (seq, _))| (edge.clone(), **s, o.epoch, *seq))
            })
            .collect();
        let chunks = shards
            .len()
            .div_ceil(MAX_BEACON_SHARDS)
            .max(truths.len().div_ceil(MAX_BEACON_TRUTHS));
        for i in 0..chunks {
            let part = |len: usize, max: usize| (i * max).min(len)..((i + 1) * max).min(len);
            sh.outputs.push_back(ClusterOutput::Beacon {
                payload: encode(&Beacon {
                    owner: sh.settings.node.clone(),
                    shards: shards[part(shards.len(), MAX_BEACON_SHARDS)].to_vec(),
                    truths: truths[part(truths.len(), MAX_BEACON_TRUTHS)].to_vec(),
                }),
            });
        }
    }

    /// The node stops acting for `shard`: its core goes, and this node's
    /// own inputs that waited in it are refused (the edge looks again).
    pub(in crate::cluster) fn drop_owner(
        &mut self,
        sh: &mut Shared,
        shard: u32,
        now: Instant,
        at: Millis,
    ) {
        let Some(o) = self.owners.remove(&shard) else {
            return;
        };
        for (_, waiting) in o.loading {
            for (_, reply) in waiting {
                if let ReplyTo::Loopback(..) = reply {
                    self.reply(sh, reply, FromOwner::NotOwner, now, at);
                }
            }
        }
    }

    /// Whether the owner of `shard` has the KV records of all `users`;
    /// if not, reads those not asked for yet (a snapshot taken before
    /// would miss a freed user's last seen, or a new owner's predecessor's
    /// view).
    pub(in crate::cluster) fn load_users<'a>(
        &mut self,
        sh: &mut Shared,
        shard: u32,
        users: impl Iterator<Item = &'a str>,
        now: Instant,
    ) -> bool {
        let Some(o) = self.owners.get_mut(&shard) else {
            return false;
        };
        let epoch = o.epoch;
        let mut all = true;
        for user in users {
            if o.loaded.contains(user) {
                continue;
            }
            all = false;
            if o.loading.contains_key(user) || self.pending_loads.len() >= MAX_PENDING_PREFS {
                continue;
            }
            o.loading.insert(user.to_owned(), Vec::new());
            sh.next_id += 1;
            let id = sh.next_id;
            self.pending_loads
                .insert(id, (shard, epoch, user.to_owned(), now));
            sh.outputs.push_back(ClusterOutput::LoadUser {
                id,
                user: user.to_owned(),
            });
        }
        all
    }

    /// A user's KV record arrived: restore it, then take the inputs that
    /// waited for it.
    /// A user's KV read failed: asked again after [`RETRY_AFTER`] (by
    /// `expire_pending`, which asks again what waited its timeout).
    pub(in crate::cluster) fn user_load_failed(&mut self, sh: &mut Shared, now: Instant, id: u64) {
        let timeout = sh.settings.request_timeout;
        if let Some((_, _, _, since)) = self.pending_loads.get_mut(&id) {
            sh.counters.retries += 1;
            *since = (now + RETRY_AFTER).checked_sub(timeout).unwrap_or(*since);
        }
    }

    pub(in crate::cluster) fn shard_load_failed(&mut self, sh: &mut Shared, now: Instant, id: u64) {
        let timeout = sh.settings.request_timeout;
        if let Some((_, _, since)) = self.pending_shards.get_mut(&id) {
            sh.counters.retries += 1;
            *since = (now + RETRY_AFTER).checked_sub(timeout).unwrap_or(*since);
        }
    }

    pub(in crate::cluster) fn user_loaded(
        &mut self,
        sh: &mut Shared,
        now: Instant,
        at: Millis,
        id: u64,
        prefs: Option<Bytes>,
        view: Option<Bytes>,
    ) {
        let Some((shard, epoch, user, asked)) = self.pending_loads.remove(&id) else {
            return;
        };
        let max_message = sh.owner_config.max_message_len;
        let prefs = prefs
            .and_then(|b| decode::<WirePrefs>(&b))
            .filter(|p| p.message.as_ref().is_none_or(|m| m.len() <= max_message));
        let view = view
            .and_then(|b| decode::<proto::Presence>(&b))
            .filter(|p| p.message.as_ref().is_none_or(|m| m.len() <= max_message));
        let Some(o) = self.owners.get_mut(&shard).filter(|o| o.epoch == epoch) else {
            return; // the owner is gone; its waiting inputs were refused then
        };
        o.loaded.insert(user.clone());
        let recorded = o.recorded.remove(&user).unwrap_or_default();
        // Owed an offline: watchers were shown her online, whatever the KV
        // kept (its view may be lost): published again, above any view.
        let owed = o.owed.remove(&user);
        let released = o.released.remove(&user).unwrap_or(o.released_floor);
        let shown_before = released.max(u64::from(owed));
        // Read in the resync window for a device's input, a user the KV
        // holds nothing of may be one whose last view the previous owner
        // published as it lost the shard, its write behind not landed yet:
        // restored from nothing (a view of no epoch), her first view under
        // this epoch is published whatever it is, or watchers keep the old
        // owner's (an invisible user shown online). A user only looked up
        // (a snapshot) stays fresh: nothing of hers is written for it.
        let unsettled = asked < o.resync_until
            && o.loading.get(&user).is_some_and(|waiting| {
                waiting
                    .iter()
                    .any(|(msg, _)| matches!(msg, ToOwner::Device { .. }))
            });
        if prefs.is_some() || view.is_some() || !recorded.is_empty() || owed || unsettled {
            // Recorded devices linger at least to the end of the resync
            // window, heard from at the record's time.
            let window = u64::try_from(sh.settings.request_timeout.as_millis()).unwrap_or(0);
            let mut devices = Vec::new();
            let mut holders = Vec::new();
            for d in &recorded {
                let Some(did) = o.devices.intern(&d.device) else {
                    continue;
                };
                devices.push(greendot_core::cluster::DeviceRecord {
                    device: DeviceId(did),
                    kind: d.kind.into(),
                    edge: greendot_core::NodeId(0),
                    last_heard: Millis(d.heard).min(at),
                    foreground: d.foreground,
                });
                holders.push(((d.edge.clone(), d.incarnation, d.conn), did, d.kind));
            }
            if let Some(uid) = o.users.intern(&user) {
                let record = greendot_core::cluster::OwnedRecord {
                    status: prefs
                        .as_ref()
                        .map_or(Default::default(), |p| p.status.into()),
                    message: prefs.as_ref().and_then(|p| p.message.clone()),
                    invisible: prefs.as_ref().is_some_and(|p| p.invisible),
                    // The preferences carry last seen as of their last write,
                    // the view as of the last publish (later, when the user
                    // went offline since).
                    last_seen: prefs
                        .as_ref()
                        .and_then(|p| p.last_seen)
                        .max(view.as_ref().and_then(|v| v.last_seen))
                        .map(Millis),
                    published: view.map(|v| v.to_core()).unwrap_or_default(),
                    devices,
                    shown_before,
                };
                // Refused only for a user already online here (cannot be:
                // their inputs waited for this), or past a limit.
                if let Ok(sessions) =
                    o.core
                        .restore_owned(at, UserId(uid), &record, at.plus(Millis(window)))
                {
                    let user_id = UserId(uid);
                    o.record.changed(user_id);
                    if o.core.presence(user_id).online && sessions.is_empty() {
                        // Shown online with no device: the record owes her
                        // offline to a next owner.
                        o.dirty_since.get_or_insert(at);
                    }
                    for (session, (holder, did, kind)) in sessions.into_iter().zip(holders) {
                        o.by_holder.insert(holder.clone(), session);
                        o.devices.acquire(did);
                        let held = HeldSession {
                            holder,
                            device: did,
                            wire: 0,
                            user: UserId(uid),
                            kind: kind.into(),
                            since: 0,
                            welcomed: None,
                        };
                        o.sessions.insert(session, held);
                    }
                }
            }
        }
        let waiting = o.loading.remove(&user).unwrap_or_default();
        for (msg, reply) in waiting {
            self.owner_input(sh, shard, msg, reply, now, at);
        }
        self.drain_owner(sh, shard, now, at);
        sh.to_edge.push_back(ToEdge::Loaded { shard, now, at });
    }

    /// The previous owner's device record of a shard arrived: each user in
    /// it is restored (preferences, view, devices as lingering) at once.
    pub(in crate::cluster) fn shard_loaded(
        &mut self,
        sh: &mut Shared,
        now: Instant,
        id: u64,
        record: Option<Bytes>,
    ) {
        let Some((shard, epoch, _)) = self.pending_shards.remove(&id) else {
            return;
        };
        let max_name = sh.max_name_len;
        let ShardRecord { devices, owed } = record
            .and_then(|b| decode_shard_record(&b))
            .unwrap_or_default();
        let devices: Vec<RecordedDevice> = devices
            .into_iter()
            .filter(|d| {
                [&d.user, &d.device, &d.edge]
                    .iter()
                    .all(|n| !n.is_empty() && n.len() <= max_name)
            })
            .take(MAX_RECORDED_DEVICES)
            .collect();
        let shard_of = sh.settings.shard_of;
        let count = sh.settings.shard_count;
        let Some(o) = self.owners.get_mut(&shard).filter(|o| o.epoch == epoch) else {
            return;
        };
        o.reading_record = false;
        // Its partials, held while the record was read, may go now.
        self.partial_due_by(now);
        let Some(o) = self.owners.get_mut(&shard) else {
            return;
        };
        let mut users = Vec::new();
        for d in devices {
            if shard_of(&d.user, count) != shard || o.loaded.contains(&d.user) {
                continue;
            }
            let list = o.recorded.entry(d.user.clone()).or_default();
            if list.is_empty() {
                users.push(d.user.clone());
            }
            list.push(d);
        }
        let owed = owed
            .into_iter()
            .filter(|u| !u.is_empty() && u.len() <= max_name)
            .take(MAX_RECORDED_DEVICES);
        for user in owed {
            let known = o.loaded.contains(&user) || o.recorded.contains_key(&user);
            if shard_of(&user, count) != shard || known || !o.owed.insert(user.clone()) {
                continue;
            }
            // Read back with no device: shown offline once the resync
            // window closes, unless an edge resends one.
            users.push(user);
        }
        for user in users {
            let Some(o) = self.owners.get_mut(&shard) else {
                return;
            };
            if o.loading.contains_key(&user) {
                continue; // its read is on the way; the devices go with it
            }
            o.loading.insert(user.clone(), Vec::new());
            sh.next_id += 1;
            let id = sh.next_id;
            self.pending_loads
                .insert(id, (shard, epoch, user.clone(), now));
            sh.outputs.push_back(ClusterOutput::LoadUser { id, user });
        }
    }

    /// An edge's lease is gone: the devices it held, at every shard this
    /// node owns, are lost as by a disconnect at its last renewal, so a
    /// device that reconnects to another edge within grace resumes unseen,
    /// and one that does not is shown offline after grace and debounce (C3).
    /// With `older_than`, only the devices of the edge's incarnations below
    /// it are lost (the edge restarted under that incarnation).
    pub(in crate::cluster) fn edge_lost(
        &mut self,
        sh: &mut Shared,
        now: Instant,
        at: Millis,
        node: &str,
        older_than: Option<u64>,
        last_heard: u64,
    ) {
        if node == sh.settings.node {
            return; // its own lease: the node is being cut off, not lost
        }
        // Unix ms (from the lease) on the core's clock.
        let last_heard = Millis(last_heard.saturating_sub(sh.unix_base_ms)).min(at);
        let shards: Vec<u32> = self.owners.keys().copied().collect();
        for shard in shards {
            let Some(o) = self.owners.get_mut(&shard) else {
                continue;
            };
            let lost: Vec<SessionId> = o
                .sessions
                .iter()
                .filter(|(_, held)| {
                    let holder = &held.holder;
                    holder.0 == node && older_than.is_none_or(|i| holder.1 < i)
                })
                .map(|(s, _)| *s)
                .collect();
            if lost.is_empty() {
                continue;
            }
            let n = o.core.handle_edge_lost(at, &lost, last_heard);
            sh.counters.edge_lost_devices += n as u64;
            self.drain_owner(sh, shard, now, at);
        }
    }

    /// Publishes what the owner's core published, and forgets ended sessions.
    pub(in crate::cluster) fn drain_owner(
        &mut self,
        sh: &mut Shared,
        shard: u32,
        now: Instant,
        at: Millis,
    ) {
        let base = sh.unix_base_ms;
        let Some(o) = self.owners.get_mut(&shard) else {
            return;
        };
        let mut ended = Vec::new();
        while let Some(out) = o.core.poll_output() {
            if let Output::SessionEnded { session, reason } = out {
                ended.push((session, reason));
            }
        }
        if !ended.is_empty() {
            o.dirty_since.get_or_insert(at);
        }
        for (session, reason) in ended {
            let Some(held) = o.sessions.remove(&session) else {
                continue;
            };
            o.record.changed(held.user);
            let names = (o.users.name(held.user.0), o.devices.name(held.device));
            if let (false, (Some(user), Some(device))) = (reason == EndReason::Superseded, names) {
                // The device is gone (not connected again): a resume naming
                // its session anywhere starts fresh.
                sh.outputs.push_back(ClusterOutput::DeleteSession {
                    user: user.to_string(),
                    device: device.to_string(),
                });
                let shown_online = o.core.presence(held.user).online;
                if shown_online && o.ended.len() < MAX_RECORDED_DEVICES {
                    let (edge, incarnation, conn) = held.holder.clone();
                    let kept = RecordedDevice {
                        user: user.to_string(),
                        device: device.to_string(),
                        kind: held.kind.into(),
                        edge,
                        incarnation,
                        conn,
                        // Ended: a next owner keeps it only to the end of
                        // its resync window, with no grace of its own.
                        heard: 0,
                        foreground: true,
                    };
                    o.ended
                        .insert((kept.user.clone(), kept.device.clone()), kept);
                }
            }
            o.by_holder.remove(&held.holder);
            forget_device(&mut o.devices, held.device);
        }
        // (user, own, presence, only to the greeted edges)
        let mut views = Vec::new();
        while let Some(p) = o.core.poll_published() {
            if p.own && !p.presence.online {
                note_idle(o, p.user, at);
            }
            if !p.own {
                // Shown online or offline: owed an offline or not.
                o.record.changed(p.user);
            }
            if !p.own && !p.presence.online {
                // The record no longer owes it (an ended device, or the
                // user in `owed`).
                o.dirty_since.get_or_insert(at);
                if let Some(name) = o.users.name(p.user.0).filter(|_| !o.ended.is_empty()) {
                    o.ended.retain(|(user, _), _| user.as_str() != &**name);
                }
            }
            views.push((p.user, p.own, p.presence, false));
        }
        // A greeted edge not sent a truth below gets the current one.
        let mut greet = std::mem::take(&mut o.greet);
        for &(user, _) in &greet {
            let already = views.iter().any(|(u, own, ..)| *u == user && *own);
            if !already {
                views.push((user, true, o.core.truth(user), true));
            }
        }
        let me = sh.settings.node.as_str();
        let mut out = Vec::new();
        let mut local = Vec::new();
        for (user, own, presence, greet_only) in views {
            let Some(name) = o.users.name(user.0) else {
                continue;
            };
            if !own {
                o.seq += 1;
            }
            let v = ShardView {
                epoch: o.epoch,
                seq: if own { 0 } else { o.seq },
                published_ms: base.saturating_add(at.0),
                user: name.to_string(),
                own,
                presence: proto::Presence::from_core(&presence, base),
            };
            let payload = encode(&v);
            if own {
                // Only the user's own sessions see the truth: it goes to
                // the edges holding the user's devices, not to every
                // watcher of the shard, numbered per edge so that an edge
                // notices one it missed.
                let holding = if greet_only {
                    Vec::new()
                } else {
                    o.core.sessions_of(user)
                };
                let mut edges: Vec<&str> = holding
                    .iter()
                    .filter_map(|s| o.sessions.get(s))
                    .map(|held| held.holder.0.as_str())
                    .chain(greet.iter().filter(|g| g.0 == user).map(|g| g.1.as_str()))
                    .filter(|e| *e != me)
                    .collect();
                edges.sort_unstable();
                edges.dedup();
                for node in edges {
                    let n = o.truth_seq.entry(node.to_owned()).or_insert((0, now));
                    *n = (n.0 + 1, now);
                    let numbered = ShardView {
                        seq: n.0,
                        ..v.clone()
                    };
                    out.push(ClusterOutput::PublishToEdge {
                        node: node.to_owned(),
                        payload: encode(&numbered),
                    });
                }
            } else {
                // Written behind, for the next owner to restore.
                out.push(ClusterOutput::PutView {
                    user: v.user.clone(),
                    value: encode(&v.presence),
                });
                out.push(ClusterOutput::Publish { shard, payload });
            }
            local.push(v);
        }
        greet.clear();
        o.greet = greet;
        for output in out {
            match output {
                ClusterOutput::Publish { .. } => sh.counters.published += 1,
                ClusterOutput::PublishToEdge { .. } => sh.counters.truths_sent += 1,
                _ => {}
            }
            sh.outputs.push_back(output);
        }
        // This node's own sessions, in process (the copy NATS brings back
        // on the shard's subject is dropped by version).
        for view in local {
            sh.to_edge.push_back(ToEdge::View { at, view });
        }
        self.note_changed_groups(shard, now);
    }
}
