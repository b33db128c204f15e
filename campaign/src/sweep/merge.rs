//! The merge of a sweep's shard files into the points of the whole sweep, in grid order, with
//! what its report needs: every file checked first, the file at fault named.

use std::path::Path;

use pdkv_core::topology::Deployment;

use super::shard_file::{PointResult, ShardFile};
use super::SweepPoint;
use crate::coverage::check_complete;
use crate::error::{Inconsistency, MergeError};
use crate::shard::Shard;

/// A merged sweep: what its report shows.
#[derive(Clone, Debug, PartialEq)]
pub struct Merged {
    /// The sweep's command line.
    pub command: String,
    /// The calibration's summary.
    pub calibration: String,
    /// Each line with where its hardware and model come from.
    pub lines: Vec<(String, String)>,
    /// Every point, in grid order.
    pub points: Vec<SweepPoint>,
    /// Whether each point had its expected outcome.
    pub expected: Vec<bool>,
}

/// Reads every shard file (a folder stands for its [`super::FILE`]), in the order given; the
/// first that cannot be read is the error.
pub fn read_shards(paths: &[impl AsRef<Path>]) -> Result<Vec<(String, ShardFile)>, MergeError> {
    paths.iter().map(|path| ShardFile::read(path.as_ref()).map_err(MergeError::from)).collect()
}

