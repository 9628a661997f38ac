//! The cost of group presence in the core, by group size. Prints a table; no
//! number is asserted anywhere.
//!
//! `cargo bench -p greendot-core --bench groups`
//!
//! One group of N members (N = 100 … 10,000) with 10 admins, every member
//! online with one session subscribed to the group. A change is a random
//! non-admin member going invisible (published at once: the count drops and
//! each admin gets a delta) or visible again (published at the end of its
//! debounce). Measured per change: the time of the input plus the timeout
//! that publishes it, and the pushes it causes; then the time of one count
//! flush, per member session it tells.

use greendot_core::*;
use std::hint::black_box;
use std::time::Instant;

const ADMINS: u64 = 10;
const CHANGES: u64 = 20_000;

fn drain(core: &mut Core) -> u64 {
    while core.poll_output().is_some() {}
    let mut n = 0;
    while let Some(o) = core.poll_group_output() {
        black_box(&o);
        n += 1;
    }
    n
}

fn main() {
    println!(
        "| members | member sessions | admin sessions | µs per change | pushes per change | flush: pushes | flush: ns per push |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for members in [100u64, 1_000, 10_000] {
        let mut config = Config::default();
        // No session expires during the run.
        for kind in DeviceKind::ALL {
            config.kind_mut(kind).heartbeat_timeout = Millis::from_secs(1_000_000);
        }
        let mut core = Core::new(config).expect("valid config");
        let group = GroupId(1);
        let users: Vec<UserId> = (1..=members).map(UserId).collect();
        let admins: Vec<UserId> = (1..=ADMINS).map(UserId).collect();
        core.handle_set_group(Millis(0), group, &users, &admins)
            .expect("within limits");
        let mut sessions = Vec::new();
        for u in 1..=members {
            let c = Connect {
                user: UserId(u),
                device: DeviceId(1),
                kind: DeviceKind::Desktop,
                watch: Watch::All,
                resume: None,
                foreground: true,
            };
            let s = core.handle_connect(Millis(0), c).expect("room").session;
            core.handle_group_subscribe(Millis(0), s, group)
                .expect("a member");
            sessions.push(s);
        }
        // Everybody published online; the first flush told the members.
        let mut now = 60_000;
        core.handle_timeout(Millis(now));
        drain(&mut core);

        let debounce = core.config().debounce.0;
        let mut pushes = 0;
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let start = Instant::now();
        for _ in 0..CHANGES / 2 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let member = ADMINS + rng % (members - ADMINS);
            let s = sessions[member as usize];
            // Invisible: published at once; visible again: at the end of
            // its debounce.
            now += 1;
            core.handle_set_invisible(Millis(now), s, true)
                .expect("online");
            pushes += drain(&mut core);
            now += 1;
            core.handle_set_invisible(Millis(now), s, false)
                .expect("online");
            now += debounce;
            core.handle_timeout(Millis(now));
            pushes += drain(&mut core);
        }
        let per_change = start.elapsed().as_secs_f64() * 1e6 / CHANGES as f64;
        let per_change_pushes = pushes as f64 / CHANGES as f64;

        // One flush: once every member session was told the count, the
        // count moves, then the interval passes.
        now += 2 * core.config().group_interval.0;
        core.handle_timeout(Millis(now));
        drain(&mut core);
        let s = sessions[(ADMINS + 1) as usize];
        core.handle_set_invisible(Millis(now + 1), s, true)
            .expect("online");
        drain(&mut core);
        let due = core.poll_timeout().expect("a flush is armed");
        let start = Instant::now();
        core.handle_timeout(due);
        let flush = start.elapsed().as_secs_f64();
        let told = drain(&mut core);
        println!(
            "| {members} | {} | {ADMINS} | {per_change:.2} | {per_change_pushes:.1} | {told} | {:.0} |",
            members - ADMINS,
            flush * 1e9 / told.max(1) as f64
        );
    }
}
