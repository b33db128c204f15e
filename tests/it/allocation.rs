//! Decode KV allocation on demand (vLLM's) against reserving the whole answer at admission:
//! with a pool too small for every answer at once, on demand admits more requests, preempts
//! some and finishes them all by recomputing, and reserving never preempts.

use pdkv_sim::{Outcome, RunOptions, RunResult};

/// 24 clients on one TP8 engine a side, 2K prompts, answers of 64 to 1,024 tokens, 2,048 KV
/// blocks per decode GPU: reserving, about a dozen answers fit at once.
fn run(allocation: &str) -> RunResult {
    let text = format!(
        "(name: \"alloc\", deployment: \"1P_TP8:1D_TP8\", workload: (clients: Closed(concurrency: 24, \
         requests: 240), input_tokens: Fixed(2048), output_tokens: Uniform(min: 64, max: 1024)), \
         engines: (kv_blocks_per_gpu: 2048, decode_kv_allocation: {allocation}))"
    );
    let scenario = pdkv_sim::load::parse_scenario(&text, "<alloc>").unwrap_or_else(|e| panic!("{e}"));
    pdkv_sim::run(&scenario, RunOptions::default()).unwrap_or_else(|e| panic!("{e}")).result
}

#[test]
fn on_demand_admits_more_preempts_and_still_finishes_every_request() {
    let (reserve, on_demand) = (run("Reserve"), run("OnDemand"));
    for r in [&reserve, &on_demand] {
        assert_eq!(r.outcome, Outcome::Clean, "{}", r.scenario_ron);
        assert_eq!((r.requests.finished, r.ledger.held), (240, 0), "{}", r.scenario_ron);
    }
    assert_eq!(reserve.requests.preemptions, 0);
    assert!(on_demand.requests.preemptions > 0, "a pool this small preempts on demand");
    // More requests decode at once, so more tokens per second despite the recomputes.
    assert!(
        on_demand.throughput.output_tok_s > reserve.throughput.output_tok_s,
        "on demand {} tok/s, reserving {} tok/s",
        on_demand.throughput.output_tok_s,
        reserve.throughput.output_tok_s
    );
    // The reserving scenario prints as it did before the field existed.
    assert!(!reserve.scenario_ron.contains("decode_kv_allocation"), "{}", reserve.scenario_ron);
    assert!(on_demand.scenario_ron.contains("decode_kv_allocation: OnDemand"), "{}", on_demand.scenario_ron);
    let again = run("OnDemand");
    assert_eq!(
        serde_json::to_string(&again).expect("JSON"),
        serde_json::to_string(&on_demand).expect("JSON"),
        "the same scenario and seed give the same result"
    );
}
