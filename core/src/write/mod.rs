//! WRITE mode's transfer plan: which decode ranks a prefill rank writes, which of its KV heads
//! land where, and how many writers each decode rank waits for.
//!
//! In WRITE mode the prefill side pushes: once the decode side has allocated its blocks and
//! said so (`remote_blocks`), every prefill TP rank of the request's DP group writes its share
//! of each layer into the decode blocks and then tells each decode rank it wrote (`write_done`).
//! A decode rank has its KV once every writer it waits for has reported.
//!
//! When the TP sizes differ, vLLM (from 0.33, `compute_write_tp_mapping`) pairs the ranks as
//! follows, and [`write_plan`] does the same:
//!
//! * decode TP larger (fan-out, ratio `r`): prefill rank `p` feeds decode ranks `p·r … p·r+r-1`,
//!   each with the heads that decode rank holds (a whole copy of MLA's latent or of a replicated
//!   head; a slice of split heads);
//! * prefill TP larger (fan-in, ratio `r`): decode rank `d` is fed by prefill ranks
//!   `d·r … d·r+r-1`. Split heads are gathered, each writer placing its heads at their offset.
//!   Copies that several of those prefill ranks hold identically (MLA's latent, a replicated
//!   head) are written once. vLLM lets the first holder write them
//!   ([`WriteRule::FirstHolder`]), so with MLA every write of a TP8 prefill engine to a TP1
//!   decode rank leaves through TP rank 0's NIC. pdkv's rule ([`WriteRule::SpreadHolders`])
//!   lets the request's transfer id pick the holder, so the writes of many requests leave
//!   through every holder's NIC. Both send the decode rank the same number of `write_done`s,
//!   carried in the message (`num_writers`), so a vLLM decode rank takes either.
//!
//! Heads follow vLLM's sharding: with `tp_size <= kv_heads` rank `i` holds heads
//! `[i·n, (i+1)·n)` with `n = kv_heads / tp_size`; with more ranks than heads every rank holds
//! the single head `i·kv_heads / tp_size`. MLA counts as one head every rank holds.
//!
//! Releases before 0.33 have no mapping: prefill rank `k` writes decode rank `k` and derives the
//! `write_done` port from its own TP rank, so the TP sizes must be equal
//! ([`WriteRule::SameRank`]).
//!
//! Two machines say when: [`send`], a prefill rank's (its writes, `write_done`, and the drain
//! before `write_failed` and the free), and [`recv`], a decode rank's (its writers' answers, and
//! the quarantine of a failed request's blocks while writes may still land).

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::policy::PeerRules;

pub mod recv;
pub mod send;

/// Who writes what, and when several prefill ranks hold an identical copy, which of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WriteRule {
    /// vLLM before 0.33: prefill TP rank `k` writes decode TP rank `k`, whole blocks; the TP
    /// sizes must be equal.
    #[serde(rename = "same-rank")]
    SameRank,
    /// vLLM 0.33 on: fan-out slices, fan-in gathers, and an identical copy is written by the
    /// first prefill rank of the decode rank's group that holds it.
    #[serde(rename = "first-holder")]
    FirstHolder,
    /// pdkv: as [`WriteRule::FirstHolder`], but the holder of an identical copy that writes it
    /// is picked by the request's transfer id ([`spread_key`]), the one value every TP rank of
    /// the group knows alike, so no two holders can disagree about who writes.
    #[serde(rename = "spread-holders")]
    SpreadHolders,
}

impl WriteRule {
    /// The rule a rule set's prefill engine writes by.
    pub fn of(rules: PeerRules) -> WriteRule {
        match rules {
            PeerRules::Pdkv => WriteRule::SpreadHolders,
            PeerRules::Vllm025
            | PeerRules::Vllm026
            | PeerRules::Vllm027
            | PeerRules::Vllm028
            | PeerRules::Vllm030 => WriteRule::SameRank,
            PeerRules::Vllm033 => WriteRule::FirstHolder,
        }
    }

