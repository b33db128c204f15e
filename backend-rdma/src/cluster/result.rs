//! What a cluster run reports (`--json`), and the rules that name its outcome.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use pdkv_engine::verdict::{self, judge, round3, BudgetRule, Summary, Verdict, ViolationKind};

use pdkv_core::ids::{RankId, Role};
use serde::Serialize;

use super::foreign_reads::ForeignReads;
use super::Cluster;

/// Requests by how they ended (the simulator's names). Not the simulator's `Requests`: that one
/// also has `failed_unexcused`, `cut_off` and `unsent`, which would add fields to `--json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Requests {
    /// Sent by the client.
    pub sent: u64,
    /// Produced all their tokens.
    pub finished: u64,
    /// Ended with an error.
    pub failed: u64,
    /// Of those, failed after an injected fault they were exposed to (docs/backend.md says
    /// exactly when): the fault's designed effect, not a failure of the run.
    pub failed_excused: u64,
    /// Still in flight at the end.
    pub unfinished: u64,
    /// Times a request waited behind a full decode batch or pool at a step (its transfer
    /// leased meanwhile); `--decode-max-batch` sets the batch.
    pub queued_at_decode: u64,
    /// Decode dispatches held until a killed prefill rank was back
    /// (`--hold-dispatches-until-restart`).
    pub held_for_restart: u64,
    /// Decode dispatches the proxy made while a prefill rank of the request's DP group was down
    /// by `--kill`, waiting for its restart (with the hold, none).
    pub dispatched_while_down: u64,
}

/// Throughput over the run (the simulator's `Throughput` plus the verified KV bytes per second).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Throughput {
    /// Prompt plus generated tokens of finished requests per second.
    pub total_tok_s: f64,
    /// Generated tokens per second.
    pub output_tok_s: f64,
    /// Finished requests per second.
    pub requests_per_s: f64,
    /// Verified KV bytes per second.
    pub kv_bytes_per_s: f64,
}

/// Wall-clock latencies of finished requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Latencies {
    /// From the client's request to the first decode step that included it.
    pub ttft: Summary,
    /// From the client's request to its last token.
    pub e2e: Summary,
}

/// Reads and bytes per prefill GPU. Not the simulator's `NicStats`: its Jain indices may be
/// `null` and it has a utilisation series the cluster does not measure.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Nic {
    /// Prefill GPUs in rank order.
    pub prefill_gpus: Vec<String>,
    /// Reads each served (one per decode worker per request).
    pub reads_per_prefill_gpu: Vec<u64>,
    /// Bytes each sent (verified on arrival).
    pub bytes_per_prefill_gpu: Vec<u64>,
    /// Jain's index of the reads.
    pub jain: f64,
    /// Jain's index of the bytes.
    pub jain_bytes: f64,
}

/// The prefill block ledger over all engines. Not the simulator's `Ledger`, whose other counters
/// (crash losses, hold times, stalls) the cluster does not measure, while it counts fences and
/// double frees.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Ledger {
    /// Transfers still held at the end.
    pub held: u64,
    /// Freed after their releases.
    pub freed: u64,
    /// Freed by the reaper.
    pub reaped: u64,
    /// Of those, reaped after an injected fault (the designed recovery, not a leak).
    pub reaped_excused: u64,
    /// Transfers fenced before reaping.
    pub fenced: u64,
    /// Frees of a block the transfer did not hold (must be 0).
    pub double_frees: u64,
}

/// A request that failed, with each decode worker's error.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Failure {
    /// The request.
    pub request: u64,
    /// Its transfer id.
    pub transfer_id: String,
    /// The prefill engine and DP rank that held its KV.
    pub prefill: String,
    /// `rank: error` for every worker that failed it.
    pub errors: Vec<String>,
}

/// A safety violation. The simulator's `Violation` also carries a virtual time and the ranks
/// involved, which the cluster does not know apart from the detail, so only the kind is shared.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Violation {
    /// `read_mismatch`, `double_free`, `protocol_error` (the simulator's names).
    pub kind: ViolationKind,
    /// What exactly.
    pub detail: String,
}

