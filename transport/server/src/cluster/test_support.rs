//! What the cluster tests share: links on a small cluster, and the exchanges
//! that carry their outputs to each other as NATS and the KV would.

use super::wire::{decode, SessionRecord, ShardView, WireOp, RECORD_FOREGROUND_SINCE};
use super::{ClusterInput, ClusterLink, ClusterOutput, ClusterSettings};
use bytes::Bytes;
use greendot_core::{Config, Epoch, Millis, Output, Presence, SessionId, Tier, UserId};
use greendot_proto as proto;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

pub(super) const SHARDS: u32 = 4;

/// Shard by name length: "alice" is shard 1, "bob" shard 3.
pub(super) fn by_len(user: &str, shards: u32) -> u32 {
    user.len() as u32 % shards
}

pub(super) fn link(node: &str) -> ClusterLink {
    link_as(node, 7)
}

pub(super) fn link_as(node: &str, incarnation: u64) -> ClusterLink {
    let settings = ClusterSettings {
        node: node.into(),
        incarnation,
        shard_count: SHARDS,
        shard_of: by_len,
        request_timeout: Duration::from_secs(5),
        resync_window: Duration::from_secs(5),
        protocol: RECORD_FOREGROUND_SINCE,
        mutant: None,
    };
    ClusterLink::new(settings, &Config::default(), 0, 128)
}

pub(super) fn all_shards(epoch: u64, until: Instant) -> BTreeMap<u32, (u64, Instant)> {
    (0..SHARDS).map(|s| (s, (epoch, until))).collect()
}

/// Carries every output of the edge `a` to the owner `b` and back, as
/// NATS would, until both are quiet. Returns the views published.
pub(super) fn exchange(
    a: &mut ClusterLink,
    b: &mut ClusterLink,
    now: Instant,
    at: Millis,
) -> usize {
    exchange_seen(a, b, now, at)
        .iter()
        .filter(|o| matches!(o, ClusterOutput::Publish { .. }))
        .count()
}

/// [`exchange`], returning what `b` published and sent to edges.
pub(super) fn exchange_seen(
    a: &mut ClusterLink,
    b: &mut ClusterLink,
    now: Instant,
    at: Millis,
) -> Vec<ClusterOutput> {
    exchange_kv(a, b, now, at, None)
}

/// [`exchange_seen`], with `views` as the KV's views bucket (without,
/// every user reads as never seen).
pub(super) fn exchange_kv(
    a: &mut ClusterLink,
    b: &mut ClusterLink,
    now: Instant,
    at: Millis,
    views: Option<&mut HashMap<String, Bytes>>,
) -> Vec<ClusterOutput> {
    exchange_lossy(a, b, now, at, views, |_| false)
}

