//! Bounded model checking of the protocol nodes: every interleaving of message deliveries,
//! read completions, message losses and read failures (from a budget) and timer firings, for a
//! tiny deployment and two requests, breadth first with state hashing, so a violation comes with
//! the shortest trace to it.
//!
//! The world here is abstract: no NICs or compute times, only the nodes of one decode DP group
//! (its TP workers), the prefill owner group and its engine, the messages between them and the
//! reads in flight. A timer may fire at any point, also while messages and reads are in flight
//! (a message still in flight then arrives late, which excuses a reaped transfer as a loss
//! does). A read that completes from blocks the engine has freed (and not fenced) is a safety
//! violation at once; every other state is checked when it has nothing left to do: the group's
//! step reached its forward (no worker raised alone or stayed blocked while its peers went on),
//! every request received or failed on every worker, every prefill transfer freed (by the reaper
//! only if a message was lost or late). The workers and the TP group's barrier (the core's
//! `DecodeGroup`, inside the group's scheduler) are the engine layer's [`DecodeNodes`], which
//! route votes and step reports to the barrier themselves: this checker only chooses which
//! message, read or timer comes next. Vote results come back as local completions, and a step
//! begins only when the barrier admits one. An input it ignores (a repeated or stale vote, a
//! report against its decision) is a violation at once.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::time::Instant as WallClock;

use pdkv_core::decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeWorker, ReadOutcome, RecvRequest};
use pdkv_core::group::{GroupAction, GroupEvent, StepReport};
use pdkv_core::ids::{EngineId, Incarnation, RankId, RequestId, Role, TransferId};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::params::{KvTransferParams, PrefillAnswer};
use pdkv_core::policy::Policy;
use pdkv_core::ports::{AddressBook, SessionKey};
use pdkv_core::prefill::{
    EngineAction, EngineEvent, PrefillDone, PrefillEngine, PrefillWorker, WorkerAction, WorkerEvent,
};
use pdkv_core::release::Release;
use pdkv_core::time::Instant;
use pdkv_core::topology::{Deployment, ModelSpec};
use pdkv_core::wire::{HandshakeMetadata, LayerMemoryDesc};
use pdkv_engine::decode::{
    DecodeNodes, DecodeScheduler, KvAllocation, NodeOutput, SchedulerLimits, SchedulerOutput,
};
use pdkv_engine::prefill::{PrefillNodes, PrefillOutput};

/// Most requests [`check`] takes: the state space grows about tenfold with each one.
pub const MAX_REQUESTS: u64 = 4;
/// Most messages lost in one execution.
pub const MAX_LOSSES: u32 = 3;
/// Most prefill restarts in one execution.
pub const MAX_RESTARTS: u32 = 2;
/// Most decode steps.
pub const MAX_STEPS: u64 = 8;
/// Most states explored: each is kept (its fingerprint) and, while queued, whole, so this bounds
/// the memory of a run to a few gigabytes.
pub const MAX_STATES: usize = 5_000_000;
/// Most ranks of the modelled prefill engine and of the modelled decode DP group.
pub const MAX_RANKS: usize = 8;

/// What to check.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Deployment notation; one prefill and one decode engine are modelled (their first DP group).
    pub deployment: String,
    /// Legacy options in force.
    pub legacy: LegacyOptions,
    /// Requests (owned by prefill DP ranks round-robin).
    pub requests: u64,
    /// Messages the network may lose in one execution.
    pub loss_budget: u32,
    /// Decode steps at most (a step begins once the group says the last one reached its
    /// forward).
    pub max_steps: u64,
    /// States to explore at most.
    pub max_states: usize,
    /// Crashes and restarts of a prefill rank at most in one execution: a restart may happen at
    /// any point, the rank coming back at once as a new incarnation with new memory (its reads
    /// in flight fail, messages in flight to it reach the new incarnation).
    pub restarts: u32,
    /// Partial-order reduction: explore only the first in-flight message in a canonical order
    /// (deliver or lose it) instead of every one. Sound here because deliveries commute: a
    /// prefill worker answers handshakes statelessly, release and lease counting does not depend
    /// on order (registration precedes them), and decode workers only meet at the vote, which
    /// waits for all of them. Timers still interleave at every quiet point and losses at every
    /// message.
    pub reduce: bool,
}

/// What the checker found.
#[derive(Clone, Debug)]
pub struct ModelReport {
    /// Distinct states visited.
    pub states: usize,
    /// Transitions taken.
    pub transitions: u64,
    /// Deepest execution explored.
    pub max_depth: usize,
    /// True if every reachable state was explored within the bounds.
    pub complete: bool,
    /// Wall time of the search, in seconds.
    pub seconds: f64,
    /// The first violation in breadth-first order, with the shortest trace to it.
    pub violation: Option<(String, Vec<String>)>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Msg {
    Dial {
        from: usize,
        session: SessionKey,
        to: usize,
    },
    /// A handshake reply, from the incarnation of rank `from` that answered the dial.
    Reply {
        to: usize,
        session: SessionKey,
        from: usize,
        incarnation: Incarnation,
    },
    Lease {
        to: usize,
        transfer: TransferId,
        lease_ms: u32,
        incarnation: Option<Incarnation>,
    },
    Release {
        to: usize,
        transfer: TransferId,
        sender_tp: u16,
        incarnation: Option<Incarnation>,
    },
    Vote {
        to: usize,
        step: u64,
        ok: bool,
    },
    /// A read posted by decode worker `to` from prefill rank `from`, in flight until delivered
    /// (it completes) or lost (it fails); it reads the memory of incarnation `memory` of the rank
    /// (the session's).
    Read {
        to: usize,
        request: RequestId,
        layer: Option<u16>,
        from: usize,
        transfer: TransferId,
        memory: Option<Incarnation>,
    },
    /// The answer to a read, delivered locally to the worker that posted it.
    ReadDone {
        to: usize,
        request: RequestId,
        layer: Option<u16>,
        answer: Answer,
    },
}

/// How a read ended, as the driver answers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Answer {
    Ok,
    Failed,
    Fenced,
    Aborted,
}

