//! Model hyper-parameters, read from a Hugging Face `config.json` or from GGUF metadata, and
//! checked for consistency before any weight is touched.

use std::path::Path;

use serde_json::Value;

use crate::gguf::GgufFile;

/// Decoder architectures Baton runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama family (SmolLM2, Llama 2/3): no biases, RoPE over halves.
    Llama,
    /// Qwen2: bias on the q/k/v projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k, head_dim independent of hidden/heads.
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention with mixture-of-experts feed-forward layers.
    Qwen3Moe,
    /// Qwen3-Next: Gated DeltaNet (linear attention) layers between gated full-attention
    /// ones, a sparse MoE with a gated shared expert, `(1 + weight)` RMSNorms.
    Qwen3Next,
    /// Qwen3.5 (text): Qwen3-Next's layers with separate q/k/v, z, b and a projections and a
    /// dense MLP.
    Qwen35,
    /// Qwen3.5-MoE (text): Qwen3.5's layers with Qwen3-Next's sparse MoE and gated shared
    /// expert in every layer.
    Qwen35Moe,
}

impl Architecture {
    /// Parse from a Hugging Face `model_type` / GGUF `general.architecture`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "llama" | "LlamaForCausalLM" => Some(Self::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Some(Self::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Some(Self::Qwen3),
            "qwen3_moe" | "qwen3moe" | "Qwen3MoeForCausalLM" => Some(Self::Qwen3Moe),
            "qwen3_next" | "qwen3next" | "Qwen3NextForCausalLM" => Some(Self::Qwen3Next),
            "qwen3_5_text" | "qwen35" | "Qwen3_5ForCausalLM" => Some(Self::Qwen35),
            "qwen3_5_moe_text" | "qwen35moe" | "Qwen3_5MoeForCausalLM" => Some(Self::Qwen35Moe),
            _ => None,
        }
    }

    /// The Hugging Face `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Qwen3Next => "qwen3_next",
            Self::Qwen35 => "qwen3_5_text",
            Self::Qwen35Moe => "qwen3_5_moe_text",
        }
    }

    /// Whether q and k get a per-head RMSNorm (and head_dim may differ from hidden/heads).
    pub fn has_qk_norm(self) -> bool {
        matches!(
            self,
            Self::Qwen3 | Self::Qwen3Moe | Self::Qwen3Next | Self::Qwen35 | Self::Qwen35Moe
        )
    }

    /// The Hugging Face class name in `architectures`.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Qwen3Next => "Qwen3NextForCausalLM",
            Self::Qwen35 => "Qwen3_5ForCausalLM",
            Self::Qwen35Moe => "Qwen3_5MoeForCausalLM",
        }
    }
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 wavelength-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Everything the decoder needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections.
    pub qkv_bias: bool,
    /// Per-head RMSNorm on queries and keys.
    pub qk_norm: bool,
    /// Mixture-of-experts feed-forward layers (Qwen3-MoE); `None` for dense models.
    pub moe: Option<MoeConfig>,
    /// Values of each head RoPE rotates (the first ones; the rest pass through): `head_dim`
    /// unless the model rotates part of each head (Qwen3-Next's `partial_rotary_factor`).
    pub rotary_dim: usize,
    /// Linear-attention layers among the full-attention ones (Qwen3-Next); `None`: every
    /// layer is full attention.
    pub linear_attention: Option<LinearAttentionConfig>,
}

/// What mixes positions in one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Causal softmax attention over a K/V cache.
    FullAttention,
    /// Gated DeltaNet: a per-sequence recurrent state instead of K/V per position.
    LinearAttention,
}

/// Positions a Gated DeltaNet layer takes through the delta rule's chunked form at once, in
/// windows aligned to position 0: a stage runs it over the whole windows that lie inside a
/// sequence's prompt (token by token elsewhere), and the coordinator ends a hybrid prompt's
/// chunks on these boundaries, so which form a position gets, and so its bits, never depends
/// on how the prompt was scheduled.
pub const DELTA_RULE_WINDOW: usize = 16;

/// The Gated DeltaNet layers of a hybrid model (names as transformers' Qwen3-Next config).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LinearAttentionConfig {
    /// Every layer's type, in order.
    pub layer_types: Vec<LayerType>,
    /// Query/key heads (`linear_num_key_heads`).
    pub num_key_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of the key heads.
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// Taps of the causal depthwise conv1d (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    /// How a GGUF file lays out these layers' tensors; `None` for Hugging Face files.
    pub gguf_layout: Option<GgufLinearLayout>,
}

/// How llama.cpp's converter laid out a hybrid's linear-attention tensors in a GGUF file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GgufLinearLayout {
    /// Qwen3-Next's q, k, v and z kept fused as Hugging Face stores them (`ssm_in`, older
    /// files) rather than split into `attn_qkv` (every q, every k, every v) and `attn_gate`.
    pub fused_qkvz: bool,
    /// Value heads ordered key-head-minor (value head `j` of key head `g` stored at
    /// `j·key_heads + g`) instead of grouped by key head: llama.cpp's Qwen3.5 converter
    /// reorders them so in every tensor a value head indexes, for its graph to broadcast.
    pub value_heads_tiled: bool,
}

