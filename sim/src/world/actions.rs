//! What the world does to its clients: the actions of their apps, and the
//! faults of their paths (disruptions, migrations) and of the host.

use super::*;

impl Sim {
    pub(super) fn act(&mut self) -> Result<(), String> {
        let i = self.rng.index(self.clients.len());
        let now = self.now;
        let instant = self.instant();
        let users = self.users.len();
        let welcomed = self.clients[i]
            .live
            .as_ref()
            .is_some_and(|l| l.is_open() && l.welcomed.is_some() && !l.logout_sent);
        if !welcomed {
            return Ok(());
        }
        let roll = self.rng.below(100);
        let request = match roll {
            0..=24 => {
                let n = self.rng.range(1, 3);
                let tier = if self.rng.chance(0.5) {
                    Tier::Realtime
                } else {
                    Tier::Batched
                };
                let targets: Vec<usize> = (0..n).map(|_| self.rng.index(users)).collect();
                for &t in &targets {
                    self.devices[i].wanted.insert(t, tier);
                }
                Some(Request::Subscribe {
                    targets: targets.iter().map(|t| format!("u{t}")).collect(),
                    tier,
                })
            }
            25..=29 => {
                let subs: Vec<usize> = self.devices[i].subs.keys().copied().collect();
                if subs.is_empty() {
                    None
                } else {
                    let t = subs[self.rng.index(subs.len())];
                    Some(Request::Unsubscribe {
                        target: format!("u{t}"),
                    })
                }
            }
            30..=49 => {
                let status = [
                    Status::Available,
                    Status::Away,
                    Status::Busy,
                    Status::DoNotDisturb,
                ][self.rng.index(4)];
                let message = if self.rng.chance(0.5) {
                    Some(format!("m{}", self.rng.below(1000)))
                } else {
                    None
                };
                Some(Request::SetStatus { status, message })
            }
            50..=57 => {
                let invisible = self.rng.chance(0.4);
                let user = self.clients[i].user;
                let truth = &mut self.users[user];
                truth.visible_since = None;
                truth.invisible_acked = None;
                truth.ambiguous |= truth.in_flight > 0;
                truth.in_flight += 1;
                Some(Request::SetInvisible { invisible })
            }
            58..=64 => Some(Request::Query {
                targets: vec![format!("u{}", self.rng.index(users))],
            }),
            65..=69 => Some(Request::Ping),
            70..=74 => Some(Request::Logout),
            75..=81 => {
                self.note(format!("c{i} killed"));
                self.faults.kills += 1;
                self.drop_pending(i);
                self.clients[i].kill();
                // Its next connection comes from a new socket: the old one
                // answers nothing (not even a stateless reset).
                let addr = self.new_address(i);
                self.clients[i].addr = addr;
                let device = &mut self.devices[i];
                device.welcomed_at = None;
                device.subs.clear();
                device.absent_since = Some(now);
                device.resume = true;
                device.reconnect_at =
                    Some(now + Duration::from_millis(self.rng.range(200, 150_000)));
                None
            }
            82..=86 => {
                self.note(format!("c{i} closes (lingers)"));
                self.clients[i].close(instant, CloseCode::Normal);
                let device = &mut self.devices[i];
                device.closing = true;
                device.absent_since = Some(now);
                device.resume = true;
                device.reconnect_at =
                    Some(now + Duration::from_millis(self.rng.range(100, 60_000)));
                None
            }
            _ => {
                self.migrate(i);
                None
            }
        };
        if let Some(request) = request {
            let id = self.clients[i].request(now, request.clone());
            self.note(format!("c{i} asks {request:?} (id {id:?})"));
        }
        Ok(())
    }

    /// The requests of a connection that is gone will never be answered.
    pub(super) fn drop_pending(&mut self, i: usize) {
        let user = self.clients[i].user;
        if let Some(live) = self.clients[i].live.as_mut() {
            for p in std::mem::take(&mut live.pending).into_values() {
                if matches!(p.request, Request::SetInvisible { .. }) {
                    let truth = &mut self.users[user];
                    truth.in_flight = truth.in_flight.saturating_sub(1);
                    truth.tainted_until =
                        truth.tainted_until.max(self.now + Duration::from_secs(90));
                }
            }
        }
    }

    /// A fresh address (a new socket), not counted as a migration.
    pub(super) fn new_address(&mut self, i: usize) -> SocketAddr {
        self.next_port = self.next_port.wrapping_add(1).max(1000);
        let old = self.clients[i].addr;
        let new = SocketAddr::from((Ipv4Addr::new(10, 1, 0, i as u8 + 1), self.next_port));
        self.addrs.remove(&old);
        self.addrs.insert(new, i);
        new
    }

    /// Client `i` can neither send nor receive (or read) for `len`.
    pub(super) fn disrupt(&mut self, i: usize, len: Duration) {
        let now = self.now;
        let device = &mut self.devices[i];
        if device.disrupted_until <= now {
            device.disrupted_from = now;
        }
        device.disrupted_until = device.disrupted_until.max(now + len);
        // Found by seed 16: after a partition of tens of seconds, the RTT
        // estimate of a connection that then only exchanges keep-alives and
        // ACK-only packets (no new RTT samples) stays inflated for minutes,
        // so a lost push is retransmitted ~10 s later, each time. The link
        // counts as recovered only after 20 times the disruption (at most
        // 10 minutes).
        let length = device.disrupted_until - device.disrupted_from;
        let settle = (length * 20).min(Duration::from_secs(600));
        device.recovered_at = device.recovered_at.max(device.disrupted_until + settle);
    }

