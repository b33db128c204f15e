//! `pdkv plan` as a library: from a GPU budget, profiles, a workload and SLOs, every layout of
//! the budget is enumerated (`layouts.rs`), screened with the cost model and the core's routing
//! (`screen.rs`), and the best few by estimated goodput per GPU run in the simulator on threads;
//! the runs' steady-state goodput per GPU ranks them, with the bound resource and the groups the
//! calibration's stated error cannot separate (`docs/sim.md`, "Planning").
//!
//! Deterministic: the screen is pure, every run is a pure function of its scenario, and results
//! are placed by index whatever the thread timing, so two plans print the same bytes.

pub mod layouts;
pub mod screen;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use pdkv_sim::load::Violation;
use pdkv_sim::profiles::ResolveError;
use pdkv_sim::scenario::{Clients, Length, Profiles, Scenario, Slo, Workload};
use pdkv_sim::{RunOptions, RunResult, SimError};
use serde::Serialize;

use layouts::{candidates, engine_layouts, Candidate, Side};
use screen::{decode_bound, Bound, Estimate, Lengths, Screen, ScreenMiss};

/// Largest GPU budget a plan searches (the notation's own limit is 4,096 per side; at 1,024
/// GPUs a mixture-of-experts model already has a million candidates).
pub const MAX_GPUS: u32 = 1024;
/// Most layouts a plan runs in the simulator.
pub const MAX_TOP: usize = 64;
/// Requests a run gets by default: ten per client of its concurrency, within these bounds, so
/// small layouts have a steady window and large ones finish in seconds.
pub const DEFAULT_REQUESTS: (u32, u32) = (400, 4000);

/// How the runs load each layout.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// Closed loops sized for each layout: the requests in flight at [`AUTO_LOAD_SHARES`] of
    /// its screened capacity (Little's law, [`Screen::in_flight`]); the best goodput stands.
    Auto,
    /// A closed loop of this many clients for every layout.
    Concurrency(u32),
    /// Poisson arrivals at this many requests per second for every layout.
    Rate(f64),
}

/// What to plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanSpec {
    /// GPUs available; a layout uses at most this many.
    pub gpus: u32,
    /// GPU profile name (`profiles/gpus.ron`).
    pub gpu: String,
    /// NIC profile name (`profiles/nics.ron`); `None` keeps the built-in NIC values.
    pub nic: Option<String>,
    /// Model profile name (`profiles/models.ron`).
    pub model: String,
    /// Serving stack (`sim/src/stack.rs`); `None` keeps the scenario default, the fitting
    /// points' stack.
    pub stack: Option<String>,
    /// Prompt length.
    pub input: Length,
    /// Answer length.
    pub output: Length,
    /// How each run is loaded.
    pub load: Load,
    /// The targets goodput counts against.
    pub slo: Slo,
    /// Layouts run in the simulator after the screen.
    pub top: usize,
    /// Requests per run instead of the default.
    pub requests: Option<u32>,
    /// Seed of every run.
    pub seed: u64,
    /// Threads running the simulations.
    pub jobs: usize,
}

/// Why a plan cannot be made.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanError {
    /// The budget is 0 or above [`MAX_GPUS`].
    Budget { gpus: u32 },
    /// `top` is 0 or above [`MAX_TOP`].
    Top { top: usize },
    /// Neither target is given, so there is no goodput to rank by.
    NoSlo,
    /// A profile name is unknown (the error lists the known ones) or a profile is bad.
    Profile(ResolveError),
    /// The workload breaks a rule of the scenario format (a length too large, say).
    Workload { violation: Violation },
    /// No layout of the budget fits the memory and the targets; `smallest` is the smallest
    /// deployment that would, with its GPU count, when one does within [`MAX_GPUS`].
    NothingFits { gpus: u32, smallest: Option<(String, u32)>, example: Option<String> },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::Budget { gpus } => write!(f, "--gpus {gpus}: the budget must be 2 to {MAX_GPUS} GPUs"),
            PlanError::Top { top } => write!(f, "--top {top}: run 1 to {MAX_TOP} layouts"),
            PlanError::NoSlo => {
                f.write_str("give --slo-ttft-ms or --slo-tpot-ms (or both): goodput counts against them")
            }
            PlanError::Profile(e) => write!(f, "{}", e.error),
            PlanError::Workload { violation } => {
                write!(f, "the workload breaks `{}`: {}", violation.field, violation.message)
            }
            PlanError::NothingFits { gpus, smallest, example } => {
                write!(f, "no layout of {gpus} GPUs fits the model's memory and the targets")?;
                if let Some(example) = example {
                    write!(f, " (e.g. {example})")?;
                }
                match smallest {
                    Some((notation, n)) => write!(f, "; the smallest that fits is {notation}, {n} GPUs"),
                    None => write!(f, "; none fits within {MAX_GPUS} GPUs either"),
                }
            }
        }
    }
}

