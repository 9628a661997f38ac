//! An owner's preference writes to the KV, at most one in flight per user.
//!
//! Within one epoch the KV record carries no order of its own: the KV write
//! reads the record's revision and compares-and-sets it, reading again on a
//! conflict. Two writes of one user in flight at once would let the older
//! one, retrying after the newer landed, put the older value back: a user
//! told "invisible" would be loaded visible by the next owner (C4). So a
//! change made while a write of its user is in flight waits for it, and
//! the waiting changes go out as one write of the newest value (it holds
//! every earlier change).

use crate::cluster::DetMap;
use bytes::Bytes;
use std::time::Instant;

/// A write the KV was asked for: whose, which requests it answers, since when.
struct InFlight {
    user: String,
    requests: Vec<u64>,
    since: Instant,
}

/// The newest value of a user, waiting for the write in flight.
pub(in crate::cluster) struct Waiting {
    pub(in crate::cluster) shard: u32,
    pub(in crate::cluster) epoch: u64,
    pub(in crate::cluster) value: Bytes,
    /// The requests answered when this value is stored.
    pub(in crate::cluster) requests: Vec<u64>,
}

/// A write done: the requests it answers, and the user's next value if
/// one waited for it.
pub(in crate::cluster) struct Finished {
    pub(in crate::cluster) requests: Vec<u64>,
    pub(in crate::cluster) user: String,
    pub(in crate::cluster) next: Option<Waiting>,
}

#[derive(Default)]
pub(in crate::cluster) struct PrefsWrites {
    /// By write id (the id of its `PutPrefs`).
    in_flight: DetMap<u64, InFlight>,
    /// By user: the id of the write in flight.
    writing: DetMap<String, u64>,
    waiting: DetMap<String, Waiting>,
}

impl PrefsWrites {
    /// Whether `user`'s write may go out now as write `id` (nothing of
    /// theirs in flight); if not, `value` waits, replacing an older one
    /// that waited. `live` tells which request ids still wait for an
    /// answer: the others (timed out) are not kept.
    pub(in crate::cluster) fn start(
        &mut self,
        now: Instant,
        id: u64,
        user: &str,
        next: Waiting,
        live: impl Fn(u64) -> bool,
    ) -> Option<Waiting> {
        if !self.writing.contains_key(user) {
            self.sent(now, id, user, next.requests.clone());
            return Some(next);
        }
        let mut requests = match self.waiting.remove(user) {
            Some(older) => older.requests,
            None => Vec::new(),
        };
        requests.retain(|r| live(*r));
        requests.extend(next.requests);
        self.waiting
            .insert(user.to_owned(), Waiting { requests, ..next });
        None
    }

    /// Write `id` of `user` went out, answering `requests` when stored.
    pub(in crate::cluster) fn sent(
        &mut self,
        now: Instant,
        id: u64,
        user: &str,
        requests: Vec<u64>,
    ) {
        self.writing.insert(user.to_owned(), id);
        self.in_flight.insert(
            id,
            InFlight {
                user: user.to_owned(),
                requests,
                since: now,
            },
        );
    }

    /// The KV answered write `id` (or it was given up): what it answers,
    /// and what waited behind it. `None` for an unknown id.
    pub(in crate::cluster) fn finished(&mut self, id: u64) -> Option<Finished> {
        let done = self.in_flight.remove(&id)?;
        self.writing.remove(&done.user);
        let next = self.waiting.remove(&done.user);
        Some(Finished {
            requests: done.requests,
            user: done.user,
            next,
        })
    }

    /// Writes in flight since before `cutoff`: the I/O lost them (an
    /// output dropped at a full queue), since its own timeouts end every
    /// write sooner.
    pub(in crate::cluster) fn lost(&self, cutoff: Instant) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, w)| w.since < cutoff)
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    pub(in crate::cluster) fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(shard: u32, epoch: u64, v: &'static [u8], requests: Vec<u64>) -> Waiting {
        Waiting {
            shard,
            epoch,
            value: Bytes::from_static(v),
            requests,
        }
    }

    #[test]
    fn a_users_second_write_waits_for_the_first_and_the_newest_value_goes_out() {
        let now = Instant::now();
        let mut w = PrefsWrites::default();
        assert!(w
            .start(now, 1, "ann", value(3, 1, b"a", vec![1]), |_| true)
            .is_some());
        // Another user is not held up.
        assert!(w
            .start(now, 2, "bob", value(4, 1, b"b", vec![2]), |_| true)
            .is_some());
        assert!(w
            .start(now, 3, "ann", value(3, 1, b"c", vec![3]), |_| true)
            .is_none());
        // Request 4 came later still; request 3 timed out meanwhile.
        assert!(w
            .start(now, 4, "ann", value(3, 1, b"d", vec![4]), |r| r != 3)
            .is_none());
        let done = w.finished(1).expect("write 1 was in flight");
        assert_eq!(done.requests, vec![1]);
        let next = done.next.expect("ann's newest value waited");
        assert_eq!(&next.value[..], b"d");
        assert_eq!(next.requests, vec![4]);
        assert!(w.finished(1).is_none(), "answered once");
        // Nothing of ann's is in flight until the caller sends the next.
        assert!(w
            .start(now, 5, "ann", value(3, 1, b"e", vec![5]), |_| true)
            .is_some());
    }

    #[test]
    fn writes_in_flight_past_the_cutoff_are_lost() {
        let t0 = Instant::now();
        let t1 = t0 + std::time::Duration::from_secs(1);
        let mut w = PrefsWrites::default();
        w.start(t0, 7, "ann", value(0, 1, b"a", vec![7]), |_| true);
        w.start(t1, 8, "bob", value(0, 1, b"b", vec![8]), |_| true);
        assert_eq!(w.lost(t1), vec![7]);
        assert!(!w.is_empty());
    }
}
