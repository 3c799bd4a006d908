//! Bounds every Baton gRPC server (a worker, the coordinator's registry) puts on its peers, so a
//! peer that opens streams without end, sends huge headers or messages, or goes silent cannot
//! exhaust a node. `[grpc]` in baton.toml, `BATON_GRPC__*`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::BodyExt;
use http_body_util::combinators::MapFrame;
use serde::{Deserialize, Serialize};
use tonic::transport::Server;
use tower::layer::util::{Identity, Stack};

/// Default largest gRPC message (hidden states of a large prefill chunk).
pub const DEFAULT_MAX_MESSAGE_MIB: usize = 256;

/// Limits of a gRPC server.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcLimits {
    /// Streams one connection may have open at once (HTTP/2 `MAX_CONCURRENT_STREAMS`; a peer
    /// waits for a free one). A pipeline needs one Forward stream per upstream plus a few calls.
    pub max_streams: u32,
    /// Largest header list a peer may send, in bytes; a larger one resets the stream.
    pub max_header_bytes: u32,
    /// Largest message a peer may send, in MiB; a larger one fails with `OUT_OF_RANGE` and is
    /// counted in `baton_grpc_limit_hits_total{limit="max_message_mib"}`.
    pub max_message_mib: usize,
    /// Seconds without an answer to a keep-alive ping before a connection is dropped.
    pub keepalive_timeout_secs: u64,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        Self {
            max_streams: 64,
            max_header_bytes: 16 << 10,
            max_message_mib: DEFAULT_MAX_MESSAGE_MIB,
            keepalive_timeout_secs: 20,
        }
    }
}

impl GrpcLimits {
    /// The message limit in bytes.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_mib.saturating_mul(1 << 20)
    }

    /// `server` with these limits, keep-alive pings to find vanished peers, a bound on streams
    /// a peer may reset before being answered (the HTTP/2 rapid-reset attack), and the count of
    /// calls refused for their message size.
    pub fn apply(&self, server: Server) -> Server<Stack<LimitMetricsLayer, Identity>> {
        server
            .max_concurrent_streams(self.max_streams.max(1))
            .http2_max_header_list_size(self.max_header_bytes.max(1024))
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(self.keepalive_timeout_secs.max(1))))
            .http2_max_pending_accept_reset_streams(Some(32))
            .tcp_keepalive(Some(Duration::from_secs(60)))
            .layer(LimitMetricsLayer)
    }
}

/// Counts calls a server ends with `OUT_OF_RANGE`, which tonic answers when a peer's message
/// is over `max_message_mib` (Baton's own handlers never use that code). The status is in the
/// response headers when the call fails before answering and in the trailers otherwise.
/// HTTP/2's own limits (streams, header list size, keep-alive) are enforced inside `h2` and
/// reach no Baton code, so they have no count.
#[derive(Debug, Clone, Copy, Default)]
pub struct LimitMetricsLayer;

impl<S> tower::Layer<S> for LimitMetricsLayer {
    type Service = LimitMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LimitMetrics { inner }
    }
}

/// The service [`LimitMetricsLayer`] wraps around a server's routes.
#[derive(Debug, Clone)]
pub struct LimitMetrics<S> {
    inner: S,
}

/// A response body whose trailers are checked as they pass.
pub type CheckedBody<B> = MapFrame<B, fn(http_body::Frame<bytes::Bytes>) -> http_body::Frame<bytes::Bytes>>;

impl<S, Req, B> tower::Service<Req> for LimitMetrics<S>
where
    S: tower::Service<Req, Response = http::Response<B>>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
{
    type Response = http::Response<CheckedBody<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let answer = self.inner.call(req);
        Box::pin(async move {
            let response = answer.await?;
            count_limit_hit(response.headers());
            let check: fn(http_body::Frame<bytes::Bytes>) -> http_body::Frame<bytes::Bytes> = check_trailers;
            Ok(response.map(|body| body.map_frame(check)))
        })
    }
}

fn check_trailers(frame: http_body::Frame<bytes::Bytes>) -> http_body::Frame<bytes::Bytes> {
    if let Some(trailers) = frame.trailers_ref() {
        count_limit_hit(trailers);
    }
    frame
}

/// `grpc-status: 11` (OUT_OF_RANGE) in `headers`: a message over the size limit.
fn count_limit_hit(headers: &http::HeaderMap) {
    if headers.get("grpc-status").map(|v| v.as_bytes()) == Some(b"11") {
        metrics::counter!("baton_grpc_limit_hits_total", "limit" => "max_message_mib").increment(1);
    }
}