    /// The rule a prefill engine writes a decode engine by. The prefill side writes, so its
    /// rules decide, except that a decode engine of a release before 0.33 takes one writer per
    /// rank and only its own TP index: a pdkv prefill engine adapts to it. A pdkv prefill engine
    /// may spread its writes to a vLLM 0.33 decode engine, which counts `num_writers` and does
    /// not ask who wrote.
    pub fn between(prefill: PeerRules, decode: PeerRules) -> WriteRule {
        let writer = WriteRule::of(prefill);
        if WriteRule::of(decode) == WriteRule::SameRank {
            WriteRule::SameRank
        } else {
            writer
        }
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            WriteRule::SameRank => "same-rank",
            WriteRule::FirstHolder => "first-holder",
            WriteRule::SpreadHolders => "spread-holders",
        }
    }
}

impl fmt::Display for WriteRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The sizes a WRITE plan depends on: both TP sizes and the model's KV heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WriteShape {
    /// TP size of the prefill (producer) engine.
    pub prefill_tp: u16,
    /// TP size of the decode (consumer) engine.
    pub decode_tp: u16,
    /// KV heads of the model (ignored with MLA, whose latent counts as one head).
    pub kv_heads: u16,
    /// Multi-head latent attention: one latent every rank holds whole.
    pub use_mla: bool,
    /// Recurrent (mamba) state beside attention: every prefill rank writes its slice of it, so
    /// every rank of a fan-in group writes.
    pub has_mamba: bool,
}

impl WriteShape {
    /// The heads a plan shards: 1 for MLA.
    fn heads(self) -> u16 {
        if self.use_mla {
            1
        } else {
            self.kv_heads
        }
    }
}

/// Why a prefill engine cannot write a decode engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteError {
    /// A TP size of zero.
    ZeroTp,
    /// Neither TP size is a multiple of the other.
    NotMultiple {
        /// Prefill TP size.
        prefill_tp: u16,
        /// Decode TP size.
        decode_tp: u16,
    },
    /// Unequal TP sizes and a model whose KV heads one of them cannot shard evenly.
    Unshardable {
        /// KV heads of the model.
        kv_heads: u16,
        /// The TP size that cannot hold them evenly.
        tp: u16,
    },
    /// Unequal TP sizes under a rule set that pairs ranks by TP index (vLLM before 0.33).
    UnequalTp {
        /// Prefill TP size.
        prefill_tp: u16,
        /// Decode TP size.
        decode_tp: u16,
    },
    /// A prefill TP rank outside its engine (a programmer error in a caller; typed so a table
    /// can show it).
    RankOutOfRange {
        /// The rank asked for.
        rank: u16,
        /// The prefill TP size.
        prefill_tp: u16,
    },
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteError::ZeroTp => f.write_str("TP sizes must be greater than 0"),
            WriteError::NotMultiple { prefill_tp, decode_tp } => write!(
                f,
                "prefill TP{prefill_tp} and decode TP{decode_tp}: WRITE needs one TP size to be a \
                 multiple of the other"
            ),
            WriteError::Unshardable { kv_heads, tp } => {
                write!(f, "WRITE cannot shard {kv_heads} KV heads over TP{tp}")
            }
            WriteError::UnequalTp { prefill_tp, decode_tp } => write!(
                f,
                "prefill TP{prefill_tp} and decode TP{decode_tp}: before vLLM 0.33 a WRITE goes \
                 from prefill TP rank k to decode TP rank k, so the TP sizes must be equal"
            ),
            WriteError::RankOutOfRange { rank, prefill_tp } => {
                write!(f, "prefill TP rank {rank} is outside TP{prefill_tp}")
            }
        }
    }
}

impl std::error::Error for WriteError {}

