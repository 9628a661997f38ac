//! `greendot group`: write a group from files, watch its count, read its
//! member list and watch a page of it (docs/groups.md).

use crate::client::{connect, connection_event, json_line, line, say, until_signal};
use crate::ClientArgs;
use greendot_client::{Client, ClientError, Event, GroupChange, GroupCursor, GroupPage, GroupRole};
use greendot_core::Presence;
use greendot_proto::ErrorCode;
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

/// A cursor as the command line shows it and takes it back: `on:N` or
/// `off:N` (the section of the page's last entry, and its place).
pub fn cursor_text(cursor: &GroupCursor) -> String {
    let section = if cursor.online { "on" } else { "off" };
    format!("{section}:{}", cursor.after)
}

pub fn parse_cursor(text: &str) -> Result<GroupCursor, String> {
    let bad =
        || format!("bad cursor `{text}`: pass back the `next:` a page printed (on:N or off:N)");
    let (section, after) = text.split_once(':').ok_or_else(bad)?;
    let online = match section {
        "on" => true,
        "off" => false,
        _ => return Err(bad()),
    };
    let after = after.parse().map_err(|_| bad())?;
    Ok(GroupCursor { online, after })
}

/// User ids from a file, one per line; blank lines and lines starting with
/// `#` are skipped, and surrounding spaces trimmed.
pub fn read_users(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(users_in(&text))
}

