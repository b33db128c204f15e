//! Release (ACK) accounting on a prefill rank: expected counts, fan-in, early and stale releases.
//!
//! Each prefill rank keeps a [`RankLedger`]. A transfer is registered with a [`Quorum`] computed
//! by [`quorum_plan`] from the two layouts; releases are applied as they arrive, in any order,
//! duplicated or early. pdkv's default counts distinct senders, so a network duplicate of a
//! release that names its sender never completes a transfer early (anonymous releases, from a
//! MoRIIO peer or in the plain-string form, cannot be told apart and each one counts), and gives
//! a quorum of zero to ranks nobody reads, so their blocks are freed at once instead of by the
//! reaper.
//!
//! Which prefill ranks a decode worker releases is [`release_ranks`]: the rank it read under
//! pdkv's rules, every rank holding its share under vLLM 0.33's ([`ReleasePlan::EveryHolder`],
//! with the uniform quorum that goes with it).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{RankId, TransferId};
use crate::policy::{EarlyReleases, Policy, QuorumRule, ReleaseCounting, ReleasePlan};
use crate::routing::{self, RoutingError};
use crate::topology::{Layout, ModelSpec};

// The release message is defined with the other notify messages: the wire decodes it, the
// ledger counts it.
pub use crate::wire::{Release, ReleaseSender};

/// Releases held for transfers not registered yet; the oldest is evicted beyond this.
pub const MAX_EARLY_RELEASES: usize = 4096;
/// Retired transfer ids remembered (of each form, see `Retired`) so that late releases are
/// recognised as stale. A release
/// later than this many retirements on its rank is buffered as early instead, and evicted in
/// turn ([`MAX_EARLY_RELEASES`]): ids are never reused, so it can never count. A simulator that
/// hosts hundreds of ranks keeps this many ids for each, so it stays modest.
pub const MAX_RETIRED_IDS: usize = 4096;

/// MoRIIO's expected releases per prefill rank: 1 when the consumer TP is not larger than the
/// producer TP, else `consumer_tp / producer_tp`. Sizes must be positive multiples.
pub fn expected_releases(producer_tp: u16, consumer_tp: u16) -> Result<u16, RoutingError> {
    routing::fixed_tp_source(consumer_tp, 0, producer_tp)?;
    Ok(if consumer_tp <= producer_tp { 1 } else { consumer_tp / producer_tp })
}

/// How many releases one prefill rank waits for before its part of a transfer is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub enum Quorum {
    /// Wait for this many releases (distinct senders by default); 0 completes at registration.
    Exact(u16),
    /// Flexible read: one rank of the owner DP group is read, chosen by the decode worker after
    /// the transfer was registered. This rank completes on its own release, or when the engine
    /// reports that another rank of the group received the release
    /// ([`RankLedger::handle_group_done`]). No rank can be freed before then, because any of them
    /// may be the one being read.
    AnyOfGroup,
}

/// Quorum of every TP rank of the owner DP group of a prefill engine for one request, read by
/// one DP group of a decode engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuorumPlan {
    /// Indexed by prefill TP rank.
    pub per_tp_rank: Vec<Quorum>,
    /// Decode reads with the flexible round-robin, so exactly one rank of the group is read.
    pub flexible: bool,
}

impl QuorumPlan {
    /// Releases the whole owner DP group waits for per request: the sum of the exact quorums, or
    /// 1 for a flexible read (one rank of the group is read). Under [`QuorumRule::Uniform`] this
    /// can exceed what decode sends (P8 to D4 waits for 8 releases and gets 4).
    pub fn releases_per_request(&self) -> u32 {
        if self.flexible {
            return 1;
        }
        self.per_tp_rank
            .iter()
            .map(|q| match q {
                Quorum::Exact(n) => u32::from(*n),
                Quorum::AnyOfGroup => 1,
            })
            .sum()
    }
}

/// The quorum of each prefill TP rank: the number of decode TP ranks whose read resolves to
/// it (pdkv), or MoRIIO's uniform [`expected_releases`] under [`QuorumRule::Uniform`] (vLLM
/// 0.33's rules, or the legacy `no-zero-quorum`).
pub fn quorum_plan(
    prefill: Layout,
    decode: Layout,
    model: &ModelSpec,
    policy: &Policy,
) -> Result<QuorumPlan, RoutingError> {
    routing::check_pair(decode, prefill, model)?;
    let flexible = routing::is_flexible(decode.tp, model.use_mla, prefill, policy.flexible_reads);
    if policy.quorum == QuorumRule::Uniform {
        let n = expected_releases(prefill.tp, decode.tp)?;
        return Ok(QuorumPlan { per_tp_rank: vec![Quorum::Exact(n); usize::from(prefill.tp)], flexible });
    }
    if flexible {
        return Ok(QuorumPlan { per_tp_rank: vec![Quorum::AnyOfGroup; usize::from(prefill.tp)], flexible });
    }
    let mut counts = vec![0u16; usize::from(prefill.tp)];
    for r in 0..decode.tp {
        counts[usize::from(routing::fixed_tp_source(decode.tp, r, prefill.tp)?)] += 1;
    }
    Ok(QuorumPlan { per_tp_rank: counts.into_iter().map(Quorum::Exact).collect(), flexible })
}

