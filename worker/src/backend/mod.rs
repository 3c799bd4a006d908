//! What a stage computes on. A [`Backend`] owns a layer range's weights in a chosen format and
//! the paged KV store for those layers, runs a batch of tokens (many sequences, prefill chunks
//! and decode tokens mixed) through them, and on the last stage samples the next tokens. The
//! pipeline [`Stage`](crate::stage::Stage) talks only to this trait, so it never sees where
//! weights, KV or kernels live.
//!
//! A backend is thin: the model code is [`crate::model::StageModel`] over a device's
//! [`crate::ops::Ops`]; a backend adds the device's K/V store and its sampling.
//! [`cpu::CpuBackend`] is this build's; a CUDA backend is `StageModel<CudaOps>` plus a device
//! K/V pool behind the same trait.
//!
//! Hidden states cross the trait as host `f32` rows: that is what travels between stages anyway,
//! and a device backend keeps everything else (weights, KV, intermediate activations) resident.

pub mod cpu;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles};

pub use crate::kv_cache::PagedSeq as SeqChunk;
use crate::kv_cache::{KvDtype, PagedKv};
use crate::model::spec::LayerSpec;
use crate::model::{ForwardError, PartBytes, WeightFormat, registry};
pub use crate::ops::cpu::CpuOptions;
use crate::sampler::Sampler;

/// Where a worker computes, as given by `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU socket; `threads` (`cpu:N`) overrides "all cores".
    Cpu { threads: Option<usize> },
    /// GPU number `gpu` (`cuda`, `cuda:N`).
    Cuda { gpu: u32 },
}

/// A `--device` value that is not one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad device '{0}': expected cpu, cpu:THREADS (THREADS ≥ 1), cuda or cuda:GPU")]
pub struct DeviceSyntax(String);

impl FromStr for Device {
    type Err = DeviceSyntax;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || DeviceSyntax(s.to_string());
        let (kind, n) = match s.trim().split_once(':') {
            None => (s.trim(), None),
            Some((k, n)) => (k, Some(n.parse::<u32>().map_err(|_| bad())?)),
        };
        match (kind.to_ascii_lowercase().as_str(), n) {
            ("cpu", Some(0)) => Err(bad()),
            ("cpu", n) => Ok(Device::Cpu {
                threads: n.map(|n| n as usize),
            }),
            ("cuda" | "gpu", n) => Ok(Device::Cuda { gpu: n.unwrap_or(0) }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu { threads: None } => write!(f, "cpu"),
            Device::Cpu { threads: Some(n) } => write!(f, "cpu:{n}"),
            Device::Cuda { gpu } => write!(f, "cuda:{gpu}"),
        }
    }
}

impl Device {
    /// The device kind as reported to the coordinator and in metrics (`cpu`, `cuda`).
    pub fn kind(&self) -> &'static str {
        match self {
            Device::Cpu { .. } => "cpu",
            Device::Cuda { .. } => "cuda",
        }
    }

    /// Whether this build can run on the device; the error says what to use instead.
    pub fn check_available(&self) -> Result<(), BackendError> {
        match self {
            Device::Cpu { .. } => Ok(()),
            Device::Cuda { .. } => Err(BackendError::Unavailable(*self)),
        }
    }
}

/// The part of a model a backend holds: a layer range, plus the embedding on the first stage and
/// the final norm and head on the last.
#[derive(Debug, Clone)]
pub struct StageShape {
    pub config: ModelConfig,
    pub layers: Range<usize>,
    /// Starts from token ids.
    pub first: bool,
    /// Produces logits.
    pub last: bool,
}

impl StageShape {
    /// The shape of a pipeline stage serving `layers`: the embedding comes with layer 0 and the
    /// head with the model's last layer.
    pub fn stage(config: &ModelConfig, layers: Range<usize>) -> Self {
        Self {
            first: layers.start == 0,
            last: layers.end == config.num_layers,
            config: config.clone(),
            layers,
        }
    }
}

/// The geometry of a backend's paged KV store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Bytes the store reserves.
    pub bytes: usize,
    pub dtype: KvDtype,
}

/// What a backend reports about itself (logs, metrics, the coordinator's cluster view).
#[derive(Debug, Clone, PartialEq)]
pub struct BackendInfo {
    pub device: Device,
    /// The kernel path (`avx512_vnni`, `avx2`, …) or the GPU's name.
    pub kernels: String,
    /// Threads the matrix products run on.
    pub threads: usize,
    pub weights: WeightFormat,
    /// Bytes of weights held.
    pub weight_bytes: usize,
    /// What the layers, the embedding and the head each need on their own.
    pub part_bytes: PartBytes,
    /// Bytes of matrix weights one decode step reads (the streaming-read floor).
    pub matrix_bytes: usize,
}

/// One row to sample on the last stage: the sequence's sampler going in, its token (and
/// log-probabilities when asked) coming out.
#[derive(Debug, Clone)]
pub struct SampleSlot {
    /// The sequence's sampling state (parameters and random stream), advanced by one draw.
    pub sampler: Sampler,
    /// Return the chosen token's log-probability and this many alternatives.
    pub top_logprobs: Option<usize>,
    pub token: u32,
    pub logprob: f32,
    /// The most likely `(id, logprob)` pairs, best first.
    pub top: Vec<(u32, f32)>,
}

impl SampleSlot {
    /// A slot for `sampler`.
    pub fn new(sampler: Sampler, top_logprobs: Option<usize>) -> Self {
        Self {
            sampler,
            top_logprobs,
            token: 0,
            logprob: 0.0,
            top: Vec::new(),
        }
    }
}

