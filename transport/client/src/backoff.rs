//! The reconnection policy: full-jitter exponential backoff, and the
//! `retry_ms` a server may put in a close reason (see the crate docs,
//! "Reconnecting").

use std::time::Duration;

/// Reconnection policy (see the module docs: waits are drawn with full jitter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reconnect {
    /// The ceiling of the first wait after a loss; it doubles with every
    /// failed attempt up to `max_backoff`.
    pub initial_backoff: Duration,
    /// The largest ceiling of a wait (a `retry_ms` from the server may exceed
    /// it).
    pub max_backoff: Duration,
    /// Stop trying after this long without a connection (`None`: never).
    pub give_up_after: Option<Duration>,
}

/// The longest wait taken from a server's `retry_ms` (a larger one is cut
/// to this).
pub const MAX_RETRY_HINT: Duration = Duration::from_secs(300);

/// The `retry_ms=<decimal>` a server may put in a close reason (a word of its
/// own: `xretry_ms=5` is not one), as a duration of at most
/// [`MAX_RETRY_HINT`]. The first one counts.
pub fn retry_hint(reason: &str) -> Option<Duration> {
    const KEY: &str = "retry_ms=";
    let mut rest = reason;
    let mut offset = 0;
    while let Some(at) = rest.find(KEY) {
        let start = offset + at;
        let word_start = match reason[..start].chars().next_back() {
            None => true,
            Some(c) => !(c.is_alphanumeric() || c == '_'),
        };
        let digits: &str = {
            let after = &reason[start + KEY.len()..];
            let end = after
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(after.len());
            &after[..end]
        };
        if word_start && !digits.is_empty() {
            // Too many digits for a u64 is simply "a very long time".
            let ms = digits.parse::<u64>().unwrap_or(u64::MAX);
            return Some(Duration::from_millis(ms).min(MAX_RETRY_HINT));
        }
        offset = start + KEY.len();
        rest = &reason[offset..];
    }
    None
}

/// Full-jitter exponential backoff: the `n`-th wait (from 0) is uniform in
/// `[0, min(max_backoff, initial_backoff * 2^n)]`, or uniform in
/// `[0, retry_ms]` when the server suggested one.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: Reconnect,
    attempt: u32,
    /// The server's last `retry_ms`, kept until a success: an attempt that
    /// fails inside a herd must not come back sooner than the spread the
    /// server asked for (with a 5 s ceiling, 100,000 failed devices would
    /// come back at 20,000 attempts per second and never let it admit them).
    floor: Duration,
    rng: u64,
}

impl Backoff {
    /// Seeded from the system's randomness (`ring`), so that two clients
    /// started together draw different waits.
    pub fn new(policy: Reconnect) -> Backoff {
        use ring::rand::SecureRandom;
        let mut seed = [0u8; 8];
        let seed = match ring::rand::SystemRandom::new().fill(&mut seed) {
            Ok(()) => u64::from_le_bytes(seed),
            // No system randomness: the clock's nanoseconds still differ
            // between clients.
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
        };
        Backoff::with_seed(policy, seed)
    }

    /// A replayable sequence of waits (tests, benchmarks).
    pub fn with_seed(policy: Reconnect, seed: u64) -> Backoff {
        Backoff {
            policy,
            attempt: 0,
            floor: Duration::ZERO,
            // xorshift needs a state other than 0.
            rng: seed | 1,
        }
    }

    /// The ceiling of the next wait without a new hint:
    /// `min(max_backoff, initial_backoff * 2^n)`, or the server's last
    /// `retry_ms` since the last success if that is longer.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt).unwrap_or(u32::MAX);
        self.policy
            .initial_backoff
            .checked_mul(factor)
            .unwrap_or(Duration::MAX)
            .min(self.policy.max_backoff)
            .max(self.floor)
    }

    /// The next wait: uniform in `[0, hint]` if the server suggested one
    /// (which then stays the least ceiling until [`Backoff::reset`]),
    /// otherwise uniform in `[0, ceiling()]`; the ceiling then doubles.
    pub fn next_delay(&mut self, hint: Option<Duration>) -> Duration {
        if let Some(hint) = hint {
            self.floor = hint;
        }
        let ceiling = hint.unwrap_or_else(|| self.ceiling());
        self.attempt = self.attempt.saturating_add(1);
        self.uniform(ceiling)
    }

    /// Starts again from `initial_backoff`, forgetting the server's hint
    /// (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
        self.floor = Duration::ZERO;
    }

    /// Uniform in `[0, max]`, to the nanosecond.
    fn uniform(&mut self, max: Duration) -> Duration {
        // xorshift64*: plenty for spreading reconnects.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let span = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        let nanos = ((u128::from(r) * (u128::from(span) + 1)) >> 64) as u64;
        Duration::from_nanos(nanos)
    }
}

impl Default for Reconnect {
    fn default() -> Reconnect {
        Reconnect {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            give_up_after: Some(Duration::from_secs(300)),
        }
    }
}