/// The prefill TP ranks that hold the share of KV decode TP rank `decode_tp_rank` (of
/// `decode_tp`) reads from a prefill engine of TP size `prefill_tp`: the rank it reads under the
/// fixed mapping and, when prefill has `m` times as many TP ranks, the `m - 1` after it, which
/// hold the same KV heads (or the same latent) and are not read. vLLM 0.33's
/// `get_moriio_read_holder_tp_ranks`. Sizes must be positive multiples.
pub fn holder_tp_ranks(
    decode_tp: u16,
    decode_tp_rank: u16,
    prefill_tp: u16,
) -> Result<std::ops::Range<u16>, RoutingError> {
    let first = routing::fixed_tp_source(decode_tp, decode_tp_rank, prefill_tp)?;
    let holders = if prefill_tp > decode_tp { prefill_tp / decode_tp } else { 1 };
    Ok(first..first + holders)
}

/// The prefill ranks a decode worker sends its release to under `plan`, given `notify`, the rank
/// its release is addressed to (the rank it read, unless the legacy `notify-other-rank` moved
/// it): that rank alone under [`ReleasePlan::RankRead`]; under [`ReleasePlan::EveryHolder`],
/// with equal TP sizes also that rank alone, else every holder of the worker's share in
/// `notify`'s DP rank ([`holder_tp_ranks`]), as vLLM 0.33's `_read_blocks` addresses them. A
/// flexible read (a TP1 worker) is not special there: every prefill TP rank holds its share.
pub fn release_ranks(
    plan: ReleasePlan,
    notify: RankId,
    decode_tp: u16,
    decode_tp_rank: u16,
    prefill_tp: u16,
) -> Result<Vec<RankId>, RoutingError> {
    if plan == ReleasePlan::RankRead || decode_tp == prefill_tp {
        return Ok(vec![notify]);
    }
    let holders = holder_tp_ranks(decode_tp, decode_tp_rank, prefill_tp)?;
    Ok(holders.map(|tp| RankId::new(notify.engine, notify.dp, tp)).collect())
}

/// What the ledger did with one release or registration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReleaseOutcome {
    /// Counted; the transfer still waits for more.
    Counted {
        /// Releases counted so far.
        have: u16,
        /// Releases the quorum requires.
        need: u16,
    },
    /// This release (or registration) completed the transfer on this rank.
    Completed,
    /// The same sender released this transfer already (a network duplicate); not counted.
    DuplicateSender,
    /// Legacy only ([`ReleaseCounting::DedupById`], `dedup-releases`): an identical release was
    /// seen already; not counted.
    Deduplicated,
    /// The transfer completed already; ignored, it never completes twice.
    AfterCompletion,
    /// The transfer was retired (blocks freed) already; ignored and not counted.
    Stale,
    /// Unknown transfer: held and applied when the transfer is registered.
    Buffered,
    /// Legacy only ([`EarlyReleases::Drop`], `drop-early-releases`): unknown transfer, dropped
    /// ("could lead to a possible hang").
    Dropped,
    /// A registration that reached the rank after the transfer was retired: its engine ended it
    /// (its reaper's deadline passed before the registration arrived) and freed its blocks once.
    /// Ignored: the rank never holds it, so nothing waits for a release that cannot come.
    RegisteredLate,
    /// The transfer was retired before its registration reached this rank (the engine's reaper
    /// fired first); the id is remembered as retired, so the registration is ignored when it
    /// comes and releases for it are stale.
    RetiredBeforeRegistration,
    /// The message named another incarnation of this rank (one before a restart): the transfer
    /// is not this incarnation's, so it is ignored and not counted.
    OtherIncarnation,
}

/// A registration the ledger refuses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LedgerError {
    /// The transfer is registered on this rank already.
    AlreadyRegistered(TransferId),
    /// The transfer is not registered on this rank (never, or no longer).
    Unknown(TransferId),
}

impl fmt::Display for LedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerError::AlreadyRegistered(id) => write!(f, "transfer {id} is registered already"),
            LedgerError::Unknown(id) => write!(f, "transfer {id} is not registered"),
        }
    }
}

impl std::error::Error for LedgerError {}

#[derive(Clone, Debug, Hash)]
struct Entry {
    quorum: Quorum,
    senders: BTreeSet<ReleaseSender>,
    /// Releases without a sender (MoRIIO peers, the plain-string form): each one counts.
    anonymous: u16,
    /// Legacy dedup: whether any release for the id has been seen.
    seen: bool,
    completed: bool,
}

impl Entry {
    fn have(&self) -> u16 {
        (self.senders.len() as u16).saturating_add(self.anonymous)
    }

    fn need(&self) -> u16 {
        match self.quorum {
            Quorum::Exact(n) => n,
            Quorum::AnyOfGroup => 1,
        }
    }
}

/// Release accounting of one prefill rank.
#[derive(Clone, Debug, Default, Hash)]
pub struct RankLedger {
    early_releases: EarlyReleases,
    counting: ReleaseCounting,
    live: BTreeMap<TransferId, Entry>,
    early: VecDeque<Release>,
    retired: Retired,
    evicted_early: u64,
}

