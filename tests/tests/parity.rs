//! The fp32 path against Hugging Face transformers fixtures (tests/fixtures/generate.py):
//! logits within 1e-4, identical greedy tokens and token ids, and stage splits that change nothing.

use baton_shared::chat_template::{ChatMessage, ChatTemplate};
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::LoadedModel;
use baton_shared::sampling::SamplingParams;
use baton_shared::tokenizer::IncrementalDecoder;
use baton_tests::{default_model, f32s, fixtures, ids, max_abs_diff, read_json};
use baton_worker::engine::Engine;
use baton_worker::model::{Scratch, StageWeights};

const TOL: f32 = 1e-4;
const TINY: &[&str] = baton_tests::TINY_MODELS;

fn tiny_engine(name: &str) -> (ModelFiles, Engine) {
    let files = ModelFiles::open(&fixtures().join("tiny").join(name)).unwrap();
    let cfg = files.config().unwrap();
    let weights = StageWeights::load_full(&files, &cfg, true).unwrap();
    (files, Engine::new(weights))
}

#[test]
fn tiny_models_match_transformers_logits_at_every_position() {
    for name in TINY {
        let (_, mut engine) = tiny_engine(name);
        let vocab = engine.weights.config.vocab_size;
        let reference = read_json(&fixtures().join("tiny").join(name).join("reference.json"));
        for (i, seq) in reference["sequences"].as_array().unwrap().iter().enumerate() {
            let tokens = ids(&seq["tokens"]);
            let got = engine.prompt_logits(&tokens, true).unwrap();
            let want: Vec<f32> = seq["logits"].as_array().unwrap().iter().flat_map(f32s).collect();
            assert_eq!(got.len(), tokens.len() * vocab);
            let err = max_abs_diff(&got, &want);
            eprintln!("{name} sequence {i}: max |logit error| {err:e}");
            assert!(err < TOL, "{name} sequence {i}: max |logit error| {err}");
        }
    }
}

#[test]
fn tiny_models_match_transformers_greedy_tokens() {
    for name in TINY {
        let (_, mut engine) = tiny_engine(name);
        let reference = read_json(&fixtures().join("tiny").join(name).join("reference.json"));
        for case in reference["greedy"].as_array().unwrap() {
            let prompt = ids(&case["prompt"]);
            let n = case["max_new_tokens"].as_u64().unwrap() as usize;
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(n)
            };
            let out = engine.generate(&prompt, &params, None, |_| {}).unwrap();
            assert_eq!(out.tokens, ids(&case["tokens"]), "{name} prompt {prompt:?}");
        }
    }
}

#[test]
fn a_qwen3_moe_gguf_file_gives_the_same_model_as_its_safetensors() {
    // model.gguf was written by the fixture script with gguf-py's own llama.cpp names, each
    // layer's experts stacked into one tensor per projection.
    let dir = fixtures().join("tiny").join("qwen3_moe");
    let gguf = ModelFiles::open(&dir.join("model.gguf")).unwrap();
    let hf = ModelFiles::open(&dir).unwrap();
    let (gc, hc) = (gguf.config().unwrap(), hf.config().unwrap());
    assert_eq!(gc.moe, hc.moe, "the expert settings read from GGUF metadata");
    assert_eq!(
        (gc.head_dim, gc.num_layers, gc.qk_norm),
        (hc.head_dim, hc.num_layers, true)
    );
    let mut from_gguf = Engine::new(StageWeights::load_full(&gguf, &gc, true).unwrap());
    let mut from_hf = Engine::new(StageWeights::load_full(&hf, &hc, true).unwrap());
    let reference = read_json(&dir.join("reference.json"));
    for seq in reference["sequences"].as_array().unwrap() {
        let tokens = ids(&seq["tokens"]);
        let got = from_gguf.prompt_logits(&tokens, true).unwrap();
        assert_eq!(
            got,
            from_hf.prompt_logits(&tokens, true).unwrap(),
            "{} tokens",
            tokens.len()
        );
        let want: Vec<f32> = seq["logits"].as_array().unwrap().iter().flat_map(f32s).collect();
        assert!(max_abs_diff(&got, &want) < TOL);
    }
}

