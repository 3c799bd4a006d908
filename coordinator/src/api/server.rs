//! The HTTP listener of the OpenAI API, bounded against clients that hold resources: at most
//! `max_connections` open connections (one more gets a 503 with `Retry-After`), a deadline for a
//! request's headers that also ends idle keep-alive connections (`header_timeout_secs`, the
//! slowloris defence), a bound on header size (`max_header_bytes`, 431 beyond), and graceful
//! shutdown that lets requests in flight finish. The body deadline is the router's
//! ([`super::router`]), since it needs the request.
//!
//! HTTP/1.1 only: what OpenAI clients speak, and what a deadline from the connection's first
//! byte can be put on (automatic HTTP/2 detection reads the preface with no deadline).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::error::ApiError;

/// Connections over the limit that are answered with a 503 at once; beyond that many such
/// answers in flight, a connection over the limit is closed without one (a flood is not
/// allowed to buy a task per connection).
const REFUSALS_IN_FLIGHT: usize = 256;
/// How long a refused client gets to send its request before the 503 goes out anyway.
const REFUSAL_DEADLINE: Duration = Duration::from_secs(2);

/// Connection-level limits of the HTTP API.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HttpLimits {
    /// Open connections at once.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, from connecting or from the previous
    /// response (so also how long an idle keep-alive connection stays open).
    pub header_timeout: Duration,
    /// Largest request head (request line and headers), in bytes.
    pub max_header_bytes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: baton_shared::settings::DEFAULT_MAX_CONNECTIONS,
            header_timeout: Duration::from_secs(baton_shared::settings::DEFAULT_HEADER_TIMEOUT_SECS),
            max_header_bytes: baton_shared::settings::DEFAULT_MAX_HEADER_BYTES,
        }
    }
}

/// Serve `router` on `listener` within `limits` until `shutdown` completes, then finish the
/// requests in flight.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusing = Arc::new(Semaphore::new(REFUSALS_IN_FLIGHT));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // A client may shut its side down once the request is sent (curl --no-buffer, netcat,
        // some proxies); hyper would otherwise drop the connection before answering.
        .half_close(true)
        // hyper's floor for its read buffer, which bounds the request head.
        .max_buf_size(limits.max_header_bytes.max(8192));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for some to close instead of
                    // spinning on accept.
                    tracing::warn!(error = %e, "accepting an HTTP connection failed");
                    metrics::counter!("baton_http_accept_errors_total").increment(1);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Streamed tokens are small writes; Nagle's algorithm would hold them back.
        let _ = tcp.set_nodelay(true);
        let Ok(permit) = open.clone().try_acquire_owned() else {
            metrics::counter!("baton_http_limit_hits_total", "limit" => "max_connections").increment(1);
            if let Ok(slot) = refusing.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(tcp, limits.max_connections).await;
                    drop(slot);
                });
            }
            continue;
        };
        let conn = builder.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(router.clone()));
        let conn = graceful.watch(conn);
        let gauge = metrics::gauge!("baton_http_open_connections");
        gauge.increment(1.0);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                count_connection_error(&e);
            }
            gauge.decrement(1.0);
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answer one request on a connection over the limit with a 503 and close it.
async fn refuse(tcp: TcpStream, limit: usize) {
    let answer = hyper::service::service_fn(move |_req| async move {
        let e = ApiError::unavailable(format!(
            "the server has its limit of {limit} open connections (max_connections); retry shortly"
        ));
        Ok::<_, std::convert::Infallible>(e.into_response())
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(REFUSAL_DEADLINE)
        .keep_alive(false);
    let conn = builder.serve_connection(TokioIo::new(tcp), answer);
    let _ = tokio::time::timeout(2 * REFUSAL_DEADLINE, conn).await;
}

/// Count a connection that ended on a limit (slow or idle headers, oversized headers).
fn count_connection_error(e: &hyper::Error) {
    let limit = if e.is_timeout() {
        "header_timeout_secs"
    } else if e.is_parse_too_large() {
        "max_header_bytes"
    } else {
        return;
    };
    metrics::counter!("baton_http_limit_hits_total", "limit" => limit).increment(1);
}
