//! Group counts across nodes (`group_owner`, `group_agg`, `group_edge`):
//! each owner's slice of a group is counted from its published views and
//! sent to the owner of the group's home shard, which sums the partials and
//! publishes the count; every edge feeds it to its hub's core. A new owner
//! of the home shard sums again from the partials the owners send on its
//! resync request, under versions above the previous owner's. Member
//! pages take their keys from that owner and their entries from the
//! members' owners.

use super::group_dir::GroupDef;
use super::test_support::{by_len, SHARDS};
use super::wire::{decode, GroupCounts, GROUPS_SINCE, PAGES_SINCE};
use super::{ClusterInput, ClusterLink, ClusterOutput, ClusterSettings, Finished, PAGE_WATCHER};
use crate::hub::GroupFeed;
use greendot_core::{Config, Millis, Output, SessionId, UserId};
use greendot_proto as proto;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const GROUP: u64 = 9;

/// "ann" is in shard 3, "bo" in 2, "carl" in 0, "dave1" in 1; the group's
/// home shard is 3 ("group/9" has 7 bytes).
const MEMBERS: [&str; 4] = ["ann", "bo", "carl", "dave1"];

fn link(node: &str, protocol: u8) -> ClusterLink {
    let settings = ClusterSettings {
        node: node.into(),
        incarnation: 7,
        shard_count: SHARDS,
        shard_of: by_len,
        request_timeout: Duration::from_secs(5),
        resync_window: Duration::from_secs(5),
        protocol,
        mutant: None,
    };
    ClusterLink::new(settings, &Config::default(), 0, 128)
}

fn def(membership: u64, members: &[&str]) -> GroupDef {
    GroupDef {
        group: GROUP,
        membership,
        next_ordinal: members.len() as u32,
        members: members
            .iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), i as u32))
            .collect(),
        admins: vec!["ann".into()],
        removed: false,
    }
}

/// A count an edge fed its hub's core: version, count, change.
type Fed = (u64, u32, Option<(String, bool)>);

/// Nodes on one simulated NATS: requests go to the node acting for the
/// shard, publishes on the groups subject to every node, KV reads find
/// nothing and writes land.
struct Bus {
    start: Instant,
    links: Vec<ClusterLink>,
    /// Who acts for each shard, under which epoch.
    owners: BTreeMap<u32, (usize, u64)>,
    /// Replies to requests, by request id and asking node.
    asked: BTreeMap<(usize, u64), ()>,
    /// The group counts published, by node.
    published: Vec<GroupCounts>,
}

impl Bus {
    fn new(protocol: u8) -> Bus {
        Bus {
            start: Instant::now(),
            links: vec![link("a", protocol), link("b", protocol)],
            owners: BTreeMap::new(),
            asked: BTreeMap::new(),
            published: Vec::new(),
        }
    }

    fn now(&self, ms: u64) -> Instant {
        self.start + Duration::from_millis(ms)
    }

    /// Node `n` acts for `shards` under `epoch`, and for nothing else.
    fn own(&mut self, ms: u64, n: usize, shards: &[u32], epoch: u64) {
        self.owners.retain(|_, (node, _)| *node != n);
        for &s in shards {
            self.owners.insert(s, (n, epoch));
        }
        let until = self.now(ms) + Duration::from_secs(3600);
        let status = shards.iter().map(|&s| (s, (epoch, until))).collect();
        let now = self.now(ms);
        self.links[n].set_status(now, Millis(ms), status);
        self.run(ms);
    }

    fn input(&mut self, ms: u64, n: usize, input: ClusterInput) {
        let now = self.now(ms);
        self.links[n].handle_input(now, Millis(ms), input);
    }

    /// Every node's directory takes `def` at `revision`.
    fn define(&mut self, ms: u64, revision: u64, def: &GroupDef) {
        for n in 0..self.links.len() {
            let changed = ClusterInput::GroupChanged {
                group: def.group,
                revision,
                def: Some(def.clone()),
            };
            self.input(ms, n, changed);
            self.input(ms, n, ClusterInput::GroupsSynced);
        }
        self.run(ms);
    }

