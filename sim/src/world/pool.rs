//! KV block pools: the blocks of one engine DP rank, and the transfer that owns each.

use std::collections::VecDeque;

/// KV blocks of one engine DP rank (the same ids on every TP rank), with their owners.
///
/// Free blocks are handed out as vLLM's `BlockPool` hands them out (`FreeKVCacheBlockQueue`):
/// every block once in ascending id order, then freed blocks from the front of a queue to whose
/// back a request's blocks are returned in reverse order (vLLM frees a request's blocks tail
/// first). So after the first pass a request's blocks are the reversed runs of the requests
/// freed before it, and a read's RDMA operations depend on both pools' histories
/// (`ReadOp::messages`).
#[derive(Clone, Debug)]
pub(super) struct Pool {
    pub(super) capacity: u32,
    next: u32,
    free: VecDeque<u32>,
    /// Owner transfer (index into `World::transfers`) of each block, `u32::MAX` when free.
    owner: Vec<u32>,
}

pub(super) const FREE: u32 = u32::MAX;

impl Pool {
    /// A pool of `blocks` ids. Ids never used are handed out fresh, in ascending order, before
    /// any freed one; nothing is allocated for them until then, so a short run with a large
    /// pool stays cheap.
    pub(super) fn new(blocks: u32) -> Pool {
        Pool { capacity: blocks, next: 0, free: VecDeque::new(), owner: Vec::new() }
    }

    pub(super) fn available(&self) -> usize {
        self.free.len() + (self.capacity - self.next) as usize
    }

    pub(super) fn alloc(&mut self, n: usize, owner: u32) -> Vec<u32> {
        debug_assert!(n <= self.available(), "caller checks availability");
        let mut blocks = Vec::with_capacity(n);
        while blocks.len() < n {
            let b = if self.next < self.capacity {
                self.next += 1;
                self.next - 1
            } else {
                self.free.pop_front().expect("caller checks availability")
            };
            if self.owner.len() <= b as usize {
                self.owner.resize(b as usize + 1, FREE);
            }
            self.owner[b as usize] = owner;
            blocks.push(b);
        }
        blocks
    }

    /// Frees `blocks` of `owner`, last block first; returns the blocks that were not `owner`'s
    /// (a double free).
    pub(super) fn release(&mut self, blocks: &[u32], owner: u32) -> Vec<u32> {
        let mut bad = Vec::new();
        for &b in blocks.iter().rev() {
            match self.owner.get(b as usize) {
                Some(&o) if o == owner => {
                    self.owner[b as usize] = FREE;
                    self.free.push_back(b);
                }
                _ => bad.push(b),
            }
        }
        bad
    }

    /// The owner of block `b` (`FREE` if free or never used).
    pub(super) fn owner_of(&self, b: u32) -> u32 {
        self.owner.get(b as usize).copied().unwrap_or(FREE)
    }
}
