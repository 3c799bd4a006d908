//! Bounds every Baton gRPC server (a worker, the coordinator's registry) puts on its peers, so a
//! peer that opens streams without end, sends huge headers or messages, or goes silent cannot
//! exhaust a node. `[grpc]` in baton.toml, `BATON_GRPC__*`.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tonic::transport::Server;

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
    /// Largest message a peer may send, in MiB; a larger one fails with `RESOURCE_EXHAUSTED`.
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

    /// `server` with these limits, keep-alive pings to find vanished peers, and a bound on
    /// streams a peer may reset before being answered (the HTTP/2 rapid-reset attack).
    pub fn apply(&self, server: Server) -> Server {
        server
            .max_concurrent_streams(self.max_streams.max(1))
            .http2_max_header_list_size(self.max_header_bytes.max(1024))
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(self.keepalive_timeout_secs.max(1))))
            .http2_max_pending_accept_reset_streams(Some(32))
            .tcp_keepalive(Some(Duration::from_secs(60)))
    }
}
