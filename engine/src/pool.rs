//! KV block pools: the blocks of one engine DP rank, handed out as vLLM hands them out, and the
//! transfer (an owner number the driver chooses) that holds each.

use std::collections::{BTreeMap, VecDeque};

/// KV blocks of one engine DP rank (the same ids on every TP rank), with their owners.
///
/// Free blocks are handed out as vLLM's `BlockPool` hands them out (`FreeKVCacheBlockQueue`):
/// every block once in ascending id order, then freed blocks from the front of a queue to whose
/// back a request's blocks are returned in reverse order (vLLM frees a request's blocks tail
/// first). So after the first pass a request's blocks are the reversed runs of the requests
/// freed before it, and a read's RDMA operations depend on both pools' histories
/// (`ReadOp::messages`).
#[derive(Clone, Debug, Hash)]
pub struct Pool {
    capacity: u32,
    next: u32,
    /// The free queue, as runs of consecutive ids: a request's blocks come back last first, so
    /// a run of them is one entry, and a pool that has handed out every block once keeps a few
    /// entries per freed request instead of one per block.
    free: VecDeque<Run>,
    /// Blocks free in `free`, in all.
    free_blocks: usize,
    /// The blocks in use, as intervals of consecutive ids with their owner transfer (index into
    /// `World::transfers`): start -> (length, owner). A block in no interval is free (or never
    /// used). A request's blocks are a few runs of consecutive ids (fresh ids ascending, freed
    /// runs), so this keeps a few entries per request in flight, and a check of a request's
    /// blocks costs a search per run, not per block.
    owner: BTreeMap<u32, (u32, u32)>,
}

/// Consecutive free ids in queue order: `first`, then `len - 1` more, each one below the one
/// before (`down`, how a request's blocks come back) or above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Run {
    first: u32,
    len: u32,
    down: bool,
}

impl Run {
    /// The id after the run's last, in the run's direction, if there is one.
    fn after(&self) -> Option<u32> {
        if self.down {
            self.first.checked_sub(self.len)
        } else {
            self.first.checked_add(self.len)
        }
    }
}

/// What [`Pool::owner_of`] says of a block no transfer holds; no driver's owner number.
pub const FREE: u32 = u32::MAX;

impl Pool {
    /// A pool of `blocks` ids. Ids never used are handed out fresh, in ascending order, before
    /// any freed one; nothing is allocated for them until then, so a short run with a large
    /// pool stays cheap.
    pub fn new(blocks: u32) -> Pool {
        Pool { capacity: blocks, next: 0, free: VecDeque::new(), free_blocks: 0, owner: BTreeMap::new() }
    }

    /// The pool's size in blocks.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Blocks free now (never used, or freed).
    pub fn available(&self) -> usize {
        self.free_blocks + (self.capacity - self.next) as usize
    }

    /// Puts `b` at the back of the free queue, extending the last run when `b` continues it.
    fn push_free(&mut self, b: u32) {
        self.free_blocks += 1;
        if let Some(last) = self.free.back_mut() {
            if last.after() == Some(b) {
                last.len += 1;
                return;
            }
            // A run of one takes the direction of its second id.
            if last.len == 1 && (b.checked_add(1) == Some(last.first) || last.first.checked_add(1) == Some(b))
            {
                last.down = b < last.first;
                last.len = 2;
                return;
            }
        }
        self.free.push_back(Run { first: b, len: 1, down: true });
    }

