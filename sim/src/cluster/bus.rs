//! The simulated NATS of the multi-node simulation: shard subjects, the
//! edge, resync and beacon subjects, requests to a shard's owner with their
//! replies, and the KV buckets the cluster link reads and writes
//! (preferences and shard device records fenced by epoch, last views, session
//! records). Claims and leases are the duty's ([`super::duty`]).
//!
//! Every message and KV operation takes a delay drawn from the seed, so
//! messages reorder; faults lose and duplicate messages, slow the KV down,
//! cut a node off, or stop the whole bus. A KV write lands at one instant
//! and its acknowledgement reaches the writer later, so a write can land
//! after its writer lost the shard (the C4 race).

use crate::rng::Rng;
use greendot_server::cluster::local::LocalKv;
use greendot_server::cluster::{ClusterInput, ClusterOutput, GroupWriteOutcome};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

/// How long a NATS request or KV operation waits before it fails (the
/// cluster's `op_timeout` default).
pub const OP_TIMEOUT: Duration = Duration::from_secs(2);

/// Messages and KV operations in flight at most: past it the run fails (an
/// unbounded queue).
const MAX_IN_FLIGHT: usize = 200_000;

/// Where a node stands with the bus, as the world tells it at each step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reach {
    /// The process runs (possibly paused), as this incarnation.
    pub incarnation: Option<u64>,
    /// Its connection to NATS carries messages now.
    pub linked: bool,
}

/// What the bus knows of the nodes when one of them sends: where each
/// stands, the shards each serves (its last status) and their names.
#[derive(Clone, Copy)]
pub struct Nodes<'a> {
    pub reach: &'a [Reach],
    pub serving: &'a [BTreeSet<u32>],
    pub names: &'a [String],
}

/// Something the bus does at an instant.
#[derive(Debug)]
enum Event {
    /// Hand `input` to node `to`, if it still runs as `incarnation`.
    Deliver {
        to: usize,
        incarnation: u64,
        input: ClusterInput,
    },
    /// A KV operation of node `from` lands now; its answer follows.
    Kv {
        from: usize,
        incarnation: u64,
        op: ClusterOutput,
    },
    /// A request still unanswered now is answered `None`.
    ReplyDeadline { reply: u64 },
}

/// A request handed to an owner, until its reply or deadline.
#[derive(Debug)]
struct PendingReply {
    shard: u32,
    asker: usize,
    incarnation: u64,
    id: u64,
}

/// Counters of what the bus carried.
#[derive(Clone, Copy, Debug, Default)]
pub struct BusCounters {
    pub messages: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub kv_ops: u64,
    pub kv_failed: u64,
    pub fenced: u64,
    /// Messages and requests a cut-off node's client held and sent once
    /// it was linked again (with `buffered`).
    pub sent_late: u64,
}

/// What a cut-off node's NATS client holds at most (async-nats queues
/// commands on a bounded channel while it reconnects).
const MAX_HELD: usize = 256;

/// The simulated NATS and its KV.
pub struct Bus {
    events: BTreeMap<(Duration, u64), Event>,
    seq: u64,
    /// Per node, the shards it watches, with how many local watchers.
    watching: Vec<BTreeMap<u32, u32>>,
    replies: HashMap<u64, PendingReply>,
    next_reply: u64,
    /// The KV buckets, as a cluster of one keeps them (preferences and
    /// shard device records fenced, last views, session records, groups);
    /// the bus adds their latency and failures.
    pub kv: LocalKv,
    /// Message loss and duplication, while a lossy phase lasts.
    pub loss: f64,
    pub duplication: f64,
    /// KV operations take up to this long while the KV is slow.
    pub kv_slow_until: Duration,
    pub counters: BusCounters,
    /// A cut-off node's messages and requests are held by its client and
    /// sent when it is linked again, as async-nats sends the commands it
    /// queued while reconnecting; off, they are lost. A request held so
    /// still fails at its asker after its timeout, and lands later anyway.
    pub buffered: bool,
    /// Per node, what its client holds: (incarnation, output).
    held: Vec<VecDeque<(u64, ClusterOutput)>>,
}

impl Bus {
    pub fn new(nodes: usize) -> Bus {
        Bus {
            events: BTreeMap::new(),
            seq: 0,
            watching: vec![BTreeMap::new(); nodes],
            replies: HashMap::new(),
            next_reply: 0,
            kv: LocalKv::default(),
            loss: 0.0,
            duplication: 0.0,
            kv_slow_until: Duration::ZERO,
            counters: BusCounters::default(),
            buffered: false,
            held: vec![VecDeque::new(); nodes],
        }
    }

    pub fn next_at(&self) -> Option<Duration> {
        self.events.keys().next().map(|(t, _)| *t)
    }

