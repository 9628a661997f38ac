//! What the tests of the `greendot` binary share: a child process whose
//! output lines arrive on a channel, waited on with deadlines.

#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A child process killed when dropped; its stdout and stderr lines
/// (prefixed `stderr: `) are read on threads.
pub struct Proc {
    pub name: String,
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

fn read_lines(pipe: impl Read + Send + 'static, tx: mpsc::Sender<String>, tag: &'static str) {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(format!("{tag}{line}")).is_err() {
                break;
            }
        }
    });
}

impl Proc {
    /// Starts `command` with its output piped; its stdin is kept if the
    /// caller piped it (see [`Proc::send`]).
    pub fn spawn(name: &str, mut command: Command) -> Proc {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let (tx, lines) = mpsc::channel();
        read_lines(child.stdout.take().expect("stdout"), tx.clone(), "");
        read_lines(child.stderr.take().expect("stderr"), tx, "stderr: ");
        Proc {
            name: name.to_owned(),
            stdin: child.stdin.take(),
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a line matching `pred`; returns it.
    pub fn wait_for(
        &mut self,
        within: Duration,
        what: &str,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "{}: no line {what} within {within:?}; it said:\n{}",
                    self.name,
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Waits for `greendot serve`'s "greendot listening on ADDR" line;
    /// returns ADDR (QUIC).
    pub fn listening_addr(&mut self, within: Duration) -> std::net::SocketAddr {
        let line = self.wait_for(within, "with its address", |l| {
            l.starts_with("greendot listening on ")
        });
        line.strip_prefix("greendot listening on ")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("{}: no address in {line:?}", self.name))
    }

    /// Waits for `greendot serve`'s "metrics on http://ADDR/metrics" line;
    /// returns ADDR.
    pub fn metrics_addr(&mut self, within: Duration) -> String {
        self.wait_for(within, "with its metrics port", |l| {
            l.starts_with("metrics on http://")
        })
        .trim_start_matches("metrics on http://")
        .trim_end_matches("/metrics")
        .to_owned()
    }

    /// Reads what arrived, without waiting.
    pub fn drain(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
    }

    /// A line to its stdin (it must have been piped).
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").expect("write to the child");
        stdin.flush().expect("flush");
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Its exit, within `within`; what it said is kept in `seen`.
    pub fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            self.drain();
            if let Ok(Some(status)) = self.child.try_wait() {
                // The rest of its output.
                std::thread::sleep(Duration::from_millis(100));
                self.drain();
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {within:?}:\n{}",
                self.name,
                self.seen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of the sample `name` (with its labels) on the metrics page at
/// `addr`, if the page answers and has it.
pub fn metric(addr: &str, name: &str) -> Option<u64> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// A new directory under the system's temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("greendot-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A loopback port free for UDP and TCP now, below the kernel's ephemeral
/// range (`ip_local_port_range`), for a server a test restarts on its old
/// address: a port from the range can be handed to a client's socket bound
/// meanwhile, and the restart then fails with "Address already in use".
pub fn port_outside_ephemeral_range() -> u16 {
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = 10_000u16.min(first_ephemeral / 2);
    let span = u32::from(first_ephemeral - low);
    // A start that differs between processes and calls, so two tests that
    // run at once rarely try the same ports.
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let calls = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = (std::process::id().wrapping_mul(7919) ^ nanos).wrapping_add(calls * 101) % span;
    (0..span)
        .map(|i| low + ((start + i) % span) as u16)
        .find(|&port| {
            std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok()
                && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
        })
        .expect("a free loopback port below the ephemeral range")
}
