//! The `baton-bench` command line from the outside: every benchmark is listed, and bad flags
//! are refused by name.
//!
//! Being an integration test of this package, it also makes `cargo test --workspace` build the
//! `baton-bench` binary, which tests/tests/load_bench.rs runs against a real server.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_baton-bench"))
        .args(args)
        .output()
        .expect("running baton-bench")
}

#[test]
fn help_lists_every_benchmark_and_bad_flags_are_refused() {
    let out = bench(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    for command in ["serve-decode", "load", "reference", "perplexity", "kernels", "synth"] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(command)),
            "{command} missing from:\n{help}"
        );
    }
    let out = bench(&["load", "--concurrency", "two"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--concurrency") && err.contains("two"), "{err}");
    let out = bench(&["no-such-benchmark"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-benchmark"));
}

#[test]
fn a_synthetic_mixture_of_experts_loads_and_generates_with_its_tokenizer() {
    let dir = std::env::temp_dir().join(format!("baton-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("moe.gguf");
    let tokenizer = baton_shared::fetch::baton_home()
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let run = bench(&[
        "synth",
        "--arch",
        "qwen3moe",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "32",
        "--experts",
        "10",
        "--experts-used",
        "3",
        "--expert-ffn",
        "32",
        "--tokenizer-from",
        tokenizer.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{run:?}");
    let loaded = baton_shared::model_source::LoadedModel::open(&out).unwrap();
    let moe = loaded.config.moe.clone().expect("a mixture of experts");
    assert_eq!(
        (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size),
        (10, 3, 32)
    );
    assert!(moe.norm_topk_prob, "llama.cpp's qwen3moe renormalizes");
    // Every matrix is Q8_0, stacked experts included, so `auto` keeps the file's blocks.
    let format = baton_worker::model::auto_format(&loaded.files);
    assert_eq!(format, baton_worker::model::WeightFormat::Native);
    let opts = baton_worker::model::LoadOptions {
        format,
        ..Default::default()
    };
    let w = baton_worker::model::StageWeights::load_full_with(&loaded.files, &loaded.config, true, &opts).unwrap();
    let mut engine = baton_worker::engine::Engine::new(w);
    let prompt = loaded.tokenizer.encode("Hello there", true).unwrap();
    let params = baton_shared::sampling::SamplingParams {
        ignore_eos: true,
        ..baton_shared::sampling::SamplingParams::greedy(4)
    };
    let got = engine.generate(&prompt, &params, None, |_| {}).unwrap();
    assert_eq!(got.tokens.len(), 4);
    assert!(got.tokens.iter().all(|&t| (t as usize) < loaded.config.vocab_size));
    // A bad shape is refused by name.
    let bad = bench(&[
        "synth",
        "--arch",
        "qwen3",
        "--layers",
        "1",
        "--hidden",
        "60",
        "--heads",
        "4",
        "--ffn",
        "64",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("multiple of 32"),
        "{bad:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
