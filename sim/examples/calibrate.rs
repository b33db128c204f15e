//! Calibration check: the fitting table (`2P_TP8:1D_TP8` at C = 32, 128 and 512 against the
//! published MI300X measurements) and the held-out validation table (public per-phase serving
//! measurements of docs/calibration.md, never used to fit); fails if a fitting figure is off by
//! more than 20 % or if `profiles/calibration.ron` no longer records what this run measured.
//! With `--fit` it first fits the free constants on the fitting points alone (`pdkv_sim::fit`)
//! and prints both tables at the fitted constants. Run with `cargo xtask calibrate [--fit]`.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use pdkv_sim::fit::{self, FittingPoint, Phase, FITTING, FREE, VALIDATION};
use pdkv_sim::scenario::CostModel;

/// Largest fitting error allowed.
const FITTING_LIMIT: f64 = 0.20;

/// Objective evaluations `--fit` may spend (each simulates the three fitting points).
const FIT_EVALUATIONS: usize = 150;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let fitting_mode = match args.as_slice() {
        [] => false,
        [flag] if flag == "--fit" => true,
        _ => {
            eprintln!("usage: calibrate [--fit]");
            return ExitCode::from(2);
        }
    };
    if fitting_mode {
        return fit_and_report();
    }
    let cost = CostModel::default();
    let fitting = fitting_table(&cost);
    let validation = validation_table(&cost);
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

/// `--fit`: fits the free constants on the fitting points alone, starting from the built-in
/// constants, prints them beside the built-in ones, then both tables at the fitted constants.
/// Nothing is written: adopting the constants is an edit of `CostModel::default`.
fn fit_and_report() -> ExitCode {
    let start = CostModel::default();
    println!(
        "Fitting {} free constants on {} (fitting points only), at most {FIT_EVALUATIONS} evaluations",
        FREE.len(),
        FITTING.iter().map(|p| p.id).collect::<Vec<_>>().join(", ")
    );
    let mut simulate = |p: &FittingPoint, cost: &CostModel| p.simulate(cost);
    let found = fit::fit(&FITTING, &start, &FREE, FIT_EVALUATIONS, &mut simulate);
    println!("fit: root mean square {:.2}% after {} evaluations", 100.0 * found.rms, found.evaluations);
    println!("{:<26} {:>12} {:>12} {:>16}", "constant", "built-in", "fitted", "range");
    for c in &FREE {
        println!(
            "{:<26} {:>12.4} {:>12.4} {:>16}",
            c.name,
            fit::value(&start, c),
            fit::value(&found.cost, c),
            format!("{}..{}", c.lo, c.hi)
        );
    }
    println!();
    let fitting = fitting_table(&found.cost);
    validation_table(&found.cost);
    if fitting.worst <= FITTING_LIMIT {
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

/// Simulates the fitting points end to end with `cost` and prints their table.
fn fitting_table(cost: &CostModel) -> Errors {
    println!(
        "Fitting set: 2P_TP8:1D_TP8, DeepSeek-R1 8K/1K, 10 x C requests, simulated vs published (error)"
    );
    println!("{:>5} {:>28} {:>24} {:>28}", "C", "total tok/s", "mean TPOT ms", "mean TTFT ms");
    let mut errors = Vec::new();
    for p in &FITTING {
        // No finished request counts as 0 ms: a 100 % error, so calibration fails.
        let r = p.simulate(cost).expect("calibration scenario runs");
        println!(
            "{:>5} {:>28} {:>24} {:>28}",
            p.concurrency,
            cell(r.total_tok_s, p.total_tok_s, &mut errors),
            cell(r.tpot_ms, p.tpot_ms, &mut errors),
            cell(r.ttft_ms, p.ttft_ms, &mut errors)
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

/// Evaluates every validation point with `cost` and prints the table.
fn validation_table(cost: &CostModel) -> Errors {
    println!();
    println!("Validation set (held out, never fitted): phase alone at the published batch, per node");
    println!(
        "{:>3} {:<9} {:<9} {:>5} {:<26} {:>14} {:>36}",
        "id", "source", "gpu", "EP", "phase", "batch", "tok/s per node, simulated vs published"
    );
    let mut errors = Vec::new();
    let mut sources: Vec<&str> = Vec::new();
    for point in &VALIDATION {
        let (sim, batch) = point.predict(cost).expect("validation profiles exist and the weights fit");
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
