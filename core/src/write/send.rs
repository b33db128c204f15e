//! A prefill rank's per-transfer machine in WRITE mode: when its writes are posted, when it may
//! tell the decode ranks and free its blocks.
//!
//! # The rule
//!
//! A prefill rank writes a layer once the layer is computed and the decode ranks' blocks are
//! known (`remote_blocks`); a layer computed before that waits, as vLLM's writer defers it. It
//! sends `write_done` (and frees its blocks) once every write it posted landed. A transfer that
//! fails (a write failed, or its deadline passed: the blocks never came, or the writes took too
//! long) is answered with `write_failed` only once none of its posted writes can still complete:
//! the prefill rank aborts them and waits for every answer, then tells the decode ranks and frees.
//! Freeing earlier would let a write already on the wire carry memory another request now owns
//! into the decode's blocks. [`DrainRule::ReleaseAtOnce`] is what vLLM does (its writer marks a
//! failed transfer done and frees it at once, telling no one; the decode waits for its own
//! timeout).
//!
//! The machine counts writes; the rank keeps which layers they are. [`step`] is pure and total,
//! and [`transition_table`] lists it for the checked-in table under `docs/machines/`.

use crate::machine::{walk, TableRow};
use crate::policy::DrainRule;

/// What one transfer asks of one prefill rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendPlan {
    /// Layers to write, each once per target (at least 1).
    pub layers: u16,
    /// Decode ranks this rank writes ([`super::WritePlan::targets`]); 0 when other ranks write
    /// everything it holds.
    pub targets: u16,
}

/// Where one transfer is on one prefill rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendState {
    /// The decode blocks are not known yet; `ready` layers are computed and wait.
    AwaitingBlocks {
        /// Layers computed so far.
        ready: u16,
    },
    /// Writes posted.
    Writing {
        /// Posted writes not answered yet.
        in_flight: u32,
        /// Layers not computed yet.
        pending: u16,
    },
    /// The transfer failed with writes posted: they were aborted, and `in_flight` answers are
    /// still owed before the decode ranks are told and the blocks freed.
    Draining {
        /// Posted writes not answered yet.
        in_flight: u32,
    },
    /// Answered and freed; the rank forgets the transfer.
    Ended,
}

impl SendState {
    /// The state's name with its counts, as in the transition table.
    pub fn kind(&self) -> String {
        match self {
            SendState::AwaitingBlocks { ready } => format!("AwaitingBlocks(ready {ready})"),
            SendState::Writing { in_flight, pending } => {
                format!("Writing(in_flight {in_flight}, pending {pending})")
            }
            SendState::Draining { in_flight } => format!("Draining(in_flight {in_flight})"),
            SendState::Ended => "Ended".into(),
        }
    }
}

/// An input to the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendEvent {
    /// The decode ranks' blocks arrived (`remote_blocks`).
    BlocksKnown,
    /// One more layer is computed.
    LayerReady,
    /// A posted write landed.
    WriteOk,
    /// A posted write failed, or was aborted.
    WriteFailed,
    /// The transfer's deadline passed: the blocks never came, or the writes took too long.
    Deadline,
}

/// What a transition asks the rank to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOutput {
    /// Nothing yet.
    None,
    /// Post the writes of this many computed layers to every target.
    Post {
        /// Layers whose writes go now.
        layers: u16,
    },
    /// Abort the posted writes; every one of them will still be answered.
    Abort,
    /// Every write landed: send `write_done` to every target (none when it has none), then free.
    Done,
    /// The transfer failed: free the blocks, after telling the decode ranks (`write_failed`)
    /// when `notify`.
    Failed {
        /// Whether the decode ranks are told.
        notify: bool,
    },
    /// The event does not apply in this state (a late answer, a repeated `remote_blocks`).
    Ignored,
}

