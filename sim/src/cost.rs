//! The compute-time model: how long a prefill batch and a decode step take on a given layout.
//!
//! Prefill is compute-bound: FLOPs (2 × active parameters per token) over the TP group's FP8
//! throughput at a calibrated utilisation, attention's FLOPs (quadratic in each prompt) over its
//! BF16 throughput, plus the TP all-reduces (two per layer) and, under EP, the busiest rank's
//! experts and the expert all-to-alls (two per MoE layer), plus a fixed per-batch cost. Decode is
//! memory-bound: a fixed per-step cost for streaming weights (scaled by how many GPUs share
//! them), the KV of every running request read from HBM (replicated on every TP rank for MLA,
//! which is why DP attention wins at high concurrency), a per-request overhead, and the same
//! collectives. `docs/sim.md` documents the formulas and the calibration.

use pdkv_core::topology::{Deployment, Layout};

use pdkv_core::ids::Role;

use crate::error::SimError;
use crate::scenario::{CostModel, EngineLimits, Hardware, ModelProfile, Scenario};

/// The constants a run uses, gathered once.
#[derive(Clone, Debug)]
pub struct Cost {
    model: ModelProfile,
    hw: Hardware,
    cost: CostModel,
    /// The engines' `gpu_memory_utilization` (an engine setting, kept with the scheduler limits).
    gpu_memory_utilization: f64,
    /// The serving stack hides the expert all-to-alls behind compute (`sim/src/stack.rs`).
    alltoall_overlap: bool,
}

/// The model's parameters split the way the cost terms use them.
struct Params {
    /// Parameters of one routed expert across all MoE layers (`P_e`).
    expert: f64,
    /// Routed experts (`E`).
    experts: f64,
    /// Experts each token chooses (`k`).
    k: f64,
    /// Everything that is not a routed expert: attention, dense layers, shared experts,
    /// embeddings.
    other: f64,
    /// The active parameters of one token outside the routed experts.
    dense_active: f64,
}

/// One prefill DP group's share of a step: its prompt tokens, and the (query, key) token pairs
/// its chunks' causal attention computes, which grow with the square of a prompt's length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillLoad {
    /// Prompt tokens of the step.
    pub tokens: u64,
    /// Token pairs attention multiplies: each token with itself and every earlier token of its
    /// prompt, the ones computed in earlier chunks included.
    pub attention_pairs: u64,
}

impl PrefillLoad {
    /// The load of `chunks`, each `(context, tokens)`: `tokens` prompt tokens that follow
    /// `context` tokens of the same prompt computed before. A chunk's token at position `p`
    /// attends to `p + 1` tokens, so a chunk costs `tokens · context + tokens · (tokens + 1) / 2`
    /// pairs.
    pub fn of_chunks(chunks: &[(u64, u64)]) -> PrefillLoad {
        chunks.iter().fold(PrefillLoad::default(), |load, &(context, tokens)| PrefillLoad {
            tokens: load.tokens + tokens,
            attention_pairs: load.attention_pairs + tokens * context + tokens * (tokens + 1) / 2,
        })
    }
}

/// One decode DP group's share of a step: its batch size and the context tokens of its batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupLoad {
    /// Requests decoding in the group.
    pub batch: u64,
    /// Sum of their context lengths (prompt plus generated so far).
    pub context_tokens: u64,
}

impl Cost {
    /// The model of one scenario.
    pub fn new(model: &ModelProfile, hw: &Hardware, cost: &CostModel, engines: &EngineLimits) -> Cost {
        Cost {
            model: model.clone(),
            hw: hw.clone(),
            cost: cost.clone(),
            gpu_memory_utilization: engines.gpu_memory_utilization,
            alltoall_overlap: crate::stack::find(&engines.stack).is_some_and(|s| s.alltoall_overlap),
        }
    }

    /// The model of `scenario`.
    pub fn of(scenario: &Scenario) -> Cost {
        Cost::new(&scenario.model, &scenario.hardware, &scenario.cost, &scenario.engines)
    }

    fn params(&self) -> Params {
        let m = &self.model;
        let expert = m.expert_params_per_layer_m * 1e6 * f64::from(m.moe_layers);
        let (experts, k) = (f64::from(m.routed_experts), f64::from(m.experts_per_token));
        Params {
            expert,
            experts,
            k,
            other: (m.total_params_b * 1e9 - experts * expert).max(0.0),
            dense_active: (m.active_params_b * 1e9 - k * expert).max(0.0),
        }
    }

