//! How a run is judged, by both drivers: its outcome and the one function that decides it, the
//! kinds of safety violation, the prefill block ledger, and latency summaries.
//!
//! The simulator and the real cluster count different things (virtual against wall time, a
//! wait-for graph against heartbeats), but once counted, a run is judged by the same rules:
//! [`judge`]. Where a budget means something different to the two, the difference is a
//! parameter ([`BudgetRule`]), not a second copy of the rules.

use serde::{Deserialize, Serialize};

/// How a run ended, from worst to best: a safety violation outranks a hang, which outranks
/// unexcused request failures, which outrank a leak, which outranks an incomplete workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every request was sent and ended; every failure was excused by an injected fault; every
    /// block was freed by its releases; no violation.
    Clean,
    /// The run's budget (`limits.max_virtual_time_s` or `limits.max_events`) ended before the
    /// workload had sent every request, or while requests were in flight and still progressing,
    /// or while they were `stalled` (no progress, and no wait the simulator can show).
    Incomplete,
    /// Blocks were freed only by the reaper, or are still held at the end.
    Leak,
    /// A request failed without an injected fault that excuses it (`docs/sim.md`, "Excused
    /// failures").
    FailedRequests,
    /// Something waited past its timeout (a collective), or requests never ended.
    Hang,
    /// A read of freed or foreign memory, a double free, or a message to a port nobody owns.
    SafetyViolation,
}

impl Outcome {
    /// Every outcome, best first.
    pub const ALL: [Outcome; 6] = [
        Outcome::Clean,
        Outcome::Incomplete,
        Outcome::Leak,
        Outcome::FailedRequests,
        Outcome::Hang,
        Outcome::SafetyViolation,
    ];

    /// The snake_case name used in files and results.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Clean => "clean",
            Outcome::Incomplete => "incomplete",
            Outcome::Leak => "leak",
            Outcome::FailedRequests => "failed_requests",
            Outcome::Hang => "hang",
            Outcome::SafetyViolation => "safety_violation",
        }
    }
}

/// Which safety check a violation broke; written in results as its snake_case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// A read completed from blocks already freed.
    ReadFreedBlock,
    /// A read addressed memory outside every region the prefill rank registered.
    ReadForeignRegion,
    /// A block was freed twice.
    DoubleFree,
    /// A control message went to a port no listener owns.
    PortWithoutListener,
    /// A node reported an inconsistency, or a message could not be decoded.
    ProtocolError,
    /// The real cluster only (`pdkv cluster`): bytes decode read differ from the pattern the
    /// source prefill rank wrote (the wrong rank, block, layer or transfer was read).
    ReadMismatch,
}

impl ViolationKind {
    /// The name results, traces and summaries use.
    pub fn name(self) -> &'static str {
        match self {
            ViolationKind::ReadFreedBlock => "read_freed_block",
            ViolationKind::ReadForeignRegion => "read_foreign_region",
            ViolationKind::DoubleFree => "double_free",
            ViolationKind::PortWithoutListener => "port_without_listener",
            ViolationKind::ProtocolError => "protocol_error",
            ViolationKind::ReadMismatch => "read_mismatch",
        }
    }
}

impl std::fmt::Display for ViolationKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Mean and percentiles of one latency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile (results written before it existed read as 0).
    #[serde(default)]
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Summary {
    /// Summarises `values` (milliseconds), sorting them; `None` when there are none (no request
    /// finished: a mean of 0 ms would be a number nobody measured). A percentile q is the value
    /// at index `round((n - 1) * q)` of the sorted values (nearest rank, no interpolation).
    pub fn of(values: &mut [f64]) -> Option<Summary> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
        Some(Summary {
            mean: round3(mean),
            p50: round3(at(0.5)),
            p90: round3(at(0.9)),
            p99: round3(at(0.99)),
        })
    }
}

/// The values of `sorted` (ascending) at percentiles 0, 1, ..., 100, rounded to microseconds.
pub fn percentiles(sorted: &[f64]) -> Vec<f64> {
    if sorted.is_empty() {
        return Vec::new();
    }
    (0..=100)
        .map(|p| round3(sorted[((sorted.len() - 1) as f64 * f64::from(p) / 100.0).round() as usize]))
        .collect()
}

/// Jain's fairness index of `values`, rounded to three decimals; `None` when there are no
/// values or all are zero.
pub fn jain(values: &[u64]) -> Option<f64> {
    values.iter().any(|&v| v > 0).then(|| round3(pdkv_core::routes::jain_index(values)))
}