impl Answer {
    /// How a trace line names the answer.
    fn name(self) -> &'static str {
        match self {
            Answer::Ok => "ok",
            Answer::Failed => "failed",
            Answer::Fenced => "fenced (the blocks were freed)",
            Answer::Aborted => "aborted",
        }
    }
}

/// How a trace line names the layers of a read: one layer, or every layer at once.
fn layers(layer: Option<u16>) -> String {
    layer.map_or_else(|| "all layers".to_string(), |l| format!("layer {l}"))
}

#[derive(Clone, Debug)]
struct State {
    now: Instant,
    /// The decode group's workers and its barrier (its step, votes, decision and who entered
    /// the forward), routed to each other.
    nodes: DecodeNodes,
    /// The prefill owner group's workers and their engine, routed to each other.
    prefill: PrefillNodes,
    msgs: Vec<Msg>,
    lost: u32,
    /// True once a timer fired while a message was in flight (that message arrives late).
    late: bool,
    frees: BTreeMap<TransferId, (u32, bool)>,
    /// Transfers whose blocks the reaper fenced (remote access revoked).
    fenced: Vec<TransferId>,
    /// The first safety violation (a read completed from freed memory, or from an incarnation
    /// that never held its transfer).
    violation: Option<String>,
    /// The current incarnation of each prefill rank.
    incarnations: Vec<Incarnation>,
    /// Prefill rank restarts so far.
    restarts: u32,
    /// Local completions (vote results, reads) delivered at once, in order, after each
    /// transition: their order is not a network choice, so exploring it would only multiply
    /// equivalent states.
    local: VecDeque<Msg>,
}

/// Everything fixed across states: who is who.
struct World {
    decode_ranks: Vec<RankId>,
    prefill_ranks: Vec<RankId>,
    metadata: Vec<(HandshakeMetadata, Vec<LayerMemoryDesc>)>,
    loss_budget: u32,
    max_steps: u64,
    reduce: bool,
    restart_budget: u32,
    policy: Policy,
    /// The incarnations each transfer was registered on, one per TP rank of its owner group.
    holders: BTreeMap<TransferId, Vec<Incarnation>>,
}

/// The state's identity for the visited set: every field but `local`, which is empty between
/// transitions. Hashed through the types' derived `Hash`, so two states share a fingerprint
/// exactly when their fields are equal (up to a 64-bit collision).
fn fingerprint(s: &State) -> u64 {
    let mut h = DefaultHasher::new();
    (&s.now, &s.nodes, &s.prefill, &s.msgs, s.lost, s.late, &s.frees, &s.fenced, &s.violation).hash(&mut h);
    (&s.incarnations, s.restarts).hash(&mut h);
    h.finish()
}

impl World {
    fn prefill_index(&self, rank: RankId) -> Option<usize> {
        self.prefill_ranks.iter().position(|r| *r == rank)
    }

    /// Feeds an event to decode worker `w` and turns what follows into messages and reports.
    fn decode(&self, s: &mut State, w: usize, event: DecodeEvent) {
        let mut out = Vec::new();
        s.nodes.handle_worker(s.now, w, event, &mut out);
        self.node_outputs(s, out);
    }

    /// Feeds the decode group's barrier from outside its workers (a step's begin).
    fn group(&self, s: &mut State, event: GroupEvent) {
        let mut out = Vec::new();
        s.nodes.handle_group_event(s.now, 0, event, &mut out);
        self.node_outputs(s, out);
    }

    /// What the decode nodes asked, in order: a worker's actions become messages; the barrier's
    /// vote results are local completions for the members it names; an input it ignores is a
    /// violation.
    fn node_outputs(&self, s: &mut State, out: Vec<NodeOutput>) {
        for output in out {
            match output {
                NodeOutput::Action { worker, action } => self.decode_action(s, worker, action),
                NodeOutput::Handled { .. } => {}
                NodeOutput::Group { output, .. } => match output {
                    SchedulerOutput::Group(GroupAction::VoteResult { member, step, ok }) => {
                        s.local.push_back(Msg::Vote { to: usize::from(member.0), step, ok })
                    }
                    SchedulerOutput::Group(GroupAction::Forward { .. }) => {}
                    SchedulerOutput::Group(GroupAction::Ignored(why)) => {
                        if s.violation.is_none() {
                            s.violation = Some(format!("the decode group ignored an input: {why}"));
                        }
                    }
                    // Requests are handed to the workers here, not admitted by the scheduler, so
                    // its request barrier decides nothing.
                    SchedulerOutput::ToMember { .. }
                    | SchedulerOutput::Joined(_)
                    | SchedulerOutput::Failed { .. }
                    | SchedulerOutput::DoubleFree { .. } => {}
                    SchedulerOutput::Preempted(_) | SchedulerOutput::Resumed { .. } => {
                        unreachable!("a reserved allocation preempts nothing")
                    }
                },
            }
        }
    }

