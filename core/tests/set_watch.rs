//! `Core::handle_set_watch`: renewed credentials narrow what a live session
//! may watch; subscriptions the new watch no longer allows end (I11), the
//! others and the session's own stay, and no push reaches an ended one.

use greendot_core::*;

fn connect(core: &mut Core, user: u64, watch: Watch) -> SessionId {
    core.handle_connect(
        Millis(0),
        Connect {
            user: UserId(user),
            device: DeviceId(user),
            kind: DeviceKind::Desktop,
            watch,
            resume: None,
            foreground: true,
        },
    )
    .unwrap()
    .session
}

#[test]
fn i11_a_narrower_watch_ends_the_subscriptions_it_no_longer_allows() {
    let mut core = Core::new(Config::default()).unwrap();
    let viewer = connect(&mut core, 1, Watch::only([UserId(2), UserId(3)]));
    for target in [1, 2, 3] {
        core.handle_subscribe(Millis(1), viewer, UserId(target), Tier::Realtime)
            .unwrap();
    }
    let ended = core
        .handle_set_watch(Millis(2), viewer, Watch::only([UserId(3)]))
        .unwrap();
    assert_eq!(ended, vec![UserId(2)]);
    core.check_invariants().unwrap();
    let mut subs: Vec<UserId> = core
        .subscriptions(viewer)
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    subs.sort();
    assert_eq!(
        subs,
        vec![UserId(1), UserId(3)],
        "its own and the allowed stay"
    );
    assert_eq!(
        core.handle_subscribe(Millis(3), viewer, UserId(2), Tier::Realtime),
        Err(Error::NotAllowed)
    );
    // A change of user 2 is pushed to nobody; one of user 3 still reaches it.
    while core.poll_output().is_some() {}
    connect(&mut core, 2, Watch::All);
    connect(&mut core, 3, Watch::All);
    core.handle_timeout(Millis(1_000));
    let mut pushed = Vec::new();
    while let Some(out) = core.poll_output() {
        if let Output::Push { to, target, .. } = out {
            if to == viewer {
                pushed.push(target);
            }
        }
    }
    assert!(pushed.contains(&UserId(3)), "{pushed:?}");
    assert!(!pushed.contains(&UserId(2)), "{pushed:?}");
    // A wider watch allows it again; nothing ends.
    assert_eq!(
        core.handle_set_watch(Millis(1_001), viewer, Watch::All),
        Ok(Vec::new())
    );
    core.handle_subscribe(Millis(1_002), viewer, UserId(2), Tier::Batched)
        .unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn a_set_watch_naming_no_current_session_is_stale() {
    let mut core = Core::new(Config::default()).unwrap();
    let s = connect(&mut core, 1, Watch::All);
    core.handle_logout(Millis(1), s).unwrap();
    assert_eq!(
        core.handle_set_watch(Millis(2), s, Watch::only([])),
        Err(Error::Stale)
    );
}