/// Run `tokens` through stages split at `cuts`, one stage after the other, as a pipeline would.
fn pipeline_logits(files: &ModelFiles, cuts: &[usize], tokens: &[u32]) -> Vec<f32> {
    let cfg = files.config().unwrap();
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(cfg.num_layers);
    let stages: Vec<StageWeights> = bounds
        .windows(2)
        .enumerate()
        .map(|(i, w)| StageWeights::load(files, &cfg, w[0]..w[1], i == 0, i == bounds.len() - 2, true).unwrap())
        .collect();
    let mut hidden = vec![0f32; tokens.len() * cfg.hidden_size];
    let mut scratch = Scratch::default();
    stages[0].embed(tokens, &mut hidden).unwrap();
    for s in &stages {
        let mut kv = s.new_kv(tokens.len());
        s.forward(&mut hidden, 0, &mut kv, &mut scratch).unwrap();
    }
    let mut out = vec![0f32; tokens.len() * cfg.vocab_size];
    stages.last().unwrap().logits(&hidden, &mut scratch, &mut out).unwrap();
    out
}

#[test]
fn split_stages_give_identical_logits() {
    for name in ["llama_untied", "qwen2", "qwen3"] {
        let (files, mut engine) = tiny_engine(name);
        let tokens = [5u32, 17, 200, 3, 99, 42];
        let whole = engine.prompt_logits(&tokens, true).unwrap();
        for cuts in [&[1][..], &[2], &[1, 2]] {
            assert_eq!(
                pipeline_logits(&files, cuts, &tokens),
                whole,
                "{name} split at {cuts:?}"
            );
        }
    }
    let files = ModelFiles::open(&default_model()).unwrap();
    let cfg = files.config().unwrap();
    let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap());
    let tokens = [504u32, 3575, 282, 4649, 314];
    let whole = engine.prompt_logits(&tokens, true).unwrap();
    assert_eq!(pipeline_logits(&files, &[15], &tokens), whole, "SmolLM2 split 15/15");
}

fn smollm2() -> LoadedModel {
    LoadedModel::open(&default_model()).unwrap()
}

#[test]
fn smollm2_token_ids_match_original_tokenizer() {
    let model = smollm2();
    let tok = &model.tokenizer;
    let fx = read_json(&fixtures().join("smollm2/tokens.json"));
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), want, "ids of {text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), text, "round trip of {text:?}");
    }
    let template = tok.chat_template.as_deref().expect("SmolLM2 ships a chat template");
    let name = |id: u32| tok.id_to_token(id).unwrap();
    let tmpl = ChatTemplate::new(template, &name(tok.bos_id.unwrap()), &name(tok.eos_ids[0])).unwrap();
    for case in fx["chat"].as_array().unwrap() {
        let msg = ChatMessage {
            role: "user".into(),
            content: case["user"].as_str().unwrap().into(),
        };
        let text = tmpl.render(&[msg], true).unwrap();
        assert_eq!(text, case["templated"].as_str().unwrap());
        assert_eq!(tok.encode(&text, false).unwrap(), ids(&case["ids"]));
    }
}

#[test]
fn smollm2_digits_are_split_before_byte_level() {
    // transformers' own GGUF tokenizer gets these wrong; the original SmolLM2 tokenizer does not.
    let model = smollm2();
    let fx = read_json(&fixtures().join("smollm2/tokens.json"));
    let differing: Vec<_> = fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ids"] != c["transformers_gguf_ids"])
        .collect();
    assert!(
        !differing.is_empty(),
        "fixtures should include texts where the digit split matters"
    );
    for case in differing {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            model.tokenizer.encode(text, true).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
    }
}

#[test]
fn incremental_decoding_is_utf8_safe() {
    let model = smollm2();
    let tok = &model.tokenizer;
    for text in [
        "I love 🦀 and 🐍! 👍🏽 ❤️",
        "你好，世界。今日は良い天気です。",
        "Ångström naïve",
    ] {
        let token_ids = tok.encode(text, false).unwrap();
        let mut dec = IncrementalDecoder::new(true);
        let mut out = String::new();
        for &id in &token_ids {
            let delta = dec.push(tok, id).unwrap();
            assert!(!delta.contains('\u{FFFD}'), "half a character leaked for {text:?}");
            out.push_str(&delta);
        }
        out.push_str(&dec.finish(tok).unwrap());
        assert_eq!(out, text);
    }
}

