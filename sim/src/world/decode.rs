//! Decode: units stepping their groups together, and carrying out what the decode nodes (the
//! engine layer's workers and group schedulers, routed to each other) ask of the world.

use pdkv_core::decode::{DecodeAction, DecodeEvent, ReadOp, RecvError};
use pdkv_core::group::GroupAction;
use pdkv_core::ids::{RankId, TpRank};
use pdkv_core::time::Instant;
use pdkv_core::wire::{self, ControlMessage};

use pdkv_engine::decode::{DecodeNodes, NodeOutput, SchedulerOutput};

use crate::cost::GroupLoad;
use crate::measure::DecodeStep;
use crate::result::ViolationKind;

use super::{list, ms, Ev, Msg, World, IDLE_STEP_NS};

/// The decode side: the nodes (workers and each group's scheduler, numbered alike here), and
/// what the simulator adds: units stepping groups together, and crashes.
pub(super) struct DecodeSide {
    /// Every decode rank, in worker order (a rank's NIC follows every prefill rank's).
    pub(super) ranks: Vec<RankId>,
    /// Index of each engine's first group in `groups`.
    pub(super) group_base: Vec<usize>,
    pub(super) groups: Vec<DGroup>,
    pub(super) units: Vec<Unit>,
    /// The workers and the groups' schedulers (admission, the request barrier, the batch, the
    /// pool and the group's barrier), routed to each other.
    pub(super) nodes: DecodeNodes,
    /// The earliest worker timer a `DecodeTick` is scheduled for, per worker.
    pub(super) worker_tick: Vec<Option<u64>>,
    /// Engines that are down (crashed, not yet restarted).
    pub(super) down: Vec<bool>,
    /// Spare output buffers for `decode_worker` (reused, never shrunk): every decode step hands
    /// every worker an event, and a fresh vector per event was a measurable share of the
    /// simulator's time.
    pub(super) spare: Vec<Vec<NodeOutput>>,
}

/// The vote results of one barrier decision, one per member: `(member, step, ok)`. A TP1
/// group's lone result is kept inline: every step of every group has one, and a vector each
/// was an allocation per group and step.
#[derive(Debug, Default)]
pub(super) enum Votes {
    #[default]
    None,
    One((TpRank, u64, bool)),
    Many(Vec<(TpRank, u64, bool)>),
}

impl Votes {
    fn push(&mut self, result: (TpRank, u64, bool)) {
        *self = match std::mem::take(self) {
            Votes::None => Votes::One(result),
            Votes::One(first) => Votes::Many(vec![first, result]),
            Votes::Many(mut all) => {
                all.push(result);
                Votes::Many(all)
            }
        };
    }

    fn is_empty(&self) -> bool {
        matches!(self, Votes::None)
    }

    /// The results in the order they were decided.
    pub(super) fn into_results(self) -> impl Iterator<Item = (TpRank, u64, bool)> {
        let (one, all) = match self {
            Votes::None => (None, Vec::new()),
            Votes::One(first) => (Some(first), Vec::new()),
            Votes::Many(all) => (None, all),
        };
        one.into_iter().chain(all)
    }
}

/// A decode DP group's place in the simulator: its engine and unit (its workers and scheduler
/// are the nodes').
pub(super) struct DGroup {
    pub(super) engine: usize,
    pub(super) unit: usize,
}

#[derive(PartialEq, Eq)]
pub(super) enum UnitState {
    Idle,
    /// A step began at `began`; its groups' barriers say who entered the forward.
    Waiting {
        began: u64,
    },
    Computing,
}

pub(super) struct Unit {
    pub(super) engine: usize,
    /// When the last step ended (for inter-token latency).
    pub(super) last_step_end: Option<u64>,
    /// Whether a collective-timeout event is pending for this unit.
    pub(super) watchdog: bool,
    pub(super) groups: Vec<usize>,
    pub(super) step: u64,
    pub(super) state: UnitState,
    wake_scheduled: bool,
}

impl Unit {
    /// An idle unit of decode engine `engine` with no groups yet.
    pub(super) fn new(engine: usize) -> Unit {
        Unit {
            engine,
            last_step_end: None,
            watchdog: false,
            groups: Vec::new(),
            step: 0,
            state: UnitState::Idle,
            wake_scheduled: false,
        }
    }
}

