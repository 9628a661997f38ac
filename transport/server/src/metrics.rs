//! Metrics in the Prometheus text format: the core's counters, the
//! transport's counters, and a fixed-bucket histogram of push latency.

use greendot_core::Counters;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in microseconds.
pub const BOUNDS_US: [u64; 14] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000,
];

/// A histogram with fixed buckets; lock-free.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = BOUNDS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(BOUNDS_US.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Cumulative counts per bucket (the last is +Inf), and the sum in µs.
    pub fn snapshot(&self) -> (Vec<u64>, u64) {
        let mut total = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Ordering::Relaxed);
                total
            })
            .collect();
        (cumulative, self.sum_us.load(Ordering::Relaxed))
    }
}

/// Everything the metrics page shows, gathered at one moment.
#[derive(Clone, Debug, Default)]
pub struct MetricsSnapshot {
    pub counters: Counters,
    pub connections_open: u64,
    /// Of them, WebSocket connections.
    pub connections_open_websocket: u64,
    /// Of them, WebTransport sessions.
    pub connections_open_webtransport: u64,
    pub connections_total: u64,
    pub migrations: u64,
    pub overloaded: u64,
    pub rejected: BTreeMap<String, u64>,
    pub latency: (Vec<u64>, u64),
    pub store_errors: u64,
    /// User names the hub holds (each with at most one core record).
    pub users_known: u64,
    /// User and device names the hub holds.
    pub names: u64,
    /// New connections shed, by reason (see [`super::Shed`]).
    pub shed: Vec<(&'static str, u64)>,
    /// WebSocket connections dropped before their hello, by reason (see
    /// [`crate::WsShed`]).
    pub websocket_shed: Vec<(&'static str, u64)>,
    /// WebSocket connections admitted that have not said hello yet.
    pub websocket_pending: u64,
    /// Handshakes that ended before completing, not for bad input.
    pub handshakes_aborted: u64,
    pub handshakes_in_flight: u64,
    /// The admission rate now, handshakes per second: the configured one,
    /// lowered while the loop is overloaded.
    pub admission_rate: u64,
    /// Load reports that cut the admission rate.
    pub admission_cuts: u64,
    /// The loop's busy share of wall time in the last load report (0-1).
    pub loop_busy: f64,
    /// Durations of the loop's passes.
    pub loop_pass: (Vec<u64>, u64),
    pub loop_carried: u64,
    /// The socket as the kernel sees it (Linux only).
    pub udp: Option<UdpSocketStats>,
    /// The cluster data path (with a cluster only).
    pub cluster: Option<ClusterMetrics>,
}

/// What the metrics page shows of the cluster data path.
#[derive(Clone, Debug, Default)]
pub struct ClusterMetrics {
    pub counters: crate::cluster::ClusterCounters,
    /// Outputs for the NATS I/O dropped at its full queue.
    pub dropped: u64,
    /// Owner's publish to this edge's fanout, in milliseconds of the two
    /// nodes' wall clocks.
    pub latency: (Vec<u64>, u64),
}

impl MetricsSnapshot {
    /// How many new connections were shed for `reason` (a label).
    pub fn shed(&self, reason: &str) -> u64 {
        self.shed
            .iter()
            .find(|(label, _)| *label == reason)
            .map_or(0, |(_, n)| *n)
    }
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

/// A histogram in the Prometheus text format.
fn histogram(out: &mut String, name: &str, help: &str, (cumulative, sum_us): &(Vec<u64>, u64)) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (i, count) in cumulative.iter().enumerate() {
        let le = match BOUNDS_US.get(i) {
            Some(b) => format!("{}", *b as f64 / 1e6),
            None => "+Inf".to_owned(),
        };
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {count}");
    }
    let _ = writeln!(out, "{name}_sum {}", *sum_us as f64 / 1e6);
    let _ = writeln!(
        out,
        "{name}_count {}",
        cumulative.last().copied().unwrap_or(0)
    );
}

/// The kernel's view of the server's UDP socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdpSocketStats {
    /// Datagrams dropped on a full receive buffer, since the socket opened.
    pub drops: u64,
    /// Bytes waiting to be read.
    pub rx_queue: u64,
}

impl UdpSocketStats {
    /// The socket with this inode in `/proc/net/udp` or `/proc/net/udp6`.
    pub fn read(inode: u64) -> Option<UdpSocketStats> {
        ["/proc/net/udp", "/proc/net/udp6"].iter().find_map(|path| {
            let text = std::fs::read_to_string(path).ok()?;
            UdpSocketStats::parse(&text, inode)
        })
    }

