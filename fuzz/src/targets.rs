//! One function per fuzz target. Each feeds the input to the entry point the project itself
//! uses and then exercises what it returned; errors are fine, panics are bugs.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use baton_coordinator::api::chat::compile_chat_template;
use baton_coordinator::pipeline::split::costs_from_profile;
use baton_coordinator::planner::{self, LayerTable, TableClass, TableLayer, Workload};
use baton_coordinator::registry::{Cluster, RegistryService};
use baton_shared::chat_template::{ChatMessage, ChatTemplate};
use baton_shared::dtype::dequantize;
use baton_shared::gguf::GgufFile;
use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::ModelFiles;
use baton_shared::proto::registry_server::Registry;
use baton_shared::proto::{self, Dtype};
use baton_shared::safetensors_dir::SafetensorsDir;
use baton_shared::sampling::SamplingDefaults;
use baton_shared::tokenizer::{IncrementalDecoder, Tokenizer};
use baton_shared::wire;
use baton_worker::backend::{self, BackendOptions, CpuOptions, Device};
use baton_worker::kv_cache::KvDtype;
use baton_worker::model::{WeightFormat, arch, registry, resolve_format};
use baton_worker::profiler::ProfileSpec;
use baton_worker::stage::{Stage, forward_span};
use prost::Message;
use tower::ServiceExt;

use crate::fixtures;

/// Largest tensor (elements) a target dequantizes, so a big declared shape costs no time.
const MAX_DEQUANT: usize = 1 << 20;

/// Texts every tokenizer encodes: specials, digits, whitespace runs, multi-byte characters.
const TEXTS: &[&str] = &[
    "",
    "Hello, world! 12345 don't",
    "<|im_start|>user\nHi<|im_end|>\n<s></s><|endoftext|>",
    "  \t\n\r\n   spaces\u{a0}and\u{3000}more  ",
    "Ünïcödé 漢字 🙂👍🏽 \u{200d}\u{fffd}",
];

/// Encode, decode (whole and incrementally) and look up ids on a loaded tokenizer.
fn exercise_tokenizer(tok: &Tokenizer) {
    let vocab = tok.vocab_size();
    for text in TEXTS {
        for special in [false, true] {
            if let Ok(ids) = tok.encode(text, special) {
                let _ = tok.decode(&ids, false);
                let _ = tok.decode(&ids, true);
                let mut inc = IncrementalDecoder::new(true);
                for &id in &ids {
                    let _ = inc.push(tok, id);
                }
                let _ = inc.finish(tok);
            }
        }
    }
    // Ids from both ends of the vocabulary (bytes, merges, specials). Bounded: a run of ids
    // that decode to invalid UTF-8 keeps IncrementalDecoder re-decoding its whole pending tail
    // at every push (quadratic in the run's length).
    let some: Vec<u32> = (0..vocab.min(48) as u32)
        .chain(vocab.saturating_sub(16) as u32..vocab as u32)
        .collect();
    let _ = tok.decode(&some, false);
    let mut inc = IncrementalDecoder::new(false);
    for &id in &some {
        let _ = inc.push(tok, id);
        let _ = tok.id_to_token(id);
        let _ = tok.is_eos(id);
    }
    let _ = inc.finish(tok);
    let _ = tok.decode(&[vocab as u32, u32::MAX], false);
    let _ = tok.id_to_token(u32::MAX);
    render_model_template(tok);
}

fn sample_messages() -> Vec<ChatMessage> {
    let m = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    vec![
        m("system", "Be brief."),
        m("user", " Hi there "),
        m("assistant", "Hello!"),
        m("user", "2+2?"),
    ]
}

/// Compile the tokenizer's chat template as the API does and render a short conversation.
fn render_model_template(tok: &Tokenizer) {
    if let Ok(Some(t)) = compile_chat_template(tok) {
        let _ = t.render(&sample_messages(), true);
        let _ = t.render(&[], false);
    }
}

/// `GgufFile::open` (path only: the input goes to a file), then what a worker and the CLI do
/// with it: metadata, every tensor dequantized, the model config, sampling defaults, the
/// tokenizer and its chat template, and for a small valid model the stage weights.
pub fn gguf(data: &[u8]) {
    let path = crate::write(crate::scratch(), "model.gguf", data);
    let Ok(files) = ModelFiles::open(&path) else { return };
    let ModelFiles::Gguf(g) = &files else { return };
    for v in g.metadata.values() {
        let _ = (v.as_u64(), v.as_f64(), v.as_str(), v.as_bool(), v.as_array());
    }
    for t in g.tensors.values() {
        let bytes = g.tensor_data(t);
        let n: usize = t.shape.iter().product();
        if n <= MAX_DEQUANT {
            let mut out = vec![0f32; n];
            dequantize(t.dtype, bytes, &mut out);
        }
    }
    let _ = files.sampling_defaults();
    let _ = files.tensor_names();
    if let Ok(tok) = Tokenizer::from_gguf(g) {
        exercise_tokenizer(&tok);
    }
    if let Ok(cfg) = files.config() {
        load_small_model(&files, &cfg);
    }
}

