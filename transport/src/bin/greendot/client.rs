//! `greendot connect`, `watch` and `query`: the client library on a terminal.

use crate::ClientArgs;
use greendot_client::{Certificate, Client, ClientConfig, Event, Reconnect, ServerAddr, Updates};
use greendot_core::{Presence, Status};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Connects as the token's device.
pub async fn connect(args: &ClientArgs) -> Result<(Client, Updates), String> {
    let server = ServerAddr::parse(&args.server)
        .map_err(|e| format!("bad --server {}: {e}", args.server))?;
    let roots = trusted_roots(args.ca.as_deref(), &args.data_dir)?;
    let roots = roots
        .iter()
        .map(|c| Certificate::from_der(c.to_vec()))
        .collect::<Vec<_>>();
    let mut config = ClientConfig::new(server, roots, args.token.trim());
    config.server_name = args.server_name.clone();
    config.connect_timeout = Duration::from_secs(3);
    config.reconnect = Some(Reconnect::new(
        Duration::from_millis(100),
        Duration::from_secs(2),
        None,
    ));
    Client::connect(config).await.map_err(|e| e.to_string())
}

/// The certificate to trust: `--ca`, or the server's in its data directory.
fn trusted_roots(
    ca: Option<&Path>,
    data_dir: &Path,
) -> Result<Vec<CertificateDer<'static>>, String> {
    let ca = ca.map_or_else(|| data_dir.join(crate::CERT_FILE), Path::to_path_buf);
    CertificateDer::pem_file_iter(&ca)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            format!(
                "cannot read the server's certificate {} ({e}); start `greendot serve` here first or pass --ca",
                ca.display()
            )
        })
}

/// Unix milliseconds as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        ms % 1000
    )
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn kinds(p: &Presence) -> Vec<&'static str> {
    p.kinds.iter().map(|k| k.name()).collect()
}

/// One line about `user`: text or JSON.
pub fn line(user: &str, p: &Presence, json: bool) -> String {
    if json {
        return json_line(user, p).to_string();
    }
    let time = utc(now_ms());
    let mut text = format!("{time} {user} ");
    if p.online {
        text.push_str("online");
        if p.status != Status::Available || p.message.is_some() {
            text.push(' ');
            text.push_str(p.status.name());
        }
        if let Some(m) = &p.message {
            text.push_str(&format!(" {m:?}"));
        }
        let k = kinds(p);
        if !k.is_empty() {
            text.push_str(&format!(" on {}", k.join(",")));
        }
    } else {
        text.push_str("offline");
        match p.last_seen {
            Some(at) => text.push_str(&format!(", last seen {}", utc(at.0))),
            None => text.push_str(", never seen"),
        }
    }
    if p.invisible {
        text.push_str(" (invisible to others)");
    }
    text
}

