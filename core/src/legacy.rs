//! Named switches that bring back historical connector bugs, so the simulator can reproduce them.
//!
//! Every option is off by default; the default protocol is the fixed one. Each option names the
//! bug it restores and what it breaks, and has a test beside the code it changes.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// One historical behaviour that caused a known hang, leak or hot spot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Legacy {
    /// Decode always reads prefill DP rank 0, whatever rank owns the request.
    ReadFromDp0,
    /// Listeners bind at `base + dp + tp` while dialers use `base + dp * tp_size + tp`.
    ListenerOffsetDpPlusTp,
    /// Sessions are keyed `<engine>_dp<d>`, so two TP ranks of one DP rank share a session.
    SessionKeyWithoutTp,
    /// The proxy takes engine and DP rank from one counter (`k mod n`, `k mod D`).
    ProxyAliasing,
    /// A release for a transfer the prefill worker does not know yet is dropped, not buffered.
    DropEarlyReleases,
    /// Releases are collected into a set by transfer id, so identical ones from different
    /// decode ranks count once.
    DedupReleases,
    /// Every prefill rank waits for `expected_releases(producer_tp, consumer_tp)` releases even
    /// if no decode rank reads it; its blocks are then freed only by the reaper.
    NoZeroQuorum,
    /// Decode reads only the `tp_size` key of `kv_transfer_params` (default 1) and ignores the
    /// `remote_tp_size` the proxy wrote, collapsing every read onto TP rank 0.
    TpSizeKey,
    /// Decode handshakes on the read path, blocking one worker through every DP rank of the
    /// remote engine while its TP peers enter the forward collective.
    LazyHandshake,
    /// A handshake dial waits forever for its reply (no socket timeout).
    NoHandshakeTimeout,
    /// The release goes to a rank recomputed without the owner DP rank or the flexible pick,
    /// so one rank is read and another is notified.
    NotifyOtherRank,
    /// The deferred-free reaper ignores read leases and frees blocks without first revoking
    /// remote access, so a read still in flight reads memory another request now uses.
    ReaperIgnoresReads,
    /// The flexible round-robin is off: a TP1 decode worker reading a TP-replicated MLA
    /// prefill uses the fixed mapping, so every read lands on TP rank 0 of the prefill engine.
    NoFlexibleReads,
    /// A request that fails while its reads are posted (its transfer timeout passed, or one of
    /// its reads failed) is released at once, without aborting and draining the other reads:
    /// the producer frees blocks that a posted read then completes from.
    ReleaseDuringReads,
    /// A request the decode engine queued (its batch or KV pool full) is leased only when a
    /// step admits it, so one that waits longer than the producer's `defer_timeout` is reaped
    /// before it is read (pdkv before its queued leases; MoRIIO leases nothing at all).
    NoQueuedLease,
    /// No incarnations: a decode rank reads, releases and leases whatever incarnation of a
    /// prefill rank answers, and a prefill rank takes releases, leases and retirements meant for
    /// its previous incarnation. A transfer prefilled before a restart and dispatched after it is
    /// read from the restarted rank's memory with the old block ids (vLLM's MoRIIO, like every
    /// connector without a fence).
    NoIncarnationFence,
}

impl Legacy {
    /// Every legacy option once, in declaration order (the order [`LegacyOptions::iter`] yields).
    pub const ALL: [Legacy; 16] = [
        Legacy::ReadFromDp0,
        Legacy::ListenerOffsetDpPlusTp,
        Legacy::SessionKeyWithoutTp,
        Legacy::ProxyAliasing,
        Legacy::DropEarlyReleases,
        Legacy::DedupReleases,
        Legacy::NoZeroQuorum,
        Legacy::TpSizeKey,
        Legacy::LazyHandshake,
        Legacy::NoHandshakeTimeout,
        Legacy::NotifyOtherRank,
        Legacy::ReaperIgnoresReads,
        Legacy::NoFlexibleReads,
        Legacy::ReleaseDuringReads,
        Legacy::NoQueuedLease,
        Legacy::NoIncarnationFence,
    ];