#[test]
fn smollm2_logits_match_transformers() {
    let model = smollm2();
    let mut engine = Engine::new(StageWeights::load_full(&model.files, &model.config, true).unwrap());
    let fx = read_json(&fixtures().join("smollm2/logits.json"));
    for p in fx["prompts"].as_array().unwrap() {
        let tokens = ids(&p["ids"]);
        assert_eq!(
            model.tokenizer.encode(p["text"].as_str().unwrap(), true).unwrap(),
            tokens
        );
        let bytes = std::fs::read(fixtures().join("smollm2").join(p["logits_file"].as_str().unwrap())).unwrap();
        let want: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let got = engine.prompt_logits(&tokens, false).unwrap();
        let err = max_abs_diff(&got, &want);
        eprintln!("SmolLM2 {:?}: max |logit error| {err:e}", p["text"]);
        assert!(err < TOL, "{:?}: max |logit error| {err}", p["text"]);
    }
}

#[test]
fn smollm2_greedy_matches_transformers() {
    let model = smollm2();
    let mut engine = Engine::new(StageWeights::load_full(&model.files, &model.config, true).unwrap());
    let fx = read_json(&fixtures().join("smollm2/greedy.json"));
    for case in fx["cases"].as_array().unwrap() {
        let prompt = ids(&case["ids"]);
        let n = case["max_new_tokens"].as_u64().unwrap() as usize;
        let mut streamed = String::new();
        let out = engine
            .generate(&prompt, &SamplingParams::greedy(n), Some(&model.tokenizer), |t| {
                streamed.push_str(t)
            })
            .unwrap();
        assert_eq!(out.tokens, ids(&case["tokens"]));
        assert_eq!(out.text, streamed, "streamed text equals the final text");
        // transformers decodes without skipping special tokens; Baton's text drops them.
        let want = case["text"].as_str().unwrap().replace("<|im_end|>", "");
        assert_eq!(out.text, want);
    }
}

#[test]
fn a_sentencepiece_gguf_tokenizer_gives_sentencepiece_ids_and_text() {
    // Mistral 7B v0.1's SentencePiece model laid out as llama.cpp's converter writes it, and the
    // ids SentencePiece itself gives (tests/fixtures/generate_spm.py): digits, whitespace runs,
    // CJK, emoji (byte fallback), code.
    let dir = fixtures().join("spm");
    let g = baton_shared::gguf::GgufFile::open(dir.join("mistral-v1-tokenizer.gguf")).unwrap();
    let tok = baton_shared::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    assert_eq!((tok.bos_id, tok.eos_ids.clone(), tok.add_bos), (Some(1), vec![2], true));
    let cases = read_json(&dir.join("cases.json"));
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
        let decoded = tok.decode(&want[1..], true).unwrap();
        assert_eq!(decoded, case["decoded"].as_str().unwrap(), "{text:?}");
        // Streamed token by token, the text is the same.
        let mut dec = IncrementalDecoder::new(true);
        let mut streamed = String::new();
        for &id in &want[1..] {
            streamed += &dec.push(&tok, id).unwrap();
        }
        streamed += &dec.finish(&tok).unwrap();
        assert_eq!(streamed, decoded, "{text:?} streamed");
    }
}

#[test]
fn every_gguf_pre_tokenizer_splits_as_the_tokenizers_package_does() {
    // tests/fixtures/generate_pretokenizers.py: each family's pre-tokenizer as its
    // tokenizer.json declares it, run by the `tokenizers` Python package on a corpus with
    // digits, whitespace runs, CJK, emoji, combining marks and code.
    let cases = read_json(&fixtures().join("pretokenizers.json"));
    let mut names = std::collections::BTreeSet::new();
    for case in cases["cases"].as_array().unwrap() {
        let (pre, text) = (case["pre"].as_str().unwrap(), case["text"].as_str().unwrap());
        let want: Vec<&str> = case["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        let got = baton_shared::tokenizer::gguf_pre_tokenize(pre, text).unwrap();
        assert_eq!(got, want, "{pre}: {text:?}");
        names.insert(pre);
    }
    assert_eq!(names.len(), 5, "{names:?}");
}
