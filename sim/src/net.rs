//! A simulated network of UDP datagrams on virtual time: per-link loss,
//! delay with jitter (hence reordering), duplication, partitions and a
//! receiver that stops reading. Every datagram in flight sits in one
//! bounded queue ordered by arrival time.

use crate::rng::Rng;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::time::Duration;

/// Datagrams in flight at most; more would mean a sender that never stops.
pub const MAX_IN_FLIGHT: usize = 200_000;

/// One client's path to the server (both directions).
#[derive(Clone, Debug)]
pub struct Link {
    pub loss: f64,
    pub duplicate: f64,
    pub delay: Duration,
    pub jitter: Duration,
    /// Nothing passes either way before this.
    pub partitioned_until: Duration,
    /// The client reads none of its datagrams before this (its socket buffer
    /// overflows: they are dropped).
    pub deaf_until: Duration,
}

impl Link {
    pub fn random(rng: &mut Rng) -> Link {
        let lossy = rng.chance(0.5);
        Link {
            loss: if lossy {
                rng.range(1, 100) as f64 / 1000.0
            } else {
                0.0
            },
            duplicate: if rng.chance(0.3) {
                rng.range(1, 30) as f64 / 1000.0
            } else {
                0.0
            },
            delay: Duration::from_millis(rng.range(2, 150)),
            jitter: Duration::from_millis(rng.range(0, 60)),
            partitioned_until: Duration::ZERO,
            deaf_until: Duration::ZERO,
        }
    }

    pub fn partitioned(&self, now: Duration) -> bool {
        now < self.partitioned_until
    }

    pub fn deaf(&self, now: Duration) -> bool {
        now < self.deaf_until
    }
}

#[derive(Debug)]
pub struct Datagram {
    pub at: Duration,
    seq: u64,
    pub from: SocketAddr,
    pub to: SocketAddr,
    /// The client whose link carries it.
    pub client: usize,
    pub data: Vec<u8>,
}

impl PartialEq for Datagram {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Datagram {}
impl PartialOrd for Datagram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Datagram {
    // Reversed: the heap pops the earliest first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Debug, Default)]
pub struct Net {
    queue: BinaryHeap<Datagram>,
    seq: u64,
    pub sent: u64,
    pub lost: u64,
    pub duplicated: u64,
}

impl Net {
    /// Sends a datagram over `link` at `now`: it may be lost, duplicated,
    /// delayed by the link's delay plus jitter.
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &mut self,
        rng: &mut Rng,
        now: Duration,
        link: &Link,
        client: usize,
        from: SocketAddr,
        to: SocketAddr,
        data: Vec<u8>,
    ) -> Result<(), String> {
        self.sent += 1;
        if link.partitioned(now) || rng.chance(link.loss) {
            self.lost += 1;
            return Ok(());
        }
        let copies = if rng.chance(link.duplicate) { 2 } else { 1 };
        self.duplicated += copies - 1;
        for _ in 0..copies {
            let jitter = rng.below(link.jitter.as_micros() as u64 + 1);
            let at = now + link.delay + Duration::from_micros(jitter);
            self.seq += 1;
            self.queue.push(Datagram {
                at,
                seq: self.seq,
                from,
                to,
                client,
                data: data.clone(),
            });
        }
        if self.queue.len() > MAX_IN_FLIGHT {
            return Err(format!(
                "unbounded queue: {} datagrams in flight",
                self.queue.len()
            ));
        }
        Ok(())
    }

    pub fn next_at(&self) -> Option<Duration> {
        self.queue.peek().map(|d| d.at)
    }

    /// The next datagram due at or before `now`.
    pub fn pop_due(&mut self, now: Duration) -> Option<Datagram> {
        if self.queue.peek().is_some_and(|d| d.at <= now) {
            self.queue.pop()
        } else {
            None
        }
    }

    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}
