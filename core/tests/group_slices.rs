//! A shard owner's core (issue 28, across a cluster): it holds the slice of
//! a group in its shard, counts it as one node does, and with changes
//! tracked notes each group whose online members changed, for the owner to
//! send on as a partial count.

use greendot_core::*;

mod group_setup;
use group_setup::{connect, drain};

fn config() -> Config {
    Config {
        debounce: Millis(100),
        ..Config::default()
    }
}

#[test]
fn an_owner_core_notes_the_groups_whose_online_members_changed() {
    let mut core = Core::new(config()).unwrap();
    let (g, other) = (GroupId(1), GroupId(2));
    // Not tracked: nothing is noted.
    core.handle_set_group(Millis(0), other, &[UserId(9)], &[])
        .unwrap();
    core.set_track_group_changes(true);
    assert!(core.take_changed_groups().is_empty());
    core.handle_set_group(Millis(0), g, &[UserId(1), UserId(2)], &[])
        .unwrap();
    assert_eq!(core.take_changed_groups(), [g], "a write is a change");
    assert!(core.take_changed_groups().is_empty(), "taken once");

    // User 1 comes online (after the debounce): g changes, not `other`.
    let s1 = connect(&mut core, 0, 1, 1);
    assert!(core.take_changed_groups().is_empty(), "not published yet");
    core.handle_timeout(Millis(100));
    assert_eq!(core.take_changed_groups(), [g]);
    assert_eq!(
        core.group_online(g).map(|o| o.collect::<Vec<_>>()),
        Some(vec![UserId(1)])
    );
    // A user of no group, and a change that is not online or offline,
    // note nothing.
    connect(&mut core, 100, 5, 1);
    core.handle_set_status(Millis(150), s1, Status::Busy, None)
        .unwrap();
    core.handle_timeout(Millis(400));
    assert!(core.take_changed_groups().is_empty());
    // Invisible is offline to the group.
    core.handle_set_invisible(Millis(400), s1, true).unwrap();
    core.handle_timeout(Millis(600));
    assert_eq!(core.take_changed_groups(), [g]);
    assert_eq!(core.group_online(g).map(|o| o.count()), Some(0));

    core.handle_remove_group(Millis(600), g).unwrap();
    assert_eq!(core.take_changed_groups(), [g], "a removal is a change");
    assert!(core.group_online(g).is_none());
    core.set_track_group_changes(false);
    core.handle_set_group(Millis(700), g, &[UserId(1)], &[])
        .unwrap();
    assert!(core.take_changed_groups().is_empty());
    assert!(drain(&mut core).is_empty(), "no subscriptions: no pushes");
    core.check_invariants().unwrap();
}
