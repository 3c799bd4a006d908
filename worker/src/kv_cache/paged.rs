//! The paged KV pool of a pipeline stage: a fixed number of blocks of `block_size` positions,
//! for every layer the stage holds. Block ids come from the coordinator, which allocates them
//! per pipeline so that id `b` names the same positions of the same sequence on every stage;
//! each stage stores its own layers' K/V there. The pool is allocated once when the stage
//! loads (zeroed lazily by the OS), so serving allocates nothing per token.

use super::BatchKv;
use crate::kernels::cpu::attention::Rows;
use crate::model::ForwardError;

/// One layer's keys and values: `blocks × block_size × kv_dim` each.
#[derive(Debug)]
struct LayerPool {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// K/V storage for a stage's layers, in blocks.
#[derive(Debug)]
pub struct PagedKv {
    layers: Vec<LayerPool>,
    kv_dim: usize,
    block_size: usize,
    blocks: usize,
}

impl PagedKv {
    /// A pool of `blocks` blocks of `block_size` positions for `n_layers` layers of width `kv_dim`.
    pub fn new(n_layers: usize, kv_dim: usize, block_size: usize, blocks: usize) -> Self {
        assert!(block_size > 0, "PagedKv: block size 0");
        let n = blocks * block_size * kv_dim;
        let layers = (0..n_layers)
            .map(|_| LayerPool {
                k: vec![0.0; n],
                v: vec![0.0; n],
            })
            .collect();
        Self {
            layers,
            kv_dim,
            block_size,
            blocks,
        }
    }

    /// Bytes one block takes across `n_layers` layers (f32 keys and values).
    pub fn bytes_per_block(n_layers: usize, kv_dim: usize, block_size: usize) -> usize {
        n_layers * 2 * block_size * kv_dim * size_of::<f32>()
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes the pool reserves.
    pub fn bytes(&self) -> usize {
        Self::bytes_per_block(self.layers.len(), self.kv_dim, self.block_size) * self.blocks
    }

    /// Storage row of position `pos` through `table`.
    fn row(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
}

/// One sequence of a paged batch: its rows `pos0..pos0+len`, the positions it held before the
/// batch, and its block table (block `j` holds positions `j*block_size..(j+1)*block_size`).
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    pub pos0: usize,
    pub len: usize,
    pub stored: usize,
    pub table: &'a [u32],
}

/// A batch of sequences over one pool. The caller records the new lengths on success.
#[derive(Debug)]
pub struct PagedBatch<'a> {
    pub pool: &'a mut PagedKv,
    pub seqs: &'a [PagedSeq<'a>],
}

impl BatchKv for PagedBatch<'_> {
    fn seqs(&self) -> usize {
        self.seqs.len()
    }

    fn span(&self, i: usize) -> (usize, usize) {
        (self.seqs[i].pos0, self.seqs[i].len)
    }

    fn stored(&self, i: usize) -> usize {
        self.seqs[i].stored
    }

    fn prepare(&mut self) -> Result<(), ForwardError> {
        for s in self.seqs {
            let needed = (s.pos0 + s.len).div_ceil(self.pool.block_size);
            if s.table.len() < needed {
                return Err(ForwardError::KvBlocks {
                    positions: s.pos0 + s.len,
                    needed,
                    have: s.table.len(),
                });
            }
            if let Some(&id) = s.table[..needed].iter().find(|&&b| b as usize >= self.pool.blocks) {
                return Err(ForwardError::KvBlockId {
                    id,
                    blocks: self.pool.blocks,
                });
            }
        }
        Ok(())
    }

    fn write(&mut self, i: usize, layer: usize, k: &[f32], v: &[f32]) {
        let s = self.seqs[i];
        let d = self.pool.kv_dim;
        for (r, (kr, vr)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let at = self.pool.row(s.table, s.pos0 + r) * d;
            let l = &mut self.pool.layers[layer];
            l.k[at..at + d].copy_from_slice(kr);
            l.v[at..at + d].copy_from_slice(vr);
        }
    }

    fn layer(&self, i: usize, layer: usize) -> (&[f32], &[f32], Rows<'_>) {
        let l = &self.pool.layers[layer];
        let layout = Rows::Paged {
            table: self.seqs[i].table,
            block_size: self.pool.block_size,
        };
        (&l.k, &l.v, layout)
    }

    fn commit(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::reference::{AttnShape, attention, attention_rows};

    #[test]
    fn paged_attention_equals_contiguous_attention_bit_for_bit() {
        let shape = AttnShape {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let (kvd, qd, bs) = (16, 32, 4);
        let n = 11; // positions 0..11 over 3 blocks, the last one partial
        let val = |i: usize| ((i * 37 % 101) as f32 - 50.0) * 0.01;
        let k: Vec<f32> = (0..n * kvd).map(val).collect();
        let v: Vec<f32> = (0..n * kvd).map(|i| val(i + 7)).collect();
        let q: Vec<f32> = (0..3 * qd).map(|i| val(i + 3)).collect();
        let mut want = vec![0f32; 3 * qd];
        attention(&q, &k, &v, n - 3, shape, &mut vec![0f32; n], &mut want);

        // Scattered, out-of-order blocks.
        let table = [5u32, 0, 3];
        let mut pool = PagedKv::new(1, kvd, bs, 6);
        let seqs = [PagedSeq {
            pos0: 0,
            len: n,
            stored: 0,
            table: &table,
        }];
        let mut batch = PagedBatch {
            pool: &mut pool,
            seqs: &seqs,
        };
        batch.prepare().unwrap();
        batch.write(0, 0, &k, &v);
        let seqs = [PagedSeq {
            pos0: n - 3,
            len: 3,
            stored: n - 3,
            table: &table,
        }];
        let batch = PagedBatch {
            pool: &mut pool,
            seqs: &seqs,
        };
        let (kp, vp, layout) = batch.layer(0, 0);
        let mut got = vec![0f32; 3 * qd];
        attention_rows(&q, kp, vp, n - 3, shape, &mut vec![0f32; n], &mut got, |p| {
            layout.row(p)
        });
        assert_eq!(got, want);
    }

    #[test]
    fn short_tables_and_foreign_block_ids_are_refused() {
        let mut pool = PagedKv::new(2, 8, 4, 3);
        let short = [PagedSeq {
            pos0: 4,
            len: 2,
            stored: 4,
            table: &[0],
        }];
        let e = PagedBatch {
            pool: &mut pool,
            seqs: &short,
        }
        .prepare()
        .unwrap_err();
        assert_eq!(
            e,
            ForwardError::KvBlocks {
                positions: 6,
                needed: 2,
                have: 1
            }
        );
        let foreign = [PagedSeq {
            pos0: 0,
            len: 2,
            stored: 0,
            table: &[3],
        }];
        let e = PagedBatch {
            pool: &mut pool,
            seqs: &foreign,
        }
        .prepare()
        .unwrap_err();
        assert_eq!(e, ForwardError::KvBlockId { id: 3, blocks: 3 });
        assert_eq!(pool.bytes(), 3 * PagedKv::bytes_per_block(2, 8, 4));
    }
}
