//! A decode worker's per-request machine: when reads are posted, when they must be aborted, and
//! when the release may go.
//!
//! # The rule
//!
//! A decode worker sends a transfer's release (and reports the request received or failed) only
//! when none of its reads of that transfer can still complete: every read it posted has been
//! answered by the driver with a [`ReadDone`](crate::decode::DecodeEvent::ReadDone). A request
//! that fails while reads are posted (its transfer timeout passed, or one of its reads failed)
//! asks the driver to abort them ([`RecvOutput::Abort`], carried out as
//! [`DecodeAction::AbortReads`](crate::decode::DecodeAction::AbortReads)) and drains: it waits for
//! the answer of every posted read, whatever that answer is, and then releases.
//!
//! The release frees the producer's blocks, so releasing earlier lets a read that is already on
//! the wire complete from memory another request now owns: a posted RDMA READ cannot be recalled,
//! only flushed (vLLM issue 56465 is of this class). The drain has no deadline of its own; the
//! producer's read lease covers it until the transfer timeout, and if the drain outlasts that,
//! the producer's reaper fences the blocks before it frees them, so a late read fails instead of
//! reading reused memory. [`Legacy::ReleaseDuringReads`](crate::legacy::Legacy) brings back the
//! historical behaviour: release at once.
//!
//! The machine counts reads; the worker keeps which layers they are. [`step`] is pure and total,
//! and [`transition_table`] lists it for the checked-in table under `docs/machines/`.

use crate::policy::DrainRule;

/// Where one request is, as far as its release is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvState {
    /// Waiting for its session (and, in eager mode, the step's vote); no read posted.
    AwaitingSession,
    /// Reads posted.
    Reading {
        /// Posted reads the driver has not answered yet.
        in_flight: u32,
        /// Reads the driver refused (send queue full), waiting to be posted again.
        retrying: u32,
    },
    /// The request failed with reads posted: they were aborted, and `in_flight` answers are
    /// still owed before the release may go.
    Draining {
        /// Posted reads the driver has not answered yet.
        in_flight: u32,
    },
    /// Released; the worker forgets the request.
    Ended,
}

impl RecvState {
    /// The state's name without its counts, as in the transition table.
    pub fn kind(&self) -> String {
        match self {
            RecvState::AwaitingSession => "AwaitingSession".into(),
            RecvState::Reading { in_flight, retrying } => {
                format!("Reading(in_flight {in_flight}, retrying {retrying})")
            }
            RecvState::Draining { in_flight } => format!("Draining(in_flight {in_flight})"),
            RecvState::Ended => "Ended".into(),
        }
    }
}

/// An input to the request machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvEvent {
    /// The session is complete and the reads were built: this many are posted.
    ReadsPosted(u32),
    /// The reads could not be built (the session's metadata rejects the request).
    Unreadable,
    /// A posted read completed with every byte.
    ReadOk,
    /// A posted read failed, or was aborted or flushed.
    ReadFailed,
    /// The driver refused a posted read (send queue full); it will be posted again.
    ReadRefused,
    /// A refused read was posted again.
    RetryPosted,
    /// The transfer timeout passed (or a retry would land after it).
    Deadline,
    /// The incarnation fence found the prefill incarnation holding the transfer gone (see
    /// [`crate::fence`]): nothing can be read, and nothing is left to release.
    Fenced,
}

/// What a transition asks the worker to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvOutput {
    /// Nothing yet.
    None,
    /// Post the reads.
    PostReads,
    /// Abort the posted reads; every one of them will still be answered.
    Abort,
    /// Send the release and report the request: received when `received`, failed otherwise.
    Release {
        /// Whether every byte arrived.
        received: bool,
    },
    /// Report the request failed and send no release: the incarnation that held its blocks is
    /// gone, and the live one never had them, so a release would only disturb it.
    FailUnreleased,
    /// The event does not apply in this state (a late answer, a repeated deadline).
    Ignored,
}

/// One transition. Pure, total, never panics; `drain` says whether a failing request waits for
/// its posted reads ([`DrainRule::ReleaseAtOnce`] is [`Legacy::ReleaseDuringReads`](crate::legacy::Legacy)).
pub fn step(state: RecvState, event: RecvEvent, drain: DrainRule) -> (RecvState, RecvOutput) {
    use RecvEvent as E;
    use RecvOutput as O;
    use RecvState as S;
    let failed = (S::Ended, O::Release { received: false });
    match (state, event) {
        (S::AwaitingSession, E::ReadsPosted(0)) => (S::Ended, O::Release { received: true }),
        (S::AwaitingSession, E::ReadsPosted(n)) => (S::Reading { in_flight: n, retrying: 0 }, O::PostReads),
        (S::AwaitingSession, E::Unreadable | E::Deadline) => failed,
        // The fence acts before any read is posted, so nothing can still complete.
        (S::AwaitingSession, E::Fenced) => (S::Ended, O::FailUnreleased),
        (S::Reading { in_flight, retrying }, E::ReadOk) if in_flight > 0 => {
            let in_flight = in_flight - 1;
            if in_flight == 0 && retrying == 0 {
                (S::Ended, O::Release { received: true })
            } else {
                (S::Reading { in_flight, retrying }, O::None)
            }
        }
        (S::Reading { in_flight, retrying }, E::ReadRefused) if in_flight > 0 => {
            (S::Reading { in_flight: in_flight - 1, retrying: retrying.saturating_add(1) }, O::None)
        }
        (S::Reading { in_flight, retrying }, E::RetryPosted) if retrying > 0 => {
            (S::Reading { in_flight: in_flight.saturating_add(1), retrying: retrying - 1 }, O::None)
        }
        (S::Reading { in_flight, .. }, E::ReadFailed) if in_flight > 0 => abort(in_flight - 1, drain),
        (S::Reading { in_flight, .. }, E::Deadline) => abort(in_flight, drain),
        (S::Draining { in_flight }, E::ReadOk | E::ReadFailed | E::ReadRefused) if in_flight > 0 => {
            if in_flight == 1 {
                failed
            } else {
                (S::Draining { in_flight: in_flight - 1 }, O::None)
            }
        }
        (state, _) => (state, O::Ignored),
    }
}

