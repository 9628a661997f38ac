//! A CPU cap for the server process: a cgroup of its own with a CFS quota
//! (cgroup v1's `cpu.cfs_quota_us`, or v2's `cpu.max`), so that the server
//! and not the load generator on the same cores is the bottleneck. Needs
//! root and a cgroup file system with the cpu controller.

use std::path::{Path, PathBuf};

/// The CFS period of the cap: the kernel's default.
pub const PERIOD_US: u64 = 100_000;

/// Which cgroup interface the cap uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// A `cpu` hierarchy of its own (or `cpu,cpuacct`) under `/sys/fs/cgroup`.
    V1,
    /// The unified hierarchy at `/sys/fs/cgroup`, with `cpu` among its
    /// controllers.
    V2,
}

/// Where a cap can be made: the version and the parent directory, from
/// what exists under `root` (`/sys/fs/cgroup` on the machine). `exists`
/// answers for a path under `root`.
pub fn detect(root: &Path, exists: impl Fn(&Path) -> bool) -> Option<(CgroupVersion, PathBuf)> {
    // A pure v2 machine has cgroup.controllers at the root; a hybrid one
    // has it only under unified/, where the cpu controller is held by v1.
    if exists(&root.join("cgroup.controllers")) {
        return Some((CgroupVersion::V2, root.to_path_buf()));
    }
    ["cpu", "cpu,cpuacct", "cpuacct,cpu"]
        .iter()
        .map(|d| root.join(d))
        .find(|d| exists(&d.join("cpu.cfs_quota_us")))
        .map(|d| (CgroupVersion::V1, d))
}

/// The quota per [`PERIOD_US`] of `cores` (0.25: a quarter of one core).
pub fn quota_us(cores: f64) -> Result<u64, String> {
    if !(cores.is_finite() && cores > 0.0) {
        return Err(format!(
            "a CPU cap must be a positive number of cores, not {cores}"
        ));
    }
    // The kernel refuses a quota under 1 ms.
    Ok(((cores * PERIOD_US as f64).round() as u64).max(1000))
}

/// The line written to v2's `cpu.max`: "quota period".
pub fn cpu_max_line(quota_us: u64) -> String {
    format!("{quota_us} {PERIOD_US}")
}

/// A cgroup's `cpu.stat`, as far as both versions have it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuStat {
    /// CPU used by the group, seconds (v2 `usage_usec`; v1 has it in the
    /// cpuacct controller, not here: `None`).
    pub usage_secs: Option<f64>,
    /// CFS periods in which the group ran, and in which it hit its quota.
    pub periods: u64,
    pub throttled: u64,
    /// Time the group was held back by its quota, seconds (v1
    /// `throttled_time` ns, v2 `throttled_usec`).
    pub throttled_secs: f64,
}

impl CpuStat {
    pub fn parse(text: &str) -> CpuStat {
        let mut stat = CpuStat::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<u64>() else {
                continue;
            };
            match key {
                "usage_usec" => stat.usage_secs = Some(value as f64 / 1e6),
                "nr_periods" => stat.periods = value,
                "nr_throttled" => stat.throttled = value,
                "throttled_time" => stat.throttled_secs = value as f64 / 1e9,
                "throttled_usec" => stat.throttled_secs = value as f64 / 1e6,
                _ => {}
            }
        }
        stat
    }
}

/// How to read a cap's `cpu.stat` (cheap to clone into the load options).
#[derive(Clone, Debug)]
pub struct CapProbe {
    /// The cap, in cores.
    pub cores: f64,
    pub version: CgroupVersion,
    stat: PathBuf,
}

impl CapProbe {
    pub fn read(&self) -> Option<CpuStat> {
        std::fs::read_to_string(&self.stat)
            .ok()
            .map(|t| CpuStat::parse(&t))
    }
}

/// A cgroup with a CPU quota, removed when dropped (its processes, if any
/// are left, go back to the parent first).
#[derive(Debug)]
pub struct CpuCap {
    dir: PathBuf,
    parent: PathBuf,
    probe: CapProbe,
}

