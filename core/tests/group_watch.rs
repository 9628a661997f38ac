//! Watched member pages and the page budget (issue 28, the core's
//! `group_watch` module): examples. The property tests of `groups.rs`
//! check G5 against a reference.

use greendot_core::*;

mod group_setup;
use group_setup::{connect, drain};

fn settle(core: &mut Core, until: u64) {
    while let Some(due) = core.poll_timeout().filter(|d| d.0 <= until) {
        core.handle_timeout(due);
        core.check_invariants().unwrap();
    }
    core.handle_timeout(Millis(until));
    while core.poll_output().is_some() {}
}

fn users(ids: impl IntoIterator<Item = u64>) -> Vec<UserId> {
    ids.into_iter().map(UserId).collect()
}

/// A page delta as (to, group, [(member, online)]).
type Delta = (SessionId, GroupId, Vec<(u64, bool)>);

/// Page deltas of the drained outputs.
fn deltas(out: &[GroupOutput]) -> Vec<Delta> {
    out.iter()
        .filter_map(|o| match o {
            GroupOutput::Page { to, group, entries } => Some((
                *to,
                *group,
                entries.iter().map(|(u, p)| (u.0, p.online)).collect(),
            )),
            _ => None,
        })
        .collect()
}

const G: GroupId = GroupId(1);

#[test]
fn a_watched_page_gets_batched_deltas_of_its_members_only() {
    let mut core = Core::new(Config::default()).unwrap();
    core.handle_set_group(Millis(0), G, &users(1..=10), &[])
        .unwrap();
    let me = connect(&mut core, 0, 1, 1);
    let other = connect(&mut core, 0, 9, 1);
    settle(&mut core, 1000);
    // Online first: 1 and 9, then 2, 3.
    let page = core
        .handle_group_watch_page(Millis(1000), me, G, None, 4)
        .unwrap();
    let ids: Vec<u64> = page.entries.iter().map(|(u, _)| u.0).collect();
    assert_eq!(ids, [1, 9, 2, 3]);
    // 2 (on the page) and 5 (not on it) come online, 3 twice within the
    // batch: each change once published, one batched push at the flush.
    connect(&mut core, 2000, 2, 1);
    connect(&mut core, 2000, 5, 1);
    connect(&mut core, 2000, 3, 1);
    settle(&mut core, 2300);
    settle(&mut core, 4299);
    assert!(deltas(&drain(&mut core)).is_empty(), "batched: not yet");
    settle(&mut core, 4300);
    assert_eq!(
        deltas(&drain(&mut core)),
        vec![(me, G, vec![(2, true), (3, true)])],
        "one push to the watcher only, of its page's members only"
    );
    // Any change of a listed member's published view is a delta, not
    // only online and offline.
    core.handle_set_status(Millis(4400), other, Status::Busy, None)
        .unwrap();
    settle(&mut core, 6700);
    match &drain(&mut core)[..] {
        [GroupOutput::Page { to, entries, .. }] => {
            assert_eq!(*to, me);
            assert_eq!(entries.len(), 1);
            assert_eq!(entries[0].0, UserId(9));
            assert_eq!(entries[0].1.status, Status::Busy);
        }
        other => panic!("{other:?}"),
    }
    core.check_invariants().unwrap();
}

#[test]
fn a_watch_runs_out_unless_renewed() {
    let config = Config {
        group_watch_ttl: Millis(5000),
        ..Config::default()
    };
    let mut core = Core::new(config).unwrap();
    core.handle_set_group(Millis(0), G, &users(1..=3), &[])
        .unwrap();
    let me = connect(&mut core, 0, 1, 1);
    settle(&mut core, 1000);
    core.handle_group_watch_page(Millis(1000), me, G, None, 10)
        .unwrap();
    // Renewed at 5,000: it lives until 10,000.
    settle(&mut core, 5000);
    core.handle_group_renew_watch(Millis(5000), me, G, None)
        .unwrap();
    connect(&mut core, 7000, 2, 1);
    settle(&mut core, 9999);
    assert_eq!(deltas(&drain(&mut core)), vec![(me, G, vec![(2, true)])]);
    assert_eq!(core.group_watches(me).len(), 1);
    settle(&mut core, 10_000);
    assert!(core.group_watches(me).is_empty(), "ran out at 10,000");
    connect(&mut core, 10_000, 3, 1);
    settle(&mut core, 20_000);
    assert!(
        deltas(&drain(&mut core)).is_empty(),
        "no deltas after it ran out"
    );
    assert_eq!(
        core.handle_group_renew_watch(Millis(20_000), me, G, None),
        Err(Error::NotSubscribed)
    );
    // Asking for the page again watches it again.
    core.handle_group_watch_page(Millis(20_000), me, G, None, 10)
        .unwrap();
    assert_eq!(core.group_watches(me)[0].3, Millis(25_000));
    core.check_invariants().unwrap();
}