    /// The share of the routed experts one GPU of `layout` holds: `1/ranks` of them under EP,
    /// a `1/tp` slice of each otherwise.
    fn expert_share(layout: Layout) -> f64 {
        if layout.ep {
            1.0 / f64::from(layout.ranks().max(1))
        } else {
            1.0 / f64::from(layout.tp.max(1))
        }
    }

    fn fabric_bytes_per_s(&self) -> f64 {
        self.hw.fabric_gb_s * 1e9 * self.cost.fabric_efficiency
    }

    /// Seconds of the TP all-reduces (two per layer, 16-bit activations) for `tokens` tokens.
    fn tp_allreduce_s(&self, tp: u16, tokens: f64) -> f64 {
        if tp <= 1 {
            return 0.0;
        }
        let bytes = tokens * f64::from(self.model.hidden_size) * 2.0;
        let ring = 2.0 * f64::from(tp - 1) / f64::from(tp);
        f64::from(self.model.layers) * 2.0 * bytes * ring / self.fabric_bytes_per_s()
    }

    /// Seconds of the expert all-to-alls of one rank sending `tokens` tokens: per MoE layer a
    /// dispatch (each token to the ranks of its `k` experts, at most once per rank, 8-bit) and a
    /// combine back (16-bit), each paying a fixed latency (the kernel launch and the slowest
    /// peer) on top of its bytes. Peers on the same node are reached over the scale-up fabric;
    /// once the EP group spans nodes (`ranks > gpus_per_node`), the share of peers on other
    /// nodes goes over the rank's RDMA NIC at the same time, and the slower path sets the time.
    /// Zero without EP.
    fn ep_alltoall_s(&self, layout: Layout, tokens: f64) -> f64 {
        let Some((on_node, off_node)) = self.ep_alltoall_paths_s(layout, tokens) else { return 0.0 };
        let latency = 2.0 * self.cost.alltoall_latency_us / 1e6;
        f64::from(self.model.moe_layers) * (latency + on_node.max(off_node))
    }

    /// Seconds per MoE layer a rank's dispatch and combine of `tokens` tokens spend on the
    /// fabric and on its NIC (each path in parallel); `None` without EP.
    fn ep_alltoall_paths_s(&self, layout: Layout, tokens: f64) -> Option<(f64, f64)> {
        if !layout.ep {
            return None;
        }
        let n = f64::from(layout.ranks());
        let node = f64::from(self.hw.gpus_per_node.max(1)).min(n);
        let copies = f64::from(self.model.experts_per_token).min(n).max(1.0);
        let bytes = tokens * f64::from(self.model.hidden_size) * copies * (1.0 + 2.0);
        // A copy lands on one of the n ranks evenly: itself, another GPU of its node, or a GPU
        // of another node.
        let on_node = bytes * (node - 1.0) / n / self.fabric_bytes_per_s();
        let off_node = bytes * (n - node) / n / (self.hw.nic_gb_s * 1e9);
        Some((on_node, off_node))
    }

    /// Nanoseconds of the expert all-to-alls (dispatch and combine of every MoE layer) of one
    /// rank sending `tokens` tokens: the part of a step `pdkv plan` names as the all-to-all
    /// when it decides what bounds a layout. Zero without EP.
    pub fn ep_alltoall_ns(&self, layout: Layout, tokens: f64) -> u64 {
        (self.ep_alltoall_s(layout, tokens) * 1e9) as u64
    }

    /// Whether an EP group of `layout` spans nodes, so part of its all-to-alls uses the NICs.
    pub fn ep_spans_nodes(&self, layout: Layout) -> bool {
        layout.ep && layout.ranks() > u32::from(self.hw.gpus_per_node)
    }

    /// Share of a step of `step_ns` that a rank's NIC spends on the expert all-to-alls of its
    /// `tokens` tokens (0 while the EP group fits in one node): KV reads share what is left.
    pub fn ep_nic_share(&self, layout: Layout, tokens: f64, step_ns: u64) -> f64 {
        let Some((_, off_node)) = self.ep_alltoall_paths_s(layout, tokens) else { return 0.0 };
        if off_node <= 0.0 || step_ns == 0 {
            return 0.0;
        }
        (f64::from(self.model.moe_layers) * off_node * 1e9 / step_ns as f64).min(1.0)
    }

