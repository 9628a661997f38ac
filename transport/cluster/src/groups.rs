//! Group definitions as the groups bucket holds them (not wired into the
//! server yet): pure encoding, sealing, chunking and checks. The I/O is in
//! `group_store`.
//!
//! Layout of `<prefix>_groups`:
//! - `g.<group>`: the header ([`GroupHeader`]), sealed with the cluster's
//!   [`Envelope`] on the key name, written by compare-and-set on its
//!   revision. It names its chunks by a nonce and holds their SHA-256, so a
//!   forged header does not open and a changed chunk does not match.
//! - `c.<group>.<nonce>.<i>`: immutable chunks of at most
//!   [`MAX_GROUP_CHUNK_BYTES`], each a postcard `Vec<(name, ordinal)>`,
//!   together the members sorted by ordinal. 10,000 names of 128 bytes are
//!   ~1.3 MB, over NATS's default 1 MB `max_payload`: hence chunks.
//!
//! Removal is a header with `removed: true` and no members (a tombstone),
//! not a KV delete: it keeps `membership`, so a group created again starts
//! above it.

use std::collections::HashSet;

use bytes::Bytes;
use ring::digest;
use serde::{Deserialize, Serialize};

use crate::envelope::Envelope;
use crate::ids::MAX_USER_ID_LEN;

/// Largest chunk of a group's members, in bytes: well under NATS's default
/// `max_payload` (1 MB).
pub const MAX_GROUP_CHUNK_BYTES: usize = 256 * 1024;
/// Most chunks one group may have (64 MiB of members).
pub const MAX_GROUP_CHUNKS: u16 = 256;
/// Most bytes one member takes in a chunk: her name at its longest, its
/// length (a varint of at most 2 bytes at [`MAX_USER_ID_LEN`]) and her
/// ordinal (a varint of at most 5).
pub const MEMBER_MAX_BYTES: usize = MAX_USER_ID_LEN + 2 + 5;
/// What a chunk's own length prefix (a varint of its entry count) may take.
const CHUNK_PREFIX_BYTES: usize = 5;

/// A group's definition, assembled from its header and chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDef {
    pub group: u64,
    /// The group's membership version (raised by every write of its lists).
    pub membership: u64,
    /// The ordinal the next member added gets (ordinals are never reused).
    pub next_ordinal: u32,
    /// Members and their ordinals, sorted by ordinal.
    pub members: Vec<(String, u32)>,
    pub admins: Vec<String>,
    /// A tombstone: the group was removed (no members, no admins).
    pub removed: bool,
}

impl GroupDef {
    /// The tombstone of a removed group, keeping its versions.
    pub fn tombstone(group: u64, membership: u64, next_ordinal: u32) -> GroupDef {
        GroupDef {
            group,
            membership,
            next_ordinal,
            members: Vec::new(),
            admins: Vec::new(),
            removed: true,
        }
    }
}

/// How large a group definition may be; checked before anything is stored
/// and before anything read is handed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimits {
    pub max_members: u32,
    pub max_admins: u32,
}

impl Default for GroupLimits {
    /// greendot-core's defaults (`max_group_members`, `max_group_admins`).
    fn default() -> GroupLimits {
        GroupLimits {
            max_members: 10_000,
            max_admins: 32,
        }
    }
}

impl GroupLimits {
    /// Whether every group within these limits fits in [`MAX_GROUP_CHUNKS`]
    /// chunks, whatever its names.
    pub fn fit_in_chunks(&self) -> bool {
        let per_chunk = (MAX_GROUP_CHUNK_BYTES - CHUNK_PREFIX_BYTES) / MEMBER_MAX_BYTES;
        self.max_members as usize <= per_chunk * MAX_GROUP_CHUNKS as usize
    }
}

