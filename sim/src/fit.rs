//! The calibration points and the fit of the cost model's free constants: the fitting set
//! (published end-to-end serving runs the constants may be fitted on), the held-out validation
//! set (published per-phase figures the fit never sees), and a deterministic Nelder–Mead search
//! that minimises the root-mean-square relative error over the fitting points alone
//! (docs/calibration.md). `cargo xtask calibrate` prints both tables; `--fit` runs the search.
//!
//! The fit is blind to the validation set by construction: [`fit`] takes fitting points only
//! (a type the validation points are not), and its objective reads nothing else, which a test
//! checks by recording every point the objective is asked about.

use pdkv_core::topology::Layout;

use crate::cost::{Cost, GroupLoad, PrefillLoad};
use crate::scenario::{Clients, CostModel, Length, Scenario};
use crate::RunOptions;

/// One fitting point: the study's `2P_TP8:1D_TP8` on MI300X, DeepSeek-R1 8K in / 1K out, a
/// closed loop at `concurrency` with 10 × C requests, and its published figures
/// (docs/reference.md, "Published measurements").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FittingPoint {
    /// The point's id in docs/calibration.md (`F1`…).
    pub id: &'static str,
    /// Clients in the closed loop.
    pub concurrency: u32,
    /// Published total (input plus output) tokens per second.
    pub total_tok_s: f64,
    /// Published mean time per output token, milliseconds.
    pub tpot_ms: f64,
    /// Published mean time to first token, milliseconds.
    pub ttft_ms: f64,
}

/// The fitting set (docs/calibration.md, "Fitting set").
pub const FITTING: [FittingPoint; 3] = [
    FittingPoint { id: "F1", concurrency: 32, total_tok_s: 8_603.0, tpot_ms: 30.3, ttft_ms: 1_270.0 },
    FittingPoint { id: "F2", concurrency: 128, total_tok_s: 27_576.0, tpot_ms: 37.6, ttft_ms: 2_497.0 },
    FittingPoint { id: "F3", concurrency: 512, total_tok_s: 38_407.0, tpot_ms: 55.9, ttft_ms: 55_179.0 },
];

/// What a validation point measured: one phase on its own, the other given whatever it needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Phase {
    /// Prefill alone: every GPU (one DP rank with its experts) prefills batches of
    /// `batch_tokens` tokens of `prompt_tokens`-token prompts (0: the engine's token budget);
    /// the figure is input tokens per second per node.
    Prefill {
        /// Tokens of each prompt.
        prompt_tokens: u32,
        /// Tokens per GPU per batch; 0 when the source does not give it.
        batch_tokens: u32,
    },
    /// Decode held at `batch` requests per GPU whose KV is `kv_tokens` long; the figure is
    /// output tokens per second per node. `batch: None` means the source gives no batch: the
    /// engine runs as many as its KV cache and its batch limit allow.
    Decode {
        /// Requests per GPU, when published.
        batch: Option<u32>,
        /// Context tokens of each request.
        kv_tokens: u32,
    },
}

/// One held-out point (docs/calibration.md, "Validation set").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValidationPoint {
    /// The point's id in docs/calibration.md (`V1`…).
    pub id: &'static str,
    /// Who published it.
    pub source: &'static str,
    /// GPU profile.
    pub gpu: &'static str,
    /// NIC profile.
    pub nic: &'static str,
    /// The serving stack the source ran (`sim/src/stack.rs`), as the source says.
    pub stack: &'static str,
    /// GPUs of the expert-parallel group, one DP-attention rank each.
    pub ep_ranks: u16,
    /// What was measured.
    pub phase: Phase,
    /// The published figure, tokens per second per node.
    pub published: f64,
}

