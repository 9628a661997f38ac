//! A cluster of one: the bus and the KV of a node that is the whole cluster,
//! in process (docs/cluster.md "A cluster of one"). The node's edge and
//! owners run the same `ClusterLink` as in a cluster of many; what NATS
//! would carry, [`LocalBus`] hands straight back: a publish to the node's
//! own watches, a request to its own owners, a KV operation to a map kept
//! here with the same fences as the NATS buckets. The node acts for every
//! shard, with no lease to lose, under one epoch per start.
//!
//! Sans-IO: [`LocalBus::handle_output`] takes what the state asked,
//! [`LocalBus::poll_input`] gives what the state is handed next.

use super::{
    ClusterInput, ClusterOutput, ClusterSettings, GroupDef, GroupWriteOutcome, LinkMutant,
};
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// The node's name in its own messages.
pub const NODE: &str = "local";

/// The shards of a cluster of one: as many as a cluster has by default, so
/// an owner's step, its device record and its timers stay small (and the
/// shards could one day run on threads of their own).
pub const SHARDS: u32 = 64;

/// A user's shard: FNV-1a of the name (stable across releases, so that a
/// store kept across restarts finds its users where it left them).
fn shard_of(user: &str, shards: u32) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in user.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % u64::from(shards.max(1))) as u32
}

