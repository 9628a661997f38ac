//! What the client tells the application, and the queue that holds it
//! until the application reads it ([`Updates`]).
//!
//! An app that stops reading (a phone in the background) must not make the
//! client grow without limit, so the queue is bounded:
//! - presence is conflated: at most one pending [`Event::Presence`] per
//!   target, the newest; a newer one replaces the pending one in its place
//!   (so the app learns the latest state no later than it would have learnt
//!   the first one), with the newest one's `source`;
//! - at most [`ClientConfig::max_pending_targets`] targets have a presence
//!   pending; a presence of one more target is dropped and counted (the
//!   client's view still has it: [`Client::presence`]);
//! - at most [`ClientConfig::max_pending_events`] other events are pending;
//!   past it the oldest of them is dropped and counted;
//! - [`Event::Closed`] is never dropped and is always the last event.
//!
//! [`Updates::stats`] says how many were conflated and dropped.
//!
//! [`ClientConfig::max_pending_targets`]: crate::ClientConfig::max_pending_targets
//! [`ClientConfig::max_pending_events`]: crate::ClientConfig::max_pending_events
//! [`Client::presence`]: crate::Client::presence

use greendot_core::{Presence, SessionId};
use greendot_proto::CloseCode;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// Where an update came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A snapshot: in a subscribe answer or a resumed welcome.
    Snapshot,
    Realtime,
    Batched,
}

/// What the client tells the application.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// What the client knows of `target` changed (newer version only). While
    /// the app does not read, only the newest of a target is kept.
    Presence {
        target: String,
        presence: Presence,
        source: Source,
    },
    /// The connection was lost; the client is reconnecting.
    Disconnected { reason: String },
    /// Connected again; `resumed` if the old session carried over unseen.
    Reconnected {
        session: SessionId,
        resumed: bool,
        carrier: Carrier,
    },
    /// A new token took over on the live connection; `ended`: the
    /// subscriptions its `watch` no longer allows, which ended.
    TokenRefreshed { ended: Vec<String> },
    /// A subscribed group's online count (members shown online; invisible
    /// members count as offline): batched for a member, realtime for an
    /// admin. Versions rise per group; older ones are dropped.
    GroupCount {
        group: u64,
        version: u64,
        count: u32,
        source: Source,
    },
    /// To an admin, in realtime: `member` is now shown online (or offline),
    /// and the group's count after it.
    GroupMember {
        group: u64,
        version: u64,
        member: String,
        online: bool,
        count: u32,
    },
    /// The group subscription ended: the user left the group, or it was
    /// removed (also when the client, after a reconnect that did not
    /// resume, subscribed again and was refused).
    GroupEnded { group: u64 },
    /// Batched, for the pages of `group` this session watches
    /// ([`Client::group_watch_page`](crate::Client::group_watch_page)):
    /// listed members whose view changed, each with its latest view.
    /// Presence versions rise per member: keep the highest.
    GroupPageDelta {
        group: u64,
        entries: Vec<(String, Presence)>,
    },
    /// The client is finished (closed, logged out, refused, superseded, or
    /// gave up reconnecting). Never dropped; nothing comes after it.
    Closed {
        code: Option<CloseCode>,
        reason: String,
    },
}

/// What a connection runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carrier {
    /// Raw QUIC (ALPN `greendot/1`).
    Quic,
    /// WebSocket over TLS over TCP: the fallback when UDP is blocked.
    WebSocket,
}

/// What the event queue holds and what it let go, so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventStats {
    /// Events waiting to be read (a pending `Closed` included).
    pub pending: usize,
    /// Targets with a presence waiting to be read.
    pub pending_targets: usize,
    /// Presence events replaced, before they were read, by a newer one of
    /// the same target.
    pub conflated: u64,
    /// Presence events dropped because `max_pending_targets` other targets
    /// had one pending.
    pub dropped_presences: u64,
    /// Other events (not presence, not `Closed`) dropped, oldest first,
    /// because `max_pending_events` were pending.
    pub dropped_events: u64,
}

/// A place in the delivery order.
enum Slot {
    /// The target's presence is in `Queue::presences`.
    Presence(String),
    Other(Event),
}

struct Queue {
    order: VecDeque<Slot>,
    presences: HashMap<String, (Presence, Source)>,
    /// `Slot::Other`s in `order`.
    others: usize,
    /// Delivered once `order` is empty.
    closed: Option<Event>,
    /// `Closed` was sent: nothing after it is taken.
    finished: bool,
    sender_gone: bool,
    receiver_gone: bool,
    stats: EventStats,
}

impl Queue {
    fn pop(&mut self) -> Option<Event> {
        match self.order.pop_front() {
            Some(Slot::Presence(target)) => {
                let (presence, source) = self.presences.remove(&target)?;
                Some(Event::Presence {
                    target,
                    presence,
                    source,
                })
            }
            Some(Slot::Other(event)) => {
                self.others -= 1;
                Some(event)
            }
            None => self.closed.take(),
        }
    }
}

