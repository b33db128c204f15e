//! What one read is: the plan every read of a request shares ([`ReadPlan`]), one read to post
//! ([`ReadOp`]) and the RDMA operations a layer's read takes ([`contiguous_runs`]). Plain values,
//! built by `reads.rs` and carried by the worker's actions.

use std::ops::Range;
use std::sync::Arc;

use crate::ids::{Incarnation, RankId, RequestId, TransferId};
use crate::ports::SessionKey;

/// What every read of one request shares: where from and which blocks. Built once per request
/// and shared by its per-layer reads (a per-layer read of a long prompt would otherwise copy the
/// ids, the transfer id and the session key once per layer).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReadPlan {
    /// The request read.
    pub request: RequestId,
    /// Its transfer id.
    pub transfer_id: TransferId,
    /// The prefill rank read (the chosen source).
    pub source: RankId,
    /// The session whose memory descriptors the reads use.
    pub session: SessionKey,
    /// Remote base address of every layer of the source rank.
    pub remote_bases: Vec<u64>,
    /// Bytes per block in the remote region.
    pub block_len: u64,
    /// Remote (prefill) block ids.
    pub remote_block_ids: Arc<[u32]>,
    /// Local (decode) block ids, one per remote block.
    pub local_block_ids: Arc<[u32]>,
    /// RDMA operations one layer's read posts ([`contiguous_runs`]), counted once per request.
    pub messages_per_layer: u64,
    /// The incarnation of the source rank whose memory descriptors the reads use (the session's,
    /// which the fence made the transfer's): a data plane that can carry it lets the rank refuse
    /// a read meant for another incarnation of it.
    pub incarnation: Option<Incarnation>,
}

/// Runs of blocks contiguous in both the local and the remote region: the RDMA operations one
/// layer's read posts, as MoRIIO's `merge_contiguous_blocks` merges them (it sorts by local
/// block and merges a block into the run before it only when both its local and its remote
/// offset follow on). With one-token blocks (the block size vLLM's AITER MLA backend needed on
/// MI300X) a fragmented pool makes an 8K prompt thousands of operations a layer, which is what a
/// NIC's per-message cost charges for.
pub fn contiguous_runs(local: &[u32], remote: &[u32]) -> u64 {
    let mut pairs: Vec<(u32, u32)> = local.iter().copied().zip(remote.iter().copied()).collect();
    pairs.sort_unstable();
    let breaks =
        pairs.windows(2).filter(|w| !(w[1].0 == w[0].0.wrapping_add(1) && w[1].1 == w[0].1.wrapping_add(1)));
    (breaks.count() + usize::from(!pairs.is_empty())) as u64
}

/// One read to post: a request's plan and the layers this read covers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReadOp {
    /// The request's shared read plan.
    pub plan: Arc<ReadPlan>,
    /// The layer for a per-layer read, `None` for a read of every layer.
    pub layer: Option<u16>,
    /// The layers this read covers: indices into `plan.remote_bases`.
    pub layers: Range<usize>,
}

impl ReadOp {
    /// The read of `plan` for `layer` as the worker posts it: layer `l` alone, or every layer
    /// for `None` (a per-request read). A retry posts it again from the request's plan.
    pub fn of_layer(plan: Arc<ReadPlan>, layer: Option<u16>) -> ReadOp {
        let layers = match layer {
            Some(l) => usize::from(l)..usize::from(l) + 1,
            None => 0..plan.remote_bases.len(),
        };
        ReadOp { plan, layer, layers }
    }

    /// The request read.
    pub fn request(&self) -> RequestId {
        self.plan.request
    }

    /// Total bytes the read moves.
    pub fn bytes(&self) -> u64 {
        self.layers.len() as u64 * self.plan.remote_block_ids.len() as u64 * self.plan.block_len
    }

    /// Remote address of the first byte this read touches.
    pub fn first_address(&self) -> u64 {
        self.plan.remote_bases[self.layers.start]
    }

    /// Remote byte ranges `(address, length)`, contiguous blocks merged, layer by layer.
    pub fn remote_ranges(&self) -> Vec<(u64, u64)> {
        let plan = &self.plan;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &base in &plan.remote_bases[self.layers.clone()] {
            let mut run: Option<(u64, u64)> = None;
            for &block in plan.remote_block_ids.iter() {
                let addr = base + u64::from(block) * plan.block_len;
                run = match run {
                    Some((start, len)) if start + len == addr => Some((start, len + plan.block_len)),
                    Some(done) => {
                        out.push(done);
                        Some((addr, plan.block_len))
                    }
                    None => Some((addr, plan.block_len)),
                };
            }
            out.extend(run);
        }
        out
    }

    /// RDMA operations this read posts: [`ReadPlan::messages_per_layer`] for each layer it covers.
    pub fn messages(&self) -> u64 {
        self.plan.messages_per_layer * self.layers.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(local: &[u32], remote: &[u32], layers: usize) -> ReadOp {
        let plan = ReadPlan {
            request: RequestId(1),
            transfer_id: TransferId::new("t"),
            source: RankId::new(crate::ids::EngineId::prefill(0), 0, 0),
            session: SessionKey("s".into()),
            remote_bases: vec![0; layers],
            block_len: 16,
            remote_block_ids: remote.into(),
            local_block_ids: local.into(),
            messages_per_layer: contiguous_runs(local, remote),
            incarnation: None,
        };
        ReadOp { plan: Arc::new(plan), layer: None, layers: 0..layers }
    }

    #[test]
    fn a_read_posts_one_message_per_run_contiguous_on_both_sides_per_layer() {
        let check = |local: &[u32], remote: &[u32], layers: usize, expected: u64| {
            assert_eq!(op(local, remote, layers).messages(), expected, "{local:?} <- {remote:?} x {layers}");
        };
        check(&[], &[], 3, 0);
        check(&[7], &[9], 61, 61);
        // Both sides contiguous: one run.
        check(&[0, 1, 2, 3], &[10, 11, 12, 13], 2, 2);
        // Remote contiguous, local not (or the other way): every block its own message.
        check(&[0, 2, 4, 6], &[10, 11, 12, 13], 1, 4);
        check(&[0, 1, 2, 3], &[13, 12, 11, 10], 1, 4);
        // Two runs; the local order decides, as merge_contiguous_blocks sorts by local offset.
        check(&[5, 6, 0, 1], &[20, 21, 30, 31], 1, 2);
        check(&[1, 0], &[31, 30], 1, 1);
    }
}
