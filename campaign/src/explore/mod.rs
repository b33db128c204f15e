//! Exploration: many seeds of a scenario run on threads (each run single-threaded and
//! deterministic) until the first broken property, with the smallest failing seed reported
//! whatever the thread timing; the seeds named by outcome, the failure shrunk, and the result
//! files of whole explorations and of shards, and their merge.

mod merge;
mod record;

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use pdkv_sim::explore::{
    broken_properties_of, ideal_jain, scenario_for_seed, search_scenario_for_seed, seed_file, shrink, Ideal,
    Property, ScenarioFile, Shrunk, SEEDS_LISTED_PER_OUTCOME,
};
use pdkv_sim::scenario::Scenario;
use pdkv_sim::{Outcome, RunOptions, SimError};
use serde::{Deserialize, Serialize};

use crate::shard::Shard;

pub use merge::{merge, read_shards};
pub use record::{
    fingerprint, Campaign, Clean, Failure, Faults, Found, Listed, NameError, NotAFileName, Record,
    ScenarioName, ScenarioText, Workload, WrittenSeeds, FORMAT,
};

/// What tells two runs apart for the count of distinct behaviours: requests finished and
/// failed, events processed, outcome. Files write it as one line, `"finished failed events
/// outcome"`, and order behaviours by those four with the outcome by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Behaviour {
    pub finished: u64,
    pub failed: u64,
    pub events: u64,
    pub outcome: Outcome,
}

impl Behaviour {
    fn key(&self) -> (u64, u64, u64, &'static str) {
        (self.finished, self.failed, self.events, self.outcome.name())
    }
}

impl Ord for Behaviour {
    fn cmp(&self, other: &Behaviour) -> CmpOrdering {
        self.key().cmp(&other.key())
    }
}

impl PartialOrd for Behaviour {
    fn partial_cmp(&self, other: &Behaviour) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Behaviour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {} {}", self.finished, self.failed, self.events, self.outcome.name())
    }
}

/// Why a text is not a behaviour.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BehaviourError {
    /// Not four fields, or a count that is not a whole number.
    Shape { text: String },
    /// The outcome is none a run has.
    Outcome { text: String },
}

impl fmt::Display for BehaviourError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BehaviourError::Shape { text } => {
                write!(f, "behaviour {text:?} is not \"finished failed events outcome\"")
            }
            BehaviourError::Outcome { text } => write!(
                f,
                "behaviour {text:?}: {}",
                crate::names::unknown_outcome(text.rsplit(' ').next().unwrap_or_default())
            ),
        }
    }
}

impl std::error::Error for BehaviourError {}

impl FromStr for Behaviour {
    type Err = BehaviourError;

    fn from_str(text: &str) -> Result<Behaviour, BehaviourError> {
        let shape = || BehaviourError::Shape { text: text.chars().take(80).collect() };
        let [finished, failed, events, outcome] = text.split(' ').collect::<Vec<_>>()[..] else {
            return Err(shape());
        };
        let count = |n: &str| n.parse::<u64>().map_err(|_| shape());
        let (finished, failed, events) = (count(finished)?, count(failed)?, count(events)?);
        let outcome = crate::names::outcome(outcome)
            .ok_or_else(|| BehaviourError::Outcome { text: text.chars().take(80).collect() })?;
        Ok(Behaviour { finished, failed, events, outcome })
    }
}

impl From<Behaviour> for String {
    fn from(b: Behaviour) -> String {
        b.to_string()
    }
}

impl TryFrom<String> for Behaviour {
    type Error = BehaviourError;

    fn try_from(text: String) -> Result<Behaviour, BehaviourError> {
        text.parse()
    }
}

/// How a search makes each seed's scenario, and when it stops handing out seeds.
#[derive(Clone, Copy, Debug)]
pub struct Search {
    /// Swarm faults drawn from each seed.
    pub swarm: bool,
    /// A small workload drawn from each seed (else the base's own).
    pub small: bool,
    /// No seed is handed out after this instant.
    pub deadline: Option<Instant>,
    /// What the fixed routing gives the base's deployment (see [`ideal_jain`]): the balance
    /// property's yardstick, and a small workload's round size.
    pub ideal: Option<Ideal>,
}

impl Search {
    /// A search of `base` without a deadline.
    pub fn new(base: &Scenario, swarm: bool, small: bool) -> Search {
        Search { swarm, small, deadline: None, ideal: ideal_jain(base) }
    }

    /// The scenario seed `seed` runs.
    pub fn scenario(&self, base: &Scenario, seed: u64) -> Scenario {
        if self.small {
            search_scenario_for_seed(base, seed, self.swarm, self.ideal)
        } else {
            scenario_for_seed(base, seed, self.swarm)
        }
    }

    /// Whether the deployment can run at all: the first seed's own scenario, without swarm
    /// faults (a small one when the search draws them, so this check costs little).
    pub fn check(&self, base: &Scenario, first_seed: u64) -> Result<(), SimError> {
        let scenario = Search { swarm: false, ..*self }.scenario(base, first_seed);
        pdkv_sim::run(&scenario, RunOptions::default()).map(|_| ())
    }
}

