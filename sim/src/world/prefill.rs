//! Prefill: batching on each DP group, and driving the core's prefill engines and workers.

use pdkv_core::ids::{EngineId, Incarnation, RankId};
use pdkv_core::prefill::{EngineAction, EngineEvent, PrefillDone, WorkerAction, WorkerEvent};
use pdkv_core::time::Instant;
use pdkv_core::topology::Layout;

use crate::cost::PrefillLoad;
use crate::measure::PrefillStep;
use crate::result::ViolationKind;
use crate::trace::{Link, Phase};

use super::{list, ms, ms_ns, Ev, World};
use pdkv_engine::pool::FREE;
use pdkv_engine::prefill::{PrefillNodes, PrefillOutput, PrefillScheduler};

/// The prefill side: each engine's node and workers, each DP group's scheduler, and what a
/// crash and a restart change of them.
pub(super) struct PrefillSide {
    /// Every prefill rank, in rank-index order (a rank's NIC is its index).
    pub(super) ranks: Vec<RankId>,
    /// Index of each engine's first group in `groups`.
    pub(super) group_base: Vec<usize>,
    pub(super) groups: Vec<PGroup>,
    /// The engines and workers (numbered as `ranks`), routed to each other.
    pub(super) nodes: PrefillNodes,
    /// The earliest engine timer an `EngineTick` is scheduled for, per engine.
    pub(super) engine_tick: Vec<Option<u64>>,
    /// Generation of each group, bumped by a crash so its in-flight batch is dropped.
    pub(super) generation: Vec<u64>,
    /// Engines that are down (crashed, not yet restarted).
    pub(super) down: Vec<bool>,
    /// Lives of each rank (bumped at every restart; it moves the memory regions).
    pub(super) epoch: Vec<u64>,
    /// The incarnations of each rank so far, the current one last (none for a rank following
    /// vLLM's rules).
    pub(super) incarnations: Vec<Vec<Incarnation>>,
}

pub(super) struct PGroup {
    pub(super) engine: usize,
    pub(super) dp: u16,
    pub(super) layout: Layout,
    /// The group's queue, chunked plan, pool and stall time (the engine layer's scheduler); the
    /// pool's owner numbers are the requests' transfer numbers.
    pub(super) sched: PrefillScheduler,
    /// A step (possibly an empty one that only keeps EP peers company) is in progress.
    pub(super) busy: bool,
    /// Prompt tokens of the step in progress, counted when it ends.
    pub(super) step_tokens: u64,
}

impl World {
    /// Starts the group's next step if it is idle: vLLM's chunked prefill, with a budget of
    /// `prefill_max_batched_tokens` prompt tokens a step. Requests already prefilling continue
    /// first, in admission order, each with as much of its prompt as the budget leaves; then
    /// queued requests are admitted while the budget lasts and their blocks fit (allocated for
    /// the whole prompt at admission; the queue never skips its head). A prompt longer than the
    /// budget is spread over several steps, and several short ones share one.
    ///
    /// Under EP every DP rank of the engine steps together, as their expert all-to-alls require:
    /// a step starts once every rank is idle, each rank batches its own requests, a rank with
    /// none runs an empty step, and the step lasts as long as the slowest rank.
    pub(super) fn try_prefill(&mut self, g: usize) {
        let layout = self.prefill.groups[g].layout;
        if !layout.ep {
            if self.prefill.groups[g].busy {
                return;
            }
            let (requests, load) = self.plan_prefill(g);
            if load.tokens > 0 {
                let duration = self.cost.prefill_batch_ns(layout, load);
                self.start_prefill(g, requests, load.tokens, duration);
            }
            return;
        }
        let first = g - usize::from(self.prefill.groups[g].dp);
        let groups = first..first + usize::from(layout.dp);
        if groups.clone().any(|i| self.prefill.groups[i].busy) {
            return;
        }
        let plans: Vec<(usize, PrefillLoad)> = groups.clone().map(|i| self.plan_prefill(i)).collect();
        let loads: Vec<PrefillLoad> = plans.iter().map(|&(_, load)| load).collect();
        if loads.iter().all(|l| l.tokens == 0) {
            return;
        }
        let duration = self.cost.prefill_ep_step_ns(layout, &loads);
        let spans_nodes = self.cost.ep_spans_nodes(layout);
        for (i, (requests, PrefillLoad { tokens: t, .. })) in groups.zip(plans) {
            if spans_nodes {
                // An all-to-all that leaves the node takes its share of each rank's NIC.
                let share = self.cost.ep_nic_share(layout, t as f64, duration);
                let nics = self.pgroup_nics(i);
                self.set_background(&nics, share);
            }
            self.start_prefill(i, requests, t, duration);
        }
    }

