//! Writes the committed seed corpus: small valid inputs for every target.
//!
//!     cargo run --manifest-path fuzz/Cargo.toml --no-default-features --example seeds [-- DIR]
//!
//! (DIR defaults to fuzz/corpus). Deterministic: rerunning it rewrites the same files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use baton_fuzz::fixtures::{self, CHATML, TEMPLATES};
use baton_fuzz::push_tagged;
use baton_shared::dtype::{quantize_q4_0, quantize_q4_1, quantize_q8_0};
use baton_shared::gguf::GgufValue;
use baton_shared::gguf::writer::{TensorToWrite, to_bytes};
use baton_shared::model_config::ModelConfig;
use baton_shared::proto::*;
use baton_worker::model::{arch, registry};
use prost::Message;
use serde_json::json;

struct Out(PathBuf);

impl Out {
    fn put(&self, target: &str, name: &str, bytes: impl AsRef<[u8]>) {
        let dir = self.0.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

fn s(v: &str) -> GgufValue {
    GgufValue::String(v.into())
}

fn strings(v: &[&str]) -> GgufValue {
    GgufValue::Array(v.iter().map(|x| s(x)).collect())
}

/// `tokenizer.ggml.*` metadata of a 16-token byte-level BPE with ChatML specials.
fn tokenizer_meta(pre: &str) -> Vec<(String, GgufValue)> {
    let tokens = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "a",
        "b",
        "c",
        "d",
        "e",
        "Ġ",
        "h",
        "i",
        "ab",
        "Ġh",
        "hi",
        "Ċ",
        "1",
    ];
    let types: Vec<GgufValue> = tokens
        .iter()
        .enumerate()
        .map(|(i, _)| GgufValue::I32(if i < 3 { 3 } else { 1 }))
        .collect();
    vec![
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s(pre)),
        ("tokenizer.ggml.tokens".into(), strings(&tokens)),
        ("tokenizer.ggml.token_type".into(), GgufValue::Array(types)),
        ("tokenizer.ggml.merges".into(), strings(&["a b", "Ġ h", "h i"])),
        ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(false)),
        ("tokenizer.chat_template".into(), s(CHATML)),
    ]
}

/// `tokenizer.ggml.*` metadata of a 12-piece SentencePiece BPE (Llama 2 / Mistral layout):
/// control and unknown pieces, byte-fallback pieces, scores ranking the merges.
fn sentencepiece_meta() -> Vec<(String, GgufValue)> {
    let tokens = [
        "<unk>", "<s>", "</s>", "<0x0A>", "<0x41>", "<0xF0>", "▁", "a", "b", "▁a", "ab", "▁ab",
    ];
    let types = [2, 3, 3, 6, 6, 6, 1, 1, 1, 1, 1, 1].map(GgufValue::I32);
    let scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0].map(GgufValue::F32);
    vec![
        ("tokenizer.ggml.model".into(), s("llama")),
        ("tokenizer.ggml.pre".into(), s("default")),
        ("tokenizer.ggml.tokens".into(), strings(&tokens)),
        ("tokenizer.ggml.scores".into(), GgufValue::Array(scores.to_vec())),
        ("tokenizer.ggml.token_type".into(), GgufValue::Array(types.to_vec())),
        ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2)),
        ("tokenizer.ggml.unknown_token_id".into(), GgufValue::U32(0)),
    ]
}

/// A tiny config (hidden 32, 2 heads of 16, 1 layer, vocab 16) for `model_type`.
fn tiny_config(model_type: &str) -> serde_json::Value {
    json!({
        "model_type": model_type, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 16,
        "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "hidden_act": "silu"
    })
}

