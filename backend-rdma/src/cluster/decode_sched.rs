//! The decode side's schedulers: each decode DP group's `DecodeScheduler` (the engine
//! layer's), what it asks carried out, and the forward's first tokens.

use std::time::Duration;

use pdkv_core::decode::{DecodeEvent, RecvRequest};
use pdkv_core::group::{GroupAction, GroupEvent, Ignored};
use pdkv_core::ids::{EngineId, RankId, RequestId};
use pdkv_core::policy::Policy;
use pdkv_core::topology::Deployment;
use pdkv_engine::decode::{DecodeScheduler, KvAllocation, SchedulerLimits, SchedulerOutput, Tokens};
use pdkv_engine::verdict::ViolationKind;

use super::{Cluster, ClusterConfig};
use crate::sched::ToRank;

/// Decode blocks per decode DP group (the KV lands there; only ids are tracked here). Admission
/// reserves a request's prompt blocks and its answer's growth from them, as the simulator's does.
const DECODE_BLOCKS: u32 = 1 << 16;
/// How long a decode group with nothing to compute waits before its next step, so queued
/// requests get redialled without spinning.
const IDLE_STEP: Duration = Duration::from_millis(2);

/// A decode DP group: its engine, DP rank and width, its scheduler, and when it steps next
/// with nothing to compute.
pub(super) struct DGroup {
    pub(super) engine: usize,
    pub(super) dp: u16,
    pub(super) tp: u16,
    /// The group's scheduler: its queue, pool, batch, request barrier and step barrier (the
    /// same one the simulator drives).
    pub(super) sched: DecodeScheduler<String>,
    pub(super) next_step: Option<std::time::Instant>,
}

/// The decode side: each decode DP group's scheduler (the engine layer's, the simulator's too).
pub(super) struct DecodeSide {
    pub(super) groups: Vec<DGroup>,
}

impl DecodeSide {
    /// A scheduler for each DP group of `d`'s decode engines, under `policy`'s handshake.
    pub(super) fn new(d: &Deployment, config: &ClusterConfig, policy: Policy) -> DecodeSide {
        let block_size_tokens = d.model.block_size_tokens;
        let groups = d
            .decode
            .iter()
            .enumerate()
            .flat_map(|(e, l)| (0..l.dp).map(move |dp| (e, dp, l.tp)))
            .map(|(engine, dp, tp)| DGroup {
                engine,
                dp,
                tp,
                sched: DecodeScheduler::new(
                    SchedulerLimits {
                        width: tp,
                        max_batch: config.decode_max_batch as usize,
                        pool_blocks: DECODE_BLOCKS,
                        block_size_tokens,
                        allocation: KvAllocation::Reserve,
                    },
                    policy.handshake,
                ),
                next_step: None,
            })
            .collect();
        DecodeSide { groups }
    }

    /// The index of the DP group of decode rank `rank`.
    pub(super) fn group_of(&self, rank: RankId) -> usize {
        self.groups
            .iter()
            .position(|g| g.engine == usize::from(rank.engine.index) && g.dp == rank.dp)
            .expect("decode ranks belong to a group")
    }

    /// TP rank `tp` of decode group `g`.
    pub(super) fn rank(&self, g: usize, tp: u16) -> RankId {
        let group = &self.groups[g];
        RankId::new(EngineId::decode(group.engine as u16), group.dp, tp)
    }

    /// Times requests waited behind a full batch or pool, over every group.
    pub(super) fn queued_total(&self) -> u64 {
        self.groups.iter().map(|g| g.sched.queued_total()).sum()
    }
}

impl Cluster {
    /// Feeds decode group `g`'s barrier and carries out what it decides.
    pub(super) fn group_event(&mut self, g: usize, event: GroupEvent) {
        let mut out = Vec::new();
        self.decode.groups[g].sched.handle_group_event(event, &mut out);
        self.sched_outputs(g, out);
    }