    /// The NICs of prefill group `g`'s GPUs (a prefill rank's NIC is its rank index).
    fn pgroup_nics(&self, g: usize) -> Vec<usize> {
        let group = &self.prefill.groups[g];
        let engine = EngineId::prefill(group.engine as u16);
        (0..group.layout.tp).map(|tp| self.d.rank_index(RankId::new(engine, group.dp, tp))).collect()
    }

    /// The NIC of decode worker `w` (after every prefill rank's).
    pub(super) fn decode_nic(&self, w: usize) -> usize {
        self.prefill.ranks.len() + w
    }

    /// Gives `share` of each of `nics` to traffic other than KV reads (0 gives it back).
    pub(super) fn set_background(&mut self, nics: &[usize], share: f64) {
        for &nic in nics {
            let finishes = self.net.nics.set_background(self.now, nic, share);
            self.schedule_flows(&[nic], finishes);
        }
    }

    /// Chooses the chunks of group `g`'s next step (see [`World::try_prefill`]): returns how
    /// many requests it computes and their load (prompt tokens and the attention work their
    /// chunks' positions imply), 0 tokens when it has nothing it can run (a stall, which the
    /// scheduler times, when requests wait for blocks).
    fn plan_prefill(&mut self, g: usize) -> (usize, PrefillLoad) {
        let budget = u64::from(self.sc.engines.prefill_max_batched_tokens);
        let plan = self.prefill.groups[g].sched.plan_step(self.now, budget);
        let chunks: Vec<(u64, u64)> =
            plan.chunks.iter().map(|c| (u64::from(c.context_tokens), u64::from(c.tokens))).collect();
        (plan.chunks.len(), PrefillLoad::of_chunks(&chunks))
    }

    /// Marks group `g` busy for a step of `duration` with `requests` requests of `tokens` prompt
    /// tokens in all (none for a rank that only keeps its EP peers company).
    fn start_prefill(&mut self, g: usize, requests: usize, tokens: u64, duration: u64) {
        let group = &mut self.prefill.groups[g];
        group.busy = true;
        group.step_tokens = tokens;
        let (engine, dp) = (group.engine, group.dp);
        if tokens > 0 {
            trace!(
                self,
                "prefill",
                "batch",
                format!("P{engine}.dp{dp}"),
                Some(duration),
                format!("requests={requests} tokens={tokens}"),
            );
        }
        let generation = self.prefill.generation[g];
        self.at(duration, Ev::PrefillDone { group: g, generation });
    }

