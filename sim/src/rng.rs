//! The simulator's random streams, one per subsystem, all derived from the scenario seed with
//! the core's seeded generator (`pdkv_core::rng`).
//!
//! Separate streams keep subsystems independent: adding a fault draw does not shift the
//! workload's request lengths.

use pdkv_core::rng::Stream;

/// The random streams of one run.
#[derive(Clone, Debug)]
pub struct Streams {
    workload: Stream,
    proxy: Stream,
    faults: Stream,
    processes: Stream,
}

impl Streams {
    /// The streams of `seed`.
    pub fn new(seed: u64) -> Streams {
        Streams {
            workload: Stream::new(seed, 1),
            proxy: Stream::new(seed, 2),
            faults: Stream::new(seed, 3),
            processes: Stream::new(seed, 4),
        }
    }

    /// A uniform draw in `min..=max` from the workload stream.
    pub fn uniform(&mut self, min: u32, max: u32) -> u32 {
        let span = u64::from(max.saturating_sub(min)) + 1;
        min + (self.workload.next_u64() % span) as u32
    }

    /// An exponential gap (nanoseconds) for Poisson arrivals at `rate_per_s`.
    pub fn exponential_ns(&mut self, rate_per_s: f64) -> u64 {
        let u = self.workload.unit();
        (-(1.0 - u).ln() / rate_per_s * 1e9) as u64
    }

    /// 128 bits for a transfer id, from the proxy stream.
    pub fn transfer_bits(&mut self) -> u128 {
        (u128::from(self.proxy.next_u64()) << 64) | u128::from(self.proxy.next_u64())
    }

    /// 64 bits for a process's incarnation, from a stream of its own (a restart does not shift
    /// the fault or workload draws).
    pub fn incarnation_bits(&mut self) -> u64 {
        self.processes.next_u64()
    }

    /// True with probability `p`, from the fault stream.
    pub fn chance(&mut self, p: f64) -> bool {
        self.faults.chance(p)
    }

    /// A uniform draw below `n` from the fault stream.
    pub fn below(&mut self, n: u64) -> u64 {
        self.faults.below(n)
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
