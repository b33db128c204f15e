//! `pdkv explore-merge`: puts the result files of `pdkv explore --shard i/N` runs back together
//! into the file one unsharded run writes (the merge itself is `pdkv_campaign::explore`), and
//! the summary lines `pdkv explore` and the merge print.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use pdkv_campaign::explore::{Clean, Found, Record, Workload};
use pdkv_campaign::names::in_name_order;
use pdkv_sim::Outcome;

const EXAMPLES: &str = "\
Examples:
  pdkv explore-merge out/shard-0.json out/shard-1.json out/shard-2.json --result out/explore.json
  pdkv explore-merge out/shard-*.json

The shard files come from one campaign run as N jobs, e.g. job i of a Slurm array:
  pdkv explore notify-drift-fixed --seeds 6000 --faults swarm --shard i/N --result out/shard-i.json
The merged file is byte for byte the file the unsharded run writes (pdkv explore ... --result
FILE): the smallest failing seed of any shard with its shrunk scenario, or, when no seed broke a
property, the outcomes, distinct behaviours and events of all shards together. The files must
come from one campaign (same scenario, seeds, faults, workload, shrink budget and number of
shards) and hold each shard exactly once. docs/cluster-campaigns.md has the Slurm and
Kubernetes recipes.

Exit codes: 0 no seed broke a property; 1 one did (its seed, the shrunk scenario and the
replay command are printed); 2 bad input (the file at fault is named).
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Merge the result files of a sharded exploration into one.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct ExploreMergeArgs {
    /// The shards' result files (`pdkv explore --shard i/N --result FILE`), one per shard.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Write the merged result here.
    #[arg(long, value_name = "FILE")]
    result: Option<PathBuf>,
    /// Folder for the shrunk scenario file of a failure.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// What a search that broke no property says of its seeds: how many have no verdict on
/// liveness (`incomplete`: their budget cut them while requests were still in flight, so they
/// were judged on safety only).
pub fn verdict(outcomes: &BTreeMap<Outcome, u64>) -> String {
    match outcomes.get(&Outcome::Incomplete).copied().unwrap_or(0) {
        0 => "no property broken".to_string(),
        n => format!(
            "no property broken, but {n} seed{} without a verdict on liveness (incomplete: cut by {} budget \
             while requests were in flight, judged on safety only)",
            if n == 1 { "" } else { "s" },
            if n == 1 { "its" } else { "their" }
        ),
    }
}

/// The summary line of a clean result, without the wall times a merge cannot know.
fn clean_summary(record: &Record, clean: &Clean) -> String {
    let c = &record.campaign;
    let histogram: Vec<String> =
        in_name_order(&clean.outcomes).iter().map(|(o, n)| format!("{} {n}", o.name())).collect();
    format!(
        "explored {} seeds of {} ({} faults, {}), {} events: {}; outcomes: {}; {} distinct behaviours",
        clean.runs,
        c.scenario,
        if c.faults == pdkv_campaign::explore::Faults::Swarm { "swarm" } else { "scenario" },
        if c.workload == Workload::Small { "a small workload per seed" } else { "the full workload" },
        clean.events,
        verdict(&clean.outcomes),
        histogram.join(", "),
        clean.behaviours.len()
    )
}

/// Writes the scenario file of every seed a clean result names to `dir`, and returns the lines
/// that name them with their replay commands, outcome by outcome, with the count of those not
/// listed.
pub fn listed_lines(clean: &Clean, dir: &Path) -> Result<Vec<String>, pdkv_campaign::WriteError> {
    let mut lines = Vec::new();
    for written in clean.write_listed(dir)? {
        let (total, named) = (written.total, written.files.len() as u64);
        let shown = if total > named { format!(", the first {named}") } else { String::new() };
        lines.push(format!(
            "{}: {total} seed{}{shown}:",
            written.outcome.name(),
            if total == 1 { "" } else { "s" }
        ));
        for (seed, file) in &written.files {
            lines.push(format!("  seed {seed}: pdkv run {}", file.display()));
        }
        if total > named {
            lines.push(format!("  and {} more", total - named));
        }
    }
    Ok(lines)
}

pub fn run(args: &ExploreMergeArgs) -> ExitCode {
    let merged = pdkv_campaign::explore::read_shards(&args.files)
        .and_then(|records| Ok((records.len(), pdkv_campaign::explore::merge(&records)?)));
    let (shards, merged) = match merged {
        Ok(merged) => merged,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(file) = &args.result {
        if let Err(message) = merged.write(file) {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    }
    let dir = args.out.clone().unwrap_or_else(|| PathBuf::from("target/pdkv/explore"));
    match &merged.found {
        Found::Clean(clean) => {
            outln!(
                "merged {shards} shard{}: {}",
                if shards == 1 { "" } else { "s" },
                clean_summary(&merged, clean)
            );
            match listed_lines(clean, &dir) {
                Ok(lines) => lines.iter().for_each(|line| outln!("{line}")),
                Err(message) => {
                    errln!("error: {message}");
                    return ExitCode::from(2);
                }
            }
            ExitCode::SUCCESS
        }
        Found::Failure(failure) => {
            let broken: Vec<&str> = failure.broken.iter().map(|p| p.name()).collect();
            outln!(
                "merged {shards} shard{}: seed {} of {} breaks: {}",
                if shards == 1 { "" } else { "s" },
                failure.seed,
                merged.campaign.scenario,
                broken.join(", ")
            );
            let file = match failure.shrunk.write_in(&dir) {
                Ok(file) => file,
                Err(message) => {
                    errln!("error: {message}");
                    return ExitCode::from(2);
                }
            };
            outln!("shrunk:");
            outln!("{}", failure.shrunk.text);
            outln!("replay: pdkv run {}", file.display());
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (incomplete seeds, the verdict).
    #[test]
    fn the_verdict_counts_the_seeds_without_one() {
        let check = |incomplete: u64, expected: &str| {
            let outcomes: BTreeMap<Outcome, u64> =
                [(Outcome::Clean, 5), (Outcome::Incomplete, incomplete)].into();
            assert_eq!(verdict(&outcomes), expected);
        };
        check(0, "no property broken");
        check(
            1,
            "no property broken, but 1 seed without a verdict on liveness (incomplete: cut by its budget while \
             requests were in flight, judged on safety only)",
        );
        check(
            3,
            "no property broken, but 3 seeds without a verdict on liveness (incomplete: cut by their budget while \
             requests were in flight, judged on safety only)",
        );
    }

    /// Each outcome's named seeds are written and listed with their replay commands; past the
    /// ones named, the rest are counted.
    #[test]
    fn named_seeds_are_written_and_listed() {
        let listed = |seed: u64| pdkv_campaign::explore::Listed {
            name: pdkv_campaign::explore::ScenarioName::new(format!("s-seed{seed}")).expect("a file name"),
            seed,
            text: format!("// seed {seed}\n"),
        };
        let clean = Clean {
            behaviours: Default::default(),
            events: 1,
            listed: [(Outcome::Incomplete, vec![listed(0), listed(2)]), (Outcome::Leak, vec![listed(1)])]
                .into(),
            outcomes: [(Outcome::Incomplete, 5), (Outcome::Leak, 1)].into(),
            runs: 6,
        };
        let dir = std::env::temp_dir().join(format!("pdkv-merge-listed-{}", std::process::id()));
        let lines = listed_lines(&clean, &dir).expect("writes");
        let file = |seed: u64| dir.join(format!("s-seed{seed}.ron")).display().to_string();
        assert_eq!(
            lines,
            [
                "incomplete: 5 seeds, the first 2:".to_string(),
                format!("  seed 0: pdkv run {}", file(0)),
                format!("  seed 2: pdkv run {}", file(2)),
                "  and 3 more".to_string(),
                "leak: 1 seed:".to_string(),
                format!("  seed 1: pdkv run {}", file(1)),
            ]
        );
        assert_eq!(std::fs::read_to_string(dir.join("s-seed0.ron")).expect("written"), "// seed 0\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
