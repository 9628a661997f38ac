//! greendot-core against the classic Redis presence design, on one workload.
//!
//! `cargo run --release -p greendot-bench --bin vs_redis` (`-- --users N` for a
//! quicker run, `-- --ops M` for the length of the mixed phase, default 10 per
//! user). Starts its own redis-server on a free loopback port (Debian's
//! package: `apt-get install -y redis-server`) and stops it at the end.
//!
//! The classic design: a key per device, `SET online:{user}:{device} {node}
//! EX ttl` on login, `EXPIRE` on heartbeat, `DEL` on logout, `PUBLISH` on a
//! change, presence read from the user's device keys (`MGET` of the known
//! devices and the status key). Driven from one Rust connection with unbounded
//! pipelining (a writer thread and a reader thread), so the client is never
//! the one waiting.
//!
//! greendot: the same operations as core inputs, in process, on a virtual
//! clock, expiry and debounce timers driven exactly as the server drives them
//! (`poll_timeout` after every input).
//!
//! Workload: every user has a phone and a laptop. Phase 1 logs every phone in
//! (1 login per user). Phase 2 is a replayed stream of `ops` operations:
//! 80% heartbeats, 10% queries, 4% status changes, 3% logins, 3% logouts, on
//! random devices. Nobody subscribes on either side (Redis has no subscriber
//! on the channels, greendot no watcher): this compares the presence state
//! itself; fan-out is measured end to end by `quic_load`.

use greendot_bench::plot::{self, Group};
use greendot_bench::resp::{self, Conn, RedisServer};
use greendot_bench::{arg, si, Rng};
use greendot_core::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use std::time::Instant;

/// Counts live heap bytes, for greendot's memory per device.
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

/// Key TTL of the Redis design, and the heartbeat timeout it stands for.
const TTL_SECS: u64 = 60;
/// Operations per second of virtual time for greendot's clock (about one
/// heartbeat per online device every 6 s at a million users).
const VIRTUAL_OPS_PER_SEC: u64 = 200_000;

/// A device is `user * 2 + d`: d = 0 phone, 1 laptop.
#[derive(Clone, Copy, Debug)]
enum Op {
    Login(u32),
    Logout(u32),
    Heartbeat(u32),
    Status(u32, u8),
    Query(u32, u32),
}

impl Op {
    fn commands(self) -> u64 {
        match self {
            Op::Heartbeat(_) | Op::Query(..) => 1,
            _ => 2,
        }
    }
}

/// A set of device ids with O(1) insert, remove and random pick.
struct Set {
    items: Vec<u32>,
    pos: Vec<u32>,
}

impl Set {
    fn new(capacity: usize) -> Set {
        Set {
            items: Vec::with_capacity(capacity),
            pos: vec![u32::MAX; capacity],
        }
    }
    fn insert(&mut self, x: u32) {
        self.pos[x as usize] = self.items.len() as u32;
        self.items.push(x);
    }
    fn remove(&mut self, x: u32) {
        let i = self.pos[x as usize] as usize;
        let last = self.items.len() - 1;
        self.items.swap(i, last);
        self.pos[self.items[i] as usize] = i as u32;
        self.items.pop();
        self.pos[x as usize] = u32::MAX;
    }
    fn pick(&self, rng: &mut Rng) -> Option<u32> {
        (!self.items.is_empty()).then(|| self.items[rng.below(self.items.len())])
    }
}

/// The mixed phase, generated once and replayed on both sides.
fn generate(users: u32, ops: usize, rng: &mut Rng) -> Vec<Op> {
    let devices = users as usize * 2;
    let mut online = Set::new(devices);
    let mut offline = Set::new(devices);
    for d in 0..devices as u32 {
        if d % 2 == 0 {
            online.insert(d);
        } else {
            offline.insert(d);
        }
    }
    let mut out = Vec::with_capacity(ops);
    while out.len() < ops {
        let roll = rng.below(100);
        let op = match roll {
            0..=79 => online.pick(rng).map(Op::Heartbeat),
            80..=89 => online
                .pick(rng)
                .map(|v| Op::Query(v, rng.below(users as usize) as u32)),
            90..=93 => online.pick(rng).map(|d| Op::Status(d, rng.below(4) as u8)),
            94..=96 => offline.pick(rng).map(|d| {
                offline.remove(d);
                online.insert(d);
                Op::Login(d)
            }),
            _ => online.pick(rng).map(|d| {
                online.remove(d);
                offline.insert(d);
                Op::Logout(d)
            }),
        };
        if let Some(op) = op {
            out.push(op);
        }
    }
    out
}

