//! A prefill DP group's scheduler, written once for every driver: the requests it queues, vLLM's
//! chunked prefill plan of each step under a token budget, admission by pool space, the requests
//! that leave with their blocks once their last chunk is computed, the frees of those blocks,
//! and how long the group stalled for blocks; and the prefill engines and workers routed to
//! each other (`nodes.rs`), for a driver that runs the workers.

use std::collections::VecDeque;

use pdkv_core::ids::RequestId;

use crate::pool::Pool;

mod nodes;

pub use nodes::{PrefillNodes, PrefillOutput};

/// The budget of a driver that does not chunk: every admitted request's whole prompt in one step.
pub const WHOLE_PROMPTS: u64 = u64::MAX;

/// A request waiting for admission.
#[derive(Clone, Copy, Debug)]
struct Queued {
    id: RequestId,
    prompt_tokens: u32,
    owner: u32,
}

/// A request between admission and its last chunk.
#[derive(Clone, Debug)]
struct Prefilling {
    id: RequestId,
    prompt_tokens: u32,
    owner: u32,
    /// Its blocks, allocated for the whole prompt at admission.
    blocks: Vec<u32>,
    /// Prompt tokens computed in earlier steps.
    done_tokens: u32,
    /// Prompt tokens of the step in progress (0 when the step does not include it).
    chunk_tokens: u32,
}

/// Part of one request's prompt that a step computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// The request.
    pub request: RequestId,
    /// Prompt tokens of this step.
    pub tokens: u32,
    /// Prompt tokens of the request computed in earlier steps: this chunk's tokens attend to
    /// them as well as to each other, so its attention costs more the later it comes.
    pub context_tokens: u32,
}

/// What a step computes: the chunks in admission order (requests that continue first, then the
/// ones this step admitted), and their prompt tokens in all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Requests with a chunk in this step, in admission order.
    pub chunks: Vec<Chunk>,
    /// The chunks' tokens in all; 0 when the step has nothing to compute.
    pub tokens: u64,
}

/// A request whose whole prompt is computed: it leaves the group with its blocks, which stay
/// held (by `owner`) until the driver frees them ([`PrefillScheduler::handle_free`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefilled {
    /// The request.
    pub request: RequestId,
    /// The owner number its blocks are held by (the driver's, from its arrival).
    pub owner: u32,
    /// Its blocks, in the order they were handed out.
    pub blocks: Vec<u32>,
}

/// What a finished step did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepDone {
    /// Requests whose last chunk the step computed, in admission order.
    pub finished: Vec<Prefilled>,
    /// Whether the step computed any chunk at all (a rank that only kept its EP peers company
    /// computed none).
    pub computed: bool,
}

/// A free named blocks its owner did not hold: freed already, never handed out, or another
/// request's. A bug of whoever freed them; the pool is left as it was for those blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DoubleFree {
    /// The blocks the owner did not hold, last first (the order they were freed in).
    pub blocks: Vec<u32>,
}

/// One prefill DP group's scheduler (every TP rank of the group holds the same block ids).
///
/// Requests arrive ([`Self::handle_arrival`]) with their prompt length and the owner number the
/// driver holds their blocks by. A step's plan ([`Self::plan_step`]) is vLLM's chunked prefill
/// under a budget of prompt tokens: requests already prefilling continue first, in admission
/// order, each with as much of its prompt as the budget leaves; then queued requests are
/// admitted in arrival order while the budget lasts and the pool has blocks for their whole
/// prompt. The queue never skips its head: a head that does not fit stops admission even when a
/// later request would fit. A prompt longer than the budget is spread over several steps, and
/// several short ones share one. When the step is done ([`Self::handle_step_done`]) the
/// requests whose last chunk it computed leave with their blocks; the driver frees those later
/// ([`Self::handle_free`]), when the transfer ends.
///
/// A driver that does not chunk plans with [`WHOLE_PROMPTS`] and ends the step at once: every
/// request that fits is admitted and leaves whole, in vLLM's block order.
///
/// Time enters only as `now_ns` of a plan, for the stall: from a plan that finds work but
/// computes nothing (the head waits for blocks) to the next plan that computes something.
#[derive(Clone, Debug)]
pub struct PrefillScheduler {
    block_size_tokens: u32,
    pool: Pool,
    queue: VecDeque<Queued>,
    /// Requests being prefilled, in admission order.
    running: Vec<Prefilling>,
    /// A planned step is in progress (until [`Self::handle_step_done`]).
    stepping: bool,
    stalled_since_ns: Option<u64>,
    stall_ns: u64,
}