/// Load every layer of a model whose config is small (a worker's LoadStage), as f32.
fn load_small_model(files: &ModelFiles, cfg: &ModelConfig) {
    let small = cfg.hidden_size <= 1024
        && cfg.intermediate_size <= 4096
        && cfg.vocab_size <= 1 << 16
        && cfg.num_layers <= 8
        && cfg.max_position_embeddings <= 1 << 14
        && cfg.num_heads <= 64
        && cfg.num_kv_heads <= 64
        && cfg.head_dim <= 256
        && cfg
            .moe
            .as_ref()
            .is_none_or(|m| m.num_experts <= 64 && m.expert_intermediate_size <= 4096);
    if !small {
        return;
    }
    let arch = registry::for_config(cfg);
    for spec in arch::stage_tensors(arch, cfg, 0..cfg.num_layers, true, true) {
        if spec.shape.iter().product::<usize>() <= MAX_DEQUANT {
            let _ = files.load_f32(&spec, true);
            let _ = files.load_blocks(&spec, true);
        }
    }
    let opts = stage_options(WeightFormat::F32, 2, 16, KvDtype::F32);
    let _ = backend::load(files, cfg, 0..cfg.num_layers, &opts);
}

fn stage_options(format: WeightFormat, kv_blocks: usize, kv_block_size: usize, kv_dtype: KvDtype) -> BackendOptions {
    BackendOptions {
        device: Device::Cpu { threads: Some(1) },
        format,
        cpu: CpuOptions::threads(1),
        check_finite: true,
        kv_blocks,
        kv_block_size,
        kv_dtype,
        state_slots: 0,
        state_snapshots: 0,
    }
}

/// A single-file checkpoint: the input is `model.safetensors` (header and data).
pub fn safetensors(data: &[u8]) {
    let dir = crate::scratch_dir("st");
    crate::write(&dir, "model.safetensors", data);
    let Ok(st) = SafetensorsDir::open(&dir) else { return };
    for t in st.tensors.values() {
        let bytes = st.tensor_data(t);
        let _ = st.tensor_path(t);
        let n: usize = t.shape.iter().product();
        if n <= MAX_DEQUANT {
            let mut out = vec![0f32; n];
            dequantize(t.dtype, bytes, &mut out);
        }
    }
}

/// A small valid shard `model-00001-of-00002.safetensors` (one F32 tensor "a" of shape [2]).
pub fn tiny_shard() -> Vec<u8> {
    let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}}"#;
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(&1f32.to_le_bytes());
    out.extend_from_slice(&(-2f32).to_le_bytes());
    out
}

/// A sharded checkpoint: the input is `model.safetensors.index.json`, beside one valid shard.
pub fn safetensors_index(data: &[u8]) {
    let dir = crate::scratch_dir("st-index");
    crate::write(&dir, "model-00001-of-00002.safetensors", &tiny_shard());
    crate::write(&dir, "model.safetensors.index.json", data);
    if let Ok(st) = SafetensorsDir::open(&dir) {
        for t in st.tensors.values() {
            let _ = st.tensor_data(t);
        }
    }
}

/// `config.json`: decoded as `from_hf_json` does, then `ModelConfig::from_hf_value`, and
/// what a worker derives from a config (architecture module, stage tensor specs).
pub fn model_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(json) = serde_json::from_str::<serde_json::Value>(text) else {
        return;
    };
    let Ok(cfg) = ModelConfig::from_hf_value("config.json", &json) else {
        return;
    };
    let _ = (cfg.q_dim(), cfg.kv_dim(), cfg.to_hf_json(Some(1), Some(2)));
    let arch = registry::for_config(&cfg);
    let layers = 0..cfg.num_layers.min(4);
    let _ = arch::stage_tensors(arch, &cfg, layers.clone(), true, true);
    let _ = stage_options(WeightFormat::F32, 4, 16, KvDtype::F16).kv_bytes(&cfg, layers);
}

/// `generation_config.json`: `SamplingDefaults::from_generation_config`.
pub fn generation_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = SamplingDefaults::from_generation_config(text);
}

