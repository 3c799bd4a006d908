//! `baton-bench load` from the outside, against a real `baton serve`: every request of every
//! level succeeds with exactly `--max-tokens` tokens and the reported statistics are
//! consistent; a server that is not there gives failed requests and a clear error, fast.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use baton_tests::baton_bench_bin;
use baton_tests::default_model;
use baton_tests::serve::Server;

/// Run `baton-bench load ARGS`, killing it (and failing) if it runs past `limit`; returns
/// its exit status, stdout and stderr.
fn load(args: &[&str], limit: Duration) -> (ExitStatus, String, String) {
    let mut child = Command::new(baton_bench_bin())
        .arg("load")
        .args(args)
        .env_remove("OPENAI_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting baton-bench");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("baton-bench load {args:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, out.join().unwrap(), err.join().unwrap())
}

fn ordered(v: &serde_json::Value, what: &str) {
    let (p50, p90, p99) = (
        v[what]["p50"].as_f64().unwrap_or_else(|| panic!("{what}.p50 in {v}")),
        v[what]["p90"].as_f64().unwrap(),
        v[what]["p99"].as_f64().unwrap(),
    );
    assert!(0.0 < p50 && p50 <= p90 && p90 <= p99, "{what}: {v}");
}

#[test]
fn load_levels_against_baton_serve() {
    let (mut server, url) = Server::start(
        &default_model(),
        &["--workers", "0", "--served-model-name", "load-test"],
    );
    let (status, out, err) = load(
        &[
            "--url",
            &url,
            "--concurrency",
            "1,3",
            "--requests",
            "3",
            "--max-tokens",
            "8",
            "--prompt-tokens",
            "16",
            "--timeout-s",
            "120",
            "--format",
            "json",
        ],
        Duration::from_secs(180),
    );
    assert!(
        status.success(),
        "{status}\nstdout: {out}\nstderr: {err}\nserver: {}",
        server.stderr_text()
    );
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    // No --model: the first id of /v1/models.
    assert_eq!(report["model"], "load-test", "{report}");
    let levels = report["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2, "{report}");
    for (level, concurrency) in levels.iter().zip([1, 3]) {
        assert_eq!(level["concurrency"], concurrency, "{level}");
        assert_eq!(level["requests_ok"], 3, "{level}");
        assert_eq!(level["requests_failed"], 0, "{level}");
        assert_eq!(level["output_tokens"], 3 * 8, "{level}");
        for what in ["ttft_s", "itl_s", "tpot_s", "e2e_s"] {
            ordered(level, what);
        }
        assert!(
            level["e2e_s"]["p50"].as_f64() > level["ttft_s"]["p50"].as_f64(),
            "{level}"
        );
        assert!(level["output_tok_per_s"].as_f64().unwrap() > 0.0, "{level}");
        assert!(level["stream_tok_per_s_mean"].as_f64().unwrap() > 0.0, "{level}");
    }

    // The chat endpoint, named model, text report.
    let (status, out, err) = load(
        &[
            "--url",
            &url,
            "--model",
            "load-test",
            "--endpoint",
            "chat",
            "--concurrency",
            "2",
            "--requests",
            "2",
            "--max-tokens",
            "4",
            "--prompt-tokens",
            "8",
        ],
        Duration::from_secs(120),
    );
    assert!(status.success(), "{status}\nstdout: {out}\nstderr: {err}");
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("2 "))
        .unwrap_or_else(|| panic!("no row for concurrency 2:\n{out}"));
    assert!(row.contains("2/0"), "{out}");

    // A model the server does not serve: every request fails with the server's message.
    let (status, out, _) = load(
        &[
            "--url",
            &url,
            "--model",
            "nope",
            "--requests",
            "2",
            "--max-tokens",
            "4",
            "--format",
            "json",
        ],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let level = &report["levels"][0];
    assert_eq!(level["requests_failed"], 2, "{level}");
    let first = level["first_error"].as_str().unwrap();
    assert!(first.starts_with("HTTP 404") && first.contains("`nope`"), "{first}");
}

#[test]
fn closed_port_fails_fast_with_a_clear_error() {
    // A port that was free a moment ago and has nothing listening now.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");

    // "Fast": the requests fail on the refused connection, not at the level's time limit,
    // which is set far beyond the time `load` allows the whole run (a run that waited for it
    // is killed and fails), and the errors must say the connection was refused.
    let (status, out, err) = load(
        &[
            "--url",
            &url,
            "--model",
            "m",
            "--concurrency",
            "1,2",
            "--requests",
            "4",
            "--timeout-s",
            "3600",
            "--format",
            "json",
        ],
        Duration::from_secs(300),
    );
    assert!(!status.success(), "failures give a non-zero exit\n{out}");
    assert!(err.contains("8 of 8 requests failed"), "{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    for level in report["levels"].as_array().unwrap() {
        assert_eq!(level["requests_ok"], 0, "{level}");
        assert_eq!(level["requests_failed"], 4, "{level}");
        assert!(level["ttft_s"].is_null(), "{level}");
        assert_eq!(level["output_tok_per_s"], 0.0, "{level}");
        let e = level["first_error"].as_str().unwrap().to_lowercase();
        assert!(e.contains("connection refused") || e.contains("connect"), "{e}");
        assert!(!e.contains("timed out"), "{e}");
    }

    // Without --model the lookup itself fails, naming the URL and the way around it.
    let (status, out, err) = load(&["--url", &url], Duration::from_secs(60));
    assert!(!status.success());
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("/v1/models") && err.contains("--model"), "{err}");
}

#[test]
fn a_stalled_server_is_cut_off_at_the_level_timeout() {
    // Accepts connections and answers with stream headers, then never sends an event.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut conn in listener.incoming().map_while(Result::ok) {
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n");
            held.push(conn);
        }
    });
    // Cut off, not hung: `load` kills a run that outlives its generous limit and fails; the
    // report below shows the level timeout is what ended the streams.
    let (status, out, _) = load(
        &[
            "--url",
            &url,
            "--model",
            "m",
            "--concurrency",
            "2",
            "--requests",
            "5",
            "--timeout-s",
            "2",
            "--format",
            "json",
        ],
        Duration::from_secs(300),
    );
    assert!(!status.success());
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let level = &report["levels"][0];
    // Both streams are aborted at the bound; the other three requests are never sent.
    assert_eq!(level["requests_failed"], 2, "{level}");
    assert_eq!(level["requests_not_sent"], 3, "{level}");
    assert!(level["first_error"].as_str().unwrap().contains("timed out"), "{level}");
    assert!(level["wall_s"].as_f64().unwrap() >= 1.9, "{level}");
}
