//! `baton serve` from the outside: with worker processes, a worker dying mid-stream loses no
//! request (streams pause and continue with the same text) and is started again; with
//! `--workers 0`, the in-process stage batches like a pipeline and reports its stage.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Instant;

use baton_tests::default_model;
use baton_tests::serve::{Server, http_request};

/// A greedy completion request of 160 tokens.
fn request(prompt: &str, stream: bool) -> String {
    format!(r#"{{"prompt": "{prompt}", "max_tokens": 160, "ignore_eos": true, "stream": {stream}, "temperature": 0}}"#)
}

/// The text of a non-streaming completion.
fn complete(addr: &str, prompt: &str) -> String {
    let (code, body) = http_request(addr, "POST", "/v1/completions", &request(prompt, false));
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn a_killed_worker_loses_no_stream_and_is_started_again() {
    let model = default_model();
    let (mut server, url) = Server::start(&model, &["--workers", "2"]);
    let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
    let workers = server.children();
    assert_eq!(workers.len(), 2, "baton serve runs two worker processes: {workers:?}");
    let (code, body) = http_request(&addr, "GET", "/admin/cluster", "");
    assert_eq!(code, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["mode"], "pipeline");
    assert_eq!(view["workers"].as_array().unwrap().len(), 2, "{view}");
    let ranges: Vec<_> = view["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["layer_start"].clone(), s["layer_end"].clone()))
        .collect();
    // The split is planned from the two workers' measured costs: contiguous, covering all 30
    // layers, each stage with a predicted time for a prompt chunk and for a decode step.
    assert_eq!(view["split"]["policy"], "measured", "{view}");
    assert_eq!((&ranges[0].0, &ranges[1].1), (&0.into(), &30.into()), "{view}");
    assert_eq!(ranges[0].1, ranges[1].0, "{view}");
    for s in view["stages"].as_array().unwrap() {
        for shape in ["prompt_chunk", "decode"] {
            assert!(s["predicted_ms"][shape].as_f64().is_some_and(|ms| ms > 0.0), "{s}");
        }
    }

    // What an undisturbed pipeline answers, streamed and not.
    let (story, code) = ("Once upon a time", "def fibonacci(n):");
    let want_story = complete(&addr, story);
    let want_code = complete(&addr, code);

    let body = request(story, true);
    let mut conn = TcpStream::connect(&addr).unwrap();
    // A stream that neither ends nor fails ends the test instead of hanging it.
    conn.set_read_timeout(Some(2 * baton_tests::PATIENCE)).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // A non-streaming request in flight beside it.
    let beside = {
        let addr = addr.clone();
        std::thread::spawn(move || complete(&addr, code))
    };
    let mut lines = BufReader::new(conn).lines();
    let mut text = String::new();
    let mut take = |line: &str| -> bool {
        if let Some(json) = line.strip_prefix("data: {") {
            let v: serde_json::Value = serde_json::from_str(&format!("{{{json}")).unwrap();
            assert!(v.get("error").is_none(), "the stream failed: {line}");
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
            return true;
        }
        false
    };
    // Wait for generated text, then kill the second stage.
    let mut seen = 0;
    for line in lines.by_ref() {
        if take(&line.unwrap()) {
            seen += 1;
            if seen == 3 {
                break;
            }
        }
    }
    let killed_at = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-9", &workers[1].to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut done = false;
    for line in lines {
        let Ok(line) = line else { break };
        take(&line);
        if line == "data: [DONE]" {
            done = true;
            break;
        }
    }
    // The stream pauses while the pipeline is rebuilt; how long is for the machine to say.
    eprintln!("the stream ended {:?} after the kill", killed_at.elapsed());
    assert!(
        done,
        "the stream ended without [DONE]; stderr:\n{}",
        server.stderr_text()
    );
    assert_eq!(text, want_story, "the stream continued exactly where it was");
    assert_eq!(
        beside.join().unwrap(),
        want_code,
        "the non-streaming request completed unchanged"
    );

    // `baton serve` started the dead worker again and the pipeline grew back to two stages.
    baton_tests::wait_until("the worker is restarted and the pipeline has two stages", || {
        let children = server.children();
        let (_, body) = http_request(&addr, "GET", "/admin/cluster", "");
        let view: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        let restarted = children.len() == 2 && !children.contains(&workers[1]);
        if restarted && view["ready"] == true && view["stages"].as_array().map(Vec::len) == Some(2) {
            Ok(())
        } else {
            Err(format!("children {children:?}, cluster {view}"))
        }
    });
    let (_, body) = http_request(&addr, "GET", "/admin/cluster", "");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(view["migrations_total"].as_u64().unwrap() >= 1, "{view}");
    assert!(view["replans_total"].as_u64().unwrap() >= 1, "{view}");
    let (_, metrics) = http_request(&addr, "GET", "/metrics", "");
    for series in [
        "baton_worker_restarts_total 1",
        "baton_replans_total{reason=\"stage_failed\"} 1",
        "baton_sequence_migrations_total{cause=\"stage_failed\"}",
    ] {
        assert!(metrics.contains(series), "{series} missing from:\n{metrics}");
    }
    assert_eq!(
        complete(&addr, story),
        want_story,
        "the rebuilt pipeline answers the same"
    );
}

#[test]
fn q8_0_weights_and_bf16_activations_between_stages() {
    let model = default_model();
    let (_server, url) = Server::start(
        &model,
        &["--workers", "2", "--activation-dtype", "bf16", "--weights", "q8_0"],
    );
    let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
    let (code, body) = http_request(
        &addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}"#,
    );
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    // Q8_0 weights and bf16 hidden states leave such a confident prediction unchanged.
    assert!(v["choices"][0]["text"].as_str().unwrap().contains("Paris"), "{body}");
    assert_eq!(v["usage"]["completion_tokens"], 4);

    // The coordinator's metrics saw that request.
    let (code, metrics) = http_request(&addr, "GET", "/metrics", "");
    assert_eq!(code, 200);
    for series in [
        "baton_time_to_first_token_seconds_bucket",
        "baton_inter_token_latency_seconds_count",
        "baton_request_duration_seconds_sum",
        "baton_requests_finished_total{outcome=\"length\"} 1",
        "baton_pipeline_ready 1",
        "baton_pipeline_stages 2",
        "baton_prefill_tokens_total 5",
        "baton_decode_tokens_total 3",
    ] {
        assert!(metrics.contains(series), "missing {series}:\n{metrics}");
    }
}

#[test]
fn in_process_serving_batches_requests_like_a_pipeline_and_reports_its_stage() {
    // `--workers 0`: the whole model as one stage in the server's own process, under the same
    // scheduler as workers. Concurrent greedy requests share micro-batches, each gets the
    // tokens it gets alone, and the stage's metrics are on the server's own /metrics.
    let model = default_model();
    let (_server, url) = Server::start(&model, &["--workers", "0", "--weights", "q8_0"]);
    let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
    let prompts = [
        "The capital of France is",
        "Water boils at",
        "The largest planet in the solar system is",
        "One, two, three,",
    ];
    let body = |p: &str| format!(r#"{{"prompt": {p:?}, "max_tokens": 12, "temperature": 0, "ignore_eos": true}}"#);
    let text = |body: &str| -> String {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (code, out) = http_request(&addr, "POST", "/v1/completions", &body(p));
            assert_eq!(code, 200, "{out}");
            text(&out)
        })
        .collect();
    let (_, before) = http_request(&addr, "GET", "/admin/cluster", "");
    let before: serde_json::Value = serde_json::from_str(&before).unwrap();
    let together: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (addr, req) = (&addr, body(p));
                scope.spawn(move || http_request(addr, "POST", "/v1/completions", &req))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (code, out) = h.join().unwrap();
                assert_eq!(code, 200, "{out}");
                text(&out)
            })
            .collect()
    });
    assert_eq!(together, alone, "batched greedy output equals each request alone");
    assert!(alone[0].contains("Paris"), "{alone:?}");

    let (_, view) = http_request(&addr, "GET", "/admin/cluster", "");
    let view: serde_json::Value = serde_json::from_str(&view).unwrap();
    assert_eq!(view["mode"], "in-process", "{view}");
    assert_eq!(view["stages"].as_array().map(Vec::len), Some(1), "{view}");
    assert_eq!(view["stages"][0]["worker_id"], "local");
    assert!(view["kv_blocks_total"].as_u64().unwrap() > 0, "a paged KV pool: {view}");
    let steps = |v: &serde_json::Value| v["steps_completed"].as_u64().unwrap();
    let batched_steps = steps(&view) - steps(&before);
    // Alone, four requests of 12 tokens take 4 × 12 micro-batches; together far fewer.
    assert!(
        batched_steps < 4 * 12,
        "the concurrent requests took {batched_steps} micro-batches: not batched"
    );
    let (code, metrics) = http_request(&addr, "GET", "/metrics", "");
    assert_eq!(code, 200);
    for series in [
        "baton_stage_forward_seconds_count{stage=\"0\"}",
        "baton_kv_blocks_total",
        "baton_pipeline_stages 1",
        "baton_requests_finished_total{outcome=\"length\"} 8",
    ] {
        assert!(metrics.contains(series), "missing {series}:\n{metrics}");
    }
}

