//! The decode group node: one per decode DP group, the barrier its TP workers meet at every step.
//!
//! A TP group's workers must enter every forward collective together, or the collective waits
//! for its timeout (the production hang of the lazy handshake, which has no barrier). The eager
//! handshake keeps them together: each worker votes whether its handshakes for the step
//! completed, the group takes the MIN, every worker is told the same result and reports the same
//! outcome, and the forward runs once every worker has entered it. This node is that barrier,
//! written once: the simulator, the real cluster's scheduler, the scripted tests and the model
//! checker feed it events and carry out its actions, so the barrier the model checker explores
//! is the one production runs.
//!
//! # How a driver calls it
//!
//! 1. Create one [`DecodeGroup`] per decode DP group with its TP size and handshake mode.
//! 2. Give the group [`GroupEvent::StepBegin`] before any worker hears of the step. A step is
//!    admitted only if [`DecodeGroup::may_begin`]: the last step reached its forward, no member
//!    was lost, and the number comes after the last one.
//! 3. Deliver every worker's [`DecodeAction::CastVote`](crate::decode::DecodeAction::CastVote)
//!    as [`GroupEvent::Vote`]. Once every member has voted the group decides the MIN and tells
//!    each live member [`GroupAction::VoteResult`]; deliver each as that worker's
//!    [`DecodeEvent::VoteResult`](crate::decode::DecodeEvent::VoteResult).
//! 4. Deliver every worker's step result (`StepReady`, or `StepFailed` classified by
//!    [`StepReport::failed`]) as [`GroupEvent::StepReport`]. Once every member has entered the
//!    forward pass the group says [`GroupAction::Forward`]: the driver runs the step's forward,
//!    and the next step may begin.
//! 5. A member gone for good is [`GroupEvent::MemberLost`]. It votes no on the step it left
//!    open, so its live peers fail the step at once instead of waiting for a vote that will never
//!    come, and the group admits no later step (its collectives can never complete).
//!
//! An input that does not apply (a repeated vote, a vote for a past or unknown step, a report
//! that contradicts the group's decision) changes nothing and comes back as
//! [`GroupAction::Ignored`] with the reason: it is never counted.
//!
//! Unlike the other nodes the group has no timer and decides nothing by time, so its inputs
//! carry no `now` and it has no `poll_timeout`: a collective that never completes is for the
//! driver's watchdog to notice (the simulator's collective timeout).
//!
//! Under [`Legacy::LazyHandshake`] there is no vote: each worker reports ready once its blocking
//! handshakes are done, and a worker that raises alone leaves the step without its forward, the
//! divergence the barrier exists to prevent.
//!
//! # Layout
//!
//! This file holds the node (`DecodeGroup`, `handle`) and its transition table; `messages` its
//! public value types (a worker's report, events, actions, why an input was ignored, the open
//! vote); `lazy` the legacy lazy handshake's rules for a vote and a report, which the fixed
//! barrier asks at one point each.

mod lazy;
mod messages;

use std::collections::{BTreeMap, BTreeSet};

use crate::ids::TpRank;
#[cfg(doc)]
use crate::legacy::Legacy;
use crate::policy::HandshakeMode;

pub use messages::{GroupAction, GroupEvent, Ignored, OpenVote, StepReport};

/// One step: its ballots, its decision and who entered its forward.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Round {
    step: u64,
    ballots: BTreeMap<TpRank, bool>,
    decision: Option<bool>,
    reports: BTreeMap<TpRank, StepReport>,
    forward: bool,
}

/// The decode group node. See the module documentation for the calling order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecodeGroup {
    width: u16,
    lazy: bool,
    lost: BTreeSet<TpRank>,
    round: Option<Round>,
}

impl DecodeGroup {
    /// A group of `width` TP members (`TpRank(0)` to `TpRank(width - 1)`) that has begun no step.
    pub fn new(width: u16, handshake: HandshakeMode) -> DecodeGroup {
        DecodeGroup { width, lazy: handshake == HandshakeMode::Lazy, lost: BTreeSet::new(), round: None }
    }

    /// Members in the group.
    pub fn width(&self) -> u16 {
        self.width
    }