/// A compute device holding a stage: weights, paged KV, kernels.
pub trait Backend: Send {
    /// The layers and parts held.
    fn shape(&self) -> &StageShape;
    /// Device, kernels, threads and weight format.
    fn info(&self) -> BackendInfo;
    /// The KV store's geometry.
    fn kv(&self) -> KvGeometry;
    /// Token ids to hidden rows (`tokens.len() × hidden_size`); first stage only.
    fn embed(&mut self, tokens: &[u32], hidden: &mut [f32]) -> Result<(), ForwardError>;
    /// Run the layers over `hidden`, holding every chunk's rows back to back in `seqs` order,
    /// and store each chunk's K/V in its blocks. Each weight matrix is applied to all rows at
    /// once; each row's result is the same as running its sequence alone. An error leaves the
    /// KV store as it was.
    fn forward(&mut self, hidden: &mut [f32], seqs: &[SeqChunk<'_>]) -> Result<(), ForwardError>;
    /// Final norm and head on each row of `rows`, writing `rows × vocab` logits to `out`; last
    /// stage only.
    fn logits(&mut self, rows: &[f32], out: &mut [f32]) -> Result<(), ForwardError>;
    /// The next token for each row of `rows` (one per slot, in order), drawn by the slot's
    /// sampler, with log-probabilities when the slot asks; last stage only. A device backend
    /// samples where the logits are and returns only ids.
    fn sample(&mut self, rows: &[f32], slots: &mut [SampleSlot]) -> Result<(), ForwardError>;
    /// What each held layer is and caches, as the model declares it.
    fn layer_specs(&self) -> &[LayerSpec];
}

/// [`Backend::sample`] for a device whose logits are in host memory: each slot's sampler on
/// its `vocab`-wide row of `logits`.
pub fn sample_rows(logits: &[f32], vocab: usize, slots: &mut [SampleSlot]) {
    for (slot, row) in slots.iter_mut().zip(logits.chunks_exact(vocab)) {
        slot.token = slot.sampler.sample(row);
        if let Some(k) = slot.top_logprobs {
            let (lp, top) = crate::sampler::log_softmax_top(row, slot.token, k);
            slot.logprob = lp;
            slot.top = top;
        }
    }
}

/// How to build a backend.
#[derive(Debug, Clone)]
pub struct BackendOptions {
    pub device: Device,
    pub format: WeightFormat,
    /// What only the CPU uses (threads when the device does not say, kernel path).
    pub cpu: CpuOptions,
    /// Reject weights holding NaN or infinity.
    pub check_finite: bool,
    pub kv_blocks: usize,
    pub kv_block_size: usize,
    pub kv_dtype: KvDtype,
}

impl BackendOptions {
    /// Bytes the KV store of `layers` of `config` takes under these options, from what each
    /// layer declares it caches (checked against a worker's KV budget before anything is
    /// allocated).
    pub fn kv_bytes(&self, config: &ModelConfig, layers: Range<usize>) -> u128 {
        let arch = registry::for_config(config);
        let per_block: usize = layers
            .map(|l| {
                let kv_dim = arch.layer(config, l).spec().cache.kv_dim();
                PagedKv::bytes_per_block(1, kv_dim, self.kv_block_size, self.kv_dtype)
            })
            .sum();
        per_block as u128 * self.kv_blocks as u128
    }
}

/// Why a backend could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("device '{0}' is not available in this build: it has no CUDA backend yet (use cpu or cpu:THREADS)")]
    Unavailable(Device),
    #[error("kv_blocks ({blocks}) and kv_block_size ({block_size}) must both be positive")]
    KvGeometry { blocks: usize, block_size: usize },
    #[error(
        "layers of this stage cache K/V of different widths ({0} and {1}); the paged pool holds one width per stage"
    )]
    MixedKvWidths(usize, usize),
}

/// Load `layers` of the model in `files` onto the device `opts` names, as a pipeline stage.
pub fn load(
    files: &ModelFiles,
    config: &ModelConfig,
    layers: Range<usize>,
    opts: &BackendOptions,
) -> Result<Box<dyn Backend>, BackendError> {
    load_shape(files, &StageShape::stage(config, layers), opts)
}

/// Load any part of the model in `files` (e.g. one layer with both the embedding and the head,
/// which the profiler times) onto the device `opts` names.
pub fn load_shape(
    files: &ModelFiles,
    shape: &StageShape,
    opts: &BackendOptions,
) -> Result<Box<dyn Backend>, BackendError> {
    match opts.device {
        Device::Cpu { .. } => Ok(Box::new(cpu::CpuBackend::load(files, shape, opts)?)),
        Device::Cuda { .. } => Err(BackendError::Unavailable(opts.device)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        for (s, d) in [
            ("cpu", Device::Cpu { threads: None }),
            ("cpu:3", Device::Cpu { threads: Some(3) }),
            ("CUDA", Device::Cuda { gpu: 0 }),
            ("cuda:1", Device::Cuda { gpu: 1 }),
        ] {
            assert_eq!(s.parse::<Device>(), Ok(d), "{s}");
            assert_eq!(d.to_string().parse::<Device>(), Ok(d));
        }
        for bad in ["", "cpu:0", "cpu:x", "tpu", "cuda:-1", "cpu:"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.to_string().contains("expected cpu"), "{bad}: {e}");
        }
    }

    #[test]
    fn cuda_is_refused_with_a_clear_error() {
        let e = Device::Cuda { gpu: 1 }.check_available().unwrap_err();
        assert!(
            e.to_string().contains("cuda:1") && e.to_string().contains("no CUDA backend"),
            "{e}"
        );
        assert!(Device::Cpu { threads: None }.check_available().is_ok());
    }
}
