//! `pdkv run`: one simulation of a scenario file or a bare notation, its summary and its files.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use pdkv_core::legacy::Legacy;
use pdkv_sim::calibration::Combination;
use pdkv_sim::result::Steady;
use pdkv_sim::scenario::{Clients, Measure, Scenario, Slo};
use pdkv_sim::{Run, RunIdentity, RunOptions, RunResult};

use crate::progress::Bar;
use crate::routes_cmd::legacy_parser;
use crate::trace_files::{self, Traces, Which};
use std::time::Duration;

const EXAMPLES: &str = "\
Examples:
  pdkv run 2P_TP8:1D_DP8EP
  pdkv run 2P_TP8:1D_DP8EP --legacy no-flexible-reads --json
  pdkv run lazy-handshake-delayed-reply          (a built-in scenario; see pdkv scenarios)
  pdkv run scenarios/notify-drift.ron --seed 7
  pdkv run 1P_TP8:1D_TP8 --concurrency 32 --requests 320 --out /tmp/run
  pdkv run 2P_TP8:1D_DP8EP --slo-ttft-ms 3000 --slo-tpot-ms 50
  pdkv run 2P_TP8:1D_DP8EP --requests 5120 --warmup 1000
  pdkv run 2P_TP8:1D_DP8EP --whole-run

A bare notation runs the default profile (DeepSeek-R1 on MI300X-class GPUs) and workload
(closed loop, C = 128, 10 x C requests, 8K in / 1K out).

The summary gives whole-run throughput and latency, then the steady state: p50/p90/p99 of
TTFT, TPOT, ITL and E2E, request and token rates overall, per GPU and per phase, and with an SLO
goodput. The steady window leaves out the warm-up (a closed loop's first max(C, N/10)
arrivals, an open loop's first N/10; --warmup N sets it) and the drain (the last arrivals, as
many as were in flight at the last arrival: C in a closed loop); --whole-run measures the whole
run instead. A run too short to leave a window is measured whole, and says so. A scenario file can name GPU, NIC and
model profiles instead (profiles: (gpu: \"h200-sxm\", nic: \"cx7-400g\", model: \"deepseek-r1\"),
listed by pdkv profiles); the summary and result.json then name them. A profile the cost
model's calibration was not fitted on (profiles/calibration.ron, covers) gets a WARNING on
stderr: the run's figures there are an extrapolation.

Writes the report to --out (default target/pdkv/<run>/, named after what the run is: the
scenario name or the notation, and the workload, seed and legacy options given here, e.g.
target/pdkv/2P_TP8-1D_DP8EP_C128-x1280-8K-1K_legacy-no-flexible-reads/): index.html with the
summary, a wait-for graph for every hang, NIC balance, NIC utilisation and latency CDF pictures
(PNG and SVG; left out, with a sentence, when the run has no data for them; above 64 prefill GPUs
the NIC pictures show a bar or row per node of hardware.gpus_per_node GPUs, with per-GPU pictures
of the busiest and least busy nodes), result.json, requests.csv (one row per request: id,
arrival, prefill DP rank, decode DP group, first token, finish, TTFT, TPOT, E2E, lengths,
outcome, whether the steady window counts it; --no-requests-csv skips it) and trace.txt, the
compact trace (one line per record, virtual time first), streamed to disk as the run goes;
--chrome-trace adds trace.json (Chrome/Perfetto, about 1.4 times the size; one request can be
followed in it from arrival to finish), --no-trace writes neither. Each trace file stops at
1 GiB with a trace_truncated record, and the summary says so.

Exit codes: 0 the outcome is the scenario's expected one (clean when none is declared);
1 it is not; 2 bad input (unreadable or invalid scenario, bad flags).
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Simulate one scenario and write its result and traces.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct RunArgs {
    /// A scenario file (.ron), a built-in scenario name, or a deployment notation such as
    /// 2P_TP8:1D_DP8EP.
    scenario: String,
    /// Seed of every random stream (default: the scenario's).
    #[arg(long)]
    seed: Option<u64>,
    /// Switch on a historical bug (repeatable), on top of the scenario's own.
    #[arg(long = "legacy", value_name = "NAME", value_parser = legacy_parser())]
    legacy: Vec<Legacy>,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    measure: MeasureArgs,
    /// Print the result object as JSON on stdout instead of the summary.
    #[arg(long)]
    json: bool,
    /// Folder for result.json and the traces.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Write no trace file (trace.txt, trace.json).
    #[arg(long)]
    no_trace: bool,
    /// Also write trace.json, the Chrome trace (Perfetto, chrome://tracing).
    #[arg(long, conflicts_with = "no_trace")]
    chrome_trace: bool,
    /// Write no requests.csv (one row per request).
    #[arg(long)]
    no_requests_csv: bool,
}

/// Reads a scenario file or a built-in scenario, or builds one from a notation; errors are
/// for the user.
pub fn load(spec: &str) -> Result<Scenario, String> {
    load_with_notation(spec).map(|(scenario, _)| scenario)
}

/// [`load`], and the notation as typed when `spec` is a bare notation (`None` for a scenario
/// file or a built-in scenario): the run's identity names a notation run by what was typed.
pub fn load_with_notation(spec: &str) -> Result<(Scenario, Option<&str>), String> {
    let path = Path::new(spec);
    if spec.ends_with(".ron") || path.is_file() {
        return pdkv_sim::load::load_scenario(path).map(|s| (s, None)).map_err(|e| e.to_string());
    }
    if let Some(scenario) = crate::builtin::find(spec) {
        return scenario.map(|s| (s, None));
    }
    let scenario = Scenario::from_notation(spec);
    pdkv_sim::load::validate(&scenario).map_err(|v| format!("{spec}: {}: {}", v.field, v.message))?;
    Ok((scenario, Some(spec)))
}

/// Checks a scenario after command-line overrides (`--concurrency`, `--requests`, ...), which
/// the file's own validation has not seen; the error names the flags.
pub fn check_overrides(scenario: &Scenario, flags: &str) -> Result<(), String> {
    pdkv_sim::load::validate(scenario)
        .map_err(|v| format!("{flags}: {} (scenario {}, field `{}`)", v.message, scenario.name, v.field))
}

/// The workload flags `pdkv run` and `pdkv explore` share: `--concurrency C` replaces the
/// scenario's clients with a closed loop of C (and 10 x C requests unless `--requests` says
/// otherwise); `--requests N` alone keeps the clients and changes only their count.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct WorkloadArgs {
    /// Closed-loop concurrency (replaces the scenario's clients; requests default to 10 x C).
    #[arg(long, value_name = "C", value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: Option<u32>,
    /// Requests in total (with --concurrency, or replacing the scenario's count).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub requests: Option<u32>,
}

