//! Group changes by difference (`Core::handle_change_group`, issue 28):
//! one example per refusal (each leaves the core as it was), and the
//! effects a change shares with `handle_set_group`. The property tests in
//! `groups.rs` mix changes with whole writes against the reference.

use greendot_core::*;

mod group_setup;
use group_setup::{connect, drain};

fn u(n: u64) -> UserId {
    UserId(n)
}

fn small() -> Core {
    Core::new(Config {
        max_group_members: 3,
        max_group_admins: 1,
        max_groups: 2,
        ..Config::default()
    })
    .unwrap()
}

/// A refused change returns `want` and leaves the core exactly as it was.
fn refused(core: &mut Core, group: u64, change: GroupChange<'_>, want: Error) {
    let before = core.clone();
    assert_eq!(
        core.handle_change_group(Millis(0), GroupId(group), &change),
        Err(want)
    );
    assert_eq!(core, &before, "a refused change changed the core");
}

#[test]
fn a_change_adds_and_removes_members_and_admins() {
    let mut core = small();
    let g = GroupId(1);
    let add = [u(1), u(2)];
    let create = GroupChange {
        add: &add,
        expect: Some(0),
        ..GroupChange::default()
    };
    assert_eq!(core.handle_change_group(Millis(0), g, &create), Ok(1));
    let promote = GroupChange {
        add_admins: &[u(3)],
        remove: &[u(2)],
        expect: Some(1),
        ..GroupChange::default()
    };
    assert_eq!(core.handle_change_group(Millis(0), g, &promote), Ok(2));
    assert_eq!(
        core.group_members(g),
        Some((&[u(1), u(3)][..], &[u(3)][..]))
    );
    // Demoted, still a member; a name both removed and added ends added.
    let demote = GroupChange {
        remove_admins: &[u(3)],
        remove: &[u(1)],
        add: &[u(1)],
        ..GroupChange::default()
    };
    assert_eq!(core.handle_change_group(Millis(0), g, &demote), Ok(3));
    assert_eq!(core.group_members(g), Some((&[u(1), u(3)][..], &[][..])));
    core.check_invariants().unwrap();
}

#[test]
fn an_unexpected_version_changes_nothing() {
    let mut core = small();
    core.handle_set_group(Millis(0), GroupId(1), &[u(1)], &[])
        .unwrap();
    let add = [u(2)];
    let stale = GroupChange {
        add: &add,
        expect: Some(0),
        ..GroupChange::default()
    };
    refused(&mut core, 1, stale, Error::VersionMismatch { current: 1 });
    // No such group: version 0.
    let stale = GroupChange {
        add: &add,
        expect: Some(1),
        ..GroupChange::default()
    };
    refused(&mut core, 2, stale, Error::VersionMismatch { current: 0 });
}

#[test]
fn a_change_past_the_members_cap_changes_nothing() {
    let mut core = small();
    core.handle_set_group(Millis(0), GroupId(1), &[u(1), u(2)], &[u(3)])
        .unwrap();
    let one_more = GroupChange {
        add: &[u(4)],
        ..GroupChange::default()
    };
    refused(
        &mut core,
        1,
        one_more,
        Error::LimitExceeded(Limit::GroupMembers),
    );
    // An admin added is a member added.
    let admin_more = GroupChange {
        add_admins: &[u(4)],
        remove_admins: &[u(3)],
        ..GroupChange::default()
    };
    refused(
        &mut core,
        1,
        admin_more,
        Error::LimitExceeded(Limit::GroupMembers),
    );
    // A list longer than the cap is refused as given, before any look-up.
    let long = [u(1), u(1), u(1), u(1)];
    let long_remove = GroupChange {
        remove: &long,
        ..GroupChange::default()
    };
    refused(
        &mut core,
        1,
        long_remove,
        Error::LimitExceeded(Limit::GroupMembers),
    );
    // Room made in the same change: taken.
    let swap = GroupChange {
        add: &[u(4)],
        remove: &[u(1)],
        ..GroupChange::default()
    };
    assert_eq!(
        core.handle_change_group(Millis(0), GroupId(1), &swap),
        Ok(2)
    );
}

