//! What the multi-node simulation checks, as watchers and the bus see it:
//!
//! - **C1, one writer:** a node publishes a shard's views, and answers
//!   `Done` for a shard's inputs, only while its status names the shard
//!   and the claim's deadline has not passed (node-local time).
//! - **Versions only rise, per watcher:** on each push stream, a user's
//!   versions strictly rise. Snapshots (on the control stream) and pushes
//!   cross, and a resume's answer may be older than what the device was
//!   shown before: the device keeps the highest, as docs/protocol.md tells
//!   clients (what it drops is counted as `stale_dropped`), and the checks
//!   below judge what it keeps.
//! - **C2, no false offline:** no watcher that shows a user online is
//!   shown her offline while one of her devices has been connected since
//!   [`SETTLE`] before to a node that ran, unpaused and not cut off alone,
//!   all along (whole-bus outages included: nobody owns then, so nobody
//!   publishes an offline). A user shown offline before stays so until her
//!   device's connect reaches an owner; that is no flap. Nor is an offline
//!   shown to a watcher that missed it or an earlier offline of hers (shown
//!   to other watchers before the watcher's connection began): it only
//!   says it again.
//! - **C3, bounded ghosts:** once a user has had no connected device, and
//!   the cluster no fault, for [`GHOST_BOUND`], every settled watcher shows
//!   the user offline. A logged-out user's last view is therefore offline.
//! - **C4, invisibility never leaks:** after `SetInvisible(true)` was
//!   answered (and no request to be visible since), no watcher is shown the
//!   user online: not by a view received later than [`DELIVERY`] after the
//!   answer, and not as its latest view [`SETTLE`] after it.

use std::time::Duration;

/// How long after a device's welcome (or a watcher's subscription, or the
/// end of its node's trouble) the checks hold it to them: a connect may
/// wait for a new owner's resync window and a request's retries.
pub const SETTLE: Duration = Duration::from_secs(20);

/// A message on a healthy bus reaches its node within this.
pub const DELIVERY: Duration = Duration::from_secs(2);

/// Lease TTL (15 s) + the longest grace (mobile, 30 s) + debounce (0.3 s),
/// plus a new owner's resync window (the request timeout, 15 s: during it
/// an owner publishes no offline for a device it has not heard of) and 5 s
/// for delivery and repair; counted from the later of the user's last
/// device's end and the end of the last fault.
pub const GHOST_BOUND: Duration = Duration::from_millis(15_000 + 30_000 + 300 + 15_000 + 5_000);

/// A violation, with what it names.
pub fn violation(what: &str, detail: String) -> String {
    format!("{what}: {detail}")
}

use super::world::World;
use greendot_proto as proto;
use greendot_server::cluster::{ClusterOutput, FromOwner};

impl World {
    /// Ran, unpaused and reachable since `since` (and still).
    fn node_fine_since(&self, node: usize, since: Duration) -> bool {
        let n = &self.nodes[node];
        n.running() && n.troubled_at <= since && n.cut_until <= since
    }

    /// A watcher the checks hold to them: welcomed, subscribed for
    /// [`SETTLE`], on a node fine for as long.
    fn settled_watcher(&self, device: usize) -> bool {
        let Some(conn) = &self.devices[device].conn else {
            return false;
        };
        let Some(since) = conn.subscribed else {
            return false;
        };
        let Some(from) = self.now.checked_sub(SETTLE) else {
            return false;
        };
        since <= from && self.node_fine_since(conn.node, from) && !self.closing.contains(&conn.id)
    }

