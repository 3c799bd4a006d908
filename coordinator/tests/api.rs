//! The OpenAI-compatible API over a scripted fake generator: request validation, error shapes,
//! text handling (detokenizing, stop strings, usage), SSE framing and cancellation.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use baton_coordinator::api;
use baton_coordinator::generation::{FinishReason, SubmitError, TokenEvent};
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn paris() -> std::sync::Arc<FakeGenerator> {
    FakeGenerator::new(tokens_then(" Paris.", FinishReason::Stop))
}

#[tokio::test]
async fn health_ready_and_models() {
    let g = paris();
    let (s, v) = json_of(get(app(&g), "/health").await).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"status": "ok"})));
    assert_eq!(get(app(&g), "/ready").await.status(), StatusCode::OK);
    g.ready.store(false, Ordering::SeqCst);
    assert_eq!(get(app(&g), "/health").await.status(), StatusCode::OK);
    let res = get(app(&g), "/ready").await;
    assert!(res.headers().contains_key(header::RETRY_AFTER));
    assert_error(json_of(res).await, StatusCode::SERVICE_UNAVAILABLE, None);

    let (s, v) = json_of(get(app(&g), "/v1/models").await).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "test-model");
    assert_eq!(v["data"][0]["object"], "model");
    let (s, v) = json_of(get(app(&g), "/v1/models/test-model").await).await;
    assert_eq!((s, &v["id"]), (StatusCode::OK, &json!("test-model")));
    let res = json_of(get(app(&g), "/v1/models/other").await).await;
    assert_error(res, StatusCode::NOT_FOUND, Some("model"));
}

#[tokio::test]
async fn unknown_routes_and_methods_are_openai_errors() {
    let g = paris();
    let (s, v) = json_of(get(app(&g), "/v1/nothing").await).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "unknown_url");
    let (s, v) = json_of(get(app(&g), COMPLETIONS).await).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert!(v["error"]["message"].is_string());
}

#[tokio::test]
async fn completion_text_usage_and_request() {
    let g = paris();
    let (s, v) = post(
        app(&g),
        COMPLETIONS,
        json!({"model": "test-model", "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], "test-model");
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], " Paris.");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["index"], 0);
    assert!(choice["logprobs"].is_null());
    // 7 text tokens; the fake ended with Done(Stop) without an EOS token.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 24, "completion_tokens": 7, "total_tokens": 31})
    );
    let req = g.last_request();
    assert_eq!(req.prompt, ids("The capital of France is"));
    assert_eq!((req.params.max_tokens, req.params.temperature), (10, 0.0));
    assert!(!req.logprobs);
}

