//! Exploration helpers: the properties every run of the fixed protocol must have, swarm faults
//! drawn from a seed, and shrinking a failing scenario to a small one that fails the same way.
//!
//! Everything here is a pure function of its inputs; running many seeds in parallel is the
//! caller's business (the simulator itself never spawns a thread).

use std::fmt;

use crate::result::RunResult;
use crate::rng::Streams;
use crate::scenario::{Clients, FaultKind, Length, Scenario, Swarm, Target, TimedFault};
use crate::RunOptions;

/// A property of the fixed protocol that a run broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Property {
    /// No read of freed or foreign memory, no double free, no protocol error.
    Safety,
    /// Every control message went to a port some listener owns.
    ListenerExists,
    /// No collective waited past its timeout.
    NoHang,
    /// Every request finished or failed with a reported error.
    EveryRequestEnds,
    /// Every prefill block freed exactly once, by its releases (the reaper only when the decode
    /// side died or a fault lost a release or lease).
    FreedByReleases,
    /// Every failed request failed because of an injected fault (`docs/sim.md`, "Excused
    /// failures"); a failure no fault explains is a protocol or configuration defect.
    FailuresExcused,
    /// Reads spread over prefill GPUs about as evenly as the fixed routing spreads them for the
    /// deployment (checked when every GPU could have served a few reads).
    Balanced,
}

impl Property {
    /// Short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Property::Safety => "safety",
            Property::ListenerExists => "listener-exists",
            Property::NoHang => "no-hang",
            Property::EveryRequestEnds => "every-request-ends",
            Property::FreedByReleases => "freed-by-releases",
            Property::FailuresExcused => "failures-excused",
            Property::Balanced => "balanced",
        }
    }
}

impl Property {
    /// What the property asks, in a few words, for the header of a shrunk scenario file.
    pub fn meaning(self) -> &'static str {
        match self {
            Property::Safety => "no read of freed or foreign memory, no double free, no protocol error",
            Property::ListenerExists => "every control message goes to a port some listener owns",
            Property::NoHang => "no collective waits past its timeout",
            Property::EveryRequestEnds => "every request finishes or fails with a reported error",
            Property::FreedByReleases => "every prefill block is freed exactly once, by its releases",
            Property::FailuresExcused => "every failed request failed because of an injected fault",
            Property::Balanced => {
                "reads spread over the prefill GPUs as evenly as the fixed routing spreads them"
            }
        }
    }
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The properties `result` breaks, in a fixed order (empty for a correct run).
pub fn broken_properties(result: &RunResult) -> Vec<Property> {
    let mut broken = Vec::new();
    let port = |v: &crate::result::Violation| v.kind == crate::result::ViolationKind::PortWithoutListener;
    if result.violations.iter().any(|v| !port(v)) {
        broken.push(Property::Safety);
    }
    if result.violations.iter().any(port) {
        broken.push(Property::ListenerExists);
    }
    if !result.hangs.is_empty() {
        broken.push(Property::NoHang);
    }
    // Requests the budget cut off while the run progressed are no verdict on liveness; the
    // blocks they hold are theirs. Requests of a run that stopped progressing, hung or
    // `stalled` (no wait the simulator can show), did not end: that breaks the property.
    let cut_off = result.requests.cut_off;
    if result.requests.unfinished > cut_off {
        broken.push(Property::EveryRequestEnds);
    }
    let ledger = &result.ledger;
    // Blocks still held when the budget cut the run, with their reaper still to come, are no
    // verdict either; nor are those of requests that never ended, already counted above.
    let held = ledger.held > 0 && cut_off + result.requests.stalled == 0 && !ledger.reaper_pending;
    if held || ledger.reaped > ledger.reaped_excused {
        broken.push(Property::FreedByReleases);
    }
    // A request that failed with no injected fault to explain it is no verdict the search may
    // ignore: the protocol or the scenario's own limits failed it.
    if result.requests.failed_unexcused > 0 {
        broken.push(Property::FailuresExcused);
    }
    broken
}

/// What the fixed routing gives a deployment: the Jain index of reads per prefill GPU over 16
/// rounds of the proxy, and how many requests one round takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ideal {
    /// Jain index of the fixed routing.
    pub jain: f64,
    /// Requests in one round of the proxy, times the largest prefill TP size (the flexible
    /// read's cycle).
    pub requests_per_round: u64,
}

/// The [`Ideal`] of `scenario`'s deployment (`None` if the deployment cannot be routed).
pub fn ideal_jain(scenario: &Scenario) -> Option<Ideal> {
    let d =
        pdkv_core::topology::Deployment::parse(&scenario.deployment).ok()?.with_model(scenario.model_spec());
    let report = pdkv_core::routes::routes(&d, &pdkv_core::legacy::LegacyOptions::none(), 16).ok()?;
    // A flexible read cycles over the prefill TP ranks one request at a time, so evenness needs
    // that many rounds too.
    let cycle = u64::from(d.prefill.iter().map(|l| l.tp).max().unwrap_or(1));
    Some(Ideal { jain: report.jain, requests_per_round: report.requests / 16 * cycle })
}

/// Slack below the ideal Jain index before a run counts as unbalanced (small workloads do not
/// fill every round of the proxy).
pub const BALANCE_SLACK: f64 = 0.2;

