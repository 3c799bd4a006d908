//! The paged KV pool of a pipeline stage: a fixed number of blocks of `block_size` positions,
//! for every layer the stage holds. Block ids come from the coordinator, which allocates them
//! per pipeline so that id `b` names the same positions of the same sequence on every stage;
//! each stage stores its own layers' K/V there. The pool is allocated once when the stage
//! loads (zeroed lazily by the OS), so serving allocates nothing per token. Values are stored
//! as f32 or, at half the memory, f16 ([`KvDtype`]).
//!
//! Beside the blocks, a stage with linear-attention layers keeps a fixed number of recurrent
//! state slots (f32), one per running sequence: a slot holds that sequence's state for every
//! such layer of the stage, and is zeroed when the sequence starts at position 0. After them
//! come the state snapshots of the prefix cache: copies of a slot taken where a chunk ended on
//! a block boundary, which a later sequence with the same tokens starts from. The coordinator
//! allocates snapshot ids, as it does block ids.

use super::{BatchKv, KvDtype, KvSpans};
use crate::kernels::cpu::attention::{KvData, Rows};
use crate::kernels::cpu::half::HalfKind;
use crate::model::ForwardError;

/// One layer's keys or values: `blocks × block_size × kv_dim`, in the pool's dtype.
#[derive(Debug)]
enum Store {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl Store {
    fn new(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F32 => Store::F32(vec![0.0; n]),
            KvDtype::F16 => Store::F16(vec![0; n]),
        }
    }

    /// Store `src` at `at` (rounded to the nearest f16 for an f16 pool).
    fn put(&mut self, at: usize, src: &[f32]) {
        match self {
            Store::F32(d) => d[at..at + src.len()].copy_from_slice(src),
            Store::F16(d) => d[at..at + src.len()]
                .iter_mut()
                .zip(src)
                .for_each(|(d, &x)| *d = HalfKind::F16.from_f32(x)),
        }
    }

    fn data(&self) -> KvData<'_> {
        match self {
            Store::F32(d) => KvData::F32(d),
            Store::F16(d) => KvData::F16(d),
        }
    }
}

/// One layer's keys and values.
#[derive(Debug)]
struct LayerPool {
    k: Store,
    v: Store,
}

/// Where each recurrent-state slot and snapshot lies in a pool's state storage (any device's):
/// the slots, then the snapshots, each `layers × values` f32s (every linear-attention layer of
/// the stage, back to back).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateLayout {
    pub layers: usize,
    pub values: usize,
    pub slots: usize,
    pub snapshots: usize,
}

impl StateLayout {
    /// `slots` slots and `snapshots` snapshots of `layers` layers of `values` f32s; none of
    /// either without linear-attention layers.
    pub fn new(layers: usize, values: usize, slots: usize, snapshots: usize) -> Self {
        let (slots, snapshots) = if layers == 0 { (0, 0) } else { (slots, snapshots) };
        Self {
            layers,
            values,
            slots,
            snapshots,
        }
    }

    /// f32s one slot (or snapshot) takes.
    pub fn per_slot(&self) -> usize {
        self.layers * self.values
    }

    /// f32s of every slot and snapshot.
    pub fn floats(&self) -> usize {
        (self.slots + self.snapshots) * self.per_slot()
    }

    /// Where `slot` lies, or `StateSlot` if there is no such slot.
    pub fn slot(&self, slot: usize) -> Result<std::ops::Range<usize>, ForwardError> {
        if slot >= self.slots {
            return Err(ForwardError::StateSlot {
                slot,
                slots: self.slots,
            });
        }
        Ok(slot * self.per_slot()..(slot + 1) * self.per_slot())
    }

    /// Where snapshot `snapshot` lies (after the slots), or `StateSnapshot` if there is no
    /// such snapshot.
    pub fn snapshot(&self, snapshot: usize) -> Result<std::ops::Range<usize>, ForwardError> {
        if snapshot >= self.snapshots {
            return Err(ForwardError::StateSnapshot {
                snapshot,
                snapshots: self.snapshots,
            });
        }
        let at = (self.slots + snapshot) * self.per_slot();
        Ok(at..at + self.per_slot())
    }

