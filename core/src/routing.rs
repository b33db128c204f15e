//! Read-source resolution on the decode side: which prefill rank each decode worker reads.
//!
//! The rules follow MoRIIO: read the request's owner DP rank; use the flexible round-robin when
//! a TP1 decode worker reads TP-replicated MLA KV from a DP1 prefill engine; otherwise map TP
//! ranks by the ratio of the TP sizes; refuse pairs that would split KV heads. The result is one
//! [`Source`] from which every address of the read is derived (see `ports::ReadTarget`).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, RankId};
use crate::policy::{FlexibleReads, Policy, ReadOwner};
use crate::topology::{Layout, ModelSpec};

/// Why a decode worker cannot read from a prefill engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub enum RoutingError {
    /// A DP or TP size of zero (from a peer's parameters).
    ZeroSize {
        /// Which size, e.g. `prefill TP size`.
        what: String,
    },
    /// TP sizes where neither divides the other.
    NotMultiple {
        /// Decode TP size (W).
        decode_tp: u16,
        /// Prefill TP size (Tp).
        prefill_tp: u16,
    },
    /// Unequal TP sizes with fewer ranks than KV heads on one side: reads would split heads.
    RequiresReplicatedHeads {
        /// Decode TP size (W).
        decode_tp: u16,
        /// Prefill TP size (Tp).
        prefill_tp: u16,
        /// KV heads of the model, more than `min(W, Tp)`.
        kv_heads: u16,
    },
    /// The request names an owner DP rank the prefill engine does not have.
    OwnerOutOfRange {
        /// The owner DP rank asked for (`remote_dp_rank`).
        owner_dp: u16,
        /// DP size of the prefill engine.
        prefill_dp: u16,
    },
}

impl fmt::Display for RoutingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RoutingError::ZeroSize { what } => write!(f, "{what} must be greater than 0"),
            RoutingError::NotMultiple { decode_tp, prefill_tp } => write!(
                f,
                "decode TP{decode_tp} and prefill TP{prefill_tp}: one TP size must be a multiple \
                 of the other"
            ),
            RoutingError::RequiresReplicatedHeads { decode_tp, prefill_tp, kv_heads } => write!(
                f,
                "decode TP{decode_tp} and prefill TP{prefill_tp} with {kv_heads} KV heads: \
                 heterogeneous TP requires replicated KV heads (replicated KV heads are required \
                 on every rank: min(TP) >= kv_heads, or MLA); reads would split heads"
            ),
            RoutingError::OwnerOutOfRange { owner_dp, prefill_dp } => {
                write!(f, "remote_dp_rank {owner_dp} is outside the prefill engine's DP size {prefill_dp}")
            }
        }
    }
}

impl std::error::Error for RoutingError {}

/// True when a decode worker uses the flexible round-robin: it is on (`rule`), and decode TP
/// world size 1, MLA, prefill DP size 1 and prefill TP size above 1. The router and the quorum
/// plan both ask here, so the rank read and the rank that waits for its release cannot disagree.
pub fn is_flexible(decode_tp: u16, use_mla: bool, prefill: Layout, rule: FlexibleReads) -> bool {
    match rule {
        FlexibleReads::RoundRobin => decode_tp == 1 && use_mla && prefill.dp == 1 && prefill.tp > 1,
        FlexibleReads::Off => false,
    }
}

/// The fixed TP mapping: equal sizes map r to r; a larger prefill spreads decode ranks
/// (`r * Tp / W`); a larger decode folds them (`r / (W / Tp)`).
pub fn fixed_tp_source(decode_tp: u16, decode_tp_rank: u16, prefill_tp: u16) -> Result<u16, RoutingError> {
    check_sizes(decode_tp, prefill_tp)?;
    debug_assert!(decode_tp_rank < decode_tp, "tp rank {decode_tp_rank} of TP{decode_tp}");
    Ok(if decode_tp == prefill_tp {
        decode_tp_rank
    } else if prefill_tp > decode_tp {
        decode_tp_rank * (prefill_tp / decode_tp)
    } else {
        decode_tp_rank / (decode_tp / prefill_tp)
    })
}

fn check_sizes(decode_tp: u16, prefill_tp: u16) -> Result<(), RoutingError> {
    if decode_tp == 0 {
        return Err(RoutingError::ZeroSize { what: "decode TP size".into() });
    }
    if prefill_tp == 0 {
        return Err(RoutingError::ZeroSize { what: "prefill TP size".into() });
    }
    let (big, small) = (decode_tp.max(prefill_tp), decode_tp.min(prefill_tp));
    if big % small != 0 {
        return Err(RoutingError::NotMultiple { decode_tp, prefill_tp });
    }
    Ok(())
}

/// The head-splitting guard: MLA or equal TP sizes pass; otherwise both sides must hold whole,
/// replicated heads (`min(W, Tp) >= kv_heads`). MoRIIO never splits heads.
pub fn check_heads(decode_tp: u16, prefill_tp: u16, model: &ModelSpec) -> Result<(), RoutingError> {
    if model.use_mla || decode_tp == prefill_tp {
        return Ok(());
    }
    if decode_tp.min(prefill_tp) >= model.kv_heads {
        return Ok(());
    }
    Err(RoutingError::RequiresReplicatedHeads { decode_tp, prefill_tp, kv_heads: model.kv_heads })
}