impl std::error::Error for PlanError {}

/// Layouts left out for one reason: how many, the first in enumeration order, and why. A
/// side's shape that does not fit rules out every deployment with that shape, so rejections are
/// grouped by reason rather than listed per deployment (a 1,024-GPU budget has a million).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rejected {
    /// Deployments rejected for this reason.
    pub layouts: usize,
    /// The first of them, e.g. `1P_TP4:1D_TP1`.
    pub example: String,
    /// Its GPUs.
    pub gpus: u32,
    /// The reason, typed.
    pub why: ScreenMiss,
    /// The same in words.
    pub reason: String,
}

/// Rejections grouped by reason, in order of first appearance.
#[derive(Default)]
struct Rejections {
    groups: Vec<Rejected>,
    index: BTreeMap<String, usize>,
}

impl Rejections {
    fn add(&mut self, why: ScreenMiss, layouts: usize, example: &Candidate) {
        let reason = why.to_string();
        match self.index.get(&reason) {
            Some(&i) => self.groups[i].layouts += layouts,
            None => {
                self.index.insert(reason.clone(), self.groups.len());
                self.groups.push(Rejected {
                    layouts,
                    example: example.notation(),
                    gpus: example.gpus(),
                    why,
                    reason,
                });
            }
        }
    }
}

/// A layout the simulator ran.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ranked {
    /// Its place, from 1.
    pub rank: usize,
    /// Its notation.
    pub layout: String,
    /// Prefill GPUs.
    pub prefill_gpus: u32,
    /// Decode GPUs.
    pub decode_gpus: u32,
    /// Steady-state goodput per GPU, requests per second.
    pub goodput_per_gpu: f64,
    /// Steady-state prompt and generated tokens per second per GPU.
    pub tok_s_per_gpu: f64,
    /// Steady-state TTFT p90, ms (`None`: nothing finished in the window).
    pub ttft_p90_ms: Option<f64>,
    /// Steady-state TPOT p90, ms.
    pub tpot_p90_ms: Option<f64>,
    /// Share of the window's requests that met the targets.
    pub met_fraction: f64,
    /// The bound resource, from the screen and the run.
    pub bound: Bound,
    /// The run's outcome name (`clean` unless something went wrong).
    pub outcome: String,
    /// The clients of the run shown (under [`Load::Auto`] the better of its runs): concurrency
    /// or rate, and requests.
    pub clients: Clients,
    /// The screen's estimate.
    pub estimate: Estimate,
}

/// Ranks whose goodput intervals chain into one another: `first` to `last`, both from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Inseparable {
    pub first: usize,
    pub last: usize,
}

/// The plan: what was searched, the ranking and what was left out.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanReport {
    /// GPUs available.
    pub gpus: u32,
    /// The profiles the hardware and model come from.
    pub profiles: String,
    /// The workload's lengths in words.
    pub workload: String,
    /// The targets.
    pub slo: Slo,
    /// How the runs were loaded.
    pub load: Load,
    /// The calibration's summary line (profiles/calibration.ron).
    pub calibration: String,
    /// Its validation median |error|, the half-width of every goodput interval; `None` when not
    /// measured (then no separation is stated).
    pub error: Option<f64>,
    /// Layouts enumerated.
    pub enumerated: usize,
    /// Layouts that passed the screen.
    pub screened: usize,
    /// Layouts run in the simulator (the best `top` by estimate).
    pub shortlisted: usize,
    /// Layouts run, best first.
    pub ranked: Vec<Ranked>,
    /// Groups of ranked layouts the error cannot separate.
    pub inseparable: Vec<Inseparable>,
    /// Layouts left out by memory, targets or routing, grouped by reason in order of first
    /// appearance.
    pub rejected: Vec<Rejected>,
    /// Shortlisted layouts whose run could not start, with the simulator's reason.
    pub failed: Vec<(String, String)>,
}

