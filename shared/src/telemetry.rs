//! Prometheus metrics for every Baton process: one recorder per process, rendered on `/metrics`.
//! Names follow Prometheus conventions: `baton_` prefix, base units (`_seconds`, `_bytes`),
//! `_total` on counters.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Latency buckets from 100 µs to 60 s, for every `*_seconds` histogram.
const SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Size buckets (tokens or bytes) in powers of four.
const SIZE_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Install the process's metrics recorder (first call) and return its handle; None if another
/// recorder was installed first (metrics then go there).
pub fn prometheus() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_tokens".into()), SIZE_BUCKETS))
                .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_bytes".into()), SIZE_BUCKETS));
            match builder.map(|b| b.install_recorder()) {
                Ok(Ok(h)) => Some(h),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "metrics recorder not installed");
                    None
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics buckets rejected");
                    None
                }
            }
        })
        .as_ref()
}

/// The current metrics in Prometheus text format (empty without a recorder).
pub fn render() -> String {
    prometheus().map(PrometheusHandle::render).unwrap_or_default()
}