/// How far a search has got, as each seed ends.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Seeds run so far.
    pub done: u64,
    /// Seeds of the shard's share.
    pub share: u64,
    /// When the search started.
    pub started: Instant,
}

/// What one exploration found.
#[derive(Clone, Debug, PartialEq)]
pub struct Exploration {
    /// Seeds run.
    pub runs: u64,
    /// Events the seeds ran, in all.
    pub events: u64,
    /// How many seeds had each outcome.
    pub outcomes: BTreeMap<Outcome, u64>,
    /// Distinct behaviours.
    pub behaviours: BTreeSet<Behaviour>,
    /// The smallest failing seed, with what it broke.
    pub failure: Option<(u64, Vec<Property>)>,
    /// For every outcome but `clean`, its smallest seeds (at most
    /// [`SEEDS_LISTED_PER_OUTCOME`]), whatever the thread timing.
    pub listed: BTreeMap<Outcome, BTreeSet<u64>>,
}

/// Runs the shard's share of seeds `from..from + seeds` of `base` on `jobs` threads, stopping
/// early after a failure or at the search's deadline, and tells `progress` as each seed ends (it
/// is called from every thread; a caller that draws a bar skips a call rather than wait). The
/// smallest failing seed of the share is reported, whatever the thread timing: every seed below
/// the highest one handed out is run to the end.
///
/// The caller checks that `from + seeds` does not overflow.
pub fn explore(
    base: &Scenario,
    from: u64,
    seeds: u64,
    shard: Shard,
    jobs: usize,
    search: &Search,
    progress: &(dyn Fn(Progress) + Sync),
) -> Exploration {
    let share = shard.share(seeds);
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let events = AtomicU64::new(0);
    let found: Mutex<Vec<(u64, Vec<Property>)>> = Mutex::new(Vec::new());
    let seen: Mutex<BTreeSet<Behaviour>> = Mutex::new(BTreeSet::new());
    let outcomes: Mutex<BTreeMap<Outcome, u64>> = Mutex::new(BTreeMap::new());
    let listed: Mutex<BTreeMap<Outcome, BTreeSet<u64>>> = Mutex::new(BTreeMap::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                if stop.load(Ordering::SeqCst) || search.deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                // Hand out the share's next seed only while one is left, so the counter never
                // passes `share` (and so never wraps). The caller checked `from + seeds` fits.
                let Ok(n) =
                    next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < share).then_some(n + 1))
                else {
                    break;
                };
                let seed = from + shard.position(n);
                let scenario = search.scenario(base, seed);
                let Ok(run) = pdkv_sim::run(&scenario, RunOptions::default()) else { break };
                let r = &run.result;
                events.fetch_add(r.events, Ordering::Relaxed);
                let behaviour = Behaviour {
                    finished: r.requests.finished,
                    failed: r.requests.failed,
                    events: r.events,
                    outcome: r.outcome,
                };
                seen.lock().expect("no panics while held").insert(behaviour);
                *outcomes.lock().expect("no panics while held").entry(r.outcome).or_default() += 1;
                if r.outcome != Outcome::Clean {
                    // The smallest seeds of each outcome, so the list is the same whatever the
                    // threads ran first.
                    let mut listed = listed.lock().expect("no panics while held");
                    let seeds = listed.entry(r.outcome).or_default();
                    seeds.insert(seed);
                    if seeds.len() > SEEDS_LISTED_PER_OUTCOME {
                        seeds.pop_last();
                    }
                }
                let broken = broken_properties_of(r, search.ideal);
                if !broken.is_empty() {
                    found.lock().expect("no panics while held").push((seed, broken));
                    stop.store(true, Ordering::SeqCst);
                }
                let n = done.fetch_add(1, Ordering::SeqCst) + 1;
                progress(Progress { done: n, share, started });
            });
        }
    });
    let mut found = found.into_inner().expect("threads ended");
    found.sort();
    Exploration {
        runs: done.into_inner(),
        events: events.into_inner(),
        outcomes: outcomes.into_inner().expect("threads ended"),
        behaviours: seen.into_inner().expect("threads ended"),
        failure: found.into_iter().next(),
        listed: listed.into_inner().expect("threads ended"),
    }
}

impl Exploration {
    /// What a search that broke no property found (`None` when a seed broke one), each named
    /// seed made a scenario file of its own so `pdkv run` of it replays the seed. The error
    /// says when the base's name makes a seed's file name that a merge would refuse (a hidden
    /// file).
    pub fn clean(&self, base: &Scenario, search: &Search) -> Result<Option<Clean>, NotAFileName> {
        if self.failure.is_some() {
            return Ok(None);
        }
        let mut listed: BTreeMap<Outcome, Vec<Listed>> = BTreeMap::new();
        for (&outcome, seeds) in &self.listed {
            for &seed in seeds {
                let scenario = search.scenario(base, seed);
                let file = seed_file(base, seed, &scenario, outcome);
                let name = ScenarioName::new(file.scenario.name)?;
                listed.entry(outcome).or_default().push(Listed { name, seed, text: file.text });
            }
        }
        Ok(Some(Clean {
            behaviours: self.behaviours.clone(),
            events: self.events,
            listed,
            outcomes: self.outcomes.clone(),
            runs: self.runs,
        }))
    }
}

