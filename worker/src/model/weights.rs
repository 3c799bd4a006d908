//! Weights of one pipeline stage: a layer range, plus the embedding and/or head. Norms, biases
//! and the embedding table are f32; the seven linear layers and the head are [`Matrix`] in the
//! chosen [`WeightFormat`].

use std::ops::Range;
use std::sync::Arc;

use baton_shared::dtype::DType;
use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles, TensorRole};

use super::rope::Rope;
use crate::kernels::cpu::dispatch::Kernels;
use crate::kernels::cpu::matmul::{MatRef, Matrix, WeightFormat};
use crate::threads::ThreadPool;

/// How to hold and run a stage's weights; the default is the reference behaviour (f32, one
/// thread), bit-identical to the fp32 reference kernels.
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

/// One decoder layer's weights, row-major `[out, in]` matrices.
#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

impl LayerWeights {
    /// The seven linear layers.
    pub fn matrices(&self) -> [&Matrix; 7] {
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
    }
}

/// Weights a stage holds: layers `layers`, the embedding on the first stage (or for a tied
/// head), the final norm and head on the last.
#[derive(Debug)]
pub struct StageWeights {
    pub config: ModelConfig,
    pub layers: Range<usize>,
    pub embedding: Option<Vec<f32>>,
    pub layer_weights: Vec<LayerWeights>,
    pub final_norm: Option<Vec<f32>>,
    /// The head matrix; `None` for a tied f32 head, which borrows `embedding`.
    pub lm_head: Option<Matrix>,
    /// Whether this stage starts from token ids (holds the embedding for input).
    pub is_first: bool,
    /// Whether this stage produces logits.
    pub is_last: bool,
    pub rope: Rope,
    /// Storage of the linear layers and the head.
    pub format: WeightFormat,
    /// The kernel path the matrix products run on.
    pub kernels: Kernels,
    /// Threads for the matrix products.
    pub pool: Arc<ThreadPool>,
}

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

