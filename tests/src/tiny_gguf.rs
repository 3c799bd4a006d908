//! The tiny tied Llama fixture rebuilt as GGUF tensors, for tests that need a small GGUF file.

use std::path::Path;

use baton_shared::gguf::GgufValue;
use baton_shared::gguf::writer::TensorToWrite;
use baton_shared::model_files::{ModelFiles, permute_rows};
use baton_worker::model::{arch, registry};

/// GGUF metadata entries in file order.
pub type Metadata = Vec<(String, GgufValue)>;

/// The Llama checkpoint in `dir` as GGUF tensors (F32, q/k rows permuted as llama.cpp's converter does).
pub fn tiny_llama(dir: &Path) -> (Metadata, Vec<TensorToWrite>) {
    let files = ModelFiles::open(dir).unwrap();
    let c = files.config().unwrap();
    let s = |v: &str| GgufValue::String(v.into());
    let u = |v: usize| GgufValue::U32(v as u32);
    let meta = vec![
        ("general.architecture".to_string(), s("llama")),
        ("llama.block_count".into(), u(c.num_layers)),
        ("llama.embedding_length".into(), u(c.hidden_size)),
        ("llama.feed_forward_length".into(), u(c.intermediate_size)),
        ("llama.attention.head_count".into(), u(c.num_heads)),
        ("llama.attention.head_count_kv".into(), u(c.num_kv_heads)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            GgufValue::F32(c.rms_norm_eps),
        ),
        ("llama.rope.freq_base".into(), GgufValue::F32(c.rope_theta as f32)),
        ("llama.context_length".into(), u(c.max_position_embeddings)),
    ];
    let mut tensors = Vec::new();
    let arch = registry::for_config(&c);
    for spec in arch::stage_tensors(arch, &c, 0..c.num_layers, true, true) {
        let mut w = files.load_f32(&spec, true).unwrap();
        if let Some(heads) = spec.gguf_heads_permuted {
            w = permute_rows(&w, heads, spec.shape[1]);
        }
        tensors.push(TensorToWrite {
            name: spec.gguf.clone(),
            shape: spec.shape.clone(),
            ggml_type: 0,
            data: w.iter().flat_map(|v| v.to_le_bytes()).collect(),
        });
    }
    (meta, tensors)
}