#[tokio::test]
async fn eos_token_is_counted_but_not_shown() {
    let mut events = tokens_then("ok", FinishReason::Stop);
    events.insert(
        2,
        TokenEvent::Token {
            id: EOS,
            logprobs: None,
        },
    );
    let g = FakeGenerator::new(events);
    let (s, v) = post(app(&g), COMPLETIONS, json!({"prompt": "x"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], "ok");
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn prompt_shapes() {
    let g = paris();
    for prompt in [json!("hi"), json!(["hi"]), json!([104, 105]), json!([[104, 105]])] {
        let (s, v) = post(app(&g), COMPLETIONS, json!({"prompt": prompt})).await;
        assert_eq!(s, StatusCode::OK, "{prompt}: {v}");
        assert_eq!(g.last_request().prompt, ids("hi"));
        assert_eq!(v["usage"]["prompt_tokens"], 2);
    }
    for prompt in [json!(""), json!([]), json!([""]), json!([[]])] {
        let res = post(app(&g), COMPLETIONS, json!({"prompt": prompt})).await;
        assert_error(res, StatusCode::BAD_REQUEST, Some("prompt"));
    }
    for prompt in [
        json!(["a", "b"]),
        json!(5),
        json!({"a": 1}),
        json!([1, "a"]),
        json!([-1]),
    ] {
        let res = post(app(&g), COMPLETIONS, json!({"prompt": prompt})).await;
        assert_error(res, StatusCode::BAD_REQUEST, Some("prompt"));
    }
    let msg = assert_error(
        post(app(&g), COMPLETIONS, json!({"prompt": [1, 99999]})).await,
        StatusCode::BAD_REQUEST,
        Some("prompt"),
    );
    assert!(msg.contains("99999"), "{msg}");
}

#[tokio::test]
async fn chat_renders_the_template_and_answers() {
    let g = paris();
    let body = json!({
        "model": "test-model",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Capital"}, {"type": "text", "text": "of France?"}]}
        ],
        "max_completion_tokens": 5,
    });
    let (s, v) = post(app(&g), CHAT, body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": " Paris."})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital\nof France?<|im_end|>\n<|im_start|>assistant\n";
    let req = g.last_request();
    assert_eq!(req.prompt, tokenizer().encode(want, false).unwrap());
    assert_eq!(req.params.max_tokens, 5);
    // Chat's default temperature is OpenAI's 1.
    assert_eq!(req.params.temperature, 1.0);
    assert_eq!(v["usage"]["prompt_tokens"], req.prompt.len());
}

#[tokio::test]
async fn chat_max_tokens_defaults_to_the_rest_of_the_context() {
    let g = paris();
    let (s, v) = post(app(&g), CHAT, json!({"messages": [{"role": "user", "content": "Hi"}]})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let req = g.last_request();
    assert_eq!(req.prompt.len() + req.params.max_tokens, 64);
}

#[tokio::test]
async fn malformed_and_mistyped_bodies() {
    let g = paris();
    for body in ["{", "{\"prompt\": }", "", "not json", "{\"prompt\": \"a\"} trailing"] {
        let res = json_of(post_raw(app(&g), COMPLETIONS, body).await).await;
        assert_error(res, StatusCode::BAD_REQUEST, None);
    }
    let res = post(app(&g), COMPLETIONS, json!({"prompt": "a", "temperature": "hot"})).await;
    let msg = assert_error(res, StatusCode::BAD_REQUEST, Some("temperature"));
    assert!(msg.contains("temperature"), "{msg}");
    let res = post(
        app(&g),
        CHAT,
        json!({"messages": [{"role": "user", "content": "a"}], "stream": "yes"}),
    )
    .await;
    assert_error(res, StatusCode::BAD_REQUEST, Some("stream"));
    let res = post(app(&g), CHAT, json!({"messages": [{"content": "a"}]})).await;
    assert_error(res, StatusCode::BAD_REQUEST, Some("messages[0].role"));
    let res = post(app(&g), CHAT, json!({"model": "test-model"})).await;
    assert_error(res, StatusCode::BAD_REQUEST, Some("messages"));
    let res = post(app(&g), COMPLETIONS, json!({"max_tokens": 3})).await;
    assert_error(res, StatusCode::BAD_REQUEST, Some("prompt"));
    // Content types other than JSON are parsed anyway (curl -d sends a form type).
    let req = Request::post(COMPLETIONS)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from(json!({"prompt": "hi"}).to_string()))
        .unwrap();
    assert_eq!(app(&g).oneshot(req).await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        g.requests.lock().unwrap().len(),
        1,
        "no invalid request may reach the generator"
    );
}

#[tokio::test]
async fn unknown_model_is_404() {
    let g = paris();
    let (s, v) = post(app(&g), COMPLETIONS, json!({"model": "gpt-4", "prompt": "a"})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let res = post(
        app(&g),
        CHAT,
        json!({"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]}),
    )
    .await;
    assert_error(res, StatusCode::NOT_FOUND, Some("model"));
}

#[tokio::test]
async fn limits_and_unsupported_options() {
    let g = paris();
    let msg = assert_error(
        post(app(&g), COMPLETIONS, json!({"prompt": "x".repeat(60), "max_tokens": 5})).await,
        StatusCode::BAD_REQUEST,
        Some("prompt"),
    );
    assert!(msg.contains("64") && msg.contains("65") && msg.contains("60"), "{msg}");
    let long_chat = json!({"messages": [{"role": "user", "content": "x".repeat(80)}]});
    assert_error(
        post(app(&g), CHAT, long_chat).await,
        StatusCode::BAD_REQUEST,
        Some("messages"),
    );
    let cases = [
        (json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "a", "max_tokens": -5}), "max_tokens"),
        (json!({"prompt": "a", "n": 2}), "n"),
        (json!({"prompt": "a", "echo": true}), "echo"),
        (json!({"prompt": "a", "top_p": 0}), "top_p"),
        (json!({"prompt": "a", "temperature": 101}), "temperature"),
        (json!({"prompt": "a", "min_p": 2}), "min_p"),
        (json!({"prompt": "a", "top_k": -2}), "top_k"),
        (json!({"prompt": "a", "stop": vec!["a"; 17]}), "stop"),
        (json!({"prompt": "a", "stop": 3}), "stop"),
        (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "a", "presence_penalty": 1}), "presence_penalty"),
    ];
    for (body, param) in cases {
        let res = post(app(&g), COMPLETIONS, body.clone()).await;
        assert_error(res, StatusCode::BAD_REQUEST, Some(param));
    }
    let user = json!([{"role": "user", "content": "a"}]);
    let chat_cases = [
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "tool", "content": "a"}]}),
            "messages[0].role",
        ),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": user, "max_completion_tokens": 0}),
            "max_completion_tokens",
        ),
        (json!({"messages": user, "max_tokens": 0}), "max_tokens"),
        (json!({"messages": user, "top_logprobs": 3}), "top_logprobs"),
        (
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"messages": user, "n": 3}), "n"),
        (json!({"messages": user, "tools": [{"type": "function"}]}), "tools"),
    ];
    for (body, param) in chat_cases {
        let res = post(app(&g), CHAT, body.clone()).await;
        assert_error(res, StatusCode::BAD_REQUEST, Some(param));
    }
    assert!(g.requests.lock().unwrap().is_empty());
    // Neutral values of unsupported options are fine.
    let (s, v) = post(
        app(&g),
        CHAT,
        json!({"messages": user, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "top_k": -1, "user": "me"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn oversized_body_is_413() {
    let g = paris();
    let mut state = state(&g);
    state.max_body_bytes = 1024;
    let app = api::router(state);
    let body = json!({"prompt": "x".repeat(2000)}).to_string();
    let res = json_of(post_raw(app.clone(), COMPLETIONS, body).await).await;
    let msg = assert_error(res, StatusCode::PAYLOAD_TOO_LARGE, None);
    assert!(msg.contains("1024"), "{msg}");
    // Without a Content-Length (chunked upload) the limit holds too.
    let chunks = futures::stream::iter((0..40).map(|_| Ok::<_, std::io::Error>("x".repeat(100))));
    let res = post_raw(app, COMPLETIONS, Body::from_stream(chunks)).await;
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn submit_errors_map_to_status_codes() {
    let g = paris();
    let body = json!({"prompt": "a"});
    *g.reject.lock().unwrap() = Some(SubmitError::Unavailable("no workers".into()));
    let res = post_raw(app(&g), COMPLETIONS, body.to_string()).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let msg = assert_error(json_of(res).await, StatusCode::SERVICE_UNAVAILABLE, None);
    assert!(msg.contains("no workers"), "{msg}");

    *g.reject.lock().unwrap() = Some(SubmitError::Overloaded("queue full".into()));
    let res = post_raw(
        app(&g),
        CHAT,
        json!({"messages": [{"role": "user", "content": "a"}]}).to_string(),
    )
    .await;
    assert_eq!(res.headers()[header::RETRY_AFTER], "1");
    let (s, v) = json_of(res).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");

    *g.reject.lock().unwrap() = Some(SubmitError::Invalid("token 7 is cursed".into()));
    let res = post(app(&g), COMPLETIONS, body).await;
    assert_error(res, StatusCode::BAD_REQUEST, None);
}

#[tokio::test]
async fn failure_mid_request() {
    let mut events = tokens_then("par", FinishReason::Stop);
    events.truncate(3);
    events.push(TokenEvent::Failed {
        message: "worker 1 died".into(),
        retriable: true,
    });
    let g = FakeGenerator::new(events.clone());
    let msg = assert_error(
        post(app(&g), COMPLETIONS, json!({"prompt": "a"})).await,
        StatusCode::SERVICE_UNAVAILABLE,
        None,
    );
    assert!(msg.contains("worker 1 died"), "{msg}");

    // Streaming: an error event, and no [DONE].
    let res = post_raw(app(&g), COMPLETIONS, json!({"prompt": "a", "stream": true}).to_string()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let data = sse_data(&text_of(res).await);
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert!(
        last["error"]["message"].as_str().unwrap().contains("worker 1 died"),
        "{data:?}"
    );
    assert!(!data.iter().any(|d| d == "[DONE]"));

    // A generator that vanishes without Done is a failure too.
    events.pop();
    let g = FakeGenerator::new(events);
    assert_error(
        post(app(&g), COMPLETIONS, json!({"prompt": "a"})).await,
        StatusCode::SERVICE_UNAVAILABLE,
        None,
    );
}

#[tokio::test]
async fn stop_strings_cut_text_and_cancel_generation() {
    let g = FakeGenerator::new(tokens_then(" Paris. The end is near.", FinishReason::Length));
    let (s, v) = post(app(&g), COMPLETIONS, json!({"prompt": "a", "stop": [". T", "zzz"]})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], " Paris");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Tokens up to the one completing the stop string: " Paris. T".
    assert_eq!(v["usage"]["completion_tokens"], 9);
    g.wait_cancelled(1).await;
    assert_eq!(g.last_request().params.stop, vec![". T".to_string(), "zzz".to_string()]);

    // The same through a stream, with a plain string `stop`.
    let body = json!({"messages": [{"role": "user", "content": "a"}], "stop": ". T", "stream": true});
    let res = post_raw(app(&g), CHAT, body.to_string()).await;
    let data = sse_data(&text_of(res).await);
    let (text, finish, _) = chat_stream_parts(&data);
    assert_eq!((text.as_str(), finish.as_str()), (" Paris", "stop"));
    g.wait_cancelled(2).await;
}

#[tokio::test]
async fn held_back_text_is_released_at_the_end() {
    // "Paris.\n" could be the start of the stop string "\n\n" until generation ends.
    let g = FakeGenerator::new(tokens_then("Paris.\n", FinishReason::Length));
    let body = json!({"prompt": "a", "stop": "\n\n", "stream": true});
    let data = sse_data(&text_of(post_raw(app(&g), COMPLETIONS, body.to_string()).await).await);
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Paris.\n");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
}

/// Concatenated content, finish reason and the usage chunk (if any) of a chat stream.
fn chat_stream_parts(data: &[String]) -> (String, String, Option<Value>) {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "{data:?}");
    let mut text = String::new();
    let mut finish = String::new();
    let mut usage = None;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(c["id"], chunks[0]["id"]);
        if c["choices"].as_array().unwrap().is_empty() {
            usage = Some(c["usage"].clone());
            continue;
        }
        assert!(finish.is_empty(), "content after finish_reason: {data:?}");
        text.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish, usage)
}

#[tokio::test]
async fn sse_framing_and_usage() {
    let g = FakeGenerator::new(tokens_then("Hé!", FinishReason::Length));
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "stream": true, "max_tokens": 4,
                      "stream_options": {"include_usage": true}});
    let res = post_raw(app(&g), CHAT, body.to_string()).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()[header::CONTENT_TYPE], "text/event-stream");
    let raw = text_of(res).await;
    assert!(raw.starts_with("data: {"), "{raw}");
    assert!(raw.ends_with("data: [DONE]\n\n"), "{raw}");
    let data = sse_data(&raw);
    let (text, finish, usage) = chat_stream_parts(&data);
    // "é" is two byte tokens: never split into invalid UTF-8.
    assert_eq!((text.as_str(), finish.as_str()), ("Hé!", "length"));
    let prompt_len = g.last_request().prompt.len();
    assert_eq!(
        usage.unwrap(),
        json!({"prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4})
    );
    // With include_usage every other chunk carries `usage: null`.
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert!(first.get("usage").is_some_and(Value::is_null), "{first}");

    // Without include_usage: no usage chunk and no usage field.
    let body = json!({"prompt": "Hi", "stream": true});
    let data = sse_data(&text_of(post_raw(app(&g), COMPLETIONS, body.to_string()).await).await);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c.get("usage").is_none() && c["object"] == "text_completion")
    );
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hé!");
}