#[test]
fn watch_limits_are_checked_before_anything_is_stored() {
    let config = Config {
        max_watched_entries: 7,
        ..Config::default()
    };
    let mut core = Core::new(config).unwrap();
    for g in 1..=5 {
        core.handle_set_group(Millis(0), GroupId(g), &users(1..=10), &[])
            .unwrap();
    }
    let me = connect(&mut core, 0, 1, 1);
    for g in 1..=3 {
        core.handle_group_watch_page(Millis(0), me, GroupId(g), None, 2)
            .unwrap();
    }
    let before = core.group_watches(me);
    assert_eq!(
        core.handle_group_watch_page(Millis(0), me, GroupId(4), None, 2),
        Err(Error::LimitExceeded(Limit::WatchedPages)),
        "a 4th page"
    );
    // Asking a watched page again renews it: no 4th watch.
    core.handle_group_watch_page(Millis(0), me, GroupId(3), None, 2)
        .unwrap();
    // 2 + 2 held: a page of 4 makes 8 entries, over 7.
    assert_eq!(
        core.handle_group_watch_page(Millis(0), me, GroupId(3), None, 4),
        Err(Error::LimitExceeded(Limit::WatchedEntries))
    );
    assert_eq!(core.group_watches(me), before, "nothing stored");
    core.handle_group_unwatch(Millis(0), me, GroupId(1), None)
        .unwrap();
    assert_eq!(
        core.handle_group_unwatch(Millis(0), me, GroupId(1), None),
        Err(Error::NotSubscribed)
    );
    core.handle_group_watch_page(Millis(0), me, GroupId(4), None, 3)
        .unwrap();
    assert_eq!(core.group_watches(me).len(), 3);
    core.check_invariants().unwrap();
}

#[test]
fn leaving_the_group_or_ending_the_session_drops_the_watches() {
    let mut core = Core::new(Config::default()).unwrap();
    core.handle_set_group(Millis(0), G, &users(1..=3), &[])
        .unwrap();
    core.handle_set_group(Millis(0), GroupId(2), &users(1..=3), &[])
        .unwrap();
    let me = connect(&mut core, 0, 1, 1);
    core.handle_group_watch_page(Millis(0), me, G, None, 10)
        .unwrap();
    core.handle_group_watch_page(Millis(0), me, GroupId(2), None, 10)
        .unwrap();
    core.handle_set_group(Millis(0), G, &users(2..=3), &[])
        .unwrap();
    let left: Vec<GroupId> = core.group_watches(me).iter().map(|w| w.0).collect();
    assert_eq!(left, [GroupId(2)]);
    connect(&mut core, 10, 2, 1);
    core.handle_logout(Millis(20), me).unwrap();
    assert!(core.group_watches(me).is_empty());
    settle(&mut core, 10_000);
    assert!(deltas(&drain(&mut core)).is_empty());
    core.check_invariants().unwrap();
}

