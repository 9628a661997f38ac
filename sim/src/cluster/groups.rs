//! Group presence across the simulated nodes (issue 28): one group of
//! every user, user 0 its admin, stored in the bus's groups bucket before
//! the run; every device subscribes to it on each connection. What its
//! devices are told is checked after every step:
//!
//! - **G2:** 0 ≤ count ≤ members.
//! - **G3:** versions strictly rise per connection and push stream.
//! - **G4:** a member's change goes only to admins' sessions.
//! - **G1, exact at quiescence:** once the cluster had no fault, and no
//!   member's published view went online or offline, for [`GROUP_BOUND`],
//!   and no device sent anything, connected or closed for [`INPUT_SETTLE`],
//!   every subscribed connection's count (the newest it was told) is the
//!   number of members whose newest published view is online. (A user read
//!   back from the KV counts by the view read until her view is published
//!   again, a debounce later: the count may lead the views by that much.)
//!
//! `LinkMutant::PartialsNotResent` (owners never send their partials again
//! to a new owner of a group's home shard) is caught by G1.

use super::checks::{violation, GHOST_BOUND};
use super::device::{user_name, Device, GroupSub, Heard};
use super::world::{World, SHARDS};
use greendot_proto as proto;
use greendot_server::cluster::{home_key, ClusterInput, ClusterOutput, GroupDef, ShardView};
use greendot_server::ServerInput;
use std::collections::BTreeMap;
use std::time::Duration;

/// The group every user is a member of.
pub const GROUP: u64 = 1;

/// Its admin.
pub const ADMIN: usize = 0;

/// The core's default group interval: members hear the count at most this
/// often, and home owners publish every count again this often.
const GROUP_INTERVAL: Duration = Duration::from_secs(10);

/// A ghost's bound (claims, resync windows, grace), then a partial (1 s),
/// the home owner's count again after a lost one, and a member's flush.
pub const GROUP_BOUND: Duration = GHOST_BOUND
    .saturating_add(GROUP_INTERVAL)
    .saturating_add(GROUP_INTERVAL)
    .saturating_add(Duration::from_secs(1));

/// What the nodes published of the members.
#[derive(Debug)]
pub struct GroupTruth {
    /// Per user, the newest published view's version, and whether online.
    pub published: BTreeMap<usize, (u64, bool)>,
    /// When a member's newest published view last went online or offline.
    pub changed_at: Duration,
    /// Steps at which G1 judged a connection's count.
    pub judged: u64,
    /// Group subscribes answered `Unsupported`.
    pub refused: u64,
    /// When a device last sent a frame, connected or closed.
    pub input_at: Duration,
    /// Devices act and faults are injected only outside quiet phases, so
    /// that counts are judged at quiescence: this one ends then, the next
    /// begins at `next_quiet`.
    quiet_until: Duration,
    next_quiet: Duration,
}

/// The group as the bucket holds it.
pub fn group_def(users: usize) -> GroupDef {
    GroupDef {
        group: GROUP,
        membership: 1,
        next_ordinal: users as u32,
        members: (0..users).map(|u| (user_name(u), u as u32)).collect(),
        admins: vec![user_name(ADMIN)],
        removed: false,
    }
}

fn user_of(name: &str) -> Option<usize> {
    name.strip_prefix('u')?.parse().ok()
}

impl GroupTruth {
    pub fn new() -> GroupTruth {
        GroupTruth {
            published: BTreeMap::new(),
            changed_at: Duration::ZERO,
            judged: 0,
            refused: 0,
            input_at: Duration::ZERO,
            quiet_until: Duration::ZERO,
            // After the devices came and subscribed.
            next_quiet: FIRST_QUIET,
        }
    }
}

/// How long after a device's last input G1 waits: a debounce, a partial,
/// its delivery, and margin.
const INPUT_SETTLE: Duration = Duration::from_secs(5);

/// When the first quiet phase begins.
const FIRST_QUIET: Duration = Duration::from_secs(60);

/// How long a quiet phase lasts: long enough for [`GROUP_BOUND`] after the
/// last fault, change and reconnect.
const QUIET: Duration = Duration::from_secs(200);

impl World {
    /// Whether devices and faults rest now (with groups only: a phase of
    /// [`QUIET`] every few minutes of activity).
    pub(super) fn group_quiet(&mut self) -> bool {
        if !self.opts.groups {
            return false;
        }
        let now = self.now;
        let t = &mut self.group_truth;
        if now >= t.next_quiet {
            t.quiet_until = now + QUIET;
            let busy = Duration::from_millis(self.rng.range(100_000, 300_000));
            self.group_truth.next_quiet = now + QUIET + busy;
            self.fail_summing_node();
        }
        now < self.group_truth.quiet_until
    }

    /// A quiet phase begins with `kill -9` of the node that sums the group
    /// (the owner of its home shard), back within seconds: the group's next
    /// sum starts with no partial, and the count must be exact again once
    /// the quiet lasted [`GROUP_BOUND`].
    fn fail_summing_node(&mut self) {
        let home = greendot_cluster::shard_of(&home_key(GROUP), SHARDS).0;
        let up = self.nodes.iter().filter(|n| n.state.is_some()).count();
        let summing = (0..self.nodes.len())
            .find(|&n| self.nodes[n].running() && self.nodes[n].status.contains_key(&home));
        let (Some(node), true) = (summing, up > 1 && self.opts.faults) else {
            return;
        };
        self.faults.kills += 1;
        self.note(format!(
            "kill -9 {}, which sums the group",
            self.names[node]
        ));
        self.kill(node);
        let back = self.now + Duration::from_millis(self.rng.range(500, 5_000));
        self.nodes[node].down_until = Some(back);
        self.calm_since = self.calm_since.max(back);
    }

