//! The shard's device record, written behind for the next owner: every
//! device the owner holds, and the users it owes an offline.
//!
//! The owner keeps the record's rows by user and rebuilds only the rows of
//! users changed since the last write (a device connected, ended or moved
//! to the background, a view published, a user read or released), so a
//! write costs the changes and one encoding, not a walk over every device
//! and user of the shard with their names copied. Under the `check` feature
//! (the simulator) and in tests, each write is compared with the record
//! built from scratch.

use crate::cluster::owner::shard::Owner;
use crate::cluster::owner::OwnedShards;
use crate::cluster::shared::Shared;
use crate::cluster::wire::{encode_shard_record, RecordedDevice, FENCED_RECORD_SINCE};
use crate::cluster::{ClusterOutput, DetSet, MAX_RECORDED_DEVICES, WRITE_BEHIND};
use greendot_core::{Millis, SessionId, UserId};
use std::collections::BTreeMap;

/// The rows of the record for the devices the owner's core holds, by user,
/// and the users shown online with no device; `changed` are the users
/// whose rows may be stale.
#[derive(Debug, Default)]
pub(in crate::cluster) struct RecordRows {
    /// Each user's held devices, by device then session: in the record's
    /// order, by user then device.
    rows: BTreeMap<String, Vec<(SessionId, RecordedDevice)>>,
    /// Users read here, shown online, with no session: owed an offline.
    alone: DetSet<String>,
    changed: DetSet<UserId>,
}

impl RecordRows {
    /// `user`'s devices or view may have changed: rebuilt at the next write.
    pub(in crate::cluster) fn changed(&mut self, user: UserId) {
        self.changed.insert(user);
    }

    /// `user` is released (no session, nothing owed): she has no row.
    pub(in crate::cluster) fn released(&mut self, user: &str) {
        self.rows.remove(user);
        self.alone.remove(user);
    }

    /// Rebuilds the rows of the users changed since the last call.
    fn refresh(&mut self, o: &Owner) {
        for user in std::mem::take(&mut self.changed) {
            let Some(name) = o.users.name(user.0) else {
                continue; // released: its rows went then
            };
            let mut rows: Vec<(SessionId, RecordedDevice)> = o
                .core
                .sessions_of(user)
                .into_iter()
                .filter_map(|s| Some((s, row(o, s, 0)?)))
                .collect();
            rows.sort_by(|(a, x), (b, y)| (&x.device, a).cmp(&(&y.device, b)));
            if rows.is_empty() {
                self.rows.remove(&**name);
            } else {
                self.rows.insert(name.to_string(), rows);
            }
            if shown_alone(o, name) {
                self.alone.insert(name.to_string());
            } else {
                self.alone.remove(&**name);
            }
        }
    }
}

/// The record's row of the held session `s`, heard at `heard`.
fn row(o: &Owner, s: SessionId, heard: u64) -> Option<RecordedDevice> {
    let held = o.sessions.get(&s)?;
    let info = o.core.session_info(s)?;
    let (edge, incarnation, conn) = &held.holder;
    Some(RecordedDevice {
        user: o.users.name(info.user.0)?.to_string(),
        device: o.devices.name(info.device.0)?.to_string(),
        kind: info.kind.into(),
        edge: edge.clone(),
        incarnation: *incarnation,
        conn: *conn,
        heard,
        foreground: info.foreground,
    })
}

/// A user read here, shown online with no device left (restored so, or
/// her last device ended): her offline is owed, and no device names her
/// for the next owner.
fn shown_alone(o: &Owner, name: &str) -> bool {
    o.loaded.contains(name)
        && o.users.get(name).is_some_and(|uid| {
            let user = UserId(uid);
            o.core.presence(user).online && o.core.sessions_of(user).is_empty()
        })
}

impl OwnedShards {
    /// Writes the shard's device record behind once `WRITE_BEHIND` passed
    /// since the first change not written.
    pub(in crate::cluster) fn write_devices(&mut self, sh: &mut Shared, shard: u32, at: Millis) {
        let heard = sh.unix_base_ms.saturating_add(at.0);
        let Some(o) = self.owners.get_mut(&shard) else {
            return;
        };
        if o.reading_record || o.dirty_since.is_none_or(|d| at < d.plus(WRITE_BEHIND)) {
            return;
        }
        o.dirty_since = None;
        o.records_written = o.records_written.wrapping_add(1);
        // The epoch first: a newer owner's first write is above an older
        // owner's every write (epochs stay below 2^24).
        let fence = (o.epoch << 32) | u64::from(o.records_written);
        let mut record = std::mem::take(&mut o.record);
        record.refresh(o);
        for (_, d) in record.rows.values_mut().flatten() {
            d.heard = heard;
        }
        let mut devices: Vec<&RecordedDevice> =
            record.rows.values().flatten().map(|r| &r.1).collect();
        // Devices of users still being read, and ended ones whose user's
        // offline is not yet published, are the shard's as much.
        let others = o.recorded.values().flatten().chain(o.ended.values());
        let before = devices.len();
        devices.extend(others);
        if devices.len() > before {
            devices.sort_by(|a, b| (&a.user, &a.device).cmp(&(&b.user, &b.device)));
        }
        devices.truncate(MAX_RECORDED_DEVICES);
        let mut owed: Vec<&String> = record.alone.iter().chain(o.owed.iter()).collect();
        owed.sort_unstable();
        owed.truncate(MAX_RECORDED_DEVICES);
        let value = encode_shard_record(&devices, &owed, sh.settings.protocol);
        #[cfg(any(test, feature = "check"))]
        check_rows(o, heard, shard, &devices, &owed);
        let fenced = sh.settings.protocol >= FENCED_RECORD_SINCE;
        sh.outputs.push_back(ClusterOutput::PutShardDevices {
            shard,
            fence: fenced.then_some(fence),
            value,
        });
        o.record = record;
    }
}

/// Asserts that the record written from the rows kept holds what one
/// built from every device and user of the shard holds (two rows of one
/// device may come in either order).
#[cfg(any(test, feature = "check"))]
fn check_rows(o: &Owner, heard: u64, shard: u32, devices: &[&RecordedDevice], owed: &[&String]) {
    let key = |d: &RecordedDevice| {
        let numbers = (d.incarnation, d.conn, d.heard, d.foreground, d.kind as u8);
        (d.user.clone(), d.device.clone(), d.edge.clone(), numbers)
    };
    let mut whole: Vec<RecordedDevice> = o
        .sessions
        .keys()
        .filter_map(|s| row(o, *s, heard))
        .collect();
    whole.extend(o.recorded.values().flatten().cloned());
    whole.extend(o.ended.values().cloned());
    let mut whole_owed: Vec<&String> = o
        .loaded
        .iter()
        .filter(|name| shown_alone(o, name))
        .chain(o.owed.iter())
        .collect();
    whole_owed.sort_unstable();
    if whole.len() <= MAX_RECORDED_DEVICES && whole_owed.len() <= MAX_RECORDED_DEVICES {
        let mut built: Vec<_> = devices.iter().map(|d| key(d)).collect();
        let mut whole: Vec<_> = whole.iter().map(key).collect();
        built.sort();
        whole.sort();
        assert_eq!(built, whole, "shard {shard}: the record's rows went stale");
        assert_eq!(
            owed,
            &whole_owed[..],
            "shard {shard}: the owed users went stale"
        );
        assert!(
            devices
                .windows(2)
                .all(|w| (&w[0].user, &w[0].device) <= (&w[1].user, &w[1].device)),
            "shard {shard}: the record is not in order"
        );
    }
}
