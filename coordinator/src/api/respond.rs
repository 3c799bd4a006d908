//! The part both endpoints share once a request is understood: submit it to the generator, then
//! either stream chunks (SSE) or collect the whole answer.

use axum::response::Response;
use baton_shared::sampling::SamplingParams;

use super::error::ApiError;
use super::output::{Collected, collect};
use super::stream::{ChunkFormat, StreamJob, sse_response};
use super::{AppState, request_id, unix_now};
use crate::generation::GenerationRequest;

/// A parsed request, ready for the generator.
pub struct Submission {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Top alternatives per token when log-probabilities were asked for.
    pub top_logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Identity shared by every chunk of one response.
pub struct ResponseIds {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// The answer: already streaming, or collected for one JSON body.
pub enum Answer {
    Streamed(Response),
    Collected {
        ids: ResponseIds,
        out: Collected,
        prompt_tokens: usize,
    },
}

/// Submit `sub`; stream chunks shaped by `format(ids, include_usage)`, or collect.
pub async fn submit<F: ChunkFormat>(
    state: &AppState,
    sub: Submission,
    id_prefix: &str,
    format: impl FnOnce(ResponseIds, bool) -> F,
) -> Result<Answer, ApiError> {
    let prompt_tokens = sub.prompt.len();
    let stops = sub.params.stop.clone();
    let rx = state.generator.submit(GenerationRequest {
        prompt: sub.prompt,
        params: sub.params,
        top_logprobs: sub.top_logprobs.unwrap_or(0),
        logprobs: sub.top_logprobs.is_some(),
    })?;
    let ids = ResponseIds {
        id: request_id(id_prefix),
        created: unix_now(),
        model: state.model_name.clone(),
    };
    if sub.stream {
        let job = StreamJob {
            tokenizer: state.tokenizer.clone(),
            stops,
            prompt_tokens,
            include_usage: sub.include_usage,
        };
        return Ok(Answer::Streamed(sse_response(format(ids, sub.include_usage), job, rx)));
    }
    let out = collect(&state.tokenizer, &stops, rx).await?;
    tracing::info!(
        completion_tokens = out.completion_tokens,
        finish_reason = out.finish_reason.as_str(),
        "request finished"
    );
    Ok(Answer::Collected {
        ids,
        out,
        prompt_tokens,
    })
}