/// Processes and how they ended.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Processes {
    /// Connector processes started (restarts included).
    pub started: u64,
    /// Exited with status 0 after shutdown.
    pub exited_cleanly: u64,
    /// Killed by an injected fault.
    pub killed_by_fault: u64,
    /// Killed because they did not exit in time after shutdown (must be 0).
    pub killed_at_shutdown: u64,
    /// Exited with an error status.
    pub failed: u64,
    /// Connectors refused at join: not started by this run (no or a wrong token), or claiming
    /// the id of a rank that is running. Not counted in `started`.
    pub refused: u64,
}

/// What the run saw of the foreign side, for the result.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ForeignReport {
    /// Which side the driver played.
    pub side: String,
    /// The rules it follows.
    pub rules: String,
    /// Decode side: requests the driver's decode groups handled without an error.
    pub received: u64,
    /// Prefill side: transfers the driver's ranks reported finished (one per rank holding it).
    pub finished: u64,
    /// Prefill side: a report of a transfer the rank did not hold, or reported twice (must be 0).
    pub unexpected_finishes: u64,
    /// The driver's own counters, from its goodbye.
    pub stats: BTreeMap<String, u64>,
    /// Decode side: the reads the driver planned, judged against the process holding the KV.
    pub reads: ForeignReads,
    /// Why the driver, or processes of its group, had to be killed at the end of the run (it
    /// stopped reading, did not exit after `shutdown` or after its `bye`, or left processes
    /// running); `None` when it exited by itself and left nothing behind.
    pub killed: Option<String>,
}

/// What a cluster run measured, in the simulator's result schema where it applies.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterResult {
    /// The deployment.
    pub deployment: String,
    /// The data plane.
    pub transport: String,
    /// The model's attention and layers.
    pub model: String,
    /// Seed of lengths and ids.
    pub seed: u64,
    /// [`Verdict::name`]: the simulator's outcome names, or `interrupted`.
    pub outcome: String,
    /// Wall time of the run, in seconds.
    pub duration_s: f64,
    /// Requests by outcome.
    pub requests: Requests,
    /// Throughput.
    pub throughput: Throughput,
    /// Latencies, in milliseconds.
    pub latency_ms: Latencies,
    /// NIC balance over prefill GPUs.
    pub nic: Nic,
    /// Prefill blocks.
    pub ledger: Ledger,
    /// KV bytes decode read and verified against the pattern prefill wrote.
    pub bytes_verified: u64,
    /// KV bytes of the finished requests' prompts: whole blocks, every layer, every KV head
    /// once. Decode reads each head once per decode rank that needs it, so a fault-free run
    /// verifies this times the deployment's replication (1 when no head is read twice).
    pub prompt_kv_bytes: u64,
    /// Where the prefill ranks kept their KV (host memory, or a HIP device), and why.
    pub memory: Vec<String>,
    /// Failed requests, the first [`MAX_FAILURES_LISTED`] (`requests.failed` counts them all).
    pub failures: Vec<Failure>,
    /// Safety violations.
    pub violations: Vec<Violation>,
    /// Faults injected, with when.
    pub faults: Vec<String>,
    /// Connector processes.
    pub processes: Processes,
    /// Releases and leases the prefill ranks refused (from outside the deployment, or forged)
    /// or took for less than they asked.
    pub control: Control,
    /// Every handshake and notify port the ranks listened on (free again once the run ended).
    pub listener_ports: Vec<u16>,
    /// What went wrong, most severe first (the run's end, the foreign driver's failure, lost
    /// processes, then notes from the ranks), each once with its count, at most 64 different
    /// ones and a line counting those left out.
    pub problems: Vec<String>,
    /// The side another connector's code played (`--foreign-side`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub foreign: Option<ForeignReport>,
}

impl ClusterResult {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("results serialise")
    }
}

/// What the prefill ranks did with control messages they did not trust.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Control {
    /// Whether the ranks held a key drawn for the run, and what they refused without it:
    /// `require` (no MAC, refused), `verify` (a wrong MAC, refused; a foreign side sends none),
    /// `open` (nothing refused).
    pub auth: String,
    /// Releases refused.
    pub refused_releases: u64,
    /// Leases refused.
    pub refused_leases: u64,
    /// Of those, refused for carrying no MAC.
    pub unauthenticated: u64,
    /// Of those, refused for a wrong MAC.
    pub bad_mac: u64,
    /// Leases longer than the transfer timeout, taken for the transfer timeout.
    pub leases_capped: u64,
    /// Who sent what was refused (`address -> rank`), at most [`MAX_REFUSED_SENDERS`] lines.
    pub refused_from: Vec<String>,
    /// The forger's messages and what became of them, when the run had one
    /// (`--forge-messages`).
    pub forged: Option<super::forger::Forged>,
    /// Refused messages by the address they came from (at most [`MAX_REFUSING_ADDRESSES`];
    /// the rest under an unknown address), to tell the forger's from any other's.
    #[serde(skip)]
    pub(super) by_address: BTreeMap<String, u64>,
}