    /// The step the group is on: the last one admitted.
    pub fn step(&self) -> Option<u64> {
        self.round.as_ref().map(|r| r.step)
    }

    /// Whether a next step may begin: the last one reached its forward and no member was lost.
    pub fn may_begin(&self) -> bool {
        self.lost.is_empty() && self.round.as_ref().is_none_or(|r| r.forward)
    }

    /// Whether every member entered the forward pass of `step` (and no later step began).
    pub fn forward_ready(&self, step: u64) -> bool {
        self.round.as_ref().is_some_and(|r| r.step == step && r.forward)
    }

    /// The MIN of the current step's votes, once decided.
    pub fn decision(&self) -> Option<bool> {
        self.round.as_ref().and_then(|r| r.decision)
    }

    /// How `member` reported the current step, if it did.
    pub fn report(&self, member: TpRank) -> Option<StepReport> {
        self.round.as_ref().and_then(|r| r.reports.get(&member).copied())
    }

    /// Whether `member` was lost.
    pub fn is_lost(&self, member: TpRank) -> bool {
        self.lost.contains(&member)
    }

    /// The current step's vote while it is open (some member voted, not every one yet): who
    /// waits for the MIN and whom it waits for, for a wait-for graph.
    pub fn open_vote(&self) -> Option<OpenVote> {
        let round = self.round.as_ref()?;
        if self.lazy || round.decision.is_some() || round.ballots.is_empty() {
            return None;
        }
        let (voted, missing) = self.members().partition(|m| round.ballots.contains_key(m));
        Some(OpenVote { step: round.step, voted, missing })
    }

    /// The state's name with its counts, as in the transition table.
    pub fn kind(&self) -> String {
        let w = self.width;
        let (name, mut counts) = match &self.round {
            None => ("Idle", Vec::new()),
            Some(round) if round.forward => ("Forward", Vec::new()),
            Some(round) => {
                let entered = round.reports.values().filter(|r| r.enters_forward()).count();
                let raised = round.reports.values().filter(|r| **r == StepReport::Raised).count();
                let mut counts = match (self.lazy, round.decision) {
                    (true, _) => ("Lazy", vec![format!("entered {entered}/{w}")]),
                    (false, None) => ("Open", vec![format!("votes {}/{w}", round.ballots.len())]),
                    (false, Some(ok)) => {
                        let min = if ok { "ok" } else { "no" };
                        ("Decided", vec![min.to_string(), format!("entered {entered}/{w}")])
                    }
                };
                if raised > 0 {
                    counts.1.push(format!("raised {raised}"));
                }
                counts
            }
        };
        if !self.lost.is_empty() {
            counts.push(format!("lost {}", self.lost.len()));
        }
        if counts.is_empty() {
            name.to_string()
        } else {
            format!("{name}({})", counts.join(", "))
        }
    }

    /// Applies one event; actions are appended to `out` in the order they must be carried out.
    pub fn handle(&mut self, event: GroupEvent, out: &mut Vec<GroupAction>) {
        let result = match event {
            GroupEvent::StepBegin { step } => self.on_step_begin(step),
            GroupEvent::Vote { member, step, ok } => self.on_vote(member, step, ok, out),
            GroupEvent::StepReport { member, step, report } => self.on_report(member, step, report, out),
            GroupEvent::MemberLost { member } => self.on_lost(member, out),
        };
        if let Err(ignored) = result {
            out.push(GroupAction::Ignored(ignored));
        }
    }

    fn members(&self) -> impl Iterator<Item = TpRank> {
        (0..self.width).map(TpRank)
    }

    fn on_step_begin(&mut self, step: u64) -> Result<(), Ignored> {
        if let Some(round) = self.round.as_ref().filter(|r| step <= r.step) {
            return Err(Ignored::StepNotAfter { step, last: round.step });
        }
        // A lost member is named first: the step in progress will never reach its forward.
        if let Some(&lost) = self.lost.first() {
            return Err(Ignored::GroupBroken { step, lost });
        }
        if let Some(round) = self.round.as_ref().filter(|r| !r.forward) {
            return Err(Ignored::StepInProgress { step, current: round.step });
        }
        self.round = Some(Round {
            step,
            ballots: BTreeMap::new(),
            decision: None,
            reports: BTreeMap::new(),
            forward: false,
        });
        Ok(())
    }