/// One transition. Pure, total, never panics; `drain` says whether a failing transfer waits for
/// its posted writes and tells the decode ranks (pdkv) or frees at once, silently (vLLM).
pub fn step(plan: SendPlan, state: SendState, event: SendEvent, drain: DrainRule) -> (SendState, SendOutput) {
    use SendEvent as E;
    use SendOutput as O;
    use SendState as S;
    let targets = u32::from(plan.targets);
    let failed = (S::Ended, O::Failed { notify: true });
    // A failure with `in_flight` writes posted.
    let fail_writing = |in_flight: u32| match (drain, in_flight) {
        (DrainRule::ReleaseAtOnce, _) => (S::Ended, O::Failed { notify: false }),
        (DrainRule::DrainFirst, 0) => failed,
        (DrainRule::DrainFirst, n) => (S::Draining { in_flight: n }, O::Abort),
    };
    match (state, event) {
        (S::AwaitingBlocks { ready }, E::LayerReady) if ready < plan.layers => {
            (S::AwaitingBlocks { ready: ready + 1 }, O::None)
        }
        (S::AwaitingBlocks { .. }, E::BlocksKnown) if targets == 0 => (S::Ended, O::Done),
        (S::AwaitingBlocks { ready }, E::BlocksKnown) => {
            let state = S::Writing { in_flight: u32::from(ready) * targets, pending: plan.layers - ready };
            let output = if ready == 0 { O::None } else { O::Post { layers: ready } };
            (state, output)
        }
        // The blocks never came: nothing was posted, so nothing can still land.
        (S::AwaitingBlocks { .. }, E::Deadline) => failed,
        (S::Writing { in_flight, pending }, E::LayerReady) if pending > 0 => {
            (S::Writing { in_flight: in_flight + targets, pending: pending - 1 }, O::Post { layers: 1 })
        }
        (S::Writing { in_flight, pending }, E::WriteOk) if in_flight > 0 => match (in_flight - 1, pending) {
            (0, 0) => (S::Ended, O::Done),
            (in_flight, pending) => (S::Writing { in_flight, pending }, O::None),
        },
        (S::Writing { in_flight, .. }, E::WriteFailed) if in_flight > 0 => fail_writing(in_flight - 1),
        (S::Writing { in_flight, .. }, E::Deadline) => fail_writing(in_flight),
        (S::Draining { in_flight }, E::WriteOk | E::WriteFailed) if in_flight > 0 => match in_flight - 1 {
            0 => failed,
            in_flight => (S::Draining { in_flight }, O::None),
        },
        _ => (state, O::Ignored),
    }
}