/// Most distinct addresses whose refused messages a run counts apart.
const MAX_REFUSING_ADDRESSES: usize = 4096;
/// What a refusal's sender is called when its address is unknown (or one too many).
const UNKNOWN_ADDRESS: &str = "an unknown address";

/// Most distinct senders of refused messages a result lists.
pub const MAX_REFUSED_SENDERS: usize = 16;

impl Control {
    /// Counts one refused message, `from` the address it came on, at `rank`.
    pub(super) fn refused(
        &mut self,
        rank: RankId,
        message: pdkv_core::prefill::Refused,
        verdict: pdkv_core::auth::Verdict,
        from: Option<&str>,
    ) {
        use pdkv_core::auth::Verdict;
        use pdkv_core::prefill::Refused;
        match message {
            Refused::Lease => self.refused_leases += 1,
            Refused::Release => self.refused_releases += 1,
        }
        match verdict {
            Verdict::BadMac => self.bad_mac += 1,
            // A rank reports only what it refused, so `Taken` never comes.
            Verdict::Unauthenticated | Verdict::Taken => self.unauthenticated += 1,
        }
        let address = from
            .filter(|a| self.by_address.contains_key(*a) || self.by_address.len() < MAX_REFUSING_ADDRESSES)
            .unwrap_or(UNKNOWN_ADDRESS);
        *self.by_address.entry(address.to_string()).or_default() += 1;
        let line = format!("{} -> {rank}", from.unwrap_or(UNKNOWN_ADDRESS));
        if !self.refused_from.contains(&line) && self.refused_from.len() < MAX_REFUSED_SENDERS {
            self.refused_from.push(line);
        }
    }
}

impl Cluster {
    /// Counts the forger's refused messages as its own and every other refusal as a protocol
    /// error ([`judge_refusals`]).
    pub(super) fn judge_refusals(&mut self) {
        let forged = self.forger.as_ref().map(|f| f.report.clone());
        let (forged, error) = judge_refusals(&self.tally.control.by_address, forged);
        if let Some(detail) = error {
            self.tally.violation(ViolationKind::ProtocolError, detail);
        }
        self.tally.control.forged = forged;
    }
}

/// Splits the refused messages, counted by sender address, into the forger's (added to its
/// report) and any other's, which the second value describes. Without an injected forger
/// nobody but the deployment's ranks sends releases or leases, so any refusal is either a rank
/// whose MAC did not verify (a bug) or a sender from outside the run: a protocol error either
/// way, and such a run is not clean.
pub(super) fn judge_refusals(
    by_address: &BTreeMap<String, u64>,
    mut forged: Option<super::forger::Forged>,
) -> (Option<super::forger::Forged>, Option<String>) {
    let mut others = Vec::new();
    for (address, &count) in by_address {
        match forged.as_mut() {
            Some(forged) if forged.from.contains(address) => forged.refused += count,
            _ => others.push(format!("{count} from {address}")),
        }
    }
    let error = (!others.is_empty()).then(|| {
        let cause =
            if forged.is_some() { "other than the injected forger" } else { "while no forger was injected" };
        format!(
            "prefill ranks refused releases or leases from senders {cause}: {} (control.refused_from \
             names the ranks)",
            others.join(", ")
        )
    });
    (forged, error)
}

/// How much a problem line matters: when the list is full, a line of a more severe kind
/// takes the place of a less severe one, and the list is printed most severe first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Severity {
    /// What ended or broke the run's own machinery: the foreign driver failed, stalled, or had
    /// to be killed.
    Fatal,
    /// A process lost (stopped answering, disconnected), refused, or a rank that could not
    /// start again.
    Lost,
    /// Everything else: notes of the ranks, the driver's own `problem` lines.
    Note,
}