/// A run about to start.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub done: u64,
    pub total: u64,
    pub layout: &'a str,
}

/// The scenario every layout's run starts from: the profiles applied to the defaults.
pub fn base_scenario(spec: &PlanSpec) -> Result<Scenario, PlanError> {
    let mut sc = Scenario::from_notation("1P_TP8:1D_TP8");
    sc.profiles = Profiles {
        gpu: Some(spec.gpu.clone()),
        nic: spec.nic.clone(),
        model: Some(spec.model.clone()),
        overrides: Vec::new(),
    };
    pdkv_sim::profiles::resolve(&mut sc, &|_| false).map_err(PlanError::Profile)?;
    if let Some(stack) = &spec.stack {
        sc.engines.stack = stack.clone();
    }
    sc.workload = Workload {
        clients: Clients::Closed { concurrency: 1, requests: 1 },
        input_tokens: spec.input,
        output_tokens: spec.output,
    };
    sc.slo = Some(spec.slo);
    sc.seed = spec.seed;
    pdkv_sim::load::validate(&sc).map_err(|violation| PlanError::Workload { violation })?;
    Ok(sc)
}

/// What the screen of a budget found: the candidates enumerated, those that passed with their
/// estimates (enumeration order), and the rejections grouped by reason.
pub struct Screened {
    pub enumerated: usize,
    pub passed: Vec<(Candidate, Estimate)>,
    pub rejected: Vec<Rejected>,
}

/// Every candidate of `gpus` screened. Each side's estimate depends on its shape alone, so it is
/// computed once per shape, and a shape that fails rules out its deployments without looking at
/// them one by one.
pub fn screen_all(sc: &Scenario, gpus: u32, lengths: Lengths, slo: Slo) -> Screened {
    let screen = Screen::new(sc, lengths, slo);
    let moe = sc.model.routed_experts > 0;
    let shapes = engine_layouts(gpus, sc.hardware.gpus_per_node, moe);
    let prefill: Vec<_> = shapes.iter().map(|&l| screen.prefill(l)).collect();
    let decode: Vec<_> = shapes.iter().map(|&l| screen.decode(l)).collect();
    let mut enumerated = 0;
    let mut passed = Vec::new();
    let mut rejections = Rejections::default();
    for (pi, &p) in shapes.iter().enumerate() {
        for (di, &d) in shapes.iter().enumerate() {
            let pair = candidates(gpus, &[p], &[d]);
            let Some(first) = pair.first() else { continue };
            enumerated += pair.len();
            match (&prefill[pi], &decode[di]) {
                (Err(why), _) | (Ok(_), Err(why)) => rejections.add(why.clone(), pair.len(), first),
                (Ok(pe), Ok(de)) => {
                    for c in pair {
                        match screen.deployment(&c, *pe, *de) {
                            Ok(e) => passed.push((c, e)),
                            Err(why) => rejections.add(why, 1, &c),
                        }
                    }
                }
            }
        }
    }
    Screened { enumerated, passed, rejected: rejections.groups }
}

/// The order of the ranking before the runs: best capacity per GPU first, ties by fewer GPUs,
/// then notation, so the order is total.
fn by_estimate((a, x): &(Candidate, Estimate), (b, y): &(Candidate, Estimate)) -> std::cmp::Ordering {
    y.requests_per_s_per_gpu
        .total_cmp(&x.requests_per_s_per_gpu)
        .then(a.gpus().cmp(&b.gpus()))
        .then(a.notation().cmp(&b.notation()))
}

/// The best `top` of `passed` once routed, in [`by_estimate`] order. Branch and bound: the NIC's
/// share (from the core's whole routing table, [`Screen::routed`]) can only lower a capacity,
/// so candidates are routed best unrouted bound first until the next bound falls below the
/// `top`-th best routed value; the result is what routing every candidate would give. A
/// candidate the routing refuses goes to `refused`.
pub fn shortlist(
    screen: &Screen<'_>,
    mut passed: Vec<(Candidate, Estimate)>,
    top: usize,
    refused: &mut dyn FnMut(&Candidate, ScreenMiss),
) -> Vec<(Candidate, Estimate)> {
    passed.sort_by(by_estimate);
    let mut routed: Vec<(Candidate, Estimate)> = Vec::new();
    for (c, e) in passed {
        if top > 0 && routed.len() >= top {
            let mut values: Vec<f64> = routed.iter().map(|(_, r)| r.requests_per_s_per_gpu).collect();
            values.sort_by(|a, b| b.total_cmp(a));
            if e.requests_per_s_per_gpu < values[top - 1] {
                break;
            }
        }
        match screen.routed(&c, &e) {
            Ok(e) => routed.push((c, e)),
            Err(why) => refused(&c, why),
        }
    }
    routed.sort_by(by_estimate);
    routed.truncate(top);
    routed
}