/// Retired ids, the most recent [`MAX_RETIRED_IDS`] of each form: an id in the form the proxy
/// mints (every id pdkv makes) as its 16 bytes, any other as text. Kept apart so the common
/// form costs 16 bytes an id in each structure.
#[derive(Clone, Debug, Default, Hash)]
struct Retired {
    bits: RetiredBits,
    text: BTreeSet<Box<str>>,
    text_order: VecDeque<Box<str>>,
}

impl Retired {
    fn contains(&self, id: &TransferId) -> bool {
        match id.to_u128() {
            Some(bits) => self.bits.contains(bits),
            None => self.text.contains(&*id.as_str()),
        }
    }

    fn insert(&mut self, id: &TransferId) {
        match id.to_u128() {
            Some(bits) => self.bits.insert(bits),
            None => {
                let (set, order) = (&mut self.text, &mut self.text_order);
                if order.len() == MAX_RETIRED_IDS {
                    if let Some(old) = order.pop_front() {
                        set.remove(&old);
                    }
                }
                let key: Box<str> = Box::from(&*id.as_str());
                set.insert(key.clone());
                order.push_back(key);
            }
        }
    }
}

/// The most recent [`MAX_RETIRED_IDS`] retirements of minted ids, in order, and the set of the
/// ids among them as an open-addressing table of positions in that order. It behaves as a
/// `BTreeSet` beside a queue did (an id retired twice is in the set once; evicting its first
/// retirement takes it out), but a lookup is a probe or two where a B-tree of random keys
/// missed the cache at every level, on every registration, release and retirement of each of
/// hundreds of ranks. Looked up, never iterated (its hash sorts the ids first).
#[derive(Clone, Debug, Default)]
struct RetiredBits {
    /// Retirements, oldest first; `order[i]` is retirement number `first + i` (numbers count
    /// modulo [`RetiredBits::NUMBERS`], far more than `order` holds).
    order: VecDeque<u128>,
    /// The number of `order`'s front.
    first: u32,
    /// A retirement number (its id is in the set), or [`RetiredBits::EMPTY`]; the length is zero
    /// or a power of two, at most half full. Four bytes a slot: hundreds of ranks keep a table.
    slots: Vec<u32>,
    /// Slots in use.
    len: usize,
}

impl RetiredBits {
    /// A slot no retirement holds.
    const EMPTY: u32 = u32::MAX;
    /// Retirement numbers count modulo this (2^31), so none is [`RetiredBits::EMPTY`].
    const NUMBERS: u32 = 1 << 31;

    /// The id of retirement number `number`, which is still in `order`.
    fn key(&self, number: u32) -> u128 {
        self.order[(number.wrapping_sub(self.first) % Self::NUMBERS) as usize]
    }

    /// The first slot to probe for `bits`: folding the halves spreads the random ids the proxy
    /// mints; ids a peer chooses only cost longer probes.
    fn home(bits: u128, mask: usize) -> usize {
        let folded = (bits as u64) ^ ((bits >> 64) as u64).rotate_left(29);
        (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask
    }

    /// The slot holding `bits`, or the empty slot where it would go (`slots` is not empty).
    fn probe(&self, bits: u128) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = Self::home(bits, mask);
        while self.slots[i] != Self::EMPTY && self.key(self.slots[i]) != bits {
            i = (i + 1) & mask;
        }
        i
    }

    fn contains(&self, bits: u128) -> bool {
        !self.slots.is_empty() && self.slots[self.probe(bits)] != Self::EMPTY
    }

    /// Retires `bits`: evicts the oldest retirement at [`MAX_RETIRED_IDS`], then files `bits`
    /// (unless it is in the set already) and queues it.
    fn insert(&mut self, bits: u128) {
        if self.order.len() == MAX_RETIRED_IDS {
            let old = self.order[0];
            let i = self.probe(old);
            if self.slots[i] != Self::EMPTY {
                self.remove_slot(i);
            }
            self.order.pop_front();
            self.first = (self.first + 1) % Self::NUMBERS;
        }
        let queued = u32::try_from(self.order.len()).expect("at most MAX_RETIRED_IDS");
        let number = (self.first + queued) % Self::NUMBERS;
        self.order.push_back(bits);
        if 2 * (self.len + 1) > self.slots.len() {
            let grown = (self.slots.len() * 2).max(64);
            let old = std::mem::replace(&mut self.slots, vec![Self::EMPTY; grown]);
            for n in old.into_iter().filter(|&n| n != Self::EMPTY) {
                let i = self.probe(self.key(n));
                self.slots[i] = n;
            }
        }
        let i = self.probe(bits);
        if self.slots[i] == Self::EMPTY {
            self.slots[i] = number;
            self.len += 1;
        }
    }

    /// Empties slot `i`, shifting back the entries after it that probed past it (linear
    /// probing's deletion, which leaves no tombstone).
    fn remove_slot(&mut self, mut i: usize) {
        let mask = self.slots.len() - 1;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            if self.slots[j] == Self::EMPTY {
                break;
            }
            let home = Self::home(self.key(self.slots[j]), mask);
            // The entry at `j` may move to `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j { i < home && home <= j } else { i < home || home <= j };
            if !stays {
                self.slots[i] = self.slots[j];
                i = j;
            }
        }
        self.slots[i] = Self::EMPTY;
        self.len -= 1;
    }
}

