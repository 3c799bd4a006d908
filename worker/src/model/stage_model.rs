//! A pipeline stage's part of a model on one device: a contiguous layer range built from its
//! architecture's blocks, plus the embedding on the first stage and the final norm and head
//! on the last. The forward pass is written once, against [`Ops`].

use std::ops::Range;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles};

use super::ForwardError;
use super::arch::{self, Architecture};
use super::blocks::{DecoderLayer, Ffn, RmsNorm};
use super::dflash::{DflashError, DflashFiles, TapProjection};
use super::loader::WeightLoader;
use super::registry;
use super::rope::Rope;
use super::scratch::{MoeStats, Scratch};
use super::spec::{CacheLayout, LayerSpec};
use crate::kernels::cpu::matmul::WeightFormat;
use crate::kv_cache::KvSpans;
use crate::ops::Ops;

/// Bytes of weights each part of a stage needs on its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PartBytes {
    /// The decoder layers.
    pub layers: usize,
    /// The input embedding (first stage).
    pub embedding: usize,
    /// Final norm and head (last stage), a borrowed tied embedding included.
    pub head: usize,
}

/// A stage's weights on the device `O`, and the forward pass over them.
pub struct StageModel<O: Ops> {
    pub config: ModelConfig,
    pub arch: &'static dyn Architecture,
    pub layers: Range<usize>,
    /// What each held layer is and caches, in order.
    pub specs: Vec<LayerSpec>,
    /// Which slot of its kind's cache each held layer uses.
    pub cache: CacheLayout,
    /// The f32 embedding table: on the first stage, or on a last stage whose head borrows it.
    embedding: Option<O::Mat>,
    blocks: Vec<DecoderLayer<O>>,
    final_norm: Option<RmsNorm<O>>,
    /// The head matrix; `None` for a tied f32 head, which borrows `embedding`.
    head: Option<O::Mat>,
    /// Whether this stage starts from token ids.
    pub is_first: bool,
    /// Whether this stage produces logits.
    pub is_last: bool,
    pub rope: Rope,
    /// Storage of the layers' matrices.
    pub format: WeightFormat,
    /// The device the weights live on.
    pub ops: O,
    /// `fc`'s blocks for the DFlash taps among this stage's layers, when a draft is served.
    taps: Option<TapProjection<O>>,
}

impl<O: Ops> std::fmt::Debug for StageModel<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageModel")
            .field("arch", &self.arch.name())
            .field("layers", &self.layers)
            .field("first", &self.is_first)
            .field("last", &self.is_last)
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

impl<O: Ops> StageModel<O> {
    /// Load `layers` (and the embedding when `first`, the head when `last`) of the model in
    /// `files` onto `ops`, the layers' matrices in `format`.
    #[allow(clippy::too_many_arguments)]
    pub fn load_on(
        ops: O,
        files: &ModelFiles,
        config: &ModelConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
        check_finite: bool,
        format: WeightFormat,
    ) -> Result<Self, LoadError> {
        if layers.start > layers.end || layers.end > config.num_layers {
            return Err(LoadError::LayerRange {
                start: layers.start,
                end: layers.end,
                layers: config.num_layers,
            });
        }
        let arch = registry::for_config(config);
        let _span = tracing::info_span!("model.load", arch = arch.name(), layers = ?layers, first, last).entered();
        let started = std::time::Instant::now();
        let w = WeightLoader {
            files,
            config,
            ops: &ops,
            format,
            check_finite,
        };
        let mut blocks = Vec::with_capacity(layers.len());
        let mut specs = Vec::with_capacity(layers.len());
        for l in layers.clone() {
            let plan = arch.layer(config, l);
            specs.push(plan.spec());
            blocks.push(DecoderLayer::load(&w, &plan)?);
        }
        let outer = arch.outer(config);
        // The head stays at 8 bits under the 4-bit formats, as llama.cpp keeps its output
        // tensor at higher precision: measured on SmolLM2, a Q4_1 head alone takes the logit
        // error from 4% to 10% of the spread.
        let head_format = match format {
            WeightFormat::Q4_0 | WeightFormat::Q4_1 => WeightFormat::Q8_0,
            other => other,
        };
        let tied = outer.head.is_none();
        let embedding = match first || (last && tied) {
            true => Some(w.table(&outer.embedding)?),
            false => None,
        };
        let head = match (&outer.head, last, format) {
            (_, false, _) => None,
            (Some(head), true, _) => Some(w.matrix_as(head, head_format)?),
            // A tied head borrows the f32 embedding, or is the embedding in its stored block
            // or 16-bit format under `native`, or a converted copy of it.
            (None, true, WeightFormat::F32) => None,
            (None, true, WeightFormat::Native) => match w.native_format(&outer.embedding) {
                WeightFormat::F32 => None,
                _ => Some(w.matrix_as(&outer.embedding, WeightFormat::Native)?),
            },
            (None, true, _) => Some(w.matrix_as(&outer.embedding, head_format)?),
        };
        // A last stage that is not first needed the embedding only to build its own head.
        let embedding = embedding.filter(|_| first || head.is_none());
        let final_norm = match last {
            true => Some(RmsNorm::load_scaled(&w, &outer.final_norm, outer.norm_scale)?),
            false => None,
        };
        let ops_info = ops.info();
        tracing::info!(
            arch = arch.name(),
            layers = ?layers,
            kinds = ?specs.iter().map(|s| format!("{}+{}", s.kind.name(), s.ffn.name())).collect::<std::collections::BTreeSet<_>>(),
            format = %format,
            kernels = %ops_info.kernels,
            seconds = started.elapsed().as_secs_f64(),
            "model part loaded"
        );
        Ok(Self {
            config: config.clone(),
            arch,
            layers,
            cache: CacheLayout::of(&specs),
            specs,
            embedding,
            blocks,
            final_norm,
            head,
            is_first: first,
            is_last: last,
            rope: Rope::new(config),
            format,
            ops,
            taps: None,
        })
    }

