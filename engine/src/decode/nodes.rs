//! A decode side's workers and the DP groups they form, in one value: what a driver that runs
//! the workers itself (the simulator) hands events to. It routes between them, so no driver
//! re-writes that wiring: a worker's vote and step report go to its group's barrier, its report
//! of a request to the request barrier, and a group's input for a member goes to that worker at
//! once. Everything else leaves, in order, as a [`NodeOutput`] for the driver to carry out.

use pdkv_core::decode::{DecodeAction, DecodeEvent, DecodeWorker, RecvError};
use pdkv_core::group::GroupEvent;
use pdkv_core::ids::TpRank;
use pdkv_core::time::Instant;

use super::{group_input, DecodeScheduler, Forwarded, SchedulerOutput};

/// What the nodes ask of their driver, in the order it is to be carried out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeOutput {
    /// An action worker `worker` took. Every action comes out, the ones the nodes routed
    /// themselves too (a vote, a step report, a request's report: the driver may trace them),
    /// each before what routing it caused.
    Action {
        /// The worker.
        worker: usize,
        /// Its action.
        action: DecodeAction,
    },
    /// Worker `worker` finished an event; `timeout` is its timer at that moment.
    Handled {
        /// The worker.
        worker: usize,
        /// [`DecodeWorker::poll_timeout`] right after the event.
        timeout: Option<Instant>,
    },
    /// What group `group`'s scheduler decided, except its inputs for members, which the nodes
    /// delivered.
    Group {
        /// The group.
        group: usize,
        /// The decision.
        output: SchedulerOutput<RecvError>,
    },
}

/// One DP group: its scheduler and its members (worker indices, in TP order).
#[derive(Clone, Debug, Hash)]
struct Group {
    sched: DecodeScheduler<RecvError>,
    members: Vec<usize>,
}

/// Decode workers and their DP groups, numbered in the order they are added. Its hash is its
/// state's (the spare buffers, always empty, are not state), for a model checker's visited set.
#[derive(Clone, Debug, Default)]
pub struct DecodeNodes {
    workers: Vec<DecodeWorker>,
    /// Each worker's group and TP rank in it.
    seats: Vec<(usize, TpRank)>,
    groups: Vec<Group>,
    /// Spare action buffers (reused, never shrunk): a decode step hands every worker an event,
    /// and a fresh vector per event was a measurable share of the simulator's time.
    spare: Vec<Vec<DecodeAction>>,
    /// Spare buffers for what a group's scheduler decides, for the same reason: every step
    /// begins, votes and enters the forward on every group. A stack, as `spare` is.
    spare_decided: Vec<Vec<SchedulerOutput<RecvError>>>,
}

impl std::hash::Hash for DecodeNodes {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (&self.workers, &self.seats, &self.groups).hash(state);
    }
}

impl DecodeNodes {
    /// No workers, no groups.
    pub fn new() -> Self {
        DecodeNodes::default()
    }

    /// Adds a group with `sched` as its scheduler; returns its number.
    pub fn add_group(&mut self, sched: DecodeScheduler<RecvError>) -> usize {
        self.groups.push(Group { sched, members: Vec::new() });
        self.groups.len() - 1
    }

    /// Adds `worker` as the next TP rank of group `group`; returns its number.
    pub fn add_worker(&mut self, group: usize, worker: DecodeWorker) -> usize {
        let members = &mut self.groups[group].members;
        let seat = TpRank(u16::try_from(members.len()).expect("a group has at most u16::MAX ranks"));
        members.push(self.workers.len());
        self.seats.push((group, seat));
        self.workers.push(worker);
        self.workers.len() - 1
    }

    /// Worker `worker`.
    pub fn worker(&self, worker: usize) -> &DecodeWorker {
        &self.workers[worker]
    }

    /// Every worker, by number.
    pub fn workers(&self) -> &[DecodeWorker] {
        &self.workers
    }

    /// Puts `fresh` in worker `worker`'s place (a restarted process).
    pub fn replace_worker(&mut self, worker: usize, fresh: DecodeWorker) {
        self.workers[worker] = fresh;
    }

    /// Group `group`'s scheduler.
    pub fn sched(&self, group: usize) -> &DecodeScheduler<RecvError> {
        &self.groups[group].sched
    }

    /// Group `group`'s scheduler, for inputs that return nothing to route (arrivals, a reset).
    pub fn sched_mut(&mut self, group: usize) -> &mut DecodeScheduler<RecvError> {
        &mut self.groups[group].sched
    }

    /// Group `group`'s members, in TP order.
    pub fn members(&self, group: usize) -> &[usize] {
        &self.groups[group].members
    }

    /// Worker `worker`'s group.
    pub fn group_of(&self, worker: usize) -> usize {
        self.seats[worker].0
    }

