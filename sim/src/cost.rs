//! The compute-time model: how long a prefill batch and a decode step take on a given layout.
//!
//! Prefill is compute-bound: FLOPs (2 × active parameters per token) over the TP group's FP8
//! throughput at a calibrated utilisation, plus the TP all-reduces (two per layer) and, under
//! EP, the expert all-to-alls (two per MoE layer), plus a fixed per-batch cost. Decode is
//! memory-bound: a fixed per-step cost for streaming weights (scaled by how many GPUs share
//! them), the KV of every running request read from HBM (replicated on every TP rank for MLA,
//! which is why DP attention wins at high concurrency), a per-request overhead, and the same
//! collectives. `docs/sim.md` documents the formulas and the calibration.

use pdkv_core::topology::Layout;

use crate::scenario::{CostModel, Hardware, ModelProfile};

/// The constants a run uses, gathered once.
#[derive(Clone, Debug)]
pub struct Cost {
    model: ModelProfile,
    hw: Hardware,
    cost: CostModel,
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
    pub fn new(model: &ModelProfile, hw: &Hardware, cost: &CostModel) -> Cost {
        Cost { model: model.clone(), hw: hw.clone(), cost: cost.clone() }
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

    /// Seconds of the expert all-to-alls (dispatch and combine per MoE layer, 8-bit values).
    fn ep_alltoall_s(&self, layout: Layout, tokens: f64) -> f64 {
        if !layout.ep {
            return 0.0;
        }
        let n = f64::from(layout.ranks());
        let bytes = tokens * f64::from(self.model.hidden_size) * (n - 1.0) / n;
        f64::from(self.model.moe_layers) * 2.0 * bytes / self.fabric_bytes_per_s()
    }

    /// Nanoseconds one DP rank of a prefill engine with `layout` takes for a batch of `tokens`.
    pub fn prefill_batch_ns(&self, layout: Layout, tokens: u64) -> u64 {
        let tokens = tokens as f64;
        let flops = 2.0 * self.model.active_params_b * 1e9 * tokens;
        let ep = if layout.ep { self.cost.prefill_ep_efficiency } else { 1.0 };
        let peak = f64::from(layout.tp) * self.hw.fp8_tflops * 1e12 * self.cost.prefill_mfu * ep;
        let seconds = self.cost.prefill_fixed_ms / 1e3
            + flops / peak
            + self.tp_allreduce_s(layout.tp, tokens)
            + self.ep_alltoall_s(layout, tokens);
        (seconds * 1e9) as u64
    }

    /// Nanoseconds of one decode step of a DP group with `layout` and `load` (collectives across
    /// DP ranks excluded; see [`Cost::decode_step_ns`]).
    fn decode_group_s(&self, layout: Layout, load: GroupLoad) -> f64 {
        // Weights are streamed once per step by every GPU; they are spread over the TP group,
        // or over every rank under EP. The constant is calibrated for eight GPUs sharing them.
        let sharing = if layout.ep { layout.ranks() } else { u32::from(layout.tp) };
        let fixed = self.cost.decode_fixed_ms / 1e3 * 8.0 / f64::from(sharing.max(1));
        let per_rank = self.kv_bytes_per_token_per_rank(layout.tp);
        let kv_bytes = load.context_tokens as f64 * f64::from(self.model.layers) * per_rank;
        let kv = kv_bytes / (self.hw.hbm_tb_s * 1e12 * self.cost.decode_kv_efficiency);
        let overhead = load.batch as f64 * self.cost.decode_per_request_us / 1e6;
        fixed + kv + overhead + self.tp_allreduce_s(layout.tp, load.batch as f64)
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

    /// Nanoseconds of one decode step. Without EP each DP group steps on its own and `loads`
    /// has one entry; under EP every DP rank steps together (idle ones included), the step
    /// lasts as long as the slowest rank plus the expert all-to-all of all ranks' tokens.
    pub fn decode_step_ns(&self, layout: Layout, loads: &[GroupLoad]) -> u64 {
        let slowest = loads.iter().map(|l| self.decode_group_s(layout, *l)).fold(0.0, f64::max);
        let tokens: u64 = loads.iter().map(|l| l.batch).sum();
        let seconds = slowest + self.ep_alltoall_s(layout, tokens as f64 / f64::from(layout.dp.max(1)));
        (seconds * 1e9) as u64
    }

    /// KV blocks one GPU holds: HBM times the KV fraction over one block's bytes on that GPU.
    pub fn kv_blocks_per_gpu(&self, tp: u16) -> u32 {
        let block_bytes = f64::from(self.model.block_size_tokens)
            * f64::from(self.model.layers)
            * self.kv_bytes_per_token_per_rank(tp);
        let bytes = self.hw.hbm_gb * 1e9 * self.hw.kv_memory_fraction;
        (bytes / block_bytes).clamp(1.0, f64::from(u32::MAX)) as u32
    }

    /// Bytes of one block of one layer on one rank (the unit of a read).
    pub fn block_bytes_per_layer(&self, tp: u16) -> u64 {
        (f64::from(self.model.block_size_tokens) * self.kv_bytes_per_token_per_rank(tp)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> Cost {
        Cost::new(&ModelProfile::default(), &Hardware::default(), &CostModel::default())
    }

    #[test]
    fn prefill_grows_with_tokens_and_shrinks_with_tp() {
        let c = cost();
        let tp8 = c.prefill_batch_ns(Layout::tp(8), 8192);
        assert!(c.prefill_batch_ns(Layout::tp(8), 16384) > tp8);
        assert!(c.prefill_batch_ns(Layout::tp(4), 8192) > tp8);
        // One DP8EP rank prefills alone (TP1): several times slower per request than TP8.
        assert!(c.prefill_batch_ns(Layout::new(8, 1, true), 8192) > 4 * tp8);
    }

    #[test]
    fn decode_kv_term_is_replicated_under_mla_tp() {
        let c = cost();
        let load = GroupLoad { batch: 64, context_tokens: 64 * 9000 };
        // TP8 reads the whole batch's latent on every GPU; DP8EP spreads the batch over 8 ranks.
        let tp8 = c.decode_step_ns(Layout::tp(8), &[load]);
        let per_rank = GroupLoad { batch: 8, context_tokens: 8 * 9000 };
        let dp8 = c.decode_step_ns(Layout::new(8, 1, true), &[per_rank; 8]);
        assert!(dp8 < tp8, "dp8ep {dp8} < tp8 {tp8}");
        assert_eq!(c.block_bytes_per_layer(8), 16 * 576);
    }
}
