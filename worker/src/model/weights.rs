//! fp32 weights of one pipeline stage: a layer range, plus the embedding and/or head.

use std::ops::Range;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles, TensorRole};

use super::rope::Rope;

/// One decoder layer's weights, row-major `[out, in]` matrices.
#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Vec<f32>,
    pub w_up: Vec<f32>,
    pub w_down: Vec<f32>,
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
    /// Untied head; a tied head uses `embedding`.
    pub lm_head: Option<Vec<f32>>,
    /// Whether this stage starts from token ids (holds the embedding for input).
    pub is_first: bool,
    /// Whether this stage produces logits.
    pub is_last: bool,
    pub rope: Rope,
}

impl StageWeights {
    /// Load the tensors for `layers` (and the embedding when `first`, the head when `last`).
    pub fn load(
        files: &ModelFiles,
        config: &ModelConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
        check_finite: bool,
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
        let mut layer_weights = Vec::with_capacity(layers.len());
        for l in layers.clone() {
            let l = Some(l);
            layer_weights.push(LayerWeights {
                attn_norm: get(TensorRole::AttnNorm, l)?,
                wq: get(TensorRole::Q, l)?,
                wk: get(TensorRole::K, l)?,
                wv: get(TensorRole::V, l)?,
                bq: opt(config.qkv_bias, TensorRole::QBias, l)?,
                bk: opt(config.qkv_bias, TensorRole::KBias, l)?,
                bv: opt(config.qkv_bias, TensorRole::VBias, l)?,
                q_norm: opt(config.qk_norm, TensorRole::QNorm, l)?,
                k_norm: opt(config.qk_norm, TensorRole::KNorm, l)?,
                wo: get(TensorRole::O, l)?,
                ffn_norm: get(TensorRole::FfnNorm, l)?,
                w_gate: get(TensorRole::Gate, l)?,
                w_up: get(TensorRole::Up, l)?,
                w_down: get(TensorRole::Down, l)?,
            });
        }
        let need_embedding = first || (last && config.tie_word_embeddings);
        Ok(Self {
            config: config.clone(),
            layers,
            embedding: opt(need_embedding, TensorRole::Embedding, None)?,
            layer_weights,
            final_norm: opt(last, TensorRole::FinalNorm, None)?,
            lm_head: opt(last && !config.tie_word_embeddings, TensorRole::LmHead, None)?,
            is_first: first,
            is_last: last,
            rope: Rope::new(config),
        })
    }

    /// Load the whole model as a single stage.
    pub fn load_full(files: &ModelFiles, config: &ModelConfig, check_finite: bool) -> Result<Self, LoadError> {
        files.validate_complete(config)?;
        Self::load(files, config, 0..config.num_layers, true, true, check_finite)
    }

    /// Bytes of f32 weights held.
    pub fn weight_bytes(&self) -> usize {
        let layer = |l: &LayerWeights| {
            [
                &l.attn_norm,
                &l.wq,
                &l.wk,
                &l.wv,
                &l.wo,
                &l.ffn_norm,
                &l.w_gate,
                &l.w_up,
                &l.w_down,
            ]
            .iter()
            .map(|v| v.len())
            .sum::<usize>()
                + [&l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm]
                    .iter()
                    .map(|v| v.as_ref().map_or(0, Vec::len))
                    .sum::<usize>()
        };
        let parts = [&self.embedding, &self.final_norm, &self.lm_head]
            .iter()
            .map(|v| v.as_ref().map_or(0, Vec::len))
            .sum::<usize>();
        4 * (parts + self.layer_weights.iter().map(layer).sum::<usize>())
    }

    /// The head matrix (`[vocab, hidden]`), if this is the last stage.
    pub fn head(&self) -> Option<&[f32]> {
        self.lm_head
            .as_deref()
            .or(if self.is_last { self.embedding.as_deref() } else { None })
    }
}
