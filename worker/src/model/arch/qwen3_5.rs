//! Qwen3.5 (the text model): Qwen3-Next's hybrid of Gated DeltaNet and gated full attention
//! with a dense MLP, and its linear-attention input split into four projections
//! (`in_proj_qkv` already in the conv's channel order, `in_proj_z`, `in_proj_b`, `in_proj_a`)
//! instead of Qwen3-Next's two per-key-head interleaved ones. Its rotary embedding is
//! multimodal (MRoPE) in the full model; for text every section takes the token's position,
//! which is plain (partial) RoPE.

use baton_shared::model_config::ModelConfig;

use super::llama_family::{self, t};
use super::qwen3_next::hybrid_layer;
use super::{Architecture, LayerPlan, LinearProjections, MixerTensors, NormScale, OuterPlan};

/// `Qwen3_5ForCausalLM` / `qwen3_5_text`.
#[derive(Debug)]
pub struct Qwen35;

impl Architecture for Qwen35 {
    fn name(&self) -> &'static str {
        "qwen3_5_text"
    }

    fn hf_names(&self) -> &'static [&'static str] {
        &["Qwen3_5ForCausalLM", "qwen3_5_text"]
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen35"]
    }

    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan {
        let mut plan = hybrid_layer(c, l);
        if let MixerTensors::LinearAttention(la) = &mut plan.mixer {
            let (h, nv) = (c.hidden_size, la.shape.value_heads);
            let (keys, values) = (la.shape.keys(), la.shape.values());
            la.projections = LinearProjections::Split {
                qkv: t(
                    l,
                    "linear_attn.in_proj_qkv.weight",
                    "attn_qkv.weight",
                    vec![2 * keys + values, h],
                ),
                z: t(l, "linear_attn.in_proj_z.weight", "attn_gate.weight", vec![values, h]),
                b: t(l, "linear_attn.in_proj_b.weight", "ssm_beta.weight", vec![nv, h]),
                a: t(l, "linear_attn.in_proj_a.weight", "ssm_alpha.weight", vec![nv, h]),
            };
        }
        plan
    }

    fn outer(&self, c: &ModelConfig) -> OuterPlan {
        OuterPlan {
            norm_scale: NormScale::OnePlusWeight,
            ..llama_family::outer(c)
        }
    }
}

/// `Qwen3_5MoeForCausalLM` / `qwen3_5_moe_text`: Qwen3.5's layers with a sparse MoE and its
/// sigmoid-gated shared expert in every layer (the config parser makes every layer sparse).
#[derive(Debug)]
pub struct Qwen35Moe;

impl Architecture for Qwen35Moe {
    fn name(&self) -> &'static str {
        "qwen3_5_moe_text"
    }

    fn hf_names(&self) -> &'static [&'static str] {
        &["Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"]
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen35moe"]
    }

    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan {
        Qwen35.layer(c, l)
    }

    fn outer(&self, c: &ModelConfig) -> OuterPlan {
        Qwen35.outer(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::registry;
    use serde_json::json;

    #[test]
    fn linear_layers_read_four_split_projections_and_the_rest_is_qwen3_next() {
        let v = json!({"model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 12});
        let c = ModelConfig::from_hf_value("t", &v).unwrap();
        assert!(c.moe.is_none(), "the dense text model");
        let arch = registry::for_config(&c);
        assert_eq!(arch.name(), "qwen3_5_text");
        let MixerTensors::LinearAttention(la) = arch.layer(&c, 0).mixer else {
            panic!("layer 0 is linear attention")
        };
        let LinearProjections::Split { qkv, z, b, a } = &la.projections else {
            panic!("Qwen3.5 splits its projections")
        };
        assert_eq!(qkv.hf, "model.layers.0.linear_attn.in_proj_qkv.weight");
        assert_eq!(
            (qkv.shape[0], z.shape[0], b.shape[0], a.shape[0]),
            (16 + 16 + 48, 48, 4, 4)
        );
        let MixerTensors::Attention(attn) = arch.layer(&c, 1).mixer else {
            panic!("layer 1 is full attention")
        };
        assert!(attn.output_gate);
        assert_eq!(arch.layer(&c, 1).norm_scale, NormScale::OnePlusWeight);
    }
}
