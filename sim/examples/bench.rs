//! Simulator benchmark: `2P_TP8:1D_DP8EP` at C = 512 with 5,120 requests of 8K in / 1K out,
//! run five times; prints wall time and events per second against the targets (under 1 s,
//! over 2 million events/s). Run it with `cargo xtask bench`.

use std::time::Instant;

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
            "{} ({} requests finished, {:.0} tok/s, Jain {:.3})",
            run.result.outcome.name(),
            run.result.requests.finished,
            run.result.throughput.total_tok_s,
            run.result.nic.jain
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
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}
