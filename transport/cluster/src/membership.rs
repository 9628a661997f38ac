//! The live-node set, from the node-lease bucket's watch: pure state that the
//! watch's entries are applied to.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::ids::NodeId;
use crate::kv::{KvEntry, KvOp};

/// A live node: the revision of its lease's first write (its incarnation)
/// and of its latest renewal, and the value it wrote (its advertised data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub since_revision: u64,
    pub revision: u64,
    pub value: Bytes,
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
                    if entry.revision > member.revision {
                        member.revision = entry.revision;
                        member.value = entry.value.clone();
                    }
                    None
                }
                None => {
                    self.live.insert(
                        node.clone(),
                        Member {
                            since_revision: entry.revision,
                            revision: entry.revision,
                            value: entry.value.clone(),
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
