//! The cluster's NATS I/O, a thin task next to the server's driver: it does
//! what the sans-IO state asks (`ClusterOutput`: publish a view, ask an
//! owner, answer a request, write preferences, watch a shard) with
//! greendot-cluster, and hands the state what NATS brings (`ClusterInput`).
//! No presence logic lives here.

use greendot_cluster::{
    Cluster, ClusterError, GroupEvent, MemberEvent, NodeStatus, OwnerRequest, RequestKind, ShardId,
};
use greendot_server::cluster::{self as gc, ClusterInput, ClusterOutput};
use greendot_server::ClusterInputs;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};

/// Requests to this node's shards waiting for the state's answer at most;
/// past it new ones are dropped (their askers time out and retry).
const MAX_PENDING_REPLIES: usize = 65_536;

fn kind_of(kind: gc::RequestKind) -> RequestKind {
    match kind {
        gc::RequestKind::Input => RequestKind::Input,
        gc::RequestKind::Snapshot => RequestKind::Snapshot,
    }
}

/// The shards the node may act for now, each until the earlier of its
/// claim's and the lease's deadline.
fn acting(status: &NodeStatus) -> BTreeMap<u32, (u64, Instant)> {
    if !status.acting(Instant::now()) {
        return BTreeMap::new();
    }
    status
        .shards
        .iter()
        .map(|(shard, owned)| {
            let until = owned.may_act_until.min(status.lease_until);
            (shard.0, (owned.epoch, until))
        })
        .collect()
}

/// Serves the requests of exactly the shards in `shards`.
async fn serve_shards(
    inbox: &mut greendot_cluster::OwnerInbox,
    shards: &BTreeMap<u32, (u64, Instant)>,
) {
    for shard in inbox.serving() {
        if !shards.contains_key(&shard.0) {
            inbox.stop(shard);
        }
    }
    for shard in shards.keys() {
        if let Err(e) = inbox.serve(ShardId(*shard)).await {
            warn!(shard, error = %e, "cannot serve the shard's requests");
        }
    }
}

/// The next join or leave of a node; never without the watch.
async fn next_member(
    watch: &mut Option<greendot_cluster::MemberWatch>,
) -> Option<greendot_cluster::Result<MemberEvent>> {
    match watch {
        Some(watch) => watch.next().await,
        None => std::future::pending().await,
    }
}

/// The next message of a subject feed; never without the subscription.
async fn next_on(feed: &mut Option<greendot_cluster::SubjectFeed>) -> Option<bytes::Bytes> {
    match feed {
        Some(feed) => feed.recv().await,
        None => std::future::pending().await,
    }
}

/// Tells the state that `node` runs as `incarnation`: its older runs'
/// devices are lost as of now. `false` once the state is gone.
async fn edge_restarted(inputs: &ClusterInputs, node: String, incarnation: u64) -> bool {
    let input = ClusterInput::EdgeRestarted {
        node,
        incarnation,
        last_heard: greendot_cluster::unix_ms(),
    };
    inputs.send(input).await
}

fn def_to_state(d: greendot_cluster::GroupDef) -> gc::GroupDef {
    gc::GroupDef {
        group: d.group,
        membership: d.membership,
        next_ordinal: d.next_ordinal,
        members: d.members,
        admins: d.admins,
        removed: d.removed,
    }
}

fn def_from_state(d: gc::GroupDef) -> greendot_cluster::GroupDef {
    greendot_cluster::GroupDef {
        group: d.group,
        membership: d.membership,
        next_ordinal: d.next_ordinal,
        members: d.members,
        admins: d.admins,
        removed: d.removed,
    }
}

