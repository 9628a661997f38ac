//! Tests of the shard's record across owner failovers: what an owner
//! writes behind (devices, backgrounded ones, ended ones, users owed an
//! offline) and in which layout, and what the next owner makes of it.

use super::test_support::*;
use super::wire::{
    decode, decode_device_record, decode_shard_record, encode, encode_device_record,
    encode_shard_record, RecordedDevice, ShardRecord, ShardView, ToOwner, WireOp,
    CONNECT_WELCOMED_SINCE, RECORD_FOREGROUND_SINCE,
};
use super::{ClusterInput, ClusterLink, ClusterOutput};
use bytes::Bytes;
use greendot_core::{Millis, SessionId, Tier, UserId};
use greendot_proto as proto;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// alice's phone goes to the background, then both its edge and the owner
/// of her shard die. The next owner has only the shard's device record: it
/// restores the phone backgrounded, so watchers see her offline once the
/// resync window and the debounce pass, not after the phone's grace (I12).
#[test]
fn a_backgrounded_device_stays_backgrounded_across_an_owner_failover() {
    let (mut a, mut b, now) = two_nodes();
    b.handle_timeout(now, Millis(600));
    exchange(&mut a, &mut b, now, Millis(600));
    let background = WireOp::SetForeground(false);
    assert!(a.input(now, Millis(700), SessionId(1), background, None));
    exchange(&mut a, &mut b, now, Millis(700));
    // Within the debounce: the owner has not published her offline yet, but
    // writes the shard's record behind.
    b.handle_timeout(now, Millis(1_300));
    let record = records_written(&mut b)
        .into_iter()
        .next()
        .expect("the owner wrote alice's shard record");
    let recorded = decode_device_record(&record).unwrap();
    assert_eq!(recorded.len(), 1);
    assert!(!recorded[0].foreground, "{recorded:?}");
    drop((a, b)); // her edge and her owner die

    let mut c = link("c");
    let t = |ms: u64| (now + Duration::from_millis(ms), Millis(ms));
    let (claimed_at, at) = t(2_000);
    c.set_status(
        claimed_at,
        at,
        all_shards(2, now + Duration::from_secs(3600)),
    );
    let online = proto::Presence {
        online: true,
        ..proto::Presence::default()
    };
    let mut offline_at = None;
    'time: for ms in (2_000..60_000).step_by(100) {
        let (now, at) = t(ms);
        c.handle_timeout(now, at);
        while let Some(out) = c.poll_output() {
            let input = match out {
                ClusterOutput::LoadShard { id, .. } => ClusterInput::ShardLoaded {
                    id,
                    record: Some(record.clone()),
                },
                ClusterOutput::LoadUser { id, .. } => ClusterInput::UserLoaded {
                    id,
                    prefs: None,
                    view: Some(encode(&online)),
                },
                ClusterOutput::Publish { payload, .. } => {
                    let view: ShardView = decode(&payload).unwrap();
                    if view.user == "alice" && !view.own && !view.presence.online {
                        offline_at = Some(ms);
                        break 'time;
                    }
                    continue;
                }
                _ => continue,
            };
            c.handle_input(now, at, input);
        }
    }
    let offline_at = offline_at.expect("alice never shown offline");
    // The resync window (the request timeout, 5 s) and the debounce, far
    // below the mobile grace.
    assert!(
        offline_at <= 2_000 + 5_000 + 1_000,
        "offline at {offline_at} ms"
    );
}

/// The shard records `b` writes at `at` (decoded).
fn records_at(b: &mut ClusterLink, now: Instant, at: Millis) -> Vec<Vec<RecordedDevice>> {
    b.handle_timeout(now, at);
    records_written(b)
        .iter()
        .filter_map(|value| decode_device_record(value))
        .collect()
}