impl WorkloadArgs {
    /// The flags that change the scenario, as the user wrote them (for error messages).
    pub fn flags(&self) -> String {
        let mut flags = Vec::new();
        if let Some(c) = self.concurrency {
            flags.push(format!("--concurrency {c}"));
        }
        if let Some(n) = self.requests {
            flags.push(format!("--requests {n}"));
        }
        if flags.is_empty() {
            flags.push("the command-line options".into());
        }
        flags.join(" ")
    }

    /// Applies the flags to a scenario's clients.
    pub fn apply(&self, scenario: &mut Scenario) {
        match (self.concurrency, self.requests, &mut scenario.workload.clients) {
            (Some(c), n, clients) => {
                *clients = Clients::Closed { concurrency: c, requests: n.unwrap_or(c.saturating_mul(10)) };
            }
            (None, Some(n), Clients::Closed { requests, .. } | Clients::Open { requests, .. }) => {
                *requests = n
            }
            (None, None, _) => {}
        }
    }
}

/// How `pdkv run` measures: the steady window and the targets of goodput. Each sets the
/// scenario's `measure` or `slo` field, so result.json's scenario (and `pdkv replay`) keeps it.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct MeasureArgs {
    /// Requests, in arrival order, left out at the start of the steady window (default: the
    /// larger of C and a tenth of the requests for a closed loop, a tenth for an open one).
    #[arg(long, value_name = "N", conflicts_with = "whole_run")]
    pub warmup: Option<u32>,
    /// Measure the whole run: no warm-up, no drain.
    #[arg(long)]
    pub whole_run: bool,
    /// Goodput's TTFT target, in milliseconds (with or without --slo-tpot-ms).
    #[arg(long, value_name = "MS")]
    pub slo_ttft_ms: Option<f64>,
    /// Goodput's TPOT target, in milliseconds.
    #[arg(long, value_name = "MS")]
    pub slo_tpot_ms: Option<f64>,
}

