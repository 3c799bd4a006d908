//! `baton bench decode|prefill`: tok/s of the CPU engine on this machine per weight format and
//! thread count, measured round-robin so every configuration sees the same machine state, with
//! the streaming-read roofline for the same bytes on the same threads.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use baton_shared::sampling::SamplingParams;
use baton_worker::engine::Engine;
use baton_worker::kernels::cpu::dispatch::{KernelPath, Kernels};
use baton_worker::model::{LoadOptions, StageWeights, WeightFormat};
use baton_worker::ops::cpu::CpuOps;
use baton_worker::roofline::stream_read_gb_per_s;
use baton_worker::threads::ThreadPool;
use clap::Subcommand;

use super::{Ctx, ModelArg};

/// `baton bench` arguments.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchKind,
}

/// What to measure.
#[derive(Debug, Subcommand)]
pub enum BenchKind {
    /// Batch-1 decode: tokens generated per second after an 8-token prompt.
    Decode(BenchOpts),
    /// Prefill: prompt tokens processed per second (one forward pass over the whole prompt).
    Prefill(BenchOpts),
}

/// Options shared by both measurements.
#[derive(Debug, clap::Args)]
pub struct BenchOpts {
    #[command(flatten)]
    pub model: ModelArg,
    /// Weight formats (f32, bf16, f16, q8_0, q4_0, q4_1, native).
    #[arg(long, value_delimiter = ',', default_value = "q8_0")]
    pub weights: Vec<WeightFormat>,
    /// Thread counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Tokens per measurement: generated tokens for decode (default 128), prompt length for
    /// prefill (default 512).
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Repetitions per configuration; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Kernel path (scalar, avx2, avx-vnni, avx512, avx512-vnni); default: the fastest this CPU runs.
    /// A slower path measures what CPUs without the faster instructions get.
    #[arg(long)]
    pub kernels: Option<KernelPath>,
    /// Output: text (a table) or json (one object per configuration and line).
    #[arg(long, default_value_t = OutputFormat::Text, value_enum)]
    pub format: OutputFormat,
}

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

/// One measured configuration.
struct Config {
    engine: usize,
    pool: Arc<ThreadPool>,
    samples: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Run `baton bench`.
pub fn run(ctx: &Ctx, args: BenchArgs) -> Result<()> {
    let (kind, opts) = match args.what {
        BenchKind::Decode(o) => ("decode", o),
        BenchKind::Prefill(o) => ("prefill", o),
    };
    let m = &opts;
    if m.threads.contains(&0) || opts.reps == 0 {
        bail!("--threads and --reps must be at least 1");
    }
    let tokens = opts.tokens.unwrap_or(if kind == "decode" { 128 } else { 512 });
    if tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    let model = ctx.open_model(&m.model)?;
    if kind == "prefill" && tokens > model.config.max_position_embeddings {
        bail!(
            "--tokens {tokens} exceeds the model context of {}",
            model.config.max_position_embeddings
        );
    }
    let kernels = match m.kernels {
        None => Kernels::detect(),
        Some(path) => Kernels::with_path(path)?,
    };
    let mut engines = Vec::new();
    for &format in &m.weights {
        let opts = LoadOptions {
            format,
            threads: 1,
            kernels: Some(kernels),
        };
        engines.push(Engine::new(StageWeights::load_full_with(
            &model.files,
            &model.config,
            ctx.settings.check_weights,
            &opts,
        )?));
    }
    let pools: Vec<Arc<ThreadPool>> = m.threads.iter().map(|&t| Arc::new(ThreadPool::new(t))).collect();
    let mut configs: Vec<Config> = (0..engines.len())
        .flat_map(|e| {
            pools.iter().map(move |p| Config {
                engine: e,
                pool: Arc::clone(p),
                samples: Vec::new(),
            })
        })
        .collect();
    // A fixed in-vocabulary prompt: content does not change the work.
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..tokens.max(8) as u32)
        .map(|i| (100 + i * 37 % 5000) % vocab)
        .collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(tokens)
    };
    for _ in 0..opts.reps {
        for c in &mut configs {
            let engine = &mut engines[c.engine];
            engine.weights.ops = CpuOps::with_pool(kernels, Arc::clone(&c.pool));
            let t = Instant::now();
            let done = if kind == "decode" {
                engine.generate(&prompt[..8], &params, None, |_| {})?.tokens.len()
            } else {
                engine.prompt_logits(&prompt[..tokens], false)?;
                tokens
            };
            c.samples.push(done as f64 / t.elapsed().as_secs_f64());
        }
    }
    if opts.format == OutputFormat::Text {
        println!(
            "{:<8} {:>7} {:>12} {:>10} {:>12} {:>14} {:>10}",
            "weights", "threads", "kernels", "tok/s", "matrix MB", "roofline tok/s", "of roofline"
        );
    }
    for c in &configs {
        let w = &engines[c.engine].weights;
        let bytes = w.matrix_bytes();
        // Decode reads every matrix byte once per token: reading as many bytes on the same
        // threads bounds it.
        let read_gbs = stream_read_gb_per_s(bytes, &c.pool, 5);
        let roofline = read_gbs * 1e9 / bytes as f64;
        let rate = median(&c.samples);
        let (decode, prefill) = if kind == "decode" {
            (Some(rate), None)
        } else {
            (None, Some(rate))
        };
        match opts.format {
            OutputFormat::Json => println!(
                "{}",
                serde_json::json!({
                    "bench": kind,
                    "model": model.files.source_name(),
                    "weights": w.format.name(),
                    "kernel_path": w.ops.kernels().path().name(),
                    "threads": c.pool.threads(),
                    "tokens": tokens,
                    "reps": opts.reps,
                    "decode_tok_per_s": decode,
                    "prefill_tok_per_s": prefill,
                    "min_max_tok_per_s": [
                        c.samples.iter().copied().fold(f64::INFINITY, f64::min),
                        c.samples.iter().copied().fold(0.0, f64::max)
                    ],
                    "weight_bytes": w.weight_bytes(),
                    "matrix_bytes": bytes,
                    "effective_gb_per_s": decode.map(|d| d * bytes as f64 / 1e9),
                    "stream_read_gb_per_s": read_gbs,
                    "roofline_tok_per_s": roofline,
                    "decode_vs_roofline": decode.map(|d| d / roofline),
                })
            ),
            OutputFormat::Text => println!(
                "{:<8} {:>7} {:>12} {:>10.1} {:>12.1} {:>14.1} {:>10}",
                w.format.name(),
                c.pool.threads(),
                w.ops.kernels().path().name(),
                rate,
                bytes as f64 / 1e6,
                roofline,
                decode.map_or("-".into(), |d| format!("{:.2}", d / roofline)),
            ),
        }
    }
    Ok(())
}