/// The records of shard 1 that `b` wrote since its outputs were last
/// taken, as written.
fn records_written(b: &mut ClusterLink) -> Vec<Bytes> {
    std::iter::from_fn(|| b.poll_output())
        .filter_map(|out| match out {
            ClusterOutput::PutShardDevices {
                shard: 1, value, ..
            } => Some(value),
            _ => None,
        })
        .collect()
}

/// alice logs out in her owner's resync window, which holds her offline.
/// The shard's record keeps her phone until the offline is published: if
/// the shard moved first, a next owner that did not find her in the record
/// would never hear of her, and her last view, online, would stand.
#[test]
fn an_ended_device_stays_in_the_record_until_its_offline_is_published() {
    let (mut a, mut b, now) = two_nodes();
    assert!(a.input(now, Millis(700), SessionId(1), WireOp::Logout, Some(100)));
    exchange(&mut a, &mut b, now, Millis(700));
    let written = records_at(&mut b, now, Millis(1_200));
    let [record] = &written[..] else {
        panic!("one record: {written:?}");
    };
    let phone = record.iter().find(|d| d.user == "alice");
    assert!(
        phone.is_some_and(|d| d.device == "phone" && d.heard == 0),
        "{record:?}"
    );
    // The window (5 s) closes, her offline goes out, and the record is
    // written again without her.
    let later = now + Duration::from_secs(6);
    b.handle_timeout(later, Millis(6_000));
    let published: Vec<ShardView> = std::iter::from_fn(|| b.poll_output())
        .filter_map(|out| match out {
            ClusterOutput::Publish { payload, .. } => decode(&payload),
            _ => None,
        })
        .collect();
    assert!(
        published
            .iter()
            .any(|v| v.user == "alice" && !v.presence.online),
        "{published:?}"
    );
    let written = records_at(&mut b, later, Millis(6_500));
    assert!(
        written.iter().all(|r| r.iter().all(|d| d.user != "alice")),
        "{written:?}"
    );
}

/// A new owner's first read of the shard's record fails; alice's phone
/// connects meanwhile. The owner does not write its record over the
/// previous owner's before it read it (carol's phone in it would be lost,
/// and with it the offline a next owner owes her), and a failed read is
/// asked again rather than taken as empty.
#[test]
fn a_new_owner_reads_the_previous_record_before_writing_its_own() {
    let now = Instant::now();
    let (mut a, mut b) = (link("a"), link("b"));
    b.set_status(
        now,
        Millis(0),
        all_shards(2, now + Duration::from_secs(3600)),
    );
    let mut first = None;
    while let Some(out) = b.poll_output() {
        if let ClusterOutput::LoadShard { id, shard } = out {
            let input = if shard == 1 {
                first = Some(id);
                ClusterInput::ShardLoadFailed { id }
            } else {
                ClusterInput::ShardLoaded { id, record: None }
            };
            b.handle_input(now, Millis(0), input);
        }
    }
    assert!(first.is_some(), "the new owner reads shard 1's record");
    alice_phone_connects(&mut a, now, Millis(0));
    exchange(&mut a, &mut b, now, Millis(0));
    assert!(
        records_at(&mut b, now, Millis(2_000)).is_empty(),
        "written before the previous record was read"
    );
    // Asked again after a pause.
    let later = now + Duration::from_secs(1);
    b.handle_timeout(later, Millis(2_000));
    let again = std::iter::from_fn(|| b.poll_output())
        .find_map(|out| match out {
            ClusterOutput::LoadShard { id, shard: 1 } => Some(id),
            _ => None,
        })
        .expect("the failed read is asked again");
    let previous = vec![RecordedDevice {
        user: "carol".into(),
        device: "phone".into(),
        kind: proto::Kind::Mobile,
        edge: "c".into(),
        incarnation: 3,
        conn: 1,
        heard: 0,
        foreground: true,
    }];
    let record = encode_device_record(&previous, RECORD_FOREGROUND_SINCE);
    b.handle_input(
        later,
        Millis(2_000),
        ClusterInput::ShardLoaded {
            id: again,
            record: Some(record),
        },
    );
    let written = records_at(&mut b, later, Millis(2_600));
    let [record] = &written[..] else {
        panic!("one record once read: {written:?}");
    };
    let mut users: Vec<&str> = record.iter().map(|d| d.user.as_str()).collect();
    users.sort_unstable();
    assert_eq!(users, ["alice", "carol"]);
}