/// The validation set, as split before any fitting. V9 needs a GB200 profile and NVFP4 weights,
/// which the simulator does not have; it is listed in docs/calibration.md, not here.
pub const VALIDATION: [ValidationPoint; 8] = [
    ValidationPoint {
        id: "V1",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        stack: "sglang",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 1024, batch_tokens: 16_384 },
        published: 57_674.0,
    },
    ValidationPoint {
        id: "V2",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        stack: "sglang",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 2048, batch_tokens: 16_384 },
        published: 54_543.0,
    },
    ValidationPoint {
        id: "V3",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        stack: "sglang",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 4096, batch_tokens: 16_384 },
        published: 50_302.0,
    },
    ValidationPoint {
        id: "V4",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        stack: "sglang",
        ep_ranks: 72,
        phase: Phase::Decode { batch: Some(256), kv_tokens: 2000 },
        published: 22_282.0,
    },
    ValidationPoint {
        id: "V5",
        source: "DeepSeek",
        gpu: "h800",
        nic: "cx7-400g",
        stack: "deepseek",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 4096, batch_tokens: 16_384 },
        published: 32_206.0,
    },
    ValidationPoint {
        id: "V6",
        source: "DeepSeek",
        gpu: "h800",
        nic: "cx7-400g",
        stack: "deepseek",
        ep_ranks: 144,
        // 14.8k output tok/s per node at 20-22 tok/s per user: 14,800 / 8 / 21 = 88 per GPU.
        phase: Phase::Decode { batch: Some(88), kv_tokens: 4989 },
        published: 14_800.0,
    },
    ValidationPoint {
        id: "V7",
        source: "AMD",
        gpu: "mi300x",
        nic: "thor2-400g",
        stack: "vllm",
        ep_ranks: 16,
        phase: Phase::Prefill { prompt_tokens: 2000, batch_tokens: 0 },
        published: 32_300.0,
    },
    ValidationPoint {
        id: "V8",
        source: "AMD",
        gpu: "mi300x",
        nic: "thor2-400g",
        stack: "vllm",
        ep_ranks: 16,
        phase: Phase::Decode { batch: None, kv_tokens: 2050 },
        published: 12_400.0,
    },
];

/// What the simulator gives for one fitting point.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    /// Total tokens per second.
    pub total_tok_s: f64,
    /// Mean TPOT, milliseconds (0 when no request finished).
    pub tpot_ms: f64,
    /// Mean TTFT, milliseconds (0 when no request finished).
    pub ttft_ms: f64,
}

impl FittingPoint {
    /// The point's scenario with the cost constants `cost`.
    pub fn scenario(&self, cost: &CostModel) -> Scenario {
        let mut scenario = Scenario::from_notation("2P_TP8:1D_TP8");
        scenario.workload.clients =
            Clients::Closed { concurrency: self.concurrency, requests: 10 * self.concurrency };
        scenario.workload.input_tokens = Length::Fixed(8192);
        scenario.workload.output_tokens = Length::Fixed(1024);
        scenario.cost = cost.clone();
        scenario
    }

    /// Simulates the point end to end with `cost`; `None` when the scenario cannot run.
    pub fn simulate(&self, cost: &CostModel) -> Option<Figures> {
        let r = crate::run(&self.scenario(cost), RunOptions::default()).ok()?.result;
        Some(Figures {
            total_tok_s: r.throughput.total_tok_s,
            tpot_ms: r.latency_ms.tpot.map_or(0.0, |t| t.mean),
            ttft_ms: r.latency_ms.ttft.map_or(0.0, |t| t.mean),
        })
    }

    /// Relative errors of `figures` against the published ones: throughput, TPOT, TTFT.
    pub fn errors(&self, figures: &Figures) -> [f64; 3] {
        [
            figures.total_tok_s / self.total_tok_s - 1.0,
            figures.tpot_ms / self.tpot_ms - 1.0,
            figures.ttft_ms / self.ttft_ms - 1.0,
        ]
    }
}

impl ValidationPoint {
    /// The point's scenario: its GPU and NIC profiles and serving stack, DeepSeek-R1, one DP+EP
    /// engine a side of its size, the cost constants `cost` and the defaults for everything else. `None` when
    /// a profile is missing or the weights do not fit.
    pub fn scenario(&self, cost: &CostModel) -> Option<Scenario> {
        let n = self.ep_ranks;
        let text = format!(
            "(name: \"{}\", deployment: \"1P_DP{n}EP:1D_DP{n}EP\", profiles: (gpu: \"{}\", nic: \"{}\", model: \"deepseek-r1\"), engines: (stack: \"{}\"))",
            self.id, self.gpu, self.nic, self.stack
        );
        let mut scenario = crate::load::parse_scenario(&text, self.id).ok()?;
        scenario.cost = cost.clone();
        Some(scenario)
    }

