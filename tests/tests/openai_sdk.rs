//! `baton serve` as a real process (the default: coordinator + 2 worker processes; and the
//! in-process engine with `--workers 0`), exercised end to end by the official OpenAI Python SDK
//! (tests/python/test_openai_api.py). The interpreter is `$BATON_TEST_PYTHON`
//! (default `python3`); without the `openai` package this test fails, it never skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use baton_tests::serve::Server;
use baton_tests::{baton_bin, default_model};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python/test_openai_api.py")
}

#[test]
fn openai_python_sdk_against_baton_serve_with_two_workers() {
    run_sdk_script(&["--weights", "f32"], &["--prefix-cache"], None);
}

#[test]
fn openai_python_sdk_against_baton_serve_in_process() {
    // The in-process stage has the same prefix cache as a pipeline. This server requires an
    // API key, which the SDK sends; a wrong one gets the SDK's AuthenticationError.
    let key = "sk-baton-test-7f3a";
    let serve = ["--workers", "0", "--weights", "f32", "--api-key", key];
    run_sdk_script(&serve, &["--prefix-cache"], Some(key));
}

/// The script checks greedy answers ("Paris" to the capital of France), so both servers run
/// the reference f32 weights: the chat answer's first token is a near-tie in f32 ("The" 25.33
/// against "L" 25.24), which the default model's own Q4_1 blocks (the `auto` default) flip.
fn run_sdk_script(serve_args: &[&str], script_args: &[&str], api_key: Option<&str>) {
    let python = std::env::var("BATON_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import openai; print(openai.__version__)"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} (set BATON_TEST_PYTHON): {e}"));
    assert!(
        probe.status.success(),
        "the OpenAI Python SDK is not importable by {python}: install it with \
         `{python} -m pip install -r tests/python/requirements.txt` or point BATON_TEST_PYTHON at an \
         interpreter that has it.\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );

    let model = default_model();
    let (mut server, url) = Server::start(&model, serve_args);
    let out = Command::new(&python)
        .arg(script())
        .arg("--baton")
        .arg(baton_bin())
        .arg("--model")
        .arg(&model)
        .args(script_args)
        .env("BATON_BASE_URL", &url)
        .envs(api_key.map(|k| ("BATON_API_KEY", k)))
        .output()
        .expect("running the Python SDK test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Every test function of the script ran and passed: "N passed, 0 failed" with N the number
    // of `def test_` in it ("0 passed, 0 failed" would be a run that checked nothing).
    let want = format!("{} passed, 0 failed", script_tests());
    assert!(
        out.status.success() && stdout.lines().last() == Some(want.as_str()),
        "Python SDK test failed ({}), expected a last line {want:?}:\n{stdout}\n{}\nserver stderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        server.stderr_text()
    );
}

/// Test functions in the script (its runner calls every module-level `test_*` function).
fn script_tests() -> usize {
    let text = std::fs::read_to_string(script()).unwrap();
    let n = text.lines().filter(|l| l.starts_with("def test_")).count();
    assert!(n > 0, "no test functions in {}", script().display());
    n
}
