//! The messages that cross NATS between nodes, and the KV records they
//! write, with their postcard encoding ([`MAX_MESSAGE`] checked first).

use super::MAX_MESSAGE;
use bytes::Bytes;
use greendot_proto::{self as proto, WireError};
use serde::{Deserialize, Serialize};

/// A device input, as the edge forwards it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireOp {
    /// `session`: the edge's wire id of the session (what `Route` lists).
    /// `since`: the order in which this edge run welcomed the session: of
    /// two sessions of one device at one edge run, the later welcomed is
    /// the one its client kept (it gives up on an attempt before making
    /// another), whatever order their connects reach the owner in.
    Connect {
        kind: proto::Kind,
        session: u64,
        since: u64,
    },
    /// `last_heard`: Unix milliseconds (the nodes' clocks agree on Unix time,
    /// not on their cores' milliseconds).
    Disconnect {
        last_heard: u64,
    },
    Logout,
    SetStatus {
        status: proto::Status,
        message: Option<String>,
    },
    SetInvisible(bool),
    /// The app went to the foreground (`true`) or the background (I12).
    SetForeground(bool),
    /// A `Connect` of a device whose app is in the background, in one step,
    /// so a new owner never shows it present in between (I12). Sent from
    /// protocol 2 ([`RECORD_FOREGROUND_SINCE`]); a node sending 1 sends
    /// `Connect`, then `SetForeground(false)`.
    ConnectInBackground {
        kind: proto::Kind,
        session: u64,
        since: u64,
    },
    /// A connect in either app state that says when its edge welcomed the
    /// session (`welcomed`, Unix milliseconds), so that sessions of one
    /// device at two nodes have an order: a node woken from a pause sends
    /// the connect of a session its client gave up on and left for another
    /// node meanwhile, which must not take the device over. Sent from
    /// protocol 3 ([`CONNECT_WELCOMED_SINCE`]).
    ConnectWelcomed {
        kind: proto::Kind,
        session: u64,
        since: u64,
        welcomed: u64,
        foreground: bool,
    },
}

/// Edge → owner, on `<prefix>.req.<shard>.<kind>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToOwner {
    Device {
        edge: String,
        incarnation: u64,
        /// Unique per (edge, incarnation), increasing: the owner's duplicate
        /// filter.
        rid: u64,
        /// The edge's connection of the device (one per connect).
        conn: u64,
        user: String,
        device: String,
        op: WireOp,
    },
    /// The views of `targets` for a subscribe by `viewer` (a target equal to
    /// the viewer gets the truth).
    Snapshot {
        viewer: String,
        targets: Vec<String>,
    },
    /// The views of `targets` (what others see, for every target; `own`:
    /// each target's truth), for an edge that missed a view (a truth) of
    /// their shard.
    Views { targets: Vec<String>, own: bool },
    /// The user's Online devices, for a service's `Route`.
    Route { user: String },
    /// Owners' partial counts of groups whose home shard this is, for the
    /// home shard's owner to sum (from protocol [`GROUPS_SINCE`]).
    GroupPartials { parts: Vec<GroupPartial> },
    /// The keys of a page of `group`'s member list, for the owner of the
    /// group's home shard (its aggregator): up to `limit` members online
    /// after `after`, then the others, by ordinal (from protocol
    /// [`PAGES_SINCE`]).
    GroupPage {
        group: u64,
        /// The previous page's last entry: (online section, ordinal).
        after: Option<(bool, u32)>,
        limit: u32,
    },
}

/// The protocol version from which owners send partial counts and the
/// owners of home shards publish group counts: a node sending less serves
/// no group subscription (a node of version 3 cannot decode them).
pub const GROUPS_SINCE: u8 = 4;

/// The protocol version from which edges ask a group's aggregator for the
/// keys of a member page: a node sending less serves no member page (a
/// node of version 4 cannot decode the request).
pub const PAGES_SINCE: u8 = 5;

/// A shard's owner's count of one group's members in its shard: the
/// ordinals (the group definition's) of those published online, an
/// absolute set that replaces the shard's previous one at the sum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPartial {
    pub group: u64,
    pub shard: u32,
    /// The owner's claim epoch of `shard`: a newer owner's partial wins.
    pub epoch: u64,
    /// Rises with each partial of the group the owner sends in the epoch.
    pub seq: u64,
    /// Sorted.
    pub online: Vec<u32>,
}

/// On `<prefix>.groups`: counts of groups whose home shard `home` the
/// sender owns under `epoch`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupCounts {
    pub home: u32,
    pub epoch: u64,
    pub counts: Vec<GroupCount>,
}

/// One group's count under the home owner's `version` (taken only above
/// the last one taken), with the member whose change made it, if one did
/// (admins get the change itself).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupCount {
    pub group: u64,
    pub version: u64,
    pub count: u32,
    pub change: Option<(String, bool)>,
}

