//! The protocol's timeouts as one value, with one set of limits and saturating conversions, for
//! every driver: a scenario's `protocol` section and the cluster's flags both become a
//! [`ProtocolTimeouts`].

use std::fmt;

use pdkv_core::decode::DecodeConfig;
use serde::{Deserialize, Serialize};

/// Nanoseconds in a millisecond.
pub const NS_PER_MS: u64 = 1_000_000;

/// Shortest timeout accepted, in milliseconds: a timeout of 0 would fire before anything could
/// happen, which tests nothing.
pub const MIN_TIMEOUT_MS: u64 = 1;

/// Longest timeout accepted, in milliseconds (about 115 days): far beyond any real deadline,
/// and small enough that sums of a few timeouts in nanoseconds stay far below `u64::MAX`.
pub const MAX_TIMEOUT_MS: u64 = 10_000_000_000;

/// Milliseconds as nanoseconds, saturating (a value past the limits never wraps around to a
/// short deadline).
pub fn ms_ns(ms: u64) -> u64 {
    ms.saturating_mul(NS_PER_MS)
}

/// The protocol's timeouts, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtocolTimeouts {
    /// Deadline of a decode worker's handshake dial.
    pub handshake_ms: u64,
    /// Deadline of a request's KV at a decode worker, from the request's arrival there; also
    /// what a read lease asks for.
    pub transfer_ms: u64,
    /// The prefill engine's reaper (MoRIIO's deferred free): how long a transfer's blocks wait
    /// for their releases.
    pub defer_ms: u64,
    /// Deadline of a TP or EP collective (NCCL's watchdog).
    pub collective_ms: u64,
}

impl Default for ProtocolTimeouts {
    /// MoRIIO's and NCCL's: a 10 s handshake, a 30 s transfer, a 60 s reaper, a 600 s
    /// collective.
    fn default() -> Self {
        ProtocolTimeouts {
            handshake_ms: 10_000,
            transfer_ms: 30_000,
            defer_ms: 60_000,
            collective_ms: 600_000,
        }
    }
}

/// One of the protocol's timeouts, to name it in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timeout {
    /// [`ProtocolTimeouts::handshake_ms`].
    Handshake,
    /// [`ProtocolTimeouts::transfer_ms`].
    Transfer,
    /// [`ProtocolTimeouts::defer_ms`].
    Defer,
    /// [`ProtocolTimeouts::collective_ms`].
    Collective,
}

impl Timeout {
    /// Its name in words.
    pub fn name(self) -> &'static str {
        match self {
            Timeout::Handshake => "handshake",
            Timeout::Transfer => "transfer",
            Timeout::Defer => "defer",
            Timeout::Collective => "collective",
        }
    }
}

/// A timeout outside [`MIN_TIMEOUT_MS`]`..=`[`MAX_TIMEOUT_MS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeoutError {
    /// Which timeout.
    pub timeout: Timeout,
    /// Its value, in milliseconds.
    pub value_ms: u64,
}

impl fmt::Display for TimeoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} timeout of {} ms is outside {MIN_TIMEOUT_MS} to {MAX_TIMEOUT_MS} ms (about 115 days)",
            self.timeout.name(),
            self.value_ms
        )
    }
}

impl std::error::Error for TimeoutError {}

impl ProtocolTimeouts {
    /// Each timeout with its value, in a fixed order.
    pub fn each(&self) -> [(Timeout, u64); 4] {
        [
            (Timeout::Handshake, self.handshake_ms),
            (Timeout::Transfer, self.transfer_ms),
            (Timeout::Defer, self.defer_ms),
            (Timeout::Collective, self.collective_ms),
        ]
    }

