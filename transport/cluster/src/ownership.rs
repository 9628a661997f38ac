//! Shard claims and who should own what: pure decisions over the claim
//! table, the live-node set and an explicit `now`.
//!
//! A claim is the KV key `<shard>` of the claims bucket, written by
//! compare-and-set with the claim TTL; its value is `<owner>@<epoch>`. The
//! shard's **epoch** comes from its counter `epoch.<shard>` (same bucket, no
//! TTL), which a claimer bumps by compare-and-set before it writes the claim:
//! epochs of a shard are small, dense and only grow, even after a claim
//! expired (the core keeps the epoch in a version's high 24 bits, so the
//! stream-wide revision, which every renewal of every shard raises, would
//! not fit for long).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use bytes::Bytes;

use crate::hashing::rendezvous_owner;
use crate::ids::{NodeId, ShardId};
use crate::kv::{KvEntry, KvOp};
use crate::membership::Membership;
use crate::tenure::Tenure;

/// A shard's claim as the KV holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimState {
    /// Never claimed (`revision` 0), released (a delete marker) or expired
    /// (an expiry marker): the next claim must compare-and-set on `revision`.
    Free {
        revision: u64,
    },
    Held(ClaimRecord),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRecord {
    pub owner: NodeId,
    pub epoch: u64,
    /// The latest write (renewal) of the claim.
    pub revision: u64,
}

/// The value of a claim write.
pub fn encode_claim(owner: &NodeId, epoch: u64) -> Bytes {
    Bytes::from(format!("{owner}@{epoch}"))
}

/// Reads a claim entry; `None` when the value is not a claim (written by
/// something else: ignored rather than trusted).
pub fn decode_claim(entry: &KvEntry) -> Option<ClaimState> {
    match entry.op {
        KvOp::Delete | KvOp::Purge => Some(ClaimState::Free {
            revision: entry.revision,
        }),
        KvOp::Put => {
            let text = std::str::from_utf8(&entry.value).ok()?;
            let (owner, epoch) = text.split_once('@')?;
            Some(ClaimState::Held(ClaimRecord {
                owner: NodeId::new(owner).ok()?,
                epoch: epoch.parse().ok()?,
                revision: entry.revision,
            }))
        }
    }
}

/// The KV key of a shard's epoch counter (not a shard key: the claim watch
/// skips it).
pub fn epoch_key(shard: ShardId) -> String {
    format!("epoch.{}", shard.0)
}

/// The highest epoch a shard may have: owners' versions carry the epoch
/// above their 40 low bits (greendot-core's `EPOCH_SHIFT`), so an epoch of
/// 2^24 or more would wrap a version to below the first owner's, and
/// watchers would drop every view after it. 16,777,215 claims of one shard:
/// 32 years at one ownership change a minute.
pub const MAX_EPOCH: u64 = (1 << 24) - 1;

/// The epoch after `current`, or `None` when it would pass [`MAX_EPOCH`]
/// (the shard must not be claimed again: see docs/cluster.md "Epochs").
pub fn next_epoch(current: u64) -> Option<u64> {
    current.checked_add(1).filter(|e| *e <= MAX_EPOCH)
}

pub fn shard_key(shard: ShardId) -> String {
    shard.0.to_string()
}

pub fn parse_shard_key(key: &str, shard_count: u32) -> Option<ShardId> {
    let n: u32 = key.parse().ok()?;
    (n < shard_count && key == n.to_string()).then_some(ShardId(n))
}

/// Every shard's claim, from the claims bucket's watch.
#[derive(Debug, Clone, Default)]
pub struct ClaimTable {
    shards: HashMap<ShardId, ClaimState>,
}

impl ClaimTable {
    /// Applies one entry; returns the shard and its new state when it changed.
    pub fn apply(&mut self, entry: &KvEntry, shard_count: u32) -> Option<(ShardId, ClaimState)> {
        let shard = parse_shard_key(&entry.key, shard_count)?;
        let state = decode_claim(entry)?;
        let known = self.shards.get(&shard).map(|s| match s {
            ClaimState::Free { revision } => *revision,
            ClaimState::Held(r) => r.revision,
        });
        if known.is_some_and(|k| entry.revision <= k) {
            return None;
        }
        self.shards.insert(shard, state.clone());
        Some((shard, state))
    }

    /// Whether some node holds a claim (so renewals keep the watch busy).
    pub fn any_held(&self) -> bool {
        self.shards
            .values()
            .any(|s| matches!(s, ClaimState::Held(_)))
    }

