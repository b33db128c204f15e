//! The reads a foreign decode side plans, judged against the prefill process that holds the KV.
//!
//! A foreign decode side cannot read here (MoRI's data plane does not run on this host), so its
//! driver reports, for every read its code plans, the block ids and the session the read would
//! go through: the peer's engine descriptor (the handshake's `agent_metadata`) and the memory
//! descriptors of the sessions it built from the handshake's layer map. Every pdkv prefill
//! process hands out descriptors of its own life (a new data-plane address, new region bases),
//! so those bytes name exactly one process: a rank and a life. The read is then judged against
//! the life whose process computed the transfer's KV on that rank (the holder): through the
//! holder's live session it reads the right bytes; through a later life's session it reads the
//! old transfer's block ids in the new process's memory, free there or another request's (a
//! stale read: on hardware, wrong KV and no error); through the session of a process that died,
//! it reads memory that is gone and fails.

use std::collections::BTreeMap;
use std::fmt;

use pdkv_core::ids::{Incarnation, RankId};
use serde::Serialize;

/// Most reads described one by one in the report; the counters count them all.
pub const MAX_READ_NOTES: usize = 20;

/// The descriptors one prefill process handed out in its handshake reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Life {
    /// The incarnation it drew (`None` for a data-plane-only rank, whose engine names none).
    pub(super) incarnation: Option<Incarnation>,
    /// Its handshake metadata's `agent_metadata` (pdkv's data-plane descriptor).
    pub(super) engine_desc: Vec<u8>,
    /// Its layers' memory descriptors, every layer's.
    pub(super) memory_descs: Vec<Vec<u8>>,
}

/// A read as the foreign decode code planned it, its bytes decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// The prefill rank the code reads (the owner DP rank and the TP rank it chose).
    pub(super) source: RankId,
    /// The block ids it reads there, every KV cache group in order.
    pub(super) block_ids: Vec<u64>,
    /// The engine descriptor its session holds for that rank.
    pub(super) engine_desc: Vec<u8>,
    /// The remote memory descriptors of the sessions it reads through, one per layer region.
    pub(super) memory_descs: Vec<Vec<u8>>,
}

/// Why a plan names no read of the transfer's blocks through one process of the source rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Mismatch {
    /// The engine descriptor is no pdkv prefill process's.
    UnknownEngineDesc,
    /// A memory descriptor is no process's, or not the engine descriptor's process's.
    MemoryDescsElsewhere {
        /// The life the engine descriptor names.
        engine_life: u32,
    },
    /// The descriptors are another rank's than the one the plan reads.
    OtherRank {
        /// Whose descriptors they are.
        descs_of: RankId,
    },
    /// The block ids are not the transfer's.
    OtherBlocks {
        /// What the transfer holds.
        held: Vec<u32>,
    },
    /// No life of the source rank is recorded as the transfer's holder.
    HolderUnknown,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::UnknownEngineDesc => f.write_str("its engine descriptor is no pdkv prefill process's"),
            Mismatch::MemoryDescsElsewhere { engine_life } => write!(
                f,
                "its memory descriptors are not all of the process (life {engine_life}) its engine \
                 descriptor names"
            ),
            Mismatch::OtherRank { descs_of } => write!(f, "its descriptors are {descs_of}'s"),
            Mismatch::OtherBlocks { held } => write!(f, "its block ids are not the transfer's {held:?}"),
            Mismatch::HolderUnknown => {
                f.write_str("no process of the source rank is known to hold the transfer")
            }
        }
    }
}

/// Where a planned read would go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ReadVerdict {
    /// Through the live session of the process holding the KV: the right bytes.
    Holder {
        /// The life that holds the KV and whose session the read goes through.
        life: u32,
    },
    /// Through the live session of another life of the rank than the holder's: the transfer's
    /// block ids in memory that never held its KV.
    Stale {
        /// The life that holds the KV.
        holder_life: u32,
        /// The life whose session the read goes through.
        session_life: u32,
    },
    /// Through the session of a process that is no longer running: the memory is gone.
    DeadSession {
        /// The life that holds the KV.
        holder_life: u32,
        /// The life whose session the read goes through.
        session_life: u32,
    },
    /// Not a read of the transfer's blocks through one process of the source rank.
    Unmatched(Mismatch),
}

