//! Sweep shard files (`pdkv sweep --shard i/N`, `sweep-shard.json` in the shard's folder).
//!
//! A shard file holds, for each of its points, the point's index in the whole grid and the
//! figures the report shows, plus what the report needs besides the points (the command line,
//! each line's hardware, the calibration's summary). The figures are written as Rust prints an
//! `f64` (the shortest text that reads back as the same number) and read back with Rust's own
//! parser, so the merged report's numbers are the unsharded run's to the last bit. The
//! steady-state figures (`steady`, as `result.json` has them) are rounded to three decimals
//! where they are measured, so serde_json writes and reads them back exactly as numbers.
//!
//! Format 2 added each point's GPUs, request rate and steady-state figures; a file of format 1
//! lacks them, and reading one is refused, saying to run the shard again.

use std::path::{Path, PathBuf};

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use pdkv_sim::result::{Gpus, Steady};

use super::SweepPoint;
use crate::files::{ReadError, WriteError};
use crate::shard::Shard;

/// The format's name and version.
pub const FORMAT: &str = "pdkv-sweep-shard/2";

/// The shard file's name in its folder.
pub const FILE: &str = "sweep-shard.json";

/// One point of a shard: its index in the whole grid, its figures, and whether its outcome was
/// the one expected.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(into = "ResultEntry", from = "ResultEntry")]
pub struct PointResult {
    pub index: u64,
    pub point: SweepPoint,
    pub as_expected: bool,
}

/// A point as the file lists it: one flat object, keys in sorted order, figures as text.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultEntry {
    as_expected: bool,
    concurrency: u32,
    deployment: String,
    gpus: Gpus,
    index: u64,
    #[serde(with = "crate::names::outcome")]
    outcome: pdkv_sim::Outcome,
    #[serde(serialize_with = "optional_figure", deserialize_with = "rate_per_s")]
    rate_per_s: Option<f64>,
    run: String,
    #[serde(deserialize_with = "steady")]
    steady: Steady,
    #[serde(serialize_with = "figure", deserialize_with = "total_tok_s")]
    total_tok_s: f64,
    #[serde(serialize_with = "optional_figure", deserialize_with = "tpot_mean_ms")]
    tpot_mean_ms: Option<f64>,
    #[serde(serialize_with = "optional_figure", deserialize_with = "ttft_mean_ms")]
    ttft_mean_ms: Option<f64>,
}

impl From<PointResult> for ResultEntry {
    fn from(r: PointResult) -> ResultEntry {
        let p = r.point;
        ResultEntry {
            as_expected: r.as_expected,
            concurrency: p.concurrency,
            deployment: p.deployment,
            gpus: p.gpus,
            index: r.index,
            outcome: p.outcome,
            rate_per_s: p.rate_per_s,
            run: p.run,
            steady: p.steady,
            total_tok_s: p.total_tok_s,
            tpot_mean_ms: p.tpot_mean_ms,
            ttft_mean_ms: p.ttft_mean_ms,
        }
    }
}

impl From<ResultEntry> for PointResult {
    fn from(e: ResultEntry) -> PointResult {
        let point = SweepPoint {
            run: e.run,
            deployment: e.deployment,
            concurrency: e.concurrency,
            rate_per_s: e.rate_per_s,
            gpus: e.gpus,
            total_tok_s: e.total_tok_s,
            ttft_mean_ms: e.ttft_mean_ms,
            tpot_mean_ms: e.tpot_mean_ms,
            outcome: e.outcome,
            steady: e.steady,
        };
        PointResult { index: e.index, point, as_expected: e.as_expected }
    }
}

/// An `f64` as text that reads back as the same number.
fn figure<S: Serializer>(v: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format!("{v:?}"))
}

fn optional_figure<S: Serializer>(v: &Option<f64>, serializer: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => figure(v, serializer),
        None => serializer.serialize_none(),
    }
}

/// A figure of the field `name`: a number in a string, finite and not negative, as a sweep
/// writes it (`None` for null, where the field may be).
fn read_figure<'de, D: Deserializer<'de>>(
    deserializer: D,
    name: &str,
    nullable: bool,
) -> Result<Option<f64>, D::Error> {
    let Some(text) = Option::<String>::deserialize(deserializer)? else {
        return if nullable { Ok(None) } else { Err(D::Error::custom(format!("`{name}` is null"))) };
    };
    let v: f64 = text.parse().map_err(|_| D::Error::custom(format!("`{name}` {text:?} is not a number")))?;
    if !v.is_finite() || v < 0.0 {
        return Err(D::Error::custom(format!("`{name}` is {v}, not a finite figure of at least 0")));
    }
    Ok(Some(v))
}

fn total_tok_s<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(read_figure(deserializer, "total_tok_s", false)?.unwrap_or_default())
}

fn ttft_mean_ms<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<f64>, D::Error> {
    read_figure(deserializer, "ttft_mean_ms", true)
}