    /// Seconds one GPU of a TP group of `tp` spends on the attention of `pairs` token pairs:
    /// per pair, layer and query head a query-key product (`2 · qk_head_dim` FLOPs) and a
    /// weighted sum of values (`2 · v_head_dim`), the heads split over the TP ranks. Attention
    /// runs in BF16 (the FP8 checkpoints quantise the linear layers, not attention), at the
    /// same `prefill_mfu` as the linear layers.
    fn prefill_attention_s(&self, tp: u16, pairs: u64) -> f64 {
        let m = &self.model;
        let per_pair = 2.0
            * f64::from(m.attention_heads)
            * f64::from(m.qk_head_dim + m.v_head_dim)
            * f64::from(m.layers);
        let peak = f64::from(tp.max(1)) * self.hw.bf16_tflops * 1e12 * self.cost.prefill_mfu;
        per_pair * pairs as f64 / peak
    }

    /// Nanoseconds one DP group of a prefill engine without EP takes for a batch of `load`:
    /// the linear layers' FLOPs (2 × active parameters per token) over the TP group's FP8
    /// peak at `prefill_mfu`, attention's (quadratic in each prompt's length), the TP
    /// all-reduces and a fixed cost. (Under EP the engine's ranks step together:
    /// [`Cost::prefill_ep_step_ns`].)
    pub fn prefill_batch_ns(&self, layout: Layout, load: PrefillLoad) -> u64 {
        debug_assert!(!layout.ep, "{layout}: an EP engine steps as a whole (prefill_ep_step_ns)");
        let tokens = load.tokens as f64;
        let flops = 2.0 * self.model.active_params_b * 1e9 * tokens;
        let peak = f64::from(layout.tp) * self.hw.fp8_tflops * 1e12 * self.cost.prefill_mfu;
        let seconds = self.cost.prefill_fixed_ms / 1e3
            + flops / peak
            + self.prefill_attention_s(layout.tp, load.attention_pairs)
            + self.tp_allreduce_s(layout.tp, tokens);
        (seconds * 1e9) as u64
    }

    /// Nanoseconds of one step of a DP+EP prefill engine whose DP ranks carry `loads` each (0
    /// tokens for a rank with nothing to prefill, which still takes part), from its mechanism:
    ///
    /// - attention data parallelism: each rank computes attention (quadratic in each prompt)
    ///   and the dense layers (attention projections, dense layers, shared experts) for its
    ///   own tokens only, split over its TP ranks;
    /// - expert parallelism: each rank computes its `1/ranks` of the routed experts for every
    ///   token routed to them, whichever rank it came from; with routing spread evenly the
    ///   busiest rank receives the expected maximum of `ranks` binomial loads, a little over
    ///   the mean ([`Cost::busiest_expert_rank_tokens`]);
    /// - the expert all-to-alls: each rank dispatches its own tokens to their experts' ranks
    ///   and combines the results, over the scale-up fabric inside the node and the NICs across
    ///   nodes ([`Cost::ep_alltoall_s`]), after its compute, or, on a stack that overlaps them
    ///   (two micro-batches, `sim/src/stack.rs`), at the same time: the longer of the two.
    ///
    /// The step waits for the slowest rank. The linear layers run at `prefill_mfu` of the FP8
    /// peak and attention at `prefill_mfu` of the BF16 peak, as under TP: no factor for EP.
    /// So one lone prompt has the whole engine's expert capacity, and at full load the work
    /// per GPU is that of TP plus the all-to-alls.
    pub fn prefill_ep_step_ns(&self, layout: Layout, loads: &[PrefillLoad]) -> u64 {
        let Params { expert: expert_params, dense_active, .. } = self.params();
        let total: u64 = loads.iter().map(|l| l.tokens).sum();
        let tp = f64::from(layout.tp.max(1));
        let peak = self.hw.fp8_tflops * 1e12 * self.cost.prefill_mfu;
        // A rank's experts are split over its TP ranks like everything else.
        let expert_flops = 2.0 * expert_params * self.busiest_expert_rank_tokens(layout, total) / tp;
        let slowest = loads
            .iter()
            .map(|load| {
                let own = load.tokens as f64;
                let dense_flops = 2.0 * dense_active * own / tp;
                let compute = (dense_flops + expert_flops) / peak
                    + self.prefill_attention_s(layout.tp, load.attention_pairs)
                    + self.tp_allreduce_s(layout.tp, own);
                self.after_or_beside(compute, self.ep_alltoall_s(layout, own))
            })
            .fold(0.0, f64::max);
        ((self.cost.prefill_fixed_ms / 1e3 + slowest) * 1e9) as u64
    }

