//! The KV byte pattern a cluster's prefill ranks write and its decode ranks verify: every byte is
//! a function of the transfer, layer, block of the request and KV head, so a read of the wrong
//! rank, block, layer or transfer is caught byte for byte.

use pdkv_core::ids::TransferId;
use pdkv_core::topology::ModelSpec;

/// A 64-bit key for a transfer id (FNV-1a of its text), the "request" part of the pattern.
pub fn transfer_key(transfer_id: &TransferId) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in transfer_id.as_str().bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// SplitMix64's finaliser: a cheap bijective mix, so nearby inputs give unrelated words.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The KV heads one rank holds: (first global head, count). Heads are split while there are
/// enough and replicated once TP exceeds them, as [`ModelSpec::heads_per_rank`] says; MLA's
/// latent is one head every rank holds.
pub fn heads_of_rank(model: &ModelSpec, tp_size: u16, tp: u16) -> (u16, u16) {
    let per_rank = model.heads_per_rank(tp_size);
    if model.use_mla {
        return (0, per_rank);
    }
    let tp_size = tp_size.max(1);
    if tp_size <= model.kv_heads {
        (tp * per_rank, per_rank)
    } else {
        // Replicated: ranks tp_size / kv_heads apart share a head.
        let group = tp_size / model.kv_heads.max(1);
        (tp / group.max(1), 1)
    }
}

/// Where a block's bytes come from: which transfer, layer, block of the request (its index in
/// the request's block list, not the physical block id) and which heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockKey {
    /// [`transfer_key`] of the transfer.
    pub transfer: u64,
    /// The layer.
    pub layer: u16,
    /// Index of the block in the request.
    pub block: u32,
    /// First global KV head the block holds.
    pub first_head: u16,
    /// Number of heads it holds (the block is split evenly between them).
    pub heads: u16,
}

impl BlockKey {
    fn seed(&self, head: u16) -> u64 {
        mix(self.transfer
            ^ mix((u64::from(self.layer) << 48) ^ (u64::from(self.block) << 16) ^ u64::from(head)))
    }

    fn head_len(&self, block_len: usize) -> usize {
        block_len / usize::from(self.heads.max(1))
    }

    /// Fills `block` (one whole block) with the pattern.
    pub fn fill(&self, block: &mut [u8]) {
        let head_len = self.head_len(block.len()).max(1);
        for (h, chunk) in block.chunks_mut(head_len).enumerate() {
            let seed = self.seed(self.first_head + h as u16);
            for (w, bytes) in chunk.chunks_mut(8).enumerate() {
                let word = mix(seed ^ w as u64).to_le_bytes();
                bytes.copy_from_slice(&word[..bytes.len()]);
            }
        }
    }

    /// The offset of the first byte of `block` that differs from the pattern, if any.
    pub fn first_mismatch(&self, block: &[u8]) -> Option<usize> {
        let head_len = self.head_len(block.len()).max(1);
        for (h, chunk) in block.chunks(head_len).enumerate() {
            let seed = self.seed(self.first_head + h as u16);
            for (w, bytes) in chunk.chunks(8).enumerate() {
                let word = mix(seed ^ w as u64).to_le_bytes();
                if bytes != &word[..bytes.len()] {
                    let at = bytes.iter().zip(word).position(|(a, b)| *a != b).unwrap_or(0);
                    return Some(h * head_len + w * 8 + at);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(transfer: u64, layer: u16, block: u32, first_head: u16, heads: u16) -> BlockKey {
        BlockKey { transfer, layer, block, first_head, heads }
    }

    #[test]
    fn a_filled_block_verifies_and_every_field_changes_it() {
        let k = key(7, 1, 2, 2, 2);
        let mut block = vec![0u8; 100];
        k.fill(&mut block);
        assert_eq!(k.first_mismatch(&block), None);
        for other in [key(8, 1, 2, 2, 2), key(7, 0, 2, 2, 2), key(7, 1, 3, 2, 2), key(7, 1, 2, 4, 2)] {
            assert_eq!(other.first_mismatch(&block), Some(0), "{other:?}");
        }
        block[63] ^= 1;
        assert_eq!(k.first_mismatch(&block), Some(63));
    }

    #[test]
    fn heads_split_then_replicate() {
        let gqa = ModelSpec::gqa(8);
        let check = |tp_size: u16, tp: u16, expected: (u16, u16)| {
            assert_eq!(heads_of_rank(&gqa, tp_size, tp), expected, "tp {tp} of {tp_size}");
        };
        check(4, 3, (6, 2));
        check(8, 5, (5, 1));
        check(16, 5, (2, 1));
        check(1, 0, (0, 8));
        assert_eq!(heads_of_rank(&ModelSpec::deepseek_r1(), 8, 5), (0, 1));
    }

    #[test]
    fn transfer_keys_differ() {
        let a = transfer_key(&TransferId::from_u128(1));
        let b = transfer_key(&TransferId::from_u128(2));
        assert_ne!(a, b);
    }
}
