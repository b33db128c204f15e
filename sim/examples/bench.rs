//! Benchmarks, run with `cargo xtask bench` (release build):
//! - the simulator: `2P_TP8:1D_DP8EP` at C = 512 with 5,120 requests of 8K in / 1K out, five
//!   times; wall time and events per second against the targets (under 1 s, over 2 M events/s);
//! - exploration: seeds per second on one core for a small deadlock scenario (target 5,000), and
//!   for the search `pdkv explore 2P_DP8EP:1D_TP8 --faults swarm` runs (target 500);
//! - the model checker: states per second on `1P_TP2:1D_TP4`.
//!
//! Each figure also goes out as a `figure <name> <value> <unit> <higher|lower>` line, which
//! `cargo xtask bench` compares with the recorded figures.

#![forbid(unsafe_code)]

/// The allocator the `pdkv` binary uses, so the figures are the ones users get.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::Instant;

use pdkv_sim::explore::{
    broken_properties, broken_properties_of, ideal_jain, scenario_for_seed, search_scenario_for_seed,
};
use pdkv_sim::model_check::{check, ModelConfig};
use pdkv_sim::scenario::{Clients, Length, Scenario};
use pdkv_sim::RunOptions;

fn main() {
    let mut scenario = Scenario::from_notation("2P_TP8:1D_DP8EP");
    scenario.workload.clients = Clients::Closed { concurrency: 512, requests: 5120 };
    scenario.workload.input_tokens = Length::Fixed(8192);
    scenario.workload.output_tokens = Length::Fixed(1024);
    let mut walls = Vec::new();
    let mut events = 0;
    let mut outcome = String::new();
    for _ in 0..5 {
        let start = Instant::now();
        let run = pdkv_sim::run(&scenario, RunOptions::default()).expect("the benchmark scenario runs");
        walls.push(start.elapsed().as_secs_f64());
        events = run.result.events;
        outcome = format!(
            "{} ({} requests finished, {:.0} tok/s, Jain {})",
            run.result.outcome.name(),
            run.result.requests.finished,
            run.result.throughput.total_tok_s,
            run.result.nic.jain.map_or("n/a".to_string(), |j| format!("{j:.3}"))
        );
    }
    walls.sort_by(f64::total_cmp);
    let (best, median) = (walls[0], walls[walls.len() / 2]);
    let rate = events as f64 / median;
    println!("simulate 2P_TP8:1D_DP8EP, C = 512, 5120 requests of 8K/1K: {outcome}");
    println!("  events        {events}");
    println!(
        "  wall          median {:.3} s, best {:.3} s (5 runs)  target < 1 s: {}",
        median,
        best,
        verdict(median < 1.0)
    );
    println!("  events/s      {:.2} M (median run)  target > 2 M: {}", rate / 1e6, verdict(rate > 2e6));
    figure("simulate_c512_median_s", median, "s", false);
    figure("simulate_c512_events_per_s", rate / 1e6, "M/s", true);
    explore_rate();
    search_rate();
    model_check_rate();
}

/// A figure for `cargo xtask bench` to compare with the recorded one.
fn figure(name: &str, value: f64, unit: &str, higher_is_better: bool) {
    let better = if higher_is_better { "higher" } else { "lower" };
    println!("figure {name} {value:.4} {unit} {better}");
}

/// Seeds per second on one thread of the search `pdkv explore 2P_DP8EP:1D_TP8 --faults swarm`
/// runs: a small scenario drawn per seed, with swarm faults and the storm.
fn search_rate() {
    let base = Scenario::from_notation("2P_DP8EP:1D_TP8");
    let ideal = ideal_jain(&base);
    let seeds = 2_000u64;
    let (mut events, mut failing) = (0, 0);
    let start = Instant::now();
    for seed in 0..seeds {
        let scenario = search_scenario_for_seed(&base, seed, true, ideal);
        let run = pdkv_sim::run(&scenario, RunOptions::default()).expect("runs");
        events += run.result.events;
        failing += u64::from(!broken_properties_of(&run.result, ideal).is_empty());
    }
    let seconds = start.elapsed().as_secs_f64();
    let rate = seeds as f64 / seconds;
    println!("explore 2P_DP8EP:1D_TP8 as a search (small seed per seed, swarm faults), one thread:");
    println!(
        "  seeds/s       {rate:.0} ({failing} of {seeds} seeds break a property; {:.2} M events/s)  target >= 500: {}",
        events as f64 / seconds / 1e6,
        verdict(rate >= 500.0)
    );
    figure("explore_search_seeds_per_s", rate, "seeds/s", true);
}

/// Seeds per second on one thread: the lost-reply deadlock (no handshake timeout), shrunk to
/// one request, with swarm faults on every seed.
fn explore_rate() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/no-handshake-timeout-lost-reply.ron");
    let mut base = pdkv_sim::load::load_scenario(std::path::Path::new(path)).expect("the scenario loads");
    base.workload.clients = Clients::Closed { concurrency: 1, requests: 1 };
    base.workload.input_tokens = Length::Fixed(64);
    base.workload.output_tokens = Length::Fixed(2);
    let seeds = 5_000u64;
    let start = Instant::now();
    let mut failing = 0;
    for seed in 0..seeds {
        let run = pdkv_sim::run(&scenario_for_seed(&base, seed, true), RunOptions::default()).expect("runs");
        failing += u64::from(!broken_properties(&run.result).is_empty());
    }
    let rate = seeds as f64 / start.elapsed().as_secs_f64();
    println!("explore no-handshake-timeout-lost-reply (1 request, swarm faults), one thread:");
    println!(
        "  seeds/s       {rate:.0} ({failing} of {seeds} seeds break a property)  target >= 5000: {}",
        verdict(rate >= 5000.0)
    );
    figure("explore_one_request_seeds_per_s", rate, "seeds/s", true);
}

/// States per second of the model checker on the fixed protocol.
fn model_check_rate() {
    let config = ModelConfig {
        deployment: "1P_TP2:1D_TP4".into(),
        legacy: Default::default(),
        requests: 3,
        loss_budget: 2,
        max_steps: 4,
        max_states: 2_000_000,
        reduce: true,
        restarts: 0,
    };
    let report = check(&config).expect("checks");
    println!("model check 1P_TP2:1D_TP4, 3 requests, up to 2 losses:");
    println!(
        "  states        {} in {:.3} s ({:.0} states/s), depth {}, {}",
        report.states,
        report.seconds,
        report.states as f64 / report.seconds.max(1e-9),
        report.max_depth,
        if report.violation.is_none() { "no violation" } else { "VIOLATION" }
    );
    figure("model_check_states_per_s", report.states as f64 / report.seconds.max(1e-9), "states/s", true);
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}
