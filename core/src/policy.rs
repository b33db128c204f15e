//! The protocol's decisions that legacy options change, resolved once into typed rules.
//!
//! A [`LegacyOptions`] set is a list of switches; code that asked `legacy.has(...)` at each
//! decision point let two places answer one question differently (the flexible-read rule was
//! computed in the router and again in the quorum plan, and the notify target a third way).
//! [`Policy::from`] is the only code that reads the switches: every node and function takes the
//! policy, or the one field it decides on, and matches on a variant named for what it does.
//! [`Policy::default`] is the fixed protocol; each legacy variant names the option selecting it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, Role};
use crate::legacy::{Legacy, LegacyOptions};
use crate::wire::Extensions;

/// Which prefill DP rank decode reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReadOwner {
    /// The request's owner DP rank (`remote_dp_rank`).
    #[default]
    OwnerDp,
    /// DP rank 0 for every request ([`Legacy::ReadFromDp0`]).
    Dp0,
}

/// Which port offset a listener binds (dialers use `dp * tp_size + tp` under both
/// [`PeerRules`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ListenerOffset {
    /// `dp * tp_size + tp`, the dialers' offset.
    #[default]
    DpTimesTpSizePlusTp,
    /// `dp + tp`: vLLM 0.33's listeners ([`PeerRules::Vllm033`]), which call `get_port_offset`
    /// without the TP size; every engine's listeners under [`Legacy::ListenerOffsetDpPlusTp`].
    DpPlusTp,
}

/// What a session with a remote rank is keyed by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SessionKeyRule {
    /// `<engine id>_dp<d>_tp<t>`: one session per remote rank.
    #[default]
    PerRank,
    /// `<engine id>_dp<d>`: TP ranks of one DP rank share a session
    /// ([`Legacy::SessionKeyWithoutTp`]).
    PerDpRank,
}

/// How the proxy picks engine and DP rank for the k-th request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ProxyRule {
    /// Round-robin over the flat list of (engine, DP rank) slots.
    #[default]
    FlatSlots,
    /// `engine = k mod n`, `dp = k mod D` from one counter ([`Legacy::ProxyAliasing`]).
    OneCounter,
}

/// What a prefill rank does with a release for a transfer it does not know yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EarlyReleases {
    /// Buffers it until the transfer is registered.
    #[default]
    Buffer,
    /// Drops it ([`Legacy::DropEarlyReleases`]).
    Drop,
}

/// How a prefill rank counts releases towards a quorum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReleaseCounting {
    /// Once per distinct sending decode rank.
    #[default]
    DistinctSenders,
    /// Once per transfer id, so identical releases from different ranks count once
    /// ([`Legacy::DedupReleases`]).
    DedupById,
}

/// How many releases each prefill TP rank waits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QuorumRule {
    /// The number of decode ranks that read it: zero for a rank nobody reads.
    #[default]
    ReadersOnly,
    /// MoRIIO's uniform `expected_releases` for every rank: vLLM 0.33's quorum
    /// ([`PeerRules::Vllm033`], whose decode releases every holder rank, so each gets its
    /// count); with pdkv's release plan the historical bug ([`Legacy::NoZeroQuorum`]).
    Uniform,
}

/// Which prefill ranks a decode worker releases once it has read (or failed to read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReleasePlan {
    /// The rank it read (its notify target); a rank nobody reads waits for nothing
    /// ([`QuorumRule::ReadersOnly`]).
    #[default]
    RankRead,
    /// Every prefill TP rank that holds the worker's share: with a larger prefill TP size
    /// (`P = m * D`), the `m` ranks `r * m .. r * m + m` of the owner DP rank, read or not;
    /// otherwise the rank read. vLLM 0.33's `get_moriio_read_holder_tp_ranks`
    /// ([`PeerRules::Vllm033`]).
    EveryHolder,
}

/// Which key of `kv_transfer_params` gives the prefill TP size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TpSizeRule {
    /// `remote_tp_size`, else `tp_size`.
    #[default]
    RemoteTpSize,
    /// Only `tp_size`, defaulting to 1 ([`Legacy::TpSizeKey`]).
    TpSizeKeyOnly,
}

/// When decode handshakes with the prefill ranks it reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HandshakeMode {
    /// Before the step, the TP group agreeing on the outcome through its barrier.
    #[default]
    Eager,
    /// On the read path, one session after another, blocking the worker alone
    /// ([`Legacy::LazyHandshake`]).
    Lazy,
}

/// Whether a handshake dial has a deadline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HandshakeTimeout {
    /// The dial fails after the configured timeout.
    #[default]
    Deadline,
    /// The dial waits forever ([`Legacy::NoHandshakeTimeout`]).
    Never,
}

impl HandshakeTimeout {
    /// The deadline of one dial under this rule, given the configured timeout.
    pub fn of(self, timeout_ns: u64) -> Option<u64> {
        match self {
            HandshakeTimeout::Deadline => Some(timeout_ns),
            HandshakeTimeout::Never => None,
        }
    }
}

/// Which prefill rank a decode worker's release is addressed to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NotifyRule {
    /// The rank read.
    #[default]
    RankRead,
    /// DP rank 0 and the fixed-mapping TP rank, recomputed without the owner DP rank or the
    /// flexible pick ([`Legacy::NotifyOtherRank`]).
    Recomputed,
}