const STATUS: [Status; 4] = [
    Status::Available,
    Status::Away,
    Status::Busy,
    Status::DoNotDisturb,
];
const STATUS_NAMES: [&[u8]; 4] = [b"available", b"away", b"busy", b"dnd"];

struct Measured {
    login_secs: f64,
    mixed_secs: f64,
    bytes_per_device: f64,
    errors: u64,
}

fn progress(what: &str, done: u64, total: u64, last: &mut u64) {
    let step = (total / 10).max(1);
    if done / step != *last / step || done == total {
        eprint!("\r  {what}: {:>3}%", done * 100 / total.max(1));
        if done == total {
            eprintln!();
        }
        let _ = std::io::stderr().flush();
    }
    *last = done;
}

// ---------------------------------------------------------------- greendot

fn run_greendot(users: u32, ops: &[Op]) -> Measured {
    let devices = users as usize * 2;
    // The bench's own table of sessions is not the core's memory.
    let mut sessions = vec![SessionId(u64::MAX); devices];
    let heap0 = LIVE.load(Relaxed);
    let config = Config {
        max_sessions: devices * 2,
        max_users: users as usize * 2,
        ..Config::default()
    };
    let mut core = Core::new(config).unwrap_or_else(|e| panic!("{e}"));
    let mut errors = 0u64;
    let mut now = 0u64;
    let connect = |core: &mut Core, now: u64, d: u32| {
        core.handle_connect(
            Millis(now),
            Connect {
                user: UserId(u64::from(d / 2)),
                device: DeviceId(u64::from(d % 2)),
                kind: if d.is_multiple_of(2) {
                    DeviceKind::Mobile
                } else {
                    DeviceKind::Desktop
                },
                watch: Watch::All,
                resume: None,
                foreground: true,
            },
        )
        .map(|c| c.session)
    };
    fn tick(core: &mut Core, now: u64) {
        if core.poll_timeout().is_some_and(|t| t.0 <= now) {
            core.handle_timeout(Millis(now));
        }
        while core.poll_output().is_some() {}
    }

    eprintln!("greendot-core:");
    let start = Instant::now();
    let mut last = 0;
    for u in 0..users {
        let d = u * 2;
        match connect(&mut core, now, d) {
            Ok(s) => sessions[d as usize] = s,
            Err(_) => errors += 1,
        }
        tick(&mut core, now);
        if u % 65_536 == 0 {
            progress(
                "login every phone",
                u64::from(u),
                u64::from(users),
                &mut last,
            );
        }
    }
    let login_secs = start.elapsed().as_secs_f64();
    progress(
        "login every phone",
        u64::from(users),
        u64::from(users),
        &mut last,
    );
    // Let the arrivals' debounces run out, then measure the resident set.
    now += 1_000;
    core.handle_timeout(Millis(now));
    while core.poll_output().is_some() {}
    let bytes_per_device = (LIVE.load(Relaxed) - heap0) as f64 / f64::from(users);

    let base = now;
    let start = Instant::now();
    let total = ops.len() as u64;
    let mut last = 0;
    for (i, &op) in ops.iter().enumerate() {
        now = base + i as u64 * 1000 / VIRTUAL_OPS_PER_SEC;
        let result = match op {
            Op::Login(d) => connect(&mut core, now, d).map(|s| sessions[d as usize] = s),
            Op::Logout(d) => core.handle_logout(Millis(now), sessions[d as usize]),
            Op::Heartbeat(d) => core.handle_activity(Millis(now), sessions[d as usize]),
            Op::Status(d, s) => {
                core.handle_set_status(Millis(now), sessions[d as usize], STATUS[s as usize], None)
            }
            Op::Query(v, t) => core
                .handle_query(Millis(now), sessions[v as usize], UserId(u64::from(t)))
                .map(|p| {
                    std::hint::black_box(p);
                }),
        };
        if result.is_err() {
            errors += 1;
        }
        tick(&mut core, now);
        if i % 1_048_576 == 0 {
            progress("mixed operations", i as u64, total, &mut last);
        }
    }
    let mixed_secs = start.elapsed().as_secs_f64();
    progress("mixed operations", total, total, &mut last);
    drop(core);
    Measured {
        login_secs,
        mixed_secs,
        bytes_per_device,
        errors,
    }
}