    /// A node that starts reads the groups bucket: every group, then the
    /// end of the first pass.
    pub(super) fn give_groups(&mut self, node: usize) {
        if !self.opts.groups {
            return;
        }
        let groups: Vec<(u64, GroupDef)> = self
            .bus
            .kv
            .groups()
            .map(|(rev, def)| (rev, def.clone()))
            .collect();
        for (revision, def) in groups {
            let changed = ClusterInput::GroupChanged {
                group: def.group,
                revision,
                def: Some(def),
            };
            self.give(node, ServerInput::Cluster(changed));
        }
        self.give(node, ServerInput::Cluster(ClusterInput::GroupsSynced));
    }

    /// A view published on a shard's subject: the members' truth.
    pub(super) fn note_published(&mut self, out: &ClusterOutput) {
        let ClusterOutput::Publish { payload, .. } = out else {
            return;
        };
        let Ok(view) = proto::decode::<ShardView>(payload) else {
            return;
        };
        let Some(user) = user_of(&view.user).filter(|_| !view.own) else {
            return;
        };
        let (version, online) = (view.presence.version, view.presence.online);
        let newest = self.group_truth.published.get(&user).copied();
        if newest.is_some_and(|(v, _)| v >= version) {
            return;
        }
        if newest.is_none_or(|(_, was)| was != online) {
            self.group_truth.changed_at = self.now;
        }
        self.group_truth.published.insert(user, (version, online));
    }

    /// A connection was welcomed: it subscribes to the group (again, after
    /// a resume, which may have carried it over: a subscribe is idempotent).
    pub(super) fn group_welcomed(&mut self, device: usize) {
        if !self.opts.groups {
            return;
        }
        let d = &mut self.devices[device];
        if d.groups_unsupported {
            return;
        }
        if let Some(c) = d.conn.as_mut() {
            c.group = Some(GroupSub::default());
        }
        if let Some(frame) = d.group_subscribe() {
            self.send_frame(device, frame);
        }
    }

    /// What a device heard of the group, checked (G2, G3, G4) and kept.
    pub(super) fn group_heard(&mut self, device: usize, heard: Heard) -> Result<(), String> {
        let now = self.now;
        let members = self.users.len() as u32;
        let d: &mut Device = &mut self.devices[device];
        let user = d.user;
        match heard {
            Heard::GroupAnswer(Ok((version, count))) => {
                d.group_held = true;
                if count > members {
                    return Err(violation("G2", format!("device {device} answered {count}")));
                }
                if let Some(sub) = d.conn.as_mut().and_then(|c| c.group.as_mut()) {
                    sub.since = Some(now);
                    if sub.versions.values().all(|v| *v <= version) {
                        sub.count = Some(count);
                    }
                }
            }
            Heard::GroupAnswer(Err(code)) => {
                d.group_held = false;
                if code == proto::ErrorCode::Unsupported {
                    d.groups_unsupported = true;
                    self.group_truth.refused += 1;
                }
                self.note(format!(
                    "device {device}: group subscribe refused: {code:?}"
                ));
            }
            Heard::GroupPush {
                stream,
                version,
                count,
                member,
            } => {
                if count > members {
                    return Err(violation("G2", format!("device {device} told {count}")));
                }
                if member.is_some() && user != ADMIN {
                    return Err(violation(
                        "G4",
                        format!("device {device} of u{user}, no admin, told {member:?}"),
                    ));
                }
                let Some(sub) = d.conn.as_mut().and_then(|c| c.group.as_mut()) else {
                    return Err(format!("device {device}: a group push, never subscribed"));
                };
                let highest = sub.versions.entry(stream).or_default();
                if version <= *highest {
                    return Err(violation(
                        "G3",
                        format!(
                            "device {device} told the group's count at {version:#x} after {:#x} on stream {stream}",
                            *highest
                        ),
                    ));
                }
                *highest = version;
                sub.count = Some(count);
                self.note(format!(
                    "device {device} told the group's count {count} at {version:#x}"
                ));
            }
            Heard::GroupEnded => {
                return Err(format!("device {device}: the group ended, never left"));
            }
            _ => {}
        }
        Ok(())
    }

    /// G1: at quiescence, every subscribed connection's count is the
    /// members shown online by their newest published views.
    pub(super) fn check_groups(&mut self) -> Result<(), String> {
        if !self.opts.groups {
            return Ok(());
        }
        let since = self.calm_since.max(self.group_truth.changed_at);
        let settled = self.group_truth.input_at + INPUT_SETTLE;
        if self.now < since + GROUP_BOUND || self.now < settled {
            return Ok(());
        }
        let truth = self
            .group_truth
            .published
            .values()
            .filter(|(_, online)| *online)
            .count() as u32;
        let mut judged = false;
        for (i, d) in self.devices.iter().enumerate() {
            let Some(conn) = &d.conn else {
                continue;
            };
            let Some(sub) = conn.group.as_ref().filter(|s| s.since.is_some()) else {
                continue;
            };
            if self.closing.contains(&conn.id) {
                continue;
            }
            judged = true;
            if sub.count != Some(truth) {
                return Err(violation(
                    "G1",
                    format!(
                        "device {i} (on {}) shows the group's count {:?}, {truth} online by the published views",
                        self.names[conn.node], sub.count
                    ),
                ));
            }
        }
        self.group_truth.judged += u64::from(judged);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    /// The bound's interval is the core's default, which the nodes run.
    #[test]
    fn the_group_interval_is_the_cores() {
        let core = greendot_core::Config::default().group_interval;
        assert_eq!(super::GROUP_INTERVAL.as_millis(), u128::from(core.0));
    }
}
