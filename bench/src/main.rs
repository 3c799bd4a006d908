//! `baton-bench`: timing of Baton's engines: the CPU path per weight format and thread count
//! against the fp32 reference (prefill and batch-1 decode), matrix-vector kernels, and decode
//! through `baton serve`; a load generator for any OpenAI-compatible server; and synthetic
//! models of any supported shape.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use baton_shared::fetch::{Sources, baton_home};
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::resolve_model;
use baton_shared::sampling::SamplingParams;
use baton_worker::engine::Engine;
use baton_worker::kernels::cpu::dispatch::{KernelPath, Kernels};
use baton_worker::kernels::cpu::matmul::WeightFormat;
use baton_worker::model::{LoadOptions, StageWeights};
use baton_worker::ops::cpu::CpuOps;
use baton_worker::roofline;
use baton_worker::threads::ThreadPool;
use clap::{Parser, Subcommand};

mod attention;
mod kernels;
mod load;
mod perplexity;
mod serve_decode;
mod synth;

#[derive(Parser)]
#[command(name = "baton-bench", about = "Baton benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Batch-1 decode through `baton serve` with 0 (in-process), 1 and 2 worker processes,
    /// interleaved round by round; prints per-configuration medians and the per-hop cost.
    ServeDecode {
        /// Model path or name passed to `baton serve` (default: the default model).
        #[arg(long)]
        model: Option<String>,
        /// Tokens generated per request.
        #[arg(long, default_value_t = 128)]
        gen_tokens: usize,
        /// Rounds; each round runs one request on every configuration.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Worker counts to compare.
        #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
        workers: Vec<usize>,
        /// Concurrent streams per measurement (1: batch-1 decode speed; more: aggregate tok/s).
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// Also measure every worker count with traces exported to this OTLP endpoint, side by
        /// side with it off (the cost of observability).
        #[arg(long)]
        otlp_endpoint: Option<String>,
    },
    /// Load generator for any OpenAI-compatible server: N concurrent streaming requests per
    /// level; reports TTFT, inter-token and end-to-end latency percentiles and throughput.
    Load(load::Args),
    /// Write a GGUF of a Llama, Qwen3 or Qwen3-MoE shape with random Q8_0 weights and the
    /// default model's tokenizer (for speed where real weights cannot be downloaded).
    Synth(synth::Args),
    /// Prefill and batch-1 decode throughput per weight format and thread count, measured side
    /// by side (round-robin) with the fp32 reference (f32, scalar kernels, one thread).
    Reference {
        /// Model path or name (default: smollm2-135m).
        #[arg(long)]
        model: Option<String>,
        /// Prompt length for the prefill measurement.
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        /// Tokens generated for the decode measurement.
        #[arg(long, default_value_t = 32)]
        gen_tokens: usize,
        /// Repetitions; the median is reported.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Weight formats to measure (f32, bf16, f16, q8_0, q4_0, q4_1, native).
        #[arg(long, value_delimiter = ',', default_value = "f32")]
        weights: Vec<WeightFormat>,
        /// Thread counts to measure.
        #[arg(long, value_delimiter = ',', default_value = "1")]
        threads: Vec<usize>,
        /// Kernel path (scalar, avx2, avx-vnni, avx512, avx512-vnni); default: the fastest supported.
        #[arg(long)]
        kernel_path: Option<KernelPath>,
    },
    /// CPU attention of one prompt chunk over a paged cache at SmolLM2's shape, per kernel
    /// path, thread count and context length.
    Attention(attention::Args),
    /// Perplexity of a text per weight format and its change from f32 (the quality cost).
    Perplexity {
        /// Model path or name (default: smollm2-135m).
        #[arg(long)]
        model: Option<String>,
        /// Plain English text to score (default: the few kB committed in bench/data).
        #[arg(long, default_value = "bench/data/perplexity.txt")]
        text: std::path::PathBuf,
        /// Tokens per window; each window is scored on its own.
        #[arg(long, default_value_t = 256)]
        context: usize,
        /// Weight formats besides f32 (always measured, the baseline).
        #[arg(long, value_delimiter = ',', default_value = "bf16,f16,q8_0,native,q4_1,q4_0")]
        weights: Vec<WeightFormat>,
        /// Threads for the matrix products.
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// Matrix-product GB/s and GFLOP/s per weight format, kernel path, thread count and
    /// activation rows at SmolLM2's shapes.
    Kernels {
        /// Thread counts to measure.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        threads: Vec<usize>,
        /// Activation rows per product (1: matrix-vector; more: prefill / batched decode).
        #[arg(long, value_delimiter = ',', default_value = "1")]
        tokens: Vec<usize>,
        /// Weight formats to measure.
        #[arg(long, value_delimiter = ',', default_value = "f32,q8_0")]
        weights: Vec<WeightFormat>,
        /// Milliseconds per measurement; the median of `reps` is reported.
        #[arg(long, default_value_t = 200)]
        ms: u64,
        /// Repetitions.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Instead of single products, time a pass over this many decoder layers' seven
        /// products each, as a forward pass runs them (30: SmolLM2-135M's layers, more bytes
        /// than L3 holds). 0: single products.
        #[arg(long, default_value_t = 0)]
        layers: usize,
    },
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::ServeDecode {
            model,
            gen_tokens,
            rounds,
            workers,
            concurrency,
            otlp_endpoint,
        } => serve_decode::run(model, gen_tokens, rounds, &workers, concurrency, otlp_endpoint)?,
        Cmd::Reference {
            model,
            prompt_tokens,
            gen_tokens,
            reps,
            weights,
            threads,
            kernel_path,
        } => reference(model, prompt_tokens, gen_tokens, reps, &weights, &threads, kernel_path)?,
        Cmd::Kernels {
            threads,
            tokens,
            weights,
            ms,
            reps,
            layers,
        } => kernels::run(&threads, &tokens, &weights, ms, reps, layers)?,
        Cmd::Load(args) => load::run(args)?,
        Cmd::Attention(args) => attention::run(&args)?,
        Cmd::Synth(args) => synth::run(&args)?,
        Cmd::Perplexity {
            model,
            text,
            context,
            weights,
            threads,
        } => perplexity::run(model, &text, context, &weights, threads)?,
    }
    Ok(())
}

