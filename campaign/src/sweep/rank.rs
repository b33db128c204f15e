//! The ranking of a sweep's lines at each load level, and which ranks the model's stated error
//! cannot separate.
//!
//! At each load (a concurrency level or a request rate) the points are ranked by goodput per GPU
//! when the sweep has an SLO, by steady-state token throughput per GPU otherwise, best first.
//! The calibration states a relative error e (its validation's median |error|, or its worst
//! fitting error while validation is not measured). The charts shade every value v over
//! `v × (1 − e) .. v × (1 + e)`; two points whose bands overlap (`a × (1 − e) ≤ b × (1 + e)` for
//! `a ≥ b`) are not ranked by the model, so a point whose band overlaps that of the point ranked
//! just above it is "not separated" from it. Ties of equal figures keep grid order.

use super::SweepPoint;

/// What the ranking compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankedBy {
    /// Steady-state goodput per GPU (requests per second meeting the SLO).
    GoodputPerGpu,
    /// Steady-state prompt plus generated tokens per second per GPU.
    ThroughputPerGpu,
}

impl RankedBy {
    /// The figure of a point that this ranking compares (0 without goodput).
    pub fn figure(self, p: &SweepPoint) -> f64 {
        match self {
            RankedBy::GoodputPerGpu => p.steady.goodput.map_or(0.0, |g| g.requests_per_s_per_gpu),
            RankedBy::ThroughputPerGpu => p.steady.throughput.total_tok_s_per_gpu,
        }
    }

    /// The ranking's words, for the table's heading.
    pub fn name(self) -> &'static str {
        match self {
            RankedBy::GoodputPerGpu => "goodput per GPU",
            RankedBy::ThroughputPerGpu => "steady tok/s per GPU",
        }
    }
}

/// A point's place among the points of its load level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rank {
    /// 1 for the best.
    pub place: usize,
    /// Points at this load level.
    pub of: usize,
    /// The point ranked just above is within the model's error of this one.
    pub not_separated_from_above: bool,
}

/// Whether `this`, ranked just below `above`, is within the model's relative `error` of it: their
/// bands `v × (1 ± error)` overlap. The one rule sweeps and plans both use to say "not
/// separated"; a negative or non-finite error counts as none.
pub fn not_separated(above: f64, this: f64, error: f64) -> bool {
    let error = if error.is_finite() { error.max(0.0) } else { 0.0 };
    above * (1.0 - error) <= this * (1.0 + error)
}

/// Ranks every point among those of its load level by `by`, with `error` the relative error the
/// calibration states (a fraction); returns one rank per point, in the points' order.
pub fn rank(points: &[SweepPoint], by: RankedBy, error: f64) -> Vec<Rank> {
    let mut ranks = vec![Rank { place: 1, of: 1, not_separated_from_above: false }; points.len()];
    let mut done = vec![false; points.len()];
    for i in 0..points.len() {
        if done[i] {
            continue;
        }
        let load = points[i].load();
        let mut level: Vec<usize> = (i..points.len()).filter(|&j| points[j].load() == load).collect();
        // A stable sort: equal figures keep grid order.
        level.sort_by(|&a, &b| by.figure(&points[b]).total_cmp(&by.figure(&points[a])));
        for (place, &j) in level.iter().enumerate() {
            done[j] = true;
            let overlaps = place > 0
                && not_separated(by.figure(&points[level[place - 1]]), by.figure(&points[j]), error);
            ranks[j] = Rank { place: place + 1, of: level.len(), not_separated_from_above: overlaps };
        }
    }
    ranks
}

#[cfg(test)]
mod tests {
    use pdkv_sim::result::{Gpus, Steady};
    use pdkv_sim::Outcome;

    use super::*;

    fn point(run: &str, concurrency: u32, per_gpu: f64) -> SweepPoint {
        let mut steady = Steady::default();
        steady.throughput.total_tok_s_per_gpu = per_gpu;
        SweepPoint {
            run: run.into(),
            deployment: "1P_TP8:1D_TP8".into(),
            concurrency,
            rate_per_s: None,
            gpus: Gpus { prefill: 8, decode: 8 },
            total_tok_s: 0.0,
            ttft_mean_ms: None,
            tpot_mean_ms: None,
            outcome: Outcome::Clean,
            steady,
        }
    }

    /// (points as (line, concurrency, tok/s per GPU), error) -> each point's (place, of, not
    /// separated from the one above).
    #[test]
    fn ranks_per_load_level_and_says_which_the_error_cannot_separate() {
        let check = |points: &[(&str, u32, f64)], error: f64, expected: &[(usize, usize, bool)]| {
            let points: Vec<SweepPoint> = points.iter().map(|&(r, c, v)| point(r, c, v)).collect();
            let got: Vec<(usize, usize, bool)> = rank(&points, RankedBy::ThroughputPerGpu, error)
                .iter()
                .map(|r| (r.place, r.of, r.not_separated_from_above))
                .collect();
            assert_eq!(got, expected, "{error}");
        };
        // The two layouts per GPU: 1,863 against 1,369 tok/s. With a 10 % error the bands
        // (1,677-2,049 and 1,232-1,506) are apart; with the 81.7 % median error they overlap.
        let two = [("a", 32, 1369.0), ("b", 32, 1863.0)];
        check(&two, 0.1, &[(2, 2, false), (1, 2, false)]);
        check(&two, 0.817, &[(2, 2, true), (1, 2, false)]);
        check(&two, 0.0, &[(2, 2, false), (1, 2, false)]);
        // Each load level is ranked on its own; within one, only the neighbour above counts.
        check(
            &[("a", 32, 100.0), ("a", 128, 300.0), ("b", 32, 95.0), ("b", 128, 100.0), ("c", 32, 50.0)],
            0.05,
            &[(1, 3, false), (1, 2, false), (2, 3, true), (2, 2, false), (3, 3, false)],
        );
        // Equal figures keep grid order and are never separated; a bad error counts as none.
        check(&[("a", 8, 10.0), ("b", 8, 10.0)], f64::NAN, &[(1, 2, false), (2, 2, true)]);
        check(&[], 0.5, &[]);
    }
}