    /// (token, expert) assignments the busiest DP rank of an EP engine computes when its
    /// ranks carry `tokens` in all: each token picks `k` experts, which land on the ranks
    /// evenly, so a rank's load is close to binomial with mean `μ = tokens · k / ranks` and
    /// variance `σ² = μ (1 − 1/ranks)`; the busiest of `ranks` is about `μ + σ √(2 ln ranks)`
    /// (the expected maximum of normal loads). Real routing is skewed towards hot experts,
    /// which this leaves out (the engines' expert load balancers exist to even it).
    pub fn busiest_expert_rank_tokens(&self, layout: Layout, tokens: u64) -> f64 {
        let ranks = f64::from(layout.dp.max(1));
        let mean = tokens as f64 * f64::from(self.model.experts_per_token) / ranks;
        if ranks <= 1.0 {
            return mean;
        }
        mean + (mean * (1.0 - 1.0 / ranks)).sqrt() * (2.0 * ranks.ln()).sqrt()
    }

    /// Seconds one decode DP group of `layout` spends on its share of a step in which the unit
    /// carries `step_tokens` tokens (every DP rank's batch under EP; the group's own without):
    /// the weights it streams or the FLOPs it computes, whichever takes longer, then its batch's
    /// KV, its per-request overhead, a fixed per-step cost and the TP all-reduces.
    ///
    /// Weights: a routed expert is streamed only when at least one token of the step chose it,
    /// which for `T` tokens choosing `k` of `E` experts is a fraction `1 - (1 - k/E)^T` of
    /// them; each rank streams its share of those (`1/ranks` of the experts under EP, `1/tp`
    /// of every expert without), plus its slice of everything else (attention, dense layers,
    /// shared experts), which DP ranks replicate and TP ranks split. So a small batch streams
    /// fewer experts than a large one, and the step grows with load until every expert is
    /// touched; the expert FLOPs (`2 k P_e` per token, the same share) take over past the
    /// GPU's ridge point.
    fn decode_group_s(&self, layout: Layout, load: GroupLoad, step_tokens: u64) -> f64 {
        let m = &self.model;
        let tp = f64::from(layout.tp.max(1));
        let share = Self::expert_share(layout);
        let Params { expert: expert_params, experts, k, other: other_params, dense_active: other_active } =
            self.params();
        let touched = if m.routed_experts == 0 {
            0.0
        } else {
            1.0 - (1.0 - (k / experts).min(1.0)).powf(step_tokens as f64)
        };
        let weight_bytes =
            (experts * touched * expert_params * share + other_params / tp) * m.weight_bytes_per_param;
        let flops =
            2.0 * (k * expert_params * step_tokens as f64 * share + other_active * load.batch as f64 / tp);
        let weights = weight_bytes / (self.hw.hbm_tb_s * 1e12 * self.cost.decode_weight_efficiency);
        let compute = flops / (self.hw.fp8_tflops * 1e12 * self.cost.decode_mfu);
        let per_rank = self.kv_bytes_per_token_per_rank(layout.tp);
        let kv_bytes = load.context_tokens as f64 * f64::from(m.layers) * per_rank;
        let kv = kv_bytes / (self.hw.hbm_tb_s * 1e12 * self.cost.decode_kv_efficiency);
        let overhead = load.batch as f64 * self.cost.decode_per_request_us / 1e6;
        self.cost.decode_fixed_ms / 1e3
            + weights.max(compute)
            + kv
            + overhead
            + self.tp_allreduce_s(layout.tp, load.batch as f64)
    }

    /// KV bytes of one token in one layer on one rank of a TP group of `tp`.
    pub fn kv_bytes_per_token_per_rank(&self, tp: u16) -> f64 {
        let whole = f64::from(self.model.kv_bytes_per_token_per_layer);
        if self.model.use_mla {
            return whole;
        }
        let heads = f64::from(self.model.kv_heads.max(1));
        let per_rank = (heads / f64::from(tp.max(1))).ceil().max(1.0);
        whole * per_rank / heads
    }