/// [`broken_properties`] plus the balance check against `ideal` (from [`ideal_jain`]), made
/// only when the run sent at least four rounds of requests (a partial round is uneven by
/// design, more so with decode engines of different widths), all of them ended (a run cut off
/// by its budget read for some requests only) and none of them failed (a failed
/// request's reads are partial or never posted, so the read counts no longer show the routing:
/// a listener slower than the handshake timeout leaves every GPU unread).
pub fn broken_properties_of(result: &RunResult, ideal: Option<Ideal>) -> Vec<Property> {
    let mut broken = broken_properties(result);
    if let Some(ideal) = ideal {
        // Every request sent must also have ended: a run its budget cut short has read for some
        // requests only.
        let q = &result.requests;
        let enough = q.sent >= 4 * ideal.requests_per_round.max(1) && q.failed == 0 && q.unfinished == 0;
        if enough && result.nic.jain.is_some_and(|jain| jain < ideal.jain - BALANCE_SLACK) {
            broken.push(Property::Balanced);
        }
    }
    broken
}

/// Swarm faults for `seed`: each probability is either off or drawn from a small menu, so some
/// seeds are calm and others stormy (swarm testing). Delays stay well below the reaper's delay.
pub fn swarm_for_seed(seed: u64) -> Swarm {
    let mut streams = Streams::new(seed ^ 0x5357_4152_4d00_0000);
    let mut pick = |menu: &[f64]| menu[streams.below(menu.len() as u64) as usize];
    Swarm {
        loss: pick(&[0.0, 0.0, 0.005, 0.02]),
        duplicate: pick(&[0.0, 0.0, 0.02, 0.1]),
        delay: pick(&[0.0, 0.05, 0.2]),
        max_delay_ms: 200,
        send_queue_full: pick(&[0.0, 0.0, 0.05, 0.3]),
    }
}

/// The scenario run for `seed`: the base with that seed and, if `swarm`, its swarm faults and
/// its storm (see [`storm_for_seed`]).
pub fn scenario_for_seed(base: &Scenario, seed: u64, swarm: bool) -> Scenario {
    let mut scenario = base.clone();
    scenario.seed = seed;
    if swarm {
        scenario.faults.swarm = swarm_for_seed(seed);
        storm_for_seed(&mut scenario, seed);
    }
    scenario
}

/// The scenario a search runs for `seed`: [`scenario_for_seed`] made small by
/// [`small_seed`], so a search spends its time on many interleavings and faults rather than on
/// request volume.
pub fn search_scenario_for_seed(base: &Scenario, seed: u64, swarm: bool, ideal: Option<Ideal>) -> Scenario {
    let mut scenario = scenario_for_seed(base, seed, swarm);
    small_seed(&mut scenario, seed, ideal);
    scenario
}

/// Most requests a search seed draws when it sizes its workload for the balance check.
pub const SEARCH_MAX_REQUESTS: u32 = 512;

/// Events every search seed may run, however few its requests (see [`search_max_events`]).
pub const SEARCH_EVENTS_FLOOR: u64 = 20_000;

/// Events a search seed may run per request it sends, above [`SEARCH_EVENTS_FLOOR`].
pub const SEARCH_EVENTS_PER_REQUEST: u64 = 1_000;

/// Most events a search seed of `requests` requests runs: [`SEARCH_EVENTS_PER_REQUEST`] per
/// request, at least [`SEARCH_EVENTS_FLOOR`]. A seed that ran out of events has no verdict on
/// liveness (its requests are cut off, `incomplete`), so the budget must let ordinary seeds
/// finish: on `2P_DP8EP:1D_TP8` they need 20-30 events per request and layer and up to 550
/// per request, and the seeds of the balance check (64 requests there, 512 on
/// `2P_TP8:1D_DP8EP`) were all cut by a flat 10,000. What it still cuts are seeds whose faults
/// make the protocol retry in a loop, such as a listener as slow as a 1 ms handshake timeout
/// that every decode rank dials at once, re-dialled at every step until the queue drains.
pub fn search_max_events(requests: u32) -> u64 {
    SEARCH_EVENTS_FLOOR.max(SEARCH_EVENTS_PER_REQUEST * u64::from(requests))
}

/// Makes `scenario` a small seed drawn from `seed` (the same seed always draws the same):
///
/// - **Workload**: mostly a few to two dozen requests (2 to 24); one seed in eight sends the
///   four rounds of the proxy the balance check needs (`ideal`'s `requests_per_round`, at
///   most [`SEARCH_MAX_REQUESTS`]), so routing bugs stay in reach. Closed loops of 1 to 8
///   clients or open loops from a trickle to a burst; prompts from a few tokens to a few
///   thousand, outputs of 1 to 32 tokens.
/// - **Depth**: seven seeds in eight run a shallower twin of the model, with 2, 3, 4 or 8 layers
///   (MoE layers and parameters in the model's proportion), the eighth the model itself. Per-layer reads make a request's events grow
///   with the depth, and a race between a release and the reads still in flight needs a few
///   layers, not sixty.
/// - **Budget**: at most [`search_max_events`] events.
pub fn small_seed(scenario: &mut Scenario, seed: u64, ideal: Option<Ideal>) {
    let mut streams = Streams::new(seed ^ 0x574f_524b_4c4f_4144);
    let rounds = ideal.map(|i| 4 * i.requests_per_round.max(1)).unwrap_or(0);
    let requests = if rounds > 24 && streams.chance(0.125) {
        rounds.min(u64::from(SEARCH_MAX_REQUESTS)) as u32
    } else {
        2 + streams.below(23) as u32
    };
    scenario.workload.clients = if streams.chance(0.7) {
        let concurrency = 1 + streams.below(u64::from(requests.min(8))) as u32;
        Clients::Closed { concurrency, requests }
    } else {
        let rate_per_s = [2.0, 20.0, 500.0][streams.below(3) as usize];
        Clients::Open { rate_per_s, requests }
    };
    let longest_prompt = [32, 512, 4096][streams.below(3) as usize];
    let shortest_prompt = 1 + streams.below(longest_prompt) as u32;
    scenario.workload.input_tokens = Length::Uniform { min: shortest_prompt, max: longest_prompt as u32 };
    let longest_output = [1, 8, 32][streams.below(3) as usize];
    scenario.workload.output_tokens = Length::Uniform { min: 1, max: longest_output };
    let model = &mut scenario.model;
    let depth = [2, 3, 4, 2, 3, 4, 8, model.layers][streams.below(8) as usize];
    shallow_twin(model, depth);
    scenario.limits.max_events = scenario.limits.max_events.min(search_max_events(requests));
}