/// The process (rank, life) whose descriptors these are, if exactly one's.
fn process_of(
    lives: &BTreeMap<(RankId, u32), Life>,
    engine_desc: &[u8],
    memory_descs: &[Vec<u8>],
) -> Result<(RankId, u32), Mismatch> {
    let (&(rank, life), record) =
        lives.iter().find(|(_, l)| l.engine_desc == engine_desc).ok_or(Mismatch::UnknownEngineDesc)?;
    if memory_descs.is_empty() || !memory_descs.iter().all(|d| record.memory_descs.contains(d)) {
        return Err(Mismatch::MemoryDescsElsewhere { engine_life: life });
    }
    Ok((rank, life))
}

/// Judges one planned read of a transfer that holds `held` blocks, computed on the source rank
/// by the process of incarnation `holder`; `live` is the life of the source rank's running
/// process when the plan was made (`None` while the rank is down).
pub(super) fn judge(
    plan: &Plan,
    held: &[u32],
    holder: Option<Incarnation>,
    lives: &BTreeMap<(RankId, u32), Life>,
    live: Option<u32>,
) -> ReadVerdict {
    let (rank, session_life) = match process_of(lives, &plan.engine_desc, &plan.memory_descs) {
        Ok(process) => process,
        Err(mismatch) => return ReadVerdict::Unmatched(mismatch),
    };
    if rank != plan.source {
        return ReadVerdict::Unmatched(Mismatch::OtherRank { descs_of: rank });
    }
    if !plan.block_ids.iter().copied().eq(held.iter().map(|&b| u64::from(b))) {
        return ReadVerdict::Unmatched(Mismatch::OtherBlocks { held: held.to_vec() });
    }
    let holder_life = lives
        .iter()
        .find(|((r, _), l)| *r == rank && holder.is_some() && l.incarnation == holder)
        .map(|((_, life), _)| *life);
    let Some(holder_life) = holder_life else {
        return ReadVerdict::Unmatched(Mismatch::HolderUnknown);
    };
    if live != Some(session_life) {
        ReadVerdict::DeadSession { holder_life, session_life }
    } else if session_life == holder_life {
        ReadVerdict::Holder { life: holder_life }
    } else {
        ReadVerdict::Stale { holder_life, session_life }
    }
}

/// What the foreign decode side's planned reads would have done, for the result.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ForeignReads {
    /// Reads the driver reported planning.
    pub planned: u64,
    /// Through the live session of the process that holds the KV.
    pub through_holder: u64,
    /// Stale: an older life's transfer through a later life's live session (wrong KV, silently,
    /// on hardware).
    pub stale: u64,
    /// Through the session of a process that had died (the read fails on hardware).
    pub through_dead_session: u64,
    /// Not a read of the transfer's blocks through one process of the rank read
    /// (`notes` says why).
    pub unmatched: u64,
    /// For each foreign decode rank and the prefill rank it read (`D0.dp0.tp1 -> P0.dp0.tp1`),
    /// the lives of the prefill rank whose sessions its reads went through, in the order first
    /// used: one entry for a decode rank that never handshook again.
    pub sessions: BTreeMap<String, Vec<u32>>,
    /// Reads by the prefill rank read, the life that held the transfer there and the life whose
    /// session they went through (`P0.dp0.tp1: held by life 0, read through life 1`), unmatched
    /// ones left out.
    pub by_lives: BTreeMap<String, u64>,
    /// The first [`MAX_READ_NOTES`] reads that did not go through the holder's live session.
    pub notes: Vec<String>,
}

