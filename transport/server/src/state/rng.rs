//! The state's randomness, all from its seed: a small generator, the QUIC
//! connection ids, and a seed taken apart per use.

use std::time::Duration;

/// xorshift64*: jitter and connection ids need no cryptographic
/// randomness, only a seed and speed.
#[derive(Clone, Debug)]
pub(super) struct SmallRng(u64);

impl SmallRng {
    pub(super) fn new(seed: u64) -> SmallRng {
        SmallRng(seed | 1)
    }

    pub(super) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform enough in `0..n` (`n` > 0).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// Connection ids from the seed (quinn's own generator draws from the
/// thread's randomness). 8 bytes, as quinn's default.
pub(super) struct SeededCids {
    pub(super) rng: SmallRng,
}

impl quinn_proto::ConnectionIdGenerator for SeededCids {
    fn generate_cid(&mut self) -> quinn_proto::ConnectionId {
        quinn_proto::ConnectionId::new(&self.rng.next().to_le_bytes())
    }

    fn cid_len(&self) -> usize {
        8
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// Takes `n` bits of a seed apart for each use, so uses do not correlate.
pub(super) fn derive(seed: u64, purpose: u64) -> u64 {
    let mut rng = SmallRng::new(seed ^ purpose.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    rng.next();
    rng.next()
}