/// Makes `model` a shallower twin of itself with `depth` layers (if that is fewer): as wide, its
/// MoE layers and parameters in proportion to its depth, so its weights and step times shrink
/// with it.
fn shallow_twin(model: &mut crate::scenario::ModelProfile, depth: u16) {
    if depth >= model.layers || depth == 0 {
        return;
    }
    // Rounded to the nearest, so DeepSeek-R1's 58 MoE layers of 61 stay all but none.
    let layers = u32::from(model.layers).max(1);
    let moe = (u32::from(model.moe_layers) * u32::from(depth) + layers / 2) / layers;
    let ratio = f64::from(depth) / f64::from(model.layers);
    model.total_params_b *= ratio;
    model.active_params_b *= ratio;
    model.moe_layers = moe as u16;
    model.layers = depth;
}

/// Timing faults and degenerate limits for a swarm seed, on top of the message faults: each is
/// drawn independently, so most seeds get one or two of them. They put reads, messages and
/// handshakes across the protocol's timeout boundaries (a read slower than the transfer timeout,
/// a message late by about a timeout, a listener as slow as the handshake timeout) and run the
/// engines at degenerate limits (a decode batch of one request, timeouts of a few
/// milliseconds), the conditions under which a release may race a read still in flight.
pub fn storm_for_seed(scenario: &mut Scenario, seed: u64) {
    let mut streams = Streams::new(seed ^ 0x5354_4f52_4d00_0000);
    let handshake_ms = scenario.protocol.handshake_timeout_ms;
    let transfer_ms = scenario.transfer_timeout_ms();
    let fault = |at_ms: u64, target: &str, fault: FaultKind, duration_ms: Option<u64>, count: Option<u32>| {
        TimedFault { at_ms, target: Target(target.into()), fault, duration_ms, count }
    };
    // Times near a timeout are drawn as a point of the window within 10 % either side of it and
    // placed once the degenerate limits below are known: a listener "as slow as the handshake
    // timeout" must be as slow as the timeout in force, not 2,000 times slower than a 5 ms one
    // (which only made the decode ranks re-dial every step until the transfer timeout).
    let mut near: Vec<(usize, Near)> = Vec::new();
    let draw_near = |streams: &mut Streams, timeout: Timeout| {
        let timeout_ms = match timeout {
            Timeout::Handshake => handshake_ms,
            Timeout::Transfer => transfer_ms,
        };
        let tenth = (timeout_ms / 10).max(1);
        Near { timeout, point: streams.below(2 * tenth + 1), of: 2 * tenth }
    };
    let targets = ["P*.dp*.tp*", "P0.dp0.tp0", "P*.dp0.tp*"];
    if streams.chance(0.3) {
        // From a tenth of the bandwidth (a read of a long prompt nears the timeout) to a
        // fifty-thousandth (every read outlives it).
        let factor = [0.1, 0.001, 0.00002][streams.below(3) as usize];
        let target = targets[streams.below(targets.len() as u64) as usize];
        let at_ms = [0, 200, 2000][streams.below(3) as usize];
        // Drawn whether or not it is used, as it always was, so seeds keep their draws.
        let about_a_timeout = draw_near(&mut streams, Timeout::Transfer);
        if streams.below(2) == 1 {
            near.push((scenario.faults.timeline.len(), about_a_timeout));
        }
        scenario.faults.timeline.push(fault(at_ms, target, FaultKind::SlowNic { factor }, None, None));
    }
    if streams.chance(0.25) {
        let timeout = if streams.chance(0.5) { Timeout::Handshake } else { Timeout::Transfer };
        near.push((scenario.faults.timeline.len(), draw_near(&mut streams, timeout)));
        let target = targets[streams.below(targets.len() as u64) as usize];
        let count = Some(1 + streams.below(4) as u32);
        let delay = FaultKind::DelayMessages { delay_ms: 0 };
        scenario.faults.timeline.push(fault(0, target, delay, None, count));
    }
    if streams.chance(0.15) {
        near.push((scenario.faults.timeline.len(), draw_near(&mut streams, Timeout::Handshake)));
        let slow = FaultKind::SlowListener { service_ms: 0 };
        scenario.faults.timeline.push(fault(0, "P*.dp*.tp*", slow, None, None));
    }
    let batch_of_one = streams.chance(0.15);
    let short_transfer = streams.chance(0.15).then(|| [1, 5, 50][streams.below(3) as usize]);
    // Imposed as a fault: a request that fails at it failed because of it (excused), which the
    // same timeout written in `protocol` would not be.
    if short_transfer.is_some() {
        scenario.faults.transfer_timeout_ms = short_transfer;
    }
    // Not both: a queued request's lease is renewed every half transfer timeout (at least every
    // millisecond) on every decode rank, and a decode batch of one queues all but one request,
    // so together they send about 24,000 leases a second per queued request on a TP8 decode
    // engine (the 48 seeds of 2,000 of `2P_DP8EP:1D_TP8` that drew both needed up to 3 M events,
    // median 50,000, and were cut). Each alone finishes within the budget.
    if batch_of_one && short_transfer.is_none() {
        scenario.engines.decode_max_batch = 1;
    }
    if streams.chance(0.1) {
        scenario.protocol.handshake_timeout_ms = [1, 5][streams.below(2) as usize];
    }
    for (index, near) in near {
        let timeout_ms = match near.timeout {
            Timeout::Handshake => scenario.protocol.handshake_timeout_ms,
            Timeout::Transfer => scenario.transfer_timeout_ms(),
        };
        let ms = near.place(timeout_ms);
        let entry = &mut scenario.faults.timeline[index];
        match &mut entry.fault {
            FaultKind::SlowNic { .. } => entry.duration_ms = Some(ms),
            FaultKind::DelayMessages { delay_ms } => *delay_ms = ms,
            FaultKind::SlowListener { service_ms } => *service_ms = ms,
            _ => unreachable!("only the faults above draw a time near a timeout"),
        }
    }
}

