//! `pdkv sweep`: a grid of runs (scenarios or notations × concurrency or request rate) and one
//! report comparing them, one line per scenario.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use clap::Args;
use pdkv_campaign::sweep::{self, RankedBy, ShardFile, Sweep, SweepPoint};
use pdkv_campaign::Shard;
use pdkv_reports::page::Provenance;
use pdkv_reports::ErrorBand;
use pdkv_sim::calibration::Calibration;

use crate::progress::Bar;
use crate::run_cmd::MeasureArgs;

const EXAMPLES: &str = "\
Examples:
  pdkv sweep 2P_TP8:1D_TP8 2P_DP8EP:1D_DP8EP 2P_TP8:1D_DP8EP --concurrency 32,128,512
  pdkv sweep 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 8,16 --requests-per-client 2 --out /tmp/s
  pdkv sweep 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 8,16 --shard 1/2 --out /tmp/s1
  pdkv sweep 2P_TP8:1D_DP8EP 2P_TP8:1D_TP8 --concurrency 32,128 --slo-ttft-ms 3000 --slo-tpot-ms 50
  pdkv sweep 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --rate 0.5,1,2 --requests 200

Each point runs the scenario (or the default profile for a notation) with a closed loop of C
clients and C x requests-per-client requests, or with --rate an open loop of Poisson arrivals
at each rate (per second) and --requests requests (default: the scenario's own count; a
closed-loop scenario's clients are replaced by the arrivals). A scenario whose workload is an
open loop is refused by a concurrency sweep, which would silently close it: sweep it by --rate.
Points run on --jobs threads (default: every core), and the report is the same for any number.

Each point carries its GPUs and the figures of its steady-state window (--warmup, --whole-run
as in pdkv run); with --slo-ttft-ms or --slo-tpot-ms, its goodput. The table ranks the lines at
each load by goodput per GPU (with an SLO) or steady tok/s per GPU, and says \"not separated\"
where a point is within the calibration's stated error of the one ranked above it (their error
bands overlap), so the model does not rank them.

Writes index.html, sweep.json and the charts (throughput, mean TTFT, mean TPOT, steady tok/s
per GPU and, with an SLO, goodput per GPU against the load, one line per scenario or notation,
so a bug and its fix on one deployment are two lines) to --out (default
target/pdkv/sweep_<lines>_<loads>/, so different sweeps keep their own reports).
The output names each line's profiles and the calibration of the cost model
(profiles/calibration.ron); the charts shade its validation error around every line, or say
that it is not yet measured. A line on a profile the calibration was not fitted on gets a
WARNING on stderr.

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
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "rate")]
    requests_per_client: u32,
    /// Request rates (arrivals per second, Poisson), comma separated: an open-loop sweep
    /// instead of a concurrency one.
    #[arg(long, value_delimiter = ',', value_name = "R", conflicts_with = "concurrency")]
    rate: Vec<f64>,
    /// Requests per point of a rate sweep (default: each scenario's own count).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), requires = "rate")]
    requests: Option<u32>,
    #[command(flatten)]
    measure: MeasureArgs,
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
    #[arg(long, value_name = "I/N", value_parser = pdkv_campaign::shard::parse)]
    shard: Option<Shard>,
}

