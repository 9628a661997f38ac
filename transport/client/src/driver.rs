//! A client's connection task: drives the live connection (requests out,
//! answers and pushes in), reconnects and resumes after a loss, and ends
//! the client. [`drive`] is spawned by `Client::connect`; `read_control`
//! and `accept_pushes` read a QUIC connection's streams.

use super::*;
use crate::request::resendable;

/// An application's request, sent and waiting for its answer.
struct User {
    reply: oneshot::Sender<Result<Answer, ClientError>>,
    ticket: Ticket,
    /// The request, kept to send it again on the next connection if this
    /// one is lost (only if that is safe: `resendable`).
    request: Option<Request>,
}

impl Pending {
    fn user(reply: oneshot::Sender<Result<Answer, ClientError>>, ticket: Ticket) -> Pending {
        Pending::User(User {
            reply,
            ticket,
            request: None,
        })
    }
}

enum Pending {
    /// An application's request.
    User(User),
    /// A subscribe sent by the client itself after a reconnect.
    Resubscribe,
    /// A group subscription the client renews itself after a reconnect
    /// that did not resume.
    GroupResubscribe(u64),
    /// The `Ping` of [`Client::network_changed`].
    Probe,
    /// A refresh with a token from [`ClientConfig::refresh`].
    Refresh,
    /// A `SetForeground` of the app's lifecycle.
    Lifecycle,
}

pub(crate) enum Exit {
    /// The application closed the client (or dropped every handle).
    Closed(CloseCode),
    /// The connection ended; the error says how.
    Lost(ClientError),
}

/// The client's task: runs connections one after another.
pub(super) async fn drive(
    shared: Arc<Shared>,
    config: ClientConfig,
    mut est: Established,
    mut cmd_rx: mpsc::Receiver<Cmd>,
) {
    let mut deferred: VecDeque<Cmd> = VecDeque::new();
    let mut next_id: u64 = 0;
    // The app's state, as the connections and the reconnects saw it last.
    let mut app = shared.foreground.subscribe();
    loop {
        let server = est.server;
        let welcome = est.welcome.clone();
        for s in &welcome.snapshots {
            shared.apply(&s.target, &s.presence, Source::Snapshot);
        }
        if welcome.resumed {
            // What carried over (perhaps from another client of the device,
            // `ClientConfig::resume`) is subscribed again after a reconnect
            // that does not resume.
            let mut state = shared.state();
            for s in &welcome.snapshots {
                state.wanted.insert(s.target.clone(), s.tier.into());
            }
        }
        let exit = run(
            &shared,
            &config,
            est,
            &mut cmd_rx,
            &mut deferred,
            &mut next_id,
            &mut app,
        )
        .await;
        let error = match exit {
            Exit::Closed(code) => {
                answer_deferred(&mut deferred, &ClientError::Closed);
                finish(&shared, Some(code), "closed by the application".into());
                return;
            }
            Exit::Lost(error) => error,
        };
        let final_code = match &error {
            ClientError::Rejected { code, .. } => !may_reconnect(&config, *code),
            _ => false,
        };
        let Some(policy) = config.reconnect.filter(|_| !final_code) else {
            let code = match &error {
                ClientError::Rejected { code, .. } => *code,
                _ => None,
            };
            answer_deferred(&mut deferred, &error);
            finish(&shared, code, error.to_string());
            return;
        };
        shared.emit(Event::Disconnected {
            reason: error.to_string(),
        });
        let hint = error.retry_after();
        // Closed for quiet in the background: nothing redials until the app
        // comes back or asks for something.
        let quiet = matches!(
            error,
            ClientError::Lost(LostReason::QuietInBackground { .. })
        );
        let again = reconnect(
            &shared,
            &config,
            (policy, hint, quiet),
            (&mut cmd_rx, &mut deferred),
            &mut app,
            server,
        );
        match again.await {
            Ok(new) => {
                let resumed = new.welcome.resumed;
                let session = SessionId(new.welcome.session);
                let carrier = new.link.carrier();
                {
                    let mut state = shared.state();
                    state.session = session;
                    state.max_frame = new.welcome.max_frame.max(1024) as usize;
                    state.stats.carrier = carrier;
                    state.stats.server = new.server;
                    match carrier {
                        Carrier::Quic => state.stats.quic_connections += 1,
                        Carrier::WebSocket => state.stats.websocket_connections += 1,
                    }
                    if !resumed {
                        // A new session, perhaps on a restarted server whose
                        // versions began again: forget what the old one said,
                        // so the fresh snapshots are not dropped as stale.
                        state.view = View::new();
                        for version in state.group_versions.values_mut() {
                            *version = 0;
                        }
                    }
                }
                shared.emit(Event::Reconnected {
                    session,
                    resumed,
                    carrier,
                });
                est = new;
            }
            Err(exit) => {
                let (code, reason) = match exit {
                    Exit::Closed(code) => {
                        answer_deferred(&mut deferred, &ClientError::Closed);
                        (Some(code), "closed by the application".to_owned())
                    }
                    Exit::Lost(e) => {
                        answer_deferred(&mut deferred, &e);
                        match e {
                            ClientError::Rejected { code, error } => (code, error.to_string()),
                            e => (None, e.to_string()),
                        }
                    }
                };
                finish(&shared, code, reason);
                return;
            }
        }
    }
}

