//! The envelope around every message one node sends another over NATS core
//! pub/sub (views, truths, requests, replies, resync requests, beacons): a
//! protocol version and an HMAC-SHA256 over the version, the subject and the
//! payload, keyed by a key derived from the token secret every node of a
//! cluster shares (docs/cluster.md "Trust boundary").
//!
//! Wire form: `version (1 byte) | tag (32 bytes) | payload`. The tag covers
//! the subject, so a message copied onto another subject (another shard's,
//! another edge's, a reply inbox) does not verify. It does not stop a
//! message from being replayed on its own subject: the protocol's numbers do
//! (a view or truth number already seen, a request id the owner already
//! took), as they do for NATS's own duplicates.
//!
//! A message that is too short, of a version this node does not read, or
//! whose tag does not verify is dropped and counted ([`DropCounts`]), never
//! handed on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use ring::hmac;

/// The inter-node protocol this build speaks: the envelope and the payloads
/// inside it (greendot-server's `cluster` wire types). Raised by one for
/// every change a node of the previous release could not read.
///
/// Rolling upgrades (docs/cluster.md): a node reads its own version and the
/// one before, and sends [`Envelope::send_version`], its own unless told to
/// send the previous one (`cluster_protocol`), which is what lets a release
/// that raises the version roll through a cluster of the previous one.
/// Version 0 is the unsigned, unversioned format of releases before the
/// envelope: never read.
///
/// Version 2: an edge connects a backgrounded device again in one step
/// (`ConnectInBackground`), and the shard's device record (a KV record)
/// keeps each device's foreground flag; nodes sending 1 send and write
/// what a node of version 1 reads.
///
/// Version 3: a connect says when its edge welcomed the session
/// (`ConnectWelcomed`), so that an owner orders a device's sessions at two
/// nodes; nodes sending 2 send the connects of version 2.
///
/// Version 4: group counts across nodes. Owners send their partial counts
/// to the owner of the group's home shard (a request a node of version 3
/// cannot decode), which publishes the sums on `<prefix>.groups`; nodes
/// sending 3 send neither and serve no group subscription.
///
/// Version 5: member pages across nodes. An edge asks the owner of the
/// group's home shard for a page's keys (a request a node of version 4
/// cannot decode); nodes sending 4 serve no member page.
pub const PROTOCOL_VERSION: u8 = 5;

/// The version byte of sealed KV records ([`Envelope::seal_record`]): never
/// a protocol version, which count up from 1.
pub const RECORD_SEAL: u8 = 0xff;

const TAG_LEN: usize = 32;
const HEADER_LEN: usize = 1 + TAG_LEN;
/// What the message key is derived under: a key of its own, so that a tag
/// on a cluster message can never serve as a token signature (HS256 uses the
/// secret itself) or the other way round.
const KEY_CONTEXT: &[u8] = b"greendot cluster v1";

/// The key of every node's message tags: HMAC-SHA256(token secret,
/// "greendot cluster v1"). Never printed.
#[derive(Clone)]
pub struct MessageKey(hmac::Key);

impl MessageKey {
    pub fn derive(token_secret: &[u8]) -> MessageKey {
        let outer = hmac::Key::new(hmac::HMAC_SHA256, token_secret);
        let derived = hmac::sign(&outer, KEY_CONTEXT);
        MessageKey(hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()))
    }
}

impl std::fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MessageKey(..)")
    }
}

/// Why a message from NATS was dropped before anything read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Its tag does not verify: not sent by a node holding the token secret,
    /// changed on the way, or sent on another subject.
    Forged,
    /// A protocol version this node does not read.
    Version,
    /// Shorter than the envelope itself.
    Malformed,
}

impl DropReason {
    pub fn label(self) -> &'static str {
        match self {
            DropReason::Forged => "forged",
            DropReason::Version => "version",
            DropReason::Malformed => "malformed",
        }
    }
}

/// Messages dropped by the envelope, by reason (shared by the node's feeds
/// and its requests; read by the metrics).
#[derive(Debug, Default)]
pub struct DropCounts {
    forged: AtomicU64,
    version: AtomicU64,
    malformed: AtomicU64,
}