/// Why a group definition is refused (to write, or as read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupLimitError {
    #[error("{members} members, over the limit of {max}")]
    TooManyMembers { members: usize, max: u32 },
    #[error("{admins} admins, over the limit of {max}")]
    TooManyAdmins { admins: usize, max: u32 },
    #[error("a name of {len} bytes (names are 1..={MAX_USER_ID_LEN} bytes)")]
    BadName { len: usize },
    #[error("{name:?} is listed twice")]
    Duplicate { name: String },
    #[error("ordinal {ordinal} is not above the one before it, or not below next_ordinal {next_ordinal}")]
    BadOrdinal { ordinal: u32, next_ordinal: u32 },
    #[error("a removed group lists members or admins")]
    TombstoneWithMembers,
    #[error("{chunks} chunks, over the limit of {MAX_GROUP_CHUNKS}")]
    TooManyChunks { chunks: usize },
    #[error("a chunk of {bytes} bytes, over the limit of {MAX_GROUP_CHUNK_BYTES}")]
    ChunkTooLarge { bytes: usize },
}

/// Why a stored group definition does not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupDefect {
    /// The envelope refused the header: forged, of a version this node
    /// does not read, or too short (counted in the envelope's drops).
    #[error("the header was dropped: {0}")]
    Dropped(&'static str),
    #[error("the header or chunk {chunk:?} does not decode")]
    Undecodable { chunk: Option<u16> },
    #[error("the header is group {found}'s")]
    WrongGroup { found: u64 },
    #[error("the chunks do not match the header's digest")]
    DigestMismatch,
    #[error("chunk {0} is missing")]
    MissingChunk(u16),
    #[error("the header counts {header} members, the chunks hold {found}")]
    CountMismatch { header: u32, found: usize },
    #[error("over the limits: {0}")]
    OverLimit(#[from] GroupLimitError),
}

/// The stored header of a group (`g.<group>`), sealed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupHeader {
    pub group: u64,
    pub membership: u64,
    pub next_ordinal: u32,
    /// Names this write's chunks (`c.<group>.<nonce>.<i>`): racing writers
    /// never share a chunk key.
    pub nonce: u64,
    pub chunks: u16,
    /// SHA-256 over the chunks, each preceded by its length (u32 BE).
    pub digest: [u8; 32],
    pub admins: Vec<String>,
    pub members: u32,
    pub removed: bool,
}

/// A definition ready to store: the sealed header and its chunks.
#[derive(Debug, Clone)]
pub struct EncodedGroup {
    pub header: GroupHeader,
    pub sealed: Bytes,
    pub chunks: Vec<Bytes>,
}

/// The key of a group's header.
pub fn header_key(group: u64) -> String {
    format!("g.{group}")
}

/// The key of chunk `i` of the write named `nonce`.
pub fn chunk_key(group: u64, nonce: u64, i: u16) -> String {
    format!("c.{group}.{nonce}.{i}")
}

/// The group of a header key (`g.<group>`, canonical decimal only).
pub fn parse_header_key(key: &str) -> Option<u64> {
    let n: u64 = key.strip_prefix("g.")?.parse().ok()?;
    (key[2..] == n.to_string()).then_some(n)
}

fn check_name(name: &str) -> Result<(), GroupLimitError> {
    if name.is_empty() || name.len() > MAX_USER_ID_LEN {
        return Err(GroupLimitError::BadName { len: name.len() });
    }
    Ok(())
}

fn check_admins(admins: &[String], limits: &GroupLimits) -> Result<(), GroupLimitError> {
    if admins.len() > limits.max_admins as usize {
        return Err(GroupLimitError::TooManyAdmins {
            admins: admins.len(),
            max: limits.max_admins,
        });
    }
    let mut seen = HashSet::with_capacity(admins.len());
    for a in admins {
        check_name(a)?;
        if !seen.insert(a.as_str()) {
            return Err(GroupLimitError::Duplicate { name: a.clone() });
        }
    }
    Ok(())
}

fn check_member_count(members: usize, limits: &GroupLimits) -> Result<(), GroupLimitError> {
    if members > limits.max_members as usize {
        return Err(GroupLimitError::TooManyMembers {
            members,
            max: limits.max_members,
        });
    }
    Ok(())
}

