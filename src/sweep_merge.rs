//! Sweep shard files (`pdkv sweep --shard i/N`) and `pdkv sweep-merge`, which writes the sweep
//! report from the shards' folders: every file byte for byte what the unsharded sweep writes.
//!
//! A shard file holds, for each of its points, the point's index in the whole grid and the
//! figures the report shows, plus what the report needs besides the points (the command line,
//! each line's hardware, the calibration's summary). The figures are written as Rust prints an
//! `f64` (the shortest text that reads back as the same number) and read back with Rust's own
//! parser, so the merged report's numbers are the unsharded run's to the last bit.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use pdkv_reports::page::Provenance;
use pdkv_reports::SweepPoint;
use serde_json::{json, Value};

use crate::shard::{check_complete, MergeError, Shard};

const FORMAT: &str = "pdkv-sweep-shard/1";

/// The shard file's name in its folder.
pub const FILE: &str = "sweep-shard.json";

const EXAMPLES: &str = "\
Examples:
  pdkv sweep-merge out/shard-0 out/shard-1 --out out/sweep
  pdkv sweep-merge out/shard-*/sweep-shard.json --out out/sweep

The shard folders come from one sweep run as N jobs, e.g. job i of a Slurm array:
  pdkv sweep 1P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 8,16 --shard i/N --out out/shard-i
The report (index.html, sweep.json, charts) is byte for byte the one the unsharded sweep
writes. The shards must come from one sweep (same command line, calibration and number of
shards) and hold each shard exactly once. docs/cluster-campaigns.md has the Slurm and
Kubernetes recipes.

Exit codes: 0 every run had its expected outcome; 1 some did not; 2 bad input (the file at
fault is named).
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Write the report of a sharded sweep from its shards' folders.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct SweepMergeArgs {
    /// The shards' folders (`pdkv sweep --shard i/N --out DIR`) or their sweep-shard.json files.
    #[arg(required = true, value_name = "DIR")]
    shards: Vec<PathBuf>,
    /// Folder of the merged sweep report.
    #[arg(long, value_name = "DIR", required = true)]
    out: PathBuf,
}

/// The results of one shard of a sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardFile {
    /// The sweep's command line, as its report shows it (without --shard, --jobs, --out).
    pub command: String,
    /// The calibration's summary.
    pub calibration: String,
    /// (line, where its hardware and model come from), as the report shows them.
    pub lines: Vec<(String, String)>,
    /// Points of the whole sweep.
    pub points: u64,
    pub shard: Shard,
    /// The shard's points: index in the whole grid, figures, whether the outcome was expected.
    pub results: Vec<(u64, SweepPoint, bool)>,
}

/// An `f64` as text that reads back as the same number.
fn float(v: f64) -> Value {
    Value::String(format!("{v:?}"))
}

impl ShardFile {
    /// The file's text: pretty JSON with sorted keys and a final newline.
    pub fn text(&self) -> String {
        let results: Vec<Value> = self
            .results
            .iter()
            .map(|(index, p, expected)| {
                json!({
                    "index": index,
                    "run": p.run,
                    "deployment": p.deployment,
                    "concurrency": p.concurrency,
                    "total_tok_s": float(p.total_tok_s),
                    "ttft_mean_ms": p.ttft_mean_ms.map(float),
                    "tpot_mean_ms": p.tpot_mean_ms.map(float),
                    "outcome": p.outcome,
                    "as_expected": expected,
                })
            })
            .collect();
        let value = json!({
            "format": FORMAT,
            "command": self.command,
            "calibration": self.calibration,
            "lines": self.lines.iter().map(|(l, h)| json!([l, h])).collect::<Vec<_>>(),
            "points": self.points,
            "shard": self.shard.json(),
            "results": results,
        });
        let mut text = serde_json::to_string_pretty(&value).expect("JSON values serialise");
        text.push('\n');
        text
    }

