//! Group presence (issue 28): examples of counts, admin deltas, limits,
//! resumes and member pages. The property tests are in `groups.rs`, the
//! watched pages' examples in `group_watch.rs`.

use greendot_core::*;

mod group_setup;
use group_setup::{connect, drain};

fn settle(core: &mut Core, until: u64) {
    while let Some(due) = core.poll_timeout().filter(|d| d.0 <= until) {
        core.handle_timeout(due);
    }
    core.handle_timeout(Millis(until));
}

#[test]
fn members_get_the_count_batched_admins_each_change_at_once() {
    let mut core = Core::new(Config::default()).unwrap();
    let g = GroupId(7);
    let members: Vec<UserId> = (1..=1000).map(UserId).collect();
    assert_eq!(
        core.handle_set_group(Millis(0), g, &members, &[UserId(1)]),
        Ok(1)
    );
    let admin = connect(&mut core, 0, 1, 1);
    let member = connect(&mut core, 0, 2, 1);
    settle(&mut core, 1000);
    let snap = core.handle_group_subscribe(Millis(1000), admin, g).unwrap();
    assert_eq!(
        (snap.role, snap.count, snap.members),
        (GroupRole::Admin, 2, 1000)
    );
    let snap = core
        .handle_group_subscribe(Millis(1000), member, g)
        .unwrap();
    assert_eq!((snap.role, snap.count), (GroupRole::Member, 2));
    assert!(drain(&mut core).is_empty());

    // Three members arrive: the admin hears each once published, the
    // member nothing until the interval ends, then the count once.
    for u in 3..=5 {
        connect(&mut core, 2000, u, 1);
    }
    settle(&mut core, 2300);
    let out = drain(&mut core);
    assert_eq!(out.len(), 3, "{out:?}");
    assert!(out.iter().all(|o| matches!(o,
        GroupOutput::Member { to, online: true, .. } if *to == admin)));
    assert!(matches!(out[2], GroupOutput::Member { count: 5, .. }));
    settle(&mut core, 12_299);
    assert!(drain(&mut core).is_empty());
    settle(&mut core, 12_300);
    match drain(&mut core)[..] {
        [GroupOutput::Count {
            to,
            count: 5,
            version,
            ..
        }] => {
            assert!(to == member && version > snap.version)
        }
        ref other => panic!("{other:?}"),
    }
    assert_eq!(core.group_count(g), Some(5));
    core.check_invariants().unwrap();
}

#[test]
fn invisible_members_count_as_offline_and_a_flap_pushes_no_count() {
    let mut core = Core::new(Config::default()).unwrap();
    let g = GroupId(1);
    core.handle_set_group(Millis(0), g, &[UserId(1), UserId(2)], &[])
        .unwrap();
    let watcher = connect(&mut core, 0, 1, 1);
    let hidden = connect(&mut core, 0, 2, 1);
    settle(&mut core, 1000);
    assert_eq!(core.group_count(g), Some(2));
    core.handle_group_subscribe(Millis(1000), watcher, g)
        .unwrap();
    core.handle_set_invisible(Millis(1000), hidden, true)
        .unwrap();
    assert_eq!(core.group_count(g), Some(1), "invisible counts at once");
    // Visible again within the interval: the count is back where the
    // member was last told, so nothing is pushed.
    core.handle_set_invisible(Millis(2000), hidden, false)
        .unwrap();
    settle(&mut core, 30_000);
    assert_eq!(core.group_count(g), Some(2));
    assert!(drain(&mut core).is_empty());
    core.check_invariants().unwrap();
}

#[test]
fn only_members_subscribe_and_limits_are_checked_before_storing() {
    let config = Config {
        max_group_members: 3,
        max_group_admins: 1,
        max_group_subscriptions_per_session: 1,
        max_groups: 2,
        ..Config::default()
    };
    let mut core = Core::new(config).unwrap();
    let u = |n| UserId(n);
    let limit = |l| Err(Error::LimitExceeded(l));
    assert_eq!(
        core.handle_set_group(Millis(0), GroupId(1), &[u(1), u(2), u(3), u(4)], &[]),
        limit(Limit::GroupMembers)
    );
    assert_eq!(
        core.handle_set_group(Millis(0), GroupId(1), &[u(1)], &[u(2), u(3)]),
        limit(Limit::GroupAdmins)
    );
    // Admins are members: three listed plus a fourth admin is too many.
    assert_eq!(
        core.handle_set_group(Millis(0), GroupId(1), &[u(1), u(2), u(3)], &[u(4)]),
        limit(Limit::GroupMembers)
    );
    assert_eq!(core.group_count(GroupId(1)), None, "nothing stored");
    core.handle_set_group(Millis(0), GroupId(1), &[u(1)], &[])
        .unwrap();
    core.handle_set_group(Millis(0), GroupId(2), &[u(1)], &[])
        .unwrap();
    assert_eq!(
        core.handle_set_group(Millis(0), GroupId(3), &[u(1)], &[]),
        limit(Limit::Groups)
    );
    let one = connect(&mut core, 0, 1, 1);
    let stranger = connect(&mut core, 0, 9, 1);
    assert_eq!(
        core.handle_group_subscribe(Millis(0), stranger, GroupId(1)),
        Err(Error::NotMember)
    );
    assert_eq!(
        core.handle_group_subscribe(Millis(0), stranger, GroupId(3)),
        Err(Error::NotMember),
        "an unknown group answers as a group one is not in"
    );
    core.handle_group_subscribe(Millis(0), one, GroupId(1))
        .unwrap();
    assert_eq!(
        core.handle_group_subscribe(Millis(0), one, GroupId(2)),
        Err(Error::LimitExceeded(Limit::GroupSubscriptionsPerSession))
    );
    // Leaving the group ends the subscription.
    core.handle_set_group(Millis(0), GroupId(1), &[u(2)], &[])
        .unwrap();
    assert_eq!(
        drain(&mut core),
        vec![GroupOutput::Ended {
            to: one,
            group: GroupId(1)
        }]
    );
    assert!(core.group_subscriptions(one).is_empty());
    core.check_invariants().unwrap();
}