    /// Carries every output until all nodes are quiet.
    fn run(&mut self, ms: u64) {
        loop {
            let mut moved = false;
            for n in 0..self.links.len() {
                while let Some(out) = self.links[n].poll_output() {
                    moved = true;
                    self.carry(ms, n, out);
                }
            }
            if !moved {
                return;
            }
        }
    }

    fn carry(&mut self, ms: u64, from: usize, out: ClusterOutput) {
        match out {
            ClusterOutput::Request {
                id,
                shard,
                kind,
                payload,
            } => match self.owners.get(&shard) {
                Some(&(to, _)) => {
                    self.asked.insert((from, id), ());
                    let reply = (from as u64) << 32 | id;
                    let request = ClusterInput::Request {
                        shard,
                        kind,
                        payload,
                        reply,
                    };
                    self.input(ms, to, request);
                }
                None => self.input(ms, from, ClusterInput::Answered { id, payload: None }),
            },
            ClusterOutput::Reply { reply, payload } => {
                let (to, id) = ((reply >> 32) as usize, reply & 0xffff_ffff);
                if self.asked.remove(&(to, id)).is_some() {
                    let answered = ClusterInput::Answered {
                        id,
                        payload: Some(payload),
                    };
                    self.input(ms, to, answered);
                }
            }
            ClusterOutput::GroupCounts { payload } => {
                self.published.push(decode(&payload).unwrap());
                for n in 0..self.links.len() {
                    let counts = ClusterInput::GroupCounts {
                        payload: payload.clone(),
                    };
                    self.input(ms, n, counts);
                }
            }
            ClusterOutput::Publish { shard, payload } => {
                for n in 0..self.links.len() {
                    let view = ClusterInput::ShardMessage {
                        shard,
                        payload: payload.clone(),
                    };
                    self.input(ms, n, view);
                }
            }
            ClusterOutput::Resync { payload } => {
                for n in (0..self.links.len()).filter(|&n| n != from) {
                    let resync = ClusterInput::Resync {
                        payload: payload.clone(),
                    };
                    self.input(ms, n, resync);
                }
            }
            ClusterOutput::LoadShard { id, .. } => {
                self.input(ms, from, ClusterInput::ShardLoaded { id, record: None })
            }
            ClusterOutput::LoadUser { id, .. } => {
                let loaded = ClusterInput::UserLoaded {
                    id,
                    prefs: None,
                    view: None,
                };
                self.input(ms, from, loaded)
            }
            ClusterOutput::PutPrefs { id, .. } => {
                self.input(ms, from, ClusterInput::PrefsStored { id, ok: true })
            }
            ClusterOutput::PutSession { id, .. } => {
                self.input(ms, from, ClusterInput::SessionStored { id, ok: true })
            }
            _ => {}
        }
    }

    /// Every node's timers, every 50 ms from `from` to `to`.
    fn pass(&mut self, from: u64, to: u64) {
        for ms in (from..=to).step_by(50) {
            let now = self.now(ms);
            for l in &mut self.links {
                l.handle_timeout(now, Millis(ms));
            }
            self.run(ms);
        }
    }

    /// A device of `user` connects at node `n`'s edge as session `s`.
    fn connect(&mut self, ms: u64, n: usize, s: u64, user: &str) {
        let now = self.now(ms);
        let kind = proto::Kind::Desktop;
        self.links[n].connected(now, Millis(ms), SessionId(s), s, user, "d", kind, None);
        self.run(ms);
    }

    /// Session `s` at node `n`'s edge logs out.
    fn logout(&mut self, ms: u64, n: usize, s: u64) {
        let now = self.now(ms);
        let op = super::WireOp::Logout;
        assert!(self.links[n].input(now, Millis(ms), SessionId(s), op, None));
        self.run(ms);
    }

