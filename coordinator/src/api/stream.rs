//! Server-sent events: `data: {chunk}` per token, a chunk with `finish_reason`, an optional
//! usage chunk, then `data: [DONE]`.
//!
//! A failure after the stream has started (a `Failed` event) is sent as one
//! `data: {"error": {...}}` event and the stream ends *without* `[DONE]`: the OpenAI SDKs raise
//! on the error event, and clients that only look for `[DONE]` see a truncated stream rather
//! than a clean end.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use baton_shared::tokenizer::Tokenizer;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::error::ApiError;
use super::output::{Detokenizer, TokenText, VANISHED, failure};
use super::types::Usage;
use crate::generation::{FinishReason, TokenEvent};

/// How one endpoint shapes its chunks (each method returns one chunk's JSON).
pub trait ChunkFormat: Send + 'static {
    /// A chunk sent before any token (chat announces the assistant role), if any.
    fn opening(&self) -> Option<String>;
    /// New text and/or the log-probabilities of one token.
    fn delta(&self, text: String, logprobs: Option<TokenText>) -> String;
    /// The chunk that carries `finish_reason`.
    fn finish(&self, reason: FinishReason) -> String;
    /// The usage chunk (`choices: []`), sent when `stream_options.include_usage` is set.
    fn usage(&self, usage: Usage) -> String;
}

/// What the streaming task needs besides the format.
pub struct StreamJob {
    pub tokenizer: Arc<Tokenizer>,
    pub stops: Vec<String>,
    pub prompt_tokens: usize,
    pub include_usage: bool,
}

/// Channel depth between the generation task and the HTTP body; small, since each slot is a
/// chunk already formatted and the client reads them as they come.
const CHUNKS_IN_FLIGHT: usize = 16;

/// An SSE response fed by a task that reads `rx`. When the client goes away the body (and so
/// the chunk channel) is dropped, the task notices and returns, dropping `rx`: that cancels
/// the generation.
pub fn sse_response(format: impl ChunkFormat, job: StreamJob, rx: mpsc::Receiver<TokenEvent>) -> Response {
    let (tx, chunks) = mpsc::channel::<Event>(CHUNKS_IN_FLIGHT);
    tokio::spawn(drive(format, job, rx, tx).instrument(tracing::Span::current()));
    let body = ReceiverStream::new(chunks).map(Ok::<_, Infallible>);
    // Comments keep proxies from timing out a long prefill; SDKs skip them.
    Sse::new(body).keep_alive(KeepAlive::default()).into_response()
}

async fn drive(format: impl ChunkFormat, job: StreamJob, mut rx: mpsc::Receiver<TokenEvent>, tx: mpsc::Sender<Event>) {
    let mut det = Detokenizer::new(&job.tokenizer, &job.stops);
    if let Some(open) = format.opening()
        && !send(&tx, open).await
    {
        return;
    }
    let mut cached_tokens = 0;
    let reason = loop {
        let event = tokio::select! {
            // A client that left must cancel promptly, even while no token is coming.
            _ = tx.closed() => {
                tracing::info!(completion_tokens = det.tokens, "client disconnected; cancelling");
                return;
            }
            event = rx.recv() => event,
        };
        match event {
            Some(TokenEvent::PromptCached { tokens }) => cached_tokens = tokens,
            Some(TokenEvent::Token { id, logprobs }) => {
                let step = match det.token(id, logprobs) {
                    Ok(step) => step,
                    Err(e) => return send_error(&tx, e).await,
                };
                if (!step.text.is_empty() || step.logprobs.is_some())
                    && !send(&tx, format.delta(step.text, step.logprobs)).await
                {
                    return;
                }
                if step.stopped {
                    break FinishReason::Stop;
                }
            }
            Some(TokenEvent::Done { reason }) => match det.finish() {
                Ok((rest, stopped)) => {
                    if !rest.is_empty() && !send(&tx, format.delta(rest, None)).await {
                        return;
                    }
                    break if stopped { FinishReason::Stop } else { reason };
                }
                Err(e) => return send_error(&tx, e).await,
            },
            Some(TokenEvent::Failed { message, retriable }) => {
                tracing::warn!(%message, retriable, "generation failed mid-stream");
                return send_error(&tx, failure(&message, retriable)).await;
            }
            None => return send_error(&tx, failure(VANISHED, true)).await,
        }
    };
    // Finished (or a stop string matched): stop the generator before the last chunks.
    drop(rx);
    let usage = Usage::new(job.prompt_tokens, det.tokens, cached_tokens);
    tracing::info!(
        completion_tokens = usage.completion_tokens,
        finish_reason = reason.as_str(),
        "stream finished"
    );
    if !send(&tx, format.finish(reason)).await {
        return;
    }
    if job.include_usage && !send(&tx, format.usage(usage)).await {
        return;
    }
    send(&tx, "[DONE]".to_string()).await;
}

/// Send one `data:` event; false when the client has gone.
async fn send(tx: &mpsc::Sender<Event>, data: String) -> bool {
    tx.send(Event::default().data(data)).await.is_ok()
}

async fn send_error(tx: &mpsc::Sender<Event>, e: ApiError) {
    let data = serde_json::to_string(&e.body()).unwrap_or_default();
    let _ = tx.send(Event::default().data(data)).await;
}