    /// Hands out `n` blocks to `owner`; the caller checked that `n` are available.
    pub fn alloc(&mut self, n: usize, owner: u32) -> Vec<u32> {
        debug_assert!(n <= self.available(), "caller checks availability");
        let mut blocks = Vec::with_capacity(n);
        // Fresh ids first, then the free queue's runs from the front, a run (or the part of it
        // needed) at a time rather than an id at a time.
        let fresh = (self.capacity - self.next).min(u32::try_from(n).unwrap_or(u32::MAX));
        blocks.extend(self.next..self.next + fresh);
        self.next += fresh;
        while blocks.len() < n {
            let run = self.free.front_mut().expect("caller checks availability");
            let take = run.len.min(u32::try_from(n - blocks.len()).unwrap_or(u32::MAX));
            let first = run.first;
            if run.down {
                blocks.extend((0..take).map(|i| first - i));
            } else {
                blocks.extend((0..take).map(|i| first + i));
            }
            run.len -= take;
            self.free_blocks -= take as usize;
            if run.len == 0 {
                self.free.pop_front();
            } else if run.down {
                run.first -= take;
            } else {
                run.first += take;
            }
        }
        // One interval per run of consecutive ids, in either direction.
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            let step = blocks.get(j).map(|&b| i64::from(b) - i64::from(blocks[i]));
            if let Some(step @ (1 | -1)) = step {
                while j < blocks.len() && i64::from(blocks[j]) - i64::from(blocks[j - 1]) == step {
                    j += 1;
                }
            }
            let low = blocks[i].min(blocks[j - 1]);
            self.owner.insert(low, ((j - i) as u32, owner));
            i = j;
        }
        blocks
    }

    /// The interval in use that holds block `b`: its start, length and owner.
    fn interval_of(&self, b: u32) -> Option<(u32, u32, u32)> {
        let (&start, &(len, owner)) = self.owner.range(..=b).next_back()?;
        (u64::from(b) < u64::from(start) + u64::from(len)).then_some((start, len, owner))
    }

    /// The blocks of `blocks` that `owner` does not hold, in order.
    pub fn not_owned_by(&self, blocks: &[u32], owner: u32) -> Vec<u32> {
        let mut wrong = Vec::new();
        let mut i = 0;
        while i < blocks.len() {
            match self.interval_of(blocks[i]) {
                Some((start, len, o)) if o == owner => {
                    // Every following block inside the same interval is the owner's too.
                    let end = u64::from(start) + u64::from(len);
                    while i < blocks.len() && blocks[i] >= start && u64::from(blocks[i]) < end {
                        i += 1;
                    }
                }
                _ => {
                    wrong.push(blocks[i]);
                    i += 1;
                }
            }
        }
        wrong
    }

    /// Frees `blocks` of `owner`, last block first; returns the blocks that were not `owner`'s
    /// (a double free).
    ///
    /// A request's blocks are a few runs of consecutive ids, so the blocks are cut out of their
    /// intervals a run at a time: one search and at most three map updates per run, where a
    /// block at a time cost as many per block (a 2K prompt holds over a hundred).
    pub fn release(&mut self, blocks: &[u32], owner: u32) -> Vec<u32> {
        let mut bad = Vec::new();
        let mut i = blocks.len();
        while i > 0 {
            let b = blocks[i - 1];
            let Some((start, len, o)) = self.interval_of(b).filter(|&(_, _, o)| o == owner) else {
                bad.push(b);
                i -= 1;
                continue;
            };
            let end = u64::from(start) + u64::from(len);
            // The blocks before `b` in the list that continue it one id at a time, in one
            // direction, inside the same interval: freeing them one by one would cut each out of
            // what is left of this interval, so they go together.
            let mut j = i - 1;
            if j > 0 {
                let inside = |x: u32| x >= start && u64::from(x) < end;
                let next = blocks[j - 1];
                let step: i64 = i64::from(next) - i64::from(b);
                if (step == 1 || step == -1) && inside(next) {
                    while j > 0
                        && inside(blocks[j - 1])
                        && i64::from(blocks[j - 1]) - i64::from(blocks[j]) == step
                    {
                        j -= 1;
                    }
                }
            }
            let run = &blocks[j..i];
            let (low, high) = (run[0].min(b), run[0].max(b));
            // Cut `low..=high` out of its interval: what is left on either side stays in use.
            self.owner.remove(&start);
            if low > start {
                self.owner.insert(start, (low - start, o));
            }
            if u64::from(high) + 1 < end {
                self.owner.insert(high + 1, ((end - u64::from(high) - 1) as u32, o));
            }
            // Back to the queue last first; once the queue's last run continues into the rest
            // (one id at a time, in the run's direction), the rest extends it at once.
            let mut rest = run.iter().rev();
            while let Some(&freed) = rest.next() {
                self.push_free(freed);
                let continues = rest
                    .clone()
                    .next()
                    .is_some_and(|&next| self.free.back().is_some_and(|last| last.after() == Some(next)));
                if continues {
                    let more = rest.len();
                    if let Some(last) = self.free.back_mut() {
                        last.len += more as u32;
                    }
                    self.free_blocks += more;
                    break;
                }
            }
            i = j;
        }
        bad
    }

    /// The owner of block `b` (`FREE` if free or never used).
    pub fn owner_of(&self, b: u32) -> u32 {
        self.interval_of(b).map_or(FREE, |(_, _, owner)| owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool hands out and frees exactly as the plain model of vLLM's free queue it
    /// replaces: every id once in ascending order, then freed ids first in, first out, a
    /// request's ids returned last first. Requests of random sizes come and go in random order.
    #[test]
    fn the_run_queue_behaves_as_a_queue_of_ids() {
        for seed in 0..20u64 {
            let capacity = 50 + (seed as u32 * 37) % 300;
            let mut pool = Pool::new(capacity);
            let (mut next, mut free, mut owner) = (0u32, VecDeque::new(), vec![FREE; capacity as usize]);
            let mut held: Vec<(u32, Vec<u32>)> = Vec::new();
            let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let mut draw = |n: u64| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (state >> 33) % n
            };
            for step in 0..2000u32 {
                if draw(2) == 0 || held.is_empty() {
                    let n = 1 + draw(24) as usize;
                    if n > pool.available() {
                        continue;
                    }
                    let blocks = pool.alloc(n, step);
                    let mut expected = Vec::new();
                    while expected.len() < n {
                        let b = if next < capacity {
                            next += 1;
                            next - 1
                        } else {
                            free.pop_front().unwrap()
                        };
                        owner[b as usize] = step;
                        expected.push(b);
                    }
                    assert_eq!(blocks, expected, "seed {seed} step {step}");
                    held.push((step, blocks));
                } else {
                    let (who, blocks) = held.swap_remove(draw(held.len() as u64) as usize);
                    assert!(pool.release(&blocks, who).is_empty());
                    for &b in blocks.iter().rev() {
                        owner[b as usize] = FREE;
                        free.push_back(b);
                    }
                }
                assert_eq!(pool.available(), free.len() + (capacity - next) as usize);
                for b in 0..capacity {
                    assert_eq!(pool.owner_of(b), owner[b as usize], "seed {seed} block {b}");
                }
                if let Some((who, blocks)) = held.last() {
                    assert!(pool.not_owned_by(blocks, *who).is_empty());
                    let mut mixed = blocks.clone();
                    mixed.extend([capacity - 1, 0]);
                    let expected: Vec<u32> =
                        mixed.iter().copied().filter(|&b| owner[b as usize] != *who).collect();
                    assert_eq!(pool.not_owned_by(&mixed, *who), expected, "seed {seed} step {step}");
                }
            }
            // A double free names the blocks that were not the freer's.
            if let Some((who, blocks)) = held.pop() {
                assert!(pool.release(&blocks, who).is_empty());
                assert_eq!(pool.release(&blocks, who), blocks.iter().rev().copied().collect::<Vec<_>>());
            }
        }
    }

    /// Frees `blocks` a block at a time: the plain form of [`Pool::release`], which cuts runs.
    fn release_one_by_one(pool: &mut Pool, blocks: &[u32], owner: u32) -> Vec<u32> {
        let mut bad = Vec::new();
        for &b in blocks.iter().rev() {
            match pool.interval_of(b) {
                Some((start, len, o)) if o == owner => {
                    pool.owner.remove(&start);
                    if b > start {
                        pool.owner.insert(start, (b - start, o));
                    }
                    let end = u64::from(start) + u64::from(len);
                    if u64::from(b) + 1 < end {
                        pool.owner.insert(b + 1, ((end - u64::from(b) - 1) as u32, o));
                    }
                    pool.push_free(b);
                }
                _ => bad.push(b),
            }
        }
        bad
    }

    /// Freeing runs at once leaves the pool as freeing a block at a time does, whatever is
    /// freed: whole requests, parts of them, blocks named twice, blocks of another owner.
    #[test]
    fn a_release_by_runs_is_a_release_block_by_block() {
        // (blocks handed out to owners 0, 1, 2 in turn, blocks released by owner 1)
        let check = |sizes: [usize; 3], release: &dyn Fn(&[Vec<u32>]) -> Vec<u32>| {
            let mut pool = Pool::new(64);
            // A first pass and a free make later requests hold reversed and mixed runs.
            let warm = pool.alloc(40, 9);
            pool.release(&warm[5..30], 9);
            let held: Vec<Vec<u32>> = (0..3).map(|o| pool.alloc(sizes[o], o as u32)).collect();
            let freed = release(&held);
            let mut plain = pool.clone();
            let expected = release_one_by_one(&mut plain, &freed, 1);
            assert_eq!(pool.release(&freed, 1), expected, "{sizes:?} {freed:?}");
            assert_eq!((pool.free.clone(), pool.owner.clone()), (plain.free, plain.owner), "{freed:?}");
            assert_eq!(pool.available(), plain.free_blocks + (plain.capacity - plain.next) as usize);
        };
        for sizes in [[3, 10, 4], [1, 1, 1], [20, 15, 5], [0, 30, 0]] {
            check(sizes, &|h| h[1].clone());
            check(sizes, &|h| h[1].iter().rev().copied().collect());
            check(sizes, &|h| h[1].iter().step_by(2).copied().collect());
            check(sizes, &|h| h[1].iter().chain(&h[1]).copied().collect());
            check(sizes, &|h| h[1].iter().flat_map(|&b| [b, b]).collect());
            check(sizes, &|h| h[0].iter().chain(&h[1]).chain(&h[2]).copied().collect());
            check(sizes, &|h| h[1].iter().skip(1).chain(h[1].first()).copied().collect());
        }
    }
}
