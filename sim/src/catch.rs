//! The legacy catch table: for every legacy option, a small deployment that shows its bug, the
//! property the bug breaks, and how many seeds an exploration may take to find it, both running
//! the scenario's own workload on every seed and as a search (a small seed drawn per seed).
//!
//! The integration tests assert every row; `cargo xtask catch` prints the seeds each mode took,
//! so the cost of a change to the search is visible option by option.

use pdkv_core::legacy::Legacy;

use crate::explore::{
    broken_properties, ideal_jain, scenario_for_seed, search_scenario_for_seed, Ideal, Property,
};
use crate::result::RunResult;
use crate::scenario::{Clients, FaultKind, Length, Scenario, Target, TimedFault};
use crate::{RunOptions, SimError};

/// What a legacy option is expected to break.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Expect {
    /// One of the protocol properties.
    Property(Property),
    /// NIC balance: the Jain index of reads at most this.
    JainAtMost(f64),
}

impl Expect {
    /// Whether `result` shows the expected failure. A search seed is judged on balance only
    /// when it sent four rounds of the proxy, all ended and none failed, as `pdkv explore`'s balance
    /// property is (`ideal` gives the rounds): fewer requests are uneven by design, whatever
    /// the routing.
    pub fn caught(self, mode: Mode, result: &RunResult, ideal: Option<Ideal>) -> bool {
        match self {
            Expect::Property(p) => broken_properties(result).contains(&p),
            Expect::JainAtMost(limit) => {
                let rounds = ideal.map_or(0, |i| 4 * i.requests_per_round.max(1));
                let q = &result.requests;
                let enough = mode == Mode::Full || (q.sent >= rounds && q.failed == 0 && q.unfinished == 0);
                // A run without reads has no Jain index: it shows no uneven spread either.
                enough && result.nic.jain.is_some_and(|jain| jain <= limit)
            }
        }
    }
}

/// How an exploration makes each seed's scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The row's own workload on every seed (what `pdkv explore --full-workload` runs).
    Full,
    /// A small seed drawn per seed (what `pdkv explore` runs by default).
    Search,
}

impl Mode {
    /// The scenario seed `seed` runs.
    pub fn scenario(self, row: &Row, base: &Scenario, seed: u64, ideal: Option<Ideal>) -> Scenario {
        match self {
            Mode::Full => scenario_for_seed(base, seed, row.swarm),
            Mode::Search => search_scenario_for_seed(base, seed, row.swarm, ideal),
        }
    }
}

/// One legacy option's row.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// The option switched on.
    pub option: Legacy,
    /// The deployment it runs on.
    pub notation: &'static str,
    /// What the row changes in the small base scenario (engines, timeouts, faults, workload).
    pub tweak: fn(&mut Scenario),
    /// What the option breaks.
    pub expect: Expect,
    /// Swarm faults on every seed.
    pub swarm: bool,
    /// Seeds [`Mode::Full`] may take.
    pub full_budget: u64,
    /// Seeds [`Mode::Search`] may take.
    pub search_budget: u64,
    /// Largest acceptable size (`explore::size`) of the shrunk counterexample.
    pub max_shrunk: u64,
    /// Other legacy options the historical bug shipped with, switched on with it (and off in the
    /// fixed twin): a bug that read the wrong rank's memory lived in connectors without an
    /// incarnation fence, and pdkv's fence, which checks that a session is the rank holding the
    /// transfer, turns its silent wrong read into a failed request.
    pub with: &'static [Legacy],
}

impl Row {
    /// The seeds `mode` may take.
    pub fn budget(&self, mode: Mode) -> u64 {
        match mode {
            Mode::Full => self.full_budget,
            Mode::Search => self.search_budget,
        }
    }

    /// The row's base scenario with its option on (or off, for the fixed twin).
    pub fn base(&self, with_option: bool) -> Scenario {
        let mut s = Scenario::from_notation(self.notation);
        s.name = format!("caught-{}", self.option.name());
        if with_option {
            s.protocol.legacy = std::iter::once(self.option).chain(self.with.iter().copied()).collect();
        }
        s.model.layers = 8;
        s.model.moe_layers = 6;
        // Eight layers of a 671B-parameter model is no real model: the KV pool is a fixed share
        // of HBM, not what the weights leave.
        s.hardware.kv_memory_fraction = 0.5;
        s.workload.clients = Clients::Closed { concurrency: 4, requests: 16 };
        s.workload.input_tokens = Length::Fixed(128);
        s.workload.output_tokens = Length::Fixed(4);
        (self.tweak)(&mut s);
        s
    }
}

/// Where an exploration first caught a row's bug.
#[derive(Clone, Debug)]
pub struct Catch {
    /// The first seed that showed it, counted from 0.
    pub seed: u64,
    /// That seed's scenario.
    pub scenario: Scenario,
    /// Events the seeds up to and including it ran.
    pub events: u64,
}

/// Explores seeds `0..budget` of `row` in `mode` until one shows its bug.
pub fn catch(row: &Row, mode: Mode, budget: u64) -> Result<Option<Catch>, SimError> {
    let base = row.base(true);
    let ideal = ideal_jain(&base);
    let mut events = 0;
    for seed in 0..budget {
        let scenario = mode.scenario(row, &base, seed, ideal);
        let result = crate::run(&scenario, RunOptions::default())?.result;
        events += result.events;
        if row.expect.caught(mode, &result, ideal) {
            return Ok(Some(Catch { seed, scenario, events }));
        }
    }
    Ok(None)
}

