//! Shared pieces of greendot's comparison benchmarks: randomness, arguments,
//! tables, process accounting, SVG plots and a delayed network path. The
//! benchmarks themselves are the binaries in `src/bin/` (`vs_redis`,
//! `quic_load`, `switch`); nothing here runs under `cargo test`.

pub mod cluster;
pub mod path;
pub mod plot;
pub mod resp;

use std::time::Duration;

/// xorshift64*: the benches' own randomness, seeded, so every run replays the
/// same workload.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `--name value` from the command line, parsed, or `default`.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Whether `--name` is on the command line.
pub fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// `1234567.0` as `1.23 M`, `12345.0` as `12.3 k`.
pub fn si(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e4 {
        format!("{:.1} k", x / 1e3)
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

/// The `q` quantile (0..=1) of sorted samples, `None` if there are none.
pub fn quantile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    Some(sorted[i.min(sorted.len() - 1)])
}

/// Where the docs are (plots go to `docs/bench-*.svg`), found from the crate
/// so that the binaries work from any directory.
pub fn docs_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("docs")
}

/// Raises the soft open-file limit to the hard one; returns the new soft limit.
pub fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                lim = want;
            }
        }
    }
    lim.rlim_cur
}

/// The machine's speed now, as the core bench measures it
/// (`core/benches/core.rs`): one dependent random read per step in a
/// 2,000,000-entry `u64` array (16 MiB), in reads per second of wall clock.
/// Load benches print it with their tables so runs compare by ratio.
pub fn random_read_baseline() -> f64 {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let table: Vec<u64> = (0..2_000_000).map(|_| rng.next_u64()).collect();
    let steps = 10_000_000u64;
    let start = std::time::Instant::now();
    let mut at = 0usize;
    for _ in 0..steps {
        at = (table[at] ^ at as u64) as usize % table.len();
    }
    std::hint::black_box(at);
    steps as f64 / start.elapsed().as_secs_f64().max(1e-9)
}

/// The 1-minute load average (`/proc/loadavg`), as text.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".to_string())
}
