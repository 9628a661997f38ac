//! `greendot group`: write a group from files, watch its count, read its
//! member list (docs/groups.md).

use crate::client::{connect, line, say, until_signal};
use crate::ClientArgs;
use greendot_client::{Event, GroupCursor, GroupRole};
use std::path::Path;

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
    let result = client.set_group(group, &members, &admins).await;
    client.close().await;
    let version = result.map_err(|e| format!("cannot set group {group}: {e}"))?;
    say(&format!(
        "group {group}: version {version}, {} members listed, {} admins",
        members.len(),
        admins.len()
    ));
    Ok(())
}

/// `greendot group remove` (a service token).
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
        for (user, presence) in &page.entries {
            say(&line(user, presence, json));
        }
        match page.next {
            Some(next) if all => after = Some(next),
            Some(next) if json => {
                say(&serde_json::json!({ "next": cursor_text(&next) }).to_string());
                break Ok(());
            }
            Some(next) => {
                say(&format!("next: {}", cursor_text(&next)));
                break Ok(());
            }
            None => {
                if !json {
                    say(&format!(
                        "group {group}: {} shown online, version {}",
                        page.count, page.version
                    ));
                }
                break Ok(());
            }
        }
    };
    client.close().await;
    result
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