/// The smallest deployment (fewest GPUs, then enumeration order) above `gpus` that passes the
/// screen: one engine per side, the cheapest shapes that fit.
fn smallest_fit(sc: &Scenario, gpus: u32, lengths: Lengths, slo: Slo) -> Option<(String, u32)> {
    let screen = Screen::new(sc, lengths, slo);
    let moe = sc.model.routed_experts > 0;
    let shapes = engine_layouts(MAX_GPUS, sc.hardware.gpus_per_node, moe);
    let mut best: Option<(String, u32)> = None;
    for &p in &shapes {
        let Ok(pe) = screen.prefill(p) else { continue };
        for &d in &shapes {
            let c =
                Candidate { prefill: Side { engines: 1, layout: p }, decode: Side { engines: 1, layout: d } };
            if c.gpus() <= gpus || c.gpus() > MAX_GPUS || best.as_ref().is_some_and(|(_, n)| *n <= c.gpus()) {
                continue;
            }
            let Ok(de) = screen.decode(d) else { continue };
            if screen.deployment(&c, pe, de).is_ok() {
                best = Some((c.notation(), c.gpus()));
            }
        }
    }
    best
}

/// Shares of a layout's screened capacity its runs are loaded at under [`Load::Auto`] (each a
/// closed loop of the requests in flight at that rate, [`Screen::in_flight`]): goodput falls off
/// a cliff once a queue builds, and the screen's capacity is an estimate, so each layout runs
/// below it and at it, and the best goodput stands.
pub const AUTO_LOAD_SHARES: [f64; 3] = [0.5, 0.75, 1.0];

/// The runs' clients for a layout: one run for a given load, one per share of the screened
/// concurrency for [`Load::Auto`].
fn clients(spec: &PlanSpec, screen: &Screen<'_>, candidate: &Candidate, estimate: &Estimate) -> Vec<Clients> {
    let requests_for = |concurrency: u32| {
        spec.requests
            .unwrap_or_else(|| concurrency.saturating_mul(10).clamp(DEFAULT_REQUESTS.0, DEFAULT_REQUESTS.1))
    };
    match spec.load {
        Load::Concurrency(c) => vec![Clients::Closed { concurrency: c, requests: requests_for(c) }],
        Load::Rate(rate) => {
            vec![Clients::Open {
                rate_per_s: rate,
                requests: spec.requests.unwrap_or(DEFAULT_REQUESTS.1 / 2),
            }]
        }
        Load::Auto => {
            let mut out: Vec<Clients> = Vec::new();
            for share in AUTO_LOAD_SHARES {
                let full = screen.in_flight(candidate, estimate, estimate.requests_per_s * share);
                let c = full.ceil().clamp(1.0, 65_536.0) as u32;
                let clients = Clients::Closed { concurrency: c, requests: requests_for(c) };
                if !out.contains(&clients) {
                    out.push(clients);
                }
            }
            out
        }
    }
}

/// The bound from the screen and the run: a run that misses the TTFT target at p90 while it
/// meets the TPOT target is bound on the prefill side (the NIC when the screen's NIC share is
/// above its prefill share, the all-to-all when that takes most of a prefill step, else the
/// prefill compute); one that misses the TPOT target is bound on the decode side; otherwise
/// (both met, or both missed) the screen's bound stands.
pub fn bound_of(estimate: &Estimate, slo: Slo, ttft_p90_ms: Option<f64>, tpot_p90_ms: Option<f64>) -> Bound {
    let missed =
        |target: Option<f64>, value: Option<f64>| matches!((target, value), (Some(t), Some(v)) if v > t);
    let (ttft_missed, tpot_missed) = (missed(slo.ttft_ms, ttft_p90_ms), missed(slo.tpot_ms, tpot_p90_ms));
    match (ttft_missed, tpot_missed) {
        (true, false) => {
            if estimate.utilisation.nic > estimate.utilisation.prefill {
                Bound::Nic
            } else if estimate.prefill.alltoall_share >= screen::ALLTOALL_BOUND_SHARE {
                Bound::AllToAll
            } else {
                Bound::PrefillCompute
            }
        }
        (false, true) => decode_bound(&estimate.decode),
        _ => estimate.bound,
    }
}