/// A whole tiny model as GGUF: metadata, tokenizer and every tensor its architecture needs.
fn tiny_gguf(model_type: &str, ggml_type: u32) -> Vec<u8> {
    let cfg = ModelConfig::from_hf_value("seed", &tiny_config(model_type)).unwrap();
    let u = |v: usize| GgufValue::U32(v as u32);
    let mut meta = vec![
        ("general.architecture".to_string(), s(model_type)),
        (format!("{model_type}.block_count"), u(cfg.num_layers)),
        (format!("{model_type}.embedding_length"), u(cfg.hidden_size)),
        (format!("{model_type}.feed_forward_length"), u(cfg.intermediate_size)),
        (format!("{model_type}.attention.head_count"), u(cfg.num_heads)),
        (format!("{model_type}.attention.head_count_kv"), u(cfg.num_kv_heads)),
        (format!("{model_type}.attention.key_length"), u(cfg.head_dim)),
        (
            format!("{model_type}.attention.layer_norm_rms_epsilon"),
            GgufValue::F32(1e-5),
        ),
        (format!("{model_type}.rope.freq_base"), GgufValue::F32(10000.0)),
        (format!("{model_type}.context_length"), u(cfg.max_position_embeddings)),
        ("general.sampling.temp".into(), GgufValue::F32(0.7)),
    ];
    meta.extend(tokenizer_meta("smollm"));
    let a = registry::for_config(&cfg);
    let tensors = arch::stage_tensors(a, &cfg, 0..cfg.num_layers, true, true)
        .into_iter()
        .map(|spec| {
            let n: usize = spec.shape.iter().product();
            let values: Vec<f32> = (0..n).map(|i| ((i * 37 % 17) as f32 - 8.0) / 16.0).collect();
            // Norm weights and odd shapes stay f32; matrices take the requested type.
            let blocky = spec.shape.len() == 2 && spec.shape[1] % 32 == 0;
            let (ty, data) = match ggml_type {
                8 if blocky => (8, quantize_q8_0(&values)),
                2 if blocky => (2, quantize_q4_0(&values)),
                _ => (0, values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            };
            TensorToWrite {
                name: spec.gguf.clone(),
                shape: spec.shape.clone(),
                ggml_type: ty,
                data,
            }
        })
        .collect::<Vec<_>>();
    to_bytes(&meta, &tensors)
}

/// Every metadata value type and every tensor type Baton reads.
fn all_types_gguf() -> Vec<u8> {
    let meta = vec![
        ("u8".to_string(), GgufValue::U8(1)),
        ("i8".into(), GgufValue::I8(-1)),
        ("u16".into(), GgufValue::U16(2)),
        ("i16".into(), GgufValue::I16(-2)),
        ("u32".into(), GgufValue::U32(3)),
        ("i32".into(), GgufValue::I32(-3)),
        ("f32".into(), GgufValue::F32(0.5)),
        ("bool".into(), GgufValue::Bool(true)),
        ("string".into(), s("text")),
        (
            "array".into(),
            GgufValue::Array(vec![GgufValue::U64(1), GgufValue::U64(2)]),
        ),
        ("u64".into(), GgufValue::U64(4)),
        ("i64".into(), GgufValue::I64(-4)),
        ("f64".into(), GgufValue::F64(0.25)),
        ("general.alignment".into(), GgufValue::U32(32)),
    ];
    let v: Vec<f32> = (0..64).map(|i| i as f32 / 8.0 - 4.0).collect();
    let f16: Vec<u8> = v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
    let bf16: Vec<u8> = v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
    let t = |name: &str, ty: u32, data: Vec<u8>| TensorToWrite {
        name: name.into(),
        shape: vec![2, 32],
        ggml_type: ty,
        data,
    };
    let tensors = vec![
        t("f32", 0, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        t("f16", 1, f16),
        t("bf16", 30, bf16),
        t("q8_0", 8, quantize_q8_0(&v)),
        t("q4_0", 2, quantize_q4_0(&v)),
        t("q4_1", 3, quantize_q4_1(&v)),
    ];
    to_bytes(&meta, &tensors)
}

fn safetensors_file(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
        );
        data.extend_from_slice(bytes);
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

fn fixture(rel: &str) -> Vec<u8> {
    std::fs::read(fixtures::tiny_llama_dir().join("../..").join(rel)).unwrap()
}

fn seq(seq_id: u64, tokens: Vec<u32>, pos0: u32, blocks: Vec<u32>, sampling: Option<Sampling>) -> SequenceChunk {
    SequenceChunk {
        seq_id,
        tokens,
        pos0,
        sample: true,
        sampling,
        blocks,
        cached: 0,
        draft: 0,
        taps: false,
        propose: 0,
        restore_state: None,
        save_state: None,
        prompt_len: 0,
    }
}

fn greedy() -> Option<Sampling> {
    Some(Sampling {
        temperature: 0.0,
        top_p: 1.0,
        ..Default::default()
    })
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    let out = Out(dir);

    // GGUF: whole tiny models (f32, q8_0, q4_0 matrices), every value and tensor type.
    out.put("gguf", "llama-f32.gguf", tiny_gguf("llama", 0));
    out.put("gguf", "qwen2-f32.gguf", tiny_gguf("qwen2", 0));
    out.put("gguf", "qwen3-q8_0.gguf", tiny_gguf("qwen3", 8));
    out.put("gguf", "llama-q4_0.gguf", tiny_gguf("llama", 2));
    out.put("gguf", "all-types.gguf", all_types_gguf());

    // GGUF tokenizers, one per supported pre-tokenizer, and a SentencePiece one.
    for pre in ["smollm", "gpt2", "qwen2", "qwen35", "llama-bpe"] {
        out.put(
            "tokenizer_gguf",
            &format!("{pre}.gguf"),
            to_bytes(&tokenizer_meta(pre), &[]),
        );
    }
    out.put(
        "tokenizer_gguf",
        "sentencepiece.gguf",
        to_bytes(&sentencepiece_meta(), &[]),
    );

    // safetensors: one file, and a shard index beside the target's fixed shard.
    let f32s: Vec<u8> = [1f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let halfs: Vec<u8> = [1f32, 2.0]
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let bf16s: Vec<u8> = [1f32, 2.0]
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    out.put(
        "safetensors",
        "three-dtypes.safetensors",
        safetensors_file(&[
            ("model.embed_tokens.weight", "F32", vec![2, 2], f32s),
            ("model.norm.weight", "F16", vec![2], halfs),
            ("lm_head.weight", "BF16", vec![1, 2], bf16s),
        ]),
    );
    out.put("safetensors", "shard.safetensors", baton_fuzz::targets::tiny_shard());
    out.put("safetensors", "empty.safetensors", safetensors_file(&[]));
    out.put(
        "safetensors_index",
        "index.json",
        json!({"metadata": {"total_size": 8}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}).to_string(),
    );
    out.put(
        "safetensors_index",
        "fixture-index.json",
        fixture("tiny/llama_sharded/model.safetensors.index.json"),
    );

    // config.json: the fixtures, and RoPE scaling variants.
    let mut tiny: Vec<String> = std::fs::read_dir(fixtures::tiny_llama_dir().join(".."))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    tiny.sort();
    for m in tiny {
        out.put(
            "model_config",
            &format!("{m}.json"),
            fixture(&format!("tiny/{m}/config.json")),
        );
    }
    let mut llama31 = tiny_config("llama");
    llama31["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    out.put("model_config", "llama3-scaling.json", llama31.to_string());
    let mut linear = tiny_config("qwen2");
    linear["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    out.put("model_config", "linear-scaling.json", linear.to_string());

    out.put(
        "generation_config",
        "fixture.json",
        fixture("tiny/llama_tied/generation_config.json"),
    );
    out.put(
        "generation_config",
        "sampling.json",
        json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
               "bos_token_id": 1, "eos_token_id": [2, 3]})
        .to_string(),
    );

    // tokenizer.json: the byte-level fixture, and GGUF-built ones with each pre-tokenizer.
    let (tokenizer_json, tokenizer_config) = fixtures::byte_level_tokenizer_files();
    out.put("tokenizer_json", "byte-level.json", &tokenizer_json);
    for pre in ["smollm", "qwen2", "llama-bpe"] {
        let dir = baton_fuzz::scratch_dir("seed");
        let path = baton_fuzz::write(&dir, "t.gguf", &to_bytes(&tokenizer_meta(pre), &[]));
        let g = baton_shared::gguf::GgufFile::open(&path).unwrap();
        let tok = baton_shared::tokenizer::Tokenizer::from_gguf(&g).unwrap();
        out.put(
            "tokenizer_json",
            &format!("{pre}.json"),
            tok.inner().to_string(false).unwrap(),
        );
    }

    // The files beside tokenizer.json, 0xFF-separated.
    let sep = |parts: &[String]| {
        let mut v = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                v.push(0xFF);
            }
            v.extend_from_slice(p.as_bytes());
        }
        v
    };
    let gen_cfg = json!({"bos_token_id": 257, "eos_token_id": [256, 258]}).to_string();
    let model_cfg = json!({"eos_token_id": 256}).to_string();
    out.put(
        "tokenizer_config",
        "chatml.bin",
        sep(&[tokenizer_config.clone(), gen_cfg.clone(), model_cfg]),
    );
    out.put(
        "tokenizer_config",
        "named-templates.bin",
        sep(&[
            json!({"bos_token": {"content": "<|im_start|>"}, "eos_token": {"content": "<|im_end|>"}, "add_bos_token": true,
                   "chat_template": [{"name": "tool_use", "template": "{{ messages }}"}, {"name": "default", "template": TEMPLATES[2]}]})
            .to_string(),
            gen_cfg,
        ]),
    );
    out.put("tokenizer_config", "config-only.bin", tokenizer_config);

    // Chat templates: each fixture template over a conversation, and each source.
    let convo = "system\0Be brief.\0user\0 Hi there \0assistant\0Hello!\0user\x002+2?";
    for (i, _) in TEMPLATES.iter().enumerate() {
        let mut v = vec![i as u8 | 0x80];
        v.extend_from_slice(convo.as_bytes());
        out.put("chat_template_render", &format!("template-{i}"), v);
        let mut alt = vec![i as u8];
        alt.extend_from_slice(b"user\0Hi\0assistant\0Yo\0user\0More?");
        out.put("chat_template_render", &format!("template-{i}-alternating"), alt);
    }
    for (i, src) in TEMPLATES.iter().enumerate() {
        out.put("chat_template_source", &format!("template-{i}.jinja"), src);
    }
    out.put(
        "chat_template_source",
        "filters.jinja",
        "{% macro m(x) %}{{ x|upper }}{% endmacro %}{% for msg in messages|reverse %}{{ m(msg.role) }}{{ msg.content|length }}{{ msg.content.split(' ')|join(',') }}{% if not loop.last %},{% endif %}{% endfor %}{{ messages|tojson }}{% set ns = namespace(n=0) %}{{ ns.n }}",
    );

    // Protobuf messages, byte 0 picks the type (see targets::proto_decode).
    let put_proto = |sel: u8, name: &str, m: &dyn Fn() -> Vec<u8>| {
        let mut v = vec![sel];
        v.extend(m());
        out.put("proto_decode", name, v);
    };
    let load = LoadStageRequest {
        model: "/models/smollm2".into(),
        layer_start: 0,
        layer_end: 3,
        weights: "q8_0".into(),
        kv_blocks: 64,
        activation_dtype: Dtype::Bf16 as i32,
        next_stage: "http://10.0.0.3:50052".into(),
        stage_index: 0,
        kv_block_size: 16,
        kv_dtype: "f16".into(),
        staged: true,
        draft_model: "/models/smollm2-dflash".into(),
        state_slots: 16,
        state_snapshots: 8,
    };
    let mut trace = HashMap::new();
    trace.insert(
        "traceparent".to_string(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
    );
    trace.insert("tracestate".to_string(), "congo=t61rcWkgMzE".to_string());
    let hidden = Tensor {
        dtype: Dtype::F16 as i32,
        shape: vec![2, 4],
        data: vec![0x00, 0x3c].repeat(8),
    };
    let mb = MicroBatch {
        batch_id: 7,
        seqs: vec![
            seq(1, vec![1, 2, 3], 0, vec![0], greedy()),
            SequenceChunk {
                seq_id: 2,
                tokens: vec![9],
                pos0: 16,
                sample: true,
                sampling: Some(Sampling {
                    temperature: 0.7,
                    top_k: 40,
                    top_p: 0.9,
                    min_p: 0.05,
                    seed: Some(42),
                    logprobs: true,
                    top_logprobs: 3,
                    drawn: 2,
                }),
                blocks: vec![1, 2],
                cached: 16,
                draft: 0,
                taps: false,
                propose: 0,
                // A hybrid model's prefix hit: the state starts from snapshot 5, and the chunk
                // ends a block, so it snapshots the state there too.
                restore_state: Some(5),
                save_state: Some(6),
                prompt_len: 0,
            },
            // A decode step carrying two proposals to verify (speculative decoding).
            SequenceChunk {
                seq_id: 3,
                tokens: vec![4, 5, 6],
                pos0: 0,
                sample: true,
                sampling: greedy(),
                blocks: vec![3],
                cached: 0,
                draft: 2,
                // DFlash: its rows carry taps, and the last stage drafts three more.
                taps: true,
                propose: 3,
                restore_state: None,
                save_state: None,
                prompt_len: 0,
            },
        ],
        hidden: Some(hidden.clone()),
        trace_context: trace,
        sent_unix_nanos: 1_700_000_000_000_000_000,
        draft_context: Some(hidden.clone()),
        free: vec![4, 9],
    };
    put_proto(0, "load_stage", &|| load.encode_to_vec());
    put_proto(1, "micro_batch", &|| mb.encode_to_vec());
    put_proto(2, "free", &|| {
        FreeRequest {
            seq_ids: vec![1, 2, u64::MAX],
        }
        .encode_to_vec()
    });
    put_proto(3, "trim", &|| TrimRequest { seq_id: 1, length: 5 }.encode_to_vec());
    put_proto(4, "health", &|| HealthRequest {}.encode_to_vec());
    let profile_req = ProfileRequest {
        model: String::new(),
        weights: "bf16".into(),
        token_counts: vec![1, 2, 4, 8, 16, 32, 64],
        context: 512,
        reps: 3,
        min_millis: 50,
        kv_dtype: "f32".into(),
    };
    put_proto(5, "profile", &|| profile_req.encode_to_vec());
    put_proto(6, "activate_stage", &|| ActivateStageRequest {}.encode_to_vec());
    let register = RegisterRequest {
        worker_id: "w-1".into(),
        address: "http://10.0.0.2:50052".into(),
        device_kind: "cpu".into(),
        cores: 16,
        memory_bytes: 64 << 30,
        features: vec!["avx512f".into(), "fp32-reference".into()],
        kv_cache_bytes: 1 << 30,
        metrics_address: "10.0.0.2:9100".into(),
    };
    put_proto(7, "register", &|| register.encode_to_vec());
    let heartbeat = HeartbeatRequest {
        worker_id: "w-1".into(),
        address: "http://10.0.0.2:50052".into(),
    };
    put_proto(8, "heartbeat", &|| heartbeat.encode_to_vec());
    put_proto(9, "deregister", &|| {
        DeregisterRequest {
            worker_id: "w-1".into(),
        }
        .encode_to_vec()
    });
    let info = StageInfo {
        layer_start: 0,
        layer_end: 15,
        num_layers: 30,
        first: true,
        last: false,
        weight_bytes: 1 << 28,
    };
    put_proto(10, "load_stage_response", &|| {
        LoadStageResponse {
            stage: Some(info.clone()),
        }
        .encode_to_vec()
    });
    let result = BatchResult {
        batch_id: 7,
        results: vec![SequenceResult {
            seq_id: 1,
            token: 42,
            logprob: -0.25,
            top_ids: vec![42, 7],
            top_logprobs: vec![-0.25, -2.0],
            more_tokens: vec![43, 44],
            proposals: vec![45, 46, 47],
            more_logprobs: vec![
                TokenLogprobs {
                    logprob: -0.5,
                    top_ids: vec![43],
                    top_logprobs: vec![-0.5],
                },
                TokenLogprobs {
                    logprob: -1.5,
                    top_ids: vec![7],
                    top_logprobs: vec![-0.75],
                },
            ],
        }],
        error: String::new(),
    };
    put_proto(11, "batch_result", &|| result.encode_to_vec());
    put_proto(12, "free_response", &|| FreeResponse { freed: 2 }.encode_to_vec());
    put_proto(13, "trim_response", &|| TrimResponse { length: 5 }.encode_to_vec());
    let health = HealthResponse {
        worker_id: "w-1".into(),
        loaded: true,
        stage: Some(info.clone()),
        active_sequences: 3,
        kv_tokens: 100,
        forward_batches: 10,
        forward_tokens: 200,
        forward_seconds: 0.5,
        kv_capacity_tokens: 1024,
        kv_bytes: 1 << 20,
        kv_blocks_used: 7,
        kv_blocks_total: 64,
        state_slots_used: 3,
        state_slots_total: 16,
        state_snapshots_total: 8,
    };
    put_proto(14, "health_response", &|| health.encode_to_vec());
    let points = |scale: f64| -> Vec<CostPoint> {
        [1u32, 2, 4, 8, 16]
            .iter()
            .map(|&t| CostPoint {
                tokens: t,
                seconds: scale * (1.0 + t as f64 / 8.0),
            })
            .collect()
    };
    let profile = ProfileResponse {
        layer: points(1e-3),
        head: points(4e-3),
        embed: points(1e-5),
        layer_weight_bytes: 1 << 20,
        embed_weight_bytes: 1 << 22,
        head_weight_bytes: 1 << 22,
        kernels: "avx2".into(),
        threads: 8,
        classes: vec![
            LayerClassCost {
                class: "linear_attention+moe".into(),
                layer: points(2e-3),
                weight_bytes: 1 << 24,
            },
            LayerClassCost {
                class: "attention+moe".into(),
                layer: points(1e-3),
                weight_bytes: 1 << 24,
            },
        ],
    };
    put_proto(15, "profile_response", &|| profile.encode_to_vec());
    let reg_resp = RegisterResponse {
        worker_id: "w-1".into(),
        heartbeat_interval_ms: 1000,
    };
    put_proto(16, "register_response", &|| reg_resp.encode_to_vec());
    put_proto(17, "heartbeat_response", &|| {
        HeartbeatResponse { known: true }.encode_to_vec()
    });
    put_proto(18, "deregister_response", &|| DeregisterResponse {}.encode_to_vec());
    put_proto(19, "tensor", &|| hidden.encode_to_vec());

    // Worker stage sessions on the tiny model (3 layers, hidden 64, context 256).
    let load_for = |start: u32, end: u32, weights: &str, kv_dtype: &str| LoadStageRequest {
        layer_start: start,
        layer_end: end,
        weights: weights.into(),
        kv_blocks: 8,
        kv_block_size: 16,
        kv_dtype: kv_dtype.into(),
        activation_dtype: Dtype::F32 as i32,
        ..Default::default()
    };
    let session = |load: &LoadStageRequest, hidden: bool| {
        let mut v = Vec::new();
        load.encode_length_delimited(&mut v).unwrap();
        let h = |rows: u32| {
            hidden.then(|| Tensor {
                dtype: Dtype::F32 as i32,
                shape: vec![rows, 64],
                data: vec![0u8; rows as usize * 64 * 4],
            })
        };
        let prefill = MicroBatch {
            batch_id: 1,
            seqs: vec![seq(1, vec![1, 2, 3, 4], 0, vec![0], greedy())],
            hidden: h(4),
            ..Default::default()
        };
        let decode = MicroBatch {
            batch_id: 2,
            seqs: vec![
                seq(1, vec![5], 4, vec![0], None),
                seq(
                    2,
                    vec![7, 8],
                    0,
                    vec![1],
                    Some(Sampling {
                        temperature: 0.8,
                        top_k: 5,
                        top_p: 0.9,
                        seed: Some(3),
                        logprobs: true,
                        top_logprobs: 2,
                        ..Default::default()
                    }),
                ),
            ],
            hidden: h(3),
            ..Default::default()
        };
        push_tagged(&mut v, 0, &prefill);
        push_tagged(&mut v, 0, &decode);
        push_tagged(&mut v, 2, &TrimRequest { seq_id: 1, length: 3 });
        push_tagged(&mut v, 3, &HealthRequest {});
        push_tagged(&mut v, 1, &FreeRequest { seq_ids: vec![1, 2] });
        v
    };
    out.put("worker_stage", "whole-f32", session(&load_for(0, 3, "", ""), false));
    out.put(
        "worker_stage",
        "whole-q8_0-kvf16",
        session(&load_for(0, 3, "q8_0", "f16"), false),
    );
    out.put(
        "worker_stage",
        "first-bf16",
        session(&load_for(0, 1, "bf16", "f32"), false),
    );
    out.put("worker_stage", "middle", session(&load_for(1, 2, "f32", "f32"), true));
    out.put("worker_stage", "last", session(&load_for(1, 3, "", ""), true));

    // Registry sessions.
    let mut reg = Vec::new();
    push_tagged(&mut reg, 0, &register);
    push_tagged(&mut reg, 1, &heartbeat);
    push_tagged(
        &mut reg,
        0,
        &RegisterRequest {
            address: "https://10.0.0.9:443".into(),
            ..Default::default()
        },
    );
    push_tagged(
        &mut reg,
        1,
        &HeartbeatRequest {
            worker_id: "worker-1".into(),
            address: String::new(),
        },
    );
    push_tagged(
        &mut reg,
        2,
        &DeregisterRequest {
            worker_id: "w-1".into(),
        },
    );
    out.put("registry", "session", reg);

    // HTTP bodies.
    let completions = [
        json!({"prompt": "Hello", "max_tokens": 4}),
        json!({"model": "fuzz-model", "prompt": "Hello there", "max_tokens": 6, "stream": true,
               "stream_options": {"include_usage": true}, "stop": ["ll", "x"], "temperature": 0.7,
               "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 1}),
        json!({"prompt": [72, 101, 108, 108, 111], "max_tokens": 3, "logprobs": 2, "echo": false, "best_of": 1}),
        json!({"prompt": ["Hi"], "max_tokens": 2, "stop": "i", "ignore_eos": true, "n": 1, "suffix": ""}),
        json!({"prompt": "", "max_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
               "repetition_penalty": 1.0, "logit_bias": {}}),
    ];
    for (i, b) in completions.iter().enumerate() {
        out.put("http_completions", &format!("body-{i}.json"), b.to_string());
    }
    let chats = [
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
        json!({"model": "fuzz-model", "messages": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}],
               "max_completion_tokens": 5, "stream": true, "stream_options": {"include_usage": true},
               "logprobs": true, "top_logprobs": 2}),
        json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": null},
               {"role": "user", "content": "again"}], "max_tokens": 3, "stop": ["a"], "temperature": 0,
               "seed": 5, "n": 1, "tools": [], "response_format": {"type": "text"}}),
    ];
    for (i, b) in chats.iter().enumerate() {
        out.put("http_chat", &format!("body-{i}.json"), b.to_string());
    }
    let _ = std::fs::remove_dir_all(baton_fuzz::scratch());
    println!("seeds written to {}", out.0.display());
}