    /// Turns decode worker `w`'s action into messages.
    fn decode_action(&self, s: &mut State, w: usize, action: DecodeAction) {
        match action {
            DecodeAction::DialHandshake { session, rank, .. } => {
                if let Some(to) = self.prefill_index(rank) {
                    s.msgs.push(Msg::Dial { from: w, session, to });
                }
            }
            DecodeAction::SendLease { rank, lease, .. } => {
                if let Some(to) = self.prefill_index(rank) {
                    let (transfer, lease_ms, incarnation) =
                        (lease.transfer_id, lease.lease_ms, lease.incarnation);
                    s.msgs.push(Msg::Lease { to, transfer, lease_ms, incarnation });
                }
            }
            DecodeAction::SendRelease { rank, release, .. } => {
                if let Some(to) = self.prefill_index(rank) {
                    let sender_tp = release.sender.as_ref().map_or(0, |x| x.tp_rank);
                    let (transfer, incarnation) = (release.transfer_id, release.incarnation);
                    s.msgs.push(Msg::Release { to, transfer, sender_tp, incarnation });
                }
            }
            DecodeAction::PostRead(op) => match self.prefill_index(op.plan.source) {
                Some(from) => s.msgs.push(Msg::Read {
                    to: w,
                    request: op.request(),
                    layer: op.layer,
                    from,
                    transfer: op.plan.transfer_id.clone(),
                    memory: op.plan.incarnation,
                }),
                None => s.local.push_back(Msg::ReadDone {
                    to: w,
                    request: op.request(),
                    layer: op.layer,
                    answer: Answer::Failed,
                }),
            },
            DecodeAction::AbortReads { request } => {
                // The driver flushes the request's posted reads: each is answered aborted
                // and touches no memory any more.
                let mut aborted = Vec::new();
                s.msgs.retain(|m| match m {
                    Msg::Read { to, request: r, layer, .. } if *to == w && *r == request => {
                        aborted.push(*layer);
                        false
                    }
                    _ => true,
                });
                for layer in aborted {
                    s.local.push_back(Msg::ReadDone { to: w, request, layer, answer: Answer::Aborted });
                }
            }
            // The group's inputs: the nodes routed them to the barrier.
            DecodeAction::CastVote { .. }
            | DecodeAction::StepReady { .. }
            | DecodeAction::StepFailed { .. } => {}
            DecodeAction::RequestReceived { .. }
            | DecodeAction::RequestFailed { .. }
            | DecodeAction::InvalidateBlocks { .. } => {}
        }
    }

    /// Feeds an event to prefill worker `i`; returns its own actions (routing to its engine,
    /// and the engine's words for workers, the nodes carried out).
    fn prefill(&self, s: &mut State, i: usize, event: WorkerEvent) -> Vec<WorkerAction> {
        let mut out = Vec::new();
        s.prefill.handle_worker(s.now, i, event, &mut out);
        self.prefill_outputs(s, Some(i), out)
    }

    fn engine(&self, s: &mut State, event: EngineEvent) {
        let mut out = Vec::new();
        s.prefill.handle_engine(s.now, 0, event, &mut out).expect("the model registers valid transfers");
        self.prefill_outputs(s, None, out);
    }

    /// Records the engine's frees and fences; returns worker `own`'s actions (none without one).
    fn prefill_outputs(
        &self,
        s: &mut State,
        own: Option<usize>,
        out: Vec<PrefillOutput>,
    ) -> Vec<WorkerAction> {
        let mut actions = Vec::new();
        for output in out {
            match output {
                PrefillOutput::Worker { worker, action } if Some(worker) == own => actions.push(action),
                PrefillOutput::Engine {
                    action: EngineAction::FreeBlocks { transfer_id, reaped, .. },
                    ..
                } => {
                    let entry = s.frees.entry(transfer_id).or_insert((0, false));
                    entry.0 += 1;
                    entry.1 |= reaped;
                }
                PrefillOutput::Engine { action: EngineAction::Fence { transfer_id, .. }, .. } => {
                    s.fenced.push(transfer_id)
                }
                _ => {}
            }
        }
        actions
    }

