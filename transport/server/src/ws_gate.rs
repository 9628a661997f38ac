//! The WebSocket door's guards before a hello (docs/protocol.md, "WebSocket
//! over TLS"): the same as QUIC's, counted apart. A TCP connection is
//! admitted only within the admission rate in force (the one the loop's
//! load sets for QUIC, with a bucket of its own), while fewer than
//! `max_pending` connections wait for their hello and fewer than
//! `per_address` of them come from its IP address. Until its hello it
//! takes no slot of the server's: the state sees it only with its first
//! message.

use super::StatsInner;
use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Why a WebSocket connection was dropped before its hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WsShed {
    /// Over the admission rate.
    Rate,
    /// Too many connections from its address wait for their hello.
    PerAddress,
    /// Too many connections wait for their hello.
    Capacity,
    /// No TLS, upgrade and hello within `hello_timeout` of the accept.
    HelloTimeout,
    /// A first message larger than `max_hello`.
    HelloTooLarge,
}

impl WsShed {
    pub const ALL: [WsShed; 5] = [
        WsShed::Rate,
        WsShed::PerAddress,
        WsShed::Capacity,
        WsShed::HelloTimeout,
        WsShed::HelloTooLarge,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            WsShed::Rate => "rate",
            WsShed::PerAddress => "per_address",
            WsShed::Capacity => "capacity",
            WsShed::HelloTimeout => "hello_timeout",
            WsShed::HelloTooLarge => "hello_too_large",
        }
    }
}

/// The door's counters, read by the metrics page.
#[derive(Debug, Default)]
pub(crate) struct WsGateStats {
    shed: [AtomicU64; WsShed::ALL.len()],
    /// Connections admitted that have not said hello yet.
    pending: AtomicUsize,
}

impl WsGateStats {
    pub(crate) fn shed(&self, why: WsShed) {
        self.shed[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Every reason with its count.
    pub(crate) fn shed_counts(&self) -> Vec<(&'static str, u64)> {
        WsShed::ALL
            .iter()
            .map(|&r| (r.label(), self.shed[r as usize].load(Ordering::Relaxed)))
            .collect()
    }

    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }
}

/// The limits of the door.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WsLimits {
    /// Connections waiting for their hello, in all.
    pub max_pending: usize,
    /// Of those, from one IP address.
    pub per_address: usize,
}

/// The admission state of the door, shared by the accept loop and the
/// connections' tasks (which give their place back when they say hello or
/// end).
pub(crate) struct WsGate {
    limits: WsLimits,
    /// The server's counters: the admission rate in force (set by the
    /// loop) and the door's own (`websocket`).
    stats: Arc<StatsInner>,
    inner: Mutex<GateInner>,
}

struct GateInner {
    per_address: HashMap<IpAddr, usize>,
    tokens: f64,
    at: Option<Instant>,
}

impl WsGate {
    pub(crate) fn new(limits: WsLimits, stats: Arc<StatsInner>) -> WsGate {
        WsGate {
            limits,
            stats,
            inner: Mutex::new(GateInner {
                per_address: HashMap::new(),
                tokens: 0.0,
                at: None,
            }),
        }
    }

    pub(crate) fn stats(&self) -> &WsGateStats {
        &self.stats.websocket
    }

    /// Admits a new connection from `ip`, or says why not (and counts it).
    /// The place it takes is given back when the [`Pending`] is dropped.
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr, now: Instant) -> Result<Pending, WsShed> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let verdict = self.check(&mut inner, ip, now);
        if let Err(why) = verdict {
            drop(inner);
            self.stats().shed(why);
            return Err(why);
        }
        *inner.per_address.entry(ip).or_default() += 1;
        inner.tokens -= 1.0;
        self.stats().pending.fetch_add(1, Ordering::Relaxed);
        Ok(Pending {
            gate: self.clone(),
            ip,
        })
    }

    fn check(&self, inner: &mut GateInner, ip: IpAddr, now: Instant) -> Result<(), WsShed> {
        // A bucket of one second's worth at the rate in force.
        let rate = self.stats.admission_rate.load(Ordering::Relaxed).max(1) as f64;
        let elapsed = inner.at.map_or(rate, |at| {
            now.saturating_duration_since(at).as_secs_f64() * rate
        });
        inner.at = Some(inner.at.map_or(now, |at| at.max(now)));
        inner.tokens = (inner.tokens + elapsed).min(rate);
        if inner.tokens < 1.0 {
            return Err(WsShed::Rate);
        }
        if self.stats().pending() >= self.limits.max_pending {
            return Err(WsShed::Capacity);
        }
        if inner.per_address.get(&ip).copied().unwrap_or(0) >= self.limits.per_address {
            return Err(WsShed::PerAddress);
        }
        Ok(())
    }

    fn release(&self, ip: IpAddr) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = inner.per_address.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                inner.per_address.remove(&ip);
            }
        }
        let was = self
            .stats()
            .pending
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        debug_assert!(was.is_ok(), "pending WebSocket count below zero");
    }

    /// Connections waiting for their hello from `ip` (for tests).
    #[cfg(test)]
    fn from(&self, ip: IpAddr) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.per_address.get(&ip).copied().unwrap_or(0)
    }
}

