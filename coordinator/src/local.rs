//! The whole model as one stage in this process (`baton serve --workers 0`, `baton generate`),
//! served by the same scheduler and engine as a pipeline of workers: continuous batching, paged KV, the
//! prefix cache and the pipeline's metrics all apply. [`start`] is the entry point.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_shared::model_files::{LoadError, ModelFiles};
use baton_shared::proto::Dtype;
use baton_worker::backend::{self, BackendError, BackendOptions, Device};
use baton_worker::kv_cache::KvDtype;
use baton_worker::model::WeightFormat;
use baton_worker::model::spec::CacheBytes;
use baton_worker::stage::Stage;

use crate::pipeline::{PipelineConfig, PipelineGenerator, StageLoader, sizing};

/// How to build the in-process stage.
#[derive(Debug, Clone)]
pub struct LocalStageOptions {
    /// Where the stage computes (`cpu`, or `cuda:N` in a build with the `cuda` feature).
    pub device: Device,
    pub format: WeightFormat,
    /// Threads for the matrix products.
    pub threads: usize,
    /// Reject weights holding NaN or infinity.
    pub check_finite: bool,
    /// Bytes the paged KV pool may take (what `kv_cache_mib` gives a worker).
    pub kv_budget_bytes: u64,
    /// At most this many blocks even if the budget fits more.
    pub kv_max_blocks: Option<usize>,
    pub kv_block_size: usize,
    pub kv_dtype: KvDtype,
    /// A DFlash draft checkpoint the stage serves (speculative decoding).
    pub draft_model: Option<std::path::PathBuf>,
    /// Recurrent-state slots (the running limit) for a model with linear-attention layers;
    /// 0: as many as the pool has blocks, at most 64.
    pub state_slots: usize,
    /// Recurrent-state snapshots for a hybrid model's prefix cache (0: none).
    pub state_snapshots: usize,
}

impl Default for LocalStageOptions {
    /// f32 weights on every core, 1 GiB of f32 KV in blocks of 16 positions.
    fn default() -> Self {
        Self {
            device: Device::Cpu { threads: None },
            format: WeightFormat::F32,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            check_finite: true,
            kv_budget_bytes: 1 << 30,
            kv_max_blocks: None,
            kv_block_size: 16,
            kv_dtype: KvDtype::F32,
            draft_model: None,
            state_slots: 0,
            state_snapshots: 0,
        }
    }
}

/// Why the in-process stage could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("opening {path}: {source}")]
    Open { path: PathBuf, source: Box<LoadError> },
    #[error("kv_block_size and kv_max_blocks must be at least 1")]
    ZeroKvGeometry,
    #[error(
        "a KV budget of {budget} bytes is less than one block of {block_size} positions ({per_block} bytes) beside \
         {states} recurrent-state copies of {state_bytes} bytes: raise kv_cache_mib (or lower max_running or state_snapshots)"
    )]
    KvBudget {
        budget: u64,
        block_size: usize,
        per_block: usize,
        states: usize,
        state_bytes: usize,
    },
    #[error("loading {path}: {source}")]
    Backend { path: PathBuf, source: Box<BackendError> },
}

/// The state slots the in-process stage keeps (as [`BackendOptions::effective_state_slots`]
/// decides once the block count is known: at most the blocks there are).
fn effective_state_slots(opts: &LocalStageOptions) -> usize {
    match opts.state_slots {
        0 => baton_worker::backend::DEFAULT_STATE_SLOTS,
        n => n,
    }
}

