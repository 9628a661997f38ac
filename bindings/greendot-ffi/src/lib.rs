//! greendot-client for Kotlin, Swift and Python, through uniffi's
//! proc-macros. The bindings are generated from the built library with the
//! workspace's `uniffi-bindgen` (bindings/uniffi-bindgen):
//!
//! ```text
//! cargo build --release -p greendot-ffi
//! cargo run --release -p greendot-uniffi-bindgen -- generate --no-format \
//!     --library target/release/libgreendot_ffi.so --language python --out-dir out
//! ```
//!
//! - [`connect`] returns a [`GreendotClient`]; its requests are `async`
//!   (Kotlin `suspend`, Swift `async`, Python `async def`) and run on one
//!   tokio runtime of this library's own (one worker thread: a phone's idle
//!   client wakes nothing of its own), whatever the caller's executor.
//! - Events reach the app through a [`PresenceListener`] it implements,
//!   called on a thread of this library's (one per listener), never on the
//!   runtime's: a slow listener delays only its own events.
//! - The lifecycle calls (`app_backgrounded`, `app_foregrounded`,
//!   `network_changed`) return at once and are safe from any thread.
//! - Errors are [`GreendotError`]; nothing panics across the FFI (uniffi
//!   turns a panic into an internal error, and a listener's exception is
//!   caught on the listener's thread).
//! - [`shutdown`] ends every call into the app before the process exits
//!   (Python's `atexit`: a finalizing interpreter ends a thread that asks
//!   for the GIL, and the process aborts if that thread is the library's).

mod exit;
mod groups;
mod types;

pub use exit::shutdown;
pub use groups::*;
pub use types::*;

use greendot_client::{
    Certificate, Client, ClientConfig, Reconnect, ServerAddr, Trust, Updates, WebSocket,
};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

uniffi::setup_scaffolding!();

/// The runtime of every client of the process: its tasks (the connection's
/// driver, timers) and every request run here.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("greendot")
            .enable_all()
            .build()
            .expect("cannot start greendot's runtime (no threads?)")
    })
}

/// Runs `future` on [`runtime`] and waits for it from any executor (the
/// join handle needs no runtime of the caller's). Its completion wakes the
/// caller only until [`shutdown`].
async fn on_runtime<T: Send + 'static>(
    future: impl Future<Output = Result<T, GreendotError>> + Send + 'static,
) -> Result<T, GreendotError> {
    match exit::gated(|| runtime().spawn(future)).await? {
        Ok(result) => result,
        Err(e) => Err(GreendotError::Internal {
            detail: format!("the request's task failed: {e}"),
        }),
    }
}

/// Reconnection waits: full jitter, doubling from `initial_backoff_ms` up
/// to `max_backoff_ms`; the client gives up after `give_up_after_ms` of
/// failed attempts (`None`: never). In the background the client does not
/// redial until the app comes to the foreground, makes a request, or (unless
/// it closed the connection itself, `close_in_background_ms`) the network
/// changes.
#[derive(Clone, Debug, uniffi::Record)]
pub struct ReconnectSettings {
    pub initial_backoff_ms: u64,
    pub max_backoff_ms: u64,
    #[uniffi(default = None)]
    pub give_up_after_ms: Option<u64>,
}

