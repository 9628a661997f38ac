//! A redis-server started by the bench on a free loopback port, and a minimal
//! RESP2 client over a std `TcpStream`: commands are encoded into a buffer and
//! replies are skipped (or read, for `INFO`). Leaner than a client crate, and
//! it pipelines without limit: a writer thread and a reader thread share the
//! connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`; killed when dropped.
pub struct RedisServer {
    child: Child,
    pub port: u16,
}

impl RedisServer {
    /// Starts `redis-server` on a free loopback port, without persistence, and
    /// waits until it answers `PING`.
    pub fn start() -> Result<RedisServer, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free port: {e}"))?;
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot start redis-server ({e}); install it with `apt-get install -y redis-server`"
                )
            })?;
        let mut server = RedisServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut conn) = Conn::connect(port) {
                if let Ok(Value::Simple(s)) = conn.call(&[b"PING"]) {
                    if s == "PONG" {
                        return Ok(server);
                    }
                }
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!("redis-server exited at start: {status}"));
            }
            if Instant::now() > deadline {
                return Err("redis-server did not answer PING within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A RESP2 reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Value>>),
}

/// Appends one command in RESP (an array of bulk strings) to `buf`.
pub fn encode(buf: &mut Vec<u8>, args: &[&[u8]]) {
    buf.push(b'*');
    push_num(buf, args.len() as u64);
    for arg in args {
        buf.push(b'$');
        push_num(buf, arg.len() as u64);
        buf.extend_from_slice(arg);
        buf.extend_from_slice(b"\r\n");
    }
}

fn push_num(buf: &mut Vec<u8>, n: u64) {
    push_decimal(buf, n);
    buf.extend_from_slice(b"\r\n");
}

/// Appends the decimal digits of `n` (no CRLF): for building keys.
pub fn push_decimal(buf: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

/// Reads RESP replies from a buffered stream.
pub struct Replies<R> {
    r: BufReader<R>,
    line: Vec<u8>,
}

impl<R: Read> Replies<R> {
    pub fn new(r: R) -> Replies<R> {
        Replies {
            r: BufReader::with_capacity(1 << 16, r),
            line: Vec::with_capacity(128),
        }
    }

    fn read_line(&mut self) -> Result<(), String> {
        self.line.clear();
        let n = self
            .r
            .read_until(b'\n', &mut self.line)
            .map_err(|e| format!("redis read: {e}"))?;
        if n < 3 || self.line[n - 2] != b'\r' {
            return Err("redis: connection closed or bad reply".into());
        }
        self.line.truncate(n - 2);
        Ok(())
    }

    fn int(&self) -> Result<i64, String> {
        std::str::from_utf8(&self.line[1..])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| "redis: bad number".to_string())
    }

    /// Reads one reply without keeping it; an error reply is returned as `Err`.
    pub fn skip(&mut self) -> Result<(), String> {
        match self.read()? {
            Value::Error(e) => Err(format!("redis error: {e}")),
            _ => Ok(()),
        }
    }

    /// Reads one reply.
    pub fn read(&mut self) -> Result<Value, String> {
        self.read_line()?;
        match self.line.first() {
            Some(b'+') => Ok(Value::Simple(
                String::from_utf8_lossy(&self.line[1..]).into_owned(),
            )),
            Some(b'-') => Ok(Value::Error(
                String::from_utf8_lossy(&self.line[1..]).into_owned(),
            )),
            Some(b':') => Ok(Value::Int(self.int()?)),
            Some(b'$') => {
                let len = self.int()?;
                if len < 0 {
                    return Ok(Value::Bulk(None));
                }
                let mut data = vec![0u8; len as usize + 2];
                self.r
                    .read_exact(&mut data)
                    .map_err(|e| format!("redis read: {e}"))?;
                data.truncate(len as usize);
                Ok(Value::Bulk(Some(data)))
            }
            Some(b'*') => {
                let len = self.int()?;
                if len < 0 {
                    return Ok(Value::Array(None));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.read()?);
                }
                Ok(Value::Array(Some(items)))
            }
            _ => Err("redis: unknown reply type".into()),
        }
    }
}

/// A simple request-reply connection (for setup and `INFO`).
pub struct Conn {
    w: TcpStream,
    replies: Replies<TcpStream>,
}

impl Conn {
    pub fn connect(port: u16) -> std::io::Result<Conn> {
        let w = TcpStream::connect(("127.0.0.1", port))?;
        w.set_nodelay(true)?;
        let r = w.try_clone()?;
        Ok(Conn {
            w,
            replies: Replies::new(r),
        })
    }

    /// The two halves, for a writer thread and a reader thread.
    pub fn split(self) -> (TcpStream, Replies<TcpStream>) {
        (self.w, self.replies)
    }

    pub fn call(&mut self, args: &[&[u8]]) -> Result<Value, String> {
        let mut buf = Vec::new();
        encode(&mut buf, args);
        self.w
            .write_all(&buf)
            .map_err(|e| format!("redis write: {e}"))?;
        self.replies.read()
    }

    /// A field of `INFO <section>` as a number (e.g. `used_memory`).
    pub fn info_field(&mut self, section: &str, field: &str) -> Option<u64> {
        let Ok(Value::Bulk(Some(text))) = self.call(&[b"INFO", section.as_bytes()]) else {
            return None;
        };
        let text = String::from_utf8_lossy(&text).into_owned();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().parse().ok())
    }
}
