//! The pipeline's KV block allocator and prefix cache. Block ids are the same on every stage
//! (each stage stores its own layers' K/V under them), so one allocator per pipeline decides
//! who holds what, and the scheduler admits, chunks and preempts by what fits.
//!
//! Full blocks whose K/V every stage has written are indexed by their content: the block
//! before them and the tokens they hold. A new sequence whose prompt starts with indexed blocks
//! takes them into its table (reference-counted) and is prefilled only from there. Blocks no
//! sequence holds stay indexed until a new allocation needs them, least recently released
//! first. Only full blocks are shared, so a shared block is never written again: a sequence
//! writes its own positions into blocks of its own.

use std::collections::{BTreeMap, HashMap};

/// A full block's identity in the prefix index: the block before it (id and generation, so a
/// stale entry whose parent id was recycled never matches) and the tokens it holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct BlockKey {
    parent: Option<(u32, u32)>,
    tokens: Box<[u32]>,
}

/// Bookkeeping of one block id.
#[derive(Debug, Default)]
struct BlockState {
    /// Sequences whose tables hold the block.
    refs: u32,
    /// Bumped each time the id is handed out afresh, so children indexed under an earlier
    /// content are unreachable.
    generation: u32,
    /// Set while the block is in the prefix index.
    key: Option<BlockKey>,
    /// Position in the eviction order while the block is indexed and held by no sequence.
    lru: Option<u64>,
}

/// How far a sequence's blocks have been offered to the prefix index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum IndexProgress {
    /// Blocks `0..n` of the table are indexed (by this sequence or before it).
    #[default]
    Start,
    Indexed(usize),
    /// A block's content was already indexed under another id: the rest of this table is
    /// not reachable from the index, so it is not offered.
    Stopped,
}

/// What a prefix lookup found for a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PrefixHit {
    /// Indexed blocks the prompt starts with.
    pub blocks: usize,
    /// Of those, how many no sequence holds (taking them removes them from the free count).
    pub idle: usize,
}

/// Free block ids and the prefix index of one pipeline's pools.
#[derive(Debug)]
pub(crate) struct BlockAllocator {
    /// Ids in no table and not indexed; lowest last, so they are handed out first.
    free: Vec<u32>,
    blocks: Vec<BlockState>,
    index: HashMap<BlockKey, u32>,
    /// Indexed blocks no sequence holds, oldest release first: reused when `free` runs out.
    idle: BTreeMap<u64, u32>,
    clock: u64,
    block_size: usize,
    caching: bool,
}

impl BlockAllocator {
    /// `total` blocks of `block_size` positions, all free; `caching` turns the prefix index on.
    pub fn new(total: usize, block_size: usize, caching: bool) -> Self {
        // Lowest ids first, so a lightly loaded pool touches little memory.
        let free = (0..total as u32).rev().collect();
        Self {
            free,
            blocks: (0..total).map(|_| BlockState::default()).collect(),
            index: HashMap::new(),
            idle: BTreeMap::new(),
            clock: 0,
            block_size: block_size.max(1),
            caching,
        }
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks a new allocation can take: held by no sequence (indexed idle blocks included).
    pub fn free(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks in the prefix index (held or idle).
    pub fn cached(&self) -> usize {
        self.index.len()
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// Grow `table` to cover `positions`; false (and `table` unchanged) if the pool lacks blocks.
    pub fn cover(&mut self, table: &mut Vec<u32>, positions: usize) -> bool {
        let need = self.blocks_for(positions).saturating_sub(table.len());
        if need > self.free() {
            return false;
        }
        for _ in 0..need {
            let id = self.take_unheld();
            self.blocks[id as usize].refs = 1;
            table.push(id);
        }
        true
    }

    /// A block no sequence holds: a never-indexed one first, else the least recently released
    /// indexed one, which leaves the index. The caller checked `free() > 0`.
    fn take_unheld(&mut self) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => self.idle.pop_first().expect("free() counted an idle block").1,
        };
        let b = &mut self.blocks[id as usize];
        b.lru = None;
        if let Some(key) = b.key.take() {
            self.index.remove(&key);
        }
        b.generation = b.generation.wrapping_add(1);
        id
    }

    /// Return a sequence's blocks. Indexed ones stay reusable until needed; the table's tail is
    /// released first so it is also reused first (its head is what other prompts share).
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for id in table.drain(..).rev() {
            let b = &mut self.blocks[id as usize];
            b.refs = b.refs.saturating_sub(1);
            if b.refs > 0 {
                continue;
            }
            if b.key.is_some() {
                b.lru = Some(self.clock);
                self.idle.insert(self.clock, id);
                self.clock += 1;
            } else {
                self.free.push(id);
            }
        }
    }

