//! Exploration result files (`pdkv explore --result FILE`) and `pdkv explore-merge`, which puts
//! the result files of `--shard i/N` runs back together into the file one unsharded run writes.
//!
//! A result file holds only what does not depend on the machine or the thread timing: the
//! campaign (scenario, its fingerprint, seeds, faults, workload, shrink budget), and then either
//! the smallest failing seed with what it broke and its shrunk scenario, or, when no seed broke
//! a property, the outcome histogram, the distinct behaviours themselves (so a merge can take
//! their union) and the event total. How many seeds ran before a failure stopped the search
//! depends on the threads, so a failure's file does not say.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use serde_json::{json, Value};

use pdkv_sim::explore::Property;
use pdkv_sim::Outcome;

use crate::shard::{check_complete, MergeError, Shard};

/// Every outcome a run can have, to check the names a file gives.
pub(crate) const OUTCOMES: [Outcome; 6] = [
    Outcome::Clean,
    Outcome::Incomplete,
    Outcome::Leak,
    Outcome::FailedRequests,
    Outcome::Hang,
    Outcome::SafetyViolation,
];

/// Every property an exploration checks, to check the names a file gives.
const PROPERTIES: [Property; 7] = [
    Property::Safety,
    Property::ListenerExists,
    Property::NoHang,
    Property::EveryRequestEnds,
    Property::FreedByReleases,
    Property::FailuresExcused,
    Property::Balanced,
];

/// The format's name and version: 2 added the seeds of every outcome but `clean`
/// (`found.clean.listed`).
const FORMAT: &str = "pdkv-explore-result/2";

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

/// The campaign a result belongs to: what must be the same in every shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Campaign {
    /// The scenario's name.
    pub scenario: String,
    /// A hash of the whole scenario (after workload flags), so two files of one name but
    /// different contents are not merged.
    pub fingerprint: String,
    /// First seed.
    pub from: u64,
    /// How many seeds.
    pub seeds: u64,
    /// `none` or `swarm`.
    pub faults: String,
    /// `small` (a workload drawn per seed) or `full` (the scenario's own).
    pub workload: String,
    /// Runs the shrinker may spend.
    pub shrink_budget: u64,
}

/// What an exploration found, in the part that is the same on any machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// No seed broke a property.
    Clean {
        /// Seeds run.
        runs: u64,
        /// Events of all seeds.
        events: u64,
        /// Outcome names and how many seeds had each.
        outcomes: BTreeMap<String, u64>,
        /// Distinct behaviours: requests finished and failed, events, outcome.
        behaviours: BTreeSet<(u64, u64, u64, String)>,
        /// For every outcome but `clean`, its smallest seeds (at most
        /// [`pdkv_sim::explore::SEEDS_LISTED_PER_OUTCOME`]) as scenario files.
        listed: BTreeMap<String, Vec<Listed>>,
    },
    /// The smallest failing seed.
    Failure {
        seed: u64,
        /// The properties it broke, by name.
        broken: Vec<String>,
        /// The shrunk scenario's name and its file's text.
        shrunk_name: String,
        shrunk_text: String,
    },
}

/// A seed an exploration names, with the scenario file that replays it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Listed {
    pub seed: u64,
    /// The scenario's name (its file is `<name>.ron`).
    pub name: String,
    /// The file's text.
    pub text: String,
}

/// A scenario name that is a file name in the output folder, or why not.
fn file_name(name: String) -> Result<String, String> {
    if name.is_empty() || name.starts_with('.') || name.contains(['/', '\\']) {
        return Err(format!("the scenario name {name:?} is not a file name"));
    }
    Ok(name)
}

/// One result file: a whole exploration, or one shard of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub campaign: Campaign,
    pub shard: Option<Shard>,
    pub found: Found,
}