    /// Seconds of `compute` and an all-to-all of `alltoall`: their sum, or on a stack that
    /// overlaps them the longer of the two.
    fn after_or_beside(&self, compute: f64, alltoall: f64) -> f64 {
        if self.alltoall_overlap {
            compute.max(alltoall)
        } else {
            compute + alltoall
        }
    }

    /// Nanoseconds of one decode step. Without EP each DP group steps on its own and `loads`
    /// has one entry; under EP every DP rank steps together (idle ones included): the step
    /// lasts as long as the slowest rank, plus the expert all-to-alls of the busiest rank's
    /// tokens, since a dispatch waits for every rank. On a stack that overlaps them the batch
    /// runs as two micro-batches: the longer of their compute, one after the other, and the
    /// all-to-all.
    pub fn decode_step_ns(&self, layout: Layout, loads: &[GroupLoad]) -> u64 {
        let tokens: u64 = loads.iter().map(|l| l.batch).sum();
        let busiest = loads.iter().map(|l| l.batch).max().unwrap_or(0);
        let alltoall = self.ep_alltoall_s(layout, busiest as f64);
        if self.alltoall_overlap && layout.ep {
            // Two micro-batches of half the requests each, computed one after the other while
            // the other's all-to-all is in flight. Each half streams the weights its own tokens
            // touch and pays the per-step costs: a memory-bound step costs nearly twice.
            let half = |l: &GroupLoad| GroupLoad {
                batch: l.batch.div_ceil(2),
                context_tokens: l.context_tokens.div_ceil(2),
            };
            let halves = loads
                .iter()
                .map(|l| 2.0 * self.decode_group_s(layout, half(l), tokens.div_ceil(2)))
                .fold(0.0, f64::max);
            return (halves.max(alltoall) * 1e9) as u64;
        }
        let slowest = loads.iter().map(|l| self.decode_group_s(layout, *l, tokens)).fold(0.0, f64::max);
        let seconds = slowest + alltoall;
        (seconds * 1e9) as u64
    }

    /// Extra time of a decode step in which groups recompute the context of preempted requests
    /// (`tokens` per group, computed side by side): the prompt-like FLOPs at the prefill MFU,
    /// the slowest group deciding a unit's lockstep. No fixed cost: the step pays that already.
    pub fn recompute_ns(&self, layout: Layout, tokens: &[u64]) -> u64 {
        let most = tokens.iter().copied().max().unwrap_or(0);
        if most == 0 {
            return 0;
        }
        let flops = 2.0 * self.model.active_params_b * 1e9 * most as f64;
        let peak = f64::from(layout.tp) * self.hw.fp8_tflops * 1e12 * self.cost.prefill_mfu;
        (flops / peak * 1e9) as u64
    }

    /// Bytes of weights one GPU of `layout` holds: its share of the routed experts (`1/ranks`
    /// of them under EP, a `1/tp` slice of each otherwise) and a `1/tp` slice of everything
    /// else (attention, dense layers, shared experts, embeddings), which DP ranks replicate.
    pub fn weight_bytes_per_gpu(&self, layout: Layout) -> f64 {
        let tp = f64::from(layout.tp.max(1));
        let Params { expert, experts, other, .. } = self.params();
        (experts * expert * Self::expert_share(layout) + other / tp) * self.model.weight_bytes_per_param
    }

    /// Bytes of KV cache one GPU of `layout` holds. With `kv_memory_fraction` 0 (the default)
    /// this is what vLLM's start-up profiling leaves: `gpu_memory_utilization` of HBM, less the
    /// GPU's weights and the activation reserve (its profiled peak, graph pools and
    /// communication buffers). So the pool depends on the layout: a TP8 rank holds an eighth of
    /// every weight, a DP8EP rank an eighth of the experts but the whole of everything else.
    /// Negative when the weights do not fit (the scenario check reports it).
    pub fn kv_bytes_per_gpu(&self, layout: Layout) -> f64 {
        let hbm = self.hw.hbm_gb * 1e9;
        if self.hw.kv_memory_fraction > 0.0 {
            return hbm * self.hw.kv_memory_fraction;
        }
        hbm * self.gpu_memory_utilization
            - self.weight_bytes_per_gpu(layout)
            - self.cost.activation_reserve_gb * 1e9
    }