impl PrefillScheduler {
    /// An empty group with a pool of `pool_blocks` blocks of `block_size_tokens` tokens.
    pub fn new(pool_blocks: u32, block_size_tokens: u32) -> Self {
        assert!(block_size_tokens > 0, "a block holds at least one token");
        PrefillScheduler {
            block_size_tokens,
            pool: Pool::new(pool_blocks),
            queue: VecDeque::new(),
            running: Vec::new(),
            stepping: false,
            stalled_since_ns: None,
            stall_ns: 0,
        }
    }

    /// The group's block pool (who holds which block, for checks of reads).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Requests waiting for admission.
    pub fn queued_len(&self) -> usize {
        self.queue.len()
    }

    /// Requests admitted and not yet wholly prefilled.
    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Whether a step is planned and not yet done.
    pub fn stepping(&self) -> bool {
        self.stepping
    }

    /// Time the group stalled for blocks until `now_ns`, the stall in progress included.
    pub fn stall_ns(&self, now_ns: u64) -> u64 {
        self.stall_ns + self.stalled_since_ns.map_or(0, |since| now_ns.saturating_sub(since))
    }

    /// Request `request`, of `prompt_tokens` prompt tokens, reached the group; its blocks will be
    /// held by `owner` (the driver's number, never [`crate::pool::FREE`]).
    pub fn handle_arrival(&mut self, request: RequestId, prompt_tokens: u32, owner: u32) {
        self.queue.push_back(Queued { id: request, prompt_tokens, owner });
    }

    /// Plans the next step under a budget of `budget_tokens` prompt tokens (see
    /// [`PrefillScheduler`]), admitting queued requests. An empty plan means there is nothing to
    /// compute: no work, the head waiting for blocks (a stall, from `now_ns`), or a step still in
    /// progress (which the plan leaves alone).
    pub fn plan_step(&mut self, now_ns: u64, budget_tokens: u64) -> StepPlan {
        if self.stepping || (self.queue.is_empty() && self.running.is_empty()) {
            return StepPlan::default();
        }
        let block = u64::from(self.block_size_tokens);
        let mut chunks = Vec::new();
        let mut left = budget_tokens;
        for p in self.running.iter_mut() {
            let chunk = u64::from(p.prompt_tokens - p.done_tokens).min(left);
            // `chunk` is at most a prompt's length, a u32.
            p.chunk_tokens = chunk as u32;
            left -= chunk;
            if chunk > 0 {
                chunks.push(Chunk { request: p.id, tokens: p.chunk_tokens, context_tokens: p.done_tokens });
            }
        }
        while left > 0 {
            let Some(head) = self.queue.front() else { break };
            let need = u64::from(head.prompt_tokens).div_ceil(block) as usize;
            if self.pool.available() < need {
                // The head waits for blocks; a later, smaller request waits behind it.
                break;
            }
            let q = self.queue.pop_front().expect("the head exists");
            let chunk = u64::from(q.prompt_tokens).min(left);
            left -= chunk;
            let blocks = self.pool.alloc(need, q.owner);
            if chunk > 0 {
                chunks.push(Chunk { request: q.id, tokens: chunk as u32, context_tokens: 0 });
            }
            self.running.push(Prefilling {
                id: q.id,
                prompt_tokens: q.prompt_tokens,
                owner: q.owner,
                blocks,
                done_tokens: 0,
                chunk_tokens: chunk as u32,
            });
        }
        let tokens = budget_tokens - left;
        if tokens == 0 {
            // Nothing prefilling and the head does not fit in the free blocks: the group stalls
            // until blocks are freed.
            self.stalled_since_ns.get_or_insert(now_ns);
        } else {
            if let Some(since) = self.stalled_since_ns.take() {
                self.stall_ns += now_ns.saturating_sub(since);
            }
            self.stepping = true;
        }
        StepPlan { chunks, tokens }
    }