    /// C1: what node `node` sends, checked against its status.
    pub(super) fn check_output(&self, node: usize, out: &ClusterOutput) -> Result<(), String> {
        let acts = |shard: u32, epoch: Option<u64>| {
            self.nodes[node]
                .status
                .get(&shard)
                .is_some_and(|(e, until)| self.now < *until && epoch.is_none_or(|x| x == *e))
        };
        match out {
            ClusterOutput::Publish { shard, .. } if !acts(*shard, None) => Err(violation(
                "C1",
                format!(
                    "{} published on shard {shard} without acting for it",
                    self.names[node]
                ),
            )),
            ClusterOutput::Reply { reply, payload } => {
                let done = proto::decode::<FromOwner>(payload)
                    .ok()
                    .and_then(|f| match f {
                        FromOwner::Done { epoch } => Some(epoch),
                        _ => None,
                    });
                match (done, self.bus.reply_shard(*reply)) {
                    (Some(epoch), Some(shard)) if !acts(shard, Some(epoch)) => Err(violation(
                        "C1",
                        format!(
                            "{} answered Done for shard {shard} at epoch {epoch} without acting for it",
                            self.names[node]
                        ),
                    )),
                    _ => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// A view a device was just shown (before it is kept).
    pub(super) fn check_view(
        &self,
        device: usize,
        target: usize,
        presence: &proto::Presence,
    ) -> Result<(), String> {
        let Some(conn) = &self.devices[device].conn else {
            return Ok(());
        };
        let watcher_node = conn.node;
        let now = self.now;
        let truth = &self.users[target];
        // Online as the newest view it could have: not if an offline view
        // after it (this one, or one between) was shown to others before
        // this connection began (the device missed it, disconnected), so
        // that this offline only says it again, late.
        let since = conn.welcomed.unwrap_or(now);
        let was_online = self.devices[device].seen.get(&target).is_some_and(|s| {
            let missed = presence.version > s.version
                && truth
                    .offline_shown
                    .range(s.version + 1..=presence.version)
                    .any(|(_, first)| *first < since);
            s.online && !missed
        });
        if !presence.online && was_online && !truth.may_hide {
            let from = now.saturating_sub(SETTLE);
            let watcher_fine = now >= SETTLE && self.node_fine_since(watcher_node, from);
            let connected = (0..self.devices.len()).find(|&d| {
                let dev = &self.devices[d];
                dev.user == target
                    && dev.conn.as_ref().is_some_and(|c| {
                        !c.logging_out
                            && !self.closing.contains(&c.id)
                            && c.welcomed.is_some_and(|w| {
                                w + SETTLE <= now && self.node_fine_since(c.node, w)
                            })
                    })
            });
            if let (true, Some(d)) = (watcher_fine, connected) {
                return Err(violation(
                    "C2",
                    format!(
                        "device {device} shown u{target} offline (version {:#x}) while device {d} is connected",
                        presence.version
                    ),
                ));
            }
        }
        if presence.online && !truth.ambiguous {
            if let Some(acked) = truth.invisible_acked {
                if now > acked + DELIVERY && self.node_fine_since(watcher_node, acked) {
                    return Err(violation(
                        "C4",
                        format!(
                            "device {device} shown u{target} online (version {:#x}) after its invisibility was acknowledged",
                            presence.version
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// C3 and C4 on every settled watcher's latest views.
    pub(super) fn check_state(&self) -> Result<(), String> {
        let now = self.now;
        for (u, truth) in self.users.iter().enumerate() {
            let present = self.devices.iter().any(|d| d.user == u && d.conn.is_some());
            let gone_since = truth.last_device.max(self.calm_since);
            let ghost_due = !present && now >= gone_since + GHOST_BOUND;
            let hidden_due = !truth.ambiguous
                && truth
                    .invisible_acked
                    .is_some_and(|acked| now >= acked.max(self.calm_since) + SETTLE);
            if !ghost_due && !hidden_due {
                continue;
            }
            for w in 0..self.devices.len() {
                if !self.settled_watcher(w) {
                    continue;
                }
                let Some(seen) = self.devices[w].seen.get(&u) else {
                    continue;
                };
                if seen.online {
                    let what = if ghost_due { "C3" } else { "C4" };
                    return Err(violation(
                        what,
                        format!(
                            "device {w} still shows u{u} online (version {:#x}, since {:.3} s)",
                            seen.version,
                            seen.at.as_secs_f64()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}