/// A matrix from a file's block bytes, kept in that format.
fn native_matrix(
    files: &ModelFiles,
    role: TensorRole,
    layer: Option<usize>,
    dtype: DType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Matrix, LoadError> {
    let err = |reason: String| LoadError::Blocks {
        source_name: files.source_name(),
        name: files.name_of(role, layer),
        reason,
    };
    match Matrix::from_ggml(dtype, bytes, rows, cols) {
        Some(Ok(m)) => Ok(m),
        Some(Err(reason)) => Err(err(reason)),
        None => Err(err(format!("{dtype} is not a block format"))),
    }
}

impl StageWeights {
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
        if layers.start > layers.end || layers.end > config.num_layers {
            return Err(LoadError::LayerRange {
                start: layers.start,
                end: layers.end,
                layers: config.num_layers,
            });
        }
        let get = |role, layer| files.load_f32(config, role, layer, check_finite);
        let opt = |cond: bool, role, layer| -> Result<Option<Vec<f32>>, LoadError> {
            if cond { get(role, layer).map(Some) } else { Ok(None) }
        };
        let fmt = opts.format;
        // Dequantize to f32 (checked for NaN/Inf), then convert: one path for every file format.
        // `native` keeps a file's block formats as stored instead (after the same checks).
        // The head stays at 8 bits under the 4-bit formats, as llama.cpp keeps its output tensor
        // at higher precision: measured on SmolLM2, a Q4_1 head alone takes the logit error
        // from 4% to 10% of the spread.
        let head_fmt = match fmt {
            WeightFormat::Q4_0 | WeightFormat::Q4_1 => WeightFormat::Q8_0,
            other => other,
        };
        let mat_as = |role: TensorRole, layer: Option<usize>, fmt: WeightFormat| -> Result<Matrix, LoadError> {
            let cols = *role.shape(config).last().unwrap_or(&1);
            let values = get(role, layer)?;
            if fmt == WeightFormat::Native {
                if let Some((dtype, bytes)) = files.load_blocks(config, role, layer)? {
                    return native_matrix(files, role, layer, dtype, &bytes, values.len() / cols, cols);
                }
                // 16-bit floats widen exactly, so rounding the f32 values back is lossless.
                let stored = files.stored(role, layer).map(|t| t.dtype);
                let as_stored = match stored {
                    Some(DType::BF16) => WeightFormat::Bf16,
                    Some(DType::F16) => WeightFormat::F16,
                    _ => WeightFormat::F32,
                };
                return Ok(Matrix::from_f32(values, cols, as_stored));
            }
            Ok(Matrix::from_f32(values, cols, fmt))
        };
        let mat = |role, layer| mat_as(role, layer, fmt);
        let mut layer_weights = Vec::with_capacity(layers.len());
        for l in layers.clone() {
            let l = Some(l);
            layer_weights.push(LayerWeights {
                attn_norm: get(TensorRole::AttnNorm, l)?,
                wq: mat(TensorRole::Q, l)?,
                wk: mat(TensorRole::K, l)?,
                wv: mat(TensorRole::V, l)?,
                bq: opt(config.qkv_bias, TensorRole::QBias, l)?,
                bk: opt(config.qkv_bias, TensorRole::KBias, l)?,
                bv: opt(config.qkv_bias, TensorRole::VBias, l)?,
                q_norm: opt(config.qk_norm, TensorRole::QNorm, l)?,
                k_norm: opt(config.qk_norm, TensorRole::KNorm, l)?,
                wo: mat(TensorRole::O, l)?,
                ffn_norm: get(TensorRole::FfnNorm, l)?,
                w_gate: mat(TensorRole::Gate, l)?,
                w_up: mat(TensorRole::Up, l)?,
                w_down: mat(TensorRole::Down, l)?,
            });
        }
        let need_embedding = first || (last && config.tie_word_embeddings);
        let embedding = opt(need_embedding, TensorRole::Embedding, None)?;
        let lm_head = match (last, config.tie_word_embeddings, fmt) {
            (false, _, _) | (true, true, WeightFormat::F32) => None,
            (true, false, _) => Some(mat_as(TensorRole::LmHead, None, head_fmt)?),
            // A tied head in the embedding's stored block format, or f32 (borrowing it).
            (true, true, WeightFormat::Native) => match mat(TensorRole::Embedding, None)? {
                Matrix::F32 { .. } => None,
                m => Some(m),
            },
            (true, true, _) => {
                let emb = embedding.as_deref().expect("a tied head loads the embedding");
                let h = config.hidden_size;
                Some(Matrix::from_f32(emb.to_vec(), h, head_fmt))
            }
        };
        // A last stage that is not first needed the embedding only to build its own head.
        let embedding = embedding.filter(|_| first || lm_head.is_none());
        Ok(Self {
            config: config.clone(),
            layers,
            embedding,
            layer_weights,
            final_norm: opt(last, TensorRole::FinalNorm, None)?,
            lm_head,
            is_first: first,
            is_last: last,
            rope: Rope::new(config),
            format: fmt,
            kernels: opts.kernels.unwrap_or_else(Kernels::detect),
            pool: Arc::new(ThreadPool::new(opts.threads)),
        })
    }

    /// Load the whole model as a single stage.
    pub fn load_full(files: &ModelFiles, config: &ModelConfig, check_finite: bool) -> Result<Self, LoadError> {
        files.validate_complete(config)?;
        Self::load(files, config, 0..config.num_layers, true, true, check_finite)
    }

    /// [`load_full`](Self::load_full) with a weight format, thread count and kernel path.
    pub fn load_full_with(
        files: &ModelFiles,
        config: &ModelConfig,
        check_finite: bool,
        opts: &LoadOptions,
    ) -> Result<Self, LoadError> {
        files.validate_complete(config)?;
        Self::load_with(files, config, 0..config.num_layers, true, true, check_finite, opts)
    }

    /// Bytes of weights held (f32 vectors and matrices in their stored format).
    pub fn weight_bytes(&self) -> usize {
        let vectors = [&self.embedding, &self.final_norm]
            .iter()
            .map(|v| v.as_ref().map_or(0, Vec::len))
            .sum::<usize>();
        4 * vectors + self.lm_head.as_ref().map_or(0, Matrix::bytes) + self.part_bytes().layers
    }

    /// What each part needs on its own: the layers, the input embedding (first stage), and the
    /// final norm with the head (last stage; a tied f32 head borrows the embedding, so it counts
    /// the embedding's bytes: a last stage that is not first holds them for the head alone).
    pub fn part_bytes(&self) -> PartBytes {
        let layer = |l: &LayerWeights| {
            l.matrices().iter().map(|m| m.bytes()).sum::<usize>()
                + 4 * (l.attn_norm.len()
                    + l.ffn_norm.len()
                    + [&l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm]
                        .iter()
                        .map(|v| v.as_ref().map_or(0, Vec::len))
                        .sum::<usize>())
        };
        let embedding = 4 * self.embedding.as_ref().map_or(0, Vec::len);
        let norm = 4 * self.final_norm.as_ref().map_or(0, Vec::len);
        let head = match (&self.lm_head, self.is_last) {
            (Some(m), _) => norm + m.bytes(),
            (None, true) => norm + embedding,
            (None, false) => 0,
        };
        PartBytes {
            layers: self.layer_weights.iter().map(layer).sum(),
            embedding: if self.is_first { embedding } else { 0 },
            head,
        }
    }

    /// Bytes of matrix weights one decode step reads (the layers' linears and the head).
    pub fn matrix_bytes(&self) -> usize {
        let layers: usize = self
            .layer_weights
            .iter()
            .flat_map(|l| l.matrices())
            .map(Matrix::bytes)
            .sum();
        let head = match (&self.lm_head, self.head()) {
            (Some(m), _) => m.bytes(),
            (None, Some(h)) => 4 * h.rows() * h.cols(),
            (None, None) => 0,
        };
        layers + head
    }

    /// The head matrix (`[vocab, hidden]`), if this is the last stage.
    pub fn head(&self) -> Option<MatRef<'_>> {
        if let Some(m) = &self.lm_head {
            return Some(m.view());
        }
        let emb = self.embedding.as_deref().filter(|_| self.is_last)?;
        Some(MatRef::F32 {
            data: emb,
            cols: self.config.hidden_size,
        })
    }
}
