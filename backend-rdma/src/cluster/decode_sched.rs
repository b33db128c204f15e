//! The decode side's schedulers: carrying out what each decode DP group's `DecodeScheduler`
//! (the engine layer's) asks, the forward's first tokens, and how requests end.

use pdkv_core::decode::{DecodeEvent, RecvRequest};
use pdkv_core::group::{GroupAction, GroupEvent, Ignored};
use pdkv_core::ids::{EngineId, RankId, RequestId};
use pdkv_engine::decode::{SchedulerOutput, Tokens};
use pdkv_engine::verdict::ViolationKind;

use super::{Cluster, IDLE_STEP};
use crate::sched::ToRank;

impl Cluster {
    /// Feeds decode group `g`'s barrier and carries out what it decides.
    pub(super) fn group_event(&mut self, g: usize, event: GroupEvent) {
        let mut out = Vec::new();
        self.dgroups[g].sched.handle_group_event(event, &mut out);
        self.sched_outputs(g, out);
    }

    /// Carries out what decode group `g`'s scheduler asks, in order: inputs go to the ranks
    /// they name, a group every rank of which entered the forward runs it, a joined request
    /// starts a step, a failed one ends.
    pub(super) fn sched_outputs(&mut self, g: usize, out: Vec<SchedulerOutput<String>>) {
        for output in out {
            match output {
                SchedulerOutput::ToMember { member, event } => {
                    let rank = self.decode_rank(g, member.0);
                    let message = match event {
                        DecodeEvent::StepBegin { step, requests } => ToRank::StepBegin { step, requests },
                        DecodeEvent::Queued { requests } => ToRank::Queued { requests },
                        DecodeEvent::Dequeued { requests } => ToRank::Dequeued { requests },
                        other => {
                            unreachable!("a decode scheduler tells its members only of steps: {other:?}")
                        }
                    };
                    self.procs.send(rank, &message);
                }
                SchedulerOutput::Group(GroupAction::VoteResult { member, step, ok }) => {
                    let rank = self.decode_rank(g, member.0);
                    self.procs.send(rank, &ToRank::VoteResult { step, ok });
                }
                SchedulerOutput::Group(GroupAction::Forward { .. }) => self.forward(g),
                // A lost rank's last messages may still be on their way when it is lost.
                SchedulerOutput::Group(GroupAction::Ignored(Ignored::LostMember { .. })) => {}
                SchedulerOutput::Group(GroupAction::Ignored(why)) => {
                    let (engine, dp) = (self.dgroups[g].engine, self.dgroups[g].dp);
                    self.tally.problem(format!("D{engine}.dp{dp}: the decode group ignored an input: {why}"));
                }
                SchedulerOutput::Joined(_) => self.begin_step(g),
                SchedulerOutput::Failed { request, errors } => {
                    self.end(request, Some(errors.into_iter().map(|(_, error)| error).collect()));
                }
                SchedulerOutput::DoubleFree { request, blocks } => {
                    let (engine, dp) = (self.dgroups[g].engine, self.dgroups[g].dp);
                    self.tally.violation(
                        ViolationKind::DoubleFree,
                        format!("D{engine}.dp{dp}: {request} freed blocks {blocks:?} it did not hold"),
                    );
                }
            }
        }
    }

    pub(super) fn dgroup_of(&self, rank: RankId) -> usize {
        self.dgroups
            .iter()
            .position(|g| g.engine == usize::from(rank.engine.index) && g.dp == rank.dp)
            .expect("decode ranks belong to a group")
    }

    pub(super) fn decode_rank(&self, g: usize, tp: u16) -> RankId {
        let group = &self.dgroups[g];
        RankId::new(EngineId::decode(group.engine as u16), group.dp, tp)
    }

    /// A request reached decode group `g`: it waits for a step with room for it.
    pub(super) fn decode_arrival(&mut self, g: usize, recv: RecvRequest) {
        let Some(req) = self.clients.requests.get(&recv.request) else { return };
        let tokens = Tokens { input: req.input, output: req.output };
        self.dgroups[g].sched.handle_arrival(recv, tokens);
        self.begin_step(g);
    }

    pub(super) fn begin_step(&mut self, g: usize) {
        // The barrier admits a step once the last one ran its forward, and never after a rank
        // of the group was lost (its collectives can never complete). Requests waiting for
        // their KV need steps too: the ranks redial their sources at step boundaries.
        let sched = &self.dgroups[g].sched;
        if !sched.barrier().may_begin() || !(sched.has_work() || sched.pending_len() > 0) {
            return;
        }
        let step = sched.barrier().step().map_or(1, |s| s + 1);
        self.dgroups[g].next_step = None;
        let mut out = Vec::new();
        self.dgroups[g].sched.handle_step_begin(step, &mut out);
        self.sched_outputs(g, out);
    }

    /// Every rank of the group entered the forward pass: one token for every running request.
    pub(super) fn forward(&mut self, g: usize) {
        let now = std::time::Instant::now();
        let mut out = Vec::new();
        let done = self.dgroups[g].sched.handle_forward(&mut out);
        for id in &done.first {
            if let Some(req) = self.clients.requests.get_mut(id) {
                req.first_token = Some(now);
                self.tally.record_first_token((now - req.started).as_secs_f64() * 1e3);
            }
        }
        self.sched_outputs(g, out);
        for id in done.finished {
            self.end(id, None);
        }
        let sched = &self.dgroups[g].sched;
        if sched.has_work() {
            self.begin_step(g);
        } else if sched.pending_len() > 0 {
            self.dgroups[g].next_step = Some(now + IDLE_STEP);
        }
    }

    pub(super) fn reported(&mut self, rank: RankId, request: RequestId, error: Option<String>) {
        let g = self.dgroup_of(rank);
        let result = match error {
            Some(error) => Err(format!("{rank}: {error}")),
            None => Ok(()),
        };
        let mut out = Vec::new();
        self.dgroups[g].sched.handle_report(request, rank.tp_rank(), result, &mut out);
        self.sched_outputs(g, out);
    }
}
