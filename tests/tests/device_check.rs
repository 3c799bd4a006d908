//! `baton device-check`, the report a GPU host is checked with (bench/gpu/check.sh), proven on
//! the CPU: `--dry-run` runs every part (kernels against the reference, whole-model parity in
//! three modes, batch invariance, speed) with the CPU as the device under test. A GPU without a
//! backend in the build is reported by name, not by a panic.

use std::process::Command;

use baton_tests::{baton_bin, fixtures};
use serde_json::Value;

fn run(args: &[&str]) -> (std::process::Output, Value) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report.json");
    let output = Command::new(baton_bin())
        .arg("device-check")
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("running baton device-check");
    let report = std::fs::read_to_string(&out)
        .map(|s| serde_json::from_str(&s).expect("the report is JSON"))
        .unwrap_or(Value::Null);
    (output, report)
}

#[test]
fn the_dry_run_checks_every_part_on_the_cpu() {
    let tiny = fixtures().join("tiny");
    // A hybrid too: its sequences keep recurrent state, one slot each.
    let (llama, qwen3, next) = (tiny.join("llama_tied"), tiny.join("qwen3"), tiny.join("qwen3_next"));
    let (output, report) = run(&[
        "--dry-run",
        "--parity-model",
        llama.to_str().unwrap(),
        "--parity-model",
        qwen3.to_str().unwrap(),
        "--parity-model",
        next.to_str().unwrap(),
        "--speed-model",
        llama.to_str().unwrap(),
        "--prefill-tokens",
        "64",
        "--decode-steps",
        "2",
        "--batches",
        "1,4",
        "--greedy-steps",
        "8",
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(report["device"], "cpu:2");
    let cases = report["kernels"]["cases"].as_array().expect("kernel cases");
    // Six matrix formats with and without bias, nine row-wise operations, five fused forms,
    // two mixtures of experts (Q8_0, Q4_1) two ways each and the Q8_0 one routed on the
    // device, at four batch sizes.
    assert_eq!(cases.len(), 4 * (12 + 9 + 5 + 5), "{cases:?}");
    assert_eq!(report["kernels"]["failed"], 0, "{cases:?}");
    // The CPU samples on the host: the part says so rather than comparing the reference with
    // itself.
    assert!(report["sampling"]["skipped"].is_string(), "{}", report["sampling"]);
    for model in [&llama, &qwen3, &next] {
        let part = &report[format!("parity:{}", model.display())];
        let modes = part["modes"].as_array().unwrap_or_else(|| panic!("{part}"));
        assert_eq!(modes.len(), 4);
        for m in modes {
            // The CPU against the single-thread CPU: the same bits in every mode.
            assert_eq!(m["ok"], true, "{m}");
            assert_eq!(m["greedy_equal"], true, "{m}");
            assert_eq!(m["max_abs_logit_error"], 0.0, "{m}");
            assert_eq!(m["top1_agreement"], "33/33", "{m}");
        }
        assert_eq!(part["batch_invariance"]["bit_identical"], true, "{part}");
        // The tiny models' context (256 positions) bounds the long prompt.
        let long = part["long_prompt"].as_array().unwrap_or_else(|| panic!("{part}"));
        assert_eq!(long.len(), 2, "{part}");
        for m in long {
            assert_eq!(m["prompt_positions"], 256, "{m}");
            assert_eq!(m["ok"], true, "{m}");
            assert_eq!(m["max_abs_logit_error"], 0.0, "{m}");
        }
    }
    let speed = &report[format!("speed:{}", llama.display())];
    let decode = speed["decode"].as_array().unwrap_or_else(|| panic!("{speed}"));
    assert_eq!(
        decode.iter().map(|d| d["batch"].as_u64().unwrap()).collect::<Vec<_>>(),
        [1, 4]
    );
    assert!(decode.iter().all(|d| d["tok_s"].as_f64().unwrap() > 0.0), "{speed}");
    assert_eq!(speed["prefill"]["tokens"], 64);
    let products = report["bandwidth"]["q8_0_products"].as_array().expect("bandwidth rows");
    // Two matrices at 1, 8 and 32 rows.
    assert_eq!(products.len(), 6);
}

#[test]
fn a_gpu_this_build_cannot_use_is_reported_by_name() {
    let (output, report) = run(&["--device", "cuda:0"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    for part in ["kernels", "bandwidth"] {
        let e = report[part]["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{part}: {report}"));
        assert!(
            e.contains("no CUDA backend") || e.contains("no NVIDIA driver"),
            "{part}: {e}"
        );
    }
}

#[test]
fn generate_takes_a_device() {
    let model = fixtures().join("tiny").join("llama_tied");
    let generate = |device: &str| {
        Command::new(baton_bin())
            .args(["generate", "--model", model.to_str().unwrap(), "--tokens", "1,2,3"])
            .args(["--max-tokens", "3", "--format", "json", "--device", device])
            .output()
            .expect("running baton generate")
    };
    let cpu = generate("cpu:1");
    assert!(cpu.status.success(), "{}", String::from_utf8_lossy(&cpu.stderr));
    let out: Value = serde_json::from_slice(&cpu.stdout).expect("JSON output");
    assert_eq!(out["tokens"].as_array().map(Vec::len), Some(3), "{out}");
    // This build (or this host) has no GPU backend: refused by name, before anything loads.
    let gpu = generate("cuda:0");
    let e = String::from_utf8_lossy(&gpu.stderr);
    assert!(
        !gpu.status.success() && (e.contains("no CUDA backend") || e.contains("no NVIDIA driver")),
        "{e}"
    );
    let bad = generate("tpu");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad device 'tpu'"));
}
