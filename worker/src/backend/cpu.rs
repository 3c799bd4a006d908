//! The CPU backend: weights in any [`WeightFormat`] on the runtime-dispatched kernels, a thread
//! pool sized to the socket, and a paged f32 or f16 KV pool allocated once at load.

use baton_shared::model_files::ModelFiles;

use super::{Backend, BackendError, BackendInfo, BackendOptions, Device, KvGeometry, SeqChunk, StageShape};
use crate::kv_cache::{PagedBatch, PagedKv};
use crate::model::{ForwardError, LoadOptions, Scratch, StageWeights};

/// A stage on the CPU.
pub struct CpuBackend {
    shape: StageShape,
    device: Device,
    weights: StageWeights,
    kv: PagedKv,
    scratch: Scratch,
}

impl CpuBackend {
    /// Load the layers, embedding and head `shape` names.
    pub fn load(files: &ModelFiles, shape: &StageShape, opts: &BackendOptions) -> Result<Self, BackendError> {
        let Device::Cpu { threads } = opts.device else {
            return Err(BackendError::Unavailable(opts.device));
        };
        if opts.kv_blocks == 0 || opts.kv_block_size == 0 {
            return Err(BackendError::KvGeometry {
                blocks: opts.kv_blocks,
                block_size: opts.kv_block_size,
            });
        }
        let load = LoadOptions {
            format: opts.format,
            threads: threads.unwrap_or(opts.threads).max(1),
            kernels: opts.kernels,
        };
        let weights = StageWeights::load_with(
            files,
            &shape.config,
            shape.layers.clone(),
            shape.first,
            shape.last,
            opts.check_finite,
            &load,
        )?;
        let kv = PagedKv::with_dtype(
            weights.layers.len(),
            weights.config.kv_dim(),
            opts.kv_block_size,
            opts.kv_blocks,
            opts.kv_dtype,
        );
        Ok(Self::new(weights, opts.device, kv))
    }

    /// A backend over loaded weights and a KV pool for their layers.
    pub fn new(weights: StageWeights, device: Device, kv: PagedKv) -> Self {
        let shape = StageShape {
            config: weights.config.clone(),
            layers: weights.layers.clone(),
            first: weights.is_first,
            last: weights.is_last,
        };
        Self {
            shape,
            device,
            weights,
            kv,
            scratch: Scratch::default(),
        }
    }
}

impl Backend for CpuBackend {
    fn shape(&self) -> &StageShape {
        &self.shape
    }

    fn info(&self) -> BackendInfo {
        let w = &self.weights;
        BackendInfo {
            device: self.device,
            kernels: w.kernels.path().name().to_string(),
            threads: w.pool.threads(),
            weights: w.format,
            weight_bytes: w.weight_bytes(),
            part_bytes: w.part_bytes(),
            matrix_bytes: w.matrix_bytes(),
        }
    }

    fn kv(&self) -> KvGeometry {
        KvGeometry {
            blocks: self.kv.blocks(),
            block_size: self.kv.block_size(),
            bytes: self.kv.bytes(),
            dtype: self.kv.dtype(),
        }
    }

    fn embed(&mut self, tokens: &[u32], hidden: &mut [f32]) -> Result<(), ForwardError> {
        if !self.weights.is_first {
            return Err(ForwardError::MissingPart("embedding"));
        }
        self.weights.embed(tokens, hidden)
    }

    fn forward(&mut self, hidden: &mut [f32], seqs: &[SeqChunk<'_>]) -> Result<(), ForwardError> {
        let mut kv = PagedBatch {
            pool: &mut self.kv,
            seqs,
        };
        self.weights.forward_batch(hidden, &mut kv, &mut self.scratch)
    }

    fn logits(&mut self, rows: &[f32], out: &mut [f32]) -> Result<(), ForwardError> {
        self.weights.logits(rows, &mut self.scratch, out)
    }
}