impl World {
    pub(super) fn wake(&mut self, unit: usize) {
        if self.decode.down[self.decode.units[unit].engine] {
            return;
        }
        let u = &mut self.decode.units[unit];
        if u.state == UnitState::Idle && !u.wake_scheduled {
            u.wake_scheduled = true;
            self.at(0, Ev::StepBegin { unit });
        }
    }

    pub(super) fn on_step_begin(&mut self, unit: usize) {
        self.decode.units[unit].wake_scheduled = false;
        if self.decode.units[unit].state != UnitState::Idle
            || self.decode.down[self.decode.units[unit].engine]
        {
            return;
        }
        self.decode.units[unit].step += 1;
        let step = self.decode.units[unit].step;
        self.decode.units[unit].state = UnitState::Waiting { began: self.now };
        let mut out = Vec::new();
        for gi in 0..self.decode.units[unit].groups.len() {
            let g = self.decode.units[unit].groups[gi];
            self.decode.nodes.handle_step_begin(Instant(self.now), g, step, &mut out);
            self.node_outputs(&mut out);
        }
        if !self.decode.units[unit].watchdog {
            self.decode.units[unit].watchdog = true;
            let timeout = self.sc.timeouts().collective_ns();
            self.at(timeout, Ev::CollectiveTimeout { unit, step });
        }
        self.maybe_compute(unit);
    }

    /// Feeds decode group `g`'s barrier and carries out what it decides (the world's own inputs
    /// reach the barrier through the nodes; tests feed it directly).
    #[cfg(test)]
    fn group_event(&mut self, g: usize, event: pdkv_core::group::GroupEvent) {
        let mut out = Vec::new();
        self.decode.nodes.handle_group_event(Instant(self.now), g, event, &mut out);
        self.node_outputs(&mut out);
    }

    /// Carries out what the decode nodes asked, in order: a worker's actions (its reads posted
    /// together, request by request; its messages sent; its timer armed once it handled an
    /// event); the vote results of one barrier decision one control latency later, together; a
    /// group whose members all entered the forward may let its unit compute; a request every
    /// rank received joins at the next step, one a rank failed ends.
    fn node_outputs(&mut self, out: &mut Vec<NodeOutput>) {
        let mut reads: Vec<ReadOp> = Vec::new();
        let mut reader = 0;
        let mut results = Votes::default();
        let mut voted = 0;
        for output in out.drain(..) {
            let posts = match &output {
                NodeOutput::Action { worker, action: DecodeAction::PostRead(op) } => {
                    Some((*worker, op.request()))
                }
                _ => None,
            };
            if !reads.is_empty() && posts.is_none_or(|(w, r)| w != reader || reads[0].request() != r) {
                self.post_reads(reader, std::mem::take(&mut reads));
            }
            let votes = matches!(&output, NodeOutput::Group { group, output: SchedulerOutput::Group(_) } if *group == voted);
            if !votes {
                self.vote_results(voted, std::mem::take(&mut results));
            }
            match output {
                NodeOutput::Action { worker, action } => {
                    if let DecodeAction::PostRead(op) = action {
                        reader = worker;
                        reads.push(op);
                    } else {
                        self.decode_action(worker, action);
                    }
                }
                NodeOutput::Handled { worker, timeout } => self.arm_decode_timer(worker, timeout),
                NodeOutput::Group { group, output } => {
                    voted = group;
                    self.group_output(group, output, &mut results);
                }
            }
        }
        if !reads.is_empty() {
            self.post_reads(reader, reads);
        }
        self.vote_results(voted, results);
    }

    /// Carries out one decision of group `g`'s scheduler (vote results gather in `results`).
    fn group_output(&mut self, g: usize, output: SchedulerOutput<RecvError>, results: &mut Votes) {
        match output {
            SchedulerOutput::ToMember { .. } => {
                unreachable!("the nodes deliver a group's inputs for its members")
            }
            SchedulerOutput::Group(GroupAction::VoteResult { member, step, ok }) => {
                results.push((member, step, ok))
            }
            SchedulerOutput::Group(GroupAction::Forward { .. }) => {
                self.maybe_compute(self.decode.groups[g].unit)
            }
            SchedulerOutput::Group(GroupAction::Ignored(why)) => {
                let engine = self.decode.groups[g].engine;
                self.violation(
                    ViolationKind::ProtocolError,
                    vec![format!("D{engine}")],
                    format!("group {g}: {why}"),
                );
            }
            SchedulerOutput::Joined(_) => self.wake(self.decode.groups[g].unit),
            SchedulerOutput::Preempted(request) => {
                self.stats.preemptions += 1;
                if self.trace_on {
                    let name = format!("D{}.u{}", self.decode.groups[g].engine, self.decode.groups[g].unit);
                    trace!(self, "decode", "preempt", name, None, format!("request={request}"));
                }
            }
            // The recompute is charged when the step computes (`maybe_compute`).
            SchedulerOutput::Resumed { .. } => {}
            SchedulerOutput::Failed { request, .. } => self.end_request(request, true),
            SchedulerOutput::DoubleFree { blocks, .. } => {
                let engine = self.decode.groups[g].engine;
                self.violation(
                    ViolationKind::DoubleFree,
                    vec![format!("D{engine}")],
                    format!("decode blocks {} freed twice", list(&blocks)),
                );
            }
        }
    }