/// The first of seeds `0..seeds` of the row's fixed twin (the option off) that shows the bug
/// anyway, which would make the row prove nothing.
pub fn fixed_twin_fails(row: &Row, mode: Mode, seeds: u64) -> Result<Option<u64>, SimError> {
    let base = row.base(false);
    let ideal = ideal_jain(&base);
    for seed in 0..seeds {
        let result = crate::run(&mode.scenario(row, &base, seed, ideal), RunOptions::default())?.result;
        if row.expect.caught(mode, &result, ideal) {
            return Ok(Some(seed));
        }
    }
    Ok(None)
}

fn none(_: &mut Scenario) {}

/// Every legacy option's row, in [`Legacy::ALL`]'s order.
pub fn rows() -> Vec<Row> {
    use Expect::{JainAtMost, Property as P};
    use Property::*;
    let row = |option, notation, expect, swarm, full_budget, search_budget, max_shrunk| Row {
        option,
        notation,
        tweak: none,
        expect,
        swarm,
        full_budget,
        search_budget,
        max_shrunk,
        with: &[],
    };
    let unfenced: &'static [Legacy] = &[Legacy::NoIncarnationFence];
    vec![
        Row { with: unfenced, ..row(Legacy::ReadFromDp0, "1P_DP2:1D_TP2", P(Safety), false, 4, 4, 20) },
        row(Legacy::ListenerOffsetDpPlusTp, "1P_DP2TP2:1D_TP2", P(ListenerExists), false, 4, 4, 20),
        Row {
            with: unfenced,
            ..row(Legacy::SessionKeyWithoutTp, "1P_TP2:1D_DP2EP", P(Safety), false, 4, 4, 20)
        },
        row(Legacy::ProxyAliasing, "2P_DP8EP:1D_TP8", JainAtMost(0.5), false, 4, 100, u64::MAX),
        Row {
            tweak: |s| s.engines.prefill_register_delay_ms = 2000,
            ..row(Legacy::DropEarlyReleases, "1P_TP2:1D_TP2", P(FreedByReleases), false, 4, 4, 20)
        },
        row(Legacy::DedupReleases, "1P_TP4:1D_TP8", P(FreedByReleases), false, 4, 4, 20),
        row(Legacy::NoZeroQuorum, "1P_TP8:1D_TP4", P(FreedByReleases), false, 4, 4, 20),
        row(Legacy::TpSizeKey, "1P_TP4:1D_TP4", P(FreedByReleases), false, 4, 4, 20),
        row(Legacy::LazyHandshake, "1P_TP2:1D_TP2", P(NoHang), true, 400, 400, 40),
        row(Legacy::NoHandshakeTimeout, "1P_TP2:1D_TP2", P(NoHang), true, 400, 400, 40),
        row(Legacy::NotifyOtherRank, "1P_DP2:1D_TP2", P(FreedByReleases), false, 4, 4, 20),
        Row {
            tweak: |s| {
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
            // A search seed shrinks less far here (to 65): its slow read needs a long prompt.
            ..row(Legacy::ReaperIgnoresReads, "1P_TP2:1D_TP2", P(Safety), false, 4, 40, 80)
        },
        row(Legacy::NoFlexibleReads, "1P_TP8:1D_DP8EP", JainAtMost(0.2), false, 4, 100, u64::MAX),
        // No tweak: the swarm's storm (slow NICs across the transfer timeout, tiny timeouts)
        // must find the release that races a posted read by itself.
        row(Legacy::ReleaseDuringReads, "1P_TP2:1D_TP2", P(Safety), true, 200, 200, 60),
        Row {
            tweak: |s| {
                // One request decodes at a time for about 5 s; the others queue far longer than
                // the 2 s reaper.
                s.engines.decode_max_batch = 1;
                s.workload.output_tokens = Length::Fixed(200);
                s.protocol.defer_timeout_ms = 2000;
                s.protocol.transfer_timeout_ms = 1000;
                s.protocol.handshake_timeout_ms = 500;
            },
            ..row(Legacy::NoQueuedLease, "1P_TP2:1D_TP2", P(FreedByReleases), false, 4, 40, 40)
        },
        Row {
            tweak: |s| {
                // Prefill engine P1 crashes and restarts while decode, two requests at a time,
                // still has its transfers queued: they are dispatched to the new incarnation.
                s.engines.decode_max_batch = 2;
                s.workload.clients = Clients::Closed { concurrency: 8, requests: 64 };
                s.workload.input_tokens = Length::Fixed(1024);
                s.workload.output_tokens = Length::Fixed(64);
                s.protocol.defer_timeout_ms = 5000;
                s.protocol.handshake_timeout_ms = 1000;
                s.protocol.transfer_timeout_ms = 3000;
                s.faults.timeline.push(TimedFault {
                    at_ms: 1500,
                    target: Target("P1.dp*.tp*".into()),
                    fault: FaultKind::EngineCrash,
                    duration_ms: Some(300),
                    count: None,
                });
            },
            ..row(Legacy::NoIncarnationFence, "2P_TP2:1D_TP2", P(Safety), false, 4, 40, 80)
        },
    ]
}
