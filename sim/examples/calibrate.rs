//! Calibration check: the fitting table (`2P_TP8:1D_TP8` at C = 32, 128 and 512 against the
//! published MI300X measurements) and the held-out validation table (public per-phase serving
//! measurements of docs/calibration.md, never used to fit); fails if a fitting figure is off by
//! more than 20 % or if `profiles/calibration.ron` no longer records what this run measured.
//! Run with `cargo xtask calibrate`.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use pdkv_core::topology::Layout;
use pdkv_sim::cost::{Cost, GroupLoad};
use pdkv_sim::scenario::{Clients, Length, Scenario};
use pdkv_sim::RunOptions;

/// (concurrency, total tok/s, mean TPOT ms, mean TTFT ms) as published (docs/reference.md,
/// "Published measurements").
const PUBLISHED: [(u32, f64, f64, f64); 3] =
    [(32, 8_603.0, 30.3, 1_270.0), (128, 27_576.0, 37.6, 2_497.0), (512, 38_407.0, 55.9, 55_179.0)];

/// Largest fitting error allowed.
const FITTING_LIMIT: f64 = 0.20;

/// What a validation point measured: one phase on its own, the other given whatever it needs.
#[derive(Clone, Copy)]
enum Phase {
    /// Prefill alone: every GPU (one DP rank with its experts) prefills batches of
    /// `batch_tokens` tokens of `prompt_tokens`-token prompts; the figure is input tokens per
    /// second per node.
    Prefill { prompt_tokens: u32, batch_tokens: u32 },
    /// Decode held at `batch` requests per GPU whose KV is `kv_tokens` long; the figure is
    /// output tokens per second per node. `batch: None` means the source gives no batch: the
    /// engine runs as many as its KV cache and its batch limit allow.
    Decode { batch: Option<u32>, kv_tokens: u32 },
}

/// One held-out point (docs/calibration.md, "Validation set").
struct Point {
    id: &'static str,
    source: &'static str,
    gpu: &'static str,
    nic: &'static str,
    /// GPUs of the expert-parallel group, one DP-attention rank each.
    ep_ranks: u16,
    phase: Phase,
    published: f64,
}

/// The validation set, as split before any fitting. V9 needs a GB200 profile and NVFP4 weights,
/// which the simulator does not have; it is listed, not simulated.
const VALIDATION: [Point; 8] = [
    Point {
        id: "V1",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 1024, batch_tokens: 16_384 },
        published: 57_674.0,
    },
    Point {
        id: "V2",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 2048, batch_tokens: 16_384 },
        published: 54_543.0,
    },
    Point {
        id: "V3",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 4096, batch_tokens: 16_384 },
        published: 50_302.0,
    },
    Point {
        id: "V4",
        source: "LMSYS",
        gpu: "h100-sxm",
        nic: "cx7-400g",
        ep_ranks: 72,
        phase: Phase::Decode { batch: Some(256), kv_tokens: 2000 },
        published: 22_282.0,
    },
    Point {
        id: "V5",
        source: "DeepSeek",
        gpu: "h800",
        nic: "cx7-400g",
        ep_ranks: 32,
        phase: Phase::Prefill { prompt_tokens: 4096, batch_tokens: 16_384 },
        published: 32_206.0,
    },
    Point {
        id: "V6",
        source: "DeepSeek",
        gpu: "h800",
        nic: "cx7-400g",
        ep_ranks: 144,
        // 14.8k output tok/s per node at 20-22 tok/s per user: 14,800 / 8 / 21 = 88 per GPU.
        phase: Phase::Decode { batch: Some(88), kv_tokens: 4989 },
        published: 14_800.0,
    },
    Point {
        id: "V7",
        source: "AMD",
        gpu: "mi300x",
        nic: "thor2-400g",
        ep_ranks: 16,
        phase: Phase::Prefill { prompt_tokens: 2000, batch_tokens: 0 },
        published: 32_300.0,
    },
    Point {
        id: "V8",
        source: "AMD",
        gpu: "mi300x",
        nic: "thor2-400g",
        ep_ranks: 16,
        phase: Phase::Decode { batch: None, kv_tokens: 2050 },
        published: 12_400.0,
    },
];