/// Checks a definition against `limits` and its own rules: names 1..=
/// [`MAX_USER_ID_LEN`] bytes and listed once, ordinals rising and below
/// `next_ordinal`, a tombstone empty.
pub fn check_def(def: &GroupDef, limits: &GroupLimits) -> Result<(), GroupLimitError> {
    if def.removed && !(def.members.is_empty() && def.admins.is_empty()) {
        return Err(GroupLimitError::TombstoneWithMembers);
    }
    check_member_count(def.members.len(), limits)?;
    check_admins(&def.admins, limits)?;
    let mut seen = HashSet::with_capacity(def.members.len());
    let mut last: Option<u32> = None;
    for (name, ordinal) in &def.members {
        check_name(name)?;
        if last.is_some_and(|l| *ordinal <= l) || *ordinal >= def.next_ordinal {
            return Err(GroupLimitError::BadOrdinal {
                ordinal: *ordinal,
                next_ordinal: def.next_ordinal,
            });
        }
        last = Some(*ordinal);
        if !seen.insert(name.as_str()) {
            return Err(GroupLimitError::Duplicate { name: name.clone() });
        }
    }
    Ok(())
}

fn varint_len(mut n: u64) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
}

/// Splits members (already checked) into runs whose postcard encoding
/// stays within [`MAX_GROUP_CHUNK_BYTES`].
fn split(members: &[(String, u32)]) -> Vec<&[(String, u32)]> {
    let mut runs = Vec::new();
    let mut start = 0;
    let mut bytes = CHUNK_PREFIX_BYTES;
    for (i, (name, ordinal)) in members.iter().enumerate() {
        let entry = varint_len(name.len() as u64) + name.len() + varint_len(u64::from(*ordinal));
        if bytes + entry > MAX_GROUP_CHUNK_BYTES && i > start {
            runs.push(&members[start..i]);
            start = i;
            bytes = CHUNK_PREFIX_BYTES;
        }
        bytes += entry;
    }
    if start < members.len() {
        runs.push(&members[start..]);
    }
    runs
}