/// How a mixture-of-experts model routes each position's feed-forward pass.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MoeConfig {
    /// Experts in each sparse layer.
    pub num_experts: usize,
    /// Experts each position is sent to (top-k of the router's softmax).
    pub experts_per_token: usize,
    /// Hidden width of one expert's gated MLP.
    pub expert_intermediate_size: usize,
    /// Renormalize the chosen experts' probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse (counting from 1).
    pub decoder_sparse_step: usize,
    /// Layers that stay dense whatever the step says.
    pub mlp_only_layers: Vec<usize>,
    /// Width of the shared expert every position also runs, scaled by a sigmoid gate
    /// (Qwen3-Next); `None`: no shared expert.
    pub shared_expert_intermediate_size: Option<usize>,
}

impl MoeConfig {
    /// Whether layer `l` uses experts (as transformers decides it: not listed as dense, and
    /// `(l + 1)` a multiple of the sparse step).
    pub fn is_sparse(&self, l: usize) -> bool {
        !self.mlp_only_layers.contains(&l) && (l + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// Errors describing a model configuration Baton cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{source_name}: cannot read: {message}")]
    Read { source_name: String, message: String },
    #[error("{source_name}: missing field '{field}'")]
    Missing { source_name: String, field: String },
    #[error("{source_name}: field '{field}' is {value}, expected {expected}")]
    Invalid {
        source_name: String,
        field: String,
        value: String,
        expected: String,
    },
    #[error(
        "{source_name}: unsupported architecture '{name}' (supported: llama, qwen2, qwen3, qwen3_moe, qwen3_next, qwen3_5_text, qwen3_5_moe_text; Qwen3.5 multimodal checkpoints serve their text model)"
    )]
    UnsupportedArchitecture { source_name: String, name: String },
    #[error("{source_name}: unsupported rope scaling type '{kind}' (supported: default, linear, llama3)")]
    UnsupportedRope { source_name: String, kind: String },
    #[error("{source_name}: inconsistent config: {message}")]
    Inconsistent { source_name: String, message: String },
}

/// Upper bound on any single dimension; larger means a corrupt or hostile file.
const MAX_DIM: usize = 1 << 24;
/// Upper bound on experts per layer: every expert is three tensors the loader names, so a
/// hostile count must not make that list huge.
const MAX_EXPERTS: usize = 4096;

struct Fields<'a> {
    source_name: &'a str,
    json: &'a Value,
}

impl Fields<'_> {
    fn missing(&self, field: &str) -> ConfigError {
        ConfigError::Missing {
            source_name: self.source_name.into(),
            field: field.into(),
        }
    }

    fn invalid(&self, field: &str, value: &Value, expected: &str) -> ConfigError {
        ConfigError::Invalid {
            source_name: self.source_name.into(),
            field: field.into(),
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    fn usize_opt(&self, field: &str) -> Result<Option<usize>, ConfigError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && (n as usize) <= MAX_DIM => Ok(Some(n as usize)),
                _ => Err(self.invalid(field, v, &format!("a positive integer at most {MAX_DIM}"))),
            },
        }
    }

    fn usize(&self, field: &str) -> Result<usize, ConfigError> {
        self.usize_opt(field)?.ok_or_else(|| self.missing(field))
    }

    fn f64_opt(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                _ => Err(self.invalid(field, v, "a positive finite number")),
            },
        }
    }

    fn bool_opt(&self, field: &str) -> Result<Option<bool>, ConfigError> {
        match self.json.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(field, v, "true or false")),
        }
    }
}