impl MeasureArgs {
    /// The flags given, as the user wrote them.
    pub fn flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        if let Some(n) = self.warmup {
            flags.push(format!("--warmup {n}"));
        }
        if self.whole_run {
            flags.push("--whole-run".into());
        }
        if let Some(ms) = self.slo_ttft_ms {
            flags.push(format!("--slo-ttft-ms {ms}"));
        }
        if let Some(ms) = self.slo_tpot_ms {
            flags.push(format!("--slo-tpot-ms {ms}"));
        }
        flags
    }

    /// Applies the flags to a scenario's `measure` and `slo`.
    pub fn apply(&self, scenario: &mut Scenario) {
        if let Some(n) = self.warmup {
            scenario.measure = Measure { warmup_requests: Some(n), whole_run: false };
        }
        if self.whole_run {
            scenario.measure = Measure { warmup_requests: None, whole_run: true };
        }
        if self.slo_ttft_ms.is_some() || self.slo_tpot_ms.is_some() {
            let slo = scenario.slo.get_or_insert_with(Slo::default);
            slo.ttft_ms = self.slo_ttft_ms.or(slo.ttft_ms);
            slo.tpot_ms = self.slo_tpot_ms.or(slo.tpot_ms);
        }
    }
}

/// Applies the command-line overrides to a scenario.
fn apply(args: &RunArgs, mut scenario: Scenario) -> Scenario {
    if let Some(seed) = args.seed {
        scenario.seed = seed;
    }
    for &option in &args.legacy {
        if !scenario.protocol.legacy.contains(&option) {
            scenario.protocol.legacy.push(option);
        }
    }
    args.workload.apply(&mut scenario);
    args.measure.apply(&mut scenario);
    scenario
}

/// Warns on stderr when `scenario` names a GPU, NIC or model profile the cost model's
/// calibration was not fitted on: its figures there are an extrapolation (docs/calibration.md).
pub fn warn_uncovered(scenario: &Scenario) {
    let calibration = pdkv_sim::calibration::current();
    if let Some(warning) = calibration.coverage_warning(&calibration.coverage(Combination::of(scenario))) {
        errln!("{warning}");
    }
}

pub fn run(args: &RunArgs) -> ExitCode {
    let (scenario, identity) = match load_with_notation(&args.scenario) {
        Ok((base, notation)) => {
            let scenario = apply(args, base.clone());
            let identity = RunIdentity::new(&base, &scenario, notation);
            (scenario, identity)
        }
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let flags = match args.measure.flags() {
        measure if measure.is_empty() => args.workload.flags(),
        measure if args.workload.concurrency.is_none() && args.workload.requests.is_none() => {
            measure.join(" ")
        }
        measure => format!("{} {}", args.workload.flags(), measure.join(" ")),
    };
    if let Err(message) = check_overrides(&scenario, &flags) {
        errln!("error: {message}");
        return ExitCode::from(2);
    }
    warn_uncovered(&scenario);
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("target/pdkv").join(identity.slug()));
    let gpus_per_node = scenario.hardware.gpus_per_node;
    let which = Which { text: !args.no_trace, chrome: args.chrome_trace };
    let command = replay_command(args, &scenario);
    // The trace writer runs on a thread of its own while the simulation goes on, and finishes
    // while the pictures are drawn.
    std::thread::scope(|scope| {
        let (sink, traces) = match which.text || which.chrome {
            true => {
                let (sink, traces) = trace_files::start(scope, &out, which);
                (Some(sink), Some(traces))
            }
            false => (None, None),
        };
        let mut bar = Bar::new(format!("simulating {}", identity.label()), Duration::from_millis(700));
        let mut progress = |p: pdkv_sim::Progress| {
            bar.update(p.ended, p.total, format!("{:.0} s virtual", p.now_ns as f64 / 1e9));
        };
        let simulated = pdkv_sim::run_with_progress(
            &scenario,
            RunOptions { trace: sink, requests: !args.no_requests_csv },
            &mut progress,
        );
        bar.finish();
        let mut run = match simulated {
            Ok(run) => run,
            Err(message) => {
                errln!("error: {}: {message}", args.scenario);
                return ExitCode::from(2);
            }
        };
        run.result.label = identity.label();
        let (written, truncated) =
            match write_files(&out, &run, gpus_per_node, &command, traces, which, !args.no_requests_csv) {
                Ok(files) => files,
                Err(message) => {
                    errln!("error: {message}");
                    return ExitCode::from(2);
                }
            };
        if args.json {
            outln!("{}", run.result.to_json());
        } else {
            out!("{}", summary(&run.result, &written, &command));
        }
        if let Some(note) = truncated {
            errln!("note: {note}");
        }
        if run.result.as_expected() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    })
}