/// What one prefill rank writes into one decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteTarget {
    /// The decode TP rank written (within the request's decode DP group).
    pub decode_tp_rank: u16,
    /// First head of the prefill block copied (relative to the heads the prefill rank holds).
    pub local_head: u16,
    /// Where those heads land in the decode block (relative to the heads the decode rank holds).
    pub remote_head: u16,
    /// Heads copied; 0 when another prefill rank writes this identical copy (the rank still
    /// writes its recurrent-state slice).
    pub heads: u16,
    /// Which of `local_slices` equal slices of the prefill rank's recurrent state is sent.
    pub local_slice: u16,
    /// Equal slices the prefill rank's recurrent state is cut into.
    pub local_slices: u16,
    /// Which of `remote_slices` slots of the decode rank's recurrent state it lands in.
    pub remote_slice: u16,
    /// Slots the decode rank's recurrent state is cut into.
    pub remote_slices: u16,
    /// Prefill ranks writing into this decode rank, each sending one `write_done` that carries
    /// this count; the decode rank has its KV once all of them reported.
    pub writers: u16,
}

/// Every decode rank one prefill rank writes for one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WritePlan {
    /// Heads the prefill rank holds.
    pub local_heads: u16,
    /// Heads the first decode rank it feeds holds.
    pub remote_heads: u16,
    /// The decode ranks written, in TP order; empty when other prefill ranks write all this
    /// rank holds.
    pub targets: Vec<WriteTarget>,
}

impl WritePlan {
    /// Whether a decode block is a byte copy of the prefill block (no slicing or gathering).
    pub fn copies_whole_block(&self, target: &WriteTarget) -> bool {
        target.heads == self.local_heads && self.local_heads == self.remote_heads
    }

    /// The decode TP ranks written.
    pub fn decode_tp_ranks(&self) -> impl Iterator<Item = u16> + '_ {
        self.targets.iter().map(|t| t.decode_tp_rank)
    }
}

/// The heads TP rank `tp_rank` of `tp_size` holds of `heads` (vLLM's sharding).
pub fn rank_heads(tp_rank: u16, tp_size: u16, heads: u16) -> Range<u16> {
    if tp_size <= heads {
        let per_rank = heads / tp_size;
        tp_rank * per_rank..(tp_rank + 1) * per_rank
    } else {
        // u32: tp_rank · heads can pass u16 (rank 300 of 301 with 300 heads).
        let head = (u32::from(tp_rank) * u32::from(heads) / u32::from(tp_size)) as u16;
        head..head + 1
    }
}

/// Refuses a pair of TP sizes the rule cannot write, in vLLM's order of checks.
pub fn validate(shape: WriteShape, rule: WriteRule) -> Result<(), WriteError> {
    let (p, d) = (shape.prefill_tp, shape.decode_tp);
    if p == 0 || d == 0 {
        return Err(WriteError::ZeroTp);
    }
    if rule == WriteRule::SameRank {
        return if p == d { Ok(()) } else { Err(WriteError::UnequalTp { prefill_tp: p, decode_tp: d }) };
    }
    let (larger, smaller) = (p.max(d), p.min(d));
    if !larger.is_multiple_of(smaller) {
        return Err(WriteError::NotMultiple { prefill_tp: p, decode_tp: d });
    }
    if shape.use_mla || p == d {
        return Ok(());
    }
    let heads = shape.kv_heads;
    if heads == 0 {
        return Err(WriteError::Unshardable { kv_heads: 0, tp: p });
    }
    for tp in [p, d] {
        let uneven = if tp <= heads { !heads.is_multiple_of(tp) } else { !tp.is_multiple_of(heads) };
        if uneven {
            return Err(WriteError::Unshardable { kv_heads: heads, tp });
        }
    }
    Ok(())
}