    /// The shard of request `reply`, while it waits for its answer.
    pub fn reply_shard(&self, reply: u64) -> Option<u32> {
        self.replies.get(&reply).map(|p| p.shard)
    }

    /// A node's process ended: its subscriptions go with its connection.
    pub fn node_gone(&mut self, node: usize) {
        self.watching[node].clear();
    }

    fn push(&mut self, at: Duration, event: Event) -> Result<(), String> {
        if self.events.len() >= MAX_IN_FLIGHT {
            return Err(format!("the bus holds {MAX_IN_FLIGHT} events: unbounded"));
        }
        self.seq += 1;
        self.events.insert((at, self.seq), event);
        Ok(())
    }

    /// `input` reaches run `incarnation` of node `to` at `at`.
    fn deliver(
        &mut self,
        at: Duration,
        (to, incarnation): (usize, u64),
        input: ClusterInput,
    ) -> Result<(), String> {
        let event = Event::Deliver {
            to,
            incarnation,
            input,
        };
        self.push(at, event)
    }

    /// Sends what node `from`'s client held while it was cut off, now that
    /// it is linked again (the same run of it: a killed process's queue
    /// died with it).
    pub fn send_held(
        &mut self,
        rng: &mut Rng,
        now: Duration,
        nodes: Nodes,
        from: usize,
    ) -> Result<(), String> {
        let reach = nodes.reach[from];
        if !reach.linked || self.held[from].is_empty() {
            return Ok(());
        }
        for (incarnation, out) in std::mem::take(&mut self.held[from]) {
            if reach.incarnation == Some(incarnation) {
                self.counters.sent_late += 1;
                self.output(rng, now, nodes, from, out)?;
            }
        }
        Ok(())
    }

    /// A message delay: a few milliseconds, now and then a few hundred.
    fn delay(rng: &mut Rng) -> Duration {
        if rng.chance(0.02) {
            Duration::from_millis(rng.range(50, 400))
        } else {
            Duration::from_micros(rng.range(200, 5_000))
        }
    }

    /// Sends `input` to `to` (lost, duplicated and delayed by the seed).
    fn send(
        &mut self,
        rng: &mut Rng,
        now: Duration,
        reach: &[Reach],
        to: usize,
        input: ClusterInput,
    ) -> Result<bool, String> {
        let Some(incarnation) = reach[to].incarnation.filter(|_| reach[to].linked) else {
            self.counters.lost += 1;
            return Ok(false);
        };
        self.counters.messages += 1;
        if rng.chance(self.loss) {
            self.counters.lost += 1;
            return Ok(false);
        }
        if rng.chance(self.duplication) {
            if let Some(copy) = copy(&input) {
                self.counters.duplicated += 1;
                let at = now + Self::delay(rng);
                self.deliver(at, (to, incarnation), copy)?;
            }
        }
        let at = now + Self::delay(rng);
        self.deliver(at, (to, incarnation), input)?;
        Ok(true)
    }