/// [`exchange_kv`], losing what `b` sends that `lose` picks.
pub(super) fn exchange_lossy(
    a: &mut ClusterLink,
    b: &mut ClusterLink,
    now: Instant,
    at: Millis,
    mut views: Option<&mut HashMap<String, Bytes>>,
    lose: fn(&ClusterOutput) -> bool,
) -> Vec<ClusterOutput> {
    let mut published = Vec::new();
    loop {
        let mut moved = false;
        while let Some(out) = a.poll_output() {
            moved = true;
            match out {
                ClusterOutput::Request {
                    id,
                    shard,
                    kind,
                    payload,
                } => {
                    let request = ClusterInput::Request {
                        shard,
                        kind,
                        payload,
                        reply: id,
                    };
                    b.handle_input(now, at, request);
                }
                ClusterOutput::PutSession { id, value, .. } if holding() => {
                    let record = decode(&value).unwrap();
                    HELD.with(|h| h.borrow_mut().as_mut().map(|h| h.push((id, record))));
                }
                ClusterOutput::PutSession {
                    id,
                    user,
                    device,
                    value,
                } => {
                    LANDED.with(|l| l.borrow_mut().insert((user, device), value));
                    let stored = ClusterInput::SessionStored { id, ok: true };
                    a.handle_input(now, at, stored);
                }
                _ => {}
            }
        }
        while let Some(out) = b.poll_output() {
            moved = true;
            if lose(&out) {
                continue;
            }
            match out {
                ClusterOutput::Beacon { payload } => {
                    a.handle_input(now, at, ClusterInput::Beacon { payload })
                }
                ClusterOutput::Reply { reply, payload } => a.handle_input(
                    now,
                    at,
                    ClusterInput::Answered {
                        id: reply,
                        payload: Some(payload),
                    },
                ),
                ClusterOutput::PutPrefs { id, .. } => {
                    b.handle_input(now, at, ClusterInput::PrefsStored { id, ok: true })
                }
                ClusterOutput::LoadUser { id, user } => {
                    let view = views.as_deref().and_then(|v| v.get(&user).cloned());
                    let loaded = ClusterInput::UserLoaded {
                        id,
                        prefs: None,
                        view,
                    };
                    b.handle_input(now, at, loaded)
                }
                ClusterOutput::LoadShard { id, .. } => {
                    // The KV holds no previous owner's record.
                    let loaded = ClusterInput::ShardLoaded { id, record: None };
                    b.handle_input(now, at, loaded)
                }
                ClusterOutput::PutView { user, value } => {
                    if let Some(v) = views.as_deref_mut() {
                        v.insert(user, value);
                    }
                }
                ClusterOutput::DeleteSession { user, device } => {
                    LANDED.with(|l| l.borrow_mut().remove(&(user, device)));
                }
                ClusterOutput::Publish { shard, ref payload } => {
                    let payload = payload.clone();
                    published.push(out);
                    a.handle_input(now, at, ClusterInput::ShardMessage { shard, payload });
                }
                ClusterOutput::PublishToEdge {
                    ref node,
                    ref payload,
                } => {
                    let to_a = *node == a.shared.settings.node;
                    let payload = payload.clone();
                    published.push(out);
                    if to_a {
                        a.handle_input(now, at, ClusterInput::EdgeMessage { payload });
                    }
                }
                _ => {}
            }
        }
        if !moved {
            return published;
        }
    }
}

thread_local! {
    /// The session records the exchanges landed, by (user, device).
    pub(super) static LANDED: std::cell::RefCell<HashMap<(String, String), Bytes>> =
        std::cell::RefCell::default();
}

thread_local! {
    /// While set, the exchanges hold `a`'s record puts here unanswered.
    pub(super) static HELD: std::cell::RefCell<Option<Vec<(u64, SessionRecord)>>> =
        const { std::cell::RefCell::new(None) };
}

pub(super) fn holding() -> bool {
    HELD.with(|h| h.borrow().is_some())
}

pub(super) fn landed(user: &str, device: &str) -> Option<Bytes> {
    LANDED.with(|l| l.borrow().get(&(user.into(), device.into())).cloned())
}

/// Lands every session record `l` puts (as the KV would); returns them
/// by (user, device), and the other outputs.
pub(super) fn store_records(
    l: &mut ClusterLink,
    now: Instant,
    at: Millis,
) -> (Vec<(String, String, SessionRecord)>, Vec<ClusterOutput>) {
    let (mut records, mut others) = (Vec::new(), Vec::new());
    while let Some(out) = l.poll_output() {
        match out {
            ClusterOutput::PutSession {
                id,
                user,
                device,
                value,
            } => {
                records.push((user, device, decode(&value).unwrap()));
                let stored = ClusterInput::SessionStored { id, ok: true };
                l.handle_input(now, at, stored);
            }
            out => others.push(out),
        }
    }
    (records, others)
}

pub(super) fn pushes(a: &mut ClusterLink) -> Vec<(SessionId, Presence)> {
    let mut out = Vec::new();
    while let Some(o) = a.poll_fanout() {
        if let Output::Push { to, presence, .. } = o {
            out.push((to, presence));
        }
    }
    out
}

/// Edge `a` and `b`, the owner of every shard, with no devices yet.
pub(super) fn edge_and_owner() -> (ClusterLink, ClusterLink, Instant) {
    let now = Instant::now();
    let (a, mut b) = (link("a"), link("b"));
    b.set_status(
        now,
        Millis(0),
        all_shards(1, now + Duration::from_secs(3600)),
    );
    (a, b, now)
}

