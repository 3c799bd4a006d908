//! `GET /dashboard` is one self-contained HTML page, and `/admin/cluster` carries what it draws,
//! including for the in-process engine (`--workers 0`), shown as a single local stage.

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{StatusCode, header};
use baton_coordinator::api::{self, AppState};
use baton_coordinator::generation::{GenerationRequest, Generator, TokenEvent};
use baton_coordinator::local::{self, LocalStageOptions};
use baton_coordinator::pipeline::PipelineConfig;
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use support::*;

#[tokio::test]
async fn dashboard_is_self_contained_html() {
    let g = FakeGenerator::new(vec![]);
    let res = get(app(&g), "/dashboard").await;
    assert_eq!(res.status(), StatusCode::OK);
    let header_of = |name| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    assert!(
        header_of(header::CONTENT_TYPE).starts_with("text/html"),
        "{:?}",
        res.headers()
    );
    let csp = header_of(header::CONTENT_SECURITY_POLICY);
    assert!(
        csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
        "the browser is told the page loads nothing from elsewhere: {csp}"
    );
    let page = text_of(res).await;
    assert!(page.starts_with("<!doctype html>"), "{}", &page[..40.min(page.len())]);
    for external in ["http://", "https://", " src=", " href=", "url(", "@import"] {
        assert!(
            !page.contains(external),
            "the page references something external: {external}"
        );
    }
    assert!(page.contains("\"/admin/cluster\""), "the page polls /admin/cluster");
    assert!(
        page.contains("<style>") && page.contains("<script>"),
        "CSS and JS are inline"
    );
}

#[tokio::test]
async fn admin_cluster_reports_the_server_clock() {
    let g = FakeGenerator::new(vec![]);
    let (status, view) = json_of(get(app(&g), "/admin/cluster").await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(view["model"], "test-model");
    assert!(view["server_time_ms"].as_u64().unwrap() > 1_600_000_000_000, "{view}");
}

#[tokio::test]
async fn in_process_engine_is_one_local_stage_with_live_counters() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/llama_tied");
    let model = ModelFiles::open(&dir).unwrap().config().unwrap();
    let layers = model.num_layers;
    let config = PipelineConfig::new(dir.display().to_string(), &model, vec![]);
    let g = Arc::new(local::start(config, &dir, &LocalStageOptions::default()).unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !g.ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "the in-process stage was not ready"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let view = g.describe();
    assert_eq!(view["mode"], "in-process");
    assert_eq!(view["max_queue"], 64, "existing fields stay");
    let stages = view["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 1, "{view}");
    let s = &stages[0];
    assert_eq!(
        (s["worker_id"].as_str(), s["address"].as_str()),
        (Some("local"), Some("in-process"))
    );
    assert_eq!(
        (s["layer_start"].as_u64(), s["layer_end"].as_u64()),
        (Some(0), Some(layers as u64))
    );
    assert_eq!(s["alive"], true);
    assert!(
        s["features"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().starts_with("kernels:")),
        "{s}"
    );
    assert_eq!(s["live"]["forward_batches"], 0);
    assert_eq!(view["generated_tokens_total"], 0);

    let prompt = vec![1, 2, 3, 4];
    let req = GenerationRequest {
        prompt: prompt.clone(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(6)
        },
        top_logprobs: 0,
        logprobs: false,
    };
    let mut rx = g.submit(req).unwrap();
    let mut tokens = 0;
    loop {
        match tokio::time::timeout(Duration::from_secs(60), rx.recv()).await.unwrap() {
            Some(TokenEvent::Token { .. }) => tokens += 1,
            Some(TokenEvent::Done { .. }) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(tokens, 6);
    // The stage thread publishes its usage after it frees the finished sequence.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let view = loop {
        let v = g.describe();
        let settled = v["running_sequences"] == 0 && v["stages"][0]["live"]["kv_tokens"] == 0;
        if settled || std::time::Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(view["generated_tokens_total"], 6, "{view}");
    assert_eq!(view["prompt_tokens_total"], prompt.len(), "{view}");
    assert_eq!(
        (view["running_sequences"].as_u64(), view["queue_depth"].as_u64()),
        (Some(0), Some(0))
    );
    let live = &view["stages"][0]["live"];
    assert_eq!(
        live["forward_batches"], 6,
        "prefill plus one forward per later token: {live}"
    );
    assert_eq!(live["forward_tokens"], prompt.len() + 5, "{live}");
    assert!(live["forward_seconds"].as_f64().unwrap() > 0.0, "{live}");
    assert_eq!(live["kv_tokens"], 0, "a finished sequence holds no KV: {live}");

    // Through the API as the dashboard reads it.
    let state = AppState::new("tiny", Arc::new(tokenizer()), 64, g.clone());
    let (status, v) = json_of(get(api::router(state), "/admin/cluster").await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (v["model"].as_str(), v["mode"].as_str()),
        (Some("tiny"), Some("in-process"))
    );
    assert_eq!(v["stages"][0]["live"]["forward_batches"], 6);
}
