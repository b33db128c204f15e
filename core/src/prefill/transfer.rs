//! One transfer's lifecycle as a prefill engine sees it: held until every worker of the owner
//! DP group finished (or was lost), or reaped; a pure [`transfer_step`] with a listed
//! transition table ([`transition_table`]) whose states cover every [`TransferState`] variant.
//!
//! A fixed-mapping read waits for each worker's release ([`TransferState::Held`], then
//! [`TransferState::PartlyFinished`]). A flexible read is the read of one rank standing for the
//! whole group: its first release is the read, the rest of the group is told so
//! ([`TransferOutput::GroupDone`]) and the transfer waits for their acknowledgements
//! ([`TransferState::HeldFlexible`], then [`TransferState::GroupDoneSent`]). Either way the last
//! worker to finish frees it ([`TransferState::Freed`]) unless the reaper got there first
//! ([`TransferState::Reaped`]).

/// Where one TP worker of the owner DP group is in a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerPart {
    /// It still holds its part of the transfer.
    Pending,
    /// It reported its part done.
    Finished,
    /// It died for good before it finished: its memory is gone with it, so its part counts as
    /// done.
    Lost,
}

/// The parts of a held transfer, one per TP rank of the owner DP group, indexed by rank. A rank
/// is in exactly one part and no rank lies outside the group, which two sets of ranks and a
/// group size could not promise.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerParts(Vec<WorkerPart>);

impl WorkerParts {
    /// The TP ranks whose part is `part`, in rank order.
    pub fn ranks(&self, part: WorkerPart) -> impl Iterator<Item = u16> + '_ {
        self.0.iter().zip(0..).filter(move |(p, _)| **p == part).map(|(_, tp)| tp)
    }

    /// The part of TP rank `tp`; `None` outside the group.
    pub fn part(&self, tp: u16) -> Option<WorkerPart> {
        self.0.get(usize::from(tp)).copied()
    }
}

/// The engine-level state of one transfer. Only this module builds [`WorkerParts`], through
/// [`TransferState::registered`] and [`transfer_step`], so a held state always has a pending part
/// (settling the last one frees the transfer instead) and a part finished only after `Held` or
/// `HeldFlexible` has moved on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TransferState {
    /// Fixed mapping: no worker finished yet (some may be lost).
    Held(WorkerParts),
    /// Flexible read: no worker released yet (some may be lost).
    HeldFlexible(WorkerParts),
    /// Fixed mapping: some workers finished, others still hold their part.
    PartlyFinished(WorkerParts),
    /// Flexible read: the first release came and the rest of the group was told; waiting for
    /// their acknowledgements.
    GroupDoneSent(WorkerParts),
    /// Every worker finished (or was lost); blocks freed.
    Freed,
    /// The reaper freed the blocks.
    Reaped,
}

impl TransferState {
    /// A transfer just registered on a group of `group` TP ranks, of which those in `lost` are
    /// already lost; `flexible` says whether one rank's read stands for the group. With every
    /// rank lost nobody holds the KV, so it is [`TransferState::Freed`] from the start.
    pub fn registered(group: u16, lost: impl IntoIterator<Item = u16>, flexible: bool) -> TransferState {
        let mut parts = WorkerParts(vec![WorkerPart::Pending; usize::from(group)]);
        for tp in lost {
            if let Some(part) = parts.0.get_mut(usize::from(tp)) {
                *part = WorkerPart::Lost;
            }
        }
        if parts.ranks(WorkerPart::Pending).next().is_none() {
            TransferState::Freed
        } else if flexible {
            TransferState::HeldFlexible(parts)
        } else {
            TransferState::Held(parts)
        }
    }

    /// The variant's name. The match has no wildcard on purpose: a new variant does not compile
    /// until it is named here, and the machines test then fails until the table lists it.
    pub fn name(&self) -> &'static str {
        match self {
            TransferState::Held(_) => "Held",
            TransferState::HeldFlexible(_) => "HeldFlexible",
            TransferState::PartlyFinished(_) => "PartlyFinished",
            TransferState::GroupDoneSent(_) => "GroupDoneSent",
            TransferState::Freed => "Freed",
            TransferState::Reaped => "Reaped",
        }
    }

    /// The state's name with how many ranks finished or were lost, as in the transition table.
    pub fn kind(&self) -> String {
        let Some(parts) = self.parts() else { return self.name().to_string() };
        let settled: Vec<String> = [(WorkerPart::Finished, "finished"), (WorkerPart::Lost, "lost")]
            .into_iter()
            .map(|(part, word)| (parts.ranks(part).count(), word))
            .filter(|&(count, _)| count > 0)
            .map(|(count, word)| format!("{count} {word}"))
            .collect();
        if settled.is_empty() {
            self.name().to_string()
        } else {
            format!("{}({})", self.name(), settled.join(", "))
        }
    }

    /// The parts of a held transfer; `None` once it ended.
    pub fn parts(&self) -> Option<&WorkerParts> {
        match self {
            TransferState::Held(parts)
            | TransferState::HeldFlexible(parts)
            | TransferState::PartlyFinished(parts)
            | TransferState::GroupDoneSent(parts) => Some(parts),
            TransferState::Freed | TransferState::Reaped => None,
        }
    }

    /// True while the worker with TP rank `tp` still holds its part.
    fn is_pending(&self, tp: u16) -> bool {
        self.parts().and_then(|parts| parts.part(tp)) == Some(WorkerPart::Pending)
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
    use TransferEvent as E;
    use TransferOutput as O;
    use TransferState as S;
    use WorkerPart::{Finished, Lost};
    match (state, event) {
        // A rank outside the group, one already finished or lost, and anything after the end
        // change nothing.
        (state, E::WorkerFinished(tp) | E::WorkerLost(tp)) if !state.is_pending(tp) => (state, O::Ignored),
        (S::Held(parts), E::WorkerFinished(tp)) => settle(parts, tp, Finished, S::PartlyFinished, O::None),
        (S::PartlyFinished(parts), E::WorkerFinished(tp)) => {
            settle(parts, tp, Finished, S::PartlyFinished, O::None)
        }
        // The first release of a flexible read is the read of the whole group.
        (S::HeldFlexible(parts), E::WorkerFinished(tp)) => {
            settle(parts, tp, Finished, S::GroupDoneSent, O::GroupDone)
        }
        (S::GroupDoneSent(parts), E::WorkerFinished(tp)) => {
            settle(parts, tp, Finished, S::GroupDoneSent, O::None)
        }
        // A lost worker's part counts as done, but never as the read of a flexible transfer:
        // another rank may be the one being read, so only a real release completes the group.
        (S::Held(parts), E::WorkerLost(tp)) => settle(parts, tp, Lost, S::Held, O::None),
        (S::PartlyFinished(parts), E::WorkerLost(tp)) => settle(parts, tp, Lost, S::PartlyFinished, O::None),
        (S::HeldFlexible(parts), E::WorkerLost(tp)) => settle(parts, tp, Lost, S::HeldFlexible, O::None),
        (S::GroupDoneSent(parts), E::WorkerLost(tp)) => settle(parts, tp, Lost, S::GroupDoneSent, O::None),
        (S::Held(_) | S::PartlyFinished(_) | S::HeldFlexible(_) | S::GroupDoneSent(_), E::ReaperDeadline) => {
            (S::Reaped, O::Reap)
        }
        (S::Freed, _) => (S::Freed, O::Ignored),
        (S::Reaped, _) => (S::Reaped, O::Ignored),
    }
}

