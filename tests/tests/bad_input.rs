//! Model files, configs and inputs that are wrong in every way we could think of give a clear
//! error naming the problem, never a panic. Small GGUF files are built here from a tiny fixture.

use std::path::{Path, PathBuf};

use baton_shared::dtype::{DType, quantize_q8_0};
use baton_shared::gguf::writer::{TensorToWrite, to_bytes};
use baton_shared::gguf::{GgufError, GgufFile, GgufValue};
use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::{LoadError, ModelFiles};
use baton_shared::model_source::{LoadedModel, ModelSourceError};
use baton_shared::sampling::SamplingParams;
use baton_tests::{default_model, fixtures, max_abs_diff};
use baton_worker::engine::{Engine, EngineError};
use baton_worker::model::{ForwardError, StageWeights, WeightFormat, auto_format, resolve_format};

/// GGUF metadata entries in file order.
type Metadata = Vec<(String, GgufValue)>;

fn tiny_dir() -> PathBuf {
    fixtures().join("tiny/llama_tied")
}

fn tiny_as_gguf() -> (Metadata, Vec<TensorToWrite>) {
    baton_tests::tiny_gguf::tiny_llama(&tiny_dir())
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn load_full(path: &Path) -> Result<StageWeights, LoadError> {
    let files = ModelFiles::open(path)?;
    let cfg = files.config()?;
    StageWeights::load_full(&files, &cfg, true)
}

fn err_of(path: &Path) -> String {
    load_full(path).map(|_| ()).unwrap_err().to_string()
}

#[test]
fn gguf_built_from_safetensors_gives_the_same_logits() {
    // Exercises GGUF parsing, the q/k un-permutation and tied embeddings against the original.
    let tmp = tempfile::tempdir().unwrap();
    let (meta, tensors) = tiny_as_gguf();
    let p = write(tmp.path(), "tiny.gguf", &to_bytes(&meta, &tensors));
    let tokens = [3u32, 7, 11, 200, 19];
    let mut a = Engine::new(load_full(&p).unwrap());
    let mut b = Engine::new(load_full(&tiny_dir()).unwrap());
    let (la, lb) = (
        a.prompt_logits(&tokens, true).unwrap(),
        b.prompt_logits(&tokens, true).unwrap(),
    );
    assert!(max_abs_diff(&la, &lb) < 1e-5);

    // The same model with Q8_0 linear weights stays close: quantization error only (a misplaced
    // block or scale would be off by the logits' own magnitude).
    let (meta, tensors) = tiny_q8_gguf(|_| false);
    let p = write(tmp.path(), "tiny-q8.gguf", &to_bytes(&meta, &tensors));
    let mut q = Engine::new(load_full(&p).unwrap());
    let lq = q.prompt_logits(&tokens, true).unwrap();
    let err = max_abs_diff(&lq, &lb);
    let scale = lb.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        err > 0.0 && err < 0.1 * scale,
        "Q8_0 error {err} vs logit scale {scale}"
    );
}

/// The tiny model as GGUF with its layer matrices as Q8_0, except those `keep` names.
fn tiny_q8_gguf(keep: impl Fn(&str) -> bool) -> (Metadata, Vec<TensorToWrite>) {
    let (meta, mut tensors) = tiny_as_gguf();
    for t in tensors
        .iter_mut()
        .filter(|t| t.shape.len() == 2 && t.shape[1] % 32 == 0 && !t.name.starts_with("token_embd") && !keep(&t.name))
    {
        let values: Vec<f32> = t
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        t.data = quantize_q8_0(&values);
        t.ggml_type = DType::Q8_0.ggml_id();
    }
    (meta, tensors)
}

#[test]
fn auto_weights_keep_only_an_all_q8_0_file_as_stored() {
    // `auto` (the default weight format) runs Q8_0: a file whose every layer matrix is Q8_0 as
    // stored, anything else re-quantized, including a file that mixes block types by layer as
    // llama.cpp's quantizer does.
    let tmp = tempfile::tempdir().unwrap();
    let auto = |p: &Path| auto_format(&ModelFiles::open(p).unwrap());
    let (meta, tensors) = tiny_q8_gguf(|_| false);
    let all_q8 = write(tmp.path(), "all-q8.gguf", &to_bytes(&meta, &tensors));
    assert_eq!(auto(&all_q8), WeightFormat::Native);
    let last = ModelFiles::open(&tiny_dir()).unwrap().config().unwrap().num_layers - 1;
    let down = format!("blk.{last}.ffn_down.weight");
    let (meta, tensors) = tiny_q8_gguf(|name| name == down);
    let mixed = write(tmp.path(), "mixed.gguf", &to_bytes(&meta, &tensors));
    assert_eq!(auto(&mixed), WeightFormat::Q8_0, "one f32 matrix in the last layer");
    assert_eq!(auto(&tiny_dir()), WeightFormat::Q8_0, "f32 safetensors");
    assert_eq!(
        auto(&default_model()),
        WeightFormat::Q8_0,
        "the default model's Q4_1 file"
    );
    assert_eq!(
        resolve_format("AUTO", &ModelFiles::open(&all_q8).unwrap()),
        Ok(WeightFormat::Native)
    );
    assert!(resolve_format("q3", &ModelFiles::open(&all_q8).unwrap()).is_err());
}