fn rope_scaling_from(source_name: &str, obj: Option<&Value>) -> Result<RopeScaling, ConfigError> {
    let Some(obj) = obj.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::Default);
    };
    let f = Fields { source_name, json: obj };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |field: &str| {
        f.f64_opt(field)?
            .ok_or_else(|| f.missing(&format!("rope scaling {field}")))
    };
    match kind {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear {
            factor: need("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        }),
        other => Err(ConfigError::UnsupportedRope {
            source_name: source_name.into(),
            kind: other.into(),
        }),
    }
}

/// Multimodal configs whose `text_config` Baton serves (the text model's tensors are under
/// `model.language_model.`; see `model_files`).
pub const MULTIMODAL_MODEL_TYPES: &[&str] = &["qwen3_5", "qwen3_5_moe"];

/// Whether a config's `model_type` is of the Qwen3.5 family (its text models or the multimodal
/// wrappers), whose published checkpoints keep the text model under `model.language_model.`.
pub fn language_model_prefixed(model_type: &str) -> bool {
    MULTIMODAL_MODEL_TYPES.contains(&model_type)
        || [Architecture::Qwen35, Architecture::Qwen35Moe]
            .iter()
            .any(|a| a.model_type() == model_type)
}

/// The text model's config of a multimodal one ([`MULTIMODAL_MODEL_TYPES`]), with the
/// wrapper's `tie_word_embeddings` where the text config does not say.
fn multimodal_text_config(json: &Value) -> Option<Value> {
    let model_type = json.get("model_type").and_then(Value::as_str)?;
    if !MULTIMODAL_MODEL_TYPES.contains(&model_type) {
        return None;
    }
    let mut text = json.get("text_config").filter(|t| t.is_object())?.clone();
    if let (Some(obj), Some(tie)) = (text.as_object_mut(), json.get("tie_word_embeddings")) {
        obj.entry("tie_word_embeddings").or_insert_with(|| tie.clone());
    }
    Some(text)
}

/// The mixture-of-experts fields of a Hugging Face config (names as transformers' Qwen3-MoE
/// config has them, with its defaults).
fn moe_from_hf(f: &Fields<'_>) -> Result<MoeConfig, ConfigError> {
    let mlp_only_layers = match f.json.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v.as_u64() {
                Some(n) if (n as usize) < MAX_DIM => Ok(n as usize),
                _ => Err(f.invalid("mlp_only_layers", v, "layer indices")),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(f.invalid("mlp_only_layers", v, "a list of layer indices")),
    };
    Ok(MoeConfig {
        // Hub checkpoints say `num_experts`; transformers 5 writes `num_local_experts`.
        num_experts: match f.usize_opt("num_experts")? {
            Some(n) => n,
            None => f
                .usize_opt("num_local_experts")?
                .ok_or_else(|| f.missing("num_experts"))?,
        },
        experts_per_token: f.usize("num_experts_per_tok")?,
        expert_intermediate_size: f.usize("moe_intermediate_size")?,
        norm_topk_prob: f.bool_opt("norm_topk_prob")?.unwrap_or(false),
        decoder_sparse_step: f.usize_opt("decoder_sparse_step")?.unwrap_or(1),
        mlp_only_layers,
        shared_expert_intermediate_size: f.usize_opt("shared_expert_intermediate_size")?,
    })
}

/// The linear-attention fields of a Qwen3-Next config: `layer_types`, or every
/// `full_attention_interval`-th layer full (transformers' default, 4) and the rest linear.
fn linear_attention_from_hf(f: &Fields<'_>, num_layers: usize) -> Result<LinearAttentionConfig, ConfigError> {
    let layer_types = match f.json.get("layer_types") {
        None | Some(Value::Null) => {
            let every = f.usize_opt("full_attention_interval")?.unwrap_or(4);
            (0..num_layers)
                .map(|l| match (l + 1).is_multiple_of(every) {
                    true => LayerType::FullAttention,
                    false => LayerType::LinearAttention,
                })
                .collect()
        }
        Some(Value::Array(items)) if items.len() == num_layers => items
            .iter()
            .map(|v| match v.as_str() {
                Some("full_attention") => Ok(LayerType::FullAttention),
                Some("linear_attention") => Ok(LayerType::LinearAttention),
                _ => Err(f.invalid("layer_types", v, "\"full_attention\" or \"linear_attention\"")),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(f.invalid(
                "layer_types",
                v,
                &format!("a list of {num_layers} layer types (one per layer)"),
            ));
        }
    };
    Ok(LinearAttentionConfig {
        layer_types,
        num_key_heads: f.usize("linear_num_key_heads")?,
        num_value_heads: f.usize("linear_num_value_heads")?,
        key_head_dim: f.usize("linear_key_head_dim")?,
        value_head_dim: f.usize("linear_value_head_dim")?,
        conv_kernel: f.usize_opt("linear_conv_kernel_dim")?.unwrap_or(4),
        gguf_layout: None,
    })
}

/// Multi-token-prediction blocks a GGUF file appends after the model's own
/// (`{arch}.nextn_predict_layers`, Qwen3.5); 0 when it has none.
pub fn gguf_nextn_layers(file: &GgufFile) -> usize {
    let arch = file.get_str("general.architecture").unwrap_or("");
    file.get_u64(&format!("{arch}.nextn_predict_layers")).unwrap_or(0) as usize
}

/// A GGUF field as a positive size, or a clear error.
fn gguf_dim(file: &GgufFile, key: &str) -> Result<Option<usize>, ConfigError> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 && (n as usize) <= MAX_DIM => Ok(Some(n as usize)),
            _ => Err(ConfigError::Invalid {
                source_name: file.path().display().to_string(),
                field: key.into(),
                value: format!("{v:?}"),
                expected: "a positive integer".into(),
            }),
        },
    }
}