#[test]
fn a_change_past_the_admins_cap_changes_nothing() {
    let mut core = small();
    core.handle_set_group(Millis(0), GroupId(1), &[u(1)], &[u(2)])
        .unwrap();
    let second = GroupChange {
        add_admins: &[u(1)],
        ..GroupChange::default()
    };
    refused(
        &mut core,
        1,
        second,
        Error::LimitExceeded(Limit::GroupAdmins),
    );
    let listed = GroupChange {
        remove_admins: &[u(2), u(2)],
        ..GroupChange::default()
    };
    refused(
        &mut core,
        1,
        listed,
        Error::LimitExceeded(Limit::GroupAdmins),
    );
}

#[test]
fn a_change_creating_a_group_past_the_groups_cap_changes_nothing() {
    let mut core = small();
    core.handle_set_group(Millis(0), GroupId(1), &[u(1)], &[])
        .unwrap();
    core.handle_set_group(Millis(0), GroupId(2), &[u(1)], &[])
        .unwrap();
    let create = GroupChange {
        add: &[u(1)],
        ..GroupChange::default()
    };
    refused(&mut core, 3, create, Error::LimitExceeded(Limit::Groups));
}

#[test]
fn a_removed_member_is_told_the_end_and_admins_the_count() {
    let mut core = Core::new(Config::default()).unwrap();
    let g = GroupId(5);
    core.handle_set_group(Millis(0), g, &[u(1), u(2)], &[u(9)])
        .unwrap();
    let admin = connect(&mut core, 0, 9, 1);
    let one = connect(&mut core, 0, 1, 1);
    let two = connect(&mut core, 0, 2, 1);
    // Published online after the debounce.
    while let Some(due) = core.poll_timeout().filter(|d| d.0 <= 1000) {
        core.handle_timeout(due);
    }
    for s in [admin, one, two] {
        core.handle_group_subscribe(Millis(1000), s, g).unwrap();
    }
    drain(&mut core);
    let leave = GroupChange {
        remove: &[u(1)],
        expect: Some(1),
        ..GroupChange::default()
    };
    assert_eq!(core.handle_change_group(Millis(1000), g, &leave), Ok(2));
    let out = drain(&mut core);
    assert!(
        out.contains(&GroupOutput::Ended { to: one, group: g }),
        "{out:?}"
    );
    assert!(
        out.iter().any(|o| matches!(o,
            GroupOutput::Count { to, count: 2, .. } if *to == admin)),
        "the admin hears the count after the change: {out:?}"
    );
    assert!(!out
        .iter()
        .any(|o| matches!(o, GroupOutput::Ended { to, .. } if *to == two)));
    assert_eq!(core.group_count(g), Some(2));
    assert!(core.group_subscriptions(one).is_empty());
    assert_eq!(core.group_subscriptions(two), vec![(g, GroupRole::Member)]);
    // Promoted by a change: the subscription moves to the admin role.
    let promote = GroupChange {
        add_admins: &[u(2)],
        ..GroupChange::default()
    };
    assert_eq!(core.handle_change_group(Millis(1000), g, &promote), Ok(3));
    assert_eq!(core.group_subscriptions(two), vec![(g, GroupRole::Admin)]);
    core.check_invariants().unwrap();
}