    /// Add each tap layer's output times its `fc` block to the running sum whenever a batch
    /// asks for taps ([`forward_host_tapped`](Self::forward_host_tapped)).
    pub fn set_taps(&mut self, taps: Option<TapProjection<O>>) {
        self.taps = taps;
    }

    /// Load `fc`'s column blocks for the DFlash tap layers among this stage's and use them;
    /// returns the tap layers held (stage-relative).
    pub fn attach_taps(&mut self, draft: &DflashFiles) -> Result<Vec<usize>, DflashError> {
        let taps = TapProjection::load(&self.ops, draft, self.layers.clone())?;
        self.set_taps(taps);
        Ok(self.tap_layers())
    }

    /// Stage-relative indices of the tap layers held.
    pub fn tap_layers(&self) -> Vec<usize> {
        self.taps.as_ref().map_or_else(Vec::new, |t| t.layers().collect())
    }

    /// The tensors the whole model needs, checked against the files (nothing missing, nothing
    /// unexpected, every shape right).
    pub fn validate_files(files: &ModelFiles, config: &ModelConfig) -> Result<(), LoadError> {
        let arch = registry::for_config(config);
        let expected = arch::stage_tensors(arch, config, 0..config.num_layers, true, true);
        files.validate_complete(config, &expected, &[arch.outer(config).tolerated_head])
    }

    /// The head matrix (`[vocab, hidden]`), if this is the last stage.
    pub fn head(&self) -> Option<&O::Mat> {
        self.head.as_ref().or(self.embedding.as_ref().filter(|_| self.is_last))
    }

    /// The embedding table, on the first stage.
    pub fn embedding_table(&self) -> Option<&O::Mat> {
        self.embedding.as_ref().filter(|_| self.is_first)
    }

    /// Layer `i` of the stage (0 is the range's first).
    pub fn block(&self, i: usize) -> &DecoderLayer<O> {
        &self.blocks[i]
    }

    /// The table to embed `tokens` from: this must be the first stage, and `tokens` not empty.
    pub fn embedding_for(&self, tokens: &[u32]) -> Result<&O::Mat, ForwardError> {
        let table = self.embedding_table().ok_or(ForwardError::MissingPart("embedding"))?;
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        Ok(table)
    }

    /// Embedding rows for `tokens` into `s.hidden`.
    pub fn embed_into(&self, tokens: &[u32], s: &mut Scratch<O>) -> Result<(), ForwardError> {
        self.ops.embed(self.embedding_for(tokens)?, tokens, &mut s.hidden)
    }