/// A value every TP rank of a prefill group derives alike from a request: FNV-1a (64 bits) of
/// its transfer id. [`WriteRule::SpreadHolders`] picks the writing holder by it, so the pick
/// needs no message and survives a restart of any rank.
pub fn spread_key(transfer_id: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    transfer_id.bytes().fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

/// What prefill TP rank `prefill_tp_rank` writes, under `rule`, for a request whose
/// [`spread_key`] is `spread` (read only by [`WriteRule::SpreadHolders`]).
pub fn write_plan(
    shape: WriteShape,
    prefill_tp_rank: u16,
    rule: WriteRule,
    spread: u64,
) -> Result<WritePlan, WriteError> {
    validate(shape, rule)?;
    let (p, d) = (shape.prefill_tp, shape.decode_tp);
    if prefill_tp_rank >= p {
        return Err(WriteError::RankOutOfRange { rank: prefill_tp_rank, prefill_tp: p });
    }
    let heads = shape.heads();
    let local = rank_heads(prefill_tp_rank, p, heads);
    let first_remote = (u32::from(prefill_tp_rank) * u32::from(d) / u32::from(p)) as u16;
    let remote_heads = rank_heads(first_remote, d, heads).len() as u16;
    let targets = if d >= p {
        fan_out(shape, prefill_tp_rank, &local)
    } else {
        fan_in(shape, prefill_tp_rank, &local, rule, spread)
    };
    Ok(WritePlan { local_heads: local.len() as u16, remote_heads, targets })
}

fn fan_out(shape: WriteShape, rank: u16, local: &Range<u16>) -> Vec<WriteTarget> {
    let ratio = shape.decode_tp / shape.prefill_tp;
    (0..ratio)
        .map(|j| {
            let decode_tp_rank = rank * ratio + j;
            let remote = rank_heads(decode_tp_rank, shape.decode_tp, shape.heads());
            WriteTarget {
                decode_tp_rank,
                local_head: remote.start - local.start,
                remote_head: 0,
                heads: remote.len() as u16,
                local_slice: j,
                local_slices: ratio,
                remote_slice: 0,
                remote_slices: 1,
                writers: 1,
            }
        })
        .collect()
}

fn fan_in(
    shape: WriteShape,
    rank: u16,
    local: &Range<u16>,
    rule: WriteRule,
    spread: u64,
) -> Vec<WriteTarget> {
    let (p, heads) = (shape.prefill_tp, shape.heads());
    let ratio = p / shape.decode_tp;
    let decode_tp_rank = rank / ratio;
    let remote = rank_heads(decode_tp_rank, shape.decode_tp, heads);
    let group = decode_tp_rank * ratio..(decode_tp_rank + 1) * ratio;
    let start_of = |q: u16| rank_heads(q, p, heads).start;
    // The ranks of the group holding this rank's heads, identically.
    let holders: Vec<u16> = group.clone().filter(|&q| start_of(q) == local.start).collect();
    let writer = match rule {
        WriteRule::SpreadHolders => holders[(spread % holders.len() as u64) as usize],
        WriteRule::SameRank | WriteRule::FirstHolder => holders[0],
    };
    let writes_attention = writer == rank;
    if !writes_attention && !shape.has_mamba {
        return Vec::new();
    }
    // One writer per distinct copy, or every rank when each sends a recurrent-state slice.
    let writers = group
        .clone()
        .filter(|&q| shape.has_mamba || !(group.start..q).any(|o| start_of(o) == start_of(q)))
        .count();
    vec![WriteTarget {
        decode_tp_rank,
        local_head: 0,
        remote_head: local.start - remote.start,
        heads: if writes_attention { local.len() as u16 } else { 0 },
        local_slice: 0,
        local_slices: 1,
        remote_slice: rank % ratio,
        remote_slices: ratio,
        writers: writers as u16,
    }]
}

/// The prefill TP ranks that write decode TP rank `decode_tp_rank` of a request, in rank order,
/// with the target each writes there. The writers' `writers` fields all equal the list's length.
pub fn writers_of(
    shape: WriteShape,
    decode_tp_rank: u16,
    rule: WriteRule,
    spread: u64,
) -> Result<Vec<(u16, WriteTarget)>, WriteError> {
    let mut out = Vec::new();
    for p in 0..shape.prefill_tp {
        let plan = write_plan(shape, p, rule, spread)?;
        out.extend(plan.targets.into_iter().filter(|t| t.decode_tp_rank == decode_tp_rank).map(|t| (p, t)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(prefill_tp: u16, decode_tp: u16, kv_heads: u16, use_mla: bool) -> WriteShape {
        WriteShape { prefill_tp, decode_tp, kv_heads, use_mla, has_mamba: false }
    }

    /// (decode rank, local head, remote head, heads, writers) of each target.
    fn targets(s: WriteShape, rank: u16, rule: WriteRule, spread: u64) -> Vec<(u16, u16, u16, u16, u16)> {
        write_plan(s, rank, rule, spread)
            .unwrap()
            .targets
            .iter()
            .map(|t| (t.decode_tp_rank, t.local_head, t.remote_head, t.heads, t.writers))
            .collect()
    }

    #[test]
    fn rank_heads_table() {
        let check = |rank, size, heads, expected: Range<u16>| {
            assert_eq!(rank_heads(rank, size, heads), expected, "rank {rank} of {size}, {heads} heads");
        };
        check(0, 4, 8, 0..2);
        check(3, 4, 8, 6..8);
        check(5, 8, 8, 5..6);
        check(5, 16, 8, 2..3);
        check(15, 16, 8, 7..8);
        check(0, 1, 1, 0..1);
        check(65534, 65535, 65535, 65534..65535);
        check(65534, 65535, 300, 299..300);
    }

    #[test]
    fn plans_table() {
        let first = WriteRule::FirstHolder;
        // Fan-out of split heads: TP4 (2 heads each) into TP8 (1 head each), a slice each.
        let gqa = shape(4, 8, 8, false);
        assert_eq!(targets(gqa, 1, first, 0), [(2, 0, 0, 1, 1), (3, 1, 0, 1, 1)]);
        // Fan-in of split heads: TP8 into TP4, each writer at its offset, two writers.
        let gqa = shape(8, 4, 8, false);
        assert_eq!(targets(gqa, 3, first, 0), [(1, 0, 1, 1, 2)]);
        // Fan-in of MLA: only the first rank of the group writes.
        let mla = shape(8, 1, 1, true);
        assert_eq!(targets(mla, 0, first, 0), [(0, 0, 0, 1, 1)]);
        assert!(targets(mla, 1, first, 0).is_empty());
        // Fan-in of replicated heads (TP16 over 8 heads into TP4): pairs hold a head alike.
        let replicated = shape(16, 4, 8, false);
        assert_eq!(targets(replicated, 4, first, 0), [(1, 0, 0, 1, 2)]);
        assert!(targets(replicated, 5, first, 0).is_empty());
        assert_eq!(targets(replicated, 6, first, 0), [(1, 0, 1, 1, 2)]);
        // Fan-out of MLA: whole copies to every decode rank of the group.
        assert_eq!(targets(shape(1, 8, 1, true), 0, first, 0).len(), 8);
        // Equal sizes: rank k to rank k, whole.
        let same = shape(8, 8, 8, false);
        for rule in [WriteRule::SameRank, first, WriteRule::SpreadHolders] {
            assert_eq!(targets(same, 5, rule, 7), [(5, 0, 0, 1, 1)]);
        }
    }

    #[test]
    fn mamba_makes_every_fan_in_rank_write() {
        let s = WriteShape { has_mamba: true, ..shape(8, 2, 1, true) };
        let plan = write_plan(s, 1, WriteRule::FirstHolder, 0).unwrap();
        assert_eq!(plan.targets.len(), 1);
        let t = plan.targets[0];
        assert_eq!((t.decode_tp_rank, t.heads, t.remote_slice, t.remote_slices, t.writers), (0, 0, 1, 4, 4));
    }

    /// Spreading moves who writes a copy, never how many write a decode rank: a vLLM decode
    /// rank counting `num_writers` cannot tell the rules apart.
    #[test]
    fn spreading_keeps_every_decode_rank_s_writer_count() {
        for (p, d, heads, mla) in [(8, 1, 1, true), (16, 4, 8, false), (8, 2, 8, false), (4, 8, 8, false)] {
            let s = shape(p, d, heads, mla);
            for spread in 0..40 {
                for rank in 0..d {
                    let first = writers_of(s, rank, WriteRule::FirstHolder, spread).unwrap();
                    let spread_writers = writers_of(s, rank, WriteRule::SpreadHolders, spread).unwrap();
                    assert_eq!(first.len(), spread_writers.len(), "{s:?} rank {rank}");
                    assert!(spread_writers
                        .iter()
                        .all(|(_, t)| usize::from(t.writers) == spread_writers.len()));
                    let heads = |w: &[(u16, WriteTarget)]| w.iter().map(|(_, t)| t.heads).sum::<u16>();
                    assert_eq!(heads(&first), heads(&spread_writers), "{s:?} rank {rank}");
                }
            }
        }
    }

    /// With MLA and TP8 into TP1, vLLM's rule leaves every write to rank 0, pdkv's spreads them.
    #[test]
    fn spread_holders_use_every_nic() {
        let s = shape(8, 1, 1, true);
        let mut per_rank = [[0u32; 8]; 2];
        for k in 0..800 {
            let key = spread_key(&format!("transfer-{k}"));
            for (i, rule) in [WriteRule::FirstHolder, WriteRule::SpreadHolders].into_iter().enumerate() {
                for (p, _) in writers_of(s, 0, rule, key).unwrap() {
                    per_rank[i][usize::from(p)] += 1;
                }
            }
        }
        assert_eq!(per_rank[0], [800, 0, 0, 0, 0, 0, 0, 0]);
        assert!(per_rank[1].iter().all(|&n| (70..=130).contains(&n)), "{:?}", per_rank[1]);
    }

    #[test]
    fn refusals_table() {
        let check = |s: WriteShape, rule, expected: WriteError| {
            assert_eq!(write_plan(s, 0, rule, 0).unwrap_err(), expected, "{s:?} {rule}");
        };
        let first = WriteRule::FirstHolder;
        check(shape(0, 4, 8, false), first, WriteError::ZeroTp);
        check(shape(4, 6, 8, false), first, WriteError::NotMultiple { prefill_tp: 4, decode_tp: 6 });
        check(shape(4, 8, 6, false), first, WriteError::Unshardable { kv_heads: 6, tp: 4 });
        check(shape(1, 4, 3, false), first, WriteError::Unshardable { kv_heads: 3, tp: 4 });
        check(
            shape(8, 1, 1, true),
            WriteRule::SameRank,
            WriteError::UnequalTp { prefill_tp: 8, decode_tp: 1 },
        );
        assert_eq!(
            write_plan(shape(4, 4, 8, false), 4, first, 0).unwrap_err(),
            WriteError::RankOutOfRange { rank: 4, prefill_tp: 4 }
        );
        // MLA and equal sizes are never refused for their heads.
        assert!(write_plan(shape(4, 8, 3, true), 0, first, 0).is_ok());
        assert!(write_plan(shape(4, 4, 3, false), 0, first, 0).is_ok());
    }

    #[test]
    fn rules_between_engines() {
        let check = |p: PeerRules, d: PeerRules, expected: WriteRule| {
            assert_eq!(WriteRule::between(p, d), expected, "{p} -> {d}");
        };
        check(PeerRules::Pdkv, PeerRules::Pdkv, WriteRule::SpreadHolders);
        check(PeerRules::Pdkv, PeerRules::Vllm033, WriteRule::SpreadHolders);
        check(PeerRules::Vllm033, PeerRules::Pdkv, WriteRule::FirstHolder);
        check(PeerRules::Pdkv, PeerRules::Vllm030, WriteRule::SameRank);
        check(PeerRules::Vllm027, PeerRules::Pdkv, WriteRule::SameRank);
    }

    #[test]
    fn spread_key_is_fnv1a() {
        assert_eq!(spread_key(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(spread_key("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