impl CpuCap {
    /// Makes `/sys/fs/cgroup/[cpu/]{name}` with a quota of `cores`.
    pub fn create(name: &str, cores: f64) -> Result<CpuCap, String> {
        let quota = quota_us(cores)?;
        let root = Path::new("/sys/fs/cgroup");
        let (version, parent) = detect(root, |p| p.exists()).ok_or_else(|| {
            format!(
                "no cgroup file system with a cpu controller under {} (neither v2's cgroup.controllers nor v1's cpu/cpu.cfs_quota_us)",
                root.display()
            )
        })?;
        // SAFETY: geteuid reads no memory of ours.
        if unsafe { libc::geteuid() } != 0 {
            return Err("a CPU cap needs root: cgroups are made and written as root".into());
        }
        if version == CgroupVersion::V2 {
            let controllers = std::fs::read_to_string(parent.join("cgroup.controllers"))
                .map_err(|e| format!("{}: {e}", parent.join("cgroup.controllers").display()))?;
            if !controllers.split_whitespace().any(|c| c == "cpu") {
                return Err(format!(
                    "the cgroup v2 root {} has no cpu controller (cgroup.controllers: {})",
                    parent.display(),
                    controllers.trim()
                ));
            }
            // Children get the cpu controller only if the parent hands it down.
            write(&parent.join("cgroup.subtree_control"), "+cpu")?;
        }
        let dir = parent.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            // Left over from a run that was killed: reuse it.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("mkdir {}: {e}", dir.display())),
        }
        let cap = CpuCap {
            probe: CapProbe {
                cores,
                version,
                stat: dir.join("cpu.stat"),
            },
            dir,
            parent,
        };
        match version {
            CgroupVersion::V1 => {
                write(&cap.dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                write(&cap.dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
            CgroupVersion::V2 => write(&cap.dir.join("cpu.max"), &cpu_max_line(quota))?,
        }
        Ok(cap)
    }

    /// Moves process `pid` (all its threads, and what it starts later) in.
    pub fn add(&self, pid: u32) -> Result<(), String> {
        write(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    pub fn probe(&self) -> CapProbe {
        self.probe.clone()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for CpuCap {
    fn drop(&mut self) {
        let left = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for pid in left.split_whitespace() {
            let _ = write(&self.parent.join("cgroup.procs"), pid);
        }
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!("loadgen: cannot remove {}: {e}", self.dir.display());
        }
    }
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("write {value:?} to {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarter_core_is_25_ms_of_each_100_ms_and_nonsense_is_refused() {
        assert_eq!(quota_us(0.25), Ok(25_000));
        assert_eq!(quota_us(1.5), Ok(150_000));
        // Under the kernel's 1 ms minimum: raised to it.
        assert_eq!(quota_us(0.001), Ok(1000));
        assert!(quota_us(0.0).is_err());
        assert!(quota_us(-1.0).is_err());
        assert!(quota_us(f64::NAN).is_err());
        assert_eq!(cpu_max_line(25_000), "25000 100000");
    }

    #[test]
    fn v2_is_taken_at_the_root_and_v1_under_its_cpu_hierarchy() {
        let root = Path::new("/sys/fs/cgroup");
        let with = |files: &'static [&'static str]| {
            move |p: &Path| files.iter().any(|f| root.join(f) == p)
        };
        assert_eq!(
            detect(root, with(&["cgroup.controllers", "cpu/cpu.cfs_quota_us"])),
            Some((CgroupVersion::V2, root.to_path_buf()))
        );
        // A hybrid machine (this one): v2 only under unified/, cpu in v1.
        assert_eq!(
            detect(
                root,
                with(&["unified/cgroup.controllers", "cpu/cpu.cfs_quota_us"])
            ),
            Some((CgroupVersion::V1, root.join("cpu")))
        );
        assert_eq!(
            detect(root, with(&["cpu,cpuacct/cpu.cfs_quota_us"])),
            Some((CgroupVersion::V1, root.join("cpu,cpuacct")))
        );
        assert_eq!(detect(root, with(&["memory/memory.limit_in_bytes"])), None);
    }

    #[test]
    fn cpu_stat_reads_both_versions() {
        let v1 = "nr_periods 120\nnr_throttled 30\nthrottled_time 2500000000\nnr_bursts 0\nburst_time 0\n";
        assert_eq!(
            CpuStat::parse(v1),
            CpuStat {
                usage_secs: None,
                periods: 120,
                throttled: 30,
                throttled_secs: 2.5,
            }
        );
        let v2 = "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\nnr_periods 10\nnr_throttled 4\nthrottled_usec 250000\n";
        assert_eq!(
            CpuStat::parse(v2),
            CpuStat {
                usage_secs: Some(1.5),
                periods: 10,
                throttled: 4,
                throttled_secs: 0.25,
            }
        );
    }
}