    /// The counts node `n` fed its hub's core since last asked:
    /// (version, count, change).
    fn fed(&mut self, n: usize) -> Vec<Fed> {
        std::iter::from_fn(|| self.links[n].poll_group_feed())
            .filter_map(|f| match f {
                GroupFeed::Count {
                    version,
                    count,
                    change,
                    ..
                } => Some((version, count, change)),
                _ => None,
            })
            .collect()
    }
}

/// a owns shards 0 and 1, b owns 2 and 3 (the group's home); carl (0) and
/// bo (2) connect at a, ann (3) at b.
fn summed() -> Bus {
    let mut bus = Bus::new(PAGES_SINCE);
    bus.own(0, 0, &[0, 1], 1);
    bus.own(0, 1, &[2, 3], 1);
    bus.define(0, 1, &def(1, &MEMBERS));
    bus.connect(10, 0, 1, "carl");
    bus.connect(10, 0, 2, "bo");
    bus.connect(10, 1, 3, "ann");
    bus.pass(10, 3_000);
    bus
}

#[test]
fn a_groups_count_is_summed_from_every_owner_and_fed_to_every_edge() {
    let mut bus = summed();
    assert_eq!(bus.links[0].shared.home_shard(GROUP), 3);
    for n in 0..2 {
        let fed = bus.fed(n);
        let last = fed.last().unwrap_or_else(|| panic!("node {n} fed nothing"));
        assert_eq!(last.1, 3, "node {n}: {fed:?}");
        // Versions rise by at least the step the edges' writes fit in.
        assert!(
            fed.windows(2).all(|w| w[1].0 >= w[0].0 + 256),
            "node {n}: {fed:?}"
        );
    }
    // Only b, the home shard's owner, published counts.
    assert!(bus.published.iter().all(|c| c.home == 3));
}

#[test]
fn a_member_going_offline_replaces_her_owners_partial() {
    let mut bus = summed();
    bus.fed(0);
    bus.logout(3_000, 0, 1);
    bus.pass(3_000, 6_000);
    let fed = bus.fed(0);
    assert_eq!(
        fed.last().map(|f| (f.1, f.2.clone())),
        Some((2, Some(("carl".into(), false)))),
        "{fed:?}"
    );
}

#[test]
fn a_new_owner_of_the_home_shard_sums_again_above_the_old_versions() {
    let mut bus = summed();
    let before = bus.fed(0).last().unwrap().0;
    // b loses shard 3 to a under epoch 2; the owners send their partials
    // again on a's resync request.
    bus.own(4_000, 1, &[2], 1);
    bus.own(4_000, 0, &[0, 1, 3], 2);
    // ann's device is resent by its edge (b) to her new owner (a).
    bus.pass(4_000, 8_000);
    let fed = bus.fed(0);
    let last = fed
        .last()
        .unwrap_or_else(|| panic!("nothing after the move"));
    assert_eq!(last.1, 3, "{fed:?}");
    assert!(last.0 > before, "{} after {before}", last.0);
    assert!(bus.published.iter().any(|c| c.home == 3 && c.epoch == 2));
}

#[test]
fn nodes_sending_protocol_3_sum_nothing() {
    let mut bus = Bus::new(GROUPS_SINCE - 1);
    bus.own(0, 0, &[0, 1], 1);
    bus.own(0, 1, &[2, 3], 1);
    bus.define(0, 1, &def(1, &MEMBERS));
    bus.connect(10, 0, 1, "carl");
    bus.pass(10, 3_000);
    assert!(bus.published.is_empty());
    assert!(bus.links[0].poll_group_feed().is_none());
}

/// A member freed by her owner while offline keeps her name's id (her
/// group's slice holds it), so she is counted when she is back.
#[test]
fn a_member_freed_while_idle_is_counted_when_back() {
    let mut bus = summed();
    bus.logout(3_000, 0, 1);
    bus.pass(3_000, 70_000);
    assert!(bus.links[0].counters().users_released > 0, "carl was freed");
    bus.fed(0);
    bus.connect(70_000, 0, 4, "carl");
    bus.pass(70_000, 73_000);
    let fed = bus.fed(0);
    assert_eq!(fed.last().map(|f| f.1), Some(3), "{fed:?}");
}

