//! The protocol's decisions that legacy options change, resolved once into typed rules.
//!
//! A [`LegacyOptions`] set is a list of switches; code that asked `legacy.has(...)` at each
//! decision point let two places answer one question differently (the flexible-read rule was
//! computed in the router and again in the quorum plan, and the notify target a third way).
//! [`Policy::from`] is the only code that reads the switches: every node and function takes the
//! policy, or the one field it decides on, and matches on a variant named for what it does.
//! [`Policy::default`] is the fixed protocol; each legacy variant names the option selecting it.

use crate::legacy::{Legacy, LegacyOptions};

/// Which prefill DP rank decode reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReadOwner {
    /// The request's owner DP rank (`remote_dp_rank`).
    #[default]
    OwnerDp,
    /// DP rank 0 for every request ([`Legacy::ReadFromDp0`]).
    Dp0,
}

/// Which port offset a listener binds (dialers always use `dp * tp_size + tp`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ListenerOffset {
    /// `dp * tp_size + tp`, the dialers' offset.
    #[default]
    DpTimesTpSizePlusTp,
    /// `dp + tp` ([`Legacy::ListenerOffsetDpPlusTp`]).
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
    /// MoRIIO's uniform `expected_releases` for every rank ([`Legacy::NoZeroQuorum`]).
    Uniform,
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
}

impl Policy {
    /// The fixed protocol: no legacy option.
    pub fn fixed() -> Policy {
        Policy::default()
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
            listener_offset: pick(
                legacy.has(Legacy::ListenerOffsetDpPlusTp),
                ListenerOffset::DpTimesTpSizePlusTp,
                ListenerOffset::DpPlusTp,
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
            ("tp_size", p.tp_size != f.tp_size),
            ("handshake", p.handshake != f.handshake),
            ("handshake_timeout", p.handshake_timeout != f.handshake_timeout),
            ("notify", p.notify != f.notify),
            ("reaper", p.reaper != f.reaper),
            ("flexible_reads", p.flexible_reads != f.flexible_reads),
            ("drain", p.drain != f.drain),
            ("queued_lease", p.queued_lease != f.queued_lease),
        ]
        .into_iter()
        .filter_map(|(name, differs)| differs.then_some(name))
        .collect()
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
