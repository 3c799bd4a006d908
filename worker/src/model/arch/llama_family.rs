//! The naming shared by the Llama family (Llama, Qwen2, Qwen3 and most of their descendants):
//! `model.layers.N.self_attn.q_proj` in Hugging Face files, `blk.N.attn_q` in GGUF files.

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::TensorSpec;

use super::{AttentionTensors, FfnTensors, LayerPlan, MixerTensors, MlpTensors, NormScale, OuterPlan};

/// How a family member's layer differs from plain Llama.
#[derive(Debug, Clone, Copy, Default)]
pub struct Variant {
    /// q/k/v projections carry biases.
    pub qkv_bias: bool,
    /// q and k get a per-head RMSNorm before RoPE.
    pub qk_norm: bool,
    /// llama.cpp's converter interleaves q/k rows within each head (it does for `llama`).
    pub gguf_permutes_qk: bool,
}

/// A tensor of layer `l`: `model.layers.{l}.{hf}` / `blk.{l}.{gguf}`.
pub fn t(l: usize, hf: &str, gguf: &str, shape: Vec<usize>) -> TensorSpec {
    TensorSpec::new(format!("model.layers.{l}.{hf}"), format!("blk.{l}.{gguf}"), shape)
}

/// Layer `l` of a Llama-family model.
pub fn layer(c: &ModelConfig, l: usize, v: Variant) -> LayerPlan {
    let (h, q, kv, f, d) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size, c.head_dim);
    let permuted = |spec: TensorSpec, heads| {
        if v.gguf_permutes_qk {
            spec.permuted_in_gguf(heads)
        } else {
            spec
        }
    };
    let attention = AttentionTensors {
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: d,
        q: permuted(
            t(l, "self_attn.q_proj.weight", "attn_q.weight", vec![q, h]),
            c.num_heads,
        ),
        k: permuted(
            t(l, "self_attn.k_proj.weight", "attn_k.weight", vec![kv, h]),
            c.num_kv_heads,
        ),
        v: t(l, "self_attn.v_proj.weight", "attn_v.weight", vec![kv, h]),
        o: t(l, "self_attn.o_proj.weight", "attn_output.weight", vec![h, q]),
        qkv_bias: v.qkv_bias.then(|| {
            [
                t(l, "self_attn.q_proj.bias", "attn_q.bias", vec![q]),
                t(l, "self_attn.k_proj.bias", "attn_k.bias", vec![kv]),
                t(l, "self_attn.v_proj.bias", "attn_v.bias", vec![kv]),
            ]
        }),
        qk_norm: v.qk_norm.then(|| {
            [
                t(l, "self_attn.q_norm.weight", "attn_q_norm.weight", vec![d]),
                t(l, "self_attn.k_norm.weight", "attn_k_norm.weight", vec![d]),
            ]
        }),
        rotary_dim: c.rotary_dim,
        output_gate: false,
    };
    LayerPlan {
        mixer_norm: t(l, "input_layernorm.weight", "attn_norm.weight", vec![h]),
        mixer: MixerTensors::Attention(attention),
        ffn_norm: t(l, "post_attention_layernorm.weight", "ffn_norm.weight", vec![h]),
        ffn: FfnTensors::Dense(MlpTensors {
            gate: t(l, "mlp.gate_proj.weight", "ffn_gate.weight", vec![f, h]),
            up: t(l, "mlp.up_proj.weight", "ffn_up.weight", vec![f, h]),
            down: t(l, "mlp.down_proj.weight", "ffn_down.weight", vec![h, f]),
        }),
        norm_scale: NormScale::Weight,
    }
}

/// The embedding, final norm and head of a Llama-family model.
pub fn outer(c: &ModelConfig) -> OuterPlan {
    let (h, vocab) = (c.hidden_size, c.vocab_size);
    let head = TensorSpec::new("lm_head.weight", "output.weight", vec![vocab, h]);
    OuterPlan {
        embedding: TensorSpec::new("model.embed_tokens.weight", "token_embd.weight", vec![vocab, h]),
        final_norm: TensorSpec::new("model.norm.weight", "output_norm.weight", vec![h]),
        head: (!c.tie_word_embeddings).then(|| head.clone()),
        tolerated_head: head,
        norm_scale: NormScale::Weight,
    }
}
