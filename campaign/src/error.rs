//! Why shard files cannot be merged ([`MergeError`]), and the lies a merge refuses in a file it
//! could read ([`Inconsistency`]): each names the file at fault and what in it is wrong.

use std::fmt;

use pdkv_core::topology::NotationError;
use pdkv_sim::load::ScenarioError;
use pdkv_sim::Outcome;

use crate::explore::Behaviour;
use crate::files::ReadError;
use crate::shard::Shard;

/// Why shard files cannot be merged, naming the file at fault.
#[derive(Debug)]
pub enum MergeError {
    /// The file cannot be read, or is not a shard file of the merge's kind.
    Read(ReadError),
    /// The file is a whole result, not a shard.
    NotAShard { file: String },
    /// The file belongs to another campaign than the first file: `field` differs.
    Mismatch { file: String, field: &'static str, value: String, first_file: String, first: String },
    /// The file is a shard of another split than the first file's.
    OtherSplit { file: String, shard: Shard, first_file: String, first: Shard },
    /// The file is the same shard as another file.
    SameShard { file: String, shard: Shard, other: String },
    /// No file holds these shards (`more`: nor some others, not listed).
    Missing { shards: Vec<Shard>, more: bool },
    /// An exploration shard's file says it ran another number of seeds than its share.
    SeedsRun { file: String, shard: Shard, seeds: u64, share: u64, ran: u64 },
    /// A sweep shard's file holds another number of points than its share.
    PointsHeld { file: String, shard: Shard, points: u64, share: u64, held: u64 },
    /// A sweep shard's file holds a point of another shard.
    StrangerPoint { file: String, index: u64, shard: Shard },
    /// A sweep shard's file holds a point twice.
    PointTwice { file: String, index: u64 },
    /// The file contradicts itself or claims what its command never writes: it was edited or
    /// forged, and a merge trusts none of it.
    Inconsistent { file: String, reason: Box<Inconsistency> },
    /// The sweep's shards were made with another calibration than this build's.
    Calibration { file: String, theirs: String, ours: String },
}

impl fmt::Display for MergeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MergeError::Read(e) => e.fmt(f),
            MergeError::NotAShard { file } => {
                write!(f, "{file}: a whole result, not a shard (it was written without --shard)")
            }
            MergeError::Mismatch { file, field, value, first_file, first } => write!(
                f,
                "{file}: {field} is {value}, but in {first_file} it is {first}: the files come from different campaigns"
            ),
            MergeError::OtherSplit { file, shard, first_file, first } => write!(
                f,
                "{file}: is shard {shard}, but {first_file} is shard {first}: the files come from different splits"
            ),
            MergeError::SameShard { file, shard, other } => write!(f, "{file}: is shard {shard}, and so is {other}"),
            MergeError::Missing { shards, more } => {
                let mut names: Vec<String> = shards.iter().map(Shard::to_string).collect();
                if *more {
                    names.push("...".to_string());
                }
                write!(f, "no file holds shard{} {}", if names.len() == 1 { "" } else { "s" }, names.join(", "))
            }
            MergeError::SeedsRun { file, shard, seeds, share, ran } => {
                write!(f, "{file}: shard {shard} of {seeds} seeds has {share} seeds, but the file says {ran} ran")
            }
            MergeError::PointsHeld { file, shard, points, share, held } => write!(
                f,
                "{file}: shard {shard} of {points} points has {share} points, but the file holds {held}"
            ),
            MergeError::StrangerPoint { file, index, shard } => {
                write!(f, "{file}: point {index} is not one of shard {shard}'s")
            }
            MergeError::PointTwice { file, index } => write!(f, "{file}: point {index} is in the file twice"),
            MergeError::Inconsistent { file, reason } => {
                write!(f, "{file}: {reason}; the file is not as pdkv wrote it, so it is not merged")
            }
            MergeError::Calibration { file, theirs, ours } => write!(
                f,
                "{file}: made with the calibration `{theirs}`, but this pdkv has `{ours}`; merge with the pdkv that ran the shards"
            ),
        }
    }
}

impl std::error::Error for MergeError {}

impl From<ReadError> for MergeError {
    fn from(e: ReadError) -> MergeError {
        MergeError::Read(e)
    }
}

/// Which item of an exploration's result a seed or a scenario text is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Item {
    /// The smallest failing seed.
    Failure,
    /// The failure's shrunk scenario.
    Shrunk,
    /// A seed named for its outcome.
    Listed { outcome: Outcome, seed: u64 },
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Item::Failure => f.write_str("the failure"),
            Item::Shrunk => f.write_str("the shrunk scenario"),
            Item::Listed { outcome, seed } => write!(f, "listed.{} seed {seed}", outcome.name()),
        }
    }
}