pub fn say(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

fn status_of(name: &str) -> Result<Status, String> {
    Status::ALL
        .into_iter()
        .find(|s| s.name() == name || (name == "dnd" && *s == Status::DoNotDisturb))
        .ok_or_else(|| format!("unknown status `{name}` (available, away, busy, do-not-disturb)"))
}

pub fn connection_event(event: &Event) -> Option<String> {
    match event {
        Event::Disconnected { reason } => Some(format!("connection lost ({reason}); reconnecting")),
        Event::Reconnected { resumed, .. } => Some(if *resumed {
            "reconnected; session resumed".into()
        } else {
            "reconnected with a new session".into()
        }),
        Event::Closed { reason, .. } => Some(format!("closed: {reason}")),
        Event::TokenRefreshed { ended } if ended.is_empty() => Some("token refreshed".into()),
        Event::TokenRefreshed { ended } => Some(format!(
            "token refreshed; no longer allowed to watch {}",
            ended.join(", ")
        )),
        // Presence, and whatever the client adds later.
        _ => None,
    }
}

/// `line` in JSON, as a value to add to.
pub fn json_line(user: &str, p: &Presence) -> serde_json::Value {
    serde_json::json!({
        "time": utc(now_ms()),
        "user": user,
        "online": p.online,
        "status": p.status.name(),
        "message": p.message.as_deref(),
        "devices": kinds(p),
        "last_seen": p.last_seen.map(|m| utc(m.0)),
        "last_seen_ms": p.last_seen.map(|m| m.0),
        "invisible": p.invisible,
        "version": p.version,
    })
}

/// `greendot connect`: online until Ctrl-C or SIGTERM.
pub async fn run_connect(
    args: &ClientArgs,
    status: Option<String>,
    message: Option<String>,
    invisible: bool,
    no_logout: bool,
) -> Result<(), String> {
    let status = status.as_deref().map(status_of).transpose()?;
    let (client, mut updates) = connect(args).await?;
    if invisible {
        client
            .set_invisible(true)
            .await
            .map_err(|e| format!("cannot go invisible: {e}"))?;
    }
    if status.is_some() || message.is_some() {
        client
            .set_status(status.unwrap_or_default(), message.as_deref())
            .await
            .map_err(|e| format!("cannot set the status: {e}"))?;
    }
    say(&format!(
        "online as {}/{}{}; Ctrl-C to {}",
        client.user(),
        client.device(),
        if invisible { " (invisible)" } else { "" },
        if no_logout {
            "leave without logging out"
        } else {
            "log out"
        }
    ));
    until_signal(&client, &mut updates, |_| Ok(())).await?;
    if no_logout {
        client.close().await;
        say("left without logging out: the device lingers for its grace");
    } else {
        client
            .logout()
            .await
            .map_err(|e| format!("logout failed: {e}"))?;
        say("logged out");
    }
    Ok(())
}

/// `greendot watch`: one line per change until Ctrl-C.
pub async fn run_watch(
    args: &ClientArgs,
    users: Vec<String>,
    json: bool,
    batched: bool,
) -> Result<(), String> {
    if users.is_empty() {
        return Err("name at least one user to watch".into());
    }
    let (client, mut updates) = connect(args).await?;
    let tier = if batched {
        greendot_core::Tier::Batched
    } else {
        greendot_core::Tier::Realtime
    };
    let answer = client
        .subscribe(&users, tier)
        .await
        .map_err(|e| format!("cannot subscribe: {e}"))?;
    for refused in &answer.refused {
        eprintln!("cannot watch {}: {}", refused.target, refused.error);
    }
    if answer.snapshots.is_empty() {
        client.logout().await.ok();
        return Err("nobody to watch".into());
    }
    // Print a user only when what is shown of them changed.
    let mut printed: HashMap<String, Presence> = HashMap::new();
    let mut show = |target: &str, p: &Presence| {
        if printed.get(target).is_some_and(|old| old.same_view(p)) {
            return;
        }
        printed.insert(target.to_owned(), p.clone());
        say(&line(target, p, json));
    };
    for (target, _, p) in &answer.snapshots {
        if let Some(latest) = client.presence(target) {
            show(target, &latest);
        } else {
            show(target, p);
        }
    }
    until_signal(&client, &mut updates, |event| {
        if let Event::Presence {
            target, presence, ..
        } = event
        {
            show(target, presence);
        }
        Ok(())
    })
    .await?;
    let _ = client.logout().await;
    Ok(())
}

/// Hands every event to `handle` until Ctrl-C or SIGTERM. Connection events
/// are told on stderr. The client closing ends it with an error, and so
/// does `handle` saying why to stop (the client is then closed: the device
/// lingers for its grace).
pub async fn until_signal(
    client: &Client,
    updates: &mut Updates,
    mut handle: impl FnMut(&Event) -> Result<(), String>,
) -> Result<(), String> {
    loop {
        tokio::select! {
            event = updates.next() => {
                let Some(event) = event else {
                    return Err("the client stopped".into());
                };
                if let Event::Closed { reason, .. } = &event {
                    return Err(format!("closed: {reason}"));
                }
                if let Some(text) = connection_event(&event) {
                    eprintln!("{text}");
                }
                if let Err(e) = handle(&event) {
                    client.close().await;
                    return Err(e);
                }
            }
            _ = crate::serve::wait_for_signal() => return Ok(()),
        }
    }
}

/// `greendot query`: answers once, then logs out.
pub async fn run_query(args: &ClientArgs, users: Vec<String>, json: bool) -> Result<(), String> {
    if users.is_empty() {
        return Err("name at least one user".into());
    }
    let (client, _updates) = connect(args).await?;
    let mut failed = false;
    for user in &users {
        match client.query(user).await {
            Ok(p) => say(&line(user, &p, json)),
            Err(e) => {
                failed = true;
                eprintln!("{user}: {e}");
            }
        }
    }
    let _ = client.logout().await;
    if failed {
        Err("some queries failed".into())
    } else {
        Ok(())
    }
}

/// `greendot revoke`: one revocation with a service token; says how many
/// live sessions it closed.
pub async fn run_revoke(
    args: &ClientArgs,
    user: &str,
    device: Option<&str>,
    before: Option<u64>,
) -> Result<(), String> {
    let before = before.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    });
    let (client, _updates) = connect(args).await?;
    let result = client.revoke(user, device, before).await;
    client.close().await;
    let closed = result.map_err(|e| format!("revoke: {e}"))?;
    say(&format!(
        "revoked the tokens of {user}{} issued before {before}; {closed} live session(s) closed",
        device.map(|d| format!(" on {d}")).unwrap_or_default()
    ));
    Ok(())
}

/// `greendot bench`: the load generator against a running server.
pub async fn run_bench(args: crate::BenchArgs) -> Result<(), String> {
    use greendot_loadgen::{run, LoadOptions, LoadReport};
    let roots = trusted_roots(args.ca.as_deref(), &args.data_dir)?;
    let secret = crate::read_secret(&args.data_dir.join(crate::SECRET_FILE))?;
    let mut opts = LoadOptions::new(args.server, roots, secret, args.connections);
    opts.contacts = args.contacts;
    opts.churn = args.churn;
    opts.duration = args.duration.0;
    opts.endpoints = args.endpoints.max(1);
    opts.server_pid = args.server_pid;
    opts.progress = true;
    let report = run(opts).await;
    println!("{}", LoadReport::header());
    println!("{report}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_unix_ms() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(utc(1_700_000_000_000), "2023-11-14T22:13:20.000Z");
    }
}