    /// Carries out what decode group `g`'s scheduler asks, in order: inputs go to the ranks
    /// they name, a group every rank of which entered the forward runs it, a joined request
    /// starts a step, a failed one ends.
    pub(super) fn sched_outputs(&mut self, g: usize, out: Vec<SchedulerOutput<String>>) {
        for output in out {
            match output {
                SchedulerOutput::ToMember { member, event } => {
                    let rank = self.decode.rank(g, member.0);
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
                    let rank = self.decode.rank(g, member.0);
                    self.procs.send(rank, &ToRank::VoteResult { step, ok });
                }
                SchedulerOutput::Group(GroupAction::Forward { .. }) => self.forward(g),
                // A lost rank's last messages may still be on their way when it is lost.
                SchedulerOutput::Group(GroupAction::Ignored(Ignored::LostMember { .. })) => {}
                SchedulerOutput::Group(GroupAction::Ignored(why)) => {
                    let (engine, dp) = (self.decode.groups[g].engine, self.decode.groups[g].dp);
                    self.tally.problem(format!("D{engine}.dp{dp}: the decode group ignored an input: {why}"));
                }
                SchedulerOutput::Joined(_) => self.begin_step(g),
                SchedulerOutput::Failed { request, errors } => {
                    self.end(request, Some(errors.into_iter().map(|(_, error)| error).collect()));
                }
                // The cluster reserves a request's blocks at admission, so nothing is preempted.
                SchedulerOutput::Preempted(request) | SchedulerOutput::Resumed { request, .. } => {
                    let (engine, dp) = (self.decode.groups[g].engine, self.decode.groups[g].dp);
                    self.tally
                        .problem(format!("D{engine}.dp{dp}: {request} preempted under reserved allocation"));
                }
                SchedulerOutput::DoubleFree { request, blocks } => {
                    let (engine, dp) = (self.decode.groups[g].engine, self.decode.groups[g].dp);
                    self.tally.violation(
                        ViolationKind::DoubleFree,
                        format!("D{engine}.dp{dp}: {request} freed blocks {blocks:?} it did not hold"),
                    );
                }
            }
        }
    }

    /// A request reached decode group `g`: it waits for a step with room for it.
    pub(super) fn decode_arrival(&mut self, g: usize, recv: RecvRequest) {
        let Some(req) = self.clients.requests.get(&recv.request) else { return };
        let tokens = Tokens { input: req.input, output: req.output };
        self.decode.groups[g].sched.handle_arrival(recv, tokens);
        self.begin_step(g);
    }

    pub(super) fn begin_step(&mut self, g: usize) {
        // The barrier admits a step once the last one ran its forward, and never after a rank
        // of the group was lost (its collectives can never complete). Requests waiting for
        // their KV need steps too: the ranks redial their sources at step boundaries.
        let sched = &self.decode.groups[g].sched;
        if !sched.barrier().may_begin() || !(sched.has_work() || sched.pending_len() > 0) {
            return;
        }
        let step = sched.barrier().step().map_or(1, |s| s + 1);
        self.decode.groups[g].next_step = None;
        let mut out = Vec::new();
        self.decode.groups[g].sched.handle_step_begin(step, &mut out);
        self.sched_outputs(g, out);
    }

    /// Every rank of the group entered the forward pass: one token for every running request.
    pub(super) fn forward(&mut self, g: usize) {
        let now = std::time::Instant::now();
        let mut out = Vec::new();
        let done = self.decode.groups[g].sched.handle_forward(&mut out);
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
        let sched = &self.decode.groups[g].sched;
        if sched.has_work() {
            self.begin_step(g);
        } else if sched.pending_len() > 0 {
            self.decode.groups[g].next_step = Some(now + IDLE_STEP);
        }
    }

    pub(super) fn reported(&mut self, rank: RankId, request: RequestId, error: Option<String>) {
        let g = self.decode.group_of(rank);
        let result = match error {
            Some(error) => Err(format!("{rank}: {error}")),
            None => Ok(()),
        };
        let mut out = Vec::new();
        self.decode.groups[g].sched.handle_report(request, rank.tp_rank(), result, &mut out);
        self.sched_outputs(g, out);
    }
}