/// The steady-state figures as a sweep writes them: read as `result.json`'s type, which takes
/// unknown fields and defaults missing ones for old results, so the text is also checked to be
/// exactly what that value writes back (no field pdkv never writes, none left out).
fn steady<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Steady, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    let steady: Steady =
        serde_json::from_value(value.clone()).map_err(|e| D::Error::custom(format!("`steady`: {e}")))?;
    if serde_json::to_value(&steady).ok().as_ref() != Some(&value) {
        return Err(D::Error::custom(
            "`steady` is not as pdkv writes it (a field added, left out or changed)",
        ));
    }
    Ok(steady)
}

fn rate_per_s<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<f64>, D::Error> {
    read_figure(deserializer, "rate_per_s", true)
}

fn tpot_mean_ms<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<f64>, D::Error> {
    read_figure(deserializer, "tpot_mean_ms", true)
}

/// The lines as the file lists them, each a pair `[line, hardware]`; anything else is named.
fn lines<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<(String, String)>, D::Error> {
    Vec::<Vec<String>>::deserialize(deserializer)?
        .into_iter()
        .map(|pair| match <[String; 2]>::try_from(pair) {
            Ok([line, hardware]) => Ok((line, hardware)),
            Err(other) => {
                let shown: String = format!("{other:?}").chars().take(160).collect();
                Err(D::Error::custom(format!("line {shown} is not [line, hardware]")))
            }
        })
        .collect()
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
    /// The shard's points, in grid order.
    pub results: Vec<PointResult>,
}

/// The file as it is on disk, keys in sorted order.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDisk {
    calibration: String,
    command: String,
    format: String,
    #[serde(deserialize_with = "lines")]
    lines: Vec<(String, String)>,
    points: u64,
    results: Vec<PointResult>,
    shard: Shard,
}

impl ShardFile {
    /// The file's text: pretty JSON with sorted keys and a final newline.
    pub fn text(&self) -> String {
        let s = self.clone();
        crate::files::text(&OnDisk {
            calibration: s.calibration,
            command: s.command,
            format: FORMAT.to_string(),
            lines: s.lines,
            points: s.points,
            results: s.results,
            shard: s.shard,
        })
    }