    /// The planned step is done: its chunks are computed. Requests whose last chunk it was leave
    /// with their blocks, in admission order; the rest continue at the next plan. Without a step
    /// in progress nothing changes.
    pub fn handle_step_done(&mut self) -> StepDone {
        let mut done = StepDone::default();
        if !std::mem::take(&mut self.stepping) {
            return done;
        }
        let mut continuing = Vec::with_capacity(self.running.len());
        for mut p in self.running.drain(..) {
            done.computed |= p.chunk_tokens > 0;
            p.done_tokens += std::mem::take(&mut p.chunk_tokens);
            if p.done_tokens >= p.prompt_tokens {
                done.finished.push(Prefilled { request: p.id, owner: p.owner, blocks: p.blocks });
            } else {
                continuing.push(p);
            }
        }
        self.running = continuing;
        done
    }

    /// Frees `blocks` held by `owner` (a finished request's, when its transfer ends), last block
    /// first as vLLM frees them. Blocks `owner` did not hold are left alone and named.
    pub fn handle_free(&mut self, owner: u32, blocks: &[u32]) -> Result<(), DoubleFree> {
        let bad = self.pool.release(blocks, owner);
        if bad.is_empty() {
            Ok(())
        } else {
            Err(DoubleFree { blocks: bad })
        }
    }

    /// Takes every queued request out (a driver failing them), in arrival order.
    pub fn take_queued(&mut self) -> Vec<RequestId> {
        self.queue.drain(..).map(|q| q.id).collect()
    }

