//! A decode worker's step machine: how one scheduler step goes from its beginning to the one
//! report (ready or failed) that lets the driver enter the forward pass.
//!
//! Eager (the default): at step begin the worker dials every session the step needs and waits
//! for those dials ([`StepState::Handshaking`]); once none is outstanding it casts its vote
//! ([`StepOutput::CastVote`]) and waits for the group's MIN ([`StepState::Voting`], decided by
//! [`crate::group`]); the result is the step's report, the same on every worker of the group.
//! Lazy ([`Legacy::LazyHandshake`](crate::legacy::Legacy::LazyHandshake)): the worker blocks
//! ([`StepState::Blocked`]), handshaking one session after another; it reports ready when the
//! last one completes and raises alone when one fails, while its peers may be in the forward
//! collective already.
//!
//! The machine counts dials and sessions; the worker keeps which ones they are. [`step`] is
//! pure and total, and [`transition_table`] lists it for the checked-in table under
//! `docs/machines/`.

/// Where one worker is in its current step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepState {
    /// No step in progress (the last one was reported).
    Idle,
    /// Eager: waiting for `waiting` dials of the step before voting.
    Handshaking {
        /// The step.
        step: u64,
        /// Dials outstanding.
        waiting: u32,
    },
    /// Eager: the vote is cast; waiting for the group's result.
    Voting {
        /// The step.
        step: u64,
    },
    /// Legacy only ([`HandshakeMode::Lazy`](crate::policy::HandshakeMode::Lazy), `lazy-handshake`):
    /// blocked in handshakes, one at a time; `left` sessions remain, the first of them being
    /// dialled.
    Blocked {
        /// The step.
        step: u64,
        /// Sessions still to handshake, the one in flight included.
        left: u32,
    },
}

impl StepState {
    /// The state's name with its counts, as in the transition table.
    pub fn kind(&self) -> String {
        match self {
            StepState::Idle => "Idle".into(),
            StepState::Handshaking { waiting, .. } => format!("Handshaking(waiting {waiting})"),
            StepState::Voting { .. } => "Voting".into(),
            StepState::Blocked { left, .. } => format!("Blocked(left {left})"),
        }
    }
}

/// An input to the step machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepEvent {
    /// Eager: `step` begins; `dials` of the handshakes it needs are outstanding.
    Begin {
        /// The step.
        step: u64,
        /// Dials the step waits for.
        dials: u32,
    },
    /// Legacy only ([`HandshakeMode::Lazy`](crate::policy::HandshakeMode::Lazy)): `step` begins
    /// with `sessions` handshakes to do one after another.
    BeginLazy {
        /// The step.
        step: u64,
        /// Sessions to handshake.
        sessions: u32,
    },
    /// A handshake the step waits for completed (or, lazy, needed no dial after all).
    HandshakeDone,
    /// A handshake the step waits for failed.
    HandshakeFailed,
    /// The group's MIN of the votes on `step`.
    VoteResult {
        /// The step voted on.
        step: u64,
        /// True when every worker of the group voted ok.
        ok: bool,
    },
}

/// What a transition asks the worker to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutput {
    /// Nothing yet.
    None,
    /// Eager: cast this worker's vote on `step` (ok when every session its requests need is
    /// complete).
    CastVote {
        /// The step.
        step: u64,
    },
    /// Lazy: dial the first of the sessions left.
    DialNext {
        /// The step.
        step: u64,
    },
    /// Post the reads whose sessions are complete and report the step ready.
    Ready {
        /// The step.
        step: u64,
    },
    /// Post the reads whose sessions are complete and report the step failed for the whole
    /// group.
    FailedWithGroup {
        /// The step.
        step: u64,
    },
    /// Lazy: report the step failed on this worker alone (it raises).
    Raised {
        /// The step.
        step: u64,
    },
    /// The event does not apply in this state (a stale vote result, a handshake the step does
    /// not wait for).
    Ignored,
    /// A step began before the last one was reported: the driver broke the calling order.
    OutOfOrder,
}

/// One transition. Pure, total, never panics.
pub fn step(state: StepState, event: StepEvent) -> (StepState, StepOutput) {
    use StepEvent as E;
    use StepOutput as O;
    use StepState as S;
    match (state, event) {
        (S::Idle, E::Begin { step, dials: 0 }) => (S::Voting { step }, O::CastVote { step }),
        (S::Idle, E::Begin { step, dials }) => (S::Handshaking { step, waiting: dials }, O::None),
        (S::Idle, E::BeginLazy { step, sessions: 0 }) => (S::Idle, O::Ready { step }),
        (S::Idle, E::BeginLazy { step, sessions }) => {
            (S::Blocked { step, left: sessions }, O::DialNext { step })
        }
        (state, E::Begin { .. } | E::BeginLazy { .. }) => (state, O::OutOfOrder),
        // Eager: a failed dial fails nothing yet; the vote says whether the step can go on.
        (S::Handshaking { step, waiting }, E::HandshakeDone | E::HandshakeFailed) if waiting > 0 => {
            if waiting == 1 {
                (S::Voting { step }, O::CastVote { step })
            } else {
                (S::Handshaking { step, waiting: waiting - 1 }, O::None)
            }
        }
        (S::Voting { step }, E::VoteResult { step: voted, ok }) if voted == step => {
            if ok {
                (S::Idle, O::Ready { step })
            } else {
                (S::Idle, O::FailedWithGroup { step })
            }
        }
        (S::Blocked { step, left }, E::HandshakeDone) if left > 0 => {
            if left == 1 {
                (S::Idle, O::Ready { step })
            } else {
                (S::Blocked { step, left: left - 1 }, O::DialNext { step })
            }
        }
        (S::Blocked { step, left }, E::HandshakeFailed) if left > 0 => (S::Idle, O::Raised { step }),
        (state, _) => (state, O::Ignored),
    }
}

