//! Decode speed through `baton serve`: one streaming request at a time, tokens timed as they
//! arrive over SSE, so the figure includes every stage hop and the HTTP layer.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

struct Serve {
    child: Child,
    url: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(model: Option<&str>, workers: usize, otlp: Option<&str>) -> Result<Serve> {
    let baton = std::env::current_exe()?.with_file_name("baton");
    let mut cmd = Command::new(&baton);
    if let Some(endpoint) = otlp {
        cmd.args(["--otlp-endpoint", endpoint]);
    }
    cmd.args(["serve", "--port", "0", "--workers", &workers.to_string()]);
    if let Some(m) = model {
        cmd.args(["--model", m]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| {
            format!(
                "starting {} (build it with `cargo build --release -p baton-coordinator`)",
                baton.display()
            )
        })?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .context("no URL in serve's ready line")?;
    Ok(Serve {
        url: url.to_string(),
        child,
    })
}

/// Token arrival times of one streamed request.
fn stream_once(agent: &ureq::Agent, url: &str, gen_tokens: usize, prompt: &str) -> Result<Vec<Instant>> {
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": gen_tokens, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let mut resp = agent
        .post(&format!("{url}/completions"))
        .header("content-type", "application/json")
        .send(body.to_string().as_bytes())?;
    let reader = BufReader::new(resp.body_mut().as_reader());
    let mut stamps = Vec::with_capacity(gen_tokens);
    for line in reader.lines() {
        let line = line?;
        if line == "data: [DONE]" {
            break;
        }
        if line.starts_with("data: {\"error\"") {
            bail!("server error: {line}");
        }
        if line.starts_with("data: {") {
            stamps.push(Instant::now());
        }
    }
    if stamps.len() < 2 {
        bail!("only {} chunks arrived", stamps.len());
    }
    Ok(stamps)
}

/// With one stream: decode tok/s (tokens after the first over the time they took). With
/// several concurrent streams (different prompts): aggregate tokens over wall time.
fn measure(agent: &ureq::Agent, url: &str, gen_tokens: usize, concurrency: usize) -> Result<f64> {
    if concurrency <= 1 {
        let stamps = stream_once(agent, url, gen_tokens, "Once upon a time")?;
        let span = stamps[stamps.len() - 1] - stamps[0];
        return Ok((stamps.len() - 1) as f64 / span.as_secs_f64());
    }
    let start = Instant::now();
    let total: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..concurrency)
            .map(|i| {
                let prompt = format!("Story number {i}: once upon a time");
                scope.spawn(move || stream_once(agent, url, gen_tokens, &prompt).map(|s| s.len()))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("stream thread panicked"))?)
            .sum::<Result<usize>>()
    })?;
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(
    model: Option<String>,
    gen_tokens: usize,
    rounds: usize,
    workers: &[usize],
    concurrency: usize,
    otlp: Option<String>,
) -> Result<()> {
    // Every worker count, and with `otlp` each once more with trace export on.
    let configs: Vec<(usize, Option<&str>)> = workers
        .iter()
        .flat_map(|&w| std::iter::once((w, None)).chain(otlp.as_deref().map(|o| (w, Some(o)))))
        .collect();
    let servers = configs
        .iter()
        .map(|&(w, o)| start(model.as_deref(), w, o))
        .collect::<Result<Vec<_>>>()?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    // Warm-up, then rounds that visit every configuration so noise hits them alike.
    for s in &servers {
        measure(&agent, &s.url, 8, 1)?;
    }
    let mut samples = vec![Vec::new(); servers.len()];
    for _ in 0..rounds.max(1) {
        for (i, s) in servers.iter().enumerate() {
            samples[i].push(measure(&agent, &s.url, gen_tokens, concurrency)?);
        }
    }
    let medians: Vec<f64> = samples.into_iter().map(median).collect();
    let rows: Vec<_> = configs
        .iter()
        .zip(&medians)
        .map(|((w, o), m)| {
            serde_json::json!({ "workers": w, "otlp": o.is_some(), "tok_per_s": m, "ms_per_token": 1000.0 / m })
        })
        .collect();
    // Each worker beyond the first adds one stage-to-stage hop per token.
    let plain = |n: usize| configs.iter().position(|&(w, o)| w == n && o.is_none());
    let per_hop_ms = match (plain(1), plain(2)) {
        (Some(a), Some(b)) => Some(1000.0 / medians[b] - 1000.0 / medians[a]),
        _ => None,
    };
    // The hop cost only reads off batch-1 decode; under concurrency the ratio is the story.
    let per_hop_ms = if concurrency <= 1 { per_hop_ms } else { None };
    let out = serde_json::json!({
        "gen_tokens": gen_tokens, "rounds": rounds, "concurrency": concurrency, "results": rows,
        "per_hop_ms": per_hop_ms,
    });
    println!("{out}");
    Ok(())
}
