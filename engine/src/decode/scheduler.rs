//! A decode DP group's scheduler, written once for every driver: the requests it queues, admits
//! by pool space and batch room, waits on until every TP rank received them, and runs a token a
//! step; its KV block pool; and the group's barrier (the core's `DecodeGroup`).

use std::collections::{BTreeMap, VecDeque};

use pdkv_core::decode::{DecodeEvent, RecvRequest};
use pdkv_core::group::{DecodeGroup, GroupAction, GroupEvent};
use pdkv_core::ids::{RequestId, TpRank};
use pdkv_core::policy::HandshakeMode;

use super::{Joined, RequestBarrier};
use crate::pool::{Pool, FREE};

/// The sizes that bound a decode DP group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SchedulerLimits {
    /// TP ranks in the group.
    pub width: u16,
    /// Requests the group decodes, and waits on, at once.
    pub max_batch: usize,
    /// KV blocks of the group's pool.
    pub pool_blocks: u32,
    /// Tokens a block holds.
    pub block_size_tokens: u32,
    /// How the pool holds a request's KV while it decodes.
    pub allocation: KvAllocation,
}

/// How a group's pool holds a request's KV while it decodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvAllocation {
    /// Blocks for the prompt and the whole answer at admission: nothing grows later and
    /// nothing is preempted. The protocol's drivers (the cluster, the model checker) use it:
    /// a request's blocks are then fixed from admission to its end.
    #[default]
    Reserve,
    /// vLLM's way: blocks for the prompt at admission, one more each time the context crosses a
    /// block boundary. When the pool cannot give a running request its next block, the newest
    /// running request is preempted (its blocks go back) until it can; a preempted request
    /// rejoins ahead of new ones by recomputing its whole context locally, and while any
    /// request was preempted at a step no request is admitted at it.
    OnDemand {
        /// Blocks a waiting or preempted request must leave free when the batch is not empty
        /// (vLLM's KV-cache watermark; 0 in vLLM by default).
        watermark_blocks: u32,
    },
}

/// A request's prompt and answer lengths, in tokens: its context at admission and how many
/// steps it decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tokens {
    /// Prompt tokens (the context the first step attends to).
    pub input: u32,
    /// Tokens to generate (at least one).
    pub output: u32,
}

/// A request in the batch (or preempted out of it), with what each step needs of it kept inline.
#[derive(Clone, Copy, Debug, Hash)]
struct Running {
    id: RequestId,
    left: u32,
    context: u64,
    first: bool,
}

/// What the scheduler holds of an admitted request until it ends.
#[derive(Clone, Debug, Hash)]
struct Held {
    tokens: Tokens,
    owner: u32,
    blocks: Vec<u32>,
}

/// What the scheduler asks of its driver, in the order it is to be carried out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SchedulerOutput<E> {
    /// An input for the worker of TP rank `member` (a step's new requests, queued requests).
    ToMember {
        /// The worker's TP rank.
        member: TpRank,
        /// What it is told.
        event: DecodeEvent,
    },
    /// What the group's barrier decided: vote results for the members, a forward every member
    /// entered, an input it ignored.
    Group(GroupAction),
    /// Every TP rank received the request's KV: it joins the batch at the next step.
    Joined(RequestId),
    /// A TP rank failed the request: it ends failed (its blocks are back in the pool), with
    /// each failing rank's error in report order.
    Failed {
        /// The request.
        request: RequestId,
        /// `(rank, error)` in the order they reported.
        errors: Vec<(TpRank, E)>,
    },
    /// The pool could not give a running request its next block: `request` left the batch and
    /// its blocks went back to the pool (on-demand allocation only). It rejoins by recomputing.
    Preempted(RequestId),
    /// A preempted request rejoined the batch: this step recomputes its `tokens` of context
    /// before it decodes on (on-demand allocation only).
    Resumed {
        /// The request.
        request: RequestId,
        /// Context tokens recomputed.
        tokens: u64,
    },
    /// Freeing a request's blocks found some it did not hold (a double free): a bug.
    DoubleFree {
        /// The request.
        request: RequestId,
        /// The blocks it did not hold.
        blocks: Vec<u32>,
    },
}

/// What one forward did to the batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forwarded {
    /// Requests that got their first token.
    pub first: Vec<RequestId>,
    /// Requests that got a later token (each waited one step gap for it).
    pub continuing: u64,
    /// Requests that got their last token, in batch order; their blocks are back in the pool.
    pub finished: Vec<RequestId>,
}