/// Checks that a decode engine can read a prefill engine at all (sizes, multiples, heads),
/// without choosing a rank.
pub fn check_pair(decode: Layout, prefill: Layout, model: &ModelSpec) -> Result<(), RoutingError> {
    if prefill.dp == 0 {
        return Err(RoutingError::ZeroSize { what: "prefill DP size".into() });
    }
    check_sizes(decode.tp, prefill.tp)?;
    check_heads(decode.tp, prefill.tp, model)
}

/// The prefill rank a read goes to, and whether the flexible rule chose it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// The prefill rank to read; the session key, handshake target and release target all derive
    /// from it.
    pub rank: RankId,
    /// The flexible round-robin chose the rank (and advanced the worker's counter).
    pub flexible: bool,
}

/// Per-decode-worker routing state: who the worker is and its flexible-read counter.
#[derive(Clone, Debug, Hash)]
pub struct ReadRouter {
    local: RankId,
    local_layout: Layout,
    model: ModelSpec,
    policy: Policy,
    /// Flexible reads made so far (the k of `(d + k) mod Tp`); one counter per worker.
    flexible_reads: u64,
}

impl ReadRouter {
    /// The router of decode worker `local`, whose engine has `local_layout`, with its flexible
    /// counter at 0. Panics if `local` lies outside `local_layout`.
    pub fn new(local: RankId, local_layout: Layout, model: ModelSpec, policy: Policy) -> ReadRouter {
        assert!(local.dp < local_layout.dp && local.tp < local_layout.tp, "{local} outside {local_layout}");
        ReadRouter { local, local_layout, model, policy, flexible_reads: 0 }
    }

    /// The decode worker this router resolves reads for.
    pub fn local(&self) -> RankId {
        self.local
    }

    /// Flexible reads resolved so far; the next one uses this value as k.
    pub fn flexible_reads(&self) -> u64 {
        self.flexible_reads
    }

