//! The core's own notion of time: an opaque instant in nanoseconds, passed in by the driver.
//!
//! The core never reads a clock. The simulator passes virtual time; the real backend passes
//! nanoseconds since its own start. Durations are plain `u64` nanoseconds named `*_ns`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Nanoseconds in a millisecond, for readable timeout constants.
pub const NS_PER_MS: u64 = 1_000_000;
/// Nanoseconds in a second.
pub const NS_PER_S: u64 = 1_000_000_000;

/// A point in (virtual or real) time, in nanoseconds since the driver's epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Instant(pub u64);

impl Instant {
    /// The driver's epoch.
    pub const ZERO: Instant = Instant(0);

    /// Nanoseconds since the epoch.
    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// This instant plus `ns` nanoseconds, saturating at the end of time rather than wrapping
    /// (a saturated deadline simply never fires).
    pub fn add_ns(self, ns: u64) -> Instant {
        Instant(self.0.saturating_add(ns))
    }

    /// Nanoseconds from `earlier` to `self`, 0 if `earlier` is later.
    pub fn since_ns(self, earlier: Instant) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Display for Instant {
    /// Seconds with millisecond precision, e.g. `12.345s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03}s", self.0 / NS_PER_S, (self.0 % NS_PER_S) / NS_PER_MS)
    }
}

/// The earliest of two optional deadlines.
pub fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_and_displays_seconds() {
        assert_eq!(Instant(5).add_ns(u64::MAX), Instant(u64::MAX));
        assert_eq!(Instant(5).since_ns(Instant(9)), 0);
        assert_eq!(Instant(12_345_678_901).to_string(), "12.345s");
        assert_eq!(earliest(Some(Instant(3)), Some(Instant(2))), Some(Instant(2)));
        assert_eq!(earliest(None, Some(Instant(2))), Some(Instant(2)));
        assert_eq!(earliest(None, None), None);
    }
}