/// `tokenizer.json`: `Tokenizer::from_hf_dir` on a directory holding only it.
pub fn tokenizer_json(data: &[u8]) {
    let dir = crate::scratch_dir("tok-json");
    crate::write(&dir, "tokenizer.json", data);
    if let Ok(tok) = Tokenizer::from_hf_dir(&dir) {
        exercise_tokenizer(&tok);
    }
}

/// The files beside `tokenizer.json` that `Tokenizer::from_hf_dir` reads: the input is
/// `tokenizer_config.json`, then `generation_config.json`, then `config.json`, separated by
/// 0xFF bytes (a part that is absent is a file that is absent); `tokenizer.json` is the
/// byte-level fixture.
pub fn tokenizer_config(data: &[u8]) {
    static TOKENIZER_JSON: OnceLock<String> = OnceLock::new();
    let tokenizer_json = TOKENIZER_JSON.get_or_init(|| fixtures::byte_level_tokenizer_files().0);
    let dir = crate::scratch_dir("tok-config");
    crate::write(&dir, "tokenizer.json", tokenizer_json.as_bytes());
    let names = ["tokenizer_config.json", "generation_config.json", "config.json"];
    for (name, part) in names.iter().zip(crate::split_parts(data, 0xFF, names.len())) {
        crate::write(&dir, name, part);
    }
    if let Ok(tok) = Tokenizer::from_hf_dir(&dir) {
        exercise_tokenizer(&tok);
    }
}

/// The tokenizer a GGUF file carries: `GgufFile::open` then `Tokenizer::from_gguf`.
pub fn tokenizer_gguf(data: &[u8]) {
    let path = crate::write(crate::scratch(), "tokenizer.gguf", data);
    let Ok(g) = GgufFile::open(&path) else { return };
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        exercise_tokenizer(&tok);
    }
}

/// Real chat templates over messages from the input: byte 0 picks the template and
/// `add_generation_prompt`; the rest is `role NUL content NUL role NUL content ...`.
pub fn chat_template_render(data: &[u8]) {
    static COMPILED: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    let compiled = COMPILED.get_or_init(|| {
        fixtures::TEMPLATES
            .iter()
            .map(|src| ChatTemplate::new(src, "<s>", "</s>").expect("fixture templates compile"))
            .collect()
    });
    let Some((&sel, rest)) = data.split_first() else { return };
    let template = &compiled[sel as usize % compiled.len()];
    let text = String::from_utf8_lossy(rest);
    let parts: Vec<&str> = text.split('\0').collect();
    let messages: Vec<ChatMessage> = parts
        .chunks(2)
        .map(|p| ChatMessage {
            role: p[0].to_string(),
            content: p.get(1).unwrap_or(&"").to_string(),
        })
        .collect();
    let _ = template.render(&messages, sel & 0x80 != 0);
}

/// A template source from the input (as a model's files carry it), compiled with
/// `ChatTemplate::new` and rendered over a fixed conversation.
pub fn chat_template_source(data: &[u8]) {
    let Ok(src) = std::str::from_utf8(data) else { return };
    let Ok(t) = ChatTemplate::new(src, "<s>", "</s>") else {
        return;
    };
    let _ = t.render(&sample_messages(), true);
    let _ = t.render(&[], false);
}

/// Decode, re-encode and decode again; the re-encoded size must not change (prost drops
/// unknown fields and duplicate map keys on the first decode, so the second is a fixpoint).
fn roundtrip<M: Message + Default>(bytes: &[u8]) -> Option<M> {
    let m = M::decode(bytes).ok()?;
    let again = M::decode(m.encode_to_vec().as_slice()).expect("a re-encoded message decodes");
    assert_eq!(again.encoded_len(), m.encoded_len(), "re-encoding changed the size");
    Some(m)
}

/// The worker's view of a LoadStageRequest that needs no model: KV dtype, activation dtype,
/// weight format, as `WorkerService::load_stage` parses them.
fn check_load_stage(r: &proto::LoadStageRequest) {
    let _ = if r.kv_dtype.is_empty() {
        Ok(KvDtype::F32)
    } else {
        r.kv_dtype.parse::<KvDtype>()
    };
    let _ = Dtype::try_from(r.activation_dtype).unwrap_or(Dtype::F32);
    let _ = r.weights.parse::<WeightFormat>();
}