/// Whether the deferred-free reaper respects read leases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReaperRule {
    /// It waits for read leases and revokes remote access (fences) before freeing.
    #[default]
    Fenced,
    /// It ignores leases and frees without fencing ([`Legacy::ReaperIgnoresReads`]).
    IgnoresReads,
}

impl ReaperRule {
    /// Whether read leases defer the reaper and a reap fences before freeing.
    pub fn fences(self) -> bool {
        self == ReaperRule::Fenced
    }
}

/// Whether TP1 decode workers reading a TP-replicated MLA prefill spread their reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FlexibleReads {
    /// Round-robin over the prefill TP ranks, one counter per worker.
    #[default]
    RoundRobin,
    /// Off: the fixed mapping, every read on TP rank 0 ([`Legacy::NoFlexibleReads`]).
    Off,
}

/// When a request that fails while its reads are posted is released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DrainRule {
    /// After every posted read has answered (the others aborted and drained).
    #[default]
    DrainFirst,
    /// At once, while reads are still posted ([`Legacy::ReleaseDuringReads`]).
    ReleaseAtOnce,
}

impl DrainRule {
    /// Whether a failing request is released without waiting for its posted reads.
    pub fn releases_at_once(self) -> bool {
        self == DrainRule::ReleaseAtOnce
    }
}

/// Whether a request the decode engine queued holds a read lease before a step admits it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QueuedLease {
    /// Leased (and renewed) while queued.
    #[default]
    Leased,
    /// Not leased until admitted ([`Legacy::NoQueuedLease`]).
    Unleased,
}

/// Whether incarnations fence reads, releases, leases and retirements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum IncarnationRule {
    /// A decode rank acts on a transfer only through a session with the incarnation that holds
    /// it, and a prefill rank ignores messages naming another incarnation.
    #[default]
    Fenced,
    /// Incarnations are carried but never compared ([`Legacy::NoIncarnationFence`]).
    Unfenced,
}

impl IncarnationRule {
    /// Whether incarnations are compared.
    pub fn fences(self) -> bool {
        self == IncarnationRule::Fenced
    }
}

/// Every decision a legacy option can change, one field per decision; the default is the fixed
/// protocol.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Policy {
    /// Which prefill DP rank decode reads (routing).
    pub read_owner: ReadOwner,
    /// Which port offset listeners bind (ports).
    pub listener_offset: ListenerOffset,
    /// What sessions are keyed by (ports).
    pub session_key: SessionKeyRule,
    /// How the proxy routes requests (proxy).
    pub proxy: ProxyRule,
    /// What a prefill rank does with early releases (release ledger).
    pub early_releases: EarlyReleases,
    /// How releases are counted (release ledger).
    pub release_counting: ReleaseCounting,
    /// How many releases each prefill rank waits for (quorum plan).
    pub quorum: QuorumRule,
    /// Which prefill ranks a decode worker releases (decode worker). No legacy option changes
    /// it; [`PeerRules::Vllm033`] does.
    pub release_plan: ReleasePlan,
    /// Which key gives the prefill TP size (request parameters).
    pub tp_size: TpSizeRule,
    /// When decode handshakes (decode worker and TP group).
    pub handshake: HandshakeMode,
    /// Whether a handshake dial has a deadline (decode worker).
    pub handshake_timeout: HandshakeTimeout,
    /// Where a release is sent (decode worker).
    pub notify: NotifyRule,
    /// Whether the reaper respects read leases (prefill engine).
    pub reaper: ReaperRule,
    /// Whether flexible reads are on (routing and quorum plan alike).
    pub flexible_reads: FlexibleReads,
    /// When a failing request is released (decode worker's per-request machine).
    pub drain: DrainRule,
    /// Whether queued requests are leased (decode worker).
    pub queued_lease: QueuedLease,
    /// Whether incarnations fence a restarted prefill rank's old transfers (decode worker and
    /// prefill worker).
    pub incarnation: IncarnationRule,
}

impl Policy {
    /// The fixed protocol: no legacy option.
    pub fn fixed() -> Policy {
        Policy::default()
    }

    /// This policy as applied under `rules`: by an engine that follows them (its own listeners
    /// and reads), or between a prefill and a decode engine ([`Policy::between`]). A vLLM rule
    /// set replaces the listener offset, the release plan and the quorum rule with its
    /// release's, and 0.25's and 0.26's also how decode reads (owner, flexible reads,
    /// handshake, TP size key) and how a prefill rank takes an early release;
    /// [`PeerRules::Pdkv`] leaves the policy as it is, legacy options included.
    pub fn under(self, rules: PeerRules) -> Policy {
        // pdkv's variant of a decision unless the rules or the policy picked the other one.
        fn either<T: Default + PartialEq>(rules: T, policy: T) -> T {
            if rules == T::default() {
                policy
            } else {
                rules
            }
        }
        Policy {
            read_owner: either(rules.read_owner(), self.read_owner),
            listener_offset: either(rules.listener_offset(), self.listener_offset),
            early_releases: either(rules.early_releases(), self.early_releases),
            release_plan: either(rules.release_plan(), self.release_plan),
            quorum: either(rules.quorum(), self.quorum),
            tp_size: either(rules.tp_size(), self.tp_size),
            handshake: either(rules.handshake(), self.handshake),
            handshake_timeout: either(rules.handshake_timeout(), self.handshake_timeout),
            flexible_reads: either(rules.flexible_reads(), self.flexible_reads),
            incarnation: either(rules.incarnation(), self.incarnation),
            ..self
        }
    }

