//! `pdkv sweep-merge`: writes the sweep report from the shards' folders of `pdkv sweep --shard
//! i/N`, every file byte for byte what the unsharded sweep writes (the merge itself is
//! `pdkv_campaign::sweep`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use pdkv_reports::page::Provenance;

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

pub fn run(args: &SweepMergeArgs) -> ExitCode {
    // The report's error band comes from this binary's calibration: it must be the shards'.
    let calibration = pdkv_sim::calibration::current().summary();
    let merged = pdkv_campaign::sweep::read_shards(&args.shards)
        .and_then(|files| pdkv_campaign::sweep::merge(&files, &calibration));
    let merged = match merged {
        Ok(merged) => merged,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let provenance = Provenance { lines: merged.lines, calibration };
    let all_expected = merged.expected.iter().all(|e| *e);
    crate::sweep_cmd::report(&args.out, &merged.points, &provenance, &merged.command, all_expected)
}
