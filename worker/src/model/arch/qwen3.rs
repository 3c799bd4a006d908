//! Qwen3 (dense): Llama's layout with a per-head RMSNorm on q and k before RoPE, and a head
//! width that need not divide the hidden size.

use baton_shared::model_config::ModelConfig;

use super::llama_family::{self, Variant};
use super::{Architecture, LayerPlan, OuterPlan};

/// `Qwen3ForCausalLM` / GGUF `qwen3`.
#[derive(Debug)]
pub struct Qwen3;

impl Architecture for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }

    fn hf_names(&self) -> &'static [&'static str] {
        &["Qwen3ForCausalLM", "qwen3"]
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen3"]
    }

    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan {
        let variant = Variant {
            qkv_bias: c.qkv_bias,
            qk_norm: true,
            gguf_permutes_qk: false,
        };
        llama_family::layer(c, l, variant)
    }

    fn outer(&self, c: &ModelConfig) -> OuterPlan {
        llama_family::outer(c)
    }
}