/// Rounds to three decimals so results stay readable (and byte-stable).
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Prefill block ledger totals.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ledger {
    /// Transfers whose blocks are still held at the end.
    pub held: u64,
    /// Transfers freed after their releases.
    pub freed: u64,
    /// Transfers freed by the reaper.
    pub reaped: u64,
    /// Of those, transfers whose decode engine crashed or one of whose releases or leases a
    /// fault lost: reaping is then the designed recovery and does not make the run a leak.
    pub reaped_excused: u64,
    /// Transfers held by a prefill engine when it crashed (their memory went with it).
    pub lost_in_crash: u64,
    /// Longest time any transfer's blocks were held, in milliseconds.
    pub max_hold_ms: f64,
    /// Time prefill DP ranks spent unable to start a batch for want of free blocks, in seconds.
    pub prefill_stall_s: f64,
    /// The run's budget ended while an engine holding blocks still had a reaper deadline ahead:
    /// the reaper could still have freed them, so blocks held then are no verdict of a leak
    /// (as requests the budget cut off are no verdict of a hang). Left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reaper_pending: bool,
}

/// What a budget's end means to the driver that counted the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetRule {
    /// Virtual time or an event count ends the run (the simulator): the world stands still at
    /// that instant, so the end excuses exactly what it cut: requests not sent, requests cut
    /// off while progressing or stalled, and blocks a reaper deadline still ahead could free.
    /// Blocks held with nothing cut off are a leak.
    Virtual,
    /// A wall clock ends the run (the real cluster): transfers in flight at the cut are held
    /// by processes still running, and nothing tells them from leaked ones, so a run whose
    /// budget ended is incomplete, whatever it held.
    WallClock,
}

/// What a driver counted at a run's end, in the terms the outcome rules need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// A safety violation was found.
    pub violated: bool,
    /// A signal stopped the run (the real cluster only); the rest of the count is partial.
    pub interrupted: bool,
    /// A wait was declared hung (a collective past its timeout, heartbeats that stopped, or a
    /// wait-for graph over requests that never ended).
    pub hung: bool,
    /// The run's budget (time or events) ended it.
    pub budget_ended: bool,
    /// Requests still in flight at the end.
    pub unfinished: u64,
    /// Of those, requests the budget cut off while the run was progressing.
    pub cut_off: u64,
    /// Of those, requests of a run that made no progress, with no wait to show for it.
    pub stalled: u64,
    /// Requests the workload had not sent when the budget ended.
    pub unsent: u64,
    /// Requests that failed with no injected fault to excuse them.
    pub failed_unexcused: u64,
    /// Transfers still held at the end.
    pub held: u64,
    /// Transfers freed by the reaper.
    pub reaped: u64,
    /// Of those, reaped as the designed recovery from an injected fault.
    pub reaped_excused: u64,
    /// A reaper deadline was still ahead when the budget ended, for blocks still held.
    pub reaper_pending: bool,
}

/// How a run ended: one of the [`Outcome`]s, or stopped by a signal, which only a real run can
/// be (so `Outcome` has no such variant, and scenario files cannot expect one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A signal stopped the run; the result is partial.
    Interrupted,
    /// The run ended as the outcome says.
    Ended(Outcome),
}

impl Verdict {
    /// The snake_case name results hold: the outcome's, or `interrupted`.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Interrupted => "interrupted",
            Verdict::Ended(outcome) => outcome.name(),
        }
    }
}

