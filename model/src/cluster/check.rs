//! The properties' judgements of a state, and its short account.

use super::*;

pub(super) fn has(s: &ClusterState, id: &str) -> bool {
    s.bad
        .iter()
        .any(|b| b.split_once(':').is_some_and(|(p, _)| p == id))
}

/// C3: alice gone for good (not invisible) is shown offline by every owner
/// within `GHOST_BOUND` ticks of losing her connection.
pub(super) fn c3(s: &ClusterState) -> bool {
    let Some(since) = s.alice.away_since else {
        return true;
    };
    if !s.alice.gone || s.alice.invisible_asked || s.t <= since + GHOST_BOUND {
        return true;
    }
    // Her desktop keeps her online (the aggregate's business).
    if s.nodes[WATCHER_NODE as usize].devices[DESKTOP as usize].is_some() {
        return true;
    }
    s.nodes
        .iter()
        .filter_map(|n| n.owner.as_deref())
        .all(|o| !o.core.presence(ALICE).online)
}

/// The acting owner, when the world is quiet: nothing in flight (messages
/// or writes), at least one tick since the last fault or input (so a beacon
/// went out after it), the claim holder acting, and bob's edge subscribed.
pub(super) fn quiet(s: &ClusterState) -> Option<&OwnerState> {
    if !s.net.is_empty() || !s.writes.is_empty() || s.t <= s.quiet_since {
        return None;
    }
    let (holder, epoch, _) = s.kv.claim?;
    let o = s.nodes[holder as usize].owner.as_deref()?;
    (o.epoch == epoch && !s.nodes[holder as usize].cut).then_some(o)
}

/// C5: when quiet, bob's view of alice is the owner's published view.
pub(super) fn c5(s: &ClusterState) -> bool {
    let Some(o) = quiet(s) else {
        return true;
    };
    if s.bob.at.is_none() {
        return true; // his edge died; he has not resumed yet
    }
    s.bob.view.get(ALICE) == Some(&o.core.presence(ALICE))
}

/// A short account of a state, for counterexamples.
pub fn describe(s: &ClusterState) -> String {
    let owners: Vec<String> = s
        .nodes
        .iter()
        .enumerate()
        .filter_map(|(n, node)| {
            node.owner.as_deref().map(|o| {
                format!(
                    "owner {n} {:?} shows {:?}",
                    o.epoch,
                    Shown(o.core.presence(ALICE)).0
                )
            })
        })
        .collect();
    let bob = s.bob.view.get(ALICE).cloned();
    format!(
        "t={} claim={:?} alice={:?} owners={owners:?} bob={bob:?} bad={:?}",
        s.t, s.kv.claim, s.alice, s.bad
    )
}