    /// Every transition out of `s`, with a line describing it.
    fn successors(&self, s: &State) -> Vec<(String, State)> {
        let mut out = Vec::new();
        if s.violation.is_some() {
            return out;
        }
        let mut seen_msgs: Vec<&Msg> = Vec::new();
        for (i, msg) in s.msgs.iter().enumerate() {
            if seen_msgs.contains(&msg) || (self.reduce && i > 0) {
                continue;
            }
            seen_msgs.push(msg);
            let mut next = s.clone();
            next.msgs.remove(i);
            let line = self.deliver(&mut next, msg.clone());
            out.push((line, next));
            if s.lost < self.loss_budget && !matches!(msg, Msg::Vote { .. } | Msg::ReadDone { .. }) {
                let mut lost = s.clone();
                lost.msgs.remove(i);
                lost.lost += 1;
                if let Msg::Read { to, request, layer, .. } = msg {
                    // A read is never lost silently: it fails at the NIC.
                    let answer = Answer::Failed;
                    lost.local.push_back(Msg::ReadDone { to: *to, request: *request, layer: *layer, answer });
                    out.push((format!("FAIL {}", self.describe(msg)), lost));
                } else {
                    out.push((format!("LOSE {}", self.describe(msg)), lost));
                }
            }
        }
        // A prefill rank crashes and comes back at once as a new incarnation, at any point.
        if s.restarts < self.restart_budget {
            for i in 0..self.prefill_ranks.len() {
                let mut next = s.clone();
                let line = self.restart(&mut next, i);
                out.push((line, next));
            }
        }
        // Time passes until the earliest timer, firing every timer due then, at any point: with
        // messages or reads still in flight too, which then arrive late (a read that outlives its
        // request's transfer timeout is exactly the case the drain rule exists for).
        let deadline = s
            .nodes
            .workers()
            .iter()
            .filter_map(DecodeWorker::poll_timeout)
            .chain(s.prefill.engine(0).poll_timeout())
            .min();
        if let Some(t) = deadline {
            let mut next = s.clone();
            next.now = t.max(s.now);
            next.late |= !s.msgs.is_empty();
            for w in 0..next.nodes.workers().len() {
                if next.nodes.worker(w).poll_timeout().is_some_and(|d| d <= next.now) {
                    self.decode(&mut next, w, DecodeEvent::Tick);
                }
            }
            if next.prefill.engine(0).poll_timeout().is_some_and(|d| d <= next.now) {
                self.engine(&mut next, EngineEvent::Tick);
            }
            out.push((format!("time passes to {}", next.now), next));
        }
        // The group begins its next step once this one reached its forward.
        let barrier = s.nodes.sched(0).barrier();
        let current = barrier.step().unwrap_or(0);
        let pending = s.nodes.workers().iter().any(|d| d.pending_requests() > 0);
        if barrier.may_begin() && pending && current < self.max_steps {
            let mut next = s.clone();
            let step = current + 1;
            self.group(&mut next, GroupEvent::StepBegin { step });
            for w in 0..next.nodes.workers().len() {
                self.decode(&mut next, w, DecodeEvent::StepBegin { step, requests: Vec::new() });
            }
            out.push((format!("step {step} begins"), next));
        }
        for (_, state) in out.iter_mut() {
            self.drain_local(state);
            state.msgs.sort();
        }
        out
    }

    /// Prefill rank `i` crashes and restarts as a new incarnation: a fresh worker with new
    /// memory, which its engine is told of. Reads in flight from the old memory fail when they
    /// arrive (its keys died with it); messages in flight to the rank reach the new incarnation.
    fn restart(&self, s: &mut State, i: usize) -> String {
        s.restarts += 1;
        let incarnation = incarnation_of(i, s.restarts);
        s.incarnations[i] = incarnation;
        let rank = self.prefill_ranks[i];
        let (metadata, layers) = self.metadata_of(i, incarnation);
        s.prefill.replace_worker(i, PrefillWorker::new(rank, metadata, layers, &self.policy));
        self.engine(s, EngineEvent::WorkerUp { rank, incarnation });
        format!("RESTART {rank} as {incarnation}")
    }

    /// The handshake answer of prefill rank `i` in `incarnation`.
    fn metadata_of(&self, i: usize, incarnation: Incarnation) -> (HandshakeMetadata, Vec<LayerMemoryDesc>) {
        let (metadata, layers) = self.metadata[i].clone();
        (HandshakeMetadata { incarnation: Some(incarnation), ..metadata }, layers)
    }

    /// Delivers local completions until none is left (they may cause more).
    fn drain_local(&self, s: &mut State) {
        while let Some(msg) = s.local.pop_front() {
            self.deliver(s, msg);
        }
    }

    fn describe(&self, msg: &Msg) -> String {
        let d = |w: usize| self.decode_ranks[w].to_string();
        let p = |i: usize| self.prefill_ranks[i].to_string();
        match msg {
            Msg::Dial { from, to, .. } => format!("handshake request {} -> {}", d(*from), p(*to)),
            Msg::Reply { to, from, incarnation, .. } => {
                format!("handshake reply {} ({incarnation}) -> {}", p(*from), d(*to))
            }
            Msg::Lease { to, transfer, .. } => format!("read lease of {transfer} -> {}", p(*to)),
            Msg::Release { to, transfer, sender_tp, .. } => {
                format!("release of {transfer} from tp{sender_tp} -> {}", p(*to))
            }
            Msg::Vote { to, step, ok } => format!("vote result of step {step} (ok={ok}) -> {}", d(*to)),
            Msg::Read { to, request, layer, from, memory, .. } => {
                let memory = memory.map_or_else(String::new, |m| format!(" ({m}'s memory)"));
                format!("read of {request} {} from {}{memory} by {}", layers(*layer), p(*from), d(*to))
            }
            Msg::ReadDone { to, request, layer, answer } => {
                format!("read of {request} {} answered {} at {}", layers(*layer), answer.name(), d(*to))
            }
        }
    }