fn users_in(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// `greendot group set`: writes the group whole (a service token).
pub async fn run_set(
    args: &ClientArgs,
    group: u64,
    members: &Path,
    admins: Option<&Path>,
) -> Result<(), String> {
    let members = read_users(members)?;
    let admins = admins.map(read_users).transpose()?.unwrap_or_default();
    let (client, _updates) = connect(args).await?;
    let max_frame = client.max_frame();
    let result = client.set_group_in_parts(group, &members, &admins).await;
    client.close().await;
    let written = result.map_err(|e| match &e {
        ClientError::Server(w) if w.code == ErrorCode::VersionMismatch => format!(
            "cannot set group {group}: another writer changed it while it was written in \
             parts ({e}); it holds part of the list: run again"
        ),
        _ => format!("cannot set group {group}: {e}"),
    })?;
    let mut said = format!(
        "group {group}: version {}, {} members listed, {} admins",
        written.version,
        members.len(),
        admins.len()
    );
    if written.requests > 1 {
        // Why the version is not 1 for a new group, and why it took long.
        said.push_str(&format!(
            " (written in {} requests: the list is larger than the server's frame cap of \
             {max_frame} bytes, so the first part was set and the rest added in parts, \
             each expecting the version before it)",
            written.requests
        ));
    }
    say(&said);
    Ok(())
}

/// `greendot group remove` (a service token).
/// `greendot group change`: one `ChangeGroup`; prints the new version.
pub async fn run_change(args: &ClientArgs, group: u64, change: GroupChange) -> Result<(), String> {
    if change.add.is_empty()
        && change.remove.is_empty()
        && change.add_admins.is_empty()
        && change.remove_admins.is_empty()
    {
        return Err(
            "nothing to change: give --add, --remove, --add-admin or --remove-admin".into(),
        );
    }
    let (client, _updates) = connect(args).await?;
    let result = client.change_group(group, change).await;
    client.close().await;
    let version = result.map_err(|e| match &e {
        ClientError::Server(w) if w.code == ErrorCode::VersionMismatch => format!(
            "cannot change group {group}: it is not at the expected version ({e}); read it \
             again and decide"
        ),
        _ => format!("cannot change group {group}: {e}"),
    })?;
    say(&format!("group {group}: version {version}"));
    Ok(())
}

pub async fn run_remove(args: &ClientArgs, group: u64) -> Result<(), String> {
    let (client, _updates) = connect(args).await?;
    let result = client.remove_group(group).await;
    client.close().await;
    result.map_err(|e| format!("cannot remove group {group}: {e}"))?;
    say(&format!("group {group}: removed"));
    Ok(())
}

/// `greendot group page`: one page, or every page with `all`; prints each
/// member as `query` does, then `next: CURSOR` (JSON: `{"next": CURSOR}`)
/// when there is more.
pub async fn run_page(
    args: &ClientArgs,
    group: u64,
    after: Option<GroupCursor>,
    limit: u32,
    all: bool,
    json: bool,
) -> Result<(), String> {
    let (client, _updates) = connect(args).await?;
    let mut after = after;
    let result = loop {
        let page = match client.group_page(group, after, limit).await {
            Ok(page) => page,
            Err(e) => break Err(format!("cannot read group {group}'s members: {e}")),
        };
        match page.next {
            Some(next) if all => {
                for (user, presence) in &page.entries {
                    say(&line(user, presence, json));
                }
                after = Some(next);
            }
            _ => {
                print_page(&page, json);
                break Ok(());
            }
        }
    };
    client.close().await;
    result
}

/// A page's members as `query` prints them, then `next: CURSOR` (JSON:
/// `{"next": CURSOR}`) or, on the last page, the count (text only).
fn print_page(page: &GroupPage, json: bool) {
    for (user, presence) in &page.entries {
        say(&line(user, presence, json));
    }
    match &page.next {
        Some(next) if json => say(&serde_json::json!({ "next": cursor_text(next) }).to_string()),
        Some(next) => say(&format!("next: {}", cursor_text(next))),
        None if json => {}
        None => say(&format!(
            "group {}: {} shown online, version {}",
            page.group, page.count, page.version
        )),
    }
}

/// `greendot group page --watch`: prints the page as `group page` does,
/// then a line for each change of a member it lists (JSON: with `group`),
/// renewing the watch every `renew_every`, until Ctrl-C (which logs out)
/// or the user leaves the group or it is removed.
///
/// The watch ends with the session, so after a reconnect it watches again;
/// a renewal that finds it gone (run out while the machine slept) does the
/// same. Each re-read prints the members whose view moved meanwhile. It
/// also subscribes to the group, for the `GroupEnded` that says at once
/// that the watch is over (a watch ends silently).
pub async fn run_watch_page(
    args: &ClientArgs,
    group: u64,
    after: Option<GroupCursor>,
    limit: u32,
    renew_every: Duration,
    json: bool,
) -> Result<(), String> {
    if renew_every.is_zero() {
        return Err("--renew-every must be more than 0".into());
    }
    let (client, mut updates) = connect(args).await?;
    let result = watch_page(
        &client,
        &mut updates,
        group,
        after,
        limit,
        renew_every,
        json,
    )
    .await;
    match &result {
        Ok(()) => {
            let _ = client.logout().await;
        }
        Err(_) => client.close().await,
    }
    result
}

async fn watch_page(
    client: &Client,
    updates: &mut greendot_client::Updates,
    group: u64,
    after: Option<GroupCursor>,
    limit: u32,
    renew_every: Duration,
    json: bool,
) -> Result<(), String> {
    client
        .group_subscribe(group)
        .await
        .map_err(|e| format!("cannot subscribe to group {group}: {e}"))?;
    let page = client
        .group_watch_page(group, after, limit)
        .await
        .map_err(|e| format!("cannot watch group {group}'s members: {e}"))?;
    print_page(&page, json);
    let mut shown = Shown::default();
    for (user, presence) in &page.entries {
        shown.newer(user, presence);
    }
    eprintln!(
        "group {group}: watching this page, renewed every {}; each change follows (Ctrl-C to stop)",
        crate::settings::Dur(renew_every)
    );
    let mut renew =
        tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
    renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            event = updates.next() => {
                let Some(event) = event else {
                    return Err("the client stopped".into());
                };
                if let Some(text) = connection_event(&event) {
                    eprintln!("{text}");
                }
                match event {
                    Event::Closed { reason, .. } => return Err(format!("closed: {reason}")),
                    Event::GroupPageDelta { group: g, entries } if g == group => {
                        for (user, presence) in &entries {
                            if shown.newer(user, presence) {
                                say(&delta_line(group, user, presence, json));
                            }
                        }
                    }
                    Event::GroupEnded { group: g } if g == group => return Err(ended(group)),
                    // The watch ended with the old session.
                    Event::Reconnected { .. } => rewatch(client, group, after, limit, &mut shown, json).await?,
                    _ => {}
                }
            }
            _ = renew.tick() => match client.group_renew_watch(group, after).await {
                Ok(()) => tracing::info!(group, "renewed the watch of the page"),
                Err(e) if e.code() == Some(ErrorCode::NotSubscribed) => {
                    eprintln!("group {group}: the watch had run out; watching the page again");
                    rewatch(client, group, after, limit, &mut shown, json).await?;
                }
                Err(ClientError::Closed) => return Err("the client closed".into()),
                // A renewal lost to a reconnect: the next one, or the
                // re-watch at `Reconnected`, takes over.
                Err(e) => eprintln!("group {group}: cannot renew the watch ({e}); trying again"),
            },
            _ = crate::serve::wait_for_signal() => return Ok(()),
        }
    }
}

