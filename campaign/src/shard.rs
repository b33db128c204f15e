//! Shards: one of N slices of an exploration's seeds or a sweep's points, so a campaign runs as
//! N independent jobs (a Slurm job array, a Kubernetes Indexed Job) whose results a merge puts
//! back together, byte for byte what one machine would have written.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Shard `index` of `count`: the items whose position is `index` modulo `count`. Taking every
/// N-th item rather than a contiguous block gives every shard a spread of seeds (small and
/// large, cheap and expensive points), so the shards take about as long as each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "ShardFields", try_from = "ShardFields")]
pub struct Shard {
    /// Which shard, from 0 to `count - 1` (Slurm's `SLURM_ARRAY_TASK_ID`, Kubernetes'
    /// `JOB_COMPLETION_INDEX`).
    pub index: u64,
    /// How many shards in all.
    pub count: u64,
}

/// A shard as shard files carry it: `{"count": N, "index": i}`, keys in that order.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardFields {
    count: u64,
    index: u64,
}

impl From<Shard> for ShardFields {
    fn from(shard: Shard) -> ShardFields {
        ShardFields { count: shard.count, index: shard.index }
    }
}

impl TryFrom<ShardFields> for Shard {
    type Error = ShardError;

    fn try_from(fields: ShardFields) -> Result<Shard, ShardError> {
        Shard::new(fields.index, fields.count)
    }
}

impl Shard {
    /// The whole campaign as one shard.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// Shard `index` of `count`, or why there is no such shard.
    pub fn new(index: u64, count: u64) -> Result<Shard, ShardError> {
        if count == 0 {
            return Err(ShardError::NoShards { text: format!("{index}/{count}") });
        }
        if index >= count {
            return Err(ShardError::NoSuchShard { text: format!("{index}/{count}"), index, count });
        }
        Ok(Shard { index, count })
    }

    /// Whether the item at `position` (0 for the first seed or point) belongs to this shard.
    pub fn owns(self, position: u64) -> bool {
        position % self.count == self.index
    }

    /// How many of the positions `0..total` belong to this shard.
    pub fn share(self, total: u64) -> u64 {
        if self.index >= total {
            0
        } else {
            (total - self.index - 1) / self.count + 1
        }
    }

    /// The position of this shard's `n`-th item.
    pub fn position(self, n: u64) -> u64 {
        self.index + n * self.count
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Why a text is not a shard (`--shard i/N`, or a shard file's `shard`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardError {
    /// Not of the form `i/N` with two whole numbers.
    Shape { text: String },
    /// `N` is 0.
    NoShards { text: String },
    /// `i` is not below `N`.
    NoSuchShard { text: String, index: u64, count: u64 },
}

impl fmt::Display for ShardError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardError::Shape { text } => {
                write!(f, "`{text}` is not a shard like 0/4 (shard i of N, i from 0 to N-1)")
            }
            ShardError::NoShards { text } => write!(f, "`{text}`: the number of shards must be at least 1"),
            ShardError::NoSuchShard { text, index, count } => {
                write!(f, "`{text}`: shard {index} does not exist; shards are numbered 0 to {}", count - 1)
            }
        }
    }
}

impl std::error::Error for ShardError {}

/// Parses `i/N`: shards are numbered from 0, as Slurm array task ids and Kubernetes completion
/// indexes are.
pub fn parse(text: &str) -> Result<Shard, ShardError> {
    let shape = || ShardError::Shape { text: text.to_string() };
    let (index, count) = text.split_once('/').ok_or_else(shape)?;
    let index: u64 = index.trim().parse().map_err(|_| shape())?;
    let count: u64 = count.trim().parse().map_err(|_| shape())?;
    Shard::new(index, count).map_err(|e| match e {
        // Name the text as written, spaces included.
        ShardError::NoShards { .. } => ShardError::NoShards { text: text.to_string() },
        ShardError::NoSuchShard { index, count, .. } => {
            ShardError::NoSuchShard { text: text.to_string(), index, count }
        }
        shape @ ShardError::Shape { .. } => shape,
    })
}

impl FromStr for Shard {
    type Err = ShardError;

    fn from_str(text: &str) -> Result<Shard, ShardError> {
        parse(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_parse_or_say_what_is_wrong() {
        let check = |text: &str, expected: Result<(u64, u64), &str>| match (parse(text), expected) {
            (Ok(s), Ok((i, n))) => assert_eq!((s.index, s.count), (i, n), "{text}"),
            (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{text}: {e} lacks {want:?}"),
            (got, _) => panic!("{text}: {got:?}, expected {expected:?}"),
        };
        check("0/1", Ok((0, 1)));
        check("2/3", Ok((2, 3)));
        check(" 2 / 3 ", Ok((2, 3)));
        check("0/0", Err("`0/0`: the number of shards must be at least 1"));
        check("3/2", Err("shard 3 does not exist"));
        check("2/2", Err("numbered 0 to 1"));
        check("junk", Err("`junk` is not a shard like 0/4"));
        check("1/", Err("is not a shard like 0/4"));
        check("-1/2", Err("is not a shard like 0/4"));
    }

    #[test]
    fn shards_read_back_as_files_write_them() {
        let check = |json: &str, expected: Result<Shard, &str>| {
            let got = serde_json::from_str::<Shard>(json);
            match (&got, expected) {
                (Ok(s), Ok(want)) => {
                    assert_eq!(*s, want, "{json}");
                    assert_eq!(serde_json::to_string(s).expect("serialises"), json);
                }
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{json}: {e} lacks {want:?}"),
                _ => panic!("{json}: {got:?}, expected {expected:?}"),
            }
        };
        check(r#"{"count":3,"index":1}"#, Ok(Shard { index: 1, count: 3 }));
        check(r#"{"count":3,"index":3}"#, Err("`3/3`: shard 3 does not exist"));
        check(r#"{"count":0,"index":0}"#, Err("the number of shards must be at least 1"));
        check(r#"{"count":3}"#, Err("missing field `index`"));
        check(r#"{"count":3,"index":1,"of":2}"#, Err("unknown field `of`"));
    }

    #[test]
    fn shares_cover_every_position_once() {
        for total in 0..12 {
            for count in 1..6 {
                let mut covered = vec![0; total as usize];
                for index in 0..count {
                    let shard = Shard { index, count };
                    for n in 0..shard.share(total) {
                        let p = shard.position(n);
                        assert!(shard.owns(p));
                        covered[p as usize] += 1;
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "{total} items in {count} shards: {covered:?}");
            }
        }
    }
}