/// A failing seed shrunk: the scenario it ran, the shrinker's result and the scenario file
/// written of it.
#[derive(Clone, Debug, PartialEq)]
pub struct ShrunkFailure {
    /// The failing seed's own scenario.
    pub failing: Scenario,
    /// The smallest scenario that still breaks the first property, and the runs it took.
    pub reduced: Shrunk,
    /// The shrunk scenario as a file of its own.
    pub file: ScenarioFile,
}

impl ShrunkFailure {
    /// The result's failure: the seed, what it broke and the shrunk file (the error as for
    /// [`Exploration::clean`]).
    pub fn failure(&self, seed: u64, broken: &[Property]) -> Result<Failure, NotAFileName> {
        let name = ScenarioName::new(self.file.scenario.name.clone())?;
        Ok(Failure {
            broken: broken.to_vec(),
            seed,
            shrunk: ScenarioText { name, text: self.file.text.clone() },
        })
    }
}

/// Shrinks failing seed `seed` of `base`, which broke `broken` (the first is the property the
/// shrinker keeps broken), within `budget` runs, to a local minimum where it can; the error says
/// why the shrunk scenario cannot run.
pub fn shrink_failure(
    base: &Scenario,
    search: &Search,
    seed: u64,
    broken: &[Property],
    budget: usize,
) -> Result<ShrunkFailure, SimError> {
    let failing = search.scenario(base, seed);
    let reduced = shrink(&failing, broken[0], budget);
    let file = pdkv_sim::explore::shrunk_file(base, seed, broken[0], &reduced.scenario)?;
    Ok(ShrunkFailure { failing, reduced, file })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (text, the behaviour it reads as, or the error's words); what reads is written back as
    /// it was.
    #[test]
    fn behaviours_read_back_as_written() {
        let check = |text: &str, expected: Result<(u64, u64, u64, Outcome), &str>| match (
            text.parse::<Behaviour>(),
            expected,
        ) {
            (Ok(b), Ok((finished, failed, events, outcome))) => {
                assert_eq!(b, Behaviour { finished, failed, events, outcome }, "{text}");
                assert_eq!(b.to_string(), text);
            }
            (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{text}: {e} lacks {want:?}"),
            (got, _) => panic!("{text}: {got:?}, expected {expected:?}"),
        };
        check("0 12 1585 failed_requests", Ok((0, 12, 1585, Outcome::FailedRequests)));
        check("3 0 40 clean", Ok((3, 0, 40, Outcome::Clean)));
        check("3 0 40", Err("behaviour \"3 0 40\" is not \"finished failed events outcome\""));
        check("3 0 40 clean x", Err("is not \"finished failed events outcome\""));
        check("3 -1 40 clean", Err("is not \"finished failed events outcome\""));
        check("3  0 40 clean", Err("is not \"finished failed events outcome\""));
        check("3 0 40 fine", Err("behaviour \"3 0 40 fine\": outcome `fine` is not one pdkv knows"));
    }

    /// Behaviours sort as their four fields with the outcome by name, as the files list them.
    #[test]
    fn behaviours_sort_with_the_outcome_by_name() {
        let b = |events, outcome| Behaviour { finished: 1, failed: 0, events, outcome };
        let set: BTreeSet<Behaviour> =
            [b(9, Outcome::Clean), b(5, Outcome::Incomplete), b(5, Outcome::FailedRequests)].into();
        let texts: Vec<String> = set.iter().map(Behaviour::to_string).collect();
        assert_eq!(texts, ["1 0 5 failed_requests", "1 0 5 incomplete", "1 0 9 clean"]);
    }

    fn scenario(name: &str) -> Scenario {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../scenarios/{name}.ron"));
        pdkv_sim::load::load_scenario(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// The smallest failing seed is the same for any number of threads: notify-drift leaks on
    /// every seed, so the first seed fails, whichever thread ran it.
    #[test]
    fn the_smallest_failing_seed_whatever_the_threads() {
        let leaky = scenario("notify-drift");
        for jobs in [1, 3] {
            let search = Search::new(&leaky, false, true);
            let found = explore(&leaky, 0, 12, Shard::WHOLE, jobs, &search, &|_| {});
            let (seed, broken) = found.failure.clone().expect("notify drift breaks a property");
            assert_eq!(seed, 0, "{jobs} threads");
            assert!(!broken.is_empty());
            assert_eq!(found.clean(&leaky, &search), Ok(None));
        }
        // A clean search runs every seed of its share.
        let base = scenario("notify-drift-fixed");
        let search = Search::new(&base, false, true);
        let shard = Shard { index: 1, count: 3 };
        let found = explore(&base, 0, 8, shard, 2, &search, &|_| {});
        assert_eq!(found.failure, None);
        // Shard 1 of 3 of seeds 0..8 holds seeds 1, 4 and 7.
        assert_eq!(found.runs, 3);
        assert_eq!(found.outcomes.values().sum::<u64>(), 3);
    }
}
