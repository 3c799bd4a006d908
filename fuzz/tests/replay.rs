//! Replays every committed input (the seed corpus and the regressions: inputs that once made
//! a target fail) through its target without libFuzzer, so `cargo test` guards the fixes:
//!
//!     cargo test --manifest-path fuzz/Cargo.toml --no-default-features

use std::path::Path;

use baton_fuzz::targets;

/// Every target, by the name of its fuzz_targets/ file and corpus/ directory.
pub const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("gguf", targets::gguf),
    ("safetensors", targets::safetensors),
    ("safetensors_index", targets::safetensors_index),
    ("model_config", targets::model_config),
    ("generation_config", targets::generation_config),
    ("tokenizer_json", targets::tokenizer_json),
    ("tokenizer_config", targets::tokenizer_config),
    ("tokenizer_gguf", targets::tokenizer_gguf),
    ("chat_template_render", targets::chat_template_render),
    ("chat_template_source", targets::chat_template_source),
    ("proto_decode", targets::proto_decode),
    ("worker_stage", targets::worker_stage),
    ("registry", targets::registry),
    ("http_completions", targets::http_completions),
    ("http_chat", targets::http_chat),
];

fn replay(kind: &str) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(kind);
    let mut n = 0;
    for (name, run) in TARGETS {
        let Ok(entries) = std::fs::read_dir(root.join(name)) else {
            continue;
        };
        let mut files: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
        files.sort();
        for f in files {
            eprintln!("{kind}/{name}: {}", f.display());
            run(&std::fs::read(&f).unwrap());
            n += 1;
        }
    }
    n
}

#[test]
fn every_target_is_listed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz_targets");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path().file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let mut listed: Vec<String> = TARGETS.iter().map(|(n, _)| n.to_string()).collect();
    listed.sort();
    assert_eq!(files, listed);
}

/// libFuzzer starts every run with the empty input.
#[test]
fn empty_input_is_handled() {
    for (name, run) in TARGETS {
        eprintln!("empty input: {name}");
        run(&[]);
    }
}

#[test]
fn seed_corpus_replays() {
    assert!(replay("corpus") > 0, "no seed corpus: run the seeds example");
}

#[test]
fn regressions_replay() {
    replay("regressions");
}
