//! `POST /v1/chat/completions`: messages rendered with the model's chat template, answered by
//! the assistant.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use baton_shared::chat_template::{ChatMessage, ChatTemplate, ChatTemplateError};
use baton_shared::tokenizer::Tokenizer;
use serde_json::Value;
use tracing::Instrument;

use super::AppState;
use super::error::{ApiError, JsonBody};
use super::output::TokenText;
use super::params::{DefaultMaxTokens, PromptField, check_model, parse_top_logprobs};
use super::respond::{Answer, ResponseIds, Submission, submit};
use super::stream::ChunkFormat;
use super::types::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessageIn, ChatMessageOut, ChatRequest,
    ChatResponse, ChatTokenLogprob, ChatTopLogprob, Usage,
};
use crate::generation::FinishReason;

/// Compile the tokenizer's chat template, with its BOS/EOS token text exposed as in
/// transformers. `Ok(None)` when the model has none.
pub fn compile_chat_template(tok: &Tokenizer) -> Result<Option<ChatTemplate>, ChatTemplateError> {
    let Some(src) = tok.chat_template.as_deref() else {
        return Ok(None);
    };
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    ChatTemplate::new(src, &name(tok.bos_id), &name(tok.eos_ids.first().copied())).map(Some)
}

/// The handler.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<ChatRequest>,
) -> Result<Response, ApiError> {
    let span = tracing::info_span!(
        "http.request",
        endpoint = "chat.completions",
        model = %state.model_name,
        stream = req.stream.unwrap_or(false),
        prompt_tokens = tracing::field::Empty,
    );
    run(state, req).instrument(span).await
}

async fn run(state: Arc<AppState>, req: ChatRequest) -> Result<Response, ApiError> {
    check_model(req.model.as_deref(), &state.model_name)?;
    if req.tools.as_ref().is_some_and(|t| !is_empty_json(t)) {
        return Err(ApiError::invalid_param(
            "tools",
            "tool calling is not supported by this server",
        ));
    }
    if let Some(format) = &req.response_format
        && !format.is_null()
        && format.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(ApiError::invalid_param(
            "response_format",
            "only response_format {\"type\": \"text\"} is supported",
        ));
    }
    let top_logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), n) => Some(n.map_or(Ok(0), |n| parse_top_logprobs("top_logprobs", n))?),
        (_, Some(n)) if n > 0 => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "'top_logprobs' needs 'logprobs' set to true",
            ));
        }
        _ => None,
    };
    let messages = messages(&req.messages)?;
    let template = state.chat_template.as_deref().ok_or_else(|| {
        ApiError::invalid_param(
            "messages",
            "the model has no chat template; use /v1/completions with a plain prompt",
        )
    })?;
    let text = template
        .render(&messages, true)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    // The template writes any BOS itself.
    let prompt = state
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid_param("messages", format!("could not tokenize the messages: {e}")))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "the messages render to an empty prompt",
        ));
    }
    tracing::Span::current().record("prompt_tokens", prompt.len());
    let max_tokens_param = if req.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let params = req.sampling().to_params(
        &state.sampling_defaults,
        prompt.len(),
        state.max_context,
        DefaultMaxTokens::RestOfContext,
        max_tokens_param,
        PromptField("messages"),
    )?;
    let sub = Submission {
        prompt,
        params,
        top_logprobs,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
    };
    let chunks = |ids: ResponseIds, include_usage| ChatChunks {
        id: ids.id,
        created: ids.created,
        model: ids.model,
        include_usage,
    };
    let (ids, out, prompt_tokens) = match submit(&state, sub, "chatcmpl", chunks).await? {
        Answer::Streamed(response) => return Ok(response),
        Answer::Collected {
            ids,
            out,
            prompt_tokens,
        } => (ids, out, prompt_tokens),
    };
    let body = ChatResponse {
        id: ids.id,
        object: "chat.completion",
        created: ids.created,
        model: ids.model,
        choices: vec![ChatChoice {
            index: 0,
            message: ChatMessageOut {
                role: "assistant",
                content: out.text,
            },
            logprobs: top_logprobs.map(|_| chat_logprobs(&out.logprobs)),
            finish_reason: Some(out.finish_reason.as_str()),
        }],
        usage: Usage::new(prompt_tokens, out.completion_tokens, out.cached_tokens),
    };
    Ok(Json(body).into_response())
}

