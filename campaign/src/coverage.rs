//! Whether a set of shard files covers a campaign: every share once, all of one split.

use std::collections::BTreeSet;

use crate::error::MergeError;
use crate::shard::Shard;

/// Checks that `shards` (one per file, in the files' order) are each shard of one split exactly
/// once.
pub fn check_complete(shards: &[(String, Shard)]) -> Result<(), MergeError> {
    let Some((first_file, first)) = shards.first() else {
        return Err(MergeError::Missing { shards: vec![Shard::WHOLE], more: false });
    };
    // More shards than files can only be an incomplete set; say so without allocating for it.
    if first.count > shards.len() as u64 {
        let held: BTreeSet<u64> = shards.iter().map(|(_, s)| s.index).collect();
        let missing = (0..first.count).filter(|i| !held.contains(i)).take(10);
        let missing: Vec<Shard> = missing.map(|index| Shard { index, count: first.count }).collect();
        let more = first.count - (held.len() as u64) > 10;
        if shards.iter().all(|(_, s)| s.count == first.count) {
            return Err(MergeError::Missing { shards: missing, more });
        }
    }
    let mut seen: Vec<Option<&str>> = vec![None; shards.len()];
    for (file, shard) in shards {
        if shard.count != first.count {
            return Err(MergeError::OtherSplit {
                file: file.clone(),
                shard: *shard,
                first_file: first_file.clone(),
                first: *first,
            });
        }
        // `count` is at most the number of files here (checked above), so this index is in range.
        let slot = &mut seen[shard.index as usize];
        if let Some(other) = slot {
            return Err(MergeError::SameShard {
                file: file.clone(),
                shard: *shard,
                other: other.to_string(),
            });
        }
        *slot = Some(file);
    }
    let missing: Vec<Shard> = seen
        .iter()
        .enumerate()
        .filter(|(i, s)| s.is_none() && (*i as u64) < first.count)
        .map(|(i, _)| Shard { index: i as u64, count: first.count })
        .collect();
    if !missing.is_empty() {
        return Err(MergeError::Missing { shards: missing, more: false });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (files' shards, the error's text, or none when the set is complete).
    #[test]
    fn incomplete_or_mixed_sets_of_shards_are_named() {
        let check = |shards: &[(u64, u64)], expected: Option<&str>| {
            let named: Vec<(String, Shard)> = shards
                .iter()
                .enumerate()
                .map(|(i, &(index, count))| (format!("f{i}"), Shard { index, count }))
                .collect();
            let got = check_complete(&named).err().map(|e| e.to_string());
            assert_eq!(got.as_deref(), expected, "{shards:?}");
        };
        check(&[(1, 2), (0, 2)], None);
        check(&[], Some("no file holds shard 0/1"));
        check(&[(0, 3), (1, 3)], Some("no file holds shard 2/3"));
        check(&[(0, 3), (2, 3), (2, 3)], Some("f2: is shard 2/3, and so is f1"));
        check(
            &[(0, 2), (0, 3)],
            Some("f1: is shard 0/3, but f0 is shard 0/2: the files come from different splits"),
        );
        check(
            &[(0, 20)],
            Some("no file holds shards 1/20, 2/20, 3/20, 4/20, 5/20, 6/20, 7/20, 8/20, 9/20, 10/20, ..."),
        );
    }
}
