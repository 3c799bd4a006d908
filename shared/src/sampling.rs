//! Sampling parameters: how the next token is chosen and when generation stops.

use serde::{Deserialize, Serialize};

/// Most proposals per speculative verify step a request or a server may ask for.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

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
    /// Speculative decoding for this request: proposals per verify step (0 turns it off);
    /// None takes the server's setting.
    pub speculative_tokens: Option<usize>,
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
            speculative_tokens: None,
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
/// Longest stop string in bytes: the matcher holds back that much streamed text, and a stop
/// longer than any reply could never match anyway.
pub const MAX_STOP_STRING_BYTES: usize = 1024;

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
        if self.stop.iter().any(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return err("stop", "stop strings must be at most 1024 bytes");
        }
        if self.speculative_tokens.is_some_and(|k| k > MAX_SPECULATIVE_TOKENS) {
            return err("speculative_tokens", "must be at most 16");
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

/// Sampling values a request falls back on when it leaves them out: the model's own
/// recommendation (`generation_config.json` beside a Hugging Face checkpoint, or a GGUF's
/// `general.sampling.*` keys), as vLLM does, else OpenAI's defaults (temperature 1, no
/// truncation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }
}

/// A model's sampling recommendation that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}: '{key}' = {value} is not a valid {what}")]
pub struct SamplingDefaultsError {
    pub source_name: String,
    pub key: &'static str,
    pub value: String,
    pub what: &'static str,
}

impl SamplingDefaults {
    /// The defaults with whatever of `temperature`, `top_k`, `top_p` and `min_p` `get` finds
    /// (`source_name` names where they come from in errors). Values out of range are errors, so
    /// a broken file is reported rather than silently ignored.
    pub fn with_overrides(source_name: &str, get: impl Fn(&str) -> Option<f64>) -> Result<Self, SamplingDefaultsError> {
        let mut d = Self::default();
        let bad = |key: &'static str, value: f64, what: &'static str| SamplingDefaultsError {
            source_name: source_name.to_string(),
            key,
            value: value.to_string(),
            what,
        };
        if let Some(t) = get("temperature") {
            if !(t.is_finite() && t >= 0.0) {
                return Err(bad("temperature", t, "temperature (≥ 0)"));
            }
            d.temperature = t as f32;
        }
        if let Some(k) = get("top_k") {
            // transformers and vLLM spell "off" as 0 or -1.
            if !(k.is_finite() && k >= -1.0 && k.fract() == 0.0) {
                return Err(bad("top_k", k, "top_k (-1, 0 or a positive integer)"));
            }
            d.top_k = if k <= 0.0 { 0 } else { k as usize };
        }
        if let Some(p) = get("top_p") {
            if !(p > 0.0 && p <= 1.0) {
                return Err(bad("top_p", p, "top_p (in (0, 1])"));
            }
            d.top_p = p as f32;
        }
        if let Some(p) = get("min_p") {
            if !(0.0..=1.0).contains(&p) {
                return Err(bad("min_p", p, "min_p (in [0, 1])"));
            }
            d.min_p = p as f32;
        }
        Ok(d)
    }

    /// From a `generation_config.json` text (missing keys keep the defaults).
    pub fn from_generation_config(text: &str) -> Result<Self, SamplingDefaultsError> {
        let json: serde_json::Value = serde_json::from_str(text).map_err(|e| SamplingDefaultsError {
            source_name: "generation_config.json".into(),
            key: "(file)",
            value: e.to_string(),
            what: "JSON document",
        })?;
        Self::with_overrides("generation_config.json", |k| json.get(k).and_then(|v| v.as_f64()))
    }
}

#[cfg(test)]
mod defaults_tests {
    use super::*;

    #[test]
    fn generation_config_values_override_openai_defaults() {
        let d = SamplingDefaults::from_generation_config(
            r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "bos_token_id": 1}"#,
        )
        .unwrap();
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: 0.6,
                top_k: 20,
                top_p: 0.95,
                min_p: 0.0
            }
        );
        assert_eq!(
            SamplingDefaults::from_generation_config("{}").unwrap(),
            SamplingDefaults::default()
        );
        let off = SamplingDefaults::from_generation_config(r#"{"top_k": -1}"#).unwrap();
        assert_eq!(off.top_k, 0);
    }

    #[test]
    fn bad_values_name_the_key() {
        for (text, key) in [
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": 2.5}"#, "top_k"),
            (r#"{"min_p": 3}"#, "min_p"),
        ] {
            let e = SamplingDefaults::from_generation_config(text).unwrap_err();
            assert_eq!(e.key, key, "{text}");
            assert!(e.to_string().contains(key), "{e}");
        }
        let e = SamplingDefaults::from_generation_config("{not json").unwrap_err();
        assert!(e.to_string().contains("generation_config.json"), "{e}");
    }
}
