//! The cluster's group directory and writes (`group_dir`): a write is
//! computed from the node's copy as one node's core computes it, stored by
//! compare-and-set, computed again after a conflict, and answered once
//! stored.

use super::group_dir::{next_def, GroupDef, GroupLimits, GroupWrite, GroupWriteOutcome};
use super::test_support::link;
use super::{ClusterInput, ClusterOutput, Finished, MAX_WRITE_TRIES};
use greendot_core::Millis;
use greendot_proto::{Answer, ErrorCode};
use std::time::{Duration, Instant};

const LIMITS: GroupLimits = GroupLimits {
    max_members: 3,
    max_admins: 1,
    max_groups: 2,
};

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|n| n.to_string()).collect()
}

fn set(members: &[&str], admins: &[&str]) -> GroupWrite {
    GroupWrite::Set {
        members: names(members),
        admins: names(admins),
    }
}

#[test]
fn a_write_is_computed_as_the_core_computes_it() {
    let first = next_def(None, 7, &set(&["cy", "ann"], &["bob"]), &LIMITS, 0).unwrap();
    assert_eq!(first.membership, 1);
    assert_eq!(first.admins, names(&["bob"]));
    // Admins are members; ordinals follow the sorted names at creation.
    assert_eq!(
        first.members,
        [("ann".into(), 0), ("bob".into(), 1), ("cy".into(), 2)]
    );
    // A change keeps the ordinals of those who stay; new ones get the next.
    let change = GroupWrite::Change {
        add: names(&["dee"]),
        remove: names(&["ann"]),
        add_admins: Vec::new(),
        remove_admins: Vec::new(),
        expect: Some(1),
    };
    let second = next_def(Some(&first), 7, &change, &LIMITS, 1).unwrap();
    assert_eq!(second.membership, 2);
    assert_eq!(
        second.members,
        [("bob".into(), 1), ("cy".into(), 2), ("dee".into(), 3)]
    );
    assert_eq!(second.next_ordinal, 4);
    // A stale expected version is refused as one node refuses it.
    let stale = next_def(Some(&second), 7, &change, &LIMITS, 1).unwrap_err();
    assert_eq!(stale.code, ErrorCode::VersionMismatch);
    assert!(stale.message.ends_with("version=2"), "{}", stale.message);
    // Limits on the resulting lists, and on the groups held.
    let over = GroupWrite::Change {
        add: names(&["eve"]),
        remove: Vec::new(),
        add_admins: Vec::new(),
        remove_admins: Vec::new(),
        expect: None,
    };
    let e = next_def(Some(&second), 7, &over, &LIMITS, 1).unwrap_err();
    assert_eq!(e.code, ErrorCode::TooManyGroupMembers);
    let e = next_def(None, 8, &set(&["x"], &["x", "y"]), &LIMITS, 1).unwrap_err();
    assert_eq!(e.code, ErrorCode::TooManyGroupAdmins);
    let e = next_def(None, 9, &set(&["x"], &[]), &LIMITS, 2).unwrap_err();
    assert_eq!(e.code, ErrorCode::TooManyGroups);
    // A removal is a tombstone that keeps the version; writing the group
    // again goes on from it, and removing it twice is refused.
    let gone = next_def(Some(&second), 7, &GroupWrite::Remove, &LIMITS, 1).unwrap();
    assert!(gone.removed && gone.members.is_empty());
    assert_eq!(gone.membership, 3);
    let e = next_def(Some(&gone), 7, &GroupWrite::Remove, &LIMITS, 0).unwrap_err();
    assert_eq!(e.code, ErrorCode::UnknownGroup);
    let again = next_def(Some(&gone), 7, &set(&["ann"], &[]), &LIMITS, 0).unwrap();
    assert_eq!(
        (again.membership, again.members.clone()),
        (4, vec![("ann".into(), 4)])
    );
}

fn written(id: u64, outcome: GroupWriteOutcome) -> ClusterInput {
    ClusterInput::GroupWritten { id, outcome }
}

fn write_asked(out: Option<ClusterOutput>) -> (u64, GroupDef, u64) {
    match out {
        Some(ClusterOutput::WriteGroup { id, def, expected }) => (id, def, expected),
        other => panic!("no write asked: {other:?}"),
    }
}

