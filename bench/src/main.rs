//! `baton-bench`: timing of Baton's engines. Today: the fp32 reference path (prefill and
//! batch-1 decode); kernel and load benchmarks join as those parts land.

use std::time::Instant;

use anyhow::{Context, Result};
use baton_shared::fetch::{Sources, baton_home};
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::resolve_model;
use baton_shared::sampling::SamplingParams;
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;
use clap::{Parser, Subcommand};

mod serve_decode;

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
    },
    /// Prefill and decode throughput of the fp32 reference engine (one thread).
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
        } => serve_decode::run(model, gen_tokens, rounds, &workers)?,
        Cmd::Reference {
            model,
            prompt_tokens,
            gen_tokens,
            reps,
        } => {
            let path = resolve_model(model.as_deref(), &baton_home(), &Sources::default(), true)?;
            let files = ModelFiles::open(&path).with_context(|| path.display().to_string())?;
            let cfg = files.config()?;
            let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, false)?);
            // Deterministic, in-vocabulary prompt; content does not matter for timing.
            let prompt: Vec<u32> = (0..prompt_tokens).map(|i| (100 + i * 37 % 5000) as u32).collect();
            let (mut prefill, mut decode) = (Vec::new(), Vec::new());
            for _ in 0..reps.max(1) {
                let t = Instant::now();
                engine.prompt_logits(&prompt, false)?;
                prefill.push(prompt_tokens as f64 / t.elapsed().as_secs_f64());
                let params = SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(gen_tokens)
                };
                let t = Instant::now();
                let out = engine.generate(&prompt[..8.min(prompt.len())], &params, None, |_| {})?;
                decode.push(out.tokens.len() as f64 / t.elapsed().as_secs_f64());
            }
            let weight_bytes: usize = 4 * ModelFiles::required(&cfg, 0..cfg.num_layers, true, true)
                .iter()
                .map(|(r, _)| r.shape(&cfg).iter().product::<usize>())
                .sum::<usize>();
            let out = serde_json::json!({
                "engine": "fp32-reference",
                "model": path.display().to_string(),
                "threads": 1,
                "weight_bytes": weight_bytes,
                "prompt_tokens": prompt_tokens,
                "prefill_tok_per_s": median(prefill),
                "gen_tokens": gen_tokens,
                "decode_tok_per_s": median(decode),
            });
            println!("{out}");
        }
    }
    Ok(())
}
