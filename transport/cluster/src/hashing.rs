//! Placement: user → shard, shard → owner. Pure and identical on every node
//! (a fixed hash, never `RandomState`), so all nodes agree without talking.

use crate::ids::{NodeId, ShardId};

/// FNV-1a over `bytes`, then a SplitMix64 finaliser so that nearby inputs
/// land far apart.
fn hash64(seed: u64, bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The shard of `user` among `shard_count` shards (`shard_count` ≥ 1).
pub fn shard_of(user: &str, shard_count: u32) -> ShardId {
    let count = u64::from(shard_count.max(1));
    ShardId((hash64(0, user.as_bytes()) % count) as u32)
}

/// The rendezvous (highest random weight) score of `node` for `shard`.
fn score(node: &NodeId, shard: ShardId) -> u64 {
    mix(hash64(1, node.as_str().as_bytes()) ^ mix(u64::from(shard.0) ^ 0x9e37_79b9_7f4a_7c15))
}

/// The node that should own `shard` among `live` nodes: the highest score,
/// ties broken by the larger id. `None` when no node is live.
///
/// When a node leaves, only its shards move; when one joins, it takes about
/// `1/n` of the shards from the others and nothing else moves.
pub fn rendezvous_owner<'a>(
    shard: ShardId,
    live: impl IntoIterator<Item = &'a NodeId>,
) -> Option<&'a NodeId> {
    live.into_iter()
        .max_by(|a, b| score(a, shard).cmp(&score(b, shard)).then_with(|| a.cmp(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(names: &[&str]) -> Vec<NodeId> {
        names.iter().map(|n| NodeId::new(*n).unwrap()).collect()
    }

    /// Pinned values (worked out apart from this code, from FNV-1a and
    /// SplitMix64 as written above): every node of every version must map
    /// users to shards, and shards to owners, the same way, or a rolling
    /// upgrade moves users between owners that disagree about who holds
    /// them. A change that moves any of these is a change of the cluster
    /// protocol, not a refactoring.
    #[test]
    fn placement_is_pinned_across_versions() {
        assert_eq!(hash64(0, b"alice"), 0xc5d1_556d_6677_4a5c);
        assert_eq!(hash64(0, b""), 0xf52a_15e9_a9b5_e89b);
        for (user, of_4096, of_64) in [
            ("alice", 2652, 28),
            ("bob", 3564, 44),
            ("user0", 2270, 30),
            ("user1", 89, 25),
            ("zo\u{eb}", 2426, 58),
        ] {
            assert_eq!(shard_of(user, 4096), ShardId(of_4096), "{user}");
            assert_eq!(shard_of(user, 64), ShardId(of_64), "{user}");
        }
        let n = nodes(&["n1", "n2", "n3"]);
        let abc = nodes(&["a", "b", "c"]);
        for (shard, of_n, of_abc) in [
            (0, "n3", "c"),
            (1, "n1", "b"),
            (2, "n2", "a"),
            (3, "n3", "b"),
            (4095, "n1", "a"),
        ] {
            let owner = |live: &[NodeId]| rendezvous_owner(ShardId(shard), live).unwrap().clone();
            assert_eq!(owner(&n).as_str(), of_n, "shard {shard}");
            assert_eq!(owner(&abc).as_str(), of_abc, "shard {shard}");
        }
    }

    #[test]
    fn shard_of_is_in_range() {
        for i in 0..10_000 {
            assert!(shard_of(&format!("user{i}"), 4096).0 < 4096);
        }
        assert_eq!(shard_of("anyone", 1), ShardId(0));
        assert_eq!(
            shard_of("anyone", 0),
            ShardId(0),
            "a zero count is treated as one shard"
        );
    }

    #[test]
    fn shards_spread_evenly() {
        let mut counts = vec![0u32; 16];
        for i in 0..16_000 {
            counts[shard_of(&format!("user{i}"), 16).0 as usize] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "uneven shard: {c}");
        }
    }

    #[test]
    fn rendezvous_moves_only_the_leaving_nodes_shards() {
        let three = nodes(&["n1", "n2", "n3"]);
        let two = nodes(&["n1", "n3"]);
        let mut owned_by_n2 = 0;
        for s in 0..4096 {
            let shard = ShardId(s);
            let before = rendezvous_owner(shard, &three).unwrap();
            let after = rendezvous_owner(shard, &two).unwrap();
            if before.as_str() == "n2" {
                owned_by_n2 += 1;
            } else {
                assert_eq!(before, after, "shard {s} moved though its owner stayed");
            }
        }
        assert!(
            (1100..1650).contains(&owned_by_n2),
            "n2 owned {owned_by_n2} of 4096"
        );
    }

    #[test]
    fn rendezvous_ignores_order_and_handles_empty() {
        let a = nodes(&["n1", "n2", "n3"]);
        let b = nodes(&["n3", "n1", "n2"]);
        for s in 0..256 {
            assert_eq!(
                rendezvous_owner(ShardId(s), &a),
                rendezvous_owner(ShardId(s), &b)
            );
        }
        assert_eq!(rendezvous_owner(ShardId(0), &Vec::<NodeId>::new()), None);
    }
}