fn main() -> ExitCode {
    let fitting = fitting_table();
    let validation = validation_table();
    let record = pdkv_sim::calibration::current();
    println!();
    println!("{}", record.summary());
    let mut ok = fitting.worst <= FITTING_LIMIT;
    let stale = stale(&record, &fitting, &validation);
    if let Some(why) = &stale {
        println!("profiles/calibration.ron is stale: {why}; write the figures above into it");
        ok = false;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The worst and root-mean-square relative errors of a table.
struct Errors {
    worst: f64,
    rms: f64,
    /// Median absolute error.
    median: f64,
    points: usize,
    sources: usize,
}

impl Errors {
    fn of(errors: &[f64], sources: usize) -> Errors {
        let mut abs: Vec<f64> = errors.iter().map(|e| e.abs()).collect();
        abs.sort_by(f64::total_cmp);
        let median = match abs.len() {
            0 => 0.0,
            n if n % 2 == 1 => abs[n / 2],
            n => (abs[n / 2 - 1] + abs[n / 2]) / 2.0,
        };
        let rms = (abs.iter().map(|e| e * e).sum::<f64>() / abs.len().max(1) as f64).sqrt();
        Errors { worst: abs.last().copied().unwrap_or(0.0), rms, median, points: errors.len(), sources }
    }
}

fn cell(sim: f64, published: f64, errors: &mut Vec<f64>) -> String {
    let error = sim / published - 1.0;
    errors.push(error);
    format!("{sim:>9.1} vs {published:>8.1} ({:+5.1}%)", 100.0 * error)
}

/// Simulates the fitting points end to end and prints their table.
fn fitting_table() -> Errors {
    println!(
        "Fitting set: 2P_TP8:1D_TP8, DeepSeek-R1 8K/1K, 10 x C requests, simulated vs published (error)"
    );
    println!("{:>5} {:>28} {:>24} {:>28}", "C", "total tok/s", "mean TPOT ms", "mean TTFT ms");
    let mut errors = Vec::new();
    for (c, tok_s, tpot, ttft) in PUBLISHED {
        let mut scenario = Scenario::from_notation("2P_TP8:1D_TP8");
        scenario.workload.clients = Clients::Closed { concurrency: c, requests: 10 * c };
        scenario.workload.input_tokens = Length::Fixed(8192);
        scenario.workload.output_tokens = Length::Fixed(1024);
        let r = pdkv_sim::run(&scenario, RunOptions::default()).expect("calibration scenario runs").result;
        println!(
            "{c:>5} {:>28} {:>24} {:>28}",
            cell(r.throughput.total_tok_s, tok_s, &mut errors),
            // No finished request counts as 0 ms: a 100 % error, so calibration fails.
            cell(r.latency_ms.tpot.map_or(0.0, |t| t.mean), tpot, &mut errors),
            cell(r.latency_ms.ttft.map_or(0.0, |t| t.mean), ttft, &mut errors)
        );
    }
    let e = Errors::of(&errors, 1);
    println!(
        "fitting: worst error {:.1}% (limit {:.0}%), root mean square {:.1}%",
        100.0 * e.worst,
        100.0 * FITTING_LIMIT,
        100.0 * e.rms
    );
    e
}

/// The scenario of one validation point: its GPU and NIC profiles, DeepSeek-R1, one DP+EP
/// engine a side of its size, the defaults for everything else (so the same cost constants as
/// the fitting set). Loading it checks that the weights fit and names the figures if not.
fn scenario_of(point: &Point) -> Scenario {
    let n = point.ep_ranks;
    let text = format!(
        "(name: \"{}\", deployment: \"1P_DP{n}EP:1D_DP{n}EP\", profiles: (gpu: \"{}\", nic: \"{}\", model: \"deepseek-r1\"))",
        point.id, point.gpu, point.nic
    );
    pdkv_sim::load::parse_scenario(&text, point.id).expect("validation profiles exist")
}

/// What the simulator's step model gives for one point at its steady state, with the batch it
/// ran (tokens per GPU for prefill, requests per GPU for decode).
fn predict(point: &Point) -> (f64, String) {
    let scenario = scenario_of(point);
    let cost = Cost::of(&scenario);
    let layout = Layout::new(point.ep_ranks, 1, true);
    let gpus = f64::from(scenario.hardware.gpus_per_node);
    match point.phase {
        Phase::Prefill { prompt_tokens, batch_tokens } => {
            let budget =
                if batch_tokens > 0 { batch_tokens } else { scenario.engines.prefill_max_batched_tokens };
            // Whole prompts fill the batch; a prompt longer than the budget is chunked.
            let tokens = (budget / prompt_tokens).max(1) * prompt_tokens.min(budget);
            let ranks = vec![u64::from(tokens); usize::from(point.ep_ranks)];
            let seconds = cost.prefill_ep_step_ns(layout, &ranks) as f64 / 1e9;
            (gpus * f64::from(tokens) / seconds, format!("{tokens} tok/GPU"))
        }
        Phase::Decode { batch, kv_tokens } => {
            let batch = batch.unwrap_or_else(|| {
                let blocks = u64::from(cost.kv_blocks_per_gpu(layout));
                let per_request = u64::from(kv_tokens).div_ceil(u64::from(scenario.model.block_size_tokens));
                (blocks / per_request.max(1)).min(u64::from(scenario.engines.decode_max_batch)) as u32
            });
            let load = GroupLoad {
                batch: u64::from(batch),
                context_tokens: u64::from(batch) * u64::from(kv_tokens),
            };
            let loads = vec![load; usize::from(point.ep_ranks)];
            let seconds = cost.decode_step_ns(layout, &loads) as f64 / 1e9;
            (gpus * f64::from(batch) / seconds, format!("{batch} req/GPU"))
        }
    }
}

/// Evaluates every validation point and prints the table.
fn validation_table() -> Errors {
    println!();
    println!("Validation set (held out, never fitted): phase alone at the published batch, per node");
    println!(
        "{:>3} {:<9} {:<9} {:>5} {:<26} {:>14} {:>36}",
        "id", "source", "gpu", "EP", "phase", "batch", "tok/s per node, simulated vs published"
    );
    let mut errors = Vec::new();
    let mut sources: Vec<&str> = Vec::new();
    for point in &VALIDATION {
        let (sim, batch) = predict(point);
        let phase = match point.phase {
            Phase::Prefill { prompt_tokens, .. } => format!("prefill, {prompt_tokens}-token prompts"),
            Phase::Decode { kv_tokens, .. } => format!("decode, KV {kv_tokens} tokens"),
        };
        if !sources.contains(&point.source) {
            sources.push(point.source);
        }
        println!(
            "{:>3} {:<9} {:<9} {:>5} {:<26} {:>14} {:>36}",
            point.id,
            point.source,
            point.gpu,
            point.ep_ranks,
            phase,
            batch,
            cell(sim, point.published, &mut errors)
        );
    }
    println!(" V9 vLLM     GB200: not simulated (no GB200 profile, no NVFP4 weights)");
    let e = Errors::of(&errors, sources.len());
    println!(
        "validation: median |error| {:.1}%, worst {:.1}%, root mean square {:.1}% over {} points from {} sources",
        100.0 * e.median,
        100.0 * e.worst,
        100.0 * e.rms,
        e.points,
        e.sources
    );
    e
}

/// Why the recorded calibration differs from this run, if it does (to the 0.1 % it prints).
fn stale(
    record: &pdkv_sim::calibration::Calibration,
    fitting: &Errors,
    validation: &Errors,
) -> Option<String> {
    let same = |a: f64, b: f64| (a - b).abs() < 0.0005;
    if !same(record.fitting_error_max, fitting.worst) {
        return Some(format!(
            "fitting_error_max is {:.3}, this run gives {:.3}",
            record.fitting_error_max, fitting.worst
        ));
    }
    let Some(v) = &record.validation else {
        return Some("validation is None, this run measured it".to_string());
    };
    let measured = [
        ("median_abs_error", v.median_abs_error, validation.median),
        ("max_abs_error", v.max_abs_error, validation.worst),
    ];
    for (field, recorded, now) in measured {
        if !same(recorded, now) {
            return Some(format!("validation.{field} is {recorded:.3}, this run gives {now:.3}"));
        }
    }
    if v.points as usize != validation.points || v.sources as usize != validation.sources {
        return Some(format!(
            "validation counts {} points from {} sources, this run {} from {}",
            v.points, v.sources, validation.points, validation.sources
        ));
    }
    None
}