    pub(super) fn migrate(&mut self, i: usize) {
        self.faults.migrations += 1;
        self.next_port = self.next_port.wrapping_add(1).max(1000);
        let old = self.clients[i].addr;
        let ip = if self.rng.chance(0.5) {
            Ipv4Addr::new(10, 2, self.rng.below(250) as u8, i as u8 + 1)
        } else {
            match old.ip() {
                std::net::IpAddr::V4(v4) => v4,
                std::net::IpAddr::V6(_) => Ipv4Addr::new(10, 1, 0, i as u8 + 1),
            }
        };
        let new = SocketAddr::from((ip, self.next_port));
        self.addrs.remove(&old);
        self.addrs.insert(new, i);
        self.clients[i].migrate(new);
        self.note(format!("c{i} moves {old} -> {new}"));
        // The new path is validated by one padded PATH_CHALLENGE; if it is
        // lost, the client's small packets do not lift the anti-amplification
        // limit, quinn-proto reverts to the old path and the client is cut
        // off until its idle timeout (it then reconnects and resumes). Until
        // then the client is not counted as healthy (answers and views may
        // lag), but nothing excuses the server closing it.
        let now = self.now;
        let device = &mut self.devices[i];
        if device.disrupted_until <= now {
            device.disrupted_from = now;
        }
        device.disrupted_until = device.disrupted_until.max(now);
        device.recovered_at = device.recovered_at.max(now + Duration::from_secs(40));
    }

    pub(super) fn fault(&mut self) -> Result<(), String> {
        let now = self.now;
        let i = self.rng.index(self.clients.len());
        let roll = self.rng.below(100);
        match roll {
            0..=17 => {
                let len = Duration::from_millis(self.rng.range(500, 60_000));
                self.faults.partitions += 1;
                self.links[i].partitioned_until = now + len;
                self.disrupt(i, len);
                self.note(format!("c{i} partitioned for {len:?}"));
            }
            18..=29 => {
                let len = Duration::from_millis(self.rng.range(500, 20_000));
                self.faults.deaf += 1;
                self.links[i].deaf_until = now + len;
                self.disrupt(i, len);
                self.note(format!("c{i} stops reading its socket for {len:?}"));
            }
            30..=39 => {
                let len = Duration::from_millis(self.rng.range(500, 30_000));
                self.faults.stalled_readers += 1;
                self.clients[i].stalled = true;
                self.disrupt(i, len);
                self.note(format!("c{i} stops reading its streams for {len:?}"));
            }
            40..=51 => {
                self.faults.link_changes += 1;
                let mut link = Link::random(&mut self.rng);
                link.partitioned_until = self.links[i].partitioned_until;
                link.deaf_until = self.links[i].deaf_until;
                self.note(format!("c{i} link now {link:?}"));
                self.links[i] = link;
            }
            52..=61 => self.migrate(i),
            62..=71 => {
                let len = Duration::from_millis(self.rng.range(500, 20_000));
                self.faults.store_failing += 1;
                self.store.mode = Mode::Failing { until: now + len };
                self.note(format!("store fails for {len:?}"));
            }
            72..=81 => {
                let len = Duration::from_millis(self.rng.range(500, 30_000));
                self.faults.store_stalls += 1;
                self.store.mode = Mode::Stalled { until: now + len };
                self.note(format!("store stalls for {len:?}"));
            }
            82..=85 => {
                if self.server.is_some() && self.draining.is_none() {
                    self.faults.drains += 1;
                    self.draining = Some(now);
                    self.note("server drains (restart)".into());
                    let instant = self.instant();
                    if let Some(server) = self.server.as_mut() {
                        server.handle_input(
                            instant,
                            ServerInput::Stop {
                                code: CloseCode::Draining,
                                text: b"server draining: reconnect and resume".to_vec(),
                                save: true,
                            },
                        );
                    }
                }
            }
            86..=88 => {
                if self.server.is_some() {
                    self.faults.crashes += 1;
                    self.note(format!("server epoch {} crashes", self.epoch));
                    self.server = None;
                    self.store.crash();
                    self.last_restart = Some(now);
                    self.draining = None;
                    self.down_until = Some(now + Duration::from_millis(self.rng.range(100, 5_000)));
                }
            }
            _ => {
                let large = self.opts.large_clock_jumps && self.rng.chance(0.3);
                let ms = if large {
                    self.rng.range(60_000, 3_600_000) as i64
                } else {
                    self.rng.range(1, 2_000) as i64
                };
                let jump = if self.rng.chance(0.5) { ms } else { -ms };
                self.faults.clock_jumps += 1;
                self.wall_offset += jump;
                if large {
                    self.last_clock_jump = Some(now);
                }
                let unix_ms = self.wall();
                self.note(format!("wall clock jumps {jump} ms"));
                let instant = self.instant();
                if let Some(server) = self.server.as_mut() {
                    server.handle_input(instant, ServerInput::SetWallClock { unix_ms });
                }
            }
        }
        Ok(())
    }
}