/// How to connect. Only `addresses` and `token` are required.
#[derive(Clone, Debug, uniffi::Record)]
pub struct ConnectConfig {
    /// The server: one or more `host:port` or `ip:port`, tried in this
    /// order at every connection attempt, each next one 250 ms after the
    /// one before unless one is up (a host name is resolved again each
    /// time, and every address it resolves to is tried). After a lost
    /// connection the address it was on is tried last, so the client moves
    /// to a live node when one dies or drains.
    pub addresses: Vec<String>,
    /// The app's token for this user and device, from its backend.
    pub token: String,
    /// The certificates trusted as roots, PEM (one or more `BEGIN
    /// CERTIFICATE` blocks): the server's own certificate if self-signed,
    /// or the CA that issued it. Default none: the platform's trust store
    /// (a certificate from a public CA), unless `certificate_sha256` pins.
    #[uniffi(default = None)]
    pub ca_certificates_pem: Option<String>,
    /// Pins instead: the SHA-256 (32 bytes each) of the server
    /// certificates' DER; any certificate with one of them is trusted,
    /// whatever its name or dates. Not with `ca_certificates_pem`.
    #[uniffi(default = [])]
    pub certificate_sha256: Vec<Vec<u8>>,
    /// The name in the server's certificate. Default: the host name an
    /// address came from, `localhost` for an IP address.
    #[uniffi(default = None)]
    pub server_name: Option<String>,
    /// The app is in the foreground at connect (`false`: started in the
    /// background, e.g. by a push). Default `true`.
    #[uniffi(default = true)]
    pub foreground: bool,
    /// How long after `app_backgrounded()` the client closes its
    /// connection if the app is still in the background with nothing
    /// awaiting an answer, so that nothing of it wakes the phone; the
    /// server keeps the session for the device's grace, and
    /// `app_foregrounded()` or a request reconnects at once, resuming it.
    /// 0: the connection stays up in the background. Default 10,000 (10 s).
    #[uniffi(default = 10000)]
    pub close_in_background_ms: u64,
    /// The WebSocket fallback's `ip:port`, tried when UDP is blocked.
    /// Default: the QUIC address's port over TCP.
    #[uniffi(default = None)]
    pub websocket_address: Option<String>,
    /// Default: 100 ms doubling to 5 s, giving up after 5 minutes.
    #[uniffi(default = None)]
    pub reconnect: Option<ReconnectSettings>,
    /// A request's deadline: how long it waits for its answer, through a
    /// silent path or a reconnect; past it, `OutcomeUnknown` if it was
    /// sent, `NotSent` if not. Default 10 s.
    #[uniffi(default = None)]
    pub request_timeout_ms: Option<u64>,
    /// A session to resume (`session()` of an earlier client of this
    /// device, e.g. before the app was restarted). Default none.
    #[uniffi(default = None)]
    pub resume_session: Option<u64>,
}

fn config_error(detail: impl Into<String>) -> GreendotError {
    GreendotError::Config {
        detail: detail.into(),
    }
}

fn parse_addresses(addresses: &[String]) -> Result<Vec<ServerAddr>, GreendotError> {
    if addresses.is_empty() {
        return Err(config_error("addresses is empty"));
    }
    addresses
        .iter()
        .map(|a| ServerAddr::parse(a).map_err(|e| config_error(format!("addresses: {e}"))))
        .collect()
}

