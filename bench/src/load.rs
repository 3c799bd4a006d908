//! `baton-bench load`: a load generator for any OpenAI-compatible server (Baton's coordinator,
//! llama.cpp's `llama-server`, vLLM). Each concurrency level runs its requests from that many
//! threads, each thread holding one streaming request at a time; the report gives TTFT,
//! inter-token latency, time per output token, end-to-end latency and throughput.

mod sse;
mod stats;

use std::io::{BufRead, BufReader, IsTerminal, Read};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use sse::{Decoder, Event, Payload};
use stats::{Arrival, Level, Sample, Summary};

/// Which OpenAI endpoint to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Endpoint {
    /// `/v1/completions` with a `prompt`.
    Completions,
    /// `/v1/chat/completions` with one user message.
    Chat,
}

/// Report format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Flags of `baton-bench load`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Base URL of the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted).
    #[arg(long)]
    url: String,
    /// Model name to request (default: the first id listed by GET /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Concurrent streams; one level is run per value, in order.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// Requests per level: one value for every level, or one per --concurrency value
    /// [default: 4 × concurrency].
    #[arg(long, value_delimiter = ',')]
    requests: Vec<usize>,
    /// Approximate prompt length in tokens of the synthetic prompts (common English words,
    /// different for every request beyond --shared-prefix-tokens).
    #[arg(long, default_value_t = 128, conflicts_with = "prompt_file")]
    prompt_tokens: usize,
    /// Leading words every synthetic prompt shares (a common system prompt), so a server's
    /// prefix cache can reuse them; 0: no request shares a prefix with another.
    #[arg(long, default_value_t = 0, conflicts_with = "prompt_file")]
    shared_prefix_tokens: usize,
    /// File with one prompt per line (or, named `*.json`, a JSON array of prompts that may span
    /// lines), used in turn instead of synthetic prompts.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Spread the requests' `max_tokens` over this many ..= --max-tokens (a fixed draw per
    /// request, the same every run), so requests end at different times and new prompts arrive
    /// while others decode, instead of in waves; unset: every request asks for --max-tokens.
    #[arg(long)]
    max_tokens_from: Option<usize>,
    /// Endpoint to drive.
    #[arg(long, value_enum, default_value = "completions")]
    endpoint: Endpoint,
    /// Send `"ignore_eos": true`, so every request generates exactly --max-tokens tokens.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    ignore_eos: bool,
    /// Sampling temperature (0: greedy, so repeated runs do the same work).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Bound per level in seconds: no request is started after it, and unfinished ones are
    /// aborted and counted as failed.
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Report format: a table, or one JSON object.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

/// Run every level and print the report; fails (after printing it) when a request failed.
pub fn run(args: Args) -> Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs positive values");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(from) = args.max_tokens_from
        && !(1..=args.max_tokens).contains(&from)
    {
        bail!(
            "--max-tokens-from must be between 1 and --max-tokens ({})",
            args.max_tokens
        );
    }
    if !(args.timeout_s > 0.0 && args.timeout_s.is_finite()) {
        bail!("--timeout-s must be a positive number of seconds");
    }
    if args.requests.len() > 1 && args.requests.len() != args.concurrency.len() {
        bail!(
            "--requests has {} values for {} concurrency levels; give one value, or one per level",
            args.requests.len(),
            args.concurrency.len()
        );
    }
    let base = base_url(&args.url);
    let prompts = Prompts::new(&args)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&base, args.api_key.as_deref())?,
    };
    let target = Target {
        url: match args.endpoint {
            Endpoint::Completions => format!("{base}/v1/completions"),
            Endpoint::Chat => format!("{base}/v1/chat/completions"),
        },
        api_key: args.api_key.clone(),
    };
    let mut next_prompt = 0;
    let mut levels = Vec::new();
    for (level, &concurrency) in args.concurrency.iter().enumerate() {
        let requests = match args.requests.as_slice() {
            [] => 4 * concurrency,
            [n] => *n,
            per_level => per_level[level],
        };
        // Prompts continue across levels, so no level reuses another's (prefix caches).
        let bodies: Vec<String> = (next_prompt..next_prompt + requests)
            .map(|i| request_body(&args, &model, &prompts.get(i), max_tokens(&args, i)).to_string())
            .collect();
        next_prompt += requests;
        levels.push(run_level(
            &target,
            concurrency,
            &bodies,
            Duration::from_secs_f64(args.timeout_s),
        ));
    }
    match args.format {
        Format::Json => {
            let out = json!({
                "url": base,
                "model": model,
                "endpoint": format!("{:?}", args.endpoint).to_lowercase(),
                "prompt_tokens": args.prompt_file.is_none().then_some(args.prompt_tokens),
                "shared_prefix_tokens": args.prompt_file.is_none().then_some(args.shared_prefix_tokens),
                "prompt_file": args.prompt_file.as_ref().map(|p| p.display().to_string()),
                "max_tokens": args.max_tokens,
                "max_tokens_from": args.max_tokens_from,
                "ignore_eos": args.ignore_eos,
                "temperature": args.temperature,
                "levels": levels.iter().map(Level::json).collect::<Vec<_>>(),
            });
            println!("{out}");
        }
        Format::Text => print!("{}", table(&base, &model, &levels)),
    }
    let failed: usize = levels.iter().map(|l| l.requests_failed + l.requests_not_sent).sum();
    if failed > 0 {
        let total: usize = levels
            .iter()
            .map(|l| l.requests_ok + l.requests_failed + l.requests_not_sent)
            .sum();
        let first = levels.iter().find_map(|l| l.first_error.clone());
        bail!(
            "{failed} of {total} requests failed or were not sent{}",
            first.map(|e| format!("; first error: {e}")).unwrap_or_default()
        );
    }
    Ok(())
}

