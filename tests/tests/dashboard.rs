//! Every metric the shipped Grafana dashboard queries is exported by a running coordinator and
//! its workers (deploy/observability/grafana/dashboards/baton-overview.json).

use std::collections::BTreeSet;
use std::path::Path;

use baton_coordinator::speculative::{DraftMethod, Drafter, SpeculativeConfig};
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster};
use baton_tests::fixtures;

/// Metric names (`baton_*`) that appear in a Prometheus text page.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Every `baton_*` identifier in the dashboard's queries.
fn queried(dashboard: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = dashboard.as_bytes();
    let mut i = 0;
    while let Some(at) = dashboard[i..].find("baton_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_' || bytes[end].is_ascii_digit())
        {
            end += 1;
        }
        names.insert(dashboard[start..end].to_string());
        i = end;
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_only_exported_metrics() {
    // This test process hosts the coordinator, so its recorder holds the coordinator's metrics.
    baton_shared::telemetry::prometheus().expect("metrics recorder");
    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let (tc, ports) = TestCluster::start_with_worker_metrics(&dir, &cfg, &[1]).await;
    tc.generate(
        &[1, 2, 3],
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(4)
        },
    )
    .await
    .unwrap();
    // Speculative decoding's metrics come from a pipeline that drafts (here, always the same
    // proposals: their acceptance does not matter).
    struct Always;
    impl Drafter for Always {
        fn method(&self) -> DraftMethod {
            DraftMethod::Ngram
        }
        fn propose(&mut self, _tokens: &[u32], k: usize, out: &mut Vec<u32>) {
            out.extend((1..=k as u32).map(|t| t % 7));
        }
    }
    let drafting = SpeculativeConfig {
        custom: Some(std::sync::Arc::new(|| Box::new(Always) as Box<dyn Drafter>)),
        ..SpeculativeConfig::new(DraftMethod::Ngram, 4)
    };
    let spec = TestCluster::start_speculative(&dir, &cfg, vec![], &[], Limits::default(), drafting).await;
    spec.generate(
        &[1, 2, 3],
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(8)
        },
    )
    .await
    .unwrap();
    assert!(
        spec.generator
            .status
            .spec_steps
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );

    let mut names = exported(&baton_shared::telemetry::render());
    for addr in &ports {
        let (code, body) = baton_tests::serve::http_request(addr, "GET", "/metrics", "");
        assert_eq!(code, 200);
        names.extend(exported(&body));
    }
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/observability/grafana/dashboards/baton-overview.json");
    let dashboard = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("the dashboard is valid JSON");
    let wanted = queried(&dashboard);
    assert!(wanted.len() >= 10, "the dashboard queries Baton metrics: {wanted:?}");
    let missing: Vec<_> = wanted.difference(&names).collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics nobody exports: {missing:?}\nexported: {names:?}"
    );
}
