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
    for command in ["serve-decode", "load", "reference", "perplexity", "kernels"] {
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