/// `http://h:p`, `http://h:p/`, `http://h:p/v1` all name the same server.
fn base_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    url.strip_suffix("/v1").unwrap_or(url).to_string()
}

/// Where requests go and how they authenticate.
struct Target {
    url: String,
    api_key: Option<String>,
}

fn authorized<B>(req: ureq::RequestBuilder<B>, key: Option<&str>) -> ureq::RequestBuilder<B> {
    match key {
        Some(k) => req.header("authorization", format!("Bearer {k}")),
        None => req,
    }
}

/// The first id of GET /v1/models.
fn first_model(base: &str, key: Option<&str>) -> Result<String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let url = format!("{base}/v1/models");
    let hint = "pass --model to skip the lookup";
    let mut resp = authorized(agent.get(&url), key)
        .call()
        .map_err(|e| anyhow::anyhow!("GET {url}: {} ({hint})", describe(&e)))?;
    let status = resp.status().as_u16();
    let body = resp
        .body_mut()
        .read_to_string()
        .with_context(|| format!("GET {url}: reading the body"))?;
    if status != 200 {
        bail!("GET {url}: {} ({hint})", sse::http_error(status, &body));
    }
    let v: Value = serde_json::from_str(&body).with_context(|| format!("GET {url}: not JSON ({hint})"))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("GET {url}: no model id in the answer ({hint})"))
}

/// Request `i`'s `max_tokens`: --max-tokens, or a fixed draw from --max-tokens-from ..=
/// --max-tokens.
fn max_tokens(args: &Args, i: usize) -> usize {
    let Some(from) = args.max_tokens_from else {
        return args.max_tokens;
    };
    // splitmix64: well spread for consecutive indices, and the same on every run.
    let mut z = (i as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    from + (z % (args.max_tokens - from + 1) as u64) as usize
}

/// The JSON body of one streaming request.
fn request_body(args: &Args, model: &str, prompt: &str, max_tokens: usize) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": true,
        // `continuous_usage_stats` (vLLM) puts cumulative usage on every chunk, which tells
        // how many tokens each chunk carries; servers that do not know it ignore it.
        "stream_options": { "include_usage": true, "continuous_usage_stats": true },
    });
    if args.ignore_eos {
        body["ignore_eos"] = true.into();
    }
    match args.endpoint {
        Endpoint::Completions => body["prompt"] = prompt.into(),
        Endpoint::Chat => body["messages"] = json!([{ "role": "user", "content": prompt }]),
    }
    body
}

/// Prompts by request number: synthetic, or the lines of --prompt-file in turn.
enum Prompts {
    /// `words` words per prompt, the first `shared` the same in every prompt.
    Synthetic {
        words: usize,
        shared: usize,
    },
    Lines(Vec<String>),
}