fn trust(pem: Option<&str>, hashes: &[Vec<u8>]) -> Result<Trust, GreendotError> {
    match (pem, hashes) {
        (Some(_), [_, ..]) => Err(config_error(
            "ca_certificates_pem and certificate_sha256 exclude each other",
        )),
        (Some(pem), []) => Certificate::from_pem(pem.as_bytes())
            .map(Trust::Roots)
            .map_err(|e| config_error(format!("ca_certificates_pem: {e}"))),
        (None, []) => Ok(Trust::Platform),
        (None, hashes) => hashes
            .iter()
            .map(|h| {
                <[u8; 32]>::try_from(h.as_slice()).map_err(|_| {
                    config_error(format!("certificate_sha256: {} bytes, not 32", h.len()))
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Trust::CertificateHashes),
    }
}

fn client_config(config: ConnectConfig) -> Result<ClientConfig, GreendotError> {
    let servers = parse_addresses(&config.addresses)?;
    let trust = trust(
        config.ca_certificates_pem.as_deref(),
        &config.certificate_sha256,
    )?;
    let mut c = ClientConfig::new(servers[0].clone(), trust, config.token);
    c.servers = servers;
    c.server_name = config.server_name;
    c.foreground = config.foreground;
    c.close_in_background =
        Some(Duration::from_millis(config.close_in_background_ms)).filter(|d| !d.is_zero());
    if let Some(ws) = config.websocket_address {
        c.websocket = WebSocket::At(
            ws.parse()
                .map_err(|e| config_error(format!("websocket_address {ws:?}: {e}")))?,
        );
    }
    if let Some(r) = config.reconnect {
        c.reconnect = Some(Reconnect::new(
            Duration::from_millis(r.initial_backoff_ms),
            Duration::from_millis(r.max_backoff_ms),
            r.give_up_after_ms.map(Duration::from_millis),
        ));
    }
    if let Some(ms) = config.request_timeout_ms {
        c.request_timeout = Duration::from_millis(ms);
    }
    c.resume = config.resume_session.map(greendot_core::SessionId);
    Ok(c)
}

/// Connects and says hello; the client then keeps itself connected
/// (reconnecting and resuming its session) until `close` or `logout`.
#[uniffi::export]
pub async fn connect(config: ConnectConfig) -> Result<Arc<GreendotClient>, GreendotError> {
    on_runtime(async move {
        let config = client_config(config)?;
        let (client, updates) = Client::connect(config).await?;
        let client = Arc::new(GreendotClient {
            client,
            queue: Arc::new(tokio::sync::Mutex::new(Queue {
                updates,
                held: None,
            })),
            listener: Mutex::new(None),
        });
        if !exit::keep_client(&client) {
            // `shutdown` came while it connected.
            client.client.close().await;
            return Err(GreendotError::Closed);
        }
        Ok(client)
    })
    .await
}

/// What the app implements to hear of presence changes and of the
/// connection. Called on a thread of the library's, one event at a time,
/// in order; return quickly (hand the event to the app's main thread).
///
/// An exception it raises is reported (on stderr) and delivery goes on
/// with the next event.
#[uniffi::export(foreign)]
pub trait PresenceListener: Send + Sync {
    fn on_event(&self, event: ClientEvent) -> Result<(), ListenerError>;
}

/// What a listener's exception becomes on the Rust side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, uniffi::Error)]
pub enum ListenerError {
    #[error("the listener failed: {detail}")]
    Failed { detail: String },
}

// Any exception of the app's, not only a ListenerError, arrives as one
// (rather than as a panic in the listener's thread).
impl From<uniffi::UnexpectedUniFFICallbackError> for ListenerError {
    fn from(e: uniffi::UnexpectedUniFFICallbackError) -> ListenerError {
        ListenerError::Failed { detail: e.reason }
    }
}

/// A connected client. Requests are async; the lifecycle calls return at
/// once.
#[derive(uniffi::Object)]
pub struct GreendotClient {
    client: Client,
    /// The client's events; one listener's thread at a time reads them.
    queue: Arc<tokio::sync::Mutex<Queue>>,
    /// The listener now.
    listener: Mutex<Option<Arc<ListenerHandle>>>,
}

struct Queue {
    updates: Updates,
    /// An event taken from `updates` by a listener cancelled before it
    /// could deliver it: the next listener's first.
    held: Option<greendot_client::Event>,
}

/// A listener's loop: until it is cancelled or the client is closed.
async fn deliver(
    queue: Arc<tokio::sync::Mutex<Queue>>,
    handle: Arc<ListenerHandle>,
    listener: Arc<dyn PresenceListener>,
) {
    // Waits for the listener it replaced to let go.
    let mut queue = queue.lock().await;
    loop {
        let event = match queue.held.take() {
            Some(event) => event,
            None => {
                tokio::select! {
                    biased;
                    _ = handle.stop.notified() => return,
                    // Cancel-safe: an event not taken stays queued.
                    event = queue.updates.next() => match event {
                        Some(event) => event,
                        None => return,
                    },
                }
            }
        };
        if handle.cancelled.load(Ordering::Acquire) {
            queue.held = Some(event);
            return;
        }
        let last = matches!(event, greendot_client::Event::Closed { .. });
        // An event this binding does not know yet (a newer client) is skipped.
        let Some(event) = client_event(event) else {
            continue;
        };
        // The app's exception (or a panic) must not end the delivery.
        IN_LISTENER.with(|l| l.set(true));
        let delivered =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| listener.on_event(event)));
        IN_LISTENER.with(|l| l.set(false));
        match delivered {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn(&format!("a PresenceListener's on_event: {e}")),
            Err(_) => warn("a PresenceListener's on_event panicked"),
        }
        if last {
            return;
        }
    }
}

impl GreendotClient {
    fn client(&self) -> Client {
        self.client.clone()
    }
}

#[uniffi::export]
impl GreendotClient {
    /// Delivers the client's events to `listener`, from the first one not
    /// yet delivered (events that came before any listener are kept, as
    /// the client bounds them). One listener at a time: this one replaces
    /// the last (cancelled). Dropping the handle does not stop it; `cancel`
    /// or closing the client does.
    pub fn listen(&self, listener: Arc<dyn PresenceListener>) -> Arc<ListenerHandle> {
        let handle = Arc::new(ListenerHandle {
            cancelled: AtomicBool::new(false),
            stop: tokio::sync::Notify::new(),
            thread: Mutex::new(None),
        });
        if let Some(last) = lock(&self.listener).replace(handle.clone()) {
            last.cancel();
        }
        let queue = self.queue.clone();
        let this = handle.clone();
        // A thread of its own: the listener's code never stalls the runtime.
        let started = exit::start_listener(&handle, || {
            std::thread::Builder::new()
                .name("greendot-listener".into())
                .spawn(move || runtime().block_on(deliver(queue, this, listener)))
                .map_err(|e| warn(&format!("cannot start a listener's thread: {e}")))
                .ok()
        });
        if !started {
            handle.cancelled.store(true, Ordering::Release);
            warn("listen after shutdown: the listener is never called");
        }
        handle
    }

    /// Watches `targets` in `tier`: their presence now (also delivered as
    /// `PresenceChanged` snapshots), then changes as events. Kept across
    /// reconnects.
    pub async fn subscribe(
        &self,
        targets: Vec<String>,
        tier: Tier,
    ) -> Result<Subscribed, GreendotError> {
        let client = self.client();
        on_runtime(async move {
            Ok(client
                .subscribe(&targets, tier.into())
                .await
                .map(Subscribed::from)?)
        })
        .await
    }

    pub async fn unsubscribe(&self, target: String) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.unsubscribe(&target).await?) }).await
    }

    /// What this session may see of `target` now, asked of the server.
    pub async fn query(&self, target: String) -> Result<Presence, GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.query(&target).await?.into()) }).await
    }

    /// The user's status and message. Idempotent: after a `Timeout`, call
    /// it again with the same values.
    pub async fn set_status(
        &self,
        status: Status,
        message: Option<String>,
    ) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.set_status(status.into(), message.as_deref()).await?) })
            .await
    }

    /// Appear offline to everybody else (or stop). Idempotent.
    pub async fn set_invisible(&self, invisible: bool) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.set_invisible(invisible).await?) }).await
    }

    /// Service tokens only (a backend): the devices of `user` with their
    /// app in the foreground. Empty: send a push notification instead.
    pub async fn route(&self, user: String) -> Result<Vec<RouteEntry>, GreendotError> {
        let client = self.client();
        on_runtime(async move {
            Ok(client
                .route(&user)
                .await?
                .into_iter()
                .map(RouteEntry::from)
                .collect())
        })
        .await
    }

    /// A round trip. Requests are answered in order, so once it returns,
    /// the server has taken every earlier call (a lifecycle change too).
    pub async fn ping(&self) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.ping().await?) }).await
    }

    /// Sends a new token on the live connection (and uses it for later
    /// hellos); returns the subscriptions it no longer allows, which ended.
    pub async fn refresh(&self, token: String) -> Result<Vec<String>, GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.refresh(&token).await?) }).await
    }

    /// Logs out: the device is offline at once, and the client is closed.
    pub async fn logout(&self) -> Result<(), GreendotError> {
        let client = self.client();
        on_runtime(async move { Ok(client.logout().await?) }).await
    }

    /// Closes without logging out: the device lingers for its grace
    /// period (an app going away that may come back).
    pub async fn close(&self) {
        let client = self.client();
        let _ = on_runtime(async move {
            client.close().await;
            Ok(())
        })
        .await;
    }

    /// The app went to the background (Android `ON_STOP`, iOS
    /// `scenePhase == .background`): the user is shown offline once no
    /// device of theirs is in the foreground, after the debounce, last seen
    /// now; `route` no longer lists this device. The client goes quiet and
    /// closes its connection after `close_in_background_ms` unless the app
    /// returns first.
    pub fn app_backgrounded(&self) {
        self.client.app_backgrounded();
    }

    /// The app came back to the foreground: online again (a toggle shorter
    /// than the debounce shows nothing), and a dead connection is replaced
    /// at once, resuming the session, with the backoff reset.
    pub fn app_foregrounded(&self) {
        self.client.app_foregrounded();
    }

    /// Whether the app is in the foreground, as last told.
    pub fn is_foreground(&self) -> bool {
        self.client.is_foreground()
    }

    /// The device's network changed (Wi-Fi to cellular, a VPN): call it
    /// from the platform's network callback. The client shows itself on the
    /// new path at once, or reconnects at once, with the backoff reset, if
    /// the connection did not survive.
    pub fn network_changed(&self) {
        // The client's command queue needs no runtime of the caller's.
        self.client.network_changed();
    }

    /// The current session (it changes when a reconnect could not resume).
    pub fn session(&self) -> u64 {
        self.client.session().0
    }

    pub fn user(&self) -> String {
        self.client.user()
    }

    pub fn device(&self) -> String {
        self.client.device()
    }

    /// What the client knows of `target` (a subscribed user), locally.
    pub fn presence(&self, target: String) -> Option<Presence> {
        self.client.presence(&target).map(Presence::from)
    }

    /// What the connection runs on now.
    pub fn carrier(&self) -> Carrier {
        self.client.carrier().into()
    }

    /// Whether the client is finished.
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }
}