    /// Takes an output of node `from` (a shard's requests go to a node
    /// serving it).
    pub fn output(
        &mut self,
        rng: &mut Rng,
        now: Duration,
        nodes: Nodes,
        from: usize,
        out: ClusterOutput,
    ) -> Result<(), String> {
        let Nodes {
            reach,
            serving,
            names,
        } = nodes;
        let Some(incarnation) = reach[from].incarnation else {
            return Ok(());
        };
        let linked = reach[from].linked;
        match out {
            ClusterOutput::Watch { shard } => {
                *self.watching[from].entry(shard).or_default() += 1;
            }
            ClusterOutput::Unwatch { shard } => {
                if let Some(n) = self.watching[from].get_mut(&shard) {
                    *n -= 1;
                    if *n == 0 {
                        self.watching[from].remove(&shard);
                    }
                }
            }
            _ if !linked => {
                // Cut off: a request or KV operation fails after its
                // timeout; anything else is lost, or held by the client.
                self.counters.lost += 1;
                if self.buffered && is_message(&out) && self.held[from].len() < MAX_HELD {
                    self.held[from].push_back((incarnation, out.clone()));
                }
                let failed = failure(out, "NATS unreachable");
                if let Some(input) = failed {
                    self.deliver(now + OP_TIMEOUT, (from, incarnation), input)?;
                }
            }
            ClusterOutput::Publish { shard, payload } => {
                for to in 0..reach.len() {
                    if self.watching[to].contains_key(&shard) {
                        let input = ClusterInput::ShardMessage {
                            shard,
                            payload: payload.clone(),
                        };
                        self.send(rng, now, reach, to, input)?;
                    }
                }
            }
            ClusterOutput::PublishToEdge { node, payload } => {
                if let Some(to) = names.iter().position(|n| *n == node) {
                    self.send(rng, now, reach, to, ClusterInput::EdgeMessage { payload })?;
                }
            }
            ClusterOutput::Resync { payload } => {
                for to in 0..reach.len() {
                    let input = ClusterInput::Resync {
                        payload: payload.clone(),
                    };
                    self.send(rng, now, reach, to, input)?;
                }
            }
            ClusterOutput::Beacon { payload } => {
                for to in 0..reach.len() {
                    let input = ClusterInput::Beacon {
                        payload: payload.clone(),
                    };
                    self.send(rng, now, reach, to, input)?;
                }
            }
            ClusterOutput::GroupCounts { payload } => {
                for to in 0..reach.len() {
                    let input = ClusterInput::GroupCounts {
                        payload: payload.clone(),
                    };
                    self.send(rng, now, reach, to, input)?;
                }
            }
            ClusterOutput::Request {
                id,
                shard,
                kind,
                payload,
            } => {
                // A queue subscription: one serving node takes it.
                let owners: Vec<usize> = (0..reach.len())
                    .filter(|&n| reach[n].linked && serving[n].contains(&shard))
                    .collect();
                if owners.is_empty() {
                    // "No responders", at once.
                    let input = ClusterInput::Answered { id, payload: None };
                    let at = now + Self::delay(rng);
                    return self.deliver(at, (from, incarnation), input);
                }
                let to = owners[rng.index(owners.len())];
                self.next_reply += 1;
                let reply = self.next_reply;
                self.replies.insert(
                    reply,
                    PendingReply {
                        shard,
                        asker: from,
                        incarnation,
                        id,
                    },
                );
                self.push(now + OP_TIMEOUT, Event::ReplyDeadline { reply })?;
                let input = ClusterInput::Request {
                    shard,
                    kind,
                    payload,
                    reply,
                };
                self.send(rng, now, reach, to, input)?;
            }
            ClusterOutput::Reply { reply, payload } => {
                if let Some(p) = self.replies.get(&reply) {
                    if reach[p.asker].incarnation == Some(p.incarnation) {
                        let input = ClusterInput::Answered {
                            id: p.id,
                            payload: Some(payload),
                        };
                        // A reply lost on the way leaves the request to its
                        // deadline, as the asker's I/O, which answers every
                        // request within the operation timeout, gives up.
                        if self.send(rng, now, reach, p.asker, input)? {
                            self.replies.remove(&reply);
                        }
                    } else {
                        self.replies.remove(&reply);
                    }
                }
            }
            op => {
                // A KV operation: it lands after a delay (long while the KV
                // is slow); its answer comes back after another.
                self.counters.kv_ops += 1;
                let latency = if now < self.kv_slow_until {
                    Duration::from_millis(rng.range(0, 6_000))
                } else {
                    Duration::from_micros(rng.range(300, 20_000))
                };
                self.push(
                    now + latency,
                    Event::Kv {
                        from,
                        incarnation,
                        op,
                    },
                )?;
            }
        }
        Ok(())
    }

    /// The next due event's delivery, if any is due at `now`: `(node,
    /// incarnation, input)`. KV operations land here.
    pub fn pop_due(
        &mut self,
        rng: &mut Rng,
        now: Duration,
        reach: &[Reach],
    ) -> Result<Option<(usize, u64, ClusterInput)>, String> {
        loop {
            let Some(entry) = self.events.first_entry() else {
                return Ok(None);
            };
            if entry.key().0 > now {
                return Ok(None);
            }
            match entry.remove() {
                Event::Deliver {
                    to,
                    incarnation,
                    input,
                } => {
                    if reach[to].incarnation == Some(incarnation) {
                        return Ok(Some((to, incarnation, input)));
                    }
                }
                Event::ReplyDeadline { reply } => {
                    if let Some(p) = self.replies.remove(&reply) {
                        if reach[p.asker].incarnation == Some(p.incarnation) {
                            let input = ClusterInput::Answered {
                                id: p.id,
                                payload: None,
                            };
                            return Ok(Some((p.asker, p.incarnation, input)));
                        }
                    }
                }
                Event::Kv {
                    from,
                    incarnation,
                    op,
                } => {
                    // The KV (a JetStream cluster) serves only while the bus runs.
                    let up = reach.iter().any(|r| r.linked);
                    if let Some(answer) = self.land(op, up) {
                        let at = now + Self::delay(rng);
                        self.deliver(at, (from, incarnation), answer)?;
                    }
                }
            }
        }
    }

    /// Applies a KV operation now; its answer, if it has one.
    fn land(&mut self, op: ClusterOutput, up: bool) -> Option<ClusterInput> {
        if !up {
            self.counters.kv_failed += 1;
            return failure(op, "the KV is down");
        }
        // Nothing in the simulation writes groups (no service token), so no
        // write's watch event is left to deliver: one answer at most.
        let mut answers = VecDeque::new();
        let _not_kv = self.kv.apply(op, &mut answers);
        self.counters.fenced = self.kv.fenced;
        answers.pop_front()
    }
}