    /// The current round, if `member` is a live member and `step` is the current step.
    fn round_for(&mut self, member: TpRank, step: u64) -> Result<&mut Round, Ignored> {
        if member.0 >= self.width {
            return Err(Ignored::NotMember { member });
        }
        if self.lost.contains(&member) {
            return Err(Ignored::LostMember { member });
        }
        match self.round.as_ref().map(|r| r.step) {
            Some(current) if step < current => Err(Ignored::PastStep { member, step, current }),
            Some(current) if step == current => Ok(self.round.as_mut().expect("matched above")),
            _ => Err(Ignored::UnknownStep { member, step }),
        }
    }

    fn on_vote(
        &mut self,
        member: TpRank,
        step: u64,
        ok: bool,
        out: &mut Vec<GroupAction>,
    ) -> Result<(), Ignored> {
        if self.lazy {
            return self.lazy_vote(member, step);
        }
        let round = self.round_for(member, step)?;
        if round.ballots.contains_key(&member) {
            return Err(Ignored::DuplicateVote { member, step });
        }
        round.ballots.insert(member, ok);
        self.maybe_decide(out);
        Ok(())
    }

    /// Once every member has a ballot, decides the MIN and tells every live member.
    fn maybe_decide(&mut self, out: &mut Vec<GroupAction>) {
        let width = usize::from(self.width);
        let Some(round) = &mut self.round else { return };
        if round.decision.is_some() || round.ballots.len() < width {
            return;
        }
        let ok = round.ballots.values().all(|&ok| ok);
        round.decision = Some(ok);
        let step = round.step;
        for member in self.members().filter(|m| !self.lost.contains(m)) {
            out.push(GroupAction::VoteResult { member, step, ok });
        }
    }

    fn on_report(
        &mut self,
        member: TpRank,
        step: u64,
        report: StepReport,
        out: &mut Vec<GroupAction>,
    ) -> Result<(), Ignored> {
        let (lazy, width) = (self.lazy, usize::from(self.width));
        let round = self.round_for(member, step)?;
        if round.reports.contains_key(&member) {
            return Err(Ignored::DuplicateReport { member, step });
        }
        // A worker enters the forward only as its group decided: a member that went on while
        // its peers failed (or the reverse) would wait in the collective alone.
        let agrees = match report {
            _ if lazy => Self::lazy_report_stands(report),
            StepReport::Ready => round.decision == Some(true),
            StepReport::FailedWithGroup => round.decision == Some(false),
            StepReport::Raised => true,
        };
        if !agrees {
            return Err(Ignored::AgainstDecision { member, step, report, decision: round.decision });
        }
        round.reports.insert(member, report);
        if round.reports.values().filter(|r| r.enters_forward()).count() == width {
            round.forward = true;
            out.push(GroupAction::Forward { step });
        }
        Ok(())
    }

    fn on_lost(&mut self, member: TpRank, out: &mut Vec<GroupAction>) -> Result<(), Ignored> {
        if member.0 >= self.width {
            return Err(Ignored::NotMember { member });
        }
        if !self.lost.insert(member) {
            return Err(Ignored::LostMember { member });
        }
        if self.lazy {
            // A lazy group takes no vote: there is no ballot to turn into a no.
            return Ok(());
        }
        // A dead member votes no, as a failed collective would: its ballot (even an ok cast
        // before it died) becomes a no, and the group decides once its live peers have voted.
        if let Some(round) = &mut self.round {
            if round.decision.is_none() {
                round.ballots.insert(member, false);
                self.maybe_decide(out);
            }
        }
        Ok(())
    }
}

/// One row of the group's transition table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupRow {
    /// State before.
    pub from: String,
    /// Event.
    pub event: String,
    /// State after.
    pub to: String,
    /// The actions, in order.
    pub output: String,
}

