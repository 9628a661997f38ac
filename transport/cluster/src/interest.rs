//! Which shards a node subscribes to: a count of local watchers per shard.
//! The node holds one NATS subscription per shard with at least one local
//! watcher, never one per user or per watcher.

use std::collections::HashMap;

use crate::ids::ShardId;

#[derive(Debug, Default, Clone)]
pub struct ShardInterest {
    watchers: HashMap<ShardId, u32>,
}

impl ShardInterest {
    /// One more local watcher of `shard`; true when the node must subscribe
    /// (the first one).
    pub fn add(&mut self, shard: ShardId) -> bool {
        let n = self.watchers.entry(shard).or_insert(0);
        *n = n.saturating_add(1);
        *n == 1
    }

    /// One local watcher fewer; true when the node must unsubscribe (the
    /// last one). Removing a watcher that was never added changes nothing.
    pub fn remove(&mut self, shard: ShardId) -> bool {
        match self.watchers.get_mut(&shard) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.watchers.remove(&shard);
                true
            }
            None => false,
        }
    }

    pub fn watchers(&self, shard: ShardId) -> u32 {
        self.watchers.get(&shard).copied().unwrap_or(0)
    }

    pub fn shards(&self) -> impl Iterator<Item = ShardId> + '_ {
        self.watchers.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribe_on_first_unsubscribe_on_last() {
        let mut i = ShardInterest::default();
        let s = ShardId(7);
        assert!(i.add(s));
        assert!(!i.add(s));
        assert!(!i.add(s));
        assert_eq!(i.watchers(s), 3);
        assert!(!i.remove(s));
        assert!(!i.remove(s));
        assert!(i.remove(s));
        assert_eq!(i.shards().count(), 0);
        assert!(!i.remove(s), "an unknown watcher is ignored");
        assert!(i.add(s), "subscribes again after the last left");
    }
}