/// What a file claims that its command never writes (counts that do not add up, a property
/// broken in a result that says none was, a seed or point that is not its shard's, a scenario
/// text that is not a scenario).
#[derive(Clone, Debug, PartialEq)]
pub enum Inconsistency {
    /// A clean result counts seeds of an outcome that breaks a property.
    BrokenOutcome { outcome: Outcome, seeds: u64 },
    /// The outcome counts do not add up to the seeds run (`None`: past 2^64).
    Counts { total: Option<u64>, runs: u64 },
    /// More distinct behaviours than seeds.
    Behaviours { behaviours: u64, runs: u64 },
    /// A behaviour whose outcome no seed had.
    BehaviourOutcome { behaviour: Behaviour },
    /// A behaviour with more events than all seeds together.
    BehaviourEvents { behaviour: Behaviour, events: u64 },
    /// More seeds listed for an outcome than an exploration lists.
    Listed { outcome: Outcome, listed: u64, most: u64 },
    /// A seed that is not one of the shard's.
    NotInShard { item: Item, seed: u64, shard: Shard, seeds: u64, from: u64 },
    /// A seed listed twice.
    ListedTwice { item: Item },
    /// A scenario text larger than a scenario may be.
    ScenarioSize { item: Item, bytes: u64, limit: u64 },
    /// A scenario text that `pdkv run` refuses.
    NotAScenario { item: Item, error: Box<ScenarioError> },
    /// A failure that breaks no property.
    NothingBroken,
    /// A failure that names a property twice.
    BrokenTwice { property: &'static str },
    /// A sweep point of none of the sweep's lines.
    StrangerLine { index: u64, run: String },
    /// A sweep point whose deployment is not a notation.
    Deployment { index: u64, deployment: String, error: NotationError },
    /// A sweep point without clients (a concurrency of 0 and no arrival rate).
    NoClients { index: u64 },
}

/// At most the first 80 characters of `text`, so a forged field cannot flood a message.
fn clipped(text: &str) -> String {
    text.chars().take(80).collect()
}

impl fmt::Display for Inconsistency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = |n: u64| if n == 1 { "" } else { "s" };
        match self {
            Inconsistency::BrokenOutcome { outcome, seeds } => write!(
                f,
                "{seeds} seed{} had outcome `{}`, which breaks a property, yet the file records no failure \
                 (`found.clean`)",
                plural(*seeds),
                outcome.name()
            ),
            Inconsistency::Counts { total, runs } => {
                let total = total.map_or("more than 2^64".to_string(), |t| t.to_string());
                write!(f, "the outcome counts add up to {total}, but `runs` is {runs}")
            }
            Inconsistency::Behaviours { behaviours, runs } => {
                write!(f, "{behaviours} distinct behaviours from {runs} seeds")
            }
            Inconsistency::BehaviourOutcome { behaviour } => {
                write!(f, "behaviour \"{behaviour}\" has an outcome no seed had")
            }
            Inconsistency::BehaviourEvents { behaviour, events } => {
                write!(f, "behaviour \"{behaviour}\" has more events than all seeds ({events})")
            }
            Inconsistency::Listed { outcome, listed, most } => write!(
                f,
                "`listed.{}` names {listed} seeds, but at most {most} of that outcome are listed",
                outcome.name()
            ),
            Inconsistency::NotInShard { item, seed, shard, seeds, from } => {
                write!(
                    f,
                    "{item} is seed {seed}, which is not one of shard {shard}'s seeds of {seeds} from {from}"
                )
            }
            Inconsistency::ListedTwice { item } => write!(f, "{item} is listed twice"),
            Inconsistency::ScenarioSize { item, bytes, limit } => {
                write!(f, "{item} is {bytes} bytes, larger than {limit} bytes, the most a scenario may be")
            }
            Inconsistency::NotAScenario { item, error } => {
                write!(f, "{item} is not a scenario pdkv run accepts: {error}")
            }
            Inconsistency::NothingBroken => f.write_str("the failure breaks no property (`broken` is empty)"),
            Inconsistency::BrokenTwice { property } => write!(f, "`broken` names {property:?} twice"),
            Inconsistency::StrangerLine { index, run } => {
                write!(f, "point {index}: `run` {:?} is none of the sweep's lines", clipped(run))
            }
            Inconsistency::Deployment { index, deployment, error } => {
                write!(f, "point {index}: `deployment` {:?}: {error}", clipped(deployment))
            }
            Inconsistency::NoClients { index } => {
                write!(f, "point {index}: `concurrency` is 0 and it has no `rate_per_s`; a sweep point runs at least one client or an arrival rate")
            }
        }
    }
}

/// The first of `fields` (what it is, this file's value, the first file's value) on which
/// `file` differs from `first_file`, as the error that names both.
pub(crate) fn check_same(
    file: &str,
    first_file: &str,
    fields: &[(&'static str, String, String)],
) -> Result<(), MergeError> {
    for (field, value, first) in fields {
        if value != first {
            return Err(MergeError::Mismatch {
                file: file.to_string(),
                field,
                value: value.clone(),
                first_file: first_file.to_string(),
                first: first.clone(),
            });
        }
    }
    Ok(())
}