#[tokio::test]
async fn streamed_and_whole_text_agree() {
    let g = FakeGenerator::new(tokens_then("One, two; three.\n\nFour", FinishReason::Length));
    let (_, whole) = post(app(&g), COMPLETIONS, json!({"prompt": "a", "stop": ["\n\n"]})).await;
    let body = json!({"prompt": "a", "stop": ["\n\n"], "stream": true});
    let data = sse_data(&text_of(post_raw(app(&g), COMPLETIONS, body.to_string()).await).await);
    let streamed: String = data[..data.len() - 1]
        .iter()
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(whole["choices"][0]["text"], "One, two; three.");
    assert_eq!(streamed, "One, two; three.");
}

#[tokio::test]
async fn logprobs_shapes() {
    let g = FakeGenerator::with_script(Script {
        events: tokens_then("ab", FinishReason::Length),
        with_logprobs: true,
        ..Default::default()
    });
    let body = json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 2});
    let (s, v) = post(app(&g), CHAT, body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let req = g.last_request();
    assert!(req.logprobs);
    assert_eq!(req.top_logprobs, 2);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2);
    assert_eq!(content[0]["token"], "a");
    assert_eq!(content[0]["logprob"], -1.0);
    assert_eq!(content[0]["bytes"], json!([97]));
    assert_eq!(
        content[0]["top_logprobs"],
        json!([{"token": "b", "logprob": -2.0, "bytes": [98]}, {"token": "c", "logprob": -3.0, "bytes": [99]}])
    );

    let (s, v) = post(app(&g), COMPLETIONS, json!({"prompt": "x", "logprobs": 1})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["a", "b"]));
    assert_eq!(lp["token_logprobs"], json!([-1.0, -1.0]));
    assert_eq!(lp["text_offset"], json!([0, 1]));
    // The top entries plus the chosen token.
    assert_eq!(lp["top_logprobs"][0], json!({"b": -2.0, "c": -3.0, "a": -1.0}));

    let body = json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "stream": true});
    let data = sse_data(&text_of(post_raw(app(&g), CHAT, body.to_string()).await).await);
    let entries: usize = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().map(Vec::len))
        .sum();
    assert_eq!(entries, 2);
}

