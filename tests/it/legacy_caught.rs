//! Every legacy option is caught: exploring seeds of a small scenario with the option on finds a
//! run that breaks the matching property within a stated budget, and the shrunk counterexample
//! is small. These tests keep the checkers honest (a vacuous checker would find nothing).

use pdkv_core::legacy::Legacy;
use pdkv_sim::explore::{broken_properties, scenario_for_seed, shrink, size, Property};
use pdkv_sim::scenario::{Clients, FaultKind, Length, Scenario, Target, TimedFault};
use pdkv_sim::{RunOptions, RunResult};

/// What a legacy option is expected to break.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// One of the protocol properties.
    Property(Property),
    /// NIC balance: the Jain index of reads at most this.
    JainAtMost(f64),
}

fn small(notation: &str, option: Legacy) -> Scenario {
    let mut s = Scenario::from_notation(notation);
    s.name = format!("caught-{}", option.name());
    s.protocol.legacy = vec![option];
    s.model.layers = 8;
    s.model.moe_layers = 6;
    // Eight layers of a 671B-parameter model is no real model: the KV pool is a fixed share of
    // HBM, not what the weights leave.
    s.hardware.kv_memory_fraction = 0.5;
    s.workload.clients = Clients::Closed { concurrency: 4, requests: 16 };
    s.workload.input_tokens = Length::Fixed(128);
    s.workload.output_tokens = Length::Fixed(4);
    s
}

fn holds(expect: Expect, result: &RunResult) -> bool {
    match expect {
        Expect::Property(p) => !broken_properties(result).contains(&p),
        // A run without reads has no Jain index: it does not show the even spread either.
        Expect::JainAtMost(limit) => result.nic.jain.is_some_and(|jain| jain > limit),
    }
}

/// Explores up to `budget` seeds; returns the first failing seed and the shrunk scenario's size.
fn catch(base: &Scenario, expect: Expect, swarm: bool, budget: u64) -> Option<(u64, u64)> {
    for seed in 0..budget {
        let scenario = scenario_for_seed(base, seed, swarm);
        let result = pdkv_sim::run(&scenario, RunOptions::default()).expect("runs").result;
        if holds(expect, &result) {
            continue;
        }
        let small = match expect {
            Expect::Property(p) => shrink(&scenario, p, 200),
            Expect::JainAtMost(_) => scenario,
        };
        return Some((seed, size(&small)));
    }
    None
}

#[test]
fn every_legacy_option_is_caught_within_its_budget() {
    use Expect::{JainAtMost, Property as P};
    use Property::*;
    // (option, deployment, scenario tweak, expected failure, swarm faults, seed budget, largest
    // acceptable shrunk size)
    type Tweak = fn(&mut Scenario);
    let none: Tweak = |_| {};
    let table: Vec<(Legacy, &str, Tweak, Expect, bool, u64, u64)> = vec![
        (Legacy::ReadFromDp0, "1P_DP2:1D_TP2", none, P(Safety), false, 4, 20),
        (Legacy::ListenerOffsetDpPlusTp, "1P_DP2TP2:1D_TP2", none, P(ListenerExists), false, 4, 20),
        (Legacy::SessionKeyWithoutTp, "1P_TP2:1D_DP2EP", none, P(Safety), false, 4, 20),
        (Legacy::ProxyAliasing, "2P_DP8EP:1D_TP8", none, JainAtMost(0.5), false, 4, u64::MAX),
        (
            Legacy::DropEarlyReleases,
            "1P_TP2:1D_TP2",
            |s| s.engines.prefill_register_delay_ms = 2000,
            P(FreedByReleases),
            false,
            4,
            20,
        ),
        (Legacy::DedupReleases, "1P_TP4:1D_TP8", none, P(FreedByReleases), false, 4, 20),
        (Legacy::NoZeroQuorum, "1P_TP8:1D_TP4", none, P(FreedByReleases), false, 4, 20),
        (Legacy::TpSizeKey, "1P_TP4:1D_TP4", none, P(FreedByReleases), false, 4, 20),
        (Legacy::LazyHandshake, "1P_TP2:1D_TP2", none, P(NoHang), true, 400, 40),
        (Legacy::NoHandshakeTimeout, "1P_TP2:1D_TP2", none, P(NoHang), true, 400, 40),
        (Legacy::NotifyOtherRank, "1P_DP2:1D_TP2", none, P(FreedByReleases), false, 4, 20),
        (
            Legacy::ReaperIgnoresReads,
            "1P_TP2:1D_TP2",
            |s| {
                s.protocol.defer_timeout_ms = 2000;
                s.protocol.handshake_timeout_ms = 500;
                s.workload.input_tokens = Length::Fixed(1024);
                s.faults.timeline.push(TimedFault {
                    at_ms: 0,
                    target: Target("P0.dp0.tp0".into()),
                    fault: FaultKind::SlowNic { factor: 0.0001 },
                    duration_ms: Some(20_000),
                    count: None,
                });
            },
            P(Safety),
            false,
            4,
            60,
        ),
        (Legacy::NoFlexibleReads, "1P_TP8:1D_DP8EP", none, JainAtMost(0.2), false, 4, u64::MAX),
        // No tweak: the swarm's storm (slow NICs across the transfer timeout, tiny timeouts)
        // must find the release that races a posted read by itself.
        (Legacy::ReleaseDuringReads, "1P_TP2:1D_TP2", none, P(Safety), true, 200, 60),
        (
            Legacy::NoQueuedLease,
            "1P_TP2:1D_TP2",
            |s| {
                // One request decodes at a time for about 5 s; the others queue far longer than
                // the 2 s reaper.
                s.engines.decode_max_batch = 1;
                s.workload.output_tokens = Length::Fixed(200);
                s.protocol.defer_timeout_ms = 2000;
                s.protocol.transfer_timeout_ms = 1000;
                s.protocol.handshake_timeout_ms = 500;
            },
            P(FreedByReleases),
            false,
            4,
            40,
        ),
    ];
    assert_eq!(table.len(), Legacy::ALL.len(), "every legacy option has a row");
    let mut missed = Vec::new();
    for (option, notation, tweak, expect, swarm, budget, max_size) in table {
        let mut base = small(notation, option);
        tweak(&mut base);
        // The same scenario without the option must hold, or the row proves nothing.
        let mut fixed = base.clone();
        fixed.protocol.legacy.clear();
        for seed in 0..budget.min(50) {
            let result =
                pdkv_sim::run(&scenario_for_seed(&fixed, seed, swarm), RunOptions::default()).unwrap().result;
            assert!(holds(expect, &result), "{option}: the fixed twin fails too at seed {seed} ({expect:?})");
        }
        match catch(&base, expect, swarm, budget) {
            Some((seed, shrunk)) => {
                eprintln!("{option}: caught at seed {seed}, shrunk to size {shrunk} ({expect:?})");
                if shrunk > max_size {
                    missed.push(format!("{option}: shrunk size {shrunk} > {max_size}"));
                }
            }
            None => {
                missed.push(format!("{option}: no violation of {expect:?} in {budget} seeds of {notation}"))
            }
        }
    }
    assert!(missed.is_empty(), "{}", missed.join("\n"));
}