/// Groups of consecutive ranks (values best first) whose intervals `v * (1 ± error)` overlap
/// their neighbour's; a group chains, so its first and last may differ by more than one
/// interval. Only groups of two or more are listed.
pub fn inseparable(values: &[f64], error: f64) -> Vec<Inseparable> {
    let mut groups = Vec::new();
    let mut start = 0;
    for i in 1..=values.len() {
        let overlaps = i < values.len() && crate::sweep::not_separated(values[i - 1], values[i], error);
        if !overlaps {
            if i - start >= 2 {
                groups.push(Inseparable { first: start + 1, last: i });
            }
            start = i;
        }
    }
    groups
}

/// A run's clients in words: `C118 x1180` or `2.5/s x2000`.
pub fn clients_text(clients: Clients) -> String {
    match clients {
        Clients::Closed { concurrency, requests } => format!("C{concurrency} x{requests}"),
        Clients::Open { rate_per_s, requests } => format!("{rate_per_s}/s x{requests}"),
    }
}

/// A length in words: `8192` or `4096-8192`.
pub fn length_text(length: Length) -> String {
    match length {
        Length::Fixed(n) => n.to_string(),
        Length::Uniform { min, max } => format!("{min}-{max}"),
    }
}

/// Makes the plan: screen, shortlist, run on `spec.jobs` threads, rank. `progress` is told of
/// each run before it starts.
pub fn plan(spec: &PlanSpec, progress: &(dyn Fn(Progress<'_>) + Sync)) -> Result<PlanReport, PlanError> {
    if spec.gpus < 2 || spec.gpus > MAX_GPUS {
        return Err(PlanError::Budget { gpus: spec.gpus });
    }
    if spec.top == 0 || spec.top > MAX_TOP {
        return Err(PlanError::Top { top: spec.top });
    }
    if spec.slo.ttft_ms.is_none() && spec.slo.tpot_ms.is_none() {
        return Err(PlanError::NoSlo);
    }
    let base = base_scenario(spec)?;
    let lengths = Lengths::of(spec.input, spec.output);
    let Screened { enumerated, passed, rejected } = screen_all(&base, spec.gpus, lengths, spec.slo);
    let mut rejections = Rejections::default();
    for r in rejected {
        rejections.index.insert(r.reason.clone(), rejections.groups.len());
        rejections.groups.push(r);
    }
    if passed.is_empty() {
        return Err(PlanError::NothingFits {
            gpus: spec.gpus,
            smallest: smallest_fit(&base, spec.gpus, lengths, spec.slo),
            example: rejections.groups.first().map(|r| format!("{}: {}", r.example, r.reason)),
        });
    }
    let screened_count = passed.len();
    let screen = Screen::new(&base, lengths, spec.slo);
    let passed = shortlist(&screen, passed, spec.top, &mut |c, why| rejections.add(why, 1, c));
    let shortlisted = passed.len();
    if passed.is_empty() {
        return Err(PlanError::NothingFits {
            gpus: spec.gpus,
            smallest: smallest_fit(&base, spec.gpus, lengths, spec.slo),
            example: rejections.groups.first().map(|r| format!("{}: {}", r.example, r.reason)),
        });
    }

    // Every run of every shortlisted layout, in shortlist order; each layout keeps its best.
    let mut runs: Vec<(usize, Scenario)> = Vec::new();
    for (i, (c, e)) in passed.iter().enumerate() {
        for clients in clients(spec, &screen, c, e) {
            let mut sc = base.clone();
            sc.name = c.notation();
            sc.description = format!("{} planned by pdkv plan", c.notation());
            sc.deployment = c.notation();
            sc.workload.clients = clients;
            runs.push((i, sc));
        }
    }
    let results = run_all(&runs, spec.jobs, progress);

    let error = pdkv_sim::calibration::current().validation.map(|v| v.median_abs_error);
    let mut best: Vec<Option<Ranked>> = vec![None; passed.len()];
    let mut failed = Vec::new();
    for ((i, sc), result) in runs.iter().zip(results) {
        let (c, e) = &passed[*i];
        let r = match result {
            Ok(r) => r,
            Err(err) => {
                failed.push((
                    format!("{} at {}", c.notation(), clients_text(sc.workload.clients)),
                    err.to_string(),
                ));
                continue;
            }
        };
        let steady = &r.steady;
        let goodput = steady.goodput.as_ref();
        let ttft = steady.latency_ms.ttft.map(|s| s.p90);
        let tpot = steady.latency_ms.tpot.map(|s| s.p90);
        let ranked = Ranked {
            rank: 0,
            layout: c.notation(),
            prefill_gpus: c.prefill.gpus(),
            decode_gpus: c.decode.gpus(),
            goodput_per_gpu: goodput.map_or(0.0, |g| g.requests_per_s_per_gpu),
            tok_s_per_gpu: steady.throughput.total_tok_s_per_gpu,
            ttft_p90_ms: ttft,
            tpot_p90_ms: tpot,
            met_fraction: goodput.map_or(0.0, |g| g.met_fraction),
            bound: bound_of(e, spec.slo, ttft, tpot),
            outcome: r.outcome.name().to_string(),
            clients: sc.workload.clients,
            estimate: e.clone(),
        };
        // The earlier (lighter) run stands on a tie, so the choice does not depend on order.
        if best[*i].as_ref().is_none_or(|b| ranked.goodput_per_gpu > b.goodput_per_gpu) {
            best[*i] = Some(ranked);
        }
    }
    let mut ranked: Vec<Ranked> = best.into_iter().flatten().collect();
    ranked.sort_by(|a, b| {
        b.goodput_per_gpu
            .total_cmp(&a.goodput_per_gpu)
            .then(b.estimate.requests_per_s_per_gpu.total_cmp(&a.estimate.requests_per_s_per_gpu))
            .then(a.layout.cmp(&b.layout))
    });
    for (i, r) in ranked.iter_mut().enumerate() {
        r.rank = i + 1;
    }
    let values: Vec<f64> = ranked.iter().map(|r| r.goodput_per_gpu).collect();
    let profiles = base.profiles.to_string();
    let profiles = if spec.nic.is_none() {
        format!("{profiles}, built-in NIC values ({} GB/s)", base.hardware.nic_gb_s)
    } else {
        profiles
    };
    Ok(PlanReport {
        gpus: spec.gpus,
        profiles: format!("{profiles}, stack {}", base.engines.stack),
        workload: format!("{} in / {} out", length_text(spec.input), length_text(spec.output)),
        slo: spec.slo,
        load: spec.load,
        calibration: pdkv_sim::calibration::current().summary(),
        error,
        enumerated,
        screened: screened_count,
        shortlisted,
        inseparable: error.map(|e| inseparable(&values, e)).unwrap_or_default(),
        ranked,
        rejected: rejections.groups,
        failed,
    })
}

/// Runs every scenario on `jobs` threads; results in input order whatever the timing.
fn run_all(
    runs: &[(usize, Scenario)],
    jobs: usize,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Vec<Result<RunResult, SimError>> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<RunResult, SimError>>>> = Mutex::new(vec![None; runs.len()]);
    let total = runs.len() as u64;
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, runs.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some((_, sc)) = runs.get(i) else { break };
                progress(Progress {
                    done: done.load(Ordering::SeqCst) as u64,
                    total,
                    layout: &sc.deployment,
                });
                let result = pdkv_sim::run(sc, RunOptions::default()).map(|run| run.result);
                results.lock().expect("no panics while held")[i] = Some(result);
                done.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    results
        .into_inner()
        .expect("threads ended")
        .into_iter()
        .map(|r| r.expect("every index is run once"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (goodputs best first, error) -> the groups it cannot separate, as "first-last".
    #[test]
    fn inseparable_table() {
        let check = |values: &[f64], error: f64, expected: &[&str]| {
            let got: Vec<String> =
                inseparable(values, error).iter().map(|g| format!("{}-{}", g.first, g.last)).collect();
            assert_eq!(got, expected, "{values:?} at {error}");
        };
        check(&[1.0, 0.9, 0.5, 0.1], 0.1, &["1-2"]);
        check(&[1.0, 0.9, 0.5, 0.1], 0.817, &["1-4"]);
        check(&[1.0, 0.5, 0.25], 0.1, &[]);
        check(&[1.0, 0.5, 0.45, 0.2, 0.19], 0.1, &["2-3", "4-5"]);
        check(&[0.3], 0.8, &[]);
        check(&[0.0, 0.0], 0.1, &["1-2"]);
    }

    fn spec(gpus: u32) -> PlanSpec {
        PlanSpec {
            gpus,
            gpu: "mi300x".into(),
            nic: None,
            model: "deepseek-r1".into(),
            stack: None,
            input: Length::Fixed(8192),
            output: Length::Fixed(1024),
            load: Load::Auto,
            slo: Slo { ttft_ms: Some(2000.0), tpot_ms: Some(50.0) },
            top: 2,
            requests: Some(40),
            seed: 0,
            jobs: 1,
        }
    }

    /// (spec change) -> the error's words.
    #[test]
    fn bad_plans_are_refused_by_name() {
        let check = |change: &dyn Fn(&mut PlanSpec), expected: &str| {
            let mut s = spec(16);
            change(&mut s);
            let err = plan(&s, &|_| {}).expect_err("refused");
            assert!(err.to_string().contains(expected), "{err} lacks {expected:?}");
        };
        check(&|s| s.gpus = 1, "--gpus 1: the budget must be 2 to 1024 GPUs");
        check(&|s| s.top = 0, "--top 0");
        check(&|s| s.slo = Slo::default(), "give --slo-ttft-ms or --slo-tpot-ms");
        check(&|s| s.gpu = "h900".into(), "h900");
        // DeepSeek-R1 needs 8 GPUs a side on 192 GB: 12 hold no layout, 16 do.
        check(&|s| s.gpus = 12, "the smallest that fits is 1P_TP8:1D_TP8, 16 GPUs");
    }

    /// The branch and bound gives the shortlist that routing every screened layout gives, on
    /// budgets where the NIC binds some layouts (a slow NIC) and where it binds none.
    #[test]
    fn the_shortlist_is_the_fully_routed_one() {
        let check = |gpus: u32, nic_gb_s: f64, top: usize| {
            let mut sc = base_scenario(&spec(gpus)).expect("profiles");
            sc.hardware.nic_gb_s = nic_gb_s;
            let lengths = Lengths::of(Length::Fixed(8192), Length::Fixed(1024));
            let slo = Slo { ttft_ms: Some(2000.0), tpot_ms: Some(50.0) };
            let screen = Screen::new(&sc, lengths, slo);
            let passed = screen_all(&sc, gpus, lengths, slo).passed;
            let mut all: Vec<(Candidate, Estimate)> =
                passed.iter().map(|(c, e)| (*c, screen.routed(c, e).expect("routes"))).collect();
            all.sort_by(by_estimate);
            all.truncate(top);
            let fast = shortlist(&screen, passed, top, &mut |c, why| panic!("{}: {why}", c.notation()));
            assert_eq!(fast, all, "{gpus} GPUs, NIC {nic_gb_s} GB/s, top {top}");
            fast.iter().filter(|(_, e)| e.bound == Bound::Nic).count()
        };
        assert_eq!(check(24, 48.0, 8), 0);
        assert!(check(32, 0.05, 5) > 0, "a 50 MB/s NIC binds");
        check(64, 0.5, 3);
    }

    /// (run's p90s) -> the bound: the screen's unless one target alone is missed.
    #[test]
    fn the_run_moves_the_bound_to_the_side_that_missed() {
        let sc = Scenario::from_notation("1P_TP8:1D_TP8");
        let slo = Slo { ttft_ms: Some(2000.0), tpot_ms: Some(50.0) };
        let s = Screen::new(&sc, Lengths::of(Length::Fixed(8192), Length::Fixed(1024)), slo);
        let layout = pdkv_core::Layout::tp(8);
        let c = Candidate { prefill: Side { engines: 1, layout }, decode: Side { engines: 1, layout } };
        let e = s
            .deployment(&c, s.prefill(layout).expect("fits"), s.decode(layout).expect("fits"))
            .expect("routes");
        let check = |ttft: f64, tpot: f64, expected: Bound| {
            assert_eq!(bound_of(&e, slo, Some(ttft), Some(tpot)), expected, "{ttft} {tpot}: {e:?}");
        };
        check(1000.0, 40.0, e.bound);
        check(9000.0, 60.0, e.bound);
        check(9000.0, 40.0, Bound::PrefillCompute);
        check(1000.0, 60.0, decode_bound(&e.decode));
    }
}