impl Prompts {
    fn new(args: &Args) -> Result<Self> {
        let Some(path) = &args.prompt_file else {
            if args.shared_prefix_tokens >= args.prompt_tokens.max(1) {
                bail!(
                    "--shared-prefix-tokens {} must be less than --prompt-tokens {}",
                    args.shared_prefix_tokens,
                    args.prompt_tokens
                );
            }
            return Ok(Self::Synthetic {
                words: args.prompt_tokens.max(1),
                shared: args.shared_prefix_tokens,
            });
        };
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let lines: Vec<String> = if path.extension().is_some_and(|e| e == "json") {
            // Prompts that span lines (code to edit, passages to quote).
            let prompts: Vec<String> = serde_json::from_str(&text)
                .with_context(|| format!("{}: expected a JSON array of strings", path.display()))?;
            prompts.into_iter().filter(|p| !p.trim().is_empty()).collect()
        } else {
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect()
        };
        if lines.is_empty() {
            bail!("{} has no non-empty line to use as a prompt", path.display());
        }
        Ok(Self::Lines(lines))
    }

    fn get(&self, i: usize) -> String {
        match self {
            Self::Synthetic { words, shared: 0 } => synthetic_prompt(i as u64, *words),
            // A seed no request number reaches, so the shared head differs from every tail.
            Self::Synthetic { words, shared } => format!(
                "{} {}",
                synthetic_prompt(u64::MAX, *shared),
                synthetic_prompt(i as u64, words - shared)
            ),
            Self::Lines(lines) => lines[i % lines.len()].clone(),
        }
    }
}

/// Short common words that BPE vocabularies hold as one token each (with the leading space).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by", "at", "from", "it", "that", "this",
    "be", "are", "or", "an", "not", "but", "had", "have", "his", "her", "they", "we", "you", "one", "all", "were",
    "when", "there", "can", "more", "will", "some", "time", "new", "up", "out", "about", "into", "over", "after",
    "first", "year", "day", "city", "water", "house", "world", "small", "great", "long", "light", "river", "story",
    "music", "green", "old", "red",
];

/// `words` words from a fixed list, chosen by a generator seeded with `seed`: deterministic
/// across runs, different per request, about one token per word.
fn synthetic_prompt(seed: u64, words: usize) -> String {
    // splitmix64: tiny, and good enough to spread word choices.
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    (0..words)
        .map(|_| WORDS[(next() % WORDS.len() as u64) as usize])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Run `bodies` with `concurrency` streams at a time, within `timeout`.
fn run_level(target: &Target, concurrency: usize, bodies: &[String], timeout: Duration) -> Level {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_idle_connections_per_host(concurrency)
        .build()
        .into();
    let bar = progress(concurrency, bodies.len());
    let next = AtomicUsize::new(0);
    let outcomes = Mutex::new(Vec::with_capacity(bodies.len()));
    let (ok, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let start = Instant::now();
    let deadline = start + timeout;
    std::thread::scope(|scope| {
        for _ in 0..concurrency.min(bodies.len()) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= bodies.len() || Instant::now() >= deadline {
                        return;
                    }
                    let outcome = stream(&agent, target, &bodies[i], deadline);
                    let counter = if outcome.is_ok() { &ok } else { &failed };
                    counter.fetch_add(1, Ordering::Relaxed);
                    bar.inc(1);
                    bar.set_message(format!(
                        "ok {} failed {}",
                        ok.load(Ordering::Relaxed),
                        failed.load(Ordering::Relaxed)
                    ));
                    // A poisoned lock only means another thread panicked; its data is intact.
                    outcomes.lock().unwrap_or_else(|e| e.into_inner()).push(outcome);
                }
            });
        }
    });
    let wall = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let outcomes = outcomes.into_inner().unwrap_or_else(|e| e.into_inner());
    Level::aggregate(concurrency, bodies.len(), &outcomes, wall)
}

/// A progress bar on stderr, hidden when stderr is not a terminal (logs, pipes, tests).
fn progress(concurrency: usize, requests: usize) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(requests as u64), target);
    if let Ok(style) = ProgressStyle::with_template("{prefix:>6} [{bar:30}] {pos}/{len} {msg} {elapsed}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(format!("c={concurrency}"));
    bar
}

/// The longest SSE line accepted; a server streaming one endless line fails the request
/// instead of growing memory without bound.
const MAX_LINE: u64 = 1 << 20;

