//! Sweeps: a grid of runs (one line per scenario or notation, one point per concurrency level),
//! run on threads in grid order whatever the thread timing, a shard's share of the points, the
//! shard files and their merge, and the points file of the report (`sweep.json`).

mod merge;
mod shard_file;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use pdkv_sim::load::Violation;
use pdkv_sim::scenario::{Clients, Hardware, ModelProfile, Scenario};
use pdkv_sim::{RunIdentity, RunOptions, RunResult, SimError};
use serde::Serialize;

use crate::files::WriteError;
use crate::shard::Shard;

pub use merge::{merge, read_shards, Merged};
pub use pdkv_sim::result::SweepPoint;
pub use shard_file::{PointResult, ShardFile, FILE, FORMAT};

/// One line of a sweep: a scenario, and its label (its identity without the workload, which the
/// sweep sets; concurrency is the charts' x axis).
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub scenario: Scenario,
    pub label: String,
}

/// One point of the grid: its line's scenario with the sweep's workload.
#[derive(Clone, Debug, PartialEq)]
pub struct GridPoint {
    pub scenario: Scenario,
    pub label: String,
    pub concurrency: u32,
}

/// A sweep: its lines, its concurrency levels and its requests per client.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep {
    pub lines: Vec<Line>,
    pub concurrency: Vec<u32>,
    pub requests_per_client: u32,
}

/// Why a sweep cannot run.
#[derive(Clone, Debug, PartialEq)]
pub enum SweepError {
    /// Two lines are one scenario.
    Twice { spec: String, label: String },
    /// A point's scenario breaks a rule of the format (a workload too large, say).
    Point { flags: String, scenario: String, violation: Violation },
    /// A point could not run.
    Run { scenario: String, error: SimError },
}

impl fmt::Display for SweepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SweepError::Twice { spec, label } => {
                write!(f, "{spec}: {label} is in the sweep twice; each line is one scenario or notation")
            }
            SweepError::Point { flags, scenario, violation } => {
                write!(f, "{flags}: {} (scenario {scenario}, field `{}`)", violation.message, violation.field)
            }
            SweepError::Run { scenario, error } => write!(f, "{scenario}: {error}"),
        }
    }
}

impl std::error::Error for SweepError {}

impl Sweep {
    /// A sweep without lines yet.
    pub fn new(concurrency: Vec<u32>, requests_per_client: u32) -> Sweep {
        Sweep { lines: Vec::new(), concurrency, requests_per_client }
    }

    /// Adds the line of `base` (loaded from `spec`, a notation when `notation` says so), with
    /// `seed` if given; a line whose label is already in the sweep is refused.
    pub fn add_line(
        &mut self,
        spec: &str,
        base: &Scenario,
        notation: Option<&str>,
        seed: Option<u64>,
    ) -> Result<(), SweepError> {
        let mut scenario = base.clone();
        if let Some(seed) = seed {
            scenario.seed = seed;
        }
        let mut identity = RunIdentity::new(base, &scenario, notation);
        identity.workload = None;
        let label = identity.label();
        if self.lines.iter().any(|line| line.label == label) {
            return Err(SweepError::Twice { spec: spec.to_string(), label });
        }
        self.lines.push(Line { scenario, label });
        Ok(())
    }

    /// Every point, by line then concurrency, each built and checked before any runs, so a bad
    /// flag fails at once.
    pub fn grid(&self) -> Result<Vec<GridPoint>, SweepError> {
        let mut grid = Vec::new();
        for line in &self.lines {
            for &c in &self.concurrency {
                let mut s = line.scenario.clone();
                s.workload.clients =
                    Clients::Closed { concurrency: c, requests: c.saturating_mul(self.requests_per_client) };
                pdkv_sim::load::validate(&s).map_err(|violation| SweepError::Point {
                    flags: format!("--concurrency {c} --requests-per-client {}", self.requests_per_client),
                    scenario: s.name.clone(),
                    violation,
                })?;
                grid.push(GridPoint { scenario: s, label: line.label.clone(), concurrency: c });
            }
        }
        Ok(grid)
    }

    /// The sweep's own folder: its lines, its concurrency levels and, when not the usual ten,
    /// its requests per client, e.g.
    /// `target/pdkv/sweep_proxy-aliasing_proxy-aliasing-fixed_C8-16`.
    pub fn default_folder(&self) -> PathBuf {
        let mut parts = vec!["sweep".to_string()];
        parts.extend(self.lines.iter().map(|line| line.label.clone()));
        let levels: Vec<String> = self.concurrency.iter().map(u32::to_string).collect();
        parts.push(format!("C{}", levels.join("-")));
        if self.requests_per_client != 10 {
            parts.push(format!("x{} per client", self.requests_per_client));
        }
        PathBuf::from("target/pdkv").join(pdkv_sim::identity::slug(&parts.join(", ")))
    }