    /// The vote results of one barrier decision reach the members one control latency later.
    fn vote_results(&mut self, g: usize, results: Votes) {
        if !results.is_empty() {
            let latency = self.control_ns();
            self.at(latency, Ev::VoteResults { group: g, results });
        }
    }

    /// Computes the unit's step once every member of each of its groups entered the forward.
    fn maybe_compute(&mut self, unit: usize) {
        let UnitState::Waiting { began } = self.decode.units[unit].state else { return };
        let step = self.decode.units[unit].step;
        if !self.decode.units[unit]
            .groups
            .iter()
            .all(|&g| self.decode.nodes.sched(g).barrier().forward_ready(step))
        {
            return;
        }
        let layout = self.d.decode[self.decode.units[unit].engine];
        let loads: Vec<GroupLoad> = self.decode.units[unit]
            .groups
            .iter()
            .map(|&g| GroupLoad {
                batch: self.decode.nodes.sched(g).batch_len() as u64,
                context_tokens: self.decode.nodes.sched(g).context_tokens(),
            })
            .collect();
        let recompute: Vec<u64> = self.decode.units[unit]
            .groups
            .iter()
            .map(|&g| self.decode.nodes.sched(g).recompute_tokens())
            .collect();
        let duration = self.cost.decode_step_ns(layout, &loads) + self.cost.recompute_ns(layout, &recompute);
        self.decode.units[unit].state = UnitState::Computing;
        // An all-to-all that leaves the node takes its share of each rank's NIC for the step.
        if self.cost.ep_spans_nodes(layout) {
            for (gi, load) in loads.iter().enumerate() {
                let share = self.cost.ep_nic_share(layout, load.batch as f64, duration);
                let g = self.decode.units[unit].groups[gi];
                let nics: Vec<usize> =
                    self.decode.nodes.members(g).iter().map(|&w| self.decode_nic(w)).collect();
                self.set_background(&nics, share);
            }
        }
        if self.trace_on {
            let batch: u64 = loads.iter().map(|l| l.batch).sum();
            let waited = self.now - began;
            let name = format!("D{}.u{unit}", self.decode.units[unit].engine);
            trace!(
                self,
                "decode",
                "step",
                name,
                Some(duration),
                format!("step={step} batch={batch} waited_ms={}", ms(waited)),
            );
        }
        self.at(duration, Ev::StepEnd { unit, step });
    }

