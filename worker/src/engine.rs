//! Single-process generation on one stage holding the whole model: prompt in, tokens and text
//! out, with stop conditions. This is the reference every pipelined run is compared against.

use baton_shared::sampling::{SamplingError, SamplingParams};
use baton_shared::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};

use crate::kv_cache::SequenceKv;
use crate::model::{ForwardError, Scratch, StageWeights};
use crate::sampler::Sampler;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the model's context reached.
    Length,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Result of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated ids (including a final EOS when that is what stopped it).
    pub tokens: Vec<u32>,
    /// Generated text, cut before a matched stop string, special tokens removed.
    pub text: String,
    pub finish_reason: FinishReason,
}

/// Errors from the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("prompt of {prompt} tokens leaves no room to generate in the model context of {max}")]
    PromptTooLong { prompt: usize, max: usize },
}

/// The whole model on one stage, with its work buffers.
pub struct Engine {
    pub weights: StageWeights,
    scratch: Scratch,
}

impl Engine {
    /// An engine over weights that hold every layer, the embedding and the head.
    pub fn new(weights: StageWeights) -> Self {
        assert!(weights.is_first && weights.is_last, "Engine needs a full-model stage");
        Self {
            weights,
            scratch: Scratch::default(),
        }
    }

    fn new_kv(&self, capacity: usize) -> SequenceKv {
        let c = &self.weights.config;
        SequenceKv::new(c.num_layers, c.kv_dim(), capacity)
    }

    /// Logits for a prompt: every position (`tokens.len() × vocab`) or only the last.
    pub fn prompt_logits(&mut self, tokens: &[u32], all_positions: bool) -> Result<Vec<f32>, EngineError> {
        let c = &self.weights.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let mut kv = self.new_kv(tokens.len());
        let mut hidden = vec![0f32; tokens.len() * h];
        self.weights.embed(tokens, &mut hidden)?;
        self.weights.forward(&mut hidden, 0, &mut kv, &mut self.scratch)?;
        let rows = if all_positions {
            &hidden[..]
        } else {
            &hidden[(tokens.len() - 1) * h..]
        };
        let mut out = vec![0f32; rows.len() / h * vocab];
        self.weights.logits(rows, &mut self.scratch, &mut out)?;
        Ok(out)
    }

    /// Generate from `prompt`, calling `on_text` with each newly final piece of text.
    ///
    /// Without a tokenizer only token ids are produced (no text, EOS or stop strings), which
    /// is how models without a tokenizer (the tiny test models) are driven.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &SamplingParams,
        tok: Option<&Tokenizer>,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation, EngineError> {
        params.validate()?;
        let c = &self.weights.config;
        let (h, vocab, max_ctx) = (c.hidden_size, c.vocab_size, c.max_position_embeddings);
        if prompt.is_empty() {
            return Err(ForwardError::Empty.into());
        }
        if prompt.len() >= max_ctx {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                max: max_ctx,
            });
        }
        let mut kv = self.new_kv((prompt.len() + params.max_tokens).min(max_ctx));
        let mut hidden = vec![0f32; prompt.len() * h];
        let mut logits = vec![0f32; vocab];
        self.weights.embed(prompt, &mut hidden)?;
        self.weights.forward(&mut hidden, 0, &mut kv, &mut self.scratch)?;
        self.weights
            .logits(&hidden[(prompt.len() - 1) * h..], &mut self.scratch, &mut logits)?;
        hidden.truncate(h);

        let mut sampler = Sampler::new(params);
        let mut decoder = IncrementalDecoder::new(true);
        let mut stops = StopMatcher::new(&params.stop);
        let mut tokens = Vec::with_capacity(params.max_tokens);
        let finish = loop {
            let id = sampler.sample(&logits);
            tokens.push(id);
            let is_eos = tok.is_some_and(|t| t.is_eos(id));
            let ends = (!params.ignore_eos && is_eos) || params.stop_token_ids.contains(&id);
            if !ends && let Some(tok) = tok {
                let delta = decoder.push(tok, id)?;
                if stops.push(&delta, &mut on_text) {
                    break FinishReason::Stop;
                }
            }
            if ends {
                break FinishReason::Stop;
            }
            let pos = prompt.len() + tokens.len() - 1;
            if tokens.len() >= params.max_tokens || pos + 1 >= max_ctx {
                break FinishReason::Length;
            }
            self.weights.embed(&[id], &mut hidden)?;
            self.weights.forward(&mut hidden, pos, &mut kv, &mut self.scratch)?;
            self.weights.logits(&hidden, &mut self.scratch, &mut logits)?;
        };
        if let Some(tok) = tok
            && !stops.matched
        {
            let rest = decoder.finish(tok)?;
            stops.push(&rest, &mut on_text);
        }
        stops.flush(&mut on_text);
        Ok(Generation {
            tokens,
            text: stops.text,
            finish_reason: finish,
        })
    }
}