/// A cost curve the way the coordinator builds one from a profile (`pipeline::split::curve`).
/// Qwen3-Next's layer pattern over `n` layers (three linear-attention layers, then full
/// attention), as the coordinator's table for it reads.
fn hybrid_table(n: usize) -> LayerTable {
    let class = |name: &str, w: f64| TableClass {
        name: name.into(),
        time: w,
        bytes: w,
    };
    LayerTable {
        classes: vec![class("linear_attention+moe", 1.0), class("attention+moe", 1.3)],
        layers: (0..n)
            .map(|l| TableLayer {
                class: usize::from(l % 4 == 3),
                time: 1.0,
                bytes: 1.0,
            })
            .collect(),
    }
}

/// Every protobuf message a worker or the coordinator accepts (requests, and the responses
/// each decodes from the other): byte 0 picks the type, the rest is the encoded message. Where
/// the receiver converts or validates a message without a model, that runs too.
pub fn proto_decode(data: &[u8]) {
    use proto::*;
    let Some((&sel, bytes)) = data.split_first() else {
        return;
    };
    match sel % 20 {
        // Worker service requests.
        0 => {
            if let Some(r) = roundtrip::<LoadStageRequest>(bytes) {
                check_load_stage(&r);
            }
        }
        1 => {
            if let Some(mb) = roundtrip::<MicroBatch>(bytes) {
                let _span = forward_span("fuzz", &mb);
                let _ = wire::hop_seconds(mb.sent_unix_nanos);
                if let Some(t) = &mb.hidden
                    && let [rows, cols] = t.shape[..]
                    && (rows as usize).saturating_mul(cols as usize) <= MAX_DEQUANT
                {
                    let mut out = Vec::new();
                    let _ = wire::decode(t, rows as usize, cols as usize, &mut out);
                }
            }
        }
        2 => drop(roundtrip::<FreeRequest>(bytes)),
        3 => drop(roundtrip::<TrimRequest>(bytes)),
        4 => drop(roundtrip::<HealthRequest>(bytes)),
        5 => {
            if let Some(r) = roundtrip::<ProfileRequest>(bytes) {
                let spec = ProfileSpec {
                    token_counts: r.token_counts.iter().map(|&t| t as usize).collect(),
                    context: r.context as usize,
                    reps: if r.reps == 0 { 3 } else { r.reps as usize },
                    min_seconds: f64::from(r.min_millis) / 1e3,
                };
                let _ = spec.validate();
                check_load_stage(&LoadStageRequest {
                    kv_dtype: r.kv_dtype,
                    weights: r.weights,
                    ..Default::default()
                });
            }
        }
        6 => drop(roundtrip::<ActivateStageRequest>(bytes)),
        // Registry requests (see also the `registry` target).
        7 => drop(roundtrip::<RegisterRequest>(bytes)),
        8 => drop(roundtrip::<HeartbeatRequest>(bytes)),
        9 => drop(roundtrip::<DeregisterRequest>(bytes)),
        // What the coordinator decodes from workers.
        10 => drop(roundtrip::<LoadStageResponse>(bytes)),
        11 => drop(roundtrip::<BatchResult>(bytes)),
        12 => drop(roundtrip::<FreeResponse>(bytes)),
        13 => drop(roundtrip::<TrimResponse>(bytes)),
        14 => drop(roundtrip::<HealthResponse>(bytes)),
        15 => {
            if let Some(p) = roundtrip::<ProfileResponse>(bytes)
                && let Ok(costs) = costs_from_profile(&p, Some(1 << 40))
            {
                for t in [1, 7, 64, 4096] {
                    let _ = (costs.layer.at(t), costs.embed.at(t), costs.head.at(t));
                }
                let workers = [costs.clone(), costs.slowed(1.5)];
                let load = Workload { tokens: 16, sampled: 4 };
                let _ = planner::plan(12, &workers, load);
                // A hybrid's table: the profile's own class curves where its names match.
                let _ = planner::plan_layers(&hybrid_table(12), &workers, load);
            }
        }
        // What a worker decodes from the coordinator.
        16 => drop(roundtrip::<RegisterResponse>(bytes)),
        17 => drop(roundtrip::<HeartbeatResponse>(bytes)),
        18 => drop(roundtrip::<DeregisterResponse>(bytes)),
        _ => drop(roundtrip::<Tensor>(bytes)),
    }
}

/// The tiny Llama checkpoint, opened once.
fn tiny_model() -> &'static (ModelFiles, ModelConfig) {
    static MODEL: OnceLock<(ModelFiles, ModelConfig)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let files = ModelFiles::open(&fixtures::tiny_llama_dir()).expect("the tiny fixture opens");
        let cfg = files.config().expect("the tiny fixture's config");
        (files, cfg)
    })
}

/// A worker's KV budget in this target (`kv_cache_mib`), small so no input allocates much.
const WORKER_KV_BUDGET: u128 = 4 << 20;