struct Inner {
    queue: Mutex<Queue>,
    /// One permit is stored when nobody waits: a send between the reader's
    /// look and its wait still wakes it.
    ready: Notify,
    max_events: usize,
    max_targets: usize,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The queue with room for `max_events` other events and presences of
/// `max_targets` targets.
pub(crate) fn channel(max_events: usize, max_targets: usize) -> (EventSender, Updates) {
    let inner = Arc::new(Inner {
        queue: Mutex::new(Queue {
            order: VecDeque::new(),
            presences: HashMap::new(),
            others: 0,
            closed: None,
            finished: false,
            sender_gone: false,
            receiver_gone: false,
            stats: EventStats::default(),
        }),
        ready: Notify::new(),
        max_events,
        max_targets,
    });
    (
        EventSender {
            inner: inner.clone(),
        },
        Updates { inner },
    )
}

/// The client's side: never blocks, never grows past the limits.
pub(crate) struct EventSender {
    inner: Arc<Inner>,
}

impl EventSender {
    pub(crate) fn send(&self, event: Event) {
        {
            let mut q = self.inner.lock();
            if q.receiver_gone {
                return;
            }
            if q.finished {
                // Nothing follows Closed (the client's task sends none).
                return;
            }
            match event {
                Event::Presence {
                    target,
                    presence,
                    source,
                } => {
                    if let Some(pending) = q.presences.get_mut(&target) {
                        *pending = (presence, source);
                        q.stats.conflated += 1;
                    } else if q.presences.len() >= self.inner.max_targets {
                        q.stats.dropped_presences += 1;
                        return;
                    } else {
                        q.presences.insert(target.clone(), (presence, source));
                        q.order.push_back(Slot::Presence(target));
                    }
                }
                closed @ Event::Closed { .. } => {
                    q.closed = Some(closed);
                    q.finished = true;
                }
                other => {
                    if q.others >= self.inner.max_events {
                        let oldest = q.order.iter().position(|s| matches!(s, Slot::Other(_)));
                        match oldest {
                            Some(at) => {
                                q.order.remove(at);
                                q.others -= 1;
                            }
                            // No room at all (a limit of 0).
                            None => {
                                q.stats.dropped_events += 1;
                                return;
                            }
                        }
                        q.stats.dropped_events += 1;
                    }
                    q.order.push_back(Slot::Other(other));
                    q.others += 1;
                }
            }
        }
        self.inner.ready.notify_one();
    }
}

impl Drop for EventSender {
    fn drop(&mut self) {
        self.inner.lock().sender_gone = true;
        self.inner.ready.notify_one();
    }
}

/// The stream of events of one client. While the app does not read, it
/// keeps the newest presence of each target and a bounded number of other
/// events (see [`crate::ClientConfig::max_pending_events`] and
/// [`crate::ClientConfig::max_pending_targets`]); `Closed` always comes,
/// last.
pub struct Updates {
    inner: Arc<Inner>,
}

impl Updates {
    /// The next event; `None` once the client is gone and all were read.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            {
                let mut q = self.inner.lock();
                if let Some(event) = q.pop() {
                    return Some(event);
                }
                if q.sender_gone {
                    return None;
                }
            }
            self.inner.ready.notified().await;
        }
    }

    /// An event already received, without waiting.
    pub fn try_next(&mut self) -> Option<Event> {
        self.inner.lock().pop()
    }

    /// What is pending now, and what was conflated or dropped so far.
    pub fn stats(&self) -> EventStats {
        let q = self.inner.lock();
        EventStats {
            pending: q.order.len() + usize::from(q.closed.is_some()),
            pending_targets: q.presences.len(),
            ..q.stats
        }
    }
}

