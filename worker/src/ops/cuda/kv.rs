//! The paged K/V pool of a stage on a GPU: the same blocks, ids and tables as the CPU pool
//! ([`crate::kv_cache::PagedKv`]), held in GPU memory as f32 or f16, allocated once at load.
//! A batch's metadata ([`BatchMeta`]) is built on the host and uploaded once per forward; every
//! layer's attention reads it.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::device::{Gpu, upload_into};
use crate::kernels::cuda::BatchMeta;
use crate::kv_cache::paged::check_tables;
use crate::kv_cache::{KvDtype, KvSpans, PagedKv, PagedSeq};
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
        })
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

    /// Bytes the pool holds on the GPU.
    pub fn bytes(&self) -> usize {
        PagedKv::bytes_per_block(self.layers.len(), self.kv_dim, self.block_size, self.dtype) * self.blocks
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

    fn prepare(&mut self) -> Result<(), ForwardError> {
        let pool = &mut *self.pool;
        check_tables(self.seqs, pool.block_size, pool.blocks)?;
        pool.meta.build(self.seqs, pool.block_size);
        let stream = &pool.gpu.stream;
        let uploaded = upload_into(stream, &pool.meta.rows, &mut pool.rows)
            .and_then(|()| upload_into(stream, &pool.meta.slots, &mut pool.slots))
            .and_then(|()| upload_into(stream, &pool.meta.tables, &mut pool.tables));
        uploaded.map_err(|e| ForwardError::Device(format!("uploading the batch's block tables: {e}")))
    }

    fn commit(&mut self) {}
}