    /// Check every sequence's slot (where there is state), then the slots of those starting
    /// at position 0: a new sequence starts from a zero state.
    pub fn new_slots<'s>(
        &self,
        seqs: &'s [PagedSeq<'_>],
    ) -> Result<impl Iterator<Item = std::ops::Range<usize>> + 's, ForwardError> {
        if self.layers > 0 {
            for s in seqs {
                self.slot(s.state_slot)?;
            }
        }
        let layout = *self;
        Ok(seqs
            .iter()
            .filter(move |s| s.pos0 == 0 && layout.layers > 0)
            .map(move |s| s.state_slot * layout.per_slot()..(s.state_slot + 1) * layout.per_slot()))
    }
}

/// K/V storage for a stage's layers, in blocks.
#[derive(Debug)]
pub struct PagedKv {
    layers: Vec<LayerPool>,
    kv_dim: usize,
    block_size: usize,
    blocks: usize,
    dtype: KvDtype,
    /// The slots, then the snapshots, as `state_at` lays them out.
    states: Vec<f32>,
    state_at: StateLayout,
}

impl PagedKv {
    /// A pool of `blocks` blocks of `block_size` positions for `n_layers` layers of width
    /// `kv_dim`, storing f32.
    pub fn new(n_layers: usize, kv_dim: usize, block_size: usize, blocks: usize) -> Self {
        Self::with_dtype(n_layers, kv_dim, block_size, blocks, KvDtype::F32)
    }

    /// [`new`](Self::new) storing `dtype`.
    pub fn with_dtype(n_layers: usize, kv_dim: usize, block_size: usize, blocks: usize, dtype: KvDtype) -> Self {
        assert!(block_size > 0, "PagedKv: block size 0");
        let n = blocks * block_size * kv_dim;
        let layers = (0..n_layers)
            .map(|_| LayerPool {
                k: Store::new(dtype, n),
                v: Store::new(dtype, n),
            })
            .collect();
        Self {
            layers,
            kv_dim,
            block_size,
            blocks,
            dtype,
            states: Vec::new(),
            state_at: StateLayout::default(),
        }
    }

    /// The pool with `slots` recurrent-state slots and `snapshots` state snapshots for
    /// `state_layers` layers of `state_values` f32s each.
    pub fn with_states(self, state_layers: usize, state_values: usize, slots: usize, snapshots: usize) -> Self {
        let state_at = StateLayout::new(state_layers, state_values, slots, snapshots);
        Self {
            states: vec![0.0; state_at.floats()],
            state_at,
            ..self
        }
    }

    /// Recurrent-state slots (0 for a stage without linear-attention layers).
    pub fn state_slots(&self) -> usize {
        self.state_at.slots
    }

    /// State snapshots kept for the prefix cache (0 for a stage without linear-attention
    /// layers).
    pub fn state_snapshots(&self) -> usize {
        self.state_at.snapshots
    }

    /// Copy `slot`'s state into snapshot `snapshot`.
    pub fn save_snapshot(&mut self, slot: usize, snapshot: usize) -> Result<(), ForwardError> {
        let from = self.state_at.slot(slot)?;
        let to = self.state_at.snapshot(snapshot)?;
        self.states.copy_within(from, to.start);
        Ok(())
    }

    /// Start `slot`'s state from snapshot `snapshot`.
    pub fn load_snapshot(&mut self, snapshot: usize, slot: usize) -> Result<(), ForwardError> {
        let from = self.state_at.snapshot(snapshot)?;
        let to = self.state_at.slot(slot)?;
        self.states.copy_within(from, to.start);
        Ok(())
    }

    /// The recurrent state of `slot`, every linear-attention layer's back to back.
    pub fn slot_state(&self, slot: usize) -> Result<&[f32], ForwardError> {
        Ok(&self.states[self.state_at.slot(slot)?])
    }

    /// [`slot_state`](Self::slot_state), to write.
    pub fn slot_state_mut(&mut self, slot: usize) -> Result<&mut [f32], ForwardError> {
        let r = self.state_at.slot(slot)?;
        Ok(&mut self.states[r])
    }

    /// Bytes one state slot takes (every linear-attention layer of the stage).
    pub fn state_slot_bytes(&self) -> usize {
        self.state_at.per_slot() * size_of::<f32>()
    }