fn is_empty_json(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// Check roles and flatten content parts into the template's plain messages.
fn messages(input: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if input.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "'messages' must contain at least one message",
        ));
    }
    input
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" => m.role.clone(),
                // OpenAI's newer name for system instructions; templates only know `system`.
                "developer" => "system".to_string(),
                other => {
                    return Err(ApiError::invalid_param(
                        &format!("messages[{i}].role"),
                        format!("unsupported role '{other}' (supported: system, user, assistant)"),
                    ));
                }
            };
            Ok(ChatMessage {
                role,
                content: content_text(i, m.content.as_ref())?,
            })
        })
        .collect()
}

/// A message's content: a string, or text parts joined by newlines (as vLLM joins them).
fn content_text(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let texts = parts
                .iter()
                .enumerate()
                .map(|(j, part)| {
                    let kind = part.get("type").and_then(Value::as_str);
                    match (kind, part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(text)) => Ok(text),
                        (Some("text"), None) => Err(ApiError::invalid_param(
                            &format!("{param}[{j}].text"),
                            "a text part needs a string 'text'",
                        )),
                        (Some(other), _) => Err(ApiError::invalid_param(
                            &format!("{param}[{j}].type"),
                            format!("content part type '{other}' is not supported (only 'text')"),
                        )),
                        (None, _) => Err(ApiError::invalid_param(
                            &format!("{param}[{j}]"),
                            "a content part must be an object with 'type': 'text' and 'text'",
                        )),
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(texts.join("\n"))
        }
        None | Some(Value::Null) => Err(ApiError::invalid_param(&param, format!("'{param}' is required"))),
        Some(_) => Err(ApiError::invalid_param(
            &param,
            format!("'{param}' must be a string or an array of text parts"),
        )),
    }
}

fn chat_logprobs(tokens: &[TokenText]) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|t| ChatTokenLogprob {
                token: t.token.clone(),
                logprob: t.logprob,
                bytes: t.token.as_bytes().to_vec(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|(token, logprob)| ChatTopLogprob {
                        token: token.clone(),
                        logprob: *logprob,
                        bytes: token.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Streamed chat chunks: the role first, then content deltas, then `finish_reason`.
struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl ChatChunks {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> String {
        let body = ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: self.include_usage.then_some(usage),
        };
        serde_json::to_string(&body).unwrap_or_default()
    }

    fn choice(delta: ChatDelta, logprobs: Option<ChatLogprobs>, finish: Option<FinishReason>) -> ChatChunkChoice {
        ChatChunkChoice {
            index: 0,
            delta,
            logprobs,
            finish_reason: finish.map(FinishReason::as_str),
        }
    }
}

impl ChunkFormat for ChatChunks {
    fn opening(&self) -> Option<String> {
        let delta = ChatDelta {
            role: Some("assistant"),
            content: Some(String::new()),
        };
        Some(self.chunk(vec![Self::choice(delta, None, None)], None))
    }

    fn delta(&self, text: String, logprobs: Option<TokenText>) -> String {
        let delta = ChatDelta {
            role: None,
            content: Some(text),
        };
        let logprobs = logprobs.map(|t| chat_logprobs(std::slice::from_ref(&t)));
        self.chunk(vec![Self::choice(delta, logprobs, None)], None)
    }

    fn finish(&self, reason: FinishReason) -> String {
        self.chunk(vec![Self::choice(ChatDelta::default(), None, Some(reason))], None)
    }

    fn usage(&self, usage: Usage) -> String {
        self.chunk(Vec::new(), Some(usage))
    }
}
