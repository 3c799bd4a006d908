//! Single-process generation on one stage holding the whole model: prompt in, tokens and text
//! out, with stop conditions. This is the reference every pipelined run is compared against.

pub use baton_shared::sampling::FinishReason;
use baton_shared::sampling::{SamplingError, SamplingParams};
use baton_shared::stop::StopMatcher;
use baton_shared::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};

use crate::kv_cache::SequenceKv;
use crate::model::{ForwardError, Scratch, StageWeights};
use crate::sampler::Sampler;

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
        self.weights.new_kv(capacity)
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
            let finish = params.finish_reason(id, is_eos, tokens.len(), prompt.len() + tokens.len(), max_ctx);
            // An ending token (EOS, stop id) adds no text.
            if finish != Some(FinishReason::Stop)
                && let Some(tok) = tok
            {
                let delta = decoder.push(tok, id)?;
                if stops.push(&delta, &mut on_text) {
                    break FinishReason::Stop;
                }
            }
            if let Some(reason) = finish {
                break reason;
            }
            let pos = prompt.len() + tokens.len() - 1;
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