    /// Bytes one block takes across `n_layers` layers (keys and values of `dtype`).
    pub fn bytes_per_block(n_layers: usize, kv_dim: usize, block_size: usize, dtype: KvDtype) -> usize {
        n_layers * 2 * block_size * kv_dim * dtype.bytes()
    }

    /// How values are stored.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes the pool reserves (blocks, state slots and snapshots).
    pub fn bytes(&self) -> usize {
        Self::bytes_per_block(self.layers.len(), self.kv_dim, self.block_size, self.dtype) * self.blocks
            + self.states.len() * size_of::<f32>()
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
    /// The sequence's recurrent-state slot (read only by a stage with linear-attention layers).
    pub state_slot: usize,
    /// The sequence's prompt length (see [`KvSpans::prompt_len`]; 0: token by token).
    pub prompt_len: usize,
}

/// Check that each sequence's block table covers its positions with ids inside a pool of
/// `blocks` blocks of `block_size` positions (any device's pool).
pub fn check_tables(seqs: &[PagedSeq<'_>], block_size: usize, blocks: usize) -> Result<(), ForwardError> {
    for s in seqs {
        let needed = (s.pos0 + s.len).div_ceil(block_size);
        if s.table.len() < needed {
            return Err(ForwardError::KvBlocks {
                positions: s.pos0 + s.len,
                needed,
                have: s.table.len(),
            });
        }
        if let Some(&id) = s.table[..needed].iter().find(|&&b| b as usize >= blocks) {
            return Err(ForwardError::KvBlockId { id, blocks });
        }
    }
    Ok(())
}

/// A batch of sequences over one pool. The caller records the new lengths on success.
#[derive(Debug)]
pub struct PagedBatch<'a> {
    pub pool: &'a mut PagedKv,
    pub seqs: &'a [PagedSeq<'a>],
}

impl KvSpans for PagedBatch<'_> {
    fn seqs(&self) -> usize {
        self.seqs.len()
    }

    fn span(&self, i: usize) -> (usize, usize) {
        (self.seqs[i].pos0, self.seqs[i].len)
    }

    fn stored(&self, i: usize) -> usize {
        self.seqs[i].stored
    }

    fn prompt_len(&self, i: usize) -> usize {
        self.seqs[i].prompt_len
    }

    fn prepare(&mut self) -> Result<(), ForwardError> {
        check_tables(self.seqs, self.pool.block_size, self.pool.blocks)?;
        for r in self.pool.state_at.new_slots(self.seqs)? {
            self.pool.states[r].fill(0.0);
        }
        Ok(())
    }

    fn commit(&mut self) {}
}