    fn deliver(&self, s: &mut State, msg: Msg) -> String {
        let line = format!("deliver {}", self.describe(&msg));
        match msg {
            Msg::Dial { from, session, to } => {
                for action in self.prefill(s, to, WorkerEvent::HandshakeRequest { peer: from as u64 }) {
                    if let WorkerAction::SendHandshakeReply { .. } = action {
                        let incarnation = s.incarnations[to];
                        s.msgs.push(Msg::Reply { to: from, session: session.clone(), from: to, incarnation });
                    }
                }
            }
            Msg::Reply { to, session, from, incarnation } => {
                let (metadata, layers) = self.metadata_of(from, incarnation);
                self.decode(
                    s,
                    to,
                    DecodeEvent::HandshakeMetadata { session: session.clone(), metadata: Box::new(metadata) },
                );
                self.decode(s, to, DecodeEvent::HandshakeDescriptors { session, layers });
            }
            Msg::Lease { to, transfer, lease_ms, incarnation } => {
                self.prefill(
                    s,
                    to,
                    WorkerEvent::Lease { transfer_id: transfer, lease_ms, incarnation, mac: None },
                );
            }
            Msg::Release { to, transfer, sender_tp, incarnation } => {
                let sender = pdkv_core::release::ReleaseSender {
                    engine_id: "decode-0:6301".into(),
                    dp_rank: 0,
                    tp_rank: sender_tp,
                };
                let release = Release {
                    transfer_id: transfer,
                    consumer_tp_size: None,
                    sender: Some(sender),
                    incarnation,
                    mac: None,
                };
                self.prefill(s, to, WorkerEvent::Release(release));
            }
            Msg::Vote { to, step, ok } => self.decode(s, to, DecodeEvent::VoteResult { step, ok }),
            Msg::Read { to, request, layer, from, transfer, memory } => {
                let tp = usize::from(self.prefill_ranks[from].tp);
                let holder = self.holders.get(&transfer).and_then(|h| h.get(tp).copied());
                // Read from the memory of an incarnation that never held the transfer.
                let stale = match (holder, memory) {
                    (Some(holder), Some(memory)) if holder != memory => Some((holder, memory)),
                    _ => None,
                };
                let answer = if memory.is_some_and(|m| m != s.incarnations[from]) {
                    // The memory of an incarnation that is gone: its keys died with it.
                    Answer::Failed
                } else if s.fenced.contains(&transfer) {
                    Answer::Fenced
                } else if let Some((holder, memory)) = stale {
                    if s.violation.is_none() {
                        s.violation = Some(format!(
                            "stale read: {} read {transfer} from the memory of {} {memory}, but {holder} held it \
                             (the old block ids read another request's KV or free blocks)",
                            self.decode_ranks[to], self.prefill_ranks[from]
                        ));
                    }
                    Answer::Ok
                } else {
                    if s.frees.contains_key(&transfer) && s.violation.is_none() {
                        s.violation = Some(format!(
                            "read of {transfer} by {} completed from blocks {} had freed (read after free)",
                            self.decode_ranks[to], self.prefill_ranks[from]
                        ));
                    }
                    Answer::Ok
                };
                s.local.push_back(Msg::ReadDone { to, request, layer, answer });
            }
            Msg::ReadDone { to, request, layer, answer } => {
                let outcome = match answer {
                    Answer::Ok => ReadOutcome::Ok,
                    Answer::Failed => ReadOutcome::Failed("read failed".into()),
                    Answer::Fenced => ReadOutcome::Failed("remote access revoked (fenced)".into()),
                    Answer::Aborted => ReadOutcome::Aborted,
                };
                self.decode(s, to, DecodeEvent::ReadDone { request, layer, outcome })
            }
        }
        line
    }

    /// The violation of a state with nothing left to do, if any.
    fn check_final(&self, s: &State) -> Option<String> {
        if let Some(violation) = &s.violation {
            return Some(violation.clone());
        }
        // The group's step must have reached its forward: every worker entered it as the
        // group decided.
        let barrier = s.nodes.sched(0).barrier();
        let step = barrier.step().unwrap_or(0);
        if !barrier.forward_ready(step) {
            let names =
                |members: &[&RankId]| members.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
            let report = |r: &RankId| barrier.report(r.tp_rank());
            let (entered, stuck): (Vec<&RankId>, Vec<&RankId>) =
                self.decode_ranks.iter().partition(|r| report(r).is_some_and(StepReport::enters_forward));
            if self.decode_ranks.iter().any(|r| report(r).is_some()) {
                return Some(format!(
                    "step {step} diverged: {} entered the forward collective, {} never did (blocked or raised \
                     alone); the collective would wait for its timeout",
                    names(&entered),
                    names(&stuck)
                ));
            }
            return Some(format!("deadlock: step {step} never reported by {}", names(&stuck)));
        }
        if step >= self.max_steps {
            return None;
        }
        if let Some(w) = s.nodes.workers().iter().position(|d| d.pending_requests() > 0) {
            return Some(format!("{} never finished its requests", self.decode_ranks[w]));
        }
        if s.prefill.engine(0).totals().held > 0 {
            return Some(format!("{} transfers still held", s.prefill.engine(0).totals().held));
        }
        for (transfer, (count, reaped)) in &s.frees {
            if *count != 1 {
                return Some(format!("{transfer} freed {count} times"));
            }
            if *reaped && s.lost == 0 && !s.late {
                return Some(format!("{transfer} freed by the reaper though no message was lost or late"));
            }
        }
        None
    }
}

/// The incarnation of prefill rank `i` after `restarts` restarts of the run (any rank's): never
/// reused, since the count only grows.
fn incarnation_of(i: usize, restarts: u32) -> Incarnation {
    Incarnation::new((i as u64 + 1) * 1000 + u64::from(restarts)).expect("a small positive value")
}

/// How far a search has come, for a progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelProgress {
    /// Distinct states visited.
    pub states: usize,
    /// States waiting to be expanded.
    pub queued: usize,
    /// Depth of the state being expanded.
    pub depth: usize,
}