/// Puts the shards' points back in grid order, checking that each file holds what a sweep
/// writes, that the files are every shard of one sweep exactly once, that each holds exactly
/// its own points, and that they were made with `calibration` (this build's: the report's error
/// band comes from it).
pub fn merge(files: &[(String, ShardFile)], calibration: &str) -> Result<Merged, MergeError> {
    let Some((first_file, first)) = files.first() else {
        return Err(MergeError::Missing { shards: vec![Shard::WHOLE], more: false });
    };
    // A file that lies is refused, naming it, before it is compared with any other.
    for (file, shard) in files {
        for r in &shard.results {
            check_point(&shard.lines, r).map_err(|reason| MergeError::Inconsistent {
                file: file.clone(),
                reason: Box::new(reason),
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
        crate::error::check_same(file, first_file, &fields)?;
    }
    check_complete(&files.iter().map(|(f, s)| (f.clone(), s.shard)).collect::<Vec<_>>())?;
    for (file, shard) in files {
        let share = shard.shard.share(first.points);
        if shard.results.len() as u64 != share {
            return Err(MergeError::PointsHeld {
                file: file.clone(),
                shard: shard.shard,
                points: first.points,
                share,
                held: shard.results.len() as u64,
            });
        }
    }
    // The shares add up to the points, and each file holds its share: as many slots as the
    // files hold points.
    let mut slots: Vec<Option<(SweepPoint, bool)>> =
        vec![None; files.iter().map(|(_, s)| s.results.len()).sum()];
    for (file, shard) in files {
        for r in &shard.results {
            let slot = slots.get_mut(r.index as usize).filter(|_| shard.shard.owns(r.index));
            let Some(slot) = slot else {
                return Err(MergeError::StrangerPoint {
                    file: file.clone(),
                    index: r.index,
                    shard: shard.shard,
                });
            };
            if slot.is_some() {
                return Err(MergeError::PointTwice { file: file.clone(), index: r.index });
            }
            *slot = Some((r.point.clone(), r.as_expected));
        }
    }
    if first.calibration != calibration {
        return Err(MergeError::Calibration {
            file: first_file.clone(),
            theirs: first.calibration.clone(),
            ours: calibration.to_string(),
        });
    }
    // Every shard held its share, without repeats or strangers, so every slot is filled.
    let (points, expected) = slots.into_iter().map(|s| s.expect("every point filled")).unzip();
    Ok(Merged {
        command: first.command.clone(),
        calibration: first.calibration.clone(),
        lines: first.lines.clone(),
        points,
        expected,
    })
}

/// Checks that a point holds what `pdkv sweep` writes: one of the sweep's lines, a deployment
/// the notation parser accepts, at least one client (its outcome and figures are checked as the
/// file is read). Whether a point had its expected outcome cannot be checked here: a scenario
/// may expect any outcome, a historical bug's included.
fn check_point(lines: &[(String, String)], r: &PointResult) -> Result<(), Inconsistency> {
    let (index, p) = (r.index, &r.point);
    if !lines.iter().any(|(line, _)| *line == p.run) {
        return Err(Inconsistency::StrangerLine { index, run: p.run.clone() });
    }
    Deployment::parse(&p.deployment).map_err(|error| Inconsistency::Deployment {
        index,
        deployment: p.deployment.clone(),
        error,
    })?;
    if p.concurrency == 0 && p.rate_per_s.is_none() {
        return Err(Inconsistency::NoClients { index });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_sim::Outcome;

    fn result(index: u64) -> PointResult {
        let point = SweepPoint {
            run: "a".into(),
            deployment: "1P_TP8:1D_TP8".into(),
            concurrency: 4 + index as u32,
            rate_per_s: None,
            gpus: pdkv_sim::result::Gpus { prefill: 8, decode: 8 },
            total_tok_s: index as f64,
            ttft_mean_ms: None,
            tpot_mean_ms: None,
            outcome: Outcome::Clean,
            steady: pdkv_sim::result::Steady::default(),
        };
        PointResult { index, point, as_expected: index != 2 }
    }

    fn shard(index: u64, results: &[u64]) -> (String, ShardFile) {
        let file = ShardFile {
            command: "pdkv sweep a".into(),
            calibration: "c".into(),
            lines: vec![("a".into(), "h".into())],
            points: 3,
            shard: Shard { index, count: 2 },
            results: results.iter().map(|&i| result(i)).collect(),
        };
        (format!("{index}.json"), file)
    }

    /// (the files, what the merge says: the points' concurrency in order, or the error's
    /// words).
    #[test]
    fn shards_merge_in_grid_order_or_the_file_at_fault_is_named() {
        let check = |files: &[(String, ShardFile)], expected: Result<&[u32], &str>| match (
            merge(files, "c"),
            expected,
        ) {
            (Ok(merged), Ok(want)) => {
                let got: Vec<u32> = merged.points.iter().map(|p| p.concurrency).collect();
                assert_eq!(got, want);
                assert_eq!(merged.expected, [true, true, false]);
            }
            (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{e} lacks {want:?}"),
            (got, _) => panic!("{got:?}, expected {expected:?}"),
        };
        check(&[shard(1, &[1]), shard(0, &[0, 2])], Ok(&[4, 5, 6]));
        check(&[shard(0, &[0, 2])], Err("no file holds shard 1/2"));
        check(
            &[shard(0, &[0]), shard(1, &[1])],
            Err("0.json: shard 0/2 of 3 points has 2 points, but the file holds 1"),
        );
        check(&[shard(0, &[0, 1]), shard(1, &[1])], Err("0.json: point 1 is not one of shard 0/2's"));
        check(&[shard(0, &[0, 0]), shard(1, &[1])], Err("0.json: point 0 is in the file twice"));
        let mut stranger = shard(1, &[1]);
        stranger.1.results[0].point.run = "b".into();
        check(
            &[shard(0, &[0, 2]), stranger],
            Err("1.json: point 1: `run` \"b\" is none of the sweep's lines"),
        );
        let mut nine = shard(1, &[1]);
        nine.1.results[0].point.deployment = "9Q".into();
        check(&[shard(0, &[0, 2]), nine], Err("1.json: point 1: `deployment` \"9Q\""));
        let mut idle = shard(1, &[1]);
        idle.1.results[0].point.concurrency = 0;
        check(&[shard(0, &[0, 2]), idle], Err("1.json: point 1: `concurrency` is 0"));
        let mut other = shard(1, &[1]);
        other.1.command = "pdkv sweep b".into();
        check(
            &[shard(0, &[0, 2]), other],
            Err("1.json: the command line is pdkv sweep b, but in 0.json it is pdkv sweep a"),
        );
        let merged = merge(&[shard(0, &[0, 2]), shard(1, &[1])], "d").expect_err("another calibration");
        assert!(merged.to_string().contains("0.json: made with the calibration `c`, but this pdkv has `d`"));
    }
}