    pub(super) fn on_prefill_done(&mut self, g: usize) {
        self.prefill.groups[g].busy = false;
        if self.cost.ep_spans_nodes(self.prefill.groups[g].layout) {
            let nics = self.pgroup_nics(g);
            self.set_background(&nics, 0.0);
        }
        let (e, dp) = (self.prefill.groups[g].engine, self.prefill.groups[g].dp);
        // Requests whose last chunk this step computed leave; the rest continue next step.
        let done = self.prefill.groups[g].sched.handle_step_done();
        let tokens = std::mem::take(&mut self.prefill.groups[g].step_tokens);
        if done.computed {
            self.stats.last_progress_ns = self.now;
            self.stats.prefill_steps.push(PrefillStep { end_ns: self.now, tokens });
        }
        let finished = done.finished.into_iter().map(|p| (p.request, p.blocks));
        for (id, blocks) in finished {
            if self.trace_on {
                // Its KV is ready: the flow to its first read starts inside this step, which
                // began `step_ns` ago and ends now.
                let track = format!("P{e}.dp{dp}");
                let link = Some(Link::FlowStart { request: id.0 });
                let detail = format!("request={id}");
                self.record_linked(
                    self.now.saturating_sub(1),
                    "prefill",
                    "kv_ready",
                    track,
                    None,
                    detail,
                    link,
                );
                self.trace_life(id, "prefill_done", Phase::Instant, format!("prefill=P{e}.dp{dp}"));
            }
            let req = self.clients.requests.get_mut(&id).expect("batched requests exist");
            req.prefill_blocks = blocks.clone();
            let (decode_engine, decode_dp) = {
                let group = &self.decode.groups[req.decode_group];
                (group.engine, req.decode_group - self.decode.group_base[group.engine])
            };
            let decode = self.d.decode[decode_engine];
            let event = EngineEvent::PrefillDone(PrefillDone {
                request: id,
                transfer_id: self
                    .clients
                    .transfers
                    .id(req.transfer)
                    .expect("a request's transfer is numbered"),
                owner_dp: dp,
                blocks: blocks.clone(),
                decode,
                // The reader's engine decides the quorum under its rules (a decode engine crashes
                // whole in the simulator, so no lone reader is ever reported lost).
                reader: Some((EngineId::decode(decode_engine as u16), decode_dp as u16)),
                holders: None,
            });
            let transfer = req.transfer;
            let mut out = Vec::new();
            match self.prefill.nodes.handle_engine(Instant(self.now), e, event, &mut out) {
                Ok(()) => {
                    // The answer names the incarnations the engine registered the transfer on,
                    // whatever happens to them before it is sent.
                    let transfer_id =
                        self.clients.transfers.id(transfer).expect("a request's transfer is numbered");
                    let holders = self.prefill.nodes.engine(e).holder_incarnations(&transfer_id);
                    if let Some(req) = self.clients.requests.get_mut(&id) {
                        req.holders = holders.map(Vec::into_boxed_slice);
                    }
                    self.prefill_outputs(out);
                    let latency = self.control_ns();
                    self.at(latency, Ev::ProxyAnswer { req: id });
                }
                Err(error) => {
                    // A refused prefill is this request's failure, not a protocol error; the
                    // engine took no action for it.
                    debug_assert!(
                        out.iter().all(|o| matches!(
                            o,
                            PrefillOutput::Refused { .. } | PrefillOutput::EngineHandled { .. }
                        )),
                        "{out:?}"
                    );
                    // The blocks were handed out to this request a moment ago, so this free
                    // cannot be a double free.
                    let _ = self.prefill.groups[g].sched.handle_free(transfer, &blocks);
                    trace!(
                        self,
                        "prefill",
                        "refused",
                        format!("P{e}.dp{dp}"),
                        None,
                        format!("{id}: {error}")
                    );
                    self.end_request(id, true);
                }
            }
        }
        self.engine_timer(e, self.prefill.nodes.engine(e).poll_timeout());
        self.try_prefill(g);
    }

    pub(super) fn engine(&mut self, e: usize, event: EngineEvent) {
        let mut out = Vec::new();
        let _ = self.prefill.nodes.handle_engine(Instant(self.now), e, event, &mut out);
        self.prefill_outputs(out);
    }

    /// Arms engine `e`'s tick for `timeout` (its timer at the end of an input), unless one is
    /// due no later.
    fn engine_timer(&mut self, e: usize, timeout: Option<Instant>) {
        if let Some(Instant(t)) = timeout {
            if self.prefill.engine_tick[e].is_none_or(|s| t < s) {
                self.prefill.engine_tick[e] = Some(t);
                let delay = t.saturating_sub(self.now);
                self.at(delay, Ev::EngineTick { engine: e });
            }
        }
    }

    /// Carries out what the prefill nodes asked, in order.
    fn prefill_outputs(&mut self, out: Vec<PrefillOutput>) {
        for output in out {
            match output {
                PrefillOutput::Worker { worker, action } => self.worker_action(worker, action),
                PrefillOutput::Engine { engine, action } => self.engine_action(engine, action),
                PrefillOutput::Refused { engine, error } => {
                    self.violation(
                        ViolationKind::ProtocolError,
                        vec![format!("P{engine}")],
                        error.to_string(),
                    );
                }
                PrefillOutput::EngineHandled { engine, timeout } => self.engine_timer(engine, timeout),
            }
        }
    }

    pub(super) fn pworker_index(&self, rank: RankId) -> usize {
        self.d.rank_index(rank)
    }

