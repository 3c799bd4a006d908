//! The HTTP API on a real socket against clients that hold resources or send garbage:
//! 1,000 idle connections and 200 slow clients (slow headers, trickled bodies) while others are
//! served, with the process's memory measured; the connection limit answers 503 with
//! `Retry-After`; oversized headers get 431; and a corpus of hostile requests gets only 4xx
//! answers while the server keeps serving in between.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use baton_coordinator::api::{self, server::HttpLimits};
use serde_json::json;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

/// Start the API over the fake generator with `limits` and a body deadline.
async fn start(limits: HttpLimits, body_timeout: Duration) -> SocketAddr {
    let g = FakeGenerator::new(tokens_then("Paris", baton_coordinator::generation::FinishReason::Stop));
    let mut state = state(&g);
    state.body_timeout = body_timeout;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(api::serve(listener, api::router(state), limits, std::future::pending()));
    addr
}

/// A parsed HTTP/1.1 answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// Send raw `request` bytes on a new connection and read the answer until the server closes.
async fn raw(addr: SocketAddr, request: &[u8]) -> Answer {
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    read_answer(&mut conn).await
}

async fn read_answer(conn: &mut TcpStream) -> Answer {
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut buf)).await;
    answer_of(buf, read.is_ok())
}

/// Parse what a server sent; `in_time` is false when it did not close within the deadline.
fn answer_of(buf: Vec<u8>, in_time: bool) -> Answer {
    let text = String::from_utf8_lossy(&buf).into_owned();
    assert!(in_time, "no answer within 30 s; got so far: {text:?}");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    Answer {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

/// A POST of `body` (raw bytes) to `path`, closing after the answer.
fn post_bytes(path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req
}

fn get_bytes(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").into_bytes()
}

/// A completion succeeds: the server still serves.
async fn assert_serving(addr: SocketAddr, context: &str) {
    let ok = raw(
        addr,
        &post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a"}"#),
    )
    .await;
    assert_eq!(ok.status, 200, "{context}: {ok:?}");
    assert!(ok.body.contains("Paris"), "{context}: {ok:?}");
}

fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?;
    Some(kb.parse::<u64>().ok()? * 1024)
}

/// Whether the server has closed `conn` (EOF or reset), waiting up to `limit`; bytes the server
/// sent before closing (a 408) are returned.
async fn closed_within(conn: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, conn.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_clients_are_bounded_while_others_are_served() {
    let limits = HttpLimits {
        header_timeout: Duration::from_secs(3),
        ..HttpLimits::default()
    };
    let addr = start(limits, Duration::from_secs(3)).await;
    assert_serving(addr, "before").await;
    let rss_before = rss_bytes();

    // 1,000 idle connections: connected, silent.
    let mut idle = Vec::with_capacity(1000);
    for _ in 0..1000 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    // 100 slowloris clients: a request head sent a few bytes at a time, never finished.
    let mut slow_heads = Vec::with_capacity(100);
    for _ in 0..100 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"POST /v1/completions HT").await.unwrap();
        slow_heads.push(c);
    }
    // 100 clients that send a head promising 1,000 body bytes and trickle them.
    let mut slow_bodies = Vec::with_capacity(100);
    for _ in 0..100 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"pro")
            .await
            .unwrap();
        slow_bodies.push(c);
    }
    // Everyone else is served meanwhile.
    for i in 0..5 {
        assert_serving(addr, &format!("with 1,200 held connections, request {i}")).await;
        for c in slow_heads.iter_mut().chain(slow_bodies.iter_mut()) {
            let _ = c.write_all(b"x").await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_held = rss_bytes();
    if let (Some(before), Some(held)) = (rss_before, rss_held) {
        let grown = held.saturating_sub(before);
        println!(
            "RSS (server and clients in one process): {} MiB before, {} MiB with 1,200 held connections (+{} KiB per connection)",
            before >> 20,
            held >> 20,
            (grown >> 10) / 1200
        );
        assert!(
            grown < 256 << 20,
            "memory grew by {} MiB for 1,200 connections",
            grown >> 20
        );
    }

    // The deadlines end them all: idle and slow heads closed without an answer, trickled
    // bodies answered 408.
    let window = Duration::from_secs(20);
    for c in idle.iter_mut().chain(slow_heads.iter_mut()) {
        assert!(
            closed_within(c, window).await.is_some(),
            "an idle or slow-head connection outlived the header deadline"
        );
    }
    for c in &mut slow_bodies {
        let got = closed_within(c, window)
            .await
            .expect("a trickled body outlived the body deadline");
        let text = String::from_utf8_lossy(&got);
        assert!(
            text.starts_with("HTTP/1.1 408") && text.contains("did not arrive"),
            "{text}"
        );
    }
    assert_serving(addr, "after the deadlines").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_limit_get_503_with_retry_after() {
    let limits = HttpLimits {
        max_connections: 8,
        header_timeout: Duration::from_secs(2),
        ..HttpLimits::default()
    };
    let addr = start(limits, Duration::from_secs(5)).await;
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    // Let the server accept them all before the ninth.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let over = raw(addr, &get_bytes("/v1/models")).await;
    assert_eq!(over.status, 503, "{over:?}");
    assert!(over.head.to_ascii_lowercase().contains("retry-after:"), "{over:?}");
    assert!(over.body.contains("max_connections"), "{over:?}");
    // Once the idle ones hit the header deadline, new clients are served.
    let start = Instant::now();
    loop {
        let a = raw(addr, &get_bytes("/v1/models")).await;
        if a.status == 200 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "still refused: {a:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_get_431() {
    let addr = start(HttpLimits::default(), Duration::from_secs(5)).await;
    let big = format!(
        "GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Junk: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(64 << 10)
    );
    let mut conn = TcpStream::connect(addr).await.unwrap();
    // The server may close while the head is still being written.
    let _ = conn.write_all(big.as_bytes()).await;
    let a = read_answer(&mut conn).await;
    assert_eq!(a.status, 431, "{a:?}");
    assert_serving(addr, "after a 431").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_only_4xx_and_the_server_keeps_serving() {
    let addr = start(HttpLimits::default(), Duration::from_secs(5)).await;
    let mut corpus: Vec<(&str, Vec<u8>)> = vec![
        ("truncated JSON", post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "max_tok"#)),
        ("malformed JSON", post_bytes(COMPLETIONS, "application/json", b"{prompt: a}")),
        ("empty body", post_bytes(COMPLETIONS, "application/json", b"")),
        ("a JSON array", post_bytes(COMPLETIONS, "application/json", b"[1,2,3]")),
        ("wrong type", post_bytes(COMPLETIONS, "application/json", br#"{"prompt": 5}"#)),
        ("wrong type (chat)", post_bytes(CHAT, "application/json", br#"{"messages": "hi"}"#)),
        (
            "huge max_tokens",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "max_tokens": 1e300}"#),
        ),
        (
            "max_tokens past u64",
            post_bytes(
                COMPLETIONS,
                "application/json",
                br#"{"prompt": "a", "max_tokens": 123456789012345678901234567890}"#,
            ),
        ),
        (
            "negative max_tokens",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "max_tokens": -1}"#),
        ),
        (
            "NaN temperature",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "temperature": NaN}"#),
        ),
        (
            "negative temperature",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "temperature": -1}"#),
        ),
        (
            "huge top_p",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "top_p": 1e308}"#),
        ),
        (
            "huge seed",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "seed": -99999999999999999999}"#),
        ),
        (
            "invalid UTF-8",
            post_bytes(COMPLETIONS, "application/json", b"{\"prompt\": \"\xff\xfe\xc3\x28\"}"),
        ),
        (
            "lone surrogate escape",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "\ud800"}"#),
        ),
        (
            "10 MB body",
            post_bytes(
                COMPLETIONS,
                "application/json",
                json!({"prompt": "x".repeat(10 << 20)}).to_string().as_bytes(),
            ),
        ),
        (
            "10,000 stop strings",
            post_bytes(
                COMPLETIONS,
                "application/json",
                json!({"prompt": "a", "stop": vec!["s"; 10_000]}).to_string().as_bytes(),
            ),
        ),
        (
            "a 100,000-token prompt",
            post_bytes(
                COMPLETIONS,
                "application/json",
                json!({"prompt": vec![1u32; 100_000]}).to_string().as_bytes(),
            ),
        ),
        (
            "token ids past the vocabulary",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": [4294967295]}"#),
        ),
        (
            "duplicate keys",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "prompt": "b"}"#),
        ),
        (
            "deep nesting",
            post_bytes(
                COMPLETIONS,
                "application/json",
                format!("{{\"prompt\": {}{}}}", "[".repeat(100_000), "]".repeat(100_000)).as_bytes(),
            ),
        ),
        (
            "wrong content type",
            post_bytes(COMPLETIONS, "image/png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"),
        ),
        (
            "chat without messages",
            post_bytes(CHAT, "application/json", br#"{"model": "test-model"}"#),
        ),
        (
            "logprobs out of range",
            post_bytes(CHAT, "application/json", br#"{"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 1000000}"#),
        ),
        (
            "n too large",
            post_bytes(COMPLETIONS, "application/json", br#"{"prompt": "a", "n": 100000}"#),
        ),
        ("unknown route", get_bytes("/v1/engines/../../etc/passwd")),
        ("wrong method", get_bytes(COMPLETIONS)),
        (
            "content-length larger than the body",
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 50\r\nConnection: close\r\n\r\n{}".to_vec(),
        ),
        ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n".to_vec()),
        (
            "bad chunked encoding",
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n".to_vec(),
        ),
    ];
    // Unknown fields are accepted as OpenAI's API does, so they are not in the 4xx corpus; they
    // are sent once to show they do no harm.
    corpus.push((
        "unknown fields (accepted)",
        post_bytes(
            COMPLETIONS,
            "application/json",
            br#"{"prompt": "a", "frobnicate": {"x": [1]}}"#,
        ),
    ));
    for (name, request) in corpus {
        eprintln!("hostile request: {name}");
        let mut conn = TcpStream::connect(addr).await.unwrap();
        // A server may answer (and close) before a large body is fully written.
        let _ = conn.write_all(&request).await;
        // The truncated-length case waits for the body deadline; half-close so it need not.
        let _ = conn.shutdown().await;
        let a = read_answer(&mut conn).await;
        if name.ends_with("(accepted)") {
            assert_eq!(a.status, 200, "{name}: {a:?}");
        } else {
            assert!((400..500).contains(&a.status), "{name}: expected 4xx, got {a:?}");
            assert!(
                a.body.is_empty() || a.body.contains("\"error\""),
                "{name}: not an OpenAI-shaped error: {a:?}"
            );
        }
        assert_serving(addr, &format!("after '{name}'")).await;
    }
}