/// Writes the result, the pictures and the index page while the trace writer finishes; returns
/// the files, page first, and a sentence when a trace file was cut at its size limit.
/// `gpus_per_node` groups the NIC pictures of large deployments by node.
fn write_files(
    out: &Path,
    run: &Run,
    gpus_per_node: u16,
    command: &str,
    traces: Option<Traces>,
    which: Which,
    requests_csv: bool,
) -> Result<(Vec<PathBuf>, Option<String>), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    // A trace file this run does not write is removed, so the folder holds this run's files
    // only and the page links to nothing stale.
    for (wanted, name) in [
        (which.text, "trace.txt"),
        (which.chrome, "trace.json"),
        (requests_csv, pdkv_sim::request_table::FILE),
    ] {
        let path = out.join(name);
        if !wanted && path.exists() {
            std::fs::remove_file(&path).map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
        }
    }
    let result_json = out.join("result.json");
    let csv = out.join(pdkv_sim::request_table::FILE);
    let (pictures, json, traces) = std::thread::scope(|scope| {
        let json = scope.spawn(|| {
            pdkv_sim::files::write_atomic(&result_json, run.result.to_json().as_bytes())
                .map_err(|e| format!("cannot write {}: {e}", result_json.display()))?;
            // Whole or nothing, like result.json: a reader never sees half a table.
            match requests_csv {
                true => pdkv_sim::files::write_atomic_with(&csv, |out| {
                    pdkv_sim::request_table::write_csv(&run.requests, out)
                })
                .map_err(|e| format!("cannot write {}: {e}", csv.display())),
                false => Ok(()),
            }
        });
        let pictures = pdkv_reports::run_pictures(&run.result, gpus_per_node, out).map_err(|e| e.to_string());
        let traces = traces.map(Traces::finish).transpose();
        let json = json.join().unwrap_or_else(|_| Err("writing result.json panicked".into()));
        (pictures, json, traces)
    });
    let (pictures, traces) = (pictures?, traces?.unwrap_or_default());
    json?;
    let calibration = pdkv_sim::calibration::current().summary();
    let mut listed = vec![("result.json", "the versioned result")];
    if requests_csv {
        listed.push((
            pdkv_sim::request_table::FILE,
            "one row per request: where it went, its times, how it ended",
        ));
    }
    for file in &traces.files {
        listed.push(match file.extension().is_some_and(|e| e == "json") {
            true => ("trace.json", "Chrome trace: open in Perfetto or chrome://tracing"),
            false => ("trace.txt", "compact trace, virtual time first"),
        });
    }
    let mut notes = Vec::new();
    notes.extend(traces.truncated.clone());
    let page = pdkv_reports::page::write_run_page(
        out,
        &run.result,
        &pictures,
        &calibration,
        command,
        &listed,
        &notes,
    )
    .map_err(|e| format!("cannot write {}: {e}", out.join("index.html").display()))?;
    let mut written = vec![page, result_json];
    written.extend(requests_csv.then_some(csv));
    written.extend(traces.files);
    Ok((written, traces.truncated))
}

/// The command that reruns this exact run.
fn replay_command(args: &RunArgs, scenario: &Scenario) -> String {
    let mut cmd = format!("pdkv run {} --seed {}", args.scenario, scenario.seed);
    for option in &args.legacy {
        let _ = write!(cmd, " --legacy {option}");
    }
    if let Some(c) = args.workload.concurrency {
        let _ = write!(cmd, " --concurrency {c}");
    }
    if let Some(n) = args.workload.requests {
        let _ = write!(cmd, " --requests {n}");
    }
    for flag in args.measure.flags() {
        let _ = write!(cmd, " {flag}");
    }
    cmd
}

