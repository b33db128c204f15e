//! The versioned result of one run, serialised as JSON (`pdkv run --json`).

use serde::{Deserialize, Serialize};

// The verdict's vocabulary is the engine layer's, shared with the real cluster's results.
pub use pdkv_engine::verdict::{jain, percentiles, round3, Ledger, Summary, ViolationKind};

use crate::scenario::{JainBounds, Outcome, Profiles, Scenario, Slo, FORMAT_VERSION};
use crate::waitfor::{WaitEdge, WaitNode};

/// One run of a sweep (one line's scenario at one concurrency level), in the figures a sweep's
/// report shows: what `pdkv-campaign` runs, writes to shard files and merges, and what
/// `pdkv-reports` draws.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepPoint {
    /// The line's label: the run's identity without its workload ([`crate::RunIdentity`]), one
    /// line per distinct value, so two scenarios of one deployment (a bug and its fix) are two
    /// lines.
    pub run: String,
    /// The deployment notation.
    pub deployment: String,
    /// Clients in flight in a concurrency sweep (a closed loop); 0 in a rate sweep (an open
    /// loop, whose load is `rate_per_s`).
    pub concurrency: u32,
    /// Mean arrivals per second in a rate sweep (Poisson arrivals, an open loop); `None` in a
    /// concurrency sweep.
    pub rate_per_s: Option<f64>,
    /// The deployment's GPUs by role.
    pub gpus: Gpus,
    /// Prompt plus generated tokens per second.
    pub total_tok_s: f64,
    /// Mean time to first token, in milliseconds (`None` when no request finished).
    pub ttft_mean_ms: Option<f64>,
    /// Mean time per output token, in milliseconds (`None` when no finished request produced a
    /// second token).
    pub tpot_mean_ms: Option<f64>,
    /// How the run ended.
    pub outcome: Outcome,
    /// The figures of the run's steady-state window ([`Steady`]), under the sweep's SLO when it
    /// has one.
    pub steady: Steady,
}

impl SweepPoint {
    /// The point's load: its rate in a rate sweep, its concurrency otherwise.
    pub fn load(&self) -> f64 {
        self.rate_per_s.unwrap_or(f64::from(self.concurrency))
    }

    /// The load as the table and charts write it: `C=128`, or `R=2.5/s`.
    pub fn load_label(&self) -> String {
        match self.rate_per_s {
            Some(rate) => format!("R={rate}/s"),
            None => format!("C={}", self.concurrency),
        }
    }
}

/// Everything a run measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The scenario's name.
    pub scenario: String,
    /// What tells this run apart from others ([`crate::RunIdentity::label`]): the scenario's
    /// name, or the notation as typed, with the workload, seed and legacy options the command
    /// line changed. Results written before it existed read as empty.
    #[serde(default)]
    pub label: String,
    /// Its deployment notation.
    pub deployment: String,
    /// The named profiles (`profiles/*.ron`) its hardware and model came from; left out when the
    /// scenario names none (its own values or the defaults were used).
    #[serde(default, skip_serializing_if = "Profiles::is_empty")]
    pub profiles: Profiles,
    /// The seed the run used.
    pub seed: u64,
    /// How the run ended.
    pub outcome: Outcome,
    /// The outcome the scenario declared (`clean` when it declared none).
    pub expected: Outcome,
    /// Bounds the scenario declared on the Jain index of reads, if any.
    pub expected_jain: Option<JainBounds>,
    /// Virtual time at the end of the run, in seconds.
    pub duration_s: f64,
    /// Requests by how they ended.
    pub requests: Requests,
    /// Token throughput over the run.
    pub throughput: Throughput,
    /// Latency distributions, in milliseconds.
    pub latency_ms: Latencies,
    /// The deployment's GPUs by role. Results written before it existed read as none.
    #[serde(default)]
    pub gpus: Gpus,
    /// The figures of the steady-state window (`docs/sim.md`, "Steady state"): latency
    /// percentiles, throughput per GPU and per phase, goodput. Results written before it existed
    /// read as an empty window.
    #[serde(default)]
    pub steady: Steady,
    /// NIC balance over prefill GPUs.
    pub nic: NicStats,
    /// What happened to prefill blocks.
    pub ledger: Ledger,
    /// Collectives or requests that never completed, with who waited for whom.
    pub hangs: Vec<Hang>,
    /// Safety violations, in the order found.
    pub violations: Vec<Violation>,
    /// Events processed.
    pub events: u64,
    /// The scenario the run used, so `pdkv replay` can rerun it exactly.
    pub scenario_ron: String,
}