impl std::hash::Hash for RetiredBits {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut set: Vec<u128> =
            self.slots.iter().filter(|&&n| n != Self::EMPTY).map(|&n| self.key(n)).collect();
        set.sort_unstable();
        (set, &self.order).hash(state);
    }
}

impl RankLedger {
    /// An empty ledger. Of the policy only [`Policy::early_releases`] and
    /// [`Policy::release_counting`] change it.
    pub fn new(policy: &Policy) -> RankLedger {
        RankLedger {
            early_releases: policy.early_releases,
            counting: policy.release_counting,
            ..RankLedger::default()
        }
    }

    /// Registers a transfer whose blocks this rank now holds. Returns `Completed` at once for a
    /// zero quorum, or when buffered early releases already satisfy it, and `RegisteredLate` for
    /// a transfer retired already (ids are never reused, so a registration after the retirement
    /// is a late one: see [`RankLedger::handle_retired`]).
    pub fn handle_transfer(
        &mut self,
        id: &TransferId,
        quorum: Quorum,
    ) -> Result<ReleaseOutcome, LedgerError> {
        if self.live.contains_key(id) {
            return Err(LedgerError::AlreadyRegistered(id.clone()));
        }
        if self.retired.contains(id) {
            return Ok(ReleaseOutcome::RegisteredLate);
        }
        let entry = Entry { quorum, senders: BTreeSet::new(), anonymous: 0, seen: false, completed: false };
        self.live.insert(id.clone(), entry);
        self.check_complete(id);
        // Early releases are rare; only rebuild the buffer when this transfer has some.
        if self.early.iter().any(|r| &r.transfer_id == id) {
            let (mine, rest): (VecDeque<Release>, VecDeque<Release>) =
                self.early.drain(..).partition(|r| &r.transfer_id == id);
            self.early = rest;
            for release in mine {
                self.handle_release(release);
            }
        }
        Ok(self.check_complete(id))
    }

    fn check_complete(&mut self, id: &TransferId) -> ReleaseOutcome {
        let entry = self.live.get_mut(id).expect("checked by caller");
        let (have, need) = (entry.have(), entry.need());
        if entry.completed || have >= need {
            entry.completed = true;
            ReleaseOutcome::Completed
        } else {
            ReleaseOutcome::Counted { have, need }
        }
    }

    /// Applies one release: counts it toward a live transfer, ignores it for a completed or
    /// retired transfer, and buffers it when the transfer is not registered yet (the oldest
    /// buffered release is evicted beyond [`MAX_EARLY_RELEASES`]; under
    /// [`EarlyReleases::Drop`] it is dropped instead). The outcome says which.
    pub fn handle_release(&mut self, release: Release) -> ReleaseOutcome {
        let id = release.transfer_id.clone();
        let Some(entry) = self.live.get_mut(&id) else {
            if self.retired.contains(&id) {
                return ReleaseOutcome::Stale;
            }
            if self.early_releases == EarlyReleases::Drop {
                return ReleaseOutcome::Dropped;
            }
            if self.early.len() == MAX_EARLY_RELEASES {
                self.early.pop_front();
                self.evicted_early += 1;
            }
            self.early.push_back(release);
            return ReleaseOutcome::Buffered;
        };
        if entry.completed {
            return ReleaseOutcome::AfterCompletion;
        }
        if self.counting == ReleaseCounting::DedupById {
            // The historical code kept a set of transfer ids: the second decode rank's
            // identical release adds nothing.
            if entry.seen {
                return ReleaseOutcome::Deduplicated;
            }
            entry.seen = true;
            entry.anonymous += 1;
        } else {
            match release.sender {
                Some(sender) => {
                    if !entry.senders.insert(sender) {
                        return ReleaseOutcome::DuplicateSender;
                    }
                }
                None => entry.anonymous = entry.anonymous.saturating_add(1),
            }
        }
        self.check_complete(&id)
    }

    /// A flexible transfer was read on another rank of this rank's group: this rank was not
    /// read and its part is done.
    pub fn handle_group_done(&mut self, id: &TransferId) -> Result<ReleaseOutcome, LedgerError> {
        let entry = self.live.get_mut(id).ok_or_else(|| LedgerError::Unknown(id.clone()))?;
        if entry.completed {
            return Ok(ReleaseOutcome::AfterCompletion);
        }
        entry.completed = true;
        Ok(ReleaseOutcome::Completed)
    }

    /// The blocks of the transfer were freed (by completion or by the reaper): forget it, and
    /// remember the id so later releases are stale rather than early, and a registration still
    /// on its way is recognised as late. The engine may retire a transfer before its registration
    /// reached this rank (the reaper fired first); that is not an error. Returns whether the
    /// rank held the transfer.
    pub fn handle_retired(&mut self, id: &TransferId) -> bool {
        let held = self.live.remove(id).is_some();
        self.early.retain(|r| &r.transfer_id != id);
        self.retired.insert(id);
        held
    }

    /// Whether the transfer is registered and complete on this rank; false once it is retired.
    pub fn is_completed(&self, id: &TransferId) -> bool {
        self.live.get(id).is_some_and(|e| e.completed)
    }