/// The terminal summary: outcome, throughput, latencies, NIC balance, ledger, hangs, violations.
pub fn summary(r: &RunResult, files: &[PathBuf], replay: &str) -> String {
    let mut s = String::new();
    let verdict = if r.as_expected() { "as expected" } else { "NOT AS EXPECTED" };
    let _ = writeln!(s, "pdkv run {}", r.title());
    if !r.profiles.is_empty() {
        let _ = writeln!(s, "  profiles     {} (profiles/*.ron)", r.profiles);
    }
    let _ = writeln!(s, "  outcome      {} (expected {}: {verdict})", r.outcome.name(), r.expected.name());
    let q = &r.requests;
    let _ = writeln!(
        s,
        "  requests     {} sent, {} finished, {} failed ({} excused by faults, {} unexcused), {} unfinished, \
         {} unsent in {:.1} s virtual ({} events)",
        q.sent,
        q.finished,
        q.failed,
        q.failed_excused,
        q.failed_unexcused,
        q.unfinished,
        q.unsent,
        r.duration_s,
        r.events
    );
    if q.unsent > 0 {
        // A hang stops the run at once; otherwise only the budget ends it with requests unsent.
        let why = if r.hangs.is_empty() {
            "the run's budget (limits.max_virtual_time_s or limits.max_events) ended first"
        } else {
            "the run stopped at the hang first"
        };
        let _ = writeln!(s, "  UNSENT       {} requests were never sent: {why}", q.unsent);
    }
    if q.cut_off > 0 {
        let _ = writeln!(
            s,
            "  CUT OFF      {} requests were in flight when the run's budget ended, and the run was still \
             progressing (requests ending, prompts prefilled, tokens generated or KV read): not hung",
            q.cut_off
        );
    }
    if q.stalled > 0 {
        let _ = writeln!(
            s,
            "  STALLED      {} requests were in flight when the run's budget ended, nothing had progressed for \
             longer than any protocol wait, and nothing waited for anything the simulator models: no \
             hang it can show (a hang has its wait-for graph), and no verdict",
            q.stalled
        );
    }
    let t = &r.throughput;
    let _ = writeln!(
        s,
        "  throughput   {:.0} tok/s total, {:.0} tok/s output over the whole run",
        t.total_tok_s, t.output_tok_s
    );
    let l = &r.latency_ms;
    let na = |what: &str| {
        if q.finished == 0 {
            "n/a (no request finished)".to_string()
        } else {
            format!("{what} n/a")
        }
    };
    let ttft =
        l.ttft.map_or_else(|| na("TTFT"), |t| format!("TTFT mean {:.0} ms (p99 {:.0})", t.mean, t.p99));
    let latency = match (l.ttft, l.tpot, l.itl) {
        (None, ..) => ttft,
        (Some(_), tpot, itl) => format!(
            "{ttft}, {}, {} over the whole run",
            tpot.map_or_else(|| na("TPOT"), |t| format!("TPOT mean {:.1} ms (p99 {:.1})", t.mean, t.p99)),
            itl.map_or_else(|| na("ITL"), |t| format!("ITL p99 {:.1} ms", t.p99))
        ),
    };
    let _ = writeln!(s, "  latency      {latency}");
    steady_lines(&mut s, r);
    let n = &r.nic;
    if let Some(bounds) = r.expected_jain {
        let holds = match n.jain {
            Some(jain) if bounds.holds(jain) => "holds",
            Some(_) => "DOES NOT HOLD",
            None => "DOES NOT HOLD (no reads, so no Jain index)",
        };
        let _ = writeln!(s, "  expectation  Jain {bounds}: {holds}");
    }
    if let Some(spread) = n.spread() {
        let gpus = n.reads_per_prefill_gpu.len();
        let _ = match n.jain {
            Some(jain) => writeln!(s, "  NIC balance  Jain {jain:.3} over {gpus} prefill GPUs; {spread}"),
            None => writeln!(s, "  NIC balance  Jain n/a: no prefill GPU served a read"),
        };
    }
    if let Some(read) = l.kv_read {
        // What a hot NIC or small RDMA operations cost a request, before its first step.
        let busiest = n.utilisation.iter().flatten().fold(0.0f64, |a, &b| a.max(b));
        let _ = writeln!(
            s,
            "  KV reads     mean {:.1} ms (p99 {:.1}) per read; busiest NIC {:.0}% busy in its busiest second",
            read.mean,
            read.p99,
            100.0 * busiest
        );
    }
    let g = &r.ledger;
    let _ = writeln!(
        s,
        "  ledger       {} freed, {} reaped, {} still held; longest hold {:.0} ms; prefill stalled {:.1} s",
        g.freed, g.reaped, g.held, g.max_hold_ms, g.prefill_stall_s
    );
    for hang in &r.hangs {
        let _ = writeln!(s, "  HANG at {:.0} ms: {}", hang.t_ms, hang.what);
        for edge in &hang.wait_for {
            let _ = writeln!(s, "      {edge}");
        }
        if let Some(cycle) = &hang.cycle {
            let members: Vec<String> = cycle.iter().map(ToString::to_string).collect();
            let _ = writeln!(s, "      cycle (deadlock): {}", members.join(" -> "));
        }
    }
    for v in r.violations.iter().take(5) {
        let _ = writeln!(s, "  VIOLATION at {:.3} ms [{}]: {}", v.t_ms, v.kind, v.detail);
    }
    if r.violations.len() > 5 {
        let _ = writeln!(s, "  ... {} violations in all (see result.json)", r.violations.len());
    }
    if let Some(page) = files.first() {
        let _ = writeln!(s, "  report       {}", page.display());
    }
    for file in files.iter().skip(1) {
        let _ = writeln!(s, "  wrote        {}", file.display());
    }
    let _ = writeln!(s, "  replay       {replay}");
    s
}