#[tokio::test]
async fn dropping_a_streamed_body_cancels_generation() {
    let g = FakeGenerator::with_script(Script {
        then_forever: Some(b'a' as u32),
        delay: Duration::from_millis(5),
        ..Default::default()
    });
    let body = json!({"prompt": "a", "stream": true, "max_tokens": 50});
    let res = post_raw(app(&g), COMPLETIONS, body.to_string()).await;
    let mut stream = res.into_body().into_data_stream();
    let first = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .unwrap();
    assert!(first.unwrap().unwrap().starts_with(b"data: "));
    drop(stream);
    g.wait_cancelled(1).await;
}

#[tokio::test]
async fn client_disconnect_cancels_generation() {
    let g = FakeGenerator::with_script(Script {
        then_forever: Some(b'a' as u32),
        delay: Duration::from_millis(5),
        ..Default::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(api::serve(
        listener,
        app(&g),
        Default::default(),
        std::future::pending(),
    ));

    let body = json!({"messages": [{"role": "user", "content": "a"}], "stream": true, "max_tokens": 20}).to_string();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"a\"") {
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no data from the server: {}", String::from_utf8_lossy(&seen)))
            .unwrap();
        assert!(n > 0, "server closed the stream early");
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen);
        assert!(text.len() < 12 || text.starts_with("HTTP/1.1 200"), "{text}");
    }
    drop(conn);
    g.wait_cancelled(1).await;
    server.abort();
}

