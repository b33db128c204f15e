//! The project's one seeded random generator: ChaCha8 streams, each derived from a seed and a
//! stream number, so every random choice (the simulator's workload, proxy and faults, the
//! exploration's storms, the real cluster fuzzer's draws) replays from the seed it prints.
//!
//! Separate streams keep subsystems independent: a new draw in one does not shift the others.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// SplitMix64 over `seed + stream`: spreads nearby seeds and stream numbers over all 64 bits,
/// so they give unrelated streams.
pub fn derive(seed: u64, stream: u64) -> u64 {
    let mut z = seed.wrapping_add(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One random stream.
#[derive(Clone, Debug)]
pub struct Stream(ChaCha8Rng);

impl Stream {
    /// Stream number `stream` of `seed`.
    pub fn new(seed: u64, stream: u64) -> Stream {
        Stream(ChaCha8Rng::seed_from_u64(derive(seed, stream)))
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform below `n` (0 when `n` is 0 or 1; the modulo bias is below 2^-40 for the sizes
    /// used here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `lo..=hi`; `lo` when `hi <= lo` (for the full range `0..=u64::MAX` the top
    /// value itself is never drawn).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// One of `items`, uniformly.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        assert!(!items.is_empty(), "pick from an empty list");
        &items[self.below(items.len() as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_draws_other_streams_and_seeds_differ() {
        let draws = |seed, stream| {
            let mut s = Stream::new(seed, stream);
            (0..4).map(|_| s.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draws(7, 1), draws(7, 1));
        assert_ne!(draws(7, 1), draws(7, 2));
        assert_ne!(draws(7, 1), draws(8, 1));
    }

    #[test]
    fn bounded_draws_stay_in_bounds() {
        let mut s = Stream::new(1, 0);
        for _ in 0..1000 {
            assert!((3..=9).contains(&s.range(3, 9)));
            assert_eq!(s.range(5, 5), 5);
            assert_eq!(s.range(9, 3), 9);
            assert!(s.below(10) < 10);
            assert_eq!(s.below(0), 0);
            let u = s.unit();
            assert!((0.0..1.0).contains(&u));
            assert!(!s.chance(0.0) && s.chance(1.0));
        }
        // The widest range does not overflow.
        s.range(0, u64::MAX);
    }
}
