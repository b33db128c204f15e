//! One transfer's lifecycle as a prefill engine sees it: held until every worker of the owner
//! DP group finished (or was lost), or reaped; a pure [`transfer_step`] with a listed
//! transition table ([`lifecycle_table`]).

use std::collections::BTreeSet;

/// The engine-level state of one transfer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TransferState {
    /// Blocks held; `finished` lists the TP ranks of the owner DP group that reported done.
    Held {
        /// TP ranks that finished.
        finished: BTreeSet<u16>,
        /// TP ranks whose worker died for good before it finished.
        lost: BTreeSet<u16>,
        /// TP ranks in the group.
        group: u16,
        /// Whether the group completes as a whole on one rank's release (flexible read).
        flexible: bool,
    },
    /// Every worker finished; blocks freed.
    Freed,
    /// The reaper freed the blocks.
    Reaped,
}

impl TransferState {
    /// The state's name without its data, as in the transition table.
    pub fn kind(&self) -> String {
        let base = match self {
            TransferState::Held { finished, flexible: false, .. } if finished.is_empty() => "Held",
            TransferState::Held { flexible: false, .. } => "PartlyFinished",
            TransferState::Held { finished, flexible: true, .. } if finished.is_empty() => "HeldFlexible",
            TransferState::Held { flexible: true, .. } => "GroupDoneSent",
            TransferState::Freed => "Freed",
            TransferState::Reaped => "Reaped",
        };
        match self {
            TransferState::Held { lost, .. } if !lost.is_empty() => format!("{base}+Lost"),
            _ => base.to_string(),
        }
    }
}

/// An input to the transfer lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferEvent {
    /// The worker with this TP rank finished its part.
    WorkerFinished(u16),
    /// The worker with this TP rank died for good: its memory is gone with it, so no read of it
    /// can complete and no release for it will come; its part counts as finished.
    WorkerLost(u16),
    /// `defer_timeout` passed since registration.
    ReaperDeadline,
}

/// What a lifecycle transition asks the engine to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferOutput {
    /// Nothing yet.
    None,
    /// Tell the other workers of the group the transfer was read (flexible), then wait.
    GroupDone,
    /// Every worker finished: report finished sending and free.
    Free,
    /// Reap: (fence and) free with a warning.
    Reap,
    /// The event came after the transfer ended or repeats one; ignored.
    Ignored,
}

/// One lifecycle transition. Pure, total, never panics.
pub fn transfer_step(state: TransferState, event: TransferEvent) -> (TransferState, TransferOutput) {
    match (state, event) {
        (TransferState::Held { mut finished, lost, group, flexible }, TransferEvent::WorkerFinished(tp)) => {
            if tp >= group || lost.contains(&tp) || !finished.insert(tp) {
                return (TransferState::Held { finished, lost, group, flexible }, TransferOutput::Ignored);
            }
            if finished.len() + lost.len() == usize::from(group) {
                (TransferState::Freed, TransferOutput::Free)
            } else if flexible && finished.len() == 1 {
                (TransferState::Held { finished, lost, group, flexible }, TransferOutput::GroupDone)
            } else {
                (TransferState::Held { finished, lost, group, flexible }, TransferOutput::None)
            }
        }
        // A lost worker's part counts as done, but never as the read of a flexible transfer:
        // another rank may be the one being read, so only a real release completes the group.
        (TransferState::Held { finished, mut lost, group, flexible }, TransferEvent::WorkerLost(tp)) => {
            if tp >= group || finished.contains(&tp) || !lost.insert(tp) {
                return (TransferState::Held { finished, lost, group, flexible }, TransferOutput::Ignored);
            }
            if finished.len() + lost.len() == usize::from(group) {
                (TransferState::Freed, TransferOutput::Free)
            } else {
                (TransferState::Held { finished, lost, group, flexible }, TransferOutput::None)
            }
        }
        (TransferState::Held { .. }, TransferEvent::ReaperDeadline) => {
            (TransferState::Reaped, TransferOutput::Reap)
        }
        (state, _) => (state, TransferOutput::Ignored),
    }
}

/// One row of the lifecycle's transition table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LifecycleRow {
    /// State before.
    pub from: String,
    /// Event.
    pub event: &'static str,
    /// State after.
    pub to: String,
    /// Output.
    pub output: String,
}

/// Applies every event to every state of a TP group of two, with fixed-mapping and flexible
/// quorums (rank 0 having finished in the partly finished states), and records the result.
pub fn lifecycle_table() -> Vec<LifecycleRow> {
    let state = |finished: &[u16], lost: &[u16], flexible: bool| TransferState::Held {
        finished: finished.iter().copied().collect(),
        lost: lost.iter().copied().collect(),
        group: 2,
        flexible,
    };
    let held = |finished: &[u16], flexible: bool| state(finished, &[], flexible);
    let states = [
        held(&[], false),
        held(&[], true),
        held(&[0], false),
        held(&[0], true),
        state(&[], &[1], false),
        state(&[], &[1], true),
        TransferState::Freed,
        TransferState::Reaped,
    ];
    let events = [
        ("WorkerFinished(rank 0)", TransferEvent::WorkerFinished(0)),
        ("WorkerFinished(rank 1)", TransferEvent::WorkerFinished(1)),
        ("WorkerFinished(rank outside group)", TransferEvent::WorkerFinished(7)),
        ("WorkerLost(rank 1)", TransferEvent::WorkerLost(1)),
        ("ReaperDeadline", TransferEvent::ReaperDeadline),
    ];
    let mut rows = Vec::new();
    for state in &states {
        for (name, event) in events {
            let (next, output) = transfer_step(state.clone(), event);
            rows.push(LifecycleRow {
                from: state.kind(),
                event: name,
                to: next.kind(),
                output: format!("{output:?}"),
            });
        }
    }
    rows
}