impl Reconnect {
    /// A policy with these waits (see the fields); a setting added later
    /// gets its default.
    pub fn new(
        initial_backoff: Duration,
        max_backoff: Duration,
        give_up_after: Option<Duration>,
    ) -> Reconnect {
        Reconnect {
            initial_backoff,
            max_backoff,
            give_up_after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClientError;
    use greendot_proto::{CloseCode, ErrorCode, WireError};

    fn policy(initial_ms: u64, max_ms: u64) -> Reconnect {
        Reconnect {
            initial_backoff: Duration::from_millis(initial_ms),
            max_backoff: Duration::from_millis(max_ms),
            give_up_after: None,
        }
    }

    #[test]
    fn backoff_ceilings_double_up_to_the_maximum() {
        let mut b = Backoff::with_seed(policy(100, 5000), 7);
        let mut ceilings = Vec::new();
        for _ in 0..10 {
            ceilings.push(b.ceiling().as_millis());
            b.next_delay(None);
        }
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]
        );
        // No overflow however many attempts.
        for _ in 0..100 {
            b.next_delay(None);
        }
        assert_eq!(b.ceiling(), Duration::from_millis(5000));
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
    }

    #[test]
    fn backoff_waits_are_spread_over_the_whole_range() {
        // Full jitter: every wait in [0, ceiling], and over many draws both
        // ends of the range are reached (not a fixed or a half-range wait).
        let mut all = Vec::new();
        for seed in 0..2000u64 {
            let mut b = Backoff::with_seed(policy(100, 400), seed.wrapping_mul(0x9e37_79b9));
            for n in 0..4 {
                let ceiling = b.ceiling();
                let d = b.next_delay(None);
                assert!(d <= ceiling, "wait {d:?} over ceiling {ceiling:?}");
                if n == 3 {
                    all.push(d.as_secs_f64() / ceiling.as_secs_f64());
                }
            }
        }
        let below = all.iter().filter(|&&x| x < 0.1).count();
        let above = all.iter().filter(|&&x| x > 0.9).count();
        let mean = all.iter().sum::<f64>() / all.len() as f64;
        assert!(below > 100 && above > 100, "{below} low, {above} high");
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
        // Two clients seeded from the system draw different waits.
        let a: Vec<_> = {
            let mut b = Backoff::new(policy(1000, 1000));
            (0..4).map(|_| b.next_delay(None)).collect()
        };
        let b: Vec<_> = {
            let mut b = Backoff::new(policy(1000, 1000));
            (0..4).map(|_| b.next_delay(None)).collect()
        };
        assert_ne!(a, b);
    }

    #[test]
    fn a_server_hint_spreads_every_attempt_until_a_success() {
        let hint = Duration::from_millis(12_000);
        let mut longest = Duration::ZERO;
        let mut longest_after_failure = Duration::ZERO;
        for seed in 1..500u64 {
            let mut b = Backoff::with_seed(policy(100, 5000), seed);
            let d = b.next_delay(Some(hint));
            assert!(d <= hint);
            longest = longest.max(d);
            // The attempt failed without a new hint: the server's spread
            // still holds (not the 200 ms of the doubling), as long as the
            // doubling stays under it.
            for _ in 0..3 {
                assert_eq!(b.ceiling(), hint);
                let d = b.next_delay(None);
                assert!(d <= hint);
                longest_after_failure = longest_after_failure.max(d);
            }
            // A success forgets it.
            b.reset();
            assert_eq!(b.ceiling(), Duration::from_millis(100));
        }
        assert!(
            longest_after_failure > Duration::from_millis(5000),
            "{longest_after_failure:?}"
        );
        // A hint above max_backoff is honoured.
        assert!(longest > Duration::from_millis(5000), "{longest:?}");
        // A zero hint: at once.
        let mut b = Backoff::with_seed(policy(100, 5000), 3);
        assert_eq!(b.next_delay(Some(Duration::ZERO)), Duration::ZERO);
    }

    #[test]
    fn retry_ms_is_read_from_a_close_reason() {
        let ms = |s: &str| retry_hint(s).map(|d| d.as_millis());
        assert_eq!(
            ms("server draining: reconnect and resume retry_ms=12000"),
            Some(12_000)
        );
        assert_eq!(ms("retry_ms=0"), Some(0));
        assert_eq!(ms("TooManyConnections: full (retry_ms=250)"), Some(250));
        assert_eq!(ms("retry_ms=250, then retry_ms=9"), Some(250));
        assert_eq!(ms("busy retry_ms=1500; more text"), Some(1500));
        // Not a word of its own, no digits, a negative or a decimal point.
        assert_eq!(ms("xretry_ms=5"), None);
        assert_eq!(ms("retry_ms="), None);
        assert_eq!(ms("retry_ms=-5"), None);
        assert_eq!(ms("retry_ms = 5"), None);
        assert_eq!(ms("retry_ms=1.5"), Some(1));
        assert_eq!(ms("server draining"), None);
        assert_eq!(ms(""), None);
        // A bad one first does not hide a good one after it.
        assert_eq!(ms("xretry_ms=5 retry_ms=7"), Some(7));
        // Absurd values are cut to MAX_RETRY_HINT.
        assert_eq!(
            retry_hint("retry_ms=99999999999999999999999"),
            Some(MAX_RETRY_HINT)
        );
        assert_eq!(retry_hint("retry_ms=86400000"), Some(MAX_RETRY_HINT));
        // Carried by a rejection, not by other errors.
        let rejected = ClientError::Rejected {
            code: Some(CloseCode::Draining),
            error: WireError::new(ErrorCode::ShuttingDown, "draining retry_ms=40"),
        };
        assert_eq!(rejected.retry_after(), Some(Duration::from_millis(40)));
        assert_eq!(
            ClientError::OutcomeUnknown { lost: None }.retry_after(),
            None
        );
    }
}
