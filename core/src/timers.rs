//! Every deadline of a core in one ordered set, with the earliest at hand.
//!
//! Every input first runs the timers due at its `now`, and almost always none
//! is: with 2,000,000 sessions resident, finding the first entry of the
//! B-tree walks seven or so nodes from the root on each input, while the
//! earliest deadline kept in a field answers with one comparison.

use crate::groups::GroupId;
use crate::types::{Millis, SessionId, UserId};
use std::collections::BTreeSet;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Timer {
    /// Heartbeat deadline of an Online session, or grace end of a Lingering one.
    Lease(SessionId),
    /// End of a user's debounce window.
    Debounce(UserId),
    /// Batch flush of a session.
    Batch(SessionId),
    /// End of a page watch (by its id); before `PageFlush`, so that a
    /// watch is over at its deadline.
    WatchExpiry(u64),
    /// Flush of the deltas of the pages a session watches.
    PageFlush(SessionId),
    /// Count flush of a group (last, so that at one instant a flush sees
    /// every publish of that instant).
    Group(GroupId),
}

/// The ordered set of `(due, timer)`. `first` is derived from `set`, so
/// comparing and hashing it with the set changes neither.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Timers {
    set: BTreeSet<(Millis, Timer)>,
    /// The earliest deadline in `set`, or `Millis(u64::MAX)` when empty.
    first: Millis,
}

impl Default for Timers {
    fn default() -> Timers {
        Timers {
            set: BTreeSet::new(),
            first: Millis(u64::MAX),
        }
    }
}

impl Timers {
    /// Whether some timer is due at `now`.
    pub(crate) fn any_due(&self, now: Millis) -> bool {
        self.first <= now
    }

    pub(crate) fn first(&self) -> Option<&(Millis, Timer)> {
        self.set.first()
    }

    pub(crate) fn pop_first(&mut self) -> Option<(Millis, Timer)> {
        let first = self.set.pop_first();
        self.first = self.earliest();
        first
    }

    pub(crate) fn insert(&mut self, entry: (Millis, Timer)) {
        self.first = self.first.min(entry.0);
        self.set.insert(entry);
    }

    pub(crate) fn remove(&mut self, entry: &(Millis, Timer)) {
        if self.set.remove(entry) && entry.0 == self.first {
            self.first = self.earliest();
        }
    }

    #[cfg(feature = "check")]
    pub(crate) fn set(&self) -> &BTreeSet<(Millis, Timer)> {
        &self.set
    }

    /// That `first` is what it caches (for `check_invariants`).
    #[cfg(feature = "check")]
    pub(crate) fn first_is_cached(&self) -> bool {
        self.first == self.earliest()
    }

    fn earliest(&self) -> Millis {
        self.set.first().map_or(Millis(u64::MAX), |&(due, _)| due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(n: u64) -> Timer {
        Timer::Lease(SessionId(n))
    }

    #[test]
    fn the_earliest_deadline_follows_inserts_and_removals() {
        let mut timers = Timers::default();
        assert!(!timers.any_due(Millis(u64::MAX - 1)));
        timers.insert((Millis(5), lease(1)));
        timers.insert((Millis(3), lease(2)));
        timers.insert((Millis(3), lease(3)));
        assert!(timers.any_due(Millis(3)) && !timers.any_due(Millis(2)));
        // Another timer still holds the earliest deadline.
        timers.remove(&(Millis(3), lease(2)));
        assert!(timers.any_due(Millis(3)));
        timers.remove(&(Millis(3), lease(3)));
        assert!(!timers.any_due(Millis(4)) && timers.any_due(Millis(5)));
        // Removing what is not there changes nothing.
        timers.remove(&(Millis(5), lease(9)));
        assert!(timers.any_due(Millis(5)));
        assert_eq!(timers.pop_first(), Some((Millis(5), lease(1))));
        assert!(!timers.any_due(Millis(u64::MAX - 1)));
        assert_eq!(timers.pop_first(), None);
    }
}