/// One configuration of `reference`: which loaded weights, on which kernels and pool.
struct Config {
    label: String,
    engine: usize,
    kernels: Kernels,
    pool: Arc<ThreadPool>,
    prefill: Vec<f64>,
    decode: Vec<f64>,
}

fn reference(
    model: Option<String>,
    prompt_tokens: usize,
    gen_tokens: usize,
    reps: usize,
    weights: &[WeightFormat],
    threads: &[usize],
    kernel_path: Option<KernelPath>,
) -> Result<()> {
    let path = resolve_model(model.as_deref(), &baton_home(), &Sources::default(), true)?;
    let files = ModelFiles::open(&path).with_context(|| path.display().to_string())?;
    let cfg = files.config()?;
    let kernels = match kernel_path {
        Some(p) => Kernels::with_path(p)?,
        None => Kernels::detect(),
    };
    let scalar = Kernels::with_path(KernelPath::Scalar)?;
    // One engine per format; configurations swap the pool and kernel path between runs, so
    // every configuration is measured round-robin in the same process.
    let mut formats = vec![WeightFormat::F32];
    formats.extend(weights.iter().filter(|&&w| w != WeightFormat::F32));
    let mut engines = formats
        .iter()
        .map(|&format| {
            let opts = LoadOptions {
                format,
                ..LoadOptions::default()
            };
            Ok(Engine::new(StageWeights::load_full_with(&files, &cfg, false, &opts)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut pools: Vec<(usize, Arc<ThreadPool>)> = Vec::new();
    let mut pool = |n: usize| {
        if let Some((_, p)) = pools.iter().find(|(m, _)| *m == n) {
            return Arc::clone(p);
        }
        let p = Arc::new(ThreadPool::new(n));
        pools.push((n, Arc::clone(&p)));
        p
    };
    let mut configs = vec![Config {
        label: "fp32-reference".into(),
        engine: 0,
        kernels: scalar,
        pool: pool(1),
        prefill: Vec::new(),
        decode: Vec::new(),
    }];
    for &w in weights {
        for &t in threads {
            configs.push(Config {
                label: format!("{w} {t}T {}", kernels.path()),
                engine: formats.iter().position(|&f| f == w).unwrap_or(0),
                kernels,
                pool: pool(t),
                prefill: Vec::new(),
                decode: Vec::new(),
            });
        }
    }
    // Deterministic, in-vocabulary prompt; content does not matter for timing.
    let prompt: Vec<u32> = (0..prompt_tokens).map(|i| (100 + i * 37 % 5000) as u32).collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(gen_tokens)
    };
    for _ in 0..reps.max(1) {
        for c in &mut configs {
            let engine = &mut engines[c.engine];
            engine.weights.ops = CpuOps::with_pool(c.kernels, Arc::clone(&c.pool));
            let t = Instant::now();
            engine.prompt_logits(&prompt, false)?;
            c.prefill.push(prompt_tokens as f64 / t.elapsed().as_secs_f64());
            let t = Instant::now();
            let out = engine.generate(&prompt[..8.min(prompt.len())], &params, None, |_| {})?;
            c.decode.push(out.tokens.len() as f64 / t.elapsed().as_secs_f64());
        }
    }
    let (base_prefill, base_decode) = (median(configs[0].prefill.clone()), median(configs[0].decode.clone()));
    for c in &configs {
        let weights = &engines[c.engine].weights;
        // Decode reads every matrix byte once per token: the streaming-read rate over the same
        // byte count, on the same threads, bounds it.
        let read_gbs = roofline::stream_read_gb_per_s(weights.matrix_bytes(), &c.pool, 5);
        let roofline = read_gbs * 1e9 / weights.matrix_bytes() as f64;
        let (prefill, decode) = (median(c.prefill.clone()), median(c.decode.clone()));
        let out = serde_json::json!({
            "config": c.label,
            "engine": if c.label == "fp32-reference" { "fp32-reference" } else { "cpu" },
            "weights": weights.format.name(),
            "kernel_path": c.kernels.path().name(),
            "threads": c.pool.threads(),
            "model": path.display().to_string(),
            "matrix_bytes": weights.matrix_bytes(),
            "weight_bytes": weights.weight_bytes(),
            "prompt_tokens": prompt_tokens,
            "prefill_tok_per_s": prefill,
            "prefill_min_max": [min(&c.prefill), max(&c.prefill)],
            "gen_tokens": gen_tokens,
            "decode_tok_per_s": decode,
            "decode_min_max": [min(&c.decode), max(&c.decode)],
            "decode_gb_per_s": decode * weights.matrix_bytes() as f64 / 1e9,
            "stream_read_gb_per_s": read_gbs,
            "roofline_tok_per_s": roofline,
            "decode_vs_roofline": decode / roofline,
            "prefill_vs_reference": prefill / base_prefill,
            "decode_vs_reference": decode / base_decode,
        });
        println!("{out}");
    }
    Ok(())
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}