    /// Worker `worker` handles `event`; see [`DecodeNodes`].
    pub fn handle_worker(
        &mut self,
        now: Instant,
        worker: usize,
        event: DecodeEvent,
        out: &mut Vec<NodeOutput>,
    ) {
        let mut actions = self.spare.pop().unwrap_or_default();
        self.workers[worker].handle(now, event, &mut actions);
        let (group, seat) = self.seats[worker];
        for action in actions.drain(..) {
            let routed = match &action {
                DecodeAction::RequestReceived { request } => Some((*request, Ok(()))),
                DecodeAction::RequestFailed { request, error } => Some((*request, Err(error.clone()))),
                _ => None,
            };
            let input = group_input(seat, &action);
            out.push(NodeOutput::Action { worker, action });
            if let Some(event) = input {
                self.handle_group_event(now, group, event, out);
            } else if let Some((request, result)) = routed {
                let mut decided = self.spare_decided.pop().unwrap_or_default();
                self.groups[group].sched.handle_report(request, seat, result, &mut decided);
                self.route(now, group, decided, out);
            }
        }
        self.spare.push(actions);
        out.push(NodeOutput::Handled { worker, timeout: self.workers[worker].poll_timeout() });
    }

    /// An input for group `group`'s barrier from outside its workers (a step's begin is
    /// [`Self::handle_step_begin`]'s; a lost member, a test's vote).
    pub fn handle_group_event(
        &mut self,
        now: Instant,
        group: usize,
        event: GroupEvent,
        out: &mut Vec<NodeOutput>,
    ) {
        let mut decided = self.spare_decided.pop().unwrap_or_default();
        self.groups[group].sched.handle_group_event(event, &mut decided);
        self.route(now, group, decided, out);
    }

    /// Step `step` begins on group `group`: its scheduler admits, and its workers hear of it.
    pub fn handle_step_begin(&mut self, now: Instant, group: usize, step: u64, out: &mut Vec<NodeOutput>) {
        let mut decided = self.spare_decided.pop().unwrap_or_default();
        self.groups[group].sched.handle_step_begin(step, &mut decided);
        self.route(now, group, decided, out);
    }

    /// Group `group` ran its forward: see [`DecodeScheduler::handle_forward`].
    pub fn handle_forward(&mut self, now: Instant, group: usize, out: &mut Vec<NodeOutput>) -> Forwarded {
        let mut decided = self.spare_decided.pop().unwrap_or_default();
        let forwarded = self.groups[group].sched.handle_forward(&mut decided);
        self.route(now, group, decided, out);
        forwarded
    }