/// Whether the next owner shows alice offline when the shard moves in
/// the resync window of an owner (sending `protocol`) that read her back
/// from an online view with no device of hers in the shard's record.
/// `kv_view`: whether the KV still holds her view when the next owner reads
/// her back (the write behind may have been lost).
fn next_owner_shows_her_offline(protocol: u8, kv_view: bool) -> bool {
    let now = Instant::now();
    let (mut a, mut b) = (link("a"), link("b"));
    b.shared.settings.protocol = protocol;
    let until = now + Duration::from_secs(3600);
    b.set_status(now, Millis(0), all_shards(2, until));
    let online = proto::Presence {
        version: (1 << 40) + 3,
        online: true,
        ..proto::Presence::default()
    };
    let mut views = HashMap::from([("alice".to_string(), encode(&online))]);
    // bob subscribes to alice at a: b reads her back, online.
    let bob = SessionId(2);
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
    let alice = vec!["alice".to_string()];
    a.subscribe(
        now,
        Millis(10),
        5,
        bob,
        "bob",
        alice,
        vec![],
        Tier::Realtime,
        false,
    );
    exchange_kv(&mut a, &mut b, now, Millis(10), Some(&mut views));
    // Within its resync window (5 s), b writes its record and dies.
    b.handle_timeout(now, Millis(1_000));
    let record = records_written(&mut b)
        .into_iter()
        .next()
        .expect("b wrote alice's shard record");
    drop(b);
    let mut c = link("c");
    let t = |ms: u64| (now + Duration::from_millis(ms), Millis(ms));
    let (claimed, at) = t(2_000);
    c.set_status(claimed, at, all_shards(3, until));
    for ms in (2_000..20_000).step_by(100) {
        let (now, at) = t(ms);
        c.handle_timeout(now, at);
        while let Some(out) = c.poll_output() {
            let input = match out {
                ClusterOutput::LoadShard { id, shard } => ClusterInput::ShardLoaded {
                    id,
                    record: (shard == 1).then(|| record.clone()),
                },
                ClusterOutput::LoadUser { id, user } => ClusterInput::UserLoaded {
                    id,
                    prefs: None,
                    view: views.get(&user).filter(|_| kv_view).cloned(),
                },
                ClusterOutput::Publish { payload, .. } => {
                    let view: ShardView = decode(&payload).unwrap();
                    if view.user == "alice" && !view.presence.online {
                        return true;
                    }
                    continue;
                }
                _ => continue,
            };
            c.handle_input(now, at, input);
        }
    }
    false
}

/// An owner that read alice back online with no device owes her offline:
/// from protocol 3 its shard record names her, so a next owner shows her
/// offline if the shard moves before the window closes. The record of
/// protocol 2 names devices only, and she stays online (a ghost).
#[test]
fn a_user_owed_an_offline_is_named_in_the_shard_record() {
    assert!(next_owner_shows_her_offline(CONNECT_WELCOMED_SINCE, true));
    assert!(next_owner_shows_her_offline(CONNECT_WELCOMED_SINCE, false));
    assert!(!next_owner_shows_her_offline(RECORD_FOREGROUND_SINCE, true));
}