/// The client ends with `error`: requests still waiting for a connection
/// fail with it, except those already sent once, whose outcome is unknown.
fn answer_deferred(deferred: &mut VecDeque<Cmd>, error: &ClientError) {
    for cmd in deferred.drain(..) {
        if let Cmd::Request { reply, ticket, .. } = cmd {
            let error = match error {
                ClientError::Closed => ClientError::Closed,
                e if ticket.was_sent() => ClientError::OutcomeUnknown {
                    lost: Some(Box::new(e.clone())),
                },
                e => e.clone(),
            };
            let _ = reply.send(Err(error));
        }
    }
}

fn finish(shared: &Shared, code: Option<CloseCode>, reason: String) {
    shared.state().closed = true;
    shared.emit(Event::Closed { code, reason });
}

/// A command that came while reconnecting: a close ends the attempt, a
/// network change is `true` (try now), any other waits for the connection.
pub(crate) fn take_command(cmd: Option<Cmd>, deferred: &mut VecDeque<Cmd>) -> Result<bool, Exit> {
    match cmd {
        Some(Cmd::Close { code, done }) => {
            let _ = done.send(());
            Err(Exit::Closed(code))
        }
        Some(Cmd::NetworkChanged) => Ok(true),
        Some(cmd) => {
            deferred.push_back(cmd);
            Ok(false)
        }
        None => Err(Exit::Closed(CloseCode::Normal)),
    }
}

/// Tries to connect again, resuming the session: before each attempt a wait
/// drawn with full jitter, or within the `retry_ms` the server last asked for.
/// Every attempt tries QUIC first (a client that fell back to WebSocket goes
/// back to QUIC as soon as UDP works again). `quiet`: the connection was
/// closed for quiet in the background, so the first wait ignores network
/// changes.
async fn reconnect(
    shared: &Arc<Shared>,
    config: &ClientConfig,
    (policy, mut hint, mut quiet): (Reconnect, Option<Duration>, bool),
    (cmd_rx, deferred): (&mut mpsc::Receiver<Cmd>, &mut VecDeque<Cmd>),
    app: &mut tokio::sync::watch::Receiver<bool>,
    lost: SocketAddr,
) -> Result<Established, Exit> {
    let started = tokio::time::Instant::now();
    let mut backoff = Backoff::new(policy);
    loop {
        let delay = backoff.next_delay(hint.take());
        let waiting = (&mut *cmd_rx, &mut *deferred);
        let woke =
            lifecycle::wait_to_reconnect(delay, app, waiting, std::mem::take(&mut quiet)).await?;
        lifecycle::after_wake(woke, &mut backoff);
        let resume = Some(shared.state().session);
        fresh_token(shared, config).await;
        let token = shared.state().token.clone();
        let foreground = *app.borrow();
        // The address just lost is tried last: its node may be dead or
        // draining while another is up.
        let attempt = establish(
            &shared.dialer,
            config,
            &token,
            resume,
            foreground,
            Some(lost),
        );
        tokio::pin!(attempt);
        // Keep taking commands while connecting: requests wait, a close ends.
        let result = loop {
            tokio::select! {
                result = &mut attempt => break result,
                cmd = cmd_rx.recv() => {
                    take_command(cmd, deferred)?;
                }
            }
        };
        match result {
            Ok(est) => return Ok(est),
            Err(ClientError::Rejected { code, error }) if !may_reconnect(config, code) => {
                return Err(Exit::Lost(ClientError::Rejected { code, error }));
            }
            Err(e) => {
                debug!(error = %e, "reconnect attempt failed");
                hint = e.retry_after();
            }
        }
        if policy
            .give_up_after
            .is_some_and(|limit| started.elapsed() >= limit)
        {
            return Err(Exit::Lost(LostReason::GaveUp.into()));
        }
    }
}

