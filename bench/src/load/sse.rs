//! Reading an OpenAI-style event stream: SSE framing first, then what each `data:` payload
//! means (a chunk with or without generated text, usage, an error, or `[DONE]`), and the
//! message of an HTTP error body.

use serde_json::Value;

/// One dispatched server-sent event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The `data:` lines of one event, joined with `\n` as the SSE spec says.
    Data(String),
    /// A non-standard `error:` field; llama-server reports some mid-stream failures this way.
    Error(String),
}

/// Assembles events from lines (line terminators already stripped).
#[derive(Debug, Default)]
pub struct Decoder {
    data: Option<String>,
}

impl Decoder {
    /// Feed one line; returns the event it completes, if any.
    pub fn line(&mut self, line: &str) -> Option<Event> {
        if line.is_empty() {
            return self.data.take().map(Event::Data);
        }
        // Comments: servers send them as keep-alives during long prefills.
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => self.data = Some(value.to_string()),
                }
                None
            }
            "error" => Some(Event::Error(value.to_string())),
            // `event`, `id`, `retry` and anything unknown carry nothing we measure.
            _ => None,
        }
    }

    /// The stream ended: an event still being assembled is dispatched (lenient: the spec
    /// would drop it, but a server that omits the last blank line still sent the data).
    pub fn finish(&mut self) -> Option<Event> {
        self.data.take().map(Event::Data)
    }
}

/// What one `data:` payload says.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// `[DONE]`: the stream ended cleanly.
    Done,
    /// A chunk: whether it carries generated text, and `usage.completion_tokens` if present
    /// (the final usage chunk, or every chunk on servers with continuous usage stats).
    Chunk {
        content: bool,
        completion_tokens: Option<u64>,
    },
    /// An `{"error": ...}` object: the request failed.
    Error(String),
}

/// Interpret one `data:` payload; `Err` when it is neither `[DONE]` nor a JSON object.
pub fn payload(data: &str) -> Result<Payload, String> {
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(Payload::Done);
    }
    let v: Value = serde_json::from_str(data).map_err(|e| format!("malformed SSE data ({e}): {}", clip(data)))?;
    if !v.is_object() {
        return Err(format!("SSE data is not a JSON object: {}", clip(data)));
    }
    if let Some(message) = error_message(&v) {
        return Ok(Payload::Error(message));
    }
    // Completions put text in `choices[].text`, chat in `choices[].delta.content`; reasoning
    // models stream `delta.reasoning_content` first, which is generated output too.
    let content = v["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|c| {
            [&c["text"], &c["delta"]["content"], &c["delta"]["reasoning_content"]]
                .iter()
                .any(|t| t.as_str().is_some_and(|s| !s.is_empty()))
        })
    });
    Ok(Payload::Chunk {
        content,
        completion_tokens: v["usage"]["completion_tokens"].as_u64(),
    })
}

/// The message of an OpenAI error object (`{"error": {"message": ...}}`), also accepting a
/// bare string (`{"error": "..."}`).
fn error_message(v: &Value) -> Option<String> {
    let e = v.get("error").filter(|e| !e.is_null())?;
    Some(match e {
        Value::String(s) => s.clone(),
        _ => match e["message"].as_str() {
            Some(m) => m.to_string(),
            None => clip(&e.to_string()),
        },
    })
}

/// One line for a non-200 answer: the status and the body's error message (OpenAI's shape,
/// FastAPI's `detail`, or the start of the body).
pub fn http_error(status: u16, body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let message = parsed.as_ref().and_then(|v| {
        error_message(v).or_else(|| match &v["detail"] {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            d => Some(clip(&d.to_string())),
        })
    });
    match message {
        Some(m) => format!("HTTP {status}: {m}"),
        None if body.trim().is_empty() => format!("HTTP {status}"),
        None => format!("HTTP {status}: {}", clip(body.trim())),
    }
}