impl ForeignReads {
    /// Counts one judged read by `reader` of `transfer` on `source`.
    pub(super) fn count(&mut self, reader: RankId, source: RankId, transfer: &str, verdict: &ReadVerdict) {
        self.planned += 1;
        let lives = match *verdict {
            ReadVerdict::Holder { life } => Some((life, life)),
            ReadVerdict::Stale { holder_life, session_life }
            | ReadVerdict::DeadSession { holder_life, session_life } => Some((holder_life, session_life)),
            ReadVerdict::Unmatched(_) => None,
        };
        let note = match verdict {
            ReadVerdict::Holder { .. } => {
                self.through_holder += 1;
                None
            }
            ReadVerdict::Stale { holder_life, session_life } => {
                self.stale += 1;
                Some(format!(
                    "{reader} read {transfer} (held by {source} life {holder_life}) through the session of \
                     life {session_life}: stale"
                ))
            }
            ReadVerdict::DeadSession { holder_life, session_life } => {
                self.through_dead_session += 1;
                Some(format!(
                    "{reader} read {transfer} (held by {source} life {holder_life}) through the session of \
                     life {session_life}, whose process had died"
                ))
            }
            ReadVerdict::Unmatched(why) => {
                self.unmatched += 1;
                Some(format!("{reader} planned a read of {transfer} on {source}: {why}"))
            }
        };
        if let Some(note) = note.filter(|_| self.notes.len() < MAX_READ_NOTES) {
            self.notes.push(note);
        }
        if let Some((holder, session)) = lives {
            let used = self.sessions.entry(format!("{reader} -> {source}")).or_default();
            if !used.contains(&session) {
                used.push(session);
            }
            *self
                .by_lives
                .entry(format!("{source}: held by life {holder}, read through life {session}"))
                .or_default() += 1;
        }
    }

    /// The result's problem line for reads that went anywhere but the holder's live session.
    pub(super) fn problem(&self) -> Option<String> {
        (self.stale + self.through_dead_session + self.unmatched > 0).then(|| {
            format!(
                "foreign decode planned {} reads: {} through the holder's live session, {} stale (an old \
                 life's blocks through a later life's session), {} through a dead process's session, {} \
                 unmatched (see foreign.reads)",
                self.planned, self.through_holder, self.stale, self.through_dead_session, self.unmatched
            )
        })
    }
}

