//! Test doubles for the HTTP API: a byte-level tokenizer written to a temp dir and a scripted
//! fake `Generator` that records requests and notices cancellation.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use baton_coordinator::api::{self, AppState};
use baton_coordinator::generation::{
    FinishReason, GenerationRequest, Generator, SubmitError, TokenEvent, TokenLogprobs,
};
use baton_shared::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tower::ServiceExt;

/// Id of `<|endoftext|>` (EOS) in the test tokenizer; ids 0..256 are the bytes themselves.
pub const EOS: u32 = 256;

/// GPT-2's byte-to-character table, so that token id == byte value.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in printable.iter().zip(chars) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// A byte-level tokenizer (one token per byte, no merges) with ChatML specials and template.
pub fn tokenizer() -> Tokenizer {
    let vocab: serde_json::Map<String, Value> = byte_chars()
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(256, "<|endoftext|>"), special(257, "<|im_start|>"), special(258, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    let config = json!({
        "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    Tokenizer::from_hf_dir(dir.path()).unwrap()
}

/// Token ids spelling `text` in the test tokenizer.
pub fn ids(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Token events for `text`, then `Done`.
pub fn tokens_then(text: &str, reason: FinishReason) -> Vec<TokenEvent> {
    ids(text)
        .into_iter()
        .map(|id| TokenEvent::Token { id, logprobs: None })
        .chain([TokenEvent::Done { reason }])
        .collect()
}

/// What the fake sends for each request.
#[derive(Clone, Default)]
pub struct Script {
    pub events: Vec<TokenEvent>,
    /// After `events`, keep sending this token until the receiver is dropped.
    pub then_forever: Option<u32>,
    pub delay: Duration,
    /// Attach logprobs (chosen token -1.0, alternatives `id+1`, `id+2` at -2.0, -3.0).
    pub with_logprobs: bool,
}

/// A scripted generator; every request gets the same script.
pub struct FakeGenerator {
    pub ready: AtomicBool,
    pub reject: Mutex<Option<SubmitError>>,
    pub script: Mutex<Script>,
    pub requests: Mutex<Vec<GenerationRequest>>,
    /// Requests whose receiver was dropped while the fake still had events to send.
    pub cancelled: Arc<AtomicUsize>,
    pub cancelled_notify: Arc<Notify>,
}

impl FakeGenerator {
    /// A ready fake sending `events` to every request.
    pub fn new(events: Vec<TokenEvent>) -> Arc<Self> {
        Self::with_script(Script {
            events,
            ..Default::default()
        })
    }

    pub fn with_script(script: Script) -> Arc<Self> {
        Arc::new(Self {
            ready: AtomicBool::new(true),
            reject: Mutex::new(None),
            script: Mutex::new(script),
            requests: Mutex::new(Vec::new()),
            cancelled: Arc::new(AtomicUsize::new(0)),
            cancelled_notify: Arc::new(Notify::new()),
        })
    }

    /// The last request received.
    pub fn last_request(&self) -> GenerationRequest {
        self.requests
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("no request reached the generator")
    }

    /// Wait (bounded) until `n` requests have been cancelled.
    pub async fn wait_cancelled(&self, n: usize) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while self.cancelled.load(Ordering::SeqCst) < n {
                let notified = self.cancelled_notify.notified();
                if self.cancelled.load(Ordering::SeqCst) >= n {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
            }
        })
        .await
        .expect("the generator never saw its receiver dropped");
    }
}

fn with_logprobs(ev: TokenEvent) -> TokenEvent {
    match ev {
        TokenEvent::Token { id, .. } => TokenEvent::Token {
            id,
            logprobs: Some(TokenLogprobs {
                logprob: -1.0,
                top: vec![(id + 1, -2.0), (id + 2, -3.0)],
            }),
        },
        other => other,
    }
}

impl Generator for FakeGenerator {
    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, SubmitError> {
        if let Some(e) = self.reject.lock().unwrap().clone() {
            return Err(e);
        }
        self.requests.lock().unwrap().push(req);
        let script = self.script.lock().unwrap().clone();
        // Capacity 1 keeps the fake at most one event ahead, so a dropped receiver is seen.
        let (tx, rx) = mpsc::channel(1);
        let (cancelled, notify) = (self.cancelled.clone(), self.cancelled_notify.clone());
        tokio::spawn(async move {
            let forever = script.then_forever.map(|id| TokenEvent::Token { id, logprobs: None });
            let events = script
                .events
                .into_iter()
                .map(Some)
                .chain(std::iter::repeat_n(None, usize::MAX));
            for ev in events {
                let Some(ev) = ev.or_else(|| forever.clone()) else {
                    return;
                };
                if !script.delay.is_zero() {
                    tokio::time::sleep(script.delay).await;
                }
                let ev = if script.with_logprobs { with_logprobs(ev) } else { ev };
                if tx.send(ev).await.is_err() {
                    cancelled.fetch_add(1, Ordering::SeqCst);
                    notify.notify_waiters();
                    return;
                }
            }
        });
        Ok(rx)
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

/// App state over the fake with the test tokenizer and a 64-token context.
pub fn state(generator: &Arc<FakeGenerator>) -> AppState {
    AppState::new("test-model", Arc::new(tokenizer()), 64, generator.clone())
}

/// The router over the fake.
pub fn app(generator: &Arc<FakeGenerator>) -> Router {
    api::router(state(generator))
}

/// POST a raw body.
pub async fn post_raw(app: Router, path: &str, body: impl Into<Body>) -> Response<Body> {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(body.into())
        .unwrap();
    app.oneshot(req).await.unwrap()
}

/// GET a path.
pub async fn get(app: Router, path: &str) -> Response<Body> {
    app.oneshot(Request::get(path).body(Body::empty()).unwrap())
        .await
        .unwrap()
}

/// POST JSON and return the status and JSON body.
pub async fn post(app: Router, path: &str, body: Value) -> (StatusCode, Value) {
    json_of(post_raw(app, path, body.to_string()).await).await
}

/// Status and JSON body of a response.
pub async fn json_of(res: Response<Body>) -> (StatusCode, Value) {
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX).await.unwrap();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&bytes)));
    (status, v)
}

/// The whole body as text.
pub async fn text_of(res: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX).await.unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The `data:` payloads of an SSE body, in order (keep-alive comments skipped).
pub fn sse_data(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "SSE body must end with a blank line: {body:?}");
    body.split("\n\n")
        .filter(|e| !e.is_empty() && !e.starts_with(':'))
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("event without 'data: ': {e:?}"))
                .to_string()
        })
        .collect()
}

/// Assert an OpenAI-shaped error with `status` and `param`.
pub fn assert_error(got: (StatusCode, Value), status: StatusCode, param: Option<&str>) -> String {
    let (s, v) = got;
    assert_eq!(s, status, "{v}");
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    e["message"].as_str().unwrap().to_string()
}
