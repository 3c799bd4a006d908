//! W3C trace context (`traceparent`, `tracestate`) carried between processes, so one request's
//! spans on the coordinator and on every stage share one trace.
//!
//! Unary gRPC calls carry it in request metadata. Micro-batches carry it in the message
//! itself: one Forward stream serves many requests, so per-stream metadata cannot name the
//! micro-batch's parent.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The context of `span` as `traceparent`/`tracestate` entries; empty when the span is not
/// exported (no OTLP endpoint), so the wire carries nothing then.
pub fn inject(span: &tracing::Span) -> HashMap<String, String> {
    let cx = span.context();
    let mut carrier = HashMap::new();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    }
    carrier
}

/// Make the context in `carrier` the parent of `span`; a missing or malformed context leaves
/// `span` a root (a bad header must never fail the work it rides on).
pub fn set_parent(span: &tracing::Span, carrier: &HashMap<String, String>) {
    if carrier.is_empty() {
        return;
    }
    adopt(span, TraceContextPropagator::new().extract(carrier));
}

/// Make `cx` the parent of `span` when it names a real span.
fn adopt(span: &tracing::Span, cx: opentelemetry::Context) {
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Put the current span's context into outgoing gRPC metadata.
pub fn inject_metadata(metadata: &mut MetadataMap) {
    let carrier = inject(&tracing::Span::current());
    let mut injector = MetadataInjector(metadata);
    for (k, v) in &carrier {
        injector.set(k, v.clone());
    }
}

/// Make the context in incoming gRPC metadata the parent of `span`.
pub fn set_parent_from_metadata(span: &tracing::Span, metadata: &MetadataMap) {
    adopt(
        span,
        TraceContextPropagator::new().extract(&MetadataExtractor(metadata)),
    );
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value)) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_injected_without_an_exporting_subscriber() {
        let span = tracing::info_span!("x");
        assert!(inject(&span).is_empty());
        let mut md = MetadataMap::new();
        let _g = span.enter();
        inject_metadata(&mut md);
        assert!(md.is_empty());
    }

    #[test]
    fn malformed_context_is_ignored() {
        let span = tracing::info_span!("x");
        let mut bad = HashMap::new();
        bad.insert("traceparent".to_string(), "00-zz-not-a-context".to_string());
        set_parent(&span, &bad);
        let mut md = MetadataMap::new();
        md.insert("traceparent", MetadataValue::from_static("garbage"));
        set_parent_from_metadata(&span, &md);
    }

    #[test]
    fn metadata_round_trips_a_context() {
        let mut md = MetadataMap::new();
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        MetadataInjector(&mut md).set("traceparent", tp.to_string());
        let cx = TraceContextPropagator::new().extract(&MetadataExtractor(&md));
        assert_eq!(
            cx.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }
}
