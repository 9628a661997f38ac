//! What a run measured, and its markdown rows.

use super::{Burst, Ctx};
use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// What a [`Burst`] did.
#[derive(Clone, Debug, Default)]
pub struct BurstReport {
    pub sessions: usize,
    /// Of them, welcomed again, and given up.
    pub back: usize,
    pub failed: usize,
    /// From the burst to the last of them back.
    pub all_back: Option<Duration>,
    /// Change-to-push p99 of the other sessions' changes: received in the
    /// window before the burst, from the burst until all were back, after.
    pub p99_before: Option<Duration>,
    pub p99_during: Option<Duration>,
    pub p99_after: Option<Duration>,
    /// From the burst's end (all back) to the first second from which every
    /// second's p99 stays within twice the one before the burst (at least
    /// 50 ms): the server back to normal.
    pub normal_after: Option<Duration>,
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    pub target: usize,
    /// Connections established by the end of the ramp.
    pub connected: usize,
    /// Connections that could not be established during the ramp.
    pub failed: usize,
    /// Connections open at the end of the measured window.
    pub held: usize,
    pub ramp: Duration,
    /// When 99% of the connections had connected or failed (the last 1% can
    /// wait for handshake retransmissions).
    pub ramp_99: Duration,
    /// Handshakes (QUIC + hello + subscribe) per second until 99% were done.
    pub handshakes_per_sec: f64,
    /// Server resident memory before and after the ramp, bytes.
    pub server_rss_before: Option<u64>,
    pub server_rss_after: Option<u64>,
    /// Server CPU during the ramp and during the window, in cores (1.0 = one
    /// core busy).
    pub server_cpu_ramp: Option<f64>,
    pub server_cpu_window: Option<f64>,
    /// The generator's own CPU during the window, in cores.
    pub client_cpu_window: Option<f64>,
    /// The server's CPU cap, cores (`None`: uncapped).
    pub server_cap: Option<f64>,
    /// Of the cap's 100 ms periods in the window in which the server ran,
    /// (those in which it used its whole quota and waited, all).
    pub server_throttled: Option<(u64, u64)>,
    /// Datagrams dropped by full receive buffers in the window: the
    /// server's socket, and the generator's own sockets.
    pub server_drops_window: Option<u64>,
    pub client_drops_window: Option<u64>,
    pub status_changes: u64,
    pub reconnects: u64,
    pub reconnect_failures: u64,
    /// Pushes received during the window.
    pub notifications: u64,
    pub window: Duration,
    pub latency_samples: usize,
    pub latency_p50: Option<Duration>,
    pub latency_p99: Option<Duration>,
    pub latency_p999: Option<Duration>,
    /// Requests answered with an error, or not answered in time.
    pub request_errors: u64,
    pub burst: Option<BurstReport>,
}

impl LoadReport {
    pub fn bytes_per_session(&self) -> Option<f64> {
        let (a, b) = (self.server_rss_before?, self.server_rss_after?);
        (self.connected > 0).then(|| b.saturating_sub(a) as f64 / self.connected as f64)
    }

    pub fn notifications_per_sec(&self) -> f64 {
        self.notifications as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// The header of [`LoadReport::bottleneck_row`].
    pub fn bottleneck_header() -> &'static str {
        "| N | server CPU cap (cores) | server CPU window (cores) | periods at the cap | generator CPU window (cores) | server socket drops | generator socket drops |\n|---:|---:|---:|---:|---:|---:|---:|"
    }

    /// Who was the bottleneck in the window: the server's cap and CPU, how
    /// often the cap held it back, the generator's CPU, and each side's
    /// socket drops.
    pub fn bottleneck_row(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            self.target,
            opt_f(self.server_cap, 2),
            // Clock ticks of 10 ms over the window: at 30 s, 0.001 of a
            // core is 3 ticks, so the third digit means something.
            opt_f(self.server_cpu_window, 3),
            self.server_throttled.map_or("-".into(), |(t, p)| format!(
                "{t} of {p} ({:.0}%)",
                t as f64 * 100.0 / p.max(1) as f64
            )),
            opt_f(self.client_cpu_window, 2),
            self.server_drops_window
                .map_or("-".into(), |d| d.to_string()),
            self.client_drops_window
                .map_or("-".into(), |d| d.to_string()),
        )
    }

    /// The markdown table header matching [`LoadReport`]'s `Display`.
    pub fn header() -> &'static str {
        "| N | held | handshakes/s | server KiB/session | p50 ms | p99 ms | p99.9 ms | notifications/s | changes / reconnects | server CPU ramp / window (cores) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    }
}

fn opt_ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

fn opt_f(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |x| format!("{x:.digits$}"))
}