    /// KV blocks one GPU of `layout` holds: its KV bytes over one block's bytes on that GPU
    /// (at least one, so a scenario whose weights do not fit fails its check, not a division).
    pub fn kv_blocks_per_gpu(&self, layout: Layout) -> u32 {
        let block_bytes = f64::from(self.model.block_size_tokens)
            * f64::from(self.model.layers)
            * self.kv_bytes_per_token_per_rank(layout.tp);
        (self.kv_bytes_per_gpu(layout) / block_bytes).clamp(1.0, f64::from(u32::MAX)) as u32
    }

    /// Bytes of one block of one layer on one rank (the unit of a read).
    pub fn block_bytes_per_layer(&self, tp: u16) -> u64 {
        (f64::from(self.model.block_size_tokens) * self.kv_bytes_per_token_per_rank(tp)) as u64
    }
}

/// Every engine of `d` keeps at least 1 GB per GPU for its KV cache once its weights and the
/// activation reserve are in (checked only when the KV cache is derived from the weights).
pub(crate) fn kv_room(sc: &Scenario, d: &Deployment) -> Result<(), SimError> {
    if sc.hardware.kv_memory_fraction > 0.0 || sc.engines.kv_blocks_per_gpu > 0 {
        return Ok(());
    }
    let cost = Cost::of(sc);
    for role in [Role::Prefill, Role::Decode] {
        for (e, &layout) in d.engines(role).iter().enumerate() {
            let kv = cost.kv_bytes_per_gpu(layout);
            if kv.is_nan() || kv < 1e9 {
                let usable = sc.hardware.hbm_gb * sc.engines.gpu_memory_utilization;
                return Err(SimError::NoKvRoom {
                    engine: format!("{}{e}", role.letter()),
                    layout,
                    detail: format!(
                        "leaves {:.1} GB of KV cache per GPU (under 1 GB): the model's weights take {:.1} GB \
                         of each GPU and the activation reserve {} GB, out of {usable:.1} GB usable ({} GB x \
                         engines.gpu_memory_utilization {}); use more GPUs per engine, or, for a protocol \
                         run on small engines, fix the KV share with hardware.kv_memory_fraction",
                        kv / 1e9,
                        cost.weight_bytes_per_gpu(layout) / 1e9,
                        sc.cost.activation_reserve_gb,
                        sc.hardware.hbm_gb,
                        sc.engines.gpu_memory_utilization,
                    ),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> Cost {
        Cost::new(
            &ModelProfile::default(),
            &Hardware::default(),
            &CostModel::default(),
            &EngineLimits::default(),
        )
    }

    /// Whole prompts of `tokens` each, `count` of them.
    fn prompts(count: u64, tokens: u64) -> PrefillLoad {
        PrefillLoad::of_chunks(&vec![(0, tokens); count as usize])
    }

    #[test]
    fn attention_pairs_table() {
        let check = |chunks: &[(u64, u64)], tokens: u64, pairs: u64| {
            assert_eq!(
                PrefillLoad::of_chunks(chunks),
                PrefillLoad { tokens, attention_pairs: pairs },
                "{chunks:?}"
            );
        };
        check(&[], 0, 0);
        check(&[(0, 1)], 1, 1);
        check(&[(0, 4)], 4, 10);
        // A prompt in two chunks costs what it costs whole: 4 + 4 tokens = 10 + (4·4 + 10).
        check(&[(0, 4), (4, 4)], 8, 36);
        check(&[(0, 8)], 8, 36);
        // Two prompts of 4 attend within themselves only.
        check(&[(0, 4), (0, 4)], 8, 20);
    }

    #[test]
    fn prefill_grows_with_tokens_and_shrinks_with_tp() {
        let c = cost();
        let tp8 = c.prefill_batch_ns(Layout::tp(8), prompts(1, 8192));
        assert!(c.prefill_batch_ns(Layout::tp(8), prompts(2, 8192)) > tp8);
        assert!(c.prefill_batch_ns(Layout::tp(4), prompts(1, 8192)) > tp8);
        // Attention grows with the square of a prompt: one 8K prompt costs more than two 4K
        // prompts of the same tokens, and a late chunk more than an early one.
        assert!(tp8 > c.prefill_batch_ns(Layout::tp(8), prompts(2, 4096)));
        let early = c.prefill_batch_ns(Layout::tp(8), PrefillLoad::of_chunks(&[(0, 2048)]));
        let late = c.prefill_batch_ns(Layout::tp(8), PrefillLoad::of_chunks(&[(6144, 2048)]));
        assert!(late > early, "{late} against {early}");
        // One DP8EP rank prefills an 8K prompt alone (TP1): its attention and dense layers on
        // one GPU, the experts spread over eight, the all-to-alls: several times TP8 (1.9 s
        // against 0.55 s with the defaults).
        let ep = Layout::new(8, 1, true);
        let idle = PrefillLoad::default();
        let mut alone = vec![idle; 8];
        alone[0] = prompts(1, 8192);
        let alone = c.prefill_ep_step_ns(ep, &alone);
        assert!(alone > 3 * tp8, "{alone} ns against {tp8}");
        // At full load each rank also computes its share of everyone's experts: a rank's step
        // is longer than alone, yet eight prompts take less than eight lone steps.
        let full = c.prefill_ep_step_ns(ep, &[prompts(1, 8192); 8]);
        assert!(full > alone && full < 8 * alone, "{full} ns against {alone}");
        // The slowest rank sets the step.
        let mut skewed = vec![idle; 8];
        skewed[0] = prompts(2, 8192);
        assert!(
            c.prefill_ep_step_ns(ep, &skewed) > c.prefill_ep_step_ns(ep, &[prompts(1, 2048); 8]),
            "imbalance costs"
        );
    }

    #[test]
    fn the_busiest_expert_rank_table() {
        let c = cost();
        let check = |dp: u16, tokens: u64, expected: f64| {
            let got = c.busiest_expert_rank_tokens(Layout::new(dp, 1, true), tokens);
            assert!((got - expected).abs() < 0.5, "DP{dp}EP, {tokens} tokens: {got}, expected {expected}");
        };
        // One rank holds every expert: k assignments per token, no imbalance.
        check(1, 1000, 8000.0);
        // μ = 1000 · 8 / 8 = 1000, σ = √(1000 · 7/8) = 29.6, √(2 ln 8) = 2.04: 1060.3.
        check(8, 1000, 1060.3);
        // At a large batch the busiest rank is within 1 % of the mean: μ = 16,384 · 8 = 131,072
        // per rank on 32 ranks, + √(131,072 · 31/32) · √(2 ln 32) = 356.3 · 2.633 = 938.2.
        check(32, 32 * 16_384, 132_010.2);
        check(8, 0, 0.0);
    }

    #[test]
    fn a_stack_that_overlaps_hides_the_all_to_all() {
        let stacked = |stack: &str| {
            let engines = EngineLimits { stack: stack.to_string(), ..EngineLimits::default() };
            Cost::new(&ModelProfile::default(), &Hardware::default(), &CostModel::default(), &engines)
        };
        let (serial, overlapped) = (stacked("vllm"), stacked("sglang"));
        // EP32 over four nodes: the all-to-all is a large share of the step, on the NICs.
        let ep = Layout::new(32, 1, true);
        let loads = vec![prompts(8, 2048); 32];
        let a2a = serial.ep_alltoall_s(ep, 16_384.0);
        let (s, o) = (serial.prefill_ep_step_ns(ep, &loads), overlapped.prefill_ep_step_ns(ep, &loads));
        assert!(o < s, "{o} against {s}");
        // Overlap saves at most the all-to-all.
        assert!((s - o) as f64 / 1e9 <= a2a + 1e-6, "{s} - {o} against {a2a} s");
        let decode = vec![GroupLoad { batch: 128, context_tokens: 128 * 2000 }; 32];
        assert!(overlapped.decode_step_ns(ep, &decode) < serial.decode_step_ns(ep, &decode));
        // Without EP there is nothing to overlap.
        let tp8 = [GroupLoad { batch: 64, context_tokens: 64_000 }];
        assert_eq!(
            overlapped.decode_step_ns(Layout::tp(8), &tp8),
            serial.decode_step_ns(Layout::tp(8), &tp8)
        );
    }

    #[test]
    fn decode_per_token_favours_dp_attention_at_capacity() {
        let c = cost();
        // At capacity (a TP8 pool holds 255 requests of 8K/1K; DP8EP runs 64 a rank here), TP8
        // reads the whole batch's latent on every GPU while DP8EP spreads it over 8 ranks, so a
        // DP8EP step carries more tokens for its time.
        let ctx = 9000;
        let tp8 = c.decode_step_ns(Layout::tp(8), &[GroupLoad { batch: 255, context_tokens: 255 * ctx }]);
        let per_rank = GroupLoad { batch: 64, context_tokens: 64 * ctx };
        let dp8 = c.decode_step_ns(Layout::new(8, 1, true), &[per_rank; 8]);
        assert!(dp8 as f64 / 512.0 < tp8 as f64 / 255.0, "dp8ep {dp8} ns for 512, tp8 {tp8} ns for 255");
        assert_eq!(c.block_bytes_per_layer(8), 16 * 576);
    }

    #[test]
    fn the_kv_cache_is_what_the_weights_leave() {
        let c = cost();
        // 192 GB x 0.92 = 176.6 GB usable, less 10 GB of activations. TP8 holds an eighth of
        // DeepSeek-R1's 671 GB; DP8EP an eighth of the 654 GB of routed experts but all 17 GB
        // of the rest; TP4 would need 168 GB of weights per GPU.
        let check = |layout: Layout, weights_gb: f64, kv_gb: f64| {
            let (w, kv) = (c.weight_bytes_per_gpu(layout) / 1e9, c.kv_bytes_per_gpu(layout) / 1e9);
            assert!(
                (w - weights_gb).abs() < 0.1 && (kv - kv_gb).abs() < 0.1,
                "{layout}: {w:.1} GB, KV {kv:.1} GB"
            );
        };
        check(Layout::tp(8), 83.9, 82.8);
        check(Layout::new(8, 1, true), 98.8, 67.8);
        check(Layout::tp(4), 167.8, -1.1);
        // So a TP8 decode engine holds 255 requests of 8K/1K (576 blocks of 16 tokens each) and
        // a DP8EP rank 209: DP attention has 6.6 times the batch room of TP8 at the same size.
        assert_eq!(c.kv_blocks_per_gpu(Layout::tp(8)) / 576, 255);
        assert_eq!(c.kv_blocks_per_gpu(Layout::new(8, 1, true)) / 576, 209);
    }

    #[test]
    fn an_expert_all_to_all_across_nodes_waits_for_the_nic() {
        let c = cost();
        // Within a node every peer is on the fabric; past eight ranks most copies leave the
        // node on a 48 GB/s NIC, so the same tokens take longer.
        let a2a = |ranks: u16| c.ep_alltoall_s(Layout::new(ranks, 1, true), 64.0);
        assert!(a2a(32) > 1.5 * a2a(8), "EP32 {} s, EP8 {} s", a2a(32), a2a(8));
        // The same holds for a node of four GPUs from EP8 on.
        let mut hw = Hardware { gpus_per_node: 4, ..Hardware::default() };
        let small_nodes =
            Cost::new(&ModelProfile::default(), &hw, &CostModel::default(), &EngineLimits::default());
        assert!(small_nodes.ep_alltoall_s(Layout::new(8, 1, true), 64.0) > 1.5 * a2a(8));
        hw.gpus_per_node = 64;
        let big_nodes =
            Cost::new(&ModelProfile::default(), &hw, &CostModel::default(), &EngineLimits::default());
        assert!(big_nodes.ep_alltoall_s(Layout::new(32, 1, true), 64.0) < a2a(32));
    }

    #[test]
    fn a_decode_step_grows_with_load_through_the_experts_it_touches() {
        let c = cost();
        let step = |layout: Layout, batch: u64, groups: usize| {
            c.decode_step_ns(layout, &vec![GroupLoad { batch, context_tokens: batch * 1000 }; groups])
        };
        // One token touches 8 of 256 experts; 512 touch nearly all: the weights streamed grow.
        for layout in [Layout::tp(8), Layout::new(8, 1, true)] {
            let groups = usize::from(layout.dp);
            let (one, many) = (step(layout, 1, groups), step(layout, 64, groups));
            assert!(many > one + one / 2, "{layout}: {one} -> {many} ns");
        }
        // Under EP a step also pays the dispatch and combine of every MoE layer, busiest rank first.
        let ep = Layout::new(8, 1, true);
        let even = c.decode_step_ns(ep, &[GroupLoad { batch: 8, context_tokens: 8000 }; 8]);
        let mut skewed = vec![GroupLoad { batch: 1, context_tokens: 1000 }; 8];
        skewed[0] = GroupLoad { batch: 57, context_tokens: 57_000 };
        assert!(c.decode_step_ns(ep, &skewed) > even, "the slowest rank sets the step");
    }
}