    pub(super) fn on_step_end(&mut self, unit: usize, step: u64) {
        if self.decode.units[unit].step != step || self.decode.units[unit].state != UnitState::Computing {
            return;
        }
        if self.cost.ep_spans_nodes(self.d.decode[self.decode.units[unit].engine]) {
            let nics: Vec<usize> = self.decode.units[unit]
                .groups
                .iter()
                .flat_map(|&g| self.decode.nodes.members(g).iter().map(|&w| self.decode_nic(w)))
                .collect();
            self.set_background(&nics, 0.0);
        }
        let now = self.now;
        let mut out = Vec::new();
        let mut ended = Vec::new();
        let (mut continuing, mut first) = (0u64, 0u64);
        for gi in 0..self.decode.units[unit].groups.len() {
            let g = self.decode.units[unit].groups[gi];
            if self.decode.nodes.sched(g).batch_len() > 0 {
                self.stats.last_progress_ns = now;
            }
            let forwarded = self.decode.nodes.handle_forward(Instant(now), g, &mut out);
            first += forwarded.first.len() as u64;
            for id in forwarded.first {
                if let Some(r) = self.clients.requests.get_mut(&id) {
                    r.first_token_ns = Some(now);
                }
                if self.trace_on {
                    self.trace_life(
                        id,
                        "first_token",
                        crate::trace::Phase::Instant,
                        format!("unit=D{}.u{unit}", self.decode.units[unit].engine),
                    );
                }
            }
            continuing += forwarded.continuing;
            ended.push((std::mem::take(&mut out), forwarded.finished));
        }
        // Inter-token latency: every request that already had a token waited one step gap (a
        // unit's first step has none: no request had a token before it).
        let last = self.decode.units[unit].last_step_end.replace(now);
        let (gap_ns, later_tokens) = last.map_or((0, 0), |last| (now - last, continuing));
        if continuing + first > 0 {
            let count = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
            self.stats.decode_steps.push(DecodeStep {
                end_ns: now,
                gap_ns,
                later_tokens: count(later_tokens),
                tokens: count(continuing + first),
            });
        }
        for (mut out, finished) in ended {
            self.node_outputs(&mut out);
            for id in finished {
                self.end_request(id, false);
            }
        }
        self.decode.units[unit].state = UnitState::Idle;
        if self.unit_has_work(unit) {
            self.wake(unit);
        } else if self.unit_has_pending(unit) {
            self.decode.units[unit].wake_scheduled = true;
            self.at(IDLE_STEP_NS, Ev::StepBegin { unit });
        }
    }

    fn unit_has_work(&self, unit: usize) -> bool {
        self.decode.units[unit].groups.iter().any(|&g| self.decode.nodes.sched(g).has_work())
    }

    fn unit_has_pending(&self, unit: usize) -> bool {
        self.decode.units[unit].groups.iter().any(|&g| {
            self.decode.nodes.members(g).iter().any(|&w| self.decode.nodes.worker(w).pending_requests() > 0)
        })
    }

    /// Decode worker `w` handles `event`, and the world carries out what follows.
    pub(super) fn decode_worker(&mut self, w: usize, event: DecodeEvent) {
        let mut out = self.decode.spare.pop().unwrap_or_default();
        self.decode.nodes.handle_worker(Instant(self.now), w, event, &mut out);
        self.node_outputs(&mut out);
        self.decode.spare.push(out);
    }

    /// Arms worker `w`'s timer at `timeout` (its timer right after an event), unless a tick is
    /// already due no later.
    fn arm_decode_timer(&mut self, w: usize, timeout: Option<Instant>) {
        if let Some(Instant(t)) = timeout {
            if self.decode.worker_tick[w].is_none_or(|s| t < s || s < self.now) {
                self.decode.worker_tick[w] = Some(t);
                let delay = t.saturating_sub(self.now);
                self.at(delay, Ev::DecodeTick { worker: w });
            }
        }
    }

