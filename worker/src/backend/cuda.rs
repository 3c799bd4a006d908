//! The CUDA backend: the model on [`CudaOps`] (Baton's kernels on one GPU), a paged f32 or f16
//! K/V pool in GPU memory allocated once at load, and sampling on the GPU: greedy rows are
//! reduced to their token ids there, and so are sampled rows (temperature, top-k, top-p,
//! min-p, with the draw the host's seeded stream makes); only ids cross to the host.
//! Log-probabilities, and sampled rows that verify a draft, read the logits on the host.

use baton_shared::model_files::ModelFiles;

use super::{
    Backend, BackendError, BackendInfo, BackendOptions, Device, KvGeometry, SampleSlot, SeqChunk, StageShape,
    model_info, sample_ids, sample_rows, sample_rows_wanted,
};
use crate::kernels::cuda::{SampleRow, linear};
use crate::model::dflash::DflashFiles;
use crate::model::spec::{LayerKind, LayerSpec, uniform_kv_dim};
use crate::model::{ForwardError, Scratch, StageModel, registry};
use crate::ops::Ops;
use crate::ops::cuda::{CudaBatch, CudaKvPool, CudaOps, GraphKey, RegionEnd};

/// A stage on a GPU.
pub struct CudaBackend {
    shape: StageShape,
    device: Device,
    model: StageModel<CudaOps>,
    kv: CudaKvPool,
    scratch: Scratch<CudaOps>,
    ids: Vec<u32>,
    settings: Vec<SampleRow>,
    logits: Vec<f32>,
}

/// Where a step's rows are sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SamplingSite {
    /// Every row greedy: `argmax_rows` on the GPU.
    Argmax,
    /// `sample_rows` on the GPU (temperature, top-k, top-p, min-p); only ids come back.
    Device,
    /// The logits go to the host: a row wants log-probabilities, or a sampled slot verifies a
    /// draft (whose rows draw only while proposals are accepted, which the host decides).
    Host,
}

impl SamplingSite {
    fn of(slots: &[SampleSlot]) -> Self {
        if slots.iter().any(|s| s.top_logprobs.is_some()) {
            return Self::Host;
        }
        if slots.iter().all(|s| s.sampler.is_greedy()) {
            return Self::Argmax;
        }
        match slots.iter().all(|s| s.sampler.is_greedy() || s.draft.is_empty()) {
            true => Self::Device,
            false => Self::Host,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Argmax => "gpu_argmax",
            Self::Device => "gpu",
            Self::Host => "host",
        }
    }
}

impl CudaBackend {
    /// Load the layers, embedding and head `shape` names onto GPU `opts.device`.
    pub fn load(files: &ModelFiles, shape: &StageShape, opts: &BackendOptions) -> Result<Self, BackendError> {
        let Device::Cuda { gpu } = opts.device else {
            return Err(BackendError::Unavailable(opts.device));
        };
        opts.check_kv_geometry()?;
        supported(&shape.config, shape.layers.clone())?;
        let ops = CudaOps::open(gpu).map_err(|e| BackendError::Cuda(e.to_string()))?;
        let gpu_handle = ops.gpu().clone();
        let model = StageModel::load_on(
            ops,
            files,
            &shape.config,
            shape.layers.clone(),
            shape.first,
            shape.last,
            opts.check_finite,
            opts.format,
        )?;
        if let Some(e) = gpu_handle.take_error() {
            return Err(BackendError::Cuda(format!("loading weights: {e}")));
        }
        let kv_dim = uniform_kv_dim(&model.specs).map_err(|(a, b)| BackendError::MixedKvWidths(a, b))?;
        let c = &model.cache;
        let kv = CudaKvPool::new(
            gpu_handle,
            c.kv_layers,
            kv_dim,
            opts.kv_block_size,
            opts.kv_blocks,
            opts.kv_dtype,
        )
        .and_then(|kv| {
            kv.with_states(
                c.state_layers,
                c.state_values,
                opts.effective_state_slots(),
                opts.state_snapshots,
            )
        })
        .map_err(BackendError::Cuda)?;
        tracing::info!(
            gpu = %model.ops.info().kernels,
            weight_bytes = model.weight_bytes(),
            kv_bytes = kv.bytes(),
            "stage loaded on the GPU"
        );
        Ok(Self {
            shape: shape.clone(),
            device: opts.device,
            model,
            kv,
            scratch: Scratch::default(),
            ids: Vec::new(),
            settings: Vec::new(),
            logits: Vec::new(),
        })
    }