    /// A shard's folder when none is given: the sweep's, with `_shard-i-of-N`.
    pub fn default_shard_folder(&self, shard: Shard) -> PathBuf {
        PathBuf::from(format!("{}_shard-{}-of-{}", self.default_folder().display(), shard.index, shard.count))
    }

    /// Each line with where its hardware and model come from, as the report shows them.
    pub fn sources(&self) -> Vec<(String, String)> {
        self.lines.iter().map(|line| (line.label.clone(), hardware(&line.scenario))).collect()
    }
}

/// The sweep's command line as its report shows it (without --shard, --jobs, --out).
pub fn command(specs: &[String], concurrency: &[u32], requests_per_client: u32, seed: Option<u64>) -> String {
    let list: Vec<String> = concurrency.iter().map(u32::to_string).collect();
    let mut cmd = format!(
        "pdkv sweep {} --concurrency {} --requests-per-client {requests_per_client}",
        specs.join(" "),
        list.join(",")
    );
    if let Some(seed) = seed {
        cmd.push_str(&format!(" --seed {seed}"));
    }
    cmd
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

/// A point about to run.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    /// Points run so far.
    pub done: u64,
    /// Points to run.
    pub total: u64,
    /// The point's line and concurrency.
    pub label: &'a str,
    pub concurrency: u32,
}

