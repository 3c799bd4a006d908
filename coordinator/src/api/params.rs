//! Turning request fields into [`SamplingParams`], with a 400 naming the field for anything out
//! of range or unsupported, and the context-length check.

use baton_shared::sampling::{
    MAX_SPECULATIVE_TOKENS, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, SamplingDefaults, SamplingParams,
};
use serde_json::Value;

use super::error::ApiError;
use super::types::SamplingFields;

/// Most alternatives per token a request may ask for (OpenAI's chat limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// `max_tokens` when the request leaves it out.
#[derive(Debug, Clone, Copy)]
pub enum DefaultMaxTokens {
    /// A fixed number (completions: OpenAI's 16).
    Fixed(usize),
    /// Whatever the context has left after the prompt (chat).
    RestOfContext,
}

/// Where the prompt came from, for error messages (`prompt` or `messages`).
#[derive(Debug, Clone, Copy)]
pub struct PromptField(pub &'static str);

/// The model name must be absent or the served one.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), ApiError> {
    match requested {
        Some(m) if m != served => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// `stop`: a string, an array of strings, or null.
pub fn parse_stop(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let err = || ApiError::invalid_param("stop", "'stop' must be a string or an array of strings");
    let stops = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(err))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(err()),
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid_param(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are supported, got {}",
                stops.len()
            ),
        )
        .at_limit("stop_strings"));
    }
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::invalid_param(
            "stop",
            format!(
                "stop strings may be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}",
                long.len()
            ),
        )
        .at_limit("stop_string_bytes"));
    }
    Ok(stops)
}

/// `top_logprobs` / completions' `logprobs` count in 0..=20.
pub fn parse_top_logprobs(param: &str, n: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&n) {
        return Err(ApiError::invalid_param(
            param,
            format!("'{param}' must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
        )
        .at_limit("top_logprobs"));
    }
    Ok(n as usize)
}

impl SamplingFields {
    /// Sampling parameters for a prompt of `prompt_len` tokens in a context of `max_context`,
    /// with `defaults` for the sampling fields left out. `max_tokens_param` names the field the
    /// limit came from (for error messages).
    #[allow(clippy::too_many_arguments)]
    pub fn to_params(
        &self,
        defaults: &SamplingDefaults,
        prompt_len: usize,
        max_context: usize,
        default_max: DefaultMaxTokens,
        max_tokens_param: &str,
        prompt_field: PromptField,
    ) -> Result<SamplingParams, ApiError> {
        self.check_unsupported()?;
        let stop = parse_stop(self.stop.as_ref())?;
        let top_k = match self.top_k {
            None => defaults.top_k,
            // vLLM spells "off" as -1, the rest of the world as 0.
            Some(0) | Some(-1) => 0,
            Some(k) if k < 0 => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("'top_k' must be -1 or 0 (off) or positive, got {k}"),
                ));
            }
            Some(k) => k as usize,
        };
        let max_tokens = match self.max_tokens {
            Some(m) if m < 1 => {
                return Err(ApiError::invalid_param(
                    max_tokens_param,
                    format!("'{max_tokens_param}' must be at least 1, got {m}"),
                ));
            }
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
            None => match default_max {
                DefaultMaxTokens::Fixed(n) => n,
                DefaultMaxTokens::RestOfContext => max_context.saturating_sub(prompt_len).max(1),
            },
        };
        check_context(prompt_len, max_tokens, max_context, prompt_field)?;
        let speculative_tokens = match self.speculative_tokens {
            None => None,
            Some(k) if (0..=MAX_SPECULATIVE_TOKENS as i64).contains(&k) => Some(k as usize),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "speculative_tokens",
                    format!("'speculative_tokens' must be between 0 (off) and {MAX_SPECULATIVE_TOKENS}, got {k}"),
                ));
            }
        };
        let params = SamplingParams {
            // The model's recommendation, else OpenAI's: 1 (sampling), not greedy.
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            // OpenAI seeds are signed 64-bit; any bit pattern is as good a seed.
            seed: self.seed.map(|s| s as u64),
            max_tokens,
            stop_token_ids: Vec::new(),
            stop,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            speculative_tokens,
        };
        params.validate().map_err(|e| {
            let param = if e.param == "max_tokens" {
                max_tokens_param
            } else {
                e.param
            };
            ApiError::invalid_param(param, format!("'{param}' {}", e.message))
        })?;
        Ok(params)
    }

    /// Fields we accept for compatibility only at their neutral values.
    fn check_unsupported(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::invalid_param("n", "only n=1 is supported"));
        }
        let unsupported =
            |param: &str| ApiError::invalid_param(param, format!("'{param}' is not supported by this server"));
        for (param, value, neutral) in [
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ] {
            if value.is_some_and(|v| v != neutral) {
                return Err(unsupported(param));
            }
        }
        match &self.logit_bias {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) if m.is_empty() => {}
            Some(_) => return Err(unsupported("logit_bias")),
        }
        Ok(())
    }
}