/// A new owner asks the edge to resend alice's backgrounded phone. From
/// protocol 2 the connect carries the background in one step, so the new
/// owner never holds her present in between; a node sending protocol 1
/// sends a `Connect`, then `SetForeground(false)`. Either way she ends
/// backgrounded at the new owner.
#[test]
fn a_backgrounded_device_is_resent_in_the_background() {
    for protocol in [RECORD_FOREGROUND_SINCE - 1, RECORD_FOREGROUND_SINCE] {
        let (mut a, mut b, now) = two_nodes();
        a.shared.settings.protocol = protocol;
        exchange(&mut a, &mut b, now, Millis(600));
        let background = WireOp::SetForeground(false);
        assert!(a.input(now, Millis(700), SessionId(1), background, None));
        exchange(&mut a, &mut b, now, Millis(700));

        let mut c = link("c");
        let (t, at) = (now + Duration::from_secs(2), Millis(2_000));
        c.set_status(t, at, all_shards(2, now + Duration::from_secs(3600)));
        let mut resyncs = Vec::new();
        while let Some(out) = c.poll_output() {
            match out {
                ClusterOutput::LoadShard { id, .. } => {
                    c.handle_input(t, at, ClusterInput::ShardLoaded { id, record: None })
                }
                ClusterOutput::Resync { payload } => resyncs.push(payload),
                _ => {}
            }
        }
        for payload in resyncs {
            a.handle_input(t, at, ClusterInput::Resync { payload });
        }
        // alice's ops as c takes them, one at a time, with c's state after each.
        let mut ops = Vec::new();
        for _ in 0..20 {
            a.handle_timeout(t, at);
            let requests = requests_of(&mut a);
            if requests.is_empty() {
                break;
            }
            for request in requests {
                let ClusterInput::Request { payload, .. } = &request else {
                    continue;
                };
                let alice = match decode::<ToOwner>(payload) {
                    Some(ToOwner::Device { user, op, .. }) if user == "alice" => Some(op),
                    _ => None,
                };
                c.handle_input(t, at, request);
                while let Some(out) = c.poll_output() {
                    match out {
                        ClusterOutput::LoadUser { id, .. } => c.handle_input(
                            t,
                            at,
                            ClusterInput::UserLoaded {
                                id,
                                prefs: None,
                                view: None,
                            },
                        ),
                        ClusterOutput::Reply { reply, payload } => a.handle_input(
                            t,
                            at,
                            ClusterInput::Answered {
                                id: reply,
                                payload: Some(payload),
                            },
                        ),
                        _ => {}
                    }
                }
                if let Some(op) = alice {
                    let o = &c.shards.owners[&1];
                    let uid = UserId(o.users.get("alice").unwrap());
                    let present = o.core.sessions_of(uid).into_iter().any(|s| {
                        o.core
                            .session_info(s)
                            .is_some_and(|i| i.online && i.foreground)
                    });
                    ops.push((op, present));
                }
            }
        }
        let kind = proto::Kind::Mobile;
        if protocol >= RECORD_FOREGROUND_SINCE {
            assert!(
                matches!(ops.as_slice(), [(WireOp::ConnectInBackground { kind: k, .. }, false)] if *k == kind),
                "{ops:?}"
            );
        } else {
            assert!(
                matches!(
                    ops.as_slice(),
                    [
                        (WireOp::Connect { .. }, true),
                        (WireOp::SetForeground(false), false)
                    ]
                ),
                "{ops:?}"
            );
        }
    }
}

/// `user`'s phone as a record holds it, on edge a.
fn phone(user: &str, foreground: bool) -> RecordedDevice {
    RecordedDevice {
        user: user.into(),
        device: "phone".into(),
        kind: proto::Kind::Mobile,
        edge: "a".into(),
        incarnation: 7,
        conn: 1,
        heard: 600,
        foreground,
    }
}