/// One row of the machine's transition table.
pub type StepRow = crate::machine::TableRow;

/// Applies every event to representative states of step 5 (the next step is 6) and records the
/// result.
pub fn transition_table() -> Vec<StepRow> {
    let states = [
        StepState::Idle,
        StepState::Handshaking { step: 5, waiting: 1 },
        StepState::Handshaking { step: 5, waiting: 2 },
        StepState::Voting { step: 5 },
        StepState::Blocked { step: 5, left: 1 },
        StepState::Blocked { step: 5, left: 2 },
    ];
    let events = [
        ("Begin(dials 0)", StepEvent::Begin { step: 6, dials: 0 }),
        ("Begin(dials 2)", StepEvent::Begin { step: 6, dials: 2 }),
        ("BeginLazy(sessions 0)", StepEvent::BeginLazy { step: 6, sessions: 0 }),
        ("BeginLazy(sessions 2)", StepEvent::BeginLazy { step: 6, sessions: 2 }),
        ("HandshakeDone", StepEvent::HandshakeDone),
        ("HandshakeFailed", StepEvent::HandshakeFailed),
        ("VoteResult(ok)", StepEvent::VoteResult { step: 5, ok: true }),
        ("VoteResult(no)", StepEvent::VoteResult { step: 5, ok: false }),
        ("VoteResult(step 4)", StepEvent::VoteResult { step: 4, ok: true }),
    ];
    let events: Vec<(String, StepEvent)> = events.into_iter().map(|(n, e)| (n.to_string(), e)).collect();
    crate::machine::walk(&states, &events, step, StepState::kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(state: StepState, event: StepEvent, expected: (StepState, StepOutput)) {
        assert_eq!(step(state, event), expected, "{state:?} + {event:?}");
    }

    #[test]
    fn eager_votes_once_no_dial_is_outstanding_and_reports_the_group_result() {
        use StepEvent as E;
        use StepOutput as O;
        use StepState as S;
        let handshaking = |waiting| S::Handshaking { step: 3, waiting };
        check(S::Idle, E::Begin { step: 3, dials: 0 }, (S::Voting { step: 3 }, O::CastVote { step: 3 }));
        check(S::Idle, E::Begin { step: 3, dials: 2 }, (handshaking(2), O::None));
        check(handshaking(2), E::HandshakeFailed, (handshaking(1), O::None));
        check(handshaking(1), E::HandshakeDone, (S::Voting { step: 3 }, O::CastVote { step: 3 }));
        let voting = S::Voting { step: 3 };
        check(voting, E::VoteResult { step: 3, ok: true }, (S::Idle, O::Ready { step: 3 }));
        check(voting, E::VoteResult { step: 3, ok: false }, (S::Idle, O::FailedWithGroup { step: 3 }));
        check(voting, E::VoteResult { step: 2, ok: true }, (voting, O::Ignored));
        check(S::Idle, E::VoteResult { step: 3, ok: true }, (S::Idle, O::Ignored));
        check(voting, E::Begin { step: 4, dials: 0 }, (voting, O::OutOfOrder));
    }

    #[test]
    fn lazy_blocks_through_every_session_and_raises_alone_on_a_failure() {
        use StepEvent as E;
        use StepOutput as O;
        use StepState as S;
        let blocked = |left| S::Blocked { step: 3, left };
        check(S::Idle, E::BeginLazy { step: 3, sessions: 0 }, (S::Idle, O::Ready { step: 3 }));
        check(S::Idle, E::BeginLazy { step: 3, sessions: 2 }, (blocked(2), O::DialNext { step: 3 }));
        check(blocked(2), E::HandshakeDone, (blocked(1), O::DialNext { step: 3 }));
        check(blocked(1), E::HandshakeDone, (S::Idle, O::Ready { step: 3 }));
        check(blocked(2), E::HandshakeFailed, (S::Idle, O::Raised { step: 3 }));
        check(blocked(1), E::VoteResult { step: 3, ok: true }, (blocked(1), O::Ignored));
    }
}