/// Accumulates generated text, cuts it at the first stop string, and releases only text that
/// cannot turn out to be the start of a stop string.
#[derive(Debug, Default)]
pub struct StopMatcher<'a> {
    stops: &'a [String],
    pub text: String,
    emitted: usize,
    pub matched: bool,
}

impl<'a> StopMatcher<'a> {
    /// A matcher for `stops` (may be empty).
    pub fn new(stops: &'a [String]) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    /// Add text; returns true when a stop string is complete (text is cut before it).
    pub fn push(&mut self, delta: &str, on_text: &mut impl FnMut(&str)) -> bool {
        if self.matched || delta.is_empty() {
            return self.matched;
        }
        let search_from = self
            .text
            .len()
            .saturating_sub(self.stops.iter().map(String::len).max().unwrap_or(0));
        self.text.push_str(delta);
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[floor_boundary(&self.text, search_from)..]
                    .find(s.as_str())
                    .map(|i| i + floor_boundary(&self.text, search_from))
            })
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            self.matched = true;
            self.flush(on_text);
            return true;
        }
        let safe = self.text.len() - self.held_back();
        if safe > self.emitted {
            on_text(&self.text[self.emitted..safe]);
            self.emitted = safe;
        }
        false
    }

    /// Bytes at the end of the text that are a proper prefix of some stop string.
    fn held_back(&self) -> usize {
        let mut best = 0;
        for s in self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.text.ends_with(&s[..i]) {
                    best = best.max(i);
                }
            }
        }
        best
    }

    /// Release everything not yet emitted.
    pub fn flush(&mut self, on_text: &mut impl FnMut(&str)) {
        if self.text.len() > self.emitted {
            on_text(&self.text[self.emitted..]);
            self.emitted = self.text.len();
        }
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        let mut matched = false;
        for d in deltas {
            if m.push(d, &mut |s| out.push_str(s)) {
                matched = true;
                break;
            }
        }
        m.flush(&mut |s| out.push_str(s));
        (m.text, out, matched)
    }

    #[test]
    fn stop_string_split_across_deltas_is_cut() {
        let (text, out, matched) = run(&["\n\n"], &["Paris.", "\n", "\nThe"]);
        assert_eq!((text.as_str(), out.as_str(), matched), ("Paris.", "Paris.", true));
    }

    #[test]
    fn partial_match_is_released_when_it_fails() {
        let (text, out, matched) = run(&["END"], &["the E", "ND", "x"]);
        assert_eq!((text.as_str(), out.as_str(), matched), ("the ", "the ", true));
        let (text, out, matched) = run(&["END"], &["the E", "nd"]);
        assert_eq!((text.as_str(), out.as_str(), matched), ("the End", "the End", false));
    }

    #[test]
    fn multibyte_text_is_safe() {
        let (text, _, matched) = run(&["é!"], &["caf", "é", "!x"]);
        assert_eq!((text.as_str(), matched), ("caf", true));
    }
}
