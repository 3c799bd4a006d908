//! The paged K/V pool of a stage on a GPU: the same blocks, ids and tables as the CPU pool
//! ([`crate::kv_cache::PagedKv`]), held in GPU memory as f32 or f16, allocated once at load;
//! and, for linear-attention layers, the recurrent-state slots and prefix-cache snapshots, laid
//! out as the CPU pool lays them out (f32). A batch's metadata ([`BatchMeta`], and its
//! sequences' state slots) is built on the host and uploaded once per forward; every layer
//! reads it.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::device::Gpu;
use crate::kernels::cuda::BatchMeta;
use crate::kernels::cuda::linear::{LinearSeq, linear_seqs};
use crate::kv_cache::paged::check_tables;
use crate::kv_cache::{KvDtype, KvSpans, PagedKv, PagedSeq, StateLayout};
use crate::model::ForwardError;

/// One layer's keys or values.
pub enum KvStore {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
}

/// The pool.
pub struct CudaKvPool {
    pub(super) layers: Vec<(KvStore, KvStore)>,
    pub(super) kv_dim: usize,
    pub(super) block_size: usize,
    blocks: usize,
    dtype: KvDtype,
    gpu: Arc<Gpu>,
    meta: BatchMeta,
    pub(super) rows: Option<CudaSlice<i32>>,
    pub(super) slots: Option<CudaSlice<i32>>,
    pub(super) tables: Option<CudaSlice<u32>>,
    /// The slots, then the snapshots, as `state_at` lays them out (none without
    /// linear-attention layers).
    pub(super) states: Option<CudaSlice<f32>>,
    pub(super) state_at: StateLayout,
    pub(super) linear_host: Vec<LinearSeq>,
    /// The batch's sequences for the linear-attention kernels.
    pub(super) linear: Option<CudaSlice<LinearSeq>>,
}

impl CudaKvPool {
    /// `blocks` blocks of `block_size` positions for `layers` layers of `kv_dim` values.
    pub fn new(
        gpu: Arc<Gpu>,
        layers: usize,
        kv_dim: usize,
        block_size: usize,
        blocks: usize,
        dtype: KvDtype,
    ) -> Result<Self, String> {
        let n = blocks * block_size * kv_dim;
        let s = &gpu.stream;
        let store = || -> Result<KvStore, String> {
            Ok(match dtype {
                KvDtype::F32 => KvStore::F32(s.alloc_zeros::<f32>(n.max(1)).map_err(|e| e.to_string())?),
                KvDtype::F16 => KvStore::F16(s.alloc_zeros::<u16>(n.max(1)).map_err(|e| e.to_string())?),
            })
        };
        let layers = (0..layers)
            .map(|_| Ok((store()?, store()?)))
            .collect::<Result<Vec<_>, String>>()
            .map_err(|e| format!("allocating {} KV blocks on the GPU: {e}", blocks))?;
        Ok(Self {
            layers,
            kv_dim,
            block_size,
            blocks,
            dtype,
            gpu,
            meta: BatchMeta::default(),
            rows: None,
            slots: None,
            tables: None,
            states: None,
            state_at: StateLayout::default(),
            linear_host: Vec::new(),
            linear: None,
        })
    }

    /// The pool with `slots` recurrent-state slots and `snapshots` snapshots for `state_layers`
    /// layers of `state_values` f32s each (zeros), as [`PagedKv::with_states`].
    pub fn with_states(
        mut self,
        state_layers: usize,
        state_values: usize,
        slots: usize,
        snapshots: usize,
    ) -> Result<Self, String> {
        if state_layers == 0 {
            return Ok(self);
        }
        let state_at = StateLayout::new(state_layers, state_values, slots, snapshots);
        let states = self
            .gpu
            .stream
            .alloc_zeros::<f32>(state_at.floats().max(1))
            .map_err(|e| {
                format!("allocating {slots} recurrent-state slots and {snapshots} snapshots on the GPU: {e}")
            })?;
        self.states = Some(states);
        self.state_at = state_at;
        Ok(self)
    }

    /// Recurrent-state slots (0 without linear-attention layers).
    pub fn state_slots(&self) -> usize {
        self.state_at.slots
    }

    /// Recurrent-state snapshots for the prefix cache.
    pub fn state_snapshots(&self) -> usize {
        self.state_at.snapshots
    }

    fn device_error(what: &str, e: impl std::fmt::Display) -> ForwardError {
        ForwardError::Device(format!("{what}: {e}"))
    }

    /// Copy `slot`'s state to the host (waits for the device).
    pub fn slot_state(&self, slot: usize, out: &mut Vec<f32>) -> Result<(), ForwardError> {
        let r = self.state_at.slot(slot)?;
        let Some(states) = self.states.as_ref() else {
            return Err(Self::device_error("reading a recurrent state", "no states"));
        };
        out.clear();
        out.resize(r.len(), 0.0);
        let stream = &self.gpu.stream;
        stream
            .memcpy_dtoh(&states.slice(r), out.as_mut_slice())
            .and_then(|()| stream.synchronize())
            .map_err(|e| Self::device_error("reading a recurrent state", e))
    }

