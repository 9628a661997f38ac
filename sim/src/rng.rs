//! The simulator's only source of randomness: SplitMix64, seeded, so that a
//! run is a function of its seed. A fuzzer may script it: the first values
//! are then read from its input (so coverage guides the choices they make),
//! and SplitMix takes over when the input is used up.

use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
    script: Option<Arc<[u8]>>,
    read: usize,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng {
            state: seed,
            script: None,
            read: 0,
        }
    }

    /// Values from `script` (8 bytes each) first, then SplitMix from `seed`.
    pub fn scripted(seed: u64, script: Arc<[u8]>) -> Rng {
        Rng {
            state: seed,
            script: Some(script),
            read: 0,
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        if let Some(script) = &self.script {
            if let Some(bytes) = script.get(self.read..self.read + 8) {
                self.read += 8;
                let mut value = [0u8; 8];
                value.copy_from_slice(bytes);
                return u64::from_le_bytes(value);
            }
        }
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0; 0 gives 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }

    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// A new generator for a separate use, so uses do not correlate.
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }

    pub fn bytes32(&mut self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for chunk in out.chunks_mut(8) {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_comes_first_then_splitmix() {
        let script: Arc<[u8]> = Arc::from(&[1u8, 0, 0, 0, 0, 0, 0, 0, 9][..]);
        let mut a = Rng::scripted(5, script);
        assert_eq!(a.next_u64(), 1);
        assert_eq!(a.next_u64(), Rng::new(5).next_u64());
    }

    #[test]
    fn same_seed_same_stream_and_bounds_hold() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let x = a.range(3, 9);
            assert!((3..=9).contains(&x));
            b.range(3, 9);
        }
        assert!(!Rng::new(1).chance(0.0));
        assert!(Rng::new(1).chance(1.0));
    }
}
