//! What goes in and out of the decode group: how a worker's step ended, the events a driver
//! feeds, the actions the group asks for, why an input changed nothing, and the open vote.

use std::fmt;

use crate::decode::StepError;
use crate::ids::TpRank;
#[cfg(doc)]
use crate::legacy::Legacy;

/// How a worker's step ended, as its group sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StepReport {
    /// The worker is ready and enters the forward collective.
    Ready,
    /// The step failed for the whole group (it voted no); the worker still enters the forward
    /// pass, together with its peers.
    FailedWithGroup,
    /// The step failed on this worker alone (a lazy handshake): it raises and never enters the
    /// collective its peers may be waiting in.
    Raised,
}

impl StepReport {
    /// The report of a worker whose step failed with `error`.
    pub fn failed(error: &StepError) -> StepReport {
        match error {
            StepError::GroupHandshakeFailed { .. } => StepReport::FailedWithGroup,
            StepError::Handshake { .. } => StepReport::Raised,
        }
    }

    /// Whether the worker enters the step's forward collective.
    pub fn enters_forward(self) -> bool {
        matches!(self, StepReport::Ready | StepReport::FailedWithGroup)
    }
}

/// An input to the group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupEvent {
    /// The scheduler begins `step` (before any worker hears of it).
    StepBegin {
        /// The step, after every step admitted before.
        step: u64,
    },
    /// A worker's vote ([`DecodeAction::CastVote`](crate::decode::DecodeAction::CastVote)).
    Vote {
        /// The voter.
        member: TpRank,
        /// The step voted on.
        step: u64,
        /// Whether the voter's handshakes all completed.
        ok: bool,
    },
    /// A worker reported its step.
    StepReport {
        /// The worker.
        member: TpRank,
        /// The step.
        step: u64,
        /// How the step ended on the worker.
        report: StepReport,
    },
    /// A member is gone for good (its process died or stopped answering).
    MemberLost {
        /// The member.
        member: TpRank,
    },
}

/// Why an input changed nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ignored {
    /// A step number not after the last admitted one.
    StepNotAfter {
        /// The step asked for.
        step: u64,
        /// The last step admitted.
        last: u64,
    },
    /// A step began before the last one reached its forward.
    StepInProgress {
        /// The step asked for.
        step: u64,
        /// The step still in progress.
        current: u64,
    },
    /// A step began after a member was lost: its collectives can never complete.
    GroupBroken {
        /// The step asked for.
        step: u64,
        /// The first member lost.
        lost: TpRank,
    },
    /// The TP rank is not in the group.
    NotMember {
        /// The rank.
        member: TpRank,
    },
    /// The member was lost already.
    LostMember {
        /// The member.
        member: TpRank,
    },
    /// A vote or report for a step the group has left.
    PastStep {
        /// The sender.
        member: TpRank,
        /// The step it named.
        step: u64,
        /// The step the group is on.
        current: u64,
    },
    /// A vote or report for a step the group has not begun.
    UnknownStep {
        /// The sender.
        member: TpRank,
        /// The step it named.
        step: u64,
    },
    /// The member voted on this step already; its first ballot counts.
    DuplicateVote {
        /// The voter.
        member: TpRank,
        /// The step.
        step: u64,
    },
    /// The group takes no vote ([`Legacy::LazyHandshake`]).
    NoVote {
        /// The voter.
        member: TpRank,
        /// The step.
        step: u64,
    },
    /// The member reported this step already.
    DuplicateReport {
        /// The worker.
        member: TpRank,
        /// The step.
        step: u64,
    },
    /// The report contradicts the group's decision: ready after a no (or before the vote),
    /// failed with the group after a yes (or without a vote).
    AgainstDecision {
        /// The worker.
        member: TpRank,
        /// The step.
        step: u64,
        /// What it reported.
        report: StepReport,
        /// The group's MIN, if decided.
        decision: Option<bool>,
    },
}

impl fmt::Display for Ignored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ignored::StepNotAfter { step, last } => write!(f, "step {step} is not after step {last}"),
            Ignored::StepInProgress { step, current } => {
                write!(f, "step {step} began before step {current} reached its forward")
            }
            Ignored::GroupBroken { step, lost } => write!(f, "step {step} began after {lost} was lost"),
            Ignored::NotMember { member } => write!(f, "{member} is not in the group"),
            Ignored::LostMember { member } => write!(f, "{member} was lost"),
            Ignored::PastStep { member, step, current } => {
                write!(f, "{member} named step {step}, but the group is on step {current}")
            }
            Ignored::UnknownStep { member, step } => {
                write!(f, "{member} named step {step}, which the group has not begun")
            }
            Ignored::DuplicateVote { member, step } => write!(f, "{member} voted on step {step} already"),
            Ignored::NoVote { member, step } => {
                write!(f, "{member} voted on step {step}, but the lazy handshake takes no vote")
            }
            Ignored::DuplicateReport { member, step } => {
                write!(f, "{member} reported step {step} already")
            }
            Ignored::AgainstDecision { member, step, report, decision } => {
                let decided = match decision {
                    Some(true) => "voted ok",
                    Some(false) => "voted no",
                    None => "has not decided",
                };
                write!(f, "{member} reported step {step} {report:?}, but the group {decided}")
            }
        }
    }
}

/// What the group asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupAction {
    /// Tell `member` the MIN of the group's votes on `step`, as its
    /// [`DecodeEvent::VoteResult`](crate::decode::DecodeEvent::VoteResult).
    VoteResult {
        /// The member told.
        member: TpRank,
        /// The step.
        step: u64,
        /// True when every member voted ok.
        ok: bool,
    },
    /// Every member entered the forward pass of `step`: run it; the next step may begin after.
    Forward {
        /// The step.
        step: u64,
    },
    /// The input changed nothing.
    Ignored(Ignored),
}

/// The vote of the current step while it is open: some member voted and not every one yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenVote {
    /// The step.
    pub step: u64,
    /// Members that voted (a lost member counts as a no vote), in TP order.
    pub voted: Vec<TpRank>,
    /// Members that have not, in TP order.
    pub missing: Vec<TpRank>,
}
