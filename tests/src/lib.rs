//! Helpers for Baton's integration tests: fixture paths, the default model, the `baton` binary,
//! and a loopback cluster of real worker processes.

pub mod cluster;
pub mod serve;
pub mod tiny_gguf;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use baton_shared::fetch::{Sources, baton_home, ensure_default_model};

/// Every tiny model of tests/fixtures/tiny, as the parity tests check them.
pub const TINY_MODELS: &[&str] = &[
    "llama_tied",
    "llama_untied",
    "llama_sharded",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_moe_dense_mix",
];

/// The tiny hybrid models (linear attention with recurrent state between full-attention
/// layers), checked by tests/tests/hybrid.rs.
pub const HYBRID_MODELS: &[&str] = &[
    "qwen3_next",
    "qwen3_next_dense",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_vl",
];

/// One stage, then every way to cut `layers` into 2 and into 3 stages (the cuts of each).
pub fn every_split(layers: usize) -> Vec<Vec<usize>> {
    let mut out = vec![vec![]];
    out.extend((1..layers).map(|c| vec![c]));
    for a in 1..layers {
        out.extend((a + 1..layers).map(|b| vec![a, b]));
    }
    out
}

/// `tests/fixtures/` in the repository.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The default model (SmolLM2-135M-Instruct GGUF), fetched into `$BATON_HOME` on first use.
///
/// Fetching is part of what is under test: if no source is reachable the test fails with the
/// fetch error rather than being skipped.
pub fn default_model() -> PathBuf {
    ensure_default_model(&baton_home(), &Sources::default(), false).expect("fetching the default model")
}

/// The `baton` binary built alongside the tests (`target/<profile>/baton`), or `$BATON_BIN`.
pub fn baton_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("BATON_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(Path::parent).expect("target directory");
    let bin = dir.join(format!("baton{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} not found: run the tests with `cargo test --workspace` so it is built",
        bin.display()
    );
    bin
}

/// The `baton-bench` binary next to `baton` (built by `cargo test --workspace` for the bench
/// package's own integration test, or by `cargo build -p baton-bench`), or `$BATON_BENCH_BIN`.
pub fn baton_bench_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("BATON_BENCH_BIN") {
        return p.into();
    }
    let bin = baton_bin().with_file_name(format!("baton-bench{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} not found: run the tests with `cargo test --workspace` so it is built",
        bin.display()
    );
    bin
}

/// Run `baton` with arguments; the environment is inherited.
pub fn baton(args: &[&str]) -> Output {
    Command::new(baton_bin()).args(args).output().expect("running baton")
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Read a JSON file.
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON array of numbers as f32.
pub fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

/// A JSON array of numbers as token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// How long a test waits for something that should happen promptly (a worker registering, a
/// stage noticing a death, KV blocks coming back): generous, so a loaded 2-core machine does
/// not fail a test by being slow. Tests poll for the condition rather than sleep for a time.
pub const PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// Poll `check` until it returns Ok, at most [`PATIENCE`]; panics with `what` and the last
/// Err (the state it saw) if it never does. Returns how long it took.
pub fn wait_until(what: &str, mut check: impl FnMut() -> Result<(), String>) -> std::time::Duration {
    let start = std::time::Instant::now();
    loop {
        match check() {
            Ok(()) => return start.elapsed(),
            Err(state) if start.elapsed() > PATIENCE => {
                panic!("{what}: not so after {PATIENCE:?} ({state})")
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
}

/// [`wait_until`] for async checks, sleeping on the tokio timer between polls.
pub async fn wait_until_async<F: std::future::Future<Output = Result<(), String>>>(
    what: &str,
    mut check: impl FnMut() -> F,
) -> std::time::Duration {
    let start = std::time::Instant::now();
    loop {
        match check().await {
            Ok(()) => return start.elapsed(),
            Err(state) if start.elapsed() > PATIENCE => {
                panic!("{what}: not so after {PATIENCE:?} ({state})")
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
}