/// The steady-state part of the summary: the window, GPUs, a `vllm bench serve` style table of
/// latency percentiles, rates overall, per GPU and per phase, and goodput when an SLO is set.
fn steady_lines(s: &mut String, r: &RunResult) {
    let Steady { window: w, latency_ms: l, throughput: t, goodput } = &r.steady;
    let sent = r.requests.sent;
    let window = w.describe(sent);
    let _ = writeln!(s, "  window       {window}");
    let _ = writeln!(s, "  GPUs         {} prefill, {} decode", r.gpus.prefill, r.gpus.decode);
    if r.requests.finished == 0 {
        // Rates of nothing would read as measured zeros.
        let _ = writeln!(s, "  steady       n/a (no request finished)");
        return;
    }
    let _ = writeln!(s, "    ms            mean       p50       p90       p99");
    for (name, summary) in [("TTFT", l.ttft), ("TPOT", l.tpot), ("ITL", l.itl), ("E2E", l.e2e)] {
        let _ = match summary {
            Some(x) => {
                writeln!(s, "    {name:<6}{:>12.1}{:>10.1}{:>10.1}{:>10.1}", x.mean, x.p50, x.p90, x.p99)
            }
            None => writeln!(s, "    {name:<6}{:>12}", "n/a"),
        };
    }
    let _ = writeln!(s, "  rate         {}", t.rate_text());
    let _ = writeln!(s, "  per GPU      {}", t.per_gpu_text());
    if let Some(g) = goodput {
        let _ = writeln!(s, "  goodput      {}", g.text());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_sim::result::Summary;

    #[test]
    fn summary_says_na_where_nothing_was_measured() {
        let some = |mean| Some(Summary { mean, p50: mean, p90: mean, p99: mean });
        // (requests finished, TTFT, TPOT, reads per GPU) -> (latency line, NIC balance line)
        let check = |finished, ttft, tpot, reads: [u64; 2], expected: [&str; 2]| {
            let mut r = RunResult::empty(&Scenario::from_notation("1P_TP2:1D_TP2"), String::new());
            r.requests.finished = finished;
            (r.latency_ms.ttft, r.latency_ms.tpot, r.latency_ms.itl) = (ttft, tpot, tpot);
            r.nic.prefill_gpus = vec!["P0.dp0.tp0".into(), "P0.dp0.tp1".into()];
            r.nic.reads_per_prefill_gpu = reads.to_vec();
            r.nic.jain = pdkv_sim::result::jain(&reads);
            let text = summary(&r, &[], "pdkv run x");
            let line =
                |start: &str| text.lines().find(|l| l.starts_with(start)).unwrap_or_default().to_string();
            assert_eq!([line("  latency"), line("  NIC balance")], expected, "{text}");
        };
        check(
            0,
            None,
            None,
            [0, 0],
            [
                "  latency      n/a (no request finished)",
                "  NIC balance  Jain n/a: no prefill GPU served a read",
            ],
        );
        check(
            4,
            some(900.0),
            None,
            [4, 4],
            [
                "  latency      TTFT mean 900 ms (p99 900), TPOT n/a, ITL n/a over the whole run",
                "  NIC balance  Jain 1.000 over 2 prefill GPUs; every GPU read 4 times",
            ],
        );
        check(
            4,
            some(900.0),
            some(25.0),
            [8, 0],
            [
                "  latency      TTFT mean 900 ms (p99 900), TPOT mean 25.0 ms (p99 25.0), ITL p99 25.0 ms over the whole run",
                "  NIC balance  Jain 0.500 over 2 prefill GPUs; most read P0.dp0.tp0 (8), least read P0.dp0.tp1 (0)",
            ],
        );
    }

    /// (what is typed) -> (the scenario's name, its deployment, whether it was a notation): a
    /// built-in and the notation of its deployment are two scenarios with two names.
    #[test]
    fn a_built_in_and_the_notation_of_its_deployment_are_named_apart() {
        let check = |spec: &str, expected: (&str, &str, bool)| {
            let (scenario, notation) = match load_with_notation(spec) {
                Ok(loaded) => loaded,
                Err(err) => panic!("{spec}: {err}"),
            };
            assert_eq!((scenario.name.as_str(), scenario.deployment.as_str(), notation.is_some()), expected);
        };
        check("2P_TP8-1D_DP8EP", ("2P_TP8-1D_DP8EP", "2P_TP8:1D_DP8EP", false));
        check("2P_TP8:1D_DP8EP", ("2P_TP8:1D_DP8EP", "2P_TP8:1D_DP8EP", true));
        check("1P_TP8-1D_TP8", ("1P_TP8-1D_TP8", "1P_TP8:1D_TP8", false));
        check("1P_TP8:1D_TP8", ("1P_TP8:1D_TP8", "1P_TP8:1D_TP8", true));
        check("1P_TP8+1P_DP8EP:1D_TP8", ("1P_TP8+1P_DP8EP:1D_TP8", "1P_TP8+1P_DP8EP:1D_TP8", true));
        check("proxy-aliasing", ("proxy-aliasing", "2P_DP8EP:1D_TP8", false));
    }

    /// The steady part of the summary: the window (steady, or the whole run and why), GPUs, the
    /// percentile table, rates and goodput (only with an SLO).
    #[test]
    fn summary_shows_the_steady_window_as_a_table() {
        use pdkv_sim::result::{Goodput, Gpus, Window, WindowKind, WindowLatencies, WindowThroughput};
        let mut r = RunResult::empty(&Scenario::from_notation("2P_TP8:1D_DP8EP"), String::new());
        r.requests.sent = 1280;
        r.gpus = Gpus { prefill: 16, decode: 8 };
        assert!(summary(&r, &[], "x")
            .contains("\n  GPUs         16 prefill, 8 decode\n  steady       n/a (no request finished)\n"));
        r.requests.finished = 1280;
        let x = |mean, p50, p90, p99| Some(Summary { mean, p50, p90, p99 });
        r.steady = Steady {
            window: Window {
                kind: WindowKind::Steady,
                warmup_requests: 128,
                drain_requests: 128,
                requests: 1024,
                start_s: 60.24,
                end_s: 480.5,
            },
            latency_ms: WindowLatencies {
                ttft: x(1612.34, 1502.1, 2890.0, 5012.24),
                tpot: x(42.8, 42.9, 43.1, 43.3),
                itl: None,
                e2e: x(45012.0, 44000.0, 47000.0, 52000.0),
            },
            throughput: WindowThroughput {
                requests_per_s: 2.4,
                input_tok_s: 19661.0,
                output_tok_s: 2457.4,
                total_tok_s: 22118.5,
                requests_per_s_per_gpu: 0.1,
                total_tok_s_per_gpu: 921.6,
                output_tok_s_per_gpu: 102.4,
                input_tok_s_per_prefill_gpu: 1228.8,
                output_tok_s_per_decode_gpu: 307.2,
            },
            goodput: None,
        };
        let steady = |r: &RunResult| {
            let text = summary(r, &[], "pdkv run x");
            let start = text.find("  window").expect("a window line");
            let end = text.find("  ledger").expect("a ledger line");
            text[start..end].to_string()
        };
        assert_eq!(
            steady(&r),
            "  window       steady: arrivals 129 to 1152 of 1280 (warm-up 128, drain 128), 60.2 s to 480.5 s virtual
  GPUs         16 prefill, 8 decode
    ms            mean       p50       p90       p99
    TTFT        1612.3    1502.1    2890.0    5012.2
    TPOT          42.8      42.9      43.1      43.3
    ITL            n/a
    E2E        45012.0   44000.0   47000.0   52000.0
  rate         2.400 req/s, 22118 tok/s (19661 in, 2457 out)
  per GPU      0.100 req/s, 922 tok/s (102 out); 1229 in per prefill GPU, 307 out per decode GPU
"
        );
        r.steady.window.kind = WindowKind::WholeRunTooShort;
        r.steady.goodput = Some(Goodput {
            slo: Slo { ttft_ms: Some(3000.0), tpot_ms: None },
            requests_per_s: 2.1,
            requests_per_s_per_gpu: 0.0874,
            met_fraction: 0.876,
        });
        let text = steady(&r);
        assert!(
            text.starts_with(
                "  window       the whole run: its 1280 arrivals leave no steady window between warm-up and drain\n"
            ),
            "{text}"
        );
        assert!(
            text.ends_with("  goodput      2.100 req/s (0.087 per GPU); 87.6% of the window's requests met TTFT <= 3000 ms\n"),
            "{text}"
        );
        r.steady.window.kind = WindowKind::WholeRunAsked;
        assert!(steady(&r).starts_with("  window       the whole run, as asked (1280 arrivals)\n"));
    }

    /// (profiles named, fields overridden) -> the summary's profiles line, absent when none are
    /// named.
    #[test]
    fn summary_names_the_profiles_used() {
        let check = |gpu: Option<&str>, model: Option<&str>, overrides: &[&str], expected: Option<&str>| {
            let mut r = RunResult::empty(&Scenario::from_notation("1P_TP2:1D_TP2"), String::new());
            r.profiles.gpu = gpu.map(str::to_string);
            r.profiles.model = model.map(str::to_string);
            r.profiles.overrides = overrides.iter().map(|path| path.to_string()).collect();
            let text = summary(&r, &[], "pdkv run x");
            assert_eq!(text.lines().find(|l| l.starts_with("  profiles")), expected, "{text}");
        };
        check(None, None, &[], None);
        check(Some("h200-sxm"), None, &[], Some("  profiles     gpu h200-sxm (profiles/*.ron)"));
        check(
            Some("mi355x"),
            Some("deepseek-r1"),
            &[],
            Some("  profiles     gpu mi355x, model deepseek-r1 (profiles/*.ron)"),
        );
        check(
            Some("mi300x"),
            None,
            &["hardware.fp8_tflops"],
            Some("  profiles     gpu mi300x; overridden: hardware.fp8_tflops (profiles/*.ron)"),
        );
    }

    #[test]
    fn jain_bounds_without_reads_do_not_hold_and_read_as_words() {
        let mut r = RunResult::empty(&Scenario::from_notation("1P_TP2:1D_TP2"), String::new());
        r.expected_jain = Some(pdkv_sim::scenario::JainBounds { at_least: None, at_most: Some(0.5) });
        let text = summary(&r, &[], "pdkv run x");
        assert!(
            text.contains("  expectation  Jain at most 0.5: DOES NOT HOLD (no reads, so no Jain index)\n"),
            "{text}"
        );
        assert!(!text.contains("Some(") && !text.contains("None"), "{text}");
    }
}