    /// Run this stage's layers on the rows in `s.hidden`, which hold every sequence's rows
    /// back to back in `kv`'s order. Each weight matrix is applied to all rows in one product;
    /// attention runs per sequence over its own cache. Each row's result is bit-identical to
    /// running its sequence alone. An error leaves every cache as it was.
    pub fn run_layers(&self, kv: &mut O::Kv<'_>, s: &mut Scratch<O>) -> Result<(), ForwardError> {
        let c = &self.config;
        let h = c.hidden_size;
        let n_seqs = kv.seqs();
        let rows = self.ops.len(&s.hidden);
        if rows == 0 || n_seqs == 0 || (0..n_seqs).any(|i| kv.span(i).1 == 0) {
            return Err(ForwardError::Empty);
        }
        let t: usize = (0..n_seqs).map(|i| kv.span(i).1).sum();
        if rows != t * h {
            return Err(ForwardError::HiddenShape { got: rows, hidden: h });
        }
        let mut longest = 0;
        for i in 0..n_seqs {
            let (pos0, len) = kv.span(i);
            if kv.stored(i) != pos0 {
                return Err(ForwardError::KvPosition {
                    have: kv.stored(i),
                    pos0,
                });
            }
            let end = pos0 + len;
            if end > c.max_position_embeddings {
                return Err(ForwardError::ContextOverflow {
                    needed: end,
                    max: c.max_position_embeddings,
                });
            }
            longest = longest.max(end);
        }
        kv.prepare()?;
        let mut batch = std::mem::take(&mut s.batch);
        let half = c.rotary_dim / 2;
        batch.cos.resize(t * half, 0.0);
        batch.sin.resize(t * half, 0.0);
        batch.longest = longest;
        let mut row = 0;
        for i in 0..n_seqs {
            let (pos0, len) = kv.span(i);
            for p in pos0..pos0 + len {
                let at = row * half..(row + 1) * half;
                self.rope.tables(p, &mut batch.cos[at.clone()], &mut batch.sin[at]);
                row += 1;
            }
        }
        s.moe = MoeStats::default();
        let taps = self.taps.as_ref().filter(|_| s.tapping);
        if let Some(times) = s.layer_seconds.as_mut() {
            times.resize(self.blocks.len(), 0.0);
            self.ops.finish();
        }
        for (index, layer) in self.blocks.iter().enumerate() {
            let started = s.layer_seconds.is_some().then(std::time::Instant::now);
            layer.forward(&self.ops, self.cache.slot[index], kv, &batch, s);
            if let Some(fc) = taps.and_then(|t| t.at(index)) {
                self.ops.matmul(&mut s.ws, &s.hidden, fc, None, &mut s.tap_product);
                self.ops.add(&mut s.taps, &s.tap_product);
            }
            if let (Some(started), Some(times)) = (started, s.layer_seconds.as_mut()) {
                self.ops.finish();
                times[index] += started.elapsed().as_secs_f64();
            }
        }
        s.batch = batch;
        kv.commit();
        if s.moe.layers > 0 {
            // How many experts' weights a micro-batch streams per sparse layer: 1 × top-k for
            // one row, up to every expert for a large batch.
            if s.moe.counted_layers > 0 {
                let per_layer = s.moe.active_experts as f64 / s.moe.counted_layers as f64;
                metrics::histogram!("baton_moe_active_experts").record(per_layer);
                tracing::Span::current().record("moe_active_experts", per_layer);
            }
            // Whether the device ran each layer's experts in one go or one by one (a GPU goes
            // one by one for weight formats without a one-go kernel).
            let one_go = s.moe.one_go_layers as u64;
            metrics::counter!("baton_moe_layers_total", "experts" => "one_go").increment(one_go);
            metrics::counter!("baton_moe_layers_total", "experts" => "by_expert")
                .increment(s.moe.layers as u64 - one_go);
        }
        Ok(())
    }

    /// [`run_layers`](Self::run_layers) on host rows `hidden`, updated in place.
    pub fn forward_host(&self, hidden: &mut [f32], kv: &mut O::Kv<'_>, s: &mut Scratch<O>) -> Result<(), ForwardError> {
        self.ops.upload(hidden, &mut s.hidden);
        self.run_layers(kv, s)?;
        self.ops.download(&s.hidden, hidden);
        Ok(())
    }

    /// [`forward_host`](Self::forward_host) that also adds this stage's DFlash taps to `taps`
    /// (the running sum, one `hidden`-wide row per row of `hidden`) when given.
    pub fn forward_host_tapped(
        &self,
        hidden: &mut [f32],
        taps: Option<&mut [f32]>,
        kv: &mut O::Kv<'_>,
        s: &mut Scratch<O>,
    ) -> Result<(), ForwardError> {
        let Some(taps) = taps else {
            return self.forward_host(hidden, kv, s);
        };
        if taps.len() != hidden.len() {
            return Err(ForwardError::HiddenShape {
                got: taps.len(),
                hidden: self.config.hidden_size,
            });
        }
        self.ops.upload(taps, &mut s.taps);
        s.tapping = true;
        let result = self.forward_host(hidden, kv, s);
        s.tapping = false;
        result?;
        self.ops.download(&s.taps, taps);
        Ok(())
    }