/// Bytes from lowercase or uppercase hex, or what is wrong with the text.
pub(super) fn unhex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) {
        return Err(format!("{} hex digits, an odd number", text.len()));
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            // from_str_radix alone would take a sign ("+1").
            text.get(i..i + 2)
                .filter(|pair| pair.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(|| format!("not hex at character {i}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::EngineId;

    fn rank(tp: u16) -> RankId {
        RankId::new(EngineId::prefill(0), 0, tp)
    }

    fn inc(n: u64) -> Option<Incarnation> {
        Incarnation::new(n)
    }

    /// Ranks tp0 (life 0) and tp1 (lives 0 and 1), each life with its own descriptors.
    fn lives() -> BTreeMap<(RankId, u32), Life> {
        let life = |tag: u8, incarnation| Life {
            incarnation,
            engine_desc: vec![tag],
            memory_descs: vec![vec![tag, 0], vec![tag, 1]],
        };
        BTreeMap::from([
            ((rank(0), 0), life(10, inc(7))),
            ((rank(1), 0), life(20, inc(8))),
            ((rank(1), 1), life(21, inc(9))),
        ])
    }

    fn plan(source: u16, tag: u8) -> Plan {
        Plan {
            source: rank(source),
            block_ids: vec![3, 4],
            engine_desc: vec![tag],
            memory_descs: vec![vec![tag, 0], vec![tag, 1]],
        }
    }

    #[test]
    fn a_read_is_judged_by_the_process_its_descriptors_name() {
        let lives = lives();
        let check = |plan: &Plan, holder, live, expected: ReadVerdict| {
            assert_eq!(judge(plan, &[3, 4], holder, &lives, live), expected, "{plan:?} {holder:?} {live:?}");
        };
        // The holder's live session.
        check(&plan(0, 10), inc(7), Some(0), ReadVerdict::Holder { life: 0 });
        check(&plan(1, 21), inc(9), Some(1), ReadVerdict::Holder { life: 1 });
        // The old life's transfer through the new life's live session: stale.
        check(&plan(1, 21), inc(8), Some(1), ReadVerdict::Stale { holder_life: 0, session_life: 1 });
        // The old life's session after it died: of the old transfer, or of a new one.
        check(&plan(1, 20), inc(8), Some(1), ReadVerdict::DeadSession { holder_life: 0, session_life: 0 });
        check(&plan(1, 20), inc(9), Some(1), ReadVerdict::DeadSession { holder_life: 1, session_life: 0 });
        check(&plan(1, 20), inc(8), None, ReadVerdict::DeadSession { holder_life: 0, session_life: 0 });
        // Descriptors of nobody, of two processes, of another rank; other blocks; no holder.
        check(&plan(1, 99), inc(8), Some(1), ReadVerdict::Unmatched(Mismatch::UnknownEngineDesc));
        let mut mixed = plan(1, 21);
        mixed.memory_descs[1] = vec![20, 1];
        check(
            &mixed,
            inc(9),
            Some(1),
            ReadVerdict::Unmatched(Mismatch::MemoryDescsElsewhere { engine_life: 1 }),
        );
        let mut none = plan(1, 21);
        none.memory_descs.clear();
        check(
            &none,
            inc(9),
            Some(1),
            ReadVerdict::Unmatched(Mismatch::MemoryDescsElsewhere { engine_life: 1 }),
        );
        check(
            &plan(1, 10),
            inc(7),
            Some(0),
            ReadVerdict::Unmatched(Mismatch::OtherRank { descs_of: rank(0) }),
        );
        let mut blocks = plan(1, 21);
        blocks.block_ids = vec![3, 5];
        check(&blocks, inc(9), Some(1), ReadVerdict::Unmatched(Mismatch::OtherBlocks { held: vec![3, 4] }));
        check(&plan(1, 21), inc(1), Some(1), ReadVerdict::Unmatched(Mismatch::HolderUnknown));
        check(&plan(1, 21), None, Some(1), ReadVerdict::Unmatched(Mismatch::HolderUnknown));
    }

    #[test]
    fn reads_are_counted_with_the_sessions_each_reader_used() {
        let mut reads = ForeignReads::default();
        let reader = RankId::new(EngineId::decode(0), 0, 1);
        reads.count(reader, rank(1), "tx-a", &ReadVerdict::Holder { life: 0 });
        reads.count(reader, rank(1), "tx-b", &ReadVerdict::DeadSession { holder_life: 1, session_life: 0 });
        reads.count(reader, rank(1), "tx-c", &ReadVerdict::Stale { holder_life: 0, session_life: 1 });
        reads.count(reader, rank(1), "tx-d", &ReadVerdict::Unmatched(Mismatch::HolderUnknown));
        assert_eq!(
            (reads.planned, reads.through_holder, reads.stale, reads.through_dead_session, reads.unmatched),
            (4, 1, 1, 1, 1)
        );
        // Life 0 first (the holder's, then the dead one), life 1 later; the unmatched read names none.
        assert_eq!(reads.sessions, BTreeMap::from([("D0.dp0.tp1 -> P0.dp0.tp1".to_string(), vec![0, 1])]));
        let by_lives: Vec<(&str, u64)> = reads.by_lives.iter().map(|(k, &n)| (k.as_str(), n)).collect();
        assert_eq!(
            by_lives,
            [
                ("P0.dp0.tp1: held by life 0, read through life 0", 1),
                ("P0.dp0.tp1: held by life 0, read through life 1", 1),
                ("P0.dp0.tp1: held by life 1, read through life 0", 1),
            ]
        );
        assert_eq!(
            reads.notes,
            [
                "D0.dp0.tp1 read tx-b (held by P0.dp0.tp1 life 1) through the session of life 0, whose \
                 process had died",
                "D0.dp0.tp1 read tx-c (held by P0.dp0.tp1 life 0) through the session of life 1: stale",
                "D0.dp0.tp1 planned a read of tx-d on P0.dp0.tp1: no process of the source rank is known \
                 to hold the transfer",
            ]
        );
        assert!(reads.problem().is_some_and(|p| p.starts_with("foreign decode planned 4 reads: 1 through")));
        assert_eq!(ForeignReads { planned: 3, through_holder: 3, ..ForeignReads::default() }.problem(), None);
    }

    #[test]
    fn hex_is_read_strictly() {
        assert_eq!(unhex("00ffA0"), Ok(vec![0, 255, 160]));
        assert_eq!(unhex(""), Ok(vec![]));
        assert_eq!(unhex("abc"), Err("3 hex digits, an odd number".into()));
        assert_eq!(unhex("zz"), Err("not hex at character 0".into()));
        assert_eq!(unhex("0é"), Err("3 hex digits, an odd number".into()));
        assert_eq!(unhex("+1"), Err("not hex at character 0".into()));
    }
}