    /// Whether `value_ms` is a timeout the protocol accepts.
    pub fn within_limits(value_ms: u64) -> bool {
        (MIN_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(&value_ms)
    }

    /// The first timeout outside the limits, if any.
    pub fn check(&self) -> Result<(), TimeoutError> {
        match self.each().into_iter().find(|&(_, ms)| !Self::within_limits(ms)) {
            Some((timeout, value_ms)) => Err(TimeoutError { timeout, value_ms }),
            None => Ok(()),
        }
    }

    /// [`Self::handshake_ms`] in nanoseconds.
    pub fn handshake_ns(&self) -> u64 {
        ms_ns(self.handshake_ms)
    }

    /// [`Self::transfer_ms`] in nanoseconds.
    pub fn transfer_ns(&self) -> u64 {
        ms_ns(self.transfer_ms)
    }

    /// [`Self::defer_ms`] in nanoseconds.
    pub fn defer_ns(&self) -> u64 {
        ms_ns(self.defer_ms)
    }

    /// [`Self::collective_ms`] in nanoseconds.
    pub fn collective_ns(&self) -> u64 {
        ms_ns(self.collective_ms)
    }

    /// The read lease a decode worker asks for, in milliseconds: the transfer timeout, capped
    /// at what the wire's `u32` carries.
    pub fn lease_ms(&self) -> u32 {
        u32::try_from(self.transfer_ms).unwrap_or(u32::MAX)
    }

    /// The longest any protocol wait may legitimately last: the collective timeout, or a
    /// transfer's handshake, transfer and reaper timeouts in a row, whichever is longer. A run
    /// that made no progress for longer is not merely slow.
    pub fn stall_window_ns(&self) -> u64 {
        let transfer = self.handshake_ns().saturating_add(self.transfer_ns()).saturating_add(self.defer_ns());
        self.collective_ns().max(transfer)
    }

    /// A decode worker's configuration with these timeouts.
    pub fn apply_to(&self, config: &mut DecodeConfig) {
        config.handshake_timeout_ns = self.handshake_ns();
        config.transfer_timeout_ns = self.transfer_ns();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::{EngineId, RankId};
    use pdkv_core::policy::Policy;
    use pdkv_core::topology::{Layout, ModelSpec};

    fn check(t: ProtocolTimeouts, expected: Result<(), &str>) {
        assert_eq!(t.check().map_err(|e| e.to_string()), expected.map_err(str::to_string), "{t:?}");
    }

    #[test]
    fn one_set_of_limits_for_every_timeout() {
        let base = ProtocolTimeouts::default();
        check(base, Ok(()));
        check(ProtocolTimeouts { handshake_ms: 1, ..base }, Ok(()));
        check(ProtocolTimeouts { collective_ms: MAX_TIMEOUT_MS, ..base }, Ok(()));
        check(
            ProtocolTimeouts { handshake_ms: 0, ..base },
            Err("the handshake timeout of 0 ms is outside 1 to 10000000000 ms (about 115 days)"),
        );
        check(
            ProtocolTimeouts { defer_ms: u64::MAX, ..base },
            Err("the defer timeout of 18446744073709551615 ms is outside 1 to 10000000000 ms (about 115 days)"),
        );
        // The first one outside is named.
        let both = ProtocolTimeouts { transfer_ms: 0, collective_ms: 0, ..base };
        assert_eq!(both.check().map_err(|e| e.timeout), Err(Timeout::Transfer));
    }

    #[test]
    fn conversions_saturate_instead_of_wrapping() {
        let huge = ProtocolTimeouts {
            handshake_ms: u64::MAX,
            transfer_ms: u64::MAX,
            defer_ms: u64::MAX,
            collective_ms: 1,
        };
        assert_eq!(huge.handshake_ns(), u64::MAX);
        assert_eq!(huge.stall_window_ns(), u64::MAX);
        assert_eq!(huge.lease_ms(), u32::MAX);
        // Within the limits nothing saturates: every sum of the protocol's four fits.
        let max = ProtocolTimeouts {
            handshake_ms: MAX_TIMEOUT_MS,
            transfer_ms: MAX_TIMEOUT_MS,
            defer_ms: MAX_TIMEOUT_MS,
            collective_ms: MAX_TIMEOUT_MS,
        };
        assert_eq!(max.stall_window_ns(), 3 * MAX_TIMEOUT_MS * NS_PER_MS);
        let rank = RankId::new(EngineId::decode(0), 0, 0);
        let layout = Layout { dp: 1, tp: 1, ep: false };
        let mut config = DecodeConfig::new(rank, layout, ModelSpec::default(), Policy::default(), "d".into());
        let short = ProtocolTimeouts { handshake_ms: 7, transfer_ms: 9, ..ProtocolTimeouts::default() };
        short.apply_to(&mut config);
        assert_eq!((config.handshake_timeout_ns, config.transfer_timeout_ns), (7 * NS_PER_MS, 9 * NS_PER_MS));
    }
}