/// A session record lists its group subscriptions from protocol 4, in a
/// layout a record without groups never has; sending 3, and with none, a
/// node writes the layout of version 3, which reads with no groups.
#[test]
fn a_session_record_lists_group_subscriptions_from_protocol_4() {
    use super::wire::{decode_session_record, encode_session_record, SessionRecord};
    let record = SessionRecord {
        wire: 1002,
        subscriptions: vec![("alice".into(), proto::Tier::Realtime)],
    };
    let with = encode_session_record(&record, &[7, 9], GROUPS_SINCE);
    assert_eq!(
        decode_session_record(&with),
        Some((record.clone(), vec![7, 9]))
    );
    // A node of version 3 does not read it as this session's.
    assert!(decode::<SessionRecord>(&with).is_none_or(|r| r.wire != record.wire));
    for plain in [
        encode_session_record(&record, &[7], GROUPS_SINCE - 1),
        encode_session_record(&record, &[], GROUPS_SINCE),
    ] {
        assert_eq!(decode::<SessionRecord>(&plain), Some(record.clone()));
        assert_eq!(
            decode_session_record(&plain),
            Some((record.clone(), vec![]))
        );
    }
}

/// A shard's slice that empties (its only member left the group) and comes
/// back (another user of the shard joined) is counted again: the owner's
/// partials rise in one sequence across its groups, so the new slice's
/// first partial is above the last one the sum took for the shard.
#[test]
fn a_slice_that_empties_and_comes_back_is_counted() {
    let mut bus = summed();
    // carl, alone in shard 0, leaves the group.
    bus.define(3_000, 2, &def(2, &["ann", "bo", "dave1"]));
    bus.pass(3_000, 6_000);
    assert_eq!(bus.fed(0).last().map(|f| f.1), Some(2));
    // cyd1 (shard 0 too) joins, and connects at a.
    let mut with_cyd = def(3, &["ann", "bo", "dave1"]);
    with_cyd.members.push(("cyd1".into(), 4));
    with_cyd.next_ordinal = 5;
    bus.define(6_000, 3, &with_cyd);
    bus.connect(6_000, 0, 4, "cyd1");
    bus.pass(6_000, 9_000);
    let fed = bus.fed(0);
    assert_eq!(fed.last().map(|f| f.1), Some(3), "{fed:?}");
}

impl Bus {
    /// A member page asked at node `n`'s edge for session `s`, answered
    /// within the bus's passes: (entries as (name, online), next).
    fn page(
        &mut self,
        ms: u64,
        n: usize,
        after: Option<proto::GroupCursor>,
        limit: u32,
    ) -> (Vec<(String, bool)>, Option<proto::GroupCursor>) {
        let now = self.now(ms);
        let wait = 1_000 + ms;
        let sid = SessionId(50);
        let link = &mut self.links[n];
        link.group_page(now, Millis(ms), wait, sid, GROUP, (after, limit), false);
        let mut answer = None;
        self.run(ms);
        self.pass(ms, ms + 200);
        while let Some((w, finished)) = self.links[n].poll_finished() {
            match finished {
                Finished::Answer(a) if w == wait => answer = Some(a),
                Finished::Failed(e) if w == wait => panic!("page failed: {e}"),
                _ => {}
            }
        }
        match answer {
            Some(proto::Answer::GroupPage(p)) => {
                assert_eq!((p.group, p.count), (GROUP, 3), "{p:?}");
                let entries = p.entries.into_iter();
                (
                    entries.map(|e| (e.user, e.presence.online)).collect(),
                    p.next,
                )
            }
            other => panic!("not a page: {other:?}"),
        }
    }
}

