//! Qwen3-Next: a hybrid of Gated DeltaNet layers (`linear_attn.*`, a recurrent state per
//! sequence) and gated full-attention layers (`self_attn.*`, Qwen3's attention whose `q_proj`
//! also yields an output gate, rotating only part of each head), as `layer_types` says; a
//! sparse mixture of experts with a sigmoid-gated shared expert (`mlp.shared_expert*`) in the
//! sparse layers; and RMSNorms that scale by `1 + weight`.
//!
//! GGUF files (llama.cpp's converter) hold the same model with the norms' one added, `A`
//! instead of `A_log`, the conv's unit dimension dropped and, in newer files, the fused
//! projections split (`attn_qkv`, `attn_gate`); the blocks and specs below read both.

use baton_shared::model_config::{LayerType, LinearAttentionConfig, ModelConfig};
use baton_shared::model_files::TensorSpec;

use super::llama_family::{self, Variant, t};
use super::qwen3_moe;
use super::{
    Architecture, FfnTensors, LayerPlan, LinearAttentionTensors, LinearProjections, MixerTensors, MlpTensors,
    NormScale, OuterPlan, SharedExpertTensors,
};
use crate::ops::LinearAttnShape;

/// `Qwen3NextForCausalLM`.
#[derive(Debug)]
pub struct Qwen3Next;

impl Architecture for Qwen3Next {
    fn name(&self) -> &'static str {
        "qwen3_next"
    }

    fn hf_names(&self) -> &'static [&'static str] {
        &["Qwen3NextForCausalLM", "qwen3_next"]
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen3next"]
    }

    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan {
        hybrid_layer(c, l)
    }

    fn outer(&self, c: &ModelConfig) -> OuterPlan {
        OuterPlan {
            norm_scale: NormScale::OnePlusWeight,
            ..llama_family::outer(c)
        }
    }
}

/// Layer `l` of a Qwen3-Next-style hybrid: linear or gated full attention as `layer_types`
/// says, `(1 + w)` norms, the sparse layers' experts with their shared expert.
pub fn hybrid_layer(c: &ModelConfig, l: usize) -> LayerPlan {
    let variant = Variant {
        qkv_bias: c.qkv_bias,
        qk_norm: true,
        gguf_permutes_qk: false,
    };
    let mut plan = llama_family::layer(c, l, variant);
    plan.norm_scale = NormScale::OnePlusWeight;
    // llama.cpp names the hybrids' second norm for what follows attention, not for the MLP.
    plan.ffn_norm.gguf = format!("blk.{l}.post_attention_norm.weight");
    match c.linear_attention.as_ref() {
        Some(la) if la.layer_types.get(l) == Some(&LayerType::LinearAttention) => {
            plan.mixer = MixerTensors::LinearAttention(linear_attention(c.hidden_size, l, la));
        }
        _ => {
            if let MixerTensors::Attention(a) = &mut plan.mixer {
                // Each head's queries, then its gates.
                a.q.shape[0] *= 2;
                a.output_gate = true;
            }
        }
    }
    if let Some(moe) = c.moe.as_ref().filter(|m| m.is_sparse(l)) {
        let mut experts = qwen3_moe::experts(c.hidden_size, l, moe);
        experts.shared = moe
            .shared_expert_intermediate_size
            .map(|f| shared_expert(c.hidden_size, f, l));
        plan.ffn = FfnTensors::Moe(experts);
    }
    plan
}

/// The Gated DeltaNet tensors of layer `l`, with Qwen3-Next's fused projections (or, from a
/// GGUF file that splits them, llama.cpp's `attn_qkv`, `attn_gate` and the `b`/`a` rows of its
/// per-key-head `ssm_ba`).
fn linear_attention(h: usize, l: usize, la: &LinearAttentionConfig) -> LinearAttentionTensors {
    let shape = LinearAttnShape {
        key_heads: la.num_key_heads,
        value_heads: la.num_value_heads,
        key_head_dim: la.key_head_dim,
        value_head_dim: la.value_head_dim,
        conv_kernel: la.conv_kernel,
        value_heads_tiled: la.gguf_layout.is_some_and(|g| g.value_heads_tiled),
    };
    let (nk, nv, dv, keys, values) = (
        shape.key_heads,
        shape.value_heads,
        shape.value_head_dim,
        shape.keys(),
        shape.values(),
    );
    // A GGUF file's `ssm_ba` keeps, per key head, its value heads' b and then their a.
    let ba = |start: usize| {
        t(l, "linear_attn.in_proj_ba.weight", "ssm_ba.weight", vec![nv, h]).rows_in_gguf(nk, 2 * nv / nk, start)
    };
    let projections = match la.gguf_layout {
        Some(g) if !g.fused_qkvz => LinearProjections::Split {
            qkv: t(
                l,
                "linear_attn.in_proj_qkvz.weight",
                "attn_qkv.weight",
                vec![2 * keys + values, h],
            ),
            z: t(
                l,
                "linear_attn.in_proj_qkvz.weight",
                "attn_gate.weight",
                vec![values, h],
            ),
            b: ba(0),
            a: ba(nv / nk),
        },
        _ => LinearProjections::Fused {
            qkvz: t(
                l,
                "linear_attn.in_proj_qkvz.weight",
                "ssm_in.weight",
                vec![2 * keys + 2 * values, h],
            ),
            ba: t(l, "linear_attn.in_proj_ba.weight", "ssm_ba.weight", vec![2 * nv, h]),
        },
    };
    LinearAttentionTensors {
        shape,
        projections,
        conv: t(
            l,
            "linear_attn.conv1d.weight",
            "ssm_conv1d.weight",
            vec![shape.channels(), 1, shape.conv_kernel],
        )
        .shaped_in_gguf(vec![shape.channels(), shape.conv_kernel]),
        dt_bias: t(l, "linear_attn.dt_bias", "ssm_dt.bias", vec![nv]),
        // GGUF stores the decay rate `-exp(A_log)` itself.
        a_log: t(l, "linear_attn.A_log", "ssm_a", vec![nv]),
        norm: t(l, "linear_attn.norm.weight", "ssm_norm.weight", vec![dv]),
        out: t(l, "linear_attn.out_proj.weight", "ssm_out.weight", vec![h, values]),
    }
}