    /// The head alone (no final norm) on host rows already normalized elsewhere (a DFlash
    /// draft's output), leaving `rows × vocab` logits in `s.logits`.
    pub fn head_only_into(&self, rows: &[f32], s: &mut Scratch<O>) -> Result<(), ForwardError> {
        let head = self.head_for(rows)?;
        self.ops.upload(rows, &mut s.xn);
        self.ops.matmul(&mut s.ws, &s.xn, head, None, &mut s.logits);
        Ok(())
    }

    /// Final norm and head on each host row of `hidden`, writing `rows × vocab` logits to
    /// `out`.
    pub fn logits(&self, hidden: &[f32], s: &mut Scratch<O>, out: &mut [f32]) -> Result<(), ForwardError> {
        self.head_into(hidden, s)?;
        self.ops.download(&s.logits, out);
        Ok(())
    }

    /// Final norm and head on each host row of `hidden`, leaving `rows × vocab` logits in
    /// `s.logits` on the device (where a backend samples them).
    pub fn head_into(&self, hidden: &[f32], s: &mut Scratch<O>) -> Result<(), ForwardError> {
        let head = self.head_for(hidden)?;
        let norm = self
            .final_norm
            .as_ref()
            .ok_or(ForwardError::MissingPart("final norm"))?;
        self.ops.upload(hidden, &mut s.hidden);
        norm.apply_for_product(&self.ops, &mut s.ws, &s.hidden, &mut s.xn);
        self.ops.matmul(&mut s.ws, &s.xn, head, None, &mut s.logits);
        Ok(())
    }

    /// The head, after checking `rows` are whole non-empty rows of the hidden width.
    fn head_for(&self, rows: &[f32]) -> Result<&O::Mat, ForwardError> {
        let head = self.head().ok_or(ForwardError::MissingPart("head"))?;
        let h = self.config.hidden_size;
        if rows.is_empty() || !rows.len().is_multiple_of(h) {
            return Err(ForwardError::HiddenShape {
                got: rows.len(),
                hidden: h,
            });
        }
        Ok(head)
    }

    /// Whether a forward waits for the device mid-way: some mixture of experts is routed on the
    /// host (its logits cross first).
    pub fn routes_on_host(&self) -> bool {
        self.blocks
            .iter()
            .any(|b| matches!(&b.ffn, Ffn::Moe(m) if !m.routes_on_device(&self.ops)))
    }

    /// Bytes of weights held (vectors and matrices as stored on the device).
    pub fn weight_bytes(&self) -> usize {
        let o = &self.ops;
        let embedding = self.embedding.as_ref().map_or(0, |m| o.matrix_bytes(m));
        let norm = 4 * self.final_norm.as_ref().map_or(0, |n| n.len(o));
        embedding + norm + self.head.as_ref().map_or(0, |m| o.matrix_bytes(m)) + self.part_bytes().layers
    }

    /// What each part needs on its own: the layers, the input embedding (first stage), and the
    /// final norm with the head (last stage; a tied f32 head borrows the embedding, so it counts
    /// the embedding's bytes: a last stage that is not first holds them for the head alone).
    pub fn part_bytes(&self) -> PartBytes {
        let o = &self.ops;
        let layer = |l: &DecoderLayer<O>| l.weight_bytes(o);
        let embedding = self.embedding.as_ref().map_or(0, |m| o.matrix_bytes(m));
        let norm = 4 * self.final_norm.as_ref().map_or(0, |n| n.len(o));
        let head = match (&self.head, self.is_last) {
            (Some(m), _) => norm + o.matrix_bytes(m),
            (None, true) => norm + embedding,
            (None, false) => 0,
        };
        PartBytes {
            layers: self.blocks.iter().map(layer).sum(),
            embedding: if self.is_first { embedding } else { 0 },
            head,
        }
    }

    /// Each held layer's weight bytes, in order.
    pub fn layer_bytes(&self) -> Vec<usize> {
        self.blocks.iter().map(|l| l.weight_bytes(&self.ops)).collect()
    }

    /// Bytes of matrix weights one decode step of one sequence reads (the layers' matrices, of
    /// a mixture of experts only the experts it is routed to, and the head).
    pub fn matrix_bytes(&self) -> usize {
        let o = &self.ops;
        let layers: usize = self.blocks.iter().map(|l| l.decode_bytes(o)).sum();
        layers + self.head().map_or(0, |m| o.matrix_bytes(m))
    }
}
