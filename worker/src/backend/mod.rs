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
#[cfg(feature = "cuda")]
pub mod cuda;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles};

use crate::kv_cache::KvDtype;
pub use crate::kv_cache::PagedSeq as SeqChunk;
use crate::model::dflash::{DflashError, DflashFiles};
use crate::model::spec::{CacheBytes, LayerSpec};
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
            #[cfg(feature = "cuda")]
            Device::Cuda { .. } if crate::ops::cuda::device::driver_present() => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda { .. } => Err(BackendError::Cuda(crate::ops::cuda::CudaError::NoDriver.to_string())),
            #[cfg(not(feature = "cuda"))]
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
    /// Bytes the store reserves (blocks and state slots).
    pub bytes: usize,
    pub dtype: KvDtype,
    /// Recurrent-state slots, one per running sequence (0: no linear-attention layers here).
    pub state_slots: usize,
    /// Recurrent-state snapshots for the prefix cache (0: none, or no such layers here).
    pub state_snapshots: usize,
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
    /// Each held layer's weight bytes, in order (every expert of a mixture included).
    pub layer_bytes: Vec<usize>,
    /// Bytes of matrix weights one decode step reads (the streaming-read floor).
    pub matrix_bytes: usize,
}

/// One sequence to sample on the last stage: the sequence's sampler going in, its token (and
/// log-probabilities when asked) coming out. With a draft (speculative decoding) the slot
/// takes `1 + draft.len()` rows and verifies the proposals (see [`sample_rows`]).
#[derive(Debug, Clone)]
pub struct SampleSlot {
    /// The sequence's sampling state (parameters and random stream), advanced by one draw per
    /// token chosen.
    pub sampler: Sampler,
    /// Return the chosen token's log-probability and this many alternatives (for `token`).
    pub top_logprobs: Option<usize>,
    /// Proposed tokens to verify, following the slot's first row in order.
    pub draft: Vec<u32>,
    pub token: u32,
    pub logprob: f32,
    /// The most likely `(id, logprob)` pairs, best first.
    pub top: Vec<(u32, f32)>,
    /// With a draft: the tokens chosen after `token` (accepted proposals, then one more).
    pub more: Vec<u32>,
    /// Their log-probabilities and alternatives, when `top_logprobs` asks.
    pub more_logprobs: Vec<(f32, Vec<(u32, f32)>)>,
}

impl SampleSlot {
    /// A slot for `sampler`.
    pub fn new(sampler: Sampler, top_logprobs: Option<usize>) -> Self {
        Self {
            sampler,
            top_logprobs,
            draft: Vec::new(),
            token: 0,
            logprob: 0.0,
            top: Vec::new(),
            more: Vec::new(),
            more_logprobs: Vec::new(),
        }
    }

