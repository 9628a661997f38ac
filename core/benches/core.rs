//! Throughput and memory of the core at scale: 1,000,000 users and 2,000,000
//! devices resident. Prints a table; no number is asserted anywhere.
//!
//! `cargo bench -p greendot-core --bench core` (add `-- --users N` for a
//! smaller run). Every rate is also given as a ratio to a baseline measured in
//! the same run: the cost of one random read in a 2,000,000-entry array, the
//! physical floor of any input that touches one session.
//!
//! Each rate is given twice: per second of wall clock, and per second this
//! thread was on a CPU (`CLOCK_THREAD_CPUTIME_ID`, 64-bit Linux only). On a shared machine the wall
//! clock also counts the time other processes had the CPU, unevenly between
//! the baseline and the measurement, so only the on-CPU ratios compare
//! across runs there. The load average at the start is printed with the
//! table.

use greendot_core::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use std::time::Instant;

/// Counts live heap bytes, to measure bytes per resident device.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// xorshift64*: the bench's own randomness (the core has none).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

struct Row {
    what: String,
    count: u64,
    unit: &'static str,
    secs: f64,
    /// On-CPU seconds, where the system tells.
    cpu_secs: Option<f64>,
}

impl Row {
    fn rate(&self) -> f64 {
        self.count as f64 / self.secs
    }

    fn cpu_rate(&self) -> Option<f64> {
        self.cpu_secs.map(|cpu| self.count as f64 / cpu)
    }
}