/// A group restored from a store keeps its membership version, so a writer
/// expecting it after a restart goes on; a restore over a held group, or
/// past a limit, changes nothing.
#[test]
fn a_restored_group_keeps_its_membership_version() {
    let mut core = small();
    let g = GroupId(1);
    core.handle_restore_group(Millis(0), g, &[u(1), u(2)], &[u(2)], 7)
        .unwrap();
    assert_eq!(core.group_membership(g), Some(7));
    assert_eq!(
        core.group_members(g),
        Some((&[u(1), u(2)][..], &[u(2)][..]))
    );
    let add = [u(3)];
    let next = GroupChange {
        add: &add,
        expect: Some(7),
        ..GroupChange::default()
    };
    assert_eq!(core.handle_change_group(Millis(0), g, &next), Ok(8));
    let before = core.clone();
    assert_eq!(
        core.handle_restore_group(Millis(0), g, &[u(1)], &[], 3),
        Err(Error::VersionMismatch { current: 8 })
    );
    assert_eq!(
        core.handle_restore_group(Millis(0), GroupId(2), &[u(1), u(2), u(3), u(4)], &[], 3),
        Err(Error::LimitExceeded(Limit::GroupMembers))
    );
    assert_eq!(core, before, "a refused restore changed the core");
    core.check_invariants().unwrap();
}

/// The list arithmetic on names, as a node of a cluster uses it, agrees
/// with the core's on ids.
#[test]
fn changed_lists_on_names_is_the_cores_change() {
    let s = |names: &[&str]| -> Vec<String> { names.iter().map(|n| n.to_string()).collect() };
    let (members, admins) = (s(&["ann", "bob", "cy"]), s(&["bob", "cy"]));
    let change = [
        &s(&["dee", "ann"])[..],
        &s(&["ann", "cy", "zed"]),
        &s(&["eve"]),
        &s(&["bob"]),
    ];
    let got = changed_lists((&members, &admins), change);
    assert_eq!(got, (s(&["ann", "bob", "dee", "eve"]), s(&["eve"])));

    // The same change on ids through the core.
    let id = |n: &str| u(u64::from(n.as_bytes()[0]));
    let ids = |names: &[String]| -> Vec<UserId> { names.iter().map(|n| id(n)).collect() };
    let mut core = Core::new(Config::default()).unwrap();
    let g = GroupId(1);
    core.handle_set_group(Millis(0), g, &ids(&members), &ids(&admins))
        .unwrap();
    let (add, remove, add_admins, remove_admins) = (
        ids(change[0]),
        ids(change[1]),
        ids(change[2]),
        ids(change[3]),
    );
    let by_ids = GroupChange {
        add: &add,
        remove: &remove,
        add_admins: &add_admins,
        remove_admins: &remove_admins,
        expect: None,
    };
    core.handle_change_group(Millis(0), g, &by_ids).unwrap();
    let (m, a) = core.group_members(g).unwrap();
    assert_eq!((m.to_vec(), a.to_vec()), (ids(&got.0), ids(&got.1)));
}

/// A membership version never repeats for a group id: a group created
/// after a removal starts above the highest version a removed group
/// reached, and a restore keeps a group's own version.
#[test]
fn a_group_written_again_after_a_removal_goes_on_above_its_version() {
    let mut core = small();
    let g = GroupId(1);
    core.handle_set_group(Millis(0), g, &[u(1)], &[]).unwrap();
    let add = [u(2)];
    let change = GroupChange {
        add: &add,
        ..GroupChange::default()
    };
    assert_eq!(core.handle_change_group(Millis(0), g, &change), Ok(2));
    core.handle_remove_group(Millis(0), g).unwrap();
    assert_eq!(core.group_membership_floor(), 2);
    assert_eq!(core.handle_set_group(Millis(0), g, &[u(1)], &[]), Ok(3));
    // Another group created now starts above the floor too.
    assert_eq!(
        core.handle_set_group(Millis(0), GroupId(2), &[u(1)], &[]),
        Ok(3)
    );
    // A restarted core: the floor raised, a stored group keeps its own.
    let mut core = small();
    core.handle_restore_group(Millis(0), g, &[u(1)], &[], 2)
        .unwrap();
    core.raise_group_membership_floor(5);
    assert_eq!(core.group_membership(g), Some(2));
    assert_eq!(
        core.handle_set_group(Millis(0), GroupId(2), &[u(1)], &[]),
        Ok(6)
    );
    core.check_invariants().unwrap();
}
