//! The decode side's glue between the core's nodes, written once for every driver: which of a
//! decode worker's actions are its group's input, the per-request barrier at which every TP
//! rank of a DP group has reported a request, the group's scheduler (`scheduler.rs`), and the
//! workers and groups routed to each other (`nodes.rs`), for a driver that runs the workers.

use std::collections::{BTreeMap, BTreeSet};

use pdkv_core::decode::DecodeAction;
use pdkv_core::group::{GroupEvent, StepReport};
use pdkv_core::ids::{RequestId, TpRank};

mod nodes;
mod scheduler;

pub use nodes::{DecodeNodes, NodeOutput};
pub use scheduler::{DecodeScheduler, Forwarded, KvAllocation, SchedulerLimits, SchedulerOutput, Tokens};

/// The input to its decode group that a worker's action is, if any: its vote on a step, or its
/// report of the step (ready; failed with the group, which still enters the forward; or raised
/// on this worker alone, which never reaches the collective). Every other action leaves the
/// group untouched.
pub fn group_input(member: TpRank, action: &DecodeAction) -> Option<GroupEvent> {
    match action {
        DecodeAction::CastVote { step, ok } => Some(GroupEvent::Vote { member, step: *step, ok: *ok }),
        DecodeAction::StepReady { step } => {
            Some(GroupEvent::StepReport { member, step: *step, report: StepReport::Ready })
        }
        DecodeAction::StepFailed { step, error } => {
            Some(GroupEvent::StepReport { member, step: *step, report: StepReport::failed(error) })
        }
        _ => None,
    }
}

/// What a request's barrier decided once every TP rank of its group reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Joined<E> {
    /// Every rank received its KV: the request joins the batch.
    Received,
    /// At least one rank failed it; the request ends failed, with each failing rank's error in
    /// the order they reported.
    Failed(Vec<(TpRank, E)>),
}

/// What one rank reported of a request so far, until the whole group has.
#[derive(Clone, Debug, Hash)]
struct Reports<E> {
    reported: BTreeSet<TpRank>,
    errors: Vec<(TpRank, E)>,
}

/// A decode DP group's per-request barrier: an admitted request waits here until every TP rank
/// of the group reported it received or failed. Reports are keyed by rank, so a repeated
/// report counts once; a report of a request the barrier does not wait for (never admitted, or
/// already decided) is ignored.
#[derive(Clone, Debug, Hash)]
pub struct RequestBarrier<E> {
    width: u16,
    waiting: BTreeMap<RequestId, Reports<E>>,
}

impl<E> RequestBarrier<E> {
    /// The barrier of a group of `width` TP ranks.
    pub fn new(width: u16) -> Self {
        assert!(width > 0, "a decode group has at least one TP rank");
        RequestBarrier { width, waiting: BTreeMap::new() }
    }

    /// `request` was admitted: the barrier waits for its reports.
    pub fn admit(&mut self, request: RequestId) {
        self.waiting
            .entry(request)
            .or_insert_with(|| Reports { reported: BTreeSet::new(), errors: Vec::new() });
    }

    /// Rank `member` reported `request`: received (`Ok`) or failed with an error. Returns the
    /// decision once the last rank of the group reported.
    pub fn report(&mut self, request: RequestId, member: TpRank, result: Result<(), E>) -> Option<Joined<E>> {
        assert!(member.0 < self.width, "{member:?} is outside a group of {} TP ranks", self.width);
        let reports = self.waiting.get_mut(&request)?;
        if !reports.reported.insert(member) {
            return None;
        }
        if let Err(error) = result {
            reports.errors.push((member, error));
        }
        if reports.reported.len() < usize::from(self.width) {
            return None;
        }
        let reports = self.waiting.remove(&request).expect("present");
        Some(if reports.errors.is_empty() { Joined::Received } else { Joined::Failed(reports.errors) })
    }

    /// The group was lost: every request it waited for, in request order, now waits no more.
    pub fn take_all(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.waiting).into_keys().collect()
    }

    /// Requests waiting for reports.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether no request waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::decode::StepError;
    use pdkv_core::handshake::HandshakeError;
    use pdkv_core::ports::SessionKey;

    #[test]
    fn a_workers_actions_that_are_its_groups_input() {
        let m = TpRank(1);
        let handshake = StepError::Handshake {
            session: SessionKey("s".into()),
            error: HandshakeError::Timeout { waited_ns: 1 },
        };
        let group = StepError::GroupHandshakeFailed { step: 3 };
        let rows: Vec<(DecodeAction, Option<GroupEvent>)> = vec![
            (
                DecodeAction::CastVote { step: 3, ok: false },
                Some(GroupEvent::Vote { member: m, step: 3, ok: false }),
            ),
            (
                DecodeAction::StepReady { step: 3 },
                Some(GroupEvent::StepReport { member: m, step: 3, report: StepReport::Ready }),
            ),
            (
                DecodeAction::StepFailed { step: 3, error: Box::new(group) },
                Some(GroupEvent::StepReport { member: m, step: 3, report: StepReport::FailedWithGroup }),
            ),
            (
                DecodeAction::StepFailed { step: 3, error: Box::new(handshake) },
                Some(GroupEvent::StepReport { member: m, step: 3, report: StepReport::Raised }),
            ),
            (DecodeAction::RequestReceived { request: RequestId(1) }, None),
            (DecodeAction::AbortReads { request: RequestId(1) }, None),
        ];
        for (action, expected) in rows {
            assert_eq!(group_input(m, &action), expected, "{action:?}");
        }
    }

    /// Reports as (rank, failed), in order, and what the barrier decides after each.
    fn check(width: u16, reports: &[(u16, bool)], expected: &[Option<Joined<&str>>]) {
        let mut barrier = RequestBarrier::new(width);
        barrier.admit(RequestId(7));
        let got: Vec<Option<Joined<&str>>> = reports
            .iter()
            .map(|&(tp, failed)| {
                barrier.report(RequestId(7), TpRank(tp), if failed { Err("why") } else { Ok(()) })
            })
            .collect();
        assert_eq!(got, expected, "{reports:?}");
    }

    #[test]
    fn a_request_is_decided_once_every_rank_reported_it_and_each_rank_counts_once() {
        use Joined::{Failed, Received};
        check(1, &[(0, false)], &[Some(Received)]);
        check(2, &[(0, false), (1, false)], &[None, Some(Received)]);
        // A repeated report stands in for no other rank (counting reports, it would have).
        check(2, &[(0, false), (0, false), (1, true)], &[None, None, Some(Failed(vec![(TpRank(1), "why")]))]);
        check(
            3,
            &[(2, true), (0, true), (1, false)],
            &[None, None, Some(Failed(vec![(TpRank(2), "why"), (TpRank(0), "why")]))],
        );
        // Once decided, the request is forgotten: a late report is ignored.
        check(1, &[(0, false), (0, true)], &[Some(Received), None]);
    }

    #[test]
    fn reports_of_requests_never_admitted_are_ignored() {
        let mut barrier = RequestBarrier::<()>::new(1);
        assert_eq!(barrier.report(RequestId(1), TpRank(0), Ok(())), None);
        assert!(barrier.is_empty());
    }
}