/// At most 200 characters, so one bad payload cannot flood the report.
fn clip(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(text: &str) -> Vec<Event> {
        let mut d = Decoder::default();
        let mut out: Vec<Event> = text.lines().filter_map(|l| d.line(l)).collect();
        out.extend(d.finish());
        out
    }

    #[test]
    fn frames_events_and_skips_comments_and_unknown_fields() {
        let got = events(
            ": keep-alive\n\ndata: {\"a\":1}\n\nevent: message\nid: 7\ndata:{\"b\":2}\n\ngarbage line\nretry: 10\n\ndata: [DONE]\n\n",
        );
        assert_eq!(
            got,
            vec![
                Event::Data("{\"a\":1}".into()),
                Event::Data("{\"b\":2}".into()),
                Event::Data("[DONE]".into())
            ]
        );
    }

    #[test]
    fn joins_multiline_data_and_flushes_at_end() {
        assert_eq!(
            events("data: {\"a\":\ndata: 1}\n\ndata: [DONE]"),
            vec![Event::Data("{\"a\":\n1}".into()), Event::Data("[DONE]".into())]
        );
    }

    #[test]
    fn error_field_is_an_event() {
        let got = events("error: {\"code\":500,\"message\":\"boom\"}\n\n");
        assert_eq!(got, vec![Event::Error("{\"code\":500,\"message\":\"boom\"}".into())]);
    }

    #[test]
    fn completion_and_chat_chunks() {
        let completion =
            r#"{"object":"text_completion","choices":[{"index":0,"text":" Paris","finish_reason":null}],"usage":null}"#;
        assert_eq!(
            payload(completion),
            Ok(Payload::Chunk {
                content: true,
                completion_tokens: None
            })
        );
        let chat = r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
        assert_eq!(
            payload(chat),
            Ok(Payload::Chunk {
                content: true,
                completion_tokens: None
            })
        );
        // The role announcement and the finish chunk carry no text.
        for empty in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#,
        ] {
            assert_eq!(
                payload(empty),
                Ok(Payload::Chunk {
                    content: false,
                    completion_tokens: None
                })
            );
        }
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":8,"total_tokens":13}}"#;
        assert_eq!(
            payload(usage),
            Ok(Payload::Chunk {
                content: false,
                completion_tokens: Some(8)
            })
        );
        assert_eq!(payload(" [DONE] "), Ok(Payload::Done));
    }

    #[test]
    fn error_objects_in_the_stream() {
        let e = r#"{"error":{"message":"worker 2 is gone","type":"server_error","param":null,"code":"service_unavailable"}}"#;
        assert_eq!(payload(e), Ok(Payload::Error("worker 2 is gone".into())));
        assert_eq!(
            payload(r#"{"error":"overloaded"}"#),
            Ok(Payload::Error("overloaded".into()))
        );
        assert_eq!(
            payload(r#"{"error":{"code":3}}"#),
            Ok(Payload::Error(r#"{"code":3}"#.into()))
        );
        // `error: null` is not an error.
        assert!(matches!(
            payload(r#"{"error":null,"choices":[]}"#),
            Ok(Payload::Chunk { .. })
        ));
    }

    #[test]
    fn garbage_payloads_are_errors_not_panics() {
        for bad in ["", "not json", "{\"choices\":", "[1,2]", "42", &"x".repeat(5000)] {
            let e = payload(bad).unwrap_err();
            assert!(e.chars().count() < 300, "{e}");
        }
        // Wrong types inside a valid object: no text, no usage.
        assert_eq!(
            payload(r#"{"choices":"x","usage":{"completion_tokens":"8"}}"#),
            Ok(Payload::Chunk {
                content: false,
                completion_tokens: None
            })
        );
    }

    #[test]
    fn http_error_bodies() {
        let openai = r#"{"error":{"message":"The model `x` does not exist.","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#;
        assert_eq!(http_error(404, openai), "HTTP 404: The model `x` does not exist.");
        assert_eq!(http_error(422, r#"{"detail":"bad field"}"#), "HTTP 422: bad field");
        assert_eq!(
            http_error(502, "<html>Bad Gateway</html>\n"),
            "HTTP 502: <html>Bad Gateway</html>"
        );
        assert_eq!(http_error(503, ""), "HTTP 503");
        assert!(http_error(500, &"é".repeat(1000)).ends_with('…'));
    }
}