#[test]
fn a_change_costs_one_push_per_watcher_of_its_page_not_per_member() {
    let mut core = Core::new(Config::default()).unwrap();
    let members = users(1..=10_000);
    core.handle_set_group(Millis(0), G, &members, &[]).unwrap();
    let mut watchers = Vec::new();
    for u in 1..=500 {
        let s = connect(&mut core, 0, u, 1);
        core.handle_group_subscribe(Millis(0), s, G).unwrap();
        watchers.push(s);
    }
    settle(&mut core, 1000);
    // Three sessions watch the first offline page (501..=700).
    let cursor = PageCursor {
        online: true,
        after: UserId(500),
    };
    for &s in &watchers[..3] {
        let page = core
            .handle_group_watch_page(Millis(1000), s, G, Some(cursor), 200)
            .unwrap();
        assert_eq!(page.entries[0].0, UserId(501));
    }
    drain(&mut core);
    connect(&mut core, 2000, 600, 1);
    connect(&mut core, 2000, 9000, 1);
    settle(&mut core, 5000);
    let got = deltas(&drain(&mut core));
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got.iter().all(|(_, _, e)| e == &[(600, true)]));
}

#[test]
fn member_pages_are_rate_limited_per_group_before_any_work() {
    let config = Config {
        group_page_burst: 3,
        group_page_refill: Millis(1000),
        ..Config::default()
    };
    let mut core = Core::new(config).unwrap();
    core.handle_set_group(Millis(0), G, &users(1..=3), &[])
        .unwrap();
    core.handle_set_group(Millis(0), GroupId(2), &users(1..=3), &[])
        .unwrap();
    let me = connect(&mut core, 0, 1, 1);
    for _ in 0..3 {
        core.handle_group_page(Millis(0), me, G, None, 10).unwrap();
    }
    let limited = |retry_after| {
        Err(Error::PageRateLimited {
            retry_after: Millis(retry_after),
        })
    };
    assert_eq!(
        core.handle_group_page(Millis(0), me, G, None, 10),
        limited(1000)
    );
    // A watched page spends from the same budget, and stores nothing.
    assert_eq!(
        core.handle_group_watch_page(Millis(400), me, G, None, 10),
        limited(600)
    );
    assert!(core.group_watches(me).is_empty());
    // Another group has its own budget.
    core.handle_group_page(Millis(400), me, GroupId(2), None, 10)
        .unwrap();
    assert_eq!(
        core.handle_group_page(Millis(999), me, G, None, 10),
        limited(1)
    );
    core.handle_group_page(Millis(1000), me, G, None, 10)
        .unwrap();
    assert_eq!(
        core.handle_group_page(Millis(1000), me, G, None, 10),
        limited(1000)
    );
    // Refilled at one page a second, up to the burst.
    for _ in 0..3 {
        core.handle_group_page(Millis(10_000), me, G, None, 10)
            .unwrap();
    }
    assert_eq!(
        core.handle_group_page(Millis(10_000), me, G, None, 10),
        limited(1000)
    );
    assert!(Error::PageRateLimited {
        retry_after: Millis(250)
    }
    .to_string()
    .contains("retry after 250 ms"));
    core.check_invariants().unwrap();
}

/// A resume carries the page budget over: reconnecting does not buy a
/// fresh burst of pages. A session that does not resume starts afresh.
#[test]
fn a_resume_keeps_the_page_budget() {
    let config = Config {
        group_page_burst: 2,
        group_page_refill: Millis(1000),
        ..Config::default()
    };
    let mut core = Core::new(config).unwrap();
    core.handle_set_group(Millis(0), G, &users(1..=3), &[])
        .unwrap();
    let first = connect(&mut core, 0, 1, 1);
    for _ in 0..2 {
        core.handle_group_page(Millis(0), first, G, None, 10)
            .unwrap();
    }
    core.handle_disconnect(Millis(10), first, Millis(10))
        .unwrap();
    let resumed = core
        .handle_connect(
            Millis(20),
            Connect {
                user: UserId(1),
                device: DeviceId(1),
                kind: DeviceKind::Desktop,
                watch: Watch::All,
                resume: Some(first),
                foreground: true,
            },
        )
        .unwrap();
    assert!(resumed.resumed);
    assert_eq!(
        core.handle_group_page(Millis(20), resumed.session, G, None, 10),
        Err(Error::PageRateLimited {
            retry_after: Millis(980)
        })
    );
    // A fresh session (no resume) has its own budget.
    let fresh = connect(&mut core, 30, 1, 1);
    core.handle_group_page(Millis(30), fresh, G, None, 10)
        .unwrap();
    core.check_invariants().unwrap();
}