    pub fn get(&self, shard: ShardId) -> ClaimState {
        self.shards
            .get(&shard)
            .cloned()
            .unwrap_or(ClaimState::Free { revision: 0 })
    }
}

/// A shard this node holds: its epoch, the latest revision it wrote, and
/// until when it may act as the shard's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldShard {
    pub shard: ShardId,
    pub epoch: u64,
    pub revision: u64,
    pub tenure: Tenure,
}

impl HeldShard {
    pub fn may_act_until(&self) -> Instant {
        self.tenure.may_act_until()
    }
}

/// What the node should do about one shard's claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimAction {
    /// This node should own the shard and it is free: compare-and-set on
    /// `expected_revision`.
    Claim {
        shard: ShardId,
        expected_revision: u64,
    },
    /// Held here and its renewal is due.
    Renew { shard: ShardId },
    /// Held here but another live node should own it now: stop acting, then
    /// delete the claim (so the other node need not wait for the TTL).
    Release { shard: ShardId },
}

/// The shards this node holds, and the plan for all shards.
#[derive(Debug, Clone)]
pub struct Ownership {
    me: NodeId,
    shard_count: u32,
    held: BTreeMap<ShardId, HeldShard>,
}

impl Ownership {
    pub fn new(me: NodeId, shard_count: u32) -> Ownership {
        Ownership {
            me,
            shard_count,
            held: BTreeMap::new(),
        }
    }

    pub fn held(&self) -> impl Iterator<Item = &HeldShard> {
        self.held.values()
    }

    pub fn get(&self, shard: ShardId) -> Option<&HeldShard> {
        self.held.get(&shard)
    }

    /// Records a won or renewed claim.
    pub fn insert(&mut self, held: HeldShard) {
        self.held.insert(held.shard, held);
    }

    pub fn remove(&mut self, shard: ShardId) -> Option<HeldShard> {
        self.held.remove(&shard)
    }

    /// The epoch under which this node may act for `shard` at `now`, if any.
    pub fn acting_epoch(&self, shard: ShardId, now: Instant, lease_until: Instant) -> Option<u64> {
        let held = self.held.get(&shard)?;
        (now < held.may_act_until().min(lease_until)).then_some(held.epoch)
    }

    /// Drops the shards the node may no longer act for at `now`: their claim
    /// was not renewed in time, or the node's own lease is about to run out
    /// (`lease_until`, its `may_act_until`): owning never outlives the lease.
    /// Returns them; the caller stops acting for them.
    pub fn stop_expired(&mut self, now: Instant, lease_until: Instant) -> Vec<HeldShard> {
        let expired: Vec<ShardId> = self
            .held
            .values()
            .filter(|h| now >= h.may_act_until().min(lease_until))
            .map(|h| h.shard)
            .collect();
        expired
            .into_iter()
            .filter_map(|s| self.held.remove(&s))
            .collect()
    }

    /// The earliest instant at which `stop_expired` would drop a shard.
    pub fn next_deadline(&self, lease_until: Instant) -> Option<Instant> {
        self.held
            .values()
            .map(|h| h.may_act_until().min(lease_until))
            .min()
    }