/// The request failed with `in_flight` reads still posted.
fn abort(in_flight: u32, drain: DrainRule) -> (RecvState, RecvOutput) {
    if in_flight == 0 || drain.releases_at_once() {
        (RecvState::Ended, RecvOutput::Release { received: false })
    } else {
        (RecvState::Draining { in_flight }, RecvOutput::Abort)
    }
}

/// One row of the machine's transition table.
pub type RecvRow = crate::machine::TableRow;

/// Applies every event to representative states (one and two reads in flight, one waiting for a
/// retry) under the fixed protocol, and records the result.
pub fn transition_table() -> Vec<RecvRow> {
    let states = [
        RecvState::AwaitingSession,
        RecvState::Reading { in_flight: 1, retrying: 0 },
        RecvState::Reading { in_flight: 2, retrying: 0 },
        RecvState::Reading { in_flight: 1, retrying: 1 },
        RecvState::Reading { in_flight: 0, retrying: 1 },
        RecvState::Draining { in_flight: 1 },
        RecvState::Draining { in_flight: 2 },
        RecvState::Ended,
    ];
    let events = [
        RecvEvent::ReadsPosted(2),
        RecvEvent::Unreadable,
        RecvEvent::ReadOk,
        RecvEvent::ReadFailed,
        RecvEvent::ReadRefused,
        RecvEvent::RetryPosted,
        RecvEvent::Deadline,
        RecvEvent::Fenced,
    ];
    let events: Vec<(String, RecvEvent)> = events.into_iter().map(|e| (format!("{e:?}"), e)).collect();
    crate::machine::walk(&states, &events, |s, e| step(s, e, DrainRule::DrainFirst), RecvState::kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(state: RecvState, event: RecvEvent, legacy: bool, expected: (RecvState, RecvOutput)) {
        let drain = if legacy { DrainRule::ReleaseAtOnce } else { DrainRule::DrainFirst };
        assert_eq!(step(state, event, drain), expected, "{state:?} + {event:?} (legacy {legacy})");
    }

    #[test]
    fn a_failing_request_releases_only_after_its_posted_reads_answered() {
        use RecvEvent as E;
        use RecvOutput as O;
        use RecvState as S;
        let reading = |in_flight, retrying| S::Reading { in_flight, retrying };
        let released = |received| (S::Ended, O::Release { received });
        check(reading(3, 0), E::Deadline, false, (S::Draining { in_flight: 3 }, O::Abort));
        check(reading(3, 0), E::ReadFailed, false, (S::Draining { in_flight: 2 }, O::Abort));
        check(reading(1, 0), E::ReadFailed, false, released(false));
        check(reading(0, 2), E::Deadline, false, released(false));
        check(S::Draining { in_flight: 2 }, E::ReadOk, false, (S::Draining { in_flight: 1 }, O::None));
        check(S::Draining { in_flight: 1 }, E::ReadOk, false, released(false));
        check(S::Draining { in_flight: 1 }, E::Deadline, false, (S::Draining { in_flight: 1 }, O::Ignored));
        // The historical behaviour releases under the posted reads.
        check(reading(3, 0), E::Deadline, true, released(false));
        check(reading(3, 0), E::ReadFailed, true, released(false));
    }

    #[test]
    fn a_request_is_received_when_every_read_completed_and_none_waits_for_a_retry() {
        use RecvEvent as E;
        use RecvOutput as O;
        use RecvState as S;
        let reading = |in_flight, retrying| S::Reading { in_flight, retrying };
        check(S::AwaitingSession, E::ReadsPosted(2), false, (reading(2, 0), O::PostReads));
        check(reading(2, 0), E::ReadOk, false, (reading(1, 0), O::None));
        check(reading(1, 1), E::ReadOk, false, (reading(0, 1), O::None));
        check(reading(0, 1), E::RetryPosted, false, (reading(1, 0), O::None));
        check(reading(1, 0), E::ReadOk, false, (S::Ended, O::Release { received: true }));
        check(reading(1, 0), E::ReadRefused, false, (reading(0, 1), O::None));
        check(reading(0, 1), E::ReadOk, false, (reading(0, 1), O::Ignored));
        check(S::Ended, E::ReadOk, false, (S::Ended, O::Ignored));
    }
}