/// A stable 64-bit FNV-1a hash of `text`, as 16 hex digits.
pub fn fingerprint(text: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

impl Record {
    /// The file's text: pretty JSON with sorted keys and a final newline, so equal records are
    /// equal bytes.
    pub fn text(&self) -> String {
        let c = &self.campaign;
        let mut value = json!({
            "format": FORMAT,
            "scenario": c.scenario,
            "fingerprint": c.fingerprint,
            "from": c.from,
            "seeds": c.seeds,
            "faults": c.faults,
            "workload": c.workload,
            "shrink_budget": c.shrink_budget,
        });
        if let Some(shard) = self.shard {
            value["shard"] = shard.json();
        }
        value["found"] = match &self.found {
            Found::Clean { runs, events, outcomes, behaviours, listed } => json!({
                "clean": {
                    "runs": runs,
                    "events": events,
                    "outcomes": outcomes,
                    // One line each: "finished failed events outcome".
                    "behaviours": behaviours.iter().map(|(a, b, e, o)| format!("{a} {b} {e} {o}")).collect::<Vec<_>>(),
                    "listed": listed.iter().map(|(outcome, seeds)| {
                        let seeds: Vec<Value> = seeds
                            .iter()
                            .map(|l| json!({ "seed": l.seed, "name": l.name, "text": l.text }))
                            .collect();
                        (outcome.clone(), Value::Array(seeds))
                    }).collect::<serde_json::Map<String, Value>>(),
                }
            }),
            Found::Failure { seed, broken, shrunk_name, shrunk_text } => json!({
                "failure": { "seed": seed, "broken": broken, "shrunk": { "name": shrunk_name, "text": shrunk_text } }
            }),
        };
        let mut text = serde_json::to_string_pretty(&value).expect("JSON values serialise");
        text.push('\n');
        text
    }

    /// Reads a record from a file's text; the error says what is missing or wrong.
    pub fn parse(text: &str) -> Result<Record, String> {
        let value = crate::shard::json_of(text, FORMAT)?;
        let (string, number) = (crate::shard::string_field, crate::shard::number_field);
        let campaign = Campaign {
            scenario: string(&value, "scenario")?,
            fingerprint: string(&value, "fingerprint")?,
            from: number(&value, "from")?,
            seeds: number(&value, "seeds")?,
            faults: string(&value, "faults")?,
            workload: string(&value, "workload")?,
            shrink_budget: number(&value, "shrink_budget")?,
        };
        let shard = value.get("shard").map(crate::shard::from_json).transpose()?;
        let found = value.get("found").ok_or("`found` missing")?;
        let found = if let Some(clean) = found.get("clean") {
            let mut outcomes = BTreeMap::new();
            for (name, n) in clean.get("outcomes").and_then(Value::as_object).ok_or("`outcomes` missing")? {
                outcomes.insert(
                    name.clone(),
                    n.as_u64().ok_or_else(|| format!("outcome `{name}` is not a count"))?,
                );
            }
            let mut behaviours = BTreeSet::new();
            for b in clean.get("behaviours").and_then(Value::as_array).ok_or("`behaviours` missing")? {
                let parts: Vec<&str> = b.as_str().unwrap_or_default().split(' ').collect();
                let key = match parts[..] {
                    [a, f, e, o] => {
                        a.parse().ok().zip(f.parse().ok()).zip(e.parse().ok()).map(|((a, f), e)| (a, f, e, o))
                    }
                    _ => None,
                };
                let (a, f, e, o) =
                    key.ok_or_else(|| format!("behaviour {b} is not \"finished failed events outcome\""))?;
                behaviours.insert((a, f, e, o.to_string()));
            }
            let mut listed = BTreeMap::new();
            for (outcome, seeds) in
                clean.get("listed").and_then(Value::as_object).ok_or("`listed` missing")?
            {
                let seeds = seeds.as_array().ok_or_else(|| format!("`listed.{outcome}` is not a list"))?;
                let mut read = Vec::new();
                for l in seeds {
                    read.push(Listed {
                        seed: number(l, "seed")?,
                        name: file_name(string(l, "name")?)?,
                        text: string(l, "text")?,
                    });
                }
                listed.insert(outcome.clone(), read);
            }
            Found::Clean {
                runs: number(clean, "runs")?,
                events: number(clean, "events")?,
                outcomes,
                behaviours,
                listed,
            }
        } else if let Some(failure) = found.get("failure") {
            let broken = failure.get("broken").and_then(Value::as_array).ok_or("`broken` missing")?;
            let broken: Option<Vec<String>> = broken.iter().map(|p| p.as_str().map(str::to_string)).collect();
            let shrunk = failure.get("shrunk").ok_or("`shrunk` missing")?;
            // The name becomes a file name in the merge's folder.
            let shrunk_name = file_name(string(shrunk, "name")?)?;
            Found::Failure {
                seed: number(failure, "seed")?,
                broken: broken.ok_or("`broken` is not a list of property names")?,
                shrunk_name,
                shrunk_text: string(shrunk, "text")?,
            }
        } else {
            return Err("`found` is neither `clean` nor `failure`".to_string());
        };
        Ok(Record { campaign, shard, found })
    }

    /// Checks that what the record claims holds together, as a file `pdkv explore` wrote would:
    /// counts that add up, only known outcome and property names, no outcome that breaks a
    /// property in a result that says none was broken, seeds that belong to the shard, and
    /// scenario texts that the loader of `pdkv run` accepts (`file` names them in its errors).
    /// A merge trusts nothing else, so a file that was edited or forged is refused here,
    /// not merged into a verdict it does not support.
    pub fn check(&self, file: &str) -> Result<(), String> {
        let c = &self.campaign;
        if !["none", "swarm"].contains(&c.faults.as_str()) {
            return Err(format!("`faults` is {:?}, not \"none\" or \"swarm\"", c.faults));
        }
        if !["small", "full"].contains(&c.workload.as_str()) {
            return Err(format!("`workload` is {:?}, not \"small\" or \"full\"", c.workload));
        }
        let shard = self.shard.unwrap_or(Shard::WHOLE);
        // A seed the record names must be one of its shard's seeds.
        let owned = |seed: u64, what: &str| -> Result<(), String> {
            let position = seed.checked_sub(c.from).filter(|p| *p < c.seeds);
            match position {
                Some(p) if shard.owns(p) => Ok(()),
                _ => Err(format!(
                    "{what} is seed {seed}, which is not one of shard {shard}'s seeds of {} from {}",
                    c.seeds, c.from
                )),
            }
        };
        let scenario = |text: &str, what: &str| -> Result<(), String> {
            let limit = pdkv_sim::load::MAX_SCENARIO_BYTES;
            if text.len() as u64 > limit {
                return Err(format!(
                    "{what} is {} bytes, larger than {limit} bytes, the most a scenario may be",
                    text.len()
                ));
            }
            pdkv_sim::load::parse_scenario(text, &format!("{file} ({what})"))
                .map(|_| ())
                .map_err(|e| format!("{what} is not a scenario pdkv run accepts: {e}"))
        };
        match &self.found {
            Found::Clean { runs, events, outcomes, behaviours, listed } => {
                for (name, n) in outcomes {
                    let Some(outcome) = OUTCOMES.iter().find(|o| o.name() == name) else {
                        return Err(format!("outcome `{name}` is not one pdkv knows"));
                    };
                    if *n > 0 && !matches!(outcome, Outcome::Clean | Outcome::Incomplete) {
                        return Err(format!(
                            "{n} seed{} had outcome `{name}`, which breaks a property, yet the file records no \
                             failure (`found.clean`)",
                            if *n == 1 { "" } else { "s" }
                        ));
                    }
                }
                let total = outcomes.values().try_fold(0u64, |sum, n| sum.checked_add(*n));
                if total != Some(*runs) {
                    let total = total.map_or("more than 2^64".to_string(), |t| t.to_string());
                    return Err(format!("the outcome counts add up to {total}, but `runs` is {runs}"));
                }
                if behaviours.len() as u64 > *runs {
                    return Err(format!("{} distinct behaviours from {runs} seeds", behaviours.len()));
                }
                for (finished, failed, e, outcome) in behaviours {
                    if outcomes.get(outcome).copied().unwrap_or(0) == 0 {
                        return Err(format!(
                            "behaviour \"{finished} {failed} {e} {outcome}\" has an outcome no seed had"
                        ));
                    }
                    if e > events {
                        return Err(format!(
                            "behaviour \"{finished} {failed} {e} {outcome}\" has more events than all seeds ({events})"
                        ));
                    }
                }
                for (outcome, seeds) in listed {
                    let total = outcomes.get(outcome).copied().unwrap_or(0);
                    let most = total.min(pdkv_sim::explore::SEEDS_LISTED_PER_OUTCOME as u64);
                    if outcome == Outcome::Clean.name() || seeds.len() as u64 > most {
                        return Err(format!(
                            "`listed.{outcome}` names {} seeds, but at most {most} of that outcome are listed",
                            seeds.len()
                        ));
                    }
                    let mut seen = BTreeSet::new();
                    for l in seeds {
                        let what = format!("listed.{outcome} seed {}", l.seed);
                        owned(l.seed, &what)?;
                        if !seen.insert(l.seed) {
                            return Err(format!("{what} is listed twice"));
                        }
                        scenario(&l.text, &what)?;
                    }
                }
            }
            Found::Failure { seed, broken, shrunk_text, .. } => {
                owned(*seed, "the failure")?;
                if broken.is_empty() {
                    return Err("the failure breaks no property (`broken` is empty)".to_string());
                }
                let mut seen = BTreeSet::new();
                for name in broken {
                    if !PROPERTIES.iter().any(|p| p.name() == name) {
                        let known: Vec<&str> = PROPERTIES.iter().map(|p| p.name()).collect();
                        return Err(format!(
                            "`broken` names {name:?}, which is not a property (they are {})",
                            known.join(", ")
                        ));
                    }
                    if !seen.insert(name) {
                        return Err(format!("`broken` names {name:?} twice"));
                    }
                }
                scenario(shrunk_text, "the shrunk scenario")?;
            }
        }
        Ok(())
    }

    /// The summary line of a clean result, without the wall times a merge cannot know.
    pub fn clean_summary(&self) -> Option<String> {
        let Found::Clean { runs, events, outcomes, behaviours, .. } = &self.found else { return None };
        let c = &self.campaign;
        let histogram: Vec<String> = outcomes.iter().map(|(name, n)| format!("{name} {n}")).collect();
        Some(format!(
            "explored {runs} seeds of {} ({} faults, {}), {events} events: {}; outcomes: {}; {} distinct behaviours",
            c.scenario,
            if c.faults == "swarm" { "swarm" } else { "scenario" },
            if c.workload == "small" { "a small workload per seed" } else { "the full workload" },
            verdict(outcomes),
            histogram.join(", "),
            behaviours.len()
        ))
    }
}

/// What a search that broke no property says of its seeds: how many have no verdict on
/// liveness (`incomplete`: their budget cut them while requests were still in flight, so they
/// were judged on safety only).
pub fn verdict<N: AsRef<str>>(outcomes: &BTreeMap<N, u64>) -> String {
    let unjudged: u64 =
        outcomes.iter().filter(|(name, _)| name.as_ref() == Outcome::Incomplete.name()).map(|(_, n)| n).sum();
    match unjudged {
        0 => "no property broken".to_string(),
        n => format!(
            "no property broken, but {n} seed{} without a verdict on liveness (incomplete: cut by {} budget \
             while requests were in flight, judged on safety only)",
            if n == 1 { "" } else { "s" },
            if n == 1 { "its" } else { "their" }
        ),
    }
}

/// Writes the scenario file of every listed seed to `dir`, and returns the lines that name them
/// with their replay commands, outcome by outcome, with the count of those not listed.
pub fn write_listed(
    listed: &BTreeMap<String, Vec<Listed>>,
    outcomes: &BTreeMap<String, u64>,
    dir: &Path,
) -> Result<Vec<String>, String> {
    let mut lines = Vec::new();
    for (outcome, seeds) in listed {
        let total = outcomes.get(outcome).copied().unwrap_or(0);
        let shown =
            if total > seeds.len() as u64 { format!(", the first {}", seeds.len()) } else { String::new() };
        lines.push(format!("{outcome}: {total} seed{}{shown}:", if total == 1 { "" } else { "s" }));
        for l in seeds {
            let file = dir.join(format!("{}.ron", l.name));
            write(&file, &l.text)?;
            lines.push(format!("  seed {}: pdkv run {}", l.seed, file.display()));
        }
        if total > seeds.len() as u64 {
            lines.push(format!("  and {} more", total - seeds.len() as u64));
        }
    }
    Ok(lines)
}

/// Merges the records of every shard of one campaign (each file's name and record) into the
/// record the unsharded exploration writes.
pub fn merge(records: &[(String, Record)]) -> Result<Record, MergeError> {
    let Some((first_file, first)) = records.first() else {
        return Err(MergeError::Missing { shards: vec!["0/1".to_string()] });
    };
    let mut shards = Vec::new();
    for (file, record) in records {
        let Some(shard) = record.shard else { return Err(MergeError::NotAShard { file: file.clone() }) };
        let (a, b) = (&record.campaign, &first.campaign);
        let fields = [
            ("the scenario", a.scenario.clone(), b.scenario.clone()),
            ("the scenario's fingerprint", a.fingerprint.clone(), b.fingerprint.clone()),
            ("the first seed (--from)", a.from.to_string(), b.from.to_string()),
            ("the number of seeds (--seeds)", a.seeds.to_string(), b.seeds.to_string()),
            ("the faults (--faults)", a.faults.clone(), b.faults.clone()),
            ("the workload", a.workload.clone(), b.workload.clone()),
            ("the shrink budget (--shrink-budget)", a.shrink_budget.to_string(), b.shrink_budget.to_string()),
        ];
        crate::shard::check_same(file, first_file, &fields)?;
        shards.push((file.clone(), shard));
    }
    check_complete(&shards)?;
    let campaign = first.campaign.clone();
    // The smallest failing seed of any shard is the smallest of all: each shard reports its
    // own smallest, and the shards split the seeds between them.
    let failure = records
        .iter()
        .filter_map(|(_, r)| match &r.found {
            Found::Failure { seed, .. } => Some((*seed, r.found.clone())),
            Found::Clean { .. } => None,
        })
        .min_by_key(|(seed, _)| *seed);
    if let Some((_, found)) = failure {
        return Ok(Record { campaign, shard: None, found });
    }
    let (mut runs, mut events) = (0u64, 0u64);
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut behaviours = BTreeSet::new();
    let mut listed: BTreeMap<String, Vec<Listed>> = BTreeMap::new();
    for (file, record) in records {
        let Found::Clean { runs: r, events: e, outcomes: o, behaviours: b, listed: l } = &record.found else {
            unreachable!("a failure returned above")
        };
        let shard = record.shard.expect("checked above");
        let share = shard.share(campaign.seeds);
        if *r != share {
            return Err(MergeError::Incomplete {
                file: file.clone(),
                reason: format!(
                    "shard {shard} of {} seeds has {share} seeds, but the file says {r} ran",
                    campaign.seeds
                ),
            });
        }
        runs += r;
        events = events.saturating_add(*e);
        for (name, n) in o {
            *outcomes.entry(name.clone()).or_default() += n;
        }
        behaviours.extend(b.iter().cloned());
        for (outcome, seeds) in l {
            listed.entry(outcome.clone()).or_default().extend(seeds.iter().cloned());
        }
    }
    // Each shard lists its own smallest seeds of each outcome, so the smallest of their union
    // are the smallest of all.
    for seeds in listed.values_mut() {
        seeds.sort();
        seeds.truncate(pdkv_sim::explore::SEEDS_LISTED_PER_OUTCOME);
    }
    let found = Found::Clean { runs, events, outcomes, behaviours, listed };
    Ok(Record { campaign, shard: None, found })
}

/// Writes `text` to `file` whole or not at all ([`pdkv_sim::files::write_atomic`]), creating its
/// folder.
pub fn write(file: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    pdkv_sim::files::write_atomic(file, text.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", file.display()))
}

pub fn run(args: &ExploreMergeArgs) -> ExitCode {
    let mut records = Vec::new();
    for file in &args.files {
        let checked = crate::shard::read_file(file, Record::parse).and_then(|(name, record)| {
            match record.check(&name) {
                Ok(()) => Ok((name, record)),
                Err(reason) => Err(MergeError::Inconsistent { file: name, reason }),
            }
        });
        match checked {
            Ok(named) => records.push(named),
            Err(e) => {
                errln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let merged = match merge(&records) {
        Ok(merged) => merged,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(file) = &args.result {
        if let Err(message) = write(file, &merged.text()) {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    }
    let shards = records.len();
    match &merged.found {
        Found::Clean { listed, outcomes, .. } => {
            outln!(
                "merged {shards} shard{}: {}",
                if shards == 1 { "" } else { "s" },
                merged.clean_summary().unwrap_or_default()
            );
            let dir = args.out.clone().unwrap_or_else(|| PathBuf::from("target/pdkv/explore"));
            match write_listed(listed, outcomes, &dir) {
                Ok(lines) => lines.iter().for_each(|line| outln!("{line}")),
                Err(message) => {
                    errln!("error: {message}");
                    return ExitCode::from(2);
                }
            }
            ExitCode::SUCCESS
        }
        Found::Failure { seed, broken, shrunk_name, shrunk_text } => {
            outln!(
                "merged {shards} shard{}: seed {seed} of {} breaks: {}",
                if shards == 1 { "" } else { "s" },
                merged.campaign.scenario,
                broken.join(", ")
            );
            let dir = args.out.clone().unwrap_or_else(|| PathBuf::from("target/pdkv/explore"));
            let file = dir.join(format!("{shrunk_name}.ron"));
            if let Err(message) = write(&file, shrunk_text) {
                errln!("error: {message}");
                return ExitCode::from(2);
            }
            outln!("shrunk:");
            outln!("{shrunk_text}");
            outln!("replay: pdkv run {}", file.display());
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn campaign() -> Campaign {
        Campaign {
            scenario: "s".into(),
            fingerprint: fingerprint("s"),
            from: 3,
            seeds: 10,
            faults: "swarm".into(),
            workload: "small".into(),
            shrink_budget: 300,
        }
    }

    #[test]
    fn records_read_back_as_written() {
        let clean = Found::Clean {
            runs: 4,
            events: 99,
            outcomes: [("clean".to_string(), 3), ("incomplete".to_string(), 1)].into(),
            behaviours: [(1, 0, 40, "clean".to_string()), (0, 2, 59, "incomplete".to_string())].into(),
            listed: [("incomplete".to_string(), vec![listed(2)])].into(),
        };
        let failure = Found::Failure {
            seed: 7,
            broken: vec!["safety".into(), "no-hang".into()],
            shrunk_name: "s-seed7-shrunk".into(),
            shrunk_text: "// header\n(name: \"s-seed7-shrunk\")\n".into(),
        };
        for found in [clean, failure] {
            for shard in [None, Some(Shard { index: 1, count: 3 })] {
                let record = Record { campaign: campaign(), shard, found: found.clone() };
                assert_eq!(Record::parse(&record.text()), Ok(record.clone()));
            }
        }
    }

    #[test]
    fn the_smallest_failing_seed_of_any_shard_wins() {
        let shard = |index, found| {
            (
                format!("{index}.json"),
                Record { campaign: campaign(), shard: Some(Shard { index, count: 3 }), found },
            )
        };
        let failure = |seed| Found::Failure {
            seed,
            broken: vec!["safety".into()],
            shrunk_name: format!("n{seed}"),
            shrunk_text: String::new(),
        };
        let clean = Found::Clean {
            runs: 3,
            events: 1,
            outcomes: BTreeMap::new(),
            behaviours: BTreeSet::new(),
            listed: BTreeMap::new(),
        };
        let merged = merge(&[shard(0, clean), shard(1, failure(11)), shard(2, failure(5))]).expect("merges");
        assert_eq!(merged.shard, None);
        assert!(matches!(merged.found, Found::Failure { seed: 5, .. }), "{merged:?}");
    }

    fn listed(seed: u64) -> Listed {
        Listed { seed, name: format!("s-seed{seed}"), text: format!("// seed {seed}\n") }
    }

    /// Each shard names its own smallest seeds of an outcome; the merge names the smallest of
    /// all, as many as one unsharded run does, and counts the rest.
    #[test]
    fn the_merge_names_the_smallest_seeds_of_each_outcome() {
        let n = pdkv_sim::explore::SEEDS_LISTED_PER_OUTCOME as u64;
        // Shard i of 2 holds the seeds i, i + 2, ...: 3n incomplete seeds of 6n, n listed each.
        let shard = |index: u64| {
            let seeds: Vec<Listed> = (0..n).map(|k| listed(index + 2 * k)).collect();
            let found = Found::Clean {
                runs: 3 * n,
                events: 1,
                outcomes: [("incomplete".to_string(), 3 * n / 2 + index)].into(),
                behaviours: BTreeSet::new(),
                listed: [("incomplete".to_string(), seeds)].into(),
            };
            let campaign = Campaign { seeds: 6 * n, ..campaign() };
            (format!("{index}.json"), Record { campaign, shard: Some(Shard { index, count: 2 }), found })
        };
        let merged = merge(&[shard(1), shard(0)]).expect("merges");
        let Found::Clean { listed: l, outcomes, .. } = &merged.found else { panic!("{merged:?}") };
        let seeds: Vec<u64> = l["incomplete"].iter().map(|l| l.seed).collect();
        assert_eq!(seeds, (0..n).collect::<Vec<_>>());
        assert_eq!(outcomes["incomplete"], 3 * n + 1);
        let dir = std::env::temp_dir().join(format!("pdkv-merge-listed-{}", std::process::id()));
        let lines = write_listed(l, outcomes, &dir).expect("writes");
        assert_eq!(lines[0], format!("incomplete: {} seeds, the first {n}:", 3 * n + 1));
        assert_eq!(lines[1], format!("  seed 0: pdkv run {}", dir.join("s-seed0.ron").display()));
        assert_eq!(lines.last().map(String::as_str), Some(format!("  and {} more", 2 * n + 1).as_str()));
        assert_eq!(std::fs::read_to_string(dir.join("s-seed0.ron")).expect("written"), "// seed 0\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