/// The run's problem lines: each distinct line once, with its count, at most `limit` of them.
/// A line that does not fit takes the place of the latest line of a less severe kind, if any;
/// what is left out is counted, and said.
#[derive(Debug)]
pub(super) struct Problems {
    limit: usize,
    lines: Vec<(Severity, String)>,
    counts: BTreeMap<String, u64>,
    /// Occurrences of lines that did not fit, or were pushed out.
    left_out: u64,
}

impl Problems {
    pub(super) fn new(limit: usize) -> Problems {
        Problems { limit, lines: Vec::new(), counts: BTreeMap::new(), left_out: 0 }
    }

    /// Notes one occurrence of `line`.
    pub(super) fn note(&mut self, severity: Severity, line: String) {
        if let Some(count) = self.counts.get_mut(&line) {
            *count += 1;
            return;
        }
        if self.lines.len() >= self.limit {
            let Some(at) = self.lines.iter().rposition(|(s, _)| *s > severity) else {
                self.left_out += 1;
                return;
            };
            let (_, out) = self.lines.remove(at);
            self.left_out += self.counts.remove(&out).unwrap_or(1);
        }
        self.counts.insert(line.clone(), 1);
        self.lines.push((severity, line));
    }

    /// The lines, most severe first (in order of arrival within a kind), each with its count
    /// when it came more than once, and a last line counting what was left out.
    pub(super) fn lines(&self) -> Vec<String> {
        let mut sorted: Vec<&(Severity, String)> = self.lines.iter().collect();
        sorted.sort_by_key(|(s, _)| *s);
        let mut lines: Vec<String> = sorted
            .into_iter()
            .map(|(_, p)| match self.counts.get(p) {
                Some(&n) if n > 1 => format!("{p} ({n} times)"),
                _ => p.clone(),
            })
            .collect();
        if self.left_out > 0 {
            lines.push(format!(
                "... and {} more problems left out (at most {} different lines are kept, the most \
                 severe first)",
                self.left_out, self.limit
            ));
        }
        lines
    }
}

/// Most failed requests listed in the result: a run whose decode group died can fail a
/// million requests, and a listing of each would make a result of hundreds of megabytes.
pub const MAX_FAILURES_LISTED: usize = 1000;
/// Most problem lines kept for the report.
const MAX_PROBLEMS: usize = 64;

/// What the run counted for its report: requests and their latencies, tokens, reads and bytes,
/// the block ledger, violations, problems, the fault log, the scheduler's own stalls and the
/// control messages the ranks refused. Every file of the cluster adds to it; only
/// [`Cluster::result`] reads it whole.
pub(super) struct Tally {
    pub(super) sent: u64,
    pub(super) finished: u64,
    pub(super) failed: u64,
    pub(super) failed_excused: u64,
    pub(super) prefilled: u32,
    pub(super) tokens_in: u64,
    pub(super) tokens_out: u64,
    pub(super) ttft_ms: Vec<f64>,
    pub(super) e2e_ms: Vec<f64>,
    pub(super) failures: Vec<Failure>,
    pub(super) violations: Vec<Violation>,
    pub(super) problems: Problems,
    pub(super) memory: BTreeSet<String>,
    pub(super) faults_log: Vec<String>,
    pub(super) ledger: Ledger,
    /// Reads and bytes each prefill rank served.
    pub(super) reads: BTreeMap<RankId, (u64, u64)>,
    pub(super) bytes_verified: u64,
    pub(super) prompt_kv_bytes: u64,
    /// Times the scheduler's own loop did not run for a while (stopped, or starved), and how
    /// long in all: each gave every rank a fresh heartbeat window.
    pub(super) stalls: u64,
    pub(super) stalled_for: Duration,
    /// Requests in flight during those stalls: their failures and reaping are excused.
    pub(super) exposed_to_stalls: u64,
    pub(super) control: Control,
}

