//! Calibration check: `2P_TP8:1D_TP8` at C = 32, 128 and 512 (8K in, 1K out, 10 x C requests)
//! against the published MI300X measurements listed in docs/reference.md (vLLM RFC #46107);
//! prints each figure, the published one and the relative error, and fails if any is off by
//! more than 20 %. Run with `cargo xtask calibrate`.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use pdkv_sim::scenario::{Clients, Length, Scenario};
use pdkv_sim::RunOptions;

/// (concurrency, total tok/s, mean TPOT ms, mean TTFT ms) as published (docs/reference.md,
/// "Published measurements").
const PUBLISHED: [(u32, f64, f64, f64); 3] =
    [(32, 8_603.0, 30.3, 1_270.0), (128, 27_576.0, 37.6, 2_497.0), (512, 38_407.0, 55.9, 55_179.0)];

fn main() -> ExitCode {
    let mut worst: f64 = 0.0;
    println!("2P_TP8:1D_TP8, DeepSeek-R1 8K/1K, 10 x C requests: simulated vs published (error)");
    println!("{:>5} {:>28} {:>24} {:>28}", "C", "total tok/s", "mean TPOT ms", "mean TTFT ms");
    for (c, tok_s, tpot, ttft) in PUBLISHED {
        let mut scenario = Scenario::from_notation("2P_TP8:1D_TP8");
        scenario.workload.clients = Clients::Closed { concurrency: c, requests: 10 * c };
        scenario.workload.input_tokens = Length::Fixed(8192);
        scenario.workload.output_tokens = Length::Fixed(1024);
        let r = pdkv_sim::run(&scenario, RunOptions::default()).expect("calibration scenario runs").result;
        let cell = |sim: f64, published: f64, worst: &mut f64| {
            let error = sim / published - 1.0;
            *worst = worst.max(error.abs());
            format!("{sim:>9.1} vs {published:>8.1} ({:+5.1}%)", 100.0 * error)
        };
        println!(
            "{c:>5} {:>28} {:>24} {:>28}",
            cell(r.throughput.total_tok_s, tok_s, &mut worst),
            // No finished request counts as 0 ms: a 100 % error, so calibration fails.
            cell(r.latency_ms.tpot.map_or(0.0, |t| t.mean), tpot, &mut worst),
            cell(r.latency_ms.ttft.map_or(0.0, |t| t.mean), ttft, &mut worst)
        );
    }
    println!("worst error {:.1}% (limit 20%)", 100.0 * worst);
    if worst <= 0.20 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