    /// Carries out one action of decode worker `w` other than a read (reads go together, in
    /// `node_outputs`); its votes, step reports and request reports were routed by the nodes.
    fn decode_action(&mut self, w: usize, action: DecodeAction) {
        match action {
            DecodeAction::PostRead(_) => unreachable!("reads are posted together"),
            DecodeAction::DialHandshake { session, rank, endpoint } => {
                trace!(
                    self,
                    "handshake",
                    "dial",
                    self.decode.ranks[w].to_string(),
                    None,
                    format!("{rank} at {endpoint}"),
                );
                self.send(w, rank, (endpoint.host, endpoint.port), Msg::Dial { from: w, session });
            }
            DecodeAction::SendLease { rank, endpoint, lease } => {
                let transfer = self.clients.transfers.number(&lease.transfer_id);
                let bytes = wire::encode(&ControlMessage::ReadLease(*lease));
                self.send(w, rank, (endpoint.host, endpoint.port), Msg::Notify { bytes, transfer });
            }
            DecodeAction::SendRelease { rank, endpoint, release } => {
                let transfer = self.clients.transfers.number(&release.transfer_id);
                let bytes = wire::encode(&ControlMessage::Release(*release));
                self.send(w, rank, (endpoint.host, endpoint.port), Msg::Notify { bytes, transfer });
            }
            DecodeAction::StepFailed { error, .. } => {
                trace!(
                    self,
                    "decode",
                    "step_failed",
                    self.decode.ranks[w].to_string(),
                    None,
                    error.to_string()
                );
            }
            DecodeAction::CastVote { .. }
            | DecodeAction::StepReady { .. }
            | DecodeAction::RequestReceived { .. } => {}
            DecodeAction::RequestFailed { request, error } => {
                trace!(
                    self,
                    "decode",
                    "request_failed",
                    self.decode.ranks[w].to_string(),
                    None,
                    format!("{request}: {error}"),
                );
                if matches!(error, RecvError::Timeout { .. }) {
                    if let Some(req) = self.clients.requests.get_mut(&request) {
                        req.timed_out = true;
                    }
                }
            }
            DecodeAction::InvalidateBlocks { .. } => {}
            DecodeAction::AbortReads { request } => self.abort_reads(w, request),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;
    use crate::world::RunOptions;
    use pdkv_core::group::GroupEvent;

    /// The queue's events stay small (the heap moves them at every push and pop): a group's
    /// vote results in one with no allocation for a TP1 group's one result.
    #[test]
    fn events_stay_small() {
        assert!(size_of::<Ev>() <= 40, "{}", size_of::<Ev>());
        let mut votes = Votes::default();
        assert!(votes.is_empty());
        votes.push((TpRank(0), 3, true));
        assert!(matches!(votes, Votes::One(_)));
        votes.push((TpRank(1), 3, false));
        votes.push((TpRank(2), 3, true));
        let all: Vec<_> = votes.into_results().collect();
        assert_eq!(all, [(TpRank(0), 3, true), (TpRank(1), 3, false), (TpRank(2), 3, true)]);
    }

    /// A worker's vote counts once however often it arrives: a repeated ballot from one worker
    /// of a TP2 group must not stand in for its peer's (it did when ballots were counted by
    /// length, deciding the MIN before the peer had finished its handshakes).
    #[test]
    fn a_repeated_vote_counts_once() {
        let mut sc = Scenario::from_notation("1P_TP1:1D_TP2");
        // Engines far too small for DeepSeek-R1's weights: a fixed KV share.
        sc.hardware.kv_memory_fraction = 0.5;
        let mut world = World::new(&sc, RunOptions::default()).unwrap();
        let results =
            |world: &World| world.queue.iter().filter(|s| matches!(s.0.ev, Ev::VoteResults { .. })).count();
        let vote = |member| GroupEvent::Vote { member: TpRank(member), step: 1, ok: true };
        world.group_event(0, GroupEvent::StepBegin { step: 1 });
        world.group_event(0, vote(0));
        world.group_event(0, vote(0));
        assert_eq!(results(&world), 0, "one worker of two voted, twice");
        world.group_event(0, vote(1));
        assert_eq!(results(&world), 1, "both voted");
        // The group reports the repeated vote instead of counting it.
        let kinds: Vec<&str> = world.checks.violations.iter().map(|v| v.kind.name()).collect();
        assert_eq!(kinds, ["protocol_error"]);
        assert!(
            world.checks.violations[0].detail.contains("voted on step 1 already"),
            "{:?}",
            world.checks.violations
        );
    }

    /// A decode engine whose EP group spans two nodes sends part of every all-to-all over its
    /// ranks' NICs, and the KV reads landing on those NICs share what is left; the same engine
    /// inside one (16-GPU) node reads faster. With the contention switched off the two are equal.
    #[test]
    fn an_all_to_all_across_nodes_slows_the_reads_on_its_nics() {
        let read_ms = |gpus_per_node: u16| {
            let mut sc = Scenario::from_notation("2P_TP8:1D_DP16EP");
            sc.hardware.gpus_per_node = gpus_per_node;
            // Short prompts keep prefill ahead, so the decode batch (and its all-to-all) is large.
            sc.workload.clients = crate::scenario::Clients::Closed { concurrency: 2048, requests: 4096 };
            sc.workload.input_tokens = crate::scenario::Length::Fixed(1024);
            sc.workload.output_tokens = crate::scenario::Length::Fixed(128);
            let r = crate::run(&sc, RunOptions::default()).unwrap_or_else(|e| panic!("{e}")).result;
            assert_eq!(r.requests.finished, 4096);
            r.latency_ms.kv_read.map_or(0.0, |s| s.mean)
        };
        let (two_nodes, one_node) = (read_ms(8), read_ms(16));
        // 3.22 ms against 3.15: at 128 requests a rank the all-to-all takes about a fifth of
        // each NIC's time, and a read of a 1K prompt is mostly per-message cost.
        assert!(two_nodes > one_node * 1.01, "two nodes {two_nodes} ms, one node {one_node} ms");
    }
}