    /// Chooses the source rank for one request: `prefill` is the remote engine and the DP and TP
    /// sizes its parameters announced, `owner_dp` the request's `remote_dp_rank`.
    pub fn resolve(
        &mut self,
        prefill: EngineId,
        prefill_layout: Layout,
        owner_dp: Option<u16>,
    ) -> Result<Source, RoutingError> {
        check_pair(self.local_layout, prefill_layout, &self.model)?;
        let owner = match self.policy.read_owner {
            ReadOwner::OwnerDp => owner_dp.unwrap_or(0),
            ReadOwner::Dp0 => 0,
        };
        if owner >= prefill_layout.dp {
            return Err(RoutingError::OwnerOutOfRange { owner_dp: owner, prefill_dp: prefill_layout.dp });
        }
        let flexible =
            is_flexible(self.local_layout.tp, self.model.use_mla, prefill_layout, self.policy.flexible_reads);
        if flexible {
            let k = self.flexible_reads;
            self.flexible_reads += 1;
            let tp = ((u64::from(self.local.dp) + k) % u64::from(prefill_layout.tp)) as u16;
            return Ok(Source { rank: RankId::new(prefill, owner, tp), flexible: true });
        }
        let tp = fixed_tp_source(self.local_layout.tp, self.local.tp, prefill_layout.tp)?;
        Ok(Source { rank: RankId::new(prefill, owner, tp), flexible: false })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::{Legacy, LegacyOptions};

    fn decode_worker(layout: &str, dp: u16, tp: u16, model: ModelSpec) -> ReadRouter {
        let layout = crate::Deployment::parse(&format!("1P_TP1:1D_{layout}")).unwrap().decode[0];
        ReadRouter::new(RankId::new(EngineId::decode(0), dp, tp), layout, model, Policy::fixed())
    }

    /// (decode TP W, prefill TP, decode ranks 0..W) -> prefill TP rank each reads.
    #[test]
    fn fixed_mapping_table() {
        let check = |w: u16, tp: u16, expected: &[u16]| {
            let got: Vec<u16> = (0..w).map(|r| fixed_tp_source(w, r, tp).unwrap()).collect();
            assert_eq!(got, expected, "D{w} <- P{tp}");
        };
        check(8, 8, &[0, 1, 2, 3, 4, 5, 6, 7]);
        check(4, 4, &[0, 1, 2, 3]);
        check(4, 8, &[0, 2, 4, 6]);
        check(2, 8, &[0, 4]);
        check(1, 8, &[0]);
        check(8, 4, &[0, 0, 1, 1, 2, 2, 3, 3]);
        check(8, 2, &[0, 0, 0, 0, 1, 1, 1, 1]);
        check(8, 1, &[0; 8]);
        check(1, 1, &[0]);
    }

    #[test]
    fn size_errors_table() {
        let check = |w: u16, tp: u16, expected: RoutingError, text: &str| {
            let err = fixed_tp_source(w, 0, tp).unwrap_err();
            assert_eq!(err, expected);
            assert!(err.to_string().contains(text), "{err}");
        };
        check(3, 2, RoutingError::NotMultiple { decode_tp: 3, prefill_tp: 2 }, "multiple");
        check(4, 6, RoutingError::NotMultiple { decode_tp: 4, prefill_tp: 6 }, "multiple");
        check(0, 8, RoutingError::ZeroSize { what: "decode TP size".into() }, "greater than 0");
        check(8, 0, RoutingError::ZeroSize { what: "prefill TP size".into() }, "greater than 0");
    }

    /// (decode TP, prefill TP, use_mla, kv_heads) -> guard passes?
    #[test]
    fn head_guard_table() {
        let check = |w: u16, tp: u16, mla: bool, heads: u16, ok: bool| {
            let model = if mla { ModelSpec::deepseek_r1() } else { ModelSpec::gqa(heads) };
            let got = check_heads(w, tp, &model);
            assert_eq!(got.is_ok(), ok, "D{w} P{tp} mla={mla} heads={heads}: {got:?}");
            if let Err(e) = got {
                assert!(e.to_string().contains("requires replicated KV heads"), "{e}");
            }
        };
        check(8, 4, true, 1, true);
        check(1, 8, true, 1, true);
        check(8, 8, false, 8, true);
        check(8, 8, false, 64, true);
        check(8, 4, false, 8, false);
        check(4, 8, false, 8, false);
        check(8, 4, false, 4, true);
        check(8, 4, false, 2, true);
        check(8, 1, false, 1, true);
        check(8, 1, false, 2, false);
        check(2, 4, false, 2, true);
    }

    #[test]
    fn flexible_gate_table() {
        let check = |w: u16, mla: bool, prefill: Layout, expected: bool| {
            assert_eq!(
                is_flexible(w, mla, prefill, FlexibleReads::RoundRobin),
                expected,
                "W{w} mla={mla} {prefill}"
            );
            assert!(!is_flexible(w, mla, prefill, FlexibleReads::Off), "W{w} mla={mla} {prefill}: off");
        };
        check(1, true, Layout::tp(8), true);
        check(1, true, Layout::tp(2), true);
        check(1, false, Layout::tp(8), false);
        check(2, true, Layout::tp(8), false);
        check(8, true, Layout::tp(8), false);
        check(1, true, Layout::tp(1), false);
        check(1, true, Layout::new(2, 4, false), false);
        check(1, true, Layout::new(8, 1, true), false);
    }

    #[test]
    fn flexible_picks_follow_dp_stagger_and_counter() {
        let picks = |dp: u16, n: usize| -> Vec<u16> {
            let mut w = decode_worker("DP8EP", dp, 0, ModelSpec::deepseek_r1());
            (0..n).map(|_| w.resolve(EngineId::prefill(0), Layout::tp(8), None).unwrap().rank.tp).collect()
        };
        assert_eq!(picks(0, 8), [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(picks(3, 1), [3]);
        let mut firsts: Vec<u16> = (0..8).map(|d| picks(d, 1)[0]).collect();
        firsts.sort_unstable();
        assert_eq!(firsts, [0, 1, 2, 3, 4, 5, 6, 7]);
        let mut counts = [0u32; 8];
        for tp in picks(0, 64) {
            counts[usize::from(tp)] += 1;
        }
        assert_eq!(counts, [8; 8]);
        // The fixed mapping never advances the counter; TP8 to TP8 is a bijection.
        let mut w = decode_worker("TP8", 0, 5, ModelSpec::deepseek_r1());
        let source = w.resolve(EngineId::prefill(0), Layout::tp(8), None).unwrap();
        assert_eq!((source.rank.tp, source.flexible, w.flexible_reads()), (5, false, 0));
    }

    #[test]
    fn owner_dp_is_read_and_legacy_reads_dp0() {
        let prefill = Layout::new(8, 1, true);
        let mut w = decode_worker("TP8", 0, 3, ModelSpec::deepseek_r1());
        let s = w.resolve(EngineId::prefill(1), prefill, Some(5)).unwrap();
        assert_eq!(s.rank, RankId::new(EngineId::prefill(1), 5, 0));
        let s = w.resolve(EngineId::prefill(1), prefill, None).unwrap();
        assert_eq!(s.rank.dp, 0, "remote_dp_rank defaults to 0");
        let err = w.resolve(EngineId::prefill(1), prefill, Some(8)).unwrap_err();
        assert_eq!(err, RoutingError::OwnerOutOfRange { owner_dp: 8, prefill_dp: 8 });

        let legacy = Policy::from(LegacyOptions::none().with(Legacy::ReadFromDp0));
        let layout = Layout::tp(8);
        let mut old =
            ReadRouter::new(RankId::new(EngineId::decode(0), 0, 3), layout, ModelSpec::deepseek_r1(), legacy);
        let reads: Vec<u16> =
            (0..8).map(|o| old.resolve(EngineId::prefill(0), prefill, Some(o)).unwrap().rank.dp).collect();
        assert_eq!(reads, [0; 8], "every owner DP rank collapses onto DP 0");
    }
}