/// Requests by outcome.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Requests {
    /// Requests the clients sent.
    pub sent: u64,
    /// Requests that produced all their tokens.
    pub finished: u64,
    /// Requests that ended with an error (KV not received, prefill refused).
    pub failed: u64,
    /// Of those, requests an injected fault excuses (`docs/sim.md`, "Excused failures").
    #[serde(default)]
    pub failed_excused: u64,
    /// Of those, requests no injected fault excuses: the run is then not clean.
    #[serde(default)]
    pub failed_unexcused: u64,
    /// Requests still in flight when the run ended.
    pub unfinished: u64,
    /// Times a decode rank preempted a running request for its blocks (on-demand allocation:
    /// `engines.decode_kv_allocation`); a preempted request recomputes its context and goes on.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub preemptions: u64,
    /// Of those, requests the run's time or event budget cut off while the run was still
    /// progressing (a request had ended within the stall window before the end, `docs/sim.md`);
    /// they make the run incomplete, not hung. The others are a hang.
    #[serde(default)]
    pub cut_off: u64,
    /// Of those, requests in a run that made no progress for the stall window while nothing the
    /// simulator models waited for anything (no wait-for edge to show): no verdict, and the run
    /// is incomplete rather than a hang without its graph (`docs/sim.md`, "Cut off or hung").
    #[serde(default)]
    pub stalled: u64,
    /// Requests the workload had not sent yet when the run's time or event budget ended (an
    /// open loop whose arrivals fall after `limits.max_virtual_time_s`).
    #[serde(default)]
    pub unsent: u64,
}

/// Token throughput.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    /// Prompt plus generated tokens of finished requests per second of the run.
    pub total_tok_s: f64,
    /// Generated tokens per second.
    pub output_tok_s: f64,
    /// Finished requests per second.
    pub requests_per_s: f64,
}

/// The four latencies of `vllm bench serve`; each is `None` (`null` in JSON) when nothing was
/// measured: no request finished, or none produced a second token (TPOT, ITL).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latencies {
    /// Time to first token.
    pub ttft: Option<Summary>,
    /// Time per output token after the first, per request.
    pub tpot: Option<Summary>,
    /// Inter-token latency, per token.
    pub itl: Option<Summary>,
    /// End to end.
    pub e2e: Option<Summary>,
    /// One KV read (a flow: one decode worker's reads of one request from one prefill GPU),
    /// from its post to its last byte: where a NIC hot spot or small RDMA operations show.
    #[serde(default)]
    pub kv_read: Option<Summary>,
    /// TTFT at every percentile 0, 1, ..., 100 (for CDF plots); empty without finished requests.
    pub ttft_percentiles: Vec<f64>,
    /// TPOT at every percentile 0, 1, ..., 100.
    pub tpot_percentiles: Vec<f64>,
}

/// GPUs by role: one per rank, whatever the layout (a DP8EP engine is 8 GPUs, a TP8 one 8, a
/// DP2TP4 one 8; expert parallelism spans the same ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpus {
    /// Prefill GPUs.
    pub prefill: u32,
    /// Decode GPUs.
    pub decode: u32,
}

impl Gpus {
    /// Every GPU of the deployment.
    pub fn total(&self) -> u32 {
        self.prefill + self.decode
    }
}

/// What a run measured in its steady-state window, or over the whole run when the window says
/// so ([`crate::measure`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Steady {
    /// Which requests and which time it covers.
    pub window: Window,
    /// Latencies of the requests that arrived inside it; ITL of the decode steps that ended
    /// inside it.
    pub latency_ms: WindowLatencies,
    /// What completed inside its time span, per second.
    pub throughput: WindowThroughput,
    /// Requests meeting the scenario's SLO; left out when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput: Option<Goodput>,
}

/// Whether the figures are the steady state's or the whole run's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowKind {
    /// Warm-up and drain left out.
    #[default]
    Steady,
    /// The whole run, as `measure.whole_run` (`--whole-run`) asked.
    WholeRunAsked,
    /// The whole run, since the run left no window: no request arrived between the warm-up and
    /// the drain, or they arrived at one instant.
    WholeRunTooShort,
}

impl WindowKind {
    /// The kind as `result.json` writes it.
    pub fn name(self) -> &'static str {
        match self {
            WindowKind::Steady => "steady",
            WindowKind::WholeRunAsked => "whole_run_asked",
            WindowKind::WholeRunTooShort => "whole_run_too_short",
        }
    }
}