/// The linear-attention fields of a Qwen3-Next or Qwen3.5 GGUF file, in llama.cpp's terms: the
/// `ssm.*` sizes, and which layers are linear from `attention.recurrent_layers` (one flag per
/// block) or, without it, every `full_attention_interval`-th layer full (default 4).
fn linear_attention_from_gguf(
    file: &GgufFile,
    key: &dyn Fn(&str) -> String,
    architecture: Architecture,
    num_layers: usize,
) -> Result<LinearAttentionConfig, ConfigError> {
    let source_name = file.path().display().to_string();
    let need = |k: &str| {
        gguf_dim(file, &key(k))?.ok_or_else(|| ConfigError::Missing {
            source_name: source_name.clone(),
            field: key(k),
        })
    };
    let invalid = |field: String, value: String, expected: &str| ConfigError::Invalid {
        source_name: source_name.clone(),
        field,
        value,
        expected: expected.into(),
    };
    let layer_types: Vec<LayerType> = match file.get(&key("attention.recurrent_layers")) {
        Some(v) => {
            let flags = v
                .as_array()
                .filter(|a| a.len() >= num_layers)
                .and_then(|a| {
                    a[..num_layers]
                        .iter()
                        .map(|f| f.as_bool().or(f.as_u64().map(|n| n != 0)))
                        .collect::<Option<Vec<bool>>>()
                })
                .ok_or_else(|| {
                    invalid(
                        key("attention.recurrent_layers"),
                        format!("{v:?}"),
                        &format!("an array of at least {num_layers} flags"),
                    )
                })?;
            flags
                .into_iter()
                .map(|linear| {
                    if linear {
                        LayerType::LinearAttention
                    } else {
                        LayerType::FullAttention
                    }
                })
                .collect()
        }
        None => {
            let every = gguf_dim(file, &key("full_attention_interval"))?.unwrap_or(4);
            (0..num_layers)
                .map(|l| match (l + 1).is_multiple_of(every) {
                    true => LayerType::FullAttention,
                    false => LayerType::LinearAttention,
                })
                .collect()
        }
    };
    let (num_value_heads, inner) = (need("ssm.time_step_rank")?, need("ssm.inner_size")?);
    if !inner.is_multiple_of(num_value_heads) {
        return Err(invalid(
            key("ssm.inner_size"),
            inner.to_string(),
            &format!("a multiple of ssm.time_step_rank {num_value_heads}"),
        ));
    }
    let first_linear = layer_types.iter().position(|t| *t == LayerType::LinearAttention);
    Ok(LinearAttentionConfig {
        layer_types,
        num_key_heads: need("ssm.group_count")?,
        num_value_heads,
        key_head_dim: need("ssm.state_size")?,
        value_head_dim: inner / num_value_heads,
        conv_kernel: need("ssm.conv_kernel")?,
        gguf_layout: Some(GgufLinearLayout {
            fused_qkvz: architecture == Architecture::Qwen3Next
                && first_linear.is_some_and(|l| file.tensors.contains_key(&format!("blk.{l}.ssm_in.weight"))),
            value_heads_tiled: matches!(architecture, Architecture::Qwen35 | Architecture::Qwen35Moe),
        }),
    })
}

/// The experts of a Qwen3-Next or Qwen3.5-MoE GGUF file: llama.cpp's `expert_*` fields, the
/// shared expert's width (`expert_shared_feed_forward_length`, or its tensor's), and dense
/// the layers without a router tensor; `None` without experts.
fn hybrid_moe_from_gguf(
    file: &GgufFile,
    key: &dyn Fn(&str) -> String,
    num_layers: usize,
) -> Result<Option<MoeConfig>, ConfigError> {
    let Some(num_experts) = gguf_dim(file, &key("expert_count"))? else {
        return Ok(None);
    };
    let missing = |k: &str| ConfigError::Missing {
        source_name: file.path().display().to_string(),
        field: key(k),
    };
    let shared = match gguf_dim(file, &key("expert_shared_feed_forward_length"))? {
        Some(f) => Some(f),
        None => (0..num_layers)
            .find_map(|l| file.tensors.get(&format!("blk.{l}.ffn_up_shexp.weight")))
            .and_then(|t| t.shape.first().copied()),
    };
    Ok(Some(MoeConfig {
        num_experts,
        experts_per_token: gguf_dim(file, &key("expert_used_count"))?.ok_or_else(|| missing("expert_used_count"))?,
        expert_intermediate_size: gguf_dim(file, &key("expert_feed_forward_length"))?
            .ok_or_else(|| missing("expert_feed_forward_length"))?,
        // llama.cpp renormalizes these models' chosen experts; a file may say otherwise.
        norm_topk_prob: file
            .get(&key("expert_weights_norm"))
            .and_then(|v| v.as_bool())
            .unwrap_or(true),
        decoder_sparse_step: 1,
        mlp_only_layers: (0..num_layers)
            .filter(|l| !file.tensors.contains_key(&format!("blk.{l}.ffn_gate_inp.weight")))
            .collect(),
        shared_expert_intermediate_size: shared,
    }))
}