/// Settles the pending part of TP rank `tp` as `part`. The last pending part frees the
/// transfer; otherwise it moves to `then` (a variant of [`TransferState`]) with `output`.
fn settle(
    mut parts: WorkerParts,
    tp: u16,
    part: WorkerPart,
    then: fn(WorkerParts) -> TransferState,
    output: TransferOutput,
) -> (TransferState, TransferOutput) {
    if let Some(slot) = parts.0.get_mut(usize::from(tp)) {
        *slot = part;
    }
    if parts.ranks(WorkerPart::Pending).next().is_none() {
        (TransferState::Freed, TransferOutput::Free)
    } else {
        (then(parts), output)
    }
}

/// One row of the lifecycle's transition table.
pub type TransferRow = crate::machine::TableRow;

/// The states the transition table applies every event to, for a TP group of two: every held
/// variant with no rank lost (rank 0 being the one that finished where one did), those in which
/// no rank finished also with rank 1 lost, and the two ends. Each variant appears at least once.
pub fn representative_states() -> Vec<TransferState> {
    use WorkerPart::{Finished as F, Lost as L, Pending as P};
    let parts = |ranks: [WorkerPart; 2]| WorkerParts(ranks.to_vec());
    vec![
        TransferState::Held(parts([P, P])),
        TransferState::HeldFlexible(parts([P, P])),
        TransferState::PartlyFinished(parts([F, P])),
        TransferState::GroupDoneSent(parts([F, P])),
        TransferState::Held(parts([P, L])),
        TransferState::HeldFlexible(parts([P, L])),
        TransferState::Freed,
        TransferState::Reaped,
    ]
}

/// Applies every event to every representative state ([`representative_states`]) and records
/// the result.
pub fn transition_table() -> Vec<TransferRow> {
    let events = [
        ("WorkerFinished(rank 0)", TransferEvent::WorkerFinished(0)),
        ("WorkerFinished(rank 1)", TransferEvent::WorkerFinished(1)),
        ("WorkerFinished(rank outside group)", TransferEvent::WorkerFinished(7)),
        ("WorkerLost(rank 1)", TransferEvent::WorkerLost(1)),
        ("ReaperDeadline", TransferEvent::ReaperDeadline),
    ];
    let events: Vec<(String, TransferEvent)> = events.into_iter().map(|(n, e)| (n.to_string(), e)).collect();
    crate::machine::walk(&representative_states(), &events, transfer_step, TransferState::kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_counts_lost_ranks_as_done_and_frees_when_every_rank_is_lost() {
        let held = TransferState::registered(2, [1], false);
        assert_eq!(held, TransferState::Held(WorkerParts(vec![WorkerPart::Pending, WorkerPart::Lost])));
        assert_eq!(TransferState::registered(2, [0, 1], true), TransferState::Freed);
        // A lost rank outside the group is no part of the transfer.
        assert_eq!(
            TransferState::registered(1, [3], true),
            TransferState::HeldFlexible(WorkerParts(vec![WorkerPart::Pending]))
        );
    }

    #[test]
    fn a_flexible_read_tells_the_group_once_and_frees_on_the_last_acknowledgement() {
        let state = TransferState::registered(3, [], true);
        let (state, out) = transfer_step(state, TransferEvent::WorkerFinished(1));
        assert_eq!((state.kind().as_str(), out), ("GroupDoneSent(1 finished)", TransferOutput::GroupDone));
        let (state, out) = transfer_step(state, TransferEvent::WorkerLost(0));
        assert_eq!((state.kind().as_str(), out), ("GroupDoneSent(1 finished, 1 lost)", TransferOutput::None));
        let (state, out) = transfer_step(state, TransferEvent::WorkerFinished(1));
        assert_eq!(out, TransferOutput::Ignored);
        let (state, out) = transfer_step(state, TransferEvent::WorkerFinished(2));
        assert_eq!((state, out), (TransferState::Freed, TransferOutput::Free));
    }
}
