//! Sweeps: a grid of runs (one line per scenario or notation, one point per concurrency level
//! or request rate), run on threads in grid order whatever the thread timing, a shard's share of
//! the points, the shard files and their merge, the ranking of lines at each load against the
//! model's stated error, and the points file of the report (`sweep.json`).

mod merge;
mod rank;
mod shard_file;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use pdkv_sim::load::Violation;
use pdkv_sim::result::{Gpus, Steady};
use pdkv_sim::scenario::{Clients, Hardware, ModelProfile, Scenario};
use pdkv_sim::{RunIdentity, RunOptions, RunResult, SimError};
use serde::Serialize;

use crate::files::WriteError;
use crate::shard::Shard;

pub use merge::{merge, read_shards, Merged};
pub use pdkv_sim::result::SweepPoint;
pub use rank::{not_separated, rank, Rank, RankedBy};
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
    /// Clients of a closed loop; 0 in a rate sweep.
    pub concurrency: u32,
    /// Arrivals per second of an open loop in a rate sweep.
    pub rate_per_s: Option<f64>,
}

impl GridPoint {
    /// The load as progress and the table write it: `C=128` or `R=2.5/s`.
    pub fn load_label(&self) -> String {
        match self.rate_per_s {
            Some(rate) => format!("R={rate}/s"),
            None => format!("C={}", self.concurrency),
        }
    }
}

/// What a sweep varies along its x axis.
#[derive(Clone, Debug, PartialEq)]
pub enum Load {
    /// A closed loop of C clients at each level, C x `requests_per_client` requests.
    Concurrency { levels: Vec<u32>, requests_per_client: u32 },
    /// An open loop of Poisson arrivals at each rate (per second), as a scenario's open-loop
    /// workload runs; `requests` in all, or the line's own request count when `None`.
    Rate { rates: Vec<f64>, requests: Option<u32> },
}

/// A sweep: its lines and its load levels.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep {
    pub lines: Vec<Line>,
    pub load: Load,
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
    /// A concurrency sweep was given a scenario whose workload is an open loop: replacing its
    /// arrivals by a closed loop would measure another workload than the one it names.
    OpenLoopInConcurrencySweep { spec: String, rate_per_s: f64 },
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
            SweepError::OpenLoopInConcurrencySweep { spec, rate_per_s } => write!(
                f,
                "{spec}: its workload is an open loop (Poisson arrivals at {rate_per_s} per second), \
                 which a concurrency sweep would silently turn into a closed loop of C clients; \
                 sweep it by request rate instead (--rate {rate_per_s},...)"
            ),
        }
    }
}

impl std::error::Error for SweepError {}

impl Sweep {
    /// A concurrency sweep without lines yet.
    pub fn new(concurrency: Vec<u32>, requests_per_client: u32) -> Sweep {
        Sweep { lines: Vec::new(), load: Load::Concurrency { levels: concurrency, requests_per_client } }
    }

    /// A request-rate sweep without lines yet: `requests` per point, or each line's own count.
    pub fn rates(rates: Vec<f64>, requests: Option<u32>) -> Sweep {
        Sweep { lines: Vec::new(), load: Load::Rate { rates, requests } }
    }

