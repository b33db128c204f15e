//! `--shard i/N`: one of N slices of an exploration's seeds or a sweep's points, so a campaign
//! runs as N independent jobs (a Slurm job array, a Kubernetes Indexed Job) whose results a
//! merge puts back together, byte for byte what one machine would have written.

use std::fmt;

/// Shard `index` of `count`: the items whose position is `index` modulo `count`. Taking every
/// N-th item rather than a contiguous block gives every shard a spread of seeds (small and
/// large, cheap and expensive points), so the shards take about as long as each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Which shard, from 0 to `count - 1` (Slurm's `SLURM_ARRAY_TASK_ID`, Kubernetes'
    /// `JOB_COMPLETION_INDEX`).
    pub index: u64,
    /// How many shards in all.
    pub count: u64,
}

impl Shard {
    /// The whole campaign as one shard.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

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

    /// The shard as JSON, as shard files carry it.
    pub fn json(self) -> serde_json::Value {
        serde_json::json!({ "index": self.index, "count": self.count })
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Parses `i/N` (clap's value parser for `--shard`): shards are numbered from 0, as Slurm array
/// task ids and Kubernetes completion indexes are.
pub fn parse(text: &str) -> Result<Shard, String> {
    let shape = || format!("`{text}` is not a shard like 0/4 (shard i of N, i from 0 to N-1)");
    let (index, count) = text.split_once('/').ok_or_else(shape)?;
    let index: u64 = index.trim().parse().map_err(|_| shape())?;
    let count: u64 = count.trim().parse().map_err(|_| shape())?;
    if count == 0 {
        return Err(format!("`{text}`: the number of shards must be at least 1"));
    }
    if index >= count {
        return Err(format!(
            "`{text}`: shard {index} does not exist; shards are numbered 0 to {}",
            count - 1
        ));
    }
    Ok(Shard { index, count })
}

/// Reads a shard or result file's JSON and checks its `format` is `expected`; the error says
/// what is wrong.
pub fn json_of(text: &str, expected: &str) -> Result<serde_json::Value, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
    let format = value.get("format").and_then(serde_json::Value::as_str);
    if format != Some(expected) {
        return Err(format!(
            "`format` is {}, not \"{expected}\"",
            format.map_or("missing".into(), |f| format!("{f:?}"))
        ));
    }
    Ok(value)
}

/// The string field `name` of `v`, or what is wrong with it.
pub fn string_field(v: &serde_json::Value, name: &str) -> Result<String, String> {
    v.get(name)
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| format!("`{name}` missing or not a string"))
}

/// The whole-number field `name` of `v`, or what is wrong with it.
pub fn number_field(v: &serde_json::Value, name: &str) -> Result<u64, String> {
    v.get(name)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| format!("`{name}` missing or not a whole number"))
}

/// Largest shard file read, in bytes. An exploration's shard holds its distinct behaviours (a
/// line each, tens of bytes) and at most a few scenario files per outcome (each at most
/// [`pdkv_sim::load::MAX_SCENARIO_BYTES`]); a sweep's shard a line per point. Sixty-four
/// megabytes is far above both, and keeps `/dev/zero` or a wrong path from filling memory.
pub const MAX_SHARD_BYTES: u64 = 64 << 20;