impl ModelConfig {
    /// Parse a Hugging Face `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self, ConfigError> {
        let source_name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            source_name: source_name.clone(),
            message: e.to_string(),
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Read {
            source_name: source_name.clone(),
            message: format!("invalid JSON: {e}"),
        })?;
        Self::from_hf_value(&source_name, &json)
    }

    /// Parse an already-decoded Hugging Face config. A multimodal Qwen3.5 config (what the
    /// published checkpoints hold) describes its text model in `text_config`, which is what
    /// Baton serves.
    pub fn from_hf_value(source_name: &str, json: &Value) -> Result<Self, ConfigError> {
        if let Some(text) = multimodal_text_config(json) {
            return Self::from_hf_value(source_name, &text);
        }
        let f = Fields { source_name, json };
        let arch_name = json
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| json.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str))
            .ok_or_else(|| f.missing("model_type"))?;
        let architecture = Architecture::parse(arch_name).ok_or_else(|| ConfigError::UnsupportedArchitecture {
            source_name: source_name.into(),
            name: arch_name.into(),
        })?;
        if let Some(act) = json.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(f.invalid("hidden_act", &json["hidden_act"], "\"silu\""));
        }
        if f.bool_opt("mlp_bias")? == Some(true) {
            return Err(f.invalid("mlp_bias", &json["mlp_bias"], "false (MLP biases are not supported)"));
        }
        let hidden_size = f.usize("hidden_size")?;
        let num_heads = f.usize("num_attention_heads")?;
        // Newer transformers nest rope settings under `rope_parameters`; older ones use
        // `rope_theta` + `rope_scaling` at the top level.
        let rope_params = json.get("rope_parameters").filter(|v| v.is_object());
        let rope_theta = match rope_params {
            Some(p) => Fields { source_name, json: p }.f64_opt("rope_theta")?,
            None => None,
        }
        .or(f.f64_opt("rope_theta")?)
        .unwrap_or(10_000.0);
        let rope_scaling = rope_scaling_from(source_name, rope_params.or(json.get("rope_scaling")))?;
        let qkv_bias = match architecture {
            Architecture::Qwen2 => true,
            _ => f.bool_opt("attention_bias")?.unwrap_or(false),
        };
        let num_layers = f.usize("num_hidden_layers")?;
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            None => hidden_size / num_heads,
        };
        let partial_rotary = match rope_params {
            Some(p) => Fields { source_name, json: p }.f64_opt("partial_rotary_factor")?,
            None => None,
        }
        .or(f.f64_opt("partial_rotary_factor")?)
        .unwrap_or(1.0);
        if partial_rotary > 1.0 {
            return Err(f.invalid(
                "partial_rotary_factor",
                &Value::from(partial_rotary),
                "a fraction of the head in (0, 1]",
            ));
        }
        let cfg = ModelConfig {
            architecture,
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            // A Qwen3.5-MoE config has no dense MLP width: its experts' width stands in.
            intermediate_size: match architecture {
                Architecture::Qwen35Moe => f.usize("moe_intermediate_size")?,
                _ => f.usize("intermediate_size")?,
            },
            num_layers,
            num_heads,
            num_kv_heads: f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads),
            head_dim,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(2048),
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            qk_norm: architecture.has_qk_norm(),
            moe: match architecture {
                Architecture::Qwen3Moe => Some(moe_from_hf(&f)?),
                // A Qwen3-Next without experts (`num_experts` 0, as transformers reads it) is dense.
                Architecture::Qwen3Next if json.get("num_experts").and_then(Value::as_u64) == Some(0) => None,
                Architecture::Qwen3Next => Some(moe_from_hf(&f)?),
                // Every layer sparse, and the router always renormalizes the chosen experts'
                // probabilities (the config has no such switches).
                Architecture::Qwen35Moe => Some(MoeConfig {
                    norm_topk_prob: true,
                    decoder_sparse_step: 1,
                    mlp_only_layers: Vec::new(),
                    ..moe_from_hf(&f)?
                }),
                _ => None,
            },
            rotary_dim: (head_dim as f64 * partial_rotary) as usize,
            linear_attention: match architecture {
                Architecture::Qwen3Next | Architecture::Qwen35 | Architecture::Qwen35Moe => {
                    Some(linear_attention_from_hf(&f, num_layers)?)
                }
                _ => None,
            },
        };
        cfg.validate(source_name)?;
        Ok(cfg)
    }

    /// Read the config from GGUF metadata (`{arch}.*` keys).
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ConfigError> {
        let source_name = file.path().display().to_string();
        let missing = |field: &str| ConfigError::Missing {
            source_name: source_name.clone(),
            field: field.into(),
        };
        let arch_name = file
            .get_str("general.architecture")
            .ok_or_else(|| missing("general.architecture"))?;
        let architecture = Architecture::parse(arch_name).ok_or_else(|| ConfigError::UnsupportedArchitecture {
            source_name: source_name.clone(),
            name: arch_name.into(),
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let dim = |k: &str| gguf_dim(file, &key(k));
        let need = |k: &str| dim(k)?.ok_or_else(|| missing(&key(k)));
        let hidden_size = need("embedding_length")?;
        let num_heads = need("attention.head_count")?;
        // Qwen3.5 files may append multi-token-prediction blocks, which Baton does not run.
        let blocks = need("block_count")?;
        let nextn = gguf_nextn_layers(file);
        if nextn >= blocks {
            return Err(ConfigError::Invalid {
                source_name,
                field: key("nextn_predict_layers"),
                value: nextn.to_string(),
                expected: format!("fewer than block_count {blocks}"),
            });
        }
        let num_layers = blocks - nextn;
        let vocab_size = match file.tensors.get("token_embd.weight") {
            Some(t) if t.shape.len() == 2 => t.shape[0],
            _ => file
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .ok_or_else(|| missing("token_embd.weight (tensor) or tokenizer.ggml.tokens"))?,
        };
        let rope_scaling = match file.get_str(&key("rope.scaling.type")) {
            None | Some("none") => RopeScaling::Default,
            Some("linear") => RopeScaling::Linear {
                factor: file
                    .get_f64(&key("rope.scaling.factor"))
                    .ok_or_else(|| missing(&key("rope.scaling.factor")))?,
            },
            Some(other) => {
                return Err(ConfigError::UnsupportedRope {
                    source_name,
                    kind: other.into(),
                });
            }
        };
        if file.tensors.contains_key("rope_freqs.weight") {
            return Err(ConfigError::UnsupportedRope {
                source_name,
                kind: "per-frequency factors (rope_freqs.weight)".into(),
            });
        }
        let cfg = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            // A model whose every layer is sparse may leave out the dense width.
            intermediate_size: match architecture {
                Architecture::Qwen3Moe | Architecture::Qwen3Next | Architecture::Qwen35Moe => {
                    dim("feed_forward_length")?.or(dim("expert_feed_forward_length")?)
                }
                _ => None,
            }
            .map_or_else(|| need("feed_forward_length"), Ok)?,
            num_layers,
            num_heads,
            num_kv_heads: dim("attention.head_count_kv")?.unwrap_or(num_heads),
            head_dim: dim("attention.key_length")?.unwrap_or(hidden_size / num_heads),
            rms_norm_eps: file.get_f64(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6) as f32,
            rope_theta: file.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: dim("context_length")?.unwrap_or(2048),
            tie_word_embeddings: !file.tensors.contains_key("output.weight"),
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture.has_qk_norm(),
            moe: match architecture {
                Architecture::Qwen3Next | Architecture::Qwen35Moe => hybrid_moe_from_gguf(file, &key, num_layers)?,
                Architecture::Qwen3Moe => Some(MoeConfig {
                    num_experts: need("expert_count")?,
                    experts_per_token: need("expert_used_count")?,
                    expert_intermediate_size: need("expert_feed_forward_length")?,
                    // llama.cpp always renormalizes Qwen3-MoE's chosen experts; a file may say so.
                    norm_topk_prob: file
                        .get(&key("expert_weights_norm"))
                        .and_then(|v| v.as_bool())
                        .unwrap_or(true),
                    decoder_sparse_step: 1,
                    mlp_only_layers: Vec::new(),
                    shared_expert_intermediate_size: None,
                }),
                _ => None,
            },
            rotary_dim: 0,
            linear_attention: match architecture {
                Architecture::Qwen3Next | Architecture::Qwen35 | Architecture::Qwen35Moe => {
                    Some(linear_attention_from_gguf(file, &key, architecture, num_layers)?)
                }
                _ => None,
            },
        };
        let cfg = ModelConfig {
            rotary_dim: dim("rope.dimension_count")?.unwrap_or(cfg.head_dim),
            ..cfg
        };
        cfg.validate(&source_name)?;
        Ok(cfg)
    }

    fn validate(&self, source_name: &str) -> Result<(), ConfigError> {
        let bad = |message: String| {
            Err(ConfigError::Inconsistent {
                source_name: source_name.into(),
                message,
            })
        };
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even and positive (RoPE rotates pairs)",
                self.head_dim
            ));
        }
        if !self.architecture.has_qk_norm() && self.num_heads * self.head_dim != self.hidden_size {
            return bad(format!(
                "hidden_size {} is not num_attention_heads {} x head_dim {}",
                self.hidden_size, self.num_heads, self.head_dim
            ));
        }
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return bad(format!(
                "the rotated part of each head ({} values) must be even, positive and at most head_dim {}",
                self.rotary_dim, self.head_dim
            ));
        }
        if let Some(la) = &self.linear_attention {
            if !la.num_value_heads.is_multiple_of(la.num_key_heads) {
                return bad(format!(
                    "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                    la.num_value_heads, la.num_key_heads
                ));
            }
            if la.conv_kernel > 64 {
                return bad(format!("linear_conv_kernel_dim {} is more than 64", la.conv_kernel));
            }
            for (what, heads, dim) in [
                ("key", la.num_key_heads, la.key_head_dim),
                ("value", la.num_value_heads, la.value_head_dim),
            ] {
                if heads as u64 * dim as u64 > MAX_DIM as u64 {
                    return bad(format!(
                        "{heads} linear-attention {what} heads of {dim} are wider than {MAX_DIM}"
                    ));
                }
            }
            let state = la.num_value_heads as u64 * la.key_head_dim as u64 * la.value_head_dim as u64;
            if state > (1 << 28) {
                return bad(format!(
                    "a linear-attention layer's state of {state} values is too large"
                ));
            }
            if la.layer_types.len() != self.num_layers {
                return bad(format!(
                    "layer_types lists {} layers, but the model has {}",
                    la.layer_types.len(),
                    self.num_layers
                ));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!("rms_norm_eps {} must be positive", self.rms_norm_eps));
        }
        if let Some(m) = &self.moe {
            if m.num_experts > MAX_EXPERTS {
                return bad(format!(
                    "num_experts {} is more than {MAX_EXPERTS} (Qwen3-Next, among the largest, has 512)",
                    m.num_experts
                ));
            }
            if m.experts_per_token > m.num_experts {
                return bad(format!(
                    "num_experts_per_tok {} is more than num_experts {}",
                    m.experts_per_token, m.num_experts
                ));
            }
            if let Some(l) = m.mlp_only_layers.iter().find(|&&l| l >= self.num_layers) {
                return bad(format!(
                    "mlp_only_layers names layer {l}, but the model has {} layers",
                    self.num_layers
                ));
            }
        }
        Ok(())
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The config as a Hugging Face `config.json` value (used by `baton convert`).
    pub fn to_hf_json(&self, bos: Option<u32>, eos: Option<u32>) -> Value {
        let rope_scaling = match self.rope_scaling {
            RopeScaling::Default => Value::Null,
            other => serde_json::to_value(other).unwrap_or(Value::Null),
        };
        serde_json::json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "num_experts": self.moe.as_ref().map(|m| m.num_experts),
            "num_experts_per_tok": self.moe.as_ref().map(|m| m.experts_per_token),
            "moe_intermediate_size": self.moe.as_ref().map(|m| m.expert_intermediate_size),
            "norm_topk_prob": self.moe.as_ref().map(|m| m.norm_topk_prob),
            "decoder_sparse_step": self.moe.as_ref().map(|m| m.decoder_sparse_step),
            "mlp_only_layers": self.moe.as_ref().map(|m| &m.mlp_only_layers),
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    }

    #[test]
    fn a_multimodal_qwen3_5_config_serves_its_text_model() {
        let text = json!({"model_type": "qwen3_5_moe_text", "vocab_size": 100, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
            "num_experts": 12, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48});
        let wrapper = json!({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": true});
        let c = ModelConfig::from_hf_value("t", &wrapper).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen35Moe);
        assert!(
            c.tie_word_embeddings,
            "the wrapper's tie where the text config does not say"
        );
        let m = c.moe.as_ref().unwrap();
        assert!(m.norm_topk_prob && m.is_sparse(0) && m.is_sparse(1));
        assert_eq!((m.num_experts, c.intermediate_size), (12, 32));
        // The text config's own tie wins; a wrapper of another family is not unwrapped.
        let mut own = wrapper.clone();
        own["text_config"]["tie_word_embeddings"] = json!(false);
        assert!(!ModelConfig::from_hf_value("t", &own).unwrap().tie_word_embeddings);
        let mut other = wrapper;
        other["model_type"] = json!("qwen3_vl_moe");
        let e = ModelConfig::from_hf_value("t", &other).unwrap_err().to_string();
        assert!(e.contains("qwen3_vl_moe"), "{e}");
    }

    #[test]
    fn a_partial_rotation_is_read_from_rope_parameters_or_the_top_level_and_bounded() {
        let mut v = base();
        assert_eq!(
            ModelConfig::from_hf_value("t", &v).unwrap().rotary_dim,
            16,
            "the whole head"
        );
        v["partial_rotary_factor"] = json!(0.5);
        assert_eq!(ModelConfig::from_hf_value("t", &v).unwrap().rotary_dim, 8);
        v["rope_parameters"] = json!({"rope_theta": 1e4, "partial_rotary_factor": 0.25});
        assert_eq!(
            ModelConfig::from_hf_value("t", &v).unwrap().rotary_dim,
            4,
            "rope_parameters first"
        );
        v["rope_parameters"] = json!({"rope_theta": 1e4, "partial_rotary_factor": 1.5});
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("partial_rotary_factor"), "{e}");
        v["rope_parameters"] = json!({"rope_theta": 1e4, "partial_rotary_factor": 0.1});
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("must be even, positive"), "{e}");
    }

    #[test]
    fn linear_attention_heads_too_wide_are_refused_by_name() {
        let v = json!({"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 0,
            "linear_num_key_heads": 4096, "linear_num_value_heads": 4096, "linear_key_head_dim": 8192,
            "linear_value_head_dim": 8});
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("linear-attention key heads"), "{e}");
    }

    #[test]
    fn parses_defaults() {
        let c = ModelConfig::from_hf_value("t", &base()).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_scaling, RopeScaling::Default);
        assert!(!c.qkv_bias && !c.qk_norm);
    }

    #[test]
    fn rejects_heads_not_dividing() {
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("not a multiple of num_key_value_heads 3"), "{e}");
        let mut v = base();
        v["num_attention_heads"] = json!(5);
        v["num_key_value_heads"] = json!(5);
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("head_dim"), "{e}");
    }

    #[test]
    fn rejects_unknown_arch_and_rope() {
        let mut v = base();
        v["model_type"] = json!("gpt2");
        assert!(matches!(
            ModelConfig::from_hf_value("t", &v),
            Err(ConfigError::UnsupportedArchitecture { .. })
        ));
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("unsupported rope scaling type 'yarn'"), "{e}");
    }

    #[test]
    fn rejects_wrong_types() {
        let mut v = base();
        v["hidden_size"] = json!("64");
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("'hidden_size'"), "{e}");
        let mut v = base();
        v.as_object_mut().unwrap().remove("vocab_size");
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("missing field 'vocab_size'"), "{e}");
    }

    fn moe() -> Value {
        json!({"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "num_experts": 10, "num_experts_per_tok": 3, "moe_intermediate_size": 32})
    }

    #[test]
    fn reads_mixture_of_experts_settings_with_transformers_defaults() {
        let c = ModelConfig::from_hf_value("t", &moe()).unwrap();
        let m = c.moe.clone().unwrap();
        assert_eq!(
            (m.num_experts, m.experts_per_token, m.expert_intermediate_size),
            (10, 3, 32)
        );
        assert!(!m.norm_topk_prob && m.decoder_sparse_step == 1 && m.mlp_only_layers.is_empty());
        assert!(c.qk_norm && (0..4).all(|l| m.is_sparse(l)));
        // transformers 5 writes `num_local_experts`; a sparse step and dense layers.
        let mut v = moe();
        v.as_object_mut().unwrap().remove("num_experts");
        v["num_local_experts"] = json!(12);
        v["decoder_sparse_step"] = json!(2);
        v["mlp_only_layers"] = json!([3]);
        let m = ModelConfig::from_hf_value("t", &v).unwrap().moe.unwrap();
        assert_eq!(m.num_experts, 12);
        let sparse: Vec<usize> = (0..4).filter(|&l| m.is_sparse(l)).collect();
        assert_eq!(sparse, [1], "layer 3 is listed dense, 0 and 2 fall between steps");
        assert!(ModelConfig::from_hf_value("t", &base()).unwrap().moe.is_none());
    }

    #[test]
    fn a_mixture_of_experts_config_survives_the_convert_round_trip() {
        let mut v = moe();
        v["mlp_only_layers"] = json!([0, 2]);
        v["norm_topk_prob"] = json!(true);
        let c = ModelConfig::from_hf_value("t", &v).unwrap();
        let back = ModelConfig::from_hf_value("converted", &c.to_hf_json(Some(1), Some(2))).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn rejects_inconsistent_mixture_of_experts_settings() {
        let mut v = moe();
        v.as_object_mut().unwrap().remove("num_experts");
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("missing field 'num_experts'"), "{e}");
        let mut v = moe();
        v["num_experts_per_tok"] = json!(11);
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok 11 is more than num_experts 10"), "{e}");
        let mut v = moe();
        v["mlp_only_layers"] = json!([4]);
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("mlp_only_layers names layer 4"), "{e}");
        let mut v = moe();
        v["mlp_only_layers"] = json!("all");
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("'mlp_only_layers'"), "{e}");
        let mut v = moe();
        v["num_experts"] = json!(1 << 20);
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("num_experts 1048576 is more than 4096"), "{e}");
    }

    #[test]
    fn reads_nested_rope_parameters() {
        let mut v = base();
        v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let c = ModelConfig::from_hf_value("t", &v).unwrap();
        assert_eq!(c.rope_theta, 5e5);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }

    use crate::gguf::GgufValue;

    /// A qwen35 GGUF file's config from `extra` metadata on top of a small valid set.
    fn qwen35_gguf(extra: &[(&str, GgufValue)]) -> Result<ModelConfig, ConfigError> {
        use crate::gguf::writer::{TensorToWrite, to_bytes};
        use GgufValue::{String as S, U32};
        let mut meta: Vec<(String, GgufValue)> = vec![("general.architecture".into(), S("qwen35".into()))];
        let sizes = [
            ("block_count", 4),
            ("embedding_length", 64),
            ("feed_forward_length", 96),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("attention.key_length", 16),
            ("rope.dimension_count", 4),
            ("ssm.conv_kernel", 4),
            ("ssm.state_size", 8),
            ("ssm.group_count", 2),
            ("ssm.time_step_rank", 4),
            ("ssm.inner_size", 48),
        ];
        meta.extend(sizes.iter().map(|(k, v)| (format!("qwen35.{k}"), U32(*v))));
        meta.extend(extra.iter().map(|(k, v)| (format!("qwen35.{k}"), v.clone())));
        let tensors = [TensorToWrite {
            name: "token_embd.weight".into(),
            shape: vec![100, 64],
            ggml_type: 0,
            data: vec![0; 64 * 100 * 4],
        }];
        let path = std::env::temp_dir().join(format!("baton-qwen35-cfg-{}-{}.gguf", std::process::id(), extra.len()));
        std::fs::write(&path, to_bytes(&meta, &tensors)).unwrap();
        let file = GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        ModelConfig::from_gguf(&file)
    }

    #[test]
    fn hybrid_gguf_metadata_gives_layer_types_heads_and_skips_prediction_blocks() {
        use GgufValue::{Array, Bool, U32};
        use LayerType::{FullAttention as F, LinearAttention as L};
        let c = qwen35_gguf(&[]).unwrap();
        let la = c.linear_attention.unwrap();
        assert_eq!(la.layer_types, [L, L, L, F], "every fourth layer full by default");
        assert_eq!(
            (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim),
            (2, 4, 8, 12)
        );
        assert_eq!((c.rotary_dim, c.num_layers, c.vocab_size), (4, 4, 100));
        let layout = la.gguf_layout.unwrap();
        assert!(layout.value_heads_tiled && !layout.fused_qkvz);
        let every = qwen35_gguf(&[("full_attention_interval", U32(2))]).unwrap();
        assert_eq!(every.linear_attention.unwrap().layer_types, [L, F, L, F]);
        // A flag per block, the last block a multi-token-prediction one.
        let flags = Array([true, false, false, false].map(Bool).to_vec());
        let c = qwen35_gguf(&[("attention.recurrent_layers", flags), ("nextn_predict_layers", U32(1))]).unwrap();
        assert_eq!(
            (c.num_layers, c.linear_attention.unwrap().layer_types),
            (3, vec![L, F, F])
        );

        let e = qwen35_gguf(&[("attention.recurrent_layers", Array(vec![Bool(true)]))])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("qwen35.attention.recurrent_layers") && e.contains("at least 4 flags"),
            "{e}"
        );
        let e = qwen35_gguf(&[("ssm.inner_size", U32(50))]).unwrap_err().to_string();
        assert!(
            e.contains("qwen35.ssm.inner_size") && e.contains("multiple of ssm.time_step_rank"),
            "{e}"
        );
        let e = qwen35_gguf(&[("nextn_predict_layers", U32(4))])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("nextn_predict_layers") && e.contains("fewer than block_count 4"),
            "{e}"
        );
        let e = qwen35_gguf(&[("ssm.group_count", U32(0))]).unwrap_err().to_string();
        assert!(e.contains("qwen35.ssm.group_count") && e.contains("positive"), "{e}");
    }
}
