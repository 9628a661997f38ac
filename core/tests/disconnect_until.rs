//! `Core::handle_disconnect_until` and `Core::extend_linger`: a restored
//! device lingers until a later instant than its grace, and no longer.

use greendot_core::*;

#[test]
fn a_disconnect_until_lingers_past_grace_until_then() {
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Web).grace = Millis(10_000);
    let mut core = Core::new(config).unwrap();
    let connect = |core: &mut Core, user, device| {
        core.handle_connect(
            Millis(0),
            Connect {
                user: UserId(user),
                device: DeviceId(device),
                kind: DeviceKind::Web,
                watch: Watch::All,
                resume: None,
                foreground: true,
            },
        )
        .unwrap()
        .session
    };
    let web = connect(&mut core, 1, 1);
    let plain = connect(&mut core, 2, 2);
    core.handle_disconnect_until(Millis(0), web, Millis(0), Millis(40_000))
        .unwrap();
    // Never shorter than the grace.
    core.handle_disconnect_until(Millis(0), plain, Millis(0), Millis(1))
        .unwrap();
    core.check_invariants().unwrap();
    let mut ended = Vec::new();
    let run_until = |core: &mut Core, t: u64, ended: &mut Vec<(u64, SessionId)>| {
        while let Some(due) = core.poll_timeout().filter(|d| d.0 <= t) {
            core.handle_timeout(due);
            while let Some(out) = core.poll_output() {
                if let Output::SessionEnded { session, .. } = out {
                    ended.push((due.0, session));
                }
            }
        }
        core.check_invariants().unwrap();
    };
    run_until(&mut core, 39_999, &mut ended);
    assert_eq!(ended, vec![(10_000, plain)]);
    assert!(core.is_online(UserId(1)), "still lingering past its grace");
    run_until(&mut core, 40_000, &mut ended);
    assert_eq!(ended, vec![(10_000, plain), (40_000, web)]);
    assert!(!core.is_online(UserId(1)));
}

#[test]
fn extend_linger_holds_a_lingering_session_and_nothing_else() {
    let mut config = Config::default();
    config.kind_mut(DeviceKind::Web).grace = Millis(10_000);
    let mut core = Core::new(config).unwrap();
    let mut connect = |user| {
        core.handle_connect(
            Millis(0),
            Connect {
                user: UserId(user),
                device: DeviceId(user),
                kind: DeviceKind::Web,
                watch: Watch::All,
                resume: None,
                foreground: true,
            },
        )
        .unwrap()
        .session
    };
    let (held, online) = (connect(1), connect(2));
    core.handle_disconnect(Millis(0), held, Millis(0)).unwrap();
    // Extended twice, the second time earlier: the later deadline stands.
    assert!(core.extend_linger(Millis(9_000), held, Millis(25_000)));
    assert!(core.extend_linger(Millis(9_500), held, Millis(12_000)));
    // An online session is not lingering: nothing to hold.
    assert!(!core.extend_linger(Millis(9_500), online, Millis(30_000)));
    core.check_invariants().unwrap();
    core.handle_timeout(Millis(24_999));
    assert!(
        core.is_online(UserId(1)),
        "shown offline before the extension ran out"
    );
    core.handle_timeout(Millis(25_000));
    assert!(!core.is_online(UserId(1)));
    // Gone: extending it says so and changes nothing.
    assert!(!core.extend_linger(Millis(25_001), held, Millis(40_000)));
    core.check_invariants().unwrap();
}