    /// Transfers registered and not yet completed, in id order.
    pub fn pending(&self) -> impl Iterator<Item = &TransferId> {
        self.live.iter().filter(|(_, e)| !e.completed).map(|(id, _)| id)
    }

    /// Releases buffered for transfers not registered yet.
    pub fn early_len(&self) -> usize {
        self.early.len()
    }

    /// Early releases pushed out by the [`MAX_EARLY_RELEASES`] limit.
    pub fn evicted_early(&self) -> u64 {
        self.evicted_early
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::{Legacy, LegacyOptions};

    fn id(n: u32) -> TransferId {
        TransferId::new(format!("tx-{n}"))
    }

    fn from(dp: u16, tp: u16) -> Option<ReleaseSender> {
        Some(ReleaseSender { engine_id: "decode-0:6301".into(), dp_rank: dp, tp_rank: tp })
    }

    fn release(n: u32, sender: Option<ReleaseSender>) -> Release {
        Release { transfer_id: id(n), consumer_tp_size: Some(8), sender, incarnation: None, mac: None }
    }

    #[test]
    fn expected_releases_table() {
        let check = |producer: u16, consumer: u16, expected: Result<u16, &str>| {
            let got = expected_releases(producer, consumer).map_err(|e| e.to_string());
            match expected {
                Ok(n) => assert_eq!(got, Ok(n), "({consumer},{producer})"),
                Err(text) => assert!(got.unwrap_err().contains(text)),
            }
        };
        check(4, 4, Ok(1));
        check(4, 8, Ok(2));
        check(8, 4, Ok(1));
        check(1, 8, Ok(8));
        check(8, 1, Ok(1));
        check(2, 8, Ok(4));
        check(4, 6, Err("multiple"));
        check(3, 4, Err("multiple"));
        check(4, 0, Err("greater than 0"));
        check(0, 4, Err("greater than 0"));
    }

    #[test]
    fn quorum_plan_table() {
        use Quorum::{AnyOfGroup as G, Exact as E};
        let check = |notation: &str, legacy: Policy, expected: &[Quorum]| {
            let d = crate::Deployment::parse(notation).unwrap();
            let plan = quorum_plan(d.prefill[0], d.decode[0], &d.model, &legacy).unwrap();
            assert_eq!(plan.per_tp_rank, expected, "{notation}");
        };
        let none = Policy::fixed();
        let old = Policy::from(LegacyOptions::none().with(Legacy::NoZeroQuorum));
        check("1P_TP8:1D_TP8", none, &[E(1); 8]);
        check("1P_TP8:1D_TP4", none, &[E(1), E(0), E(1), E(0), E(1), E(0), E(1), E(0)]);
        check("1P_TP8:1D_TP4", old, &[E(1); 8]);
        check("1P_TP4:1D_TP8", none, &[E(2); 4]);
        check("1P_DP8EP:1D_TP8", none, &[E(8)]);
        check("1P_TP8:1D_DP8EP", none, &[G; 8]);
        check("1P_TP8:1D_DP8EP", old, &[E(1); 8]);
        check("1P_DP2TP4:1D_TP2", none, &[E(1), E(0), E(1), E(0)]);
    }

    /// (decode TP, prefill TP) -> the prefill TP ranks holding each decode rank's share, as
    /// vLLM 0.33.0's `get_moriio_read_holder_tp_ranks(r, decode_tp, prefill_tp)` returns them
    /// (computed by running it), and `get_moriio_expected_ack_count(prefill_tp, decode_tp)`.
    #[test]
    fn holder_ranks_and_expected_acks_are_vllms() {
        let check = |decode: u16, prefill: u16, holders: &[&[u16]], acks: u16| {
            let got: Vec<Vec<u16>> =
                (0..decode).map(|r| holder_tp_ranks(decode, r, prefill).unwrap().collect()).collect();
            assert_eq!(got, holders, "D{decode} P{prefill}");
            assert_eq!(expected_releases(prefill, decode), Ok(acks), "D{decode} P{prefill}");
        };
        check(4, 8, &[&[0, 1], &[2, 3], &[4, 5], &[6, 7]], 1);
        check(1, 8, &[&[0, 1, 2, 3, 4, 5, 6, 7]], 1);
        check(2, 8, &[&[0, 1, 2, 3], &[4, 5, 6, 7]], 1);
        check(2, 4, &[&[0, 1], &[2, 3]], 1);
        check(1, 2, &[&[0, 1]], 1);
        check(8, 8, &[&[0], &[1], &[2], &[3], &[4], &[5], &[6], &[7]], 1);
        check(4, 4, &[&[0], &[1], &[2], &[3]], 1);
        check(1, 1, &[&[0]], 1);
        check(8, 4, &[&[0], &[0], &[1], &[1], &[2], &[2], &[3], &[3]], 2);
        check(8, 1, &[&[0u16][..]; 8], 8);
        assert!(holder_tp_ranks(4, 0, 6).is_err());
        assert!(holder_tp_ranks(0, 0, 8).is_err());
    }

    /// (plan, notify rank, decode TP rank of TP size, prefill TP) -> the ranks released.
    #[test]
    fn release_ranks_table() {
        use ReleasePlan::{EveryHolder, RankRead};
        let p = |dp: u16, tp: u16| RankId::new(crate::ids::EngineId::prefill(0), dp, tp);
        let check =
            |plan: ReleasePlan, notify: RankId, rank: u16, decode: u16, prefill: u16, expected: &[RankId]| {
                let got = release_ranks(plan, notify, decode, rank, prefill).unwrap();
                assert_eq!(got, expected, "{plan:?} {notify} D{decode} rank {rank} P{prefill}");
            };
        // P8 to D4: rank 1 reads prefill rank 2; vLLM 0.33 also releases rank 3, its twin.
        check(RankRead, p(0, 2), 1, 4, 8, &[p(0, 2)]);
        check(EveryHolder, p(0, 2), 1, 4, 8, &[p(0, 2), p(0, 3)]);
        // The owner DP rank's holders, not DP rank 0's.
        check(EveryHolder, p(1, 6), 3, 4, 8, &[p(1, 6), p(1, 7)]);
        // A flexible read of rank 5: vLLM 0.33 releases all eight ranks, in order.
        let all: Vec<RankId> = (0..8).map(|tp| p(0, tp)).collect();
        check(EveryHolder, p(0, 5), 0, 1, 8, &all);
        check(RankRead, p(0, 5), 0, 1, 8, &[p(0, 5)]);
        // Equal and smaller prefill TP sizes: the rank read, under both plans.
        for plan in [RankRead, EveryHolder] {
            check(plan, p(0, 3), 3, 8, 8, &[p(0, 3)]);
            check(plan, p(0, 1), 3, 8, 4, &[p(0, 1)]);
            check(plan, p(2, 0), 5, 8, 1, &[p(2, 0)]);
        }
    }

    /// For every layout pair, the releases all decode ranks of one DP group send meet each
    /// prefill rank's quorum exactly whenever one side is pdkv, whatever the other's rules:
    /// nothing waits for the reaper and nothing completes early. vLLM 0.33 gets there with a
    /// release per holder and a uniform quorum, pdkv with a release per reader and a quorum per
    /// reader (zero for the unread), and a pdkv side adapts to an older vLLM peer. (Two vLLM
    /// engines before 0.33 do leave the unread holders to the reaper:
    /// `policy::tests::each_side_decides_by_its_own_release_and_pdkv_adapts`.)
    #[test]
    fn every_rule_sets_releases_meet_its_quorums() {
        use crate::ids::EngineId;
        use crate::policy::{PeerBook, PeerRules};
        for notation in [
            "1P_TP8:1D_TP8",
            "1P_TP8:1D_TP4",
            "1P_TP8:1D_TP2",
            "1P_TP4:1D_TP8",
            "1P_TP2:1D_TP8",
            "1P_DP2TP4:1D_TP2",
            "1P_DP2TP4:1D_TP8",
            "1P_DP8EP:1D_TP8",
            "1P_TP8:1D_DP2TP4",
        ] {
            let d = crate::Deployment::parse(notation).unwrap();
            let (prefill, decode) = (d.prefill[0], d.decode[0]);
            let (p, dd) = (EngineId::prefill(0), EngineId::decode(0));
            let books = PeerRules::ALL
                .into_iter()
                .flat_map(|rules| [PeerBook::pdkv().with(p, rules), PeerBook::pdkv().with(dd, rules)]);
            for book in books {
                let rules = (book.rules(p), book.rules(dd));
                let policy = Policy::fixed().between(&book, p, dd);
                let plan = quorum_plan(prefill, decode, &d.model, &policy).unwrap();
                assert!(!plan.flexible, "{notation}");
                let mut got = vec![0u16; usize::from(prefill.tp)];
                for r in 0..decode.tp {
                    let read = routing::fixed_tp_source(decode.tp, r, prefill.tp).unwrap();
                    let notify = RankId::new(crate::ids::EngineId::prefill(0), 0, read);
                    for rank in release_ranks(policy.release_plan, notify, decode.tp, r, prefill.tp).unwrap()
                    {
                        got[usize::from(rank.tp)] += 1;
                    }
                }
                let need: Vec<u16> =
                    plan.per_tp_rank.iter().map(|q| if let Quorum::Exact(n) = q { *n } else { 1 }).collect();
                assert_eq!(got, need, "{notation} {rules:?}");
            }
        }
    }

    /// (notation) -> the quorum of each prefill TP rank under vLLM 0.33's rules: its uniform
    /// `get_moriio_expected_ack_count` on every rank, read or not.
    #[test]
    fn vllm_quorum_table() {
        use crate::policy::PeerRules;
        use Quorum::Exact as E;
        let check = |notation: &str, expected: &[Quorum]| {
            let d = crate::Deployment::parse(notation).unwrap();
            let policy = Policy::fixed().under(PeerRules::Vllm033);
            let plan = quorum_plan(d.prefill[0], d.decode[0], &d.model, &policy).unwrap();
            assert_eq!(plan.per_tp_rank, expected, "{notation}");
        };
        check("1P_TP8:1D_TP8", &[E(1); 8]);
        check("1P_TP8:1D_TP4", &[E(1); 8]);
        check("1P_TP4:1D_TP8", &[E(2); 4]);
        check("1P_DP8EP:1D_TP8", &[E(8)]);
        check("1P_TP8:1D_DP8EP", &[E(1); 8]);
        check("1P_DP2TP4:1D_TP2", &[E(1); 4]);
    }

    /// Steps applied in order to one ledger, each with the outcome it must give.
    enum Step {
        Register(u32, Quorum),
        Release(u32, Option<ReleaseSender>),
        GroupDone(u32),
        Retire(u32),
    }

    fn run(legacy: Policy, steps: &[(Step, ReleaseOutcome)]) -> RankLedger {
        let mut ledger = RankLedger::new(&legacy);
        for (i, (step, expected)) in steps.iter().enumerate() {
            let got = match step {
                Step::Register(n, q) => ledger.handle_transfer(&id(*n), *q).unwrap(),
                Step::Release(n, s) => ledger.handle_release(release(*n, s.clone())),
                Step::GroupDone(n) => ledger.handle_group_done(&id(*n)).unwrap(),
                Step::Retire(n) => {
                    assert!(ledger.handle_retired(&id(*n)), "step {i}: retired a transfer not held");
                    ReleaseOutcome::Completed
                }
            };
            assert_eq!(&got, expected, "step {i}");
        }
        ledger
    }

    use ReleaseOutcome::*;
    use Step::{GroupDone, Register, Retire};

    fn rel(n: u32, s: Option<ReleaseSender>) -> Step {
        Step::Release(n, s)
    }

    #[test]
    fn fan_in_counts_distinct_senders_and_completes_once() {
        run(
            Policy::fixed(),
            &[
                (Register(1, Quorum::Exact(2)), Counted { have: 0, need: 2 }),
                (rel(1, from(0, 0)), Counted { have: 1, need: 2 }),
                (rel(1, from(0, 0)), DuplicateSender),
                (rel(1, from(0, 1)), Completed),
                (rel(1, from(0, 2)), AfterCompletion),
                (Retire(1), Completed),
                (rel(1, from(0, 3)), Stale),
            ],
        );
    }

    #[test]
    fn anonymous_releases_from_different_ranks_all_count() {
        // MoRIIO semantics: identical releases from different decode ranks are all counted.
        run(
            Policy::fixed(),
            &[
                (Register(1, Quorum::Exact(2)), Counted { have: 0, need: 2 }),
                (rel(1, None), Counted { have: 1, need: 2 }),
                (rel(1, None), Completed),
                (rel(1, None), AfterCompletion),
            ],
        );
    }

    #[test]
    fn zero_quorum_completes_at_registration() {
        run(
            Policy::fixed(),
            &[(Register(1, Quorum::Exact(0)), Completed), (rel(1, from(0, 0)), AfterCompletion)],
        );
    }

    #[test]
    fn early_release_is_buffered_and_applied() {
        let ledger = run(
            Policy::fixed(),
            &[
                (rel(1, from(0, 0)), Buffered),
                (rel(1, from(0, 1)), Buffered),
                (rel(2, from(0, 0)), Buffered),
                (Register(1, Quorum::Exact(2)), Completed),
            ],
        );
        assert_eq!(ledger.early_len(), 1, "only the release of tx-2 stays buffered");
    }

    #[test]
    fn flexible_group_completes_on_read_rank_or_by_peer() {
        run(
            Policy::fixed(),
            &[
                (Register(1, Quorum::AnyOfGroup), Counted { have: 0, need: 1 }),
                (rel(1, from(3, 0)), Completed),
                (Register(2, Quorum::AnyOfGroup), Counted { have: 0, need: 1 }),
                (GroupDone(2), Completed),
                (rel(2, from(3, 0)), AfterCompletion),
            ],
        );
    }

    /// Legacy: dropping early releases leaves a fan-in that never completes.
    #[test]
    fn legacy_drop_early_never_completes() {
        let ledger = run(
            Policy::from(LegacyOptions::none().with(Legacy::DropEarlyReleases)),
            &[(rel(1, from(0, 0)), Dropped), (Register(1, Quorum::Exact(1)), Counted { have: 0, need: 1 })],
        );
        assert_eq!(ledger.pending().collect::<Vec<_>>(), [&id(1)]);
    }

    /// Legacy: deduplicating by id breaks the P4 to D8 fan-in of two releases per rank.
    #[test]
    fn legacy_dedup_never_completes_fan_in() {
        let ledger = run(
            Policy::from(LegacyOptions::none().with(Legacy::DedupReleases)),
            &[
                (Register(1, Quorum::Exact(2)), Counted { have: 0, need: 2 }),
                (rel(1, from(0, 0)), Counted { have: 1, need: 2 }),
                (rel(1, from(0, 1)), Deduplicated),
            ],
        );
        assert!(!ledger.is_completed(&id(1)));
    }

    /// Legacy: without zero quorum, P8 to D4 leaves the odd prefill ranks waiting forever.
    #[test]
    fn legacy_no_zero_quorum_strands_unread_ranks() {
        let d = crate::Deployment::parse("1P_TP8:1D_TP4").unwrap();
        for (legacy, stranded) in
            [(Policy::fixed(), 0), (Policy::from(LegacyOptions::none().with(Legacy::NoZeroQuorum)), 4)]
        {
            let plan = quorum_plan(d.prefill[0], d.decode[0], &d.model, &legacy).unwrap();
            let mut ledgers: Vec<RankLedger> = (0..8).map(|_| RankLedger::new(&legacy)).collect();
            for (t, ledger) in ledgers.iter_mut().enumerate() {
                ledger.handle_transfer(&id(1), plan.per_tp_rank[t]).unwrap();
            }
            // Decode ranks 0..4 read prefill ranks 0, 2, 4, 6 and release them.
            for r in 0..4u16 {
                let t = routing::fixed_tp_source(4, r, 8).unwrap();
                ledgers[usize::from(t)].handle_release(release(1, from(0, r)));
            }
            let waiting = ledgers.iter().filter(|l| !l.is_completed(&id(1))).count();
            assert_eq!(waiting, stranded, "{legacy:?}");
        }
    }

    #[test]
    fn registration_errors() {
        let mut ledger = RankLedger::new(&Policy::fixed());
        ledger.handle_transfer(&id(1), Quorum::Exact(1)).unwrap();
        assert_eq!(
            ledger.handle_transfer(&id(1), Quorum::Exact(1)),
            Err(LedgerError::AlreadyRegistered(id(1)))
        );
        assert!(ledger.handle_retired(&id(1)));
        assert_eq!(ledger.handle_transfer(&id(1), Quorum::Exact(1)), Ok(RegisteredLate));
        assert_eq!(ledger.handle_group_done(&id(9)), Err(LedgerError::Unknown(id(9))));
    }

    /// A registration that arrives after its transfer was retired (the engine's reaper fired
    /// before it reached the rank) is late, not an error: the rank remembers the retirement, ignores
    /// the registration, holds nothing, and releases for the transfer are stale (buffered early
    /// ones are dropped). Before, the retirement of an unregistered transfer was an error and the
    /// late registration held the transfer on the rank forever.
    #[test]
    fn a_registration_after_retirement_is_late_and_holds_nothing() {
        let mut ledger = RankLedger::new(&Policy::fixed());
        assert_eq!(ledger.handle_release(release(9, from(0, 0))), Buffered);
        assert!(!ledger.handle_retired(&id(9)), "it never held the transfer");
        assert_eq!(ledger.early_len(), 0);
        assert_eq!(ledger.handle_transfer(&id(9), Quorum::Exact(1)), Ok(RegisteredLate));
        assert_eq!(ledger.pending().count(), 0);
        assert!(!ledger.is_completed(&id(9)));
        assert_eq!(ledger.handle_release(release(9, from(0, 1))), Stale);
    }

    #[test]
    fn early_buffer_is_bounded() {
        let mut ledger = RankLedger::new(&Policy::fixed());
        for n in 0..(MAX_EARLY_RELEASES as u32 + 10) {
            assert_eq!(ledger.handle_release(release(n, None)), Buffered);
        }
        assert_eq!(ledger.early_len(), MAX_EARLY_RELEASES);
        assert_eq!(ledger.evicted_early(), 10);
    }
}

#[cfg(test)]
mod retired_tests {
    use super::*;