/// Reject a request whose prompt plus completion cannot fit the model's context.
pub fn check_context(
    prompt_len: usize,
    max_tokens: usize,
    max_context: usize,
    prompt_field: PromptField,
) -> Result<(), ApiError> {
    if prompt_len.saturating_add(max_tokens) > max_context {
        let field = prompt_field.0;
        return Err(ApiError::invalid_param(
            field,
            format!(
                "This model's maximum context length is {max_context} tokens. However, you requested \
                 {} tokens ({prompt_len} in the {field}, {max_tokens} for the completion). Please reduce \
                 the length of the {field} or the completion.",
                prompt_len.saturating_add(max_tokens)
            ),
        )
        .at_limit("max_model_len"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: SamplingFields, prompt: usize) -> Result<SamplingParams, ApiError> {
        f.to_params(
            &SamplingDefaults::default(),
            prompt,
            100,
            DefaultMaxTokens::Fixed(16),
            "max_tokens",
            PromptField("prompt"),
        )
    }

    #[test]
    fn defaults_follow_openai() {
        let p = params(SamplingFields::default(), 5).unwrap();
        assert_eq!((p.temperature, p.top_p, p.max_tokens, p.top_k), (1.0, 1.0, 16, 0));
        let p = SamplingFields::default()
            .to_params(
                &SamplingDefaults::default(),
                30,
                100,
                DefaultMaxTokens::RestOfContext,
                "max_tokens",
                PromptField("messages"),
            )
            .unwrap();
        assert_eq!(p.max_tokens, 70);
    }

    #[test]
    fn the_models_recommendation_fills_what_a_request_leaves_out() {
        let model = SamplingDefaults {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.05,
        };
        let to_params = |f: SamplingFields| {
            f.to_params(
                &model,
                5,
                100,
                DefaultMaxTokens::Fixed(16),
                "max_tokens",
                PromptField("prompt"),
            )
            .unwrap()
        };
        let p = to_params(SamplingFields::default());
        assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p), (0.6, 20, 0.95, 0.05));
        // What the request sets wins, including "off".
        let p = to_params(SamplingFields {
            temperature: Some(0.0),
            top_k: Some(-1),
            top_p: Some(1.0),
            min_p: Some(0.0),
            ..Default::default()
        });
        assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p), (0.0, 0, 1.0, 0.0));
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        let cases = [
            (
                SamplingFields {
                    max_tokens: Some(0),
                    ..Default::default()
                },
                "max_tokens",
            ),
            (
                SamplingFields {
                    temperature: Some(-0.5),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingFields {
                    top_p: Some(0.0),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingFields {
                    top_k: Some(-3),
                    ..Default::default()
                },
                "top_k",
            ),
            (
                SamplingFields {
                    n: Some(2),
                    ..Default::default()
                },
                "n",
            ),
            (
                SamplingFields {
                    stop: Some(serde_json::json!([1])),
                    ..Default::default()
                },
                "stop",
            ),
            (
                SamplingFields {
                    stop: Some(serde_json::json!([""])),
                    ..Default::default()
                },
                "stop",
            ),
            (
                SamplingFields {
                    frequency_penalty: Some(0.5),
                    ..Default::default()
                },
                "frequency_penalty",
            ),
        ];
        for (fields, param) in cases {
            let e = params(fields, 5).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
    }

    #[test]
    fn prompt_plus_completion_must_fit() {
        let f = SamplingFields {
            max_tokens: Some(20),
            ..Default::default()
        };
        assert!(params(f.clone(), 80).is_ok());
        let e = params(f, 81).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("100") && e.message.contains("101"), "{}", e.message);
        let huge = SamplingFields {
            max_tokens: Some(i64::MAX),
            ..Default::default()
        };
        assert!(params(huge, 1).is_err());
    }
}