    /// Delivers a group's inputs for its members at once, in order, and passes the rest on.
    fn route(
        &mut self,
        now: Instant,
        group: usize,
        mut decided: Vec<SchedulerOutput<RecvError>>,
        out: &mut Vec<NodeOutput>,
    ) {
        for output in decided.drain(..) {
            match output {
                SchedulerOutput::ToMember { member, event } => {
                    let worker = self.groups[group].members[usize::from(member.0)];
                    self.handle_worker(now, worker, event, out);
                }
                output => out.push(NodeOutput::Group { group, output }),
            }
        }
        self.spare_decided.push(decided);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{KvAllocation, SchedulerLimits, Tokens};
    use pdkv_core::decode::{DecodeConfig, RecvRequest};
    use pdkv_core::ids::{EngineId, RankId, RequestId};
    use pdkv_core::params::KvTransferParams;
    use pdkv_core::policy::{HandshakeMode, Policy};
    use pdkv_core::ports::AddressBook;
    use pdkv_core::topology::Deployment;

    /// One decode group of `tp` workers of `1P_TP1:1D_TP<tp>`, under pdkv's rules.
    fn nodes(tp: u16) -> DecodeNodes {
        let d = Deployment::parse(&format!("1P_TP1:1D_TP{tp}")).expect("a deployment");
        let book = AddressBook::one_host_per_engine(&d);
        let engine = EngineId::decode(0);
        let limits = SchedulerLimits {
            width: tp,
            max_batch: 4,
            pool_blocks: 64,
            block_size_tokens: 16,
            allocation: KvAllocation::Reserve,
        };
        let mut nodes = DecodeNodes::new();
        let g = nodes.add_group(DecodeScheduler::new(limits, HandshakeMode::Eager));
        for t in 0..tp {
            let rank = RankId::new(engine, 0, t);
            let config = DecodeConfig::new(
                rank,
                d.layout(engine),
                d.model.clone(),
                Policy::default(),
                book.engine_id(engine),
            );
            nodes.add_worker(g, DecodeWorker::new(config));
        }
        nodes
    }

    /// The outputs in a few words each, in order.
    fn render(out: &[NodeOutput]) -> Vec<String> {
        out.iter()
            .map(|o| match o {
                NodeOutput::Action { worker, action } => {
                    let name = format!("{action:?}");
                    format!("w{worker} {}", name.split([' ', '(']).next().unwrap_or_default())
                }
                NodeOutput::Handled { worker, .. } => format!("w{worker} handled"),
                NodeOutput::Group { group, output } => match output {
                    SchedulerOutput::Group(pdkv_core::group::GroupAction::VoteResult {
                        member, ok, ..
                    }) => {
                        format!("g{group} vote result for {} ok={ok}", member.0)
                    }
                    other => format!("g{group} {other:?}"),
                },
            })
            .collect()
    }

    /// A step with nothing to read: the nodes hand it to every worker in TP order, each votes
    /// at once, and the group's decision comes out right after the last vote that made it,
    /// before that worker's event is over; vote results are the driver's to deliver.
    #[test]
    fn a_step_reaches_every_worker_and_their_votes_reach_the_group() {
        let mut n = nodes(2);
        let mut out = Vec::new();
        n.handle_step_begin(Instant::ZERO, 0, 1, &mut out);
        assert_eq!(
            render(&out),
            [
                "w0 CastVote",
                "w0 handled",
                "w1 CastVote",
                "g0 vote result for 0 ok=true",
                "g0 vote result for 1 ok=true",
                "w1 handled"
            ]
        );
        // The results delivered, each worker is ready; the second ready lets the forward run.
        out.clear();
        for w in 0..2 {
            n.handle_worker(Instant::ZERO, w, DecodeEvent::VoteResult { step: 1, ok: true }, &mut out);
        }
        assert_eq!(
            render(&out),
            ["w0 StepReady", "w0 handled", "w1 StepReady", "g0 Group(Forward { step: 1 })", "w1 handled"]
        );
    }

    /// A request's reports go to the request barrier: a request without the prefill's TP size
    /// fails on each worker, and it ends failed once, after the second report, with both
    /// errors, its blocks back in the pool.
    #[test]
    fn reports_reach_the_request_barrier() {
        let mut n = nodes(2);
        let d = Deployment::parse("1P_TP1:1D_TP2").expect("parses");
        let recv = RecvRequest {
            request: RequestId(9),
            prefill_engine: EngineId::prefill(0),
            prefill_address: AddressBook::one_host_per_engine(&d).engine(EngineId::prefill(0)).clone(),
            params: KvTransferParams {
                do_remote_prefill: true,
                transfer_id: Some("tx-9".into()),
                remote_block_ids: vec![3].into(),
                ..Default::default()
            },
            local_block_ids: Vec::new(),
        };
        n.sched_mut(0).handle_arrival(recv, Tokens { input: 16, output: 1 });
        let mut out = Vec::new();
        n.handle_step_begin(Instant::ZERO, 0, 1, &mut out);
        let failed = out
            .iter()
            .position(|o| matches!(o, NodeOutput::Group { output: SchedulerOutput::Failed { .. }, .. }));
        let second = out.iter().position(|o| {
            matches!(o, NodeOutput::Action { worker: 1, action: DecodeAction::RequestFailed { .. } })
        });
        assert_eq!((second.map(|i| i + 1), n.sched(0).free_blocks()), (failed, 64), "{:?}", render(&out));
        let Some(NodeOutput::Group { output: SchedulerOutput::Failed { errors, .. }, .. }) =
            failed.map(|i| &out[i])
        else {
            unreachable!("found above")
        };
        assert_eq!(errors.iter().map(|(m, _)| m.0).collect::<Vec<_>>(), [0, 1]);
        assert_eq!((n.members(0), n.group_of(1), n.workers().len()), (&[0, 1][..], 0, 2));
    }

    /// What every decode step moves through the output vectors stays small: the large, rare
    /// payloads (handshake metadata, a release, a lease, a step error) are boxed. At 176 bytes
    /// an output, moving them was a sixth of the 1,024-GPU simulation's time.
    #[test]
    fn outputs_stay_small() {
        use std::mem::size_of;
        assert!(size_of::<DecodeEvent>() <= 56, "{}", size_of::<DecodeEvent>());
        assert!(size_of::<DecodeAction>() <= 64, "{}", size_of::<DecodeAction>());
        assert!(size_of::<SchedulerOutput<RecvError>>() <= 64, "{}", size_of::<SchedulerOutput<RecvError>>());
        assert!(size_of::<NodeOutput>() <= 80, "{}", size_of::<NodeOutput>());
    }

    /// The hash is the state's: an event that changes nothing (a tick with no timer due) leaves
    /// it equal, though the nodes now keep a spare buffer, so a model checker sees one state.
    #[test]
    fn the_hash_ignores_spare_buffers() {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let hash = |n: &DecodeNodes| {
            let mut h = DefaultHasher::new();
            n.hash(&mut h);
            h.finish()
        };
        let before = nodes(2);
        let mut after = before.clone();
        let mut out = Vec::new();
        after.handle_worker(Instant::ZERO, 0, DecodeEvent::Tick, &mut out);
        assert_eq!(render(&out), ["w0 handled"]);
        assert_eq!(hash(&before), hash(&after));
    }
}
