//! Which groups' online members changed: what a shard owner of a cluster
//! sends on as partial counts (issue 28). An owner's core holds the slice of
//! each group in its shard (`handle_set_group` with those members) and
//! counts it from its published views as one node does; with changes
//! tracked, it also notes each group whose online members or members
//! changed, or which was removed, until the owner takes them.

use crate::engine::Core;
use crate::groups::GroupId;
use crate::types::UserId;
use std::collections::BTreeSet;

impl Core {
    /// Starts (or stops) noting the groups whose online members change.
    pub fn set_track_group_changes(&mut self, on: bool) {
        self.groups.changed = on.then(BTreeSet::new);
    }

    /// The groups noted since the last call, in order: their online members
    /// or members changed, or they were removed.
    pub fn take_changed_groups(&mut self) -> Vec<GroupId> {
        match &mut self.groups.changed {
            Some(changed) => std::mem::take(changed).into_iter().collect(),
            None => Vec::new(),
        }
    }

    /// The members of `group` published online, in order; `None` for no
    /// such group (or fed counts, which keep none).
    pub fn group_online(&self, group: GroupId) -> Option<impl Iterator<Item = UserId> + '_> {
        let g = self.groups.groups.get(&group)?;
        (!self.groups.fed).then(|| g.online.iter().copied())
    }
}