// ------------------------------------------------------------------- redis

fn key_online(buf: &mut Vec<u8>, d: u32) {
    buf.clear();
    buf.extend_from_slice(b"online:");
    resp::push_decimal(buf, u64::from(d / 2));
    buf.push(b':');
    resp::push_decimal(buf, u64::from(d % 2));
}

fn key_user(buf: &mut Vec<u8>, prefix: &[u8], user: u32) {
    buf.clear();
    buf.extend_from_slice(prefix);
    resp::push_decimal(buf, u64::from(user));
}

/// Encodes the Redis commands of one operation.
fn encode_op(out: &mut Vec<u8>, op: Op, k1: &mut Vec<u8>, k2: &mut Vec<u8>, k3: &mut Vec<u8>) {
    let ttl = TTL_SECS.to_string();
    match op {
        Op::Login(d) => {
            key_online(k1, d);
            resp::encode(out, &[b"SET", k1, b"n1", b"EX", ttl.as_bytes()]);
            key_user(k2, b"presence:", d / 2);
            resp::encode(out, &[b"PUBLISH", k2, b"online"]);
        }
        Op::Logout(d) => {
            key_online(k1, d);
            resp::encode(out, &[b"DEL", k1]);
            key_user(k2, b"presence:", d / 2);
            resp::encode(out, &[b"PUBLISH", k2, b"offline"]);
        }
        Op::Heartbeat(d) => {
            key_online(k1, d);
            resp::encode(out, &[b"EXPIRE", k1, ttl.as_bytes()]);
        }
        Op::Status(d, s) => {
            key_user(k1, b"status:", d / 2);
            resp::encode(out, &[b"SET", k1, STATUS_NAMES[s as usize]]);
            key_user(k2, b"presence:", d / 2);
            resp::encode(out, &[b"PUBLISH", k2, STATUS_NAMES[s as usize]]);
        }
        Op::Query(_, t) => {
            key_online(k1, t * 2);
            key_online(k2, t * 2 + 1);
            key_user(k3, b"status:", t);
            resp::encode(out, &[b"MGET", k1, k2, k3]);
        }
    }
}