    /// Writes the file into the folder `dir`, returning its path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, String> {
        let path = dir.join(FILE);
        crate::explore_merge::write(&path, &self.text())?;
        Ok(path)
    }

    /// Reads a shard file's text; the error says what is missing or wrong.
    pub fn parse(text: &str) -> Result<ShardFile, String> {
        let value = crate::shard::json_of(text, FORMAT)?;
        let (string, number) = (crate::shard::string_field, crate::shard::number_field);
        let figure = |v: &Value, name: &str| -> Result<Option<f64>, String> {
            match v.get(name) {
                Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => {
                    s.parse().map(Some).map_err(|_| format!("`{name}` {s:?} is not a number"))
                }
                _ => Err(format!("`{name}` missing or not a number in a string")),
            }
        };
        let mut lines = Vec::new();
        for line in value.get("lines").and_then(Value::as_array).ok_or("`lines` missing")? {
            let pair = line.as_array().filter(|p| p.len() == 2);
            let pair = pair.and_then(|p| Some((p[0].as_str()?.to_string(), p[1].as_str()?.to_string())));
            lines.push(pair.ok_or_else(|| format!("line {line} is not [line, hardware]"))?);
        }
        let mut results = Vec::new();
        for r in value.get("results").and_then(Value::as_array).ok_or("`results` missing")? {
            let concurrency = number(r, "concurrency")?;
            let point = SweepPoint {
                run: string(r, "run")?,
                deployment: string(r, "deployment")?,
                concurrency: u32::try_from(concurrency)
                    .map_err(|_| format!("concurrency {concurrency} too large"))?,
                total_tok_s: figure(r, "total_tok_s")?.ok_or("`total_tok_s` is null")?,
                ttft_mean_ms: figure(r, "ttft_mean_ms")?,
                tpot_mean_ms: figure(r, "tpot_mean_ms")?,
                outcome: string(r, "outcome")?,
            };
            let expected = r.get("as_expected").and_then(Value::as_bool).ok_or("`as_expected` missing")?;
            results.push((number(r, "index")?, point, expected));
        }
        Ok(ShardFile {
            command: string(&value, "command")?,
            calibration: string(&value, "calibration")?,
            lines,
            points: number(&value, "points")?,
            shard: crate::shard::from_json(value.get("shard").ok_or("`shard` missing")?)?,
            results,
        })
    }
}

/// Puts the shards' points back in grid order, checking that the files are every shard of one
/// sweep exactly once and that each holds exactly its own points.
pub fn merge(files: &[(String, ShardFile)]) -> Result<(Vec<SweepPoint>, Vec<bool>), MergeError> {
    let Some((first_file, first)) = files.first() else {
        return Err(MergeError::Missing { shards: vec!["0/1".to_string()] });
    };
    // A file that lies is refused, naming it, before it is compared with any other.
    for (file, shard) in files {
        for (index, point, _) in &shard.results {
            check_point(&shard.lines, point).map_err(|reason| MergeError::Inconsistent {
                file: file.clone(),
                reason: format!("point {index}: {reason}"),
            })?;
        }
    }
    for (file, shard) in files {
        let lines = |s: &ShardFile| format!("{:?}", s.lines);
        let fields = [
            ("the command line", shard.command.clone(), first.command.clone()),
            ("the calibration", shard.calibration.clone(), first.calibration.clone()),
            ("the lines' hardware", lines(shard), lines(first)),
            ("the number of points", shard.points.to_string(), first.points.to_string()),
        ];
        crate::shard::check_same(file, first_file, &fields)?;
    }
    check_complete(&files.iter().map(|(f, s)| (f.clone(), s.shard)).collect::<Vec<_>>())?;
    for (file, shard) in files {
        let share = shard.shard.share(first.points);
        if shard.results.len() as u64 != share {
            return Err(MergeError::Incomplete {
                file: file.clone(),
                reason: format!(
                    "shard {} of {} points has {share} points, but the file holds {}",
                    shard.shard,
                    first.points,
                    shard.results.len()
                ),
            });
        }
    }
    // The shares add up to the points, and each file holds its share: as many slots as the
    // files hold points.
    let mut slots: Vec<Option<(SweepPoint, bool)>> =
        vec![None; files.iter().map(|(_, s)| s.results.len()).sum()];
    for (file, shard) in files {
        let wrong = |reason: String| MergeError::Incomplete { file: file.clone(), reason };
        for (index, point, expected) in &shard.results {
            let slot = slots.get_mut(*index as usize).filter(|_| shard.shard.owns(*index));
            let Some(slot) = slot else {
                return Err(wrong(format!("point {index} is not one of shard {}'s", shard.shard)));
            };
            if slot.is_some() {
                return Err(wrong(format!("point {index} is in the file twice")));
            }
            *slot = Some((point.clone(), *expected));
        }
    }
    // Every shard held its share, without repeats or strangers, so every slot is filled.
    Ok(slots.into_iter().map(|s| s.expect("every point filled")).unzip())
}