impl fmt::Display for LoadReport {
    /// One markdown table row (see [`LoadReport::header`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "| {} | {} | {:.0} | {} | {} | {} | {} | {:.0} | {} / {} | {} / {} |",
            self.target,
            self.held,
            self.handshakes_per_sec,
            opt_f(self.bytes_per_session().map(|b| b / 1024.0), 1),
            opt_ms(self.latency_p50),
            opt_ms(self.latency_p99),
            opt_ms(self.latency_p999),
            self.notifications_per_sec(),
            self.status_changes,
            self.reconnects,
            opt_f(self.server_cpu_ramp, 2),
            opt_f(self.server_cpu_window, 2),
        )
    }
}

/// The p99 of latencies (µs).
fn p99(mut lat: Vec<u32>) -> Option<Duration> {
    lat.sort_unstable();
    let i = ((lat.len() as f64 - 1.0) * 0.99).round() as usize;
    lat.get(i.min(lat.len().saturating_sub(1)))
        .map(|&us| Duration::from_micros(u64::from(us)))
}

/// `timed`: (received ms, latency µs); the burst from `start` to `end` ms.
pub(crate) fn burst_report(
    ctx: &Ctx,
    b: Burst,
    timed: &[(u32, u32)],
    start: u32,
    end: Option<u32>,
) -> BurstReport {
    BurstReport {
        sessions: b.sessions,
        back: ctx.burst_back.load(Relaxed),
        failed: ctx.burst_failed.load(Relaxed),
        all_back: end.map(|e| Duration::from_millis(u64::from(e.saturating_sub(start)))),
        ..burst_latency(timed, start, end)
    }
}

/// The latency figures of a [`BurstReport`].
fn burst_latency(timed: &[(u32, u32)], start: u32, end: Option<u32>) -> BurstReport {
    let end_ms = end.unwrap_or(u32::MAX);
    let within = |from: u32, to: u32| -> Vec<u32> {
        timed
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, l)| *l)
            .collect()
    };
    let before = p99(within(0, start));
    // Back to normal: seconds after the end whose p99 all stay under the bar.
    let bar = before.map_or(Duration::from_millis(50), |p| {
        (p * 2).max(Duration::from_millis(50))
    });
    let last = timed.iter().map(|(at, _)| *at).max().unwrap_or(0);
    let normal_after = end.and_then(|end| {
        let seconds: Vec<u32> = (end..=last).step_by(1000).collect();
        let ok = |from: u32| p99(within(from, from + 1000)).is_none_or(|p| p <= bar);
        let first_bad_from_end = seconds.iter().rposition(|&s| !ok(s));
        let from = match first_bad_from_end {
            None => end,
            Some(k) => seconds.get(k + 1).copied()?,
        };
        Some(Duration::from_millis(u64::from(from - end)))
    });
    BurstReport {
        p99_before: before,
        p99_during: p99(within(start, end_ms)),
        p99_after: end.and_then(|e| p99(within(e, u32::MAX))),
        normal_after,
        ..BurstReport::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_back_to_normal_from_the_first_second_that_stays_under_the_bar() {
        let ms = Duration::from_millis;
        // 5 ms before the burst (at 10 s), 900 ms during it (to 12 s), then
        // two slow seconds, a fast one, a slow one, and fast ones.
        let mut timed: Vec<(u32, u32)> = (0..10_000).step_by(10).map(|t| (t, 5_000)).collect();
        timed.extend((10_000..12_000).step_by(10).map(|t| (t, 900_000)));
        for (second, us) in [(12, 300_000), (13, 300_000), (14, 5_000), (15, 200_000)] {
            timed.extend(
                (second * 1000..second * 1000 + 1000)
                    .step_by(10)
                    .map(|t| (t, us)),
            );
        }
        timed.extend((16_000..20_000).step_by(10).map(|t| (t, 5_000)));
        let r = burst_latency(&timed, 10_000, Some(12_000));
        assert_eq!(r.p99_before, Some(ms(5)));
        assert_eq!(r.p99_during, Some(ms(900)));
        assert_eq!(r.p99_after, Some(ms(300)));
        // The bar is 50 ms (twice 5 ms is less); the slow second at 15 s
        // counts, so normal from 16 s: 4 s after the burst.
        assert_eq!(r.normal_after, Some(ms(4_000)));
        // Never back within the samples.
        timed.push((20_500, 400_000));
        assert_eq!(
            burst_latency(&timed, 10_000, Some(12_000)).normal_after,
            None
        );
        // Not over within the window: nothing after it.
        let r = burst_latency(&timed, 10_000, None);
        assert_eq!((r.p99_after, r.normal_after), (None, None));
    }
}
