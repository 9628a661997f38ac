//! When a node may act on a lease-like key (its node lease, a shard claim),
//! from explicit instants: pure, no clock of its own.
//!
//! NATS starts a key's TTL when the stream leader stores the write, which is
//! after the writer sent it. So a key written at local instant `sent_at`
//! cannot expire before `sent_at + ttl`. The holder acts only until
//! `sent_at + ttl - margin`: the margin covers clock-rate error and the time
//! between checking the deadline and the effect of an action. Renewals are
//! due every `(ttl - margin) / 3`, so two renewals may fail before the holder
//! has to stop.

use std::time::{Duration, Instant};

/// The TTL of one kind of key and the margin its holder keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    pub ttl: Duration,
    pub margin: Duration,
}

impl LeaseTiming {
    /// How long after a successful write the holder may act.
    pub fn act_window(&self) -> Duration {
        self.ttl.saturating_sub(self.margin)
    }

    /// How often the holder renews.
    pub fn renew_every(&self) -> Duration {
        self.act_window() / 3
    }
}

/// Until when side work (making a watch again) may run at `now`, bounded by
/// one operation timeout `op`: only while every holding outlasts it by
/// another `op`, so a renewal due meanwhile still has one operation timeout
/// to run. `None`: not now. Side work is not fitted between renewals: with
/// the default timing they are due every 4 s and an operation may take 2 s,
/// so a gap of two operation timeouts before the next renewal never comes.
pub fn side_work_until(now: Instant, op: Duration, must_renew_by: Instant) -> Option<Instant> {
    (now + op * 2 <= must_renew_by).then_some(now + op)
}

/// A held lease or claim: the instant its last successful write was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenure {
    timing: LeaseTiming,
    sent_at: Instant,
}

impl Tenure {
    /// A write sent at `sent_at` succeeded.
    pub fn granted(timing: LeaseTiming, sent_at: Instant) -> Tenure {
        Tenure { timing, sent_at }
    }

    /// A renewal sent at `sent_at` succeeded. Never moves the deadline back
    /// (an older renewal's answer arriving late changes nothing).
    pub fn renewed(&mut self, sent_at: Instant) {
        self.sent_at = self.sent_at.max(sent_at);
    }

    /// The holder may act strictly before this instant, and must not after.
    pub fn may_act_until(&self) -> Instant {
        self.sent_at + self.timing.act_window()
    }

    pub fn may_act(&self, now: Instant) -> bool {
        now < self.may_act_until()
    }

    /// The earliest instant the key can expire in NATS if never renewed again.
    pub fn expires_no_earlier_than(&self) -> Instant {
        self.sent_at + self.timing.ttl
    }

    /// When the next renewal is due.
    pub fn renew_at(&self) -> Instant {
        self.sent_at + self.timing.renew_every()
    }

    pub fn timing(&self) -> LeaseTiming {
        self.timing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: LeaseTiming = LeaseTiming {
        ttl: Duration::from_secs(2),
        margin: Duration::from_millis(500),
    };

    #[test]
    fn acting_stops_a_margin_before_the_earliest_expiry() {
        let t0 = Instant::now();
        let tenure = Tenure::granted(T, t0);
        assert_eq!(tenure.may_act_until(), t0 + Duration::from_millis(1500));
        assert!(tenure.may_act(t0 + Duration::from_millis(1499)));
        assert!(!tenure.may_act(t0 + Duration::from_millis(1500)));
        assert!(tenure.may_act_until() + T.margin == tenure.expires_no_earlier_than());
        assert_eq!(tenure.renew_at(), t0 + Duration::from_millis(500));
    }

    #[test]
    fn renewal_extends_and_never_shortens() {
        let t0 = Instant::now();
        let mut tenure = Tenure::granted(T, t0);
        tenure.renewed(t0 + Duration::from_secs(1));
        assert_eq!(tenure.may_act_until(), t0 + Duration::from_millis(2500));
        tenure.renewed(t0);
        assert_eq!(tenure.may_act_until(), t0 + Duration::from_millis(2500));
    }

    #[test]
    fn a_margin_as_large_as_the_ttl_never_acts() {
        let t0 = Instant::now();
        let timing = LeaseTiming {
            ttl: Duration::from_secs(1),
            margin: Duration::from_secs(2),
        };
        assert!(!Tenure::granted(timing, t0).may_act(t0));
    }

    #[test]
    fn side_work_fits_anywhere_in_a_renewal_period_but_never_at_the_deadline() {
        let defaults = crate::ClusterConfig::new(crate::NodeId::new("a").unwrap());
        let timing = defaults.lease_timing();
        let op = defaults.op_timeout;
        let t0 = Instant::now();
        let tenure = Tenure::granted(timing, t0);
        let mut now = t0;
        while now <= tenure.renew_at() + op {
            let until = side_work_until(now, op, tenure.may_act_until());
            assert_eq!(until, Some(now + op), "at {:?}", now - t0);
            now += Duration::from_millis(100);
        }
        let late = tenure.may_act_until() - op * 2 + Duration::from_millis(1);
        assert_eq!(side_work_until(late, op, tenure.may_act_until()), None);
    }
}