/// How long the node may act for its shards: nothing revokes them, so the
/// deadline only has to lie past any run.
const ACT_FOR: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The settings of a cluster of one started at `incarnation` (Unix
/// milliseconds): [`SHARDS`] shards, every message at the newest protocol.
pub fn settings(incarnation: u64) -> ClusterSettings {
    ClusterSettings {
        node: NODE.to_string(),
        incarnation,
        shard_count: SHARDS,
        shard_of,
        // Nothing in process is lost; a request unanswered this long is an
        // owner that waits on its own KV read, which answers at once here.
        request_timeout: Duration::from_secs(10),
        resync_window: Duration::ZERO,
        protocol: super::wire::PAGES_SINCE,
        mutant: None::<LinkMutant>,
    }
}

/// What the KV buckets of a cluster hold, in memory, with their fences: a
/// preference or device record write is refused over one of a higher
/// epoch or fence, and a group write only lands at the revision it read.
#[derive(Debug, Default)]
pub struct LocalKv {
    prefs: HashMap<String, (u64, Bytes)>,
    views: HashMap<String, Bytes>,
    shard_devices: HashMap<u32, (u64, Bytes)>,
    sessions: HashMap<(String, String), Bytes>,
    groups: BTreeMap<u64, (u64, GroupDef)>,
    /// The bucket's last revision (NATS KV revisions rise across keys).
    revision: u64,
    /// Writes refused by a fence.
    pub fenced: u64,
}

impl LocalKv {
    /// Stores a group's definition at the next revision, as a write made
    /// before the run (the simulator's groups); returns the revision.
    pub fn insert_group(&mut self, def: GroupDef) -> u64 {
        self.revision += 1;
        self.groups.insert(def.group, (self.revision, def));
        self.revision
    }

    /// Every group's revision and definition, as a watch of the bucket
    /// delivers them at its start.
    pub fn groups(&self) -> impl Iterator<Item = (u64, &GroupDef)> {
        self.groups.values().map(|(rev, def)| (*rev, def))
    }

    /// Applies a KV operation; what it answers goes to `answers`. `Err`
    /// gives back what is not a KV operation.
    pub fn apply(
        &mut self,
        op: ClusterOutput,
        answers: &mut VecDeque<ClusterInput>,
    ) -> Result<(), ClusterOutput> {
        match op {
            ClusterOutput::PutPrefs {
                id,
                user,
                epoch,
                value,
            } => {
                let fenced = self.prefs.get(&user).is_some_and(|(e, _)| *e > epoch);
                self.fenced += u64::from(fenced);
                if !fenced {
                    self.prefs.insert(user, (epoch, value));
                }
                answers.push_back(ClusterInput::PrefsStored { id, ok: !fenced });
            }
            ClusterOutput::LoadUser { id, user } => {
                answers.push_back(ClusterInput::UserLoaded {
                    id,
                    prefs: self.prefs.get(&user).map(|(_, v)| v.clone()),
                    view: self.views.get(&user).cloned(),
                });
            }
            ClusterOutput::PutView { user, value } => {
                self.views.insert(user, value);
            }
            ClusterOutput::PutShardDevices {
                shard,
                fence,
                value,
            } => {
                // A write without a fence counts as 0, as in the bucket.
                let fence = fence.unwrap_or(0);
                let fenced = self
                    .shard_devices
                    .get(&shard)
                    .is_some_and(|(written, _)| *written > fence);
                self.fenced += u64::from(fenced);
                if !fenced {
                    self.shard_devices.insert(shard, (fence, value));
                }
            }
            ClusterOutput::LoadShard { id, shard } => {
                answers.push_back(ClusterInput::ShardLoaded {
                    id,
                    record: self.shard_devices.get(&shard).map(|(_, v)| v.clone()),
                });
            }
            ClusterOutput::PutSession {
                id,
                user,
                device,
                value,
            } => {
                self.sessions.insert((user, device), value);
                answers.push_back(ClusterInput::SessionStored { id, ok: true });
            }
            ClusterOutput::LoadSession { id, user, device } => {
                answers.push_back(ClusterInput::SessionLoaded {
                    id,
                    record: self.sessions.get(&(user, device)).cloned(),
                });
            }
            ClusterOutput::DeleteSession { user, device } => {
                self.sessions.remove(&(user, device));
            }
            ClusterOutput::ReadGroup { id, group } => {
                let read = self
                    .groups
                    .get(&group)
                    .map_or((0, None), |(rev, def)| (*rev, Some(def.clone())));
                answers.push_back(ClusterInput::GroupRead { id, read: Ok(read) });
            }
            ClusterOutput::WriteGroup { id, def, expected } => {
                let stored = self.groups.get(&def.group).map_or(0, |(rev, _)| *rev);
                if stored != expected {
                    let outcome = GroupWriteOutcome::Conflict;
                    answers.push_back(ClusterInput::GroupWritten { id, outcome });
                    return Ok(());
                }
                self.revision += 1;
                let revision = self.revision;
                self.groups.insert(def.group, (revision, def.clone()));
                let outcome = GroupWriteOutcome::Written { revision };
                answers.push_back(ClusterInput::GroupWritten { id, outcome });
                // The groups bucket's watch sees the write after it lands.
                answers.push_back(ClusterInput::GroupChanged {
                    group: def.group,
                    revision,
                    def: Some(def),
                });
            }
            other => return Err(other),
        }
        Ok(())
    }
}

/// The in-process bus of a cluster of one, and its KV.
#[derive(Debug)]
pub struct LocalBus {
    node: String,
    shard_count: u32,
    /// Shards with a local watcher: a publish on one of them comes back.
    watched: HashSet<u32>,
    kv: LocalKv,
    inputs: VecDeque<ClusterInput>,
}

impl LocalBus {
    /// The bus of a node started at `now` with `settings`: its first inputs
    /// give it every shard at epoch 1, and say the (empty) groups bucket
    /// has been read.
    pub fn new(settings: &ClusterSettings, now: Instant) -> LocalBus {
        let until = now + ACT_FOR;
        let shards = (0..settings.shard_count).map(|s| (s, (1, until))).collect();
        let mut inputs = VecDeque::new();
        inputs.push_back(ClusterInput::Status { shards });
        inputs.push_back(ClusterInput::GroupsSynced);
        LocalBus {
            node: settings.node.clone(),
            shard_count: settings.shard_count,
            watched: HashSet::new(),
            kv: LocalKv::default(),
            inputs,
        }
    }

    /// Writes refused by a fence so far.
    pub fn fenced(&self) -> u64 {
        self.kv.fenced
    }

    /// What the state asked; what it is handed back waits in
    /// [`LocalBus::poll_input`].
    pub fn handle_output(&mut self, out: ClusterOutput) {
        let out = match self.kv.apply(out, &mut self.inputs) {
            Ok(()) => return,
            Err(out) => out,
        };
        let input = match out {
            ClusterOutput::Watch { shard } => {
                self.watched.insert(shard);
                return;
            }
            ClusterOutput::Unwatch { shard } => {
                self.watched.remove(&shard);
                return;
            }
            ClusterOutput::Publish { shard, payload } => {
                if !self.watched.contains(&shard) {
                    return;
                }
                ClusterInput::ShardMessage { shard, payload }
            }
            ClusterOutput::PublishToEdge { node, payload } => {
                if node != self.node {
                    return;
                }
                ClusterInput::EdgeMessage { payload }
            }
            ClusterOutput::Resync { payload } => ClusterInput::Resync { payload },
            ClusterOutput::Beacon { payload } => ClusterInput::Beacon { payload },
            ClusterOutput::GroupCounts { payload } => ClusterInput::GroupCounts { payload },
            // The edge asks its own owners in process; a request that
            // still comes here goes to them as NATS would bring it, and
            // its reply back under the request's own id.
            ClusterOutput::Request {
                id,
                shard,
                kind,
                payload,
            } => match shard < self.shard_count {
                true => ClusterInput::Request {
                    shard,
                    kind,
                    payload,
                    reply: id,
                },
                false => ClusterInput::Answered { id, payload: None },
            },
            ClusterOutput::Reply { reply, payload } => ClusterInput::Answered {
                id: reply,
                payload: Some(payload),
            },
            kv => unreachable!("a KV operation is applied above: {kv:?}"),
        };
        self.inputs.push_back(input);
    }

    /// The next input for the state.
    pub fn poll_input(&mut self) -> Option<ClusterInput> {
        self.inputs.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bus() -> LocalBus {
        let mut bus = LocalBus::new(&settings(1), Instant::now());
        assert!(
            matches!(bus.poll_input(), Some(ClusterInput::Status { shards }) if shards.len() == SHARDS as usize)
        );
        assert!(matches!(bus.poll_input(), Some(ClusterInput::GroupsSynced)));
        assert!(bus.poll_input().is_none());
        bus
    }

    #[test]
    fn a_publish_comes_back_only_while_its_shard_is_watched() {
        let mut bus = bus();
        let publish = || ClusterOutput::Publish {
            shard: 0,
            payload: Bytes::from_static(b"v"),
        };
        bus.handle_output(publish());
        assert!(bus.poll_input().is_none());
        bus.handle_output(ClusterOutput::Watch { shard: 0 });
        bus.handle_output(publish());
        assert!(matches!(
            bus.poll_input(),
            Some(ClusterInput::ShardMessage { shard: 0, .. })
        ));
        bus.handle_output(ClusterOutput::Unwatch { shard: 0 });
        bus.handle_output(publish());
        assert!(bus.poll_input().is_none());
    }

    #[test]
    fn a_preference_write_under_an_older_epoch_is_refused() {
        let mut bus = bus();
        let put = |id, epoch, value: &'static [u8]| ClusterOutput::PutPrefs {
            id,
            user: "alice".into(),
            epoch,
            value: Bytes::from_static(value),
        };
        bus.handle_output(put(1, 2, b"new"));
        bus.handle_output(put(2, 1, b"old"));
        assert!(matches!(
            bus.poll_input(),
            Some(ClusterInput::PrefsStored { id: 1, ok: true })
        ));
        assert!(matches!(
            bus.poll_input(),
            Some(ClusterInput::PrefsStored { id: 2, ok: false })
        ));
        bus.handle_output(ClusterOutput::LoadUser {
            id: 3,
            user: "alice".into(),
        });
        let Some(ClusterInput::UserLoaded { id: 3, prefs, .. }) = bus.poll_input() else {
            panic!("the read is answered");
        };
        assert_eq!(prefs.as_deref(), Some(&b"new"[..]));
        assert_eq!(bus.fenced(), 1);
    }

    #[test]
    fn a_group_write_lands_only_at_the_revision_it_read_and_is_watched() {
        let mut bus = bus();
        let def = GroupDef {
            group: 7,
            membership: 1,
            next_ordinal: 1,
            members: vec![("alice".into(), 0)],
            admins: vec![],
            removed: false,
        };
        let write = |id, expected| ClusterOutput::WriteGroup {
            id,
            def: def.clone(),
            expected,
        };
        bus.handle_output(write(1, 0));
        assert!(matches!(
            bus.poll_input(),
            Some(ClusterInput::GroupWritten {
                id: 1,
                outcome: GroupWriteOutcome::Written { revision: 1 }
            })
        ));
        assert!(matches!(
            bus.poll_input(),
            Some(ClusterInput::GroupChanged {
                group: 7,
                revision: 1,
                def: Some(_)
            })
        ));
        bus.handle_output(write(2, 0));
        assert!(matches!(
            bus.poll_input(),
            Some(ClusterInput::GroupWritten {
                id: 2,
                outcome: GroupWriteOutcome::Conflict
            })
        ));
        assert!(bus.poll_input().is_none());
    }

    #[test]
    fn a_request_reaches_the_nodes_own_owner_and_its_reply_the_asker() {
        let mut bus = bus();
        bus.handle_output(ClusterOutput::Request {
            id: 9,
            shard: 0,
            kind: super::super::RequestKind::Input,
            payload: Bytes::from_static(b"op"),
        });
        let Some(ClusterInput::Request { reply, .. }) = bus.poll_input() else {
            panic!("the owner is asked");
        };
        bus.handle_output(ClusterOutput::Reply {
            reply,
            payload: Bytes::from_static(b"done"),
        });
        assert!(matches!(
            bus.poll_input(),
            Some(ClusterInput::Answered {
                id: 9,
                payload: Some(_)
            })
        ));
    }
}