#[test]
fn a_write_is_answered_once_stored_and_computed_again_after_a_conflict() {
    let mut l = link("a");
    let now = Instant::now();
    let at = Millis(0);
    // Before the directory is read, a write waits for it.
    l.group_write(now, 2, 5, set(&["ann"], &[]));
    assert!(l.poll_output().is_none() && l.poll_finished().is_none());
    l.handle_input(now, at, ClusterInput::GroupsSynced);
    let (id, def, expected) = write_asked(l.poll_output());
    assert_eq!((expected, def.membership), (0, 1));
    assert!(l.poll_finished().is_none(), "answered before it was stored");
    l.handle_input(
        now,
        at,
        written(id, GroupWriteOutcome::Written { revision: 10 }),
    );
    assert!(matches!(
        l.poll_finished(),
        Some((2, Finished::Answer(Answer::GroupSet { version: 1 })))
    ));
    assert_eq!(
        l.group_def(5).0,
        10,
        "held at once, before the watch brings it"
    );

    // Another node adds bob meanwhile: this write loses, is computed again
    // from the copy the watch brought, and keeps bob.
    let change = GroupWrite::Change {
        add: names(&["cy"]),
        remove: Vec::new(),
        add_admins: Vec::new(),
        remove_admins: Vec::new(),
        expect: None,
    };
    l.group_write(now, 3, 5, change);
    let (id, _, expected) = write_asked(l.poll_output());
    assert_eq!(expected, 10);
    let theirs = GroupDef {
        group: 5,
        membership: 2,
        next_ordinal: 2,
        members: vec![("ann".into(), 0), ("bob".into(), 1)],
        admins: Vec::new(),
        removed: false,
    };
    l.handle_input(
        now,
        at,
        ClusterInput::GroupChanged {
            group: 5,
            revision: 11,
            def: Some(theirs),
        },
    );
    l.handle_input(now, at, written(id, GroupWriteOutcome::Conflict));
    assert!(
        l.poll_output().is_none(),
        "computed again only after a pause"
    );
    let later = now + Duration::from_millis(200);
    l.handle_timeout(later, at);
    let (id, def, expected) = write_asked(l.poll_output());
    assert_eq!((expected, def.membership), (11, 3));
    assert_eq!(
        def.members,
        [("ann".into(), 0), ("bob".into(), 1), ("cy".into(), 2)]
    );
    l.handle_input(
        later,
        at,
        written(id, GroupWriteOutcome::Written { revision: 12 }),
    );
    assert!(matches!(
        l.poll_finished(),
        Some((3, Finished::Answer(Answer::GroupSet { version: 3 })))
    ));
}