    /// Put `state` (as [`slot_state`](Self::slot_state) gave it) into `slot`.
    pub fn set_slot_state(&mut self, slot: usize, state: &[f32]) -> Result<(), ForwardError> {
        let r = self.state_at.slot(slot)?;
        if r.len() != state.len() {
            return Err(ForwardError::StateSize {
                got: state.len(),
                want: r.len(),
            });
        }
        let stream = self.gpu.stream.clone();
        let Some(states) = self.states.as_mut() else {
            return Err(Self::device_error("writing a recurrent state", "no states"));
        };
        stream
            .memcpy_htod(state, &mut states.slice_mut(r))
            .map_err(|e| Self::device_error("writing a recurrent state", e))
    }

    /// Copy `slot`'s state into snapshot `snapshot` (on the device).
    pub fn save_snapshot(&mut self, slot: usize, snapshot: usize) -> Result<(), ForwardError> {
        let (from, to) = (self.state_at.slot(slot)?, self.state_at.snapshot(snapshot)?);
        self.copy_state(from, to)
    }

    /// Start `slot`'s state from snapshot `snapshot` (on the device).
    pub fn load_snapshot(&mut self, snapshot: usize, slot: usize) -> Result<(), ForwardError> {
        let (from, to) = (self.state_at.snapshot(snapshot)?, self.state_at.slot(slot)?);
        self.copy_state(from, to)
    }

    /// Copy one slot-sized range of `states` onto another (a slot and a snapshot: disjoint).
    fn copy_state(&mut self, from: std::ops::Range<usize>, to: std::ops::Range<usize>) -> Result<(), ForwardError> {
        let mid = self.state_at.slots * self.state_at.per_slot();
        let stream = self.gpu.stream.clone();
        let Some(states) = self.states.as_mut() else {
            return Err(Self::device_error("copying a recurrent state", "no states"));
        };
        // Slots lie below `mid`, snapshots above it: two views that do not overlap.
        let (mut slots, mut snapshots) = states.split_at_mut(mid);
        let r = match from.start < mid {
            true => stream.memcpy_dtod(
                &slots.slice(from),
                &mut snapshots.slice_mut(to.start - mid..to.end - mid),
            ),
            false => stream.memcpy_dtod(
                &snapshots.slice(from.start - mid..from.end - mid),
                &mut slots.slice_mut(to),
            ),
        };
        r.map_err(|e| Self::device_error("copying a recurrent state", e))
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes the pool holds on the GPU (blocks, state slots and snapshots).
    pub fn bytes(&self) -> usize {
        PagedKv::bytes_per_block(self.layers.len(), self.kv_dim, self.block_size, self.dtype) * self.blocks
            + self.state_at.floats() * size_of::<f32>()
    }
}

/// A batch of sequences over the pool, as [`crate::kv_cache::PagedBatch`] is on the CPU.
pub struct CudaBatch<'a> {
    pub pool: &'a mut CudaKvPool,
    pub seqs: &'a [PagedSeq<'a>],
}

impl KvSpans for CudaBatch<'_> {
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
        let pool = &mut *self.pool;
        check_tables(self.seqs, pool.block_size, pool.blocks)?;
        let new_slots = pool.state_at.new_slots(self.seqs)?;
        pool.meta.build(self.seqs, pool.block_size);
        // The tables padded to a power of two: their upload keeps one size while the sequences
        // grow, so a decode step's copies stay those of the graph captured for it.
        let padded = pool.meta.tables.len().max(1).next_power_of_two();
        pool.meta.tables.resize(padded, 0);
        let gpu = pool.gpu.clone();
        let uploaded = gpu
            .upload_into(&pool.meta.rows, &mut pool.rows)
            .and_then(|()| gpu.upload_into(&pool.meta.slots, &mut pool.slots))
            .and_then(|()| gpu.upload_into(&pool.meta.tables, &mut pool.tables));
        uploaded.map_err(|e| ForwardError::Device(format!("uploading the batch's block tables: {e}")))?;
        let Some(states) = pool.states.as_mut() else {
            return Ok(());
        };
        // A sequence starting at position 0 starts from a zero state, as on the CPU.
        for r in new_slots {
            gpu.zero(states, r)
                .map_err(|e| ForwardError::Device(format!("zeroing a recurrent state: {e}")))?;
        }
        linear_seqs(self.seqs, &mut pool.linear_host);
        gpu.upload_into(&pool.linear_host, &mut pool.linear)
            .map_err(|e| ForwardError::Device(format!("uploading the batch's state slots: {e}")))
    }

    fn commit(&mut self) {}
}
