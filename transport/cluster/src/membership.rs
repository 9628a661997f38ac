//! The live-node set, from the node-lease bucket's watch: pure state that the
//! watch's entries are applied to.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::ids::NodeId;
use crate::kv::{KvEntry, KvOp};
use crate::node::NodeInfo;

/// A live node: the revision of its lease's first write and of its latest
/// renewal, the value it wrote (its advertised data), and the incarnation
/// that value names (`None`: not a value a node wrote).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub since_revision: u64,
    pub revision: u64,
    pub value: Bytes,
    pub incarnation: Option<u64>,
}

fn incarnation_of(value: &[u8]) -> Option<u64> {
    NodeInfo::decode(value).map(|i| i.incarnation)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberEvent {
    Joined {
        node: NodeId,
        revision: u64,
    },
    /// `expired`: NATS removed the lease on its TTL (an expiry marker,
    /// `Purge`); otherwise the node deleted it when leaving.
    Left {
        node: NodeId,
        revision: u64,
        expired: bool,
    },
    /// The live lease now names another incarnation: the node restarted
    /// within its TTL and took its lease over, so the previous run is gone
    /// without its lease ever expiring.
    Restarted {
        node: NodeId,
        incarnation: u64,
        revision: u64,
    },
}

#[derive(Debug, Clone, Default)]
pub struct Membership {
    live: BTreeMap<NodeId, Member>,
}

impl Membership {
    /// Applies one entry of the lease bucket; returns what changed. Entries
    /// older than what is known, and keys that are no node id, change nothing.
    pub fn apply(&mut self, entry: &KvEntry) -> Option<MemberEvent> {
        let node = NodeId::new(entry.key.as_str()).ok()?;
        match entry.op {
            KvOp::Put => match self.live.get_mut(&node) {
                Some(member) => {
                    if entry.revision <= member.revision {
                        return None;
                    }
                    member.revision = entry.revision;
                    member.value = entry.value.clone();
                    let incarnation = incarnation_of(&entry.value);
                    match incarnation {
                        Some(i) if member.incarnation != incarnation => {
                            member.incarnation = incarnation;
                            Some(MemberEvent::Restarted {
                                node,
                                incarnation: i,
                                revision: entry.revision,
                            })
                        }
                        _ => None,
                    }
                }
                None => {
                    self.live.insert(
                        node.clone(),
                        Member {
                            since_revision: entry.revision,
                            revision: entry.revision,
                            value: entry.value.clone(),
                            incarnation: incarnation_of(&entry.value),
                        },
                    );
                    Some(MemberEvent::Joined {
                        node,
                        revision: entry.revision,
                    })
                }
            },
            KvOp::Delete | KvOp::Purge => {
                let member = self.live.get(&node)?;
                if entry.revision <= member.revision {
                    return None;
                }
                self.live.remove(&node);
                Some(MemberEvent::Left {
                    node,
                    revision: entry.revision,
                    expired: entry.op == KvOp::Purge,
                })
            }
        }
    }

    pub fn live(&self) -> impl Iterator<Item = &NodeId> {
        self.live.keys()
    }

    pub fn is_live(&self, node: &NodeId) -> bool {
        self.live.contains_key(node)
    }

    /// Every live node with what its lease says.
    pub fn members(&self) -> impl Iterator<Item = (&NodeId, &Member)> {
        self.live.iter()
    }

    pub fn member(&self, node: &NodeId) -> Option<&Member> {
        self.live.get(node)
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, op: KvOp, revision: u64) -> KvEntry {
        KvEntry {
            key: key.into(),
            op,
            revision,
            value: Bytes::from_static(b"addr"),
        }
    }

    #[test]
    fn join_renew_expire() {
        let mut m = Membership::default();
        let n1 = NodeId::new("n1").unwrap();
        assert_eq!(
            m.apply(&entry("n1", KvOp::Put, 3)),
            Some(MemberEvent::Joined {
                node: n1.clone(),
                revision: 3
            })
        );
        assert_eq!(
            m.apply(&entry("n1", KvOp::Put, 7)),
            None,
            "a renewal is no join"
        );
        assert_eq!(m.member(&n1).unwrap().since_revision, 3);
        assert_eq!(m.member(&n1).unwrap().revision, 7);
        assert_eq!(
            m.apply(&entry("n1", KvOp::Purge, 9)),
            Some(MemberEvent::Left {
                node: n1.clone(),
                revision: 9,
                expired: true
            })
        );
        assert!(!m.is_live(&n1));
        assert_eq!(
            m.apply(&entry("n1", KvOp::Purge, 9)),
            None,
            "a gone node leaves once"
        );
    }

    fn lease(incarnation: u64, renewed_ms: u64, revision: u64) -> KvEntry {
        let info = NodeInfo {
            advertise: "n1.example:4433".into(),
            started_ms: incarnation,
            incarnation,
            renewed_ms,
            shard_count: 64,
            lease_ttl_ms: 2000,
            http: None,
        };
        KvEntry {
            key: "n1".into(),
            op: KvOp::Put,
            revision,
            value: info.encode(),
        }
    }

    #[test]
    fn a_lease_taken_over_by_a_new_incarnation_is_a_restart() {
        let mut m = Membership::default();
        let n1 = NodeId::new("n1").unwrap();
        assert!(matches!(
            m.apply(&lease(100, 100, 3)),
            Some(MemberEvent::Joined { .. })
        ));
        assert_eq!(m.member(&n1).unwrap().incarnation, Some(100));
        assert_eq!(m.apply(&lease(100, 600, 4)), None, "a renewal");
        assert_eq!(
            m.apply(&lease(900, 900, 6)),
            Some(MemberEvent::Restarted {
                node: n1.clone(),
                incarnation: 900,
                revision: 6
            })
        );
        assert_eq!(m.apply(&lease(900, 1400, 7)), None, "its renewal");
        assert_eq!(m.apply(&lease(100, 700, 5)), None, "an older write");
        assert_eq!(m.member(&n1).unwrap().incarnation, Some(900));
        // A value that is no node's: renewed as before, no restart.
        assert_eq!(m.apply(&entry("n1", KvOp::Put, 8)), None);
        assert_eq!(m.member(&n1).unwrap().incarnation, Some(900));
    }

    #[test]
    fn stale_and_foreign_entries_change_nothing() {
        let mut m = Membership::default();
        m.apply(&entry("n1", KvOp::Put, 5));
        assert_eq!(m.apply(&entry("n1", KvOp::Delete, 4)), None);
        assert_eq!(m.len(), 1);
        assert_eq!(m.apply(&entry("not.a.node", KvOp::Put, 6)), None);
        assert_eq!(m.len(), 1);
        let left = m.apply(&entry("n1", KvOp::Delete, 8));
        assert!(matches!(
            left,
            Some(MemberEvent::Left { expired: false, .. })
        ));
    }
}
