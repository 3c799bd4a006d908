//! The pipeline's KV block allocator. Block ids are the same on every stage (each stage stores
//! its own layers' K/V under them), so one allocator per pipeline decides who holds what, and
//! the scheduler admits, chunks and preempts by what fits.

/// Free block ids of one pipeline's pools.
#[derive(Debug)]
pub(crate) struct BlockAllocator {
    free: Vec<u32>,
    total: usize,
    block_size: usize,
}

impl BlockAllocator {
    /// `total` blocks of `block_size` positions, all free.
    pub fn new(total: usize, block_size: usize) -> Self {
        // Lowest ids first, so a lightly loaded pool touches little memory.
        let free = (0..total as u32).rev().collect();
        Self {
            free,
            total,
            block_size: block_size.max(1),
        }
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks not held by any sequence.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// Grow `table` to cover `positions`; false (and `table` unchanged) if the pool lacks blocks.
    pub fn cover(&mut self, table: &mut Vec<u32>, positions: usize) -> bool {
        let need = self.blocks_for(positions).saturating_sub(table.len());
        if need > self.free.len() {
            return false;
        }
        let at = self.free.len() - need;
        table.extend(self.free.drain(at..).rev());
        true
    }

    /// Return a sequence's blocks.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.append(table);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_once_and_come_back() {
        let mut a = BlockAllocator::new(5, 16);
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
}