/// Which timeout a storm's time is drawn near.
#[derive(Clone, Copy)]
enum Timeout {
    Handshake,
    Transfer,
}

/// A time drawn near a timeout: `point` of `of + 1` equal steps across the window within 10 %
/// either side of it.
#[derive(Clone, Copy)]
struct Near {
    timeout: Timeout,
    point: u64,
    of: u64,
}

impl Near {
    /// The time near `timeout_ms` (the timeout in force): the same point of its window. For the
    /// timeout the point was drawn against, exactly the time drawn.
    fn place(self, timeout_ms: u64) -> u64 {
        let tenth = (timeout_ms / 10).max(1);
        let offset = u128::from(self.point) * u128::from(2 * tenth) / u128::from(self.of.max(1));
        timeout_ms.saturating_sub(tenth).saturating_add(offset as u64)
    }
}

/// A measure of a scenario's size: requests, concurrency, tokens and faults (a timeline entry,
/// a swarm probability, an injected transfer timeout count 10 each).
pub fn size(scenario: &Scenario) -> u64 {
    let (c, n) = match scenario.workload.clients {
        Clients::Closed { concurrency, requests } => (u64::from(concurrency), u64::from(requests)),
        Clients::Open { requests, .. } => (1, u64::from(requests)),
    };
    let swarm = &scenario.faults.swarm;
    let swarm_faults = [swarm.loss, swarm.duplicate, swarm.delay, swarm.send_queue_full]
        .iter()
        .filter(|p| **p > 0.0)
        .count();
    let injected = usize::from(scenario.faults.transfer_timeout_ms.is_some());
    n + c
        + longest(scenario.workload.input_tokens) / 64
        + longest(scenario.workload.output_tokens)
        + 10 * (scenario.faults.timeline.len() + swarm_faults + injected) as u64
}

/// The longest length `l` draws.
fn longest(l: Length) -> u64 {
    match l {
        Length::Fixed(n) => u64::from(n),
        Length::Uniform { max, .. } => u64::from(max),
    }
}

/// GPUs of `scenario`'s deployment (0 when it does not parse).
fn gpus(scenario: &Scenario) -> u64 {
    pdkv_core::topology::Deployment::parse(&scenario.deployment)
        .map_or(0, |d| d.prefill.iter().chain(&d.decode).map(|l| u64::from(l.ranks())).sum())
}

/// What shrinking makes smaller, most important first: [`size`], then the deployment's GPUs,
/// the model's layers, the longest prompt and output (a halving that [`size`] rounds away), and
/// the messages the timeline's message faults hit. Every reduction lowers one of them and
/// raises none of those before it, so shrinking ends.
fn measure(s: &Scenario) -> (u64, u64, u16, u64, u64) {
    let hits: u64 = s.faults.timeline.iter().filter_map(|f| f.count).map(u64::from).sum();
    (
        size(s),
        gpus(s),
        s.model.layers,
        longest(s.workload.input_tokens) + longest(s.workload.output_tokens),
        hits,
    )
}

/// The deployments one engine, DP group or TP rank smaller than `notation`'s: each engine
/// dropped (one stays per side), each engine's DP and TP halved. Only those that parse.
fn smaller_deployments(notation: &str) -> Vec<String> {
    let Ok(d) = pdkv_core::topology::Deployment::parse(notation) else { return Vec::new() };
    let mut out = Vec::new();
    for prefill_side in [true, false] {
        let engines = if prefill_side { &d.prefill } else { &d.decode };
        for i in 0..engines.len() {
            let mut variants = Vec::new();
            if engines.len() > 1 {
                let mut fewer = engines.clone();
                fewer.remove(i);
                variants.push(fewer);
            }
            let layout = engines[i];
            for smaller in [
                pdkv_core::topology::Layout { dp: layout.dp / 2, ..layout },
                pdkv_core::topology::Layout { tp: layout.tp / 2, ..layout },
            ] {
                if smaller.dp >= 1 && smaller.tp >= 1 && smaller != layout {
                    let mut changed = engines.clone();
                    changed[i] = smaller;
                    variants.push(changed);
                }
            }
            for engines in variants {
                let mut t = d.clone();
                if prefill_side {
                    t.prefill = engines;
                } else {
                    t.decode = engines;
                }
                let notation = t.notation();
                if pdkv_core::topology::Deployment::parse(&notation).is_ok() && !out.contains(&notation) {
                    out.push(notation);
                }
            }
        }
    }
    out
}