    /// The policy a node of an engine following `rules` runs for itself: a decode worker reads
    /// (owner, flexible reads, handshake and its deadline, the TP size key, no incarnation
    /// fence under a vLLM release) and a prefill rank takes early releases as its release does.
    /// Listeners, release plans and quorums are decided per pair ([`Policy::between`]) or per
    /// listener ([`Policy::under`]). Under every vLLM rule set from 0.27 only the fence differs
    /// from pdkv's fixed protocol.
    pub fn own(self, rules: PeerRules) -> Policy {
        let under = self.under(rules);
        Policy { early_releases: under.early_releases, ..self.with_decode_side(under) }
    }

    /// The decisions a decode worker makes about its own reads (which rank, when it
    /// handshakes, how it reads the prefill's size, whether it fences by incarnation), taken
    /// from `from`: between two engines these are the decode engine's, whatever the prefill
    /// engine follows.
    fn with_decode_side(self, from: Policy) -> Policy {
        Policy {
            read_owner: from.read_owner,
            tp_size: from.tp_size,
            handshake: from.handshake,
            handshake_timeout: from.handshake_timeout,
            flexible_reads: from.flexible_reads,
            incarnation: from.incarnation,
            ..self
        }
    }

    /// This policy between prefill engine `prefill` and decode engine `decode` of `book`: each
    /// side's decision is its own engine's rules where that engine follows a vLLM release
    /// (vLLM cannot do otherwise), and a pdkv engine adapts to its peer. A decode worker's
    /// release plan is its own dialect's; a pdkv decode worker facing a vLLM prefill engine
    /// releases every holder, which is what the uniform count every vLLM release waits for
    /// asks. A prefill rank's quorum is vLLM's uniform count under a vLLM dialect; a pdkv
    /// prefill engine facing a vLLM decode engine counts the releases that decode's plan sends:
    /// every holder (from 0.33) gives each holder its uniform count, the rank read (before
    /// 0.33) nothing to the ranks nobody reads, which pdkv then frees at once where vLLM's own
    /// prefill waits for its reaper. Between two pdkv engines the policy is unchanged, legacy
    /// options included.
    pub fn between(self, book: &PeerBook, prefill: EngineId, decode: EngineId) -> Policy {
        let (p, d) = (book.rules(prefill), book.rules(decode));
        if !p.is_vllm() && !d.is_vllm() {
            return self;
        }
        let release_plan = if d.is_vllm() { d.release_plan() } else { ReleasePlan::EveryHolder };
        let quorum = match (p.is_vllm(), release_plan) {
            (true, _) | (false, ReleasePlan::EveryHolder) => QuorumRule::Uniform,
            (false, ReleasePlan::RankRead) => QuorumRule::ReadersOnly,
        };
        // How a decode worker reads is its own engine's (a pdkv decode worker reads the owner
        // rank of a 0.25 prefill engine as well); the rest as before, under the vLLM side's rules.
        let decode_side = if d.is_vllm() { self.under(d) } else { self };
        let early_releases = if p.is_vllm() { self.under(p).early_releases } else { self.early_releases };
        Policy { release_plan, quorum, early_releases, ..self.under(p.meet(d)).with_decode_side(decode_side) }
    }
}

/// The rules an engine follows where the current vLLM MoRIIO release and pdkv's fixed protocol
/// differ on the wire: where its listeners bind, which prefill ranks a decode worker releases,
/// and how many releases each prefill rank waits for. Where the release differs from pdkv's
/// protocol the release is the truth for wire compatibility, so both are kept as named rule sets
/// and chosen per engine ([`PeerBook`]): a pdkv engine talking to a vLLM 0.33 engine follows
/// vLLM 0.33's rules with it ([`PeerRules::meet`]); what an engine binds follows its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PeerRules {
    /// pdkv's fixed protocol: listeners at `dp * tp_size + tp`, a release to the rank read, a
    /// quorum of the readers of each rank (zero for a rank nobody reads).
    #[default]
    #[serde(rename = "pdkv")]
    Pdkv,
    /// vLLM 0.33.0's MoRIIO connector as it is: listeners at `dp + tp`
    /// ([`ListenerOffset::DpPlusTp`]) while its dialers use `dp * tp_size + tp`; with a larger
    /// prefill TP size a release to every holder rank ([`ReleasePlan::EveryHolder`]), each of
    /// which waits for `get_moriio_expected_ack_count` releases ([`QuorumRule::Uniform`]).
    #[serde(rename = "vllm-0.33")]
    Vllm033,
    /// vLLM 0.25.0 and 0.25.1: as [`PeerRules::Vllm027`], and besides a decode rank reads DP
    /// rank 0 whatever rank owns the request ([`ReadOwner::Dp0`]; the request cannot name its
    /// owner), never flexibly ([`FlexibleReads::Off`]), handshakes on the read path with no
    /// deadline ([`HandshakeMode::Lazy`], [`HandshakeTimeout::Never`]) and reads the prefill TP
    /// size from `tp_size` alone ([`TpSizeRule::TpSizeKeyOnly`]); a prefill rank drops a
    /// release that comes before it knows the transfer ([`EarlyReleases::Drop`]). Its dialers
    /// use `dp + tp`, which differs from `dp * tp_size + tp` only for a DP > 1 rank, which it
    /// never reads (its lazy handshake still dials there; not modelled).
    #[serde(rename = "vllm-0.25")]
    Vllm025,
    /// vLLM 0.26.0: [`PeerRules::Vllm025`]'s rules, but a prefill rank buffers an early
    /// release ([`EarlyReleases::Buffer`]).
    #[serde(rename = "vllm-0.26")]
    Vllm026,
    /// vLLM 0.27.0's MoRIIO: as [`PeerRules::Vllm033`] but a decode rank releases only the
    /// prefill rank it read ([`ReleasePlan::RankRead`]), so with a larger prefill TP size the
    /// holders nobody read wait for their uniform count until the 60 s reaper frees them. Its
    /// prefill does not write `remote_dp_rank` (the proxy must) and it does not fold DP ranks
    /// per pod; pdkv does not model either difference yet (docs/moriio-releases.md).
    #[serde(rename = "vllm-0.27")]
    Vllm027,
    /// vLLM 0.28.0 and 0.29.0: [`PeerRules::Vllm027`]'s rules. Prefill writes the owner rank,
    /// listeners bind at the pod-local DP rank (multi-pod folding, not modelled yet: one pod).
    #[serde(rename = "vllm-0.28")]
    Vllm028,
    /// vLLM 0.30.0 to 0.32.0: [`PeerRules::Vllm028`]'s rules; `remote_block_ids` is one list per
    /// KV cache group, which pdkv reads in both shapes.
    #[serde(rename = "vllm-0.30")]
    Vllm030,
}