    /// The kebab-case name used on the command line and in scenario files.
    pub fn name(self) -> &'static str {
        match self {
            Legacy::ReadFromDp0 => "read-from-dp0",
            Legacy::ListenerOffsetDpPlusTp => "listener-offset-dp-plus-tp",
            Legacy::SessionKeyWithoutTp => "session-key-without-tp",
            Legacy::ProxyAliasing => "proxy-aliasing",
            Legacy::DropEarlyReleases => "drop-early-releases",
            Legacy::DedupReleases => "dedup-releases",
            Legacy::NoZeroQuorum => "no-zero-quorum",
            Legacy::TpSizeKey => "tp-size-key",
            Legacy::LazyHandshake => "lazy-handshake",
            Legacy::NoHandshakeTimeout => "no-handshake-timeout",
            Legacy::NotifyOtherRank => "notify-other-rank",
            Legacy::ReaperIgnoresReads => "reaper-ignores-reads",
            Legacy::NoFlexibleReads => "no-flexible-reads",
            Legacy::ReleaseDuringReads => "release-during-reads",
            Legacy::NoQueuedLease => "no-queued-lease",
            Legacy::NoIncarnationFence => "no-incarnation-fence",
        }
    }

    /// One sentence: what the option restores and what it breaks.
    pub fn description(self) -> &'static str {
        match self {
            Legacy::ReadFromDp0 => {
                "decode reads prefill DP rank 0 for every request; other DP ranks' blocks are \
                 never read and block ids can overrun DP0's memory region"
            }
            Legacy::ListenerOffsetDpPlusTp => {
                "listeners bind base+dp+tp while dialers use base+dp*tp_size+tp; ports collide \
                 and dials miss when DP>1 and TP>1"
            }
            Legacy::SessionKeyWithoutTp => {
                "sessions keyed per (engine, dp) only; TP ranks of one DP rank share a session \
                 and reads use the wrong rank's memory descriptors"
            }
            Legacy::ProxyAliasing => {
                "proxy takes engine = k mod n and dp = k mod D from one counter; with 2 engines \
                 of DP8, engine 0 sees only even DP ranks and half the GPUs idle"
            }
            Legacy::DropEarlyReleases => {
                "a release arriving before the prefill worker knows the transfer is dropped; \
                 the fan-in never completes and the blocks wait for the reaper"
            }
            Legacy::DedupReleases => {
                "releases are deduplicated by transfer id; when several decode ranks read one \
                 prefill rank (P4 to D8) the fan-in never completes"
            }
            Legacy::NoZeroQuorum => {
                "every prefill rank waits for releases even when no decode rank reads it \
                 (P8 to D4, flexible reads); those blocks are freed only by the reaper"
            }
            Legacy::TpSizeKey => {
                "decode reads kv_transfer_params[tp_size] (default 1) instead of remote_tp_size; \
                 every decode rank reads prefill TP rank 0"
            }
            Legacy::LazyHandshake => {
                "decode handshakes on the read path, one DP rank at a time; a lost reply blocks \
                 one worker while its TP peers wait in the forward collective until it times out"
            }
            Legacy::NoHandshakeTimeout => {
                "a handshake dial waits forever for its reply; one lost message hangs the worker"
            }
            Legacy::NotifyOtherRank => {
                "the release is addressed to DP 0 and the fixed-mapping TP rank instead of the \
                 rank read; the read rank's blocks wait for the reaper"
            }
            Legacy::ReaperIgnoresReads => {
                "the reaper ignores read leases and frees without revoking remote access; a \
                 read still in flight returns another request's KV silently"
            }
            Legacy::NoFlexibleReads => {
                "TP1 decode workers reading a TP-replicated MLA prefill all use the fixed mapping; \
                 every read lands on prefill TP rank 0, one NIC of eight carries the traffic"
            }
            Legacy::ReleaseDuringReads => {
                "a request that times out (or whose read fails) is released while its other reads \
                 are still posted; prefill frees the blocks and a read completes from freed memory"
            }
            Legacy::NoQueuedLease => {
                "a request waiting in the decode queue holds no lease; after defer_timeout the \
                 prefill reaper frees its KV and its reads are refused when a step admits it"
            }
            Legacy::NoIncarnationFence => {
                "no incarnation check: a request prefilled before a prefill rank restarted and \
                 dispatched after it reads the old block ids from the new incarnation's memory, \
                 another request's KV or free blocks, silently"
            }
        }
    }
}

impl fmt::Display for Legacy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A legacy option name that pdkv does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownLegacy(pub String);

impl fmt::Display for UnknownLegacy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let known: Vec<&str> = Legacy::ALL.iter().map(|l| l.name()).collect();
        write!(f, "unknown legacy option {:?}; known options: {}", self.0, known.join(", "))
    }
}

impl std::error::Error for UnknownLegacy {}

impl FromStr for Legacy {
    type Err = UnknownLegacy;

    fn from_str(s: &str) -> Result<Legacy, UnknownLegacy> {
        Legacy::ALL.iter().copied().find(|l| l.name() == s).ok_or_else(|| UnknownLegacy(s.to_string()))
    }
}

/// The set of legacy options switched on; empty is the fixed protocol.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(transparent)]
pub struct LegacyOptions(BTreeSet<Legacy>);

impl LegacyOptions {
    /// No option switched on: the fixed protocol.
    pub fn none() -> LegacyOptions {
        LegacyOptions::default()
    }

    /// This set plus `option`, for building a set in one expression.
    pub fn with(mut self, option: Legacy) -> LegacyOptions {
        self.0.insert(option);
        self
    }

    /// Switches `option` on; switching it on twice changes nothing.
    pub fn insert(&mut self, option: Legacy) {
        self.0.insert(option);
    }

    /// Whether `option` is switched on.
    pub fn has(&self, option: Legacy) -> bool {
        self.0.contains(&option)
    }

    /// True for the fixed protocol (no option switched on).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The options switched on, each once, in declaration order.
    pub fn iter(&self) -> impl Iterator<Item = Legacy> + '_ {
        self.0.iter().copied()
    }
}

impl FromIterator<Legacy> for LegacyOptions {
    fn from_iter<I: IntoIterator<Item = Legacy>>(iter: I) -> LegacyOptions {
        LegacyOptions(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_known_ones() {
        for option in Legacy::ALL {
            assert_eq!(option.name().parse::<Legacy>(), Ok(option));
            assert!(!option.description().is_empty());
        }
        let err = "read-from-dp1".parse::<Legacy>().unwrap_err();
        let shown = err.to_string();
        assert!(shown.contains("\"read-from-dp1\"") && shown.contains("read-from-dp0"), "{shown}");
    }
}