#[test]
fn a_write_that_keeps_losing_or_fails_is_answered_with_an_error() {
    let mut l = link("a");
    let mut now = Instant::now();
    let at = Millis(0);
    l.handle_input(now, at, ClusterInput::GroupsSynced);
    l.group_write(now, 1, 5, set(&["ann"], &[]));
    for _ in 0..MAX_WRITE_TRIES {
        let (id, _, _) = write_asked(l.poll_output());
        l.handle_input(now, at, written(id, GroupWriteOutcome::Conflict));
        now += Duration::from_millis(200);
        l.handle_timeout(now, at);
    }
    match l.poll_finished() {
        Some((1, Finished::Failed(e))) => {
            assert!(
                e.message.contains("other nodes kept writing it"),
                "{}",
                e.message
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(l.poll_output().is_none());

    // No group to remove in this node's copy: the store is asked first
    // (the copy may lag), then it is refused as one node refuses it.
    l.group_write(now, 2, 5, GroupWrite::Remove);
    let id = match l.poll_output() {
        Some(ClusterOutput::ReadGroup { id, group: 5 }) => id,
        other => panic!("no read asked: {other:?}"),
    };
    assert!(l.poll_finished().is_none());
    l.handle_input(
        now,
        at,
        ClusterInput::GroupRead {
            id,
            read: Ok((0, None)),
        },
    );
    match l.poll_finished() {
        Some((2, Finished::Failed(e))) => assert_eq!(e.code, ErrorCode::UnknownGroup),
        other => panic!("{other:?}"),
    }
    l.group_write(now, 3, 5, set(&["ann"], &[]));
    let (id, _, _) = write_asked(l.poll_output());
    l.handle_input(
        now,
        at,
        written(id, GroupWriteOutcome::Failed("timed out".into())),
    );
    match l.poll_finished() {
        Some((3, Finished::Failed(e))) => {
            assert_eq!(e.code, ErrorCode::Internal);
            assert!(
                e.message.contains("could not be stored: timed out"),
                "{}",
                e.message
            );
        }
        other => panic!("{other:?}"),
    }
    // A write the I/O never answers is given up at its deadline.
    l.group_write(now, 4, 5, set(&["ann"], &[]));
    write_asked(l.poll_output());
    l.handle_timeout(now + Duration::from_secs(6), at);
    match l.poll_finished() {
        Some((4, Finished::Failed(e))) => {
            assert!(e.message.contains("no answer in time"), "{}", e.message)
        }
        other => panic!("{other:?}"),
    }
    // So is one on a node that never reads the cluster's groups.
    let mut unread = link("b");
    unread.group_write(now, 5, 5, set(&["ann"], &[]));
    unread.handle_timeout(now + Duration::from_secs(6), at);
    match unread.poll_finished() {
        Some((5, Finished::Failed(e))) => {
            assert!(
                e.message.contains("could not read the cluster's groups"),
                "{}",
                e.message
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_directory_keeps_the_newest_revision() {
    let mut l = link("a");
    let now = Instant::now();
    let at = Millis(0);
    let def = |membership| GroupDef {
        group: 5,
        membership,
        next_ordinal: 1,
        members: vec![("ann".into(), 0)],
        admins: Vec::new(),
        removed: false,
    };
    let changed = |revision, def| ClusterInput::GroupChanged {
        group: 5,
        revision,
        def,
    };
    l.handle_input(now, at, changed(4, Some(def(2))));
    l.handle_input(now, at, changed(3, Some(def(1))));
    assert_eq!(
        l.group_def(5).1.map(|d| d.membership),
        Some(2),
        "older ignored"
    );
    // A definition under another group's key is not taken.
    let mut stray = def(3);
    stray.group = 6;
    l.handle_input(now, at, changed(9, Some(stray)));
    assert!(l.group_def(6).1.is_none());
    // A deleted header: no group.
    l.handle_input(now, at, changed(5, None));
    assert!(l.group_def(5).1.is_none());
}

/// An expected version this node's copy does not have yet (the watch is
/// behind) is not refused on the copy: the store's definition is read, and
/// the write goes on from it.
#[test]
fn an_expected_version_is_checked_against_the_store_not_a_lagging_copy() {
    let mut l = link("c");
    let now = Instant::now();
    let at = Millis(0);
    l.handle_input(now, at, ClusterInput::GroupsSynced);
    let change = GroupWrite::Change {
        add: names(&["bob"]),
        remove: Vec::new(),
        add_admins: Vec::new(),
        remove_admins: Vec::new(),
        expect: Some(1),
    };
    l.group_write(now, 1, 5, change);
    let id = match l.poll_output() {
        Some(ClusterOutput::ReadGroup { id, group: 5 }) => id,
        other => panic!("refused on the copy: {other:?}"),
    };
    let stored = GroupDef {
        group: 5,
        membership: 1,
        next_ordinal: 1,
        members: vec![("ann".into(), 0)],
        admins: Vec::new(),
        removed: false,
    };
    l.handle_input(
        now,
        at,
        ClusterInput::GroupRead {
            id,
            read: Ok((3, Some(stored))),
        },
    );
    let (id, def, expected) = write_asked(l.poll_output());
    assert_eq!((expected, def.membership), (3, 2));
    l.handle_input(
        now,
        at,
        written(id, GroupWriteOutcome::Written { revision: 4 }),
    );
    assert!(matches!(
        l.poll_finished(),
        Some((1, Finished::Answer(Answer::GroupSet { version: 2 })))
    ));
}