    /// Whether releasing `table` would free a block (one no other sequence holds).
    pub fn frees_any(&self, table: &[u32]) -> bool {
        table.iter().any(|&id| self.blocks[id as usize].refs == 1)
    }

    /// The indexed blocks `tokens` starts with, at most `max_blocks` of them.
    fn chain<'a>(&'a self, tokens: &'a [u32], max_blocks: usize) -> impl Iterator<Item = u32> + 'a {
        let mut parent = None;
        tokens
            .chunks_exact(self.block_size)
            .take(if self.caching { max_blocks } else { 0 })
            .map_while(move |block| {
                let key = BlockKey {
                    parent,
                    tokens: block.into(),
                };
                let id = *self.index.get(&key)?;
                parent = Some((id, self.blocks[id as usize].generation));
                Some(id)
            })
    }

    /// Most blocks a prompt of `len` tokens may reuse: full blocks only, and never the whole
    /// prompt, since its last position must be computed to sample from.
    fn reusable_blocks(&self, len: usize) -> usize {
        len.saturating_sub(1) / self.block_size
    }

    /// What `prompt` would reuse, without taking anything.
    pub fn peek_prefix(&self, prompt: &[u32]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        for id in self.chain(prompt, self.reusable_blocks(prompt.len())) {
            hit.blocks += 1;
            hit.idle += usize::from(self.blocks[id as usize].refs == 0);
        }
        hit
    }

    /// Start an empty `table` with the indexed blocks `prompt` starts with; returns the
    /// positions they hold (0 when nothing is cached).
    pub fn take_prefix(&mut self, table: &mut Vec<u32>, prompt: &[u32]) -> usize {
        debug_assert!(table.is_empty(), "a prefix starts a table");
        let found: Vec<u32> = self.chain(prompt, self.reusable_blocks(prompt.len())).collect();
        for &id in &found {
            let b = &mut self.blocks[id as usize];
            if let Some(t) = b.lru.take() {
                self.idle.remove(&t);
            }
            b.refs += 1;
        }
        table.extend(&found);
        found.len() * self.block_size
    }

