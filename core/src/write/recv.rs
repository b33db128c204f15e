//! A decode rank's per-request machine in WRITE mode: when its KV is complete, and when the
//! blocks the prefill ranks write into may be freed.
//!
//! # The rule
//!
//! A decode rank has its KV once each of its writers ([`super::writers_of`]) sent `write_done`.
//! A request that fails first (its deadline passed, or a writer sent `write_failed`) is reported
//! failed at once, but its blocks stay held until every writer has answered, or until the
//! writers' own deadline has passed: a prefill rank answers only once none of its writes can
//! still land (its drain rule, [`super::send`]), so before that a write may still be on the wire
//! into these blocks, and a block freed and handed to another request would take it.
//! [`QuarantineRule::FreeAtOnce`] is what vLLM does: a decode request that fails frees its blocks
//! at once.
//!
//! [`step`] is pure and total, and [`transition_table`] lists it for the checked-in table under
//! `docs/machines/`.

use crate::machine::{walk, TableRow};

/// What a failed request does with blocks writers may still write into.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QuarantineRule {
    /// pdkv: hold them until every writer answered or the writers' deadline passed.
    #[default]
    Hold,
    /// vLLM: free them with the failure.
    FreeAtOnce,
}

/// Where one request is on one decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvState {
    /// Blocks allocated and named to the writers; `answered` writers have sent `write_done`.
    Awaiting {
        /// Writers that answered.
        answered: u16,
    },
    /// The request failed with writers that have not answered: its blocks are held.
    Quarantined {
        /// Writers that answered.
        answered: u16,
    },
    /// The KV is complete, or the request failed and its blocks are free.
    Ended,
}

impl RecvState {
    /// The state's name with its count, as in the transition table.
    pub fn kind(&self) -> String {
        match self {
            RecvState::Awaiting { answered } => format!("Awaiting(answered {answered})"),
            RecvState::Quarantined { answered } => format!("Quarantined(answered {answered})"),
            RecvState::Ended => "Ended".into(),
        }
    }
}

/// An input to the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvEvent {
    /// A writer's `write_done`: all its writes landed.
    WriteDone,
    /// A writer's `write_failed`: it gave up and will write nothing more.
    WriteFailed,
    /// The request's deadline passed.
    Deadline,
    /// The writers' deadline passed: each has answered or can no longer write.
    WritersGone,
}

/// What a transition asks the rank to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvOutput {
    /// Nothing yet.
    None,
    /// Every writer's KV landed: the request may decode.
    Received,
    /// Report the request failed; free its blocks now when `free_blocks`, else later with
    /// [`RecvOutput::FreeBlocks`].
    Fail {
        /// Whether the blocks are freed with the failure.
        free_blocks: bool,
    },
    /// The quarantine is over: free the failed request's blocks.
    FreeBlocks,
    /// The event does not apply in this state.
    Ignored,
}

/// One transition for a request written by `writers` prefill ranks (at least 1). Pure, total,
/// never panics.
pub fn step(
    writers: u16,
    state: RecvState,
    event: RecvEvent,
    rule: QuarantineRule,
) -> (RecvState, RecvOutput) {
    use RecvEvent as E;
    use RecvOutput as O;
    use RecvState as S;
    // A failure after `answered` writers answered.
    let fail = |answered: u16| {
        if answered >= writers || rule == QuarantineRule::FreeAtOnce {
            (S::Ended, O::Fail { free_blocks: true })
        } else {
            (S::Quarantined { answered }, O::Fail { free_blocks: false })
        }
    };
    match (state, event) {
        (S::Awaiting { answered }, E::WriteDone) if answered + 1 >= writers => (S::Ended, O::Received),
        (S::Awaiting { answered }, E::WriteDone) => (S::Awaiting { answered: answered + 1 }, O::None),
        (S::Awaiting { answered }, E::WriteFailed) => fail(answered + 1),
        (S::Awaiting { answered }, E::Deadline) => fail(answered),
        (S::Awaiting { .. }, E::WritersGone) => (S::Ended, O::Fail { free_blocks: true }),
        (S::Quarantined { answered }, E::WriteDone | E::WriteFailed) if answered + 1 >= writers => {
            (S::Ended, O::FreeBlocks)
        }
        (S::Quarantined { answered }, E::WriteDone | E::WriteFailed) => {
            (S::Quarantined { answered: answered + 1 }, O::None)
        }
        (S::Quarantined { .. }, E::WritersGone) => (S::Ended, O::FreeBlocks),
        _ => (state, O::Ignored),
    }
}