impl PeerRules {
    /// Every rule set, pdkv's first, then vLLM's dialects, oldest first.
    pub const ALL: [PeerRules; 7] = [
        PeerRules::Pdkv,
        PeerRules::Vllm025,
        PeerRules::Vllm026,
        PeerRules::Vllm027,
        PeerRules::Vllm028,
        PeerRules::Vllm030,
        PeerRules::Vllm033,
    ];

    /// The name used in scenario files: `pdkv` or `vllm-<dialect>` (`vllm-0.33`).
    pub fn name(self) -> &'static str {
        match self {
            PeerRules::Pdkv => "pdkv",
            PeerRules::Vllm025 => "vllm-0.25",
            PeerRules::Vllm026 => "vllm-0.26",
            PeerRules::Vllm027 => "vllm-0.27",
            PeerRules::Vllm028 => "vllm-0.28",
            PeerRules::Vllm030 => "vllm-0.30",
            PeerRules::Vllm033 => "vllm-0.33",
        }
    }

    /// Whether these are a vLLM release's rules.
    pub fn is_vllm(self) -> bool {
        self != PeerRules::Pdkv
    }

    /// The pdkv extensions an engine under these rules advertises: all of them for pdkv; none
    /// for vLLM, whose notify receiver stops on a message type it does not know.
    pub fn extensions(self) -> Extensions {
        if self.is_vllm() {
            Extensions::NONE
        } else {
            Extensions::ALL
        }
    }

    /// Where the engine's listeners bind: every vLLM release calls `get_port_offset` without
    /// the TP size.
    pub fn listener_offset(self) -> ListenerOffset {
        if self.is_vllm() {
            ListenerOffset::DpPlusTp
        } else {
            ListenerOffset::DpTimesTpSizePlusTp
        }
    }

    /// Which prefill ranks a decode worker releases: every holder from vLLM 0.33 on, the rank
    /// read before.
    pub fn release_plan(self) -> ReleasePlan {
        match self {
            PeerRules::Pdkv
            | PeerRules::Vllm025
            | PeerRules::Vllm026
            | PeerRules::Vllm027
            | PeerRules::Vllm028
            | PeerRules::Vllm030 => ReleasePlan::RankRead,
            PeerRules::Vllm033 => ReleasePlan::EveryHolder,
        }
    }

    /// Whether a decode engine under these rules reads `remote_block_ids` as one list per KV
    /// cache group (vLLM 0.30 on, and pdkv, which reads both shapes) rather than one flat list
    /// (0.27 to 0.29): a prefill answer to it must be written that way.
    pub fn block_ids_per_group(self) -> bool {
        !matches!(self, PeerRules::Vllm025 | PeerRules::Vllm026 | PeerRules::Vllm027 | PeerRules::Vllm028)
    }

    /// Whether a decode engine under these rules reads as 0.25 and 0.26 do: DP rank 0 only,
    /// never flexibly, handshaking on the read path without a deadline, the prefill TP size
    /// from `tp_size` alone.
    fn reads_dp0(self) -> bool {
        matches!(self, PeerRules::Vllm025 | PeerRules::Vllm026)
    }

    /// Which prefill DP rank a decode worker reads: DP rank 0 before 0.27, whose requests
    /// cannot name their owner.
    pub fn read_owner(self) -> ReadOwner {
        if self.reads_dp0() {
            ReadOwner::Dp0
        } else {
            ReadOwner::OwnerDp
        }
    }

    /// Whether a TP1 decode worker reads a TP-replicated prefill flexibly: not before 0.27.
    pub fn flexible_reads(self) -> FlexibleReads {
        if self.reads_dp0() {
            FlexibleReads::Off
        } else {
            FlexibleReads::RoundRobin
        }
    }

    /// When a decode worker handshakes: on the read path before 0.27, before the forward after.
    pub fn handshake(self) -> HandshakeMode {
        if self.reads_dp0() {
            HandshakeMode::Lazy
        } else {
            HandshakeMode::Eager
        }
    }

    /// Whether a handshake dial has a deadline. No vLLM release sets one; pdkv models only the
    /// lazy releases' missing deadline, where a stuck dial blocks the TP group, as the hang it
    /// is ([`Legacy::NoHandshakeTimeout`]).
    pub fn handshake_timeout(self) -> HandshakeTimeout {
        if self.reads_dp0() {
            HandshakeTimeout::Never
        } else {
            HandshakeTimeout::Deadline
        }
    }

    /// Which key gives a decode worker the prefill TP size: `tp_size` alone before 0.27.
    pub fn tp_size(self) -> TpSizeRule {
        if self.reads_dp0() {
            TpSizeRule::TpSizeKeyOnly
        } else {
            TpSizeRule::RemoteTpSize
        }
    }

    /// Whether a node fences a restarted peer's transfers by incarnation: no vLLM release names
    /// or checks one ([`Legacy::NoIncarnationFence`]).
    pub fn incarnation(self) -> IncarnationRule {
        if self.is_vllm() {
            IncarnationRule::Unfenced
        } else {
            IncarnationRule::Fenced
        }
    }

    /// What a prefill rank does with a release for a transfer it does not know yet: 0.25 drops
    /// it, every later release buffers it.
    pub fn early_releases(self) -> EarlyReleases {
        if self == PeerRules::Vllm025 {
            EarlyReleases::Drop
        } else {
            EarlyReleases::Buffer
        }
    }

    /// How many releases each prefill rank waits for: vLLM's uniform count in every release.
    pub fn quorum(self) -> QuorumRule {
        if self.is_vllm() {
            QuorumRule::Uniform
        } else {
            QuorumRule::ReadersOnly
        }
    }

    /// The rules two engines follow with each other: the vLLM engine's when one follows a vLLM
    /// release's. A vLLM engine cannot do otherwise, and a pdkv engine adapts to it: a pdkv
    /// decode worker releases the holder ranks a vLLM prefill engine waits for, and a pdkv
    /// prefill engine waits for the releases a vLLM decode engine sends. A deployment mixes no
    /// two vLLM dialects ([`PeerBook::mixed_dialects`]); were it to, the first would win.
    pub fn meet(self, other: PeerRules) -> PeerRules {
        if self.is_vllm() {
            self
        } else {
            other
        }
    }
}