impl DropCounts {
    pub(crate) fn count(&self, reason: DropReason) {
        let counter = match reason {
            DropReason::Forged => &self.forged,
            DropReason::Version => &self.version,
            DropReason::Malformed => &self.malformed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, reason: DropReason) -> u64 {
        match reason {
            DropReason::Forged => &self.forged,
            DropReason::Version => &self.version,
            DropReason::Malformed => &self.malformed,
        }
        .load(Ordering::Relaxed)
    }

    /// `greendot_cluster_rejected_total{reason=…}` in Prometheus's text format.
    pub fn render_metrics(&self) -> String {
        let mut out = String::from(
            "# HELP greendot_cluster_rejected_total Messages from other nodes dropped before \
             reading: forged (the tag does not verify), version (a protocol version this node \
             does not read), malformed (shorter than the envelope).\n\
             # TYPE greendot_cluster_rejected_total counter\n",
        );
        for reason in [
            DropReason::Forged,
            DropReason::Version,
            DropReason::Malformed,
        ] {
            out.push_str(&format!(
                "greendot_cluster_rejected_total{{reason=\"{}\"}} {}\n",
                reason.label(),
                self.get(reason)
            ));
        }
        out
    }
}

/// Seals what this node sends and opens what it receives.
#[derive(Debug, Clone)]
pub struct Envelope {
    key: MessageKey,
    /// The newest version this node reads (its build's).
    own: u8,
    send: u8,
    drops: Arc<DropCounts>,
}

impl Envelope {
    /// Sends and reads [`PROTOCOL_VERSION`] (and reads the one before).
    pub fn new(key: MessageKey) -> Envelope {
        Envelope::speaking(key, PROTOCOL_VERSION)
    }

    /// A node of a build whose own version is `own` (tests: a cluster of
    /// two releases).
    #[doc(hidden)]
    pub fn speaking(key: MessageKey, own: u8) -> Envelope {
        Envelope {
            key,
            own,
            send: own,
            drops: Arc::new(DropCounts::default()),
        }
    }

    /// Sends `version` instead of the build's own: the one before it, while
    /// nodes of the previous release are still in the cluster. `Err`: a
    /// version this node does not read (it must read what it sends).
    pub fn sending(mut self, version: u8) -> Result<Envelope, String> {
        if !self.reads(version) {
            return Err(format!(
                "cluster_protocol {version}: this build reads protocol {} and {} only",
                self.own.saturating_sub(1).max(1),
                self.own
            ));
        }
        self.send = version;
        Ok(self)
    }

    pub fn send_version(&self) -> u8 {
        self.send
    }

    /// Its own version and the one before (never 0: unsigned).
    pub fn reads(&self, version: u8) -> bool {
        version != 0 && (version == self.own || version.checked_add(1) == Some(self.own))
    }

    pub fn drops(&self) -> &Arc<DropCounts> {
        &self.drops
    }

    fn tag(&self, version: u8, subject: &str, payload: &[u8]) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(&self.key.0);
        ctx.update(&[version]);
        // The subject's length first: subject and payload cannot trade bytes.
        ctx.update(
            &u32::try_from(subject.len())
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        ctx.update(subject.as_bytes());
        ctx.update(payload);
        ctx.sign()
    }

    /// The message to publish on `subject`.
    pub fn seal(&self, subject: &str, payload: &[u8]) -> Bytes {
        self.seal_as(self.send, subject, payload)
    }

    fn seal_as(&self, version: u8, subject: &str, payload: &[u8]) -> Bytes {
        let tag = self.tag(version, subject, payload);
        let mut out = BytesMut::with_capacity(HEADER_LEN + payload.len());
        out.put_u8(version);
        out.put_slice(tag.as_ref());
        out.put_slice(payload);
        out.freeze()
    }