#[test]
fn truncated_and_corrupt_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let (meta, tensors) = tiny_as_gguf();
    let bytes = to_bytes(&meta, &tensors);
    for cut in [3, 20, 200, bytes.len() / 2, bytes.len() - 1] {
        let p = write(tmp.path(), "cut.gguf", &bytes[..cut]);
        let e = GgufFile::open(&p).unwrap_err();
        assert!(matches!(e, GgufError::Truncated { .. }), "cut at {cut}: {e}");
        assert!(e.to_string().contains("cut.gguf"), "{e}");
    }
    let mut bad = bytes.clone();
    bad[..4].copy_from_slice(b"GGML");
    let e = GgufFile::open(write(tmp.path(), "magic.gguf", &bad))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
    let mut bad = bytes.clone();
    bad[4] = 1;
    let e = GgufFile::open(write(tmp.path(), "v1.gguf", &bad))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported GGUF version 1"), "{e}");
    // A huge string length must not allocate or panic.
    let mut bad = bytes.clone();
    bad[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = GgufFile::open(write(tmp.path(), "len.gguf", &bad))
        .unwrap_err()
        .to_string();
    assert!(e.contains("truncated or corrupt"), "{e}");
    // A tensor offset at the end of u64 (found by tests/tests/mutated_files.rs: computing the
    // error's offset overflowed) is a truncation error.
    let first = &tensors[0];
    let name_at = bytes
        .windows(first.name.len())
        .position(|w| w == first.name.as_bytes())
        .unwrap();
    let offset_at = name_at + first.name.len() + 4 + 8 * first.shape.len() + 4;
    let mut bad = bytes.clone();
    bad[offset_at..offset_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = GgufFile::open(write(tmp.path(), "offset.gguf", &bad)).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    assert!(
        e.to_string().contains(&format!("data of tensor '{}'", first.name)),
        "{e}"
    );
    // The real model, cut short.
    let real = std::fs::read(default_model()).unwrap();
    let p = write(tmp.path(), "real-cut.gguf", &real[..real.len() - 1000]);
    let e = GgufFile::open(&p).unwrap_err().to_string();
    assert!(e.contains("data of tensor"), "{e}");
}

#[test]
fn missing_extra_misshapen_and_unsupported_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let (meta, mut tensors) = tiny_as_gguf();
    tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    let e = err_of(&write(tmp.path(), "missing.gguf", &to_bytes(&meta, &tensors)));
    assert!(e.contains("missing tensor 'blk.1.ffn_up.weight'"), "{e}");

    let (meta, mut tensors) = tiny_as_gguf();
    tensors.push(TensorToWrite {
        name: "blk.9.surprise.weight".into(),
        shape: vec![4],
        ggml_type: 0,
        data: vec![0; 16],
    });
    let e = err_of(&write(tmp.path(), "extra.gguf", &to_bytes(&meta, &tensors)));
    assert!(
        e.contains("unexpected tensors") && e.contains("blk.9.surprise.weight"),
        "{e}"
    );

    let (meta, mut tensors) = tiny_as_gguf();
    let t = tensors.iter_mut().find(|t| t.name == "blk.0.attn_norm.weight").unwrap();
    t.shape = vec![32];
    t.data.truncate(32 * 4);
    let e = err_of(&write(tmp.path(), "shape.gguf", &to_bytes(&meta, &tensors)));
    assert!(
        e.contains("'blk.0.attn_norm.weight' has shape [32], expected [64]"),
        "{e}"
    );

    let (meta, mut tensors) = tiny_as_gguf();
    let t = tensors.iter_mut().find(|t| t.name == "blk.0.ffn_gate.weight").unwrap();
    t.ggml_type = 12; // Q4_K
    let e = GgufFile::open(write(tmp.path(), "qk.gguf", &to_bytes(&meta, &tensors)))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'blk.0.ffn_gate.weight' has ggml type 12") && e.contains("does not support"),
        "{e}"
    );
}

