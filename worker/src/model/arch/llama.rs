//! Llama (and the many checkpoints that reuse its layout, SmolLM2 among them).

use baton_shared::model_config::ModelConfig;

use super::llama_family::{self, Variant};
use super::{Architecture, LayerPlan, OuterPlan};

/// `LlamaForCausalLM` / GGUF `llama`.
#[derive(Debug)]
pub struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn hf_names(&self) -> &'static [&'static str] {
        &["LlamaForCausalLM", "llama"]
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["llama"]
    }

    fn layer(&self, c: &ModelConfig, l: usize) -> LayerPlan {
        let variant = Variant {
            // Llama's config can turn on `attention_bias`.
            qkv_bias: c.qkv_bias,
            qk_norm: false,
            gguf_permutes_qk: true,
        };
        llama_family::layer(c, l, variant)
    }

    fn outer(&self, c: &ModelConfig) -> OuterPlan {
        llama_family::outer(c)
    }
}
