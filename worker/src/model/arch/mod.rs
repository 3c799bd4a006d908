//! Architecture modules: each says, for one model family, what its tensors are called in both
//! file formats, what shape each has, and which blocks each layer is built from. They are
//! declarative; the compute lives in [`crate::model::blocks`], written once against
//! [`crate::ops::Ops`], so a module for a new family is names and shapes, plus a block where
//! the family computes something new.
//!
//! [`crate::model::registry`] maps a Hugging Face `architectures` entry or a GGUF
//! `general.architecture` to its module.

mod llama;
mod llama_family;
mod qwen2;
mod qwen3;
mod qwen3_5;
mod qwen3_moe;
mod qwen3_next;

pub use llama::Llama;
pub use qwen2::Qwen2;
pub use qwen3::Qwen3;
pub use qwen3_5::{Qwen35, Qwen35Moe};
pub use qwen3_moe::Qwen3Moe;
pub use qwen3_next::Qwen3Next;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::TensorSpec;

use super::spec::{CacheSpec, FfnKind, LayerKind, LayerSpec};
use crate::ops::LinearAttnShape;

/// A model family.
pub trait Architecture: Sync + std::fmt::Debug {
    /// The name Baton reports (`llama`, `qwen2`, …).
    fn name(&self) -> &'static str;
    /// Hugging Face class names in `config.json`'s `architectures`, and `model_type` values.
    fn hf_names(&self) -> &'static [&'static str];
    /// GGUF `general.architecture` values.
    fn gguf_names(&self) -> &'static [&'static str];
    /// The tensors and blocks of decoder layer `l`.
    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan;
    /// The embedding, final norm and head.
    fn outer(&self, c: &ModelConfig) -> OuterPlan;
}

/// How an RMSNorm applies its learned vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormScale {
    /// `x / rms(x) · w` (Llama).
    #[default]
    Weight,
    /// `x / rms(x) · (1 + w)`: the vector is stored as an offset from one (Qwen3-Next,
    /// Gemma); applied once at load.
    OnePlusWeight,
}

/// The tensors of a (grouped-query, rotary) self-attention block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionTensors {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (fewer than `heads` under grouped-query attention).
    pub kv_heads: usize,
    pub head_dim: usize,
    pub q: TensorSpec,
    pub k: TensorSpec,
    pub v: TensorSpec,
    pub o: TensorSpec,
    /// q/k/v biases (Qwen2).
    pub qkv_bias: Option<[TensorSpec; 3]>,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: Option<[TensorSpec; 2]>,
    /// Values of each head RoPE rotates (the first ones): `head_dim` unless partial.
    pub rotary_dim: usize,
    /// `q` also yields a gate per query value (each head's `head_dim` queries, then its
    /// `head_dim` gates): the attention output is scaled by `sigmoid(gate)` (Qwen3-Next).
    pub output_gate: bool,
}

/// How a Gated DeltaNet block projects its input.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)]
pub enum LinearProjections {
    /// Qwen3-Next: `in_qkvz` `[2·keys + 2·values, hidden]` (per key head its q, k, then its
    /// value heads' v and z) and `in_ba` `[2·value_heads, hidden]` (per key head its value
    /// heads' b, then their a).
    Fused { qkvz: TensorSpec, ba: TensorSpec },
    /// Qwen3.5: `in_proj_qkv` `[2·keys + values, hidden]` (every q, every k, every v: the
    /// conv's channel order), `in_proj_z` `[values, hidden]`, `in_proj_b` and `in_proj_a`
    /// `[value_heads, hidden]`.
    Split {
        qkv: TensorSpec,
        z: TensorSpec,
        b: TensorSpec,
        a: TensorSpec,
    },
}

impl LinearProjections {
    /// The projection matrices, in order.
    pub fn matrices(&self) -> Vec<&TensorSpec> {
        match self {
            LinearProjections::Fused { qkvz, ba } => vec![qkvz, ba],
            LinearProjections::Split { qkv, z, b, a } => vec![qkv, z, b, a],
        }
    }
}