/// Hands the state the groups bucket's definitions as they change, making
/// the watch again (a second later) when it ends or cannot be made: the
/// state keeps the newest revision of each.
async fn feed_groups(cluster: Cluster, inputs: ClusterInputs) {
    loop {
        match cluster.watch_groups().await {
            Ok(mut watch) => {
                while let Some(event) = watch.next().await {
                    let input = match event {
                        Ok(GroupEvent::Changed {
                            group,
                            revision,
                            def,
                        }) => ClusterInput::GroupChanged {
                            group,
                            revision,
                            def: def.map(def_to_state),
                        },
                        Ok(GroupEvent::Synced) => ClusterInput::GroupsSynced,
                        Err(e) => {
                            warn!(error = %e, "a group definition that does not open was skipped");
                            continue;
                        }
                    };
                    if !inputs.send(input).await {
                        return;
                    }
                }
                warn!("the groups watch ended: made again");
            }
            Err(e) => warn!(error = %e, "cannot watch the cluster's groups: tried again"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

pub async fn run(
    cluster: Cluster,
    mut status: watch::Receiver<NodeStatus>,
    mut outputs: mpsc::Receiver<ClusterOutput>,
    inputs: ClusterInputs,
) {
    tokio::spawn(feed_groups(cluster.clone(), inputs.clone()));
    let mut feed = cluster.view_feed();
    let mut inbox = cluster.owner_inbox();
    // Every node hears every new owner's resync request (one subscription).
    let mut resyncs = match cluster.resync_feed().await {
        Ok(sub) => Some(sub),
        Err(e) => {
            warn!(error = %e, "cannot subscribe to resync requests: failovers will show devices offline");
            None
        }
    };
    // Every node hears every owner's beacon (one subscription).
    let mut beacons = match cluster.beacon_feed().await {
        Ok(sub) => Some(sub),
        Err(e) => {
            warn!(error = %e, "cannot subscribe to beacons: a lost view leaves watchers stale until the user's next change");
            None
        }
    };
    // Every node hears every group count (one subscription).
    let mut group_counts = match cluster.group_counts_feed().await {
        Ok(sub) => Some(sub),
        Err(e) => {
            warn!(error = %e, "cannot subscribe to group counts: group subscriptions here see no count change");
            None
        }
    };
    // Owners send the truths of users with devices here to this one subject.
    let mut truths = match cluster.edge_feed().await {
        Ok(sub) => Some(sub),
        Err(e) => {
            warn!(error = %e, "cannot subscribe to this edge's subject: users watching themselves miss changes made elsewhere");
            None
        }
    };
    let timeout = cluster.config().op_timeout;
    // Owners treat the devices of a node whose lease went as lost.
    let lease_ttl = cluster.config().lease_ttl;
    let mut members = match cluster.watch_members().await {
        Ok(watch) => Some(watch),
        Err(e) => {
            warn!(error = %e, "cannot watch the node leases: devices of dead nodes stay online");
            None
        }
    };
    let mut pending: HashMap<u64, (OwnerRequest, Instant)> = HashMap::new();
    let mut next_reply = 0u64;
    let mut last: Option<BTreeMap<u32, (u64, Instant)>> = None;
    let mut rejoins = status.borrow().rejoins;
    loop {
        let (shards, rejoined) = {
            let now = status.borrow_and_update();
            (acting(&now), now.rejoins)
        };
        if rejoined > rejoins {
            rejoins = rejoined;
            // Owners may have dropped this node's devices with its lease.
            if !inputs.send(ClusterInput::Rejoined).await {
                return;
            }
        }
        if last.as_ref() != Some(&shards) {
            serve_shards(&mut inbox, &shards).await;
            if !inputs
                .send(ClusterInput::Status {
                    shards: shards.clone(),
                })
                .await
            {
                return;
            }
            last = Some(shards);
        }
        tokio::select! {
            changed = status.changed() => {
                if changed.is_err() {
                    // The duty task ended (cut off or left): own nothing.
                    let _ = inputs.send(ClusterInput::Status { shards: BTreeMap::new() }).await;
                    return;
                }
            }
            event = next_member(&mut members) => match event {
                Some(Ok(MemberEvent::Left { node, .. })) => {
                    // The lease was last renewed at most a TTL ago.
                    let ms = u64::try_from(lease_ttl.as_millis()).unwrap_or(u64::MAX);
                    let last_heard = greendot_cluster::unix_ms().saturating_sub(ms);
                    let input = ClusterInput::EdgeLost { node: node.to_string(), last_heard };
                    if !inputs.send(input).await {
                        return;
                    }
                }
                Some(Ok(MemberEvent::Restarted { node, incarnation, .. })) => {
                    // Restarted within its TTL: its previous run died at an
                    // unknown moment before; its devices get their full
                    // grace from now, when their loss is known.
                    if !edge_restarted(&inputs, node.to_string(), incarnation).await {
                        return;
                    }
                }
                Some(Ok(MemberEvent::Joined { node, .. })) => {
                    // Devices of an older run this owner still holds (its
                    // leave was missed: the watch was made again) are lost.
                    let incarnation = members
                        .as_ref()
                        .and_then(|w| w.membership().member(&node))
                        .and_then(|m| m.incarnation);
                    if let Some(incarnation) = incarnation {
                        if !edge_restarted(&inputs, node.to_string(), incarnation).await {
                            return;
                        }
                    }
                }
                Some(Err(e)) => debug!(error = %e, "node lease watch"),
                None => {
                    warn!("the node lease watch ended: devices of dead nodes stay online");
                    members = None;
                }
            },
            Some(payload) = next_on(&mut truths) => {
                if !inputs.send(ClusterInput::EdgeMessage { payload }).await {
                    return;
                }
            }
            Some(payload) = next_on(&mut resyncs) => {
                if !inputs.send(ClusterInput::Resync { payload }).await {
                    return;
                }
            }
            Some(payload) = next_on(&mut beacons) => {
                if !inputs.send(ClusterInput::Beacon { payload }).await {
                    return;
                }
            }
            Some(payload) = next_on(&mut group_counts) => {
                if !inputs.send(ClusterInput::GroupCounts { payload }).await {
                    return;
                }
            }
            msg = feed.recv() => {
                let input = ClusterInput::ShardMessage { shard: msg.shard.0, payload: msg.payload };
                if !inputs.send(input).await {
                    return;
                }
            }
            req = inbox.recv() => {
                let now = Instant::now();
                // An answer the state never gave is useless after the asker's timeout.
                pending.retain(|_, (_, at)| now.duration_since(*at) < timeout * 2);
                if pending.len() >= MAX_PENDING_REPLIES {
                    debug!("too many requests waiting for answers: dropped one");
                    continue;
                }
                next_reply += 1;
                let kind = match req.kind {
                    RequestKind::Input => gc::RequestKind::Input,
                    RequestKind::Snapshot => gc::RequestKind::Snapshot,
                };
                let input = ClusterInput::Request {
                    shard: req.shard.0,
                    kind,
                    payload: req.payload.clone(),
                    reply: next_reply,
                };
                pending.insert(next_reply, (req, now));
                if !inputs.send(input).await {
                    return;
                }
            }
            out = outputs.recv() => {
                let Some(out) = out else { return };
                match out {
                    ClusterOutput::Publish { shard, payload } => {
                        match cluster.publish_view(ShardId(shard), payload).await {
                            // Down: the failed lease and claim renewals
                            // say so; a line per view would flood the log.
                            Err(e @ ClusterError::Reconnecting { .. }) => {
                                debug!(shard, error = %e, "cannot publish a view");
                            }
                            Err(e) => warn!(shard, error = %e, "cannot publish a view"),
                            Ok(()) => {}
                        }
                    }
                    ClusterOutput::PublishToEdge { node, payload } => {
                        let sent = match greendot_cluster::NodeId::new(node) {
                            Ok(node) => cluster.publish_to_edge(&node, payload).await,
                            Err(e) => Err(e.into()),
                        };
                        if let Err(e) = sent {
                            debug!(error = %e, "cannot send a truth to an edge");
                        }
                    }
                    ClusterOutput::Request { id, shard, kind, payload } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        // Each request waits on its own task, never the loop.
                        tokio::spawn(async move {
                            let asked = c.request(ShardId(shard), kind_of(kind), payload);
                            let payload = match tokio::time::timeout(timeout, asked).await {
                                Ok(Ok(bytes)) => Some(bytes),
                                _ => None,
                            };
                            inputs.send(ClusterInput::Answered { id, payload }).await;
                        });
                    }
                    ClusterOutput::Reply { reply, payload } => {
                        if let Some((req, _)) = pending.remove(&reply) {
                            if let Err(e) = inbox.reply(&req, payload).await {
                                debug!(error = %e, "cannot answer a request");
                            }
                        }
                    }
                    ClusterOutput::PutPrefs { id, user, epoch, value } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        tokio::spawn(async move {
                            let ok = match c.put_preferences(&user, epoch, value).await {
                                Ok(_) => true,
                                Err(e) => {
                                    warn!(error = %e, "cannot store preferences");
                                    false
                                }
                            };
                            inputs.send(ClusterInput::PrefsStored { id, ok }).await;
                        });
                    }
                    ClusterOutput::LoadUser { id, user } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        tokio::spawn(async move {
                            // A failed read is asked again (the user's inputs
                            // wait): started fresh, a user who chose to be
                            // invisible would be shown online.
                            let read = async {
                                let prefs = c.preferences(&user).await?;
                                let view = c.view(&user).await?;
                                Ok::<_, greendot_cluster::ClusterError>((prefs, view))
                            };
                            let input = match read.await {
                                Ok((prefs, view)) => ClusterInput::UserLoaded { id, prefs, view },
                                Err(e) => {
                                    warn!(error = %e, "cannot read a user's preferences or last view: asking again");
                                    ClusterInput::UserLoadFailed { id }
                                }
                            };
                            inputs.send(input).await;
                        });
                    }
                    ClusterOutput::PutView { user, value } => {
                        let c = cluster.clone();
                        tokio::spawn(async move {
                            if let Err(e) = c.put_view(&user, value).await {
                                debug!(error = %e, "cannot store a view");
                            }
                        });
                    }
                    ClusterOutput::PutShardDevices { shard, fence, value } => {
                        let c = cluster.clone();
                        tokio::spawn(async move {
                            if let Err(e) = c.put_shard_devices(ShardId(shard), fence, value).await {
                                debug!(shard, error = %e, "cannot store the shard's devices");
                            }
                        });
                    }
                    ClusterOutput::LoadShard { id, shard } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        tokio::spawn(async move {
                            // A failed read is asked again: taken as empty, the
                            // previous owner's devices would be lost.
                            let input = match c.shard_devices(ShardId(shard)).await {
                                Ok(record) => ClusterInput::ShardLoaded { id, record },
                                Err(e) => {
                                    warn!(shard, error = %e, "cannot read the shard's devices: asking again");
                                    ClusterInput::ShardLoadFailed { id }
                                }
                            };
                            inputs.send(input).await;
                        });
                    }
                    ClusterOutput::PutSession { id, user, device, value } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        tokio::spawn(async move {
                            let ok = match c.put_session(&user, &device, value).await {
                                Ok(_) => true,
                                Err(e) => {
                                    warn!(error = %e, "cannot store a session record");
                                    false
                                }
                            };
                            inputs.send(ClusterInput::SessionStored { id, ok }).await;
                        });
                    }
                    ClusterOutput::WriteGroup { id, def, expected } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        tokio::spawn(async move {
                            let group = def.group;
                            let outcome = match c.write_group_if(&def_from_state(def), expected).await {
                                Ok(revision) => gc::GroupWriteOutcome::Written { revision },
                                Err(ClusterError::Conflict { .. }) => gc::GroupWriteOutcome::Conflict,
                                Err(e) => {
                                    warn!(group, error = %e, "cannot store a group");
                                    gc::GroupWriteOutcome::Failed(e.to_string())
                                }
                            };
                            inputs.send(ClusterInput::GroupWritten { id, outcome }).await;
                        });
                    }
                    ClusterOutput::ReadGroup { id, group } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        tokio::spawn(async move {
                            let read = match c.read_group(group).await {
                                Ok(Some((revision, def))) => Ok((revision, Some(def_to_state(def)))),
                                Ok(None) => Ok((0, None)),
                                Err(e) => {
                                    warn!(group, error = %e, "cannot read a group");
                                    Err(e.to_string())
                                }
                            };
                            inputs.send(ClusterInput::GroupRead { id, read }).await;
                        });
                    }
                    ClusterOutput::LoadSession { id, user, device } => {
                        let (c, inputs) = (cluster.clone(), inputs.clone());
                        tokio::spawn(async move {
                            // A failed read starts the session fresh (the
                            // client subscribes again) rather than holding it.
                            let record = c.session(&user, &device).await.unwrap_or_else(|e| {
                                warn!(error = %e, "cannot read a session record");
                                None
                            });
                            inputs.send(ClusterInput::SessionLoaded { id, record }).await;
                        });
                    }
                    ClusterOutput::DeleteSession { user, device } => {
                        let c = cluster.clone();
                        tokio::spawn(async move {
                            if let Err(e) = c.delete_session(&user, &device).await {
                                debug!(error = %e, "cannot delete a session record");
                            }
                        });
                    }
                    ClusterOutput::Resync { payload } => {
                        if let Err(e) = cluster.publish_resync(payload).await {
                            warn!(error = %e, "cannot ask the edges to resync");
                        }
                    }
                    ClusterOutput::Beacon { payload } => {
                        if let Err(e) = cluster.publish_beacon(payload).await {
                            debug!(error = %e, "cannot publish a beacon");
                        }
                    }
                    ClusterOutput::GroupCounts { payload } => {
                        // A lost one is published again within a group interval.
                        if let Err(e) = cluster.publish_group_counts(payload).await {
                            debug!(error = %e, "cannot publish group counts");
                        }
                    }
                    ClusterOutput::Watch { shard } => {
                        if let Err(e) = feed.watch(ShardId(shard)).await {
                            warn!(shard, error = %e, "cannot watch the shard's views");
                        }
                    }
                    ClusterOutput::Unwatch { shard } => feed.unwatch(ShardId(shard)),
                }
            }
        }
    }
}