/// A worker stage on the tiny model driven by the messages a worker accepts. The input is a
/// LoadStageRequest (length-delimited; its model field is ignored: the tiny fixture is
/// loaded), checked and loaded as `WorkerService::load_stage` does, then up to 24 tagged
/// messages: 0 MicroBatch (`Stage::run_observed`, what Forward does with each), 1
/// FreeRequest, 2 TrimRequest, 3 HealthRequest.
pub fn worker_stage(data: &[u8]) {
    let mut buf = data;
    let Ok(load) = proto::LoadStageRequest::decode_length_delimited(&mut buf) else {
        return;
    };
    let (files, cfg) = tiny_model();
    // The checks of WorkerService::load_stage, in its order.
    let (start, end) = (load.layer_start as usize, load.layer_end as usize);
    if start >= end || end > cfg.num_layers {
        return;
    }
    let format = if load.weights.is_empty() {
        WeightFormat::F32
    } else {
        match resolve_format(&load.weights, files) {
            Ok(f) => f,
            Err(_) => return,
        }
    };
    let kv_dtype = if load.kv_dtype.is_empty() {
        KvDtype::F32
    } else {
        match load.kv_dtype.parse::<KvDtype>() {
            Ok(d) => d,
            Err(_) => return,
        }
    };
    let opts = stage_options(format, load.kv_blocks as usize, load.kv_block_size as usize, kv_dtype);
    if opts.kv_bytes(cfg, start..end) > WORKER_KV_BUDGET {
        return;
    }
    let Ok(backend) = backend::load(files, cfg, start..end, &opts) else {
        return;
    };
    let dtype = Dtype::try_from(load.activation_dtype).unwrap_or(Dtype::F32);
    let mut stage = Stage::new(backend, load.stage_index, dtype);
    let _ = stage.info();
    for (tag, bytes) in crate::tagged_messages(buf, 24) {
        match tag % 4 {
            0 => {
                if let Ok(mb) = proto::MicroBatch::decode(bytes) {
                    let span = forward_span("fuzz-worker", &mb);
                    let _ = stage.run_observed(mb, &span);
                }
            }
            1 => {
                if let Ok(r) = proto::FreeRequest::decode(bytes) {
                    stage.free(&r.seq_ids);
                    stage.record_usage();
                }
            }
            2 => {
                if let Ok(r) = proto::TrimRequest::decode(bytes) {
                    let _ = stage.trim(r.seq_id, r.length as usize);
                }
            }
            _ => {
                let _ = stage.health();
            }
        }
    }
}

/// The coordinator's registry service driven by up to 64 tagged messages: 0 RegisterRequest,
/// 1 HeartbeatRequest, 2 DeregisterRequest; then the live-worker list the supervisor reads.
pub fn registry(data: &[u8]) {
    let svc = RegistryService {
        cluster: Arc::new(Cluster::new(Duration::from_secs(1))),
    };
    for (tag, bytes) in crate::tagged_messages(data, 64) {
        match tag % 3 {
            0 => {
                if let Ok(r) = proto::RegisterRequest::decode(bytes) {
                    let _ = futures::executor::block_on(svc.register(tonic::Request::new(r)));
                }
            }
            1 => {
                if let Ok(r) = proto::HeartbeatRequest::decode(bytes) {
                    let _ = futures::executor::block_on(svc.heartbeat(tonic::Request::new(r)));
                }
            }
            _ => {
                if let Ok(r) = proto::DeregisterRequest::decode(bytes) {
                    let _ = futures::executor::block_on(svc.deregister(tonic::Request::new(r)));
                }
            }
        }
    }
    for w in svc.cluster.alive() {
        let _ = svc.cluster.is_alive(&w.id);
    }
}

/// POST `body` to `path` on the real router (body extractor, validation, tokenizing,
/// templating, the fake generator's tokens, detokenizing, stop strings, SSE) and read the
/// whole answer.
fn post(path: &str, body: &[u8]) {
    let (rt, app) = fixtures::http_app();
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_vec()))
        .expect("a valid request");
    rt.block_on(async {
        let resp = app.clone().oneshot(req).await.expect("the router is infallible");
        let _ = axum::body::to_bytes(resp.into_body(), usize::MAX).await;
    });
}

/// The JSON body of `POST /v1/completions`.
pub fn http_completions(data: &[u8]) {
    post("/v1/completions", data);
}

/// The JSON body of `POST /v1/chat/completions`.
pub fn http_chat(data: &[u8]) {
    post("/v1/chat/completions", data);
}
