//! `pdkv replay`: rerun the exact scenario and seed recorded in a result and confirm the outcome.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use pdkv_sim::scenario::FORMAT_VERSION;
use pdkv_sim::{RunOptions, RunResult};
use serde::Deserialize;

const EXAMPLES: &str = "\
Examples:
  pdkv run notify-drift --out /tmp/drift
  pdkv replay /tmp/drift/result.json

Exit codes: 0 the rerun has the recorded outcome (and, normally, a byte-identical result);
1 it does not; 2 the file cannot be read or holds no runnable scenario.
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Rerun the scenario and seed stored in a result.json and compare.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct ReplayArgs {
    /// A result.json written by `pdkv run` (or printed by `pdkv run --json`).
    result: PathBuf,
}

pub fn run(args: &ReplayArgs) -> ExitCode {
    let recorded = match read(args) {
        Ok(r) => r,
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let origin = format!("{} (scenario_ron)", args.result.display());
    // The stored scenario gets the same size bound as a scenario file.
    let limit = pdkv_sim::load::MAX_SCENARIO_BYTES;
    if recorded.scenario_ron.len() as u64 > limit {
        errln!("error: {origin}: the scenario is larger than {limit} bytes, the most a scenario may be");
        return ExitCode::from(2);
    }
    let mut scenario = match pdkv_sim::load::parse_scenario(&recorded.scenario_ron, &origin) {
        Ok(s) => s,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    scenario.seed = recorded.seed;
    let mut rerun = match pdkv_sim::run(&scenario, RunOptions::default()) {
        Ok(run) => run.result,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // The label says how the run was asked for (a notation, flags on the command line), which
    // the stored scenario does not hold; it is the recorded run's, not an output to compare.
    rerun.label.clone_from(&recorded.label);
    let identical = rerun.to_json() == recorded.to_json();
    outln!(
        "replayed {}, seed {}: outcome {} (recorded {}){}",
        recorded.title(),
        recorded.seed,
        rerun.outcome.name(),
        recorded.outcome.name(),
        if identical { "; result byte-identical" } else { "; result differs in detail" }
    );
    if rerun.outcome == recorded.outcome {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Largest result file read, in bytes. A day-long run of a large deployment writes tens of
/// megabytes (one NIC utilisation value per prefill GPU per second); the bound keeps
/// `/dev/zero` or a wrong path from filling memory.
const MAX_RESULT_BYTES: u64 = 256 << 20;

fn read(args: &ReplayArgs) -> Result<RunResult, String> {
    let text = pdkv_sim::load::read_capped(&args.result, MAX_RESULT_BYTES)
        .map_err(|e| format!("cannot read {}: {e}", args.result.display()))?;
    let shown = args.result.display();
    // The version is read on its own first, so a result of another format version is named as
    // such instead of failing on whichever field changed shape.
    let header: Header =
        serde_json::from_str(&text).map_err(|e| format!("{shown}: not a pdkv result: {e}"))?;
    if header.version != FORMAT_VERSION {
        return Err(format!(
            "{shown}: result format version {}, but this pdkv reads version {FORMAT_VERSION}; rerun its scenario with `pdkv run`",
            header.version
        ));
    }
    serde_json::from_str(&text).map_err(|e| format!("{shown}: not a pdkv result: {e}"))
}

/// The one field every result format version has.
#[derive(Deserialize)]
struct Header {
    version: u32,
}