/// A measurement window: requests by arrival order, and a time span.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Steady, or the whole run and why.
    pub kind: WindowKind,
    /// Requests left out at the start, by arrival order.
    pub warmup_requests: u64,
    /// Requests left out at the end, by arrival order.
    pub drain_requests: u64,
    /// Requests that arrived inside it (its latencies are theirs).
    pub requests: u64,
    /// Its start, virtual seconds: the arrival of its first request (0 for the whole run).
    pub start_s: f64,
    /// Its end: the arrival of the first drain request (the run's end for the whole run).
    pub end_s: f64,
}

impl Window {
    /// The window in words, as `pdkv run`'s summary and its page say it; `sent` is the run's
    /// arrivals.
    pub fn describe(&self, sent: u64) -> String {
        match self.kind {
            WindowKind::Steady => format!(
                "steady: arrivals {} to {} of {sent} (warm-up {}, drain {}), {:.1} s to {:.1} s virtual",
                self.warmup_requests + 1,
                self.warmup_requests + self.requests,
                self.warmup_requests,
                self.drain_requests,
                self.start_s,
                self.end_s
            ),
            WindowKind::WholeRunAsked => format!("the whole run, as asked ({sent} arrivals)"),
            WindowKind::WholeRunTooShort => {
                format!("the whole run: its {sent} arrivals leave no steady window between warm-up and drain")
            }
        }
    }
}

impl WindowThroughput {
    /// The rates overall in words, as the summary and the run page say them.
    pub fn rate_text(&self) -> String {
        format!(
            "{:.3} req/s, {:.0} tok/s ({:.0} in, {:.0} out)",
            self.requests_per_s, self.total_tok_s, self.input_tok_s, self.output_tok_s
        )
    }

    /// The rates per GPU and per phase in words, as the summary and the run page say them.
    pub fn per_gpu_text(&self) -> String {
        format!(
            "{:.3} req/s, {:.0} tok/s ({:.0} out); {:.0} in per prefill GPU, {:.0} out per decode GPU",
            self.requests_per_s_per_gpu,
            self.total_tok_s_per_gpu,
            self.output_tok_s_per_gpu,
            self.input_tok_s_per_prefill_gpu,
            self.output_tok_s_per_decode_gpu
        )
    }
}

impl Goodput {
    /// The goodput in words, as the summary and the run page say it.
    pub fn text(&self) -> String {
        format!(
            "{:.3} req/s ({:.3} per GPU); {:.1}% of the window's requests met {}",
            self.requests_per_s,
            self.requests_per_s_per_gpu,
            100.0 * self.met_fraction,
            self.slo
        )
    }
}

/// The latencies of `vllm bench serve`, in milliseconds, each `{mean, p50, p90, p99}` or `None`
/// when nothing was measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowLatencies {
    /// Time to first token.
    pub ttft: Option<Summary>,
    /// Time per output token after the first, per request.
    pub tpot: Option<Summary>,
    /// Inter-token latency, per token.
    pub itl: Option<Summary>,
    /// End to end.
    pub e2e: Option<Summary>,
}

/// Throughput over a window's time span: what completed in it divided by its length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowThroughput {
    /// Requests that finished.
    pub requests_per_s: f64,
    /// Prompt tokens prefill steps computed.
    pub input_tok_s: f64,
    /// Tokens decode steps generated.
    pub output_tok_s: f64,
    /// Both.
    pub total_tok_s: f64,
    /// Requests per second per GPU of the deployment (prefill and decode).
    pub requests_per_s_per_gpu: f64,
    /// Prompt and generated tokens per second per GPU of the deployment.
    pub total_tok_s_per_gpu: f64,
    /// Generated tokens per second per GPU of the deployment.
    pub output_tok_s_per_gpu: f64,
    /// Prompt tokens per second per prefill GPU.
    pub input_tok_s_per_prefill_gpu: f64,
    /// Generated tokens per second per decode GPU.
    pub output_tok_s_per_decode_gpu: f64,
}

/// Goodput: requests that meet every target of an SLO.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    /// The targets.
    pub slo: Slo,
    /// Requests that finished inside the window meeting them, per second.
    pub requests_per_s: f64,
    /// The same per GPU of the deployment.
    pub requests_per_s_per_gpu: f64,
    /// Of the requests that arrived inside the window, the fraction that finished meeting them
    /// (failed and unfinished ones miss).
    pub met_fraction: f64,
}