/// Sends every operation on one connection, pipelined without limit; returns
/// the seconds until the last reply and the number of error replies.
fn pipeline(
    port: u16,
    what: &str,
    ops: impl Iterator<Item = Op> + Send + 'static,
    count: u64,
) -> Result<(f64, u64), String> {
    let commands_total = count;
    let conn = Conn::connect(port).map_err(|e| format!("connect to redis: {e}"))?;
    let (mut w, mut replies) = conn.split();
    let start = Instant::now();
    let writer = std::thread::spawn(move || -> Result<(), String> {
        let mut buf = Vec::with_capacity(1 << 17);
        let (mut k1, mut k2, mut k3) = (Vec::new(), Vec::new(), Vec::new());
        for op in ops {
            encode_op(&mut buf, op, &mut k1, &mut k2, &mut k3);
            if buf.len() >= 1 << 16 {
                w.write_all(&buf).map_err(|e| format!("redis write: {e}"))?;
                buf.clear();
            }
        }
        w.write_all(&buf).map_err(|e| format!("redis write: {e}"))?;
        Ok(())
    });
    let mut errors = 0u64;
    let mut last = 0;
    for i in 0..commands_total {
        if let Err(e) = replies.skip() {
            if e.starts_with("redis error") {
                errors += 1;
            } else {
                return Err(e);
            }
        }
        if i % 1_048_576 == 0 {
            progress(what, i, commands_total, &mut last);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    progress(what, commands_total, commands_total, &mut last);
    writer
        .join()
        .map_err(|_| "the writer thread panicked".to_string())??;
    Ok((secs, errors))
}

fn run_redis(users: u32, ops: &std::sync::Arc<Vec<Op>>) -> Result<(Measured, u64), String> {
    eprintln!("redis-server (classic design):");
    let server = RedisServer::start()?;
    let mut admin = Conn::connect(server.port).map_err(|e| e.to_string())?;
    let mem0 = admin.info_field("memory", "used_memory").unwrap_or(0);
    let logins = (0..users).map(|u| Op::Login(u * 2));
    let login_cmds = u64::from(users) * 2;
    let (login_secs, e1) = pipeline(server.port, "login every phone", logins, login_cmds)?;
    let mem1 = admin.info_field("memory", "used_memory").unwrap_or(0);
    let mixed_cmds: u64 = ops.iter().map(|op| op.commands()).sum();
    let replay = ops.clone();
    let iter = (0..replay.len()).map(move |i| replay[i]);
    let (mixed_secs, e2) = pipeline(server.port, "mixed operations", iter, mixed_cmds)?;
    let version = match admin.call(&[b"INFO", b"server"]) {
        Ok(resp::Value::Bulk(Some(text))) => String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:").map(str::to_owned))
            .unwrap_or_default(),
        _ => String::new(),
    };
    eprintln!("  redis-server {version}, pid {}", server.pid());
    drop(server);
    Ok((
        Measured {
            login_secs,
            mixed_secs,
            bytes_per_device: mem1.saturating_sub(mem0) as f64 / f64::from(users),
            errors: e1 + e2,
        },
        mixed_cmds,
    ))
}

fn main() {
    let users: u32 = arg("--users", 1_000_000);
    let ops_count: usize = arg("--ops", users as usize * 10);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    eprintln!("generating {ops_count} operations for {users} users...");
    let ops = std::sync::Arc::new(generate(users, ops_count, &mut rng));
    let mut mix = [0u64; 5];
    for op in ops.iter() {
        mix[match op {
            Op::Heartbeat(_) => 0,
            Op::Query(..) => 1,
            Op::Status(..) => 2,
            Op::Login(_) => 3,
            Op::Logout(_) => 4,
        }] += 1;
    }

    let (redis, redis_cmds) = match run_redis(users, &ops) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vs_redis: {e}");
            std::process::exit(2);
        }
    };
    let green = run_greendot(users, &ops);

    let n = ops.len() as f64;
    let u = f64::from(users);
    let rows = [
        (
            "login every phone",
            u,
            u / redis.login_secs,
            u / green.login_secs,
        ),
        (
            "mixed operations",
            n,
            n / redis.mixed_secs,
            n / green.mixed_secs,
        ),
    ];
    println!();
    println!(
        "{users} users (2 devices each), mixed phase of {} operations: {} heartbeats, {} queries, {} status changes, {} logins, {} logouts",
        ops.len(),
        mix[0],
        mix[1],
        mix[2],
        mix[3],
        mix[4]
    );
    println!();
    println!("| phase | operations | Redis ops/s | greendot-core ops/s | greendot / Redis |");
    println!("|---|---:|---:|---:|---:|");
    for (what, count, r, g) in rows {
        println!(
            "| {what} | {count:.0} | {} | {} | {:.1}x |",
            si(r),
            si(g),
            g / r
        );
    }
    println!(
        "| memory per online device (after phase 1) | {users} | {:.0} B | {:.0} B | {:.2}x |",
        redis.bytes_per_device,
        green.bytes_per_device,
        green.bytes_per_device / redis.bytes_per_device.max(1.0)
    );
    println!();
    println!(
        "Redis: {} commands/s in the mixed phase ({redis_cmds} commands, {} error replies); greendot: {} inputs refused (stale sessions after expiry).",
        si(redis_cmds as f64 / redis.mixed_secs),
        redis.errors,
        green.errors
    );

    let path = greendot_bench::docs_dir().join("bench-vs-redis.svg");
    let groups: Vec<Group> = rows
        .iter()
        .map(|(what, _, r, g)| Group {
            label: what.to_string(),
            values: vec![*r, *g],
        })
        .collect();
    match plot::grouped_bars(
        &path,
        &format!(
            "Presence operations per second, {} users (log scale)",
            si(u)
        ),
        "operations/s",
        &[
            "Redis 7 (classic design, pipelined)",
            "greendot-core (in process)",
        ],
        &groups,
        true,
    ) {
        Ok(()) => eprintln!("plot: {}", path.display()),
        Err(e) => eprintln!("plot failed: {e}"),
    }
}
