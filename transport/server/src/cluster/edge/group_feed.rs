//! What an edge of a cluster feeds its hub's core of groups (issue 28):
//! the core serves group subscriptions on one node's code, with counts fed
//! from outside (`Core::set_group_counts_fed`). The definitions come from
//! the directory every node keeps; the counts from `<prefix>.groups`, where
//! the owner of each group's home shard publishes them.
//!
//! The edge keeps the newest count of each group it has a definition of,
//! so a definition that arrives after its group's count (the directory's
//! watch and the counts travel apart) is told the count at once.

use crate::cluster::wire::{decode, GroupCount, GroupCounts};
use crate::cluster::ClusterLink;
use crate::hub::GroupFeed;

impl ClusterLink {
    /// What the hub's core learns of groups next: apply in order.
    pub fn poll_group_feed(&mut self) -> Option<GroupFeed> {
        self.edge.group_feed.pop_front()
    }

    /// A message on `<prefix>.groups`.
    pub(in crate::cluster) fn group_counts_message(&mut self, payload: &[u8]) {
        if !self.shared.serves_groups() {
            return;
        }
        let max_name = self.shared.max_name_len;
        let fits = |c: &GroupCount| {
            c.change
                .as_ref()
                .is_none_or(|(n, _)| !n.is_empty() && n.len() <= max_name)
        };
        match decode::<GroupCounts>(payload) {
            Some(msg)
                if msg.home < self.shared.settings.shard_count && msg.counts.iter().all(fits) =>
            {
                self.take_group_counts(msg)
            }
            _ => self.shared.counters.malformed += 1,
        }
    }

    /// Counts from a home shard's owner: each one above the version held
    /// goes to the hub's core.
    pub(in crate::cluster) fn take_group_counts(&mut self, msg: GroupCounts) {
        for c in msg.counts {
            let def = self.shared.groups.get(c.group).1;
            // A late count of a removed group is no count of one written
            // again under its id.
            if def.is_some_and(|d| d.removed) {
                continue;
            }
            let known = def.is_some();
            let home = self.shared.home_shard(c.group);
            let held = self.edge.fed_counts.get(&c.group);
            let any =
                self.shared.settings.mutant == Some(crate::cluster::LinkMutant::CountsAnyVersion);
            let newer = any || held.is_none_or(|(v, _)| c.version > *v);
            // Kept for a definition still on its way, within the groups a
            // node holds.
            let room = known
                || held.is_some()
                || self.edge.fed_counts.len() < self.shared.owner_config.max_groups;
            if home != msg.home || !newer || !room {
                continue;
            }
            self.edge.fed_counts.insert(c.group, (c.version, c.count));
            if !known {
                continue;
            }
            self.edge.group_feed.push_back(GroupFeed::Count {
                group: c.group,
                version: c.version,
                count: c.count,
                change: c.change,
            });
        }
    }

    /// A definition the directory took: the hub's core follows it, and
    /// hears the newest count of it.
    pub(in crate::cluster) fn feed_definition(&mut self, group: u64) {
        if !self.shared.serves_groups() {
            return;
        }
        match self.shared.groups.get(group).1.filter(|d| !d.removed) {
            Some(def) => {
                self.edge.group_feed.push_back(GroupFeed::Define {
                    group,
                    membership: def.membership,
                    members: def.members.iter().map(|(n, _)| n.clone()).collect(),
                    admins: def.admins.clone(),
                });
                if let Some(&(version, count)) = self.edge.fed_counts.get(&group) {
                    self.edge.group_feed.push_back(GroupFeed::Count {
                        group,
                        version,
                        count,
                        change: None,
                    });
                }
            }
            None => {
                self.edge.fed_counts.remove(&group);
                self.edge.group_feed.push_back(GroupFeed::Remove { group });
            }
        }
    }
}