/// The tensors of a Gated DeltaNet block (Qwen3-Next's and Qwen3.5's linear attention).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearAttentionTensors {
    /// Heads, their widths and the conv's taps (what the state's size follows from).
    pub shape: LinearAttnShape,
    /// The input projections.
    pub projections: LinearProjections,
    /// `[conv channels, 1, kernel]`: the depthwise causal conv over q, k and v.
    pub conv: TensorSpec,
    /// `[value_heads]`: added to `a` before the softplus of the decay gate.
    pub dt_bias: TensorSpec,
    /// `[value_heads]`: the decay rate is `-exp(A_log)`.
    pub a_log: TensorSpec,
    /// `[value_head_dim]`: the gated RMSNorm of each head's output.
    pub norm: TensorSpec,
    /// `[hidden, values]`.
    pub out: TensorSpec,
}

/// The tensors of a gated (SwiGLU) MLP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpTensors {
    pub gate: TensorSpec,
    pub up: TensorSpec,
    pub down: TensorSpec,
}

/// The tensors of a mixture-of-experts feed-forward part: a router choosing `top_k` of the
/// gated-MLP experts for each position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeTensors {
    /// `[experts, hidden]`: one logit per expert.
    pub router: TensorSpec,
    pub experts: Vec<MlpTensors>,
    /// Experts each position is sent to.
    pub top_k: usize,
    /// Renormalize the chosen experts' probabilities to sum to one.
    pub normalize: bool,
    /// An expert every position runs, scaled by `sigmoid(gate · x)` (Qwen3-Next).
    pub shared: Option<SharedExpertTensors>,
}

/// The shared expert of a mixture and its gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedExpertTensors {
    pub mlp: MlpTensors,
    /// `[1, hidden]`.
    pub gate: TensorSpec,
}

/// What mixes information across positions in a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
// Plans are built a few times per layer at load, never per token: boxing saves nothing.
#[allow(clippy::large_enum_variant)]
pub enum MixerTensors {
    /// Full causal self-attention over a K/V cache.
    Attention(AttentionTensors),
    /// Gated DeltaNet over a per-sequence recurrent state.
    LinearAttention(LinearAttentionTensors),
}

/// The per-position feed-forward part of a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)]
pub enum FfnTensors {
    /// One dense gated MLP.
    Dense(MlpTensors),
    /// A routed mixture of gated-MLP experts.
    Moe(MoeTensors),
}

/// One pre-norm decoder layer: `x += mixer(norm(x)); x += ffn(norm(x))`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlan {
    pub mixer_norm: TensorSpec,
    pub mixer: MixerTensors,
    pub ffn_norm: TensorSpec,
    pub ffn: FfnTensors,
    /// How the layer's RMSNorms (and q/k norms) apply their vectors.
    pub norm_scale: NormScale,
}

/// The parts outside the layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OuterPlan {
    pub embedding: TensorSpec,
    pub final_norm: TensorSpec,
    /// The head; `None` when tied to the embedding.
    pub head: Option<TensorSpec>,
    /// A head tensor a tied checkpoint may still carry (identical, ignored).
    pub tolerated_head: TensorSpec,
    /// How the final norm applies its vector.
    pub norm_scale: NormScale,
}

impl LayerPlan {
    /// Every tensor of the layer.
    pub fn tensors(&self) -> Vec<&TensorSpec> {
        let mut out = self.matrices();
        out.extend([&self.mixer_norm, &self.ffn_norm]);
        if let FfnTensors::Moe(m) = &self.ffn {
            out.push(&m.router);
            out.extend(m.shared.iter().map(|s| &s.gate));
        }
        match &self.mixer {
            MixerTensors::Attention(a) => {
                out.extend(a.qkv_bias.iter().flatten());
                out.extend(a.qk_norm.iter().flatten());
            }
            MixerTensors::LinearAttention(a) => out.extend([&a.conv, &a.dt_bias, &a.a_log, &a.norm]),
        }
        out
    }

    /// The matrices a decode step streams (what the weight format applies to).
    pub fn matrices(&self) -> Vec<&TensorSpec> {
        let mut out = Vec::new();
        match &self.mixer {
            MixerTensors::Attention(a) => out.extend([&a.q, &a.k, &a.v, &a.o]),
            MixerTensors::LinearAttention(a) => {
                out.extend(a.projections.matrices());
                out.push(&a.out);
            }
        }
        match &self.ffn {
            FfnTensors::Dense(m) => out.extend([&m.gate, &m.up, &m.down]),
            FfnTensors::Moe(moe) => {
                out.extend(moe.experts.iter().flat_map(|m| [&m.gate, &m.up, &m.down]));
                out.extend(moe.shared.iter().flat_map(|s| [&s.mlp.gate, &s.mlp.up, &s.mlp.down]));
            }
        }
        out
    }