    /// What to do about every shard, given the live nodes and the claim
    /// table. Claims the shards that rendezvous hashing gives to this node
    /// when they are free, or held in this node's own name: a claim it
    /// stopped acting for (renewals failed past its deadline) or a claim
    /// write it gave up on that landed. Those are taken back at once by
    /// compare-and-set on their revision, under a new epoch, instead of
    /// waiting for NATS to expire them: an expiry marker a stalled watch
    /// never delivers would leave the shard unowned for good. Never takes a
    /// claim another node holds (its TTL frees it).
    pub fn plan(
        &self,
        members: &Membership,
        claims: &ClaimTable,
        now: Instant,
    ) -> Vec<ClaimAction> {
        let mut actions = Vec::new();
        let live: Vec<&NodeId> = members.live().collect();
        for s in 0..self.shard_count {
            let shard = ShardId(s);
            let desired = rendezvous_owner(shard, live.iter().copied());
            match self.held.get(&shard) {
                Some(held) => {
                    if desired.is_some_and(|d| *d != self.me) {
                        actions.push(ClaimAction::Release { shard });
                    } else if now >= held.tenure.renew_at() {
                        actions.push(ClaimAction::Renew { shard });
                    }
                }
                None => {
                    if desired == Some(&self.me) {
                        let revision = match claims.get(shard) {
                            ClaimState::Free { revision } => Some(revision),
                            ClaimState::Held(r) if r.owner == self.me => Some(r.revision),
                            ClaimState::Held(_) => None,
                        };
                        if let Some(revision) = revision {
                            actions.push(ClaimAction::Claim {
                                shard,
                                expected_revision: revision,
                            });
                        }
                    }
                }
            }
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn epochs_stop_before_versions_would_wrap() {
        assert_eq!(super::next_epoch(0), Some(1));
        assert_eq!(
            super::next_epoch(super::MAX_EPOCH - 1),
            Some(super::MAX_EPOCH)
        );
        assert_eq!(super::next_epoch(super::MAX_EPOCH), None);
        assert_eq!(super::next_epoch(u64::MAX), None);
        // The last epoch's versions still fit above 40 bits.
        assert_eq!((super::MAX_EPOCH << 40) >> 40, super::MAX_EPOCH);
        assert_ne!(((super::MAX_EPOCH + 1) << 40) >> 40, super::MAX_EPOCH + 1);
    }

    use super::*;
    use crate::tenure::LeaseTiming;
    use std::time::Duration;

    const TIMING: LeaseTiming = LeaseTiming {
        ttl: Duration::from_secs(2),
        margin: Duration::from_millis(500),
    };

    fn node(n: &str) -> NodeId {
        NodeId::new(n).unwrap()
    }

    fn put(key: &str, value: &str, revision: u64) -> KvEntry {
        KvEntry {
            key: key.into(),
            op: KvOp::Put,
            revision,
            value: Bytes::from(value.to_owned()),
        }
    }

    fn members(names: &[&str]) -> Membership {
        let mut m = Membership::default();
        for (i, n) in names.iter().enumerate() {
            m.apply(&put(n, "", i as u64 + 1));
        }
        m
    }

    #[test]
    fn claim_values_round_trip() {
        let n1 = node("n1");
        let claim = put("5", std::str::from_utf8(&encode_claim(&n1, 3)).unwrap(), 44);
        assert_eq!(
            decode_claim(&claim),
            Some(ClaimState::Held(ClaimRecord {
                owner: n1,
                epoch: 3,
                revision: 44
            }))
        );
        assert_eq!(decode_claim(&put("5", "n1", 44)), None, "no epoch");
        assert_eq!(decode_claim(&put("5", "n1@x", 44)), None);
        assert_eq!(decode_claim(&put("5", "bad node@1", 44)), None);
        let marker = KvEntry {
            key: "5".into(),
            op: KvOp::Purge,
            revision: 50,
            value: Bytes::new(),
        };
        assert_eq!(
            decode_claim(&marker),
            Some(ClaimState::Free { revision: 50 })
        );
    }

    #[test]
    fn shard_keys_are_canonical_and_in_range() {
        assert_eq!(parse_shard_key("17", 4096), Some(ShardId(17)));
        assert_eq!(parse_shard_key("017", 4096), None);
        assert_eq!(parse_shard_key("4096", 4096), None);
        assert_eq!(parse_shard_key("x", 4096), None);
        assert_eq!(
            parse_shard_key(&epoch_key(ShardId(3)), 4096),
            None,
            "counters are no claims"
        );
    }

    #[test]
    fn claim_table_ignores_stale_entries() {
        let mut t = ClaimTable::default();
        assert!(t.apply(&put("1", "n1@1", 10), 8).is_some());
        assert!(t.apply(&put("1", "n2@2", 9), 8).is_none());
        assert!(t.apply(&put("epoch.1", "5", 11), 8).is_none());
        assert!(matches!(t.get(ShardId(1)), ClaimState::Held(r) if r.owner.as_str() == "n1"));
        assert_eq!(t.get(ShardId(2)), ClaimState::Free { revision: 0 });
    }

    #[test]
    fn plan_claims_own_free_shards_and_waits_for_held_ones() {
        let m = members(&["n1", "n2"]);
        let me = Ownership::new(node("n1"), 64);
        let mut claims = ClaimTable::default();
        let now = Instant::now();
        let plan = me.plan(&m, &claims, now);
        let mine: Vec<ShardId> = (0..64)
            .map(ShardId)
            .filter(|s| rendezvous_owner(*s, m.live()) == Some(&node("n1")))
            .collect();
        assert!(!mine.is_empty() && mine.len() < 64);
        assert_eq!(
            plan,
            mine.iter()
                .map(|&shard| ClaimAction::Claim {
                    shard,
                    expected_revision: 0
                })
                .collect::<Vec<_>>()
        );
        // Held by n2 (say n2 owned it before n1 joined): n1 waits.
        claims.apply(&put(&mine[0].0.to_string(), "n2@1", 100), 64);
        let plan = me.plan(&m, &claims, now);
        assert!(!plan
            .iter()
            .any(|a| matches!(a, ClaimAction::Claim { shard, .. } if *shard == mine[0])));
        // Expired: claim on the marker's revision.
        claims.apply(
            &KvEntry {
                key: mine[0].0.to_string(),
                op: KvOp::Purge,
                revision: 120,
                value: Bytes::new(),
            },
            64,
        );
        let plan = me.plan(&m, &claims, now);
        assert!(plan.contains(&ClaimAction::Claim {
            shard: mine[0],
            expected_revision: 120
        }));
    }

    /// A claim in this node's own name that it does not hold (it stopped
    /// acting when renewals failed) is claimed again at once, on its
    /// revision: waiting for its expiry marker left shards unowned for good
    /// when the claim watch had stalled with the NATS node that died.
    #[test]
    fn plan_takes_back_a_claim_in_its_own_name_that_it_stopped_acting_for() {
        let m = members(&["n1", "n2"]);
        let me = Ownership::new(node("n1"), 64);
        let mine = (0..64)
            .map(ShardId)
            .find(|s| rendezvous_owner(*s, m.live()) == Some(&node("n1")))
            .unwrap();
        let mut claims = ClaimTable::default();
        claims.apply(&put(&mine.0.to_string(), "n1@7", 300), 64);
        let plan = me.plan(&m, &claims, Instant::now());
        assert!(
            plan.contains(&ClaimAction::Claim {
                shard: mine,
                expected_revision: 300
            }),
            "{plan:?}"
        );
    }

    #[test]
    fn plan_renews_when_due_and_releases_to_a_better_owner() {
        let t0 = Instant::now();
        let alone = members(&["n1"]);
        let both = members(&["n1", "n2"]);
        let mut me = Ownership::new(node("n1"), 64);
        for s in 0..64 {
            me.insert(HeldShard {
                shard: ShardId(s),
                epoch: 1,
                revision: 1,
                tenure: Tenure::granted(TIMING, t0),
            });
        }
        let claims = ClaimTable::default();
        assert!(me.plan(&alone, &claims, t0).is_empty(), "nothing due yet");
        let due = t0 + TIMING.renew_every();
        assert_eq!(me.plan(&alone, &claims, due).len(), 64);
        assert!(me
            .plan(&alone, &claims, due)
            .iter()
            .all(|a| matches!(a, ClaimAction::Renew { .. })));
        let plan = me.plan(&both, &claims, t0);
        for a in &plan {
            let ClaimAction::Release { shard } = a else {
                panic!("unexpected {a:?}")
            };
            assert_eq!(rendezvous_owner(*shard, both.live()), Some(&node("n2")));
        }
        assert!(!plan.is_empty());
    }

    #[test]
    fn stops_acting_at_the_claim_deadline_or_the_lease_deadline() {
        let t0 = Instant::now();
        let mut me = Ownership::new(node("n1"), 8);
        me.insert(HeldShard {
            shard: ShardId(1),
            epoch: 7,
            revision: 7,
            tenure: Tenure::granted(TIMING, t0),
        });
        let mut late = Tenure::granted(TIMING, t0);
        late.renewed(t0 + Duration::from_secs(1));
        me.insert(HeldShard {
            shard: ShardId(2),
            epoch: 9,
            revision: 12,
            tenure: late,
        });
        let far = t0 + Duration::from_secs(60);
        let claim_deadline = t0 + TIMING.act_window();
        assert_eq!(me.next_deadline(far), Some(claim_deadline));
        assert_eq!(
            me.acting_epoch(ShardId(1), claim_deadline - Duration::from_millis(1), far),
            Some(7)
        );
        assert_eq!(me.acting_epoch(ShardId(1), claim_deadline, far), None);
        assert!(me
            .stop_expired(claim_deadline - Duration::from_millis(1), far)
            .is_empty());
        let stopped = me.stop_expired(claim_deadline, far);
        assert_eq!(
            stopped.iter().map(|h| h.shard).collect::<Vec<_>>(),
            vec![ShardId(1)]
        );
        // The node's lease runs out first: shard 2 stops though its claim is fresh.
        let lease_until = t0 + Duration::from_millis(1600);
        assert_eq!(me.acting_epoch(ShardId(2), lease_until, lease_until), None);
        let stopped = me.stop_expired(lease_until, lease_until);
        assert_eq!(
            stopped.iter().map(|h| h.shard).collect::<Vec<_>>(),
            vec![ShardId(2)]
        );
        assert_eq!(me.held().count(), 0);
    }
}