pub fn run(args: &SweepArgs) -> ExitCode {
    if args.concurrency.contains(&0) {
        errln!("error: --concurrency values must be at least 1");
        return ExitCode::from(2);
    }
    if let Some(rate) = args.rate.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
        errln!("error: --rate {rate}: a rate is a number of arrivals per second above 0");
        return ExitCode::from(2);
    }
    // Each line is one scenario, labelled by its identity without the workload: the sweep sets
    // the workload, and the load (concurrency or rate) is the chart's x axis.
    let mut sweep = match args.rate.is_empty() {
        true => Sweep::new(args.concurrency.clone(), args.requests_per_client),
        false => Sweep::rates(args.rate.clone(), args.requests),
    };
    for spec in &args.deployments {
        let added = crate::run_cmd::load_with_notation(spec).and_then(|(mut base, notation)| {
            // The measurement flags set the scenario's own `measure` and `slo`, as `pdkv run`'s do.
            args.measure.apply(&mut base);
            crate::run_cmd::warn_uncovered(&base);
            sweep.add_line(spec, &base, notation, args.seed).map_err(|e| e.to_string())
        });
        if let Err(message) = added {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    }
    // Every point is built and checked before the first runs, so a bad flag fails at once.
    let grid = match sweep.grid() {
        Ok(grid) => grid,
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let jobs = args
        .jobs
        .map(|j| j as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // A shard runs its own points only, each with its index in the whole grid.
    let shard = args.shard.unwrap_or(Shard::WHOLE);
    let bar = Mutex::new(Bar::new("sweep", Duration::ZERO));
    let progress = |p: sweep::Progress| {
        if let Ok(mut bar) = bar.lock() {
            bar.update(p.done, p.total, format!("{} at {}", p.label, p.point.load_label()));
        }
    };
    let results = sweep::run(&grid, shard, jobs, &progress);
    bar.into_inner().expect("threads ended").finish();
    let results = match results {
        Ok(results) => results,
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let provenance =
        Provenance { lines: sweep.sources(), calibration: pdkv_sim::calibration::current().summary() };
    let command = sweep::command(&args.deployments, &sweep.load, args.seed, &args.measure.flags());
    if let Some(shard) = args.shard {
        let out = args.out.clone().unwrap_or_else(|| sweep.default_shard_folder(shard));
        let file = ShardFile {
            command,
            calibration: provenance.calibration.clone(),
            lines: provenance.lines.clone(),
            points: grid.len() as u64,
            shard,
            results,
        };
        return match file.write(&out) {
            Ok(path) => {
                let points: Vec<SweepPoint> = file.results.iter().map(|r| r.point.clone()).collect();
                print_table(&points, &provenance, &pdkv_sim::calibration::current());
                outln!(
                    "shard {shard} of the sweep ({} of its {} points): {}",
                    points.len(),
                    grid.len(),
                    path.display()
                );
                exit_code(file.results.iter().all(|r| r.as_expected))
            }
            Err(message) => {
                errln!("error: {message}");
                ExitCode::from(2)
            }
        };
    }
    let out = args.out.clone().unwrap_or_else(|| sweep.default_folder());
    let all_expected = results.iter().all(|r| r.as_expected);
    let points: Vec<SweepPoint> = results.into_iter().map(|r| r.point).collect();
    report(&out, &points, &provenance, &command, all_expected)
}

/// Writes the sweep report of `points` to `out`, prints its table and says whether every point
/// had its expected outcome (exit 0) or not (exit 1); 2 when the report cannot be written.
pub fn report(
    out: &Path,
    points: &[SweepPoint],
    provenance: &Provenance,
    command: &str,
    all_expected: bool,
) -> ExitCode {
    let calibration = pdkv_sim::calibration::current();
    match write(out, points, provenance, &error_band(&calibration), command) {
        Ok(page) => {
            print_table(points, provenance, &calibration);
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

/// Prints one line per point, then how the points are ranked and what produced the figures.
fn print_table(points: &[SweepPoint], provenance: &Provenance, calibration: &Calibration) {
    for line in table(points, calibration) {
        outln!("{line}");
    }
    // What produced the figures, so a ranking is read against the model's error.
    let width = points.iter().map(|p| p.run.chars().count()).max().unwrap_or(0).max(24);
    outln!("model:");
    for (line, hardware) in &provenance.lines {
        outln!("  {line:<width$} {hardware}");
    }
    outln!("{}", provenance.calibration);
}

/// The relative error the calibration states: its validation's median |error|, or its worst
/// fitting error while validation is not measured (docs/calibration.md).
fn stated_error(c: &Calibration) -> f64 {
    c.validation.map_or(c.fitting_error_max, |v| v.median_abs_error)
}

/// The table's lines: one per point (the line, its load, its GPUs, whole-run tok/s and mean
/// latencies, steady tok/s per GPU, goodput per GPU with an SLO, its rank at its load and
/// whether the model's error separates it from the rank above, its outcome), then how the
/// ranking reads.
fn table(points: &[SweepPoint], calibration: &Calibration) -> Vec<String> {
    let width = points.iter().map(|p| p.run.chars().count()).max().unwrap_or(0).max(24);
    // A run without finished requests has no latency: "n/a", in the numbers' columns.
    let ms = |v: Option<f64>, width: usize, decimals: usize| {
        v.map_or_else(|| format!("{:>width$}   ", "n/a"), |v| format!("{v:>width$.decimals$} ms"))
    };
    let by = match points.iter().any(|p| p.steady.goodput.is_some()) {
        true => RankedBy::GoodputPerGpu,
        false => RankedBy::ThroughputPerGpu,
    };
    let error = stated_error(calibration);
    let ranks = sweep::rank(points, by, error);
    let mut lines = Vec::new();
    for (p, rank) in points.iter().zip(&ranks) {
        let gpus = format!("{} GPUs ({}P+{}D)", p.gpus.total(), p.gpus.prefill, p.gpus.decode);
        let goodput = p
            .steady
            .goodput
            .map_or_else(String::new, |g| format!("  goodput {:>7.4} req/s/GPU", g.requests_per_s_per_gpu));
        let place = match (rank.of, rank.not_separated_from_above) {
            (1, _) => String::new(),
            (of, false) => format!("  rank {} of {of}", rank.place),
            (of, true) => format!("  rank {} of {of}, not separated from {}", rank.place, rank.place - 1),
        };
        // The steady window's TTFT percentiles, as `pdkv run` prints them.
        let ttft = p
            .steady
            .latency_ms
            .ttft
            .map_or_else(|| "n/a".to_string(), |t| format!("{:.0}/{:.0} ms", t.p50, t.p99));
        lines.push(format!(
            "{:<width$} {:<9} {gpus:<18} {:>9.0} tok/s  TTFT {}  TPOT {}  steady {:>6.0} tok/s/GPU, TTFT p50/p99 {ttft:>15}{goodput}{place}  {}",
            p.run,
            p.load_label(),
            p.total_tok_s,
            ms(p.ttft_mean_ms, 9, 0),
            ms(p.tpot_mean_ms, 6, 1),
            p.steady.throughput.total_tok_s_per_gpu,
            p.outcome.name()
        ));
    }
    if ranks.iter().any(|r| r.of > 1) {
        lines.push(format!(
            "ranked at each load by {}; \"not separated\": within ± {} (the calibration's {}) of the rank \
             above, so their error bands overlap and the model does not rank them",
            by.name(),
            pdkv_sim::calibration::percent(error),
            if calibration.validation.is_some() {
                "validation median |error|"
            } else {
                "worst fitting error"
            }
        ));
    }
    lines
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
    out: &Path,
    points: &[SweepPoint],
    provenance: &Provenance,
    band: &ErrorBand,
    command: &str,
) -> Result<PathBuf, String> {
    sweep::write_report_points(out, points).map_err(|e| e.to_string())?;
    let images = pdkv_reports::sweep_charts(points, band, out).map_err(|e| e.to_string())?;
    pdkv_reports::page::write_sweep_page(out, points, &images, provenance, command)
        .map_err(|e| format!("cannot write {}: {e}", out.join("index.html").display()))
}

#[cfg(test)]
mod tests {
    use pdkv_sim::calibration::Validation;
    use pdkv_sim::result::{Goodput, Gpus, Steady, Summary};
    use pdkv_sim::scenario::Slo;
    use pdkv_sim::Outcome;

    use super::*;

    fn point(run: &str, per_gpu: f64, goodput: Option<f64>) -> SweepPoint {
        let mut steady = Steady::default();
        steady.throughput.total_tok_s_per_gpu = per_gpu;
        steady.latency_ms.ttft = Some(Summary { mean: 900.0, p50: 800.0, p90: 1200.0, p99: 2500.0 });
        steady.goodput = goodput.map(|g| Goodput {
            slo: Slo { ttft_ms: Some(3000.0), tpot_ms: None },
            requests_per_s: g * 24.0,
            requests_per_s_per_gpu: g,
            met_fraction: 0.9,
        });
        SweepPoint {
            run: run.into(),
            deployment: "2P_TP8:1D_DP8EP".into(),
            concurrency: 128,
            rate_per_s: None,
            gpus: Gpus { prefill: 16, decode: 8 },
            total_tok_s: per_gpu * 24.0,
            ttft_mean_ms: Some(1502.4),
            tpot_mean_ms: None,
            outcome: Outcome::Clean,
            steady,
        }
    }

    /// (points, the calibration's validation error) -> the table's lines: GPUs, steady figures,
    /// goodput with an SLO, ranks and "not separated", and how the ranking reads.
    #[test]
    fn the_table_shows_gpus_steady_figures_and_which_ranks_the_error_cannot_separate() {
        let check = |points: &[SweepPoint], median: f64, expected: &[&str]| {
            let mut calibration = pdkv_sim::calibration::current();
            calibration.validation =
                Some(Validation { points: 8, sources: 3, median_abs_error: median, max_abs_error: 1.5 });
            assert_eq!(table(points, &calibration), expected);
        };
        check(
            &[point("a", 1100.0, None)],
            0.817,
            &["a                        C=128     24 GPUs (16P+8D)       26400 tok/s  TTFT      1502 ms  TPOT    n/a     steady   1100 tok/s/GPU, TTFT p50/p99     800/2500 ms  clean"],
        );
        let two = [point("a", 1100.0, Some(0.05)), point("b", 1000.0, Some(0.1))];
        check(
            &two,
            0.1,
            &[
                "a                        C=128     24 GPUs (16P+8D)       26400 tok/s  TTFT      1502 ms  TPOT    n/a     steady   1100 tok/s/GPU, TTFT p50/p99     800/2500 ms  goodput  0.0500 req/s/GPU  rank 2 of 2  clean",
                "b                        C=128     24 GPUs (16P+8D)       24000 tok/s  TTFT      1502 ms  TPOT    n/a     steady   1000 tok/s/GPU, TTFT p50/p99     800/2500 ms  goodput  0.1000 req/s/GPU  rank 1 of 2  clean",
                "ranked at each load by goodput per GPU; \"not separated\": within ± 10.0 % (the calibration's \
                 validation median |error|) of the rank above, so their error bands overlap and the model does not \
                 rank them",
            ],
        );
        let lines = table(&two, &{
            let mut c = pdkv_sim::calibration::current();
            c.validation =
                Some(Validation { points: 8, sources: 3, median_abs_error: 0.5, max_abs_error: 1.5 });
            c
        });
        assert!(lines[0].ends_with("rank 2 of 2, not separated from 1  clean"), "{lines:?}");
    }
}
