//! Settings of the core, with defaults chosen for chat clients on real networks.

use crate::types::{DeviceKind, Millis};
use std::fmt;

/// Timeouts of one kind of device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KindConfig {
    /// An Online device silent for this long is reaped as a ghost. The driver
    /// renews the lease while the connection lives (QUIC keep-alive is the real
    /// heartbeat), so this is the safety net for a driver that forgot.
    pub heartbeat_timeout: Millis,
    /// How long a lost connection lingers, unseen by others, so that a quick
    /// reconnect resumes it.
    pub grace: Millis,
}

/// What to do when a target already has `max_realtime_per_target` realtime
/// subscribers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RealtimeOverflow {
    /// Subscribe in the batched tier instead and say so in the answer.
    Downgrade,
    /// Refuse with `Error::LimitExceeded(Limit::RealtimePerTarget)`.
    Reject,
}

/// What a backgrounded device means for its user (I12).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Backgrounded {
    /// Not present: it does not make its user shown online, and once no
    /// device of the user is in the foreground the user is shown offline
    /// (after debounce), last seen when the last one went to the background.
    #[default]
    Offline,
    /// Present but away: the user stays shown online, with status `Away`
    /// while every device is in the background and the chosen status is
    /// `Available` (an explicit busy or do-not-disturb is kept).
    Away,
}

/// The core's settings. `Config::default()` is what the server runs with.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// A visible change waits this long and is published only if it held.
    pub debounce: Millis,
    /// Batched subscribers get coalesced changes at most this late.
    pub batch_interval: Millis,
    /// Indexed by `DeviceKind::index()`.
    pub kinds: [KindConfig; 4],
    pub max_subscriptions_per_session: usize,
    pub max_realtime_per_target: usize,
    pub realtime_overflow: RealtimeOverflow,
    /// In bytes of UTF-8.
    pub max_message_len: usize,
    pub max_devices_per_user: usize,
    pub max_sessions: usize,
    /// Users the core keeps a record of (online or not: last seen is remembered).
    pub max_users: usize,
    /// What a device whose app is in the background means (I12). Routing
    /// ignores it: a backgrounded device is never routable.
    pub backgrounded: Backgrounded,
    /// Group presence (see the `groups` module): a member subscribed to a
    /// group gets its online count at most this often, only when it changed.
    pub group_interval: Millis,
    /// Members of one group, admins included.
    pub max_group_members: usize,
    pub max_group_admins: usize,
    pub max_group_subscriptions_per_session: usize,
    /// Groups the core keeps.
    pub max_groups: usize,
    /// Entries per page of a group's member list, at most.
    pub group_page_size: usize,
    /// A watched page (the `group_watch` module) stops getting deltas this
    /// long after it was last asked for or renewed.
    pub group_watch_ttl: Millis,
    /// Pages a session may watch at once, over all groups.
    pub max_watched_pages: usize,
    /// Entries of the pages a session watches, in all.
    pub max_watched_entries: usize,
    /// Member pages a session may ask of one group in a burst (a token
    /// bucket of this size)...
    pub group_page_burst: u32,
    /// ...which gains one page back this often.
    pub group_page_refill: Millis,
}

impl Default for Config {
    /// - debounce 300 ms: longer than a Wi-Fi/4G hand-over blip, shorter than a
    ///   person notices;
    /// - batch interval 2 s: a contact list may be that stale, and 2 s of
    ///   coalescing absorbs bursts;
    /// - mobile: 30 s grace (elevators, tunnels, network switches) and a 90 s
    ///   heartbeat timeout (mobile OSes delay keep-alives of backgrounded apps);
    /// - desktop: 15 s grace (sleep, Wi-Fi roaming), 60 s heartbeat timeout;
    /// - web: 10 s grace (a page reload reconnects within a few seconds), 60 s;
    /// - other: 15 s grace, 60 s;
    /// - a backgrounded device is not present (`Backgrounded::Offline`);
    /// - groups: a count every 10 s at most (a room's "42 online" may be that
    ///   stale), 10,000 members, 32 admins, 100 group subscriptions per
    ///   session, 100,000 groups, member pages of 200;
    /// - watched pages: 3 per session, 600 entries (three screens of a
    ///   member list), each for 60 s unless renewed, so a backgrounded phone
    ///   that stops renewing stops costing within a minute;
    /// - member pages: 10 per group in a burst, then one a second: opening
    ///   a list and scrolling through 2,000 members is one burst, and
    ///   crawling a 10,000-member group (50 pages) takes 40 s or more, in
    ///   the spirit of Discord's one full member request per 30 s.
    fn default() -> Config {
        let kind = |grace, heartbeat| KindConfig {
            heartbeat_timeout: Millis::from_secs(heartbeat),
            grace: Millis::from_secs(grace),
        };
        Config {
            debounce: Millis(300),
            batch_interval: Millis(2000),
            kinds: [kind(30, 90), kind(15, 60), kind(10, 60), kind(15, 60)],
            max_subscriptions_per_session: 1_000,
            max_realtime_per_target: 1_000,
            realtime_overflow: RealtimeOverflow::Downgrade,
            max_message_len: 256,
            max_devices_per_user: 16,
            max_sessions: 4_000_000,
            max_users: 10_000_000,
            backgrounded: Backgrounded::Offline,
            group_interval: Millis::from_secs(10),
            max_group_members: 10_000,
            max_group_admins: 32,
            max_group_subscriptions_per_session: 100,
            max_groups: 100_000,
            group_page_size: 200,
            group_watch_ttl: Millis::from_secs(60),
            max_watched_pages: 3,
            max_watched_entries: 600,
            group_page_burst: 10,
            group_page_refill: Millis::from_secs(1),
        }
    }
}

impl Config {
    pub fn kind(&self, kind: DeviceKind) -> &KindConfig {
        &self.kinds[kind.index()]
    }

    pub fn kind_mut(&mut self, kind: DeviceKind) -> &mut KindConfig {
        &mut self.kinds[kind.index()]
    }

    /// Rejects settings under which the semantics would not hold.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.debounce == Millis::ZERO {
            return Err(ConfigError("debounce must be at least 1 ms"));
        }
        if self.batch_interval == Millis::ZERO {
            return Err(ConfigError("batch_interval must be at least 1 ms"));
        }
        for kind in &self.kinds {
            if kind.heartbeat_timeout == Millis::ZERO {
                return Err(ConfigError("heartbeat_timeout must be at least 1 ms"));
            }
        }
        if self.max_sessions > u32::MAX as usize || self.max_users > u32::MAX as usize {
            return Err(ConfigError(
                "max_sessions and max_users must fit in 32 bits",
            ));
        }
        if self.max_devices_per_user == 0 || self.max_sessions == 0 || self.max_users == 0 {
            return Err(ConfigError(
                "max_devices_per_user, max_sessions and max_users must be at least 1",
            ));
        }
        if self.group_interval == Millis::ZERO {
            return Err(ConfigError("group_interval must be at least 1 ms"));
        }
        if self.group_page_size == 0 {
            return Err(ConfigError("group_page_size must be at least 1"));
        }
        if self.group_watch_ttl == Millis::ZERO {
            return Err(ConfigError("group_watch_ttl must be at least 1 ms"));
        }
        if self.group_page_burst == 0 {
            return Err(ConfigError("group_page_burst must be at least 1"));
        }
        if self.max_group_members > u32::MAX as usize {
            return Err(ConfigError("max_group_members must fit in 32 bits"));
        }
        Ok(())
    }
}

/// Why a `Config` was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigError(pub &'static str);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid config: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}
