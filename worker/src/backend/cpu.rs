//! The CPU backend: the model on [`CpuOps`] (runtime-dispatched kernels, a thread pool sized to
//! the socket), a paged f32 or f16 KV pool allocated once at load, and sampling where the head
//! left the logits (host memory).

use baton_shared::model_files::ModelFiles;

use super::{
    Backend, BackendError, BackendInfo, BackendOptions, Device, KvGeometry, SampleSlot, SeqChunk, StageShape,
    model_info, sample_rows, sample_rows_wanted,
};
use crate::kv_cache::{PagedBatch, PagedKv};
use crate::model::dflash::DflashFiles;
use crate::model::spec::{LayerSpec, uniform_kv_dim};
use crate::model::{ForwardError, Scratch, StageModel};
use crate::ops::cpu::CpuOps;

/// A stage on the CPU.
pub struct CpuBackend {
    shape: StageShape,
    device: Device,
    model: StageModel<CpuOps>,
    kv: PagedKv,
    scratch: Scratch<CpuOps>,
}

impl CpuBackend {
    /// Load the layers, embedding and head `shape` names.
    pub fn load(files: &ModelFiles, shape: &StageShape, opts: &BackendOptions) -> Result<Self, BackendError> {
        let Device::Cpu { threads } = opts.device else {
            return Err(BackendError::Unavailable(opts.device));
        };
        opts.check_kv_geometry()?;
        let ops = CpuOps::new(threads.unwrap_or(opts.cpu.threads).max(1), opts.cpu.kernels);
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
        let kv = Self::kv_pool(&model, opts)?;
        Ok(Self::new(model, opts.device, kv))
    }

    /// The paged pool for `model`'s layers, sized from what each layer declares it caches.
    fn kv_pool(model: &StageModel<CpuOps>, opts: &BackendOptions) -> Result<PagedKv, BackendError> {
        let kv_dim = uniform_kv_dim(&model.specs).map_err(|(a, b)| BackendError::MixedKvWidths(a, b))?;
        let c = &model.cache;
        Ok(
            PagedKv::with_dtype(c.kv_layers, kv_dim, opts.kv_block_size, opts.kv_blocks, opts.kv_dtype).with_states(
                c.state_layers,
                c.state_values,
                opts.effective_state_slots(),
                opts.state_snapshots,
            ),
        )
    }

    /// The layers over `hidden` with each chunk's K/V in the paged pool, adding the DFlash taps
    /// to `taps` when given.
    fn forward_paged(
        &mut self,
        hidden: &mut [f32],
        seqs: &[SeqChunk<'_>],
        taps: Option<&mut [f32]>,
    ) -> Result<(), ForwardError> {
        let mut kv = PagedBatch {
            pool: &mut self.kv,
            seqs,
        };
        self.model.forward_host_tapped(hidden, taps, &mut kv, &mut self.scratch)
    }

    /// A backend over a loaded model and a KV pool for its layers.
    pub fn new(model: StageModel<CpuOps>, device: Device, kv: PagedKv) -> Self {
        let shape = StageShape {
            config: model.config.clone(),
            layers: model.layers.clone(),
            first: model.is_first,
            last: model.is_last,
        };
        Self {
            shape,
            device,
            model,
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
        self.model.embed(tokens, hidden)
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
        let state = self.kv.slot_state(slot)?;
        out.clear();
        out.extend_from_slice(state);
        Ok(())
    }

    fn restore_state(&mut self, slot: usize, state: &[f32]) -> Result<(), ForwardError> {
        let dst = self.kv.slot_state_mut(slot)?;
        if dst.len() != state.len() {
            return Err(ForwardError::StateSize {
                got: state.len(),
                want: dst.len(),
            });
        }
        dst.copy_from_slice(state);
        Ok(())
    }

    fn save_snapshot(&mut self, slot: usize, snapshot: usize) -> Result<(), ForwardError> {
        self.kv.save_snapshot(slot, snapshot)
    }

    fn load_snapshot(&mut self, snapshot: usize, slot: usize) -> Result<(), ForwardError> {
        self.kv.load_snapshot(snapshot, slot)
    }

    fn draft_argmax(&mut self, rows: &[f32], out: &mut Vec<u32>) -> Result<(), ForwardError> {
        let vocab = self.shape.config.vocab_size;
        self.model.head_only_into(rows, &mut self.scratch)?;
        out.clear();
        out.extend(self.scratch.logits.chunks_exact(vocab).map(crate::sampler::argmax));
        Ok(())
    }

    fn logits(&mut self, rows: &[f32], out: &mut [f32]) -> Result<(), ForwardError> {
        self.model.logits(rows, &mut self.scratch, out)
    }

    fn sample(&mut self, rows: &[f32], slots: &mut [SampleSlot]) -> Result<(), ForwardError> {
        let (h, vocab) = (self.shape.config.hidden_size, self.shape.config.vocab_size);
        sample_rows_wanted(rows, slots, h)?;
        // The logits stay in the scratch buffer the head wrote: no copy.
        self.model.head_into(rows, &mut self.scratch)?;
        sample_rows(&self.scratch.logits, vocab, slots);
        Ok(())
    }

    fn layer_specs(&self) -> &[LayerSpec] {
        &self.model.specs
    }

    fn layer_times(&mut self, on: bool) -> Vec<f64> {
        self.scratch.layer_times(on)
    }
}