/// The answer of a request or KV operation that failed for `why`; `None`
/// for what nobody waits on.
fn failure(op: ClusterOutput, why: &str) -> Option<ClusterInput> {
    match op {
        ClusterOutput::Request { id, .. } => Some(ClusterInput::Answered { id, payload: None }),
        ClusterOutput::PutPrefs { id, .. } => Some(ClusterInput::PrefsStored { id, ok: false }),
        ClusterOutput::LoadUser { id, .. } => Some(ClusterInput::UserLoadFailed { id }),
        ClusterOutput::LoadShard { id, .. } => Some(ClusterInput::ShardLoadFailed { id }),
        ClusterOutput::PutSession { id, .. } => Some(ClusterInput::SessionStored { id, ok: false }),
        ClusterOutput::LoadSession { id, .. } => {
            Some(ClusterInput::SessionLoaded { id, record: None })
        }
        ClusterOutput::ReadGroup { id, .. } => Some(ClusterInput::GroupRead {
            id,
            read: Err(why.into()),
        }),
        ClusterOutput::WriteGroup { id, .. } => Some(ClusterInput::GroupWritten {
            id,
            outcome: GroupWriteOutcome::Failed(why.into()),
        }),
        _ => None,
    }
}

/// A message or request, not a KV operation (whose own stream is not
/// modelled as held).
fn is_message(out: &ClusterOutput) -> bool {
    matches!(
        out,
        ClusterOutput::Publish { .. }
            | ClusterOutput::PublishToEdge { .. }
            | ClusterOutput::Resync { .. }
            | ClusterOutput::Beacon { .. }
            | ClusterOutput::GroupCounts { .. }
            | ClusterOutput::Request { .. }
    )
}

/// A copy of a message NATS may deliver twice (what is not a KV answer).
fn copy(input: &ClusterInput) -> Option<ClusterInput> {
    Some(match input {
        ClusterInput::ShardMessage { shard, payload } => ClusterInput::ShardMessage {
            shard: *shard,
            payload: payload.clone(),
        },
        ClusterInput::EdgeMessage { payload } => ClusterInput::EdgeMessage {
            payload: payload.clone(),
        },
        ClusterInput::Beacon { payload } => ClusterInput::Beacon {
            payload: payload.clone(),
        },
        ClusterInput::GroupCounts { payload } => ClusterInput::GroupCounts {
            payload: payload.clone(),
        },
        ClusterInput::Resync { payload } => ClusterInput::Resync {
            payload: payload.clone(),
        },
        ClusterInput::Request {
            shard,
            kind,
            payload,
            reply,
        } => ClusterInput::Request {
            shard: *shard,
            kind: *kind,
            payload: payload.clone(),
            reply: *reply,
        },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use greendot_server::cluster::RequestKind;

    /// The asker's I/O answers every request within the operation timeout:
    /// a reply lost on its way back still ends the request, `None` at its
    /// deadline, instead of leaving it to the link's own (much longer)
    /// request timeout.
    #[test]
    fn a_lost_reply_is_answered_none_at_the_requests_deadline() {
        let mut bus = Bus::new(2);
        let mut rng = Rng::new(1);
        let reach = [Reach {
            incarnation: Some(1),
            linked: true,
        }; 2];
        let serving = [BTreeSet::new(), BTreeSet::from([7])];
        let names = ["n0".to_owned(), "n1".to_owned()];
        let request = ClusterOutput::Request {
            id: 42,
            shard: 7,
            kind: RequestKind::Snapshot,
            payload: Bytes::from_static(b"views"),
        };
        let nodes = Nodes {
            reach: &reach,
            serving: &serving,
            names: &names,
        };
        bus.output(&mut rng, Duration::ZERO, nodes, 0, request)
            .unwrap();
        let asked = bus
            .pop_due(&mut rng, Duration::from_secs(1), &reach)
            .unwrap();
        let Some((1, 1, ClusterInput::Request { reply, .. })) = asked else {
            panic!("the owner was not asked: {asked:?}");
        };
        bus.loss = 1.0;
        let answer = ClusterOutput::Reply {
            reply,
            payload: Bytes::from_static(b"answer"),
        };
        bus.output(&mut rng, Duration::from_secs(1), nodes, 1, answer)
            .unwrap();
        let before = bus.pop_due(&mut rng, OP_TIMEOUT - Duration::from_millis(1), &reach);
        assert!(matches!(before, Ok(None)), "{before:?}");
        match bus.pop_due(&mut rng, OP_TIMEOUT, &reach) {
            Ok(Some((
                0,
                1,
                ClusterInput::Answered {
                    id: 42,
                    payload: None,
                },
            ))) => {}
            other => panic!("the asker was not told at the deadline: {other:?}"),
        }
    }
}