/// Applies every event to representative states of a TP2 group on step 5 (reached by feeding
/// the node, so every one of them is reachable) and records the result.
pub fn transition_table() -> Vec<GroupRow> {
    use GroupEvent as E;
    let (tp0, tp1) = (TpRank(0), TpRank(1));
    let vote = |member, step, ok| E::Vote { member, step, ok };
    let report = |member, report| E::StepReport { member, step: 5, report };
    let eager = HandshakeMode::Eager;
    let lazy = HandshakeMode::Lazy;
    let reach = |mode: &HandshakeMode, events: Vec<GroupEvent>| {
        let mut group = DecodeGroup::new(2, *mode);
        for event in events {
            group.handle(event, &mut Vec::new());
        }
        group
    };
    let begin = E::StepBegin { step: 5 };
    let states = vec![
        reach(&eager, vec![]),
        reach(&eager, vec![begin.clone()]),
        reach(&eager, vec![begin.clone(), vote(tp0, 5, true)]),
        reach(&eager, vec![begin.clone(), vote(tp0, 5, true), vote(tp1, 5, true)]),
        reach(&eager, vec![begin.clone(), vote(tp0, 5, true), vote(tp1, 5, false)]),
        reach(
            &eager,
            vec![begin.clone(), vote(tp0, 5, true), vote(tp1, 5, true), report(tp0, StepReport::Ready)],
        ),
        reach(
            &eager,
            vec![
                begin.clone(),
                vote(tp0, 5, true),
                vote(tp1, 5, true),
                report(tp0, StepReport::Ready),
                report(tp1, StepReport::Ready),
            ],
        ),
        reach(&eager, vec![begin.clone(), vote(tp0, 5, true), E::MemberLost { member: tp1 }]),
        reach(&lazy, vec![begin.clone()]),
        reach(&lazy, vec![begin.clone(), report(tp0, StepReport::Ready)]),
    ];
    let events: Vec<(&str, GroupEvent)> = vec![
        ("StepBegin(6)", E::StepBegin { step: 6 }),
        ("StepBegin(5)", begin),
        ("Vote(tp0 ok)", vote(tp0, 5, true)),
        ("Vote(tp1 ok)", vote(tp1, 5, true)),
        ("Vote(tp1 no)", vote(tp1, 5, false)),
        ("Vote(tp0 ok, step 4)", vote(tp0, 4, true)),
        ("Vote(tp0 ok, step 6)", vote(tp0, 6, true)),
        ("Report(tp1 Ready)", report(tp1, StepReport::Ready)),
        ("Report(tp1 FailedWithGroup)", report(tp1, StepReport::FailedWithGroup)),
        ("Report(tp1 Raised)", report(tp1, StepReport::Raised)),
        ("MemberLost(tp1)", E::MemberLost { member: tp1 }),
    ];
    let mut rows = Vec::new();
    for state in &states {
        for (name, event) in &events {
            let mut next = state.clone();
            let mut out = Vec::new();
            next.handle(event.clone(), &mut out);
            let output: Vec<String> = out
                .iter()
                .map(|a| match a {
                    GroupAction::VoteResult { member, ok, .. } => {
                        format!("VoteResult({member} {})", if *ok { "ok" } else { "no" })
                    }
                    GroupAction::Forward { step } => format!("Forward({step})"),
                    GroupAction::Ignored(why) => format!("Ignored: {why}"),
                })
                .collect();
            let output = if output.is_empty() { "None".to_string() } else { output.join(", ") };
            rows.push(GroupRow { from: state.kind(), event: name.to_string(), to: next.kind(), output });
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::StepError;
    use crate::handshake::HandshakeError;
    use crate::ports::SessionKey;

    const TP0: TpRank = TpRank(0);
    const TP1: TpRank = TpRank(1);
    const TP2: TpRank = TpRank(2);
    const TP3: TpRank = TpRank(3);

    fn begin(step: u64) -> GroupEvent {
        GroupEvent::StepBegin { step }
    }
    fn vote(member: TpRank, step: u64, ok: bool) -> GroupEvent {
        GroupEvent::Vote { member, step, ok }
    }
    fn report(member: TpRank, step: u64, report: StepReport) -> GroupEvent {
        GroupEvent::StepReport { member, step, report }
    }
    fn told(step: u64, ok: bool, members: &[TpRank]) -> Vec<GroupAction> {
        members.iter().map(|&member| GroupAction::VoteResult { member, step, ok }).collect()
    }
    fn ignored(why: Ignored) -> Vec<GroupAction> {
        vec![GroupAction::Ignored(why)]
    }

    /// Feeds `events` one at a time to a group of `width` and checks the actions each one
    /// produced, then the decision of the step the group ends on.
    fn check(
        width: u16,
        mode: HandshakeMode,
        steps: Vec<(GroupEvent, Vec<GroupAction>)>,
        decision: Option<bool>,
    ) {
        let mut group = DecodeGroup::new(width, mode);
        for (i, (event, expected)) in steps.into_iter().enumerate() {
            let mut out = Vec::new();
            group.handle(event.clone(), &mut out);
            assert_eq!(out, expected, "input {i}: {event:?} in {}", group.kind());
        }
        assert_eq!(group.decision(), decision, "{group:?}");
    }

    #[test]
    fn a_repeated_vote_counts_once_and_the_min_decides() {
        let eager = || HandshakeMode::Eager;
        // A duplicated ok does not stand in for the peer that has not voted.
        check(
            2,
            eager(),
            vec![
                (begin(1), vec![]),
                (vote(TP0, 1, true), vec![]),
                (vote(TP0, 1, true), ignored(Ignored::DuplicateVote { member: TP0, step: 1 })),
                (vote(TP1, 1, true), told(1, true, &[TP0, TP1])),
            ],
            Some(true),
        );
        // The first ballot counts: a later ok does not take back a no.
        check(
            2,
            eager(),
            vec![
                (begin(1), vec![]),
                (vote(TP1, 1, false), vec![]),
                (vote(TP1, 1, true), ignored(Ignored::DuplicateVote { member: TP1, step: 1 })),
                (vote(TP0, 1, true), told(1, false, &[TP0, TP1])),
                (vote(TP0, 1, true), ignored(Ignored::DuplicateVote { member: TP0, step: 1 })),
            ],
            Some(false),
        );
    }

    #[test]
    fn a_late_or_unknown_vote_is_never_counted() {
        let forward = |step| vec![GroupAction::Forward { step }];
        check(
            2,
            HandshakeMode::Eager,
            vec![
                (vote(TP0, 1, true), ignored(Ignored::UnknownStep { member: TP0, step: 1 })),
                (begin(1), vec![]),
                (vote(TP0, 1, true), vec![]),
                (vote(TP1, 1, true), told(1, true, &[TP0, TP1])),
                (report(TP0, 1, StepReport::Ready), vec![]),
                (report(TP1, 1, StepReport::Ready), forward(1)),
                (begin(2), vec![]),
                // A vote for step 1 arriving during step 2 does not count for either.
                (vote(TP1, 1, true), ignored(Ignored::PastStep { member: TP1, step: 1, current: 2 })),
                (vote(TP1, 3, true), ignored(Ignored::UnknownStep { member: TP1, step: 3 })),
                (vote(TP3, 2, true), ignored(Ignored::NotMember { member: TP3 })),
                (vote(TP0, 2, true), vec![]),
            ],
            None,
        );
    }

    #[test]
    fn steps_are_admitted_in_order_after_the_forward() {
        let forward = |step| vec![GroupAction::Forward { step }];
        check(
            1,
            HandshakeMode::Eager,
            vec![
                (begin(3), vec![]),
                (begin(4), ignored(Ignored::StepInProgress { step: 4, current: 3 })),
                (vote(TP0, 3, false), told(3, false, &[TP0])),
                (report(TP0, 3, StepReport::FailedWithGroup), forward(3)),
                (begin(3), ignored(Ignored::StepNotAfter { step: 3, last: 3 })),
                (begin(2), ignored(Ignored::StepNotAfter { step: 2, last: 3 })),
                (begin(7), vec![]),
            ],
            None,
        );
    }

    #[test]
    fn every_member_enters_the_forward_only_as_the_group_decided() {
        let (ready, failed, raised) = (StepReport::Ready, StepReport::FailedWithGroup, StepReport::Raised);
        let against = |member, report, decision| {
            ignored(Ignored::AgainstDecision { member, step: 1, report, decision })
        };
        check(
            2,
            HandshakeMode::Eager,
            vec![
                (begin(1), vec![]),
                (report(TP0, 1, ready), against(TP0, ready, None)),
                (vote(TP0, 1, true), vec![]),
                (vote(TP1, 1, false), told(1, false, &[TP0, TP1])),
                (report(TP0, 1, ready), against(TP0, ready, Some(false))),
                (report(TP0, 1, failed), vec![]),
                (report(TP0, 1, failed), ignored(Ignored::DuplicateReport { member: TP0, step: 1 })),
                (report(TP1, 1, failed), vec![GroupAction::Forward { step: 1 }]),
            ],
            Some(false),
        );
        // Lazy: no vote; a worker that raises alone keeps the step from its forward.
        check(
            2,
            HandshakeMode::Lazy,
            vec![
                (begin(1), vec![]),
                (vote(TP0, 1, true), ignored(Ignored::NoVote { member: TP0, step: 1 })),
                (report(TP0, 1, ready), vec![]),
                (report(TP1, 1, raised), vec![]),
                (begin(2), ignored(Ignored::StepInProgress { step: 2, current: 1 })),
            ],
            None,
        );
    }

    #[test]
    fn a_lost_member_votes_no_and_the_group_admits_no_later_step() {
        let lost = |member| GroupEvent::MemberLost { member };
        check(
            3,
            HandshakeMode::Eager,
            vec![
                (begin(1), vec![]),
                (vote(TP0, 1, true), vec![]),
                (vote(TP1, 1, true), vec![]),
                // Its ok, cast before it died, turns into a no; the live members are told.
                (lost(TP1), vec![]),
                (vote(TP1, 1, true), ignored(Ignored::LostMember { member: TP1 })),
                (vote(TP2, 1, true), told(1, false, &[TP0, TP2])),
                (lost(TP1), ignored(Ignored::LostMember { member: TP1 })),
                (report(TP0, 1, StepReport::FailedWithGroup), vec![]),
                (report(TP2, 1, StepReport::FailedWithGroup), vec![]),
                (begin(2), ignored(Ignored::GroupBroken { step: 2, lost: TP1 })),
            ],
            Some(false),
        );
        // Lost while the others still handshake: the last live vote decides.
        check(
            2,
            HandshakeMode::Eager,
            vec![(begin(1), vec![]), (lost(TP0), vec![]), (vote(TP1, 1, true), told(1, false, &[TP1]))],
            Some(false),
        );
    }

    #[test]
    fn an_open_vote_names_who_voted_and_who_has_not() {
        let mut group = DecodeGroup::new(3, HandshakeMode::Eager);
        let mut out = Vec::new();
        group.handle(begin(1), &mut out);
        assert_eq!(group.open_vote(), None, "nobody voted yet");
        group.handle(vote(TP2, 1, true), &mut out);
        let open = OpenVote { step: 1, voted: vec![TP2], missing: vec![TP0, TP1] };
        assert_eq!(group.open_vote(), Some(open));
        group.handle(vote(TP0, 1, true), &mut out);
        group.handle(vote(TP1, 1, true), &mut out);
        assert_eq!(group.open_vote(), None, "decided");
    }

    #[test]
    fn a_step_error_says_whether_the_worker_enters_the_forward() {
        let alone = StepError::Handshake {
            session: SessionKey("P0:6301:0".into()),
            error: HandshakeError::Transport("refused".into()),
        };
        let cases = [
            (StepError::GroupHandshakeFailed { step: 1 }, StepReport::FailedWithGroup, true),
            (alone, StepReport::Raised, false),
        ];
        for (error, report, enters) in cases {
            assert_eq!(StepReport::failed(&error), report, "{error}");
            assert_eq!(report.enters_forward(), enters, "{error}");
        }
        assert!(StepReport::Ready.enters_forward());
    }
}