/// A place among the connections waiting for their hello; given back when
/// dropped (the hello came, or the connection ended).
pub(crate) struct Pending {
    gate: Arc<WsGate>,
    ip: IpAddr,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.gate.release(self.ip);
    }
}

/// A stream whose reads stop with an error once `budget` bytes were read
/// (until the budget is lifted): a connection before its hello can make the
/// server hold no more than that, whatever it sends (an upgrade with
/// endless headers, a hello in many fragments).
pub(crate) struct Budgeted<S> {
    inner: S,
    budget: Arc<AtomicUsize>,
}

/// A budget that no longer limits.
pub(crate) const UNLIMITED: usize = usize::MAX;

impl<S> Budgeted<S> {
    pub(crate) fn new(inner: S, budget: Arc<AtomicUsize>) -> Budgeted<S> {
        Budgeted { inner, budget }
    }
}

/// The error a read past the budget fails with.
pub(crate) fn over_budget(error: &std::io::Error) -> bool {
    error.kind() == std::io::ErrorKind::InvalidData && error.to_string() == OVER_BUDGET
}

const OVER_BUDGET: &str = "more bytes before the hello than allowed";

impl<S: AsyncRead + Unpin> AsyncRead for Budgeted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let left = self.budget.load(Ordering::Relaxed);
        if left == 0 {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                OVER_BUDGET,
            )));
        }
        // Read no more than the budget allows.
        let n = if left >= buf.remaining() {
            let before = buf.filled().len();
            let result = Pin::new(&mut self.inner).poll_read(cx, buf);
            if !matches!(result, Poll::Ready(Ok(()))) {
                return result;
            }
            buf.filled().len() - before
        } else {
            let mut room = vec![0u8; left];
            let mut limited = ReadBuf::new(&mut room);
            let result = Pin::new(&mut self.inner).poll_read(cx, &mut limited);
            if !matches!(result, Poll::Ready(Ok(()))) {
                return result;
            }
            buf.put_slice(limited.filled());
            limited.filled().len()
        };
        if left != UNLIMITED {
            let _ = self
                .budget
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                    (b != UNLIMITED).then(|| b.saturating_sub(n))
                });
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Budgeted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn gate(max_pending: usize, per_address: usize, rate: u64) -> Arc<WsGate> {
        let stats = StatsInner::default();
        stats.admission_rate.store(rate, Ordering::Relaxed);
        Arc::new(WsGate::new(
            WsLimits {
                max_pending,
                per_address,
            },
            Arc::new(stats),
        ))
    }

    #[test]
    fn one_address_cannot_take_every_place() {
        let gate = gate(4, 2, 100);
        let t0 = Instant::now();
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        let held: Vec<_> = (0..2).map(|_| gate.admit(a, t0).unwrap()).collect();
        assert_eq!(gate.admit(a, t0).err(), Some(WsShed::PerAddress));
        let more: Vec<_> = (0..2).map(|_| gate.admit(b, t0).unwrap()).collect();
        assert_eq!(gate.admit(b, t0).err(), Some(WsShed::Capacity));
        assert_eq!(gate.stats().pending(), 4);
        drop(held);
        assert_eq!(gate.from(a), 0);
        assert_eq!(gate.stats().pending(), 2);
        let _again = gate.admit(a, t0).unwrap();
        drop(more);
        let counts: HashMap<_, _> = gate.stats().shed_counts().into_iter().collect();
        assert_eq!(counts["per_address"], 1);
        assert_eq!(counts["capacity"], 1);
    }

    #[test]
    fn admissions_follow_the_rate_in_force() {
        let gate = gate(1000, 1000, 10);
        let t0 = Instant::now();
        let ip: IpAddr = [10, 0, 0, 1].into();
        // One second's worth at once, then one per 100 ms.
        let burst: Vec<_> = (0..10).map(|_| gate.admit(ip, t0).unwrap()).collect();
        assert_eq!(gate.admit(ip, t0).err(), Some(WsShed::Rate));
        let _next = gate.admit(ip, t0 + Duration::from_millis(100)).unwrap();
        assert_eq!(
            gate.admit(ip, t0 + Duration::from_millis(100)).err(),
            Some(WsShed::Rate)
        );
        // The loop cut the rate: the bucket holds no more than the new rate.
        gate.stats.admission_rate.store(2, Ordering::Relaxed);
        let later = t0 + Duration::from_secs(5);
        let _a = gate.admit(ip, later).unwrap();
        let _b = gate.admit(ip, later).unwrap();
        assert_eq!(gate.admit(ip, later).err(), Some(WsShed::Rate));
        drop(burst);
    }

    #[tokio::test]
    async fn reads_stop_at_the_budget_until_it_is_lifted() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let budget = Arc::new(AtomicUsize::new(10));
        let mut server = Budgeted::new(server, budget.clone());
        client.write_all(&[7u8; 64]).await.unwrap();
        let mut buf = [0u8; 64];
        let mut got = 0;
        let error = loop {
            match server.read(&mut buf[got..]).await {
                Ok(n) => got += n,
                Err(e) => break e,
            }
        };
        assert_eq!(got, 10);
        assert!(over_budget(&error), "{error}");
        budget.store(UNLIMITED, Ordering::Relaxed);
        server.read_exact(&mut buf[..54]).await.unwrap();
        assert_eq!(budget.load(Ordering::Relaxed), UNLIMITED);
    }
}