    /// What the step-time model gives for the point at its steady state with `cost`, tokens
    /// per second per node, and the batch it ran (tokens per GPU for prefill, requests per
    /// GPU for decode). No queueing: a phase-isolated benchmark runs its batch back to back.
    pub fn predict(&self, cost: &CostModel) -> Option<(f64, String)> {
        let scenario = self.scenario(cost)?;
        let cost = Cost::of(&scenario);
        let layout = Layout::new(self.ep_ranks, 1, true);
        let gpus = f64::from(scenario.hardware.gpus_per_node);
        Some(match self.phase {
            Phase::Prefill { prompt_tokens, batch_tokens } => {
                let budget =
                    if batch_tokens > 0 { batch_tokens } else { scenario.engines.prefill_max_batched_tokens };
                // Whole prompts fill the batch; a prompt longer than the budget is chunked.
                let prompts = (budget / prompt_tokens).max(1);
                let chunk = u64::from(prompt_tokens.min(budget));
                let load = PrefillLoad::of_chunks(&vec![(0, chunk); prompts as usize]);
                let ranks = vec![load; usize::from(self.ep_ranks)];
                let seconds = cost.prefill_ep_step_ns(layout, &ranks) as f64 / 1e9;
                (gpus * load.tokens as f64 / seconds, format!("{} tok/GPU", load.tokens))
            }
            Phase::Decode { batch, kv_tokens } => {
                let batch = batch.unwrap_or_else(|| {
                    let blocks = u64::from(cost.kv_blocks_per_gpu(layout));
                    let per_request =
                        u64::from(kv_tokens).div_ceil(u64::from(scenario.model.block_size_tokens));
                    (blocks / per_request.max(1)).min(u64::from(scenario.engines.decode_max_batch)) as u32
                });
                let load = GroupLoad {
                    batch: u64::from(batch),
                    context_tokens: u64::from(batch) * u64::from(kv_tokens),
                };
                let loads = vec![load; usize::from(self.ep_ranks)];
                let seconds = cost.decode_step_ns(layout, &loads) as f64 / 1e9;
                (gpus * f64::from(batch) / seconds, format!("{batch} req/GPU"))
            }
        })
    }
}

/// A constant the fit may move, and the range it may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FreeConstant {
    /// The `CostModel` field.
    pub name: &'static str,
    /// Smallest value.
    pub lo: f64,
    /// Largest value.
    pub hi: f64,
}

/// The constants the fitting set constrains: it is `2P_TP8:1D_TP8` end to end, so the prefill
/// and decode step costs of TP8, not the EP or all-to-all ones. The ranges are what is
/// physically plausible (an efficiency is in (0, 1]), not what fits.
pub const FREE: [FreeConstant; 6] = [
    FreeConstant { name: "prefill_fixed_ms", lo: 0.0, hi: 1000.0 },
    FreeConstant { name: "prefill_mfu", lo: 0.02, hi: 1.0 },
    FreeConstant { name: "decode_fixed_ms", lo: 0.0, hi: 50.0 },
    FreeConstant { name: "decode_weight_efficiency", lo: 0.1, hi: 1.0 },
    FreeConstant { name: "decode_kv_efficiency", lo: 0.1, hi: 1.0 },
    FreeConstant { name: "decode_per_request_us", lo: 0.0, hi: 100.0 },
];

/// The field `name` of `cost`, mutably; `None` for a name that is not a free constant.
fn field<'a>(cost: &'a mut CostModel, name: &str) -> Option<&'a mut f64> {
    Some(match name {
        "prefill_fixed_ms" => &mut cost.prefill_fixed_ms,
        "prefill_mfu" => &mut cost.prefill_mfu,
        "decode_fixed_ms" => &mut cost.decode_fixed_ms,
        "decode_weight_efficiency" => &mut cost.decode_weight_efficiency,
        "decode_kv_efficiency" => &mut cost.decode_kv_efficiency,
        "decode_per_request_us" => &mut cost.decode_per_request_us,
        _ => return None,
    })
}

/// The value of free constant `c` in `cost`.
pub fn value(cost: &CostModel, c: &FreeConstant) -> f64 {
    let mut copy = cost.clone();
    field(&mut copy, c.name).map_or(f64::NAN, |v| *v)
}

/// `cost` with the free constants at `unit` (each in 0..=1 across its range).
fn with_unit(cost: &CostModel, free: &[FreeConstant], unit: &[f64]) -> CostModel {
    let mut out = cost.clone();
    for (c, u) in free.iter().zip(unit) {
        if let Some(v) = field(&mut out, c.name) {
            *v = c.lo + u.clamp(0.0, 1.0) * (c.hi - c.lo);
        }
    }
    out
}