/// Candidate reductions of `s`, each strictly smaller by [`measure`] and valid as a scenario
/// file (a fault whose target the smaller deployment lacks, say, is not offered): one request
/// fewer or half of them, fewer clients, shorter prompts and outputs, each fault dropped (a
/// timeline entry, a swarm probability, the injected transfer timeout), each engine, DP group or
/// TP half of the deployment, fewer layers.
fn reductions(s: &Scenario) -> Vec<Scenario> {
    let mut out = Vec::new();
    let mut with = |f: &dyn Fn(&mut Scenario)| {
        let mut t = s.clone();
        f(&mut t);
        if measure(&t) < measure(s) && crate::load::validate(&t).is_ok() {
            out.push(t);
        }
    };
    // A request fewer shifts every random draw after it, so a failure of many requests may
    // still show with very few where it does not with one fewer: try those first.
    let counts = |requests: u32| {
        let mut counts: Vec<u32> = vec![1, 2, 4, (requests / 2).max(1), requests.saturating_sub(1).max(1)];
        counts.retain(|&n| n < requests);
        counts.sort_unstable();
        counts.dedup();
        counts
    };
    match s.workload.clients {
        Clients::Closed { concurrency, requests } => {
            for n in counts(requests) {
                with(&|t| {
                    t.workload.clients = Clients::Closed { concurrency: concurrency.min(n), requests: n }
                });
            }
            with(&|t| {
                let c = (concurrency / 2).max(1);
                t.workload.clients = Clients::Closed { concurrency: c, requests: requests.max(c) };
            });
            with(&|t| {
                let c = concurrency.saturating_sub(1).max(1);
                t.workload.clients = Clients::Closed { concurrency: c, requests: requests.max(c) };
            });
        }
        Clients::Open { rate_per_s, requests } => {
            for n in counts(requests) {
                with(&|t| t.workload.clients = Clients::Open { rate_per_s, requests: n });
            }
        }
    }
    for i in 0..s.faults.timeline.len() {
        with(&|t| {
            t.faults.timeline.remove(i);
        });
    }
    with(&|t| t.faults.transfer_timeout_ms = None);
    // A message fault that hits fewer messages.
    for i in 0..s.faults.timeline.len() {
        if let Some(count) = s.faults.timeline[i].count.filter(|&c| c > 1) {
            with(&|t| t.faults.timeline[i].count = Some(1));
            with(&|t| t.faults.timeline[i].count = Some(count - 1));
        }
    }
    with(&|t| t.faults.swarm.loss = 0.0);
    with(&|t| t.faults.swarm.duplicate = 0.0);
    with(&|t| t.faults.swarm.delay = 0.0);
    with(&|t| t.faults.swarm.send_queue_full = 0.0);
    let halve = |l: Length| match l {
        Length::Fixed(n) => Length::Fixed((n / 2).max(1)),
        Length::Uniform { min, max } => Length::Fixed(((min + max) / 4).max(1)),
    };
    // A drawn length range may fail only near one end: try its shortest as well as halving.
    let shortest = |l: Length| match l {
        Length::Uniform { min, .. } => Length::Fixed(min),
        fixed => fixed,
    };
    with(&|t| t.workload.input_tokens = shortest(t.workload.input_tokens));
    with(&|t| t.workload.output_tokens = shortest(t.workload.output_tokens));
    with(&|t| t.workload.input_tokens = halve(t.workload.input_tokens));
    with(&|t| t.workload.output_tokens = halve(t.workload.output_tokens));
    for notation in smaller_deployments(&s.deployment) {
        with(&|t| t.deployment = notation.clone());
    }
    let layers = s.model.layers;
    for depth in [layers / 2, layers.saturating_sub(1)] {
        with(&|t| shallow_twin(&mut t.model, depth));
    }
    out
}

/// What shrinking found: the smallest failing scenario, and how many runs it took.
#[derive(Clone, Debug, PartialEq)]
pub struct Shrunk {
    /// The scenario.
    pub scenario: Scenario,
    /// Runs the shrinker spent (at most its budget).
    pub runs: usize,
    /// Whether it ended at a local minimum: no single reduction of `scenario` (see
    /// [`reductions`]) still breaks the property. False when the budget ran out first.
    pub local_minimum: bool,
}

/// Whether `scenario` (with its own seed) breaks `property`; a scenario that cannot run does
/// not.
fn breaks(scenario: &Scenario, property: Property) -> bool {
    crate::run(scenario, RunOptions::default())
        .is_ok_and(|run| broken_properties_of(&run.result, ideal_jain(scenario)).contains(&property))
}

/// Shrinks a scenario that breaks `property` (with its own seed) to a smaller one that still
/// breaks it, trying at most `budget` runs. Greedy to a fixpoint: the first reduction that still
/// fails is taken, and the reductions of the result tried again, until none fails (a local
/// minimum) or the budget is spent. Deterministic: the same scenario shrinks to the same one.
pub fn shrink(failing: &Scenario, property: Property, budget: usize) -> Shrunk {
    let mut current = failing.clone();
    let mut runs = 0;
    'outer: loop {
        for candidate in reductions(&current) {
            if runs >= budget {
                return Shrunk { scenario: current, runs, local_minimum: false };
            }
            runs += 1;
            if breaks(&candidate, property) {
                current = candidate;
                continue 'outer;
            }
        }
        return Shrunk { scenario: current, runs, local_minimum: true };
    }
}

/// A seed of an exploration (shrunk, or as it ran) made a scenario of its own, and the text of
/// its file.
#[derive(Clone, Debug, PartialEq)]
pub struct ScenarioFile {
    /// The scenario: named `<base>-seed<seed>-shrunk` or `<base>-seed<seed>`.
    pub scenario: Scenario,
    /// The RON file: a header saying where it comes from and what it breaks, then the scenario.
    pub text: String,
}

