//! `Core::handle_disconnect_until`: a restored device lingers until a later
//! instant than its grace, and no longer.

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