    /// Reads a shard file's text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<ShardFile, ReadError> {
        let d: OnDisk = crate::files::parse(text, FORMAT, file)?;
        Ok(ShardFile {
            command: d.command,
            calibration: d.calibration,
            lines: d.lines,
            points: d.points,
            shard: d.shard,
            results: d.results,
        })
    }

    /// Reads the shard file at `path`, or in the folder `path`; returns the file's name as
    /// messages show it.
    pub fn read(path: &Path) -> Result<(String, ShardFile), ReadError> {
        let path = if path.is_dir() { path.join(FILE) } else { path.to_path_buf() };
        let (name, text) = crate::files::read_text(&path)?;
        let file = ShardFile::parse(&text, &name)?;
        Ok((name, file))
    }

    /// Writes the file into the folder `dir`, returning its path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, WriteError> {
        let path = dir.join(FILE);
        crate::files::write(&path, &self.text())?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_sim::Outcome;

    fn point(x: f64) -> SweepPoint {
        SweepPoint {
            run: "a".into(),
            deployment: "1P_TP8:1D_TP8".into(),
            concurrency: 8,
            rate_per_s: None,
            gpus: Gpus { prefill: 16, decode: 8 },
            total_tok_s: x,
            ttft_mean_ms: Some(x / 3.0),
            tpot_mean_ms: None,
            outcome: Outcome::Clean,
            steady: Steady::default(),
        }
    }

    fn file() -> ShardFile {
        ShardFile {
            command: "pdkv sweep a".into(),
            calibration: "c".into(),
            lines: vec![("a".into(), "h".into())],
            points: 3,
            shard: Shard { index: 1, count: 2 },
            results: vec![
                PointResult { index: 1, point: point(0.1 + 0.2), as_expected: true },
                PointResult {
                    index: 3,
                    point: SweepPoint { rate_per_s: Some(0.1 + 0.7), concurrency: 0, ..point(1e-300 / 7.0) },
                    as_expected: false,
                },
            ],
        }
    }

    #[test]
    fn shard_files_read_back_bit_for_bit() {
        let file = file();
        let back = ShardFile::parse(&file.text(), "s.json").expect("parses");
        assert_eq!(back, file);
        for (a, b) in back.results.iter().zip(&file.results) {
            assert_eq!(a.point.total_tok_s.to_bits(), b.point.total_tok_s.to_bits());
            assert_eq!(a.point.ttft_mean_ms.map(f64::to_bits), b.point.ttft_mean_ms.map(f64::to_bits));
        }
    }

    /// The file as `pdkv sweep --shard` writes it: these bytes are the format (version 2).
    #[test]
    fn a_shard_file_is_written_as_the_format_says() {
        let mut file = file();
        file.results.truncate(1);
        let expected = r#"{
  "calibration": "c",
  "command": "pdkv sweep a",
  "format": "pdkv-sweep-shard/2",
  "lines": [
    [
      "a",
      "h"
    ]
  ],
  "points": 3,
  "results": [
    {
      "as_expected": true,
      "concurrency": 8,
      "deployment": "1P_TP8:1D_TP8",
      "gpus": {
        "prefill": 16,
        "decode": 8
      },
      "index": 1,
      "outcome": "clean",
      "rate_per_s": null,
      "run": "a",
      "steady": {
        "window": {
          "kind": "steady",
          "warmup_requests": 0,
          "drain_requests": 0,
          "requests": 0,
          "start_s": 0.0,
          "end_s": 0.0
        },
        "latency_ms": {
          "ttft": null,
          "tpot": null,
          "itl": null,
          "e2e": null
        },
        "throughput": {
          "requests_per_s": 0.0,
          "input_tok_s": 0.0,
          "output_tok_s": 0.0,
          "total_tok_s": 0.0,
          "requests_per_s_per_gpu": 0.0,
          "total_tok_s_per_gpu": 0.0,
          "output_tok_s_per_gpu": 0.0,
          "input_tok_s_per_prefill_gpu": 0.0,
          "output_tok_s_per_decode_gpu": 0.0
        }
      },
      "total_tok_s": "0.30000000000000004",
      "tpot_mean_ms": null,
      "ttft_mean_ms": "0.10000000000000002"
    }
  ],
  "shard": {
    "count": 2,
    "index": 1
  }
}
"#;
        assert_eq!(file.text(), expected);
    }

    /// A file of the first format (no GPUs, rate or steady figures) is refused by name.
    #[test]
    fn a_shard_file_of_format_1_is_refused_saying_to_run_it_again() {
        let old = file().text().replace(FORMAT, "pdkv-sweep-shard/1");
        let e = ShardFile::parse(&old, "s.json").expect_err("format 1").to_string();
        assert_eq!(
            e,
            "s.json: written by another version of pdkv: `format` is \"pdkv-sweep-shard/1\", and this pdkv \
             reads \"pdkv-sweep-shard/2\" only (its fields differ); run that shard again with this pdkv"
        );
    }

    /// (what is changed in a good file, the error's words).
    #[test]
    fn fields_pdkv_never_writes_are_refused_as_the_file_is_read() {
        let good = file().text();
        let check = |from: &str, to: &str, words: &str| {
            assert!(good.contains(from), "{from}");
            let e = ShardFile::parse(&good.replacen(from, to, 1), "s.json").expect_err(to).to_string();
            assert!(e.starts_with("s.json: ") && e.contains(words), "{to}: {e} lacks {words:?}");
        };
        check(r#""outcome": "clean""#, r#""outcome": "banana""#, "outcome `banana` is not one pdkv knows");
        check(
            r#""total_tok_s": "0.30000000000000004""#,
            r#""total_tok_s": "NaN""#,
            "`total_tok_s` is NaN, not a finite",
        );
        check(
            r#""total_tok_s": "0.30000000000000004""#,
            r#""total_tok_s": "-1""#,
            "`total_tok_s` is -1, not a finite",
        );
        check(
            r#""total_tok_s": "0.30000000000000004""#,
            r#""total_tok_s": "fast""#,
            "`total_tok_s` \"fast\" is not a number",
        );
        check(r#""total_tok_s": "0.30000000000000004""#, r#""total_tok_s": null"#, "`total_tok_s` is null");
        check(
            r#""ttft_mean_ms": "0.10000000000000002""#,
            r#""ttft_mean_ms": "inf""#,
            "`ttft_mean_ms` is inf",
        );
        check(r#""tpot_mean_ms": null,"#, "", "missing field `tpot_mean_ms`");
        check(r#""start_s": 0.0,"#, r#""start_s": 0.0, "was": 1,"#, "`steady` is not as pdkv writes it");
        check(r#""requests": 0,"#, "", "`steady`: missing field `requests`");
        // A missing `Option` would read as `None`: the check back against the text refuses it.
        check(r#""itl": null,"#, "", "`steady` is not as pdkv writes it");
        check(r#""kind": "steady""#, r#""kind": "fast""#, "`steady`: unknown variant `fast`");
        check(r#""as_expected": true,"#, r#""as_expected": true, "was": 1,"#, "unknown field `was`");
        check(r#""concurrency": 8"#, r#""concurrency": 5000000000"#, "expected u32");
        check(
            r#""a",
      "h""#,
            r#""a""#,
            "line [\"a\"] is not [line, hardware]",
        );
        check(
            r#""h"
    ]"#,
            r#""h", "x"
    ]"#,
            "line [\"a\", \"h\", \"x\"] is not [line, hardware]",
        );
    }
}