/// Watches the page again (re-reading it) and prints the members whose
/// view moved since they were last printed. Fails only when the user is no
/// longer a member; another failure (a reconnect under way, the page
/// budget) is told, and the next renewal, finding no watch, tries again.
async fn rewatch(
    client: &Client,
    group: u64,
    after: Option<GroupCursor>,
    limit: u32,
    shown: &mut Shown,
    json: bool,
) -> Result<(), String> {
    match client.group_watch_page(group, after, limit).await {
        Ok(page) => {
            for (user, presence) in &page.entries {
                if shown.newer(user, presence) {
                    say(&delta_line(group, user, presence, json));
                }
            }
            Ok(())
        }
        Err(e) if e.code() == Some(ErrorCode::NotMember) => Err(ended(group)),
        Err(e) => {
            eprintln!(
                "group {group}: cannot watch the page again ({e}); trying at the next renewal"
            );
            Ok(())
        }
    }
}

fn ended(group: u64) -> String {
    format!("group {group}: the watch ended (no longer a member, or the group was removed)")
}

/// The highest presence version printed per member: a view read again
/// after a reconnect may be one already printed.
#[derive(Default)]
struct Shown(HashMap<String, u64>);

impl Shown {
    /// Whether `presence` is newer than what was printed of `user`; if so
    /// it is noted.
    fn newer(&mut self, user: &str, presence: &Presence) -> bool {
        match self.0.get_mut(user) {
            Some(v) if *v >= presence.version => false,
            Some(v) => {
                *v = presence.version;
                true
            }
            None => {
                self.0.insert(user.to_owned(), presence.version);
                true
            }
        }
    }
}

/// A member's change: the line `query` prints (JSON: with the group).
fn delta_line(group: u64, user: &str, presence: &Presence, json: bool) -> String {
    if !json {
        return line(user, presence, false);
    }
    let mut value = json_line(user, presence);
    value["group"] = group.into();
    value.to_string()
}

/// `greendot group watch`: subscribes as a member (or admin) and prints
/// the count when it changes, and each member's change to an admin.
pub async fn run_watch(args: &ClientArgs, group: u64, json: bool) -> Result<(), String> {
    let (client, mut updates) = connect(args).await?;
    let snapshot = client
        .group_subscribe(group)
        .await
        .map_err(|e| format!("cannot subscribe to group {group}: {e}"))?;
    let role = match snapshot.role {
        GroupRole::Admin => "admin",
        GroupRole::Member => "member",
    };
    say(&count_line(
        group,
        snapshot.count,
        Some(snapshot.members),
        Some(role),
        json,
    ));
    let mut shown = snapshot.count;
    until_signal(&client, &mut updates, |event| {
        match event {
            Event::GroupCount {
                group: g, count, ..
            } if *g == group && *count != shown => {
                shown = *count;
                say(&count_line(group, *count, None, None, json));
            }
            Event::GroupMember {
                group: g,
                member,
                online,
                count,
                ..
            } if *g == group => {
                shown = *count;
                say(&member_line(group, member, *online, *count, json));
            }
            Event::GroupEnded { group: g } if *g == group => {
                return Err(format!(
                    "group {group}: the subscription ended (left or removed)"
                ));
            }
            _ => {}
        }
        Ok(())
    })
    .await?;
    let _ = client.logout().await;
    Ok(())
}

fn count_line(
    group: u64,
    count: u32,
    members: Option<u32>,
    role: Option<&str>,
    json: bool,
) -> String {
    let time = crate::client::utc(crate::client::now_ms());
    if json {
        let mut value = serde_json::json!({ "time": time, "group": group, "online": count });
        if let Some(m) = members {
            value["members"] = m.into();
        }
        if let Some(r) = role {
            value["role"] = r.into();
        }
        return value.to_string();
    }
    let mut text = format!("{time} group {group}: {count} online");
    if let Some(m) = members {
        text.push_str(&format!(" of {m}"));
    }
    if let Some(r) = role {
        text.push_str(&format!(" (subscribed as {r})"));
    }
    text
}

fn member_line(group: u64, member: &str, online: bool, count: u32, json: bool) -> String {
    let time = crate::client::utc(crate::client::now_ms());
    let state = if online { "online" } else { "offline" };
    if json {
        return serde_json::json!({
            "time": time, "group": group, "member": member, "member_online": online, "online": count,
        })
        .to_string();
    }
    format!("{time} group {group}: {member} {state}, {count} online")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_read_back_what_they_print() {
        for cursor in [
            GroupCursor {
                online: true,
                after: 0,
            },
            GroupCursor {
                online: false,
                after: u64::MAX,
            },
        ] {
            assert_eq!(parse_cursor(&cursor_text(&cursor)), Ok(cursor));
        }
        for bad in ["", "on", "on:", "up:3", "on:-1", "off:x", "3"] {
            assert!(parse_cursor(bad).is_err(), "{bad:?} was taken");
        }
    }

    #[test]
    fn member_files_skip_blanks_and_comments() {
        let text = "# the team\nalice\n\n  bob  \n#carol\ndave\n";
        assert_eq!(users_in(text), ["alice", "bob", "dave"]);
    }
}
