//! Qwen2 (and Qwen2.5): Llama's layout with biases on the q/k/v projections.

use baton_shared::model_config::ModelConfig;

use super::llama_family::{self, Variant};
use super::{Architecture, LayerPlan, OuterPlan};

/// `Qwen2ForCausalLM` / GGUF `qwen2`.
#[derive(Debug)]
pub struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }

    fn hf_names(&self) -> &'static [&'static str] {
        &["Qwen2ForCausalLM", "qwen2"]
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen2"]
    }

    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan {
        let variant = Variant {
            qkv_bias: c.qkv_bias,
            qk_norm: false,
            gguf_permutes_qk: false,
        };
        llama_family::layer(c, l, variant)
    }

    fn outer(&self, c: &ModelConfig) -> OuterPlan {
        llama_family::outer(c)
    }
}
