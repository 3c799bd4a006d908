//! DFlash, a block-diffusion draft for speculative decoding: its checkpoint, the feature taps
//! every stage contributes, and the draft's forward pass on the last stage.
//!
//! A DFlash draft is a small Qwen3-style stack with no embedding or head of its own. It
//! conditions on the outputs of target layers `target_layer_ids` (a tap is the *output* of that
//! layer: transformers' `hidden_states[id + 1]`), concatenated per position, projected by `fc`
//! (`[hidden, taps × hidden]`, no bias) and RMS-normed by `hidden_norm`. Rather than shipping
//! every tap to the last stage, each stage multiplies its own taps by their column blocks of
//! `fc` ([`TapProjection`]) and adds them to a running `[rows, hidden]` sum that travels with
//! the hidden rows; the last stage normalizes it into the draft's context.
//!
//! Every draft layer turns each context row into keys and values (k-norm, RoPE at the row's
//! absolute position), kept per sequence. A block of `block_size` rows (the target's embedding
//! of the last token and mask tokens) then runs through the layers with its queries seeing the
//! whole context and the whole block; the draft's `norm` and the target's head turn rows 1.. of
//! the block into proposals for the positions after the last token.

use std::ops::Range;
use std::path::{Path, PathBuf};

use baton_shared::model_config::{Architecture as ConfigArch, ModelConfig};
use baton_shared::model_files::{LoadError, ModelFiles, TensorSpec};
use serde_json::Value;

use super::ForwardError;
use super::arch::{self, Architecture, FfnTensors, LayerPlan, MixerTensors};
use super::blocks::{DecoderLayer, RmsNorm};
use super::loader::WeightLoader;
use super::rope::Rope;
use super::scratch::{Batch, Scratch};
use crate::kernels::cpu::matmul::WeightFormat;
use crate::kv_cache::KvSpans;
use crate::ops::{AttnMask, HostMatrix, Ops};

/// Why a DFlash draft could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DflashError {
    #[error("DFlash draft {path}: {message}")]
    Config { path: String, message: String },
    #[error("DFlash draft {path} does not fit the target model: {message}")]
    Mismatch { path: String, message: String },
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// What a DFlash checkpoint's `config.json` says beyond its layers' shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct DflashConfig {
    /// The draft stack (a Qwen3 layer layout).
    pub layers: ModelConfig,
    /// Rows per drafted block: the last token and `block_size - 1` mask tokens.
    pub block_size: usize,
    /// Target layers whose outputs feed the draft, in `fc`'s column order.
    pub tap_layers: Vec<usize>,
    /// The token id of a masked block position.
    pub mask_token: u32,
}

