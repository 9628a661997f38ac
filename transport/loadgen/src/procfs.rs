//! A process's memory and CPU, from `/proc`.

/// `VmRSS` of a process, bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// `utime + stime` of a process, in seconds (assuming the usual 100 ticks/s).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// Datagrams dropped so far by the UDP sockets of process `pid` (full
/// receive buffers), from the `drops` column of `/proc/net/udp` and
/// `udp6` for the sockets among its file descriptors. `None`: the process
/// cannot be read.
pub fn udp_drops(pid: u32) -> Option<u64> {
    let inodes: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|link| {
            let link = link.to_str()?;
            link.strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect();
    let table = |name: &str| std::fs::read_to_string(name).unwrap_or_default();
    Some(
        udp_drops_of(&table("/proc/net/udp"), &inodes)
            + udp_drops_of(&table("/proc/net/udp6"), &inodes),
    )
}

/// The `drops` of the sockets of `/proc/net/udp`'s `table` whose inode is
/// one of `inodes`.
pub(crate) fn udp_drops_of(table: &str, inodes: &std::collections::HashSet<u64>) -> u64 {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local remote st tx:rx tr:when retrnsmt uid timeout inode ref pointer drops
            let inode: u64 = fields.get(9)?.parse().ok()?;
            let drops: u64 = fields.get(12)?.parse().ok()?;
            inodes.contains(&inode).then_some(drops)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_drops_counts_only_the_given_sockets() {
        let table = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  612: 0100007F:1151 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 40506 2 0000000000000000 17
  700: 0200007F:A0B1 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 40507 2 0000000000000000 5
  701: 0300007F:A0B2 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 40999 2 0000000000000000 1000
";
        let ours = [40506, 40507].into_iter().collect();
        assert_eq!(udp_drops_of(table, &ours), 22);
        assert_eq!(udp_drops_of(table, &Default::default()), 0);
    }
}