/// The outcome rules. A violation outranks an interruption (whose count is partial), which
/// outranks a hang; requests that never ended beyond those the budget cut off or that stalled
/// are a hang too. A hang outranks unexcused failures, which outrank what the budget rule says
/// of held blocks and of the budget's end (see [`BudgetRule`]).
pub fn judge(t: &Tally, rule: BudgetRule) -> Verdict {
    let excused_unfinished = t.cut_off.saturating_add(t.stalled);
    let outcome = if t.violated {
        Outcome::SafetyViolation
    } else if t.interrupted {
        return Verdict::Interrupted;
    } else if t.hung || t.unfinished > excused_unfinished {
        Outcome::Hang
    } else if t.failed_unexcused > 0 {
        Outcome::FailedRequests
    } else {
        let reaped_unexcused = t.reaped > t.reaped_excused;
        match rule {
            BudgetRule::Virtual => {
                if reaped_unexcused || (t.held > 0 && excused_unfinished == 0 && !t.reaper_pending) {
                    // Blocks still held by requests the budget cut off are theirs, not leaked.
                    Outcome::Leak
                } else if t.unsent > 0 || excused_unfinished > 0 || (t.reaper_pending && t.held > 0) {
                    // Cut short: requests unsent or cut off, or blocks the reaper had still to free.
                    Outcome::Incomplete
                } else {
                    Outcome::Clean
                }
            }
            BudgetRule::WallClock => {
                if t.budget_ended {
                    Outcome::Incomplete
                } else if t.held > 0 || reaped_unexcused {
                    Outcome::Leak
                } else {
                    Outcome::Clean
                }
            }
        }
    };
    Verdict::Ended(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(tally: Tally, rule: BudgetRule, expected: &str) {
        assert_eq!(judge(&tally, rule).name(), expected, "{tally:?} under {rule:?}");
    }

    const NONE: Tally = Tally {
        violated: false,
        interrupted: false,
        hung: false,
        budget_ended: false,
        unfinished: 0,
        cut_off: 0,
        stalled: 0,
        unsent: 0,
        failed_unexcused: 0,
        held: 0,
        reaped: 0,
        reaped_excused: 0,
        reaper_pending: false,
    };

    /// The table of the rules, for both budget semantics; each row differs from a clean run in
    /// what its name says.
    #[test]
    fn the_outcome_rules() {
        use BudgetRule::{Virtual, WallClock};
        let cut = Tally { budget_ended: true, unfinished: 3, cut_off: 3, held: 3, ..NONE };
        let rows: &[(Tally, &str, &str)] = &[
            (NONE, "clean", "clean"),
            (
                Tally { violated: true, interrupted: true, hung: true, ..NONE },
                "safety_violation",
                "safety_violation",
            ),
            (Tally { interrupted: true, hung: true, ..NONE }, "interrupted", "interrupted"),
            (Tally { hung: true, failed_unexcused: 1, ..NONE }, "hang", "hang"),
            // Requests that never ended and that nothing excuses are a hang, graph or not.
            (Tally { unfinished: 2, cut_off: 1, ..NONE }, "hang", "hang"),
            (Tally { failed_unexcused: 1, held: 1, ..NONE }, "failed_requests", "failed_requests"),
            (Tally { held: 1, ..NONE }, "leak", "leak"),
            (Tally { reaped: 2, reaped_excused: 1, ..NONE }, "leak", "leak"),
            (Tally { reaped: 2, reaped_excused: 2, ..NONE }, "clean", "clean"),
            // A budget that cut requests off: their blocks are theirs under both rules.
            (cut, "incomplete", "incomplete"),
            // The budget ended with everything done: nothing was cut, under virtual time.
            (Tally { budget_ended: true, ..NONE }, "clean", "incomplete"),
            // Blocks held past a cut that cut nothing off: a leak in virtual time, where the
            // world stood still; under a wall clock the cut may have caught them in flight.
            (Tally { budget_ended: true, held: 1, ..NONE }, "leak", "incomplete"),
            // The reaper could still free them.
            (Tally { budget_ended: true, held: 1, reaper_pending: true, ..NONE }, "incomplete", "incomplete"),
            // A reaper that freed what no fault excuses is a leak, even in a cut run.
            (Tally { reaped: 1, ..cut }, "leak", "incomplete"),
            (Tally { budget_ended: true, unsent: 4, ..NONE }, "incomplete", "incomplete"),
            (Tally { budget_ended: true, unfinished: 1, stalled: 1, ..NONE }, "incomplete", "incomplete"),
        ];
        for &(tally, virtual_time, wall_clock) in rows {
            check(tally, Virtual, virtual_time);
            check(tally, WallClock, wall_clock);
        }
    }

    /// (values) -> (mean, p50, p90, p99): the percentile of q is the sorted value at index
    /// round((n - 1) * q), with no interpolation.
    #[test]
    fn summaries_take_the_nearest_rank() {
        let check = |values: &[f64], expected: Option<[f64; 4]>| {
            let got = Summary::of(&mut values.to_vec()).map(|s| [s.mean, s.p50, s.p90, s.p99]);
            assert_eq!(got, expected, "{values:?}");
        };
        check(&[], None);
        check(&[7.0], Some([7.0, 7.0, 7.0, 7.0]));
        // Index round(1 * 0.5) = 1 (half away from zero), round(0.9) = 1, round(0.99) = 1.
        check(&[2.0, 1.0], Some([1.5, 2.0, 2.0, 2.0]));
        // 1..=100: index round(99 q) = 50, 89, 98 (values 51, 90, 99).
        let hundred: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        check(&hundred, Some([50.5, 51.0, 90.0, 99.0]));
        // 1..=10: round(4.5) = 5, round(8.1) = 8, round(8.91) = 9.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        check(&ten, Some([5.5, 6.0, 9.0, 10.0]));
        // Three decimals, as results are written.
        check(&[1.23456, 1.23456], Some([1.235, 1.235, 1.235, 1.235]));
    }

    #[test]
    fn every_outcome_is_listed_once_best_first() {
        let mut sorted = Outcome::ALL;
        sorted.sort();
        assert_eq!(sorted, Outcome::ALL);
        let names: std::collections::BTreeSet<&str> = Outcome::ALL.iter().map(|o| o.name()).collect();
        assert_eq!(names.len(), Outcome::ALL.len());
    }
}