    /// Columns: sl local rem st tx_queue:rx_queue tr:when retrnsmt uid
    /// timeout inode ref pointer drops.
    fn parse(text: &str, inode: u64) -> Option<UdpSocketStats> {
        text.lines().skip(1).find_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.get(9)?.parse::<u64>().ok()? != inode {
                return None;
            }
            let rx = cols.get(4)?.split(':').nth(1)?;
            Some(UdpSocketStats {
                drops: cols.get(12)?.parse().ok()?,
                rx_queue: u64::from_str_radix(rx, 16).ok()?,
            })
        })
    }
}

impl MetricsSnapshot {
    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let c = &self.counters;
        let mut out = String::new();
        metric(
            &mut out,
            "greendot_users_online",
            "gauge",
            "Users really online (some device online or lingering).",
            &[("", c.users_online)],
        );
        metric(
            &mut out,
            "greendot_devices",
            "gauge",
            "Devices by state.",
            &[
                ("state=\"online\"", c.sessions_online),
                ("state=\"lingering\"", c.sessions_lingering),
            ],
        );
        metric(
            &mut out,
            "greendot_sessions",
            "gauge",
            "Live sessions (online or lingering).",
            &[("", c.sessions_online + c.sessions_lingering)],
        );
        metric(
            &mut out,
            "greendot_sessions_started_total",
            "counter",
            "Sessions started.",
            &[("", c.sessions_started)],
        );
        metric(
            &mut out,
            "greendot_sessions_ended_total",
            "counter",
            "Sessions ended, by reason.",
            &[
                ("reason=\"logout\"", c.logouts),
                ("reason=\"superseded\"", c.superseded),
                ("reason=\"heartbeat_timeout\"", c.ghosts_reaped),
                ("reason=\"grace_expired\"", c.grace_expired),
            ],
        );
        metric(
            &mut out,
            "greendot_resumed_total",
            "counter",
            "Lingering sessions resumed by a reconnect.",
            &[("", c.resumed)],
        );
        metric(
            &mut out,
            "greendot_disconnects_total",
            "counter",
            "Connections lost without a logout.",
            &[("", c.disconnects)],
        );
        metric(
            &mut out,
            "greendot_users_known",
            "gauge",
            "Users the server keeps a record of (live, watched, or with saved state).",
            &[("", self.users_known)],
        );
        metric(
            &mut out,
            "greendot_names",
            "gauge",
            "User and device names held.",
            &[("", self.names)],
        );
        metric(
            &mut out,
            "greendot_connections",
            "gauge",
            "Open connections by binding (raw QUIC, WebTransport, WebSocket).",
            &[
                (
                    "binding=\"quic\"",
                    self.connections_open
                        .saturating_sub(self.connections_open_websocket)
                        .saturating_sub(self.connections_open_webtransport),
                ),
                (
                    "binding=\"webtransport\"",
                    self.connections_open_webtransport,
                ),
                ("binding=\"websocket\"", self.connections_open_websocket),
            ],
        );
        metric(
            &mut out,
            "greendot_connections_total",
            "counter",
            "Connections accepted (every binding).",
            &[("", self.connections_total)],
        );
        metric(
            &mut out,
            "greendot_migrations_total",
            "counter",
            "Connection migrations (a client's address changed).",
            &[("", self.migrations)],
        );
        metric(
            &mut out,
            "greendot_ghosts_reaped_total",
            "counter",
            "Online devices reaped after their heartbeat timeout.",
            &[("", c.ghosts_reaped)],
        );
        metric(
            &mut out,
            "greendot_flaps_suppressed_total",
            "counter",
            "Debounce windows that ended with nothing new to publish.",
            &[("", c.flaps_suppressed)],
        );
        metric(
            &mut out,
            "greendot_publishes_total",
            "counter",
            "Changes published to subscribers.",
            &[("", c.publishes)],
        );
        metric(
            &mut out,
            "greendot_notifications_total",
            "counter",
            "Notifications sent, by tier.",
            &[
                ("tier=\"realtime\"", c.notifications_realtime),
                ("tier=\"batched\"", c.notifications_batched),
                ("tier=\"snapshot\"", c.snapshots),
            ],
        );
        metric(
            &mut out,
            "greendot_limits_hit_total",
            "counter",
            "Requests refused by a configured cap.",
            &[("", c.limits_hit)],
        );
        metric(
            &mut out,
            "greendot_stale_inputs_total",
            "counter",
            "Inputs naming a session that was no longer current.",
            &[("", c.stale_inputs)],
        );
        let rejected: Vec<(String, u64)> = self
            .rejected
            .iter()
            .map(|(reason, n)| (format!("reason=\"{reason}\""), *n))
            .collect();
        let rejected: Vec<(&str, u64)> = rejected.iter().map(|(l, n)| (l.as_str(), *n)).collect();
        metric(
            &mut out,
            "greendot_rejected_total",
            "counter",
            "Connections refused or closed for bad input, by reason.",
            &rejected,
        );
        metric(
            &mut out,
            "greendot_handshakes_aborted_total",
            "counter",
            "Handshakes cut short (the client's network went away, it gave up): not bad input.",
            &[("", self.handshakes_aborted)],
        );
        metric(
            &mut out,
            "greendot_overloaded_total",
            "counter",
            "Connections closed because the client did not read its pushes.",
            &[("", self.overloaded)],
        );
        metric(
            &mut out,
            "greendot_store_errors_total",
            "counter",
            "Failed writes to the durable store.",
            &[("", self.store_errors)],
        );
        let shed: Vec<(String, u64)> = self
            .shed
            .iter()
            .map(|(reason, n)| (format!("reason=\"{reason}\""), *n))
            .collect();
        let shed: Vec<(&str, u64)> = shed.iter().map(|(l, n)| (l.as_str(), *n)).collect();
        metric(
            &mut out,
            "greendot_shed_total",
            "counter",
            "New connections shed instead of served, by reason: retry (sent a QUIC Retry), \
             per_address, capacity, rate (admission rate), handshake_timeout, draining.",
            &shed,
        );
        let ws_shed: Vec<(String, u64)> = self
            .websocket_shed
            .iter()
            .map(|(reason, n)| (format!("reason=\"{reason}\""), *n))
            .collect();
        let ws_shed: Vec<(&str, u64)> = ws_shed.iter().map(|(l, n)| (l.as_str(), *n)).collect();
        metric(
            &mut out,
            "greendot_websocket_shed_total",
            "counter",
            "WebSocket connections dropped before their hello, by reason: rate (admission \
             rate), per_address, capacity (too many waiting for their hello), hello_timeout \
             (no TLS, upgrade and hello in time), hello_too_large.",
            &ws_shed,
        );
        metric(
            &mut out,
            "greendot_websocket_pending",
            "gauge",
            "WebSocket connections admitted that have not said hello yet (they hold no \
             connection slot).",
            &[("", self.websocket_pending)],
        );
        metric(
            &mut out,
            "greendot_handshakes_in_flight",
            "gauge",
            "Handshakes (and hellos) in progress.",
            &[("", self.handshakes_in_flight)],
        );
        metric(
            &mut out,
            "greendot_admission_rate",
            "gauge",
            "New handshakes admitted per second at most now: max_handshakes_per_sec, cut while \
             the socket drops datagrams or passes of the loop read their whole datagram budget.",
            &[("", self.admission_rate)],
        );
        metric(
            &mut out,
            "greendot_admission_cuts_total",
            "counter",
            "Load reports (every 250 ms) that cut the admission rate.",
            &[("", self.admission_cuts)],
        );
        let _ = writeln!(
            out,
            "# HELP greendot_loop_busy_ratio Share of the time since the previous load report (every 250 ms or more) the server's loop spent working rather than waiting.\n\
             # TYPE greendot_loop_busy_ratio gauge\ngreendot_loop_busy_ratio {}",
            self.loop_busy
        );
        histogram(
            &mut out,
            "greendot_push_latency_seconds",
            "From the server's loop taking a change (an input or a due timer) \
             to its push being written to the connection (debounce and batch waits excluded).",
            &self.latency,
        );
        if let Some(cl) = &self.cluster {
            let c = &cl.counters;
            metric(
                &mut out,
                "greendot_cluster_forwarded_inputs_total",
                "counter",
                "Device inputs this edge sent to their owner: over NATS (remote) or in process (local), retries included.",
                &[("to=\"remote\"", c.forwarded), ("to=\"local\"", c.forwarded_local)],
            );
            metric(
                &mut out,
                "greendot_cluster_owner_inputs_total",
                "counter",
                "Device inputs this node took as owner from other edges.",
                &[("", c.owner_inputs)],
            );
            metric(
                &mut out,
                "greendot_cluster_views_published_total",
                "counter",
                "Views published on shard subjects (each once, whoever watches).",
                &[("", c.published)],
            );
            metric(
                &mut out,
                "greendot_cluster_truths_sent_total",
                "counter",
                "Users' truths sent to the other nodes holding their devices (for the users' own sessions).",
                &[("", c.truths_sent)],
            );
            metric(
                &mut out,
                "greendot_cluster_views_applied_total",
                "counter",
                "Views from other nodes taken by this edge's fanout (newer than what it knew).",
                &[("", c.views_applied)],
            );
            metric(
                &mut out,
                "greendot_cluster_retries_total",
                "counter",
                "Requests to an owner asked again: refused (not the owner, device unknown) or unanswered.",
                &[("", c.retries)],
            );
            metric(
                &mut out,
                "greendot_cluster_resyncs_total",
                "counter",
                "New owners' resync requests this edge answered by resending its devices of the shard.",
                &[("", c.resyncs)],
            );
            metric(
                &mut out,
                "greendot_cluster_edge_lost_devices_total",
                "counter",
                "Devices this node's owners moved to lingering because their edge's lease went.",
                &[("", c.edge_lost_devices)],
            );
            metric(
                &mut out,
                "greendot_cluster_stale_incarnation_total",
                "counter",
                "Device inputs of an edge's previous run, dropped because a newer run of it was known.",
                &[("", c.stale_incarnation)],
            );
            metric(
                &mut out,
                "greendot_cluster_stale_connects_total",
                "counter",
                "Connects that reached the owner after a later session of the same device (welcomed later at the same node, or more than 3 s later at another): not taken.",
                &[("", c.stale_connects)],
            );
            metric(
                &mut out,
                "greendot_cluster_view_gaps_total",
                "counter",
                "Times this edge missed a view of a watched shard (a gap in its numbers, or a beacon ahead) and asked the owner for the shard's views again.",
                &[("", c.view_gaps)],
            );
            metric(
                &mut out,
                "greendot_cluster_silent_shards_total",
                "counter",
                "Times a watched shard's owner was not heard of for 3 s (no view, beacon or answer): this edge asked for the shard's views again, answering none from what it held until then.",
                &[("", c.silent_shards)],
            );
            metric(
                &mut out,
                "greendot_cluster_truth_gaps_total",
                "counter",
                "Times this edge missed a truth an owner sent it (a gap in their numbers, or a beacon ahead) and asked for the truths of the shard's users with a session here again.",
                &[("", c.truth_gaps)],
            );
            metric(
                &mut out,
                "greendot_cluster_resumed_elsewhere_total",
                "counter",
                "Sessions resumed here from another node's (or a previous process's) session record, their subscriptions carried over.",
                &[("", c.resumed_elsewhere)],
            );
            metric(
                &mut out,
                "greendot_cluster_session_writes_failed_total",
                "counter",
                "Session record writes the KV refused or did not answer (tried again; a subscribe waits for its record at most a request timeout).",
                &[("", c.session_writes_failed)],
            );
            metric(
                &mut out,
                "greendot_cluster_users_released_total",
                "counter",
                "Users this node's owners freed after a minute without a device (read back from the KV at their next input or snapshot).",
                &[("", c.users_released)],
            );
            metric(
                &mut out,
                "greendot_cluster_malformed_total",
                "counter",
                "Messages from NATS dropped: undecodable, too large, bad names or the wrong shard.",
                &[("", c.malformed)],
            );
            metric(
                &mut out,
                "greendot_cluster_dropped_total",
                "counter",
                "Outputs for the NATS I/O dropped at its full queue.",
                &[("", cl.dropped)],
            );
            histogram(
                &mut out,
                "greendot_cluster_view_latency_seconds",
                "From the owner publishing a view to this edge's fanout taking it (wall clocks of \
                 both nodes, millisecond resolution).",
                &cl.latency,
            );
        }
        histogram(
            &mut out,
            "greendot_loop_pass_seconds",
            "Duration of each pass of the server's loop (read the socket, timers, connections): \
             how long a datagram may wait to be read once the loop is busy.",
            &self.loop_pass,
        );
        metric(
            &mut out,
            "greendot_loop_carried_total",
            "counter",
            "Passes that left work (due timers, busy connections) to the next pass.",
            &[("", self.loop_carried)],
        );
        if let Some(udp) = &self.udp {
            metric(
                &mut out,
                "greendot_udp_receive_drops_total",
                "counter",
                "Datagrams the kernel dropped because the server's socket buffer was full \
                 (from /proc/net/udp).",
                &[("", udp.drops)],
            );
            metric(
                &mut out,
                "greendot_udp_receive_queue_bytes",
                "gauge",
                "Bytes waiting in the server's socket receive buffer.",
                &[("", udp.rx_queue)],
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_renders() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(50));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(10));
        let (cumulative, _) = h.snapshot();
        assert_eq!(cumulative[0], 1);
        assert_eq!(cumulative[BOUNDS_US.len()], 3);
        let text = MetricsSnapshot {
            latency: h.snapshot(),
            ..Default::default()
        }
        .render();
        assert!(text.contains("greendot_push_latency_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("greendot_devices{state=\"lingering\"} 0"));
        assert!(text.contains("greendot_users_known 0"));
        assert!(text.contains("greendot_handshakes_aborted_total 0"));
    }

    #[test]
    fn udp_drops_are_read_from_the_sockets_line() {
        let text = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n\
  1: 00000000:1151 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 1111 2 0000000000000000 0\n\
  2: 0100007F:D2C3 00000000:0000 07 00000000:00003F00 00:00000000 00000000     0        0 4242 2 0000000000000000 17\n";
        assert_eq!(
            UdpSocketStats::parse(text, 4242),
            Some(UdpSocketStats {
                drops: 17,
                rx_queue: 0x3f00
            })
        );
        assert_eq!(UdpSocketStats::parse(text, 9), None);
    }
}