    /// Carries out one action of engine `e` (the nodes delivered its words for workers, and
    /// registrations too unless they are delayed).
    fn engine_action(&mut self, e: usize, action: EngineAction) {
        match action {
            EngineAction::Register { rank, transfer_id, quorum, incarnation } => {
                let delay = ms_ns(self.sc.engines.prefill_register_delay_ms);
                if delay >= self.sc.timeouts().defer_ns() {
                    // A registration that reaches the worker after the reaper's delay comes
                    // late for the ledger, like a release delayed that long: the reaper may
                    // free the transfer first, which is the design's recovery, and the reads
                    // it fences fail because of the delay.
                    if let Some(t) = self.clients.transfers.number(&transfer_id) {
                        self.checks.excused.insert(t);
                    }
                    self.touch(rank, self.now, self.now.saturating_add(delay));
                }
                // Without a delay the nodes delivered it (they hold registrations only when
                // the scenario delays them).
                if delay > 0 {
                    let event = WorkerEvent::Register { transfer_id, quorum, incarnation };
                    self.at(delay, Ev::ToPrefill { rank, event: Box::new(event) });
                }
            }
            EngineAction::GroupDone { .. } | EngineAction::Retire { .. } => {}
            EngineAction::FinishedSending { request, .. } => {
                trace!(self, "prefill", "finished_sending", format!("P{e}"), None, format!("{request}"));
            }
            EngineAction::Fence { transfer_id, .. } => {
                if let Some(t) = self.clients.transfers.number(&transfer_id) {
                    self.checks.fenced.insert(t);
                }
            }
            EngineAction::FreeBlocks { transfer_id, owner_dp, blocks, reaped } => {
                let g = self.prefill.group_base[e] + usize::from(owner_dp);
                let t = self.clients.transfers.number(&transfer_id).unwrap_or(FREE - 1);
                if let Err(bad) = self.prefill.groups[g].sched.handle_free(t, &blocks) {
                    let detail = format!("{transfer_id}: blocks {} were not held by it", list(&bad.blocks));
                    self.violation(ViolationKind::DoubleFree, vec![format!("P{e}.dp{owner_dp}")], detail);
                }
                let name = if reaped { "reap" } else { "free" };
                trace!(
                    self,
                    "prefill",
                    name,
                    format!("P{e}.dp{owner_dp}"),
                    None,
                    format!("{transfer_id} blocks={}{}", blocks.len(), self.request_words(&transfer_id)),
                );
                self.try_prefill(g);
            }
            EngineAction::ReapWarning { transfer_id, held_ns, unfinished_tp } => {
                self.stats.max_hold_ns = self.stats.max_hold_ns.max(held_ns);
                if self
                    .clients
                    .transfers
                    .number(&transfer_id)
                    .is_some_and(|t| self.checks.excused.contains(&t))
                {
                    self.stats.reaped_excused += 1;
                }
                let detail = format!(
                    "{transfer_id} held {} ms; unreleased TP ranks {}",
                    ms(held_ns),
                    list(&unfinished_tp)
                );
                trace!(self, "prefill", "reap_warning", format!("P{e}"), None, detail);
            }
        }
    }

    pub(super) fn prefill_worker(&mut self, rank: RankId, event: WorkerEvent) {
        let i = self.pworker_index(rank);
        let mut out = Vec::new();
        self.prefill.nodes.handle_worker(Instant(self.now), i, event, &mut out);
        self.prefill_outputs(out);
    }

    /// Carries out one action of prefill worker `i` (the nodes routed its finished parts and
    /// leases to its engine).
    fn worker_action(&mut self, i: usize, action: WorkerAction) {
        match action {
            WorkerAction::Finished { .. } | WorkerAction::Leased { .. } => {}
            WorkerAction::Ignored { transfer_id, outcome } => {
                let rank = self.prefill.ranks[i].to_string();
                let why = release_outcome_words(&outcome);
                let request = self.request_words(&transfer_id);
                trace!(self, "release", "ignored", rank, None, format!("{transfer_id}: {why}{request}"));
            }
            WorkerAction::Refused { transfer_id, message, verdict } => {
                // The simulator has no forger yet, so a refusal means its own ranks
                // disagree on the key: a protocol error.
                self.violation(
                    ViolationKind::ProtocolError,
                    vec![self.prefill.ranks[i].to_string()],
                    format!("{transfer_id}: {message:?} refused ({verdict:?})"),
                );
            }
            WorkerAction::LeaseCapped { transfer_id, asked_ms, granted_ms } => {
                let rank = self.prefill.ranks[i].to_string();
                let request = self.request_words(&transfer_id);
                let detail =
                    format!("{transfer_id}: lease of {asked_ms} ms taken for {granted_ms} ms{request}");
                trace!(self, "release", "lease_capped", rank, None, detail);
            }
            WorkerAction::Error { rank, error } => {
                self.violation(
                    ViolationKind::ProtocolError,
                    vec![self.prefill.ranks[i].to_string()],
                    format!("{rank}: {error}"),
                );
            }
            WorkerAction::SendHandshakeReply { .. } => {
                // Replies are sent by the listener that carried the request (on_serve).
            }
        }
    }
}

