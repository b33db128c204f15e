//! The merge of an exploration's shard result files into the file one unsharded run writes,
//! byte for byte: the smallest failing seed of any shard, or the outcomes, behaviours, events
//! and named seeds of all shards together.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use pdkv_sim::explore::SEEDS_LISTED_PER_OUTCOME;
use pdkv_sim::Outcome;

use super::record::{Clean, Found, Listed, Record};
use crate::coverage::check_complete;
use crate::error::MergeError;
use crate::shard::Shard;

/// Reads every shard file and checks each holds together ([`Record::check`]), in the order
/// given; the first file that cannot be read or lies is the error.
pub fn read_shards(paths: &[impl AsRef<Path>]) -> Result<Vec<(String, Record)>, MergeError> {
    let mut records = Vec::new();
    for path in paths {
        let (file, record) = Record::read(path.as_ref())?;
        record
            .check(&file)
            .map_err(|reason| MergeError::Inconsistent { file: file.clone(), reason: Box::new(reason) })?;
        records.push((file, record));
    }
    Ok(records)
}

/// The first field of the campaign on which `file` differs from `first_file`, as the error that
/// names both.
fn check_same_campaign(file: &str, a: &Record, first_file: &str, b: &Record) -> Result<(), MergeError> {
    let (a, b) = (&a.campaign, &b.campaign);
    let fields = [
        ("the scenario", a.scenario.clone(), b.scenario.clone()),
        ("the scenario's fingerprint", a.fingerprint.clone(), b.fingerprint.clone()),
        ("the first seed (--from)", a.from.to_string(), b.from.to_string()),
        ("the number of seeds (--seeds)", a.seeds.to_string(), b.seeds.to_string()),
        ("the faults (--faults)", a.faults.to_string(), b.faults.to_string()),
        ("the workload", a.workload.to_string(), b.workload.to_string()),
        ("the shrink budget (--shrink-budget)", a.shrink_budget.to_string(), b.shrink_budget.to_string()),
    ];
    crate::error::check_same(file, first_file, &fields)
}