/// A decode DP group's scheduler. Requests arrive ([`Self::handle_arrival`]) and wait; at a step
/// ([`Self::handle_step_begin`]) requests that every rank received join the batch, and waiting
/// ones are admitted in arrival order (the head is never skipped) while the batch has room and
/// the pool has blocks for the prompt's KV and the answer's growth; every worker hears of the
/// new requests, and of those still queued (which they lease meanwhile). A forward
/// ([`Self::handle_forward`]) gives every running request a token. Votes and step reports go to
/// the group's barrier ([`Self::handle_group_event`]); the ranks' reports of each request to the
/// request barrier ([`Self::handle_report`]). Effects leave as [`SchedulerOutput`]s; time never
/// enters: when to step is the driver's.
#[derive(Clone, Debug, Hash)]
pub struct DecodeScheduler<E> {
    limits: SchedulerLimits,
    handshake: HandshakeMode,
    pool: Pool,
    /// Requests not admitted yet, in arrival order, with their lengths.
    waiting: VecDeque<(RecvRequest, Tokens)>,
    /// How many requests at the front of `waiting` the workers were told are queued (they keep
    /// those leased); the rest arrived since the last step began.
    told: usize,
    /// Admitted requests waiting for every TP rank to report them.
    pending: RequestBarrier<E>,
    /// Requests every rank received, joining the batch at the next step.
    ready: Vec<RequestId>,
    running: Vec<Running>,
    /// Requests preempted out of the batch, oldest first: they rejoin before any waiting one.
    preempted: VecDeque<Running>,
    /// Context tokens the step that began last recomputes for requests that rejoined at it.
    recompute_tokens: u64,
    /// Preemptions since the group was made.
    preemptions_total: u64,
    /// Sum of the running requests' context lengths.
    context_tokens: u64,
    /// Admitted requests' blocks and lengths, until they end.
    held: BTreeMap<RequestId, Held>,
    /// The next owner number for the pool (a request's, from admission to its end).
    next_owner: u32,
    barrier: DecodeGroup,
    /// Requests the workers were ever told are queued (a request taken back and returned
    /// counts again).
    queued_total: u64,
}

impl<E> DecodeScheduler<E> {
    /// An empty group's scheduler, its barrier on no step.
    pub fn new(limits: SchedulerLimits, handshake: HandshakeMode) -> Self {
        assert!(limits.block_size_tokens > 0, "a block holds at least one token");
        DecodeScheduler {
            limits,
            handshake,
            pool: Pool::new(limits.pool_blocks),
            waiting: VecDeque::new(),
            told: 0,
            pending: RequestBarrier::new(limits.width),
            ready: Vec::new(),
            running: Vec::new(),
            preempted: VecDeque::new(),
            recompute_tokens: 0,
            preemptions_total: 0,
            context_tokens: 0,
            held: BTreeMap::new(),
            next_owner: 0,
            barrier: DecodeGroup::new(limits.width, handshake),
            queued_total: 0,
        }
    }

    /// The group's barrier (which step it is on, who voted, who entered the forward).
    pub fn barrier(&self) -> &DecodeGroup {
        &self.barrier
    }

    /// Requests in the batch.
    pub fn batch_len(&self) -> usize {
        self.running.len()
    }

    /// The running requests' context, in tokens.
    pub fn context_tokens(&self) -> u64 {
        self.context_tokens
    }