impl BatchKv for PagedBatch<'_> {
    fn write(&mut self, i: usize, layer: usize, k: &[f32], v: &[f32]) {
        let s = self.seqs[i];
        let d = self.pool.kv_dim;
        for (r, (kr, vr)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let at = self.pool.row(s.table, s.pos0 + r) * d;
            let l = &mut self.pool.layers[layer];
            l.k.put(at, kr);
            l.v.put(at, vr);
        }
    }

    fn layer(&self, i: usize, layer: usize) -> (KvData<'_>, KvData<'_>, Rows<'_>) {
        let l = &self.pool.layers[layer];
        let layout = Rows::Paged {
            table: self.seqs[i].table,
            block_size: self.pool.block_size,
        };
        (l.k.data(), l.v.data(), layout)
    }

    fn state(&mut self, i: usize, layer: usize) -> &mut [f32] {
        let n = self.pool.state_at.values;
        let at = (self.seqs[i].state_slot * self.pool.state_at.layers + layer) * n;
        &mut self.pool.states[at..at + n]
    }
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
            state_slot: 0,
            prompt_len: 0,
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
            state_slot: 0,
            prompt_len: 0,
        }];
        let batch = PagedBatch {
            pool: &mut pool,
            seqs: &seqs,
        };
        let (KvData::F32(kp), KvData::F32(vp), layout) = batch.layer(0, 0) else {
            panic!("an f32 pool gives f32 rows");
        };
        let mut got = vec![0f32; 3 * qd];
        attention_rows(&q, kp, vp, n - 3, shape, &mut vec![0f32; n], &mut got, |p| {
            layout.row(p)
        });
        assert_eq!(got, want);
    }

    #[test]
    fn an_f16_pool_stores_each_value_rounded_to_the_nearest_half() {
        let (kvd, bs) = (8, 4);
        let k: Vec<f32> = (0..3 * kvd).map(|i| (i as f32 - 11.3) * 0.377).collect();
        let v: Vec<f32> = k.iter().map(|x| x * 1e3 + 1e-4).collect();
        let mut pool = PagedKv::with_dtype(2, kvd, bs, 4, KvDtype::F16);
        assert_eq!(pool.dtype(), KvDtype::F16);
        let table = [2u32];
        let seqs = [PagedSeq {
            pos0: 0,
            len: 3,
            stored: 0,
            table: &table,
            state_slot: 0,
            prompt_len: 0,
        }];
        let mut batch = PagedBatch {
            pool: &mut pool,
            seqs: &seqs,
        };
        batch.prepare().unwrap();
        batch.write(0, 1, &k, &v);
        let (KvData::F16(kp), KvData::F16(vp), layout) = batch.layer(0, 1) else {
            panic!("an f16 pool gives f16 rows");
        };
        for p in 0..3 {
            let at = layout.row(p) * kvd;
            for j in 0..kvd {
                assert_eq!(kp[at + j], HalfKind::F16.from_f32(k[p * kvd + j]));
                assert_eq!(vp[at + j], HalfKind::F16.from_f32(v[p * kvd + j]));
                let back = HalfKind::F16.to_f32(kp[at + j]);
                assert!((back - k[p * kvd + j]).abs() <= k[p * kvd + j].abs() / 2048.0);
            }
        }
    }

    #[test]
    fn short_tables_and_foreign_block_ids_are_refused() {
        let mut pool = PagedKv::new(2, 8, 4, 3);
        let short = [PagedSeq {
            pos0: 4,
            len: 2,
            stored: 4,
            table: &[0],
            state_slot: 0,
            prompt_len: 0,
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
            state_slot: 0,
            prompt_len: 0,
        }];
        let e = PagedBatch {
            pool: &mut pool,
            seqs: &foreign,
        }
        .prepare()
        .unwrap_err();
        assert_eq!(e, ForwardError::KvBlockId { id: 3, blocks: 3 });
        assert_eq!(pool.bytes(), 3 * PagedKv::bytes_per_block(2, 8, 4, KvDtype::F32));
        let half = PagedKv::with_dtype(2, 8, 4, 3, KvDtype::F16);
        assert_eq!(half.bytes() * 2, pool.bytes());
    }

    #[test]
    fn a_state_layout_places_slots_then_snapshots_and_names_the_new_sequences_slots() {
        let at = StateLayout::new(2, 5, 3, 2);
        assert_eq!((at.per_slot(), at.floats()), (10, 50));
        assert_eq!(at.slot(2).unwrap(), 20..30);
        assert_eq!(at.snapshot(1).unwrap(), 40..50);
        assert!(matches!(at.slot(3), Err(ForwardError::StateSlot { slot: 3, slots: 3 })));
        assert!(matches!(
            at.snapshot(2),
            Err(ForwardError::StateSnapshot {
                snapshot: 2,
                snapshots: 2
            })
        ));
        let table = [0u32];
        let seq = |pos0, state_slot| PagedSeq {
            pos0,
            len: 1,
            stored: pos0,
            table: &table,
            state_slot,
            prompt_len: 0,
        };
        let seqs = [seq(0, 1), seq(4, 0), seq(0, 2)];
        let new: Vec<_> = at.new_slots(&seqs).unwrap().collect();
        assert_eq!(new, [10..20, 20..30], "only the sequences starting at position 0");
        assert!(at.new_slots(&[seq(4, 3)]).is_err(), "a slot past the last");
        // Without linear-attention layers: no slots, and no slot is checked.
        let none = StateLayout::new(0, 5, 3, 2);
        assert_eq!((none.slots, none.snapshots, none.floats()), (0, 0, 0));
        assert_eq!(none.new_slots(&seqs).unwrap().count(), 0);
    }
}