/// Merges the records of every shard of one campaign (each file's name and record) into the
/// record the unsharded exploration writes.
pub fn merge(records: &[(String, Record)]) -> Result<Record, MergeError> {
    let Some((first_file, first)) = records.first() else {
        return Err(MergeError::Missing { shards: vec![Shard::WHOLE], more: false });
    };
    let mut shards = Vec::new();
    for (file, record) in records {
        let Some(shard) = record.shard else { return Err(MergeError::NotAShard { file: file.clone() }) };
        check_same_campaign(file, record, first_file, first)?;
        shards.push((file.clone(), shard));
    }
    check_complete(&shards)?;
    let campaign = first.campaign.clone();
    // The smallest failing seed of any shard is the smallest of all: each shard reports its
    // own smallest, and the shards split the seeds between them.
    let failure = records
        .iter()
        .filter_map(|(_, r)| match &r.found {
            Found::Failure(f) => Some(f),
            Found::Clean(_) => None,
        })
        .min_by_key(|f| f.seed);
    if let Some(failure) = failure {
        return Ok(Record { campaign, shard: None, found: Found::Failure(failure.clone()) });
    }
    let (mut runs, mut events) = (0u64, 0u64);
    let mut outcomes: BTreeMap<Outcome, u64> = BTreeMap::new();
    let mut behaviours = BTreeSet::new();
    let mut listed: BTreeMap<Outcome, Vec<Listed>> = BTreeMap::new();
    for (file, record) in records {
        let Found::Clean(clean) = &record.found else { unreachable!("a failure returned above") };
        let shard = record.shard.expect("checked above");
        let share = shard.share(campaign.seeds);
        if clean.runs != share {
            return Err(MergeError::SeedsRun {
                file: file.clone(),
                shard,
                seeds: campaign.seeds,
                share,
                ran: clean.runs,
            });
        }
        runs += clean.runs;
        events = events.saturating_add(clean.events);
        for (outcome, n) in &clean.outcomes {
            *outcomes.entry(*outcome).or_default() += n;
        }
        behaviours.extend(clean.behaviours.iter().copied());
        for (outcome, seeds) in &clean.listed {
            listed.entry(*outcome).or_default().extend(seeds.iter().cloned());
        }
    }
    // Each shard lists its own smallest seeds of each outcome, so the smallest of their union
    // are the smallest of all.
    for seeds in listed.values_mut() {
        seeds.sort();
        seeds.truncate(SEEDS_LISTED_PER_OUTCOME);
    }
    let found = Found::Clean(Clean { behaviours, events, listed, outcomes, runs });
    Ok(Record { campaign, shard: None, found })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explore::record::tests::campaign;
    use crate::explore::{Campaign, Failure, Faults, ScenarioName, ScenarioText};
    use pdkv_sim::explore::Property;

    fn listed(seed: u64) -> Listed {
        Listed {
            name: ScenarioName::new(format!("s-seed{seed}")).expect("a file name"),
            seed,
            text: String::new(),
        }
    }

    fn clean(runs: u64) -> Found {
        Found::Clean(Clean {
            runs,
            events: 1,
            outcomes: [(Outcome::Clean, runs)].into(),
            behaviours: BTreeSet::new(),
            listed: BTreeMap::new(),
        })
    }

    fn failure(seed: u64) -> Found {
        Found::Failure(Failure {
            seed,
            broken: vec![Property::Safety],
            shrunk: ScenarioText {
                name: ScenarioName::new(format!("n{seed}")).expect("a file name"),
                text: String::new(),
            },
        })
    }

    fn shard(index: u64, count: u64, found: Found) -> (String, Record) {
        (format!("{index}.json"), Record { campaign: campaign(), shard: Some(Shard { index, count }), found })
    }

    #[test]
    fn the_smallest_failing_seed_of_any_shard_wins() {
        let merged = merge(&[shard(0, 3, clean(4)), shard(1, 3, failure(11)), shard(2, 3, failure(5))])
            .expect("merges");
        assert_eq!(merged.shard, None);
        assert!(matches!(merged.found, Found::Failure(Failure { seed: 5, .. })), "{merged:?}");
    }

    /// (the files, what the merge says: an error's words, or the seeds run of a clean merge).
    #[test]
    fn shards_merge_or_the_file_at_fault_is_named() {
        let check =
            |records: &[(String, Record)], expected: Result<u64, &str>| match (merge(records), expected) {
                (Ok(Record { found: Found::Clean(c), shard: None, .. }), Ok(runs)) => {
                    assert_eq!(c.runs, runs)
                }
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{e} lacks {want:?}"),
                (got, _) => panic!("{got:?}, expected {expected:?}"),
            };
        check(&[shard(1, 2, clean(5)), shard(0, 2, clean(5))], Ok(10));
        check(&[], Err("no file holds shard 0/1"));
        check(&[shard(0, 2, clean(5))], Err("no file holds shard 1/2"));
        check(
            &[shard(0, 2, clean(5)), shard(1, 2, clean(4))],
            Err("1.json: shard 1/2 of 10 seeds has 5 seeds, but the file says 4 ran"),
        );
        let mut other = shard(1, 2, clean(5));
        other.1.campaign.faults = Faults::None;
        check(
            &[shard(0, 2, clean(5)), other],
            Err("1.json: the faults (--faults) is none, but in 0.json it is swarm: the files come from different campaigns"),
        );
        let mut whole = shard(1, 2, clean(5));
        whole.1.shard = None;
        check(&[shard(0, 2, clean(5)), whole], Err("1.json: a whole result, not a shard"));
    }

    /// Each shard names its own smallest seeds of an outcome; the merge names the smallest of
    /// all, as many as one unsharded run does, in seed order (not name order, which would put
    /// seed 10 before seed 2).
    #[test]
    fn the_merge_names_the_smallest_seeds_of_each_outcome() {
        let n = SEEDS_LISTED_PER_OUTCOME as u64;
        // Shard i of 2 holds the seeds i, i + 2, ...: 3n incomplete seeds of 6n, n listed each.
        let shard = |index: u64| {
            let seeds: Vec<Listed> = (0..n).map(|k| listed(index + 2 * k)).collect();
            let found = Found::Clean(Clean {
                runs: 3 * n,
                events: 1,
                outcomes: [(Outcome::Incomplete, 3 * n / 2 + index)].into(),
                behaviours: BTreeSet::new(),
                listed: [(Outcome::Incomplete, seeds)].into(),
            });
            let campaign = Campaign { seeds: 6 * n, ..campaign() };
            (format!("{index}.json"), Record { campaign, shard: Some(Shard { index, count: 2 }), found })
        };
        let merged = merge(&[shard(1), shard(0)]).expect("merges");
        let Found::Clean(c) = &merged.found else { panic!("{merged:?}") };
        let seeds: Vec<u64> = c.listed[&Outcome::Incomplete].iter().map(|l| l.seed).collect();
        assert_eq!(seeds, (0..n).collect::<Vec<_>>());
        assert_eq!(c.outcomes[&Outcome::Incomplete], 3 * n + 1);
    }
}
