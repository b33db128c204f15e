//! `pdkv sweep`: a grid of runs (scenarios or notations × concurrency) and one report comparing
//! them, one line per scenario.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use clap::Args;
use pdkv_reports::page::Provenance;
use pdkv_reports::{ErrorBand, SweepPoint};
use pdkv_sim::calibration::Calibration;
use pdkv_sim::scenario::{Clients, Hardware, ModelProfile, Scenario};
use pdkv_sim::{RunIdentity, RunOptions, RunResult};

use crate::progress::Bar;
use crate::shard::Shard;

const EXAMPLES: &str = "\
Examples:
  pdkv sweep 2P_TP8:1D_TP8 2P_DP8EP:1D_DP8EP 2P_TP8:1D_DP8EP --concurrency 32,128,512
  pdkv sweep 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 8,16 --requests-per-client 2 --out /tmp/s
  pdkv sweep 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 8,16 --shard 1/2 --out /tmp/s1

Each point runs the scenario (or the default profile for a notation) with a closed loop of C
clients and C x requests-per-client requests; points run on --jobs threads (default: every
core), and the report is the same for any number. Writes index.html, sweep.json and the charts
(throughput, mean TTFT and mean TPOT against concurrency, one line per scenario or notation,
so a bug and its fix on one deployment are two lines) to --out (default
target/pdkv/sweep_<lines>_<concurrencies>/, so different sweeps keep their own reports).
The output names each line's profiles and the calibration of the cost model
(profiles/calibration.ron); the charts shade its validation error around every line, or say
that it is not yet measured.