/// The machine's table for a request written by two prefill ranks, under pdkv's rule: every
/// event applied to every representative state.
pub fn transition_table() -> Vec<TableRow> {
    let states = [
        RecvState::Awaiting { answered: 0 },
        RecvState::Awaiting { answered: 1 },
        RecvState::Quarantined { answered: 0 },
        RecvState::Quarantined { answered: 1 },
        RecvState::Ended,
    ];
    let events: Vec<(String, RecvEvent)> =
        [RecvEvent::WriteDone, RecvEvent::WriteFailed, RecvEvent::Deadline, RecvEvent::WritersGone]
            .into_iter()
            .map(|e| (format!("{e:?}"), e))
            .collect();
    walk(&states, &events, |s, e| step(2, s, e, QuarantineRule::Hold), RecvState::kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use RecvEvent::{Deadline, WriteDone as Done, WriteFailed as Failed, WritersGone as Gone};
    use RecvOutput as O;

    fn run(writers: u16, events: &[RecvEvent], rule: QuarantineRule) -> Vec<RecvOutput> {
        let mut state = RecvState::Awaiting { answered: 0 };
        events
            .iter()
            .map(|&e| {
                let (next, output) = step(writers, state, e, rule);
                state = next;
                output
            })
            .collect()
    }

    /// (writers, events, rule) -> outputs.
    #[test]
    fn lifecycles_table() {
        let check = |writers: u16, events: &[RecvEvent], rule, expected: &[O]| {
            assert_eq!(run(writers, events, rule), expected, "{writers} writers, {events:?}, {rule:?}");
        };
        let hold = QuarantineRule::Hold;
        check(1, &[Done, Done], hold, &[O::Received, O::Ignored]);
        check(2, &[Done, Done], hold, &[O::None, O::Received]);
        // A deadline with one of two writers answered: failed now, blocks held for the other.
        check(2, &[Done, Deadline, Done], hold, &[O::None, O::Fail { free_blocks: false }, O::FreeBlocks]);
        check(2, &[Deadline, Gone, Done], hold, &[O::Fail { free_blocks: false }, O::FreeBlocks, O::Ignored]);
        // A write_failed answers for its writer; the other still may write.
        check(2, &[Failed, Done], hold, &[O::Fail { free_blocks: false }, O::FreeBlocks]);
        check(1, &[Failed], hold, &[O::Fail { free_blocks: true }]);
        // vLLM frees with the failure, whatever may still land.
        check(2, &[Deadline, Done], QuarantineRule::FreeAtOnce, &[O::Fail { free_blocks: true }, O::Ignored]);
    }

    /// Under pdkv's rule the blocks are freed exactly once, and never while a writer that has
    /// not answered could still write before the writers' deadline.
    #[test]
    fn blocks_free_once_and_only_when_no_write_can_land() {
        let all = [Done, Failed, Deadline, Gone];
        for writers in 1..=3u16 {
            for seq in crate::machine::sequences(&all, 6) {
                let mut state = RecvState::Awaiting { answered: 0 };
                let (mut answered, mut gone, mut frees, mut ends) = (0u16, false, 0, 0);
                for &e in &seq {
                    let (next, output) = step(writers, state, e, QuarantineRule::Hold);
                    if output != O::Ignored {
                        match e {
                            Done | Failed => answered += 1,
                            Gone => gone = true,
                            Deadline => {}
                        }
                    }
                    let freed = matches!(output, O::FreeBlocks | O::Fail { free_blocks: true });
                    if freed {
                        frees += 1;
                        assert!(answered >= writers || gone, "{writers} writers, {seq:?}: freed too early");
                    }
                    if matches!(output, O::Received | O::Fail { .. }) {
                        ends += 1;
                    }
                    state = next;
                }
                assert!(frees <= 1 && ends <= 1, "{writers} writers, {seq:?}");
            }
        }
    }
}