    /// Index a sequence's blocks that are full of computed K/V (`computed` positions of
    /// `tokens`, written on every stage), so later prompts can reuse them.
    pub fn index(&mut self, table: &[u32], tokens: &[u32], computed: usize, progress: &mut IndexProgress) {
        if !self.caching {
            return;
        }
        let start = match *progress {
            IndexProgress::Start => 0,
            IndexProgress::Indexed(n) => n,
            IndexProgress::Stopped => return,
        };
        let full = (computed.min(tokens.len()) / self.block_size).min(table.len());
        for j in start..full {
            let id = table[j];
            if self.blocks[id as usize].key.is_none() {
                let key = BlockKey {
                    parent: (j > 0).then(|| (table[j - 1], self.blocks[table[j - 1] as usize].generation)),
                    tokens: tokens[j * self.block_size..(j + 1) * self.block_size].into(),
                };
                if self.index.contains_key(&key) {
                    *progress = IndexProgress::Stopped;
                    return;
                }
                self.index.insert(key.clone(), id);
                self.blocks[id as usize].key = Some(key);
            }
            *progress = IndexProgress::Indexed(j + 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_once_and_come_back() {
        let mut a = BlockAllocator::new(5, 16, false);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        assert!(a.cover(&mut x, 17));
        assert_eq!(x, [0, 1]);
        assert!(a.cover(&mut x, 32), "still two blocks");
        assert_eq!(x.len(), 2);
        assert!(a.cover(&mut y, 40));
        assert_eq!(y, [2, 3, 4]);
        assert_eq!(a.free(), 0);
        assert!(!a.cover(&mut x, 33), "no block left");
        assert_eq!(x.len(), 2, "a failed cover takes nothing");
        a.release(&mut y);
        assert!(y.is_empty());
        assert_eq!(a.free(), 3);
        assert!(a.cover(&mut x, 33));
        let mut all: Vec<u32> = x.clone();
        all.extend(&a.free);
        all.sort();
        assert_eq!(all, [0, 1, 2, 3, 4], "no id lost or duplicated");
    }

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    /// Cover and index a whole prompt as if it had been computed.
    fn compute(a: &mut BlockAllocator, prompt: &[u32]) -> Vec<u32> {
        let mut t = Vec::new();
        let reused = a.take_prefix(&mut t, prompt);
        assert!(a.cover(&mut t, prompt.len()));
        let mut p = IndexProgress::default();
        a.index(&t, prompt, prompt.len(), &mut p);
        assert!(reused <= prompt.len());
        t
    }

    #[test]
    fn a_shared_prefix_is_reused_up_to_the_last_full_block_before_the_end() {
        let mut a = BlockAllocator::new(16, 4, true);
        let p = tokens(10, 0);
        let t1 = compute(&mut a, &p);
        assert_eq!(a.cached(), 2, "two full blocks of 4");
        // Same first 9 tokens, different tenth: both full blocks are shared.
        let mut q = p.clone();
        q[9] = 999;
        assert_eq!(a.peek_prefix(&q), PrefixHit { blocks: 2, idle: 0 });
        let mut t2 = Vec::new();
        assert_eq!(a.take_prefix(&mut t2, &q), 8);
        assert_eq!(t2, t1[..2]);
        // A prompt of exactly 8 cached tokens reuses one block: its last position is computed.
        assert_eq!(a.peek_prefix(&p[..8]).blocks, 1);
        // A different first block shares nothing, even with the same second block.
        let mut r = p.clone();
        r[0] = 12345;
        assert_eq!(a.peek_prefix(&r).blocks, 0);
        // Both tables hold the shared blocks; released by both, they stay indexed and idle.
        let free_before = a.free();
        let mut t1 = t1;
        a.release(&mut t1);
        assert_eq!(a.free(), free_before + 1, "the shared two are still held by t2");
        a.release(&mut t2);
        assert_eq!(a.cached(), 2);
        assert_eq!(a.free(), 16);
        assert_eq!(a.peek_prefix(&q), PrefixHit { blocks: 2, idle: 2 });
    }

    #[test]
    fn idle_cached_blocks_are_reused_oldest_first_and_stale_children_never_match() {
        let mut a = BlockAllocator::new(4, 4, true);
        let p = tokens(9, 1);
        let mut t = compute(&mut a, &p);
        assert_eq!(a.cached(), 2);
        a.release(&mut t);
        // 4 blocks: 1 never indexed (the third of p's table went back to free) + 1 never used
        // + 2 idle cached. Taking 3 evicts the oldest released idle block: p's tail (block 1),
        // then its head would be next.
        let mut other = Vec::new();
        assert!(a.cover(&mut other, 12));
        assert_eq!(a.cached(), 1);
        assert_eq!(a.peek_prefix(&p).blocks, 1, "the head is still cached");
        a.release(&mut other);
        // Taking everything recycles the head too; then nothing of p matches, even though
        // its old second block's content could be rebuilt under a recycled parent id.
        assert!(a.cover(&mut other, 16));
        assert_eq!(a.cached(), 0);
        assert_eq!(a.peek_prefix(&p).blocks, 0);
        a.release(&mut other);
        assert_eq!(a.free(), 4);
    }

    #[test]
    fn duplicate_content_is_indexed_once_and_the_later_table_stops_there() {
        let mut a = BlockAllocator::new(8, 4, true);
        let p = tokens(12, 2);
        // Two sequences computed the same prompt before either was indexed.
        let mut t1 = Vec::new();
        let mut t2 = Vec::new();
        assert!(a.cover(&mut t1, 12) && a.cover(&mut t2, 12));
        let (mut p1, mut p2) = (IndexProgress::default(), IndexProgress::default());
        a.index(&t1, &p, 12, &mut p1);
        a.index(&t2, &p, 12, &mut p2);
        assert_eq!(p1, IndexProgress::Indexed(3));
        assert_eq!(p2, IndexProgress::Stopped);
        assert_eq!(a.cached(), 3);
        a.release(&mut t2);
        assert_eq!(a.free(), 5, "the duplicate's blocks go straight back");
        a.release(&mut t1);
        assert_eq!(a.free(), 8);
    }

    #[test]
    fn indexing_follows_computed_positions_only() {
        let mut a = BlockAllocator::new(8, 4, true);
        let p = tokens(11, 3);
        let mut t = Vec::new();
        assert!(a.cover(&mut t, 11));
        let mut progress = IndexProgress::default();
        a.index(&t, &p, 3, &mut progress);
        assert_eq!((a.cached(), progress), (0, IndexProgress::Start));
        a.index(&t, &p, 9, &mut progress);
        assert_eq!((a.cached(), progress), (2, IndexProgress::Indexed(2)));
        a.index(&t, &p, 11, &mut progress);
        assert_eq!(a.cached(), 2, "the partial last block is never indexed");
    }

    #[test]
    fn caching_off_indexes_nothing() {
        let mut a = BlockAllocator::new(8, 4, false);
        let p = tokens(12, 4);
        let mut t = compute(&mut a, &p);
        assert_eq!(a.cached(), 0);
        a.release(&mut t);
        let mut u = Vec::new();
        assert_eq!(a.take_prefix(&mut u, &p), 0);
    }

    /// Random admissions, growth, indexing and releases against the invariants: every id is
    /// in exactly one place (a table, free, or idle), reference counts equal table counts,
    /// and every reused prefix holds exactly the tokens it was computed from.
    #[test]
    fn random_traffic_keeps_every_invariant() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let bs = 4;
        let mut a = BlockAllocator::new(24, bs, true);
        // What each block id holds when written: (position, token) per slot.
        let mut content: Vec<Vec<Option<u32>>> = vec![vec![None; bs]; 24];
        struct S {
            prompt: Vec<u32>,
            table: Vec<u32>,
            computed: usize,
            progress: IndexProgress,
        }
        let mut live: Vec<S> = Vec::new();
        // Blocks taken from the prefix index (each checked against what it holds), and how
        // many of those no sequence held when taken (reuse after release).
        let (mut reused_blocks, mut reused_idle) = (0, 0);
        for _ in 0..4000 {
            match next(4) {
                0 if live.len() < 6 => {
                    // Prompts from a few shared stems so prefixes repeat.
                    let stem = next(3) as u32;
                    let len = 1 + next(20) as usize;
                    let prompt: Vec<u32> = (0..len as u32)
                        .map(|i| if i < 10 { stem * 100 + i } else { next(3) as u32 })
                        .collect();
                    let mut table = Vec::new();
                    let hit = a.peek_prefix(&prompt);
                    let reused = a.take_prefix(&mut table, &prompt);
                    assert_eq!(
                        (reused, table.len()),
                        (hit.blocks * bs, hit.blocks),
                        "peek and take agree"
                    );
                    reused_blocks += table.len();
                    reused_idle += hit.idle;
                    for (j, &id) in table.iter().enumerate() {
                        for s in 0..bs {
                            assert_eq!(
                                content[id as usize][s],
                                Some(prompt[j * bs + s]),
                                "reused block {id} holds other tokens"
                            );
                        }
                    }
                    live.push(S {
                        prompt,
                        table,
                        computed: reused,
                        progress: IndexProgress::Start,
                    });
                }
                1 if !live.is_empty() => {
                    // Compute a few more positions, writing the content they hold.
                    let i = next(live.len() as u64) as usize;
                    let s = &mut live[i];
                    let upto = (s.computed + 1 + next(6) as usize).min(s.prompt.len());
                    if a.cover(&mut s.table, upto) {
                        for p in s.computed..upto {
                            content[s.table[p / bs] as usize][p % bs] = Some(s.prompt[p]);
                        }
                        s.computed = upto;
                        a.index(&s.table, &s.prompt, s.computed, &mut s.progress);
                    }
                }
                2 if !live.is_empty() => {
                    let i = next(live.len() as u64) as usize;
                    let mut s = live.swap_remove(i);
                    a.release(&mut s.table);
                }
                _ => {}
            }
            let mut refs = [0u32; 24];
            for s in &live {
                for &id in &s.table {
                    refs[id as usize] += 1;
                }
            }
            let mut seen = [0; 24];
            for &id in &a.free {
                seen[id as usize] += 1;
                assert!(a.blocks[id as usize].key.is_none());
            }
            for &id in a.idle.values() {
                seen[id as usize] += 1;
                assert!(a.blocks[id as usize].key.is_some());
            }
            for id in 0..24 {
                assert_eq!(a.blocks[id].refs, refs[id], "block {id} reference count");
                let held = usize::from(refs[id] > 0);
                assert_eq!(seen[id] + held, 1, "block {id} is in exactly one place");
            }
            for (key, &id) in &a.index {
                assert_eq!(a.blocks[id as usize].key.as_ref(), Some(key));
            }
        }
        eprintln!("{reused_blocks} blocks reused, {reused_idle} of them idle");
        // The traffic exercised reuse, of held and of released blocks alike, so the content
        // check above compared something.
        assert!(
            reused_blocks >= 100 && reused_idle >= 10,
            "{reused_blocks} blocks reused, {reused_idle} of them idle"
        );
    }
}