/// A registered listener; `cancel` stops it.
#[derive(uniffi::Object)]
pub struct ListenerHandle {
    cancelled: AtomicBool,
    stop: tokio::sync::Notify,
    /// The thread that calls the listener: `cancel` waits for it to end,
    /// which is also when it lets go of the listener object.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

thread_local! {
    /// This thread is in a listener's `on_event`: a `cancel` made there
    /// must not wait for a listener to return.
    static IN_LISTENER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[uniffi::export]
impl ListenerHandle {
    /// No `on_event` starts after this returns, none is running, and the
    /// library holds the listener no more: it waits for the listener's
    /// thread to end, so for an `on_event` in progress to return (called
    /// from inside an `on_event`, it returns at once instead). Safe to call
    /// twice. A process about to exit calls [`shutdown`] instead, which
    /// cancels every listener.
    pub fn cancel(&self) {
        if !self.cancelled.swap(true, Ordering::AcqRel) {
            // A permit if the loop is not waiting yet: it will not miss it.
            self.stop.notify_one();
        }
        if !IN_LISTENER.with(|l| l.get()) {
            if let Some(thread) = lock(&self.thread).take() {
                let _ = thread.join();
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn warn(message: &str) {
    eprintln!("greendot: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use greendot_client::ClientError;
    use greendot_proto::{ErrorCode, WireError};

    #[test]
    fn addresses_are_names_or_ips_and_at_least_one() {
        let parsed = parse_addresses(&[
            "presence.example.com:4433".into(),
            "127.0.0.1:4433".into(),
            "[::1]:4433".into(),
        ])
        .unwrap();
        assert_eq!(
            parsed[0],
            ServerAddr::parse("presence.example.com:4433").unwrap()
        );
        assert!(
            matches!(parsed[0], ServerAddr::Host { ref name, port: 4433 } if name == "presence.example.com")
        );
        assert!(matches!(parsed[1], ServerAddr::Ip(a) if a.port() == 4433));
        assert!(matches!(parsed[2], ServerAddr::Ip(a) if a.is_ipv6()));
        for bad in [vec![], vec!["no port".to_owned()], vec!["a b:1".to_owned()]] {
            assert!(
                matches!(parse_addresses(&bad), Err(GreendotError::Config { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn trust_is_roots_pins_or_the_platform() {
        assert_eq!(trust(None, &[]).unwrap(), Trust::Platform);
        assert_eq!(
            trust(None, &[vec![7; 32]]).unwrap(),
            Trust::CertificateHashes(vec![[7; 32]])
        );
        assert!(matches!(
            trust(None, &[vec![7; 31]]),
            Err(GreendotError::Config { .. })
        ));
        assert!(matches!(
            trust(Some("x"), &[vec![7; 32]]),
            Err(GreendotError::Config { .. })
        ));
    }

    #[test]
    fn roots_without_a_certificate_are_refused() {
        for pem in [
            "",
            "not a PEM",
            "-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n",
        ] {
            assert!(
                matches!(trust(Some(pem), &[]), Err(GreendotError::Config { .. })),
                "{pem:?}"
            );
        }
    }

    #[test]
    fn a_page_delta_reaches_the_app_as_page_entries() {
        let busy = greendot_core::Presence {
            version: 7,
            online: true,
            status: greendot_core::Status::Busy,
            message: Some("in a meeting".into()),
            ..Default::default()
        };
        let event = client_event(greendot_client::Event::GroupPageDelta {
            group: 42,
            entries: vec![("lu".into(), busy.clone())],
        });
        assert_eq!(
            event,
            Some(ClientEvent::GroupPageDelta {
                group: 42,
                entries: vec![GroupMemberEntry {
                    user: "lu".into(),
                    presence: busy.into(),
                }],
            })
        );
    }

    #[test]
    fn client_errors_keep_their_kind_and_code() {
        assert!(matches!(
            GreendotError::from(ClientError::OutcomeUnknown { lost: None }),
            GreendotError::OutcomeUnknown { .. }
        ));
        assert!(matches!(
            GreendotError::from(ClientError::NotSent),
            GreendotError::NotSent { .. }
        ));
        assert_eq!(
            GreendotError::from(ClientError::Closed),
            GreendotError::Closed
        );
        let refused = ClientError::Server(WireError::new(ErrorCode::NotAllowed, "no"));
        match GreendotError::from(refused) {
            GreendotError::Server { code, detail } => {
                assert_eq!(code, "NotAllowed");
                assert!(detail.contains("no"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }
}