    /// What the layer is, what it keeps per sequence, and how many weights it has.
    pub fn spec(&self) -> LayerSpec {
        let (kind, cache) = match &self.mixer {
            MixerTensors::Attention(a) => (
                LayerKind::Attention,
                CacheSpec::Attention {
                    kv_heads: a.kv_heads,
                    head_dim: a.head_dim,
                },
            ),
            MixerTensors::LinearAttention(a) => (
                LayerKind::LinearAttention,
                CacheSpec::Recurrent {
                    values: a.shape.state_values(),
                },
            ),
        };
        let params = |t: &TensorSpec| t.shape.iter().product::<usize>();
        let weight_params: usize = self.tensors().into_iter().map(params).sum();
        // One position reads only its chosen experts.
        let (ffn, idle_experts) = match &self.ffn {
            FfnTensors::Dense(_) => (FfnKind::Dense, 0),
            FfnTensors::Moe(m) => {
                let expert: usize = m
                    .experts
                    .first()
                    .map_or(0, |e| params(&e.gate) + params(&e.up) + params(&e.down));
                let kind = FfnKind::Moe {
                    experts: m.experts.len(),
                    active: m.top_k,
                };
                (kind, expert * (m.experts.len() - m.top_k.min(m.experts.len())))
            }
        };
        LayerSpec {
            kind,
            ffn,
            cache,
            weight_params,
            active_params: weight_params - idle_experts,
        }
    }
}