/// Reads the file at `path` (a regular file of at most [`MAX_SHARD_BYTES`]) and parses it with
/// `parse`; the error names the file and says what is wrong. Returns the file's name as
/// messages show it, and what it holds.
pub fn read_file<T>(
    path: &std::path::Path,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<(String, T), MergeError> {
    let name = path.display().to_string();
    let text = pdkv_sim::load::read_capped(path, MAX_SHARD_BYTES)
        .map_err(|reason| MergeError::Unreadable { file: name.clone(), reason })?;
    let value = parse(&text).map_err(|reason| MergeError::Malformed { file: name.clone(), reason })?;
    Ok((name, value))
}

/// The first of `fields` (what it is, this file's value, the first file's value) on which
/// `file` differs from `first_file`, as the error that names both.
pub fn check_same(file: &str, first_file: &str, fields: &[(&str, String, String)]) -> Result<(), MergeError> {
    for (field, value, first) in fields {
        if value != first {
            return Err(MergeError::Mismatch {
                file: file.to_string(),
                field: field.to_string(),
                value: value.clone(),
                first_file: first_file.to_string(),
                first: first.clone(),
            });
        }
    }
    Ok(())
}

/// A shard as a shard file writes it, or what is wrong with it.
pub fn from_json(value: &serde_json::Value) -> Result<Shard, String> {
    let field = |name: &str| {
        value.get(name).and_then(serde_json::Value::as_u64).ok_or_else(|| format!("`shard` lacks `{name}`"))
    };
    let (index, count) = (field("index")?, field("count")?);
    parse(&format!("{index}/{count}"))
}

/// Why shard files cannot be merged, naming the file at fault.
#[derive(Debug, PartialEq, Eq)]
pub enum MergeError {
    /// The file cannot be read.
    Unreadable { file: String, reason: String },
    /// The file is not what the merge takes (not JSON, a field missing or of the wrong kind).
    Malformed { file: String, reason: String },
    /// The file is a whole result, not a shard.
    NotAShard { file: String },
    /// The file belongs to another campaign than the first file: `field` differs.
    Mismatch { file: String, field: String, value: String, first_file: String, first: String },
    /// The file is a shard of another split than the first, or the same shard as another file.
    Split { file: String, reason: String },
    /// No file holds these shards.
    Missing { shards: Vec<String> },
    /// The file's results do not cover its share of the campaign.
    Incomplete { file: String, reason: String },
    /// The file contradicts itself or claims what its command never writes (counts that do not
    /// add up, a property broken in a result that says none was, an unknown name, a scenario
    /// text that is not a scenario): it was edited or forged, and a merge trusts none of it.
    Inconsistent { file: String, reason: String },
}

impl fmt::Display for MergeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MergeError::Unreadable { file, reason } => write!(f, "{file}: cannot read it: {reason}"),
            MergeError::Malformed { file, reason } => write!(f, "{file}: not a shard file: {reason}"),
            MergeError::NotAShard { file } => {
                write!(f, "{file}: a whole result, not a shard (it was written without --shard)")
            }
            MergeError::Mismatch { file, field, value, first_file, first } => write!(
                f,
                "{file}: {field} is {value}, but in {first_file} it is {first}: the files come from different campaigns"
            ),
            MergeError::Split { file, reason } => write!(f, "{file}: {reason}"),
            MergeError::Missing { shards } => {
                write!(f, "no file holds shard{} {}", if shards.len() == 1 { "" } else { "s" }, shards.join(", "))
            }
            MergeError::Incomplete { file, reason } => write!(f, "{file}: {reason}"),
            MergeError::Inconsistent { file, reason } => {
                write!(f, "{file}: {reason}; the file is not as pdkv wrote it, so it is not merged")
            }
        }
    }
}

/// Checks that `shards` (one per file, in the files' order) are each shard of one split exactly
/// once.
pub fn check_complete(shards: &[(String, Shard)]) -> Result<(), MergeError> {
    let Some((first_file, first)) = shards.first() else {
        return Err(MergeError::Missing { shards: vec!["0/1".to_string()] });
    };
    // More shards than files can only be an incomplete set; say so without allocating for it.
    if first.count > shards.len() as u64 {
        let held: std::collections::BTreeSet<u64> = shards.iter().map(|(_, s)| s.index).collect();
        let missing =
            (0..first.count).filter(|i| !held.contains(i)).take(10).map(|i| format!("{i}/{}", first.count));
        let mut missing: Vec<String> = missing.collect();
        if first.count - (held.len() as u64) > 10 {
            missing.push("...".to_string());
        }
        if shards.iter().all(|(_, s)| s.count == first.count) {
            return Err(MergeError::Missing { shards: missing });
        }
    }
    let mut seen: Vec<Option<&str>> = vec![None; shards.len()];
    for (file, shard) in shards {
        if shard.count != first.count {
            return Err(MergeError::Split {
                file: file.clone(),
                reason: format!(
                    "is shard {shard}, but {first_file} is shard {first}: the files come from different splits"
                ),
            });
        }
        // `count` is at most the number of files here (checked above), so this index is in range.
        let slot = &mut seen[shard.index as usize];
        if let Some(other) = slot {
            return Err(MergeError::Split {
                file: file.clone(),
                reason: format!("is shard {shard}, and so is {other}"),
            });
        }
        *slot = Some(file);
    }
    let missing: Vec<String> = seen
        .iter()
        .enumerate()
        .filter(|(i, s)| s.is_none() && (*i as u64) < first.count)
        .map(|(i, _)| format!("{i}/{}", first.count))
        .collect();
    if !missing.is_empty() {
        return Err(MergeError::Missing { shards: missing });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_parse_or_say_what_is_wrong() {
        for (text, expected) in [
            ("0/1", Ok((0, 1))),
            ("2/3", Ok((2, 3))),
            ("0/0", Err("at least 1")),
            ("3/2", Err("shard 3 does not exist")),
            ("2/2", Err("numbered 0 to 1")),
            ("junk", Err("is not a shard like 0/4")),
            ("1/", Err("is not a shard like 0/4")),
            ("-1/2", Err("is not a shard like 0/4")),
        ] {
            match (parse(text), expected) {
                (Ok(s), Ok((i, n))) => assert_eq!((s.index, s.count), (i, n), "{text}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "{text}: {e:?} lacks {want:?}"),
                (got, _) => panic!("{text}: {got:?}, expected {expected:?}"),
            }
        }
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