/// Checks that a point holds what `pdkv sweep` writes: one of the sweep's lines, a deployment
/// the notation parser accepts, at least one client, a known outcome, figures that are finite
/// and not negative. (Whether a point had its expected outcome cannot be checked here: a
/// scenario may expect any outcome, a historical bug's included.)
fn check_point(lines: &[(String, String)], p: &SweepPoint) -> Result<(), String> {
    if !lines.iter().any(|(line, _)| *line == p.run) {
        return Err(format!(
            "`run` {:?} is none of the sweep's lines",
            p.run.chars().take(80).collect::<String>()
        ));
    }
    pdkv_core::topology::Deployment::parse(&p.deployment)
        .map_err(|e| format!("`deployment` {:?}: {e}", p.deployment.chars().take(80).collect::<String>()))?;
    if p.concurrency == 0 {
        return Err("`concurrency` is 0; a sweep runs at least one client".to_string());
    }
    if !crate::explore_merge::OUTCOMES.iter().any(|o| o.name() == p.outcome) {
        return Err(format!(
            "outcome `{}` is not one pdkv knows",
            p.outcome.chars().take(80).collect::<String>()
        ));
    }
    for (name, value) in [
        ("total_tok_s", Some(p.total_tok_s)),
        ("ttft_mean_ms", p.ttft_mean_ms),
        ("tpot_mean_ms", p.tpot_mean_ms),
    ] {
        if value.is_some_and(|v| !v.is_finite() || v < 0.0) {
            return Err(format!(
                "`{name}` is {}, not a finite figure of at least 0",
                value.unwrap_or_default()
            ));
        }
    }
    Ok(())
}

pub fn run(args: &SweepMergeArgs) -> ExitCode {
    let mut files = Vec::new();
    for given in &args.shards {
        let path = if given.is_dir() { given.join(FILE) } else { given.clone() };
        match crate::shard::read_file(&path, ShardFile::parse) {
            Ok(named) => files.push(named),
            Err(e) => {
                errln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let (points, expected) = match merge(&files) {
        Ok(merged) => merged,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let first = &files[0].1;
    // The report's error band comes from this binary's calibration: it must be the shards'.
    let calibration = pdkv_sim::calibration::current().summary();
    if calibration != first.calibration {
        errln!(
            "error: {}: made with the calibration `{}`, but this pdkv has `{calibration}`; merge with the pdkv that ran the shards",
            files[0].0, first.calibration
        );
        return ExitCode::from(2);
    }
    let provenance = Provenance { lines: first.lines.clone(), calibration };
    crate::sweep_cmd::report(&args.out, &points, &provenance, &first.command, expected.iter().all(|e| *e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_files_read_back_bit_for_bit() {
        let point = |x: f64| SweepPoint {
            run: "a".into(),
            deployment: "1P_TP8:1D_TP8".into(),
            concurrency: 8,
            total_tok_s: x,
            ttft_mean_ms: Some(x / 3.0),
            tpot_mean_ms: None,
            outcome: "clean".into(),
        };
        let file = ShardFile {
            command: "pdkv sweep a".into(),
            calibration: "c".into(),
            lines: vec![("a".into(), "h".into())],
            points: 3,
            shard: Shard { index: 1, count: 2 },
            results: vec![(1, point(0.1 + 0.2), true), (3, point(1e-300 / 7.0), false)],
        };
        let back = ShardFile::parse(&file.text()).expect("parses");
        assert_eq!(back, file);
        for ((_, a, _), (_, b, _)) in back.results.iter().zip(&file.results) {
            assert_eq!(a.total_tok_s.to_bits(), b.total_tok_s.to_bits());
            assert_eq!(a.ttft_mean_ms.map(f64::to_bits), b.ttft_mean_ms.map(f64::to_bits));
        }
    }
}