impl DflashConfig {
    /// Parse `config.json` of a draft directory.
    pub fn read(dir: &Path) -> Result<Self, DflashError> {
        let path = dir.join("config.json");
        let err = |message: String| DflashError::Config {
            path: dir.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| err(format!("cannot read config.json: {e}")))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| err(format!("config.json is not JSON: {e}")))?;
        Self::from_json(&dir.display().to_string(), &json)
    }

    /// Parse an already-decoded draft config.
    pub fn from_json(source: &str, json: &Value) -> Result<Self, DflashError> {
        let err = |message: String| DflashError::Config {
            path: source.to_string(),
            message,
        };
        let class = json
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("");
        if class != "DFlashDraftModel" {
            return Err(err(format!(
                "architectures[0] is {class:?}; Baton runs \"DFlashDraftModel\" drafts (DFlash2 drafts, with convolutions and a candidate selector, are not supported)"
            )));
        }
        // Options the published reference applies and Baton does not: refuse them rather than
        // draft from a different function.
        let dflash = json.get("dflash_config").filter(|v| v.is_object());
        let field = |name: &str| dflash.and_then(|d| d.get(name)).or_else(|| json.get(name));
        for (name, neutral) in [("input_embedding_scale", 1.0), ("output_multiplier", 1.0)] {
            if let Some(v) = field(name).and_then(Value::as_f64)
                && v != neutral
            {
                return Err(err(format!("{name} = {v} is not supported (only {neutral})")));
            }
        }
        if field("final_logit_softcapping")
            .and_then(Value::as_f64)
            .is_some_and(|v| v > 0.0)
        {
            return Err(err("final_logit_softcapping is not supported".into()));
        }
        if let Some(types) = json.get("layer_types").and_then(Value::as_array)
            && types.iter().any(|t| t.as_str() != Some("full_attention"))
        {
            return Err(err(
                "only full_attention draft layers are supported (no sliding windows)".into(),
            ));
        }
        if json.get("is_causal").and_then(Value::as_bool) == Some(true) {
            return Err(err(
                "is_causal = true is not supported (DFlash blocks attend both ways)".into(),
            ));
        }
        let mut body = json.clone();
        body["model_type"] = Value::from("qwen3");
        let layers = ModelConfig::from_hf_value(source, &body).map_err(|e| err(e.to_string()))?;
        if layers.architecture != ConfigArch::Qwen3 {
            return Err(err("the draft layers must be Qwen3 layers".into()));
        }
        let block_size = match field("block_size") {
            Some(v) => v
                .as_u64()
                .ok_or_else(|| err(format!("block_size {v} is not a whole number")))? as usize,
            None => 16,
        };
        if !(2..=64).contains(&block_size) {
            return Err(err(format!("block_size {block_size} is outside 2..=64")));
        }
        let tap_layers: Vec<usize> = field("target_layer_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| err("dflash_config.target_layer_ids is missing".into()))?
            .iter()
            .map(|v| v.as_u64().map(|x| x as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| err("target_layer_ids must be whole numbers".into()))?;
        if tap_layers.is_empty() {
            return Err(err("target_layer_ids is empty".into()));
        }
        if tap_layers.windows(2).any(|w| w[0] >= w[1]) {
            return Err(err(format!("target_layer_ids {tap_layers:?} must be increasing")));
        }
        let mask_token = field("mask_token_id")
            .and_then(Value::as_u64)
            .ok_or_else(|| err("dflash_config.mask_token_id is missing".into()))? as u32;
        Ok(Self {
            layers,
            block_size,
            tap_layers,
            mask_token,
        })
    }

    /// Check the draft against the target it drafts for.
    pub fn check_target(&self, source: &str, target: &ModelConfig) -> Result<(), DflashError> {
        let err = |message: String| DflashError::Mismatch {
            path: source.to_string(),
            message,
        };
        if self.layers.hidden_size != target.hidden_size {
            return Err(err(format!(
                "hidden size {} vs the target's {}",
                self.layers.hidden_size, target.hidden_size
            )));
        }
        if let Some(&l) = self.tap_layers.iter().find(|&&l| l >= target.num_layers) {
            return Err(err(format!(
                "tap layer {l}, but the target has {} layers",
                target.num_layers
            )));
        }
        if self.mask_token as usize >= target.vocab_size {
            return Err(err(format!(
                "mask token {} outside the target's vocabulary of {}",
                self.mask_token, target.vocab_size
            )));
        }
        Ok(())
    }

    /// The `fc` tensor: `[hidden, taps × hidden]`.
    pub fn fc_spec(&self) -> TensorSpec {
        let h = self.layers.hidden_size;
        TensorSpec::new("fc.weight", "fc.weight", vec![h, self.tap_layers.len() * h])
    }

    /// Layer `l` of the draft: a Qwen3 layer named without the `model.` prefix.
    fn layer_plan(&self, l: usize) -> LayerPlan {
        let mut plan = arch::Qwen3.layer(&self.layers, l);
        for spec in plan_specs(&mut plan) {
            if let Some(rest) = spec.hf.strip_prefix("model.") {
                spec.hf = rest.to_string();
            }
        }
        plan
    }
}

/// Every tensor spec of a dense attention layer, to rename.
fn plan_specs(plan: &mut LayerPlan) -> Vec<&mut TensorSpec> {
    let mut out = vec![&mut plan.mixer_norm, &mut plan.ffn_norm];
    match &mut plan.mixer {
        MixerTensors::Attention(a) => {
            out.extend([&mut a.q, &mut a.k, &mut a.v, &mut a.o]);
            out.extend(a.qkv_bias.iter_mut().flatten());
            out.extend(a.qk_norm.iter_mut().flatten());
        }
        MixerTensors::LinearAttention(_) => unreachable!("a Qwen3 layer is full attention"),
    }
    match &mut plan.ffn {
        FfnTensors::Dense(m) => out.extend([&mut m.gate, &mut m.up, &mut m.down]),
        FfnTensors::Moe(_) => unreachable!("a Qwen3 layer is dense"),
    }
    out
}

/// An opened DFlash checkpoint: its config and its safetensors.
pub struct DflashFiles {
    pub path: PathBuf,
    pub config: DflashConfig,
    pub files: ModelFiles,
}

impl std::fmt::Debug for DflashFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DflashFiles")
            .field("path", &self.path)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl DflashFiles {
    /// Open the draft directory `path` (config.json and safetensors) and check it fits `target`.
    pub fn open(path: &Path, target: &ModelConfig) -> Result<Self, DflashError> {
        if !path.is_dir() {
            return Err(DflashError::Config {
                path: path.display().to_string(),
                message: "not a directory (a DFlash draft is a Hugging Face directory)".into(),
            });
        }
        let config = DflashConfig::read(path)?;
        config.check_target(&path.display().to_string(), target)?;
        let files = ModelFiles::open(path)?;
        let fc = config.fc_spec();
        match files.stored(&fc) {
            Some(t) if t.shape == fc.shape => {}
            Some(t) => {
                return Err(DflashError::Mismatch {
                    path: path.display().to_string(),
                    message: format!("fc.weight is {:?}, expected {:?}", t.shape, fc.shape),
                });
            }
            None => {
                return Err(DflashError::Config {
                    path: path.display().to_string(),
                    message: "fc.weight is missing".into(),
                });
            }
        }
        Ok(Self {
            path: path.into(),
            config,
            files,
        })
    }
}

/// A stage's share of `fc`: for each tap layer the stage holds, that layer's index within the
/// stage and `fc`'s column block for it (`[hidden, hidden]`, kept in f32).
pub struct TapProjection<O: Ops> {
    taps: Vec<(usize, O::Mat)>,
}

impl<O: Ops> TapProjection<O> {
    /// The column blocks of the taps in `layers`; None when the stage holds no tap layer (it
    /// passes the running sum on unchanged).
    pub fn load(ops: &O, draft: &DflashFiles, layers: Range<usize>) -> Result<Option<Self>, DflashError> {
        let c = &draft.config;
        let held: Vec<(usize, usize)> = c
            .tap_layers
            .iter()
            .enumerate()
            .filter(|(_, l)| layers.contains(l))
            .map(|(j, &l)| (j, l - layers.start))
            .collect();
        if held.is_empty() {
            return Ok(None);
        }
        let h = c.layers.hidden_size;
        let fc = draft.files.load_f32(&c.fc_spec(), true)?;
        let width = c.tap_layers.len() * h;
        let mut taps = Vec::with_capacity(held.len());
        for (j, index) in held {
            let mut block = Vec::with_capacity(h * h);
            for row in fc.chunks_exact(width) {
                block.extend_from_slice(&row[j * h..(j + 1) * h]);
            }
            let m = ops
                .matrix(HostMatrix::F32 { values: block, cols: h }, WeightFormat::F32)
                .map_err(|reason| LoadError::Blocks {
                    source_name: draft.files.source_name(),
                    name: "fc.weight".into(),
                    reason,
                })?;
            taps.push((index, m));
        }
        Ok(Some(Self { taps }))
    }

    /// `fc`'s block for the stage's layer `index`, if that layer is a tap.
    pub fn at(&self, index: usize) -> Option<&O::Mat> {
        self.taps.iter().find(|(i, _)| *i == index).map(|(_, m)| m)
    }

    /// Tap layers held (stage-relative indices).
    pub fn layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.taps.iter().map(|(i, _)| *i)
    }
}