    /// Admitted requests still waiting for some rank's report.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Whether a step has something to do: requests running, joining, or waiting for room.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty()
            || !self.ready.is_empty()
            || !self.waiting.is_empty()
            || !self.preempted.is_empty()
    }

    /// Context tokens the step that began last recomputes for preempted requests that rejoined.
    pub fn recompute_tokens(&self) -> u64 {
        self.recompute_tokens
    }

    /// Requests preempted since the group was made (a reset starts again from 0).
    pub fn preemptions_total(&self) -> u64 {
        self.preemptions_total
    }

    /// Blocks free in the pool.
    pub fn free_blocks(&self) -> usize {
        self.pool.available()
    }

    /// Requests that waited behind a full batch or pool at a step, since the group was made
    /// (a reset starts again from 0).
    pub fn queued_total(&self) -> u64 {
        self.queued_total
    }

    /// A request reached the group: it waits for a step that has room for it.
    pub fn handle_arrival(&mut self, recv: RecvRequest, tokens: Tokens) {
        self.waiting.push_back((recv, tokens));
    }

    /// Step `step` begins: see [`DecodeScheduler`].
    pub fn handle_step_begin(&mut self, step: u64, out: &mut Vec<SchedulerOutput<E>>) {
        // Requests whose KV arrived join the batch at this step boundary.
        let room = self.limits.max_batch.saturating_sub(self.running.len());
        for id in self.ready.drain(..self.ready.len().min(room)) {
            let tokens = self.held[&id].tokens;
            self.context_tokens += u64::from(tokens.input);
            self.running.push(Running {
                id,
                left: tokens.output,
                context: u64::from(tokens.input),
                first: true,
            });
        }
        self.recompute_tokens = 0;
        let watermark = match self.limits.allocation {
            KvAllocation::Reserve => 0,
            KvAllocation::OnDemand { watermark_blocks } => {
                if self.grow_running(out) {
                    // vLLM admits nothing at a step that had to preempt.
                    self.announce(step, Vec::new(), out);
                    return;
                }
                self.resume_preempted(watermark_blocks as usize, out);
                if !self.preempted.is_empty() {
                    self.announce(step, Vec::new(), out);
                    return;
                }
                watermark_blocks as usize
            }
        };
        let mut new = Vec::new();
        while let Some((recv, tokens)) = self.waiting.front() {
            // A list the core refuses (several KV cache groups) gets no blocks; its route fails.
            let remote = recv.params.remote_block_ids.single_group().map_or(0, <[u64]>::len);
            let growth = match self.limits.allocation {
                KvAllocation::Reserve => tokens.output.div_ceil(self.limits.block_size_tokens) as usize,
                KvAllocation::OnDemand { .. } => 0,
            };
            let busy = self.running.len() + self.ready.len() + self.pending.len();
            // The watermark applies only when some request is already scheduled, as in vLLM.
            let spare = if busy > 0 { watermark } else { 0 };
            if busy >= self.limits.max_batch
                || self.pool.available() < remote.saturating_add(growth).saturating_add(spare)
            {
                break;
            }
            let (mut recv, tokens) = self.waiting.pop_front().expect("front exists");
            self.told = self.told.saturating_sub(1);
            let owner = self.next_owner;
            // Owner numbers only tell live requests apart; `FREE` is the pool's "nobody".
            self.next_owner = self.next_owner.wrapping_add(1) % FREE;
            let local = self.pool.alloc(remote, owner);
            let more = self.pool.alloc(growth, owner);
            recv.local_block_ids = local.clone();
            self.held.insert(
                recv.request,
                Held { tokens, owner, blocks: local.into_iter().chain(more).collect() },
            );
            self.pending.admit(recv.request);
            new.push(recv);
        }
        self.announce(step, new, out);
    }

    /// Blocks a request of `context` tokens needs beyond the `held` it has.
    fn blocks_short(&self, context: u64, held: usize) -> usize {
        let need = context.div_ceil(u64::from(self.limits.block_size_tokens));
        usize::try_from(need).unwrap_or(usize::MAX).saturating_sub(held)
    }

    /// On-demand allocation: gives every running request, in batch order, the blocks this
    /// step's token needs, preempting the newest running requests while the pool is short (a
    /// request that would have to preempt itself is preempted). Returns whether any was.
    fn grow_running(&mut self, out: &mut Vec<SchedulerOutput<E>>) -> bool {
        let mut preempted_any = false;
        let mut i = 0;
        while i < self.running.len() {
            let Running { id, context, .. } = self.running[i];
            let short = self.blocks_short(context, self.held[&id].blocks.len());
            while self.pool.available() < short && i < self.running.len() {
                let victim = self.running.pop().expect("the batch holds request i");
                self.preempt(victim, out);
                preempted_any = true;
            }
            if i >= self.running.len() {
                break;
            }
            let held = self.held.get_mut(&id).expect("a running request is held");
            held.blocks.extend(self.pool.alloc(short, held.owner));
            i += 1;
        }
        preempted_any
    }

    /// Takes `victim` (already out of the batch) off the pool; it waits to rejoin, oldest first.
    fn preempt(&mut self, victim: Running, out: &mut Vec<SchedulerOutput<E>>) {
        self.context_tokens -= victim.context;
        let held = self.held.get_mut(&victim.id).expect("a running request is held");
        let blocks = std::mem::take(&mut held.blocks);
        let owner = held.owner;
        let bad = self.pool.release(&blocks, owner);
        if !bad.is_empty() {
            out.push(SchedulerOutput::DoubleFree { request: victim.id, blocks: bad });
        }
        // The newest running request is preempted first, so pushing to the front keeps the
        // queue oldest first.
        self.preempted.push_front(victim);
        self.preemptions_total += 1;
        out.push(SchedulerOutput::Preempted(victim.id));
    }

    /// Preempted requests rejoin, oldest first, while the batch has room and the pool their
    /// whole context (plus the watermark when the batch is not empty); this step recomputes it.
    fn resume_preempted(&mut self, watermark: usize, out: &mut Vec<SchedulerOutput<E>>) {
        while let Some(&r) = self.preempted.front() {
            let busy = self.running.len() + self.ready.len() + self.pending.len();
            let short = self.blocks_short(r.context, 0);
            let spare = if busy > 0 { watermark } else { 0 };
            if busy >= self.limits.max_batch || self.pool.available() < short.saturating_add(spare) {
                break;
            }
            self.preempted.pop_front();
            let held = self.held.get_mut(&r.id).expect("a preempted request is held");
            held.blocks = self.pool.alloc(short, held.owner);
            self.context_tokens += r.context;
            self.recompute_tokens += r.context;
            self.running.push(r);
            out.push(SchedulerOutput::Resumed { request: r.id, tokens: r.context });
        }
    }

    /// Step `step` begins with `new` requests admitted: the barrier, then every worker, hears
    /// of it, and of requests still queued.
    fn announce(&mut self, step: u64, new: Vec<RecvRequest>, out: &mut Vec<SchedulerOutput<E>>) {
        // The barrier admits the step before any worker hears of it (a worker with nothing to
        // dial votes at once).
        self.handle_group_event(GroupEvent::StepBegin { step }, out);
        for member in (0..self.limits.width).map(TpRank) {
            out.push(SchedulerOutput::ToMember {
                member,
                event: DecodeEvent::StepBegin { step, requests: new.clone() },
            });
        }
        // Requests that stay queued behind a full batch or pool: the workers lease them until
        // they are admitted, so their prefill blocks are not reaped meanwhile.
        if self.told < self.waiting.len() {
            let queued: Vec<RecvRequest> =
                self.waiting.iter().skip(self.told).map(|(r, _)| r.clone()).collect();
            self.told = self.waiting.len();
            self.queued_total += queued.len() as u64;
            for member in (0..self.limits.width).map(TpRank) {
                out.push(SchedulerOutput::ToMember {
                    member,
                    event: DecodeEvent::Queued { requests: queued.clone() },
                });
            }
        }
    }

    /// An input for the group's barrier (a vote, a step report, a lost member).
    pub fn handle_group_event(&mut self, event: GroupEvent, out: &mut Vec<SchedulerOutput<E>>) {
        let mut actions = Vec::new();
        self.barrier.handle(event, &mut actions);
        out.extend(actions.into_iter().map(SchedulerOutput::Group));
    }

    /// Rank `member` received `request` (`Ok`) or failed it. Once every rank reported, the
    /// request joins (`Joined`) or ends failed (`Failed`, its blocks freed).
    pub fn handle_report(
        &mut self,
        request: RequestId,
        member: TpRank,
        result: Result<(), E>,
        out: &mut Vec<SchedulerOutput<E>>,
    ) {
        match self.pending.report(request, member, result) {
            None => {}
            Some(Joined::Received) => {
                self.ready.push(request);
                out.push(SchedulerOutput::Joined(request));
            }
            Some(Joined::Failed(errors)) => {
                self.free(request, out);
                out.push(SchedulerOutput::Failed { request, errors });
            }
        }
    }

    /// Every member entered the forward: every running request gets a token; finished ones
    /// leave the batch and free their blocks.
    pub fn handle_forward(&mut self, out: &mut Vec<SchedulerOutput<E>>) -> Forwarded {
        let mut done = Forwarded::default();
        let mut context_done = 0u64;
        // Every request of the batch grows by one token; finished ones leave with theirs.
        self.context_tokens += self.running.len() as u64;
        self.running.retain_mut(|r| {
            r.left -= 1;
            r.context += 1;
            if r.first {
                r.first = false;
                done.first.push(r.id);
            } else {
                done.continuing += 1;
            }
            if r.left == 0 {
                done.finished.push(r.id);
                context_done += r.context;
                return false;
            }
            true
        });
        self.context_tokens -= context_done;
        for &id in &done.finished {
            self.free(id, out);
        }
        done
    }

    /// Takes the waiting requests `take` picks out of the queue (a driver holding them back),
    /// keeping the others in order. Workers told of a taken request stop leasing it.
    pub fn take_waiting(
        &mut self,
        mut take: impl FnMut(&RecvRequest) -> bool,
        out: &mut Vec<SchedulerOutput<E>>,
    ) -> Vec<RecvRequest> {
        let mut taken = Vec::new();
        let mut untold = Vec::new();
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        let mut told = 0;
        for (i, (recv, tokens)) in std::mem::take(&mut self.waiting).into_iter().enumerate() {
            if take(&recv) {
                if i < self.told {
                    untold.push(recv.request);
                }
                taken.push(recv);
            } else {
                told += usize::from(i < self.told);
                kept.push_back((recv, tokens));
            }
        }
        self.waiting = kept;
        self.told = told;
        self.dequeue(untold, out);
        taken
    }

    /// Tells every worker to stop leasing `requests`, which they were told are queued.
    fn dequeue(&self, requests: Vec<RequestId>, out: &mut Vec<SchedulerOutput<E>>) {
        if requests.is_empty() {
            return;
        }
        for member in (0..self.limits.width).map(TpRank) {
            out.push(SchedulerOutput::ToMember {
                member,
                event: DecodeEvent::Dequeued { requests: requests.clone() },
            });
        }
    }

    /// Ends every request the group has, its barrier kept (a group that lost a member stays
    /// stopped: no later step begins), and tells the workers to stop leasing the queued ones;
    /// the pool is whole again. Returns the requests in the order waiting, waiting for reports,
    /// joining, running, preempted.
    pub fn drain(&mut self, out: &mut Vec<SchedulerOutput<E>>) -> Vec<RequestId> {
        let told: Vec<RequestId> = self.waiting.iter().take(self.told).map(|(r, _)| r.request).collect();
        self.dequeue(told, out);
        let mut lost: Vec<RequestId> = self.waiting.drain(..).map(|(r, _)| r.request).collect();
        lost.extend(self.pending.take_all());
        lost.append(&mut self.ready);
        lost.extend(self.running.drain(..).map(|r| r.id));
        lost.extend(self.preempted.drain(..).map(|r| r.id));
        self.told = 0;
        self.context_tokens = 0;
        self.held.clear();
        self.pool = Pool::new(self.limits.pool_blocks);
        lost
    }

    /// The group restarts empty with its workers (its engine crashed), with a fresh barrier and
    /// pool. Returns what [`Self::drain`] does; the new workers need telling nothing.
    pub fn reset(&mut self) -> Vec<RequestId> {
        let lost = self.drain(&mut Vec::new());
        *self = DecodeScheduler::new(self.limits, self.handshake);
        lost
    }

    /// Returns `request`'s blocks to the pool; blocks it did not hold are a double free.
    fn free(&mut self, request: RequestId, out: &mut Vec<SchedulerOutput<E>>) {
        let Some(held) = self.held.remove(&request) else { return };
        let bad = self.pool.release(&held.blocks, held.owner);
        if !bad.is_empty() {
            out.push(SchedulerOutput::DoubleFree { request, blocks: bad });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::EngineId;
    use pdkv_core::params::KvTransferParams;
    use pdkv_core::ports::EngineAddress;

    /// One input of a script, with the request numbers it names.
    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// Request `n` arrives needing `blocks` prompt blocks and `output` tokens.
        Arrive {
            n: u64,
            blocks: usize,
            output: u32,
        },
        Step,
        /// Rank `rank` reports request `n`, failed or not.
        Report {
            n: u64,
            rank: u16,
            failed: bool,
        },
        Forward,
        /// The driver takes request `n` out of the queue.
        Take(u64),
        Reset,
    }
    use Op::*;

    fn recv(n: u64, blocks: usize) -> RecvRequest {
        RecvRequest {
            request: RequestId(n),
            prefill_engine: EngineId::prefill(0),
            prefill_address: EngineAddress {
                host: "p".into(),
                handshake_port_base: 6301,
                notify_port_base: 61005,
            },
            params: KvTransferParams { remote_block_ids: vec![0; blocks].into(), ..Default::default() },
            local_block_ids: Vec::new(),
        }
    }

    fn ids(requests: &[RecvRequest]) -> String {
        let ids: Vec<String> = requests.iter().map(|r| r.request.0.to_string()).collect();
        ids.join(",")
    }

    /// What an input did, compactly: rank 0's inputs (every rank gets the same), the barrier's
    /// decisions, the forward's result, and the pool's free blocks after it.
    fn render(s: &mut DecodeScheduler<&'static str>, op: Op, step: &mut u64) -> String {
        let mut out = Vec::new();
        let mut said = Vec::new();
        match op {
            Arrive { n, blocks, output } => s.handle_arrival(recv(n, blocks), Tokens { input: 16, output }),
            Step => {
                *step += 1;
                s.handle_step_begin(*step, &mut out);
            }
            Report { n, rank, failed } => s.handle_report(
                RequestId(n),
                TpRank(rank),
                if failed { Err("why") } else { Ok(()) },
                &mut out,
            ),
            Forward => {
                let f = s.handle_forward(&mut out);
                let first: Vec<String> = f.first.iter().map(|r| r.0.to_string()).collect();
                let fin: Vec<String> = f.finished.iter().map(|r| r.0.to_string()).collect();
                said.push(format!("first[{}] more{} done[{}]", first.join(","), f.continuing, fin.join(",")));
            }
            Take(n) => {
                let took = s.take_waiting(|r| r.request == RequestId(n), &mut out);
                said.push(format!("took[{}]", ids(&took)));
            }
            Reset => {
                let lost: Vec<String> = s.reset().iter().map(|r| r.0.to_string()).collect();
                said.push(format!("lost[{}]", lost.join(",")));
            }
        }
        for o in out {
            match o {
                SchedulerOutput::ToMember {
                    member: TpRank(0),
                    event: DecodeEvent::StepBegin { requests, .. },
                } => {
                    let blocks: Vec<String> =
                        requests.iter().map(|r| format!("{:?}", r.local_block_ids)).collect();
                    said.push(format!("begin[{}]{}", ids(&requests), blocks.join("")));
                }
                SchedulerOutput::ToMember { member: TpRank(0), event: DecodeEvent::Queued { requests } } => {
                    said.push(format!("queued[{}]", ids(&requests)))
                }
                SchedulerOutput::ToMember {
                    member: TpRank(0),
                    event: DecodeEvent::Dequeued { requests },
                } => {
                    let ids: Vec<String> = requests.iter().map(|r| r.0.to_string()).collect();
                    said.push(format!("dequeued[{}]", ids.join(",")))
                }
                SchedulerOutput::ToMember { .. } | SchedulerOutput::Group(_) => {}
                SchedulerOutput::Joined(r) => said.push(format!("joined{}", r.0)),
                SchedulerOutput::Failed { request, errors } => {
                    let ranks: Vec<String> = errors.iter().map(|(m, _)| m.0.to_string()).collect();
                    said.push(format!("failed{} by[{}]", request.0, ranks.join(",")))
                }
                SchedulerOutput::DoubleFree { request, .. } => said.push(format!("double-free{}", request.0)),
                SchedulerOutput::Preempted(r) => said.push(format!("preempted{}", r.0)),
                SchedulerOutput::Resumed { request, tokens } => {
                    said.push(format!("resumed{}+{tokens}", request.0))
                }
            }
        }
        said.push(format!("free{} batch{}", s.free_blocks(), s.batch_len()));
        said.join(" ")
    }

    /// Runs `script` on a group of two ranks, a batch of `max_batch` and a pool of `blocks`
    /// blocks of 16 tokens, and compares what each input did with the table.
    fn check(max_batch: usize, blocks: u32, script: &[(Op, &str)]) -> DecodeScheduler<&'static str> {
        check_allocating(KvAllocation::Reserve, max_batch, blocks, script)
    }

    /// [`check`] with the pool allocating as `allocation` says.
    fn check_allocating(
        allocation: KvAllocation,
        max_batch: usize,
        blocks: u32,
        script: &[(Op, &str)],
    ) -> DecodeScheduler<&'static str> {
        let limits =
            SchedulerLimits { width: 2, max_batch, pool_blocks: blocks, block_size_tokens: 16, allocation };
        let mut s = DecodeScheduler::new(limits, HandshakeMode::Eager);
        let mut step = 0;
        for (i, (op, expected)) in script.iter().enumerate() {
            assert_eq!(render(&mut s, *op, &mut step), *expected, "input {i}: {op:?}");
        }
        s
    }

    #[test]
    fn admission_takes_the_head_while_pool_and_batch_have_room_and_never_skips_it() {
        check(
            4,
            6,
            &[
                // Prompt blocks plus one block for up to 16 tokens of answer.
                (Arrive { n: 1, blocks: 2, output: 1 }, "free6 batch0"),
                (Arrive { n: 2, blocks: 3, output: 16 }, "free6 batch0"),
                (Arrive { n: 3, blocks: 1, output: 1 }, "free6 batch0"),
                // Request 2 does not fit after 1; 3 would, but the head is never skipped. The
                // queued ones are told once, and only the prompt's blocks go to the workers.
                (Step, "begin[1][0, 1] queued[2,3] free3 batch0"),
                (Report { n: 1, rank: 0, failed: false }, "free3 batch0"),
                (Report { n: 1, rank: 1, failed: false }, "joined1 free3 batch0"),
                // Nothing new to tell: no queued message.
                (Step, "begin[] free3 batch1"),
                (Forward, "first[1] more0 done[1] free6 batch0"),
                (Step, "begin[2,3][3, 4, 5][1] free0 batch0"),
            ],
        );
    }

    #[test]
    fn on_demand_grows_at_block_boundaries_preempts_the_newest_and_resumes_oldest_first() {
        let on_demand = KvAllocation::OnDemand { watermark_blocks: 0 };
        let s = check_allocating(
            on_demand,
            4,
            3,
            &[
                // Prompts of 16 tokens: one block each at admission, none for the answer.
                (Arrive { n: 1, blocks: 1, output: 3 }, "free3 batch0"),
                (Arrive { n: 2, blocks: 1, output: 20 }, "free3 batch0"),
                (Arrive { n: 3, blocks: 1, output: 20 }, "free3 batch0"),
                (Step, "begin[1,2,3][0][1][2] free0 batch0"),
                (Report { n: 1, rank: 0, failed: false }, "free0 batch0"),
                (Report { n: 1, rank: 1, failed: false }, "joined1 free0 batch0"),
                (Report { n: 2, rank: 0, failed: false }, "free0 batch0"),
                (Report { n: 2, rank: 1, failed: false }, "joined2 free0 batch0"),
                (Report { n: 3, rank: 0, failed: false }, "free0 batch0"),
                (Report { n: 3, rank: 1, failed: false }, "joined3 free0 batch0"),
                // 16 tokens of context fit their one block.
                (Step, "begin[] free0 batch3"),
                (Forward, "first[1,2,3] more0 done[] free0 batch3"),
                // The 17th token needs a second block: 1 gets the newest's (3); 2 would have to
                // preempt itself, and is (its block goes back too).
                (Step, "preempted3 preempted2 begin[] free1 batch1"),
                (Forward, "first[] more1 done[] free1 batch1"),
                // No room for 2's 17 tokens yet, so nothing else is admitted either.
                (Step, "begin[] free1 batch1"),
                (Forward, "first[] more1 done[1] free3 batch0"),
                // The oldest preempted request rejoins, recomputing its context; 3 waits.
                (Step, "resumed2+17 begin[] free1 batch1"),
            ],
        );
        assert_eq!((s.preemptions_total(), s.recompute_tokens(), s.has_work()), (2, 17, true));
    }

    #[test]
    fn on_demand_admits_on_the_prompt_alone_and_leaves_the_watermark_once_the_batch_is_busy() {
        check_allocating(
            KvAllocation::OnDemand { watermark_blocks: 1 },
            4,
            3,
            &[
                (Arrive { n: 1, blocks: 1, output: 100 }, "free3 batch0"),
                (Arrive { n: 2, blocks: 1, output: 100 }, "free3 batch0"),
                (Arrive { n: 3, blocks: 1, output: 100 }, "free3 batch0"),
                // 1 needs no spare block (nothing scheduled yet); 2 leaves one; 3 would not.
                (Step, "begin[1,2][0][1] queued[3] free1 batch0"),
            ],
        );
    }

    #[test]
    fn the_batch_limit_counts_requests_waiting_for_reports() {
        check(
            1,
            100,
            &[
                (Arrive { n: 1, blocks: 1, output: 2 }, "free100 batch0"),
                (Arrive { n: 2, blocks: 1, output: 2 }, "free100 batch0"),
                (Step, "begin[1][0] queued[2] free98 batch0"),
                (Step, "begin[] free98 batch0"),
                (Report { n: 1, rank: 1, failed: false }, "free98 batch0"),
                (Report { n: 1, rank: 0, failed: false }, "joined1 free98 batch0"),
                (Step, "begin[] free98 batch1"),
                (Forward, "first[1] more0 done[] free98 batch1"),
                (Forward, "first[] more1 done[1] free100 batch0"),
                (Step, "begin[2][2] free98 batch0"),
            ],
        );
    }

    #[test]
    fn a_failed_request_frees_its_blocks_once_every_rank_reported() {
        check(
            4,
            10,
            &[
                (Arrive { n: 1, blocks: 3, output: 1 }, "free10 batch0"),
                (Step, "begin[1][0, 1, 2] free6 batch0"),
                (Report { n: 1, rank: 1, failed: true }, "free6 batch0"),
                (Report { n: 1, rank: 0, failed: true }, "failed1 by[1,0] free10 batch0"),
                // A late repeat of a decided request changes nothing.
                (Report { n: 1, rank: 0, failed: false }, "free10 batch0"),
                (Step, "begin[] free10 batch0"),
            ],
        );
    }

    #[test]
    fn taking_a_queued_request_keeps_the_others_told() {
        let s = check(
            4,
            2,
            &[
                (Arrive { n: 1, blocks: 2, output: 16 }, "free2 batch0"),
                (Arrive { n: 2, blocks: 1, output: 1 }, "free2 batch0"),
                (Step, "begin[] queued[1,2] free2 batch0"),
                (Arrive { n: 3, blocks: 1, output: 1 }, "free2 batch0"),
                // The workers were told of 1: they stop leasing it. 3 was never told.
                (Take(1), "took[1] dequeued[1] free2 batch0"),
                (Take(3), "took[3] free2 batch0"),
                (Arrive { n: 3, blocks: 1, output: 1 }, "free2 batch0"),
                // 2 was told already; only 3 is news.
                (Step, "begin[2][0] queued[3] free0 batch0"),
            ],
        );
        // 1 and 2 at the first step, 3 at the second (1 was taken back and never returned).
        assert_eq!(s.queued_total(), 3);
    }

    #[test]
    fn a_reset_loses_every_request_in_stage_order_and_empties_the_pool() {
        check(
            2,
            100,
            &[
                (Arrive { n: 1, blocks: 1, output: 5 }, "free100 batch0"),
                (Step, "begin[1][0] free98 batch0"),
                (Report { n: 1, rank: 0, failed: false }, "free98 batch0"),
                (Report { n: 1, rank: 1, failed: false }, "joined1 free98 batch0"),
                (Arrive { n: 2, blocks: 1, output: 5 }, "free98 batch0"),
                (Arrive { n: 3, blocks: 1, output: 5 }, "free98 batch0"),
                (Step, "begin[2][2] queued[3] free96 batch1"),
                (Reset, "lost[3,2,1] free100 batch0"),
                // The restarted group tells nothing of the lost requests.
                (Step, "begin[] free100 batch0"),
            ],
        );
    }

    #[test]
    fn a_drained_group_keeps_its_barrier_so_a_lost_member_still_stops_it() {
        let limits = SchedulerLimits {
            width: 2,
            max_batch: 4,
            pool_blocks: 10,
            block_size_tokens: 16,
            allocation: KvAllocation::Reserve,
        };
        let mut s = DecodeScheduler::<&str>::new(limits, HandshakeMode::Eager);
        let mut out = Vec::new();
        s.handle_arrival(recv(1, 2), Tokens { input: 16, output: 4 });
        s.handle_step_begin(1, &mut out);
        s.handle_group_event(GroupEvent::MemberLost { member: TpRank(1) }, &mut out);
        s.handle_arrival(recv(2, 20), Tokens { input: 16, output: 4 });
        s.handle_step_begin(2, &mut out);
        out.clear();
        assert_eq!(s.drain(&mut out), vec![RequestId(2), RequestId(1)]);
        let told = out.iter().filter(|o| {
            matches!(o, SchedulerOutput::ToMember { event: DecodeEvent::Dequeued { requests }, .. }
                if requests == &[RequestId(2)])
        });
        assert_eq!(told.count(), 2, "both workers stop leasing the queued request: {out:?}");
        assert_eq!((s.free_blocks(), s.has_work(), s.pending_len()), (10, false, 0));
        assert!(!s.barrier().may_begin(), "a group with a lost member begins no step");
        assert_eq!(s.reset(), Vec::<RequestId>::new());
        assert!(s.barrier().may_begin(), "a restarted group begins steps again");
    }
}
