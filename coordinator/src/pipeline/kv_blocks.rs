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
//!
//! A hybrid model's linear-attention layers keep a recurrent state per sequence instead of
//! K/V per position, so cached blocks alone cannot restart one: the state after them is needed
//! too. For such a model the allocator also hands out state snapshot ids (each stage keeps
//! that many copies of a sequence's state), a chunk ending on a block boundary may ask the
//! stages to snapshot the state there, and the snapshot is attached to that block once the
//! chunk is back. A prefix is then reused only up to its last block with a snapshot, and
//! starts from it. Evicting a block frees its snapshot; when none is free, the snapshot of the
//! least recently released idle block is taken (the block stays cached, reusable only as far
//! as an earlier snapshot reaches).

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
    /// The recurrent state after the block's last position, for a hybrid model.
    snapshot: Option<u32>,
}

/// How far a sequence's blocks have been offered to the prefix index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct IndexProgress {
    /// Blocks `0..blocks` of the table are indexed: by this sequence, or as a twin, a block
    /// of the same content (the same tokens after the same chain) indexed before it.
    pub blocks: usize,
    /// The indexed block (id, generation) the next block's key names as its parent: the last
    /// of those blocks, or its twin. Blocks computed after a twin are thus indexed under the
    /// chain a lookup follows, holding the same K/V as if they followed the twin itself.
    parent: Option<(u32, u32)>,
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
    /// State snapshots of a hybrid model (0: the model has no recurrent state).
    snapshots: usize,
    /// Snapshot ids attached to no block and reserved by no chunk.
    free_snapshots: Vec<u32>,
    /// Positions a prompt's chunks align to below its last whole window (a hybrid model's
    /// delta-rule window; 1: any).
    prompt_window: usize,
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
            snapshots: 0,
            free_snapshots: Vec::new(),
            prompt_window: 1,
        }
    }

    /// The allocator of a hybrid model whose stages keep `snapshots` state snapshots: prefixes
    /// are reused only up to a block with a snapshot (none at all when `snapshots` is 0).
    pub fn with_snapshots(mut self, snapshots: usize) -> Self {
        self.snapshots = snapshots;
        self.free_snapshots = (0..snapshots as u32).rev().collect();
        self.caching &= snapshots > 0;
        self
    }

    /// The allocator of a model whose prompts run in `window`-position windows aligned to
    /// position 0 (a hybrid's delta rule): prompt chunks end on window boundaries below the
    /// prompt's last whole window, and snapshots are taken only on such boundaries.
    pub fn with_prompt_window(mut self, window: usize) -> Self {
        self.prompt_window = window.max(1);
        self
    }

    /// See [`with_prompt_window`](Self::with_prompt_window) (1: chunks may end anywhere).
    pub fn prompt_window(&self) -> usize {
        self.prompt_window
    }

    /// Whether reusing a prefix needs a state snapshot (a hybrid model with prefix caching).
    pub fn keeps_snapshots(&self) -> bool {
        self.caching && self.snapshots > 0
    }

    /// State snapshots attached to blocks or reserved by chunks in flight, and all there are.
    pub fn snapshots_used(&self) -> (usize, usize) {
        (self.snapshots - self.free_snapshots.len(), self.snapshots)
    }

    /// A snapshot id for a chunk to fill: a free one, else the one of the least recently
    /// released idle block that has one; None when every snapshot is on a held block.
    pub fn reserve_snapshot(&mut self) -> Option<u32> {
        if let Some(s) = self.free_snapshots.pop() {
            return Some(s);
        }
        let id = self
            .idle
            .values()
            .copied()
            .find(|&id| self.blocks[id as usize].snapshot.is_some())?;
        self.blocks[id as usize].snapshot.take()
    }

    /// A chunk that ended after the first `blocks` full blocks of `tokens` filled `snapshot`
    /// with the state there: attach it to the indexed block those tokens end with (the
    /// sequence's own, or its twin) if that block has none, else free it.
    pub fn attach_snapshot(&mut self, tokens: &[u32], blocks: usize, snapshot: u32) {
        let last = match blocks {
            0 => None,
            n => self.chain(tokens, n).nth(n - 1),
        };
        match last.map(|id| &mut self.blocks[id as usize]) {
            Some(b) if b.snapshot.is_none() => b.snapshot = Some(snapshot),
            _ => self.free_snapshots.push(snapshot),
        }
    }

    /// Give back a snapshot a chunk reserved but did not fill (its micro-batch failed).
    pub fn release_snapshot(&mut self, snapshot: u32) {
        self.free_snapshots.push(snapshot);
    }

    /// The state snapshot after `block`, if it has one.
    pub fn snapshot_of(&self, block: u32) -> Option<u32> {
        self.blocks[block as usize].snapshot
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
        if let Some(s) = b.snapshot.take() {
            self.free_snapshots.push(s);
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

    /// The indexed blocks `prompt` may reuse: the chain it starts with, for a hybrid model cut
    /// after the last block with a state snapshot.
    fn reusable(&self, prompt: &[u32]) -> Vec<u32> {
        let mut found: Vec<u32> = self.chain(prompt, self.reusable_blocks(prompt.len())).collect();
        if self.snapshots > 0 {
            let keep = found
                .iter()
                .rposition(|&id| self.blocks[id as usize].snapshot.is_some())
                .map_or(0, |i| i + 1);
            found.truncate(keep);
        }
        found
    }

    /// What `prompt` would reuse, without taking anything.
    pub fn peek_prefix(&self, prompt: &[u32]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        for id in self.reusable(prompt) {
            hit.blocks += 1;
            hit.idle += usize::from(self.blocks[id as usize].refs == 0);
        }
        hit
    }

    /// Start an empty `table` with the indexed blocks `prompt` starts with; returns the
    /// positions they hold (0 when nothing is cached).
    pub fn take_prefix(&mut self, table: &mut Vec<u32>, prompt: &[u32]) -> usize {
        debug_assert!(table.is_empty(), "a prefix starts a table");
        let found = self.reusable(prompt);
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

    /// The index progress of a table that starts with the blocks [`take_prefix`] gave it.
    ///
    /// [`take_prefix`]: Self::take_prefix
    pub fn progress_after_prefix(&self, table: &[u32]) -> IndexProgress {
        IndexProgress {
            blocks: table.len(),
            parent: table.last().map(|&id| (id, self.blocks[id as usize].generation)),
        }
    }

    /// Index a sequence's blocks that are full of computed K/V (`computed` positions of
    /// `tokens`, written on every stage), so later prompts can reuse them. A block whose
    /// content is already indexed under another id (two sequences computed the same prefix)
    /// stays out, and the blocks after it are indexed as following that twin.
    pub fn index(&mut self, table: &[u32], tokens: &[u32], computed: usize, progress: &mut IndexProgress) {
        if !self.caching {
            return;
        }
        let full = (computed.min(tokens.len()) / self.block_size).min(table.len());
        for j in progress.blocks..full {
            let id = table[j];
            let key = BlockKey {
                parent: progress.parent,
                tokens: tokens[j * self.block_size..(j + 1) * self.block_size].into(),
            };
            let indexed = match self.index.get(&key) {
                Some(&twin) => twin,
                None if self.blocks[id as usize].key.is_none() => {
                    self.index.insert(key.clone(), id);
                    self.blocks[id as usize].key = Some(key);
                    id
                }
                // Indexed under another chain (never expected): leave the rest out.
                None => return,
            };
            progress.parent = Some((indexed, self.blocks[indexed as usize].generation));
            progress.blocks = j + 1;
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
        assert_eq!((p1.blocks, p2.blocks), (3, 3));
        assert_eq!(a.cached(), 3);
        a.release(&mut t2);
        assert_eq!(a.free(), 5, "the duplicate's blocks go straight back");
        a.release(&mut t1);
        assert_eq!(a.free(), 8);
    }

    #[test]
    fn blocks_computed_after_a_duplicate_are_indexed_behind_its_twin() {
        let mut a = BlockAllocator::new(8, 4, true);
        let p = tokens(8, 2);
        let q: Vec<u32> = p.iter().copied().chain([90, 91, 92, 93, 94]).collect();
        // Both computed the first 8 tokens before either was indexed; q went on.
        let (mut t1, mut t2) = (Vec::new(), Vec::new());
        assert!(a.cover(&mut t1, 8) && a.cover(&mut t2, 13));
        let (mut p1, mut p2) = (IndexProgress::default(), IndexProgress::default());
        a.index(&t1, &p, 8, &mut p1);
        a.index(&t2, &q, 13, &mut p2);
        assert_eq!(a.cached(), 3, "p's two blocks, then q's third behind them");
        let mut t3 = Vec::new();
        let r: Vec<u32> = q.iter().copied().chain([7]).collect();
        assert_eq!(a.take_prefix(&mut t3, &r), 12);
        assert_eq!(t3, [t1[0], t1[1], t2[2]]);
    }

    #[test]
    fn indexing_follows_computed_positions_only() {
        let mut a = BlockAllocator::new(8, 4, true);
        let p = tokens(11, 3);
        let mut t = Vec::new();
        assert!(a.cover(&mut t, 11));
        let mut progress = IndexProgress::default();
        a.index(&t, &p, 3, &mut progress);
        assert_eq!((a.cached(), progress), (0, IndexProgress::default()));
        a.index(&t, &p, 9, &mut progress);
        assert_eq!((a.cached(), progress.blocks), (2, 2));
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
                    let progress = a.progress_after_prefix(&table);
                    live.push(S {
                        prompt,
                        table,
                        computed: reused,
                        progress,
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

    /// Cover and index `prompt` as computed, then attach a fresh snapshot after block `j`.
    fn compute_with_snapshot(a: &mut BlockAllocator, prompt: &[u32], j: usize) -> (Vec<u32>, u32) {
        let t = compute(a, prompt);
        let s = a.reserve_snapshot().expect("a snapshot is free");
        a.attach_snapshot(prompt, j + 1, s);
        (t, s)
    }

    #[test]
    fn a_hybrid_prefix_is_reused_only_as_far_as_its_last_state_snapshot() {
        let mut a = BlockAllocator::new(8, 4, true).with_snapshots(2);
        assert!(a.keeps_snapshots());
        let p = tokens(14, 3);
        let mut t = compute(&mut a, &p);
        assert_eq!(a.cached(), 3, "three full blocks indexed");
        assert_eq!(
            a.peek_prefix(&p).blocks,
            0,
            "no snapshot, nothing to start the state from"
        );
        let s = a.reserve_snapshot().unwrap();
        a.attach_snapshot(&p, 2, s);
        assert_eq!(a.snapshots_used(), (1, 2));
        assert_eq!(
            a.peek_prefix(&p).blocks,
            2,
            "up to the block with the snapshot, not past it"
        );
        let mut t2 = Vec::new();
        assert_eq!(a.take_prefix(&mut t2, &p), 8);
        assert_eq!(a.snapshot_of(*t2.last().unwrap()), Some(s));
        // A snapshot for a block that is not in the index (or already has one) goes back.
        let mut plain = Vec::new();
        assert!(a.cover(&mut plain, 4));
        let s2 = a.reserve_snapshot().unwrap();
        a.attach_snapshot(&tokens(4, 77), 1, s2);
        assert_eq!(a.snapshot_of(plain[0]), None);
        let s3 = a.reserve_snapshot().unwrap();
        a.attach_snapshot(&p, 2, s3);
        assert_eq!(a.snapshot_of(t[1]), Some(s), "the first snapshot stays");
        assert_eq!(a.snapshots_used(), (1, 2));
        // Every snapshot is on a held block: none can be taken.
        let s4 = a.reserve_snapshot().unwrap();
        assert_eq!(a.reserve_snapshot(), None);
        a.release_snapshot(s4);
        a.release(&mut t2);
        a.release(&mut plain);
        // Held by t still: nothing idle has a snapshot to give up.
        assert_eq!(a.reserve_snapshot(), Some(s4));
        a.release_snapshot(s4);
        a.release(&mut t);
        // Evicting the idle blocks frees the snapshot with them.
        let mut big = Vec::new();
        assert!(a.cover(&mut big, 32));
        assert_eq!(a.cached(), 0);
        assert_eq!(a.snapshots_used(), (0, 2));
        // Without snapshots a hybrid model reuses nothing.
        let mut off = BlockAllocator::new(8, 4, true).with_snapshots(0);
        assert!(!off.keeps_snapshots());
        let _ = compute(&mut off, &p);
        assert_eq!(off.peek_prefix(&p).blocks, 0);
    }

    #[test]
    fn with_every_snapshot_on_a_cached_block_the_least_recently_released_block_gives_its_snapshot_up() {
        let mut a = BlockAllocator::new(16, 4, true).with_snapshots(2);
        let (p, q) = (tokens(9, 1), tokens(9, 2));
        let (mut tp, sp) = compute_with_snapshot(&mut a, &p, 1);
        let (mut tq, sq) = compute_with_snapshot(&mut a, &q, 1);
        a.release(&mut tp);
        a.release(&mut tq);
        assert_eq!((a.peek_prefix(&p).blocks, a.peek_prefix(&q).blocks), (2, 2));
        // p was released first: its snapshot is taken, its blocks stay cached but unreachable
        // without a state to start from.
        assert_eq!(a.reserve_snapshot(), Some(sp));
        assert_eq!((a.peek_prefix(&p).blocks, a.peek_prefix(&q).blocks), (0, 2));
        assert_eq!(a.cached(), 4);
        assert_eq!(a.reserve_snapshot(), Some(sq));
        assert_eq!(a.reserve_snapshot(), None);
    }

    #[test]
    fn random_hybrid_traffic_starts_every_reused_prefix_from_the_state_of_exactly_its_tokens() {
        // Sequences from shared stems compute in chunks that end on block boundaries, each
        // filling a snapshot with "the state after these tokens" (here: the tokens themselves),
        // attached when the chunk is back. Every reuse must start from a snapshot of exactly
        // the reused tokens, and every snapshot id must be in one place only.
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let (bs, total, snaps) = (4, 24, 5);
        let mut a = BlockAllocator::new(total, bs, true).with_snapshots(snaps);
        // What each snapshot id was last filled with.
        let mut filled: Vec<Option<Vec<u32>>> = vec![None; snaps];
        struct S {
            prompt: Vec<u32>,
            table: Vec<u32>,
            computed: usize,
            progress: IndexProgress,
        }
        let mut live: Vec<S> = Vec::new();
        let mut restored = 0;
        for _ in 0..4000 {
            match next(4) {
                0 if live.len() < 5 => {
                    let stem = next(3) as u32;
                    let len = 1 + next(24) as usize;
                    let prompt: Vec<u32> = (0..len as u32)
                        .map(|i| if i < 14 { stem * 100 + i } else { next(2) as u32 })
                        .collect();
                    let mut table = Vec::new();
                    let reused = a.take_prefix(&mut table, &prompt);
                    if reused > 0 {
                        let s = a
                            .snapshot_of(*table.last().unwrap())
                            .expect("a reused prefix ends with a snapshot");
                        assert_eq!(filled[s as usize].as_deref(), Some(&prompt[..reused]));
                        restored += 1;
                    }
                    let progress = a.progress_after_prefix(&table);
                    live.push(S {
                        prompt,
                        table,
                        computed: reused,
                        progress,
                    });
                }
                1 if !live.is_empty() => {
                    // A chunk to the next block boundary (or the prompt's end), snapshotting
                    // the state at a boundary when a snapshot can be had.
                    let i = next(live.len() as u64) as usize;
                    let s = &mut live[i];
                    let upto = ((s.computed / bs + 1) * bs).min(s.prompt.len());
                    if upto > s.computed && a.cover(&mut s.table, upto) {
                        let snapshot = upto.is_multiple_of(bs).then(|| a.reserve_snapshot()).flatten();
                        if let Some(sn) = snapshot {
                            filled[sn as usize] = Some(s.prompt[..upto].to_vec());
                        }
                        s.computed = upto;
                        a.index(&s.table, &s.prompt, s.computed, &mut s.progress);
                        if let Some(sn) = snapshot {
                            a.attach_snapshot(&s.prompt, upto / bs, sn);
                        }
                    }
                }
                2 if !live.is_empty() => {
                    let i = next(live.len() as u64) as usize;
                    let mut s = live.swap_remove(i);
                    a.release(&mut s.table);
                }
                _ => {}
            }
            let mut seen = vec![0; snaps];
            for &s in &a.free_snapshots {
                seen[s as usize] += 1;
            }
            for b in &a.blocks {
                if let Some(s) = b.snapshot {
                    seen[s as usize] += 1;
                    assert!(b.key.is_some(), "a snapshot sits on a cached block");
                }
            }
            assert!(
                seen.iter().all(|&n| n == 1),
                "each snapshot in exactly one place: {seen:?}"
            );
        }
        assert!(restored >= 100, "{restored} prefixes restored");
    }
}