fn chunks_digest(chunks: &[Bytes]) -> [u8; 32] {
    let mut ctx = digest::Context::new(&digest::SHA256);
    for c in chunks {
        ctx.update(&(c.len() as u32).to_be_bytes());
        ctx.update(c);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// Checks `def` and encodes it as the write named `nonce`: the chunks and
/// the header sealed on its key. Refused before anything is stored.
pub fn encode(
    def: &GroupDef,
    nonce: u64,
    limits: &GroupLimits,
    envelope: &Envelope,
) -> Result<EncodedGroup, GroupLimitError> {
    check_def(def, limits)?;
    let runs = split(&def.members);
    if runs.len() > MAX_GROUP_CHUNKS as usize {
        return Err(GroupLimitError::TooManyChunks { chunks: runs.len() });
    }
    let mut chunks = Vec::with_capacity(runs.len());
    for run in runs {
        // Serializing owned strings and integers into a Vec cannot fail.
        let bytes = postcard::to_allocvec(run).unwrap_or_default();
        if bytes.len() > MAX_GROUP_CHUNK_BYTES {
            return Err(GroupLimitError::ChunkTooLarge { bytes: bytes.len() });
        }
        chunks.push(Bytes::from(bytes));
    }
    let header = GroupHeader {
        group: def.group,
        membership: def.membership,
        next_ordinal: def.next_ordinal,
        nonce,
        // At most MAX_GROUP_CHUNKS, checked above.
        chunks: chunks.len() as u16,
        digest: chunks_digest(&chunks),
        admins: def.admins.clone(),
        members: def.members.len() as u32,
        removed: def.removed,
    };
    let payload = postcard::to_allocvec(&header).unwrap_or_default();
    let sealed = envelope.seal_record(&header_key(def.group), &payload);
    Ok(EncodedGroup {
        header,
        sealed,
        chunks,
    })
}

/// Opens the header stored under `key` and checks what it claims against
/// `limits`, before any chunk is read. A header the envelope refuses is
/// counted in its drops.
pub fn open_header(
    key: &str,
    sealed: &Bytes,
    envelope: &Envelope,
    limits: &GroupLimits,
) -> Result<GroupHeader, GroupDefect> {
    let payload = match envelope.check_record(key, sealed) {
        Ok(payload) => payload,
        Err(reason) => {
            // Counted as every other drop is.
            envelope.drops().count(reason);
            return Err(GroupDefect::Dropped(reason.label()));
        }
    };
    let header: GroupHeader =
        postcard::from_bytes(&payload).map_err(|_| GroupDefect::Undecodable { chunk: None })?;
    if parse_header_key(key) != Some(header.group) {
        return Err(GroupDefect::WrongGroup {
            found: header.group,
        });
    }
    check_member_count(header.members as usize, limits)?;
    check_admins(&header.admins, limits)?;
    if header.chunks > MAX_GROUP_CHUNKS {
        return Err(GroupLimitError::TooManyChunks {
            chunks: header.chunks.into(),
        }
        .into());
    }
    if header.removed && (header.members != 0 || !header.admins.is_empty()) {
        return Err(GroupLimitError::TombstoneWithMembers.into());
    }
    Ok(header)
}

/// The definition of an opened header and its chunks (in order): the
/// chunks must match the header's digest and hold what it counts.
pub fn assemble(
    header: &GroupHeader,
    chunks: &[Bytes],
    limits: &GroupLimits,
) -> Result<GroupDef, GroupDefect> {
    if chunks.len() != header.chunks as usize {
        return Err(GroupDefect::MissingChunk(chunks.len() as u16));
    }
    if let Some(big) = chunks.iter().find(|c| c.len() > MAX_GROUP_CHUNK_BYTES) {
        return Err(GroupLimitError::ChunkTooLarge { bytes: big.len() }.into());
    }
    if chunks_digest(chunks) != header.digest {
        return Err(GroupDefect::DigestMismatch);
    }
    let mut members = Vec::with_capacity(header.members as usize);
    for (i, chunk) in chunks.iter().enumerate() {
        let run: Vec<(String, u32)> =
            postcard::from_bytes(chunk).map_err(|_| GroupDefect::Undecodable {
                chunk: Some(i as u16),
            })?;
        members.extend(run);
        if members.len() > header.members as usize {
            break;
        }
    }
    if members.len() != header.members as usize {
        return Err(GroupDefect::CountMismatch {
            header: header.members,
            found: members.len(),
        });
    }
    let def = GroupDef {
        group: header.group,
        membership: header.membership,
        next_ordinal: header.next_ordinal,
        members,
        admins: header.admins.clone(),
        removed: header.removed,
    };
    check_def(&def, limits)?;
    Ok(def)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{DropReason, MessageKey};

    fn envelope() -> Envelope {
        Envelope::new(MessageKey::derive(b"the cluster's token secret"))
    }

    fn def(group: u64, n: u32, name_len: usize) -> GroupDef {
        let members = (0..n)
            .map(|i| {
                let mut name = format!("u{i:06}-");
                name.push_str(&"x".repeat(name_len.saturating_sub(name.len())));
                (name, i * 2 + 1)
            })
            .collect();
        GroupDef {
            group,
            membership: 7,
            next_ordinal: n * 2 + 1,
            members,
            admins: vec!["boss".into(), "u000001-x".into()],
            removed: false,
        }
    }

    fn roundtrip(d: &GroupDef, limits: &GroupLimits) -> Result<GroupDef, GroupDefect> {
        let e = envelope();
        let enc = encode(d, 99, limits, &e).unwrap();
        let header = open_header(&header_key(d.group), &enc.sealed, &e, limits)?;
        assert_eq!(header, enc.header);
        assemble(&header, &enc.chunks, limits)
    }

    #[test]
    fn a_definition_round_trips() {
        let limits = GroupLimits::default();
        let d = def(5, 3, 10);
        assert_eq!(roundtrip(&d, &limits).unwrap(), d);
        let empty = GroupDef {
            members: Vec::new(),
            ..def(6, 0, 0)
        };
        let enc = encode(&empty, 1, &limits, &envelope()).unwrap();
        assert_eq!(enc.header.chunks, 0);
        assert_eq!(roundtrip(&empty, &limits).unwrap(), empty);
        let gone = GroupDef::tombstone(6, 12, 40);
        assert_eq!(roundtrip(&gone, &limits).unwrap(), gone);
    }

    #[test]
    fn ten_thousand_long_names_go_in_chunks_under_the_limit() {
        let limits = GroupLimits::default();
        let d = def(1, 10_000, 128);
        let enc = encode(&d, 3, &limits, &envelope()).unwrap();
        let total: usize = enc.chunks.iter().map(|c| c.len()).sum();
        assert!(total > 1_300_000, "{total}");
        assert_eq!(enc.chunks.len(), total.div_ceil(MAX_GROUP_CHUNK_BYTES));
        assert!(enc.chunks.iter().all(|c| c.len() <= MAX_GROUP_CHUNK_BYTES));
        // The chunks nearly fill their limit: the size estimate is tight.
        assert!(enc.chunks[0].len() > MAX_GROUP_CHUNK_BYTES - 200);
        assert!(enc.sealed.len() < 4096);
        assert_eq!(roundtrip(&d, &limits).unwrap(), d);
        // The longest names, at the most members the limits allow.
        let widest = GroupLimits {
            max_members: 20_000,
            max_admins: 32,
        };
        assert!(widest.fit_in_chunks());
        let d = def(2, 20_000, MAX_USER_ID_LEN);
        assert_eq!(roundtrip(&d, &widest).unwrap(), d);
        assert!(!GroupLimits {
            max_members: u32::MAX,
            max_admins: 1
        }
        .fit_in_chunks());
    }

    #[test]
    fn a_changed_or_missing_chunk_does_not_assemble() {
        let limits = GroupLimits::default();
        let e = envelope();
        let d = def(1, 3_000, 128);
        let enc = encode(&d, 3, &limits, &e).unwrap();
        assert!(enc.chunks.len() >= 2);
        let mut changed = enc.chunks.clone();
        let mut bytes = changed[1].to_vec();
        bytes[10] ^= 1;
        changed[1] = Bytes::from(bytes);
        assert_eq!(
            assemble(&enc.header, &changed, &limits),
            Err(GroupDefect::DigestMismatch)
        );
        // Chunks of another write of the same group: the digest differs.
        let other = encode(&def(1, 3_000, 100), 4, &limits, &e).unwrap();
        assert_eq!(
            assemble(&enc.header, &other.chunks[..enc.chunks.len()], &limits),
            Err(GroupDefect::DigestMismatch)
        );
        assert!(matches!(
            assemble(&enc.header, &enc.chunks[1..], &limits),
            Err(GroupDefect::MissingChunk(_))
        ));
    }

    /// A header is read until it is rewritten, so its seal does not
    /// depend on the protocol versions its writer and reader speak.
    #[test]
    fn a_header_opens_whatever_protocol_versions_the_nodes_speak() {
        let limits = GroupLimits::default();
        let key = || MessageKey::derive(b"greendot test secret");
        let old = Envelope::speaking(key(), 3);
        let enc = encode(&def(1, 3, 8), 3, &limits, &old).unwrap();
        for own in [3, 4, 7] {
            let reader = Envelope::speaking(key(), own);
            assert_eq!(
                open_header("g.1", &enc.sealed, &reader, &limits).map(|h| h.membership),
                Ok(enc.header.membership),
                "a node of protocol {own}"
            );
        }
    }

    #[test]
    fn a_forged_or_moved_header_does_not_open() {
        let limits = GroupLimits::default();
        let e = envelope();
        let enc = encode(&def(1, 3, 8), 3, &limits, &e).unwrap();
        // Sealed with another cluster's key.
        let other = Envelope::new(MessageKey::derive(b"another secret"));
        let forged = encode(&def(1, 3, 8), 3, &limits, &other).unwrap();
        assert_eq!(
            open_header("g.1", &forged.sealed, &e, &limits),
            Err(GroupDefect::Dropped("forged"))
        );
        // Copied under another group's key: the tag covers the key.
        assert_eq!(
            open_header("g.2", &enc.sealed, &e, &limits),
            Err(GroupDefect::Dropped("forged"))
        );
        // A payload sealed on the right key that names another group.
        let payload = postcard::to_allocvec(&enc.header).unwrap();
        let moved = e.seal_record("g.2", &payload);
        assert_eq!(
            open_header("g.2", &moved, &e, &limits),
            Err(GroupDefect::WrongGroup { found: 1 })
        );
        // Sealed as a message on the key, not as a record: refused.
        assert_eq!(
            open_header("g.1", &e.seal("g.1", &payload), &e, &limits),
            Err(GroupDefect::Dropped("version"))
        );
        // Garbage that is sealed: undecodable, not a panic.
        let junk = e.seal_record("g.1", b"\xff\xff\xff");
        assert_eq!(
            open_header("g.1", &junk, &e, &limits),
            Err(GroupDefect::Undecodable { chunk: None })
        );
        assert_eq!(
            open_header("g.1", &Bytes::new(), &e, &limits),
            Err(GroupDefect::Dropped("malformed"))
        );
        assert_eq!(e.drops().get(DropReason::Forged), 2);
    }

    #[test]
    fn limits_are_checked_on_write_and_on_read() {
        let limits = GroupLimits {
            max_members: 10,
            max_admins: 2,
        };
        let e = envelope();
        let refused = |d: &GroupDef| encode(d, 1, &limits, &e).unwrap_err();
        assert_eq!(
            refused(&def(1, 11, 4)),
            GroupLimitError::TooManyMembers {
                members: 11,
                max: 10
            }
        );
        let mut d = def(1, 3, 4);
        d.admins.push("third".into());
        assert!(matches!(
            refused(&d),
            GroupLimitError::TooManyAdmins { admins: 3, .. }
        ));
        let mut d = def(1, 3, 4);
        d.members[1].0 = "y".repeat(MAX_USER_ID_LEN + 1);
        assert_eq!(
            refused(&d),
            GroupLimitError::BadName {
                len: MAX_USER_ID_LEN + 1
            }
        );
        let mut d = def(1, 3, 4);
        d.admins[0] = String::new();
        assert_eq!(refused(&d), GroupLimitError::BadName { len: 0 });
        let mut d = def(1, 3, 4);
        d.members[2].0 = d.members[0].0.clone();
        assert!(matches!(refused(&d), GroupLimitError::Duplicate { .. }));
        let mut d = def(1, 3, 4);
        d.members.swap(0, 1);
        assert!(matches!(refused(&d), GroupLimitError::BadOrdinal { .. }));
        let mut d = def(1, 3, 4);
        d.next_ordinal = d.members[2].1;
        assert!(matches!(refused(&d), GroupLimitError::BadOrdinal { .. }));
        let mut d = GroupDef::tombstone(1, 2, 3);
        d.admins.push("a".into());
        assert_eq!(refused(&d), GroupLimitError::TombstoneWithMembers);

        // Written under larger limits, read under smaller ones: refused
        // from the header, before any chunk is read.
        let wide = GroupLimits::default();
        let enc = encode(&def(1, 11, 4), 1, &wide, &e).unwrap();
        assert_eq!(
            open_header("g.1", &enc.sealed, &e, &limits),
            Err(GroupDefect::OverLimit(GroupLimitError::TooManyMembers {
                members: 11,
                max: 10
            }))
        );
        // A header counting fewer members than its chunks hold.
        let mut enc = encode(&def(1, 5, 4), 1, &limits, &e).unwrap();
        enc.header.members = 4;
        assert_eq!(
            assemble(&enc.header, &enc.chunks, &limits),
            Err(GroupDefect::CountMismatch {
                header: 4,
                found: 5
            })
        );
        // An oversized chunk is refused before it is hashed or decoded.
        let mut enc = encode(&def(1, 5, 4), 1, &limits, &e).unwrap();
        enc.chunks[0] = Bytes::from(vec![0u8; MAX_GROUP_CHUNK_BYTES + 1]);
        assert!(matches!(
            assemble(&enc.header, &enc.chunks, &limits),
            Err(GroupDefect::OverLimit(
                GroupLimitError::ChunkTooLarge { .. }
            ))
        ));
    }

    #[test]
    fn header_keys_are_canonical() {
        assert_eq!(parse_header_key(&header_key(42)), Some(42));
        assert_eq!(parse_header_key(&header_key(u64::MAX)), Some(u64::MAX));
        for bad in ["g.042", "g.", "g.-1", "c.1.2.3", "g.1.2", "g.+1"] {
            assert_eq!(parse_header_key(bad), None, "{bad}");
        }
        assert_eq!(chunk_key(1, 2, 3), "c.1.2.3");
    }
}