#[test]
fn a_resume_carries_group_subscriptions_and_tells_the_count() {
    let mut core = Core::new(Config::default()).unwrap();
    let g = GroupId(1);
    core.handle_set_group(Millis(0), g, &[UserId(1), UserId(2)], &[])
        .unwrap();
    let s = connect(&mut core, 0, 1, 1);
    core.handle_group_subscribe(Millis(0), s, g).unwrap();
    settle(&mut core, 1000);
    core.handle_disconnect(Millis(1000), s, Millis(1000))
        .unwrap();
    let resumed = core
        .handle_connect(
            Millis(1020),
            Connect {
                user: UserId(1),
                device: DeviceId(1),
                kind: DeviceKind::Desktop,
                watch: Watch::All,
                resume: Some(s),
                foreground: true,
            },
        )
        .unwrap();
    assert!(resumed.resumed);
    let s2 = resumed.session;
    assert_eq!(core.group_subscriptions(s2), vec![(g, GroupRole::Member)]);
    assert!(core.group_subscriptions(s).is_empty());
    assert!(matches!(drain(&mut core)[..], [GroupOutput::Count { to, count: 1, .. }] if to == s2));
    // Logout ends it.
    core.handle_logout(Millis(1030), s2).unwrap();
    assert!(core.group_subscriptions(s2).is_empty());
    core.check_invariants().unwrap();
}

#[test]
fn one_change_in_a_large_group_pushes_only_to_admins() {
    let mut core = Core::new(Config::default()).unwrap();
    let g = GroupId(1);
    let members: Vec<UserId> = (1..=10_000).map(UserId).collect();
    let admins: Vec<UserId> = (1..=3).map(UserId).collect();
    core.handle_set_group(Millis(0), g, &members, &admins)
        .unwrap();
    let mut subscribers = Vec::new();
    for u in 1..=200 {
        let s = connect(&mut core, 0, u, 1);
        core.handle_group_subscribe(Millis(0), s, g).unwrap();
        subscribers.push(s);
    }
    settle(&mut core, 20_000);
    drain(&mut core);
    connect(&mut core, 20_000, 5_000, 1);
    settle(&mut core, 20_300);
    let out = drain(&mut core);
    assert_eq!(out.len(), 3, "one delta per admin session: {out:?}");
    settle(&mut core, 30_300);
    let counts = drain(&mut core);
    assert_eq!(counts.len(), 197, "one count per member session");
}

#[test]
fn member_pages_list_online_members_first_then_by_id() {
    let mut core = Core::new(Config::default()).unwrap();
    let g = GroupId(1);
    let members: Vec<UserId> = (1..=450).map(UserId).collect();
    core.handle_set_group(Millis(0), g, &members, &[]).unwrap();
    let me = connect(&mut core, 0, 1, 1);
    for u in [400, 7, 300] {
        connect(&mut core, 0, u, 1);
    }
    settle(&mut core, 1000);
    let first = core
        .handle_group_page(Millis(1000), me, g, None, 1000)
        .unwrap();
    assert_eq!(first.entries.len(), 200, "capped at the page size");
    assert_eq!(first.count, 4);
    let ids: Vec<u64> = first.entries.iter().map(|(u, _)| u.0).collect();
    assert_eq!(ids[..6], [1, 7, 300, 400, 2, 3]);
    assert!(first.entries[..4].iter().all(|(_, p)| p.online));
    assert!(first.entries[4..].iter().all(|(_, p)| !p.online));
    let next = first.next.unwrap();
    assert_eq!(
        next,
        PageCursor {
            online: false,
            after: UserId(198)
        }
    );
    let second = core
        .handle_group_page(Millis(1000), me, g, Some(next), 200)
        .unwrap();
    let third = core
        .handle_group_page(Millis(1000), me, g, second.next, 200)
        .unwrap();
    assert_eq!((second.entries.len(), third.entries.len()), (200, 50));
    assert_eq!(third.next, None);
    let stranger = connect(&mut core, 1000, 451, 1);
    assert_eq!(
        core.handle_group_page(Millis(1000), stranger, g, None, 10),
        Err(Error::NotMember)
    );
}
