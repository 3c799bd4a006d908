//! The contract between the HTTP API and whatever produces tokens (the local engine, or the
//! pipeline of workers). The API deals in text; generators deal in token ids only.

use baton_shared::sampling::SamplingParams;
use tokio::sync::mpsc;

/// One request for tokens.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids (already templated and tokenized, non-empty).
    pub prompt: Vec<u32>,
    /// Sampling and stopping. Stop *strings* are handled by the API layer, which drops the
    /// receiver when one matches; generators stop on EOS, `stop_token_ids` and `max_tokens`.
    pub params: SamplingParams,
    /// Number of top alternatives to report per token (0: only the chosen token's logprob
    /// when `logprobs` is set).
    pub top_logprobs: usize,
    /// Whether to compute log-probabilities at all.
    pub logprobs: bool,
}

impl GenerationRequest {
    /// What every generator refuses up front: an empty prompt, invalid sampling values, token
    /// ids outside the vocabulary, and a prompt plus `max_tokens` longer than the context.
    pub fn check(&self, vocab_size: usize, max_context: usize) -> Result<(), SubmitError> {
        let invalid = |m: String| Err(SubmitError::Invalid(m));
        if self.prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if let Err(e) = self.params.validate() {
            return invalid(e.to_string());
        }
        if let Some(&id) = self.prompt.iter().find(|&&id| id as usize >= vocab_size) {
            return invalid(format!(
                "token id {id} is out of range (vocabulary has {vocab_size} entries)"
            ));
        }
        let needed = self.prompt.len().saturating_add(self.params.max_tokens);
        if needed > max_context {
            return invalid(format!(
                "prompt ({}) plus max_tokens ({}) exceeds the model context of {max_context}",
                self.prompt.len(),
                self.params.max_tokens
            ));
        }
        Ok(())
    }
}

/// Log-probability of a chosen token and its top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// `(token id, logprob)` of the most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
}

pub use baton_shared::sampling::FinishReason;

/// What a generator sends back, in order: at most one `PromptCached`, tokens, then exactly one
/// `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// Leading prompt tokens whose K/V came from the prefix cache (not prefilled again); sent
    /// before the first token when there are any.
    PromptCached {
        tokens: usize,
    },
    Token {
        id: u32,
        logprobs: Option<TokenLogprobs>,
    },
    Done {
        reason: FinishReason,
    },
    /// The request could not be completed (e.g. a worker died); `retriable` maps to 503.
    Failed {
        message: String,
        retriable: bool,
    },
}

/// Why a request was not accepted.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum SubmitError {
    /// The serving pipeline is not ready (no workers, a stage down): HTTP 503.
    #[error("service unavailable: {0}")]
    Unavailable(String),
    /// Too many requests queued: HTTP 429.
    #[error("too many requests: {0}")]
    Overloaded(String),
    /// The request itself is invalid (e.g. token out of range): HTTP 400.
    #[error("{0}")]
    Invalid(String),
}

/// Something that turns prompts into token streams. Dropping the receiver cancels the
/// request: the generator must notice (a failed send) and free the sequence's resources.
pub trait Generator: Send + Sync + 'static {
    /// Start generating; events arrive on the returned channel.
    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, SubmitError>;
    /// Whether requests can be served right now (`/ready`).
    fn ready(&self) -> bool;
    /// What serves the requests, as JSON for `/admin/cluster` (topology, assignment, load).
    fn describe(&self) -> serde_json::Value {
        serde_json::json!({ "mode": "unknown", "ready": self.ready() })
    }
}