    /// Rows of hidden states (and logits) this slot takes.
    pub fn rows(&self) -> usize {
        1 + self.draft.len()
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
    /// [`forward`](Self::forward) that also adds each DFlash tap layer's output times its
    /// `fc` block to `taps` (the running context sum, one row per row of `hidden`).
    fn forward_tapped(
        &mut self,
        hidden: &mut [f32],
        seqs: &[SeqChunk<'_>],
        taps: &mut [f32],
    ) -> Result<(), ForwardError>;
    /// Load `fc`'s blocks for the DFlash taps among this stage's layers; returns the tap
    /// layers held (stage-relative).
    fn load_taps(&mut self, draft: &DflashFiles) -> Result<Vec<usize>, BackendError>;
    /// The target's head alone (no final norm) on rows a DFlash draft normalized, and the
    /// most likely token of each row into `out`; last stage only.
    fn draft_argmax(&mut self, rows: &[f32], out: &mut Vec<u32>) -> Result<(), ForwardError>;
    /// Final norm and head on each row of `rows`, writing `rows × vocab` logits to `out`; last
    /// stage only.
    fn logits(&mut self, rows: &[f32], out: &mut [f32]) -> Result<(), ForwardError>;
    /// The next token for each slot, drawn by the slot's sampler from its rows of `rows` (one,
    /// or `1 + draft` to verify a draft: see [`sample_rows`]; slots' rows back to back in
    /// order), with log-probabilities when the slot asks; last stage only. A device backend
    /// samples where the logits are and returns only ids.
    fn sample(&mut self, rows: &[f32], slots: &mut [SampleSlot]) -> Result<(), ForwardError>;
    /// What each held layer is and caches, as the model declares it.
    fn layer_specs(&self) -> &[LayerSpec];
    /// Copy the recurrent state of `slot` (every linear-attention layer held) into `out`, so a
    /// verify step's rejected proposals can be undone; see [`restore_state`](Self::restore_state).
    fn save_state(&self, _slot: usize, _out: &mut Vec<f32>) -> Result<(), ForwardError> {
        Err(ForwardError::Device(format!(
            "{} keeps no recurrent state (this backend runs no linear-attention layers)",
            self.info().kernels
        )))
    }
    /// Put back a state [`save_state`](Self::save_state) copied from `slot`.
    fn restore_state(&mut self, _slot: usize, _state: &[f32]) -> Result<(), ForwardError> {
        Err(ForwardError::Device(format!(
            "{} keeps no recurrent state (this backend runs no linear-attention layers)",
            self.info().kernels
        )))
    }
    /// Copy `slot`'s recurrent state into prefix-cache snapshot `snapshot` (see
    /// [`KvGeometry::state_snapshots`]).
    fn save_snapshot(&mut self, _slot: usize, _snapshot: usize) -> Result<(), ForwardError> {
        Err(ForwardError::Device(format!(
            "{} keeps no recurrent state (this backend runs no linear-attention layers)",
            self.info().kernels
        )))
    }
    /// Start `slot`'s recurrent state from snapshot `snapshot`.
    fn load_snapshot(&mut self, _snapshot: usize, _slot: usize) -> Result<(), ForwardError> {
        Err(ForwardError::Device(format!(
            "{} keeps no recurrent state (this backend runs no linear-attention layers)",
            self.info().kernels
        )))
    }
    /// A diagnostic: start (`true`) or stop timing each kernel on the device, returning the
    /// `(kernel, launches, milliseconds)` timed so far; empty where the device has no such
    /// timer (the CPU).
    fn kernel_times(&mut self, _on: bool) -> Vec<(String, usize, f64)> {
        Vec::new()
    }
    /// Turn decode steps as device graphs on or off; `false` where the device has none (the
    /// CPU).
    fn set_graphs(&mut self, _on: bool) -> bool {
        false
    }
    /// Steps so far by how they ran: `(eager, captured, replayed, rerun)`; `None` without
    /// graphs.
    fn graph_counts(&self) -> Option<[u64; 4]> {
        None
    }
    /// Route mixtures of experts on the device (`true`) or on the host; `false` where the
    /// device never routes (the CPU).
    fn set_device_routing(&mut self, _on: bool) -> bool {
        false
    }
    /// Run quantized products with the kernels the device chose for each batch size (`true`)
    /// or all with its reference kernel; `false` where the device has no such choice (the CPU).
    fn set_planned_products(&mut self, _on: bool) -> bool {
        false
    }
    /// Bytes free in the device's own memory (a GPU's), or `None` where the stage lives in
    /// host memory.
    fn device_free_bytes(&self) -> Option<u64> {
        None
    }
    /// Start (`true`) or stop timing each of the stage's layers, returning each layer's seconds
    /// summed over the passes timed so far (empty when timing was off). Timing waits for the
    /// device after every layer, so it is for the profiler, not for serving.
    fn layer_times(&mut self, on: bool) -> Vec<f64>;
}

/// [`Backend::sample`] for a device whose logits are in host memory: each slot's sampler on
/// its `vocab`-wide rows of `logits`.
///
/// A slot with a draft verifies it: the sampler draws a token from the first row, and while
/// that token equals the next proposal it draws the following one from the next row. Each
/// token is drawn exactly as plain decoding would draw it at that position (the same logits,
/// the same random stream, one draw per token), and a proposal is kept only where the draw
/// chose it, so the output is the same as without the draft: bit for bit with a seed, and in
/// distribution without. For a drafter that proposes one token (no distribution of its own),
/// this is what standard speculative rejection sampling reduces to: the proposal is accepted
/// with probability p(proposal), and a rejection's replacement comes from p without it.
pub fn sample_rows(logits: &[f32], vocab: usize, slots: &mut [SampleSlot]) {
    let mut at = 0;
    for slot in slots.iter_mut() {
        let rows = &logits[at * vocab..(at + slot.rows()) * vocab];
        at += slot.rows();
        let mut rows = rows.chunks_exact(vocab);
        let first = rows.next().expect("a slot has at least one row");
        slot.token = slot.sampler.sample(first);
        if let Some(k) = slot.top_logprobs {
            let (lp, top) = crate::sampler::log_softmax_top(first, slot.token, k);
            slot.logprob = lp;
            slot.top = top;
        }
        slot.more.clear();
        slot.more_logprobs.clear();
        let mut chosen = slot.token;
        for (&proposal, row) in slot.draft.iter().zip(rows) {
            if chosen != proposal {
                break;
            }
            chosen = slot.sampler.sample(row);
            slot.more.push(chosen);
            if let Some(k) = slot.top_logprobs {
                slot.more_logprobs.push(crate::sampler::log_softmax_top(row, chosen, k));
            }
        }
    }
}

/// What every backend reports of a model on device `device`.
pub fn model_info<O: crate::ops::Ops>(m: &crate::model::StageModel<O>, device: Device) -> BackendInfo {
    let ops = m.ops.info();
    BackendInfo {
        device,
        kernels: ops.kernels,
        threads: ops.threads,
        weights: m.format,
        weight_bytes: m.weight_bytes(),
        part_bytes: m.part_bytes(),
        layer_bytes: m.layer_bytes(),
        matrix_bytes: m.matrix_bytes(),
    }
}

/// The rows [`Backend::sample`] takes for `slots` (one per slot, plus its draft), checked
/// against the `hidden`-wide `rows` given.
pub fn sample_rows_wanted(rows: &[f32], slots: &[SampleSlot], hidden: usize) -> Result<usize, ForwardError> {
    let wanted: usize = slots.iter().map(SampleSlot::rows).sum();
    match rows.len() == wanted * hidden {
        true => Ok(wanted),
        false => Err(ForwardError::HiddenShape {
            got: rows.len(),
            hidden,
        }),
    }
}

/// [`sample_rows`] for slots whose samplers are all greedy, from each row's most likely token
/// (computed where the logits are): the same choices, with only ids crossing to the host.
pub fn sample_ids(ids: &[u32], slots: &mut [SampleSlot]) {
    let mut at = 0;
    for slot in slots.iter_mut() {
        let rows = &ids[at..at + slot.rows()];
        at += slot.rows();
        slot.token = rows[0];
        slot.more.clear();
        slot.more_logprobs.clear();
        let mut chosen = slot.token;
        for (&proposal, &id) in slot.draft.iter().zip(&rows[1..]) {
            if chosen != proposal {
                break;
            }
            chosen = id;
            slot.more.push(chosen);
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
    /// Recurrent-state slots (sequences that may run at once) for a stage with
    /// linear-attention layers; 0: as many as the pool has blocks, at most
    /// [`DEFAULT_STATE_SLOTS`].
    pub state_slots: usize,
    /// Recurrent-state snapshots the prefix cache of a hybrid model keeps on such a stage.
    pub state_snapshots: usize,
}

/// Recurrent-state slots a stage keeps when nobody says how many.
pub const DEFAULT_STATE_SLOTS: usize = 64;

impl BackendOptions {
    /// Refuse a KV pool of no blocks or of blocks of no positions.
    pub fn check_kv_geometry(&self) -> Result<(), BackendError> {
        match self.kv_blocks == 0 || self.kv_block_size == 0 {
            true => Err(BackendError::KvGeometry {
                blocks: self.kv_blocks,
                block_size: self.kv_block_size,
            }),
            false => Ok(()),
        }
    }

    /// The state slots a stage with linear-attention layers keeps.
    pub fn effective_state_slots(&self) -> usize {
        match self.state_slots {
            0 => self.kv_blocks.min(DEFAULT_STATE_SLOTS),
            n => n,
        }
    }

    /// Bytes the KV store of `layers` of `config` takes under these options, from what each
    /// layer declares it caches (checked against a worker's KV budget before anything is
    /// allocated).
    pub fn kv_bytes(&self, config: &ModelConfig, layers: Range<usize>) -> u128 {
        let arch = registry::for_config(config);
        let caches = layers.map(|l| arch.layer(config, l).spec().cache);
        let bytes = CacheBytes::of(caches, self.kv_block_size, self.kv_dtype.bytes());
        let states = match bytes.per_state {
            0 => 0,
            _ => self.effective_state_slots() + self.state_snapshots,
        };
        bytes.total(self.kv_blocks, states)
    }
}

/// Why a backend could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(
        "device '{0}' is not available in this build: it has no CUDA backend (build with `--features cuda`, or use cpu or cpu:THREADS)"
    )]
    Unavailable(Device),
    #[error("GPU: {0}")]
    Cuda(String),
    #[error("not supported on this device: {0}")]
    Unsupported(String),
    #[error("kv_blocks ({blocks}) and kv_block_size ({block_size}) must both be positive")]
    KvGeometry { blocks: usize, block_size: usize },
    #[error(
        "layers of this stage cache K/V of different widths ({0} and {1}); the paged pool holds one width per stage"
    )]
    MixedKvWidths(usize, usize),
    #[error(transparent)]
    Draft(#[from] DflashError),
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
        #[cfg(feature = "cuda")]
        Device::Cuda { .. } => Ok(Box::new(cuda::CudaBackend::load(files, shape, opts)?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(BackendError::Unavailable(opts.device)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_shared::sampling::SamplingParams;

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

    fn slot(params: &SamplingParams, draft: &[u32]) -> SampleSlot {
        let mut slot = SampleSlot::new(Sampler::new(params), None);
        slot.draft = draft.to_vec();
        slot
    }

    #[test]
    fn a_greedy_draft_is_kept_while_it_matches_each_rows_choice() {
        // Four rows over a vocabulary of 5: the argmaxes are 3, 1, 4, 0.
        let rows: Vec<f32> = [
            [0., 1., 2., 9., 3.],
            [1., 8., 0., 2., 3.],
            [0., 1., 2., 3., 7.],
            [6., 1., 2., 3., 4.],
        ]
        .concat();
        let greedy = SamplingParams::greedy(8);
        let verify = |draft: &[u32]| {
            let mut slots = [slot(&greedy, draft)];
            sample_rows(&rows[..slots[0].rows() * 5], 5, &mut slots);
            let [s] = slots;
            (s.token, s.more)
        };
        assert_eq!(verify(&[]), (3, vec![]));
        assert_eq!(
            verify(&[3, 1, 4]),
            (3, vec![1, 4, 0]),
            "all accepted, plus the last row's choice"
        );
        assert_eq!(verify(&[3, 2, 4]), (3, vec![1]), "the second proposal rejected");
        assert_eq!(verify(&[0, 1, 4]), (3, vec![]), "the first proposal rejected");
        // Slots take their own rows in order.
        let mut slots = [slot(&greedy, &[3]), slot(&greedy, &[])];
        sample_rows(&rows[..15], 5, &mut slots);
        assert_eq!((slots[0].token, &slots[0].more, slots[1].token), (3, &vec![1], 4));
    }

    #[test]
    fn a_seeded_draft_reproduces_plain_sampling_draw_for_draw() {
        let rows: Vec<f32> = (0..4 * 7).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        for seed in 0..50 {
            let params = SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::greedy(8)
            };
            // Plain decoding: one draw per row in turn.
            let mut plain = Sampler::new(&params);
            let chain: Vec<u32> = rows.chunks_exact(7).map(|r| plain.sample(r)).collect();
            // Proposing that chain accepts all of it; proposing a wrong second token keeps
            // the first draw and replaces the second with the same draw plain decoding made.
            let mut slots = [slot(&params, &chain[..3])];
            sample_rows(&rows, 7, &mut slots);
            assert_eq!(
                (slots[0].token, &slots[0].more[..]),
                (chain[0], &chain[1..]),
                "seed {seed}"
            );
            let wrong = (chain[1] + 1) % 7;
            let mut slots = [slot(&params, &[chain[0], wrong, chain[2]])];
            sample_rows(&rows, 7, &mut slots);
            assert_eq!(
                (slots[0].token, &slots[0].more[..]),
                (chain[0], &chain[1..2]),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn verifying_a_proposal_keeps_the_targets_distribution() {
        // p = softmax of the first row; the proposal is token 1 (p = 0.3). Over many
        // unseeded-like streams the first token follows p, and the token after an accepted
        // proposal follows the second row's distribution.
        let p0 = [0.5f32, 0.3, 0.15, 0.05];
        let p1 = [0.1f32, 0.2, 0.3, 0.4];
        let rows: Vec<f32> = p0.iter().chain(&p1).map(|p| p.ln()).collect();
        let n = 40_000;
        let (mut first, mut second, mut accepted) = ([0usize; 4], [0usize; 4], 0);
        for seed in 0..n {
            let params = SamplingParams {
                temperature: 1.0,
                seed: Some(seed as u64 * 7919 + 1),
                ..SamplingParams::greedy(8)
            };
            let mut slots = [slot(&params, &[1])];
            sample_rows(&rows, 4, &mut slots);
            first[slots[0].token as usize] += 1;
            if let Some(&t) = slots[0].more.first() {
                accepted += 1;
                second[t as usize] += 1;
            }
        }
        for (i, &p) in p0.iter().enumerate() {
            let f = first[i] as f32 / n as f32;
            assert!((f - p).abs() < 0.015, "first token {i}: {f} vs {p}");
        }
        assert_eq!(accepted, first[1], "the proposal is accepted exactly when it is drawn");
        for (i, &p) in p1.iter().enumerate() {
            let f = second[i] as f32 / accepted as f32;
            assert!((f - p).abs() < 0.03, "after acceptance, token {i}: {f} vs {p}");
        }
    }

    #[test]
    fn greedy_ids_choose_what_greedy_sampling_of_the_rows_chooses() {
        let rows: Vec<f32> = (0..6 * 5).map(|i| ((i * 31 % 17) as f32) * 0.5).collect();
        let ids: Vec<u32> = rows.chunks_exact(5).map(crate::sampler::argmax).collect();
        let greedy = SamplingParams::greedy(8);
        for draft in [
            vec![],
            vec![ids[0]],
            vec![ids[0], ids[1], ids[2]],
            vec![ids[0], 9, ids[2]],
            vec![7],
        ] {
            let mut a = [slot(&greedy, &draft), slot(&greedy, &[])];
            let mut b = a.clone();
            let n = a[0].rows() + 1;
            sample_rows(&rows[..n * 5], 5, &mut a);
            sample_ids(&ids[..n], &mut b);
            for (a, b) in a.iter().zip(&b) {
                assert_eq!((a.token, &a.more), (b.token, &b.more), "draft {draft:?}");
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
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