--shard i/N runs only shard i of N (the grid points whose index is i modulo N, shards numbered
from 0; points are ordered by line, then concurrency) and writes their results to
sweep-shard.json in --out (default: the sweep's folder with _shard-i-of-N); `pdkv sweep-merge`
writes the report from the N shard folders, every file byte for byte the unsharded sweep's, so
a sweep can run as a Slurm job array or a Kubernetes Indexed Job (docs/cluster-campaigns.md).

Exit codes: 0 every run had its expected outcome (NIC-balance bounds of a scenario file are
not checked, since the sweep changes its workload); 1 some did not; 2 bad input.
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Run every deployment at every concurrency and chart them together.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct SweepArgs {
    /// Deployment notations, built-in scenario names or scenario files.
    #[arg(required = true)]
    deployments: Vec<String>,
    /// Concurrency levels, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [32u32, 128, 512])]
    concurrency: Vec<u32>,
    /// Requests per client (N = C x this), as in the published study (10).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    requests_per_client: u32,
    /// Seed of every run.
    #[arg(long)]
    seed: Option<u64>,
    /// Folder of the sweep report.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Threads running points (default: the machine's cores); the report is the same for any.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    jobs: Option<u32>,
    /// Run only shard I of N of the points (indexes equal to I modulo N; I from 0 to N-1) and
    /// write their results for `pdkv sweep-merge` instead of the report.
    #[arg(long, value_name = "I/N", value_parser = crate::shard::parse)]
    shard: Option<Shard>,
}

/// The sweep's own folder: its lines, its concurrency levels and, when not the usual ten, its
/// requests per client, e.g. `target/pdkv/sweep_proxy-aliasing_proxy-aliasing-fixed_C8-16`.
fn default_folder(scenarios: &[(Scenario, String)], args: &SweepArgs) -> PathBuf {
    let mut parts = vec!["sweep".to_string()];
    parts.extend(scenarios.iter().map(|(_, label)| label.clone()));
    let levels: Vec<String> = args.concurrency.iter().map(u32::to_string).collect();
    parts.push(format!("C{}", levels.join("-")));
    if args.requests_per_client != 10 {
        parts.push(format!("x{} per client", args.requests_per_client));
    }
    PathBuf::from("target/pdkv").join(pdkv_sim::identity::slug(&parts.join(", ")))
}

pub fn run(args: &SweepArgs) -> ExitCode {
    if args.concurrency.contains(&0) {
        errln!("error: --concurrency values must be at least 1");
        return ExitCode::from(2);
    }
    // Each line is one scenario, labelled by its identity without the workload: the sweep sets
    // the workload, and concurrency is the chart's x axis.
    let mut scenarios: Vec<(Scenario, String)> = Vec::new();
    for spec in &args.deployments {
        let (base, notation) = match crate::run_cmd::load_with_notation(spec) {
            Ok(loaded) => loaded,
            Err(message) => {
                errln!("error: {message}");
                return ExitCode::from(2);
            }
        };
        let mut scenario = base.clone();
        if let Some(seed) = args.seed {
            scenario.seed = seed;
        }
        let mut identity = RunIdentity::new(&base, &scenario, notation);
        identity.workload = None;
        let label = identity.label();
        if scenarios.iter().any(|(_, other)| *other == label) {
            errln!("error: {spec}: {label} is in the sweep twice; each line is one scenario or notation");
            return ExitCode::from(2);
        }
        scenarios.push((scenario, label));
    }
    // Every point is built and checked before the first runs, so a bad flag fails at once.
    let mut grid = Vec::new();
    for (scenario, label) in &scenarios {
        for &c in &args.concurrency {
            let mut s = scenario.clone();
            s.workload.clients =
                Clients::Closed { concurrency: c, requests: c.saturating_mul(args.requests_per_client) };
            let flags = format!("--concurrency {c} --requests-per-client {}", args.requests_per_client);
            if let Err(message) = crate::run_cmd::check_overrides(&s, &flags) {
                errln!("error: {message}");
                return ExitCode::from(2);
            }
            grid.push((s, label, c));
        }
    }
    let jobs = args
        .jobs
        .map(|j| j as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // A shard runs its own points only, each with its index in the whole grid.
    let shard = args.shard.unwrap_or(Shard::WHOLE);
    let total = grid.len();
    let (indexes, grid): (Vec<usize>, Vec<_>) =
        grid.into_iter().enumerate().filter(|(i, _)| shard.owns(*i as u64)).unzip();
    let bar = Mutex::new(Bar::new("sweep", Duration::ZERO));
    let results = run_points(&grid, jobs, &bar);
    bar.into_inner().expect("threads ended").finish();
    let mut points = Vec::new();
    let mut expected = Vec::new();
    // In grid order, whatever order the threads finished in: the first point that could not run
    // is the one reported, and the report is the same for any number of threads.
    for ((s, label, c), result) in grid.iter().zip(results) {
        let result = match result {
            Some(Ok(result)) => result,
            Some(Err(message)) => {
                errln!("error: {}: {message}", s.name);
                return ExitCode::from(2);
            }
            None => unreachable!("a point is left unrun only after an earlier one failed"),
        };
        // The sweep replaces the workload, so only the outcome is compared: a scenario's
        // NIC-balance bounds belong to its own request count.
        expected.push(result.outcome == result.expected);
        points.push(SweepPoint {
            run: (*label).clone(),
            deployment: s.deployment.clone(),
            concurrency: *c,
            total_tok_s: result.throughput.total_tok_s,
            ttft_mean_ms: result.latency_ms.ttft.map(|t| t.mean),
            tpot_mean_ms: result.latency_ms.tpot.map(|t| t.mean),
            outcome: result.outcome.name().to_string(),
        });
    }
    let calibration = pdkv_sim::calibration::current();
    let provenance = Provenance {
        lines: scenarios.iter().map(|(s, label)| (label.clone(), hardware(s))).collect(),
        calibration: calibration.summary(),
    };
    if let Some(shard) = args.shard {
        let out = args.out.clone().unwrap_or_else(|| {
            let whole = default_folder(&scenarios, args);
            PathBuf::from(format!("{}_shard-{}-of-{}", whole.display(), shard.index, shard.count))
        });
        let file = crate::sweep_merge::ShardFile {
            command: command(args),
            calibration: provenance.calibration.clone(),
            lines: provenance.lines.clone(),
            points: total as u64,
            shard,
            results: indexes
                .into_iter()
                .map(|i| i as u64)
                .zip(points)
                .zip(expected)
                .map(|((i, p), e)| (i, p, e))
                .collect(),
        };
        return match file.write(&out) {
            Ok(path) => {
                let points: Vec<SweepPoint> = file.results.iter().map(|(_, p, _)| p.clone()).collect();
                print_table(&points, &provenance);
                outln!(
                    "shard {shard} of the sweep ({} of its {total} points): {}",
                    points.len(),
                    path.display()
                );
                exit_code(file.results.iter().all(|(_, _, e)| *e))
            }
            Err(message) => {
                errln!("error: {message}");
                ExitCode::from(2)
            }
        };
    }
    let out = args.out.clone().unwrap_or_else(|| default_folder(&scenarios, args));
    report(&out, &points, &provenance, &command(args), expected.iter().all(|e| *e))
}

/// Writes the sweep report of `points` to `out`, prints its table and says whether every point
/// had its expected outcome (exit 0) or not (exit 1); 2 when the report cannot be written.
pub fn report(
    out: &std::path::Path,
    points: &[SweepPoint],
    provenance: &Provenance,
    command: &str,
    all_expected: bool,
) -> ExitCode {
    let calibration = pdkv_sim::calibration::current();
    match write(out, points, provenance, &error_band(&calibration), command) {
        Ok(page) => {
            print_table(points, provenance);
            outln!("report: {}", page.display());
        }
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    }
    exit_code(all_expected)
}

fn exit_code(all_expected: bool) -> ExitCode {
    if all_expected {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Prints one line per point, then what produced the figures.
fn print_table(points: &[SweepPoint], provenance: &Provenance) {
    let width = points.iter().map(|p| p.run.chars().count()).max().unwrap_or(0).max(24);
    // A run without finished requests has no latency: "n/a", in the numbers' columns.
    let ms = |v: Option<f64>, width: usize, decimals: usize| {
        v.map_or_else(|| format!("{:>width$}   ", "n/a"), |v| format!("{v:>width$.decimals$} ms"))
    };
    for p in points {
        outln!(
            "{:<width$} C={:<5} {:>9.0} tok/s  TTFT {}  TPOT {}  {}",
            p.run,
            p.concurrency,
            p.total_tok_s,
            ms(p.ttft_mean_ms, 9, 0),
            ms(p.tpot_mean_ms, 6, 1),
            p.outcome
        );
    }
    // What produced the figures, so a ranking is read against the model's error.
    outln!("model:");
    for (line, hardware) in &provenance.lines {
        outln!("  {line:<width$} {hardware}");
    }
    outln!("{}", provenance.calibration);
}

/// One result per grid point, in grid order, run on `jobs` threads (each run single-threaded
/// and deterministic, so a point's result does not depend on the thread that ran it). Points
/// are handed out in order; after a point fails to run, no further point starts, and the
/// points not run are `None` (all after the failure's index, so the first failure in grid order
/// is always among the results).
fn run_points(
    grid: &[(Scenario, &String, u32)],
    jobs: usize,
    bar: &Mutex<Bar>,
) -> Vec<Option<Result<RunResult, String>>> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<RunResult, String>>>> = Mutex::new(vec![None; grid.len()]);
    let total = grid.len() as u64;
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(grid.len()) {
            scope.spawn(|| {
                while !failed.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some((s, label, c)) = grid.get(i) else { break };
                    if let Ok(mut bar) = bar.lock() {
                        let n = done.load(Ordering::SeqCst) as u64;
                        bar.update(n, total, format!("{label} at C = {c}"));
                    }
                    let result = pdkv_sim::run(s, RunOptions::default()).map(|run| run.result);
                    let result = result.map_err(|e| e.to_string());
                    failed.fetch_or(result.is_err(), Ordering::SeqCst);
                    results.lock().expect("no panics while held")[i] = Some(result);
                    done.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    results.into_inner().expect("threads ended")
}

/// Where a line's hardware and model come from, in words: the profiles it names, or the
/// built-in defaults the calibration was fitted on.
pub fn hardware(s: &Scenario) -> String {
    const DEFAULTS: &str = "built-in MI300X-class defaults";
    let p = &s.profiles;
    if p.is_empty() {
        // A scenario file may change default values without naming a profile (a slower control
        // network, say); its figures are then not the defaults' either.
        if s.hardware == Hardware::default() && s.model == ModelProfile::default() {
            format!("{DEFAULTS}, DeepSeek-R1 (no profile named)")
        } else {
            format!("{DEFAULTS}, DeepSeek-R1, with the scenario file's own values (no profile named)")
        }
    } else if p.gpu.is_some() && p.nic.is_some() && p.model.is_some() {
        format!("{p} (profiles/*.ron)")
    } else {
        format!("{p} (profiles/*.ron), {DEFAULTS} for the rest")
    }
}

/// The charts' account of the model's error: the validation's median error as a band once it is
/// measured, the fitting error until then.
fn error_band(c: &Calibration) -> ErrorBand {
    match c.validation {
        Some(v) => ErrorBand::Measured {
            half_width: v.median_abs_error,
            points: v.points,
            calibration: c.name.clone(),
        },
        None => ErrorBand::Unmeasured { fitting_error_max: c.fitting_error_max, calibration: c.name.clone() },
    }
}

fn write(
    out: &std::path::Path,
    points: &[SweepPoint],
    provenance: &Provenance,
    band: &ErrorBand,
    command: &str,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let json =
        serde_json::to_string_pretty(&points.iter().map(point_json).collect::<Vec<_>>()).expect("serialises");
    let file = out.join("sweep.json");
    pdkv_sim::files::write_atomic(&file, json.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    let images = pdkv_reports::sweep_charts(points, band, out).map_err(|e| e.to_string())?;
    pdkv_reports::page::write_sweep_page(out, points, &images, provenance, command)
        .map_err(|e| format!("cannot write {}: {e}", out.join("index.html").display()))
}

fn point_json(p: &SweepPoint) -> serde_json::Value {
    serde_json::json!({
        "run": p.run,
        "deployment": p.deployment,
        "concurrency": p.concurrency,
        "total_tok_s": p.total_tok_s,
        "ttft_mean_ms": p.ttft_mean_ms,
        "tpot_mean_ms": p.tpot_mean_ms,
        "outcome": p.outcome,
    })
}

fn command(args: &SweepArgs) -> String {
    let list: Vec<String> = args.concurrency.iter().map(u32::to_string).collect();
    let mut cmd = format!(
        "pdkv sweep {} --concurrency {} --requests-per-client {}",
        args.deployments.join(" "),
        list.join(","),
        args.requests_per_client
    );
    if let Some(seed) = args.seed {
        cmd.push_str(&format!(" --seed {seed}"));
    }
    cmd
}