/// The requests the edge `a` sends, as the owner takes them.
pub(super) fn requests_of(a: &mut ClusterLink) -> Vec<ClusterInput> {
    std::iter::from_fn(|| a.poll_output())
        .filter_map(|out| match out {
            ClusterOutput::Request {
                id,
                shard,
                kind,
                payload,
            } => Some(ClusterInput::Request {
                shard,
                kind,
                payload,
                reply: id,
            }),
            _ => None,
        })
        .collect()
}

/// Edge `a` holds alice's phone and bob's session; `b` owns every shard.
pub(super) fn two_nodes() -> (ClusterLink, ClusterLink, Instant) {
    let (mut a, mut b, now) = edge_and_owner();
    let (alice, bob) = (SessionId(1), SessionId(2));
    a.connected(
        now,
        Millis(0),
        alice,
        1001,
        "alice",
        "phone",
        proto::Kind::Mobile,
        None,
    );
    a.connected(
        now,
        Millis(0),
        bob,
        1002,
        "bob",
        "laptop",
        proto::Kind::Desktop,
        None,
    );
    exchange(&mut a, &mut b, now, Millis(0));
    (a, b, now)
}

/// What `outs` carry: (on a shard subject?, to which edge, own, user).
pub(super) fn carried(outs: &[ClusterOutput]) -> Vec<(Option<u32>, Option<String>, bool, String)> {
    outs.iter()
        .map(|o| match o {
            ClusterOutput::Publish { shard, payload } => {
                let v: ShardView = decode(payload).unwrap();
                (Some(*shard), None, v.own, v.user)
            }
            ClusterOutput::PublishToEdge { node, payload } => {
                let v: ShardView = decode(payload).unwrap();
                (None, Some(node.clone()), v.own, v.user)
            }
            other => panic!("not a view: {other:?}"),
        })
        .collect()
}

/// bob's laptop (session 2, on `a`) subscribes to alice in realtime.
pub(super) fn bob_subscribes_to_alice(
    a: &mut ClusterLink,
    now: Instant,
    at: Millis,
    wait: u64,
) -> Option<proto::Answer> {
    let targets = vec!["alice".into()];
    a.subscribe(
        now,
        at,
        wait,
        SessionId(2),
        "bob",
        targets,
        vec![],
        Tier::Realtime,
        false,
    )
}

pub(super) fn epoch_base_of(epoch: u32) -> u64 {
    greendot_core::cluster::epoch_base(Epoch(epoch))
}

/// The session's device sets `status` at `at` ms; the owner publishes
/// what others see after its debounce (`lose` applies to all of it).
pub(super) fn set_status(
    a: &mut ClusterLink,
    b: &mut ClusterLink,
    session: SessionId,
    status: proto::Status,
    now: Instant,
    at: u64,
    lose: fn(&ClusterOutput) -> bool,
) {
    let op = WireOp::SetStatus {
        status,
        message: None,
    };
    assert!(a.input(now, Millis(at), session, op, None));
    exchange_lossy(a, b, now, Millis(at), None, lose);
    b.handle_timeout(now, Millis(at + 300));
    exchange_lossy(a, b, now, Millis(at + 300), None, lose);
}

/// Whether `b`, the owner of alice's shard (1), holds a connected session
/// of hers.
pub(super) fn alice_connected_at(b: &ClusterLink) -> bool {
    let o = &b.shards.owners[&1];
    o.users.get("alice").is_some_and(|uid| {
        o.core
            .sessions_of(UserId(uid))
            .into_iter()
            .any(|s| o.core.session_info(s).is_some_and(|i| i.online))
    })
}

/// alice's phone (session 1, wire id 1001) connects at edge `a`.
pub(super) fn alice_phone_connects(a: &mut ClusterLink, now: Instant, at: Millis) {
    let kind = proto::Kind::Mobile;
    a.connected(now, at, SessionId(1), 1001, "alice", "phone", kind, None);
}

/// The views of `user` published on shard subjects among `outs`.
pub(super) fn published_views(outs: &[ClusterOutput], user: &str) -> Vec<proto::Presence> {
    outs.iter()
        .filter_map(|o| match o {
            ClusterOutput::Publish { payload, .. } => decode::<ShardView>(payload),
            _ => None,
        })
        .filter(|v| v.user == user)
        .map(|v| v.presence)
        .collect()
}