impl fmt::Display for PeerRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A rule set name that pdkv does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPeerRules(pub String);

impl fmt::Display for UnknownPeerRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let known: Vec<&str> = PeerRules::ALL.iter().map(|r| r.name()).collect();
        write!(f, "unknown rule set {:?}; known rule sets: {}", self.0, known.join(", "))
    }
}

impl std::error::Error for UnknownPeerRules {}

impl FromStr for PeerRules {
    type Err = UnknownPeerRules;

    fn from_str(s: &str) -> Result<PeerRules, UnknownPeerRules> {
        PeerRules::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| UnknownPeerRules(s.to_string()))
    }
}

/// The rules each engine of a deployment follows, indexed like the deployment's engines; an
/// engine past the end of its list follows pdkv's, so the empty book is the fixed protocol
/// everywhere.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerBook {
    /// Rules of each prefill engine, by engine index.
    #[serde(default)]
    pub prefill: Vec<PeerRules>,
    /// Rules of each decode engine, by engine index.
    #[serde(default)]
    pub decode: Vec<PeerRules>,
}

impl PeerBook {
    /// Every engine follows pdkv's rules.
    pub fn pdkv() -> PeerBook {
        PeerBook::default()
    }

    /// This book with `engine` following `rules`.
    pub fn with(mut self, engine: EngineId, rules: PeerRules) -> PeerBook {
        self.set(engine, rules);
        self
    }

    /// Makes `engine` follow `rules` (engines before it that were not named follow pdkv's).
    pub fn set(&mut self, engine: EngineId, rules: PeerRules) {
        let side = match engine.role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
        };
        let i = usize::from(engine.index);
        if side.len() <= i {
            side.resize(i + 1, PeerRules::Pdkv);
        }
        side[i] = rules;
    }

    /// The rules `engine` follows.
    pub fn rules(&self, engine: EngineId) -> PeerRules {
        let side = match engine.role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        };
        side.get(usize::from(engine.index)).copied().unwrap_or_default()
    }

    /// Two engines of the book that follow different vLLM dialects, if any: the first such
    /// pair in engine order (prefill engines, then decode engines). The rules between a
    /// prefill and a decode engine of two vLLM releases would be each one's own for its own
    /// decisions, which pdkv does not model, so a deployment must not mix them.
    pub fn mixed_dialects(&self) -> Option<((EngineId, PeerRules), (EngineId, PeerRules))> {
        let named = |role: Role, rules: &[PeerRules]| -> Vec<(EngineId, PeerRules)> {
            rules
                .iter()
                .enumerate()
                .filter(|(_, r)| r.is_vllm())
                .map(|(i, &r)| (EngineId { role, index: i as u16 }, r))
                .collect()
        };
        let mut all = named(Role::Prefill, &self.prefill);
        all.extend(named(Role::Decode, &self.decode));
        let first = *all.first()?;
        all.into_iter().find(|(_, r)| *r != first.1).map(|other| (first, other))
    }
}