/// Pages list the members online by the partials first, then the others,
/// each by ordinal, with each member's published view from her owner,
/// asked at an edge that holds none of them and at the aggregator itself;
/// an invisible member is listed offline, in the online section she was
/// counted in until her owner's next partial.
#[test]
fn member_pages_list_online_members_first_from_every_owner() {
    let mut bus = summed();
    let online = |n: &str, o: bool| (n.to_string(), o);
    for n in 0..2 {
        let (first, next) = bus.page(3_000, n, None, 2);
        assert_eq!(first, vec![online("ann", true), online("bo", true)]);
        let cursor = proto::GroupCursor {
            online: true,
            after: 1,
        };
        assert_eq!(next, Some(cursor));
        let (second, next) = bus.page(3_500, n, next, 2);
        assert_eq!(second, vec![online("carl", true), online("dave1", false)]);
        assert_eq!(next, None);
    }
    // bo (at a) goes invisible: her view is offline at once.
    let now = bus.now(4_000);
    let op = super::WireOp::SetInvisible(true);
    assert!(bus.links[0].input(now, Millis(4_000), SessionId(2), op, None));
    bus.run(4_000);
    let (page, _) = bus.page(4_000, 1, None, 4);
    assert!(page.contains(&online("bo", false)), "{page:?}");
}

/// A watched page's members are followed by the node's page watcher from
/// their read on: a change of one of them is pushed to it. A member let go
/// of while a read not yet handed over holds her stays followed; once it is
/// handed over, those no watch lists are let go. Let go of, members are
/// followed no more, and the shards watched only for them are not watched
/// any more.
#[test]
fn a_watched_pages_members_are_followed_until_let_go() {
    let mut bus = summed();
    let (now, at) = (bus.now(3_000), Millis(3_000));
    let wait = 77;
    let sid = SessionId(50);
    bus.links[0].group_page(now, at, wait, sid, GROUP, (None, 10), true);
    bus.run(3_000);
    bus.pass(3_000, 3_200);
    let mut read = None;
    while let Some((w, finished)) = bus.links[0].poll_finished() {
        if let (
            true,
            Finished::WatchedPage {
                session,
                page,
                followed,
                ..
            },
        ) = (w == wait, finished)
        {
            read = Some((session, page, followed));
        }
    }
    let (session, page, followed) = read.expect("the watched page was read");
    assert_eq!((session, page.entries.len()), (sid, 4), "{page:?}");
    let link = &mut bus.links[0];
    assert_eq!(link.edge.fanout.subscriptions(PAGE_WATCHER).len(), 4);
    // Let go of (another watch ended) before the read is handed over: the
    // read holds her; handed over, bo is not listed and is let go.
    link.unfollow_page_member(Millis(3_200), "ann");
    assert_eq!(link.edge.fanout.subscriptions(PAGE_WATCHER).len(), 4);
    link.settle_page_read(Millis(3_200), &followed, |name| name != "bo");
    assert_eq!(link.edge.fanout.subscriptions(PAGE_WATCHER).len(), 3);
    while link.poll_fanout().is_some() {}
    // ann (at b, in b's shard 3) logs out: pushed to a's page watcher.
    bus.logout(3_500, 1, 3);
    bus.pass(3_500, 6_000);
    let link = &mut bus.links[0];
    let ann = link.edge.names.get("ann").map(UserId).unwrap();
    let pushed = std::iter::from_fn(|| link.poll_fanout()).any(|o| {
        matches!(o, Output::Push { to, target, presence, .. }
            if to == PAGE_WATCHER && target == ann && !presence.online)
    });
    assert!(pushed, "ann's logout was not pushed to the page watcher");
    for member in MEMBERS {
        link.unfollow_page_member(Millis(6_000), member);
    }
    assert!(link.edge.fanout.subscriptions(PAGE_WATCHER).is_empty());
    assert!(
        link.edge.shard_watchers.is_empty(),
        "{:?}",
        link.edge.shard_watchers
    );
}
