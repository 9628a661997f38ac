//! The state's clock: Unix milliseconds that never go backwards, with
//! steps of the wall clock slewed in.

use greendot_core::Millis;
use std::time::{Duration, Instant};

/// The state's clock: Unix milliseconds, read as the wall clock at a base
/// instant plus the monotonic time since, so it never goes backwards and
/// saved wall-clock instants (last seen) mean the same after a restart.
///
/// A step of the wall clock (NTP, a resumed VM) is never taken at once: a
/// step forward taken whole would expire every heartbeat, grace and lease
/// together (every healthy session reaped, everyone shown offline), a step
/// back would run time backwards. It is slewed in instead: the clock runs
/// up to [`SLEW_PER_MS`] faster or slower until it has caught up, so every
/// window the core measures lasts at least 99% of its length in real time,
/// and last seen drifts back to the wall clock (a one-minute step in 100
/// minutes).
#[derive(Clone, Copy, Debug)]
pub(super) struct Clock {
    start: Instant,
    start_ms: u64,
    /// What is still to be slewed in (wall clock minus this clock), in ms.
    pending: i64,
}

/// The slew rate: 1 ms per 100 ms.
const SLEW_PER_MS: u64 = 100;

impl Clock {
    pub(super) fn new(start: Instant, unix_ms: u64) -> Clock {
        Clock {
            start,
            start_ms: unix_ms,
            pending: 0,
        }
    }

    /// `instant` on this clock.
    pub(super) fn at(&self, instant: Instant) -> Millis {
        let elapsed = instant.saturating_duration_since(self.start);
        let elapsed = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        let slewed = (elapsed / SLEW_PER_MS).min(self.pending.unsigned_abs());
        let run = if self.pending >= 0 {
            elapsed.saturating_add(slewed)
        } else {
            elapsed - slewed
        };
        Millis(self.start_ms.saturating_add(run))
    }

    /// When a core deadline is due. `at()` truncates to the millisecond, so
    /// an input stamped `m` happened up to 1 ms after `m`: waking at `at + 1`
    /// ms keeps every window the core measures (debounce, grace) at least as
    /// long in real time, never a fraction of a millisecond short (less the
    /// slew).
    pub(super) fn instant(&self, at: Millis) -> Option<Instant> {
        let run = at.0.saturating_sub(self.start_ms);
        let p = self.pending.unsigned_abs();
        // Invert `at()`: while slewing, `run = elapsed * (1 ± 1/SLEW_PER_MS)`;
        // once `p` is slewed in (after `p * SLEW_PER_MS` ms), `run = elapsed ± p`.
        let elapsed = if self.pending >= 0 {
            let slewing = p.saturating_mul(SLEW_PER_MS + 1);
            if run <= slewing {
                run.saturating_mul(SLEW_PER_MS) / (SLEW_PER_MS + 1)
            } else {
                run - p
            }
        } else {
            let slewing = p.saturating_mul(SLEW_PER_MS - 1);
            if run <= slewing {
                run.saturating_mul(SLEW_PER_MS).div_ceil(SLEW_PER_MS - 1)
            } else {
                run.saturating_add(p)
            }
        };
        self.start
            .checked_add(Duration::from_millis(elapsed.saturating_add(1)))
    }

    /// The wall clock reads `unix_ms` at `now`: the difference is slewed in
    /// from here on (replacing what was still pending).
    pub(super) fn set(&mut self, now: Instant, unix_ms: u64) {
        let current = self.at(now).0;
        self.start = now;
        self.start_ms = current;
        self.pending = i64::try_from(i128::from(unix_ms) - i128::from(current)).unwrap_or(0);
    }
}