impl From<&LegacyOptions> for Policy {
    /// The one place the legacy switches are read.
    fn from(legacy: &LegacyOptions) -> Policy {
        // The legacy variant of one decision when its option is on, else the fixed one.
        fn pick<T>(on: bool, fixed: T, old: T) -> T {
            if on {
                old
            } else {
                fixed
            }
        }
        Policy {
            read_owner: pick(legacy.has(Legacy::ReadFromDp0), ReadOwner::OwnerDp, ReadOwner::Dp0),
            // The historical listener offset is vLLM 0.33's current one: the option binds every
            // engine's listeners by vLLM 0.33's rule.
            listener_offset: pick(
                legacy.has(Legacy::ListenerOffsetDpPlusTp),
                PeerRules::Pdkv.listener_offset(),
                PeerRules::Vllm033.listener_offset(),
            ),
            session_key: pick(
                legacy.has(Legacy::SessionKeyWithoutTp),
                SessionKeyRule::PerRank,
                SessionKeyRule::PerDpRank,
            ),
            proxy: pick(legacy.has(Legacy::ProxyAliasing), ProxyRule::FlatSlots, ProxyRule::OneCounter),
            early_releases: pick(
                legacy.has(Legacy::DropEarlyReleases),
                EarlyReleases::Buffer,
                EarlyReleases::Drop,
            ),
            release_counting: pick(
                legacy.has(Legacy::DedupReleases),
                ReleaseCounting::DistinctSenders,
                ReleaseCounting::DedupById,
            ),
            quorum: pick(legacy.has(Legacy::NoZeroQuorum), QuorumRule::ReadersOnly, QuorumRule::Uniform),
            release_plan: ReleasePlan::RankRead,
            tp_size: pick(legacy.has(Legacy::TpSizeKey), TpSizeRule::RemoteTpSize, TpSizeRule::TpSizeKeyOnly),
            handshake: pick(legacy.has(Legacy::LazyHandshake), HandshakeMode::Eager, HandshakeMode::Lazy),
            handshake_timeout: pick(
                legacy.has(Legacy::NoHandshakeTimeout),
                HandshakeTimeout::Deadline,
                HandshakeTimeout::Never,
            ),
            notify: pick(legacy.has(Legacy::NotifyOtherRank), NotifyRule::RankRead, NotifyRule::Recomputed),
            reaper: pick(
                legacy.has(Legacy::ReaperIgnoresReads),
                ReaperRule::Fenced,
                ReaperRule::IgnoresReads,
            ),
            flexible_reads: pick(
                legacy.has(Legacy::NoFlexibleReads),
                FlexibleReads::RoundRobin,
                FlexibleReads::Off,
            ),
            drain: pick(
                legacy.has(Legacy::ReleaseDuringReads),
                DrainRule::DrainFirst,
                DrainRule::ReleaseAtOnce,
            ),
            queued_lease: pick(legacy.has(Legacy::NoQueuedLease), QueuedLease::Leased, QueuedLease::Unleased),
            incarnation: pick(
                legacy.has(Legacy::NoIncarnationFence),
                IncarnationRule::Fenced,
                IncarnationRule::Unfenced,
            ),
        }
    }
}