/// Owner → edge (a reply).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromOwner {
    Done {
        epoch: u64,
    },
    /// This node does not act for the shard: look again and retry.
    NotOwner,
    /// No live session of the device here: connect it again, then retry.
    Unknown,
    /// The owner refused the input (a limit): tell the client.
    Refused(WireError),
    /// `epoch` and `seq`: the shard's last published view when answered
    /// (the presences include every view up to it).
    Snapshot {
        presences: Vec<proto::Presence>,
        epoch: u64,
        seq: u64,
    },
    /// The user's Online devices, wherever they are connected.
    Route(Vec<proto::RouteEntry>),
    /// Some targets' KV records are being read (users the owner freed, or
    /// has not met since it took the shard): ask again shortly.
    Loading,
    /// The keys of a member page (`ToOwner::GroupPage`): the members' names
    /// in page order, each with whether it is online by the latest
    /// partials; the count and version of the sum when answered; the next
    /// page's cursor, `None` on the last.
    GroupPageKeys {
        version: u64,
        count: u32,
        keys: Vec<(String, bool)>,
        next: Option<(bool, u32)>,
    },
}

/// On `<prefix>.shard.<n>`: a view the owner published (on an edge's
/// subject: a truth).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardView {
    pub epoch: u64,
    /// On the shard's subject: the view's number in the epoch, from 1 with
    /// no gaps, so an edge notices a lost one. On an edge's subject: the
    /// truth's number among those the shard's owner sent that edge in the
    /// epoch, the same way.
    pub seq: u64,
    /// When the owner published it (Unix milliseconds of its clock).
    pub published_ms: u64,
    pub user: String,
    /// The truth, for the user's own sessions.
    pub own: bool,
    pub presence: proto::Presence,
}

/// One device of a shard's record, as its owner last wrote it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedDevice {
    pub user: String,
    pub device: String,
    pub kind: proto::Kind,
    pub edge: String,
    pub incarnation: u64,
    pub conn: u64,
    /// Unix milliseconds of the write.
    pub heard: u64,
    /// Its app was in the foreground (I12). Not in records of the first
    /// layout, which read as `true`.
    pub foreground: bool,
}

/// A device in the shard record's first layout (protocol 1), before the
/// foreground flag.
#[derive(Serialize, Deserialize)]
struct RecordedDeviceV1 {
    user: String,
    device: String,
    kind: proto::Kind,
    edge: String,
    incarnation: u64,
    conn: u64,
    heard: u64,
}

/// The protocol version from which owners write the shard record with the
/// foreground flag (greendot-cluster's `PROTOCOL_VERSION` 2).
pub const RECORD_FOREGROUND_SINCE: u8 = 2;

/// The protocol version from which a connect says when it was welcomed
/// ([`WireOp::ConnectWelcomed`]), and owners write the shard record with
/// the users they owe an offline ([`ShardRecord::owed`]).
pub const CONNECT_WELCOMED_SINCE: u8 = 3;

/// The protocol version from which owners write the shard record fenced by
/// their epoch (a late write of an older owner does not replace a newer
/// owner's record). A node of the previous release reads neither this nor
/// the third layout.
pub const FENCED_RECORD_SINCE: u8 = 3;

/// What a shard record of the second layout begins with. A record of the
/// first layout is a bare postcard list, which begins with 0 only when it
/// is empty, and then is that one byte: the two never meet.
const RECORD_V2: &[u8] = b"\0gdD2";

/// What a shard record of the third layout begins with.
const RECORD_V3: &[u8] = b"\0gdD3";

/// A shard's record, as its owner writes it behind for the next owner.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// The devices of the shard, online or lingering (and ended ones whose
    /// user's offline is not published yet).
    pub devices: Vec<RecordedDevice>,
    /// Users shown online with no device left: their offline is not
    /// published yet (a debounce, or a resync window holds it). The next
    /// owner reads them back and publishes it; the devices alone would not
    /// name them. From protocol 3.
    pub owed: Vec<String>,
}

/// The shard's record, given by its parts (borrowed: an owner writes it
/// from the rows it keeps, not copied), in the layout of protocol
/// `version`: the first layout below [`RECORD_FOREGROUND_SINCE`], which a
/// node of the previous release reads during a rolling upgrade
/// (docs/cluster.md), and the users owed an offline only from
/// [`CONNECT_WELCOMED_SINCE`]. Decoded as a [`ShardRecord`].
pub fn encode_shard_record(devices: &[&RecordedDevice], owed: &[&String], version: u8) -> Bytes {
    #[derive(Serialize)]
    struct Parts<'a> {
        devices: &'a [&'a RecordedDevice],
        owed: &'a [&'a String],
    }
    if version >= CONNECT_WELCOMED_SINCE {
        let mut out = RECORD_V3.to_vec();
        out.extend_from_slice(&encode(&Parts { devices, owed }));
        return Bytes::from(out);
    }
    let devices: Vec<RecordedDevice> = devices.iter().map(|d| (*d).clone()).collect();
    encode_device_record(&devices, version)
}

/// A shard's record of any layout; `None` if it is none.
pub fn decode_shard_record(payload: &[u8]) -> Option<ShardRecord> {
    if let Some(v3) = payload.strip_prefix(RECORD_V3) {
        return decode(v3);
    }
    let devices = decode_device_record(payload)?;
    Some(ShardRecord {
        devices,
        owed: Vec::new(),
    })
}

