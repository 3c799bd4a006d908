//! Sampling parameters: how the next token is chosen and when generation stops.

use serde::{Deserialize, Serialize};

/// How to pick tokens and when to stop; validated with [`SamplingParams::validate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one; 0 disables.
    pub min_p: f32,
    /// Seed for reproducible sampling; None draws one from the clock.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Extra ids that end generation (besides the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the text is cut before them.
    pub stop: Vec<String>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// Why a generation ended.
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

/// A sampling parameter outside its valid range.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("invalid sampling parameter '{param}': {message}")]
pub struct SamplingError {
    pub param: &'static str,
    pub message: String,
}

/// Upper bound for stop strings, to keep per-token matching cheap.
pub const MAX_STOP_STRINGS: usize = 16;

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            ..Self::default()
        }
    }

    /// Check every field's range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let err = |param, message: &str| {
            Err(SamplingError {
                param,
                message: message.into(),
            })
        };
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return err("temperature", "must be between 0 and 100");
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return err("top_p", "must be in (0, 1]");
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return err("min_p", "must be in [0, 1]");
        }
        if self.max_tokens == 0 {
            return err("max_tokens", "must be at least 1");
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return err("stop", "at most 16 stop strings");
        }
        if self.stop.iter().any(String::is_empty) {
            return err("stop", "stop strings must not be empty");
        }
        Ok(())
    }

    /// Why generation ends once `token` has been sampled, if it does. `generated` counts the
    /// sampled tokens (this one included) and `seq_len` the whole sequence (prompt + generated):
    /// EOS (unless ignored) or a stop id is `Stop`; `max_tokens`, or a sequence that fills the
    /// context so the token could not be run, is `Length`.
    pub fn finish_reason(
        &self,
        token: u32,
        is_eos: bool,
        generated: usize,
        seq_len: usize,
        max_context: usize,
    ) -> Option<FinishReason> {
        if (is_eos && !self.ignore_eos) || self.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if generated >= self.max_tokens || seq_len >= max_context {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Whether sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons() {
        let p = SamplingParams {
            stop_token_ids: vec![7],
            ..SamplingParams::greedy(3)
        };
        assert_eq!(p.finish_reason(5, true, 1, 4, 100), Some(FinishReason::Stop));
        assert_eq!(p.finish_reason(7, false, 1, 4, 100), Some(FinishReason::Stop));
        assert_eq!(p.finish_reason(5, false, 1, 4, 100), None);
        assert_eq!(p.finish_reason(5, false, 3, 6, 100), Some(FinishReason::Length));
        assert_eq!(p.finish_reason(5, false, 1, 100, 100), Some(FinishReason::Length));
        let ignoring = SamplingParams { ignore_eos: true, ..p };
        assert_eq!(ignoring.finish_reason(5, true, 1, 4, 100), None);
    }

    #[test]
    fn validates_ranges() {
        assert!(SamplingParams::default().validate().is_ok());
        let bad = [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                max_tokens: 0,
                ..Default::default()
            },
            SamplingParams {
                stop: vec![String::new()],
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?}");
        }
    }
}