impl From<LegacyOptions> for Policy {
    fn from(legacy: LegacyOptions) -> Policy {
        Policy::from(&legacy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (prefill rules, decode rules) -> the release plan and quorum between them: each vLLM
    /// side decides as its release does, a pdkv side adapts, and only two vLLM engines before
    /// 0.33 leave unread holders to the reaper (rank read against a uniform count).
    #[test]
    fn each_side_decides_by_its_own_release_and_pdkv_adapts() {
        use PeerRules::{Pdkv, Vllm027, Vllm030, Vllm033};
        use QuorumRule::{ReadersOnly, Uniform};
        use ReleasePlan::{EveryHolder, RankRead};
        let (p, d) = (EngineId::prefill(0), EngineId::decode(0));
        let check = |prefill: PeerRules, decode: PeerRules, expected: (ReleasePlan, QuorumRule)| {
            let book = PeerBook::pdkv().with(p, prefill).with(d, decode);
            let policy = Policy::fixed().between(&book, p, d);
            assert_eq!((policy.release_plan, policy.quorum), expected, "{prefill} {decode}");
        };
        check(Pdkv, Pdkv, (RankRead, ReadersOnly));
        check(Pdkv, Vllm033, (EveryHolder, Uniform));
        check(Vllm033, Pdkv, (EveryHolder, Uniform));
        check(Vllm033, Vllm033, (EveryHolder, Uniform));
        for old in [Vllm027, Vllm030] {
            check(Pdkv, old, (RankRead, ReadersOnly));
            check(old, Pdkv, (EveryHolder, Uniform));
            check(old, old, (RankRead, Uniform));
        }
        // Between pdkv engines a legacy option keeps its decision.
        let legacy = Policy::from(&LegacyOptions::none().with(Legacy::NoZeroQuorum));
        assert_eq!(legacy.between(&PeerBook::pdkv(), p, d), legacy);
    }

    /// A vLLM 0.33 engine advertises no pdkv extension, so no pdkv rank sends it a read lease
    /// (a message type its notify receiver would stop on).
    #[test]
    fn only_pdkv_engines_advertise_pdkv_extensions() {
        assert_eq!(PeerRules::Pdkv.extensions(), Extensions::ALL);
        assert_eq!(PeerRules::Vllm033.extensions(), Extensions::NONE);
    }

    /// The decisions in which `policy` differs from the fixed protocol.
    fn changed(policy: Policy) -> Vec<&'static str> {
        let f = Policy::fixed();
        let p = policy;
        [
            ("read_owner", p.read_owner != f.read_owner),
            ("listener_offset", p.listener_offset != f.listener_offset),
            ("session_key", p.session_key != f.session_key),
            ("proxy", p.proxy != f.proxy),
            ("early_releases", p.early_releases != f.early_releases),
            ("release_counting", p.release_counting != f.release_counting),
            ("quorum", p.quorum != f.quorum),
            ("release_plan", p.release_plan != f.release_plan),
            ("tp_size", p.tp_size != f.tp_size),
            ("handshake", p.handshake != f.handshake),
            ("handshake_timeout", p.handshake_timeout != f.handshake_timeout),
            ("notify", p.notify != f.notify),
            ("reaper", p.reaper != f.reaper),
            ("flexible_reads", p.flexible_reads != f.flexible_reads),
            ("drain", p.drain != f.drain),
            ("queued_lease", p.queued_lease != f.queued_lease),
            ("incarnation", p.incarnation != f.incarnation),
        ]
        .into_iter()
        .filter_map(|(name, differs)| differs.then_some(name))
        .collect()
    }

    /// (rules, legacy options) -> the listener offset, release plan and quorum rule applied: vLLM
    /// 0.33's rules replace pdkv's three decisions and its incarnation fence (no release has
    /// one); under pdkv's a legacy option keeps its historical variant, and no legacy option is
    /// undone by vLLM's rules.
    #[test]
    fn rules_replace_three_decisions_and_keep_the_rest() {
        use ListenerOffset::{DpPlusTp as Sum, DpTimesTpSizePlusTp as Product};
        use QuorumRule::{ReadersOnly, Uniform};
        use ReleasePlan::{EveryHolder, RankRead};
        let check =
            |rules: PeerRules, legacy: &[Legacy], expected: (ListenerOffset, ReleasePlan, QuorumRule)| {
                let policy = Policy::from(&legacy.iter().copied().collect::<LegacyOptions>());
                let under = policy.under(rules);
                assert_eq!(
                    (under.listener_offset, under.release_plan, under.quorum),
                    expected,
                    "{rules} {legacy:?}"
                );
                let fence = if rules.is_vllm() { IncarnationRule::Unfenced } else { policy.incarnation };
                assert_eq!(under.incarnation, fence, "{rules} {legacy:?}");
                // Every other decision is the policy's own.
                let same = Policy {
                    listener_offset: policy.listener_offset,
                    release_plan: policy.release_plan,
                    quorum: policy.quorum,
                    incarnation: policy.incarnation,
                    ..under
                };
                assert_eq!(same, policy, "{rules} {legacy:?}");
            };
        check(PeerRules::Pdkv, &[], (Product, RankRead, ReadersOnly));
        check(PeerRules::Vllm033, &[], (Sum, EveryHolder, Uniform));
        check(PeerRules::Pdkv, &[Legacy::ListenerOffsetDpPlusTp], (Sum, RankRead, ReadersOnly));
        check(PeerRules::Pdkv, &[Legacy::NoZeroQuorum], (Product, RankRead, Uniform));
        check(PeerRules::Vllm033, &[Legacy::ListenerOffsetDpPlusTp], (Sum, EveryHolder, Uniform));
        for older in [PeerRules::Vllm027, PeerRules::Vllm028, PeerRules::Vllm030] {
            check(older, &[], (Sum, RankRead, Uniform));
            check(older, &[Legacy::NoZeroQuorum], (Sum, RankRead, Uniform));
            assert_eq!(older.extensions(), Extensions::NONE);
        }
        check(
            PeerRules::Vllm033,
            &[Legacy::NoZeroQuorum, Legacy::LazyHandshake],
            (Sum, EveryHolder, Uniform),
        );
        assert_eq!(Policy::fixed().under(PeerRules::Pdkv), Policy::fixed());
        // The legacy listener option is vLLM 0.33's listener rule, nothing else of its rules.
        let legacy = Policy::from(&LegacyOptions::none().with(Legacy::ListenerOffsetDpPlusTp));
        assert_eq!(legacy.listener_offset, PeerRules::Vllm033.listener_offset());
    }

    /// vLLM 0.25's rule set is the named legacy options it shipped with: what pdkv calls bugs
    /// is what that release does. 0.26 buffers early releases; a pdkv engine facing either
    /// keeps its own reads and its own ledger.
    #[test]
    fn the_0_25_rule_set_is_its_legacy_options() {
        let legacy: LegacyOptions = [
            Legacy::ReadFromDp0,
            Legacy::ListenerOffsetDpPlusTp,
            Legacy::DropEarlyReleases,
            Legacy::NoZeroQuorum,
            Legacy::TpSizeKey,
            Legacy::LazyHandshake,
            Legacy::NoHandshakeTimeout,
            Legacy::NoFlexibleReads,
            Legacy::NoIncarnationFence,
        ]
        .into_iter()
        .collect();
        assert_eq!(Policy::fixed().under(PeerRules::Vllm025), Policy::from(&legacy));
        let v026 = Policy::fixed().under(PeerRules::Vllm026);
        assert_eq!(v026, Policy { early_releases: EarlyReleases::Buffer, ..Policy::from(&legacy) });
        assert_eq!(Policy::fixed().own(PeerRules::Pdkv), Policy::fixed());
        for rules in [PeerRules::Vllm027, PeerRules::Vllm028, PeerRules::Vllm030, PeerRules::Vllm033] {
            let unfenced = Policy { incarnation: IncarnationRule::Unfenced, ..Policy::fixed() };
            assert_eq!(Policy::fixed().own(rules), unfenced, "{rules}");
        }
        let own = Policy::fixed().own(PeerRules::Vllm025);
        assert_eq!(
            (own.read_owner, own.handshake, own.early_releases),
            (ReadOwner::Dp0, HandshakeMode::Lazy, EarlyReleases::Drop)
        );
        assert_eq!(own.listener_offset, Policy::fixed().listener_offset, "listeners are per listener");

        let (p, d) = (EngineId::prefill(0), EngineId::decode(0));
        let book = |prefill, decode| PeerBook { prefill: vec![prefill], decode: vec![decode] };
        // A pdkv decode reading a 0.25 prefill reads the owner, eagerly; 0.25's prefill drops.
        let b = Policy::fixed().between(&book(PeerRules::Vllm025, PeerRules::Pdkv), p, d);
        assert_eq!(
            (b.read_owner, b.handshake, b.early_releases),
            (ReadOwner::OwnerDp, HandshakeMode::Eager, EarlyReleases::Drop)
        );
        // A 0.25 decode reading a pdkv prefill reads DP rank 0 lazily; pdkv's prefill buffers.
        let b = Policy::fixed().between(&book(PeerRules::Pdkv, PeerRules::Vllm025), p, d);
        assert_eq!(
            (b.read_owner, b.handshake, b.early_releases),
            (ReadOwner::Dp0, HandshakeMode::Lazy, EarlyReleases::Buffer)
        );
    }

    #[test]
    fn rule_set_names_round_trip_and_unknown_names_list_the_known_ones() {
        for rules in PeerRules::ALL {
            assert_eq!(rules.name().parse::<PeerRules>(), Ok(rules));
            assert_eq!(rules.to_string(), rules.name());
        }
        let shown = "vllm-0.34".parse::<PeerRules>().unwrap_err().to_string();
        assert_eq!(
            shown,
            "unknown rule set \"vllm-0.34\"; known rule sets: pdkv, vllm-0.25, vllm-0.26, vllm-0.27, vllm-0.28, vllm-0.30, vllm-0.33"
        );
    }

    /// (book, engine a, engine b) -> the rules of a, and the rules between a and b.
    #[test]
    fn peer_book_names_engines_and_pairs_meet_on_vllm_rules() {
        use PeerRules::{Pdkv, Vllm033};
        let (p0, p1, p2, d0, d1) = (
            EngineId::prefill(0),
            EngineId::prefill(1),
            EngineId::prefill(2),
            EngineId::decode(0),
            EngineId::decode(1),
        );
        let book = PeerBook::pdkv().with(p1, Vllm033).with(d1, Vllm033);
        let check = |a: EngineId, b: EngineId, own: PeerRules, between: PeerRules| {
            assert_eq!(
                (book.rules(a), book.rules(a).meet(book.rules(b)), book.rules(b).meet(book.rules(a))),
                (own, between, between),
                "{a} {b}"
            );
        };
        check(p0, d0, Pdkv, Pdkv);
        check(p1, d0, Vllm033, Vllm033);
        check(p0, d1, Pdkv, Vllm033);
        check(p1, d1, Vllm033, Vllm033);
        check(p2, d0, Pdkv, Pdkv);
        assert_eq!(book.prefill, [Pdkv, Vllm033], "engines before a named one are filled with pdkv");
        assert_eq!(book.mixed_dialects(), None);
        // A pdkv engine meets each dialect on that dialect's rules.
        for rules in PeerRules::ALL {
            assert_eq!((Pdkv.meet(rules), rules.meet(Pdkv), rules.meet(rules)), (rules, rules, rules));
        }
        let mixed = PeerBook::pdkv().with(p1, Vllm033).with(d0, PeerRules::Vllm030);
        assert_eq!(mixed.mixed_dialects(), Some(((p1, Vllm033), (d0, PeerRules::Vllm030))));
    }

    #[test]
    fn no_option_is_the_fixed_protocol_and_each_option_changes_its_own_decision() {
        assert_eq!(Policy::from(&LegacyOptions::none()), Policy::fixed());
        let mut seen = std::collections::BTreeSet::new();
        for option in Legacy::ALL {
            let changed = changed(Policy::from(&LegacyOptions::none().with(option)));
            assert_eq!(changed.len(), 1, "{option}: {changed:?}");
            assert!(seen.insert(changed[0]), "{option} changes the decision of another option");
        }
        let all: LegacyOptions = Legacy::ALL.into_iter().collect();
        assert_eq!(changed(Policy::from(&all)).len(), Legacy::ALL.len());
    }
}
