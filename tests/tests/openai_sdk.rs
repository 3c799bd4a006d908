//! `baton serve` as a real process (the default: coordinator + 2 worker processes; and the
//! in-process engine with `--workers 0`), exercised end to end by the official OpenAI Python SDK
//! (tests/python/test_openai_api.py). The interpreter is `$BATON_TEST_PYTHON`
//! (default `python3`); without the `openai` package this test fails, it never skips.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use baton_tests::{baton_bin, default_model};

/// Test inputs that share baton's `BATON_` prefix but are not settings, kept away from baton.
const NOT_SETTINGS: &[&str] = &["BATON_TEST_PYTHON", "BATON_BASE_URL"];

/// A `baton serve` child process, killed when dropped.
struct Server {
    child: Child,
    stderr: tempfile::NamedTempFile,
}

impl Server {
    /// Start `baton serve EXTRA --port 0` on a free port; returns it and its `/v1` base URL.
    fn start(model: &Path, extra: &[&str]) -> (Self, String) {
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let mut cmd = Command::new(baton_bin());
        cmd.arg("serve")
            .args(extra)
            .args(["--port", "0", "--model"])
            .arg(model)
            .stdout(Stdio::piped())
            .stderr(stderr.reopen().unwrap());
        for var in NOT_SETTINGS {
            cmd.env_remove(var);
        }
        let mut child = cmd.spawn().expect("starting baton serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut server = Self { child, stderr };
        // "Baton serving NAME at http://HOST:PORT/v1"
        let line = rx.recv_timeout(Duration::from_secs(180)).unwrap_or_else(|e| {
            panic!(
                "baton serve printed no ready line ({e}); stderr:\n{}",
                server.stderr_text()
            )
        });
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in {line:?}"))
            .to_string();
        assert!(line.starts_with("Baton serving "), "{line}");
        server.wait_ready(&url);
        (server, url)
    }

    fn stderr_text(&mut self) -> String {
        let mut s = String::new();
        let _ = self.stderr.reopen().and_then(|mut f| f.read_to_string(&mut s));
        s
    }

    /// Poll `GET /ready` until it answers 200.
    fn wait_ready(&mut self, base_url: &str) {
        let addr = base_url
            .trim_start_matches("http://")
            .trim_end_matches("/v1")
            .to_string();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("baton serve exited ({status}); stderr:\n{}", self.stderr_text());
            }
            if http_status(&addr, "/ready") == Some(200) {
                return;
            }
            assert!(Instant::now() < deadline, "/ready never answered 200");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status code of `GET path`, or None if the server does not answer.
fn http_status(addr: &str, path: &str) -> Option<u16> {
    let mut conn = TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(conn, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python/test_openai_api.py")
}

#[test]
fn openai_python_sdk_against_baton_serve_with_two_workers() {
    run_sdk_script(&[]);
}

#[test]
fn openai_python_sdk_against_baton_serve_in_process() {
    run_sdk_script(&["--workers", "0"]);
}

fn run_sdk_script(serve_args: &[&str]) {
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
        .env("BATON_BASE_URL", &url)
        .output()
        .expect("running the Python SDK test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "Python SDK test failed ({}):\n{stdout}\n{}\nserver stderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        server.stderr_text()
    );
}