/// A request with an optional `Authorization: Bearer` key.
async fn with_key(app: axum::Router, method: &str, path: &str, key: Option<&str>) -> axum::http::Response<Body> {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let body = match method {
        "POST" => Body::from(json!({"model": "test-model", "prompt": "Hi", "max_tokens": 3}).to_string()),
        _ => Body::empty(),
    };
    app.oneshot(req.body(body).unwrap()).await.unwrap()
}

#[tokio::test]
async fn api_keys_guard_the_api_and_leave_the_probes_open() {
    use baton_coordinator::api::auth::ApiKeys;
    for protect_admin in [false, true] {
        let g = paris();
        let keyed = || {
            let keys = ApiKeys::new(vec!["sk-one".into(), "sk-two".into()], protect_admin).unwrap();
            api::router(api::AppState {
                api_keys: keys,
                ..state(&g)
            })
        };
        for (method, path) in [("POST", COMPLETIONS), ("GET", "/v1/models"), ("GET", "/nowhere")] {
            for key in [None, Some("sk-three"), Some("sk-on")] {
                let res = with_key(keyed(), method, path, key).await;
                assert_eq!(res.headers()[header::WWW_AUTHENTICATE], "Bearer");
                let got = json_of(res).await;
                assert_eq!(got.1["error"]["code"], "invalid_api_key", "{}", got.1);
                let msg = assert_error(got, StatusCode::UNAUTHORIZED, None);
                let want = if key.is_none() {
                    "provide an API key"
                } else {
                    "Incorrect API key"
                };
                assert!(msg.contains(want), "{path} {key:?}: {msg}");
            }
        }
        // No request reached the generator without a key.
        assert!(g.requests.lock().unwrap().is_empty());
        for key in ["sk-one", "sk-two"] {
            let (s, v) = json_of(with_key(keyed(), "POST", COMPLETIONS, Some(key)).await).await;
            assert_eq!(
                (s, v["choices"][0]["text"].as_str()),
                (StatusCode::OK, Some(" Paris.")),
                "{v}"
            );
        }
        for path in ["/health", "/ready"] {
            assert_eq!(
                with_key(keyed(), "GET", path, None).await.status(),
                StatusCode::OK,
                "{path}"
            );
        }
        for path in ["/metrics", "/admin/cluster", "/dashboard"] {
            let status = with_key(keyed(), "GET", path, None).await.status();
            assert_eq!(status == StatusCode::UNAUTHORIZED, protect_admin, "{path}: {status}");
            let status = with_key(keyed(), "GET", path, Some("sk-one")).await.status();
            assert_ne!(status, StatusCode::UNAUTHORIZED, "{path} with a key");
        }
    }
    // Without keys the API stays open to any or no key.
    let g = paris();
    assert_eq!(
        with_key(app(&g), "GET", "/v1/models", None).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        with_key(app(&g), "GET", "/v1/models", Some("x")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn limits_hit_are_counted_by_name_and_long_stop_strings_are_refused() {
    baton_shared::telemetry::prometheus().expect("metrics recorder");
    let g = paris();
    let long = "x".repeat(1025);
    let body = json!({"model": "test-model", "prompt": "Hi", "max_tokens": 3, "stop": ["ok", long]});
    let msg = assert_error(
        post(app(&g), COMPLETIONS, body).await,
        StatusCode::BAD_REQUEST,
        Some("stop"),
    );
    assert!(msg.contains("at most 1024 bytes, got one of 1025"), "{msg}");
    let fine = json!({"model": "test-model", "prompt": "Hi", "max_tokens": 3, "stop": ["x".repeat(1024)]});
    assert_eq!(post(app(&g), COMPLETIONS, fine).await.0, StatusCode::OK);
    let too_many = json!({"model": "test-model", "prompt": "Hi", "stop": vec!["s"; 17]});
    assert_error(
        post(app(&g), COMPLETIONS, too_many).await,
        StatusCode::BAD_REQUEST,
        Some("stop"),
    );
    let metrics = text_of(get(app(&g), "/metrics").await).await;
    for limit in ["stop_string_bytes", "stop_strings"] {
        let line = format!("baton_http_limit_hits_total{{limit=\"{limit}\"}}");
        assert!(metrics.contains(&line), "{line} missing from:\n{metrics}");
    }
}
