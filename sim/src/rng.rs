//! Seeded random streams, one per subsystem, all derived from the scenario seed.
//!
//! Separate streams keep subsystems independent: adding a fault draw does not shift the
//! workload's request lengths. Every stream is ChaCha8, seeded from the scenario seed and the
//! stream's fixed number through SplitMix64.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The random streams of one run.
#[derive(Clone, Debug)]
pub struct Streams {
    workload: ChaCha8Rng,
    proxy: ChaCha8Rng,
    faults: ChaCha8Rng,
}

/// SplitMix64: spreads `seed + stream` over all 64 bits so nearby seeds give unrelated streams.
fn derive(seed: u64, stream: u64) -> u64 {
    let mut z = seed.wrapping_add(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Streams {
    /// The streams of `seed`.
    pub fn new(seed: u64) -> Streams {
        let stream = |n| ChaCha8Rng::seed_from_u64(derive(seed, n));
        Streams { workload: stream(1), proxy: stream(2), faults: stream(3) }
    }

    /// A uniform draw in `min..=max` from the workload stream.
    pub fn uniform(&mut self, min: u32, max: u32) -> u32 {
        let span = u64::from(max.saturating_sub(min)) + 1;
        min + (self.workload.next_u64() % span) as u32
    }

    /// An exponential gap (nanoseconds) for Poisson arrivals at `rate_per_s`.
    pub fn exponential_ns(&mut self, rate_per_s: f64) -> u64 {
        let u = (self.workload.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        (-(1.0 - u).ln() / rate_per_s * 1e9) as u64
    }

    /// 128 bits for a transfer id, from the proxy stream.
    pub fn transfer_bits(&mut self) -> u128 {
        (u128::from(self.proxy.next_u64()) << 64) | u128::from(self.proxy.next_u64())
    }

    /// True with probability `p`, from the fault stream.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.faults.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A uniform draw below `n` from the fault stream.
    pub fn below(&mut self, n: u64) -> u64 {
        self.faults.next_u64() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_draws_and_streams_are_independent() {
        let (mut a, mut b) = (Streams::new(7), Streams::new(7));
        assert_eq!(a.transfer_bits(), b.transfer_bits());
        // Drawing from the fault stream does not move the workload stream.
        a.chance(0.5);
        assert_eq!(a.uniform(0, 1000), b.uniform(0, 1000));
        assert_ne!(Streams::new(8).transfer_bits(), Streams::new(7).transfer_bits());
    }
}
