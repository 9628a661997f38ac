//! The subscriber's side of the version logic, shared by the client library and
//! the model checker so that both apply snapshots and deltas the same way.

use crate::types::{Presence, UserId};
use std::collections::BTreeMap;

/// A subscriber's picture of the users it watches. Snapshots and deltas may
/// arrive in any order (answers and pushes travel on different streams, and a
/// resumed session gets fresh snapshots): only a strictly newer version
/// replaces what is known.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct View {
    known: BTreeMap<UserId, Presence>,
}

/// What `View::apply` did with an update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// First knowledge of this user.
    New,
    /// Replaced an older version.
    Updated,
    /// Not newer than what is known (a duplicate or reordered update): dropped.
    Dropped,
}

impl View {
    pub fn new() -> View {
        View::default()
    }

    /// Applies a snapshot or a delta for `target`.
    pub fn apply(&mut self, target: UserId, presence: Presence) -> Applied {
        match self.known.get_mut(&target) {
            None => {
                self.known.insert(target, presence);
                Applied::New
            }
            Some(known) if presence.version > known.version => {
                *known = presence;
                Applied::Updated
            }
            Some(_) => Applied::Dropped,
        }
    }

    pub fn get(&self, target: UserId) -> Option<&Presence> {
        self.known.get(&target)
    }

    /// Forgets a target (after unsubscribing).
    pub fn forget(&mut self, target: UserId) -> Option<Presence> {
        self.known.remove(&target)
    }

    pub fn iter(&self) -> impl Iterator<Item = (UserId, &Presence)> {
        self.known.iter().map(|(user, presence)| (*user, presence))
    }

    pub fn len(&self) -> usize {
        self.known.len()
    }

    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(version: u64, online: bool) -> Presence {
        Presence {
            version,
            online,
            ..Presence::default()
        }
    }

    #[test]
    fn newer_replaces_older_and_duplicates_drop() {
        let mut view = View::new();
        let bob = UserId(2);
        assert_eq!(view.apply(bob, at(3, true)), Applied::New);
        assert_eq!(view.apply(bob, at(3, false)), Applied::Dropped);
        assert_eq!(view.apply(bob, at(2, false)), Applied::Dropped);
        assert!(view.get(bob).is_some_and(|p| p.online));
        assert_eq!(view.apply(bob, at(4, false)), Applied::Updated);
        assert!(view.get(bob).is_some_and(|p| !p.online && p.version == 4));
        assert!(view.forget(bob).is_some());
        assert!(view.is_empty());
    }
}