/// The draft stack on the last stage, with the target's embedding table it embeds blocks from.
pub struct DraftModel<O: Ops> {
    pub config: DflashConfig,
    layers: Vec<DecoderLayer<O>>,
    hidden_norm: RmsNorm<O>,
    norm: RmsNorm<O>,
    embedding: O::Mat,
    rope: Rope,
    pub ops: O,
}

impl<O: Ops> DraftModel<O> {
    /// Load the draft in `draft` onto `ops` (its layers in f32), and the embedding table of the
    /// target in `target_files`.
    pub fn load(
        ops: O,
        draft: &DflashFiles,
        target_files: &ModelFiles,
        target: &ModelConfig,
    ) -> Result<Self, DflashError> {
        let c = &draft.config;
        let _span =
            tracing::info_span!("dflash.load", path = %draft.path.display(), layers = c.layers.num_layers).entered();
        let w = WeightLoader {
            files: &draft.files,
            config: &c.layers,
            ops: &ops,
            format: WeightFormat::F32,
            check_finite: true,
        };
        let layers = (0..c.layers.num_layers)
            .map(|l| DecoderLayer::load(&w, &c.layer_plan(l)))
            .collect::<Result<Vec<_>, _>>()?;
        let vector = |name: &str| TensorSpec::new(name, name, vec![c.layers.hidden_size]);
        let hidden_norm = RmsNorm::load(&w, &vector("hidden_norm.weight"))?;
        let norm = RmsNorm::load(&w, &vector("norm.weight"))?;
        let t = WeightLoader {
            files: target_files,
            config: target,
            ops: &ops,
            format: WeightFormat::F32,
            check_finite: true,
        };
        let embedding = t.table(&registry_outer(target).embedding)?;
        Ok(Self {
            config: c.clone(),
            layers,
            hidden_norm,
            norm,
            embedding,
            rope: Rope::new(&c.layers),
            ops,
        })
    }

