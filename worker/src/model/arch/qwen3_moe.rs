//! Qwen3-MoE: Qwen3's attention (q/k norms) with a mixture-of-experts feed-forward part in
//! its sparse layers (`mlp.gate` router, `mlp.experts.E.*` gated MLPs) and Qwen3's dense MLP
//! in the others. llama.cpp keeps each sparse layer's experts as one stacked tensor per
//! projection (`blk.N.ffn_gate_exps`), and the router as `blk.N.ffn_gate_inp`.

use baton_shared::model_config::{ModelConfig, MoeConfig};
use baton_shared::model_files::TensorSpec;

use super::llama_family::{self, Variant};
use super::{Architecture, FfnTensors, LayerPlan, MlpTensors, MoeTensors, OuterPlan};

/// `Qwen3MoeForCausalLM` / GGUF `qwen3moe`.
#[derive(Debug)]
pub struct Qwen3Moe;

impl Architecture for Qwen3Moe {
    fn name(&self) -> &'static str {
        "qwen3_moe"
    }

    fn hf_names(&self) -> &'static [&'static str] {
        &["Qwen3MoeForCausalLM", "qwen3_moe"]
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen3moe"]
    }

    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan {
        let variant = Variant {
            qkv_bias: c.qkv_bias,
            qk_norm: true,
            gguf_permutes_qk: false,
        };
        let mut plan = llama_family::layer(c, l, variant);
        if let Some(moe) = c.moe.as_ref().filter(|m| m.is_sparse(l)) {
            plan.ffn = FfnTensors::Moe(experts(c.hidden_size, l, moe));
        }
        plan
    }

    fn outer(&self, c: &ModelConfig) -> OuterPlan {
        llama_family::outer(c)
    }
}

/// The router and experts of sparse layer `l`. Each expert's projection is read where the file
/// keeps it: one tensor per expert (Hugging Face checkpoints saved per expert) or slice `e` of a
/// stacked one (llama.cpp's `ffn_*_exps`); or else from the fused layout of newer files, where
/// gate and up are one `[experts, 2 · f, h]` tensor, each expert's gate rows before its up rows
/// (published Qwen3.5-MoE checkpoints' `mlp.experts.gate_up_proj` and `down_proj`, and
/// llama.cpp's `ffn_gate_up_exps` made from them).
pub fn experts(h: usize, l: usize, moe: &MoeConfig) -> MoeTensors {
    let (n, f) = (moe.num_experts, moe.expert_intermediate_size);
    let expert = |e: usize, hf: &str, gguf: &str, shape: Vec<usize>| {
        TensorSpec::new(
            format!("model.layers.{l}.mlp.experts.{e}.{hf}.weight"),
            format!("blk.{l}.{gguf}.weight"),
            shape,
        )
        .stacked_in_gguf(e, n)
    };
    let fused = |e: usize, hf: &str, gguf: &str, shape: Vec<usize>| {
        TensorSpec::new(
            format!("model.layers.{l}.mlp.experts.{hf}"),
            format!("blk.{l}.{gguf}.weight"),
            shape,
        )
        .stacked_in_hf(e, n)
        .stacked_in_gguf(e, n)
    };
    let gate_up = |e: usize, start: usize| {
        fused(e, "gate_up_proj", "ffn_gate_up_exps", vec![f, h])
            .rows_in_hf(1, 2 * f, start)
            .rows_in_gguf(1, 2 * f, start)
    };
    MoeTensors {
        router: TensorSpec::new(
            format!("model.layers.{l}.mlp.gate.weight"),
            format!("blk.{l}.ffn_gate_inp.weight"),
            vec![n, h],
        ),
        experts: (0..n)
            .map(|e| MlpTensors {
                gate: expert(e, "gate_proj", "ffn_gate_exps", vec![f, h]).otherwise(gate_up(e, 0)),
                up: expert(e, "up_proj", "ffn_up_exps", vec![f, h]).otherwise(gate_up(e, f)),
                down: expert(e, "down_proj", "ffn_down_exps", vec![h, f]).otherwise(fused(
                    e,
                    "down_proj",
                    "ffn_down_exps",
                    vec![h, f],
                )),
            })
            .collect(),
        top_k: moe.experts_per_token,
        normalize: moe.norm_topk_prob,
        shared: None,
    }
}
