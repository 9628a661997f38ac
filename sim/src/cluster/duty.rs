//! Node leases and shard claims, as greendot-cluster's duty task holds them
//! in the NATS KV: a lease per node and a claim per shard, each with a TTL
//! that starts when its write lands; a holder acts only until its write's
//! send time plus the act window (TTL − margin); shards go to their
//! rendezvous owner among the live leases, a holder that is not it
//! releases, and a free or expired claim is taken under the next epoch.
//!
//! The simulation writes claims and leases at once when the node can reach
//! the KV (the real duty task's writes take an operation's time); what it
//! keeps is the rule that matters to the data path: a node never acts past
//! its last successful write plus the act window, and nobody takes a claim
//! before its TTL since that write ran out.

use greendot_cluster::{rendezvous_owner, NodeId, ShardId};
use std::collections::BTreeMap;
use std::time::Duration;

/// Lease and claim TTL (the cluster's default).
pub const TTL: Duration = Duration::from_secs(15);
/// What a holder keeps before its key's earliest expiry.
pub const MARGIN: Duration = Duration::from_secs(3);
/// How often a node's duty runs.
pub const DUTY_EVERY: Duration = Duration::from_secs(1);

/// A shard's claim in the KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    pub node: usize,
    pub epoch: u64,
    pub expires: Duration,
}

/// A node's lease in the KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub incarnation: u64,
    pub expires: Duration,
    /// When the last renewal was written.
    pub renewed: Duration,
}

/// What changed at a duty pass that others hear of through their watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Membership {
    /// `node`'s lease expired; it was last renewed at `renewed`.
    Lost { node: usize, renewed: Duration },
    /// `node` holds a lease as a new incarnation.
    Restarted { node: usize, incarnation: u64 },
    /// `node` took its lease again, as the same incarnation, after it
    /// lapsed: told to the node itself.
    Rejoined { node: usize },
}

/// The KV's leases and claims, and each node's view of what it holds.
pub struct Duty {
    names: Vec<NodeId>,
    shards: u32,
    pub leases: Vec<Option<Lease>>,
    /// Lost leases already told.
    lost_told: Vec<bool>,
    pub claims: BTreeMap<u32, Claim>,
    epochs: BTreeMap<u32, u64>,
    /// Per node: the shards it holds, with epoch and act-until.
    pub held: Vec<BTreeMap<u32, (u64, Duration)>>,
    /// Per node: it may act until then (its lease's act window).
    pub lease_until: Vec<Duration>,
}

impl Duty {
    pub fn new(names: &[String], shards: u32) -> Duty {
        let n = names.len();
        Duty {
            names: names
                .iter()
                .map(|s| NodeId::new(s.clone()).expect("simulated node names are valid"))
                .collect(),
            shards,
            leases: vec![None; n],
            lost_told: vec![false; n],
            claims: BTreeMap::new(),
            epochs: BTreeMap::new(),
            held: vec![BTreeMap::new(); n],
            lease_until: vec![Duration::ZERO; n],
        }
    }

    /// A node's process ended: what it held it no longer knows.
    pub fn forget(&mut self, node: usize) {
        self.held[node].clear();
        self.lease_until[node] = Duration::ZERO;
    }

    /// Leases that ran out since the last call, each once.
    pub fn expire(&mut self, now: Duration) -> Vec<Membership> {
        let mut out = Vec::new();
        for node in 0..self.leases.len() {
            if let Some(lease) = self.leases[node] {
                if lease.expires <= now && !self.lost_told[node] {
                    self.lost_told[node] = true;
                    out.push(Membership::Lost {
                        node,
                        renewed: lease.renewed,
                    });
                }
            }
        }
        out
    }

    /// One duty pass of `node` (running as `incarnation`), which can reach
    /// the KV: renews its lease, releases, renews and takes claims.
    pub fn pass(&mut self, node: usize, incarnation: u64, now: Duration) -> Vec<Membership> {
        let mut out = Vec::new();
        // Claims past their act window were given up (the node stopped
        // acting); they are taken again under a new epoch, as the duty
        // task's plan does.
        let lease_until = self.lease_until[node];
        self.held[node].retain(|_, (_, until)| now < *until && now < lease_until);
        let fresh = match self.leases[node] {
            Some(lease) => lease.incarnation != incarnation || lease.expires <= now,
            None => true,
        };
        if fresh && self.leases[node].is_none_or(|l| l.incarnation != incarnation) {
            out.push(Membership::Restarted { node, incarnation });
        } else if fresh {
            out.push(Membership::Rejoined { node });
        }
        self.leases[node] = Some(Lease {
            incarnation,
            expires: now + TTL,
            renewed: now,
        });
        self.lost_told[node] = false;
        self.lease_until[node] = now + TTL - MARGIN;
        let live: Vec<&NodeId> = (0..self.names.len())
            .filter(|&n| self.leases[n].is_some_and(|l| l.expires > now))
            .map(|n| &self.names[n])
            .collect();
        let owners: Vec<Option<usize>> = (0..self.shards)
            .map(|s| {
                rendezvous_owner(ShardId(s), live.iter().copied())
                    .and_then(|d| self.names.iter().position(|n| n == d))
            })
            .collect();
        for (s, desired) in (0..self.shards).zip(owners) {
            let claim = self.claims.get(&s).copied().filter(|c| c.expires > now);
            match self.held[node].get(&s).copied() {
                Some((epoch, _)) => {
                    let still_mine = claim.is_some_and(|c| c.node == node && c.epoch == epoch);
                    if desired != Some(node) || !still_mine {
                        self.held[node].remove(&s);
                        if still_mine {
                            self.claims.remove(&s);
                        }
                    } else {
                        self.write_claim(node, s, epoch, now);
                    }
                }
                None => {
                    if desired == Some(node) && claim.is_none_or(|c| c.node == node) {
                        let epoch = self.epochs.entry(s).or_default();
                        *epoch += 1;
                        let epoch = *epoch;
                        self.write_claim(node, s, epoch, now);
                    }
                }
            }
        }
        out
    }

    /// `node` writes shard `s`'s claim under `epoch` (a take or a renewal):
    /// it expires a TTL from now, and the node acts until its act window.
    fn write_claim(&mut self, node: usize, s: u32, epoch: u64, now: Duration) {
        let expires = now + TTL;
        self.claims.insert(
            s,
            Claim {
                node,
                epoch,
                expires,
            },
        );
        self.held[node].insert(s, (epoch, expires - MARGIN));
    }

    /// What `node` may act for at `now`: each held shard until the earlier
    /// of its claim's and its lease's act window.
    pub fn status(&self, node: usize, now: Duration) -> BTreeMap<u32, (u64, Duration)> {
        let lease_until = self.lease_until[node];
        if now >= lease_until {
            return BTreeMap::new();
        }
        self.held[node]
            .iter()
            .filter(|(_, (_, until))| now < *until)
            .map(|(s, (epoch, until))| (*s, (*epoch, (*until).min(lease_until))))
            .collect()
    }
}
