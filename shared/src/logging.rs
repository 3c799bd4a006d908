//! The tracing subscriber every Baton process installs: log lines on stderr (text or JSON) and,
//! when an OTLP endpoint is configured, spans exported to an OpenTelemetry collector.
//!
//! Export runs on the SDK's batch thread; the gRPC (tonic) client it uses needs a Tokio
//! reactor, which that thread lacks, so the exporter is wrapped to run each export on a small
//! runtime of its own. An absent or failing collector costs one warning, not one per batch.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::settings::LogFormat;

/// How long finished spans wait before a batch is exported.
const EXPORT_DELAY: Duration = Duration::from_millis(500);
/// Upper bound on one export call (the collector may be down or unreachable).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// What to log and where to send traces.
#[derive(Debug, Clone)]
pub struct LoggingOptions {
    /// Log filter in `RUST_LOG` syntax (an invalid filter falls back to `warn`).
    pub log_level: String,
    pub log_format: LogFormat,
    /// OTLP/gRPC collector, e.g. `http://otel-collector:4317`; None exports nothing.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of this process's spans (`baton-coordinator`, `baton-worker`, ...).
    pub service_name: String,
}

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("otlp_endpoint '{endpoint}' is not usable: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("could not start the trace export runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// Flushes and stops trace export when dropped (keep it alive for the life of the process).
#[must_use = "dropping the guard stops trace export"]
pub struct LoggingGuard {
    provider: Option<SdkTracerProvider>,
}

impl LoggingGuard {
    /// Export every finished span now (tests call this before asking the collector).
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            let _ = p.force_flush();
        }
    }

    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for LoggingGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown_with_timeout(EXPORT_TIMEOUT);
        }
    }
}

/// Install the global subscriber. A second call in one process (tests) keeps the first
/// subscriber and returns a guard that exports nothing.
pub fn init(opts: &LoggingOptions) -> Result<LoggingGuard, LoggingError> {
    let filter = EnvFilter::try_new(&opts.log_level).unwrap_or_else(|_| EnvFilter::new("warn"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match opts.log_format {
        LogFormat::Json => fmt.json().with_filter(filter).boxed(),
        LogFormat::Text => fmt.with_filter(filter).boxed(),
    };
    let (otel, provider) = match opts.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) {
        Some(endpoint) => {
            let provider = otlp_provider(endpoint, &opts.service_name)?;
            // Spans are exported at info whatever the log level: an operator wants traces
            // without drowning stderr. Only Baton's own spans; library internals stay out.
            let targets = Targets::new()
                .with_default(LevelFilter::OFF)
                .with_target("baton", LevelFilter::INFO)
                .with_target("baton_coordinator", LevelFilter::INFO)
                .with_target("baton_worker", LevelFilter::INFO)
                .with_target("baton_shared", LevelFilter::INFO);
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("baton"))
                .with_filter(targets);
            (Some(layer), Some(provider))
        }
        None => (None, None),
    };
    let installed = tracing_subscriber::registry().with(fmt).with(otel).try_init().is_ok();
    Ok(LoggingGuard {
        provider: provider.filter(|_| installed),
    })
}

/// A tracer provider exporting over OTLP/gRPC in batches.
fn otlp_provider(endpoint: &str, service_name: &str) -> Result<SdkTracerProvider, LoggingError> {
    let bad = |reason: String| LoggingError::Endpoint {
        endpoint: endpoint.to_string(),
        reason,
    };
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(bad("expected an http:// or https:// URL".into()));
    }
    let rt = export_runtime()?;
    // The tonic channel is created lazily but spawns its worker on the current runtime.
    let _entered = rt.enter();
    let inner = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let exporter = ReactorExporter {
        inner,
        endpoint: endpoint.to_string(),
        failing: AtomicBool::new(false),
    };
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(BatchConfigBuilder::default().with_scheduled_delay(EXPORT_DELAY).build())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(Resource::builder().with_service_name(service_name.to_string()).build())
        .build())
}

/// One small runtime per process for trace export, never dropped (dropping a runtime from
/// inside another runtime's thread panics, and shutdown may happen there).
fn export_runtime() -> Result<&'static tokio::runtime::Runtime, std::io::Error> {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("baton-otlp")
        .enable_all()
        .build()?;
    Ok(RT.get_or_init(|| rt))
}

/// A change in the collector's health worth one log line.
#[derive(Debug, PartialEq, Eq)]
enum Change {
    Failing,
    Recovered,
}

/// Record an export's outcome; Some only on the first failure of a streak and on recovery.
fn change(failing: &AtomicBool, ok: bool) -> Option<Change> {
    match (failing.swap(!ok, Ordering::Relaxed), ok) {
        (false, false) => Some(Change::Failing),
        (true, true) => Some(Change::Recovered),
        _ => None,
    }
}

/// The OTLP exporter, driven on [`export_runtime`], logging a failing collector once.
#[derive(Debug)]
struct ReactorExporter {
    inner: opentelemetry_otlp::SpanExporter,
    endpoint: String,
    failing: AtomicBool,
}

impl SpanExporter for ReactorExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let result = match export_runtime() {
            Ok(rt) => rt.block_on(self.inner.export(batch)),
            Err(e) => Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(e.to_string())),
        };
        match (change(&self.failing, result.is_ok()), &result) {
            (Some(Change::Recovered), _) => tracing::info!(endpoint = %self.endpoint, "trace export recovered"),
            (Some(Change::Failing), Err(e)) => {
                tracing::warn!(endpoint = %self.endpoint, error = %e, "trace export failed; spans are dropped until the collector answers");
            }
            _ => {}
        }
        // The failure is reported above; the SDK need not log it again every batch.
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_collector_is_reported_once_per_outage() {
        let failing = AtomicBool::new(false);
        let outcomes = [true, false, false, false, true, true, false];
        let changes: Vec<_> = outcomes.iter().map(|&ok| change(&failing, ok)).collect();
        assert_eq!(
            changes,
            [
                None,
                Some(Change::Failing),
                None,
                None,
                Some(Change::Recovered),
                None,
                Some(Change::Failing)
            ]
        );
    }

    #[test]
    fn an_endpoint_without_a_scheme_is_named() {
        let e = otlp_provider("collector:4317", "t").unwrap_err().to_string();
        assert!(e.contains("'collector:4317'") && e.contains("http://"), "{e}");
    }
}