/// Reads and bytes per prefill GPU (rank order: engine, DP, TP).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NicStats {
    /// Prefill GPU names in rank order.
    pub prefill_gpus: Vec<String>,
    /// Reads each prefill GPU served (one per decode worker per request).
    pub reads_per_prefill_gpu: Vec<u64>,
    /// Bytes each prefill GPU sent.
    pub bytes_per_prefill_gpu: Vec<u64>,
    /// RDMA operations each prefill GPU served: per read, one per layer per run of blocks
    /// contiguous on both sides (`ReadOp::messages`). Each costs NIC time as well as its bytes.
    #[serde(default)]
    pub messages_per_prefill_gpu: Vec<u64>,
    /// Jain's fairness index of the reads; `None` (`null`) when no GPU served a read, since
    /// evenness is undefined without reads.
    pub jain: Option<f64>,
    /// Jain's index of the bytes; `None` when no GPU sent a byte.
    pub jain_bytes: Option<f64>,
    /// Per prefill GPU, the fraction of its NIC busy in each virtual second of the run: bytes
    /// plus the per-message cost of its operations, over the NIC's bandwidth (six decimals;
    /// every row has one value per second).
    pub utilisation: Vec<Vec<f64>>,
}

impl NicStats {
    /// How reads spread over the prefill GPUs, in words: "every GPU read N times", or the most-
    /// and least-read GPU with their counts (ties go to the first in rank order). `None` without
    /// prefill GPUs.
    pub fn spread(&self) -> Option<String> {
        let reads = &self.reads_per_prefill_gpu;
        let (hi, hv) = reads.iter().enumerate().max_by_key(|(i, v)| (**v, usize::MAX - i))?;
        let (lo, lv) = reads.iter().enumerate().min_by_key(|(i, v)| (**v, *i))?;
        Some(if hv == lv {
            format!("every GPU read {hv} times")
        } else {
            format!("most read {} ({hv}), least read {} ({lv})", self.prefill_gpus[hi], self.prefill_gpus[lo])
        })
    }
}

/// A wait that never ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hang {
    /// When it was detected, in virtual milliseconds.
    pub t_ms: f64,
    /// What hung (e.g. a collective) and why it was declared hung.
    pub what: String,
    /// Ranks involved.
    pub ranks: Vec<String>,
    /// Who waits for whom, one edge each, in the order they were found (see
    /// [`crate::waitfor`] for how they read in JSON).
    pub wait_for: Vec<WaitEdge>,
    /// The members of a cycle in the wait-for graph (a deadlock), sorted by label, if there is
    /// one.
    pub cycle: Option<Vec<WaitNode>>,
    /// The wait-for graph in Graphviz form.
    pub dot: String,
}

/// A safety violation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Violation {
    /// When, in virtual milliseconds.
    pub t_ms: f64,
    /// Which check failed.
    pub kind: ViolationKind,
    /// Ranks involved.
    pub ranks: Vec<String>,
    /// What exactly.
    pub detail: String,
}

impl RunResult {
    /// An empty result for `scenario` (filled in by the run).
    pub fn empty(scenario: &Scenario, scenario_ron: String) -> RunResult {
        RunResult {
            version: FORMAT_VERSION,
            scenario: scenario.name.clone(),
            // A run of the scenario as it is; the command that changed it relabels the result.
            label: crate::RunIdentity::of_scenario(scenario).label(),
            deployment: scenario.deployment.clone(),
            profiles: scenario.profiles.clone(),
            seed: scenario.seed,
            outcome: Outcome::Clean,
            expected: scenario.expect.unwrap_or(Outcome::Clean),
            expected_jain: scenario.expect_jain,
            duration_s: 0.0,
            requests: Requests::default(),
            throughput: Throughput::default(),
            latency_ms: Latencies::default(),
            gpus: Gpus::default(),
            steady: Steady::default(),
            nic: NicStats::default(),
            ledger: Ledger::default(),
            hangs: Vec::new(),
            violations: Vec::new(),
            events: 0,
            scenario_ron,
        }
    }

    /// The run's title for pages and pictures: its label, then the deployment in parentheses
    /// unless the label starts with it (a bare notation), e.g. `proxy-aliasing (2P_DP8EP:1D_TP8)`.
    pub fn title(&self) -> String {
        let label = if self.label.is_empty() { &self.scenario } else { &self.label };
        if label == &self.deployment || label.starts_with(&format!("{}, ", self.deployment)) {
            label.clone()
        } else {
            format!("{label} ({})", self.deployment)
        }
    }

    /// True when the outcome and the NIC balance are what the scenario declared (bounds on the
    /// Jain index do not hold for a run without reads: there is no balance to bound).
    pub fn as_expected(&self) -> bool {
        self.outcome == self.expected
            && self.expected_jain.is_none_or(|b| self.nic.jain.is_some_and(|jain| b.holds(jain)))
    }

    /// Pretty JSON; byte-identical for identical runs.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("results serialise")
    }
}

/// Whether a count is zero: a field added later stays out of results that never had it.
fn is_zero(n: &u64) -> bool {
    *n == 0
}
