//! `greendot cluster status`: what the cluster's KV says now.

use greendot_cluster::{chain, observe, unix_ms, ClusterView, ShardId};
use std::fmt::Write;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(2);

fn age(ms: u64, now: u64) -> String {
    let d = now.saturating_sub(ms);
    format!("{}.{}s", d / 1000, (d % 1000) / 100)
}

/// The table `greendot cluster status` prints.
pub fn render(view: &ClusterView, shard: Option<u32>, each: bool, now_ms: u64) -> String {
    let mut out = String::new();
    let owned = view.owned_by();
    let _ = writeln!(out, "nodes: {}", view.nodes.len());
    let _ = writeln!(
        out,
        "{:<16} {:<24} {:>8} {:>10} {:>10} {:>7}",
        "NODE", "ADDRESS", "UP", "RENEWED", "EXPIRES", "SHARDS"
    );
    for n in &view.nodes {
        let count = owned.get(&n.node).map_or(0, Vec::len);
        match &n.info {
            Some(i) => {
                let expires = (i.renewed_ms + i.lease_ttl_ms).saturating_sub(now_ms);
                let _ = writeln!(
                    out,
                    "{:<16} {:<24} {:>8} {:>10} {:>10} {:>7}",
                    n.node.as_str(),
                    i.advertise,
                    age(i.started_ms, now_ms),
                    format!("{} ago", age(i.renewed_ms, now_ms)),
                    format!("in {}", age(0, expires)),
                    count
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "{:<16} (lease value not written by greendot)",
                    n.node.as_str()
                );
            }
        }
    }
    for (owner, shards) in &owned {
        if !view.nodes.iter().any(|n| &n.node == *owner) {
            let _ = writeln!(
                out,
                "{:<16} (no live lease) {:>48}",
                owner.as_str(),
                shards.len()
            );
        }
    }
    match view.shard_count() {
        Some(total) => {
            let unowned: Vec<u32> = (0..total)
                .filter(|s| !view.claims.contains_key(&ShardId(*s)))
                .collect();
            let _ = writeln!(
                out,
                "shards: {total}, owned {}, unowned {}",
                total as usize - unowned.len(),
                unowned.len()
            );
            if !unowned.is_empty() {
                let list: Vec<String> = unowned.iter().take(32).map(u32::to_string).collect();
                let more = if unowned.len() > 32 { " …" } else { "" };
                let _ = writeln!(out, "unowned: {}{more}", list.join(" "));
            }
        }
        None => {
            let _ = writeln!(
                out,
                "shards: {} claimed (no live node to tell the shard count)",
                view.claims.len()
            );
        }
    }
    if each {
        for (owner, shards) in &owned {
            let list: Vec<String> = shards.iter().map(|(s, e)| format!("{s}@{e}")).collect();
            let _ = writeln!(out, "{}: {}", owner.as_str(), list.join(" "));
        }
    }
    if let Some(s) = shard {
        match view.claims.get(&ShardId(s)) {
            Some(c) => {
                let _ = writeln!(
                    out,
                    "shard {s}: owner {} epoch {} revision {}",
                    c.owner, c.epoch, c.revision
                );
            }
            None => {
                let _ = writeln!(out, "shard {s}: unowned");
            }
        }
    }
    out
}

pub async fn status(
    urls: &str,
    access: &greendot_cluster::NatsAccess,
    shard: Option<u32>,
    each: bool,
) -> Result<(), String> {
    let view = observe(urls, access, "gd", TIMEOUT)
        .await
        .map_err(|e| format!("cannot read the cluster at {urls}: {}", chain(&e)))?;
    print!("{}", render(&view, shard, each, unix_ms()));
    Ok(())
}
