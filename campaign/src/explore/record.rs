//! Exploration result files (`pdkv explore --result FILE`, whole or one shard) and what a merge
//! checks of one before it trusts it.
//!
//! A result file holds only what does not depend on the machine or the thread timing: the
//! campaign (scenario, its fingerprint, seeds, faults, workload, shrink budget), and then either
//! the smallest failing seed with what it broke and its shrunk scenario, or, when no seed broke
//! a property, the outcome histogram, the distinct behaviours themselves (so a merge can take
//! their union) and the event total. How many seeds ran before a failure stopped the search
//! depends on the threads, so a failure's file does not say.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use pdkv_sim::explore::{Property, SEEDS_LISTED_PER_OUTCOME};
use pdkv_sim::scenario::Scenario;
use pdkv_sim::Outcome;
use serde::{Deserialize, Serialize};

use super::Behaviour;
use crate::error::{Inconsistency, Item};
use crate::files::{ReadError, WriteError};
use crate::shard::Shard;

/// The format's name and version: 2 added the seeds of every outcome but `clean`
/// (`found.clean.listed`).
pub const FORMAT: &str = "pdkv-explore-result/2";

/// A name that is not one of a field's few values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameError {
    /// The field.
    pub field: &'static str,
    /// The name found.
    pub name: String,
    /// The names there are, as the message lists them.
    pub known: &'static str,
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` is {:?}, not {}",
            self.field,
            self.name.chars().take(80).collect::<String>(),
            self.known
        )
    }
}

impl std::error::Error for NameError {}

/// Fault injection of an exploration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum Faults {
    /// Only the scenario's own faults.
    None,
    /// Plus random message loss, duplication, delay and send-queue-full drawn from each seed.
    Swarm,
}

impl TryFrom<String> for Faults {
    type Error = NameError;

    fn try_from(name: String) -> Result<Faults, NameError> {
        match name.as_str() {
            "none" => Ok(Faults::None),
            "swarm" => Ok(Faults::Swarm),
            _ => Err(NameError { field: "faults", name, known: "\"none\" or \"swarm\"" }),
        }
    }
}

/// The workload of each seed of an exploration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum Workload {
    /// A small workload drawn from each seed.
    Small,
    /// The scenario's own.
    Full,
}

impl TryFrom<String> for Workload {
    type Error = NameError;

    fn try_from(name: String) -> Result<Workload, NameError> {
        match name.as_str() {
            "small" => Ok(Workload::Small),
            "full" => Ok(Workload::Full),
            _ => Err(NameError { field: "workload", name, known: "\"small\" or \"full\"" }),
        }
    }
}

impl fmt::Display for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Faults::None => "none",
            Faults::Swarm => "swarm",
        })
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Workload::Small => "small",
            Workload::Full => "full",
        })
    }
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
    pub faults: Faults,
    pub workload: Workload,
    /// Runs the shrinker may spend.
    pub shrink_budget: u64,
}

impl Campaign {
    /// The campaign of seeds `from..from + seeds` of `base`, its fingerprint taken of the
    /// scenario as JSON (which tells two different scenarios of one name apart).
    pub fn new(
        base: &Scenario,
        from: u64,
        seeds: u64,
        faults: Faults,
        workload: Workload,
        shrink_budget: u64,
    ) -> Campaign {
        let json = serde_json::to_string(base).expect("a scenario has string keys only");
        Campaign {
            scenario: base.name.clone(),
            fingerprint: fingerprint(&json),
            from,
            seeds,
            faults,
            workload,
            shrink_budget,
        }
    }
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

/// A scenario name that is a file name in an output folder (its file is `<name>.ron`): not
/// empty, not hidden, no folder in it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct ScenarioName(String);

/// A scenario name that is not a file name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotAFileName {
    pub name: String,
}

impl fmt::Display for NotAFileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the scenario name {:?} is not a file name", self.name.chars().take(80).collect::<String>())
    }
}

impl std::error::Error for NotAFileName {}

impl ScenarioName {
    /// `name`, if it is a file name.
    pub fn new(name: String) -> Result<ScenarioName, NotAFileName> {
        if name.is_empty() || name.starts_with('.') || name.contains(['/', '\\']) {
            return Err(NotAFileName { name });
        }
        Ok(ScenarioName(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The scenario's file in `dir`.
    pub fn file_in(&self, dir: &Path) -> std::path::PathBuf {
        dir.join(format!("{}.ron", self.0))
    }
}

impl fmt::Display for ScenarioName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<ScenarioName> for String {
    fn from(name: ScenarioName) -> String {
        name.0
    }
}

impl TryFrom<String> for ScenarioName {
    type Error = NotAFileName;

    fn try_from(name: String) -> Result<ScenarioName, NotAFileName> {
        ScenarioName::new(name)
    }
}

/// A seed an exploration names, with the scenario file that replays it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listed {
    /// The scenario's name.
    pub name: ScenarioName,
    pub seed: u64,
    /// The file's text.
    pub text: String,
}

/// Listed seeds sort by seed (their names would put seed 10 before seed 2).
impl Ord for Listed {
    fn cmp(&self, other: &Listed) -> CmpOrdering {
        (self.seed, &self.name, &self.text).cmp(&(other.seed, &other.name, &other.text))
    }
}

impl PartialOrd for Listed {
    fn partial_cmp(&self, other: &Listed) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

/// A scenario file's name and text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioText {
    pub name: ScenarioName,
    pub text: String,
}

/// The scenario files of one outcome's named seeds, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenSeeds {
    pub outcome: Outcome,
    /// Seeds of that outcome in all, named or not.
    pub total: u64,
    /// The seeds named, with their files.
    pub files: Vec<(u64, PathBuf)>,
}

impl ScenarioText {
    /// Writes the file `<name>.ron` into `dir`, returning its path.
    pub fn write_in(&self, dir: &Path) -> Result<PathBuf, WriteError> {
        let file = self.name.file_in(dir);
        crate::files::write(&file, &self.text)?;
        Ok(file)
    }
}

/// What a search that broke no property found. Fields in the order the file lists them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Clean {
    /// Distinct behaviours.
    pub behaviours: BTreeSet<Behaviour>,
    /// Events of all seeds.
    pub events: u64,
    /// For every outcome but `clean`, its smallest seeds (at most
    /// [`SEEDS_LISTED_PER_OUTCOME`]) as scenario files.
    #[serde(with = "crate::names::outcome_map")]
    pub listed: BTreeMap<Outcome, Vec<Listed>>,
    /// How many seeds had each outcome.
    #[serde(with = "crate::names::outcome_map")]
    pub outcomes: BTreeMap<Outcome, u64>,
    /// Seeds run.
    pub runs: u64,
}

impl Clean {
    /// Writes the scenario file of every named seed into `dir`, outcome by outcome in name
    /// order, and says which seeds went where.
    pub fn write_listed(&self, dir: &Path) -> Result<Vec<WrittenSeeds>, WriteError> {
        let mut written = Vec::new();
        for (outcome, seeds) in crate::names::in_name_order(&self.listed) {
            let mut files = Vec::new();
            for l in seeds {
                let file = l.name.file_in(dir);
                crate::files::write(&file, &l.text)?;
                files.push((l.seed, file));
            }
            let total = self.outcomes.get(&outcome).copied().unwrap_or(0);
            written.push(WrittenSeeds { outcome, total, files });
        }
        Ok(written)
    }
}

/// The smallest failing seed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Failure {
    /// The properties it broke.
    #[serde(with = "crate::names::broken")]
    pub broken: Vec<Property>,
    pub seed: u64,
    /// The shrunk scenario's file.
    pub shrunk: ScenarioText,
}

/// What an exploration found, in the part that is the same on any machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Found {
    /// No seed broke a property.
    Clean(Clean),
    /// The smallest failing seed.
    Failure(Failure),
}

/// One result file: a whole exploration, or one shard of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub campaign: Campaign,
    pub shard: Option<Shard>,
    pub found: Found,
}

/// A result file as it is on disk: one flat object, its keys in sorted order.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordFile {
    faults: Faults,
    fingerprint: String,
    format: String,
    found: Found,
    from: u64,
    scenario: String,
    seeds: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shard: Option<Shard>,
    shrink_budget: u64,
    workload: Workload,
}

impl Record {
    /// The file's text: pretty JSON with sorted keys and a final newline, so equal records are
    /// equal bytes.
    pub fn text(&self) -> String {
        let c = self.campaign.clone();
        crate::files::text(&RecordFile {
            faults: c.faults,
            fingerprint: c.fingerprint,
            format: FORMAT.to_string(),
            found: self.found.clone(),
            from: c.from,
            scenario: c.scenario,
            seeds: c.seeds,
            shard: self.shard,
            shrink_budget: c.shrink_budget,
            workload: c.workload,
        })
    }

    /// Reads a record from a file's text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Record, ReadError> {
        let r: RecordFile = crate::files::parse(text, FORMAT, file)?;
        let campaign = Campaign {
            scenario: r.scenario,
            fingerprint: r.fingerprint,
            from: r.from,
            seeds: r.seeds,
            faults: r.faults,
            workload: r.workload,
            shrink_budget: r.shrink_budget,
        };
        Ok(Record { campaign, shard: r.shard, found: r.found })
    }

    /// Reads the record of the file at `path`; returns the file's name as messages show it.
    pub fn read(path: &Path) -> Result<(String, Record), ReadError> {
        let (name, text) = crate::files::read_text(path)?;
        let record = Record::parse(&text, &name)?;
        Ok((name, record))
    }

    /// Writes the record to `file`, whole or not at all.
    pub fn write(&self, file: &Path) -> Result<(), WriteError> {
        crate::files::write(file, &self.text())
    }

    /// Checks that what the record claims holds together, as a file `pdkv explore` wrote would:
    /// counts that add up, no outcome that breaks a property in a result that says none was
    /// broken, seeds that belong to the shard, and scenario texts that the loader of `pdkv run`
    /// accepts (`file` names them in its errors). Names are checked as the file is read. A
    /// merge trusts nothing else, so a file that was edited or forged is refused here, not
    /// merged into a verdict it does not support.
    pub fn check(&self, file: &str) -> Result<(), Inconsistency> {
        let c = &self.campaign;
        let shard = self.shard.unwrap_or(Shard::WHOLE);
        // A seed the record names must be one of its shard's seeds.
        let owned = |seed: u64, item: Item| -> Result<(), Inconsistency> {
            let position = seed.checked_sub(c.from).filter(|p| *p < c.seeds);
            match position {
                Some(p) if shard.owns(p) => Ok(()),
                _ => Err(Inconsistency::NotInShard { item, seed, shard, seeds: c.seeds, from: c.from }),
            }
        };
        let scenario = |text: &str, item: Item| -> Result<(), Inconsistency> {
            let limit = pdkv_sim::load::MAX_SCENARIO_BYTES;
            if text.len() as u64 > limit {
                return Err(Inconsistency::ScenarioSize { item, bytes: text.len() as u64, limit });
            }
            pdkv_sim::load::parse_scenario(text, &format!("{file} ({item})"))
                .map(|_| ())
                .map_err(|error| Inconsistency::NotAScenario { item, error: Box::new(error) })
        };
        match &self.found {
            Found::Clean(Clean { runs, events, outcomes, behaviours, listed }) => {
                for (outcome, &seeds) in crate::names::in_name_order(outcomes) {
                    if seeds > 0 && !matches!(outcome, Outcome::Clean | Outcome::Incomplete) {
                        return Err(Inconsistency::BrokenOutcome { outcome, seeds });
                    }
                }
                let total = outcomes.values().try_fold(0u64, |sum, n| sum.checked_add(*n));
                if total != Some(*runs) {
                    return Err(Inconsistency::Counts { total, runs: *runs });
                }
                if behaviours.len() as u64 > *runs {
                    return Err(Inconsistency::Behaviours {
                        behaviours: behaviours.len() as u64,
                        runs: *runs,
                    });
                }
                for &behaviour in behaviours {
                    if outcomes.get(&behaviour.outcome).copied().unwrap_or(0) == 0 {
                        return Err(Inconsistency::BehaviourOutcome { behaviour });
                    }
                    if behaviour.events > *events {
                        return Err(Inconsistency::BehaviourEvents { behaviour, events: *events });
                    }
                }
                for (outcome, seeds) in crate::names::in_name_order(listed) {
                    let total = outcomes.get(&outcome).copied().unwrap_or(0);
                    let most = total.min(SEEDS_LISTED_PER_OUTCOME as u64);
                    if outcome == Outcome::Clean || seeds.len() as u64 > most {
                        return Err(Inconsistency::Listed { outcome, listed: seeds.len() as u64, most });
                    }
                    let mut seen = BTreeSet::new();
                    for l in seeds {
                        let item = Item::Listed { outcome, seed: l.seed };
                        owned(l.seed, item)?;
                        if !seen.insert(l.seed) {
                            return Err(Inconsistency::ListedTwice { item });
                        }
                        scenario(&l.text, item)?;
                    }
                }
            }
            Found::Failure(Failure { seed, broken, shrunk }) => {
                owned(*seed, Item::Failure)?;
                if broken.is_empty() {
                    return Err(Inconsistency::NothingBroken);
                }
                let mut seen = BTreeSet::new();
                for property in broken {
                    if !seen.insert(*property) {
                        return Err(Inconsistency::BrokenTwice { property: property.name() });
                    }
                }
                scenario(&shrunk.text, Item::Shrunk)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn campaign() -> Campaign {
        Campaign {
            scenario: "s".into(),
            fingerprint: fingerprint("s"),
            from: 3,
            seeds: 10,
            faults: Faults::Swarm,
            workload: Workload::Small,
            shrink_budget: 300,
        }
    }

    fn listed(seed: u64) -> Listed {
        Listed {
            name: ScenarioName::new(format!("s-seed{seed}")).expect("a file name"),
            seed,
            text: format!("// seed {seed}\n"),
        }
    }

    fn clean() -> Found {
        let b = |finished, failed, events, outcome| Behaviour { finished, failed, events, outcome };
        Found::Clean(Clean {
            runs: 4,
            events: 99,
            outcomes: [(Outcome::Clean, 3), (Outcome::Incomplete, 1)].into(),
            behaviours: [b(1, 0, 40, Outcome::Clean), b(0, 2, 59, Outcome::Incomplete)].into(),
            listed: [(Outcome::Incomplete, vec![listed(4)])].into(),
        })
    }

    fn failure() -> Found {
        Found::Failure(Failure {
            seed: 7,
            broken: vec![Property::Safety, Property::NoHang],
            shrunk: ScenarioText {
                name: ScenarioName::new("s-seed7-shrunk".into()).expect("a file name"),
                text: "// header\n(name: \"s-seed7-shrunk\")\n".into(),
            },
        })
    }

    /// FNV-1a's published 64-bit values.
    #[test]
    fn fingerprints_are_fnv_1a() {
        assert_eq!(fingerprint(""), "cbf29ce484222325");
        assert_eq!(fingerprint("a"), "af63dc4c8601ec8c");
        assert_eq!(fingerprint("foobar"), "85944171f73967e8");
    }

    #[test]
    fn records_read_back_as_written() {
        for found in [clean(), failure()] {
            for shard in [None, Some(Shard { index: 1, count: 3 })] {
                let record = Record { campaign: campaign(), shard, found: found.clone() };
                let back = Record::parse(&record.text(), "r.json").expect("reads");
                assert_eq!(back, record);
            }
        }
    }

    /// The file as `pdkv explore` has always written it: these bytes are the format.
    #[test]
    fn a_clean_record_is_written_as_the_format_says() {
        let record =
            Record { campaign: campaign(), shard: Some(Shard { index: 1, count: 3 }), found: clean() };
        let expected = r#"{
  "faults": "swarm",
  "fingerprint": "af63ee4c86020b22",
  "format": "pdkv-explore-result/2",
  "found": {
    "clean": {
      "behaviours": [
        "0 2 59 incomplete",
        "1 0 40 clean"
      ],
      "events": 99,
      "listed": {
        "incomplete": [
          {
            "name": "s-seed4",
            "seed": 4,
            "text": "// seed 4\n"
          }
        ]
      },
      "outcomes": {
        "clean": 3,
        "incomplete": 1
      },
      "runs": 4
    }
  },
  "from": 3,
  "scenario": "s",
  "seeds": 10,
  "shard": {
    "count": 3,
    "index": 1
  },
  "shrink_budget": 300,
  "workload": "small"
}
"#;
        assert_eq!(record.text(), expected);
    }

    /// (what is changed in a good file's JSON, the error's words): names that are none of the
    /// format's are refused as the file is read, with the field named.
    #[test]
    fn names_the_format_lacks_are_refused_as_the_file_is_read() {
        let good =
            Record { campaign: campaign(), shard: Some(Shard { index: 1, count: 3 }), found: clean() }.text();
        let check = |from: &str, to: &str, words: &str| {
            assert!(good.contains(from), "{from}");
            let text = good.replacen(from, to, 1);
            let e = Record::parse(&text, "f.json").expect_err(to).to_string();
            assert!(e.starts_with("f.json: ") && e.contains(words), "{to}: {e} lacks {words:?}");
        };
        check(
            r#""faults": "swarm""#,
            r#""faults": "banana""#,
            "`faults` is \"banana\", not \"none\" or \"swarm\"",
        );
        check(
            r#""workload": "small""#,
            r#""workload": "big""#,
            "`workload` is \"big\", not \"small\" or \"full\"",
        );
        check(r#""clean": 3"#, r#""fine": 3"#, "outcome `fine` is not one pdkv knows");
        check(r#""incomplete": ["#, r#""bad": ["#, "outcome `bad` is not one pdkv knows");
        check(r#""0 2 59 incomplete""#, r#""0 2 incomplete""#, "behaviour \"0 2 incomplete\" is not");
        check(r#""name": "s-seed4""#, r#""name": "../s""#, "the scenario name \"../s\" is not a file name");
        check(r#""runs": 4"#, r#""runs": 4, "wall_s": 3"#, "unknown field `wall_s`");
        check(r#""workload": "small""#, r#""workload": "small", "host": "a""#, "unknown field `host`");
        check(r#""seeds": 10,"#, "", "missing field `seeds`");
        check(
            r#""clean": {"#,
            r#""cleanish": {"#,
            "unknown variant `cleanish`, expected `clean` or `failure`",
        );
        check(r#""index": 1"#, r#""index": 3"#, "`3/3`: shard 3 does not exist");
        check(
            r#""format": "pdkv-explore-result/2""#,
            r#""format": "pdkv-explore-result/1""#,
            "written by another version of pdkv: `format` is \"pdkv-explore-result/1\"",
        );
    }

    /// (a change to a good record, the inconsistency's words, or none when it still holds).
    #[test]
    fn records_that_contradict_themselves_are_refused() {
        let check = |found: Found, shard: Option<Shard>, expected: Option<&str>| {
            let record = Record { campaign: campaign(), shard, found };
            let got = record.check("f.json").err().map(|e| e.to_string());
            match (&got, expected) {
                (None, None) => {}
                (Some(e), Some(want)) => assert!(e.contains(want), "{e} lacks {want:?}"),
                _ => panic!("{got:?}, expected {expected:?}"),
            }
        };
        let shard = Some(Shard { index: 1, count: 3 });
        let with = |edit: &dyn Fn(&mut Clean)| {
            let Found::Clean(mut c) = clean() else { unreachable!() };
            edit(&mut c);
            Found::Clean(c)
        };
        let scenario = "(name: \"x\", deployment: \"1P_TP8:1D_TP8\")".to_string();
        let text_listed = |seed: u64| Listed { text: scenario.clone(), ..listed(seed) };
        let fail = |seed, broken: Vec<Property>, text: &str| {
            let Found::Failure(f) = failure() else { unreachable!() };
            Found::Failure(Failure {
                seed,
                broken,
                shrunk: ScenarioText { text: text.to_string(), ..f.shrunk },
            })
        };
        check(with(&|c| c.listed = [(Outcome::Incomplete, vec![text_listed(4)])].into()), shard, None);
        check(
            with(&|c| c.outcomes = [(Outcome::Clean, 3), (Outcome::Hang, 1)].into()),
            shard,
            Some("1 seed had outcome `hang`, which breaks a property, yet the file records no failure"),
        );
        check(
            with(&|c| c.outcomes = [(Outcome::Clean, 3)].into()),
            shard,
            Some("the outcome counts add up to 3, but `runs` is 4"),
        );
        check(
            with(&|c| c.outcomes = [(Outcome::Clean, u64::MAX), (Outcome::Incomplete, 1)].into()),
            shard,
            Some("add up to more than 2^64"),
        );
        check(with(&|c| c.runs = 1), shard, Some("the outcome counts add up to 4, but `runs` is 1"));
        check(
            with(&|c| c.events = 50),
            shard,
            Some("behaviour \"0 2 59 incomplete\" has more events than all seeds (50)"),
        );
        check(
            with(&|c| c.listed = [(Outcome::Incomplete, vec![text_listed(5)])].into()),
            shard,
            Some("listed.incomplete seed 5 is seed 5, which is not one of shard 1/3's seeds of 10 from 3"),
        );
        check(
            with(&|c| c.listed = [(Outcome::Incomplete, vec![text_listed(4), text_listed(4)])].into()),
            shard,
            Some("`listed.incomplete` names 2 seeds, but at most 1 of that outcome are listed"),
        );
        check(
            with(&|c| c.listed = [(Outcome::Clean, vec![text_listed(4)])].into()),
            shard,
            Some("`listed.clean` names 1 seeds, but at most 3 of that outcome are listed"),
        );
        check(with(&|_| {}), shard, Some("listed.incomplete seed 4 is not a scenario pdkv run accepts"));
        check(fail(7, vec![Property::Safety], &scenario), shard, None);
        check(fail(7, vec![], &scenario), shard, Some("the failure breaks no property"));
        check(
            fail(7, vec![Property::Safety, Property::Safety], &scenario),
            shard,
            Some("`broken` names \"safety\" twice"),
        );
        check(
            fail(8, vec![Property::Safety], &scenario),
            shard,
            Some("the failure is seed 8, which is not one of"),
        );
        check(fail(13, vec![Property::Safety], &scenario), None, Some("the failure is seed 13"));
        check(fail(12, vec![Property::Safety], &scenario), None, None);
        check(
            fail(7, vec![Property::Safety], &" ".repeat(2 << 20)),
            shard,
            Some("the shrunk scenario is 2097152 bytes, larger than 1048576 bytes"),
        );
    }
}
