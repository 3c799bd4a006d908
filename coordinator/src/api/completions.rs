//! `POST /v1/completions`: a text (or token-id) prompt continued by the model.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use baton_shared::tokenizer::Tokenizer;
use serde_json::Value;
use tracing::Instrument;

use super::AppState;
use super::error::{ApiError, JsonBody};
use super::output::TokenText;
use super::params::{DefaultMaxTokens, PromptField, check_model, parse_top_logprobs};
use super::respond::{Answer, ResponseIds, Submission, submit};
use super::stream::ChunkFormat;
use super::types::{CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, TopMap, Usage};
use crate::generation::FinishReason;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;

/// The handler.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let span = tracing::info_span!(
        "http.request",
        endpoint = "completions",
        model = %state.model_name,
        stream = req.stream.unwrap_or(false),
        prompt_tokens = tracing::field::Empty,
    );
    run(state, req).instrument(span).await
}

async fn run(state: Arc<AppState>, req: CompletionRequest) -> Result<Response, ApiError> {
    check_model(req.model.as_deref(), &state.model_name)?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid_param(
            "echo",
            "'echo' is not supported by this server",
        ));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid_param("best_of", "only best_of=1 is supported"));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param(
            "suffix",
            "'suffix' is not supported by this server",
        ));
    }
    let prompt = prompt_ids(&req.prompt, &state.tokenizer)?;
    tracing::Span::current().record("prompt_tokens", prompt.len());
    let params = req.sampling().to_params(
        &state.sampling_defaults,
        prompt.len(),
        state.max_context,
        DefaultMaxTokens::Fixed(DEFAULT_MAX_TOKENS),
        "max_tokens",
        PromptField("prompt"),
    )?;
    let top_logprobs = req.logprobs.map(|n| parse_top_logprobs("logprobs", n)).transpose()?;
    let sub = Submission {
        prompt,
        params,
        top_logprobs,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
    };
    let chunks = |ids: ResponseIds, include_usage| CompletionChunks {
        id: ids.id,
        created: ids.created,
        model: ids.model,
        include_usage,
    };
    let (ids, out, prompt_tokens) = match submit(&state, sub, "cmpl", chunks).await? {
        Answer::Streamed(response) => return Ok(response),
        Answer::Collected {
            ids,
            out,
            prompt_tokens,
        } => (ids, out, prompt_tokens),
    };
    let body = CompletionResponse {
        id: ids.id,
        object: "text_completion",
        created: ids.created,
        model: ids.model,
        choices: vec![CompletionChoice {
            index: 0,
            text: out.text,
            logprobs: top_logprobs.map(|_| completion_logprobs(&out.logprobs)),
            finish_reason: Some(out.finish_reason.as_str()),
        }],
        usage: Some(Some(Usage::new(
            prompt_tokens,
            out.completion_tokens,
            out.cached_tokens,
        ))),
    };
    Ok(Json(body).into_response())
}

/// The prompt as token ids: a string is tokenized (with BOS when the model wants it), token
/// ids are taken as they are.
pub fn prompt_ids(prompt: &Value, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let shape_err = || {
        ApiError::invalid_param(
            "prompt",
            "'prompt' must be a string, an array with one string, or an array of token ids",
        )
    };
    let empty_err = || ApiError::invalid_param("prompt", "'prompt' must not be empty");
    let text = |s: &str| -> Result<Vec<u32>, ApiError> {
        if s.is_empty() {
            return Err(empty_err());
        }
        tok.encode(s, true)
            .map_err(|e| ApiError::invalid_param("prompt", format!("could not tokenize the prompt: {e}")))
    };
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        let vocab = tok.vocab_size();
        items
            .iter()
            .map(|v| {
                let id = v.as_u64().ok_or_else(shape_err)?;
                if id >= vocab as u64 {
                    return Err(ApiError::invalid_param(
                        "prompt",
                        format!("token id {id} is out of range (vocabulary has {vocab} entries)"),
                    ));
                }
                Ok(id as u32)
            })
            .collect()
    };
    let out = match prompt {
        Value::String(s) => text(s)?,
        Value::Array(items) => match items.first() {
            None => return Err(empty_err()),
            Some(_) if items.len() > 1 && !items[0].is_number() => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!("only one prompt per request is supported, got {}", items.len()),
                ));
            }
            Some(Value::String(s)) => text(s)?,
            Some(Value::Array(inner)) => ids(inner)?,
            Some(Value::Number(_)) => ids(items)?,
            Some(_) => return Err(shape_err()),
        },
        _ => return Err(shape_err()),
    };
    if out.is_empty() {
        return Err(empty_err());
    }
    Ok(out)
}

/// Completions' parallel-array logprobs; `top_logprobs` also holds the chosen token, as OpenAI's
/// "up to logprobs+1 entries" says.
fn completion_logprobs(tokens: &[TokenText]) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in tokens {
        out.tokens.push(t.token.clone());
        out.token_logprobs.push(t.logprob);
        let mut top = t.top.clone();
        if !top.iter().any(|(s, _)| *s == t.token) {
            top.push((t.token.clone(), t.logprob));
        }
        out.top_logprobs.push(TopMap(top));
        out.text_offset.push(t.offset);
    }
    out
}

/// Streamed completion chunks (`object: "text_completion"`, as OpenAI streams them).
struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl CompletionChunks {
    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> String {
        let body = CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            // With include_usage every chunk has `usage`, null until the last one.
            usage: self.include_usage.then_some(usage),
        };
        serde_json::to_string(&body).unwrap_or_default()
    }
}

impl ChunkFormat for CompletionChunks {
    fn opening(&self) -> Option<String> {
        None
    }

    fn delta(&self, text: String, logprobs: Option<TokenText>) -> String {
        let choice = CompletionChoice {
            index: 0,
            text,
            logprobs: logprobs.map(|t| completion_logprobs(std::slice::from_ref(&t))),
            finish_reason: None,
        };
        self.chunk(vec![choice], None)
    }

    fn finish(&self, reason: FinishReason) -> String {
        let choice = CompletionChoice {
            index: 0,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(reason.as_str()),
        };
        self.chunk(vec![choice], None)
    }

    fn usage(&self, usage: Usage) -> String {
        self.chunk(Vec::new(), Some(usage))
    }
}