/// One streaming request, timed.
fn stream(agent: &ureq::Agent, target: &Target, body: &str, deadline: Instant) -> Result<Sample, String> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    let start = Instant::now();
    let req = authorized(agent.post(&target.url), target.api_key.as_deref())
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .config()
        .timeout_global(Some(remaining))
        .build();
    let resp = req.send(body).map_err(|e| describe(&e))?;
    let status = resp.status().as_u16();
    let mut reader = BufReader::new(resp.into_body().into_reader());
    if status != 200 {
        let mut text = String::new();
        let _ = reader.take(64 * 1024).read_to_string(&mut text);
        return Err(sse::http_error(status, &text));
    }
    let mut decoder = Decoder::default();
    let mut chunks = Vec::new();
    let mut usage = None;
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .map_err(|e| describe_io(&e))?;
        let event = if n == 0 {
            decoder.finish()
        } else {
            if line.last() != Some(&b'\n') && n as u64 == MAX_LINE {
                return Err(format!("an SSE line longer than {MAX_LINE} bytes"));
            }
            let text = String::from_utf8_lossy(&line);
            decoder.line(text.trim_end_matches(['\n', '\r']))
        };
        let at = start.elapsed().as_secs_f64();
        match event {
            Some(Event::Error(e)) => return Err(format!("error event: {e}")),
            Some(Event::Data(data)) => match sse::payload(&data)? {
                Payload::Done => return Sample::from_stream(&chunks, at, usage),
                Payload::Error(e) => return Err(format!("error in the stream: {e}")),
                Payload::Chunk {
                    content,
                    completion_tokens,
                } => {
                    usage = completion_tokens.or(usage);
                    if content {
                        chunks.push(Arrival {
                            at,
                            cumulative_tokens: completion_tokens,
                        });
                    }
                }
            },
            None => {}
        }
        if n == 0 {
            return Err(format!(
                "the stream ended without [DONE] after {} content chunks",
                chunks.len()
            ));
        }
    }
}

/// One line for a failed call; timeouts name the flag that bounds them.
fn describe(e: &ureq::Error) -> String {
    match e {
        ureq::Error::Timeout(_) => TIMED_OUT.to_string(),
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => TIMED_OUT.to_string(),
        e => e.to_string(),
    }
}

const TIMED_OUT: &str = "timed out (aborted at the level's --timeout-s bound)";

/// One line for a failure while reading the body.
fn describe_io(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::TimedOut {
        return TIMED_OUT.to_string();
    }
    // ureq wraps its own errors in io::Error while the body is read.
    match e.get_ref().and_then(|inner| inner.downcast_ref::<ureq::Error>()) {
        Some(inner) => describe(inner),
        None => format!("reading the stream: {e}"),
    }
}

/// Milliseconds with precision that suits the magnitude.
fn ms(s: f64) -> String {
    let ms = s * 1000.0;
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 10.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.2}")
    }
}

fn triple(s: Option<Summary>, unit: fn(f64) -> String) -> String {
    match s {
        Some(s) => format!("{} / {} / {}", unit(s.p50), unit(s.p90), unit(s.p99)),
        None => "-".to_string(),
    }
}