impl Tally {
    /// An empty tally; `auth` is how the ranks take control messages ([`Control::auth`]).
    pub(super) fn new(auth: &str) -> Tally {
        Tally {
            sent: 0,
            finished: 0,
            failed: 0,
            failed_excused: 0,
            prefilled: 0,
            tokens_in: 0,
            tokens_out: 0,
            ttft_ms: Vec::new(),
            e2e_ms: Vec::new(),
            failures: Vec::new(),
            violations: Vec::new(),
            problems: Problems::new(MAX_PROBLEMS),
            memory: BTreeSet::new(),
            faults_log: Vec::new(),
            ledger: Ledger::default(),
            reads: BTreeMap::new(),
            bytes_verified: 0,
            prompt_kv_bytes: 0,
            stalls: 0,
            stalled_for: Duration::ZERO,
            exposed_to_stalls: 0,
            control: Control { auth: auth.into(), ..Control::default() },
        }
    }

    /// Requests that ended, finished or failed.
    pub(super) fn done(&self) -> u64 {
        self.finished + self.failed
    }

    /// A safety violation.
    pub(super) fn violation(&mut self, kind: ViolationKind, detail: String) {
        self.violations.push(Violation { kind, detail });
    }

    /// Notes a problem line of the ranks' or the driver's (a note); repeats of a line are
    /// counted, not listed again.
    pub(super) fn problem(&mut self, line: String) {
        self.problems.note(Severity::Note, line);
    }

    /// Notes a problem line that matters more than a note ([`Severity`]): a full list makes
    /// room for it.
    pub(super) fn problem_of(&mut self, severity: Severity, line: String) {
        self.problems.note(severity, line);
    }

    /// A request produced its first token `ttft_ms` after it was sent.
    pub(super) fn record_first_token(&mut self, ttft_ms: f64) {
        self.ttft_ms.push(ttft_ms);
    }

    /// A request finished: its tokens, its prompt's KV bytes and its latency.
    pub(super) fn record_finished(&mut self, input: u32, output: u32, prompt_kv_bytes: u64, e2e_ms: f64) {
        self.finished += 1;
        self.prompt_kv_bytes += prompt_kv_bytes;
        self.e2e_ms.push(e2e_ms);
        self.tokens_in += u64::from(input);
        self.tokens_out += u64::from(output);
    }

    /// A request failed, `excused` by a fault it was exposed to; listed while the list has room.
    pub(super) fn record_failed(&mut self, failure: Failure, excused: bool) {
        self.failed += 1;
        if excused {
            self.failed_excused += 1;
        }
        if self.failures.len() < MAX_FAILURES_LISTED {
            self.failures.push(failure);
        }
    }

    /// A decode rank verified `bytes` read from `source`; a request's reads count once per
    /// decode worker, whatever the granularity (`layer` is `None` or the first layer once).
    pub(super) fn record_read(&mut self, source: RankId, layer: Option<u16>, bytes: u64) {
        let entry = self.reads.entry(source).or_default();
        if layer.is_none_or(|l| l == 0) {
            entry.0 += 1;
        }
        entry.1 += bytes;
        self.bytes_verified += bytes;
    }

    /// The scheduler itself did not run for `gap`, with `in_flight` requests exposed to it.
    pub(super) fn record_stall(&mut self, gap: Duration, in_flight: u64) {
        self.exposed_to_stalls += in_flight;
        self.stalls += 1;
        self.stalled_for += gap;
    }
}

/// Progress for a bar.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Requests ended.
    pub done: u64,
    /// Requests in all.
    pub total: u64,
}

/// How a run ended, by the engine's outcome rules under a wall clock's budget
/// ([`BudgetRule::WallClock`]): this maps what the cluster counted onto their terms. A request
/// still in flight when the budget ended was cut off by it; any other unfinished request is a
/// hang. Requests that failed and transfers the reaper freed after an injected fault they were
/// exposed to are the fault's designed effect and recovery, not a failure of the run.
pub(super) fn outcome(
    violated: bool,
    interrupted: bool,
    hung: bool,
    budget_ended: bool,
    requests: &Requests,
    ledger: &Ledger,
) -> Verdict {
    let tally = verdict::Tally {
        violated,
        interrupted,
        hung,
        budget_ended,
        unfinished: requests.unfinished,
        cut_off: if budget_ended { requests.unfinished } else { 0 },
        failed_unexcused: requests.failed.saturating_sub(requests.failed_excused),
        held: ledger.held,
        reaped: ledger.reaped,
        reaped_excused: ledger.reaped_excused,
        ..verdict::Tally::default()
    };
    judge(&tally, BudgetRule::WallClock)
}