    /// Draft layers (slots in a draft cache).
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Width of a draft cache row.
    pub fn kv_dim(&self) -> usize {
        self.config.layers.kv_dim()
    }

    /// RoPE tables for the rows of `kv` (sequence `i`'s rows sit at absolute positions
    /// `origin[i] + span`), and the longest cache a query reads.
    fn tables(&self, kv: &O::Kv<'_>, origin: &[usize], batch: &mut Batch) {
        let half = self.config.layers.rotary_dim / 2;
        batch.cos.clear();
        batch.sin.clear();
        batch.longest = 0;
        for (i, &o) in origin.iter().enumerate().take(kv.seqs()) {
            let (pos0, len) = kv.span(i);
            batch.longest = batch.longest.max(pos0 + len);
            for p in pos0..pos0 + len {
                let at = batch.cos.len();
                batch.cos.resize(at + half, 0.0);
                batch.sin.resize(at + half, 0.0);
                self.rope.tables(o + p, &mut batch.cos[at..], &mut batch.sin[at..]);
            }
        }
    }

    fn check_spans(&self, kv: &O::Kv<'_>, origin: &[usize], rows: usize) -> Result<(), ForwardError> {
        let h = self.config.layers.hidden_size;
        let t: usize = (0..kv.seqs()).map(|i| kv.span(i).1).sum();
        if origin.len() != kv.seqs() || t == 0 || rows != t * h {
            return Err(ForwardError::HiddenShape { got: rows, hidden: h });
        }
        for i in 0..kv.seqs() {
            let (pos0, _) = kv.span(i);
            if kv.stored(i) != pos0 {
                return Err(ForwardError::KvPosition {
                    have: kv.stored(i),
                    pos0,
                });
            }
        }
        Ok(())
    }

    /// Append context rows to each sequence's draft cache: `s.hidden` holds the summed `fc`
    /// projections of the taps (`hidden_norm` is applied here), sequence `i`'s rows at cache
    /// rows `kv.span(i)`, absolute positions offset by `origin[i]`.
    pub fn add_context(&self, kv: &mut O::Kv<'_>, origin: &[usize], s: &mut Scratch<O>) -> Result<(), ForwardError> {
        self.check_spans(kv, origin, self.ops.len(&s.hidden))?;
        kv.prepare()?;
        let mut batch = std::mem::take(&mut s.batch);
        self.tables(kv, origin, &mut batch);
        self.hidden_norm.apply(&self.ops, &s.hidden, &mut s.xn);
        for (index, layer) in self.layers.iter().enumerate() {
            let super::blocks::Mixer::Attention(a) = &layer.mixer else {
                unreachable!("a DFlash draft's layers are Qwen3 attention layers")
            };
            a.store_context(&self.ops, index, kv, &batch, s);
        }
        s.batch = batch;
        kv.commit();
        Ok(())
    }

    /// Embed each sequence's block (`anchors[i]` then mask tokens) into `s.hidden`.
    pub fn embed_blocks(&self, anchors: &[u32], s: &mut Scratch<O>) -> Result<(), ForwardError> {
        let b = self.config.block_size;
        let mut tokens = Vec::with_capacity(anchors.len() * b);
        for &a in anchors {
            tokens.push(a);
            tokens.extend(std::iter::repeat_n(self.config.mask_token, b - 1));
        }
        self.ops.embed(&self.embedding, &tokens, &mut s.hidden)
    }