#[test]
fn non_finite_weights_are_rejected_when_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let (meta, mut tensors) = tiny_as_gguf();
    let t = tensors.iter_mut().find(|t| t.name == "blk.2.attn_v.weight").unwrap();
    t.data[40..44].copy_from_slice(&f32::NAN.to_le_bytes());
    let p = write(tmp.path(), "nan.gguf", &to_bytes(&meta, &tensors));
    let e = err_of(&p);
    assert!(
        e.contains("'blk.2.attn_v.weight' has a non-finite value (NaN) at index 10"),
        "{e}"
    );
    let files = ModelFiles::open(&p).unwrap();
    let cfg = files.config().unwrap();
    assert!(
        StageWeights::load_full(&files, &cfg, false).is_ok(),
        "unchecked load accepts it"
    );
}

#[test]
fn bad_configs_name_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let edit = |f: &dyn Fn(&mut Metadata)| {
        let (mut meta, tensors) = tiny_as_gguf();
        f(&mut meta);
        let p = write(tmp.path(), "cfg.gguf", &to_bytes(&meta, &tensors));
        ModelConfig::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string()
    };
    let e = edit(&|m| m[0].1 = GgufValue::String("gpt2".into()));
    assert!(e.contains("unsupported architecture 'gpt2'"), "{e}");
    let e = edit(&|m| m.retain(|(k, _)| k != "llama.block_count"));
    assert!(e.contains("missing field 'llama.block_count'"), "{e}");
    let e = edit(&|m| {
        m.iter_mut()
            .filter(|(k, _)| k == "llama.attention.head_count_kv")
            .for_each(|kv| kv.1 = GgufValue::U32(3))
    });
    assert!(e.contains("not a multiple of num_key_value_heads 3"), "{e}");

    // Hugging Face directory with an inconsistent config.json.
    let dir = tmp.path().join("hf");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(tiny_dir().join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_dir().join("config.json")).unwrap()).unwrap();
    cfg["num_attention_heads"] = serde_json::json!(5);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("config.json") && e.contains("inconsistent config"), "{e}");
    cfg["num_attention_heads"] = serde_json::json!("four");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("'num_attention_heads'"), "{e}");
    std::fs::write(dir.join("config.json"), "{not json").unwrap();
    let e = err_of(&dir);
    assert!(e.contains("invalid JSON"), "{e}");
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(tiny_dir().join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(tiny_dir().join("model.safetensors")).unwrap();
    for (label, data) in [
        ("truncated", bytes[..bytes.len() - 100].to_vec()),
        ("header", {
            let mut b = bytes.clone();
            b[10] = b'!';
            b
        }),
        ("tiny", bytes[..5].to_vec()),
    ] {
        std::fs::write(dir.join("model.safetensors"), &data).unwrap();
        let e = err_of(&dir);
        assert!(
            e.contains("model.safetensors") && e.contains("invalid safetensors"),
            "{label}: {e}"
        );
    }
    // A well-formed file whose tensor has an integer dtype.
    let data = [0u8; 16];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![4], &data).unwrap();
    safetensors::serialize_to_file([("model.norm.weight", view)], None, &dir.join("model.safetensors")).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("'model.norm.weight' has dtype I32"), "{e}");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("no model.safetensors"), "{e}");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
    )
    .unwrap();
    let e = err_of(&dir);
    assert!(e.contains("not a plain file name"), "{e}");
}

#[test]
fn bad_tokens_and_prompts() {
    let mut engine = Engine::new(load_full(&tiny_dir()).unwrap());
    let e = engine.prompt_logits(&[1, 320], false).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::Forward(ForwardError::TokenOutOfRange { id: 320, vocab: 320 })
        ),
        "{e}"
    );
    let e = engine
        .generate(&[], &SamplingParams::greedy(3), None, |_| {})
        .unwrap_err();
    assert!(matches!(e, EngineError::Forward(ForwardError::Empty)), "{e}");
    let long = vec![1u32; 256];
    let e = engine
        .generate(&long, &SamplingParams::greedy(3), None, |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("prompt of 256 tokens leaves no room"), "{e}");
    let bad = SamplingParams {
        top_p: 2.0,
        ..SamplingParams::greedy(3)
    };
    let e = engine.generate(&[1, 2], &bad, None, |_| {}).unwrap_err().to_string();
    assert!(e.contains("'top_p'"), "{e}");
}

#[test]
fn unknown_model_paths() {
    let e = LoadedModel::open(Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(matches!(e, ModelSourceError::Load(LoadError::NotAModel { .. })), "{e}");
    let tmp = tempfile::tempdir().unwrap();
    let e = LoadedModel::open(tmp.path()).unwrap_err().to_string();
    assert!(
        e.contains("expected a .gguf file or a directory with config.json"),
        "{e}"
    );
}