/// Runs the shard's points of `grid` on `jobs` threads (each run single-threaded and
/// deterministic, so a point's result does not depend on the thread that ran it) and returns
/// them in grid order, each with its index in the whole grid and whether it had its expected
/// outcome. `progress` is told of each point before it runs. Points are handed out in order;
/// after a point fails to run no further point starts, and the error is the first failure in
/// grid order, whatever the thread timing.
pub fn run(
    grid: &[GridPoint],
    shard: Shard,
    jobs: usize,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Result<Vec<PointResult>, SweepError> {
    let owned: Vec<(u64, &GridPoint)> =
        grid.iter().enumerate().map(|(i, p)| (i as u64, p)).filter(|(i, _)| shard.owns(*i)).collect();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<RunResult, SimError>>>> = Mutex::new(vec![None; owned.len()]);
    let total = owned.len() as u64;
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(owned.len()) {
            scope.spawn(|| {
                while !failed.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some((_, point)) = owned.get(i) else { break };
                    let n = done.load(Ordering::SeqCst) as u64;
                    progress(Progress {
                        done: n,
                        total,
                        label: &point.label,
                        concurrency: point.concurrency,
                    });
                    let result = pdkv_sim::run(&point.scenario, RunOptions::default()).map(|run| run.result);
                    failed.fetch_or(result.is_err(), Ordering::SeqCst);
                    results.lock().expect("no panics while held")[i] = Some(result);
                    done.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    let results = results.into_inner().expect("threads ended");
    let mut points = Vec::new();
    for ((index, p), result) in owned.into_iter().zip(results) {
        let result = match result {
            Some(Ok(result)) => result,
            Some(Err(error)) => return Err(SweepError::Run { scenario: p.scenario.name.clone(), error }),
            None => unreachable!("a point is left unrun only after an earlier one failed"),
        };
        // The sweep replaces the workload, so only the outcome is compared: a scenario's
        // NIC-balance bounds belong to its own request count.
        let point = SweepPoint {
            run: p.label.clone(),
            deployment: p.scenario.deployment.clone(),
            concurrency: p.concurrency,
            total_tok_s: result.throughput.total_tok_s,
            ttft_mean_ms: result.latency_ms.ttft.map(|t| t.mean),
            tpot_mean_ms: result.latency_ms.tpot.map(|t| t.mean),
            outcome: result.outcome,
        };
        points.push(PointResult { index, point, as_expected: result.outcome == result.expected });
    }
    Ok(points)
}

/// A point as the report's `sweep.json` lists it, keys in sorted order.
#[derive(Serialize)]
struct ReportPoint<'a> {
    concurrency: u32,
    deployment: &'a str,
    outcome: &'static str,
    run: &'a str,
    total_tok_s: f64,
    tpot_mean_ms: Option<f64>,
    ttft_mean_ms: Option<f64>,
}

/// The name of the report's points file in its folder.
pub const REPORT_FILE: &str = "sweep.json";

/// Writes the report's points file, [`REPORT_FILE`], into `out` (creating it), returning its
/// path.
pub fn write_report_points(out: &Path, points: &[SweepPoint]) -> Result<PathBuf, WriteError> {
    let listed: Vec<ReportPoint<'_>> = points
        .iter()
        .map(|p| ReportPoint {
            concurrency: p.concurrency,
            deployment: &p.deployment,
            outcome: p.outcome.name(),
            run: &p.run,
            total_tok_s: p.total_tok_s,
            tpot_mean_ms: p.tpot_mean_ms,
            ttft_mean_ms: p.ttft_mean_ms,
        })
        .collect();
    let file = out.join(REPORT_FILE);
    // No final newline: the file has always ended with its closing bracket.
    let text = serde_json::to_string_pretty(&listed).expect("points have string keys only");
    crate::files::write(&file, &text)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use pdkv_sim::Outcome;

    use super::*;

    fn point(outcome: Outcome, ttft: Option<f64>) -> SweepPoint {
        SweepPoint {
            run: "a".into(),
            deployment: "1P_TP8:1D_TP8".into(),
            concurrency: 8,
            total_tok_s: 0.1 + 0.2,
            ttft_mean_ms: ttft,
            tpot_mean_ms: None,
            outcome,
        }
    }

    #[test]
    fn the_report_points_file_is_as_it_always_was() {
        let dir = std::env::temp_dir().join(format!("pdkv-campaign-report-{}", std::process::id()));
        let file = write_report_points(&dir, &[point(Outcome::FailedRequests, Some(2.5))]).expect("writes");
        let expected = r#"[
  {
    "concurrency": 8,
    "deployment": "1P_TP8:1D_TP8",
    "outcome": "failed_requests",
    "run": "a",
    "total_tok_s": 0.30000000000000004,
    "tpot_mean_ms": null,
    "ttft_mean_ms": 2.5
  }
]"#;
        assert_eq!(std::fs::read_to_string(&file).expect("written"), expected);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// (lines by notation, concurrency, requests per client, what the sweep says: the grid's
    /// points as "label@C", or the error's words).
    #[test]
    fn grids_are_built_or_refused_before_anything_runs() {
        let check = |specs: &[&str],
                     concurrency: &[u32],
                     per_client: u32,
                     expected: Result<&[&str], &str>| {
            let mut sweep = Sweep::new(concurrency.to_vec(), per_client);
            let got = specs
                .iter()
                .try_for_each(|spec| sweep.add_line(spec, &Scenario::from_notation(spec), Some(spec), None))
                .and_then(|()| sweep.grid());
            match (got, expected) {
                (Ok(grid), Ok(want)) => {
                    let names: Vec<String> =
                        grid.iter().map(|p| format!("{}@{}", p.label, p.concurrency)).collect();
                    assert_eq!(names, want, "{specs:?}");
                }
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{specs:?}: {e} lacks {want:?}"),
                (got, _) => panic!("{specs:?}: {got:?}, expected {expected:?}"),
            }
        };
        check(
            &["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP"],
            &[4, 8],
            2,
            Ok(&["1P_TP8:1D_TP8@4", "1P_TP8:1D_TP8@8", "2P_TP8:1D_DP8EP@4", "2P_TP8:1D_DP8EP@8"]),
        );
        check(
            &["1P_TP8:1D_TP8", "1P_TP8:1D_TP8"],
            &[4],
            2,
            Err("1P_TP8:1D_TP8: 1P_TP8:1D_TP8 is in the sweep twice"),
        );
        check(
            &["1P_TP8:1D_TP8"],
            &[100_000],
            4_000_000_000,
            Err("--concurrency 100000 --requests-per-client 4000000000: "),
        );
    }

    #[test]
    fn the_default_folders_name_the_sweep() {
        let mut sweep = Sweep::new(vec![2, 4], 1);
        for spec in ["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP"] {
            sweep.add_line(spec, &Scenario::from_notation(spec), Some(spec), None).expect("a line");
        }
        assert_eq!(
            sweep.default_folder(),
            PathBuf::from("target/pdkv/sweep_1P_TP8-1D_TP8_2P_TP8-1D_DP8EP_C2-4_x1-per-client")
        );
        assert_eq!(
            sweep.default_shard_folder(Shard { index: 1, count: 2 }),
            PathBuf::from("target/pdkv/sweep_1P_TP8-1D_TP8_2P_TP8-1D_DP8EP_C2-4_x1-per-client_shard-1-of-2")
        );
        assert_eq!(
            command(&["a".into(), "b".into()], &[2, 4], 1, Some(7)),
            "pdkv sweep a b --concurrency 2,4 --requests-per-client 1 --seed 7"
        );
    }
}