/// The root mean square of `errors`.
pub fn rms(errors: &[f64]) -> f64 {
    (errors.iter().map(|e| e * e).sum::<f64>() / errors.len().max(1) as f64).sqrt()
}

/// Minimises `f` from `start` with the Nelder–Mead simplex (reflection 1, expansion 2,
/// contraction ½, shrink ½), every coordinate kept in 0..=1. The first simplex steps `step`
/// along each axis (inwards at the upper edge). Stops after `max_evals` evaluations or once
/// the simplex's values differ by less than `tolerance`. Deterministic: no randomness, ties
/// broken by position. Returns the best point and its value.
pub fn nelder_mead(
    f: &mut dyn FnMut(&[f64]) -> f64,
    start: &[f64],
    step: f64,
    max_evals: usize,
    tolerance: f64,
) -> (Vec<f64>, f64) {
    let n = start.len();
    let clamp = |x: Vec<f64>| -> Vec<f64> { x.into_iter().map(|v| v.clamp(0.0, 1.0)).collect() };
    let mut evals = 0;
    let mut eval = |x: &[f64], evals: &mut usize| {
        *evals += 1;
        let v = f(x);
        if v.is_nan() {
            f64::INFINITY
        } else {
            v
        }
    };
    let mut simplex: Vec<(Vec<f64>, f64)> = Vec::with_capacity(n + 1);
    let x0 = clamp(start.to_vec());
    let v0 = eval(&x0, &mut evals);
    simplex.push((x0.clone(), v0));
    for i in 0..n {
        let mut x = x0.clone();
        x[i] = if x[i] + step <= 1.0 { x[i] + step } else { x[i] - step };
        let v = eval(&x, &mut evals);
        simplex.push((x, v));
    }
    let point = |a: &[f64], b: &[f64], t: f64| -> Vec<f64> {
        clamp(a.iter().zip(b).map(|(a, b)| a + t * (b - a)).collect())
    };
    while evals < max_evals {
        // Stable sort: equal values keep their order, so the run is the same every time.
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        let (best, worst) = (simplex[0].1, simplex[n].1);
        if (worst - best).abs() < tolerance {
            break;
        }
        let centroid: Vec<f64> =
            (0..n).map(|j| simplex[..n].iter().map(|(x, _)| x[j]).sum::<f64>() / n as f64).collect();
        let reflected = point(&centroid, &simplex[n].0, -1.0);
        let vr = eval(&reflected, &mut evals);
        if vr < best {
            let expanded = point(&centroid, &simplex[n].0, -2.0);
            let ve = eval(&expanded, &mut evals);
            simplex[n] = if ve < vr { (expanded, ve) } else { (reflected, vr) };
            continue;
        }
        if vr < simplex[n - 1].1 {
            simplex[n] = (reflected, vr);
            continue;
        }
        let (toward, vt) = if vr < worst { (reflected.clone(), vr) } else { (simplex[n].0.clone(), worst) };
        let contracted = point(&centroid, &toward, 0.5);
        let vc = eval(&contracted, &mut evals);
        if vc < vt {
            simplex[n] = (contracted, vc);
            continue;
        }
        let first = simplex[0].0.clone();
        for s in simplex.iter_mut().skip(1) {
            let x = point(&first, &s.0, 0.5);
            let v = eval(&x, &mut evals);
            *s = (x, v);
        }
    }
    simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
    let (x, v) = simplex.swap_remove(0);
    (x, v)
}

/// What a fit found.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// The constants: `start` with the free ones at their fitted values.
    pub cost: CostModel,
    /// Root-mean-square relative error over the fitting points' figures at `cost`.
    pub rms: f64,
    /// Objective evaluations the search made.
    pub evaluations: usize,
}