/// Turns `small`, shrunk from seed `seed` of `base` because it broke `property`, into a
/// scenario file of its own. It gets its own name, so its report does not overwrite the
/// original's. It drops the original's `expect` and `expect_jain`: those describe the original
/// run, and a stale `expect: leak` would call a shrunk leak "as expected". Without them it is
/// expected to be clean, which a run that breaks a property is not: `pdkv run` of the file
/// exits 1 for as long as the failure lasts, and 0 once a fix makes it pass. The header says
/// which property it breaks and the outcome it has (`small` runs once more to learn it); an
/// error says why it cannot run. Profiles whose values it no longer holds are dropped
/// ([`crate::profiles::drop_contradicted`]), so the file loads whatever the original named.
pub fn shrunk_file(
    base: &Scenario,
    seed: u64,
    property: Property,
    small: &Scenario,
) -> Result<ScenarioFile, crate::SimError> {
    let mut scenario = small.clone();
    scenario.name = format!("{}-seed{seed}-shrunk", base.name);
    scenario.description =
        format!("Shrunk by pdkv explore from seed {seed} of {}: breaks {property}", base.name);
    scenario.expect = None;
    scenario.expect_jain = None;
    let declares = match (property, ideal_jain(&scenario)) {
        // Balance is no outcome: the file bounds the Jain index instead, at what the search
        // asks (the fixed routing's index less the slack), so `pdkv run` fails on it too.
        (Property::Balanced, Some(ideal)) => {
            let at_least = ((ideal.jain - BALANCE_SLACK) * 1000.0).floor() / 1000.0;
            scenario.expect_jain =
                Some(crate::scenario::JainBounds { at_least: Some(at_least), at_most: None });
            format!("`expect_jain: (at_least: {at_least})` (the fixed routing's index less {BALANCE_SLACK}) and no `expect`")
        }
        _ => "no `expect`".to_string(),
    };
    let dropped = crate::profiles::drop_contradicted(&mut scenario);
    let outcome = crate::run(&scenario, RunOptions::default())?.result.outcome;
    let text = format!(
        "// Shrunk by `pdkv explore` from seed {seed} of {}; its outcome is {}.\n\
         // It breaks the property {property}: {}.\n\
         // It declares {declares}, so `pdkv run` expects it clean and exits 1\n\
         // (NOT AS EXPECTED) while it breaks the property, and 0 once a fix makes it pass.\n{}{}",
        base.name,
        outcome.name(),
        property.meaning(),
        profiles_note(&dropped),
        crate::load::scenario_to_ron(&scenario)
    );
    Ok(ScenarioFile { scenario, text })
}

/// The header lines that say which profiles a written scenario no longer names.
fn profiles_note(dropped: &[String]) -> String {
    if dropped.is_empty() {
        return String::new();
    }
    format!(
        "// It no longer names the {}, whose values it does not hold (a search runs a\n\
         // shallower twin of the model): its own values are written out below.\n",
        dropped.join(" and the ")
    )
}

/// How many seeds of each outcome but `clean` an exploration names and writes as scenario files
/// (the smallest ones; the others are counted).
pub const SEEDS_LISTED_PER_OUTCOME: usize = 10;