/// The shard's device record in the layout of protocol `version` up to 2.
pub fn encode_device_record(devices: &[RecordedDevice], version: u8) -> Bytes {
    if version >= RECORD_FOREGROUND_SINCE {
        let mut out = RECORD_V2.to_vec();
        out.extend_from_slice(&encode(&devices));
        return Bytes::from(out);
    }
    let v1: Vec<RecordedDeviceV1> = devices
        .iter()
        .map(|d| RecordedDeviceV1 {
            user: d.user.clone(),
            device: d.device.clone(),
            kind: d.kind,
            edge: d.edge.clone(),
            incarnation: d.incarnation,
            conn: d.conn,
            heard: d.heard,
        })
        .collect();
    encode(&v1)
}

/// The devices of a shard's record of any layout; `None` if it is none.
pub fn decode_device_record(payload: &[u8]) -> Option<Vec<RecordedDevice>> {
    if let Some(v3) = payload.strip_prefix(RECORD_V3) {
        return decode::<ShardRecord>(v3).map(|r| r.devices);
    }
    if let Some(v2) = payload.strip_prefix(RECORD_V2) {
        return decode(v2);
    }
    let v1: Vec<RecordedDeviceV1> = decode(payload)?;
    Some(
        v1.into_iter()
            .map(|d| RecordedDevice {
                user: d.user,
                device: d.device,
                kind: d.kind,
                edge: d.edge,
                incarnation: d.incarnation,
                conn: d.conn,
                heard: d.heard,
                foreground: true,
            })
            .collect(),
    )
}

/// In the sessions bucket, under the device's key: what its current
/// session subscribed to, so that a resume on another node (or in the next
/// process) carries it over. Written before a subscribe is answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// The session's wire id (what the client names to resume it).
    pub wire: u64,
    pub subscriptions: Vec<(String, proto::Tier)>,
}

/// What a session record that lists group subscriptions begins with (from
/// protocol [`GROUPS_SINCE`]). A record without begins with its wire id (a
/// session id under the process's random key), so the two meet only for a
/// wire id of 0, and a record that does not decode with groups is read
/// without. A node of version 3 reads one with groups as a record of
/// another session, and the resume starts fresh.
const SESSION_GROUPS: &[u8] = b"\0gdS4";

#[derive(Serialize, Deserialize)]
struct GroupedSessionRecord {
    record: SessionRecord,
    groups: Vec<u64>,
}

/// A session's record with its group subscriptions, in the layout of
/// protocol `version` (below [`GROUPS_SINCE`] groups are not recorded: no
/// node of that version serves them).
pub fn encode_session_record(record: &SessionRecord, groups: &[u64], version: u8) -> Bytes {
    if groups.is_empty() || version < GROUPS_SINCE {
        return encode(record);
    }
    let mut out = SESSION_GROUPS.to_vec();
    out.extend_from_slice(&encode(&GroupedSessionRecord {
        record: record.clone(),
        groups: groups.to_vec(),
    }));
    Bytes::from(out)
}

/// A session's record of either layout, with its group subscriptions.
pub fn decode_session_record(payload: &[u8]) -> Option<(SessionRecord, Vec<u64>)> {
    let grouped = payload
        .strip_prefix(SESSION_GROUPS)
        .and_then(decode::<GroupedSessionRecord>);
    match grouped {
        Some(g) => Some((g.record, g.groups)),
        None => decode::<SessionRecord>(payload).map(|r| (r, Vec::new())),
    }
}

/// On the resync subject: the new owner of `shard` asks every edge to
/// resend its live devices of the shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncRequest {
    pub shard: u32,
    pub epoch: u64,
    pub owner: String,
}

/// On `<prefix>.beacon`, every [`BEACON_EVERY`](super::BEACON_EVERY): the
/// latest view number of each shard `owner` acts for and has published in
/// (at most [`MAX_BEACON_SHARDS`](super::MAX_BEACON_SHARDS)). An edge
/// watching one of them that has seen an older number missed a view and
/// asks the owner again (C5 under loss).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beacon {
    pub owner: String,
    /// (shard, epoch, seq)
    pub shards: Vec<(u32, u64, u64)>,
    /// (edge, shard, epoch, seq) of the last truth sent to another edge,
    /// for those sent in the last
    /// [`TRUTH_BEACON_FOR`](super::TRUTH_BEACON_FOR).
    pub truths: Vec<(String, u32, u64, u64)>,
}

/// A user's preferences as the owner writes them to the KV.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePrefs {
    pub status: proto::Status,
    pub message: Option<String>,
    pub invisible: bool,
    /// Unix milliseconds.
    pub last_seen: Option<u64>,
}

pub(super) fn encode<T: Serialize>(value: &T) -> Bytes {
    // Our own small types always encode.
    Bytes::from(postcard::to_stdvec(value).unwrap_or_default())
}

pub(super) fn decode<'a, T: Deserialize<'a>>(payload: &'a [u8]) -> Option<T> {
    if payload.len() > MAX_MESSAGE {
        return None;
    }
    postcard::from_bytes(payload).ok()
}