/// What the release ledger did, in words, for the trace.
fn release_outcome_words(outcome: &pdkv_core::release::ReleaseOutcome) -> String {
    use pdkv_core::release::ReleaseOutcome as O;
    match outcome {
        O::Counted { have, need } => format!("counted ({have} of {need})"),
        O::Completed => "completed".into(),
        O::DuplicateSender => "duplicate sender".into(),
        O::Deduplicated => "deduplicated (legacy)".into(),
        O::AfterCompletion => "after completion".into(),
        O::Stale => "stale (transfer retired)".into(),
        O::Buffered => "buffered (early)".into(),
        O::Dropped => "dropped (legacy)".into(),
        O::RegisteredLate => "registered after its retirement (late registration ignored)".into(),
        O::RetiredBeforeRegistration => "retired before its registration arrived".into(),
        O::OtherIncarnation => "names another incarnation of the rank".into(),
    }
}

#[cfg(test)]
mod tests {
    use crate::scenario::{Clients, Length, Scenario};
    use crate::trace::TraceMemory;
    use crate::world::RunOptions;

    /// The prefill batches of `deployment`'s engine P0 as (start, end, rank).
    fn batches(deployment: &str) -> Vec<(u64, u64, String)> {
        let mut sc = Scenario::from_notation(deployment);
        sc.workload.clients = Clients::Closed { concurrency: 12, requests: 24 };
        sc.workload.input_tokens = Length::Uniform { min: 1024, max: 40_000 };
        sc.workload.output_tokens = Length::Fixed(8);
        let trace = TraceMemory::default();
        let run =
            crate::run(&sc, RunOptions { trace: Some(Box::new(trace.clone())), ..RunOptions::default() })
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(run.result.requests.finished, 24, "{deployment}");
        trace
            .records()
            .iter()
            .filter(|r| r.cat == "prefill" && r.name == "batch" && r.track.starts_with("P0."))
            .map(|r| (r.t_ns, r.t_ns + r.dur_ns.unwrap_or(0), r.track.clone()))
            .collect()
    }

    /// A registration that reaches the workers after its transfer's reaper deadline (MoRIIO
    /// registers with the next step's metadata, so an idle prefill engine can be that late): the
    /// reaper frees the blocks once, the workers take the retirement first and ignore the late
    /// registration, and the reaping is excused by the delay. Before, every rank reported
    /// "transfer … is not registered", a safety violation, with no fault at all.
    /// (registration delay, defer and transfer timeouts in ms) -> (outcome, freed, reaped).
    #[test]
    fn a_registration_later_than_the_reaper_is_no_violation() {
        use crate::scenario::Outcome;
        let check = |delay_ms: u64, timeouts_ms: Option<u64>, expected: (Outcome, u64, u64)| {
            let mut sc = Scenario::from_notation("1P_TP2:1D_TP2");
            sc.hardware.kv_memory_fraction = 0.5;
            sc.workload.clients = Clients::Closed { concurrency: 1, requests: 1 };
            sc.workload.input_tokens = Length::Fixed(1024);
            sc.workload.output_tokens = Length::Fixed(16);
            sc.engines.prefill_register_delay_ms = delay_ms;
            if let Some(ms) = timeouts_ms {
                sc.protocol.defer_timeout_ms = ms;
                sc.protocol.transfer_timeout_ms = ms;
            }
            let r = crate::run(&sc, RunOptions::default()).unwrap_or_else(|e| panic!("{e}")).result;
            assert!(r.violations.is_empty(), "{delay_ms} {timeouts_ms:?}: {:?}", r.violations);
            assert_eq!((r.outcome, r.ledger.freed, r.ledger.reaped), expected, "{delay_ms} {timeouts_ms:?}");
        };
        check(3000, Some(1000), (Outcome::Clean, 0, 1));
        check(70_000, None, (Outcome::Clean, 0, 1));
        // In time: freed by the releases.
        check(500, Some(1000), (Outcome::Clean, 1, 0));
    }

    #[test]
    fn dp_ep_prefill_ranks_step_together() {
        // Under EP a rank never starts while another rank of its engine is mid-step: every
        // batch of one step starts and ends at the same instants.
        let ep = batches("1P_DP8EP:1D_TP8");
        assert!(ep.len() > 8, "{ep:?}");
        for a in &ep {
            for b in &ep {
                let overlap = a.0 < b.1 && b.0 < a.1;
                assert!(!overlap || (a.0 == b.0 && a.1 == b.1), "{a:?} overlaps {b:?}");
            }
        }
        // Without EP, DP ranks step on their own: some batches overlap without being aligned.
        let dp = batches("1P_DP2TP8:1D_TP8");
        let free = dp.iter().any(|a| dp.iter().any(|b| a.0 < b.1 && b.0 < a.1 && a.0 != b.0));
        assert!(free, "{dp:?}");
    }
}