    /// Run the blocks in `s.hidden` (one per sequence of `kv`, `block_size` rows each) through
    /// the draft, leaving the final-normed rows in `s.xn`. The blocks' K/V are written after
    /// each sequence's context and committed; the caller truncates them away afterwards.
    pub fn run_blocks(&self, kv: &mut O::Kv<'_>, origin: &[usize], s: &mut Scratch<O>) -> Result<(), ForwardError> {
        self.check_spans(kv, origin, self.ops.len(&s.hidden))?;
        let b = self.config.block_size;
        if (0..kv.seqs()).any(|i| kv.span(i).1 != b) {
            return Err(ForwardError::Empty);
        }
        kv.prepare()?;
        let mut batch = std::mem::take(&mut s.batch);
        self.tables(kv, origin, &mut batch);
        for (index, layer) in self.layers.iter().enumerate() {
            layer.forward_masked(&self.ops, index, kv, &batch, AttnMask::Block, s);
        }
        s.batch = batch;
        kv.commit();
        self.norm.apply(&self.ops, &s.hidden, &mut s.xn);
        Ok(())
    }
}

/// The target's embedding tensor spec.
fn registry_outer(target: &ModelConfig) -> arch::OuterPlan {
    super::registry::for_config(target).outer(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Value {
        serde_json::json!({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 320,
            "block_size": 8,
            "dflash_config": {"target_layer_ids": [1, 5, 9], "mask_token_id": 317}
        })
    }

    fn refused(edit: impl FnOnce(&mut Value)) -> String {
        let mut c = config();
        edit(&mut c);
        DflashConfig::from_json("draft", &c).unwrap_err().to_string()
    }

    #[test]
    fn a_published_layout_config_is_read() {
        let c = DflashConfig::from_json("draft", &config()).unwrap();
        assert_eq!(
            (c.block_size, c.mask_token, c.tap_layers.clone()),
            (8, 317, vec![1, 5, 9])
        );
        assert_eq!(c.layers.num_layers, 2);
        assert_eq!(c.fc_spec().shape, vec![64, 192]);
        // Names without the `model.` prefix a target's layers have.
        assert_eq!(c.layer_plan(1).mixer_norm.hf, "layers.1.input_layernorm.weight");
        // The block size may also sit in dflash_config, and defaults to 16.
        let mut v = config();
        v.as_object_mut().unwrap().remove("block_size");
        assert_eq!(DflashConfig::from_json("draft", &v).unwrap().block_size, 16);
    }

    #[test]
    fn what_baton_does_not_run_is_refused_by_name() {
        let e = refused(|c| c["architectures"] = serde_json::json!(["DFlash2DraftModel"]));
        assert!(e.contains("DFlash2"), "{e}");
        let e = refused(|c| c["layer_types"] = serde_json::json!(["sliding_attention", "full_attention"]));
        assert!(e.contains("sliding"), "{e}");
        let e = refused(|c| c["dflash_config"]["output_multiplier"] = serde_json::json!(0.2));
        assert!(e.contains("output_multiplier"), "{e}");
        let e = refused(|c| c["dflash_config"]["final_logit_softcapping"] = serde_json::json!(20.0));
        assert!(e.contains("softcapping"), "{e}");
        let e = refused(|c| c["is_causal"] = serde_json::json!(true));
        assert!(e.contains("is_causal"), "{e}");
        let e = refused(|c| {
            c["dflash_config"].as_object_mut().unwrap().remove("target_layer_ids");
        });
        assert!(e.contains("target_layer_ids"), "{e}");
        let e = refused(|c| c["dflash_config"]["target_layer_ids"] = serde_json::json!([5, 1]));
        assert!(e.contains("increasing"), "{e}");
        let e = refused(|c| {
            c["dflash_config"].as_object_mut().unwrap().remove("mask_token_id");
        });
        assert!(e.contains("mask_token_id"), "{e}");
        let e = refused(|c| c["block_size"] = serde_json::json!(1));
        assert!(e.contains("block_size 1"), "{e}");
    }
}
