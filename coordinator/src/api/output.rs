//! From token events to text: incremental detokenization, stop strings, log-probabilities,
//! and collecting a whole (non-streamed) generation.

use baton_shared::stop::StopMatcher;
use baton_shared::tokenizer::{IncrementalDecoder, Tokenizer};
use tokio::sync::mpsc;

use super::error::ApiError;
use crate::generation::{FinishReason, TokenEvent, TokenLogprobs};

/// A generated token's log-probabilities, with token text for the client.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenText {
    /// The token's own text (special tokens shown).
    pub token: String,
    pub logprob: f32,
    /// Characters of generated text before this token (completions' `text_offset`).
    pub offset: usize,
    /// `(text, logprob)` of the most likely alternatives, best first.
    pub top: Vec<(String, f32)>,
}

/// What one token added.
#[derive(Debug, Default)]
pub struct Step {
    /// Text now final (may be empty: held back for a possible stop string or half a character).
    pub text: String,
    pub logprobs: Option<TokenText>,
    /// A stop string completed; the caller should stop reading (and so cancel generation).
    pub stopped: bool,
}

/// Turns one request's token ids into released text, cut before the first stop string.
pub struct Detokenizer<'a> {
    tok: &'a Tokenizer,
    decoder: IncrementalDecoder,
    stops: StopMatcher<'a>,
    /// Characters decoded so far (before any stop cut), for `text_offset`.
    decoded_chars: usize,
    /// Tokens received, which is what usage counts (EOS included when it ended generation).
    pub tokens: usize,
}

impl<'a> Detokenizer<'a> {
    /// A detokenizer that skips special tokens in the text and stops at `stops`.
    pub fn new(tok: &'a Tokenizer, stops: &'a [String]) -> Self {
        Self {
            tok,
            decoder: IncrementalDecoder::new(true),
            stops: StopMatcher::new(stops),
            decoded_chars: 0,
            tokens: 0,
        }
    }

    /// Add one generated token.
    pub fn token(&mut self, id: u32, logprobs: Option<TokenLogprobs>) -> Result<Step, ApiError> {
        self.tokens += 1;
        let logprobs = logprobs.map(|lp| self.token_text(id, &lp));
        let delta = self
            .decoder
            .push(self.tok, id)
            .map_err(|e| ApiError::internal(format!("detokenizing generated token {id}: {e}")))?;
        self.decoded_chars += delta.chars().count();
        let mut text = String::new();
        let stopped = self.stops.push(&delta, &mut |s| text.push_str(s));
        Ok(Step {
            text,
            logprobs,
            stopped,
        })
    }

    /// Generation ended: release the text still held back. Returns it and whether a stop
    /// string completed in it after all.
    pub fn finish(&mut self) -> Result<(String, bool), ApiError> {
        let mut text = String::new();
        if self.stops.matched {
            return Ok((text, true));
        }
        let rest = self
            .decoder
            .finish(self.tok)
            .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
        let stopped = self.stops.push(&rest, &mut |s| text.push_str(s));
        self.stops.flush(&mut |s| text.push_str(s));
        Ok((text, stopped))
    }

    fn token_text(&self, id: u32, lp: &TokenLogprobs) -> TokenText {
        let text = |id: u32| self.tok.decode(&[id], false).unwrap_or_default();
        TokenText {
            token: text(id),
            logprob: lp.logprob,
            offset: self.decoded_chars,
            top: lp.top.iter().map(|&(t, l)| (text(t), l)).collect(),
        }
    }
}

/// A whole generation, for a non-streamed response.
#[derive(Debug)]
pub struct Collected {
    pub text: String,
    /// One entry per generated token when log-probabilities were asked for.
    pub logprobs: Vec<TokenText>,
    pub finish_reason: FinishReason,
    pub completion_tokens: usize,
    /// Prompt tokens reused from the prefix cache.
    pub cached_tokens: usize,
}

/// The error a client sees for a generator's `Failed` event (or a generator that vanished).
pub fn failure(message: &str, retriable: bool) -> ApiError {
    if retriable {
        ApiError::unavailable(format!("generation failed: {message}"))
    } else {
        ApiError::internal(format!("generation failed: {message}"))
    }
}

/// What a generator that closes its channel without `Done` means for the client.
pub const VANISHED: &str = "the generator stopped without finishing the request";

/// Read events until the end; a stop string ends reading early, which drops `rx` and so
/// cancels the rest of the generation.
pub async fn collect(
    tok: &Tokenizer,
    stops: &[String],
    mut rx: mpsc::Receiver<TokenEvent>,
) -> Result<Collected, ApiError> {
    let mut det = Detokenizer::new(tok, stops);
    let mut text = String::new();
    let mut logprobs = Vec::new();
    let mut cached_tokens = 0;
    let finish_reason = loop {
        match rx.recv().await {
            Some(TokenEvent::PromptCached { tokens }) => cached_tokens = tokens,
            Some(TokenEvent::Token { id, logprobs: lp }) => {
                let step = det.token(id, lp)?;
                text.push_str(&step.text);
                logprobs.extend(step.logprobs);
                if step.stopped {
                    break FinishReason::Stop;
                }
            }
            Some(TokenEvent::Done { reason }) => {
                let (rest, stopped) = det.finish()?;
                text.push_str(&rest);
                break if stopped { FinishReason::Stop } else { reason };
            }
            Some(TokenEvent::Failed { message, retriable }) => return Err(failure(&message, retriable)),
            None => return Err(failure(VANISHED, true)),
        }
    };
    drop(rx);
    Ok(Collected {
        text,
        logprobs,
        finish_reason,
        completion_tokens: det.tokens,
        cached_tokens,
    })
}