    /// A record to store under KV key `key`, sealed under
    /// [`RECORD_SEAL`] whatever this node sends: a record is read until it
    /// is rewritten, across any number of protocol versions, so its seal
    /// must not depend on them (its payload carries its own format
    /// version). The distinct version byte keeps records and messages
    /// apart: neither opens as the other.
    pub fn seal_record(&self, key: &str, payload: &[u8]) -> Bytes {
        self.seal_as(RECORD_SEAL, key, payload)
    }

    /// The payload of a record stored under `key`, or why it does not open.
    /// Counts nothing.
    pub fn check_record(&self, key: &str, record: &Bytes) -> Result<Bytes, DropReason> {
        if record.len() < HEADER_LEN {
            return Err(DropReason::Malformed);
        }
        if record[0] != RECORD_SEAL {
            return Err(DropReason::Version);
        }
        self.verify(RECORD_SEAL, key, record)
    }

    /// The payload of a message received on `subject`, or why it is dropped.
    /// Counts nothing (see [`Envelope::open`]).
    pub fn check(&self, subject: &str, message: &Bytes) -> Result<(u8, Bytes), DropReason> {
        if message.len() < HEADER_LEN {
            return Err(DropReason::Malformed);
        }
        let version = message[0];
        if !self.reads(version) {
            return Err(DropReason::Version);
        }
        self.verify(version, subject, message)
            .map(|payload| (version, payload))
    }

    /// The payload after the tag, if the tag is `version`'s over `subject`.
    fn verify(&self, version: u8, subject: &str, message: &Bytes) -> Result<Bytes, DropReason> {
        let expected = self.tag(version, subject, &message[HEADER_LEN..]);
        // Every byte compared whatever the first difference: the time taken
        // tells a forger nothing of the right tag.
        let diff = expected
            .as_ref()
            .iter()
            .zip(&message[1..HEADER_LEN])
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            return Err(DropReason::Forged);
        }
        Ok(message.slice(HEADER_LEN..))
    }