/// Jain's index rounded as the simulator rounds it; always a number, where the simulator's
/// `jain` says `null` for a run without reads, since the cluster's schema has always had one.
pub(super) fn jain(values: &[u64]) -> f64 {
    round3(pdkv_core::routes::jain_index(values))
}

impl Cluster {
    pub(super) fn result(&self) -> ClusterResult {
        let duration_s = self.started_at.elapsed().as_secs_f64();
        let held = self.prefill.held();
        let unfinished = u64::from(self.config.requests) - self.tally.finished - self.tally.failed;
        let gpus: Vec<RankId> = self.d.ranks(Role::Prefill);
        let reads: Vec<u64> = gpus.iter().map(|r| self.tally.reads.get(r).map_or(0, |v| v.0)).collect();
        let bytes: Vec<u64> = gpus.iter().map(|r| self.tally.reads.get(r).map_or(0, |v| v.1)).collect();
        let ledger = Ledger { held, ..self.tally.ledger.clone() };
        let requests = Requests {
            sent: self.tally.sent,
            finished: self.tally.finished,
            failed: self.tally.failed,
            failed_excused: self.tally.failed_excused,
            unfinished,
            queued_at_decode: self.decode.queued_total(),
            held_for_restart: self.faults.holds.count,
            dispatched_while_down: self.faults.holds.while_down,
        };
        let outcome = outcome(
            !self.tally.violations.is_empty(),
            self.procs.interrupted.is_some(),
            self.hung.is_some(),
            self.budget_ended.is_some(),
            &requests,
            &ledger,
        );
        let mut problems = self.tally.problems.lines();
        // Reads the foreign decode side planned through anything but the holder's live session
        // are its own (pdkv's outcome judges pdkv's side); the line says they happened.
        problems.extend(self.foreign.report.reads.problem());
        if self.tally.stalls > 0 {
            let times = if self.tally.stalls == 1 {
                "once".to_string()
            } else {
                format!("{} times", self.tally.stalls)
            };
            problems.push(format!(
                "pdkv cluster itself did not run {times}, {:.1} s in all (stopped, or starved of CPU): \
                 each time every rank got a fresh heartbeat window instead of the blame, and the \
                 {} requests then in flight were exposed to it (the ranks' timers ran meanwhile)",
                self.tally.stalled_for.as_secs_f64(),
                self.tally.exposed_to_stalls
            ));
        }
        if let Some(signal) = self.procs.interrupted {
            problems
                .insert(0, format!("interrupted by {}: the result is partial", crate::signals::name(signal)));
        }
        if let Some(hung) = &self.hung {
            problems.insert(0, format!("hung: {hung}"));
        }
        if let Some(ended) = &self.budget_ended {
            problems.insert(0, format!("incomplete: {ended}"));
        }
        let per_s = |x: f64| if duration_s > 0.0 { (x / duration_s * 10.0).round() / 10.0 } else { 0.0 };
        ClusterResult {
            deployment: self.config.deployment.clone(),
            transport: self.config.transport.to_string(),
            model: if self.d.model.use_mla {
                format!("MLA, {} layers", self.d.model.layers)
            } else {
                let heads = self.d.model.kv_heads;
                let plural = if heads == 1 { "" } else { "s" };
                format!("GQA with {heads} KV head{plural}, {} layers", self.d.model.layers)
            },
            seed: self.config.seed,
            outcome: outcome.name().into(),
            duration_s: (duration_s * 1000.0).round() / 1000.0,
            requests,
            throughput: Throughput {
                total_tok_s: per_s((self.tally.tokens_in + self.tally.tokens_out) as f64),
                output_tok_s: per_s(self.tally.tokens_out as f64),
                requests_per_s: per_s(self.tally.finished as f64),
                kv_bytes_per_s: per_s(self.tally.bytes_verified as f64),
            },
            latency_ms: Latencies {
                ttft: Summary::of(&mut self.tally.ttft_ms.clone()).unwrap_or_default(),
                e2e: Summary::of(&mut self.tally.e2e_ms.clone()).unwrap_or_default(),
            },
            nic: Nic {
                prefill_gpus: gpus.iter().map(|r| r.to_string()).collect(),
                jain: jain(&reads),
                jain_bytes: jain(&bytes),
                reads_per_prefill_gpu: reads,
                bytes_per_prefill_gpu: bytes,
            },
            ledger,
            bytes_verified: self.tally.bytes_verified,
            prompt_kv_bytes: self.tally.prompt_kv_bytes,
            memory: self.tally.memory.iter().cloned().collect(),
            failures: self.tally.failures.clone(),
            violations: self.tally.violations.clone(),
            faults: self.fault_lines(),
            processes: self.procs.processes.clone(),
            control: self.tally.control.clone(),
            listener_ports: self
                .addresses
                .iter()
                .flat_map(|(engine, a)| {
                    let ranks = self.d.layout(*engine).ranks() as u16;
                    (0..ranks).flat_map(move |i| [a.handshake_port_base + i, a.notify_port_base + i])
                })
                .collect(),
            problems,
            foreign: self.config.foreign.as_ref().map(|_| self.foreign.report.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{judge_refusals, Problems, Severity};
    use crate::cluster::forger::Forged;

    #[test]
    fn refusals_from_the_forger_are_its_own_and_any_other_is_a_protocol_error() {
        let check =
            |refused: &[(&str, u64)], forger: Option<&[&str]>, expected: (Option<u64>, Option<&str>)| {
                let by_address = refused.iter().map(|(a, n)| (a.to_string(), *n)).collect();
                let forged = forger.map(|from| Forged {
                    from: from.iter().map(|a| a.to_string()).collect(),
                    ..Forged::default()
                });
                let (forged, error) = judge_refusals(&by_address, forged);
                assert_eq!(forged.map(|f| f.refused), expected.0, "{refused:?} {forger:?}");
                match (error, expected.1) {
                    (None, None) => {}
                    (Some(error), Some(needle)) => assert!(error.contains(needle), "{error}"),
                    (got, want) => panic!("{refused:?} {forger:?}: got {got:?}, want {want:?}"),
                }
            };
        check(&[], None, (None, None));
        check(&[], Some(&["a:1"]), (Some(0), None));
        check(&[("a:1", 5), ("a:2", 7)], Some(&["a:1", "a:2"]), (Some(12), None));
        // Without a forger, any refusal is an error naming the sender.
        check(
            &[("10.0.0.9:555", 3)],
            None,
            (None, Some("while no forger was injected: 3 from 10.0.0.9:555")),
        );
        // With one, only the others' are.
        check(
            &[("a:1", 5), ("b:9", 1)],
            Some(&["a:1"]),
            (Some(5), Some("other than the injected forger: 1 from b:9")),
        );
        check(&[("an unknown address", 2)], Some(&["a:1"]), (Some(0), Some("2 from an unknown address")));
    }

    /// Notes `(severity, line)` in order into a list of `limit` lines and checks what it says.
    fn check(limit: usize, notes: &[(Severity, &str)], expected: &[&str]) {
        let mut problems = Problems::new(limit);
        for &(severity, line) in notes {
            problems.note(severity, line.to_string());
        }
        assert_eq!(problems.lines(), expected, "{notes:?}");
    }

    #[test]
    fn a_full_problem_list_keeps_its_most_severe_lines_and_says_what_it_left_out() {
        use Severity::{Fatal, Lost, Note};
        let left_out = |n: u64, limit: usize| {
            format!(
                "... and {n} more problems left out (at most {limit} different lines are kept, the most \
                 severe first)"
            )
        };
        // Room for all: most severe first, repeats counted.
        check(
            4,
            &[(Note, "a"), (Fatal, "driver"), (Note, "a"), (Lost, "r")],
            &["driver", "r", "a (2 times)"],
        );
        // A full list of notes: the driver's line pushes out the latest note (and its repeats).
        check(
            2,
            &[(Note, "a"), (Note, "b"), (Note, "b"), (Fatal, "driver killed")],
            &["driver killed", "a", &left_out(2, 2)],
        );
        // A note finds no room and is counted; a lost rank replaces a note, never a fatal line.
        check(
            2,
            &[(Fatal, "driver"), (Note, "a"), (Note, "c"), (Lost, "D0 lost"), (Lost, "D1 lost")],
            &["driver", "D0 lost", &left_out(3, 2)],
        );
        // A repeat of a kept line is counted, even in a full list.
        check(1, &[(Fatal, "x"), (Fatal, "x"), (Fatal, "y")], &["x (2 times)", &left_out(1, 1)]);
    }
}
