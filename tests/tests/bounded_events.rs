//! A watcher that does not read its events (an app in the background)
//! against a real server: while it does not read, the client keeps the
//! newest presence of each target, not every change; once it reads it gets
//! the latest state, and a later change still wakes it.

use greendot_client::{Client, Event};
use greendot_core::{Millis, Status, Tier};
use greendot_proto::Kind;
use greendot_server::token::WatchClaim;
use greendot_server::RateLimit;
use greendot_tests::{eventually, TestServer, SLACK};

const CHANGES: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_does_not_read_keeps_only_the_newest_presence_per_target() {
    // 200 status changes in a row are more than the default burst; the
    // shortest debounce publishes each one.
    let ts = TestServer::start(|c| {
        c.rate = RateLimit::new(10_000, 10_000);
        c.core.debounce = Millis(1);
    });
    let (ada, _) = ts.connect("ada", "laptop", Kind::Desktop).await;
    let (_bo, _) = ts.connect("bo", "laptop", Kind::Desktop).await;
    let token = ts.token("walt", "phone", Kind::Mobile, WatchClaim::all());
    let (watcher, mut updates) = Client::connect(ts.client_config(token)).await.unwrap();
    let targets = ["ada", "bo"];
    watcher.subscribe(&targets, Tier::Realtime).await.unwrap();
    // A watcher that reads says when each change was published.
    let (reader, mut seen) = ts.connect("rita", "laptop", Kind::Desktop).await;
    reader.subscribe(&["ada"], Tier::Realtime).await.unwrap();
    // A snapshot shows what was published: a connect published after the
    // watcher subscribed comes as one more push. Counted from here, once
    // the watcher's view shows both online, only the changes below remain.
    let online = |c: &Client, user: &str| c.presence(user).is_some_and(|p| p.online);
    assert!(
        eventually(SLACK, || targets.iter().all(|t| online(&watcher, t))).await,
        "the watcher never saw both targets online"
    );
    let conflated_before = updates.stats().conflated;

    // Ada changes her status message 200 times, each one published; the
    // watcher reads nothing.
    for n in 0..CHANGES {
        let status = if n % 2 == 0 {
            Status::Away
        } else {
            Status::Busy
        };
        ada.set_status(status, Some(&format!("change {n}")))
            .await
            .unwrap();
        let message = format!("change {n}");
        seen.wait_presence("ada", SLACK, |p| {
            p.message.as_deref() == Some(message.as_str())
        })
        .await
        .expect("each change is published");
    }
    let last = format!("change {}", CHANGES - 1);
    // The watcher's connection took every push (its view has the last one)
    // although the app read nothing.
    let in_view = |c: &Client| {
        c.presence("ada")
            .is_some_and(|p| p.message.as_deref() == Some(last.as_str()))
    };
    assert!(
        eventually(SLACK, || in_view(&watcher)).await,
        "the watcher's view never got ada's last change: {:?}",
        watcher.presence("ada")
    );

    let stats = updates.stats();
    assert!(
        stats.pending_targets <= targets.len() && stats.pending <= targets.len(),
        "more pending than targets: {stats:?}"
    );
    // 200 pushes, each replacing the one pending.
    assert_eq!(
        stats.conflated - conflated_before,
        CHANGES as u64,
        "{stats:?}"
    );
    assert_eq!((stats.dropped_events, stats.dropped_presences), (0, 0));

    let mut read = Vec::new();
    while let Some(event) = updates.try_next() {
        read.push(event);
    }
    assert!(
        read.len() <= targets.len(),
        "{} events: {read:?}",
        read.len()
    );
    let of_ada: Vec<_> = read
        .iter()
        .filter_map(|e| match e {
            Event::Presence {
                target, presence, ..
            } if target == "ada" => Some(presence),
            _ => None,
        })
        .collect();
    assert_eq!(of_ada.len(), 1, "{read:?}");
    assert_eq!(of_ada[0].message.as_deref(), Some(last.as_str()));
    assert_eq!(Some(of_ada[0]), watcher.presence("ada").as_ref());

    // Reading again, a new change wakes the reader.
    ada.set_status(Status::Available, Some("back"))
        .await
        .unwrap();
    let next = tokio::time::timeout(SLACK, updates.next())
        .await
        .expect("the reader woke on the next change");
    match next {
        Some(Event::Presence {
            target, presence, ..
        }) => {
            assert_eq!(target, "ada");
            assert_eq!(presence.message.as_deref(), Some("back"));
        }
        other => panic!("expected ada's presence, got {other:?}"),
    }
}