impl std::fmt::Debug for Updates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Updates")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for Updates {
    fn drop(&mut self) {
        // Nobody will read: keep nothing.
        let mut q = self.inner.lock();
        q.receiver_gone = true;
        q.order.clear();
        q.presences.clear();
        q.others = 0;
        q.closed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn presence(version: u64) -> Presence {
        Presence {
            version,
            online: version % 2 == 1,
            ..Presence::default()
        }
    }

    fn update(target: &str, version: u64) -> Event {
        Event::Presence {
            target: target.into(),
            presence: presence(version),
            source: if version == 0 {
                Source::Snapshot
            } else {
                Source::Realtime
            },
        }
    }

    fn lost(n: usize) -> Event {
        Event::Disconnected {
            reason: format!("lost {n}"),
        }
    }

    fn closed() -> Event {
        Event::Closed {
            code: Some(CloseCode::Normal),
            reason: "closed by the application".into(),
        }
    }

    fn drain(updates: &mut Updates) -> Vec<Event> {
        std::iter::from_fn(|| updates.try_next()).collect()
    }

    #[test]
    fn presence_of_a_target_is_conflated_to_the_newest_in_the_first_ones_place() {
        let (tx, mut rx) = channel(64, 4096);
        let targets = ["ann", "bob", "cy"];
        for version in 0..10_000u64 {
            tx.send(update(targets[(version % 3) as usize], version));
        }
        let stats = rx.stats();
        assert_eq!(stats.pending, 3);
        assert_eq!(stats.pending_targets, 3);
        assert_eq!(stats.conflated, 10_000 - 3);
        // Each is the newest of its target, in the order the targets came
        // first, with the newest one's source.
        assert_eq!(
            drain(&mut rx),
            [
                update("ann", 9_999),
                update("bob", 9_997),
                update("cy", 9_998)
            ]
        );
        assert_eq!(rx.stats().pending, 0);
        // Read, a target queues anew.
        tx.send(update("bob", 10_000));
        assert_eq!(drain(&mut rx), [update("bob", 10_000)]);
    }

    #[test]
    fn other_events_keep_their_place_among_presences() {
        let (tx, mut rx) = channel(64, 4096);
        tx.send(update("ann", 1));
        tx.send(lost(1));
        tx.send(update("bob", 2));
        tx.send(update("ann", 3));
        assert_eq!(
            drain(&mut rx),
            [update("ann", 3), lost(1), update("bob", 2)]
        );
    }

    #[test]
    fn other_events_are_bounded_and_the_oldest_are_dropped_and_counted() {
        let (tx, mut rx) = channel(4, 4096);
        for n in 0..10 {
            tx.send(lost(n));
        }
        tx.send(update("ann", 1));
        let stats = rx.stats();
        assert_eq!(stats.dropped_events, 6);
        assert_eq!(stats.pending, 5);
        assert_eq!(
            drain(&mut rx),
            [lost(6), lost(7), lost(8), lost(9), update("ann", 1)]
        );
    }

    #[test]
    fn closed_is_kept_and_last_even_when_the_queue_is_full() {
        let (tx, mut rx) = channel(2, 1);
        tx.send(lost(0));
        tx.send(update("ann", 1));
        tx.send(lost(1));
        tx.send(closed());
        // Nothing follows Closed.
        tx.send(lost(2));
        tx.send(update("ann", 3));
        assert_eq!(
            drain(&mut rx),
            [lost(0), update("ann", 1), lost(1), closed()]
        );
        // Closed took no other event's place.
        assert_eq!(rx.stats().dropped_events, 0);
    }

    #[test]
    fn targets_past_the_limit_are_dropped_and_counted() {
        let (tx, mut rx) = channel(64, 2);
        tx.send(update("ann", 1));
        tx.send(update("bob", 2));
        tx.send(update("cy", 3));
        // A pending target still takes its newer versions.
        tx.send(update("ann", 4));
        let stats = rx.stats();
        assert_eq!((stats.pending_targets, stats.dropped_presences), (2, 1));
        assert_eq!(drain(&mut rx), [update("ann", 4), update("bob", 2)]);
        tx.send(update("cy", 5));
        assert_eq!(drain(&mut rx), [update("cy", 5)]);
    }

    #[tokio::test]
    async fn a_waiting_reader_wakes_on_a_send_and_ends_once_the_sender_is_gone() {
        let (tx, mut rx) = channel(64, 4096);
        let reader = tokio::spawn(async move {
            let first = rx.next().await;
            let second = rx.next().await;
            let third = rx.next().await;
            let after = rx.next().await;
            (first, second, third, after)
        });
        // The reader is waiting: it must wake on the send.
        tokio::task::yield_now().await;
        assert!(!reader.is_finished());
        tx.send(update("ann", 1));
        tx.send(lost(0));
        tx.send(closed());
        drop(tx);
        let got = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .expect("the reader woke")
            .unwrap();
        assert_eq!(
            got,
            (Some(update("ann", 1)), Some(lost(0)), Some(closed()), None)
        );
    }

    #[tokio::test]
    async fn a_reader_waiting_alone_wakes_when_the_sender_goes() {
        let (tx, mut rx) = channel(64, 4096);
        let reader = tokio::spawn(async move { rx.next().await });
        tokio::task::yield_now().await;
        assert!(!reader.is_finished());
        drop(tx);
        let got = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .expect("the reader woke")
            .unwrap();
        assert_eq!(got, None);
    }

    #[test]
    fn a_dropped_reader_makes_the_sender_keep_nothing() {
        let (tx, rx) = channel(64, 4096);
        let inner = rx.inner.clone();
        drop(rx);
        tx.send(update("ann", 1));
        tx.send(lost(0));
        assert_eq!(inner.lock().order.len(), 0);
        assert!(inner.lock().presences.is_empty());
    }
}