/// Load every layer of the model at `path` with its embedding and head, and a KV pool of as
/// many blocks as the budget fits (capped by `kv_max_blocks`). Needs no tokenizer files.
pub fn load_stage(path: &Path, opts: &LocalStageOptions) -> Result<Stage, LocalError> {
    let _span = tracing::info_span!("model.load_weights", path = %path.display()).entered();
    let open = |source| LocalError::Open {
        path: path.to_path_buf(),
        source: Box::new(source),
    };
    let files = ModelFiles::open(path).map_err(open)?;
    let config = files.config().map_err(open)?;
    if opts.kv_block_size == 0 || opts.kv_max_blocks == Some(0) {
        return Err(LocalError::ZeroKvGeometry);
    }
    // The budget holds the blocks and, for a model with linear-attention layers, the state
    // slots and snapshots (as a worker's does).
    let caches = crate::pipeline::layer_caches(&config);
    let bytes = CacheBytes::of(caches, opts.kv_block_size, opts.kv_dtype.bytes());
    let states = match bytes.per_state {
        0 => 0,
        _ => effective_state_slots(opts) + opts.state_snapshots,
    };
    let per_block = bytes.per_block.max(1);
    let left = (opts.kv_budget_bytes as u128).saturating_sub(bytes.total(0, states));
    let fits = (left / per_block as u128).min(usize::MAX as u128) as usize;
    let kv_blocks = fits.min(opts.kv_max_blocks.unwrap_or(usize::MAX));
    if kv_blocks == 0 {
        return Err(LocalError::KvBudget {
            budget: opts.kv_budget_bytes,
            block_size: opts.kv_block_size,
            per_block,
            states,
            state_bytes: bytes.per_state,
        });
    }
    let backend_opts = BackendOptions {
        device: opts.device,
        format: opts.format,
        cpu: baton_worker::backend::CpuOptions::threads(opts.threads.max(1)),
        check_finite: opts.check_finite,
        kv_blocks,
        kv_block_size: opts.kv_block_size,
        kv_dtype: opts.kv_dtype,
        state_slots: opts.state_slots,
        state_snapshots: opts.state_snapshots,
    };
    let mut backend =
        backend::load(&files, &config, 0..config.num_layers, &backend_opts).map_err(|source| LocalError::Backend {
            path: path.to_path_buf(),
            source: Box::new(source),
        })?;
    let runner = match &opts.draft_model {
        Some(draft) => baton_worker::drafting::attach(&mut *backend, draft, &files, opts.threads.max(1), None)
            .map_err(|source| LocalError::Backend {
                path: draft.clone(),
                source: Box::new(source),
            })?,
        None => None,
    };
    let info = backend.info();
    tracing::info!(kernels = %info.kernels, threads = info.threads, weights = %info.weights,
        weight_bytes = info.weight_bytes, kv_blocks, kv_dtype = %opts.kv_dtype, "in-process stage loaded");
    let mut stage = Stage::new(backend, 0, Dtype::F32);
    if let Some(runner) = runner {
        stage.serve_draft(Some(runner));
    }
    Ok(stage)
}

/// Load the model at `path` as one in-process stage and serve it with the engine (call
/// inside a tokio runtime). `config.stages` is taken as 1; if the stage ever fails it is
/// loaded again from the same files.
///
/// For a model with linear-attention layers whose running limit was left to be sized, the
/// stage keeps only the recurrent-state slots (one per running sequence) that fit the KV
/// budget beside the prefix cache's snapshots, as a worker's stage is sized, and the running
/// limit comes down to them: a Qwen3-Next slot is tens of MB, so the default 64 need not fit
/// the default 1 GiB.
pub fn start(config: PipelineConfig, path: &Path, opts: &LocalStageOptions) -> Result<PipelineGenerator, LocalError> {
    let mut opts = opts.clone();
    let bytes = config.cache_bytes(0..config.num_layers);
    if bytes.per_state > 0 && config.auto_limits.max_running {
        let fits = sizing::state_sequences(
            bytes,
            opts.kv_budget_bytes,
            opts.state_snapshots,
            opts.kv_block_size,
            config.max_context,
        );
        if fits < effective_state_slots(&opts) {
            opts.state_slots = fits.max(1);
        }
    }
    let stage = load_stage(path, &opts)?;
    let path = path.to_path_buf();
    let reload: StageLoader = Arc::new(move || load_stage(&path, &opts).map_err(|e| e.to_string()));
    Ok(PipelineGenerator::start_local(config, stage, reload))
}