/// Seed `seed` of an exploration of `base`, which ran `scenario` and ended `outcome`, as a
/// scenario file of its own, so `pdkv run` of it replays that seed: named `<base>-seed<seed>`,
/// its `expect` the outcome it had (`pdkv run` exits 0 while it still ends so), without the
/// profiles whose values it no longer holds.
pub fn seed_file(base: &Scenario, seed: u64, scenario: &Scenario, outcome: crate::Outcome) -> ScenarioFile {
    let mut scenario = scenario.clone();
    scenario.name = format!("{}-seed{seed}", base.name);
    scenario.description = format!("Seed {seed} of {} as pdkv explore ran it: {}", base.name, outcome.name());
    scenario.expect = Some(outcome);
    scenario.expect_jain = None;
    let dropped = crate::profiles::drop_contradicted(&mut scenario);
    let why = match outcome {
        crate::Outcome::Incomplete => format!(
            "// Its budget (limits.max_events {}, limits.max_virtual_time_s {}) ended it while requests\n\
             // were still in flight and progressing: no verdict on liveness. Raise it to see the run end.\n",
            scenario.limits.max_events, scenario.limits.max_virtual_time_s
        ),
        _ => String::new(),
    };
    let text = format!(
        "// Seed {seed} of {} as `pdkv explore` ran it; its outcome is {}.\n{why}\
         // It declares `expect: {}`, so `pdkv run` of it exits 0 while it still ends so.\n{}{}",
        base.name,
        outcome.name(),
        outcome.name(),
        profiles_note(&dropped),
        crate::load::scenario_to_ron(&scenario)
    );
    ScenarioFile { scenario, text }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swarm_is_a_function_of_the_seed_and_varies() {
        assert_eq!(swarm_for_seed(3), swarm_for_seed(3));
        let calm =
            (0..64).filter(|&s| swarm_for_seed(s) == Swarm { max_delay_ms: 200, ..Swarm::default() }).count();
        assert!(calm > 0 && calm < 64, "{calm} of 64 seeds calm");
    }

    /// The storm's times near a timeout are near the timeout in force: a listener as slow as a
    /// 1 ms handshake timeout, not as the default 10 s one (which made the decode ranks re-dial
    /// at every step until the transfer timeout, hundreds of thousands of events, cut by the
    /// budget). Seeds that keep their default timeouts keep the times they always drew.
    #[test]
    fn storm_times_are_near_the_timeouts_in_force() {
        let base = Scenario::from_notation("2P_DP8EP:1D_TP8");
        let (mut shortened, mut kept) = (0, 0);
        for seed in 0..2000 {
            let mut s = base.clone();
            storm_for_seed(&mut s, seed);
            let (handshake, transfer) = (s.protocol.handshake_timeout_ms, s.transfer_timeout_ms());
            let near = |ms: u64, timeout: u64| {
                let tenth = (timeout / 10).max(1);
                (timeout.saturating_sub(tenth)..=timeout + tenth).contains(&ms)
            };
            for f in &s.faults.timeline {
                match f.fault {
                    FaultKind::SlowListener { service_ms } => {
                        assert!(near(service_ms, handshake), "seed {seed}: {service_ms} ms vs {handshake} ms")
                    }
                    FaultKind::DelayMessages { delay_ms } => assert!(
                        near(delay_ms, handshake) || near(delay_ms, transfer),
                        "seed {seed}: {delay_ms} ms vs {handshake} and {transfer} ms"
                    ),
                    FaultKind::SlowNic { .. } => {
                        if let Some(d) = f.duration_ms {
                            assert!(near(d, transfer), "seed {seed}: {d} ms vs {transfer} ms")
                        }
                    }
                    _ => {}
                }
            }
            // A decode batch of one with a transfer timeout of a few milliseconds renews leases
            // every millisecond on every rank: never both.
            assert!(!(s.engines.decode_max_batch == 1 && s.faults.transfer_timeout_ms.is_some()));
            assert_eq!(s.protocol.transfer_timeout_ms, base.protocol.transfer_timeout_ms);
            if handshake < base.protocol.handshake_timeout_ms {
                shortened += s
                    .faults
                    .timeline
                    .iter()
                    .filter(|f| matches!(f.fault, FaultKind::SlowListener { .. }))
                    .count();
            } else {
                kept += 1;
            }
        }
        assert!(
            shortened > 5 && kept > 1000,
            "{shortened} slow listeners at a short timeout, {kept} seeds kept"
        );
        // A time drawn near a timeout is the same point of the window near another one.
        let n = Near { timeout: Timeout::Handshake, point: 1500, of: 2000 };
        assert_eq!([n.place(10_000), n.place(1), n.place(5), n.place(50)], [10_500, 1, 5, 52]);
        let n = Near { timeout: Timeout::Transfer, point: 0, of: 2 };
        assert_eq!([n.place(10), n.place(1), n.place(0)], [9, 0, 0]);
    }

    /// The seeds of `2P_DP8EP:1D_TP8 --faults swarm` that ended `failed_requests`: each drew a
    /// 1 ms transfer timeout, and every failure was "KV not received within 1 ms". Most of them
    /// were excused only because a message fault happened to touch the request's ranks; these
    /// had a few that nothing touched. The timeout is the storm's fault, imposed as one, so its
    /// failures are its doing.
    #[test]
    fn failures_at_the_storms_transfer_timeout_are_the_storms() {
        let base = Scenario::from_notation("2P_DP8EP:1D_TP8");
        let ideal = ideal_jain(&base);
        for seed in [281, 1069, 1363, 1472, 1526, 1590] {
            let s = search_scenario_for_seed(&base, seed, true, ideal);
            assert_eq!(s.faults.transfer_timeout_ms, Some(1), "seed {seed}");
            let r = crate::run(&s, RunOptions::default()).expect("runs").result;
            assert!(r.requests.failed_excused > 0, "seed {seed}: {:?}", r.requests);
            assert_eq!(r.requests.failed_unexcused, 0, "seed {seed}: {:?}", r.requests);
        }
    }

    #[test]
    fn a_search_seed_is_small_varied_and_a_function_of_the_seed() {
        let base = Scenario::from_notation("2P_DP8EP:1D_TP8");
        let ideal = ideal_jain(&base);
        let rounds = 4 * ideal.expect("routable").requests_per_round;
        assert_eq!(
            search_scenario_for_seed(&base, 5, true, ideal),
            search_scenario_for_seed(&base, 5, true, ideal)
        );
        let seeds: Vec<Scenario> =
            (0..400).map(|s| search_scenario_for_seed(&base, s, true, ideal)).collect();
        let requests = |s: &Scenario| match s.workload.clients {
            Clients::Closed { requests, .. } | Clients::Open { requests, .. } => u64::from(requests),
        };
        for s in &seeds {
            let n = requests(s);
            assert!((2..=24).contains(&n) || n == rounds.min(u64::from(SEARCH_MAX_REQUESTS)), "{n} requests");
            assert!(s.limits.max_events <= search_max_events(n as u32));
            assert!(s.model.moe_layers <= s.model.layers && s.model.layers >= 2);
            let Length::Uniform { max, .. } = s.workload.output_tokens else {
                panic!("drawn outputs are uniform")
            };
            assert!(max <= 32);
        }
        // The draws vary: both loop kinds, shallow twins and the model itself, balance seeds.
        let count = |f: &dyn Fn(&Scenario) -> bool| seeds.iter().filter(|s| f(s)).count();
        let open = count(&|s| matches!(s.workload.clients, Clients::Open { .. }));
        let own_depth = count(&|s| s.model.layers == base.model.layers);
        let balance = count(&|s| requests(s) == rounds);
        for (what, n) in
            [("open loops", open), ("the model's own depth", own_depth), ("balance seeds", balance)]
        {
            assert!(n > 10 && n < 300, "{what}: {n} of 400");
        }
        // A shallow twin keeps the model's width and its MoE share, with parameters in
        // proportion: DeepSeek-R1's 58 MoE layers of 61 at depth 4 are 4 of 4.
        let twin = seeds.iter().find(|s| s.model.layers == 4).expect("some seed draws depth 4");
        assert_eq!(twin.model.moe_layers, 4);
        assert_eq!(twin.model.hidden_size, base.model.hidden_size);
        let ratio = twin.model.total_params_b / base.model.total_params_b;
        assert!((ratio - 4.0 / 61.0).abs() < 1e-12, "{ratio}");
        // Every seed of the deployment can run (a twin's weights leave room for its KV).
        for s in seeds.iter().take(40) {
            crate::run(s, RunOptions::default()).expect("a search seed runs");
        }
    }

    /// Shrinking ends at a local minimum: no single request, fault, engine, DP group, TP half or
    /// layer of the result can be removed with the failure kept. Checked on legacy options
    /// caught as a search (a small seed per seed), where shrinking had stopped early: an open
    /// loop's requests were never reduced (`prefill-crash-restart` seed 51 stayed at size 128)
    /// and nothing shrank the deployment or the model.
    #[test]
    fn a_shrunk_failure_is_a_local_minimum() {
        use crate::catch::{catch, rows, Expect, Mode};
        use pdkv_core::legacy::Legacy;
        for option in [Legacy::NoZeroQuorum, Legacy::ReadFromDp0, Legacy::ReleaseDuringReads] {
            let row = rows().into_iter().find(|r| r.option == option).expect("every option has a row");
            let Expect::Property(property) = row.expect else { panic!("{option}: a property row") };
            let found = catch(&row, Mode::Search, row.budget(Mode::Search)).expect("runs").expect("caught");
            let shrunk = shrink(&found.scenario, property, 2000);
            assert!(shrunk.local_minimum, "{option}: budget spent after {} runs", shrunk.runs);
            assert!(breaks(&shrunk.scenario, property), "{option}: the result still fails");
            let candidates = reductions(&shrunk.scenario);
            assert!(!candidates.is_empty(), "{option}: {:?}", shrunk.scenario);
            for candidate in candidates {
                assert!(
                    !breaks(&candidate, property),
                    "{option}: a reduction still breaks {property}: {}",
                    crate::load::scenario_to_ron(&candidate)
                );
            }
            assert!(size(&shrunk.scenario) <= size(&found.scenario));
            // The same failure shrinks to the same scenario.
            assert_eq!(shrink(&found.scenario, property, 2000), shrunk, "{option}");
        }
    }

    /// The reductions offered include one request fewer for either kind of clients, dropping each
    /// fault, each engine and half of each layout, and fewer layers; each is strictly smaller and
    /// a valid scenario.
    #[test]
    fn reductions_remove_requests_faults_ranks_and_layers() {
        let mut s = Scenario::from_notation("2P_TP4:1D_DP2TP2");
        s.hardware.kv_memory_fraction = 0.5;
        s.workload.clients = Clients::Open { rate_per_s: 20.0, requests: 9 };
        s.faults.transfer_timeout_ms = Some(5);
        s.faults.timeline.push(TimedFault {
            at_ms: 0,
            target: Target("P1.dp0.tp*".into()),
            fault: FaultKind::DelayMessages { delay_ms: 100 },
            duration_ms: None,
            count: Some(3),
        });
        let all = reductions(&s);
        let has = |f: &dyn Fn(&Scenario) -> bool| all.iter().any(f);
        for n in [1, 2, 4, 8] {
            assert!(has(&|t| t.workload.clients == Clients::Open { rate_per_s: 20.0, requests: n }), "{n}");
        }
        assert!(has(&|t| t.faults.timeline.is_empty()));
        assert!(has(&|t| t.faults.transfer_timeout_ms.is_none()));
        assert!(has(&|t| t.faults.timeline.first().is_some_and(|f| f.count == Some(1))));
        let deployments: Vec<&str> =
            all.iter().map(|t| t.deployment.as_str()).filter(|d| *d != s.deployment).collect();
        // Dropping an engine of P0 and P1 leaves P0 (the fault's P1 would be gone): not offered.
        assert_eq!(
            deployments,
            ["1P_TP2+1P_TP4:1D_DP2TP2", "1P_TP4+1P_TP2:1D_DP2TP2", "2P_TP4:1D_TP2", "2P_TP4:1D_DP2"]
        );
        assert!(has(&|t| t.model.layers == s.model.layers / 2));
        assert!(has(&|t| t.model.layers == s.model.layers - 1));
        for t in &all {
            assert!(measure(t) < measure(&s));
            crate::load::validate(t).expect("a valid scenario");
        }
    }

    #[test]
    fn shrinking_keeps_the_failure_and_reduces_the_size() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/no-zero-quorum-p8-d4.ron");
        let scenario = crate::load::load_scenario(&path).unwrap();
        let run = crate::run(&scenario, RunOptions::default()).unwrap();
        assert_eq!(broken_properties(&run.result), [Property::FreedByReleases]);
        let small = shrink(&scenario, Property::FreedByReleases, 200).scenario;
        assert!(size(&small) < size(&scenario), "{} !< {}", size(&small), size(&scenario));
        let again = crate::run(&small, RunOptions::default()).unwrap();
        assert!(broken_properties(&again.result).contains(&Property::FreedByReleases));
        assert_eq!(small.workload.clients, Clients::Closed { concurrency: 1, requests: 1 });

        // As a file, it has a name of its own, no stale expectation, and a header that says what
        // it breaks; the file reads back as the same scenario.
        let file = shrunk_file(&scenario, 0, Property::FreedByReleases, &small).unwrap();
        assert_eq!(file.scenario.name, "no-zero-quorum-p8-d4-seed0-shrunk");
        assert_eq!((scenario.expect, file.scenario.expect), (Some(crate::Outcome::Leak), None));
        assert_eq!(file.scenario.expect_jain, None);
        assert_eq!(file.scenario.workload, small.workload);
        assert!(
            file.text.starts_with(
                "// Shrunk by `pdkv explore` from seed 0 of no-zero-quorum-p8-d4; its outcome is leak.\n\
                 // It breaks the property freed-by-releases: every prefill block is freed exactly once, \
                 by its releases.\n"
            ),
            "{}",
            file.text
        );
        let back = crate::load::parse_scenario(&file.text, "shrunk").unwrap();
        assert_eq!(back, file.scenario);
        let rerun = crate::run(&back, RunOptions::default()).unwrap().result;
        assert!(!rerun.as_expected(), "expected clean, and it leaks");
    }
}