/// States between two progress reports.
const PROGRESS_EVERY: u64 = 1 << 14;

/// Refuses a configuration beyond the limits above, naming the field.
fn check_limits(config: &ModelConfig) -> Result<(), String> {
    let over = |field: &str, value: u64, max: u64| {
        Err(format!("{field}: {value} is above the model checker's limit of {max}"))
    };
    if config.requests == 0 {
        return Err("requests: at least one request is needed".into());
    }
    if config.requests > MAX_REQUESTS {
        return over("requests", config.requests, MAX_REQUESTS);
    }
    if config.loss_budget > MAX_LOSSES {
        return over("losses", config.loss_budget.into(), MAX_LOSSES.into());
    }
    if config.restarts > MAX_RESTARTS {
        return over("restarts", config.restarts.into(), MAX_RESTARTS.into());
    }
    if config.max_steps == 0 || config.max_steps > MAX_STEPS {
        return Err(format!("max steps: {} is outside 1..={MAX_STEPS}", config.max_steps));
    }
    if config.max_states == 0 || config.max_states > MAX_STATES {
        return Err(format!("max states: {} is outside 1..={MAX_STATES}", config.max_states));
    }
    Ok(())
}

/// Explores every interleaving of `config` breadth first.
pub fn check(config: &ModelConfig) -> Result<ModelReport, String> {
    check_with_progress(config, &mut |_| {})
}

