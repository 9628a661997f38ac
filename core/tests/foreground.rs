//! I12: foreground and background (DESIGN.md, "Backgrounded(session)").

use greendot_core::*;

const ALICE: UserId = UserId(1);
const BOB: UserId = UserId(2);
const PHONE: DeviceId = DeviceId(1);
const LAPTOP: DeviceId = DeviceId(2);

fn connect(core: &mut Core, now: u64, user: UserId, device: DeviceId, fg: bool) -> SessionId {
    let c = Connect {
        user,
        device,
        kind: DeviceKind::Mobile,
        watch: Watch::All,
        resume: None,
        foreground: fg,
    };
    core.handle_connect(Millis(now), c).unwrap().session
}

/// Runs every deadline up to `now`, checks the invariants, and returns what
/// Bob's session was pushed about Alice.
fn run_to(core: &mut Core, now: u64) -> Vec<Presence> {
    while let Some(due) = core.poll_timeout().filter(|d| d.0 <= now) {
        core.handle_timeout(due);
    }
    core.handle_timeout(Millis(now));
    core.check_invariants().unwrap();
    std::iter::from_fn(|| core.poll_output())
        .filter_map(|o| match o {
            Output::Push {
                target, presence, ..
            } if target == ALICE => Some(presence),
            _ => None,
        })
        .collect()
}

/// Alice on her phone, Bob watching her in realtime, both published.
fn watched(config: Config) -> (Core, SessionId) {
    let mut core = Core::new(config).unwrap();
    let phone = connect(&mut core, 0, ALICE, PHONE, true);
    let bob = connect(&mut core, 0, BOB, LAPTOP, true);
    core.handle_subscribe(Millis(0), bob, ALICE, Tier::Realtime)
        .unwrap();
    let pushed = run_to(&mut core, 1_000);
    assert!(pushed.last().is_some_and(|p| p.online), "{pushed:?}");
    (core, phone)
}

#[test]
fn backgrounded_is_offline_after_debounce_last_seen_when_it_went() {
    let (mut core, phone) = watched(Config::default());
    core.handle_set_foreground(Millis(5_000), phone, false)
        .unwrap();
    // Keep-alives of the backgrounded phone do not move last seen.
    core.handle_activity(Millis(5_200), phone).unwrap();
    assert!(
        run_to(&mut core, 5_299).is_empty(),
        "published before debounce"
    );
    let pushed = run_to(&mut core, 5_300);
    assert_eq!(pushed.len(), 1);
    assert!(!pushed[0].online);
    assert_eq!(pushed[0].last_seen, Some(Millis(5_000)));
    assert!(
        core.route(ALICE).is_empty(),
        "a backgrounded phone is routable"
    );
    assert!(!core.truth(ALICE).online);
    assert!(core.is_online(ALICE), "the session is kept");
    // Its later keep-alives, loss and expiry never move last seen.
    core.handle_activity(Millis(20_000), phone).unwrap();
    core.handle_disconnect(Millis(30_000), phone, Millis(29_000))
        .unwrap();
    assert!(run_to(&mut core, 200_000).is_empty());
    assert_eq!(core.presence(ALICE).last_seen, Some(Millis(5_000)));
    // Back in the foreground: online again, routable.
    let (mut core, phone) = watched(Config::default());
    core.handle_set_foreground(Millis(5_000), phone, false)
        .unwrap();
    run_to(&mut core, 6_000);
    core.handle_set_foreground(Millis(7_000), phone, true)
        .unwrap();
    assert_eq!(core.route(ALICE), vec![phone]);
    let pushed = run_to(&mut core, 7_300);
    assert!(pushed.len() == 1 && pushed[0].online, "{pushed:?}");
}

#[test]
fn a_toggle_shorter_than_debounce_is_never_published() {
    let (mut core, phone) = watched(Config::default());
    core.handle_set_foreground(Millis(5_000), phone, false)
        .unwrap();
    core.handle_set_foreground(Millis(5_150), phone, true)
        .unwrap();
    core.handle_set_foreground(Millis(5_200), phone, false)
        .unwrap();
    core.handle_set_foreground(Millis(5_350), phone, true)
        .unwrap();
    assert!(run_to(&mut core, 10_000).is_empty(), "a flap was published");
    assert!(core.presence(ALICE).online);
}

#[test]
fn last_seen_is_when_the_last_foreground_device_went() {
    let (mut core, phone) = watched(Config::default());
    let laptop = connect(&mut core, 1_000, ALICE, LAPTOP, true);
    run_to(&mut core, 2_000);
    // The laptop's connection drops (last heard 2,500); the phone goes to
    // the background later, at 4,000, and keeps sending keep-alives.
    core.handle_disconnect(Millis(3_000), laptop, Millis(2_500))
        .unwrap();
    core.handle_set_foreground(Millis(4_000), phone, false)
        .unwrap();
    core.handle_activity(Millis(9_000), phone).unwrap();
    core.handle_logout(Millis(10_000), phone).unwrap();
    let pushed = run_to(&mut core, 100_000);
    let last = pushed.last().unwrap();
    assert!(!last.online);
    assert_eq!(last.last_seen, Some(Millis(4_000)), "{pushed:?}");
}

#[test]
fn connecting_in_the_background_shows_nothing_and_routes_nowhere() {
    let (mut core, phone) = watched(Config::default());
    core.handle_logout(Millis(2_000), phone).unwrap();
    run_to(&mut core, 3_000);
    let phone = connect(&mut core, 4_000, ALICE, PHONE, false);
    assert!(run_to(&mut core, 10_000).is_empty());
    assert!(core.route(ALICE).is_empty());
    assert_eq!(core.presence(ALICE).last_seen, Some(Millis(2_000)));
    core.handle_set_foreground(Millis(11_000), phone, true)
        .unwrap();
    assert_eq!(core.route(ALICE), vec![phone]);
}

#[test]
fn away_setting_keeps_the_user_shown_as_away() {
    let config = Config {
        backgrounded: Backgrounded::Away,
        ..Config::default()
    };
    let (mut core, phone) = watched(config);
    core.handle_set_foreground(Millis(5_000), phone, false)
        .unwrap();
    let pushed = run_to(&mut core, 6_000);
    assert_eq!(pushed.len(), 1);
    assert!(pushed[0].online && pushed[0].status == Status::Away);
    assert!(core.route(ALICE).is_empty(), "routing ignores the setting");
    // An explicit choice beats the inferred away.
    core.handle_set_status(Millis(7_000), phone, Status::Busy, None)
        .unwrap();
    let pushed = run_to(&mut core, 8_000);
    assert_eq!(pushed.last().map(|p| p.status), Some(Status::Busy));
}

#[test]
fn the_background_counted_mutant_really_counts_a_backgrounded_device() {
    let (mut core, phone) = watched(Config::default());
    core.set_mutant(Some(mutants::Mutant::BackgroundCounted));
    core.handle_set_foreground(Millis(5_000), phone, false)
        .unwrap();
    run_to(&mut core, 6_000);
    assert!(core.presence(ALICE).online, "the mutant is switched on");
    assert_eq!(core.route(ALICE), vec![phone]);
}
