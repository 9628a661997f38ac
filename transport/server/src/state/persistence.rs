//! The store seen from the state: the changed user records written
//! behind, and what the store loaded restored into a fresh hub.

use super::{ServerOutput, ServerState, StoreRequest};
use crate::hub::Hub;
use crate::store::{Batch, Loaded};
use crate::{readmit_ms, record, ServerConfig, ServerError};
use greendot_core::{Millis, UserId};
use tracing::{error, info, warn};

/// User names checked per lease-renewal tick by [`Hub::sweep`].
pub(super) const SWEEP_BUDGET: usize = 4096;

impl ServerState {
    /// The records of every user changed since the last write.
    pub(super) fn changed_records(&mut self) -> Batch {
        self.dirty_users.extend(self.hub.take_touched());
        let mut users: Vec<UserId> = self.dirty_users.drain().collect();
        users.sort_unstable();
        let users = users
            .into_iter()
            .filter_map(|u| record(&self.hub, u))
            .collect();
        Batch {
            users,
            alive_at: Some(self.clock.at(self.last_now).0),
            ..Batch::default()
        }
    }

    pub(super) fn flush_store(&mut self) {
        let batch = self.changed_records();
        // Users are freed only once their records are taken: a freed user's
        // record can no longer be read.
        self.hub.release_idle();
        self.hub.sweep(SWEEP_BUDGET);
        self.outputs
            .push_back(ServerOutput::Store(StoreRequest::Behind(batch)));
    }
}

/// Restores everything saved into a fresh hub. A record that cannot be
/// restored stops the start: starting without it could show an invisible
/// user online.
pub(super) fn restore(
    hub: &mut Hub,
    loaded: Loaded,
    now: Millis,
    config: &ServerConfig,
) -> Result<(), ServerError> {
    let mut restored = 0usize;
    for (name, record) in &loaded.users {
        let saved = record.to_saved(loaded.alive_at);
        match hub.restore(name, saved.clone()) {
            Ok(_) => restored += 1,
            Err(e) => {
                // A message over a lowered cap: keep the rest.
                let without = greendot_core::Saved {
                    message: None,
                    ..saved
                };
                hub.restore(name, without)
                    .map_err(|source| ServerError::Restore {
                        user: name.clone(),
                        source,
                    })
                    .inspect(|_| warn!(user = %name, error = %e, "restored without its message"))?;
                restored += 1;
            }
        }
    }
    // Devices live at a drained shutdown come back as lost connections, as of
    // just over one debounce ago, so that those shown online are published
    // online again before anyone subscribes.
    let back = Millis(
        now.0
            .saturating_sub(config.core.debounce.0.saturating_add(1)),
    );
    // They come back at most at the admission rate: each lingers for its
    // grace plus the time to readmit them all, so that nobody waiting for
    // their turn is shown offline.
    let readmit = readmit_ms(loaded.drained.len(), config.max_handshakes_per_sec);
    let mut lingering = 0usize;
    for d in &loaded.drained {
        let grace = config.core.kind(d.kind.into()).grace;
        let until = Millis(now.0.saturating_add(grace.0).saturating_add(readmit));
        match hub.restore_device(back, &d.user, &d.device, d.kind, until) {
            Ok(()) => lingering += 1,
            Err(e) => {
                warn!(user = %d.user, device = %d.device, error = %e, "cannot restore a device")
            }
        }
    }
    let mut groups = 0usize;
    // A cluster's groups live in its groups bucket: these are from a time
    // the node ran alone, and stay stored untouched.
    let saved_groups = match config.cluster {
        Some(_) if !loaded.groups.is_empty() => {
            warn!(
                groups = loaded.groups.len(),
                "groups saved while running alone are not served in a cluster"
            );
            &[][..]
        }
        _ => &loaded.groups[..],
    };
    for g in saved_groups {
        match hub.restore_group(now, g) {
            Ok(()) => groups += 1,
            // Over a lowered limit: the record stays stored until the group
            // is written again, and the limit can be raised to bring it back.
            // A write meanwhile starts above its version.
            Err(e) => {
                hub.raise_group_membership_floor(g.membership);
                error!(group = g.group, members = g.members.len(), error = %e, "a stored group was not restored")
            }
        }
    }
    // After the groups: those restored keep their own versions.
    hub.raise_group_membership_floor(loaded.group_membership_floor);
    hub.handle_timeout(now);
    while hub.poll_output().is_some() {}
    hub.take_touched();
    info!(
        users = restored,
        groups,
        lingering,
        clean = loaded.clean,
        "restored the saved state"
    );
    Ok(())
}