    /// `r`, or the GPU error that the work behind it met (waiting for that work: the one wait
    /// of a call).
    fn finish<T>(&self, r: Result<T, ForwardError>) -> Result<T, ForwardError> {
        let device = self.model.ops.gpu().take_error();
        let v = r?;
        match device {
            Some(e) => Err(ForwardError::Device(e)),
            None => Ok(v),
        }
    }

    /// The graph a step of `seqs` may run as: decode steps (a row per sequence) of a stage
    /// whose forward never waits on the host mid-way (no mixture of experts routed on the
    /// host) and is not timed layer by layer.
    fn graph_key(&self, seqs: &[SeqChunk<'_>], taps: bool) -> Option<GraphKey> {
        let decode = !seqs.is_empty() && seqs.iter().all(|s| s.len == 1);
        let host_waits = self.scratch.layer_seconds.is_some() || self.model.routes_on_host();
        (decode && !host_waits).then_some(GraphKey { rows: seqs.len(), taps })
    }

    fn forward_paged(
        &mut self,
        hidden: &mut [f32],
        seqs: &[SeqChunk<'_>],
        mut taps: Option<&mut [f32]>,
    ) -> Result<(), ForwardError> {
        let gpu = self.model.ops.gpu().clone();
        gpu.begin_region(self.graph_key(seqs, taps.is_some()));
        let mut kv = CudaBatch {
            pool: &mut self.kv,
            seqs,
        };
        let mut r = self
            .model
            .forward_host_tapped(hidden, taps.as_deref_mut(), &mut kv, &mut self.scratch);
        if gpu.finish_region() == RegionEnd::Rerun && r.is_ok() {
            // Nothing of the step ran (its tape differed from its graph's, or it could not be
            // captured), and the host rows are as they were: run it again, eagerly.
            gpu.begin_region(None);
            r = self.model.forward_host_tapped(hidden, taps, &mut kv, &mut self.scratch);
            gpu.finish_region();
        }
        // The experts woken per layer, for the layers routed on the device (the model counts
        // the others): one more small read once the step's rows are down. Read (and zeroed)
        // after a failed step too, so the next step counts only its own.
        let moe = self.scratch.moe;
        let routed_on_device = moe.layers - moe.counted_layers;
        if routed_on_device > 0
            && let Some(active) = self.model.ops.take_device_routed_experts()
            && r.is_ok()
        {
            let per_layer = active as f64 / routed_on_device as f64;
            metrics::histogram!("baton_moe_active_experts").record(per_layer);
            tracing::Span::current().record("moe_active_experts", per_layer);
        }
        self.finish(r)
    }
}

/// Refuse, by name, what the GPU kernels do not hold: attention heads wider than the attention
/// kernel's, linear-attention heads wider than the delta rule's.
pub fn supported(
    config: &baton_shared::model_config::ModelConfig,
    layers: std::ops::Range<usize>,
) -> Result<(), BackendError> {
    let arch = registry::for_config(config);
    for l in layers {
        let spec = arch.layer(config, l).spec();
        if spec.kind != LayerKind::LinearAttention {
            continue;
        }
        let Some(la) = config.linear_attention.as_ref() else {
            continue;
        };
        let (dk, dv) = (la.key_head_dim, la.value_head_dim);
        if dk > linear::MAX_KEY_DIM || dv > linear::MAX_VALUE_DIM {
            return Err(BackendError::Unsupported(format!(
                "layer {l} of this {} model: linear-attention heads of {dk} key and {dv} value dimensions \
                 (the CUDA delta rule holds up to {} and {}); run this stage with --device cpu",
                arch.name(),
                linear::MAX_KEY_DIM,
                linear::MAX_VALUE_DIM
            )));
        }
    }
    if config.head_dim > crate::kernels::cuda::MAX_HEAD_DIM {
        return Err(BackendError::Unsupported(format!(
            "attention heads of {} values (the CUDA attention kernel holds up to {})",
            config.head_dim,
            crate::kernels::cuda::MAX_HEAD_DIM
        )));
    }
    Ok(())
}

impl Backend for CudaBackend {
    fn shape(&self) -> &StageShape {
        &self.shape
    }

    fn info(&self) -> BackendInfo {
        model_info(&self.model, self.device)
    }

    fn kv(&self) -> KvGeometry {
        KvGeometry {
            blocks: self.kv.blocks(),
            block_size: self.kv.block_size(),
            bytes: self.kv.bytes(),
            dtype: self.kv.dtype(),
            state_slots: self.kv.state_slots(),
            state_snapshots: self.kv.state_snapshots(),
        }
    }

    fn embed(&mut self, tokens: &[u32], hidden: &mut [f32]) -> Result<(), ForwardError> {
        let h = self.shape.config.hidden_size;
        if hidden.len() != tokens.len() * h {
            return Err(ForwardError::HiddenShape {
                got: hidden.len(),
                hidden: h,
            });
        }
        let r = self.model.embed_into(tokens, &mut self.scratch);
        if r.is_ok() {
            self.model.ops.download(&self.scratch.hidden, hidden);
        }
        self.finish(r)
    }

    fn forward(&mut self, hidden: &mut [f32], seqs: &[SeqChunk<'_>]) -> Result<(), ForwardError> {
        self.forward_paged(hidden, seqs, None)
    }

    fn forward_tapped(
        &mut self,
        hidden: &mut [f32],
        seqs: &[SeqChunk<'_>],
        taps: &mut [f32],
    ) -> Result<(), ForwardError> {
        self.forward_paged(hidden, seqs, Some(taps))
    }

    fn load_taps(&mut self, draft: &DflashFiles) -> Result<Vec<usize>, BackendError> {
        Ok(self.model.attach_taps(draft)?)
    }

    fn save_state(&self, slot: usize, out: &mut Vec<f32>) -> Result<(), ForwardError> {
        let r = self.kv.slot_state(slot, out);
        self.finish(r)
    }

    fn restore_state(&mut self, slot: usize, state: &[f32]) -> Result<(), ForwardError> {
        let r = self.kv.set_slot_state(slot, state);
        self.finish(r)
    }

    fn save_snapshot(&mut self, slot: usize, snapshot: usize) -> Result<(), ForwardError> {
        let r = self.kv.save_snapshot(slot, snapshot);
        self.finish(r)
    }

    fn load_snapshot(&mut self, snapshot: usize, slot: usize) -> Result<(), ForwardError> {
        let r = self.kv.load_snapshot(snapshot, slot);
        self.finish(r)
    }

    fn draft_argmax(&mut self, rows: &[f32], out: &mut Vec<u32>) -> Result<(), ForwardError> {
        let vocab = self.shape.config.vocab_size;
        let r = self.model.head_only_into(rows, &mut self.scratch);
        if r.is_ok() {
            self.model.ops.argmax_rows(&self.scratch.logits, vocab, out);
        }
        self.finish(r)
    }

    fn logits(&mut self, rows: &[f32], out: &mut [f32]) -> Result<(), ForwardError> {
        let r = self.model.logits(rows, &mut self.scratch, out);
        self.finish(r)
    }

    fn sample(&mut self, rows: &[f32], slots: &mut [SampleSlot]) -> Result<(), ForwardError> {
        let (h, vocab) = (self.shape.config.hidden_size, self.shape.config.vocab_size);
        let wanted = sample_rows_wanted(rows, slots, h)?;
        let r = self.model.head_into(rows, &mut self.scratch);
        let site = SamplingSite::of(slots);
        if r.is_ok() {
            match site {
                SamplingSite::Argmax => self.model.ops.argmax_rows(&self.scratch.logits, vocab, &mut self.ids),
                SamplingSite::Device => {
                    self.settings.clear();
                    for slot in slots.iter_mut() {
                        // A greedy slot's draft rows are greedy too; a sampled slot has one row.
                        let first = SampleRow::next(&mut slot.sampler);
                        self.settings.push(first);
                        self.settings
                            .extend(std::iter::repeat_n(SampleRow::GREEDY, slot.rows() - 1));
                    }
                    self.model
                        .ops
                        .sample_rows(&self.scratch.logits, vocab, &self.settings, &mut self.ids);
                }
                SamplingSite::Host => {
                    self.logits.resize(wanted * vocab, 0.0);
                    self.model.ops.download(&self.scratch.logits, &mut self.logits);
                }
            }
        }
        self.finish(r)?;
        metrics::counter!("baton_sampled_rows_total", "site" => site.label()).increment(wanted as u64);
        match site {
            SamplingSite::Argmax | SamplingSite::Device => sample_ids(&self.ids, slots),
            SamplingSite::Host => sample_rows(&self.logits, vocab, slots),
        }
        Ok(())
    }

    fn layer_specs(&self) -> &[LayerSpec] {
        &self.model.specs
    }

    fn device_free_bytes(&self) -> Option<u64> {
        Some(self.model.ops.gpu().free_bytes() as u64)
    }

    fn kernel_times(&mut self, on: bool) -> Vec<(String, usize, f64)> {
        let gpu = self.model.ops.gpu();
        let times = gpu.kernel_times();
        gpu.set_timing(on);
        times
            .into_iter()
            .map(|t| (t.kernel.to_string(), t.launches, t.ms))
            .collect()
    }

    fn layer_times(&mut self, on: bool) -> Vec<f64> {
        self.scratch.layer_times(on)
    }

    fn set_graphs(&mut self, on: bool) -> bool {
        self.model.ops.gpu().set_graphs(on);
        true
    }

    fn set_device_routing(&mut self, on: bool) -> bool {
        self.model.ops.set_device_routing(on);
        true
    }

    fn set_planned_products(&mut self, on: bool) -> bool {
        self.model.ops.set_planned_products(on);
        true
    }

    fn graph_counts(&self) -> Option<[u64; 4]> {
        let c = self.model.ops.gpu().graph_counts();
        Some([c.eager, c.captured, c.replayed, c.rerun])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Sampler;
    use baton_shared::sampling::SamplingParams;

    fn slot(temperature: f32, logprobs: Option<usize>, draft: &[u32]) -> SampleSlot {
        let mut s = SampleSlot::new(
            Sampler::new(&SamplingParams {
                temperature,
                seed: Some(1),
                ..Default::default()
            }),
            logprobs,
        );
        s.draft = draft.to_vec();
        s
    }

    #[test]
    fn rows_are_sampled_on_the_gpu_unless_the_host_must_see_the_logits() {
        let (greedy, sampled) = (0.0, 0.8);
        let site = |slots: &[SampleSlot]| SamplingSite::of(slots);
        assert_eq!(
            site(&[slot(greedy, None, &[]), slot(greedy, None, &[5, 6])]),
            SamplingSite::Argmax
        );
        assert_eq!(
            site(&[slot(greedy, None, &[5]), slot(sampled, None, &[])]),
            SamplingSite::Device
        );
        // A sampled slot verifying a draft draws only while proposals hold: the host decides.
        assert_eq!(site(&[slot(sampled, None, &[5])]), SamplingSite::Host);
        assert_eq!(
            site(&[slot(greedy, Some(2), &[]), slot(sampled, None, &[])]),
            SamplingSite::Host
        );
    }

    fn config(fixture: &str) -> baton_shared::model_config::ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/tiny")
            .join(fixture);
        ModelFiles::open(&dir).and_then(|f| f.config()).expect("a tiny fixture")
    }

    #[test]
    fn a_gpu_stage_takes_experts_and_linear_attention_and_refuses_heads_too_wide_by_layer() {
        for fixture in [
            "qwen3",
            "qwen3_moe",
            "qwen3_moe_dense_mix",
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
        ] {
            let c = config(fixture);
            assert!(supported(&c, 0..c.num_layers).is_ok(), "{fixture}");
        }
        let mut c = config("qwen3_next");
        c.linear_attention.as_mut().expect("a hybrid").key_head_dim = linear::MAX_KEY_DIM + 32;
        let e = supported(&c, 0..c.num_layers).unwrap_err().to_string();
        assert!(
            e.contains("layer 0 ") && e.contains("key and") && e.contains("--device cpu"),
            "{e}"
        );
        // A range holding only its full-attention layers is taken.
        let full: Vec<usize> = (0..c.num_layers)
            .filter(|&l| registry::for_config(&c).layer(&c, l).spec().kind != LayerKind::LinearAttention)
            .collect();
        assert!(!full.is_empty());
        assert!(supported(&c, full[0]..full[0] + 1).is_ok());
    }
}