/// The machine's table for a transfer of two layers written to one decode rank, under pdkv's
/// drain rule: every event applied to every representative state.
pub fn transition_table() -> Vec<TableRow> {
    let plan = SendPlan { layers: 2, targets: 1 };
    let states = [
        SendState::AwaitingBlocks { ready: 0 },
        SendState::AwaitingBlocks { ready: 1 },
        SendState::AwaitingBlocks { ready: 2 },
        SendState::Writing { in_flight: 0, pending: 1 },
        SendState::Writing { in_flight: 1, pending: 1 },
        SendState::Writing { in_flight: 1, pending: 0 },
        SendState::Writing { in_flight: 2, pending: 0 },
        SendState::Draining { in_flight: 1 },
        SendState::Draining { in_flight: 2 },
        SendState::Ended,
    ];
    let events: Vec<(String, SendEvent)> = [
        SendEvent::BlocksKnown,
        SendEvent::LayerReady,
        SendEvent::WriteOk,
        SendEvent::WriteFailed,
        SendEvent::Deadline,
    ]
    .into_iter()
    .map(|e| (format!("{e:?}"), e))
    .collect();
    walk(&states, &events, |s, e| step(plan, s, e, DrainRule::DrainFirst), SendState::kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `events` from a fresh transfer and returns the outputs and the last state.
    fn run(plan: SendPlan, events: &[SendEvent], drain: DrainRule) -> (Vec<SendOutput>, SendState) {
        let mut state = SendState::AwaitingBlocks { ready: 0 };
        let mut outputs = Vec::new();
        for &e in events {
            let (next, output) = step(plan, state, e, drain);
            state = next;
            outputs.push(output);
        }
        (outputs, state)
    }

    use SendEvent::{
        BlocksKnown as Blocks, Deadline, LayerReady as Layer, WriteFailed as Bad, WriteOk as Ok,
    };
    use SendOutput as O;

    /// (events) -> outputs, for three layers written to two decode ranks.
    #[test]
    fn lifecycles_table() {
        let plan = SendPlan { layers: 3, targets: 2 };
        let check = |events: &[SendEvent], drain, expected: &[O], end: SendState| {
            let (outputs, state) = run(plan, events, drain);
            assert_eq!(outputs, expected, "{events:?}");
            assert_eq!(state, end, "{events:?}");
        };
        let first = DrainRule::DrainFirst;
        let ended = SendState::Ended;
        // Blocks first: each layer posts as it is computed; done after the last write.
        check(
            &[Blocks, Layer, Ok, Ok, Layer, Layer, Ok, Ok, Ok, Ok],
            first,
            &[O::None, O::Post { layers: 1 }, O::None, O::None, O::Post { layers: 1 }, O::Post { layers: 1 }]
                .into_iter()
                .chain([O::None, O::None, O::None, O::Done])
                .collect::<Vec<_>>(),
            ended,
        );
        // Layers first: the computed ones wait for the blocks and go together.
        check(
            &[Layer, Layer, Blocks, Layer, Ok, Ok, Ok, Ok, Ok, Ok],
            first,
            &[
                O::None,
                O::None,
                O::Post { layers: 2 },
                O::Post { layers: 1 },
                O::None,
                O::None,
                O::None,
                O::None,
            ]
            .into_iter()
            .chain([O::None, O::Done])
            .collect::<Vec<_>>(),
            ended,
        );
        // The blocks never come: write_failed, nothing to drain.
        check(&[Layer, Deadline], first, &[O::None, O::Failed { notify: true }], ended);
        // A write fails with three more in flight: abort, drain, then tell and free.
        check(
            &[Blocks, Layer, Layer, Bad, Ok, Bad, Ok, Layer],
            first,
            &[O::None, O::Post { layers: 1 }, O::Post { layers: 1 }, O::Abort, O::None, O::None]
                .into_iter()
                .chain([O::Failed { notify: true }, O::Ignored])
                .collect::<Vec<_>>(),
            ended,
        );
        // vLLM: a failed write frees at once and tells nobody; late answers are ignored.
        check(
            &[Blocks, Layer, Bad, Ok],
            DrainRule::ReleaseAtOnce,
            &[O::None, O::Post { layers: 1 }, O::Failed { notify: false }, O::Ignored],
            ended,
        );
        // A deadline while writing drains too.
        check(
            &[Blocks, Layer, Deadline, Ok, Ok],
            first,
            &[O::None, O::Post { layers: 1 }, O::Abort, O::None, O::Failed { notify: true }],
            ended,
        );
    }

    /// A rank other ranks write for (MLA fan-in under the first-holder rule) frees as soon as
    /// the blocks are known: it writes nothing and sends nothing.
    #[test]
    fn a_rank_without_targets_is_done_at_the_blocks() {
        let plan = SendPlan { layers: 61, targets: 0 };
        let (outputs, state) = run(plan, &[Layer, Blocks, Layer], DrainRule::DrainFirst);
        assert_eq!(outputs, [O::None, O::Done, O::Ignored]);
        assert_eq!(state, SendState::Ended);
    }

    /// Whatever arrives, in any order: never a second answer, never a free while a write is
    /// posted under the drain rule, and every transfer whose writes all land ends done.
    #[test]
    fn no_answer_twice_and_no_free_under_a_posted_write() {
        let plan = SendPlan { layers: 2, targets: 2 };
        let all = [Blocks, Layer, Ok, Bad, Deadline];
        for seq in crate::machine::sequences(&all, 6) {
            let mut state = SendState::AwaitingBlocks { ready: 0 };
            let mut answers = 0;
            let mut posted: u32 = 0;
            let mut answered: u32 = 0;
            for &e in &seq {
                let (next, output) = step(plan, state, e, DrainRule::DrainFirst);
                if matches!(e, Ok | Bad) && output != O::Ignored {
                    answered += 1;
                }
                match output {
                    O::Post { layers } => posted += u32::from(layers) * 2,
                    O::Done | O::Failed { .. } => {
                        answers += 1;
                        assert_eq!(posted, answered, "{seq:?}: freed with writes posted");
                    }
                    _ => {}
                }
                state = next;
            }
            assert!(answers <= 1, "{seq:?}");
        }
    }
}