    /// The group is lost (its engine crashed): it restarts empty, with a fresh pool of the same
    /// size and no step in progress. Returns every request it had: the queued ones in arrival
    /// order, then the prefilling ones in admission order. A stall in progress ends uncounted
    /// (the group no longer waits for anything); the stall time counted so far stays.
    pub fn reset(&mut self) -> Vec<RequestId> {
        let mut lost = self.take_queued();
        lost.extend(self.running.drain(..).map(|p| p.id));
        self.pool = Pool::new(self.pool.capacity());
        self.stepping = false;
        self.stalled_since_ns = None;
        lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One input of a script, with the request numbers it names (request `n` is owner `n`).
    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// Request `n` arrives with `tokens` prompt tokens.
        Arrive {
            n: u64,
            tokens: u32,
        },
        /// A step is planned at `now` with a budget of `budget` tokens.
        Plan {
            now: u64,
            budget: u64,
        },
        /// The step is done.
        Done,
        /// Request `n`'s blocks (as it left with them) are freed.
        Free(u64),
        /// Owner `n` frees these blocks.
        FreeBlocks(u64, &'static [u32]),
        Reset,
    }
    use Op::*;

    fn list<T: ToString>(items: impl IntoIterator<Item = T>) -> String {
        items.into_iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
    }

    /// Runs `script` on a group of `blocks` blocks of 16 tokens and compares what each input did
    /// with the table: a plan's chunks (`request:tokens`) and total, a step's finished requests
    /// with their blocks, a free's double free, a reset's lost requests; then the queue, the
    /// running requests, the free blocks and the stall so far (at the last plan's time).
    fn check(blocks: u32, script: &[(Op, &str)]) {
        let mut s = PrefillScheduler::new(blocks, 16);
        let mut held = std::collections::BTreeMap::new();
        let mut now = 0;
        for (i, (op, expected)) in script.iter().enumerate() {
            let said = match *op {
                Arrive { n, tokens } => {
                    s.handle_arrival(RequestId(n), tokens, n as u32);
                    String::new()
                }
                Plan { now: t, budget } => {
                    now = t;
                    let plan = s.plan_step(t, budget);
                    let chunks = plan.chunks.iter().map(|c| format!("{}:{}", c.request.0, c.tokens));
                    format!("plan[{}]={} ", list(chunks), plan.tokens)
                }
                Done => {
                    let done = s.handle_step_done();
                    let finished: Vec<String> =
                        done.finished.iter().map(|p| format!("{}{:?}", p.request.0, p.blocks)).collect();
                    for p in done.finished {
                        held.insert(p.request.0, (p.owner, p.blocks));
                    }
                    format!("done[{}]{} ", finished.join(","), if done.computed { "" } else { " idle" })
                }
                Free(n) => {
                    let (owner, blocks) = held.get(&n).cloned().unwrap_or((n as u32, Vec::new()));
                    match s.handle_free(owner, &blocks) {
                        Ok(()) => String::new(),
                        Err(e) => format!("double-free{:?} ", e.blocks),
                    }
                }
                FreeBlocks(n, blocks) => match s.handle_free(n as u32, blocks) {
                    Ok(()) => String::new(),
                    Err(e) => format!("double-free{:?} ", e.blocks),
                },
                Reset => format!("lost[{}] ", list(s.reset().iter().map(|r| r.0))),
            };
            let state = format!(
                "{said}q{} r{} free{} stall{}",
                s.queued_len(),
                s.running_len(),
                s.pool().available(),
                s.stall_ns(now)
            );
            assert_eq!(state, *expected, "input {i}: {op:?}");
        }
    }

    #[test]
    fn the_head_is_never_skipped_even_when_a_later_request_fits() {
        check(
            4,
            &[
                (Arrive { n: 1, tokens: 48 }, "q1 r0 free4 stall0"),
                (Arrive { n: 2, tokens: 64 }, "q2 r0 free4 stall0"),
                (Arrive { n: 3, tokens: 16 }, "q3 r0 free4 stall0"),
                // 1 takes 3 blocks; 2 needs 4 of the 1 left, and 3, which would fit, waits behind.
                (Plan { now: 0, budget: 1000 }, "plan[1:48]=48 q2 r1 free1 stall0"),
                (Done, "done[1[0, 1, 2]] q2 r0 free1 stall0"),
                // Still no room for the head: a stall from t=10, and 3 still waits.
                (Plan { now: 10, budget: 1000 }, "plan[]=0 q2 r0 free1 stall0"),
                (Plan { now: 15, budget: 1000 }, "plan[]=0 q2 r0 free1 stall5"),
                (Free(1), "q2 r0 free4 stall5"),
                // The stall ends at t=30. 2 takes the never-used block 3, then 1's, which came
                // back last first; 3 waits for the next free.
                (Plan { now: 30, budget: 1000 }, "plan[2:64]=64 q1 r1 free0 stall20"),
                (Done, "done[2[3, 2, 1, 0]] q1 r0 free0 stall20"),
            ],
        );
    }

    #[test]
    fn a_long_prompt_is_spread_over_steps_and_continues_first() {
        check(
            100,
            &[
                (Arrive { n: 1, tokens: 250 }, "q1 r0 free100 stall0"),
                (Arrive { n: 2, tokens: 40 }, "q2 r0 free100 stall0"),
                // 1's blocks are allocated whole at admission; the budget ends before 2.
                (Plan { now: 0, budget: 100 }, "plan[1:100]=100 q1 r1 free84 stall0"),
                // A plan while the step runs changes nothing.
                (Plan { now: 1, budget: 100 }, "plan[]=0 q1 r1 free84 stall0"),
                (Done, "done[] q1 r1 free84 stall0"),
                (Plan { now: 2, budget: 100 }, "plan[1:100]=100 q1 r1 free84 stall0"),
                (Done, "done[] q1 r1 free84 stall0"),
                // 1's last 50 tokens, then 2 shares the step with what the budget leaves.
                (Plan { now: 3, budget: 100 }, "plan[1:50,2:40]=90 q0 r2 free81 stall0"),
                (
                    Done,
                    "done[1[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],2[16, 17, 18]] q0 r0 free81 stall0",
                ),
                (Done, "done[] idle q0 r0 free81 stall0"),
            ],
        );
    }

    #[test]
    fn several_short_prompts_share_a_step_and_a_chunked_one_finishes_later() {
        check(
            100,
            &[
                (Arrive { n: 1, tokens: 30 }, "q1 r0 free100 stall0"),
                (Arrive { n: 2, tokens: 30 }, "q2 r0 free100 stall0"),
                (Arrive { n: 3, tokens: 70 }, "q3 r0 free100 stall0"),
                (Arrive { n: 4, tokens: 10 }, "q4 r0 free100 stall0"),
                // 3 gets the budget's last 40 tokens; 4 waits for the next step's budget.
                (Plan { now: 0, budget: 100 }, "plan[1:30,2:30,3:40]=100 q1 r3 free91 stall0"),
                (Done, "done[1[0, 1],2[2, 3]] q1 r1 free91 stall0"),
                (Plan { now: 1, budget: 100 }, "plan[3:30,4:10]=40 q0 r2 free90 stall0"),
                (Done, "done[3[4, 5, 6, 7, 8],4[9]] q0 r0 free90 stall0"),
            ],
        );
    }

    #[test]
    fn whole_prompts_admit_every_request_that_fits_in_vllm_block_order() {
        check(
            6,
            &[
                (Arrive { n: 1, tokens: 40 }, "q1 r0 free6 stall0"),
                (Arrive { n: 2, tokens: 20 }, "q2 r0 free6 stall0"),
                (Arrive { n: 3, tokens: 33 }, "q3 r0 free6 stall0"),
                (Plan { now: 0, budget: WHOLE_PROMPTS }, "plan[1:40,2:20]=60 q1 r2 free1 stall0"),
                (Done, "done[1[0, 1, 2],2[3, 4]] q1 r0 free1 stall0"),
                (Plan { now: 0, budget: WHOLE_PROMPTS }, "plan[]=0 q1 r0 free1 stall0"),
                (Free(1), "q1 r0 free4 stall0"),
                // The never-used block 5 first, then 1's blocks, freed last first.
                (Plan { now: 0, budget: WHOLE_PROMPTS }, "plan[3:33]=33 q0 r1 free1 stall0"),
                (Done, "done[3[5, 2, 1]] q0 r0 free1 stall0"),
            ],
        );
    }

    #[test]
    fn a_double_free_is_reported_and_leaves_the_pool_alone() {
        check(
            4,
            &[
                (Arrive { n: 1, tokens: 32 }, "q1 r0 free4 stall0"),
                (Arrive { n: 2, tokens: 16 }, "q2 r0 free4 stall0"),
                (Plan { now: 0, budget: 100 }, "plan[1:32,2:16]=48 q0 r2 free1 stall0"),
                (Done, "done[1[0, 1],2[2]] q0 r0 free1 stall0"),
                (Free(1), "q0 r0 free3 stall0"),
                (Free(1), "double-free[1, 0] q0 r0 free3 stall0"),
                // Another request's block, and one never handed out.
                (FreeBlocks(1, &[2, 3]), "double-free[3, 2] q0 r0 free3 stall0"),
                (Free(2), "q0 r0 free4 stall0"),
            ],
        );
    }

    #[test]
    fn a_reset_loses_the_queue_then_the_prefilling_and_empties_the_pool() {
        check(
            10,
            &[
                (Arrive { n: 1, tokens: 64 }, "q1 r0 free10 stall0"),
                (Arrive { n: 2, tokens: 144 }, "q2 r0 free10 stall0"),
                (Arrive { n: 3, tokens: 16 }, "q3 r0 free10 stall0"),
                (Plan { now: 0, budget: 100 }, "plan[1:64]=64 q2 r1 free6 stall0"),
                (Done, "done[1[0, 1, 2, 3]] q2 r0 free6 stall0"),
                (Arrive { n: 4, tokens: 16 }, "q3 r0 free6 stall0"),
                (Plan { now: 5, budget: 100 }, "plan[]=0 q3 r0 free6 stall0"),
                (Free(1), "q3 r0 free10 stall0"),
                (Plan { now: 7, budget: 100 }, "plan[2:100]=100 q2 r1 free1 stall2"),
                (Reset, "lost[3,4,2] q0 r0 free10 stall2"),
                // The step in progress died with the group.
                (Done, "done[] idle q0 r0 free10 stall2"),
                // 1's blocks are the old pool's: freeing them now is a double free.
                (Free(1), "double-free[3, 2, 1, 0] q0 r0 free10 stall2"),
            ],
        );
    }

    /// A pool smaller than one prompt: the group stalls, never skips the head, never panics,
    /// and nothing behind the head gets in; the stall grows with time.
    #[test]
    fn a_pool_smaller_than_a_prompt_stalls_without_skipping_or_panicking() {
        check(
            2,
            &[
                (Arrive { n: 1, tokens: 48 }, "q1 r0 free2 stall0"),
                (Arrive { n: 2, tokens: 16 }, "q2 r0 free2 stall0"),
                (Plan { now: 100, budget: 64 }, "plan[]=0 q2 r0 free2 stall0"),
                (Done, "done[] idle q2 r0 free2 stall0"),
                (Plan { now: 300, budget: WHOLE_PROMPTS }, "plan[]=0 q2 r0 free2 stall200"),
                (Reset, "lost[1,2] q0 r0 free2 stall0"),
            ],
        );
    }
}