/// Every tensor a stage holding `layers` (with the embedding when `first`, the head when
/// `last`) needs from the files.
pub fn stage_tensors(
    arch: &dyn Architecture,
    c: &ModelConfig,
    layers: std::ops::Range<usize>,
    first: bool,
    last: bool,
) -> Vec<TensorSpec> {
    let outer = arch.outer(c);
    let mut out = Vec::new();
    if first || (last && outer.head.is_none()) {
        out.push(outer.embedding.clone());
    }
    for l in layers {
        out.extend(arch.layer(c, l).tensors().into_iter().cloned());
    }
    if last {
        out.push(outer.final_norm);
        out.extend(outer.head);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::registry;
    use baton_shared::model_files::StackedSlice;
    use serde_json::json;

    fn config(model_type: &str, tied: bool) -> ModelConfig {
        let v = json!({"model_type": model_type, "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "tie_word_embeddings": tied});
        ModelConfig::from_hf_value("t", &v).unwrap()
    }

    fn names(specs: &[TensorSpec]) -> Vec<&str> {
        specs.iter().map(|s| s.hf.as_str()).collect()
    }

    #[test]
    fn each_family_member_names_its_own_tensors() {
        let c = config("llama", true);
        let llama = registry::for_config(&c);
        let l1 = llama.layer(&c, 1);
        assert_eq!(l1.tensors().len(), 9);
        let MixerTensors::Attention(a) = &l1.mixer else {
            panic!("attention")
        };
        assert_eq!(a.q.hf, "model.layers.1.self_attn.q_proj.weight");
        assert_eq!(a.q.gguf, "blk.1.attn_q.weight");
        assert_eq!((a.q.gguf_heads_permuted, a.k.gguf_heads_permuted), (Some(4), Some(2)));
        assert_eq!(a.v.gguf_heads_permuted, None);
        assert_eq!(a.o.shape, vec![64, 64]);

        let c2 = config("qwen2", true);
        let MixerTensors::Attention(a) = registry::for_config(&c2).layer(&c2, 0).mixer else {
            panic!("attention")
        };
        let bias = a.qkv_bias.expect("qwen2 has q/k/v biases");
        assert_eq!(bias[1].gguf, "blk.0.attn_k.bias");
        assert_eq!(bias[1].shape, vec![32]);
        assert_eq!(a.q.gguf_heads_permuted, None, "only llama's GGUF converter permutes");

        let c3 = config("qwen3", true);
        let MixerTensors::Attention(a) = registry::for_config(&c3).layer(&c3, 2).mixer else {
            panic!("attention")
        };
        let norms = a.qk_norm.expect("qwen3 has q/k norms");
        assert_eq!(norms[0].hf, "model.layers.2.self_attn.q_norm.weight");
        assert_eq!(norms[0].shape, vec![16]);
    }

    #[test]
    fn a_mixture_of_experts_layer_names_its_router_and_every_expert() {
        let v = json!({"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_experts": 10, "num_experts_per_tok": 3,
            "moe_intermediate_size": 24, "mlp_only_layers": [1]});
        let c = ModelConfig::from_hf_value("t", &v).unwrap();
        let arch = registry::for_config(&c);
        assert_eq!(arch.name(), "qwen3_moe");
        let sparse = arch.layer(&c, 2);
        let FfnTensors::Moe(m) = &sparse.ffn else {
            panic!("layer 2 is sparse")
        };
        assert_eq!((m.experts.len(), m.top_k, m.normalize), (10, 3, false));
        assert_eq!(m.router.hf, "model.layers.2.mlp.gate.weight");
        assert_eq!(m.router.gguf, "blk.2.ffn_gate_inp.weight");
        let e7 = &m.experts[7];
        assert_eq!(e7.down.hf, "model.layers.2.mlp.experts.7.down_proj.weight");
        assert_eq!(e7.down.gguf, "blk.2.ffn_down_exps.weight");
        assert_eq!(e7.down.shape, vec![64, 24]);
        assert_eq!(e7.down.gguf_packing.stacked, Some(StackedSlice { index: 7, count: 10 }));
        // Files with the fused layout keep expert 7's up rows 24..48 of its gate_up slice.
        let up = e7.up.otherwise.as_deref().unwrap();
        assert_eq!(up.hf, "model.layers.2.mlp.experts.gate_up_proj");
        assert_eq!(up.gguf, "blk.2.ffn_gate_up_exps.weight");
        assert_eq!(up.hf_packing, up.gguf_packing);
        assert_eq!(up.gguf_packing.stacked, Some(StackedSlice { index: 7, count: 10 }));
        assert_eq!(
            up.gguf_packing.rows.map(|r| (r.groups, r.group_rows, r.start, r.take)),
            Some((1, 48, 24, 24))
        );
        assert!(
            matches!(arch.layer(&c, 1).ffn, FfnTensors::Dense(_)),
            "layer 1 is listed dense"
        );
        // 4 attention matrices, 30 expert matrices; norms, q/k norms and the router.
        assert_eq!(sparse.matrices().len(), 4 + 30);
        assert_eq!(sparse.tensors().len(), 4 + 30 + 2 + 2 + 1);
        // A position reads 3 of the 10 experts.
        let spec = sparse.spec();
        assert_eq!(spec.ffn, FfnKind::Moe { experts: 10, active: 3 });
        assert_eq!(arch.layer(&c, 1).spec().ffn, FfnKind::Dense);
        let expert = 3 * 24 * 64;
        assert_eq!(spec.weight_params - spec.active_params, 7 * expert);
    }

    #[test]
    fn a_stage_reads_its_layers_and_only_the_outer_parts_it_holds() {
        let tied = config("llama", true);
        let arch = registry::for_config(&tied);
        let middle = stage_tensors(arch, &tied, 1..2, false, false);
        assert_eq!(middle.len(), 9);
        assert!(names(&middle).iter().all(|n| n.starts_with("model.layers.1.")));
        // A tied last stage reads the embedding for its head; an untied one reads lm_head.
        let last = stage_tensors(arch, &tied, 2..3, false, true);
        assert!(names(&last).contains(&"model.embed_tokens.weight"));
        assert!(!names(&last).contains(&"lm_head.weight"));
        let untied = config("llama", false);
        let last = stage_tensors(arch, &untied, 2..3, false, true);
        assert!(names(&last).contains(&"lm_head.weight") && !names(&last).contains(&"model.embed_tokens.weight"));
        assert_eq!(stage_tensors(arch, &untied, 0..3, true, true).len(), 3 * 9 + 3);
    }

    #[test]
    fn a_layer_declares_its_cache_and_weights() {
        let c = config("qwen2", true);
        let spec = registry::for_config(&c).layer(&c, 0).spec();
        assert_eq!(spec.kind, LayerKind::Attention);
        assert_eq!(
            spec.cache,
            CacheSpec::Attention {
                kv_heads: 2,
                head_dim: 16
            }
        );
        let (h, kv, f) = (64, 32, 128);
        let matrices = h * h + 2 * kv * h + h * h + 3 * f * h;
        assert_eq!(spec.weight_params, matrices + 2 * h + h + 2 * kv);
    }
}