/// [`check`], reporting progress every few thousand states.
pub fn check_with_progress(
    config: &ModelConfig,
    progress: &mut dyn FnMut(ModelProgress),
) -> Result<ModelReport, String> {
    let started = WallClock::now();
    check_limits(config)?;
    let d = Deployment::parse(&config.deployment)
        .map_err(|e| e.to_string())?
        .with_model(ModelSpec { layers: 1, ..ModelSpec::deepseek_r1() });
    let book = AddressBook::one_host_per_engine(&d);
    let (prefill, decode) = (EngineId::prefill(0), EngineId::decode(0));
    let (pl, dl) = (d.layout(prefill), d.layout(decode));
    let decode_ranks: Vec<RankId> = (0..dl.tp).map(|tp| RankId::new(decode, 0, tp)).collect();
    let prefill_ranks: Vec<RankId> =
        d.ranks(Role::Prefill).into_iter().filter(|r| r.engine == prefill).collect();
    if prefill_ranks.len() > MAX_RANKS {
        let ranks = prefill_ranks.len();
        return Err(format!(
            "{}: prefill engine P0 has {ranks} ranks; the model checker takes at most {MAX_RANKS}",
            config.deployment
        ));
    }
    if decode_ranks.len() > MAX_RANKS {
        let ranks = decode_ranks.len();
        return Err(format!("{}: a DP group of decode engine D0 has {ranks} ranks; the model checker takes at most {MAX_RANKS}", config.deployment));
    }
    let metadata: Vec<(HandshakeMetadata, Vec<LayerMemoryDesc>)> = prefill_ranks
        .iter()
        .enumerate()
        .map(|(i, _)| {
            let meta = HandshakeMetadata {
                engine_id: book.engine_id(prefill),
                agent_metadata: Vec::new(),
                kv_caches_base_addr: vec![(i as u64 + 1) << 32],
                num_blocks: 64,
                block_len: 1024,
                attn_backend_name: "model-check".into(),
                rank: None,
                extensions: pdkv_core::wire::Extensions::ALL,
                incarnation: None,
            };
            (meta, vec![LayerMemoryDesc { layer_name: "layer.0".into(), descs: vec![vec![0]] }])
        })
        .collect();
    let policy = Policy::from(&config.legacy);
    let mut world = World {
        decode_ranks: decode_ranks.clone(),
        prefill_ranks: prefill_ranks.clone(),
        metadata: metadata.clone(),
        loss_budget: config.loss_budget,
        max_steps: config.max_steps,
        reduce: config.reduce,
        restart_budget: config.restarts,
        policy,
        holders: BTreeMap::new(),
    };
    let incarnations: Vec<Incarnation> = (0..prefill_ranks.len()).map(|i| incarnation_of(i, 0)).collect();
    // The scheduler admits nothing here (the requests are handed to the workers below), so its
    // batch and pool are never used.
    let limits = SchedulerLimits {
        width: dl.tp,
        max_batch: 1,
        pool_blocks: 0,
        block_size_tokens: 1,
        allocation: KvAllocation::Reserve,
    };
    let mut nodes = DecodeNodes::new();
    let group = nodes.add_group(DecodeScheduler::new(limits, policy.handshake));
    for &r in &decode_ranks {
        let config = DecodeConfig::new(r, dl, d.model.clone(), policy, book.engine_id(decode));
        nodes.add_worker(group, DecodeWorker::new(config));
    }
    // The owner group's workers, numbered as `prefill_ranks`; the engine's words for ranks of
    // other groups are dropped.
    let mut prefill_nodes = PrefillNodes::new();
    let mut engine = PrefillEngine::new(prefill, pl, d.model.clone(), policy);
    for (&rank, &incarnation) in prefill_ranks.iter().zip(&incarnations) {
        engine
            .handle(Instant::ZERO, EngineEvent::WorkerUp { rank, incarnation }, &mut Vec::new())
            .map_err(|e| e.to_string())?;
    }
    prefill_nodes.add_engine(engine);
    for (i, &r) in prefill_ranks.iter().enumerate() {
        let (m, l) = world.metadata_of(i, incarnations[i]);
        prefill_nodes.add_worker(r, PrefillWorker::new(r, m, l, &policy));
    }
    let mut initial = State {
        now: Instant::ZERO,
        nodes,
        prefill: prefill_nodes,
        msgs: Vec::new(),
        lost: 0,
        late: false,
        frees: BTreeMap::new(),
        fenced: Vec::new(),
        violation: None,
        incarnations,
        restarts: 0,
        local: VecDeque::new(),
    };
    let mut requests = Vec::new();
    for n in 1..=config.requests {
        let owner = (n - 1) as u16 % pl.dp;
        let transfer_id = TransferId::from_u128(u128::from(n));
        let event = EngineEvent::PrefillDone(PrefillDone {
            request: RequestId(n),
            transfer_id: transfer_id.clone(),
            owner_dp: owner,
            blocks: vec![n as u32],
            decode: dl,
            reader: None,
            holders: None,
        });
        world.engine(&mut initial, event);
        let holders = initial
            .prefill
            .engine(0)
            .holder_incarnations(&transfer_id)
            .ok_or("the engine knows every worker")?;
        world.holders.insert(transfer_id.clone(), holders.clone());
        let answer = KvTransferParams::prefill_answer(&PrefillAnswer {
            transfer_id: Some(&transfer_id),
            blocks: &[n as u32],
            address: book.engine(prefill),
            layout: pl,
            extensions: pdkv_core::wire::Extensions::ALL,
            holders: Some(&holders),
            blocks_per_group: true,
        });
        requests.push(RecvRequest {
            request: RequestId(n),
            prefill_engine: prefill,
            prefill_address: book.engine(prefill).clone(),
            params: answer.forwarded(&transfer_id, (pl.dp > 1).then_some(owner), pl.tp),
            local_block_ids: vec![n as u32 + 100],
        });
    }
    world.group(&mut initial, GroupEvent::StepBegin { step: 1 });
    for w in 0..initial.nodes.workers().len() {
        world.decode(&mut initial, w, DecodeEvent::StepBegin { step: 1, requests: requests.clone() });
    }
    world.drain_local(&mut initial);
    initial.msgs.sort();

    // Breadth first, remembering each state's parent for the shortest trace.
    let mut visited: HashSet<u64> = HashSet::new();
    let mut trail: Vec<(Option<usize>, String)> = vec![(None, "initial state".into())];
    let mut queue: VecDeque<(State, usize, usize)> = VecDeque::new();
    visited.insert(fingerprint(&initial));
    queue.push_back((initial, 0, 0));
    let (mut transitions, mut max_depth, mut complete) = (0u64, 0usize, true);
    let mut expanded = 0u64;
    while let Some((state, id, depth)) = queue.pop_front() {
        max_depth = max_depth.max(depth);
        expanded += 1;
        if expanded.is_multiple_of(PROGRESS_EVERY) {
            progress(ModelProgress { states: visited.len(), queued: queue.len(), depth });
        }
        let next = world.successors(&state);
        if next.is_empty() {
            if let Some(violation) = world.check_final(&state) {
                let mut trace = Vec::new();
                let mut at = Some(id);
                while let Some(i) = at {
                    trace.push(trail[i].1.clone());
                    at = trail[i].0;
                }
                trace.reverse();
                return Ok(ModelReport {
                    states: visited.len(),
                    transitions,
                    max_depth,
                    complete: false,
                    seconds: started.elapsed().as_secs_f64(),
                    violation: Some((violation, trace)),
                });
            }
            continue;
        }
        for (line, successor) in next {
            transitions += 1;
            if visited.len() >= config.max_states {
                complete = false;
                break;
            }
            if visited.insert(fingerprint(&successor)) {
                trail.push((Some(id), line));
                queue.push_back((successor, trail.len() - 1, depth + 1));
            }
        }
    }
    Ok(ModelReport {
        states: visited.len(),
        transitions,
        max_depth,
        complete,
        seconds: started.elapsed().as_secs_f64(),
        violation: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::legacy::Legacy;

    fn config(deployment: &str, legacy: LegacyOptions, loss_budget: u32) -> ModelConfig {
        ModelConfig {
            deployment: deployment.into(),
            legacy,
            requests: 2,
            loss_budget,
            max_steps: 3,
            max_states: 200_000,
            reduce: true,
            restarts: 0,
        }
    }

    /// The reduction agrees with the full interleaving on the smallest deployment, where the
    /// full search still fits: same verdict, fewer states.
    #[test]
    fn reduction_agrees_with_full_interleaving() {
        // One request keeps the full search small enough to finish; both the fixed protocol and
        // the legacy read-after-free must get the same verdict either way.
        for (legacy, violation) in
            [(LegacyOptions::none(), false), (LegacyOptions::none().with(Legacy::ReleaseDuringReads), true)]
        {
            let small = ModelConfig { requests: 1, ..config("1P_TP1:1D_TP2", legacy.clone(), 1) };
            let reduced = check(&small).unwrap();
            let full = check(&ModelConfig { reduce: false, ..small }).unwrap();
            assert_eq!(full.violation.is_some(), violation, "{legacy:?} full: {:?}", full.violation);
            assert_eq!(reduced.violation.is_some(), violation, "{legacy:?} reduced: {:?}", reduced.violation);
            if !violation {
                assert!(full.complete && reduced.complete);
                assert!(reduced.states < full.states, "{} !< {}", reduced.states, full.states);
            }
        }
    }

    /// A request that times out while its reads are posted: released at once (the legacy
    /// behaviour) the prefill frees the blocks under the read; the default drains first.
    #[test]
    fn read_after_free_is_found_with_the_drain_rule_off() {
        let legacy = LegacyOptions::none().with(Legacy::ReleaseDuringReads);
        for deployment in ["1P_TP1:1D_TP1", "1P_TP2:1D_TP4"] {
            let report = check(&config(deployment, legacy.clone(), 0)).unwrap();
            let (violation, trace) = report.violation.expect("the read after free is found");
            assert!(violation.contains("read after free"), "{deployment}: {violation}");
            assert!(trace.iter().any(|l| l.starts_with("time passes")), "{deployment}: {trace:#?}");
            // The trace is for people: reads name their layer in words, not as Rust's Option.
            assert!(trace.iter().any(|l| l.contains("read of req-1 layer 0 ")), "{deployment}: {trace:#?}");
            assert!(!trace.iter().any(|l| l.contains("Some(") || l.contains("None")), "{trace:#?}");
        }
        let report = check(&config("1P_TP1:1D_TP1", LegacyOptions::none(), 1)).unwrap();
        assert!(report.violation.is_none() && report.complete, "{:?}", report.violation);
    }

    #[test]
    fn default_protocol_has_no_deadlock_or_leak_in_any_interleaving() {
        for deployment in ["1P_DP2:1D_TP2", "1P_TP2:1D_TP4", "1P_TP4:1D_TP2"] {
            let report = check(&config(deployment, LegacyOptions::none(), 1)).unwrap();
            assert!(report.violation.is_none(), "{deployment}: {:?}", report.violation);
            assert!(report.complete, "{deployment}: bound reached at {} states", report.states);
            assert!(report.states >= 50, "{deployment}: only {} states", report.states);
            eprintln!(
                "{deployment}: {} states, depth {}, {:.2} s",
                report.states, report.max_depth, report.seconds
            );
        }
    }

    /// A prefill rank crashes and restarts at any point of the execution. With the incarnation
    /// fence off, some interleaving reads a transfer's old block ids from the restarted rank's
    /// new memory (the handshake reply comes from the new incarnation); with the fence, none
    /// does, nothing hangs or leaks, and every transfer is freed once, by its releases.
    #[test]
    fn a_prefill_restart_reads_stale_kv_only_without_the_incarnation_fence() {
        for deployment in ["1P_TP1:1D_TP1", "1P_TP2:1D_TP2"] {
            let fixed = ModelConfig { restarts: 1, ..config(deployment, LegacyOptions::none(), 0) };
            let report = check(&fixed).unwrap();
            assert!(report.violation.is_none(), "{deployment}: {:?}", report.violation);
            assert!(report.complete, "{deployment}: bound reached at {} states", report.states);
            let legacy = LegacyOptions::none().with(Legacy::NoIncarnationFence);
            let report = check(&ModelConfig { restarts: 1, ..config(deployment, legacy, 0) }).unwrap();
            let (violation, trace) = report.violation.expect("the stale read is found");
            assert!(violation.starts_with("stale read"), "{deployment}: {violation}");
            assert!(trace.iter().any(|l| l.starts_with("RESTART")), "{deployment}: {trace:#?}");
        }
    }

    /// A configuration beyond the limits is refused, naming what is too large.
    #[test]
    fn configurations_beyond_the_limits_are_refused() {
        let check_err = |change: fn(&mut ModelConfig), expected: &str| {
            let mut c = config("1P_TP2:1D_TP2", LegacyOptions::none(), 0);
            change(&mut c);
            assert_eq!(check(&c).err().as_deref(), Some(expected));
        };
        check_err(|c| c.requests = 0, "requests: at least one request is needed");
        check_err(|c| c.requests = 5, "requests: 5 is above the model checker's limit of 4");
        check_err(|c| c.loss_budget = 4, "losses: 4 is above the model checker's limit of 3");
        check_err(|c| c.restarts = 3, "restarts: 3 is above the model checker's limit of 2");
        check_err(|c| c.max_steps = 0, "max steps: 0 is outside 1..=8");
        check_err(
            |c| c.max_states = usize::MAX,
            &format!("max states: {} is outside 1..=5000000", usize::MAX),
        );
        check_err(
            |c| c.deployment = "1P_DP2TP8:1D_TP2".into(),
            "1P_DP2TP8:1D_TP2: prefill engine P0 has 16 ranks; the model checker takes at most 8",
        );
        check_err(
            |c| c.deployment = "1P_TP2:1D_TP16".into(),
            "1P_TP2:1D_TP16: a DP group of decode engine D0 has 16 ranks; the model checker takes at most 8",
        );
        check_err(
            |c| c.deployment = "1P_TQ2:1D_TP2".into(),
            &Deployment::parse("1P_TQ2:1D_TP2").unwrap_err().to_string(),
        );
    }

    #[test]
    fn lazy_handshake_diverges_in_some_interleaving() {
        let legacy = LegacyOptions::none().with(Legacy::LazyHandshake);
        let report = check(&config("1P_TP2:1D_TP2", legacy, 1)).unwrap();
        let (violation, trace) = report.violation.expect("the divergent interleaving is found");
        assert!(violation.contains("diverged") || violation.contains("deadlock"), "{violation}");
        assert!(trace.iter().any(|l| l.starts_with("LOSE handshake")), "{trace:#?}");
    }
}