/// The shard record's two layouts: a node sending protocol 1 writes the
/// first (no foreground flag), which every node reads as foreground; the
/// second keeps the flag; the two never read as each other.
#[test]
fn the_shard_record_is_written_in_the_layout_of_the_protocol_sent() {
    let device = |foreground| phone("alice", foreground);
    let both = vec![device(false), device(true)];
    let v2 = encode_device_record(&both, RECORD_FOREGROUND_SINCE);
    assert_eq!(decode_device_record(&v2), Some(both.clone()));
    let v1 = encode_device_record(&both, RECORD_FOREGROUND_SINCE - 1);
    assert_eq!(
        decode_device_record(&v1),
        Some(vec![device(true), device(true)])
    );
    for version in [1, 2] {
        let empty = encode_device_record(&[], version);
        assert_eq!(decode_device_record(&empty), Some(Vec::new()));
    }
    assert_eq!(decode_device_record(b"\0gdD2\xff"), None);
    assert_eq!(decode_device_record(b"\xff\xff"), None);
}

/// The shard's record written from borrowed parts reads back whole from
/// protocol 3 (with the users owed an offline), and as its devices alone
/// in the layouts before.
#[test]
fn a_shard_record_written_from_its_parts_reads_back() {
    let devices = [phone("alice", false), phone("bob", true)];
    let refs: Vec<&RecordedDevice> = devices.iter().collect();
    let carol = "carol".to_string();
    let v3 = encode_shard_record(&refs, &[&carol], CONNECT_WELCOMED_SINCE);
    assert_eq!(
        decode_shard_record(&v3),
        Some(ShardRecord {
            devices: devices.to_vec(),
            owed: vec![carol.clone()],
        })
    );
    let v2 = encode_shard_record(&refs, &[&carol], RECORD_FOREGROUND_SINCE);
    assert_eq!(
        decode_shard_record(&v2),
        Some(ShardRecord {
            devices: devices.to_vec(),
            owed: Vec::new(),
        })
    );
}

/// From protocol 3 an owner writes the shard's record fenced by its epoch
/// and its count of writes (a late write of an older owner, or an earlier
/// one of its own, must not replace a later record: seed 7754, a device
/// dropped from the record and its user a ghost); a node sending protocol
/// 2 writes it as the previous release does.
#[test]
fn the_shard_record_is_written_under_the_owners_epoch_from_protocol_3() {
    let fences = |protocol: u8| {
        let (mut a, mut b, now) = two_nodes();
        b.shared.settings.protocol = protocol;
        let mut fences = Vec::new();
        for (ms, foreground) in [(600, false), (2_000, true)] {
            let op = WireOp::SetForeground(foreground);
            assert!(a.input(now, Millis(ms), SessionId(1), op, None));
            exchange(&mut a, &mut b, now, Millis(ms));
            b.handle_timeout(now, Millis(ms + 600));
            fences.extend(
                std::iter::from_fn(|| b.poll_output()).filter_map(|out| match out {
                    ClusterOutput::PutShardDevices {
                        shard: 1, fence, ..
                    } => Some(fence),
                    _ => None,
                }),
            );
        }
        fences
    };
    let fenced = fences(CONNECT_WELCOMED_SINCE);
    assert!(fenced.len() >= 2, "{fenced:?}");
    assert!(
        fenced.iter().all(|f| f.is_some_and(|f| f >> 32 == 1)),
        "epoch 1: {fenced:?}"
    );
    assert!(fenced.windows(2).all(|w| w[0] < w[1]), "{fenced:?}");
    let plain = fences(RECORD_FOREGROUND_SINCE);
    assert!(
        !plain.is_empty() && plain.iter().all(Option::is_none),
        "{plain:?}"
    );
}

/// The owner writes its record from rows it keeps between writes; the
/// check that runs in tests and the simulator catches rows gone stale (a
/// change not noted): here alice's, dropped while her phone is online.
#[test]
#[should_panic(expected = "the record's rows went stale")]
fn rows_gone_stale_are_caught_when_the_record_is_written() {
    let (_a, mut b, now) = two_nodes();
    b.handle_timeout(now, Millis(1_000));
    let owner = b.shards.owners.get_mut(&1).expect("b owns alice's shard");
    owner.record.released("alice");
    owner.dirty_since = Some(Millis(1_000));
    b.handle_timeout(now, Millis(2_000));
}
