//! # greendot-core
//!
//! The presence state machine of greendot: who is online, on which devices,
//! with what status, since when they were last seen, and who must be told.
//!
//! It is pure and deterministic, in the style of quinn-proto: no clock, no I/O,
//! no threads, no randomness. Every input carries `now` (a [`Millis`] on the
//! driver's monotonic clock) and returns a `Result` with a typed [`Error`];
//! after each input the driver drains [`Core::poll_output`], and calls
//! [`Core::handle_timeout`] when [`Core::poll_timeout`] says so.
//!
//! ```
//! use greendot_core::*;
//! let mut core = Core::new(Config::default()).unwrap();
//! let alice = core
//!     .handle_connect(Millis(0), Connect {
//!         user: UserId(1), device: DeviceId(1), kind: DeviceKind::Mobile,
//!         watch: Watch::All, resume: None, foreground: true,
//!     })
//!     .unwrap()
//!     .session;
//! let bob = core
//!     .handle_connect(Millis(0), Connect {
//!         user: UserId(2), device: DeviceId(1), kind: DeviceKind::Desktop,
//!         watch: Watch::All, resume: None, foreground: true,
//!     })
//!     .unwrap()
//!     .session;
//! core.handle_subscribe(Millis(0), bob, UserId(1), Tier::Realtime).unwrap();
//! while core.poll_output().is_some() {}
//! // Alice's arrival is published once the debounce window has held.
//! let due = core.poll_timeout().unwrap();
//! assert_eq!(due, Millis(300));
//! core.handle_timeout(due);
//! match core.poll_output() {
//!     Some(Output::Push { to, presence, .. }) => assert!(to == bob && presence.online),
//!     other => panic!("{other:?}"),
//! }
//! # let _ = alice;
//! ```
//!
//! Group presence (online counts for members, realtime deltas for admins,
//! member pages) is in the `groups` module's terms: see
//! [`Core::handle_set_group`] and docs/groups.md.
//!
//! Defaults are in [`Config::default`]. The semantics and the invariants
//! I1–I12 are those of greendot's DESIGN.md (I12, foreground and background,
//! is stated in the `foreground` module); `check_invariants` (feature
//! `check`) verifies the structural ones after any step.

pub mod cluster;
mod config;
mod engine;
mod error;
mod fanout;
mod foreground;
mod group_changes;
mod group_fed;
mod group_fed_watch;
mod group_hooks;
mod group_pages;
mod group_sum;
mod group_watch;
mod groups;
mod index;
mod output;
mod timers;
mod types;
mod view;

#[cfg(feature = "check")]
mod audit;
#[cfg(feature = "check")]
mod check;
#[cfg(feature = "check")]
mod group_check;
#[cfg(feature = "mutants")]
pub mod mutants;

#[cfg(feature = "check")]
pub use audit::Audit;
pub use cluster::{Epoch, NodeId, Published, ShardId};
pub use config::{Backgrounded, Config, ConfigError, KindConfig, RealtimeOverflow};
pub use engine::{Connect, Connected, Core, Counters, Input, Reply, Saved, SessionInfo, Snapshot};
pub use error::{Error, Limit};
pub use fanout::Fanout;
pub use group_fed::FED_VERSION_STEP;
pub use group_pages::{GroupPage, PageCursor, PageKeys};
pub use group_sum::{GroupSum, SumMutant, SumOutput};
pub use group_watch::PAGE_DELTA_ENTRIES;
pub use groups::{changed_lists, GroupChange, GroupId, GroupOutput, GroupRole, GroupSnapshot};
pub use output::{EndReason, Output};
pub use types::{
    DeviceId, DeviceKind, Kinds, Millis, Presence, SessionId, Status, Tier, UserId, Watch,
};
pub use view::{Applied, View};