/// Seconds this thread has spent on a CPU: `CLOCK_THREAD_CPUTIME_ID`, which
/// counts to the nanosecond (the thread's schedstat in `/proc` lags by up to
/// a scheduler tick, too coarse for the phases of a few milliseconds).
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn cpu_secs() -> Option<f64> {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec of the platform's layout.
    let ok = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
    ok.then(|| ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9)
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn cpu_secs() -> Option<f64> {
    None
}

fn timed(what: impl Into<String>, unit: &'static str, f: impl FnOnce() -> u64) -> Row {
    let cpu_start = cpu_secs();
    let start = Instant::now();
    let count = f();
    let secs = start.elapsed().as_secs_f64();
    let cpu_secs = cpu_start.zip(cpu_secs()).map(|(a, b)| b - a);
    Row {
        what: what.into(),
        count,
        unit,
        secs,
        cpu_secs,
    }
}

fn drain(core: &mut Core) -> u64 {
    let mut n = 0;
    while let Some(o) = core.poll_output() {
        black_box(&o);
        n += 1;
    }
    n
}

fn connect(core: &mut Core, now: u64, user: u64, device: u64, kind: DeviceKind) -> SessionId {
    let c = Connect {
        user: UserId(user),
        device: DeviceId(device),
        kind,
        watch: Watch::All,
        resume: None,
        foreground: true,
    };
    match core.handle_connect(Millis(now), c) {
        Ok(c) => c.session,
        Err(e) => panic!("bench setup: connect refused: {e}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let users: u64 = args
        .iter()
        .position(|a| a == "--users")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000);
    let devices = users * 2;
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".to_string());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rows = Vec::new();

    // Baseline: one dependent random read per step in an array as large as
    // the session table.
    let table: Vec<u64> = (0..devices).map(|_| rng.next()).collect();
    let steps = 10_000_000u64;
    let baseline = timed("baseline: random read in a 2M array", "reads", || {
        let mut at = 0usize;
        for _ in 0..steps {
            at = (table[at] ^ at as u64) as usize % table.len();
        }
        black_box(at);
        steps
    });
    drop(table);

    let config = Config {
        max_sessions: (devices * 2) as usize,
        max_users: (users * 2) as usize,
        ..Config::default()
    };
    let mut core = match Core::new(config) {
        Ok(core) => core,
        Err(e) => panic!("{e}"),
    };

    // 1. Resident set: every user on a phone and a laptop. The laptops of the
    // first 1% connect at t=0, the rest at t=10 s, so that at t=60 s exactly
    // 1% of the devices are past their heartbeat deadline.
    let heap_before = LIVE.load(Relaxed);
    let expiring = users / 100;
    let mut phones = Vec::with_capacity(users as usize);
    let mut laptops = Vec::with_capacity(users as usize);
    let setup = timed("connect (resident set)", "inputs", || {
        for u in 0..expiring {
            laptops.push(connect(&mut core, 0, u, 2, DeviceKind::Desktop));
        }
        for u in 0..users {
            phones.push(connect(&mut core, 10_000, u, 1, DeviceKind::Mobile));
        }
        for u in expiring..users {
            laptops.push(connect(&mut core, 10_000, u, 2, DeviceKind::Desktop));
        }
        drain(&mut core);
        devices
    });
    // Publish everyone's arrival so the set is at rest.
    core.handle_timeout(Millis(10_400));
    drain(&mut core);
    let heap = LIVE.load(Relaxed) - heap_before;
    let bytes_per_device = heap as f64 / devices as f64;
    rows.push(setup);
    // Sessions that keep talking (not the 1% that will expire).
    let talking: Vec<SessionId> = phones
        .iter()
        .chain(&laptops[expiring as usize..])
        .copied()
        .collect();

    // 2. Activity on random sessions.
    let picks: Vec<SessionId> = (0..10_000_000)
        .map(|_| talking[rng.below(talking.len())])
        .collect();
    rows.push(timed("activity (random session)", "inputs", || {
        for (i, &s) in picks.iter().enumerate() {
            let now = 10_400 + (i as u64 >> 20);
            if core.handle_activity(Millis(now), s).is_err() {
                panic!("activity refused");
            }
        }
        picks.len() as u64
    }));
    drop(picks);

    // 3. SetStatus of users with 20 realtime subscribers each.
    let hot = 2_000u64;
    let mut now = 20_000u64;
    for h in 0..hot {
        for k in 0..20 {
            let watcher = talking[((h * 7919 + k * 104_729) % (talking.len() as u64)) as usize];
            if core
                .handle_subscribe(Millis(now), watcher, UserId(users - 1 - h), Tier::Realtime)
                .is_err()
            {
                panic!("subscribe refused");
            }
        }
    }
    drain(&mut core);
    let rounds = 50u64;
    let debounce = core.config().debounce.0;
    let mut status_changes = 0;
    rows.push(timed(
        "set status, 20 realtime subscribers",
        "notifications",
        || {
            let mut pushed = 0;
            for round in 0..rounds {
                let status = if round % 2 == 0 {
                    Status::Busy
                } else {
                    Status::Available
                };
                for h in 0..hot {
                    let s = phones[(users - 1 - h) as usize];
                    if core
                        .handle_set_status(Millis(now), s, status, None)
                        .is_err()
                    {
                        panic!("set status refused");
                    }
                    status_changes += 1;
                }
                now += debounce;
                core.handle_timeout(Millis(now));
                pushed += drain(&mut core);
            }
            pushed
        },
    ));
    let notify_row = rows.last().map(|r| (r.count, r.secs)).unwrap_or((0, 1.0));

    // 4. Login storm: new devices connect and subscribe to 20 targets each,
    // every subscribe answered with a snapshot.
    let logins = 100_000u64;
    let heap_before_storm = LIVE.load(Relaxed);
    let storm = timed("login storm: connect + 20 subscribes", "inputs", || {
        let mut inputs = 0;
        for i in 0..logins {
            let user = rng.below(users as usize) as u64;
            let s = connect(&mut core, now, user, 3 + i, DeviceKind::Web);
            for _ in 0..20 {
                let target = UserId(rng.below(users as usize) as u64);
                match core.handle_subscribe(Millis(now), s, target, Tier::Batched) {
                    Ok(snapshot) => {
                        black_box(snapshot);
                    }
                    Err(e) => panic!("login storm subscribe refused: {e}"),
                }
            }
            inputs += 21;
            drain(&mut core);
        }
        inputs
    });
    let logins_per_sec = logins as f64 / storm.secs;
    let logins_per_cpu_sec = storm.cpu_secs.map(|cpu| logins as f64 / cpu);
    let bytes_per_login = (LIVE.load(Relaxed) - heap_before_storm) as f64 / logins as f64;
    rows.push(storm);
    // Let the storm's debounces and batches run out, so that the expiry
    // measurement below does expiry only.
    core.handle_timeout(Millis(now + 5_000));
    drain(&mut core);

    // 5. handle_timeout when 1% of the devices expire (the laptops that
    // connected at t=0 and never spoke again).
    let before = core.counters().ghosts_reaped;
    let t_expire = 60_000;
    let mut expired = 0;
    let expiry = timed(
        "handle_timeout, 1% of devices expiring",
        "expired devices",
        || {
            core.handle_timeout(Millis(t_expire));
            drain(&mut core);
            expired = core.counters().ghosts_reaped - before;
            expired
        },
    );
    rows.push(expiry);
    let idle = timed("handle_timeout, nothing due", "calls", || {
        for _ in 0..1_000_000 {
            core.handle_timeout(Millis(t_expire));
        }
        1_000_000
    });
    rows.push(idle);

    println!();
    println!("greendot-core, {users} users, {devices} devices resident; load average {load} at the start");
    println!();
    println!("| measurement | count | unit | rate (/s) | vs. baseline | rate per CPU second | vs. baseline, on-CPU |");
    println!("|---|---:|---|---:|---:|---:|---:|");
    let base = baseline.rate();
    let cpu_base = baseline.cpu_rate();
    for row in std::iter::once(&baseline).chain(&rows) {
        let (cpu_rate, cpu_ratio) = match (row.cpu_rate(), cpu_base) {
            (Some(rate), Some(base)) => (
                format!("{:.2} M", rate / 1e6),
                format!("{:.2}", rate / base),
            ),
            _ => ("-".to_string(), "-".to_string()),
        };
        println!(
            "| {} | {} | {} | {:.2} M | {:.2} | {cpu_rate} | {cpu_ratio} |",
            row.what,
            row.count,
            row.unit,
            row.rate() / 1e6,
            row.rate() / base
        );
    }
    println!();
    println!(
        "heap per resident device: {bytes_per_device:.0} bytes ({:.0} MiB for {devices} devices)",
        heap as f64 / (1 << 20) as f64
    );
    println!(
        "login storm: {logins_per_sec:.0} logins/s ({} per CPU second; 21 inputs each); heap per login (one session, 20 subscriptions): {bytes_per_login:.0} bytes",
        logins_per_cpu_sec.map_or("-".to_string(), |r| format!("{r:.0}"))
    );
    println!(
        "set status: {status_changes} changes -> {} notifications in {:.3} s",
        notify_row.0, notify_row.1
    );
    println!("expiry: {expired} devices reaped in one handle_timeout call");
}
