//! The model on the CPU under its historical name, [`StageWeights`], with the host-slice entry
//! points the single-process engine, the benchmarks and the tests use.

use std::ops::Range;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles};

use super::{ForwardError, Scratch, StageModel};
use crate::kernels::cpu::dispatch::Kernels;
use crate::kernels::cpu::matmul::WeightFormat;
use crate::kv_cache::{AnyKv, BatchKv, BatchSeq, SequenceKv};
use crate::ops::cpu::{CpuOps, embed_rows};

/// A stage's weights on the CPU.
pub type StageWeights = StageModel<CpuOps>;

/// How to hold and run a stage's weights on the CPU; the default is the reference behaviour
/// (f32, one thread), bit-identical to the fp32 reference kernels.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Storage of the linear layers and the head.
    pub format: WeightFormat,
    /// Threads for the matrix products (the calling thread included).
    pub threads: usize,
    /// Kernel path; `None` picks the fastest this CPU supports.
    pub kernels: Option<Kernels>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            format: WeightFormat::F32,
            threads: 1,
            kernels: None,
        }
    }
}

impl StageModel<CpuOps> {
    /// Load the tensors for `layers` (and the embedding when `first`, the head when `last`) as
    /// f32 on one thread (the reference behaviour).
    pub fn load(
        files: &ModelFiles,
        config: &ModelConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
        check_finite: bool,
    ) -> Result<Self, LoadError> {
        Self::load_with(
            files,
            config,
            layers,
            first,
            last,
            check_finite,
            &LoadOptions::default(),
        )
    }

    /// [`load`](Self::load) with a weight format, thread count and kernel path.
    pub fn load_with(
        files: &ModelFiles,
        config: &ModelConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
        check_finite: bool,
        opts: &LoadOptions,
    ) -> Result<Self, LoadError> {
        let ops = CpuOps::new(opts.threads, opts.kernels);
        Self::load_on(ops, files, config, layers, first, last, check_finite, opts.format)
    }

    /// Load the whole model as a single stage, after checking the files hold exactly its tensors.
    pub fn load_full(files: &ModelFiles, config: &ModelConfig, check_finite: bool) -> Result<Self, LoadError> {
        Self::load_full_with(files, config, check_finite, &LoadOptions::default())
    }

    /// [`load_full`](Self::load_full) with a weight format, thread count and kernel path.
    pub fn load_full_with(
        files: &ModelFiles,
        config: &ModelConfig,
        check_finite: bool,
        opts: &LoadOptions,
    ) -> Result<Self, LoadError> {
        Self::validate_files(files, config)?;
        Self::load_with(files, config, 0..config.num_layers, true, true, check_finite, opts)
    }

    /// An empty cache of one sequence for this stage's layers (K/V for its attention layers,
    /// recurrent state for its linear-attention ones), with room for `capacity` positions.
    pub fn new_kv(&self, capacity: usize) -> SequenceKv {
        let c = &self.cache;
        SequenceKv::with_state(
            c.kv_layers,
            self.config.kv_dim(),
            capacity,
            c.state_layers,
            c.state_values,
        )
    }

    /// Embedding rows for `tokens` into `out` (`tokens.len() × hidden`).
    pub fn embed(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), ForwardError> {
        embed_rows(self.embedding_for(tokens)?, tokens, out)
    }

    /// Run this stage's layers on `hidden` (`t × hidden_size`, tokens at positions
    /// `pos0..pos0+t` of one sequence), updating the sequence's KV cache. The rows count as
    /// prompt (see [`KvSpans::prompt_len`](crate::kv_cache::KvSpans::prompt_len)): a
    /// hybrid's prompt gives the same bits cut into calls on window boundaries or in one.
    pub fn forward(
        &self,
        hidden: &mut [f32],
        pos0: usize,
        kv: &mut SequenceKv,
        s: &mut Scratch,
    ) -> Result<(), ForwardError> {
        let len = hidden.len() / self.config.hidden_size;
        let prompt_len = pos0 + len;
        self.forward_batch(
            hidden,
            &mut [BatchSeq {
                pos0,
                len,
                prompt_len,
                kv,
            }][..],
            s,
        )
    }

    /// Run this stage's layers on the rows of several sequences at once (see
    /// [`run_layers`](StageModel::run_layers)), over any host K/V layout.
    pub fn forward_batch<K: BatchKv + ?Sized>(
        &self,
        hidden: &mut [f32],
        kv: &mut K,
        s: &mut Scratch,
    ) -> Result<(), ForwardError> {
        self.forward_host(hidden, &mut AnyKv(kv), s)
    }
}