/// Whether to reconnect after the server closed with `code`: a token that
/// expired is no end when the application gives new ones.
pub(crate) fn may_reconnect(config: &ClientConfig, code: Option<CloseCode>) -> bool {
    match code {
        Some(CloseCode::TokenExpired) => config.refresh.is_some(),
        code => code.is_some_and(|c| c.may_reconnect()),
    }
}

/// Before a reconnect: a new token from the application if the current
/// one is due for refresh (or past it). A failure keeps the old token (the
/// server's answer then says what is wrong with it).
async fn fresh_token(shared: &Shared, config: &ClientConfig) {
    let Some(refresh) = &config.refresh else {
        return;
    };
    let token = shared.state().token.clone();
    if refresh::refresh_in(&token, config.refresh_ahead).is_some_and(|d| !d.is_zero()) {
        return;
    }
    match tokio::time::timeout(config.connect_timeout, refresh.fetch()).await {
        Ok(Ok(token)) => shared.state().token = token,
        Ok(Err(e)) => debug!(error = %e, "token refresh failed before a reconnect"),
        Err(_) => debug!("token refresh took too long before a reconnect"),
    }
}

/// Reads QUIC control frames into the connection's inbound channel; the
/// last item says how the connection ended.
pub(super) async fn read_control(
    conn: quinn::Connection,
    mut recv: quinn::RecvStream,
    tx: mpsc::UnboundedSender<Inbound>,
) {
    let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
    let ended = loop {
        match read_frame(&mut recv, &mut reader).await {
            Ok(Some(payload)) => match proto::decode::<ServerFrame>(&payload) {
                Ok(frame) => {
                    if tx.send(Inbound::Frame(frame)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    conn.close(CloseCode::ProtocolError.varint(), b"bad control frame");
                    break ClientError::Protocol(ProtocolError::BadFrame {
                        carrier: Carrier::Quic,
                        error: e,
                    });
                }
            },
            // The server finished or reset the stream: it closes next.
            Ok(None) | Err(_) => break lost(&conn.closed().await),
        }
    };
    let _ = tx.send(Inbound::Ended(ended));
}

/// Accepts the server's QUIC push streams and forwards what they carry.
/// Aborting this task stops its readers too.
pub(super) async fn accept_pushes(conn: quinn::Connection, tx: mpsc::UnboundedSender<Inbound>) {
    let mut readers = tokio::task::JoinSet::new();
    while let Ok(recv) = conn.accept_uni().await {
        readers.spawn(read_pushes(recv, tx.clone()));
    }
    while readers.join_next().await.is_some() {}
}

async fn read_pushes(mut recv: quinn::RecvStream, tx: mpsc::UnboundedSender<Inbound>) {
    let mut reader = FrameReader::new(proto::MAX_SERVER_FRAME);
    let mut source = None;
    while let Ok(Some(payload)) = read_frame(&mut recv, &mut reader).await {
        match proto::decode::<Push>(&payload) {
            Ok(Push::Stream { tier }) => {
                source = Some(match tier {
                    proto::Tier::Realtime => Source::Realtime,
                    proto::Tier::Batched => Source::Batched,
                })
            }
            Ok(
                push @ (Push::GroupCount { .. }
                | Push::GroupMember { .. }
                | Push::GroupEnded { .. }
                | Push::GroupPageDelta { .. }),
            ) => {
                if let Some(item) = crate::groups::inbound(push, source) {
                    if tx.send(item).is_err() {
                        return;
                    }
                }
            }
            Ok(Push::Update { target, presence }) => {
                if let Some(source) = source {
                    let push = Inbound::Push {
                        target,
                        presence,
                        source,
                    };
                    if tx.send(push).is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                debug!(error = %e, "bad push frame");
                return;
            }
        }
    }
}

/// One connection's life, whatever its carrier: requests out, answers and
/// pushes in, until it ends.
async fn run(
    shared: &Arc<Shared>,
    config: &ClientConfig,
    est: Established,
    cmd_rx: &mut mpsc::Receiver<Cmd>,
    deferred: &mut VecDeque<Cmd>,
    next_id: &mut u64,
    app: &mut tokio::sync::watch::Receiver<bool>,
) -> Exit {
    let Established {
        mut link,
        mut inbound,
        early,
        tasks,
        welcome,
        foreground: said,
        server: _,
    } = est;
    // The app's state as the server knows it; a change since is sent.
    let mut told = said;
    // When the connection closes for quiet, the app being in the background
    // (`ClientConfig::close_in_background`): armed when the server is told
    // of the background, and again at each request of the app meanwhile.
    let quiet_after = config.close_in_background;
    let quiet_from_now = || quiet_after.map(|d| tokio::time::Instant::now() + d);
    let mut quiet_at = if said { None } else { quiet_from_now() };
    // The cap on what the client sends; what it reads is capped by MAX_SERVER_FRAME.
    let max_frame = welcome.max_frame.max(1024) as usize;
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    for item in early {
        match item {
            Inbound::Push {
                target,
                presence,
                source,
            } => shared.apply(&target, &presence, source),
            Inbound::Group(event) => shared.apply_group(event),
            _ => {}
        }
    }

    // After a reconnect that did not resume, subscribe again.
    let mut startup: VecDeque<(Request, Pending)> = VecDeque::new();
    if !welcome.resumed {
        let wanted = shared.state().wanted.clone();
        for tier in [Tier::Realtime, Tier::Batched] {
            let targets: Vec<String> = wanted
                .iter()
                .filter(|(_, t)| **t == tier)
                .map(|(name, _)| name.clone())
                .collect();
            if !targets.is_empty() {
                startup.push_back((
                    Request::Subscribe {
                        targets,
                        tier: tier.into(),
                    },
                    Pending::Resubscribe,
                ));
            }
        }
        let mut groups: Vec<u64> = shared.state().group_versions.keys().copied().collect();
        groups.sort_unstable();
        for group in groups {
            let request = Request::GroupSubscribe { group };
            startup.push_back((request, Pending::GroupResubscribe(group)));
        }
    }
    while let Some(cmd) = deferred.pop_front() {
        match cmd {
            Cmd::Request {
                request,
                reply,
                ticket,
            } => startup.push_back((request, Pending::user(reply, ticket))),
            Cmd::NetworkChanged => {}
            Cmd::Close { code, done } => {
                link.close(code, "closed by the application").await;
                let _ = done.send(());
                return Exit::Closed(code);
            }
        }
    }

    // Over WebSocket, after a network change: when the connection counts
    // as dead unless the probe is answered.
    let mut probe_deadline: Option<tokio::time::Instant> = None;
    // When to fetch a new token (with a refresh callback), the fetch in
    // flight, and the tokens of refreshes sent, by request id.
    let refresh_at = |token: &str| {
        config.refresh.as_ref()?;
        refresh::refresh_in(token, config.refresh_ahead).map(|d| tokio::time::Instant::now() + d)
    };
    let mut refresh_due = refresh_at(&shared.state().token);
    let mut fetching: Option<tokio::task::JoinHandle<Result<String, String>>> = None;
    let mut refreshes: HashMap<u64, String> = HashMap::new();
    let exit = 'conn: loop {
        // A lifecycle change goes out before the requests that follow it.
        let foreground = *app.borrow_and_update();
        if foreground != told {
            told = foreground;
            let waiter = if foreground {
                quiet_at = None;
                // Back from the background: the connection may have died
                // meanwhile; an unanswered check replaces it at once.
                if probe_deadline.is_none() {
                    probe_deadline = Some(tokio::time::Instant::now() + config.probe_timeout);
                }
                Pending::Probe
            } else {
                quiet_at = quiet_from_now();
                Pending::Lifecycle
            };
            // Before any request the application made after the change.
            startup.push_front((Request::SetForeground { foreground }, waiter));
        }
        while let Some((request, mut waiter)) = startup.pop_front() {
            if let Pending::User(user) = &mut waiter {
                // The caller gave up waiting (its deadline): a request never
                // sent must never take effect later, so it is not sent at
                // all; one sent before (on a connection since lost) is not
                // sent again either.
                if user.reply.is_closed() || !user.ticket.send() {
                    continue;
                }
                if resendable(&request) {
                    user.request = Some(request.clone());
                }
                if !told {
                    quiet_at = quiet_from_now();
                }
            }
            *next_id = next_id.wrapping_add(1);
            let id = *next_id;
            let refreshing_token = match &request {
                Request::Refresh { token } => Some(token.clone()),
                _ => None,
            };
            let bytes = match encode_frame(&RequestFrame { id, request }) {
                Ok(b) => b,
                Err(e) => {
                    if let Pending::User(user) = waiter {
                        let _ = user.reply.send(Err(ClientError::Encode(e)));
                    }
                    continue;
                }
            };
            if bytes.len() > max_frame + 4 {
                if let Pending::User(user) = waiter {
                    let _ =
                        user.reply
                            .send(Err(ClientError::Config(ConfigError::RequestTooLarge {
                                len: bytes.len() - 4,
                                max: max_frame,
                            })));
                }
                continue;
            }
            if let Some(token) = refreshing_token {
                refreshes.insert(id, token);
            }
            pending.insert(id, waiter);
            if !link.send(bytes).await {
                debug!("control write failed");
                break 'conn Exit::Lost(ended(&mut inbound).await);
            }
        }
        let probe = async {
            match probe_deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let timer_due = refresh_due.filter(|_| fetching.is_none());
        let refresh_timer = async {
            match timer_due {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let fetched = async {
            match fetching.as_mut() {
                Some(task) => task.await,
                None => std::future::pending().await,
            }
        };
        let quiet = async {
            match quiet_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = app.changed() => {}
            _ = refresh_timer => {
                if let Some(refresh) = &config.refresh {
                    fetching = Some(tokio::spawn(refresh.fetch()));
                }
            }
            result = fetched => {
                fetching = None;
                match result {
                    Ok(Ok(token)) => {
                        refresh_due = None;
                        startup.push_back((Request::Refresh { token }, Pending::Refresh));
                    }
                    failed => {
                        debug!(?failed, "token refresh failed; trying again in a second");
                        refresh_due = Some(tokio::time::Instant::now() + Duration::from_secs(1));
                    }
                }
            }
            cmd = cmd_rx.recv() => match cmd {
                Some(Cmd::Request { request, reply, ticket }) => {
                    startup.push_back((request, Pending::user(reply, ticket)));
                }
                Some(Cmd::NetworkChanged) => {
                    // Anything sent goes out on the new path; a Ping is the
                    // smallest request (and renews the lease).
                    startup.push_back((Request::Ping, Pending::Probe));
                    if link.carrier() == Carrier::WebSocket && probe_deadline.is_none() {
                        probe_deadline = Some(tokio::time::Instant::now() + config.probe_timeout);
                    }
                }
                Some(Cmd::Close { code, done }) => {
                    link.close(code, "closed by the application").await;
                    let _ = done.send(());
                    break Exit::Closed(code);
                }
                None => {
                    link.close(CloseCode::Normal, "client dropped").await;
                    break Exit::Closed(CloseCode::Normal);
                }
            },
            item = inbound.recv() => match item {
                Some(Inbound::Push { target, presence, source }) => {
                    shared.apply(&target, &presence, source);
                }
                Some(Inbound::Group(event)) => shared.apply_group(event),
                Some(Inbound::Frame(ServerFrame::Reply { id, result })) => {
                    let token = refreshes.remove(&id);
                    if let (Some(token), Ok(Answer::Refreshed { ended, .. })) = (token, &result) {
                        refresh_due = refresh_at(&token);
                        let mut state = shared.state();
                        state.token = token;
                        for target in ended {
                            state.wanted.remove(target);
                        }
                        drop(state);
                        shared.emit(Event::TokenRefreshed { ended: ended.clone() });
                    }
                    if let Ok(Answer::Subscribed { snapshots, .. }) = &result {
                        let mut state = shared.state();
                        for s in snapshots {
                            state.wanted.insert(s.target.clone(), s.tier.into());
                        }
                    }
                    if let Ok(Answer::Subscribed { snapshots, .. }) = &result {
                        for s in snapshots {
                            shared.apply(&s.target, &s.presence, Source::Snapshot);
                        }
                    }
                    if let Ok(Answer::GroupSubscribed(s)) = &result {
                        let mut state = shared.state();
                        let seen = state.group_versions.entry(s.group).or_default();
                        *seen = (*seen).max(s.version);
                    }
                    match pending.remove(&id) {
                        Some(Pending::User(user)) => {
                            let _ = user.reply.send(result.map_err(ClientError::Server));
                            if !told {
                                quiet_at = quiet_from_now();
                            }
                        }
                        Some(Pending::Probe) => probe_deadline = None,
                        Some(Pending::Refresh) => {
                            if let Err(e) = &result {
                                debug!(error = %e, "refreshed token refused; trying again in a second");
                                refresh_due = Some(tokio::time::Instant::now() + Duration::from_secs(1));
                            }
                        }
                        Some(Pending::GroupResubscribe(group)) => match &result {
                            // The count may have moved while the session was
                            // gone, and no push comes until it moves again.
                            Ok(Answer::GroupSubscribed(snapshot)) => shared.emit(Event::GroupCount {
                                group,
                                version: snapshot.version,
                                count: snapshot.count,
                                source: Source::Snapshot,
                            }),
                            // No longer a member (or the group is gone): the
                            // subscription ended, as a push would say.
                            Err(_) => shared.apply_group(Event::GroupEnded { group }),
                            Ok(_) => {}
                        },
                        Some(Pending::Resubscribe | Pending::Lifecycle) => {}
                        None => debug!(id, "reply to no request"),
                    }
                }
                Some(Inbound::Frame(ServerFrame::Error(error))) => {
                    // The server closes next; report its error with the close code.
                    break Exit::Lost(rejected_after(&mut inbound, error).await);
                }
                Some(Inbound::Frame(ServerFrame::Welcome(_))) => {
                    link.close(CloseCode::ProtocolError, "a second welcome").await;
                    break Exit::Lost(ProtocolError::SecondWelcome.into());
                }
                Some(Inbound::Ended(e)) => break Exit::Lost(e),
                None => break Exit::Lost(LostReason::Ended.into()),
            },
            _ = quiet => {
                if pending.values().any(|p| matches!(p, Pending::User(_))) {
                    // The app waits for an answer: closing now would leave
                    // its outcome unknown.
                    quiet_at = quiet_from_now();
                } else if let Some(after) = quiet_after {
                    // A plain close: the device lingers for its grace.
                    link.close(CloseCode::Normal, "quiet in the background").await;
                    break Exit::Lost(ClientError::Lost(LostReason::QuietInBackground { after }));
                }
            }
            _ = probe => {
                // The TCP connection did not survive the network change. A
                // plain close: the device lingers and the reconnect resumes.
                link.close(CloseCode::Normal, "no answer after a network change").await;
                break Exit::Lost(ClientError::Lost(LostReason::NoProbeAnswer {
                    after: config.probe_timeout,
                }));
            }
        }
    };
    drop(tasks);
    if let Some(task) = fetching {
        task.abort();
    }
    carry_over(&exit, pending, startup, deferred);
    exit
}

/// The application's requests of a connection that ended. Closed by the
/// application: they fail. Lost: those not sent yet, and those sent whose
/// repetition is safe, wait for the next connection (in the order they
/// were made, before anything asked later); the others sent have an
/// unknown outcome, except when the server's close answers them (a
/// logout).
fn carry_over(
    exit: &Exit,
    pending: HashMap<u64, Pending>,
    startup: VecDeque<(Request, Pending)>,
    deferred: &mut VecDeque<Cmd>,
) {
    let mut sent: Vec<(u64, Pending)> = pending.into_iter().collect();
    // Ids wrap only after 2^64 requests.
    sent.sort_by_key(|(id, _)| *id);
    let sent = sent.into_iter().map(|(_, waiter)| (None, waiter));
    let unsent = startup
        .into_iter()
        .map(|(request, waiter)| (Some(request), waiter));
    let mut carried = VecDeque::new();
    for (unsent, waiter) in sent.chain(unsent) {
        let Pending::User(user) = waiter else {
            continue;
        };
        let error = match exit {
            Exit::Closed(_) => ClientError::Closed,
            Exit::Lost(
                e @ ClientError::Rejected {
                    code: Some(CloseCode::Logout),
                    ..
                },
            ) => e.clone(),
            Exit::Lost(e) => match unsent.or(user.request) {
                Some(request) => {
                    carried.push_back(Cmd::Request {
                        request,
                        reply: user.reply,
                        ticket: user.ticket,
                    });
                    continue;
                }
                None => ClientError::OutcomeUnknown {
                    lost: Some(Box::new(e.clone())),
                },
            },
        };
        let _ = user.reply.send(Err(error));
    }
    while let Some(cmd) = carried.pop_back() {
        deferred.push_front(cmd);
    }
}