    /// The table answers as the set and queue it replaced did, through growth, eviction at
    /// [`MAX_RETIRED_IDS`], ids retired twice and ids that share a home slot.
    #[test]
    fn retired_bits_behave_as_a_set_beside_a_queue() {
        let mut table = RetiredBits::default();
        let (mut set, mut order) = (BTreeSet::new(), VecDeque::new());
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut draw = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..3 * MAX_RETIRED_IDS {
            let r = draw();
            // Few distinct ids, so repeats are common; some collide in the fold.
            let bits = match r % 4 {
                0 => u128::from(r % 64) << 64,
                1 => u128::from(r % 64) << 29,
                _ => u128::from(draw()) << 64 | u128::from(draw()),
            };
            if order.len() == MAX_RETIRED_IDS {
                if let Some(old) = order.pop_front() {
                    set.remove(&old);
                }
            }
            set.insert(bits);
            order.push_back(bits);
            table.insert(bits);
            assert_eq!(table.len, set.len(), "step {step}");
            let probe = u128::from(draw() % 64) << if r % 2 == 0 { 64 } else { 29 };
            assert_eq!(table.contains(probe), set.contains(&probe), "step {step}");
            assert!(table.contains(bits));
        }
        assert!(order.iter().all(|b| table.contains(*b) == set.contains(b)));
    }

    /// Retirement numbers wrap (modulo 2^31) without losing an id or naming an empty slot.
    #[test]
    fn retirement_numbers_wrap() {
        let mut table = RetiredBits { first: RetiredBits::NUMBERS - 10, ..RetiredBits::default() };
        let id = |i: u128| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        for i in 0..2 * MAX_RETIRED_IDS as u128 {
            table.insert(id(i));
            assert!(table.slots.iter().all(|&n| n == RetiredBits::EMPTY || n < RetiredBits::NUMBERS));
        }
        let kept = MAX_RETIRED_IDS as u128..2 * MAX_RETIRED_IDS as u128;
        assert!(kept.clone().all(|i| table.contains(id(i))));
        assert!((0..MAX_RETIRED_IDS as u128).all(|i| !table.contains(id(i))));
        assert_eq!((table.len, table.first), (MAX_RETIRED_IDS, MAX_RETIRED_IDS as u32 - 10));
    }
}