    /// [`Envelope::check`], counting a drop.
    pub fn open(&self, subject: &str, message: &Bytes) -> Option<Bytes> {
        match self.check(subject, message) {
            Ok((_, payload)) => Some(payload),
            Err(reason) => {
                self.drops.count(reason);
                tracing::debug!(
                    subject,
                    reason = reason.label(),
                    "dropped a cluster message"
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> MessageKey {
        MessageKey::derive(b"the cluster's token secret")
    }

    #[test]
    fn a_sealed_message_opens_on_its_subject_only() {
        let e = Envelope::new(key());
        let sealed = e.seal("gd.shard.7", b"a view");
        assert_eq!(sealed[0], PROTOCOL_VERSION);
        assert_eq!(
            e.open("gd.shard.7", &sealed).as_deref(),
            Some(&b"a view"[..])
        );
        // Replayed onto another shard's subject: forged.
        assert_eq!(e.check("gd.shard.8", &sealed), Err(DropReason::Forged));
        // Subject and payload cannot trade bytes.
        let shifted = e.seal("gd.shard.7a", b" view");
        assert_eq!(e.check("gd.shard.7", &shifted), Err(DropReason::Forged));
        assert_eq!(e.drops().get(DropReason::Forged), 0, "check counts nothing");
    }

    #[test]
    fn forged_changed_and_short_messages_are_dropped_and_counted() {
        let e = Envelope::new(key());
        let other = Envelope::new(MessageKey::derive(b"another secret"));
        let subject = "gd.req.3.input";
        // Signed with another key (a node of another cluster, or a guess).
        assert_eq!(e.open(subject, &other.seal(subject, b"x")), None);
        // One payload bit changed on the way.
        let mut changed = e.seal(subject, b"logout").to_vec();
        *changed.last_mut().unwrap() ^= 1;
        assert_eq!(e.open(subject, &Bytes::from(changed)), None);
        // A payload of the old unsigned format: version 0 is never read.
        let mut unsigned = vec![0u8; HEADER_LEN];
        unsigned.extend_from_slice(b"postcard");
        assert_eq!(e.open(subject, &Bytes::from(unsigned)), None);
        // Shorter than the envelope, empty included.
        assert_eq!(e.open(subject, &Bytes::new()), None);
        assert_eq!(
            e.open(subject, &Bytes::from_static(&[1; HEADER_LEN - 1])),
            None
        );
        let d = e.drops();
        assert_eq!(
            (
                d.get(DropReason::Forged),
                d.get(DropReason::Version),
                d.get(DropReason::Malformed)
            ),
            (2, 1, 2)
        );
        let text = d.render_metrics();
        assert!(
            text.contains("greendot_cluster_rejected_total{reason=\"forged\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("greendot_cluster_rejected_total{reason=\"malformed\"} 2\n"),
            "{text}"
        );
        // The key is never printed.
        assert_eq!(format!("{:?}", key()), "MessageKey(..)");
    }

    /// The rolling-upgrade rule, between a build of version N and one of
    /// N + 1: the newer reads both and, told to, sends N; the older drops
    /// N + 1 (an unknown, future version) and counts it.
    #[test]
    fn two_versions_in_one_cluster() {
        let n = PROTOCOL_VERSION + 1;
        let old = Envelope::speaking(key(), n - 1);
        let new = Envelope::speaking(key(), n);
        let subject = "gd.beacon";

        // A message of version N - 1 is read by a node of version N.
        let from_old = old.seal(subject, b"beacon");
        assert_eq!(from_old[0], n - 1);
        assert_eq!(
            new.open(subject, &from_old).as_deref(),
            Some(&b"beacon"[..])
        );

        // A node of version N sending its own: the older node drops it.
        let from_new = new.seal(subject, b"beacon");
        assert_eq!(old.open(subject, &from_new), None);
        assert_eq!(old.drops().get(DropReason::Version), 1);

        // During the roll the newer node sends N - 1: read by both.
        let rolling = Envelope::speaking(key(), n).sending(n - 1).unwrap();
        let sent = rolling.seal(subject, b"beacon");
        assert_eq!(old.open(subject, &sent).as_deref(), Some(&b"beacon"[..]));
        assert_eq!(new.open(subject, &sent).as_deref(), Some(&b"beacon"[..]));

        // A version two ahead, or two behind, is read by neither.
        let far = Envelope::speaking(key(), n + 1).seal(subject, b"beacon");
        assert_eq!(new.check(subject, &far), Err(DropReason::Version));
        let ancient = Envelope::speaking(key(), n + 2);
        assert_eq!(ancient.check(subject, &from_old), Err(DropReason::Version));
        // A build never sends what it cannot read itself, nor version 0.
        assert!(Envelope::speaking(key(), n).sending(n + 1).is_err());
        assert!(Envelope::speaking(key(), n).sending(n - 2).is_err());
        assert!(Envelope::speaking(key(), 1).sending(0).is_err());
        assert_eq!(Envelope::new(key()).send_version(), PROTOCOL_VERSION);
    }

    #[test]
    fn the_key_is_derived_not_the_secret() {
        // A tag made with the token secret itself (as a token's HS256
        // signature is) does not verify as a cluster message.
        let secret = b"the cluster's token secret";
        let raw = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let e = Envelope::new(MessageKey::derive(secret));
        let subject = "gd.resync";
        let mut signed = vec![PROTOCOL_VERSION];
        signed.extend_from_slice(&(subject.len() as u32).to_be_bytes());
        signed.extend_from_slice(subject.as_bytes());
        signed.extend_from_slice(b"resync");
        let tag = hmac::sign(&raw, &signed);
        let mut message = vec![PROTOCOL_VERSION];
        message.extend_from_slice(tag.as_ref());
        message.extend_from_slice(b"resync");
        assert_eq!(
            e.check(subject, &Bytes::from(message)),
            Err(DropReason::Forged)
        );
        // The same construction with the derived key verifies: the test
        // above fails for the key alone.
        let derived = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, secret), KEY_CONTEXT);
        let tag = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()),
            &signed,
        );
        let mut message = vec![PROTOCOL_VERSION];
        message.extend_from_slice(tag.as_ref());
        message.extend_from_slice(b"resync");
        assert!(e.check(subject, &Bytes::from(message)).is_ok());
    }
}