/// The text report: one row per level, then the first error of any level that had one.
fn table(base: &str, model: &str, levels: &[Level]) -> String {
    let mut out = format!("{base}  model {model}\n");
    let header = [
        "conc",
        "ok/fail",
        "wall s",
        "out tok/s",
        "stream tok/s",
        "TTFT ms p50/p90/p99",
        "ITL ms p50/p90/p99",
        "TPOT ms p50/p90/p99",
        "E2E s p50/p90/p99",
    ];
    let rows: Vec<[String; 9]> = levels
        .iter()
        .map(|l| {
            let fail = l.requests_failed + l.requests_not_sent;
            [
                l.concurrency.to_string(),
                format!("{}/{fail}", l.requests_ok),
                format!("{:.1}", l.wall_s),
                format!("{:.1}", l.output_tok_per_s()),
                l.stream_tok_per_s.map_or("-".into(), |s| format!("{:.1}", s.mean)),
                triple(l.ttft, ms),
                triple(l.itl, ms),
                triple(l.tpot, ms),
                triple(l.e2e, |s| format!("{s:.2}")),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let cells: Vec<String> = cells.zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        cells.join("  ").trim_end().to_string() + "\n"
    };
    out += &line(&mut header.iter().copied());
    for r in &rows {
        out += &line(&mut r.iter().map(String::as_str));
    }
    for l in levels {
        if let Some(e) = &l.first_error {
            out += &format!("c={}: first error: {e}\n", l.concurrency);
        }
        if l.requests_not_sent > 0 {
            out += &format!(
                "c={}: {} requests not sent (--timeout-s reached)\n",
                l.concurrency, l.requests_not_sent
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(flags: &[&str]) -> Result<Args, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(["load", "--url", "http://127.0.0.1:9"].iter().chain(flags)).map(|c| c.args)
    }

    #[test]
    fn flags_parse_and_bad_combinations_are_refused_before_any_request() {
        let a = parse(&["--concurrency", "1,4,16", "--ignore-eos", "false"]).unwrap();
        assert_eq!(a.concurrency, [1, 4, 16]);
        assert!(!a.ignore_eos && a.requests.is_empty());
        assert!(parse(&[]).unwrap().ignore_eos);
        assert!(parse(&["--prompt-tokens", "8", "--prompt-file", "p.txt"]).is_err());
        assert!(parse(&["--endpoint", "embeddings"]).is_err());
        // Port 9 has nothing listening: these fail on validation, not on a connection.
        for (flags, message) in [
            (&["--concurrency", "1,2", "--requests", "1,2,3"][..], "3 values for 2"),
            (&["--concurrency", "0"], "positive"),
            (&["--max-tokens", "0"], "--max-tokens"),
            (&["--timeout-s", "0"], "--timeout-s"),
            (&["--max-tokens", "8", "--max-tokens-from", "9"], "--max-tokens-from"),
            (&["--max-tokens-from", "0"], "--max-tokens-from"),
        ] {
            let e = run(parse(flags).unwrap()).unwrap_err().to_string();
            assert!(e.contains(message), "{flags:?}: {e}");
        }
        let e = run(parse(&["--prompt-file", "/no/such/file"]).unwrap()).unwrap_err();
        assert!(format!("{e:#}").contains("/no/such/file"), "{e:#}");
    }

    #[test]
    fn spread_max_tokens_are_fixed_per_request_and_cover_the_range() {
        let a = parse(&["--max-tokens", "256", "--max-tokens-from", "32"]).unwrap();
        let drawn: Vec<usize> = (0..64).map(|i| max_tokens(&a, i)).collect();
        assert_eq!(drawn, (0..64).map(|i| max_tokens(&a, i)).collect::<Vec<_>>());
        assert!(drawn.iter().all(|t| (32..=256).contains(t)), "{drawn:?}");
        // Spread, not clustered: both ends of the range are drawn from.
        assert!(
            drawn.iter().any(|&t| t < 88) && drawn.iter().any(|&t| t > 200),
            "{drawn:?}"
        );
        let fixed = parse(&["--max-tokens", "40"]).unwrap();
        assert!((0..8).all(|i| max_tokens(&fixed, i) == 40));
        assert_eq!(request_body(&a, "m", "p", drawn[3])["max_tokens"], drawn[3]);
    }

    #[test]
    fn base_url_accepts_v1_and_slashes() {
        for u in [
            "http://h:1",
            "http://h:1/",
            "http://h:1/v1",
            "http://h:1/v1/",
            " http://h:1 ",
        ] {
            assert_eq!(base_url(u), "http://h:1");
        }
    }

    #[test]
    fn synthetic_prompts_are_deterministic_and_distinct() {
        let a = synthetic_prompt(3, 50);
        assert_eq!(a, synthetic_prompt(3, 50));
        assert_ne!(a, synthetic_prompt(4, 50));
        assert_eq!(a.split(' ').count(), 50);
        assert!(a.split(' ').all(|w| WORDS.contains(&w)));
    }

    #[test]
    fn shared_prefix_prompts_share_exactly_their_head() {
        let p = Prompts::Synthetic { words: 40, shared: 30 };
        let (a, b) = (p.get(0), p.get(1));
        let (a, b): (Vec<&str>, Vec<&str>) = (a.split(' ').collect(), b.split(' ').collect());
        assert_eq!((a.len(), b.len()), (40, 40));
        assert_eq!(a[..30], b[..30]);
        assert_ne!(a[30..], b[30..]);
    }

    #[test]
    fn table_lists_levels_and_errors() {
        let sample = Sample {
            ttft: 0.05,
            itl: vec![0.02; 3],
            e2e: 0.11,
            output_tokens: 4,
        };
        let levels = [
            Level::aggregate(1, 1, &[Ok(sample)], 0.11),
            Level::aggregate(2, 3, &[Err("HTTP 429: full".into())], 0.01),
        ];
        let t = table("http://x", "m", &levels);
        assert!(t.contains("50.0 / 50.0 / 50.0"), "{t}");
        assert!(t.contains("c=2: first error: HTTP 429: full"), "{t}");
        assert!(t.contains("c=2: 2 requests not sent"), "{t}");
        assert_eq!(t.lines().count(), 6, "{t}");
    }
}
