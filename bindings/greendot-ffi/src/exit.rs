//! Ending every call of this library into the app before its process exits.
//!
//! A Python interpreter that is finalizing ends any other thread that asks
//! for the GIL (`pthread_exit`). A thread of this library's ended that way,
//! with Rust frames under it, aborts the process ("FATAL: exception not
//! rethrown"). Two kinds of thread call into the app: a listener's thread
//! (`on_event`, and releasing the listener), and whichever thread completes
//! an async call (the runtime's worker, waking the awaiting coroutine
//! through uniffi's continuation, which releases the GIL and takes it back
//! while it schedules the coroutine). [`shutdown`], run before the
//! interpreter finalizes (Python's `atexit`), cancels every listener and
//! waits for every wake in progress; after it none starts. It also closes
//! the clients the app left open, while the runtime can still send the
//! close.

use crate::{lock, runtime, GreendotClient, GreendotError, ListenerHandle};
use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

struct Calls {
    /// `shutdown` has not been called.
    open: bool,
    /// Wakes passing into the app now.
    running: usize,
    /// Every listener started (dead ones pruned as new ones come).
    listeners: Vec<Weak<ListenerHandle>>,
    /// Every client connected (the same).
    clients: Vec<Weak<GreendotClient>>,
}

static CALLS: Mutex<Calls> = Mutex::new(Calls {
    open: true,
    running: 0,
    listeners: Vec::new(),
    clients: Vec::new(),
});
/// How long `shutdown` waits for the clients' closes to go out.
const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// Signalled when `running` drops to zero.
static ENDED: Condvar = Condvar::new();

thread_local! {
    /// This thread is passing a wake into the app: a `shutdown` called
    /// from there does not wait for itself.
    static IN_WAKE: Cell<bool> = const { Cell::new(false) };
}

/// A wake passing into the app; `shutdown` waits for it to be dropped.
struct Running;

impl Running {
    fn start() -> Option<Running> {
        let mut calls = lock(&CALLS);
        if !calls.open {
            return None;
        }
        calls.running += 1;
        IN_WAKE.with(|w| w.set(true));
        Some(Running)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        IN_WAKE.with(|w| w.set(false));
        let mut calls = lock(&CALLS);
        calls.running -= 1;
        if calls.running == 0 {
            ENDED.notify_all();
        }
    }
}

/// Passes a wake on only until `shutdown`: it runs the app's code on the
/// waking thread.
struct GatedWaker(Waker);

impl Wake for GatedWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(_running) = Running::start() {
            self.0.wake_by_ref();
        }
    }
}

/// The future `start` makes, with its wakes through [`GatedWaker`]. After
/// `shutdown` fails at once with `Closed` and starts nothing (its wake
/// would never come).
pub(crate) async fn gated<F: Future + Unpin>(
    start: impl FnOnce() -> F,
) -> Result<F::Output, GreendotError> {
    if !lock(&CALLS).open {
        return Err(GreendotError::Closed);
    }
    Ok(Gated {
        future: start(),
        waker: None,
    }
    .await)
}

struct Gated<F> {
    future: F,
    /// The gated waker of the last poll, made again only when the
    /// caller's waker changes.
    waker: Option<(Waker, Waker)>,
}

impl<F: Future + Unpin> Future for Gated<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let waker = match &this.waker {
            Some((outer, gated)) if outer.will_wake(cx.waker()) => gated.clone(),
            _ => {
                let gated = Waker::from(Arc::new(GatedWaker(cx.waker().clone())));
                this.waker = Some((cx.waker().clone(), gated.clone()));
                gated
            }
        };
        Pin::new(&mut this.future).poll(&mut Context::from_waker(&waker))
    }
}

/// Starts `handle`'s thread with `start` and keeps the handle for
/// `shutdown`; after `shutdown` starts nothing and returns false.
pub(crate) fn start_listener(
    handle: &Arc<ListenerHandle>,
    start: impl FnOnce() -> Option<JoinHandle<()>>,
) -> bool {
    let mut calls = lock(&CALLS);
    if !calls.open {
        return false;
    }
    remember(&mut calls.listeners, handle);
    // Under the lock: a `shutdown` that comes next finds the thread to
    // wait for.
    *lock(&handle.thread) = start();
    true
}

/// Keeps `client` for `shutdown`; false after it.
pub(crate) fn keep_client(client: &Arc<GreendotClient>) -> bool {
    let mut calls = lock(&CALLS);
    if !calls.open {
        return false;
    }
    remember(&mut calls.clients, client);
    true
}

/// Adds `item` to `list`, dropping the entries no longer alive.
fn remember<T>(list: &mut Vec<Weak<T>>, item: &Arc<T>) {
    list.retain(|l| l.strong_count() > 0);
    list.push(Arc::downgrade(item));
}

/// Ends every call of this library into the app, for a process about to
/// exit: cancels every listener (waiting for an `on_event` in progress to
/// return), closes every client as `close` does (the server keeps the
/// devices for their grace, instead of noticing a silent connection only
/// at its idle timeout; it waits up to 1 s for the closes to go out), and
/// waits for the async calls' completions in progress. After it no
/// listener is called, a new listener is never called, a new async call
/// fails with `Closed`, and an async call still waiting never returns.
///
/// Python must call it before the interpreter finalizes:
/// `atexit.register(greendot_ffi.shutdown)`. Safe to call twice. Called
/// from inside an `on_event` it cannot wait for the listeners' threads
/// (one of them is the caller): call it from the app's own thread.
#[uniffi::export]
pub fn shutdown() {
    let (listeners, clients) = {
        let mut calls = lock(&CALLS);
        calls.open = false;
        (
            std::mem::take(&mut calls.listeners),
            std::mem::take(&mut calls.clients),
        )
    };
    for listener in listeners.iter().filter_map(Weak::upgrade) {
        listener.cancel();
    }
    let clients: Vec<_> = clients
        .iter()
        .filter_map(Weak::upgrade)
        .map(|c| c.client.clone())
        .collect();
    if !clients.is_empty() {
        // Waited for from here, not with `block_on`: this may be a thread
        // of the runtime's (a listener's).
        let (closed, wait) = std::sync::mpsc::channel();
        runtime().spawn(async move {
            let mut closing = tokio::task::JoinSet::new();
            for client in clients {
                closing.spawn(async move { client.close().await });
            }
            while closing.join_next().await.is_some() {}
            let _ = closed.send(());
        });
        let _ = wait.recv_timeout(CLOSE_WAIT);
    }
    let own = usize::from(IN_WAKE.with(|w| w.get()));
    let mut calls = lock(&CALLS);
    while calls.running > own {
        calls = ENDED.wait(calls).unwrap_or_else(|p| p.into_inner());
    }
}