/// The shared expert (width `f`) of sparse layer `l`, and its gate.
fn shared_expert(h: usize, f: usize, l: usize) -> SharedExpertTensors {
    SharedExpertTensors {
        mlp: MlpTensors {
            gate: t(
                l,
                "mlp.shared_expert.gate_proj.weight",
                "ffn_gate_shexp.weight",
                vec![f, h],
            ),
            up: t(l, "mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight", vec![f, h]),
            down: t(
                l,
                "mlp.shared_expert.down_proj.weight",
                "ffn_down_shexp.weight",
                vec![h, f],
            ),
        },
        gate: TensorSpec::new(
            format!("model.layers.{l}.mlp.shared_expert_gate.weight"),
            format!("blk.{l}.ffn_gate_inp_shexp.weight"),
            vec![1, h],
        )
        .shaped_in_gguf(vec![h]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::registry;
    use crate::model::spec::{CacheSpec, FfnKind, LayerKind};
    use serde_json::json;

    fn config() -> ModelConfig {
        let v = json!({"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.25,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4,
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40, "mlp_only_layers": [2]});
        ModelConfig::from_hf_value("t", &v).unwrap()
    }

    #[test]
    fn layers_follow_layer_types_with_their_own_tensors_and_caches() {
        let c = config();
        assert_eq!(c.rotary_dim, 4);
        let arch = registry::for_config(&c);
        assert_eq!(arch.name(), "qwen3_next");
        let linear = arch.layer(&c, 0);
        let MixerTensors::LinearAttention(la) = &linear.mixer else {
            panic!("layer 0 is linear attention")
        };
        // q and k: 2 heads of 8; v and z: 4 heads of 12.
        let LinearProjections::Fused { qkvz, ba } = &la.projections else {
            panic!("Qwen3-Next fuses its projections")
        };
        assert_eq!(qkvz.shape, vec![2 * 16 + 2 * 48, 64]);
        assert_eq!(ba.shape, vec![8, 64]);
        assert_eq!(la.conv.shape, vec![16 + 16 + 48, 1, 4]);
        assert_eq!(la.out.hf, "model.layers.0.linear_attn.out_proj.weight");
        assert_eq!(linear.norm_scale, NormScale::OnePlusWeight);
        let spec = linear.spec();
        assert_eq!(spec.kind, LayerKind::LinearAttention);
        assert_eq!(
            spec.cache,
            CacheSpec::Recurrent {
                values: 3 * 80 + 4 * 8 * 12
            }
        );
        assert_eq!(spec.cache.kv_dim(), 0);

        let full = arch.layer(&c, 1);
        let MixerTensors::Attention(a) = &full.mixer else {
            panic!("layer 1 is full attention")
        };
        assert!(a.output_gate && a.qk_norm.is_some());
        assert_eq!((a.q.shape.clone(), a.rotary_dim), (vec![2 * 64, 64], 4));
        assert_eq!(full.spec().cache.kv_dim(), 32);

        // Sparse with a shared expert, except the listed dense layer.
        let FfnTensors::Moe(m) = &full.ffn else {
            panic!("layer 1 is sparse")
        };
        let shared = m.shared.as_ref().expect("a shared expert");
        assert_eq!(shared.gate.hf, "model.layers.1.mlp.shared_expert_gate.weight");
        assert_eq!(shared.mlp.down.shape, vec![64, 40]);
        assert_eq!(full.spec().ffn, FfnKind::Moe { experts: 6, active: 2 });
        assert!(matches!(arch.layer(&c, 2).ffn, FfnTensors::Dense(_)));
        // A position reads 2 of 6 experts, and always the shared one.
        let s = full.spec();
        assert_eq!(s.weight_params - s.active_params, 4 * 3 * 24 * 64);
    }

    #[test]
    fn without_layer_types_every_fourth_layer_is_full_attention() {
        let mut v = json!({"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 12, "num_experts": 0});
        let c = ModelConfig::from_hf_value("t", &v).unwrap();
        let types = &c.linear_attention.as_ref().unwrap().layer_types;
        let full: Vec<usize> = (0..8).filter(|&l| types[l] == LayerType::FullAttention).collect();
        assert_eq!(full, vec![3, 7]);
        assert!(c.moe.is_none(), "no experts configured: dense");
        v["layer_types"] = json!(["full_attention"]);
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("layer_types") && e.contains("8 layer types"), "{e}");
        v["layer_types"] = json!(vec!["full_attention"; 8]);
        v["linear_num_value_heads"] = json!(3);
        let e = ModelConfig::from_hf_value("t", &v).unwrap_err().to_string();
        assert!(e.contains("not a multiple of linear_num_key_heads"), "{e}");
    }
}