    /// Adds the line of `base` (loaded from `spec`, a notation when `notation` says so), with
    /// `seed` if given; a line whose label is already in the sweep is refused, and so is an
    /// open-loop scenario in a concurrency sweep (a rate sweep replaces a closed loop by Poisson
    /// arrivals at each rate, keeping its request count unless the sweep gives one).
    pub fn add_line(
        &mut self,
        spec: &str,
        base: &Scenario,
        notation: Option<&str>,
        seed: Option<u64>,
    ) -> Result<(), SweepError> {
        if let (Load::Concurrency { .. }, Clients::Open { rate_per_s, .. }) =
            (&self.load, base.workload.clients)
        {
            return Err(SweepError::OpenLoopInConcurrencySweep { spec: spec.to_string(), rate_per_s });
        }
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
            // Each level as (clients, the flags that set them, concurrency, rate).
            let levels: Vec<(Clients, String, u32, Option<f64>)> = match &self.load {
                Load::Concurrency { levels, requests_per_client } => levels
                    .iter()
                    .map(|&c| {
                        let clients = Clients::Closed {
                            concurrency: c,
                            requests: c.saturating_mul(*requests_per_client),
                        };
                        (
                            clients,
                            format!("--concurrency {c} --requests-per-client {requests_per_client}"),
                            c,
                            None,
                        )
                    })
                    .collect(),
                Load::Rate { rates, requests } => {
                    let own = match line.scenario.workload.clients {
                        Clients::Closed { requests, .. } | Clients::Open { requests, .. } => requests,
                    };
                    let n = requests.unwrap_or(own);
                    rates
                        .iter()
                        .map(|&rate_per_s| {
                            let clients = Clients::Open { rate_per_s, requests: n };
                            (clients, format!("--rate {rate_per_s} --requests {n}"), 0, Some(rate_per_s))
                        })
                        .collect()
                }
            };
            for (clients, flags, concurrency, rate_per_s) in levels {
                let mut s = line.scenario.clone();
                s.workload.clients = clients;
                pdkv_sim::load::validate(&s).map_err(|violation| SweepError::Point {
                    flags,
                    scenario: s.name.clone(),
                    violation,
                })?;
                grid.push(GridPoint { scenario: s, label: line.label.clone(), concurrency, rate_per_s });
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
        match &self.load {
            Load::Concurrency { levels, requests_per_client } => {
                let levels: Vec<String> = levels.iter().map(u32::to_string).collect();
                parts.push(format!("C{}", levels.join("-")));
                if *requests_per_client != 10 {
                    parts.push(format!("x{requests_per_client} per client"));
                }
            }
            Load::Rate { rates, requests } => {
                let rates: Vec<String> = rates.iter().map(f64::to_string).collect();
                parts.push(format!("R{}", rates.join("-")));
                if let Some(n) = requests {
                    parts.push(format!("x{n}"));
                }
            }
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

/// The sweep's command line as its report shows it (without --shard, --jobs, --out);
/// `measure` holds the measurement flags as given (`--warmup 100`, `--slo-ttft-ms 2000`).
pub fn command(specs: &[String], load: &Load, seed: Option<u64>, measure: &[String]) -> String {
    let mut cmd = match load {
        Load::Concurrency { levels, requests_per_client } => {
            let list: Vec<String> = levels.iter().map(u32::to_string).collect();
            format!(
                "pdkv sweep {} --concurrency {} --requests-per-client {requests_per_client}",
                specs.join(" "),
                list.join(",")
            )
        }
        Load::Rate { rates, requests } => {
            let list: Vec<String> = rates.iter().map(f64::to_string).collect();
            let mut cmd = format!("pdkv sweep {} --rate {}", specs.join(" "), list.join(","));
            if let Some(n) = requests {
                cmd.push_str(&format!(" --requests {n}"));
            }
            cmd
        }
    };
    if let Some(seed) = seed {
        cmd.push_str(&format!(" --seed {seed}"));
    }
    for flag in measure {
        cmd.push(' ');
        cmd.push_str(flag);
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
    /// The point's line and load.
    pub label: &'a str,
    pub point: &'a GridPoint,
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
                    progress(Progress { done: n, total, label: &point.label, point });
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
            rate_per_s: p.rate_per_s,
            gpus: result.gpus,
            total_tok_s: result.throughput.total_tok_s,
            ttft_mean_ms: result.latency_ms.ttft.map(|t| t.mean),
            tpot_mean_ms: result.latency_ms.tpot.map(|t| t.mean),
            outcome: result.outcome,
            steady: result.steady.clone(),
        };
        points.push(PointResult { index, point, as_expected: result.outcome == result.expected });
    }
    Ok(points)
}

/// A point as the report's `sweep.json` lists it, keys in sorted order. The keys of the first
/// sweeps keep their meaning (`concurrency` is null in a rate sweep); `gpus`, `rate_per_s` and
/// `steady` (the run's steady-state figures, as `result.json` has them) came later.
#[derive(Serialize)]
struct ReportPoint<'a> {
    concurrency: Option<u32>,
    deployment: &'a str,
    gpus: ReportGpus,
    outcome: &'static str,
    rate_per_s: Option<f64>,
    run: &'a str,
    steady: &'a Steady,
    total_tok_s: f64,
    tpot_mean_ms: Option<f64>,
    ttft_mean_ms: Option<f64>,
}

/// A layout's GPUs as `sweep.json` lists them.
#[derive(Serialize)]
struct ReportGpus {
    decode: u32,
    prefill: u32,
    total: u32,
}

impl From<Gpus> for ReportGpus {
    fn from(g: Gpus) -> ReportGpus {
        ReportGpus { decode: g.decode, prefill: g.prefill, total: g.total() }
    }
}

/// The name of the report's points file in its folder.
pub const REPORT_FILE: &str = "sweep.json";

/// Writes the report's points file, [`REPORT_FILE`], into `out` (creating it), returning its
/// path.
pub fn write_report_points(out: &Path, points: &[SweepPoint]) -> Result<PathBuf, WriteError> {
    let listed: Vec<ReportPoint<'_>> = points
        .iter()
        .map(|p| ReportPoint {
            concurrency: p.rate_per_s.is_none().then_some(p.concurrency),
            deployment: &p.deployment,
            gpus: p.gpus.into(),
            outcome: p.outcome.name(),
            rate_per_s: p.rate_per_s,
            run: &p.run,
            steady: &p.steady,
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
            rate_per_s: None,
            gpus: Gpus { prefill: 8, decode: 8 },
            total_tok_s: 0.1 + 0.2,
            ttft_mean_ms: ttft,
            tpot_mean_ms: None,
            outcome,
            steady: Steady::default(),
        }
    }

    /// The keys the first sweeps wrote keep their values, one line each as they always were;
    /// `gpus`, `rate_per_s` and `steady` are added beside them.
    #[test]
    fn the_report_points_file_keeps_its_old_keys_and_adds_gpus_rate_and_steady() {
        let dir = std::env::temp_dir().join(format!("pdkv-campaign-report-{}", std::process::id()));
        let mut rate = point(Outcome::Clean, None);
        rate.rate_per_s = Some(2.5);
        rate.concurrency = 0;
        let file =
            write_report_points(&dir, &[point(Outcome::FailedRequests, Some(2.5)), rate]).expect("writes");
        let text = std::fs::read_to_string(&file).expect("written");
        for line in [
            "[\n  {\n    \"concurrency\": 8,\n    \"deployment\": \"1P_TP8:1D_TP8\",\n",
            "\n    \"outcome\": \"failed_requests\",\n",
            "\n    \"run\": \"a\",\n",
            "\n    \"total_tok_s\": 0.30000000000000004,\n    \"tpot_mean_ms\": null,\n    \"ttft_mean_ms\": 2.5\n  },",
        ] {
            assert!(text.contains(line), "{line:?} is not in {text}");
        }
        assert!(text.ends_with("]"), "no final newline, as always");
        let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(json[0]["gpus"], serde_json::json!({"decode": 8, "prefill": 8, "total": 16}));
        assert_eq!(
            (&json[0]["rate_per_s"], &json[1]["rate_per_s"]),
            (&serde_json::Value::Null, &serde_json::json!(2.5))
        );
        assert_eq!(json[1]["concurrency"], serde_json::Value::Null, "a rate sweep has no concurrency");
        assert_eq!(json[0]["steady"]["window"]["kind"], "steady");
        assert!(json[0]["steady"]["throughput"]["total_tok_s_per_gpu"].is_number());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// (lines by notation, concurrency, requests per client, what the sweep says: the grid's
    /// points as "label@C", or the error's words).
    #[test]
    fn grids_are_built_or_refused_before_anything_runs() {
        let check =
            |specs: &[&str], concurrency: &[u32], per_client: u32, expected: Result<&[&str], &str>| {
                check_sweep(Sweep::new(concurrency.to_vec(), per_client), specs, expected);
            };
        check(
            &["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP"],
            &[4, 8],
            2,
            Ok(&["1P_TP8:1D_TP8@C=4", "1P_TP8:1D_TP8@C=8", "2P_TP8:1D_DP8EP@C=4", "2P_TP8:1D_DP8EP@C=8"]),
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
        // An open loop is refused by a concurrency sweep, and swept by rate; a closed loop in a
        // rate sweep becomes Poisson arrivals with its own request count (1,280 for a notation).
        check(&["open:1P_TP8:1D_TP8"], &[4], 2, Err("open:1P_TP8:1D_TP8: its workload is an open loop (Poisson arrivals at 3 per second), which a concurrency sweep would silently turn into a closed loop"));
        check_sweep(
            Sweep::rates(vec![0.5, 2.0], None),
            &["1P_TP8:1D_TP8", "open:1P_TP8:1D_TP8"],
            Ok(&[
                "1P_TP8:1D_TP8@R=0.5/s x1280",
                "1P_TP8:1D_TP8@R=2/s x1280",
                "1P_TP8:1D_TP8, open@R=0.5/s x50",
                "1P_TP8:1D_TP8, open@R=2/s x50",
            ]),
        );
        check_sweep(Sweep::rates(vec![1.0], Some(7)), &["1P_TP8:1D_TP8"], Ok(&["1P_TP8:1D_TP8@R=1/s x7"]));
        check_sweep(
            Sweep::rates(vec![1.0], Some(4_000_000_000)),
            &["1P_TP8:1D_TP8"],
            Err("--rate 1 --requests 4000000000: "),
        );
    }

    /// Builds `sweep` with a line per spec (a notation, or `open:` and a notation for its open
    /// loop of 50 requests at 3 per second) and checks its grid, as "label@load xN", or the
    /// error's words.
    fn check_sweep(mut sweep: Sweep, specs: &[&str], expected: Result<&[&str], &str>) {
        {
            let got = specs
                .iter()
                .try_for_each(|spec| {
                    let (notation, open) = match spec.strip_prefix("open:") {
                        Some(notation) => (notation, true),
                        None => (*spec, false),
                    };
                    let mut base = Scenario::from_notation(notation);
                    if open {
                        base.name = format!("{notation}, open");
                        base.workload.clients = Clients::Open { rate_per_s: 3.0, requests: 50 };
                    }
                    sweep.add_line(spec, &base, (!open).then_some(notation), None)
                })
                .and_then(|()| sweep.grid());
            let requests = |p: &GridPoint| match p.scenario.workload.clients {
                Clients::Closed { requests, .. } | Clients::Open { requests, .. } => requests,
            };
            match (got, expected) {
                (Ok(grid), Ok(want)) => {
                    let names: Vec<String> = grid
                        .iter()
                        .map(|p| match p.rate_per_s {
                            Some(_) => format!("{}@{} x{}", p.label, p.load_label(), requests(p)),
                            None => format!("{}@{}", p.label, p.load_label()),
                        })
                        .collect();
                    assert_eq!(names, want, "{specs:?}");
                }
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{specs:?}: {e} lacks {want:?}"),
                (got, _) => panic!("{specs:?}: {got:?}, expected {expected:?}"),
            }
        }
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
            command(
                &["a".into(), "b".into()],
                &Load::Concurrency { levels: vec![2, 4], requests_per_client: 1 },
                Some(7),
                &[]
            ),
            "pdkv sweep a b --concurrency 2,4 --requests-per-client 1 --seed 7"
        );
        let rates = Load::Rate { rates: vec![0.5, 2.0], requests: Some(300) };
        assert_eq!(
            command(&["a".into()], &rates, None, &["--slo-ttft-ms 2000".into()]),
            "pdkv sweep a --rate 0.5,2 --requests 300 --slo-ttft-ms 2000"
        );
        let mut sweep = Sweep::rates(vec![0.5, 2.0], None);
        sweep
            .add_line("1P_TP8:1D_TP8", &Scenario::from_notation("1P_TP8:1D_TP8"), Some("1P_TP8:1D_TP8"), None)
            .expect("a line");
        assert_eq!(sweep.default_folder(), PathBuf::from("target/pdkv/sweep_1P_TP8-1D_TP8_R0.5-2"));
    }
}