/// Fits the free constants `free` of `start` to `points` with `simulate` (the simulator, or a
/// stand-in in tests): Nelder–Mead over the constants scaled to their ranges, minimising the
/// root-mean-square relative error of every published figure of every point. A point the
/// simulator cannot run counts as a 100 % error on each figure. Only fitting points reach the
/// objective; validation points are a different type.
pub fn fit(
    points: &[FittingPoint],
    start: &CostModel,
    free: &[FreeConstant],
    max_evals: usize,
    simulate: &mut dyn FnMut(&FittingPoint, &CostModel) -> Option<Figures>,
) -> Fit {
    let unit: Vec<f64> =
        free.iter().map(|c| ((value(start, c) - c.lo) / (c.hi - c.lo)).clamp(0.0, 1.0)).collect();
    let mut evaluations = 0;
    let mut objective = |u: &[f64]| {
        evaluations += 1;
        let cost = with_unit(start, free, u);
        let errors: Vec<f64> = points
            .iter()
            .flat_map(|p| simulate(p, &cost).map_or([1.0; 3], |figures| p.errors(&figures)))
            .collect();
        rms(&errors)
    };
    let (best, value) = nelder_mead(&mut objective, &unit, 0.1, max_evals, 1e-5);
    Fit { cost: with_unit(start, free, &best), rms: value, evaluations }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nelder_mead_finds_a_bounded_minimum() {
        let check = |target: [f64; 3], expected: [f64; 3]| {
            let mut f = |x: &[f64]| x.iter().zip(target).map(|(x, t)| (x - t) * (x - t)).sum::<f64>();
            let (x, v) = nelder_mead(&mut f, &[0.5, 0.5, 0.5], 0.1, 2000, 1e-14);
            for (x, e) in x.iter().zip(expected) {
                assert!((x - e).abs() < 1e-3, "{target:?}: {x} against {e}");
            }
            assert!(v < 1e-5 || target.iter().any(|t| !(0.0..=1.0).contains(t)), "{v}");
        };
        check([0.2, 0.7, 0.4], [0.2, 0.7, 0.4]);
        check([0.95, 0.05, 0.5], [0.95, 0.05, 0.5]);
        // Outside the box the search stops at its edge.
        check([1.5, -0.3, 0.3], [1.0, 0.0, 0.3]);
    }

    #[test]
    fn the_search_is_deterministic() {
        let mut f = |x: &[f64]| (x[0] - 0.3).powi(2) + 10.0 * (x[1] - x[0] * x[0]).powi(2);
        let a = nelder_mead(&mut f, &[0.9, 0.1], 0.1, 300, 1e-12);
        let b = nelder_mead(&mut f, &[0.9, 0.1], 0.1, 300, 1e-12);
        assert_eq!(a, b);
    }

    /// A stand-in simulator whose figures follow two constants, so the fit has a known answer.
    fn stand_in(point: &FittingPoint, cost: &CostModel) -> Figures {
        let c = f64::from(point.concurrency);
        Figures {
            total_tok_s: point.total_tok_s * cost.prefill_mfu / 0.2,
            tpot_ms: point.tpot_ms * cost.decode_fixed_ms / 20.0,
            ttft_ms: point.ttft_ms * (1.0 + (cost.prefill_mfu - 0.2) * c / 512.0),
        }
    }

    #[test]
    fn the_fit_sees_fitting_points_only() {
        let mut seen: Vec<&'static str> = Vec::new();
        let fit = fit(&FITTING, &CostModel::default(), &FREE, 400, &mut |p, cost| {
            seen.push(p.id);
            Some(stand_in(p, cost))
        });
        assert!(fit.rms < 1e-3, "{fit:?}");
        assert!(
            (fit.cost.prefill_mfu - 0.2).abs() < 1e-3 && (fit.cost.decode_fixed_ms - 20.0).abs() < 0.05,
            "{fit:?}"
        );
        // Every point the objective was asked about is a fitting point, and no validation
        // point's id or published figure is among them.
        assert!(!seen.is_empty());
        let fitting: Vec<&str> = FITTING.iter().map(|p| p.id).collect();
        assert!(seen.iter().all(|id| fitting.contains(id)), "{seen:?}");
        for v in &VALIDATION {
            assert!(!seen.contains(&v.id), "{} reached the fit", v.id);
            assert!(
                FITTING.iter().all(|p| ![p.total_tok_s, p.tpot_ms, p.ttft_ms].contains(&v.published)),
                "{}'s figure is in the fitting set",
                v.id
            );
        }
        assert_eq!(fit.evaluations, seen.len() / FITTING.len());
    }

    #[test]
    fn ids_are_disjoint_and_every_free_constant_is_a_field() {
        for f in &FITTING {
            assert!(f.id.starts_with('F') && VALIDATION.iter().all(|v| v.id != f.id), "{}", f.id);
        }
        for c in &FREE {
            assert!(value(&CostModel::default(), c).is_finite(), "{} is not a CostModel field", c.name);
            assert!(c.lo < c.hi);
        }
    }
}