#[test]
fn ngram_speculation_through_serve_keeps_answers_and_reports_itself() {
    // Two workers with prompt lookup on: answers equal a server without it, a request may turn
    // it off or choose its own k, out-of-range values are refused naming the field, and the
    // proposals and acceptances show in /metrics and /admin/cluster.
    let model = default_model();
    let prompt = "Copy this list exactly: apple, pear, plum, apple, pear, plum, apple, pear, plum, apple,";
    let body = |extra: &str| {
        format!(r#"{{"prompt": {prompt:?}, "max_tokens": 24, "temperature": 0, "ignore_eos": true{extra}}}"#)
    };
    let text = |addr: &str, extra: &str| -> (u16, String) {
        let (code, out) = http_request(addr, "POST", "/v1/completions", &body(extra));
        if code != 200 {
            return (code, out);
        }
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (code, v["choices"][0]["text"].as_str().unwrap().to_string())
    };
    // Log-probabilities of every token, a verified draft's included.
    let logprobs = |addr: &str| -> serde_json::Value {
        let (code, out) = http_request(addr, "POST", "/v1/completions", &body(r#", "logprobs": 2"#));
        assert_eq!(code, 200, "{out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["choices"][0]["logprobs"].clone()
    };
    let (plain, plain_logprobs) = {
        let (_server, url) = Server::start(&model, &["--workers", "0"]);
        let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
        let (code, out) = text(&addr, r#", "speculative_tokens": 2"#);
        assert_eq!(code, 400, "a server without speculation refuses the field: {out}");
        assert!(out.contains("speculative"), "{out}");
        let (code, out) = text(&addr, "");
        assert_eq!(code, 200, "{out}");
        (out, logprobs(&addr))
    };
    let (_server, url) = Server::start(&model, &["--workers", "2", "--speculative", "ngram"]);
    let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
    for extra in [
        "",
        r#", "speculative_tokens": 0"#,
        r#", "speculative_tokens": 1"#,
        r#", "speculative_tokens": 16"#,
    ] {
        let (code, out) = text(&addr, extra);
        assert_eq!(code, 200, "{extra}: {out}");
        assert_eq!(out, plain, "{extra}");
    }
    let before = http_request(&addr, "GET", "/admin/cluster", "").1;
    let spec_logprobs = logprobs(&addr);
    let after = http_request(&addr, "GET", "/admin/cluster", "").1;
    let accepted = |view: &str| {
        let v: serde_json::Value = serde_json::from_str(view).unwrap();
        v["speculative"]["accepted_tokens_total"].as_u64().unwrap()
    };
    assert!(
        accepted(&after) > accepted(&before),
        "the logprobs request was drafted for"
    );
    // The same logits (a pipeline and batching change no row), so the same numbers exactly.
    assert_eq!(spec_logprobs["token_logprobs"].as_array().map(Vec::len), Some(24));
    assert_eq!(spec_logprobs, plain_logprobs);
    for bad in ["-1", "17", "\"many\""] {
        let (code, out) = text(&addr, &format!(r#", "speculative_tokens": {bad}"#));
        assert_eq!(code, 400, "{bad}: {out}");
        assert!(out.contains("speculative_tokens"), "{bad}: {out}");
    }
    let (_, view) = http_request(&addr, "GET", "/admin/cluster", "");
    let view: serde_json::Value = serde_json::from_str(&view).unwrap();
    let spec = &view["speculative"];
    assert_eq!(spec["method"], "ngram", "{view}");
    let (proposed, accepted) = (
        spec["proposed_tokens_total"].as_u64().unwrap(),
        spec["accepted_tokens_total"].as_u64().unwrap(),
    );
    assert!(
        accepted > 0 && accepted <= proposed,
        "the repeated list was drafted and partly accepted: {spec}"
    );
    let (_, metrics) = http_request(&addr, "GET", "/metrics", "");
    for series in [
        "baton_spec_proposed_tokens_total{method=\"ngram\"}",
        "baton_spec_accepted_tokens_total{method=\"ngram\"}",
        "baton_spec_tokens_per_step_count{method=\"ngram\"}",
        "baton_spec_accepted_position_total{method=\"ngram\",position=\"1\"}",
    ] {
        assert!(metrics.contains(series), "missing {series}");
    }
}
